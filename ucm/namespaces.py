"""Namespaces (tenants): every key belongs to one, and a namespace never sees another's blocks.

**How a namespace reaches a key.** The store maps a caller's block id to the id every tier
stores, the *scoped id*:

- in the default namespace (``"default"``) the scoped id is the block id itself, so data
  written before namespaces existed, and every single-tenant deployment, keeps its keys;
- in namespace ``N`` it is ``tag(N) + blake2b(block_id, key=N)[:8]``: 8 bytes naming the
  namespace (``tag``, a keyed hash of the name), then 8 bytes of a hash of the block id keyed by
  the name.

The same block id in two namespaces is therefore two different keys in every tier (the
CacheBuffer included): no hit, load, remove, touch or presence answer crosses namespaces, by
construction and without any tier's help. A second node serving the same namespace computes the
same scoped ids, so it sees the same blocks. The tag makes a key's namespace readable from the
key: what purge and per-namespace usage enumerate (``ucm purge``, ``ucm namespaces``), in the
CacheBuffer from its slots (``ucm_buffer_list_ready``) and in lower tiers from their key spaces,
where a namespace other than the default also gets its own prefix (``ns/<name>/``).

Resolving a tag back to its name needs the name: this module keeps the names this process has
used or seen in a lower tier's key space (:func:`register`). A key whose tag is unknown here is
reported under ``#<tag hex>`` by the usage listings and treated as the default namespace's by
lower tiers' placement (it keeps its own scoped id, so isolation holds either way).

The collision bounds: two names share a tag with probability 2^-64 per pair; a default-namespace
block id is taken for a namespace's key with probability 2^-64 per (block, namespace); two block
ids of one namespace share a scoped id with probability about n^2 / 2^65 for n blocks.
"""

from __future__ import annotations

import hashlib
import re
import threading
from typing import Any

from .errors import InvalidArgumentError

DEFAULT_NAMESPACE = "default"
"""The namespace of every call that names none (and of ``ucm.open`` without ``namespace=``)."""

NAMESPACE_NAME_MAX = 64
"""Longest namespace name, in characters (it is also a blake2b key: at most 64 bytes)."""

NAME_RULE = (
    f"1 to {NAMESPACE_NAME_MAX} characters of A-Z a-z 0-9 '.' '_' '-', starting with a letter "
    "or a digit"
)
NAME_PATTERN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{NAMESPACE_NAME_MAX - 1}}}")

TAG_BYTES = 8
"""Leading bytes of a scoped id that name its namespace."""

_PERSON_TAG = b"ucm-ns-tag"
_PERSON_ID = b"ucm-ns-id"

_lock = threading.Lock()
_names: dict[bytes, str] = {}
"""tag -> name of every namespace this process used or saw (never the default)."""


def check_namespace(value: Any, argument: str = "namespace") -> str:
    """Returns ``value`` if it is a valid namespace name, else raises InvalidArgumentError
    naming the argument, the value and the rule. Registers the name (see :func:`register`)."""
    if not isinstance(value, str) or NAME_PATTERN.fullmatch(value) is None:
        raise InvalidArgumentError(
            f"{argument}={value!r} is not a valid namespace name: expected {NAME_RULE} "
            f"(the default namespace is {DEFAULT_NAMESPACE!r})"
        )
    register(value)
    return value


def tag(namespace: str) -> bytes:
    """The 8 bytes that start every scoped id of ``namespace`` (not the default's)."""
    return hashlib.blake2b(namespace.encode(), digest_size=TAG_BYTES, person=_PERSON_TAG).digest()


_DEFAULT_TAG = tag(DEFAULT_NAMESPACE)
"""What a purge of the default namespace records (its ids carry no tag of their own)."""


def register(namespace: str) -> None:
    """Remembers ``namespace``'s name so that its keys resolve back to it in this process."""
    if namespace == DEFAULT_NAMESPACE:
        return
    key = tag(namespace)
    with _lock:
        _names.setdefault(key, namespace)


def scope(namespace: str, block_ids: list[bytes]) -> list[bytes]:
    """The ids the tiers store for ``block_ids`` (16 bytes each) in ``namespace``."""
    if namespace == DEFAULT_NAMESPACE:
        return block_ids
    prefix = tag(namespace)
    secret = namespace.encode()
    return [
        prefix
        + hashlib.blake2b(
            block_id, digest_size=16 - TAG_BYTES, key=secret, person=_PERSON_ID
        ).digest()
        for block_id in block_ids
    ]


def namespace_of(scoped_id: bytes) -> str:
    """The namespace of a stored id: a registered namespace whose tag starts it, else the
    default."""
    return _names.get(bytes(scoped_id[:TAG_BYTES]), DEFAULT_NAMESPACE)


def belongs(namespace: str, scoped_id: bytes) -> bool:
    """Whether a stored id is one of ``namespace``'s (for the default: of no registered
    namespace)."""
    if namespace == DEFAULT_NAMESPACE:
        return namespace_of(scoped_id) == DEFAULT_NAMESPACE
    return bytes(scoped_id[:TAG_BYTES]) == tag(namespace)


def purge_covers(purged_tag: bytes, scoped_id: bytes) -> bool:
    """Whether a purge of the namespace whose tag is ``purged_tag`` covers a stored id: for
    the default namespace's tag (``tag(DEFAULT_NAMESPACE)``), an id of no registered
    namespace; for another's, an id that its tag starts. The one decision the removal log's
    readers (:mod:`ucm.finality`) make per key and purge."""
    if purged_tag == _DEFAULT_TAG:
        return belongs(DEFAULT_NAMESPACE, scoped_id)
    return bytes(scoped_id[:TAG_BYTES]) == purged_tag


def known() -> list[str]:
    """Every namespace name this process has registered (not the default)."""
    with _lock:
        return sorted(_names.values())
