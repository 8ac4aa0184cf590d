"""The Store: UCM's public API over a stack of tiers (DESIGN.md "Public Python API").

Cascade semantics: a load is served by the first tier holding the key and promoted into the top
tier (and into intermediate tiers with ``promote: true``); a dump goes to the top tier within the
task, then asynchronously to every ``write: through`` tier; ``write: back`` tiers receive shards
that a tier above evicts. Touch and remove reach every tier; lookup stops descending at the first
tier that answers.
"""

from __future__ import annotations

import contextlib
import os
import threading
from array import array
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import arguments
from .buffer import BufferTier
from .config import LowerTierConfig
from .errors import (
    ConfigError,
    InvalidArgumentError,
    KeyMissingError,
    RoleError,
    StoreClosedError,
)
from .layout import Key, Layout
from .loadqueue import DumpItem, DumpQueue, LoadPath
from .native.buffer import SLOT_NONE
from .native.queue import LOCAL_RANK_SIZE_MAX, NativeQueue, TaskKind
from .plugins import tier_types
from .stack import StackConfig, load_stack
from .task import Progress, Task
from .tier import HOST_MEMORY_OPTION, Outcome, ShardViews, Tier, TierContext

DEFAULT_WRITE_QUEUE_BYTES = 256 * 1024 * 1024


class Pin:
    """The shards of one block that :meth:`Store.pin` holds in the CacheBuffer, until
    :meth:`Store.unpin`. ``held`` of them (0 .. ``shards_per_block``) were Ready in the buffer
    and cannot be evicted meanwhile; the others (below the buffer, or absent) are not held."""

    __slots__ = ("_slots", "block_id")

    def __init__(self, block_id: bytes, slots: tuple[int, ...]) -> None:
        self.block_id = block_id
        self._slots = slots

    @property
    def held(self) -> int:
        """How many of the block's shards this pin holds in the buffer."""
        return len(self._slots)

    def __repr__(self) -> str:
        return f"Pin({self.block_id.hex()}, held={self.held})"


class Store:
    """One rank's handle on a tier stack. Thread-safe; use as a context manager.

    Loads and prefetches run in one engine, the native queue (:class:`~ucm.loadqueue.LoadPath`:
    native dispatcher and copy threads, Python loader threads for the tiers below): the
    buffer's queue, or a queue over a null buffer for a stack without one. The buffer part of
    dumps runs there too. Dumps that feed ``write: through`` tiers (or a stack without a
    buffer) also pass through the :class:`~ucm.loadqueue.DumpQueue`. Many tasks may be in
    flight at once.
    """

    def __init__(
        self,
        config: StackConfig,
        device_id: int = 0,
        local_rank_size: int = 1,
        write_queue_bytes: int | None = None,
    ) -> None:
        _check_rank(device_id, local_rank_size)
        self.config = config
        self.device_id = device_id
        self.local_rank_size = local_rank_size
        self.layout = Layout(
            shard_size=config.resolved_shard_size,
            shards_per_block=config.shards_per_block,
            tensor_sizes=config.resolved_tensor_sizes,
        )
        self._counters: Counter[str] = Counter()
        self._counters_lock = threading.Lock()
        self._closed = False
        self._final_tier_stats: list[dict[str, Any]] | None = None
        self.tiers: list[Tier] = []
        installed = tier_types()
        host_memory: tuple[tuple[int, int], ...] = ()
        try:
            for position, tier_config in enumerate(config.tiers):
                context = TierContext(
                    layout=self.layout,
                    unique_id=config.unique_id,
                    device_id=device_id,
                    local_rank_size=local_rank_size,
                    position=position,
                    evict_sink=self._evict_sink_for(position),
                    options={HOST_MEMORY_OPTION: host_memory} if host_memory else {},
                )
                try:
                    self.tiers.append(installed[tier_config.type](tier_config, context))
                except InvalidArgumentError as exc:
                    raise ConfigError(f"tiers[{position}] ({tier_config.type}): {exc}") from exc
                # Memory the buffer keeps mapped (its slots), for the tiers below.
                if isinstance(self.tiers[-1], BufferTier):
                    host_memory += self.tiers[-1].host_memory
        except BaseException:
            for tier in self.tiers:
                tier.close()
            raise
        top = self.tiers[0]
        # The shared CacheBuffer (native core), typed: it brings the native load queue.
        self._buffer: BufferTier | None = top if isinstance(top, BufferTier) else None
        # One settings model with or without a buffer (the buffer tier's config is one).
        settings = config.load_settings
        if write_queue_bytes is not None:
            settings = settings.model_copy(update={"write_queue_bytes": write_queue_bytes})
        self.settings = settings
        self._start = 1 if self._buffer is not None else 0
        through = [
            tier
            for tier in self.tiers[1:]
            if isinstance(tier.config, LowerTierConfig) and tier.config.write == "through"
        ]
        self._native: LoadPath | None = None
        self._own_queue: NativeQueue | None = None
        self._dumps: DumpQueue | None = None
        self._worker = device_id >= 0
        try:
            if self._worker:
                if self._buffer is not None:
                    queue = self._buffer.queue
                else:  # a null buffer: every key is loaded from the tiers (BYPASS)
                    queue = self._own_queue = NativeQueue(
                        None,
                        [],
                        settings,
                        device_id=device_id,
                        local_rank_size=min(local_rank_size, LOCAL_RANK_SIZE_MAX),
                        shards_per_block=self.layout.shards_per_block,
                        tensor_sizes=self.layout.tensor_sizes,
                    )
                self._native = LoadPath(
                    queue=queue,
                    buffer=self._buffer,
                    fill=self._fill_from_below,
                    count=self._count,
                    shard_size=self.layout.shard_size,
                    settings=settings,
                    dirty_dumps=self._buffer is not None and self._buffer.writes_back,
                )
            # Dumps that Python follows up go through the dump thread: without a buffer, with
            # write-through tiers, or within the write-back bound.
            writes_back = self._buffer is not None and self._buffer.writes_back
            if self._worker and (self._buffer is None or through or writes_back):
                self._dumps = DumpQueue(
                    top=top,
                    through=through,
                    count=self._count,
                    settings=settings,
                    native=self._native,
                    buffer=self._buffer,
                )
        except BaseException:
            if self._native is not None:
                self._native.close()
            if self._own_queue is not None:
                self._own_queue.destroy()
            for tier in self.tiers:
                tier.close()
            raise
        self._native_final: dict[str, int] | None = None
        self._prefetches: list[Task] = []
        self._prefetch_lock = threading.Lock()
        self._pins: set[Pin] = set()
        self._pins_lock = threading.Lock()

    @property
    def buffer(self) -> BufferTier | None:
        """The stack's CacheBuffer (its top tier), or None for a stack without one."""
        return self._buffer

    # ---- public API -------------------------------------------------------------------------

    def lookup(self, block_ids: Sequence[bytes]) -> list[bool]:
        """Whether every shard of each block is present in some tier."""
        self._check_open()
        blocks = arguments.check_block_ids(block_ids)
        keys = self.layout.keys_of_blocks(blocks)
        present = self._lookup_keys(keys)
        per_block = self.layout.shards_per_block
        return [all(present[i * per_block : (i + 1) * per_block]) for i in range(len(blocks))]

    def lookup_on_prefix(self, block_ids: Sequence[bytes]) -> int:
        """Index of the last block of the longest present prefix, -1 if the first is absent."""
        present = self.lookup(block_ids)
        for index, hit in enumerate(present):
            if not hit:
                return index - 1
        return len(present) - 1

    def prefetch(self, block_ids: Sequence[bytes]) -> None:
        """Starts moving the blocks' shards up into the top tier (asynchronously)."""
        self._check_open()
        blocks = arguments.check_block_ids(block_ids)
        if not self._worker:
            raise RoleError(
                f"prefetch is not allowed on a scheduler (device_id={self.device_id}): the "
                "scheduler role has no data plane to fill; prefetch from a worker rank"
            )
        keys = self.layout.keys_of_blocks(blocks)
        if not keys or len(self.tiers) == 1:
            return
        present = self.tiers[0].lookup(keys)
        missing = [key for key, hit in zip(keys, present, strict=True) if not hit]
        if not missing:
            return
        assert self._native is not None
        job = self._native.submit(TaskKind.PREFETCH, arguments.TaskKeys.of(missing), None)
        task = self._native.task("prefetch", job)
        with self._prefetch_lock:
            self._prefetches = [t for t in self._prefetches if not t.done()]
            self._prefetches.append(task)

    def load(self, block_ids: Sequence[bytes], shard_index: Any, dst: Any) -> Task:
        """Loads shard ``shard_index[i]`` of block i into the tensors ``dst[i]``."""
        prepared = self._prepare(block_ids, shard_index, "dst", dst, for_load=True)
        return self._submit_load(*prepared)

    def dump(self, block_ids: Sequence[bytes], shard_index: Any, src: Any) -> Task:
        """Stores the tensors ``src[i]`` as shard ``shard_index[i]`` of block i."""
        prepared = self._prepare(block_ids, shard_index, "src", src, for_load=False)
        return self._submit_dump(*prepared)

    def load_data(self, block_ids: Sequence[bytes], shard_index: Any, dst_ptrs: Any) -> Task:
        """Like load, with raw addresses: ``dst_ptrs[i][j]`` receives tensor j of block i."""
        prepared = self._prepare(block_ids, shard_index, "dst_ptrs", dst_ptrs, for_load=True)
        return self._submit_load(*prepared)

    def dump_data(self, block_ids: Sequence[bytes], shard_index: Any, src_ptrs: Any) -> Task:
        """Like dump, with raw addresses: ``src_ptrs[i][j]`` holds tensor j of block i."""
        prepared = self._prepare(block_ids, shard_index, "src_ptrs", src_ptrs, for_load=False)
        return self._submit_dump(*prepared)

    def wait_prefetches(self) -> None:
        """Blocks until every prefetch started so far has finished (its errors are ignored:
        a failed prefetch only means the later load reads from below)."""
        with self._prefetch_lock:
            tasks = list(self._prefetches)
        for task in tasks:
            # A failed prefetch only means that the later load reads from below.
            with contextlib.suppress(Exception):
                task.completion.failures(self.settings.queue_timeout_s)

    def wait(self, task: Task) -> None:
        """Blocks until the task finishes; raises TaskError naming each failed key."""
        _check_task(task)
        task.result()

    def check(self, task: Task) -> bool:
        """Non-blocking: whether the task finished (successfully or not)."""
        _check_task(task)
        return task.done()

    def pin(self, block_ids: Sequence[bytes]) -> list[Pin]:
        """Holds each block's shards that are Ready in the CacheBuffer there, so that no
        eviction (of this rank or any other on the node) takes them, until :meth:`unpin`; one
        :class:`Pin` per block, saying how many shards it holds. Shards below the buffer, or
        absent, are not held (a pin never loads nor allocates), and a stack without a buffer,
        or the scheduler role, holds nothing. ``remove(force=True)`` still removes a pinned
        shard (its memory is freed at the unpin). Pins held at :meth:`close` are released."""
        self._check_open()
        blocks = arguments.check_block_ids(block_ids)
        if self._native is None or self._buffer is None or not blocks:
            return [Pin(block, ()) for block in blocks]
        per_block = self.layout.shards_per_block
        ids = b"".join(block for block in blocks for _ in range(per_block))
        shards = array("I", list(range(per_block)) * len(blocks))
        with self._pins_lock:
            self._check_open()
            slots = self._native.queue.pin(ids, shards)
            pins = [
                Pin(
                    block,
                    tuple(s for s in slots[i * per_block : (i + 1) * per_block] if s != SLOT_NONE),
                )
                for i, block in enumerate(blocks)
            ]
            self._pins.update(pin for pin in pins if pin.held)
        self._count("pinned_shards", sum(pin.held for pin in pins))
        return pins

    def unpin(self, pins: Sequence[Pin]) -> None:
        """Releases pins from :meth:`pin` (one already released, or released by close, is
        skipped)."""
        if not isinstance(pins, Sequence) or not all(isinstance(pin, Pin) for pin in pins):
            raise InvalidArgumentError(
                f"pins must be a list of the Pin objects store.pin returned, got {pins!r}"
            )
        with self._pins_lock:
            slots = array("I")
            for pin in pins:
                if pin in self._pins:
                    self._pins.discard(pin)
                    slots.extend(pin._slots)
            if slots and self._native is not None:
                self._native.queue.unpin(slots)
        self._count("unpinned_shards", len(slots))

    def touch(self, block_ids: Sequence[bytes]) -> None:
        """Renews every resident shard of the blocks in every tier."""
        self._check_open()
        blocks = arguments.check_block_ids(block_ids)
        if blocks:
            for tier in self.tiers:
                tier.touch(blocks)

    def remove(self, block_ids: Sequence[bytes], force: bool = False) -> int:
        """Removes every shard of the blocks from every tier; returns distinct shards removed.
        Shards in use are kept unless ``force``."""
        self._check_open()
        if not isinstance(force, bool):
            raise InvalidArgumentError(f"force must be a bool, got {force!r}")
        blocks = arguments.check_block_ids(block_ids)
        keys = list(dict.fromkeys(self.layout.keys_of_blocks(blocks)))
        if not keys:
            return 0
        # Pending write-through work would resurrect removed shards below: finish it first.
        self.drain()
        before = self._lookup_keys(keys, stop_early=False)
        for tier in self.tiers:
            tier.batched_remove(keys, force=force)
        after = self._lookup_keys(keys, stop_early=False)
        removed = sum(1 for was, still in zip(before, after, strict=True) if was and not still)
        self._count("removed_shards", removed)
        return removed

    def drain(self) -> None:
        """Blocks until every dump submitted so far is written to every ``write: through``
        tier (what close() also does)."""
        if self._dumps is not None:
            self._dumps.drain()

    def stats(self) -> dict[str, Any]:
        """Store counters plus each tier's own counters under ``tiers``."""
        with self._counters_lock:
            counters: dict[str, Any] = dict(self._counters)
        # The load engine's counters: the queue owns these names (the store never counts them).
        if self._native is not None and not self._native.queue.destroyed:
            native = self._native.queue.stats()
            counters.update({name: native[name] for name in _NATIVE_STORE_COUNTERS})
        elif self._native_final is not None:
            counters.update(self._native_final)
        for name in (
            "hits",
            "misses",
            "loaded_shards",
            "dumped_shards",
            "failed_shards",
            "repaired_shards",
        ):
            counters.setdefault(name, 0)
        lookups = counters["hits"] + counters["misses"]
        counters["hit_rate"] = counters["hits"] / lookups if lookups else 0.0
        writer = self._dumps.writer if self._dumps is not None else None
        counters["write_queue_bytes"] = writer.pending_bytes if writer is not None else 0
        # A closed tier may have unmapped its counters: report what it had at close.
        counters["tiers"] = self._final_tier_stats or self._tier_stats()
        return counters

    def close(self) -> None:
        """Finishes pending tasks and write-through work, then closes every tier."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        try:
            with self._pins_lock:  # before the queue goes: their references are its uses
                held = list(self._pins)
            self.unpin(held)
            if self._dumps is not None:  # may still hand dumps to the native queue
                self._dumps.close()
            if self._native is not None:
                self._native.close()
            # Top first: the buffer's write-back debt lands in the tiers below before they
            # flush. One tier's failure does not keep the others from flushing.
            for tier in self.tiers:
                try:
                    tier.flush()
                except Exception as exc:
                    errors.append(exc)
        finally:
            self._final_tier_stats = self._tier_stats()
            if self._native is not None and not self._native.queue.destroyed:
                native = self._native.queue.stats()
                self._native_final = {name: native[name] for name in _NATIVE_STORE_COUNTERS}
            if self._own_queue is not None:  # left alone when abandoned (tasks outlived close)
                self._own_queue.destroy()
            for tier in self.tiers:
                tier.close()
        if errors:
            raise errors[0]

    def _tier_stats(self) -> list[dict[str, Any]]:
        return [{"type": tier.type_name, "name": tier.label, **tier.stats()} for tier in self.tiers]

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed; open a new one with ucm.open()")

    def _count(self, name: str, amount: int = 1) -> None:
        with self._counters_lock:
            self._counters[name] += amount

    def _prepare(
        self, block_ids: Any, shard_index: Any, name: str, buffers: Any, for_load: bool
    ) -> tuple[arguments.TaskKeys, arguments.ShardMemory]:
        self._check_open()
        if self.device_id < 0:
            verb = "load" if for_load else "dump"
            raise RoleError(
                f"{verb} is not allowed on a scheduler (device_id={self.device_id}): the "
                "scheduler role only answers lookups; open the store with device_id >= 0"
            )
        task_keys = arguments.check_task_keys(block_ids, shard_index, self.layout)
        if name.endswith("_ptrs"):
            memory = arguments.check_pointers(buffers, len(task_keys), self.layout, name)
        else:
            memory = arguments.check_tensors(buffers, len(task_keys), self.layout, name, for_load)
        return task_keys, memory

    def _submit_load(self, task_keys: arguments.TaskKeys, memory: arguments.ShardMemory) -> Task:
        if not len(task_keys):  # nothing to load: done at once, and not a task of the queue
            return Task("load", [], Progress([]))
        assert self._native is not None  # the queue counts its load tasks
        return self._native.task("load", self._native.submit(TaskKind.LOAD, task_keys, memory))

    def _submit_dump(self, task_keys: arguments.TaskKeys, memory: arguments.ShardMemory) -> Task:
        self._count("dump_tasks")
        if not len(task_keys):
            return Task("dump", [], Progress([]))
        if self._dumps is None:  # straight into the buffer's native queue
            assert self._native is not None
            return self._native.task("dump", self._native.submit(TaskKind.DUMP, task_keys, memory))
        progress = Progress(
            task_keys.keys, on_complete=lambda _done: arguments.release_staging(memory)
        )
        try:
            self._dumps.submit(DumpItem(task_keys, memory, progress))
        except BaseException:
            arguments.release_staging(memory)
            raise
        return Task("dump", task_keys, progress)

    def _lookup_keys(self, keys: list[Key], stop_early: bool = True) -> list[bool]:
        present = [False] * len(keys)
        pending = list(range(len(keys)))
        for tier in self.tiers:
            if not pending:
                break
            answers = tier.lookup([keys[i] for i in pending])
            pending = [i for i, hit in zip(pending, answers, strict=True) if not hit]
            for i in set(range(len(keys))) - set(pending):
                present[i] = True
            if stop_early and not pending:
                break
        return present

    def _fill_from_below(
        self, keys: list[Key], views: list[ShardViews]
    ) -> tuple[dict[Key, BaseException], list[int]]:
        """Loads keys through the cascade below the buffer (or from the top when there is no
        buffer), then promotes and repairs. Used by the load path's loader threads."""
        failures, served_by, broken = self._cascade_load(keys, views, self._start)
        self._write_up(keys, views, served_by, broken)
        return failures, served_by

    def _cascade_load(
        self, keys: list[Key], views: Sequence[ShardViews], start_tier: int = 0
    ) -> tuple[dict[Key, BaseException], list[int], list[set[int]]]:
        """Loads each key from the first tier that has it. Returns failures, per key the
        position of the tier that served it (-1 if none), and per key the positions that
        failed it with an error other than a plain miss (corrupt data, I/O error)."""
        served_by = [-1] * len(keys)
        broken: list[set[int]] = [set() for _ in keys]
        last_error: dict[int, BaseException] = {}
        pending = list(range(len(keys)))
        for position in range(start_tier, len(self.tiers)):
            if not pending:
                break
            tier = self.tiers[position]
            try:
                outcomes: Sequence[Outcome] = tier.load(
                    [keys[i] for i in pending], [views[i] for i in pending]
                )
            except Exception as exc:  # a tier that raises fails its whole batch, not the task
                outcomes = [exc] * len(pending)
            still = []
            for i, outcome in zip(pending, outcomes, strict=True):
                if outcome is None:
                    served_by[i] = position
                else:
                    if not isinstance(outcome, KeyMissingError):
                        last_error[i] = outcome
                        broken[i].add(position)
                        self._count(f"tier{position}_errors")
                    still.append(i)
            pending = still
        failures: dict[Key, BaseException] = {}
        for i in pending:
            failures[keys[i]] = last_error.get(
                i, KeyMissingError(f"not found in any of the {len(self.tiers)} tier(s)")
            )
        return failures, served_by, broken

    def _write_up(
        self,
        keys: list[Key],
        views: Sequence[ShardViews],
        served_by: list[int],
        broken: list[set[int]],
    ) -> None:
        """Writes keys served from below into the tiers above that should hold them: the top
        tier (promotion; the buffer's owner rank fills its slot itself), ``promote: true``
        tiers, and every tier that failed the key with an error other than a miss (repair: a
        torn or corrupt copy is replaced by the good one)."""
        for position in range(len(self.tiers) - 1):
            tier = self.tiers[position]
            if position == 0 and self._buffer is not None:
                continue
            tier_config = tier.config
            writable = not (
                isinstance(tier_config, LowerTierConfig) and tier_config.write == "none"
            )
            promote = position == 0 or (
                isinstance(tier_config, LowerTierConfig) and tier_config.promote
            )
            repair = [
                i
                for i, served in enumerate(served_by)
                if served > position and position in broken[i]
            ]
            chosen = sorted(
                {i for i, served in enumerate(served_by) if served > position and promote}
                | (set(repair) if writable else set())
            )
            if not chosen:
                continue
            try:
                outcomes: Sequence[Outcome] = tier.dump(
                    [keys[i] for i in chosen], [views[i] for i in chosen]
                )
            except Exception as exc:
                outcomes = [exc] * len(chosen)
            written = {i for i, o in zip(chosen, outcomes, strict=True) if o is None}
            repaired = sum(1 for i in repair if i in written)
            self._count("repaired_shards", repaired)
            self._count("promoted_shards", len(written) - repaired)

    def _evict_sink_for(
        self, position: int
    ) -> Callable[[Sequence[Key], Sequence[ShardViews]], Sequence[Outcome]] | None:
        # The `write: back` tiers below `position` that a shard leaving it would otherwise
        # lack: those above the first `write: through` tier below it, which holds every dump
        # already (its own evictions feed the back tiers under it).
        back = []
        for i in range(position + 1, len(self.config.tiers)):
            tier_config = self.config.tiers[i]
            if not isinstance(tier_config, LowerTierConfig):
                continue
            if tier_config.write == "through":
                break
            if tier_config.write == "back":
                back.append(i)
        if not back:
            return None

        def sink(keys: Sequence[Key], views: Sequence[ShardViews]) -> Sequence[Outcome]:
            results: list[Outcome] = [None] * len(keys)
            for i in back:
                outcomes = self.tiers[i].dump(keys, views)
                for j, outcome in enumerate(outcomes):
                    if outcome is not None:
                        results[j] = outcome
            self._count("written_back_shards", sum(1 for r in results if r is None))
            return results

        return sink


_NATIVE_STORE_COUNTERS = (
    "load_tasks",
    "hits",
    "misses",
    "loaded_shards",
    "dumped_shards",
    "failed_shards",
    "prefetched_shards",
    "takeovers",
    "prewarmed",
    "get_ns",
    "get_keys",
)
"""Counters of the native queue that are the store's own (its loads, dumps, prefetches)."""


def _check_rank(device_id: Any, local_rank_size: Any) -> None:
    if not isinstance(device_id, int) or isinstance(device_id, bool):
        raise InvalidArgumentError(
            f"device_id must be an int (>= 0 for a worker rank, < 0 for the scheduler), got "
            f"{device_id!r}"
        )
    if not isinstance(local_rank_size, int) or isinstance(local_rank_size, bool):
        raise InvalidArgumentError(f"local_rank_size must be an int >= 1, got {local_rank_size!r}")
    if local_rank_size < 1:
        raise InvalidArgumentError(f"local_rank_size must be >= 1, got {local_rank_size}")


def _check_task(task: Any) -> None:
    if not isinstance(task, Task):
        raise InvalidArgumentError(
            f"task must be a ucm Task returned by load/dump, got {type(task).__name__}"
        )


def open_store(
    stack: str | os.PathLike[str] | Mapping[str, Any] | StackConfig,
    device_id: int = 0,
    local_rank_size: int = 1,
    **options: Any,
) -> Store:
    """Opens a store for one rank: ``ucm.open("stack.yaml", device_id=0, local_rank_size=4)``."""
    return Store(load_stack(stack), device_id=device_id, local_rank_size=local_rank_size, **options)
