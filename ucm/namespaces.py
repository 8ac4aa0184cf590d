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

Resolving a tag back to its name needs the name. **The authority is the CacheBuffer's control
plane**: every namespace a process uses with a buffer is entered there (tag and name) before
its first key can land (``Store`` does it at the first call naming the namespace), so every
process of the node, a fresh ``ucm purge`` included, resolves every key of the buffer, and a key
whose tag the table does not hold is the default namespace's. Each open buffer adds its table
as an authority (:func:`add_authority`). A stack without a buffer resolves tags from the lower
tiers' own layout (a tier that finds ``ns/<name>/`` calls :func:`register`), and from the names
this process used. A (tag, name) pair learnt from any of these is a fact of the hash, so it is
remembered; the verdict "default" is never remembered and, with a buffer open, comes from its
table only.

The collision bounds: two names share a tag with probability 2^-64 per pair; a default-namespace
block id is taken for a namespace's key with probability 2^-64 per (block, namespace); two block
ids of one namespace share a scoped id with probability about n^2 / 2^65 for n blocks.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable
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
"""tag -> name of every namespace this process used, saw in a lower tier's layout or resolved
through an authority (never the default)."""

Resolver = Callable[[bytes], str | None]
"""An authority: a tag (8 bytes) -> its namespace's name, or None (not a registered
namespace's: the default's)."""

_authorities: list[Resolver] = []
"""The identity tables of this process's open CacheBuffers."""


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


def add_authority(resolve: Resolver) -> None:
    """Makes ``resolve`` (an open CacheBuffer's identity table) answer for tags this process
    has not resolved yet, until :func:`remove_authority`."""
    with _lock:
        _authorities.append(resolve)


def remove_authority(resolve: Resolver) -> None:
    with _lock:
        if resolve in _authorities:
            _authorities.remove(resolve)


def namespace_of(scoped_id: bytes) -> str:
    """The namespace of a stored id: the namespace whose tag starts it, as this process knows
    it or an open CacheBuffer's identity table says, else the default."""
    key = bytes(scoped_id[:TAG_BYTES])
    name = _names.get(key)
    if name is not None:
        return name
    with _lock:
        authorities = list(_authorities)
    for resolve in authorities:
        name = resolve(key)
        if name is not None:
            with _lock:
                _names.setdefault(key, name)
            return name
    return DEFAULT_NAMESPACE


def belongs(namespace: str, scoped_id: bytes) -> bool:
    """Whether a stored id is one of ``namespace``'s (for the default: of no namespace that
    :func:`namespace_of` resolves, the open buffers' identity tables included)."""
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
