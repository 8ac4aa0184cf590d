"""The per-rank load and dump paths.

Every load and prefetch runs in one engine, the native queue (``ucm.native.queue``,
``core-native/src/queue.zig``): one call hands a task over, and native threads walk it in
RearrangeIndex order, one step at a time. **With a buffer tier** (the usual stack) a step is
a batched Get: the copies (``copy_threads`` threads), the futex waits on slots other ranks
fill, the releases and the idle-window Prealloc are native, while the runtime's thread holds
the GIL. **Without one** the queue runs on a null buffer: every key of a step is BYPASS work,
loaded from the tiers straight into its destination.

:class:`LoadPath` is the queue's Python side: it builds each task's arrays, runs the *loader*
threads that serve the keys this rank owns (or bypasses) from the tiers below (those stay
Python plugins), and completes :class:`~ucm.task.Task` objects by waiting on the task's futex
word (GIL released) — never by polling. CUDA destinations are copied by the loader threads from
the registered buffer memory (``COPY_OUT`` work), or through the pinned staging ring
(``ucm.staging``) when registration is unavailable (or there is no buffer).

The **DumpQueue** runs dumps that Python must follow up: stacks without a buffer (into the top
tier) and stacks with ``write: through`` tiers (the buffer part through the native queue, then
a snapshot of the bytes for the write-through writer, bounded in bytes).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import mmap
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from . import arguments
from .affinity import background_work, become_background
from .buffer import BufferTier
from .config import LoadSettings
from .cudart import batch_copier
from .errors import (
    BufferLockTimeoutError,
    KeyMissingError,
    NoBufferSlotError,
    StoreClosedError,
    TierError,
)
from .finality import Finality, forced_remove
from .layout import Key
from .native.pybuffer import copy_into
from .native.queue import (
    ENTRY_FLAG_CALLER_COPY,
    TASK_FLAG_BACKGROUND,
    TASK_FLAG_DIRTY,
    TASK_FLAG_NO_FILL,
    TASK_FLAG_NO_WAIT,
    EntryResult,
    NativeQueue,
    TaskKind,
    WorkBatch,
    WorkKind,
    WorkState,
)
from .native.removals import process_log
from .task import Progress, Task
from .threadname import enter_thread
from .tier import Outcome, ShardViews, Tier

Fill = Callable[[list[Key], list[ShardViews]], tuple[dict[Key, BaseException], list[int]]]
"""Loads keys from the tiers below into the views; returns failures and, per key, the position
of the tier that served it (-1 if none)."""

Count = Callable[[str, int], None]


LOADER_IDLE_S = 3600.0
"""How long an idle loader sleeps in ``next_work`` (GIL released) before asking again; the
queue wakes it at once for work or for close."""

_ERRORS: dict[int, Callable[[], BaseException]] = {
    EntryResult.OWNER_FAILED: lambda: TierError(
        "the rank that was loading this shard from the tiers below failed to load it"
    ),
    EntryResult.OWNER_MISSING: lambda: KeyMissingError(
        "not found in any tier (by the rank that was loading it from the tiers below)"
    ),
    EntryResult.NO_SLOT: lambda: NoBufferSlotError(
        "no buffer slot for the shard (NO_SLOT): every slot is in use"
    ),
    EntryResult.LOCK_TIMEOUT: lambda: BufferLockTimeoutError(
        "a bucket lock of the buffer stayed held by a live process past the lock timeout"
    ),
    EntryResult.NO_MEMORY: lambda: TierError(
        "out of shared memory (/dev/shm) while faulting the buffer slot in; lower the buffer "
        "capacity or free /dev/shm"
    ),
    EntryResult.MISSING: lambda: KeyMissingError("not in the buffer"),
    EntryResult.CALLER_FAILED: lambda: TierError("the load from the tiers below failed"),
    EntryResult.BACKLOG: lambda: TierError(
        "the native queue's work ring stayed full, so the loaded shard could not be handed on "
        "to be copied to its CUDA destination; load it again"
    ),
}


class NativeJob:
    """One task in the native queue: the arrays it reads and writes (kept alive until it
    completes) and the :class:`~ucm.task.Completion` of its Task."""

    __slots__ = (
        "_final",
        "_path",
        "addresses",
        "background",
        "direct",
        "entry_flags",
        "failures_seen",
        "kind",
        "memory",
        "on_complete",
        "results",
        "tag",
        "task_keys",
        "token",
    )

    def __init__(
        self,
        path: LoadPath,
        kind: TaskKind,
        task_keys: arguments.TaskKeys,
        memory: arguments.ShardMemory | None,
        tag: int,
    ) -> None:
        self._path = path
        self.kind = kind
        self.task_keys = task_keys
        self.memory = memory
        self.tag = tag
        self.token: int | None = None
        self.results = bytearray(len(task_keys))
        self.failures_seen: dict[int, BaseException] = {}
        """Why a loader failed an entry (set before it reports the entry)."""
        self.direct: set[int] = set()
        """Entries copied to CUDA tensors straight from registered buffer memory."""
        self.on_complete: Callable[[NativeJob], None] | None = None
        self._final: dict[Key, BaseException] | None = None
        self.addresses: Any = None
        self.entry_flags: bytes | None = None
        self.background = False
        """Nobody waits on it (an engine's asynchronous load or its prefetch): the loaders do
        its fill's tier I/O on their own threads (``affinity.background_work``)."""

    @property
    def keys(self) -> list[Key]:
        return self.task_keys.keys

    def done(self) -> bool:
        if self._final is not None:
            return True
        token = self.token
        if token is None or not self._path.queue.done(token):
            return False
        self._path.finalize(self)
        return True

    def failures(self, timeout: float | None) -> dict[Key, BaseException]:
        if self._final is None:
            token = self.token
            assert token is not None
            if not self._path.queue.wait(token, timeout):
                raise TimeoutError(f"the task did not finish within {timeout} s")
            self._path.finalize(self)
        assert self._final is not None
        return self._final

    def settle(self) -> None:
        """Builds the failures from the per-entry results (once, after completion)."""
        failures: dict[Key, BaseException] = {}
        results = self.results
        if results.count(0) != len(results):
            for i, code in enumerate(results):
                if code:
                    cause = self.failures_seen.get(i) or _ERRORS.get(code, _ERRORS[1])()
                    failures[self.keys[i]] = cause
        if self.on_complete is not None:
            self.on_complete(self)
        self._final = failures

    @property
    def settled(self) -> bool:
        return self._final is not None


class LoadPath:
    """The Python side of the native queue: submits tasks, serves the loaders, completes.
    ``queue`` runs over ``buffer``, or over a null buffer when ``buffer`` is None."""

    def __init__(
        self,
        *,
        queue: NativeQueue,
        buffer: BufferTier | None,
        fill: Fill,
        count: Count,
        shard_size: int,
        settings: LoadSettings,
        dirty_dumps: bool,
    ) -> None:
        self._buffer = buffer
        self.queue = queue
        self._fill = fill
        self._count = count
        self._shard_size = shard_size
        self._settings = settings
        self._dump_flags = TASK_FLAG_DIRTY if dirty_dumps else 0
        self._jobs: dict[int, NativeJob] = {}
        self._order: deque[NativeJob] = deque()
        self._lock = threading.Lock()
        self._tags = itertools.count(1)
        self._cuda: _CudaDirect | None = None
        self._cuda_checked = False
        self._closed = False
        rate = settings.background_read_bytes_per_s
        self._pacer = Pacer(rate) if rate is not None else None
        self._loaders = [
            threading.Thread(target=self._serve, name=f"ucm-loader-{i}", daemon=True)
            for i in range(settings.load_workers)
        ]
        for loader in self._loaders:
            loader.start()

    # ---- submission -------------------------------------------------------------------------

    def submit(
        self,
        kind: TaskKind,
        task_keys: arguments.TaskKeys,
        memory: arguments.ShardMemory | None,
        *,
        background: bool = False,
        timeout_s: float | None = None,
        fill: bool = True,
    ) -> NativeJob:
        """Hands a task to the native queue; the job is the Task's completion. ``background``
        (loads and prefetches): nobody waits on it, so the loaders do its fill's tier I/O on
        their own threads rather than on the tiers' pools, and a load's copies yield the CPU
        between batches. ``timeout_s``: longest to block on a full queue (loads and
        prefetches; default ``queue_timeout_s``; a dump's is ``dump_submit_timeout_s``).
        ``fill=False`` (loads): a shard the buffer does not hold Ready fails
        (``KeyMissingError``) rather than being read from the tiers below, and so does one
        another load is filling (it is not waited for: the load waits on no tier)."""
        if self._closed:
            raise StoreClosedError("the store is closed; open a new one with ucm.open()")
        job = NativeJob(self, kind, task_keys, memory, next(self._tags))
        job.background = background and kind is not TaskKind.DUMP
        flags = 0
        if memory is not None:
            job.addresses = memory.flat
            if memory.cuda_pairs:
                self._prepare_cuda(job, memory)
        if kind is TaskKind.DUMP:
            flags = self._dump_flags
        elif kind is TaskKind.LOAD:
            no_fill = 0 if fill else TASK_FLAG_NO_FILL | TASK_FLAG_NO_WAIT
            flags = (TASK_FLAG_BACKGROUND if background else 0) | no_fill
        with self._lock:
            self._reap()
            self._jobs[job.tag] = job
            self._order.append(job)
        try:
            job.token = self.queue.submit(
                kind,
                task_keys.ids,
                task_keys.shards,
                job.addresses,
                job.results,
                flags=flags,
                entry_flags=job.entry_flags,
                tag=job.tag,
                # A dump's caller is an engine's save call: bounded by its own, short timeout.
                timeout_s=self._settings.dump_submit_timeout_s
                if kind is TaskKind.DUMP
                else self._settings.queue_timeout_s
                if timeout_s is None
                else timeout_s,
                depth_knob="dump_queue_depth" if kind is TaskKind.DUMP else "load_queue_depth",
            )
        except BaseException:
            if memory is not None:
                arguments.release_staging(memory)
            with self._lock:
                self._jobs.pop(job.tag, None)
                # Not only the last: another thread may have queued its job since, and a job
                # that never started left in the order would stop every later one's reaping.
                if job in self._order:
                    self._order.remove(job)
            raise
        return job

    def task(self, kind: str, job: NativeJob) -> Task:
        return Task(kind, job.task_keys, job)

    def _reap(self) -> None:
        """Forgets completed jobs at the front (called under the lock, at each submit), so a
        caller that never waits does not grow the registry."""
        order = self._order
        reaped = 0
        while order and reaped < 64:
            job = order[0]
            if not job.settled:
                token = job.token
                if token is None or not self.queue.done(token):
                    return
                self._settle(job)
            order.popleft()
            self._jobs.pop(job.tag, None)
            reaped += 1

    def finalize(self, job: NativeJob) -> None:
        with self._lock:
            if not job.settled:
                self._settle(job)
            self._jobs.pop(job.tag, None)

    def _settle(self, job: NativeJob) -> None:
        try:
            job.settle()
        except BaseException as exc:  # completing must never leave the task hanging
            job.failures_seen.clear()
            job._final = {key: _as_error(exc) for key in job.keys}

    # ---- loaders ----------------------------------------------------------------------------

    def _serve(self) -> None:
        """A loader thread: takes work from the native queue (blocking, GIL released) until
        the queue stops."""
        enter_thread()
        native = self.queue
        for _ in itertools.count():
            batch = native.next_work(LOADER_IDLE_S)
            if batch is None:
                return
            if not len(batch):
                continue
            try:
                states = self._run(batch)
            except BaseException as exc:  # a report is owed for every item
                job = self._jobs.get(batch.tag)
                if job is not None:
                    for entry in batch.entries:
                        job.failures_seen[entry] = _as_error(exc)
                states = [WorkState.FAILED] * len(batch)
            native.work_done(batch, states)

    def _run(self, batch: WorkBatch) -> list[WorkState]:
        job = self._jobs[batch.tag]
        entries = list(batch.entries)
        keys = [job.keys[e] for e in entries]
        if batch.kind is WorkKind.COPY_OUT:
            return self._copy_out(job, entries, batch.addresses)
        size = self._shard_size
        if batch.kind is WorkKind.FILL:
            views: list[ShardViews] = [[_view_at(address, size)] for address in batch.addresses]
        elif job.memory is None:  # a prefetch without a buffer: promoted into the top tier
            views = [[memoryview(bytearray(size))] for _ in entries]
        else:
            assert job.memory is not None
            views = [job.memory.views[e] for e in entries]
        try:
            # A background task's reads stay on this loader: on a tier's pool they would be
            # up to io_threads more threads taking the engine's GIL in turn (issue 21).
            if job.background and self._pacer is not None:
                failures, served = self._paced_fill(self._pacer, keys, views)
            else:
                with background_work() if job.background else nullcontext():
                    failures, served = self._fill(keys, views)
        except Exception as exc:
            failures, served = {key: exc for key in keys}, [-1] * len(keys)
        states = []
        for entry, key, position in zip(entries, keys, served, strict=True):
            if position >= 0:
                # Served by the top tier: a hit of a stack without a buffer (with one, the
                # loaders start below it and never see position 0).
                states.append(WorkState.HIT if position == 0 else WorkState.READY)
                continue
            cause = failures.get(key) or KeyMissingError("not found in any tier")
            job.failures_seen[entry] = cause
            # A miss everywhere is committed as such, so waiters in other ranks raise the same
            # KeyMissingError as this one instead of a generic failure.
            missing = isinstance(cause, KeyMissingError) and batch.kind is WorkKind.FILL
            states.append(WorkState.MISSING if missing else WorkState.FAILED)
        return states

    def _paced_fill(
        self, pacer: Pacer, keys: list[Key], views: list[ShardViews]
    ) -> tuple[dict[Key, BaseException], list[int]]:
        """A background fill under ``background_read_bytes_per_s``: one shard at a time, each
        started when the process's rate allows, so a loader never holds a paced batch for
        longer than its own shards need."""
        failures: dict[Key, BaseException] = {}
        served: list[int] = []
        with background_work():
            for key, shard in zip(keys, views, strict=True):
                waited_s = pacer.take(self._shard_size)
                if waited_s > 0:
                    self._count("background_paced_shards", 1)
                    self._count("background_paced_us", max(1, round(waited_s * 1e6)))
                failed, position = self._fill([key], [shard])
                failures.update(failed)
                served.extend(position)
        return failures, served

    def _copy_out(self, job: NativeJob, entries: list[int], addresses: Any) -> list[WorkState]:
        """CUDA destinations: async host-to-device copies from the registered slot memory."""
        cuda = self._cuda
        memory = job.memory
        assert cuda is not None and memory is not None
        shards = []
        for entry, address in zip(entries, addresses, strict=True):
            pairs = memory.cuda[entry]
            assert pairs is not None
            shards.append((address, pairs))
        cuda.copy(shards)
        job.direct.update(entries)
        cuda.synchronize()  # the slot bytes must be copied before the release
        return [WorkState.READY] * len(entries)

    # ---- CUDA -------------------------------------------------------------------------------

    def _prepare_cuda(self, job: NativeJob, memory: arguments.ShardMemory) -> None:
        """CUDA destinations: copied from registered buffer memory by the loaders when the
        buffer could be registered (``cudaHostRegister``), else through the staging tensors."""
        if job.kind is TaskKind.LOAD:
            self._maybe_enable_cuda()
            if self._cuda is not None:
                job.entry_flags = bytes(
                    ENTRY_FLAG_CALLER_COPY if pairs is not None else 0 for pairs in memory.cuda
                )

            def complete(done: NativeJob) -> None:
                arguments.finish_cuda_loads(memory, done.direct)

            job.on_complete = complete
        else:  # a dump: its staging slots go back once the native queue has read them
            job.on_complete = lambda _done: arguments.release_staging(memory)

    def _maybe_enable_cuda(self) -> None:
        if self._cuda_checked:
            return
        self._cuda_checked = True
        if self._buffer is None:  # no buffer memory to copy from: the staging tensors
            return
        try:
            self._cuda = _CudaDirect(
                self._buffer.bases, self._buffer.segment_bytes, self._shard_size
            )
        except Exception as exc:  # the staging fallback (arguments.py) still works
            self._count("cuda_register_failures", 1)
            sys.stderr.write(f"ucm: CUDA host registration unavailable, staging instead: {exc}\n")

    # ---- lifetime ---------------------------------------------------------------------------

    def close(self) -> bool:
        """Finishes every task, then stops the native threads and the loaders. Returns False
        when tasks were still running after queue_timeout_s (the queue is then left alive)."""
        if self._closed:
            return True
        self._closed = True
        if self._pacer is not None:
            self._pacer.lift()  # the tasks left run at full speed: close is not paced
        drained = self.queue.drain(self._settings.queue_timeout_s)
        if not drained:
            sys.stderr.write(
                f"ucm: load tasks still running after {self._settings.queue_timeout_s} s at "
                "close; leaving the native queue running\n"
            )
            # Its loaders were not stopped and its tasks may still complete: never free it.
            self.queue.abandon()
            return False
        self.queue.stop()
        for loader in self._loaders:
            loader.join()
        with self._lock:
            for job in list(self._order):
                if not job.settled:
                    self._settle(job)
            self._order.clear()
            self._jobs.clear()
        if self._cuda is not None:
            self._cuda.close()
        return True


class Pacer:
    """Paces background reads to ``rate_bytes_per_s`` across a process's loaders: each
    :meth:`take` books the next free interval of the rate's clock and sleeps until it starts.
    An idle pacer stores no credit, so a new load never starts with a burst."""

    def __init__(self, rate_bytes_per_s: int) -> None:
        assert rate_bytes_per_s > 0
        self._rate_bytes_per_s = rate_bytes_per_s
        self._next_s = 0.0
        self._lock = threading.Lock()
        self._lifted = threading.Event()

    def take(self, nbytes: int) -> float:
        """Waits until ``nbytes`` more may be read; returns the seconds waited. Each wait is at
        most the bytes booked ahead of it (bounded by the loaders' shards in flight) over the
        rate, and ends at once when the pacer is lifted."""
        with self._lock:
            now_s = time.monotonic()
            start_s = max(now_s, self._next_s)
            self._next_s = start_s + nbytes / self._rate_bytes_per_s
        if start_s <= now_s or self._lifted.is_set():
            return 0.0
        self._lifted.wait(start_s - now_s)
        return time.monotonic() - now_s

    def lift(self) -> None:
        """Stops pacing: every wait ends now and no new one starts."""
        self._lifted.set()


def _view_at(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def _put(target: queue.Queue[Any], item: Any, timeout_s: float, what: str, knob: str) -> None:
    try:
        target.put(item, timeout=timeout_s)
    except queue.Full:
        raise TimeoutError(
            f"the {what} queue stayed full for {timeout_s} s: the rank submits faster than the "
            f"cache drains; wait for earlier tasks or raise {what}_queue_depth / {knob}"
        ) from None


REGISTER_CHUNK_BYTES = 256 << 20
"""About how much buffer memory one ``cudaHostRegister`` pins (rounded to whole slots and
pages): registration is per chunk, on first use."""


def register_chunk_bytes(slot_bytes: int, segment_bytes: int, target: int) -> int:
    """The registration chunk: a multiple of both the slot size (no slot spans two chunks)
    and the page size (no page in two registrations), about ``target`` bytes; the whole
    segment when no such multiple fits in it."""
    unit = math.lcm(slot_bytes, mmap.PAGESIZE)
    if unit >= segment_bytes:
        return segment_bytes
    return min(segment_bytes, max(unit, target // unit * unit))


class _CudaDirect:
    """Host-to-device copies straight from the buffer's data segments, registered with
    ``cudaHostRegister`` so the copies are asynchronous DMA from pinned memory. Registration
    is lazy and chunked: a chunk is registered (its pages pinned, so faulted in) by the loader
    thread that first copies from it, never the whole buffer at once on the caller's thread."""

    def __init__(self, bases: Sequence[int], segment_bytes: int, slot_bytes: int) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        self._torch = torch
        self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        self._segment_bytes = segment_bytes
        self._chunk_bytes = register_chunk_bytes(slot_bytes, segment_bytes, REGISTER_CHUNK_BYTES)
        self._segments = [
            (
                base,
                torch.frombuffer(
                    (ctypes.c_ubyte * segment_bytes).from_address(base), dtype=torch.uint8
                ),
            )
            for base in bases
        ]
        self._registered: set[int] = set()
        """Start addresses of the registered chunks."""
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self.batch = batch_copier()
        """The runtime's batched copy (CUDA 13+); None: tensor by tensor."""

    def _register(self, base: int, offset: int, nbytes: int) -> None:
        """Registers the chunks of [offset, offset + nbytes) of the segment at ``base``."""
        chunk = self._chunk_bytes
        first = offset // chunk * chunk
        for start in range(first, offset + nbytes, chunk):
            address = base + start
            if address in self._registered:
                continue
            with self._lock:
                if address in self._registered:
                    continue
                size = min(chunk, self._segment_bytes - start)
                self._torch.cuda.check_error(self._cudart.cudaHostRegister(address, size, 0))
                self._registered.add(address)

    def copy(self, shards: list[tuple[int, list[tuple[Any, Any]]]]) -> None:
        """Queues the host-to-device copies of ``shards`` (each: its slot's address and its
        (device tensor, staging view) pairs) on the copy stream: one batched runtime call for
        them all where the runtime has one, else a torch copy per tensor."""
        torch = self._torch
        copies: list[tuple[Any, Any, int, int]] = []
        """(device tensor, its segment's tensor, offset in the segment, bytes)"""
        for address, pairs in shards:
            found = [
                (base, segment)
                for base, segment in self._segments
                if base <= address < base + self._segment_bytes
            ]
            if not found:
                raise TierError(f"slot address {address:#x} is outside the registered segments")
            base, segment = found[0]
            offset = address - base
            sizes = [device_tensor.nbytes for device_tensor, _staging in pairs]
            self._register(base, offset, sum(sizes))
            for (device_tensor, _staging), nbytes in zip(pairs, sizes, strict=True):
                copies.append((device_tensor, segment, offset, nbytes))
                offset += nbytes
        if self.batch is not None:
            with torch.cuda.device(self._stream.device):
                self.batch.copy(
                    [device_tensor.data_ptr() for device_tensor, _s, _o, _n in copies],
                    [segment.data_ptr() + offset for _d, segment, offset, _n in copies],
                    [nbytes for _d, _s, _o, nbytes in copies],
                    self._stream.cuda_stream,
                )
            return
        with torch.cuda.stream(self._stream):
            for device_tensor, segment, offset, nbytes in copies:
                source = segment[offset : offset + nbytes]
                device_tensor.reshape(-1).view(torch.uint8).copy_(source, non_blocking=True)

    def synchronize(self) -> None:
        self._stream.synchronize()

    def close(self) -> None:
        with self._lock:
            for address in self._registered:
                self._cudart.cudaHostUnregister(address)
            self._registered.clear()


class DumpQueue:
    """Dumps Python follows up, on their own thread: stacks without a buffer write into the
    top tier; stacks with a buffer write it through the native queue (within the write-back
    bound when ``write: back`` tiers below need the shards). Then a snapshot goes to the
    write-through writer for every ``write: through`` tier below."""

    def __init__(
        self,
        *,
        top: Tier,
        through: list[Tier],
        count: Count,
        settings: LoadSettings,
        native: LoadPath | None = None,
        buffer: BufferTier | None = None,
        finality: Finality | None = None,
    ) -> None:
        self._top = top
        self._finality = finality if finality is not None else Finality(process_log())
        self._native = native
        self._buffer = buffer
        self._through = through
        self._count = count
        self._settings = settings
        # Only a stack with write-through tiers has a writer. Its thread runs at the lowest
        # priority, and an idle one still costs: a killed process is reaped only once all of
        # its threads have exited, and on a busy machine a nice-19 thread is the last to get
        # a CPU for that (0.02 s median with nice 0, up to 0.4 s with nice 19 beside three CPU
        # burners here, seconds with more).
        self.writer = (
            WriteQueue(
                settings.write_queue_bytes,
                count,
                settings.write_through_wait_s,
                settings.write_snapshot_idle_s,
                finality=self._finality,
            )
            if through
            else None
        )
        self._pending: queue.Queue[DumpItem | None] = queue.Queue(settings.dump_queue_depth)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ucm-dump", daemon=True)
        self._thread.start()

    def submit(self, dump: DumpItem) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed; open a new one with ucm.open()")
        # An engine's save call: never blocked past dump_submit_timeout_s.
        _put(
            self._pending,
            dump,
            self._settings.dump_submit_timeout_s,
            "dump",
            "dump_submit_timeout_s",
        )

    def drain(self) -> None:
        """Waits for every queued dump, then for the write-through backlog. Once closed,
        StoreClosedError: no thread would finish the marker."""
        if self._closed:
            raise StoreClosedError("the store is closed; open a new one with ucm.open()")
        marker = Progress([(b"\0" * 16, 0)])  # finished by the dump thread when it gets here
        self._pending.put(
            DumpItem(arguments.TaskKeys.of([]), arguments.ShardMemory(views=[]), marker)
        )
        marker.future.result(timeout=self._settings.queue_timeout_s)
        if self.writer is not None:
            self.writer.drain()

    def close(self) -> bool:
        """Finishes the queued dumps, waiting ``queue_timeout_s`` at most. Returns False when
        the dump thread was still inside a dump then (a tier that holds its write: a hung
        NFS): that dump is left running on its thread (a daemon), and the dumps queued behind
        it end with StoreClosedError. The caller must then keep what that dump may still use
        (the native queue, the buffer's mappings)."""
        if self._closed:
            return True
        self._closed = True
        timeout_s = self._settings.queue_timeout_s
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(queue.Full):  # a stuck thread takes nothing: ended below
            self._pending.put(None, timeout=timeout_s)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        finished = not self._thread.is_alive()
        # What was queued behind a stuck dump, or what a drain or submit racing this close
        # queued behind the None: ended here, so that no caller waits for a thread that has
        # gone (or that never comes back).
        closed = StoreClosedError("the store is closed; open a new one with ucm.open()")
        while True:
            try:
                item = self._pending.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item.progress.finish(item.progress.unfinished(), closed)
        if not finished:
            # The stuck thread ends once its dump returns (the queue is empty now).
            with contextlib.suppress(queue.Full):
                self._pending.put_nowait(None)
        if self.writer is not None:
            self.writer.close(timeout_s)
        return finished

    def _run(self) -> None:
        enter_thread()
        while True:
            item = self._pending.get()
            if item is None:
                return
            if not len(item.task_keys):
                item.progress.finish(range(len(item.progress.keys)))
                continue
            try:
                self._dump(item)
            except BaseException as exc:
                item.progress.finish(item.progress.unfinished(), _as_error(exc))

    def _dump(self, item: DumpItem) -> None:
        keys, memory, progress = item.task_keys.keys, item.memory, item.progress
        # Before any of the bytes land (ucm.finality): a removal after this is found below.
        since = self._finality.start()
        if self._buffer is not None:  # the buffer part, natively, straight from the addresses
            native, buffer = self._native, self._buffer
            assert native is not None

            def run(start: int, end: int) -> list[Outcome]:
                job = native.submit(
                    TaskKind.DUMP, item.task_keys.slice(start, end), memory.slice(start, end)
                )
                failures = job.failures(None)
                return [failures.get(key) for key in keys[start:end]]

            outcomes = buffer.dump_with(keys, run, lambda i: memory.views[i])
        else:
            outcomes = self._top.dump(keys, memory.views)
            # Without a buffer the top tier is a lower tier: a removal meanwhile is final.
            self._finality.settle(since, keys, forced_remove([self._top]))
        if self._through:
            # The caller may reuse its tensors once the task is done: snapshot the bytes (those
            # the backlog takes: the rest skip the write-through tiers, never waiting for them).
            # Keys the top tier refused still reach the write-through tiers: they are snapshot
            # first, and done only when the backlog takes them.
            order = [i for i, o in enumerate(outcomes) if o is not None]
            order += [i for i, o in enumerate(outcomes) if o is None]
            assert self.writer is not None  # made with the write-through tiers
            taken = self.writer.put(
                self._through, [keys[i] for i in order], [memory.views[i] for i in order], since
            )
            if taken < len(keys) and self._buffer is not None:
                # Node-wide too (the buffer's counters), for `ucm stats` and its metrics.
                self._buffer.core.count_write_through_skipped(
                    (len(keys) - taken) * len(self._through)
                )
            skipped = set(order[taken:])
            outcomes = [o if i in skipped else None for i, o in enumerate(outcomes)]
        failed = {i: o for i, o in enumerate(outcomes) if o is not None}
        if self._buffer is None and self._native is not None:
            # Into a top tier that is not the buffer: counted with the queue's counters.
            self._native.queue.count_dumps(len(keys) - len(failed), len(failed))
        progress.finish(i for i in range(len(keys)) if i not in failed)
        progress.fail(failed)


@dataclass(eq=False)
class DumpItem:
    task_keys: arguments.TaskKeys
    memory: arguments.ShardMemory
    progress: Progress


Snapshot = bytearray | mmap.mmap
"""A shard's bytes copied for the write-through writer."""

SNAPSHOT_MAPPED_BYTES_MIN = 64 * 1024
"""Snapshots from this size up get an anonymous mapping of their own, so that freeing one
returns its pages to the system at once. From the C heap, a freed buffer below glibc's
adaptive mmap threshold (raised by the first such buffer freed) stays resident: 64 MiB of
128 KiB snapshots did. ``malloc_trim`` would return them but holds the allocator's arena
locks, which the engine's threads share, for about 20 ms per 256 MiB. Below this size the
heap is kept: one mapping per small shard could exhaust ``vm.max_map_count``."""


class WriteQueue:
    """Background writer for ``write: through`` tiers, bounded in bytes. A dump never waits
    for it longer than ``wait_s``: what the backlog has no room for then skips the
    write-through tiers (counted in ``write_through_skipped``), so a slow tier never blocks
    the dump thread, nor through it an engine's save call.

    The snapshots' buffers are reused: once written, a shard's buffer goes back to a free
    list (at most ``capacity_bytes`` of them kept) for the next dump. A fresh buffer costs a
    zero fill and, on a VM, new pages: snapshotting 225 MiB (one 1,800-token prompt of the
    serving benchmark's model) took 0.17-0.20 s of the dump thread's CPU into fresh buffers
    and 0.034-0.038 s into reused ones. Kept buffers are freed once the writer has been idle
    for ``idle_s``: a burst must not hold that memory for the life of the engine."""

    def __init__(
        self,
        capacity_bytes: int,
        count: Count,
        wait_s: float = 0.0,
        idle_s: float = LoadSettings.model_fields["write_snapshot_idle_s"].default,
        *,
        finality: Finality | None = None,
    ) -> None:
        self._capacity_bytes = capacity_bytes
        self._finality = finality if finality is not None else Finality(process_log())
        self._count = count
        self._wait_s = wait_s
        self._idle_s = idle_s
        self._pending_bytes = 0
        self._free: dict[int, list[Snapshot]] = {}
        """Snapshot buffers written and given back, by size (at most capacity_bytes in all)."""
        self._free_bytes = 0
        self._releasing_bytes = 0
        """Bytes the idle trim took off the free list and is unmapping (the writer's only)."""
        self._free_lock = threading.Lock()
        self._condition = threading.Condition()
        self._queue: queue.Queue[tuple[list[Tier], list[Key], list[Snapshot], int] | None] = (
            queue.Queue()
        )
        self._thread = threading.Thread(target=self._run, name="ucm-write-through", daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    @property
    def kept_bytes(self) -> int:
        """Snapshot buffers written and kept for the next dumps (freed when idle)."""
        return self._free_bytes + self._releasing_bytes

    def put(
        self,
        tiers: list[Tier],
        keys: list[Key],
        sources: Sequence[ShardViews],
        since: int | None = None,
    ) -> int:
        """Snapshots and queues the longest prefix of the shards that fits in the backlog
        (an empty backlog takes them all), after waiting up to ``wait_s`` for room; the rest
        skip the write-through tiers. Returns how many shards were queued. ``since``: the
        removal generation read before the bytes were captured (ucm.finality; None: now)."""
        if since is None:
            since = self._finality.start()
        sizes = [sum(len(view) for view in views) for views in sources]
        deadline = time.monotonic() + self._wait_s
        with self._condition:
            # Bounded wait loop: each pass sleeps until the writer frees bytes or time is up.
            for _ in range(WRITE_WAIT_ROUNDS_MAX):
                if (
                    not self._pending_bytes
                    or self._pending_bytes + sum(sizes) <= self._capacity_bytes
                ):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._condition.wait(timeout=min(remaining, 1.0))
            taken, room = 0, self._capacity_bytes - self._pending_bytes
            if not self._pending_bytes:
                taken = len(sizes)
            else:
                for size in sizes:
                    if size > room:
                        break
                    room -= size
                    taken += 1
            self._pending_bytes += sum(sizes[:taken])
        skipped = len(keys) - taken
        if skipped:
            # One per shard and write-through tier, as write_through_shards counts.
            self._count("write_through_skipped", skipped * len(tiers))
        if taken:
            # The caller may reuse its memory once the task is done: copy the bytes now.
            data = [
                _snapshot(views, self._buffer_of(sum(memoryview(v).nbytes for v in views)))
                for views in sources[:taken]
            ]
            self._queue.put((tiers, keys[:taken], data, since))
        return taken

    def drain(self) -> None:
        with self._condition:
            for _ in range(WRITE_WAIT_ROUNDS_MAX):
                if not self._pending_bytes:
                    return
                self._condition.wait(timeout=1.0)

    def close(self, timeout_s: float | None = None) -> bool:
        """Lets the writer finish the backlog, for ``timeout_s`` at most (None: until done);
        whether it did. Past the bound, what is still queued skips the write-through tiers
        (counted in ``write_through_skipped``: a later miss there, never wrong data) and the
        write in progress goes on in the background until its tier answers or fails (the
        thread is a daemon: it never holds the process's exit up)."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            return True
        skipped = 0
        for _ in range(self._queue.qsize() + 1):  # nothing is put once closed
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                tiers, keys, data, _since = item
                skipped += len(keys) * len(tiers)
                with self._condition:
                    self._pending_bytes -= sum(len(d) for d in data)
                    self._condition.notify_all()
        self._queue.put(None)  # the writer stops after the write in progress
        self._count("write_through_skipped", skipped)
        sys.stderr.write(
            f"ucm: close left a write-through tier that did not answer within {timeout_s} s "
            f"(queue_timeout_s); {skipped} queued shard writes skipped it, one write goes on "
            "in the background\n"
        )
        return False

    def _run(self) -> None:
        # Nobody waits for these writes: the lowest priority, and the tiers' I/O on this thread.
        become_background()
        while True:
            try:
                # Sleeps without a timeout unless buffers are kept: then for idle_s at most.
                item = self._queue.get(timeout=self._idle_s if self._free_bytes else None)
            except queue.Empty:
                self._trim()
                continue
            if item is None:
                return
            tiers, keys, data, since = item
            views: list[ShardViews] = [[memoryview(d)] for d in data]
            for tier in tiers:
                # Just before the bytes land, and again once they have (ucm.finality): a key
                # that a purge or a forced remove covered since the dump is not written, or
                # is removed again.
                kept = self._finality.unremoved(since, keys)
                written_keys = [keys[i] for i in kept]
                failed = 0
                if written_keys:
                    try:
                        outcomes = tier.dump(written_keys, [views[i] for i in kept])
                        failed = sum(1 for o in outcomes if o is not None)
                    except Exception:
                        failed = len(written_keys)
                    self._finality.settle(since, written_keys, forced_remove([tier]))
                self._count("write_through_shards", len(written_keys) - failed)
                self._count("write_through_failures", failed)
            del views  # the tiers are done with them: the buffers may be written again
            self._give_back(data)
            with self._condition:
                self._pending_bytes -= sum(len(d) for d in data)
                self._condition.notify_all()

    def _trim(self) -> None:
        """Frees the kept buffers: the writer was idle for ``idle_s``. They count in
        ``kept_bytes`` until they are unmapped, not just taken off the free list."""
        with self._free_lock:
            kept, self._free = self._free, {}
            self._releasing_bytes, self._free_bytes = self._free_bytes, 0
        kept.clear()  # unmapped outside the lock: a dump may take a buffer meanwhile
        self._releasing_bytes = 0

    def _buffer_of(self, size: int) -> Snapshot:
        """A buffer of ``size`` bytes for a snapshot: a reused one, or a new one (its own
        anonymous mapping from ``SNAPSHOT_MAPPED_BYTES_MIN`` up)."""
        with self._free_lock:
            free = self._free.get(size)
            if free:
                self._free_bytes -= size
                return free.pop()
        if size < SNAPSHOT_MAPPED_BYTES_MIN:
            return bytearray(size)
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # anonymous: private, not shmem

    def _give_back(self, data: list[Snapshot]) -> None:
        with self._free_lock:
            for buffer in data:
                if self._free_bytes + len(buffer) > self._capacity_bytes:
                    return  # beyond the bound: freed
                self._free.setdefault(len(buffer), []).append(buffer)
                self._free_bytes += len(buffer)


def _snapshot(views: ShardViews, data: Snapshot) -> Snapshot:
    """``data`` (exactly their size) filled with a shard's views (``b"".join(views)``), copied
    with the GIL released: a dump thread snapshotting a prompt's KV (225 MiB for 1,800 tokens
    of the serving benchmark's model) must not hold up the engine's Python threads meanwhile."""
    assert len(data) == sum(memoryview(view).nbytes for view in views)
    offset = 0
    for view in views:
        offset += copy_into(data, offset, view)
    return data


WRITE_WAIT_ROUNDS_MAX = 600
"""Rounds (of at most one second) a dump waits for write-through room (at most
``write_through_wait_s`` in all), or ``drain`` for the backlog."""


def _as_error(exc: BaseException) -> BaseException:
    return exc if isinstance(exc, Exception) else TierError(f"interrupted: {exc!r}")


__all__ = [
    "DumpQueue",
    "Fill",
    "LoadPath",
    "NativeJob",
    "Pacer",
    "WriteQueue",
]
