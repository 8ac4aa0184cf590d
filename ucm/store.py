"""The Store: UCM's public API over a stack of tiers (DESIGN.md "Public Python API").

Cascade semantics: a load is served by the first tier holding the key and promoted into the top
tier (and into intermediate tiers with ``promote: true``); a dump goes to the top tier within the
task, then asynchronously to every ``write: through`` tier; ``write: back`` tiers receive shards
that a tier above evicts. Touch and remove reach every tier; lookup stops descending at the first
tier that answers.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from . import arguments
from .config import LowerTierConfig, StackConfig, load_stack
from .errors import (
    ConfigError,
    InvalidArgumentError,
    KeyMissingError,
    RoleError,
    StoreClosedError,
)
from .layout import Key, Layout
from .plugins import tier_types
from .task import Task
from .tier import Outcome, ShardViews, Tier, TierContext

DEFAULT_WRITE_QUEUE_BYTES = 256 * 1024 * 1024


class Store:
    """One rank's handle on a tier stack. Thread-safe; use as a context manager."""

    def __init__(
        self,
        config: StackConfig,
        device_id: int = 0,
        local_rank_size: int = 1,
        write_queue_bytes: int = DEFAULT_WRITE_QUEUE_BYTES,
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
        self.tiers: list[Tier] = []
        installed = tier_types()
        try:
            for position, tier_config in enumerate(config.tiers):
                context = TierContext(
                    layout=self.layout,
                    unique_id=config.unique_id,
                    device_id=device_id,
                    local_rank_size=local_rank_size,
                    position=position,
                    evict_sink=self._evict_sink_for(position),
                )
                if tier_config.type == "buffer" and position > 0:
                    raise ConfigError(
                        f"tiers[{position}].type: the buffer tier must be the first tier (the "
                        "node-wide host-memory cache sits above every other tier)"
                    )
                try:
                    self.tiers.append(installed[tier_config.type](tier_config, context))
                except InvalidArgumentError as exc:
                    raise ConfigError(f"tiers[{position}] ({tier_config.type}): {exc}") from exc
        except BaseException:
            for tier in self.tiers:
                tier.close()
            raise
        top = self.tiers[0]
        # The shared CacheBuffer (native core) offers the owner/waiter load path.
        self._buffer: Any = top if hasattr(top, "load_through") else None
        self._tasks = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ucm-task")
        self._writer = _WriteQueue(write_queue_bytes, self._count)
        self._prefetches: list[Future[None]] = []

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
        keys = self.layout.keys_of_blocks(blocks)
        if keys and len(self.tiers) > 1:
            self._prefetches = [f for f in self._prefetches if not f.done()]
            self._prefetches.append(self._tasks.submit(self._prefetch, keys))

    def load(self, block_ids: Sequence[bytes], shard_index: Any, dst: Any) -> Task:
        """Loads shard ``shard_index[i]`` of block i into the tensors ``dst[i]``."""
        keys, memory = self._prepare(block_ids, shard_index, "dst", dst, for_load=True)
        return self._submit("load", keys, self._run_load, memory)

    def dump(self, block_ids: Sequence[bytes], shard_index: Any, src: Any) -> Task:
        """Stores the tensors ``src[i]`` as shard ``shard_index[i]`` of block i."""
        keys, memory = self._prepare(block_ids, shard_index, "src", src, for_load=False)
        return self._submit("dump", keys, self._run_dump, memory)

    def load_data(self, block_ids: Sequence[bytes], shard_index: Any, dst_ptrs: Any) -> Task:
        """Like load, with raw addresses: ``dst_ptrs[i][j]`` receives tensor j of block i."""
        keys, memory = self._prepare(block_ids, shard_index, "dst_ptrs", dst_ptrs, for_load=True)
        return self._submit("load", keys, self._run_load, memory)

    def dump_data(self, block_ids: Sequence[bytes], shard_index: Any, src_ptrs: Any) -> Task:
        """Like dump, with raw addresses: ``src_ptrs[i][j]`` holds tensor j of block i."""
        keys, memory = self._prepare(block_ids, shard_index, "src_ptrs", src_ptrs, for_load=False)
        return self._submit("dump", keys, self._run_dump, memory)

    def wait_prefetches(self) -> None:
        """Blocks until every prefetch started so far has finished (its errors are ignored:
        a failed prefetch only means the later load reads from below)."""
        for future in list(self._prefetches):
            future.exception()

    def wait(self, task: Task) -> None:
        """Blocks until the task finishes; raises TaskError naming each failed key."""
        _check_task(task)
        task.result()

    def check(self, task: Task) -> bool:
        """Non-blocking: whether the task finished (successfully or not)."""
        _check_task(task)
        return task.done()

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
        self._writer.drain()
        before = self._lookup_keys(keys, stop_early=False)
        for tier in self.tiers:
            tier.batched_remove(keys, force=force)
        after = self._lookup_keys(keys, stop_early=False)
        removed = sum(1 for was, still in zip(before, after, strict=True) if was and not still)
        self._count("removed_shards", removed)
        return removed

    def stats(self) -> dict[str, Any]:
        """Store counters plus each tier's own counters under ``tiers``."""
        with self._counters_lock:
            counters: dict[str, Any] = dict(self._counters)
        for name in ("hits", "misses", "loaded_shards", "dumped_shards", "failed_shards"):
            counters.setdefault(name, 0)
        lookups = counters["hits"] + counters["misses"]
        counters["hit_rate"] = counters["hits"] / lookups if lookups else 0.0
        counters["write_queue_bytes"] = self._writer.pending_bytes
        counters["tiers"] = [
            {"type": tier.type_name, "name": tier.label, **tier.stats()} for tier in self.tiers
        ]
        return counters

    def close(self) -> None:
        """Finishes pending tasks and write-through work, then closes every tier."""
        if self._closed:
            return
        self._closed = True
        self._tasks.shutdown(wait=True)
        self._writer.close()
        for tier in self.tiers:
            tier.flush()
        for tier in self.tiers:
            tier.close()

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
    ) -> tuple[list[Key], arguments.ShardMemory]:
        self._check_open()
        if self.device_id < 0:
            verb = "load" if for_load else "dump"
            raise RoleError(
                f"{verb} is not allowed on a scheduler (device_id={self.device_id}): the "
                "scheduler role only answers lookups; open the store with device_id >= 0"
            )
        blocks = arguments.check_block_ids(block_ids)
        indexes = arguments.check_shard_indexes(shard_index, len(blocks), self.layout)
        keys = arguments.keys_for(blocks, indexes)
        arguments.check_unique_keys(keys)
        if name.endswith("_ptrs"):
            memory = arguments.check_pointers(buffers, len(blocks), self.layout, name)
        else:
            memory = arguments.check_tensors(buffers, len(blocks), self.layout, name, for_load)
        return keys, memory

    def _submit(
        self,
        kind: str,
        keys: list[Key],
        runner: Callable[[list[Key], arguments.ShardMemory], dict[Key, BaseException]],
        memory: arguments.ShardMemory,
    ) -> Task:
        future: Future[dict[Key, BaseException]] = self._tasks.submit(runner, keys, memory)
        self._count(f"{kind}_tasks")
        return Task(kind=kind, keys=keys, future=future)

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

    def _cascade_load(
        self, keys: list[Key], views: Sequence[ShardViews], start_tier: int = 0
    ) -> tuple[dict[Key, BaseException], list[int]]:
        """Loads each key from the first tier that has it. Returns failures and, per key, the
        position of the tier that served it (-1 if none)."""
        served_by = [-1] * len(keys)
        last_error: dict[int, BaseException] = {}
        pending = list(range(len(keys)))
        for position in range(start_tier, len(self.tiers)):
            if not pending:
                break
            tier = self.tiers[position]
            outcomes = tier.load([keys[i] for i in pending], [views[i] for i in pending])
            still = []
            for i, outcome in zip(pending, outcomes, strict=True):
                if outcome is None:
                    served_by[i] = position
                else:
                    if not isinstance(outcome, KeyMissingError):
                        last_error[i] = outcome
                        self._count(f"tier{position}_errors")
                    still.append(i)
            pending = still
        failures: dict[Key, BaseException] = {}
        for i in pending:
            failures[keys[i]] = last_error.get(
                i, KeyMissingError(f"not found in any of the {len(self.tiers)} tier(s)")
            )
        return failures, served_by

    def _promote(self, keys: list[Key], views: Sequence[ShardViews], served_by: list[int]) -> None:
        """Copies keys served from below into the top tier and into `promote: true` tiers."""
        for position in range(len(self.tiers) - 1):
            tier = self.tiers[position]
            if tier is self._buffer:
                continue  # the owner rank filled the buffer slot itself
            wants = position == 0 or getattr(tier.config, "promote", False)
            if not wants:
                continue
            chosen = [i for i, served in enumerate(served_by) if served > position]
            if chosen:
                outcomes = tier.dump([keys[i] for i in chosen], [views[i] for i in chosen])
                self._count("promoted_shards", sum(1 for o in outcomes if o is None))

    def _run_load(self, keys: list[Key], memory: arguments.ShardMemory) -> dict[Key, BaseException]:
        failures: dict[Key, BaseException]
        served_by: list[int]
        if self._buffer is not None:
            failures, served_by = self._buffer.load_through(
                keys, memory.views, lambda k, v: self._cascade_load(k, v, start_tier=1)
            )
        else:
            failures, served_by = self._cascade_load(keys, memory.views)
        hits = sum(1 for served in served_by if served == 0)
        self._count("hits", hits)
        self._count("misses", len(keys) - hits)
        self._count("loaded_shards", sum(1 for served in served_by if served >= 0))
        self._count("failed_shards", len(failures))
        self._promote(keys, memory.views, served_by)
        arguments.finish_cuda_loads(memory)
        return failures

    def _run_dump(self, keys: list[Key], memory: arguments.ShardMemory) -> dict[Key, BaseException]:
        top = self.tiers[0]
        outcomes = top.dump(keys, memory.views)
        failures = {key: o for key, o in zip(keys, outcomes, strict=True) if o is not None}
        through = [
            tier
            for tier in self.tiers[1:]
            if isinstance(tier.config, LowerTierConfig) and tier.config.write == "through"
        ]
        if through:
            # The caller may reuse its tensors once the task is done: snapshot the bytes.
            accepted = [i for i, o in enumerate(outcomes) if o is None]
            snapshot = [b"".join(bytes(v) for v in memory.views[i]) for i in accepted]
            self._writer.put(through, [keys[i] for i in accepted], snapshot)
        self._count("dumped_shards", len(keys) - len(failures))
        self._count("failed_shards", len(failures))
        return failures

    def _prefetch(self, keys: list[Key]) -> None:
        top_present = self.tiers[0].lookup(keys)
        missing = [key for key, hit in zip(keys, top_present, strict=True) if not hit]
        if not missing:
            return
        buffers = [bytearray(self.layout.shard_size) for _ in missing]
        views: list[ShardViews] = [[memoryview(b)] for b in buffers]
        if self._buffer is not None:
            # Claims the slots, so ranks prefetching the same blocks read each shard once.
            _, served_by = self._buffer.load_through(
                missing, views, lambda k, v: self._cascade_load(k, v, start_tier=1)
            )
        else:
            _, served_by = self._cascade_load(missing, views, start_tier=1)
        self._promote(missing, views, served_by)
        self._count("prefetched_shards", sum(1 for served in served_by if served > 0))

    def _evict_sink_for(
        self, position: int
    ) -> Callable[[Sequence[Key], Sequence[ShardViews]], Sequence[Outcome]] | None:
        back = [
            i
            for i, tier_config in enumerate(self.config.tiers)
            if i > position
            and isinstance(tier_config, LowerTierConfig)
            and tier_config.write == "back"
        ]
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


class _WriteQueue:
    """Background writer for ``write: through`` tiers, bounded in bytes (backpressure)."""

    def __init__(self, capacity_bytes: int, count: Callable[[str, int], None]) -> None:
        self._capacity_bytes = capacity_bytes
        self._count = count
        self._pending_bytes = 0
        self._condition = threading.Condition()
        self._queue: queue.Queue[tuple[list[Tier], list[Key], list[bytes]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ucm-write-through", daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def put(self, tiers: list[Tier], keys: list[Key], data: list[bytes]) -> None:
        size = sum(len(d) for d in data)
        with self._condition:
            # Bounded wait loop: each pass sleeps until the writer frees bytes.
            while self._pending_bytes and self._pending_bytes + size > self._capacity_bytes:
                self._condition.wait(timeout=1.0)
            self._pending_bytes += size
        self._queue.put((tiers, keys, data))

    def drain(self) -> None:
        with self._condition:
            while self._pending_bytes:
                self._condition.wait(timeout=1.0)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            tiers, keys, data = item
            views: list[ShardViews] = [[memoryview(d)] for d in data]
            for tier in tiers:
                outcomes = tier.dump(keys, views)
                failed = sum(1 for o in outcomes if o is not None)
                self._count("write_through_shards", len(keys) - failed)
                self._count("write_through_failures", failed)
            with self._condition:
                self._pending_bytes -= sum(len(d) for d in data)
                self._condition.notify_all()


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
