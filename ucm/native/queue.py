"""Typed binding to the native per-rank load queue (``core-native/src/queue.zig``).

One :class:`NativeQueue` per worker process and stack: over the stack's buffer, or over a *null
buffer* for a stack without one (every key is BYPASS work: a loader loads it from the tiers
into its destination; no dumps). A task goes in with one call
(:meth:`NativeQueue.submit`); native threads then do the per-shard work: batched Get in
RearrangeIndex order, copies of hits on ``copy_threads`` threads (the C library's memcpy, GIL
released), futex waits on slots other ranks fill, releases, Prealloc in the idle window, and the
buffer part of dumps. Keys this rank owns go to the caller's *loaders* — Python threads calling
:meth:`NativeQueue.next_work` (it blocks with the GIL released) — which fill the slot from the
tiers below and report with :meth:`NativeQueue.work_done`. A task's completion is a futex word:
:meth:`NativeQueue.wait` blocks on it, :meth:`NativeQueue.done` reads it; nothing polls.

The arrays handed to :meth:`submit` (keys, caller addresses, the results bytearray) are read and
written by native threads until the task completes: the caller keeps them alive until then
(:class:`NativeTask` does).
"""

from __future__ import annotations

import ctypes
import threading
import time
import weakref
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import LoadSettings
from ..errors import InvalidArgumentError, StoreClosedError, UcmError
from ..layout import BLOCK_ID_BYTES, Key
from . import _abi, lib
from .buffer import SLOT_NONE, BufferCore, DirtyBatch

COUNTER_NAMES = _abi.QUEUE_COUNTER_NAMES
"""Counter order of ``ucm_queue_stats`` (``queue.counter_names`` in queue.zig)."""

# Limits, enums and flags: generated from the Zig sources (``_abi.py``), never copied by hand.
COPY_THREADS_MAX = _abi.QUEUE_COPY_THREADS_MAX
STEP_KEYS_MAX = _abi.QUEUE_STEP_KEYS_MAX
FILL_PARTS_MAX = _abi.QUEUE_FILL_PARTS_MAX
LANE_DEPTH_MAX = _abi.QUEUE_LANE_DEPTH_MAX
TASK_KEYS_MAX = _abi.QUEUE_TASK_KEYS_MAX
TENSORS_MAX = _abi.QUEUE_TENSORS_MAX
LOCAL_RANK_SIZE_MAX = _abi.QUEUE_LOCAL_RANK_SIZE_MAX
WORK_BATCH_MAX = _abi.QUEUE_WORK_BATCH_MAX
"""Most items one ``next_work`` call returns (the export's per-call buffer)."""

TaskKind = _abi.TaskKind
EntryResult = _abi.EntryResult
"""Final per-entry code (``CALLER_FAILED``: a loader reported a failure; the caller recorded
why)."""
WorkKind = _abi.WorkKind
"""``FILL``: fill the slot owned here from the tiers below; ``BYPASS``: load the entry from the
tiers straight into its destination (no slot); ``COPY_OUT``: copy the Ready slot into the
entry's destination (a caller copy)."""
WorkState = _abi.WorkState
"""A loader's report; ``HIT`` (null buffer, BYPASS only): served by the top tier."""

TASK_FLAG_DIRTY = _abi.TASK_FLAG_DIRTY
"""Dump: commit the slots dirty (write-back debt)."""
TASK_FLAG_NO_FILL = _abi.TASK_FLAG_NO_FILL
"""Load: nothing below the buffer; a key not Ready here is a miss (one another load is filling
is waited for, unless ``TASK_FLAG_NO_WAIT``)."""
TASK_FLAG_NO_WAIT = _abi.TASK_FLAG_NO_WAIT
"""Load, with ``TASK_FLAG_NO_FILL`` only: a key another load is filling is a miss at once, not
waited for (the load waits on no tier)."""
TASK_FLAG_BACKGROUND = _abi.TASK_FLAG_BACKGROUND
"""Load: nobody waits on it; its copies yield the CPU between batches, as dumps' do."""
ENTRY_FLAG_CALLER_COPY = _abi.ENTRY_FLAG_CALLER_COPY
"""The entry's destination is copied by the caller (a CUDA tensor): ``COPY_OUT`` work."""
_SETTINGS_FLAG_PREALLOC = _abi.SETTINGS_FLAG_PREALLOC
_SETTINGS_FLAG_REARRANGE = _abi.SETTINGS_FLAG_REARRANGE

_Status = _abi.QueueStatus
_OK, _INVALID, _FULL = _Status.OK, _Status.INVALID_ARGUMENT, _Status.FULL
_CLOSED, _WRONG_PROCESS, _NO_MEMORY = _Status.CLOSED, _Status.WRONG_PROCESS, _Status.OUT_OF_MEMORY
_WAIT_FOREVER_NS = 2**63
_WAIT_SLICE_NS = 500_000_000
"""Longest one native wait of :meth:`NativeQueue.wait` (it waits in slices): a thread waiting
past :meth:`NativeQueue.destroy` leaves the queue within this, before it is freed."""

_Settings = _abi.Settings


def _address(values: array[int] | bytearray | bytes | None) -> int | None:
    if values is None:
        return None
    if isinstance(values, array):
        return values.buffer_info()[0] if len(values) else None
    if not values:
        return None
    if isinstance(values, bytes):
        return ctypes.cast(ctypes.c_char_p(values), ctypes.c_void_p).value
    return ctypes.addressof(ctypes.c_char.from_buffer(values))


@dataclass
class WorkBatch:
    """Items of one task and kind a loader took (echoed back to :meth:`work_done`)."""

    tag: int
    kind: WorkKind
    tokens: array[int]
    entries: array[int]
    slots: array[int]
    steps: array[int]
    addresses: array[int]
    """Slot address per item (0 for BYPASS)."""
    kinds: array[int]

    def __len__(self) -> int:
        return len(self.entries)


class NativeQueue:
    """The native load queue of this process over one buffer, or over none (``core`` None: a
    stack without a buffer; see the module docstring)."""

    def __init__(
        self,
        core: BufferCore | None,
        segment_bases: Sequence[int],
        settings: LoadSettings,
        *,
        device_id: int,
        local_rank_size: int,
        shards_per_block: int,
        tensor_sizes: Sequence[int],
        region_handle: int = 0,
        keepalive: object = None,
    ) -> None:
        tensor_sizes = tuple(tensor_sizes)
        _check_rank(device_id, local_rank_size, shards_per_block, tensor_sizes, settings)
        self.buffered = core is not None
        segment_count = core.geometry.segment_count if core is not None else 0
        if len(segment_bases) != segment_count or not all(segment_bases):
            raise InvalidArgumentError(
                f"segment_bases has {len(segment_bases)} entries: expected the "
                f"{segment_count} non-zero segment addresses of a worker's mapping"
            )
        if core is not None and sum(tensor_sizes) != core.geometry.shard_size_bytes:
            raise InvalidArgumentError(
                f"tensor_sizes={list(tensor_sizes)} sum to "
                f"{sum(tensor_sizes)} bytes, not shard_size_bytes="
                f"{core.geometry.shard_size_bytes}"
            )
        self.settings = settings
        # The mappings the native threads touch (the SharedRegion): never finalized (unmapped)
        # before this queue, whatever order the garbage collector picks.
        self._keepalive = keepalive
        self.tensor_count = len(tensor_sizes)
        self._native = lib()
        flags = (_SETTINGS_FLAG_PREALLOC if settings.prealloc else 0) | (
            _SETTINGS_FLAG_REARRANGE if settings.rearrange else 0
        )
        raw = _Settings(
            sum(tensor_sizes),
            int(settings.wait_timeout_s * 1e9),
            device_id,
            local_rank_size,
            shards_per_block,
            self.tensor_count,
            settings.step_keys,
            settings.copy_threads,
            settings.load_workers,
            settings.load_queue_depth,
            settings.dump_queue_depth,
            flags,
        )
        bases = array("Q", segment_bases)
        sizes = array("Q", tensor_sizes)
        handle = ctypes.c_size_t(0)
        status = self._native.ucm_queue_create(
            core.ctrl_address if core is not None else 0,
            core.holder if core is not None else 0,
            region_handle,
            bases.buffer_info()[0] if len(bases) else None,
            len(bases),
            ctypes.byref(raw),
            sizes.buffer_info()[0],
            ctypes.byref(handle),
        )
        if status == _NO_MEMORY:
            raise UcmError("cannot create the native load queue: out of memory or threads")
        if status != _OK:
            raise InvalidArgumentError(f"the native load queue refused its settings ({status})")
        self._handle = int(handle.value)
        # At the interpreter's exit (or if this object goes without destroy()), the native
        # threads stop first: the finalizer of the mappings they read (the SharedRegion's,
        # created before this one, so run after it) unmaps them, and a dispatcher waiting on
        # a slot then read unmapped memory (SIGSEGV at exit).
        self._stop_at_exit = weakref.finalize(self, self._native.ucm_queue_stop, self._handle)
        self._stopped = False
        self._destroyed = False
        # Threads inside the native wait/done (destroy waits for them: they read the queue).
        self._callers = 0
        self._callers_left = threading.Condition()
        self._freeing = False
        self._abandoned = False
        # Bound once: these sit on every task's path.
        self._submit = self._native.ucm_queue_submit
        self._done = self._native.ucm_queue_done
        self._wait = self._native.ucm_queue_wait
        self._dirty_cursor = ctypes.c_uint32(0)

    @property
    def handle(self) -> int:
        return self._handle

    # -- tasks -----------------------------------------------------------------------------

    def submit(
        self,
        kind: TaskKind,
        ids: bytes,
        shards: array[int],
        addresses: array[int] | None,
        results: bytearray,
        *,
        flags: int = 0,
        entry_flags: bytes | None = None,
        tag: int = 0,
        timeout_s: float = 60.0,
        depth_knob: str = "load_queue_depth",
    ) -> int:
        """Hands a task over; returns its token. ``addresses`` holds ``tensor_count`` caller
        addresses per key (destinations of a load, sources of a dump; None for a prefetch),
        ``results`` one byte per key that the queue fills with :class:`EntryResult` codes."""
        n = len(shards)
        # One out-parameter per call: ctypes releases the GIL during the call, so threads that
        # submit at once (the runtime's and the DumpQueue's) must not share one.
        token = ctypes.c_uint64(0)
        status = self._submit(
            self._handle,
            int(kind),
            flags,
            n,
            ids,
            _address(shards),
            _address(addresses),
            _address(entry_flags),
            _address(results),
            tag,
            int(timeout_s * 1e9),
            ctypes.byref(token),
        )
        if status == _OK:
            return token.value
        if status == _FULL:
            raise TimeoutError(
                f"the {kind.name.lower()} queue stayed full for "
                f"{timeout_s} s: the rank submits faster than the cache drains; wait for earlier "
                f"tasks or raise {depth_knob} / queue_timeout_s"
            )
        if status == _CLOSED:
            raise StoreClosedError("the store is closed; open a new one with ucm.open()")
        self._raise(status, "submit")
        raise AssertionError  # unreachable

    def done(self, token: int) -> bool:
        """Whether the task completed (True once the queue is being freed: see :meth:`wait`)."""
        if not self._enter():
            return True
        try:
            status = self._done(self._handle, token)
        finally:
            self._leave()
        if status < 0:
            self._raise(status, "done")
        return bool(status)

    def wait(self, token: int, timeout_s: float | None) -> bool:
        """Blocks (futex, GIL released) until the task completes; False on timeout. True also
        once the queue is being freed (:meth:`destroy`, after a close): its threads are stopped,
        so the task is complete or never will be (its unfinished entries read as failed)."""
        deadline_ns = None
        if timeout_s is not None and timeout_s * 1e9 < _WAIT_FOREVER_NS:  # inf and NaN: forever
            deadline_ns = time.monotonic_ns() + max(0, int(timeout_s * 1e9))
        if not self._enter():
            return True
        try:
            # In slices, so that destroy() never frees the queue under this thread.
            while True:
                slice_ns = _WAIT_SLICE_NS
                if deadline_ns is not None:
                    slice_ns = max(0, min(slice_ns, deadline_ns - time.monotonic_ns()))
                status = self._wait(self._handle, token, slice_ns)
                if status < 0:
                    self._raise(status, "wait")
                if status:
                    return True
                if deadline_ns is not None and time.monotonic_ns() >= deadline_ns:
                    return False
                if self._freeing:
                    return True
        finally:
            self._leave()

    def _enter(self) -> bool:
        """Counts a thread in (False: the queue is being freed; touch nothing)."""
        with self._callers_left:
            if self._freeing:
                return False
            self._callers += 1
            return True

    def _leave(self) -> None:
        with self._callers_left:
            self._callers -= 1
            if not self._callers:
                self._callers_left.notify_all()

    # -- loaders -----------------------------------------------------------------------------

    def next_work(self, timeout_s: float, capacity: int = WORK_BATCH_MAX) -> WorkBatch | None:
        """One batch of work (blocks with the GIL released); an empty batch on timeout, None
        once the queue stopped."""
        capacity = max(1, min(capacity, WORK_BATCH_MAX))
        tags = array("Q", bytes(8 * capacity))
        tokens = array("Q", bytes(8 * capacity))
        entries = array("I", bytes(4 * capacity))
        slots = array("I", bytes(4 * capacity))
        steps = array("I", bytes(4 * capacity))
        addresses = array("Q", bytes(8 * capacity))
        kinds = array("B", bytes(capacity))
        count = self._native.ucm_queue_next_work(
            self._handle,
            int(timeout_s * 1e9),
            capacity,
            tags.buffer_info()[0],
            tokens.buffer_info()[0],
            entries.buffer_info()[0],
            slots.buffer_info()[0],
            steps.buffer_info()[0],
            addresses.buffer_info()[0],
            kinds.buffer_info()[0],
        )
        if count == _CLOSED:
            return None
        if count < 0:
            self._raise(count, "next_work")
        for values in (tokens, entries, slots, steps, addresses, kinds):
            del values[count:]
        tag = tags[0] if count else 0
        kind = WorkKind(kinds[0]) if count else WorkKind.FILL
        return WorkBatch(tag, kind, tokens, entries, slots, steps, addresses, kinds)

    def work_done(self, batch: WorkBatch, states: Sequence[WorkState]) -> int:
        """Reports a batch: one state per item. Returns how many reports were applied (items
        not handed out, or reported twice, are refused)."""
        if len(states) != len(batch):
            raise InvalidArgumentError(
                f"states has {len(states)} entries, the batch {len(batch)}: one per item"
            )
        if not len(batch):
            return 0
        codes = array("B", [int(state) for state in states])
        applied = int(
            self._native.ucm_queue_work_done(
                self._handle,
                len(batch),
                batch.tokens.buffer_info()[0],
                batch.entries.buffer_info()[0],
                batch.slots.buffer_info()[0],
                batch.steps.buffer_info()[0],
                batch.kinds.buffer_info()[0],
                codes.buffer_info()[0],
            )
        )
        if applied < 0:
            self._raise(applied, "work_done")
        return applied

    def count_dumps(self, dumped: int, failed: int) -> None:
        """A stack without a buffer: counts the dumps written into its top tier (Python does
        that) in the queue's counters, the stack's one set."""
        status = self._native.ucm_queue_count_dumps(self._handle, dumped, failed)
        if status < 0:
            self._raise(status, "count_dumps")

    # -- write-back flushers ------------------------------------------------------------------

    def take_dirty(self, capacity: int) -> DirtyBatch:
        """Claims up to ``capacity`` dirty slots for writing down (``BufferCore.take_dirty``,
        with this process's references counted by the queue, so its loads of the same keys see
        them held). Release them with :meth:`release` after ``BufferCore.clean``."""
        capacity = max(1, min(capacity, STEP_KEYS_MAX))
        slots = array("I", bytes(4 * capacity))
        shards = array("I", bytes(4 * capacity))
        ids = ctypes.create_string_buffer(BLOCK_ID_BYTES * capacity)
        taken = int(
            self._native.ucm_queue_take_dirty(
                self._handle,
                ctypes.byref(self._dirty_cursor),
                capacity,
                slots.buffer_info()[0],
                ctypes.addressof(ids),
                shards.buffer_info()[0],
            )
        )
        if taken < 0:
            self._raise(taken, "take_dirty")
        raw = ids.raw
        keys = [
            (raw[i * BLOCK_ID_BYTES : (i + 1) * BLOCK_ID_BYTES], shards[i]) for i in range(taken)
        ]
        return DirtyBatch(slots[:taken], keys)

    def take_admitted(
        self,
        keys: Sequence[Key],
        *,
        reuses_min: int,
        tier: int,
        mature: bool = False,
        needs_mature: bool = False,
    ) -> DirtyBatch:
        """Admission (``Buffer.admit``): the keys Ready in the buffer that meet the rule and
        were not yet admitted to lower tier ``tier`` (its admission index, 0..7) are marked
        admitted node-wide and held for this process to write down; release them with
        :meth:`release`. ``mature``: this is the tier's residency check (mark the keys matured
        first); ``needs_mature``: admit only matured keys. Never counts a use."""
        slots_out = array("I")
        taken: list[Key] = []
        for start in range(0, len(keys), STEP_KEYS_MAX):
            part = keys[start : start + STEP_KEYS_MAX]
            ids = b"".join(block_id for block_id, _ in part)
            shards = array("I", [shard for _, shard in part])
            out = array("I", bytes(4 * len(part)))
            admitted = self._native.ucm_queue_take_admitted(
                self._handle,
                len(part),
                ids,
                shards.buffer_info()[0],
                reuses_min,
                tier,
                mature,
                needs_mature,
                out.buffer_info()[0],
            )
            if admitted < 0:
                self.release(slots_out)
                self._raise(admitted, "take_admitted")
            for key, slot in zip(part, out, strict=True):
                if slot != SLOT_NONE:
                    slots_out.append(slot)
                    taken.append(key)
        return DirtyBatch(slots_out, taken)

    def unadmit(self, slots: array[int], tier: int) -> int:
        """Undoes :meth:`take_admitted` for ``slots`` (taken by it, not yet released) whose
        write to lower tier ``tier`` failed: their admitted bit is cleared, so a later check
        admits them again (else admission, exactly once, would never retry them). Returns how
        many bits were cleared."""
        cleared = 0
        for start in range(0, len(slots), STEP_KEYS_MAX):
            part = array("I", slots[start : start + STEP_KEYS_MAX])
            status = self._native.ucm_queue_unadmit(
                self._handle, len(part), part.buffer_info()[0], tier
            )
            if status < 0:
                self._raise(status, "unadmit")
            cleared += status
        return cleared

    def release(self, slots: array[int]) -> None:
        """Drops references taken by :meth:`take_dirty`."""
        if not slots:
            return
        scratch = array("I", slots)  # reordered by the native side
        status = self._native.ucm_queue_release(
            self._handle, len(scratch), scratch.buffer_info()[0]
        )
        if status < 0:
            self._raise(status, "release")

    # -- pins ----------------------------------------------------------------------------------

    def pin(self, ids: bytes, shards: array[int]) -> array[int]:
        """Holds this process's reference on each key Ready in the buffer (16-byte ids
        concatenated, one shard index each), so that no eviction takes it, until
        :meth:`unpin`. Returns one slot per key, ``SLOT_NONE`` where nothing is held (the key
        is not Ready here: a pin never allocates a slot nor starts a load)."""
        count = len(shards)
        if len(ids) != BLOCK_ID_BYTES * count:
            raise InvalidArgumentError(
                f"ids has {len(ids)} bytes: expected {BLOCK_ID_BYTES} per key, {count} keys"
            )
        slots = array("I", bytes(4 * count))
        for start in range(0, count, STEP_KEYS_MAX):
            end = min(count, start + STEP_KEYS_MAX)
            part = array("I", shards[start:end])
            out = array("I", bytes(4 * (end - start)))
            pinned = self._native.ucm_queue_pin(
                self._handle,
                end - start,
                ids[start * BLOCK_ID_BYTES : end * BLOCK_ID_BYTES],
                part.buffer_info()[0],
                out.buffer_info()[0],
            )
            if pinned < 0:
                self.unpin(array("I", [s for s in slots[:start] if s != SLOT_NONE]))
                self._raise(pinned, "pin")
            slots[start:end] = out
        return slots

    def unpin(self, slots: array[int]) -> None:
        """Drops pins taken with :meth:`pin` (its slots, ``SLOT_NONE`` left out)."""
        for start in range(0, len(slots), STEP_KEYS_MAX):
            scratch = array("I", slots[start : start + STEP_KEYS_MAX])  # reordered natively
            status = self._native.ucm_queue_unpin(
                self._handle, len(scratch), scratch.buffer_info()[0]
            )
            if status < 0:
                self._raise(status, "unpin")

    # -- lifetime ----------------------------------------------------------------------------

    def drain(self, timeout_s: float) -> bool:
        """Refuses new tasks and waits until every submitted task completed."""
        if self._stopped:
            return True
        status = self._native.ucm_queue_drain(self._handle, int(timeout_s * 1e9))
        if status < 0:
            self._raise(status, "drain")
        return bool(status)

    def stop(self) -> None:
        """Stops the native threads; :meth:`next_work` then returns None. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._native.ucm_queue_stop(self._handle)

    def abandon(self) -> None:
        """Marks the queue as never to be freed: its tasks outlived the close, so native
        threads, loaders or waiters may still use it (and the mappings it copies between).
        :meth:`destroy` then does nothing; at the process's exit its threads are stopped
        before the mappings go, and the exit reclaims the rest."""
        self._abandoned = True

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def destroy(self) -> None:
        """Frees the queue. Only once no loader can call in any more (they saw None); an
        abandoned queue is left alone."""
        if self._destroyed or self._abandoned:
            return
        self.stop()
        with self._callers_left:  # each leaves within one wait slice: the threads are stopped
            self._freeing = True
            self._callers_left.wait_for(lambda: not self._callers)
        self._destroyed = True
        self._stop_at_exit.detach()  # the handle is freed below
        self._native.ucm_queue_destroy(self._handle)

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def stats(self) -> dict[str, int]:
        """The queue's counters, plus ``held_slots``: slots this process holds through it."""
        if self._destroyed:
            raise UcmError("the native load queue is closed")
        out = array("Q", bytes(8 * len(COUNTER_NAMES)))
        held = ctypes.c_uint32(0)
        count = self._native.ucm_queue_stats(
            self._handle, out.buffer_info()[0], len(COUNTER_NAMES), ctypes.byref(held)
        )
        assert count == len(COUNTER_NAMES), count
        return {**dict(zip(COUNTER_NAMES, out, strict=True)), "held_slots": held.value}

    def _raise(self, status: int, operation: str) -> None:
        if status == _WRONG_PROCESS:
            raise UcmError(
                f"{operation}: this store's load queue belongs to the process that opened it; "
                "a forked child must open its own store with ucm.open()"
            )
        raise InvalidArgumentError(f"{operation}: the native load queue refused the call")


def walk_order(n: int, device_id: int, local_rank_size: int, rearrange: bool = True) -> list[int]:
    """The order in which a rank's dispatcher walks a task of ``n`` entries: RearrangeIndex
    (seed 3.1; ``device_id % local_rank_size``'s stride first, then the others in rotation),
    or natural order with ``rearrange=False`` (the benchmarks' baseline). Asked of the native
    queue, which holds the one implementation (``walk_order`` in queue.zig)."""
    for name, value, low, high in (
        ("n", n, 0, TASK_KEYS_MAX),
        ("local_rank_size", local_rank_size, 1, LOCAL_RANK_SIZE_MAX),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise InvalidArgumentError(
                f"{name}={value!r} is not valid: expected an integer in [{low}, {high}]"
            )
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise InvalidArgumentError(
            f"device_id={device_id!r} is not valid: expected an integer >= 0"
        )
    out = array("I", bytes(4 * n))
    # The stride start depends on device_id % local_rank_size only: reduce it to fit a u32.
    count = lib().ucm_queue_walk_order(
        n,
        device_id % local_rank_size,
        local_rank_size,
        int(rearrange),
        out.buffer_info()[0] if n else None,
    )
    if count != n:
        raise InvalidArgumentError(f"the native queue refused walk_order({n}, ...) ({count})")
    return out.tolist()


def _check_rank(
    device_id: int,
    local_rank_size: int,
    shards_per_block: int,
    tensor_sizes: tuple[int, ...],
    settings: LoadSettings,
) -> None:
    """The rank and geometry a queue runs with (the tunables are ``LoadSettings``, validated by
    pydantic against the same limits)."""
    bounds: tuple[tuple[str, int, int, int], ...] = (
        ("device_id", device_id, 0, 2**31 - 1),
        ("local_rank_size", local_rank_size, 1, LOCAL_RANK_SIZE_MAX),
        ("shards_per_block", shards_per_block, 1, 2**32 - 1),
    )
    for name, value, low, high in bounds:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise InvalidArgumentError(
                f"{name}={value!r} is not valid: expected an integer in [{low}, {high}]"
            )
    for name, depth in (
        ("load_queue_depth", settings.load_queue_depth),
        ("dump_queue_depth", settings.dump_queue_depth),
    ):
        if not 1 <= depth <= LANE_DEPTH_MAX:
            raise InvalidArgumentError(
                f"{name}={depth!r} is not valid: expected an integer in [1, {LANE_DEPTH_MAX}]"
            )
    if not 1 <= len(tensor_sizes) <= TENSORS_MAX or not all(size > 0 for size in tensor_sizes):
        raise InvalidArgumentError(
            f"tensor_sizes has {len(tensor_sizes)} entries: expected 1 to {TENSORS_MAX} sizes > 0"
        )


__all__ = [
    "ENTRY_FLAG_CALLER_COPY",
    "TASK_FLAG_DIRTY",
    "TASK_FLAG_NO_FILL",
    "TASK_FLAG_NO_WAIT",
    "EntryResult",
    "NativeQueue",
    "TaskKind",
    "WorkBatch",
    "WorkKind",
    "WorkState",
    "walk_order",
]
