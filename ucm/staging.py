"""Pinned host staging for CUDA tensors passed to ``store.load`` / ``store.dump``.

A CUDA shard the native queue cannot copy itself (every dump, and loads when the buffer's
memory could not be registered) goes through one **slot** of a fixed ring of pinned host
memory, one shard per slot, per shard size and process:

- **dumps**: the shard's device-to-host copies are queued on a side stream (after the caller's
  stream, so they see what the forward pass wrote), one CUDA event is recorded for the task,
  and the task waits on that event only (never ``torch.cuda.synchronize()`` of the device, no
  synchronous copy per tensor) before the native queue reads the slots; the slots go back to
  the ring when the dump task completes.
- **loads**: the shard lands in its slot; when the task completes, the host-to-device copies of
  the whole task are queued on the side stream and the task waits on their event (again: not
  the device), then the slots go back.

**Back-pressure**: a task takes all its slots at once. A load that finds too few free waits up
to ``wait_s`` for completed tasks to return theirs; a dump does not wait (a save never holds
the forward pass back). Past that, :class:`StagingFullError` (a :class:`~ucm.errors.TierError`:
the vLLM connector counts the save as failed; a load not done is recomputed). A task needing
more slots than the ring has fails at once, naming both.

:class:`SlotRing` is the bookkeeping (no CUDA: unit-tested on the CPU); :class:`CudaStaging`
adds the pinned memory (allocated per slot on first use, so nothing is pinned up front), the
side stream and the events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from .cudart import batch_copier
from .errors import TierError

STAGING_SLOTS = 256
"""Slots per ring (one shard each): a task of more shards than this cannot be staged."""
STAGING_WAIT_S = 5.0
"""Longest a task waits for free slots before it fails (back-pressure)."""


class StagingFullError(TierError):
    """No staging slots for a CUDA task within the bounded wait."""


class SlotRing:
    """``capacity`` slots, each free or held by one task. :meth:`acquire` takes ``count``
    slots at once (bounded wait), :meth:`release` gives them back. Counters: ``acquired`` and
    ``released`` slots, ``waits`` (acquires that found too few free slots), ``timeouts``
    (acquires that gave up), ``high_water`` (most slots held at once)."""

    def __init__(self, capacity: int, wait_s: float) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: a ring has at least one slot")
        self.capacity = capacity
        self.wait_s = wait_s
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._held: set[int] = set()
        self._cond = threading.Condition()
        self.acquired = 0
        self.released = 0
        self.waits = 0
        self.timeouts = 0
        self.high_water = 0

    @property
    def free(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, count: int, wait_s: float | None = None) -> list[int]:
        """``count`` distinct slots, lowest first. Waits up to ``wait_s`` (the ring's by
        default) for enough of them to be free; :class:`StagingFullError` past it."""
        if count > self.capacity:
            raise StagingFullError(
                f"a task of {count} CUDA shards needs {count} staging slots but the ring has "
                f"{self.capacity}; submit at most {self.capacity} CUDA shards per task"
            )
        if count <= 0:
            return []
        limit = self.wait_s if wait_s is None else wait_s
        with self._cond:
            if len(self._free) < count:
                self.waits += 1
                deadline = time.monotonic() + limit
                # Bounded: each pass waits until the deadline or a release.
                while len(self._free) < count:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.timeouts += 1
                        raise StagingFullError(
                            f"no {count} free CUDA staging slots within {limit} s "
                            f"({len(self._free)} of {self.capacity} free): earlier tasks still "
                            "hold them; wait for them or submit fewer shards"
                        )
                    self._cond.wait(left)
            slots = [self._free.pop() for _ in range(count)]
            self._held.update(slots)
            self.acquired += count
            self.high_water = max(self.high_water, len(self._held))
            return slots

    def release(self, slots: Sequence[int]) -> None:
        """Gives slots back (each exactly once: a slot not held is a bug and raises)."""
        if not slots:
            return
        with self._cond:
            for slot in slots:
                if slot not in self._held:
                    raise ValueError(f"slot {slot} is not held: released twice?")
            for slot in slots:
                self._held.discard(slot)
                self._free.append(slot)
            self._free.sort(reverse=True)  # lowest first: reuse the slots already pinned
            self.released += len(slots)
            self._cond.notify_all()


class StagedTask:
    """The slots one task holds; :meth:`release` returns them once (idempotent), whichever
    of completion or a failed submit gets there first."""

    __slots__ = ("_lock", "_ring", "slots")

    def __init__(self, ring: SlotRing, slots: list[int]) -> None:
        self._ring = ring
        self.slots = slots
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            slots, self.slots = self.slots, []
        self._ring.release(slots)


class CudaStaging:
    """A :class:`SlotRing` of ``slot_bytes`` pinned host slots with a side stream (CUDA)."""

    def __init__(self, slot_bytes: int, slots: int = STAGING_SLOTS, wait_s: float = STAGING_WAIT_S):
        import torch

        self._torch = torch
        self.slot_bytes = slot_bytes
        self.ring = SlotRing(slots, wait_s)
        self._memory: dict[int, Any] = {}
        self._memory_lock = threading.Lock()
        self._stream: Any = None
        self.batch = batch_copier()
        """The runtime's batched copy (CUDA 13+); None: a torch copy per tensor."""

    def slot(self, index: int) -> Any:
        """Slot ``index``'s pinned uint8 tensor, allocated on first use."""
        memory = self._memory.get(index)
        if memory is None:
            with self._memory_lock:
                memory = self._memory.get(index)
                if memory is None:
                    memory = self._torch.empty(
                        self.slot_bytes, dtype=self._torch.uint8, pin_memory=True
                    )
                    self._memory[index] = memory
        return memory

    @property
    def stream(self) -> Any:
        if self._stream is None:
            self._stream = self._torch.cuda.Stream()  # type: ignore[no-untyped-call]
        return self._stream

    def to_host(self, pairs: Sequence[tuple[Any, Any]]) -> None:
        """Copies each (device tensor, host slot view) pair to the host on the side stream,
        after the work already queued on the caller's stream, and waits for that copy's event
        only."""
        self._copy(pairs, to_host=True)

    def to_device(self, pairs: Sequence[tuple[Any, Any]]) -> None:
        """Copies each (device tensor, host slot view) pair to the device on the side stream
        and waits for that copy's event only."""
        self._copy(pairs, to_host=False)

    def _copy(self, pairs: Sequence[tuple[Any, Any]], to_host: bool) -> None:
        torch = self._torch
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if self.batch is not None:
                devices = [device.data_ptr() for device, _host in pairs]
                hosts = [host.data_ptr() for _device, host in pairs]
                self.batch.copy(
                    hosts if to_host else devices,
                    devices if to_host else hosts,
                    [host.nbytes for _device, host in pairs],
                    stream.cuda_stream,
                )
            else:
                for device_tensor, host in pairs:
                    flat = device_tensor.reshape(-1).view(torch.uint8)
                    if to_host:
                        host.copy_(flat, non_blocking=True)
                    else:
                        flat.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        event.synchronize()


_STAGING: dict[int, CudaStaging] = {}
_STAGING_LOCK = threading.Lock()


def cuda_staging(slot_bytes: int) -> CudaStaging:
    """The process's staging ring for shards of ``slot_bytes`` (made on first use)."""
    with _STAGING_LOCK:
        staging = _STAGING.get(slot_bytes)
        if staging is None:
            staging = _STAGING[slot_bytes] = CudaStaging(slot_bytes)
        return staging
