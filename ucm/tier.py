"""The interface every tier implements, built-in or third-party.

A tier is batch-oriented: each call takes many keys so that locking, I/O scheduling and any
native-binding cost are paid per batch. Data moves between the tier and *caller memory*: each
key comes with a list of writable (load) or readable (dump) memoryviews whose sizes add up to
``layout.shard_size`` — the shard is their concatenation (scatter/gather), so a shard made of
several tensors is read straight into them.

Per-key outcomes are returned, never raised: ``None`` means done, :class:`KeyMissingError` means
the tier does not hold the key (load only), any other exception is that key's failure. Raising
from a batch call is reserved for programming errors, except look-ups: a look-up that cannot
reach the tier raises (the store answers "miss" and counts a failure on the tier's breaker).
"""

from __future__ import annotations

import abc
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

from . import namespaces
from .config import TierConfig
from .errors import TierError
from .layout import Key, Layout
from .native import _abi
from .threadname import enter_thread

ShardViews = Sequence[memoryview]
"""One shard in caller memory: memoryviews (format 'B') whose sizes sum to shard_size."""

Outcome = BaseException | None

NAMESPACE_BYTES_OPTION = "namespace_bytes"
"""``TierContext.options`` key: a :class:`NamespaceBytes`, the most bytes each namespace may
hold on this tier (the stack's ``quotas:`` for this tier's label). Absent: no quota. A tier that
enforces it (posix, fsspec) evicts a namespace's oldest blocks first when it is over."""


@dataclass(frozen=True)
class NamespaceBytes:
    """Byte quotas of namespaces on one tier: ``named`` by namespace name, ``others`` for any
    other namespace (None: no quota)."""

    named: dict[str, int]
    others: int | None = None

    def limit(self, namespace: str) -> int | None:
        """The most bytes ``namespace`` may hold here, or None."""
        return self.named.get(namespace, self.others)


NAMESPACE_SCAN_INTERVAL_S = 60.0
"""Least seconds between two scans that refresh a tier's per-namespace bytes for stats and
metrics (:meth:`NamespaceUsage.refresh`): reading stats starts one, in the background, when the
last is older than this."""


class NamespaceUsage:
    """One tier's estimate of each namespace's bytes, under its :class:`NamespaceBytes` quotas
    (None: no quota, the estimate serves stats only): exact after a scan (:meth:`rescanned`),
    grown by this process's dumps (:meth:`add`), shrunk by its removals and evictions
    (:meth:`remove`, which also counts this process's evictions per namespace). Unknown
    (:meth:`figures` is None) until the first scan. Thread-safe."""

    def __init__(
        self,
        quotas: NamespaceBytes | None = None,
        scan_interval_s: float = NAMESPACE_SCAN_INTERVAL_S,
    ) -> None:
        self.quotas = quotas
        self.scan_interval_s = scan_interval_s
        self._lock = threading.Lock()
        self._usage: dict[str, int] = {}
        self._written: dict[str, int] = {}
        """Bytes this process stored per namespace since the last scan."""
        self._evictions: Counter[str] = Counter()
        self._scanned_at: float | None = None
        """``time.monotonic()`` of the last scan; None before the first."""
        self._tried_at: float | None = None
        """``time.monotonic()`` of the last scan started or done (failed ones too)."""
        self._scanner: threading.Thread | None = None

    def add(self, namespace: str, nbytes: int) -> bool:
        """Adds bytes a dump of this process stored; whether the namespace is now over its
        quota here, or stored an eighth of it since the last scan (other processes' writes are
        then seen by the scan this asks for)."""
        if nbytes == 0:
            return False
        with self._lock:
            usage = self._usage[namespace] = max(0, self._usage.get(namespace, 0) + nbytes)
            since = self._written[namespace] = self._written.get(namespace, 0) + nbytes
        limit = self.quotas.limit(namespace) if self.quotas is not None else None
        if limit is None:
            return False
        return usage > limit or since > max(limit // 8, 1)

    def rescanned(self, usage: dict[str, int]) -> dict[str, int]:
        """Sets the estimates from a scan (bytes per namespace); returns the bytes each
        namespace holds over its quota (only those over it)."""
        with self._lock:
            self._usage = dict(usage)
            self._written = {}
            self._scanned_at = self._tried_at = time.monotonic()
        excess = {}
        for namespace, used in usage.items():
            limit = self.quotas.limit(namespace) if self.quotas is not None else None
            if limit is not None and used > limit:
                excess[namespace] = used - limit
        return excess

    def remove(self, namespace: str, nbytes: int, evicted: int = 0) -> None:
        """Takes bytes this process removed off the estimate; ``evicted``: how many of the
        shards went by eviction (capacity or quota)."""
        with self._lock:
            self._usage[namespace] = max(0, self._usage.get(namespace, 0) - nbytes)
            if evicted:
                self._evictions[namespace] += evicted

    def figures(self) -> dict[str, dict[str, int]] | None:
        """``{namespace: {"bytes": estimate, "evictions": this process's}}`` for every
        namespace holding bytes or evicted here; None before the first scan (unknown)."""
        with self._lock:
            if self._scanned_at is None:
                return None
            names = {name for name, used in self._usage.items() if used} | set(self._evictions)
            return {
                name: {"bytes": self._usage.get(name, 0), "evictions": self._evictions[name]}
                for name in sorted(names)
            }

    def refresh(self, scan: Callable[[], dict[str, int]], wait_s: float = 0.0) -> None:
        """Starts ``scan`` (bytes per namespace) on a daemon thread when the last scan is
        older than ``scan_interval_s`` (or there was none) and no scan is running; then waits
        at most ``wait_s`` for a running one. Reading stats never blocks on storage otherwise:
        a scan of a large tier takes as long as listing it, at most one at a time, at most
        one per interval."""
        with self._lock:
            running = self._scanner
            now = time.monotonic()
            due = self._tried_at is None or now - self._tried_at >= self.scan_interval_s
            if (running is None or not running.is_alive()) and due:
                self._tried_at = now
                running = self._scanner = threading.Thread(
                    target=self._scan, args=(scan,), name="ucm-namespace-scan", daemon=True
                )
                running.start()
        if running is not None and wait_s > 0:
            running.join(wait_s)

    def _scan(self, scan: Callable[[], dict[str, int]]) -> None:
        enter_thread()
        try:
            usage = scan()
        except Exception:  # an unreachable tier: the figures stay as they were, and the
            return  # next try waits for the interval
        self.rescanned(usage)


HOST_MEMORY_OPTION = "host_memory"
"""``TierContext.options`` key: ``((address, nbytes), ...)``, host memory that tiers above this
one keep mapped for the store's whole life (the CacheBuffer's data plane). Loads from below are
read into it and write-back/promotion dumps come from it, so a tier that must register memory
with its transport (RDMA, Mooncake Store) registers these ranges once at open instead of on
every call. A tier exposes such memory as a ``host_memory`` attribute of the same shape."""

REMOVE_CHUNK_KEYS = _abi.BUFFER_REMOVE_CHUNK_KEYS
"""batched_remove takes a tier's lock once per chunk of at most this many keys (seed 003): one
acquisition per chunk instead of one per key, yet never held long enough to starve readers."""

EvictSink = Callable[[Sequence[Key], Sequence[ShardViews]], Sequence[Outcome]]
"""Called by a tier with shards it is about to drop, *before* dropping them, so the stack can
write them to ``write: back`` tiers below. Returns per-key outcomes; a tier must keep a shard
whose outcome is an error (eviction never drops the only copy)."""

WriteBackRemove = Callable[[Sequence[Key]], None]
"""Removes keys (force) from the ``write: back`` tiers an :data:`EvictSink` writes to: for a
writer that finds, once its write is over, that the shards it wrote down were removed above
meanwhile (a ``remove(force=True)`` racing the write would otherwise find nothing below to
remove, and the write would then bring the removed shards back)."""


@dataclass(frozen=True)
class TierContext:
    """What a tier learns about its place in the stack and the calling rank."""

    layout: Layout
    unique_id: str
    device_id: int
    local_rank_size: int
    position: int
    """Index in the stack, 0 = top."""
    evict_sink: EvictSink | None = None
    """Set when a tier below this one has ``write: back``."""
    write_back_remove: WriteBackRemove | None = None
    """Set with ``evict_sink`` (unless it writes nowhere, every ``write: back`` tier below being
    gated by ``admit:``): undoes what it wrote for keys removed while it wrote."""
    options: dict[str, Any] = field(default_factory=dict)
    """Free-form runtime options passed down by the store (see :data:`HOST_MEMORY_OPTION`)."""

    @property
    def is_scheduler(self) -> bool:
        return self.device_id < 0


class PinTable:
    """Counts in-use references per key. ``batched_remove`` keeps pinned keys unless forced."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[Key] = Counter()

    def pin(self, keys: Sequence[Key]) -> None:
        with self._lock:
            self._counts.update(keys)

    def unpin(self, keys: Sequence[Key]) -> None:
        with self._lock:
            for key in keys:
                count = self._counts[key]
                assert count > 0, f"unpin of a key that is not pinned: {key!r}"
                if count == 1:
                    del self._counts[key]
                else:
                    self._counts[key] = count - 1

    def is_pinned(self, key: Key) -> bool:
        # Reading a Counter entry is atomic under the GIL; callers that need a stable answer
        # hold their own tier lock, under which pins of the same key are not released.
        return self._counts.get(key, 0) > 0

    @contextmanager
    def pinned(self, keys: Sequence[Key]) -> Iterator[None]:
        self.pin(keys)
        try:
            yield
        finally:
            self.unpin(keys)


def scatter(data: bytes | bytearray | memoryview, views: ShardViews) -> None:
    """Copies a whole shard (``data``) into its destination views, in order."""
    source = memoryview(data).cast("B")
    assert source.nbytes == sum(view.nbytes for view in views), (source.nbytes, len(views))
    offset = 0
    for view in views:
        view[:] = source[offset : offset + view.nbytes]
        offset += view.nbytes


def chunks(items: Sequence[Any], size: int = REMOVE_CHUNK_KEYS) -> Iterator[Sequence[Any]]:
    assert size > 0
    for start in range(0, len(items), size):
        yield items[start : start + size]


class Tier(abc.ABC):
    """One cache level. Subclasses set ``type_name`` and ``config_model`` and are registered
    through the ``register_tiers`` plugin hook."""

    type_name: ClassVar[str]
    config_model: ClassVar[type[TierConfig]]

    def __init__(self, config: TierConfig, context: TierContext) -> None:
        self.config = config
        self.context = context
        self.layout = context.layout
        self.pins = PinTable()

    @property
    def label(self) -> str:
        return self.config.label

    @abc.abstractmethod
    def lookup(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key is present (and readable) in this tier."""

    def lookup_prefix(self, keys: Sequence[Key]) -> list[bool]:
        """Answers about a prefix of ``keys``: every key, or at least those up to and including
        the first absent one (the store's prefix look-up needs no more). A tier that pays one
        request per block (an object store) overrides this to stop soon after the first absent
        key; by default it is :meth:`lookup`."""
        return self.lookup(keys)

    def lookup_blocks(self, block_ids: Sequence[bytes]) -> list[bool]:
        """Whether every shard of each block is present. Tiers may override with a cheaper
        per-block check."""
        keys = self.layout.keys_of_blocks(list(block_ids))
        present = self.lookup(keys)
        per_block = self.layout.shards_per_block
        return [all(present[i * per_block : (i + 1) * per_block]) for i in range(len(block_ids))]

    @abc.abstractmethod
    def load(self, keys: Sequence[Key], destinations: Sequence[ShardViews]) -> list[Outcome]:
        """Reads each key's shard into its destination views."""

    @abc.abstractmethod
    def dump(self, keys: Sequence[Key], sources: Sequence[ShardViews]) -> list[Outcome]:
        """Stores each key's shard from its source views. A key already present is replaced."""

    @abc.abstractmethod
    def touch(self, block_ids: Sequence[bytes]) -> None:
        """Marks every resident shard of each block as recently used."""

    @abc.abstractmethod
    def batched_remove(self, keys: Sequence[Key], force: bool = False) -> int:
        """Removes the keys; returns how many distinct keys were removed. Pinned (in-use) keys
        are kept unless ``force``. Takes the tier's lock once per chunk of REMOVE_CHUNK_KEYS."""

    # ---- namespaces (ucm/namespaces.py) -----------------------------------------------------
    # A key's block id is the *scoped* id: its namespace is part of it, so keeping namespaces
    # apart needs nothing of a tier. What a tier adds is a key space per namespace (a prefix,
    # ``namespace_prefix``) and the enumeration that purge and per-namespace usage need.

    @staticmethod
    def namespace_of(block_id: bytes) -> str:
        """The namespace of a key's (scoped) block id."""
        return namespaces.namespace_of(block_id)

    @classmethod
    def namespace_prefix(cls, block_id: bytes) -> str:
        """``""`` for the default namespace, else ``"ns/<name>/"``: where a tier with paths or
        key prefixes puts the key, so that each namespace is a separate key space."""
        name = namespaces.namespace_of(block_id)
        return "" if name == namespaces.DEFAULT_NAMESPACE else f"ns/{name}/"

    def list_keys(self) -> list[Key]:
        """Every key this tier holds, every namespace's (what purge and ``ucm namespaces``
        enumerate). A tier that stores namespaces under prefixes registers the names it finds
        (``ucm.namespaces.register``), so a fresh process resolves their keys."""
        raise TierError(
            f"tier {self.label!r} (type {self.type_name!r}) cannot enumerate its keys: it "
            "implements no Tier.list_keys, which purge and per-namespace usage need"
        )

    def namespace_usage(self) -> dict[str, int] | None:
        """Shards held per namespace (namespaces with none are left out); None for a tier
        whose store cannot list its keys (then ``purge`` removes by prefix)."""
        usage: Counter[str] = Counter(self.namespace_of(key[0]) for key in self.list_keys())
        return dict(usage)

    def namespace_figures(self, wait_s: float = 0.0) -> dict[str, dict[str, int]] | None:
        """Per namespace, the bytes this tier holds (an estimate: exact after its last scan,
        moved by this process's dumps, removals and evictions since) and this process's
        evictions here: ``{namespace: {"bytes": ..., "evictions": ...}}``, for
        ``store.stats()["namespace_tiers"]`` and metrics. None where unknown: a tier that
        cannot list its keys cheaply (Mooncake, and any tier not overriding this), or before
        its first scan. Must not block on storage beyond ``wait_s``."""
        return None

    def purge(self, namespace: str) -> int:
        """Removes every shard of ``namespace`` (pinned ones too), batched like
        ``batched_remove``; returns how many were removed."""
        keys = [key for key in self.list_keys() if namespaces.belongs(namespace, key[0])]
        return self.batched_remove(keys, force=True) if keys else 0

    # ---- control records (reset epochs: ucm/integration/keys.py) ------------------------------
    # A control record is a name (16 bytes) and a monotonic maximum (an int >= 0). It is no
    # block: outside admission, quotas, eviction, codecs and namespaces, never counted in
    # capacity or usage, never listed by list_keys, never removed by batched_remove or purge.

    def read_control(self, names: Sequence[bytes]) -> list[int | None]:
        """Each record's value, None where this tier holds no record of that name. Raises
        (a :class:`~ucm.TierError`) when it cannot answer exactly: unreachable, or a record it
        holds is torn or corrupt. A missing record must mean "never raised here"."""
        raise TierError(
            f"tier {self.label!r} (type {self.type_name!r}) keeps no control records: it "
            "implements no Tier.read_control/raise_control, so a reset epoch cannot be read "
            "from it (the read fails closed)"
        )

    def raise_control(self, name: bytes, value: int) -> None:
        """Raises record ``name`` to ``max(its value, value)``, durably before returning (as
        durable as the tier is), never lowering it. Raises a :class:`~ucm.TierError` when the
        record could not be written."""
        raise TierError(
            f"tier {self.label!r} (type {self.type_name!r}) keeps no control records: it "
            "implements no Tier.read_control/raise_control, so a reset epoch cannot be written "
            "to it"
        )

    def stats(self) -> dict[str, int | float]:
        """Counters for ``store.stats()``. The conformance suite requires at least ``hits`` and
        ``misses`` (keys loaded / missing) and ``remove_lock_acquisitions`` (lock acquisitions
        made by batched_remove: one per chunk of REMOVE_CHUNK_KEYS keys)."""
        return {}

    def flush(self) -> None:  # noqa: B027 - optional hook, most tiers write synchronously
        """Waits until everything acknowledged is durable in this tier."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases resources. Called once, after flush()."""
