"""Block ids and stack geometry shared by every engine integration (vLLM, LMCache, SGLang).

**Block ids.** A block id is 16 bytes of keyed BLAKE2b. The key is a *salt*: the digest of
everything that makes two engines' KV for the same tokens incompatible (:class:`KeySpace`: the
engine, model, dtype, tokens per block, KV layout, TP size, the engine-specific fields of
:mod:`ucm.integration.salts`, and the reset epoch). Two engines whose key spaces differ in any
field never compute the same block id, so they never serve each other's blocks even on one stack.
A request's ``cache_salt`` (and LoRA adapter) is salted by the vLLM connector, which sees each
request; SGLang puts both in its page keys itself; LMCache 0.5.6's keys carry neither, so the
LMCache plugin refuses a LoRA-enabled engine (docs/lmcache.md).

**Reset epochs** (:class:`Epochs`): vLLM's ``reset_cache`` and SGLang's ``clear`` must stop UCM
serving anything saved before them, on every tier and every process sharing the stack. A reset
does not delete blocks (UCM cannot enumerate a tier's keys by key space); it moves the key space
to a new *epoch*, which every block id carries, and records the epoch in a control record of
the stack (the buffer's node-wide table and every lower tier, outside admission, quotas,
eviction, codecs and namespaces), where every process opening the stack later reads it. Blocks
of older epochs stay until their tiers evict them, and are never served again.

- :func:`chain_block_ids`: the id of each *full* block of a token sequence is the hash of the
  previous block's id and the block's own token ids, so block *i*'s id names the whole prefix
  ``tokens[: (i + 1) * block_tokens]`` (vLLM's prefix-hash chain, rebuilt here because UCM ids
  must be stable across processes and engine versions, which Python's ``hash`` is not).
- :func:`named_block_id`: the id of a block an engine already names (LMCache's chunk hash,
  SGLang's page key).

**Geometry.** A stack for an engine states ``unique_id`` and ``tiers`` only; the engine's KV cache
fixes the shard geometry (:class:`EngineGeometry`), and :func:`engine_stack` adds it. A stack
that states a geometry the engine contradicts is refused with a :class:`~ucm.ConfigError` that
says what the engine's layout is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from array import array
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from ..breaker import DaemonPool
from ..codecs import FP8_DTYPES, Fp8Codec
from ..errors import ConfigError, LookupUnansweredError, UcmError
from ..layout import BLOCK_ID_BYTES
from ..stack import StackConfig, parse_stack, read_stack_source

if TYPE_CHECKING:
    from ..store import Store

logger = logging.getLogger(__name__)

KEYS_VERSION = 2
"""Bumped whenever the derivation below changes: old ids then simply stop matching (misses).
2: reset epochs are control records, no longer marker blocks; the ids of every epoch an older
UCM wrote (whose markers this version does not read) stop matching."""

_CHAIN_TAG = b"ucm-chain\0"
_NAME_TAG = b"ucm-name\0"

GEOMETRY_KEYS = ("shard_size", "tensor_size_list", "shards_per_block")
"""Stack keys an engine integration derives from the engine instead of reading them."""


@dataclass(frozen=True)
class KeySpace:
    """Everything that makes KV for the same tokens incompatible between two engines."""

    engine: str
    """``vllm``, ``lmcache``, ``sglang``: integrations never share ids with each other."""
    model: str
    dtype: str
    block_tokens: int
    """Tokens per block (vLLM block, LMCache chunk, SGLang page)."""
    kv_layout: str
    """The KV cache's memory layout as the engine reports it (shape order, layers, heads)."""
    tp_size: int
    extra: tuple[tuple[str, str], ...] = field(default=())
    """Engine-specific fields that also change the KV (sorted by name when salted)."""

    def __post_init__(self) -> None:
        if not isinstance(self.block_tokens, int) or self.block_tokens < 1:
            raise ValueError(f"block_tokens must be an int >= 1, got {self.block_tokens!r}")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {self.tp_size!r}")

    def salt(self, cache_salt: str | None = None, epoch: int = 0) -> bytes:
        """The 32-byte key of this key space (and of one ``cache_salt``, when given) in reset
        epoch ``epoch`` (0 before any reset)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        fields: list[tuple[str, Any]] = [
            ("keys_version", KEYS_VERSION),
            ("engine", self.engine),
            ("model", self.model),
            ("dtype", self.dtype),
            ("block_tokens", self.block_tokens),
            ("kv_layout", self.kv_layout),
            ("tp_size", self.tp_size),
            *sorted(self.extra),
        ]
        if cache_salt is not None:
            fields.append(("cache_salt", cache_salt))
        if epoch:
            fields.append(("epoch", epoch))
        encoded = json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()
        return hashlib.blake2b(encoded, digest_size=32).digest()


def chain_block_ids(
    salt: bytes,
    token_ids: Sequence[int],
    block_tokens: int,
    parent: bytes | None = None,
    start_block: int = 0,
) -> list[bytes]:
    """The id of every full block of ``token_ids`` (a trailing partial block has none).

    Block *i*'s id hashes block *i - 1*'s id with block *i*'s tokens, so it names the whole
    prefix. ``parent`` and ``start_block`` continue a chain: pass the id of block
    ``start_block - 1`` to hash only the blocks from ``start_block`` on.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if (parent is None) != (start_block == 0):
        raise ValueError("a chain continued at start_block > 0 needs the parent block's id")
    ids: list[bytes] = []
    previous = parent if parent is not None else b""
    full = len(token_ids) // block_tokens
    for block in range(start_block, full):
        tokens = array("q", token_ids[block * block_tokens : (block + 1) * block_tokens])
        digest = hashlib.blake2b(
            _CHAIN_TAG + previous + tokens.tobytes(), digest_size=BLOCK_ID_BYTES, key=salt
        ).digest()
        ids.append(digest)
        previous = digest
    return ids


def named_block_id(salt: bytes, name: bytes | str | int) -> bytes:
    """The id of a block the engine names itself (a chunk hash, a page key)."""
    if isinstance(name, int):
        data = name.to_bytes((name.bit_length() + 8) // 8 or 1, "little", signed=True)
        data = b"i" + data
    elif isinstance(name, str):
        data = b"s" + name.encode()
    else:
        data = b"b" + bytes(name)
    return hashlib.blake2b(_NAME_TAG + data, digest_size=BLOCK_ID_BYTES, key=salt).digest()


_EPOCH_TAG = b"ucm-epoch\0"


@dataclass(frozen=True)
class Epochs:
    """The reset epochs of one key space: a control record of the stack
    (:meth:`~ucm.Store.read_control`), a monotonic maximum held in the buffer's node-wide
    table and in every lower tier, outside admission, quotas, eviction, codecs and namespaces.

    - ``base`` is the key space's salt at epoch 0, so a reset moves one key space only (one
      model, dtype, layout...), on every tier and for every process that opens the stack later.
    - ``writer`` names whose sequence of resets this is: one per engine instance that resets on
      its own (an SGLang TP rank clears on its own; vLLM's scheduler resets for all its ranks).
      All ranks of a deployment are reset together by their engine, so their sequences agree.

    The record's name (:attr:`name`) is 16 bytes of keyed BLAKE2b of the writer, keyed by
    ``base``. Its value is the current epoch (0 when no tier holds it: no reset yet). A read
    the stack cannot answer exactly raises :class:`~ucm.LookupUnansweredError` (the caller
    fails closed: :class:`EpochState`).
    """

    base: bytes
    writer: str = ""

    @property
    def name(self) -> bytes:
        """The key space's control record name."""
        return hashlib.blake2b(
            _EPOCH_TAG + self.writer.encode(), digest_size=16, key=self.base
        ).digest()

    def current(self, store: Store) -> int:
        """The stack's epoch: the largest value any tier holds (0 when none). Raises
        :class:`~ucm.LookupUnansweredError` when a tier did not answer exactly (past its
        deadline, its breaker open, a damaged record, a tier that keeps no records)."""
        (epoch,) = store.read_control([self.name])
        return epoch

    def begin(self, store: Store, after: int = 0) -> int:
        """Starts a new epoch, past the stack's current one and past ``after`` (the epoch this
        process is in): raises the record in every tier of ``store`` and returns the epoch.
        Raises :class:`~ucm.TierError` when a tier could not be written (the epoch is begun
        wherever it could be)."""
        epoch = max(self.current(store), after) + 1
        store.raise_control(self.name, epoch)
        return epoch


EPOCH_RETRY_S = 2.0
"""How often a process whose epoch is unknown reads it again (on a thread of its own)."""


def provisional_salt(salt: bytes, nonce: bytes) -> bytes:
    """``salt`` keyed with one process's ``nonce``: the salt of ids no other process computes,
    used while the process's reset epoch is unknown (:class:`EpochState`)."""
    return hashlib.blake2b(salt, digest_size=32, key=nonce).digest()


class EpochState:
    """The reset epoch one engine process's ids are in: the stack's, never a lower one.

    :meth:`start` reads the epoch (:meth:`Epochs.current`: every tier's control record, each
    within its deadline). When a tier does not answer exactly (:class:`~ucm.LookupUnansweredError`:
    past its ``lookup_timeout_ms``, its breaker open, a damaged record), the epoch is *unknown*
    (``epoch`` is None): the engine salts its ids with a nonce of this process
    (:func:`provisional_salt`), so it is served only what it saved itself since, and nothing of
    any epoch saved by anyone else. The read is retried on a thread of its own, at most every
    ``retry_s``; :meth:`poll`, called by the engine on its own thread, never waits and adopts
    the epoch once it has been read.

    A reset (:meth:`reset`) moves the process to the epoch past the stack's and its own, and
    raises the record to it in every tier at once (:meth:`~ucm.Store.raise_control`). A reset
    whose read of the stack's epoch fails is *pending*: the engine moves to a new nonce at once
    (nothing saved before is served), and the epoch is begun when the read succeeds. A record
    that could not be raised in every tier is raised again from :meth:`poll` until it is.
    """

    def __init__(self, epochs: Epochs, store: Store, *, retry_s: float = EPOCH_RETRY_S) -> None:
        self._epochs = epochs
        self._store = store
        self._retry_s = retry_s
        self.epoch: int | None = 0
        """The epoch this process's ids are in; None while unknown."""
        self.nonce = os.urandom(32)
        """While the epoch is unknown: the key of :func:`provisional_salt` (new at each reset)."""
        self._floor = 0
        """The highest epoch this process has been in: a reset goes past it."""
        self._reset_pending = False
        self._unrecorded: int | None = None
        """An epoch this process began whose record some tier did not take yet."""
        self._job: tuple[str, Future[int]] | None = None
        """The background read (``"read"``) or record raise (``"raise"``) under way."""
        self._retry_at = 0.0
        self._pool: DaemonPool | None = None
        self._lock = threading.Lock()

    def start(self) -> int | None:
        """Reads the stack's epoch (bounded by each tier's deadline); None when unknown. One
        read only: a black-holed tier holds the read's thread (the tier's one exact-look-up
        thread, apart from the requests') until its client gives up, so a second read at once
        would find it taken and learn nothing."""
        try:
            self.epoch = self._floor = self._epochs.current(self._store)
        except LookupUnansweredError as exc:
            self._unknown(str(exc))
        return self.epoch

    def reset(self) -> int | None:
        """A reset: the new epoch (past the stack's and this process's), recorded in every
        tier before this returns; None when the stack's epoch cannot be read now (the reset is
        pending: :meth:`poll` returns its epoch later)."""
        with self._lock:
            self._floor = max(self._floor, self.epoch or 0)
            self._job = None  # a read started before the reset answers for the old epoch
            try:
                stack = self._epochs.current(self._store)
            except UcmError as exc:
                self._reset_pending = True
                self._unknown(str(exc))
                return None
            self._reset_pending = False
            epoch = self.epoch = self._floor = max(stack, self._floor) + 1
        self._record(epoch)
        return epoch

    def poll(self) -> int | None:
        """While the epoch is unknown: starts a read when one is due, and once one has answered,
        adopts its epoch (beginning a pending reset's) and returns it. While a begun epoch's
        record is missing from a tier: raises it again when due. None when there is nothing
        new. Never waits on a tier."""
        if self.epoch is not None and self._unrecorded is None:
            return None
        with self._lock:
            job = self._job
            if job is None:
                now = time.monotonic()
                if now >= self._retry_at:
                    self._retry_at = now + self._retry_s
                    if self._pool is None:
                        self._pool = DaemonPool("ucm-epoch", 1)
                    if self.epoch is None:
                        read = partial(self._read, self._reset_pending, self._floor)
                        future = self._pool.try_submit(read)
                        self._job = ("read", future) if future is not None else None
                    elif self._unrecorded is not None:
                        future = self._pool.try_submit(partial(self._raise, self._unrecorded))
                        self._job = ("raise", future) if future is not None else None
                return None
            kind, future = job
            if not future.done():
                return None
            self._job = None
            try:
                value = future.result()
            except Exception as exc:  # not yet: the next try is due after retry_s
                logger.debug("UCM: the reset epoch's %s failed again: %s", kind, exc)
                return None
            if kind == "raise":
                if self._unrecorded is not None and self._unrecorded <= value:
                    self._unrecorded = None
                logger.info("UCM: reset epoch %d is now recorded in every tier", value)
                return None
            began = self._reset_pending
            if began:  # the job began the pending reset's epoch: ``value`` is it
                self._reset_pending = False
                epoch = value
            else:
                epoch = max(value, self._floor)
            self.epoch = self._floor = epoch
        logger.info(
            "UCM: the stack's reset epoch is now known: %d%s; ids from now on are in it",
            epoch,
            " (the pending reset begins it)" if began else "",
        )
        return epoch

    @property
    def unrecorded(self) -> int | None:
        """An epoch this process began whose record some tier did not take yet (None: none)."""
        return self._unrecorded

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def _read(self, pending: bool, floor: int) -> int:
        """The background read (on the epoch thread): the stack's epoch; with a pending reset,
        the epoch it begins (past the stack's and ``floor``), recorded before it is adopted (a
        tier that does not take it leaves it to be recorded again from :meth:`poll`)."""
        stack = self._epochs.current(self._store)
        if not pending:
            return stack
        epoch = max(stack, floor) + 1
        self._record(epoch)
        return epoch

    def _raise(self, epoch: int) -> int:
        self._store.raise_control(self._epochs.name, epoch)
        return epoch

    def _record(self, epoch: int) -> None:
        try:
            self._raise(epoch)
        except UcmError as exc:
            with self._lock:
                self._unrecorded = max(self._unrecorded or 0, epoch)
                self._retry_at = time.monotonic() + self._retry_s
            logger.warning(
                "UCM: reset epoch %d could not be recorded in every tier (%s): this process is "
                "in it; recording it again every %.1f s (an engine started before then may "
                "read an older epoch from the tiers that lack it)",
                epoch,
                exc,
                self._retry_s,
            )
            return
        with self._lock:
            if self._unrecorded is not None and self._unrecorded <= epoch:
                self._unrecorded = None

    def _unknown(self, why: str) -> None:
        self.epoch = None
        self.nonce = os.urandom(32)
        self._retry_at = time.monotonic() + self._retry_s
        logger.warning(
            "UCM: the key space's reset epoch cannot be read now (%s): until it can, this "
            "process's block ids carry a nonce of its own, so it is served only what it saves "
            "itself (never a block of another epoch); reading again every %.1f s",
            why,
            self._retry_s,
        )


def warn_node_local(engine: str, nodes: int, shards: int, stack: StackConfig) -> bool:
    """Warns (and returns True) when tensor parallelism spans ``nodes`` > 1 nodes: a block is
    ``shards`` shards, one per TP rank, but a node's buffer holds only its own ranks' shards, so
    a block is whole only in a tier every node writes to."""
    if nodes <= 1 or shards <= 1:
        return False
    lower = [tier.type for tier in stack.tiers if tier is not stack.buffer]
    where = (
        "this stack has no tier below the buffer, so it never hits"
        if not lower
        else f"this stack's lower tier(s) {lower} hit only if every node shares them"
    )
    logger.warning(
        "UCM: %s runs tensor parallelism over %d nodes: a block is %d shards (one per TP rank), "
        "and a node's buffer holds only its own ranks' shards, so a block is complete only in a "
        "tier shared by every node; %s. Fix: give the stack a shared lower tier (posix on a "
        "shared filesystem, s3, mooncake)",
        engine,
        nodes,
        shards,
        where,
    )
    return True


@dataclass(frozen=True)
class EngineGeometry:
    """The shard geometry an engine's KV cache fixes."""

    tensor_sizes: tuple[int, ...]
    """Byte sizes of the tensors of one shard, in order (e.g. one per layer)."""
    shards_per_block: int
    """Shards per block (e.g. the TP size: one shard per rank)."""
    description: str = ""
    """How the engine lays the shard out, for error messages (e.g. tensor shapes)."""
    dtype: str | None = None
    """The KV cache's element type (``torch.bfloat16`` or ``bfloat16``), when the engine has
    one: a tier with the lossy ``fp8`` codec must name the same ``source_dtype``."""

    def __post_init__(self) -> None:
        if not self.tensor_sizes or any(
            not isinstance(size, int) or size < 1 for size in self.tensor_sizes
        ):
            raise ValueError(f"tensor_sizes must be positive ints, got {self.tensor_sizes!r}")
        if self.shards_per_block < 1:
            raise ValueError(f"shards_per_block must be >= 1, got {self.shards_per_block}")

    @property
    def shard_size(self) -> int:
        return sum(self.tensor_sizes)

    def explain(self) -> str:
        sizes = list(self.tensor_sizes)
        shown = f"{sizes}" if len(sizes) <= 8 else f"{len(sizes)} tensors of {sorted(set(sizes))}"
        text = (
            f"shard_size {self.shard_size}, tensor_size_list {shown}, "
            f"shards_per_block {self.shards_per_block}"
        )
        return f"{text} ({self.description})" if self.description else text


StackSource = str | os.PathLike[str] | Mapping[str, Any] | StackConfig


def engine_stack(
    source: StackSource | None, geometry: EngineGeometry, *, key: str, engine: str
) -> StackConfig:
    """The stack ``source`` (a YAML path, a mapping or a StackConfig) with the engine's geometry.

    ``key`` names where the user gave the stack (``kv_connector_extra_config['ucm_stack']``) and
    starts every error message. A stack may leave every geometry key out (the usual case) or
    state them; stated values must match the engine's, or a ConfigError names the key, the
    stated value and the engine's layout.
    """
    if source is None:
        raise ConfigError(
            f"{key} is missing: give the path of a YAML stack or the stack itself as a dict "
            "(unique_id and tiers; UCM derives the geometry from the engine)"
        )
    if isinstance(source, StackConfig):
        data: Mapping[str, Any] = source.model_dump(exclude_none=True)
        name = "stack"
    elif isinstance(source, Mapping | str | os.PathLike):
        try:
            data, name = read_stack_source(source)
        except ConfigError as exc:
            raise ConfigError(f"{key}: {exc}") from None
    else:
        raise ConfigError(
            f"{key} must be the path of a YAML stack or a dict, got {type(source).__name__}"
        )
    merged = dict(data)
    stated_sizes = merged.get("tensor_size_list")
    stated_shard = merged.get("shard_size")
    stated_shards = merged.get("shards_per_block")
    problems = []
    if stated_sizes is not None and list(stated_sizes) != list(geometry.tensor_sizes):
        problems.append(f"tensor_size_list: {_short(stated_sizes)}")
    if stated_shard is not None and stated_shard != geometry.shard_size:
        problems.append(f"shard_size: {stated_shard!r}")
    if stated_shards is not None and stated_shards != geometry.shards_per_block:
        problems.append(f"shards_per_block: {stated_shards!r}")
    if problems:
        raise ConfigError(
            f"{key}: the stack states {'; '.join(problems)}, but {engine}'s KV cache has "
            f"{geometry.explain()}. Leave {', '.join(GEOMETRY_KEYS)} out of a stack for "
            f"{engine}: UCM derives them from the engine"
        )
    merged.pop("shard_size", None)
    merged["tensor_size_list"] = list(geometry.tensor_sizes)
    merged["shards_per_block"] = geometry.shards_per_block
    stack = parse_stack(merged, source=f"{key} ({name})")
    _check_fp8_dtype(stack, merged, geometry, key=key, engine=engine)
    return stack


def _check_fp8_dtype(
    stack: StackConfig,
    data: Mapping[str, Any],
    geometry: EngineGeometry,
    *,
    key: str,
    engine: str,
) -> None:
    """A tier that stores KV as fp8 must have been told the KV cache's dtype: a tier sees bytes
    only, and the wrong ``source_dtype`` would turn every shard into numbers that pass the
    checksum."""
    if geometry.dtype is None:
        return
    kv_dtype = geometry.dtype.removeprefix("torch.")
    # With a `buffer:` section the parsed tiers start with it; YAML's tiers[] do not.
    shift = 1 if data.get("buffer") is not None else 0
    for position, tier in enumerate(stack.tiers):
        codec = getattr(tier, "codec", None)
        if isinstance(codec, Fp8Codec) and codec.source_dtype != kv_dtype:
            fix = (
                f"source_dtype: {kv_dtype}"
                if kv_dtype in FP8_DTYPES
                else f"fp8 stores {', '.join(FP8_DTYPES)} KV only"
            )
            raise ConfigError(
                f"{key}: tiers[{position - shift}].codec.source_dtype is "
                f"{codec.source_dtype!r}, but {engine}'s KV cache holds {kv_dtype}: the lossy "
                f"fp8 codec must name the KV dtype ({fix})"
            )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = [
    "GEOMETRY_KEYS",
    "KEYS_VERSION",
    "EngineGeometry",
    "Epochs",
    "KeySpace",
    "StackSource",
    "chain_block_ids",
    "engine_stack",
    "named_block_id",
    "warn_node_local",
]
