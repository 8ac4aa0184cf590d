"""The per-rank load path (seed 000 §1, §3.1, §3.4): a dispatcher thread and a copier thread.

The **dispatcher** takes load tasks in order from a bounded pending queue. It walks each task in
RearrangeIndex order, one stride per step: a step is one batched Get on the shared CacheBuffer.
Per key the Get answers

- HIT: the slot is Ready; it goes to the copier at once;
- OWNER: this rank claimed the slot; a loader thread fills it from the tiers below, commits it
  Ready (or Failed) and hands it to the copier;
- WAITER: another rank (or thread) is filling it; the dispatcher sleeps on the slot's futex and
  hands it on when its state arrives (a Failed owner fails the key here too);
- NO_SLOT / LOCK_TIMEOUT: loaded from below straight into the destination (bypass).

A step ends when its owned and waited keys have resolved, so a rank never claims more than it is
loading: with every rank starting on its own stride the ranks own disjoint keys, load them
concurrently and find the other strides Ready (Scenario A). In the idle window after a task (no
task pending), the dispatcher prewarms (block, index + 1) of the task's blocks (Prealloc).

The **copier** moves slot bytes into the destinations (every host tensor of a task in one
native call, ``ucm.native.memcopy``; CUDA tensors take an async host-to-device copy from the
registered buffer, or the staging fallback) and releases the slots. Without a buffer tier the
dispatcher simply hands each step to the loader threads.

The **DumpQueue** takes dumps on its own thread, so dumps never delay the dispatcher: each shard
goes into the top tier, and a snapshot goes to the write-through writer for every ``write:
through`` tier below (bounded in bytes).
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import arguments
from .errors import KeyMissingError, StoreClosedError, TierError
from .layout import Key
from .native.buffer import Geometry, GetBatch, PreallocResult, State, WaitResult
from .native.memcopy import CopyRanges
from .rearrange import rearrange_strides
from .task import Progress
from .tier import Outcome, ShardViews, Tier


class BufferTier(Protocol):
    """The slot protocol of the ``buffer`` tier (``ucm_backends.buffer.BufferTier``)."""

    geometry: Geometry
    bases: list[int]

    def claim(self, keys: Sequence[Key]) -> GetBatch: ...
    def commit(
        self, keys: Sequence[Key], slots: Sequence[int], states: Sequence[State]
    ) -> None: ...
    def release(self, slots: Sequence[int]) -> None: ...
    def wait_slots(self, keys: Sequence[Key], slots: Sequence[int]) -> list[WaitResult]: ...
    def prewarm(self, keys: Sequence[Key]) -> list[PreallocResult]: ...
    def slot_addresses(self, slots: Sequence[int]) -> list[int]: ...
    def slot_views(self, slots: Sequence[int]) -> list[memoryview]: ...
    def dump_ranges(
        self, keys: Sequence[Key], sources: Sequence[Sequence[tuple[int, int]]]
    ) -> list[Outcome]: ...
    def count(self, name: str, amount: int = 1) -> None: ...


Fill = Callable[[list[Key], list[ShardViews]], tuple[dict[Key, BaseException], list[int]]]
"""Loads keys from the tiers below into the views; returns failures and, per key, the position
of the tier that served it (-1 if none)."""

Count = Callable[[str, int], None]

_HIT, _OWNER, _WAITER = 0, 1, 2
_READY, _FAILED, _TAKEOVER, _MISSING = 1, 2, 3, 5


@dataclass(frozen=True)
class QueueSettings:
    """Queue depths, concurrency and timeouts (the buffer tier's keys of the same names)."""

    load_queue_depth: int = 64
    dump_queue_depth: int = 64
    queue_timeout_s: float = 60.0
    load_workers: int = 4
    step_keys: int = 1024
    prealloc: bool = True
    rearrange: bool = True
    wait_timeout_s: float = 30.0
    write_queue_bytes: int = 256 * 1024 * 1024

    @classmethod
    def from_tier_config(cls, config: Any) -> QueueSettings:
        names = cls.__dataclass_fields__
        return cls(**{name: getattr(config, name) for name in names if hasattr(config, name)})


@dataclass(eq=False)
class LoadJob:
    """One load (or prefetch, when ``memory`` is None) task in the queue."""

    keys: list[Key]
    memory: arguments.ShardMemory | None
    progress: Progress
    direct: set[int] = field(default_factory=set)
    """Entries copied to CUDA tensors straight from registered buffer memory."""


def _put(target: queue.Queue[Any], item: Any, timeout_s: float, what: str) -> None:
    try:
        target.put(item, timeout=timeout_s)
    except queue.Full:
        raise TimeoutError(
            f"the {what} queue stayed full for {timeout_s} s: the rank submits faster than the "
            f"cache drains; wait for earlier tasks or raise {what}_queue_depth / queue_timeout_s"
        ) from None


class LoadQueue:
    """The load path of one worker rank. Thread-safe ``submit``; ``close`` drains it."""

    def __init__(
        self,
        *,
        buffer: BufferTier | None,
        fill: Fill,
        count: Count,
        device_id: int,
        local_rank_size: int,
        shards_per_block: int,
        shard_size: int,
        settings: QueueSettings,
    ) -> None:
        self._buffer = buffer
        self._shard_size = shard_size
        self._fill = fill
        self._count = count
        self._device_id = device_id
        self._local_rank_size = local_rank_size
        self._shards_per_block = shards_per_block
        self._settings = settings
        self._pending: queue.Queue[LoadJob | None] = queue.Queue(settings.load_queue_depth)
        self._copies: queue.Queue[tuple[LoadJob, list[int], list[int]] | None] = queue.Queue()
        self._loaders = ThreadPoolExecutor(settings.load_workers, thread_name_prefix="ucm-loader")
        self._cuda: _CudaDirect | None = None
        self._cuda_checked = False
        self._closed = False
        self._dispatcher = threading.Thread(
            target=self._dispatch_loop, name="ucm-dispatcher", daemon=True
        )
        self._copier = threading.Thread(target=self._copy_loop, name="ucm-copier", daemon=True)
        self._dispatcher.start()
        self._copier.start()

    # ---- submission -------------------------------------------------------------------------

    def submit(self, job: LoadJob) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed; open a new one with ucm.open()")
        if job.memory is not None and self._buffer is not None:
            self._maybe_enable_cuda(job.memory)
        _put(self._pending, job, self._settings.queue_timeout_s, "load")

    def close(self) -> None:
        """Finishes every queued task, then stops the threads."""
        if self._closed:
            return
        self._closed = True
        self._pending.put(None)
        self._dispatcher.join()
        self._loaders.shutdown(wait=True)
        self._copies.put(None)
        self._copier.join()
        if self._cuda is not None:
            self._cuda.close()

    # ---- dispatcher -------------------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        while True:
            job = self._pending.get()
            if job is None:
                return
            try:
                if self._buffer is None:
                    self._dispatch_direct(job)
                else:
                    self._dispatch_buffer(job, self._buffer)
                    if self._settings.prealloc and job.memory is not None and self._pending.empty():
                        self._prewarm(job, self._buffer)
            except BaseException as exc:  # never leave a task hanging
                job.progress.finish(job.progress.unfinished(), _as_error(exc))

    def _steps(self, n: int) -> list[list[int]]:
        limit = self._settings.step_keys
        if self._buffer is not None:
            # A step holds a reference on every slot it claims: half the regular pool at most,
            # so a task larger than the buffer still finds free slots.
            regular = self._buffer.geometry.slot_count_regular
            limit = max(1, min(limit, regular // 2))
        steps: list[list[int]] = []
        if self._settings.rearrange:
            strides = rearrange_strides(n, self._device_id, self._local_rank_size)
        else:  # natural order, in steps of the same size (for comparison)
            width = -(-n // self._local_rank_size)
            strides = [list(range(start, min(n, start + width))) for start in range(0, n, width)]
        for stride in strides:
            steps.extend(stride[start : start + limit] for start in range(0, len(stride), limit))
        return steps

    def _dispatch_direct(self, job: LoadJob) -> None:
        """No buffer: each step is loaded through the cascade straight into the destination."""
        futures = []
        for step in self._steps(len(job.keys)):
            for part in _split(step, self._settings.load_workers):
                futures.append(self._loaders.submit(self._bypass, job, part))
        wait_futures(futures, timeout=self._settings.queue_timeout_s)

    def _dispatch_buffer(self, job: LoadJob, buffer: BufferTier) -> None:
        for step in self._steps(len(job.keys)):
            keys = [job.keys[i] for i in step]
            started = time.perf_counter_ns()
            batch = buffer.claim(keys)
            self._count("get_ns", time.perf_counter_ns() - started)
            self._count("get_keys", len(keys))
            results, slots = batch.results, batch.slots
            hits = [j for j, r in enumerate(results) if r == _HIT]
            owned = [j for j, r in enumerate(results) if r == _OWNER]
            waiting = [j for j, r in enumerate(results) if r == _WAITER]
            bypass = [j for j, r in enumerate(results) if r > _WAITER]
            if hits:
                if job.memory is not None:
                    self._count("hits", len(hits))
                self._copies.put((job, [step[j] for j in hits], [slots[j] for j in hits]))
            futures: list[Future[None]] = []
            for part in _split(owned, self._settings.load_workers):
                futures.append(
                    self._loaders.submit(
                        self._fill_owned, job, [step[j] for j in part], [slots[j] for j in part]
                    )
                )
            if waiting:
                self._resolve_waiting(job, buffer, [step[j] for j in waiting], waiting, slots)
            if bypass:
                buffer.count("bypassed", len(bypass))
                futures.append(self._loaders.submit(self._bypass, job, [step[j] for j in bypass]))
            # The step ends when what it claimed has resolved: claim no more than is loading.
            wait_futures(futures, timeout=self._settings.wait_timeout_s)

    def _resolve_waiting(
        self,
        job: LoadJob,
        buffer: BufferTier,
        entries: list[int],
        positions: list[int],
        slots: Sequence[int],
    ) -> None:
        held = [slots[j] for j in positions]
        buffer.count("waited", len(entries))
        try:
            states = buffer.wait_slots([job.keys[i] for i in entries], held)
        except BaseException:
            buffer.release(held)
            raise
        ready = [k for k, s in enumerate(states) if s == _READY]
        failed = [k for k, s in enumerate(states) if s == _FAILED]
        missing = [k for k, s in enumerate(states) if s == _MISSING]
        taken = [k for k, s in enumerate(states) if s == _TAKEOVER]
        handled = (_READY, _FAILED, _MISSING, _TAKEOVER)
        other = [k for k, s in enumerate(states) if s not in handled]
        if ready and job.memory is not None:
            self._count("hits", len(ready))
        if ready:
            self._copies.put((job, [entries[k] for k in ready], [held[k] for k in ready]))
        if taken:  # the owner died: this rank loads it now
            self._count("takeovers", len(taken))
            self._fill_owned(job, [entries[k] for k in taken], [held[k] for k in taken])
        if failed or missing or other:
            buffer.release([held[k] for k in failed + missing + other])
        if (failed or missing) and job.memory is not None:
            self._count("misses", len(failed) + len(missing))
            self._count("failed_shards", len(failed) + len(missing))
        if failed:
            job.progress.finish(
                [entries[k] for k in failed],
                TierError(
                    "the rank that was loading this shard from the tiers below failed to load it"
                ),
            )
        if missing:
            job.progress.finish(
                [entries[k] for k in missing],
                KeyMissingError(
                    "not found in any tier (by the rank that was loading it from the tiers below)"
                ),
            )
        if other:  # timed out behind a live owner, or lock trouble: load it here, from below
            buffer.count("bypassed", len(other))
            self._bypass(job, [entries[k] for k in other])

    def _fill_owned(self, job: LoadJob, entries: list[int], slots: list[int]) -> None:
        """Fills claimed slots from below, commits them and hands the loaded ones on."""
        assert self._buffer is not None
        buffer = self._buffer
        keys = [job.keys[i] for i in entries]
        buffer.count("owned", len(entries))
        try:
            views: list[ShardViews] = [[view] for view in buffer.slot_views(slots)]
            failures, served = self._fill(keys, views)
        except BaseException as exc:
            failures, served = {key: _as_error(exc) for key in keys}, [-1] * len(keys)
        # A miss everywhere is committed as such, so waiters in other ranks raise the same
        # KeyMissingError as this one instead of a generic failure.
        states = [
            State.READY
            if position >= 0
            else State.MISSING
            if isinstance(failures.get(key), KeyMissingError)
            else State.FAILED
            for key, position in zip(keys, served, strict=True)
        ]
        buffer.commit(keys, slots, states)
        loaded = [k for k, position in enumerate(served) if position >= 0]
        bad = [k for k, position in enumerate(served) if position < 0]
        if job.memory is None:
            self._count("prefetched_shards", len(loaded))
        else:
            self._count("misses", len(entries))
        if bad:
            buffer.release([slots[k] for k in bad])
            self._count("failed_shards", len(bad))
            job.progress.fail({entries[k]: failures[keys[k]] for k in bad})
        if loaded:
            self._copies.put((job, [entries[k] for k in loaded], [slots[k] for k in loaded]))

    def _bypass(self, job: LoadJob, entries: list[int]) -> None:
        """Loads entries from the cascade straight into their destinations (no slot held)."""
        if job.memory is None:
            if self._buffer is None:  # no buffer: the cascade promotes into the top tier
                size = self._shard_size
                scratch: list[ShardViews] = [[memoryview(bytearray(size))] for _ in entries]
                _, served = self._fill([job.keys[i] for i in entries], scratch)
                self._count("prefetched_shards", sum(1 for p in served if p > 0))
            # (with a buffer, a prefetch without a slot has nowhere to put the bytes)
            job.progress.finish(entries)
            return
        keys = [job.keys[i] for i in entries]
        try:
            failures, served = self._fill(keys, [job.memory.views[i] for i in entries])
        except BaseException as exc:
            failures, served = {key: _as_error(exc) for key in keys}, [-1] * len(keys)
        hits = sum(1 for position in served if position == 0)
        self._count("hits", hits)
        self._count("misses", len(entries) - hits)
        loaded = [entries[k] for k, position in enumerate(served) if position >= 0]
        self._count("loaded_shards", len(loaded))
        self._count("failed_shards", len(entries) - len(loaded))
        job.progress.finish(loaded)
        job.progress.fail(
            {i: failures[key] for i, key, p in zip(entries, keys, served, strict=True) if p < 0}
        )

    def _prewarm(self, job: LoadJob, buffer: BufferTier) -> None:
        """Idle window (seed 3.4): hang idle slots for (block, index + 1) of this task's blocks,
        from the reserved pool when the regular one is full. Only this task's blocks."""
        following = [(b, s + 1) for b, s in job.keys if s + 1 < self._shards_per_block]
        if not following:
            return
        outcomes = buffer.prewarm(following)
        self._count("prewarmed", sum(1 for outcome in outcomes if outcome == 0))

    # ---- copier -----------------------------------------------------------------------------

    def _copy_loop(self) -> None:
        while True:
            item = self._copies.get()
            if item is None:
                return
            job, entries, slots = item
            try:
                self._copy(job, entries, slots)
            except BaseException as exc:
                job.progress.finish(entries, _as_error(exc))

    def _copy(self, job: LoadJob, entries: list[int], slots: list[int]) -> None:
        assert self._buffer is not None
        buffer = self._buffer
        try:
            memory = job.memory
            if memory is not None:
                addresses = buffer.slot_addresses(slots)
                cuda = self._cuda
                # Host tensors: every range of the task in one native call (libc's memmove
                # underneath). One call, not one per tensor: a ctypes call costs ~0.5 us, and
                # each one gives up the GIL and must win it back from the threads preparing
                # the next tasks (+10% on the 256 KiB hit path, 1.6x with 8 KiB tensors).
                ranges = CopyRanges()
                for i, source in zip(entries, addresses, strict=True):
                    pairs = memory.cuda[i]
                    if pairs is not None and cuda is not None:
                        cuda.copy(source, pairs)
                        job.direct.add(i)
                        continue
                    for target, nbytes in memory.addresses[i]:
                        ranges.add(target, source, nbytes)
                        source += nbytes
                ranges.copy()
                if cuda is not None and any(memory.cuda[i] is not None for i in entries):
                    cuda.synchronize()  # the slot bytes must be copied before the release
                self._count("loaded_shards", len(entries))
        finally:
            buffer.release(slots)
        job.progress.finish(entries)

    # ---- CUDA -------------------------------------------------------------------------------

    def _maybe_enable_cuda(self, memory: arguments.ShardMemory) -> None:
        if self._cuda_checked or not memory.cuda_pairs:
            return
        self._cuda_checked = True
        assert self._buffer is not None
        try:
            self._cuda = _CudaDirect(self._buffer.bases, self._buffer.geometry.segment_size_bytes)
        except Exception as exc:  # the staging fallback (arguments.py) still works
            self._count("cuda_register_failures", 1)
            sys.stderr.write(f"ucm: CUDA host registration unavailable, staging instead: {exc}\n")


class _CudaDirect:
    """Host-to-device copies straight from the buffer's data segments, registered with
    ``cudaHostRegister`` so the copies are asynchronous DMA from pinned memory."""

    def __init__(self, bases: Sequence[int], segment_bytes: int) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        self._torch = torch
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        self._registered: list[int] = []
        self._segments = []
        for base in bases:
            torch.cuda.check_error(cudart.cudaHostRegister(base, segment_bytes, 0))
            self._registered.append(base)
            raw = (ctypes.c_ubyte * segment_bytes).from_address(base)
            self._segments.append((base, torch.frombuffer(raw, dtype=torch.uint8)))
        self._segment_bytes = segment_bytes
        self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def copy(self, address: int, pairs: list[tuple[Any, Any]]) -> None:
        torch = self._torch
        found = [
            (address - base, tensor)
            for base, tensor in self._segments
            if base <= address < base + self._segment_bytes
        ]
        if not found:
            raise TierError(f"slot address {address:#x} is outside the registered segments")
        offset, segment = found[0]
        with torch.cuda.stream(self._stream):
            for device_tensor, _staging in pairs:
                nbytes = device_tensor.numel() * device_tensor.element_size()
                source = segment[offset : offset + nbytes]
                device_tensor.reshape(-1).view(torch.uint8).copy_(source, non_blocking=True)
                offset += nbytes

    def synchronize(self) -> None:
        self._stream.synchronize()

    def close(self) -> None:
        cudart = self._torch.cuda.cudart()  # type: ignore[no-untyped-call]
        for base in self._registered:
            cudart.cudaHostUnregister(base)
        self._registered.clear()


class DumpQueue:
    """Dumps on their own thread: into the top tier, then snapshots to the write-through tiers."""

    def __init__(
        self,
        *,
        top: Tier,
        through: list[Tier],
        count: Count,
        settings: QueueSettings,
        buffer: BufferTier | None = None,
    ) -> None:
        self._top = top
        self._buffer = buffer
        self._through = through
        self._count = count
        self._settings = settings
        self.writer = WriteQueue(settings.write_queue_bytes, count)
        self._pending: queue.Queue[tuple[list[Key], arguments.ShardMemory, Progress] | None] = (
            queue.Queue(settings.dump_queue_depth)
        )
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ucm-dump", daemon=True)
        self._thread.start()

    def submit(self, keys: list[Key], memory: arguments.ShardMemory, progress: Progress) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed; open a new one with ucm.open()")
        _put(self._pending, (keys, memory, progress), self._settings.queue_timeout_s, "dump")

    def drain(self) -> None:
        """Waits for every queued dump, then for the write-through backlog."""
        marker = Progress([(b"\0" * 16, 0)])  # finished by the dump thread when it gets here
        self._pending.put(([], arguments.ShardMemory(views=[]), marker))
        marker.future.result(timeout=self._settings.queue_timeout_s)
        self.writer.drain()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pending.put(None)
        self._thread.join()
        self.writer.close()

    def _run(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            keys, memory, progress = item
            if not keys:
                progress.finish(range(len(progress.keys)))
                continue
            try:
                self._dump(keys, memory, progress)
            except BaseException as exc:
                progress.finish(progress.unfinished(), _as_error(exc))

    def _dump(self, keys: list[Key], memory: arguments.ShardMemory, progress: Progress) -> None:
        if self._buffer is not None:  # the top tier: straight from the tensors' addresses
            outcomes = self._buffer.dump_ranges(keys, memory.addresses)
        else:
            outcomes = self._top.dump(keys, memory.views)
        if self._through:
            # The caller may reuse its tensors once the task is done: snapshot the bytes. Keys
            # the top tier refused still reach the write-through tiers.
            snapshot = [b"".join(memory.views[i]) for i in range(len(keys))]
            self.writer.put(self._through, keys, snapshot)
            outcomes = [None] * len(keys)
        failed = {i: o for i, o in enumerate(outcomes) if o is not None}
        self._count("dumped_shards", len(keys) - len(failed))
        self._count("failed_shards", len(failed))
        progress.finish(i for i in range(len(keys)) if i not in failed)
        progress.fail(failed)


class WriteQueue:
    """Background writer for ``write: through`` tiers, bounded in bytes (backpressure)."""

    def __init__(self, capacity_bytes: int, count: Count) -> None:
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
            for _ in range(WRITE_WAIT_ROUNDS_MAX):
                if not self._pending_bytes or self._pending_bytes + size <= self._capacity_bytes:
                    break
                self._condition.wait(timeout=1.0)
            self._pending_bytes += size
        self._queue.put((tiers, keys, data))

    def drain(self) -> None:
        with self._condition:
            for _ in range(WRITE_WAIT_ROUNDS_MAX):
                if not self._pending_bytes:
                    return
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
                try:
                    outcomes = tier.dump(keys, views)
                    failed = sum(1 for o in outcomes if o is not None)
                except Exception:
                    failed = len(keys)
                self._count("write_through_shards", len(keys) - failed)
                self._count("write_through_failures", failed)
            with self._condition:
                self._pending_bytes -= sum(len(d) for d in data)
                self._condition.notify_all()


WRITE_WAIT_ROUNDS_MAX = 600
"""One-second rounds a dump waits for write-through room (or ``drain`` for the backlog)."""


def _split(items: list[int], parts: int) -> list[list[int]]:
    """``items`` in at most ``parts`` contiguous, non-empty, near-equal pieces."""
    if not items:
        return []
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def _as_error(exc: BaseException) -> BaseException:
    return exc if isinstance(exc, Exception) else TierError(f"interrupted: {exc!r}")


__all__ = ["DumpQueue", "Fill", "LoadJob", "LoadQueue", "QueueSettings", "WriteQueue"]
