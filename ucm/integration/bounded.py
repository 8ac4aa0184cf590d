"""Loads an engine waits on, bounded by a deadline: SGLang's and LMCache's gets.

SGLang (``batch_get_v1``, ``batch_get``) and LMCache (``get_blocking``, the prefetch of an
asynchronous look-up) wait for each get to finish. A tier that answered the look-up and then
stalls (a black-holed S3, a hung NFS) would hold that get for the tier's own request deadline:
up to 106 s for S3 at the defaults. :class:`BoundedLoads` returns by the load deadline instead,
and **never writes the engine's memory after it returned**: a page that did not arrive in time
is a failed page (the engine recomputes it), and bytes that arrive later land in UCM's memory
only.

- **Through the CacheBuffer** (a stack with one): the blocks the buffer holds whole are pinned
  (no eviction can take them); the others are moved up into it (:meth:`~ucm.Store.prefetch`),
  waited for until the deadline, and pinned too; then what the pins hold is copied into the
  engine's memory, a memcpy that no tier can stall. This is the vLLM connector's asynchronous
  load, done synchronously. A hit costs a pin, the copy and an unpin.
- **Through staging memory** (a stack without a buffer, or blocks the prefetch could not place
  in the buffer, such as a full one): the shards are loaded into private memory, waited for
  until the deadline, and copied into the engine's memory only if they arrived in time (one
  native call for all of them, :func:`~ucm.native.copy.copy_ranges`). Staging
  memory of a load that ran late is kept until that load is over, so a late write lands in it.

A block absent from every tier is not read twice: the prefetch's miss fails it at once.
The vLLM connector has its own, asynchronous loads (``ucm_load_deadline_s`` in
``docs/vllm.md``); this module shares their deadline's bounds and default, and its staging
memory (:class:`Staging`, :func:`keep_late`) serves their *direct* loads (no CacheBuffer).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .. import Store, Task, TaskError, arguments
from ..errors import ConfigError, KeyMissingError, UcmError
from ..layout import Layout
from ..native.copy import copy_ranges

logger = logging.getLogger(__name__)

LOAD_DEADLINE_S_DEFAULT = 10.0
"""Seconds a load may take, by default (every engine)."""
LOAD_DEADLINE_S_MAX = 3600.0


def check_load_deadline_s(
    value: object, key: str, default: float = LOAD_DEADLINE_S_DEFAULT
) -> float:
    """A load (or set) deadline from an engine's config (``key`` names where it was given;
    ``default`` is the one its error message names)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value <= LOAD_DEADLINE_S_MAX  # NaN fails it too
    ):
        raise ConfigError(
            f"{key}: {value!r} is not valid: expected a number of seconds in "
            f"(0, {LOAD_DEADLINE_S_MAX:g}] (default {default:g})"
        )
    return float(value)


def _by_block(error: TaskError, causes: dict[bytes, BaseException | str]) -> None:
    """Each failed block's first cause, from a task's failures (keyed by block and shard)."""
    for (block, _shard), cause in error.failures.items():
        causes.setdefault(block, cause)


def _left(deadline: float) -> float:
    """Seconds left until ``deadline`` (a ``time.monotonic()`` instant), at least 0."""
    return max(0.0, deadline - time.monotonic())


class LateLoadError(UcmError):
    """A block that did not reach the engine's memory within the load deadline."""


class Staging:
    """Private memory for ``count`` shards of ``layout``, which a load writes before what
    arrived in time is copied into an engine's memory. ``addresses[n]``: shard n's tensors,
    as :meth:`~ucm.Store.load_data` takes them. ``populate``: fault every page in now (one
    call, on the caller's thread); otherwise the load's threads fault them in as they write."""

    __slots__ = ("addresses", "memory")

    def __init__(self, layout: Layout, count: int, *, populate: bool = True) -> None:
        shard_size = layout.shard_size
        flags = mmap.MAP_PRIVATE | (mmap.MAP_POPULATE if populate else 0)
        self.memory = mmap.mmap(-1, max(1, shard_size * count), flags=flags)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
        sizes = layout.tensor_sizes
        offsets = [sum(sizes[:j]) for j in range(len(sizes))]
        self.addresses = [
            [base + n * shard_size + offset for offset in offsets] for n in range(count)
        ]

    def __len__(self) -> int:
        return len(self.memory)


_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
"""Linux's flag (Python 3.11's mmap module does not name it): reserve no swap for the slots."""
_PAGE_BYTES = mmap.PAGESIZE
STAGING_WARM_BYTES = 256 << 20
"""Free staging slots kept warm (their pages resident) by default; more when one transfer
took more."""


class StagingSlots:
    """``capacity`` shard-sized slots of private memory for staged transfers that follow one
    another (the vLLM worker's staged saves, SGLang's staged sets), reused so that a slot's
    pages are faulted in once, not at every transfer: a copy into fresh memory pays a page
    fault per 4 KiB (16 MiB took 10-12 ms here against 2-3 ms into warm memory;
    ``ucm bench --only vllm_saves``).

    One reservation of ``capacity`` slots: no memory until a slot is first written.
    :meth:`take` hands out warm slots first, and None when fewer than ``count`` are free (the
    caller's bound on its staging memory). :meth:`give` returns slots: free slots stay warm
    up to ``warm_bytes`` (at least the largest take so far), and the rest come back to the
    caller for :meth:`trim`, which gives their pages back to the system (``MADV_DONTNEED``;
    meant for a thread the engine does not wait on) and only then frees them."""

    def __init__(
        self, layout: Layout, capacity: int, *, warm_bytes: int = STAGING_WARM_BYTES
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: staging holds at least one slot")
        self.shard_size = layout.shard_size
        self.capacity = capacity
        self.memory = mmap.mmap(
            -1, self.shard_size * capacity, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE
        )
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
        self._sizes = sizes = layout.tensor_sizes
        self._offsets = [sum(sizes[:j]) for j in range(len(sizes))]
        self._warm_slots = max(1, warm_bytes // self.shard_size)
        self._warm: list[int] = []
        """Free slots whose pages are resident, the last given first out."""
        self._cold: list[int] = list(range(capacity - 1, -1, -1))
        """Free slots never written, or trimmed."""
        self._largest = 0
        self._lock = threading.Lock()
        self.held = 0
        """Slots taken and not given back yet."""
        self.high_water = 0

    @classmethod
    def reserve(cls, layout: Layout, capacity: int, what: str, short: str) -> StagingSlots:
        """``capacity`` slots, or, where the system refuses that much address space (strict
        overcommit, ``RLIMIT_AS``), half as many, and so on down to one. A refusal is logged:
        staging memory for so many of ``capacity`` ``what`` (the refusal): ``short`` (what
        happens when the slots run short)."""
        wanted = capacity
        refused: OSError | None = None
        while True:  # bounded: capacity halves down to 1
            try:
                slots = cls(layout, capacity)
                break
            except OSError as exc:
                if capacity == 1:
                    raise
                capacity = max(1, capacity // 2)
                refused = exc
        if refused is not None:
            logger.warning(
                "UCM: staging memory for %d of the %d %s (%s): %s",
                capacity,
                wanted,
                what,
                refused,
                short,
            )
        return slots

    def __len__(self) -> int:
        """Bytes of the slots taken and not given back (not of the whole reservation)."""
        return self.held * self.shard_size

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._warm) + len(self._cold)

    def take(self, count: int) -> list[int] | None:
        """``count`` free slots, warm ones first; None when fewer are free (nothing taken)."""
        if count < 1:
            raise ValueError(f"count={count}: take at least one slot")
        with self._lock:
            if count > len(self._warm) + len(self._cold):
                return None
            self._largest = max(self._largest, count)
            warm = min(count, len(self._warm))
            slots = self._warm[len(self._warm) - warm :]
            del self._warm[len(self._warm) - warm :]
            for _ in range(count - warm):
                slots.append(self._cold.pop())
            self.held += count
            self.high_water = max(self.high_water, self.held)
            return slots

    def addresses(self, slots: Sequence[int]) -> list[list[int]]:
        """Each slot's tensor addresses, as :meth:`~ucm.Store.dump_data` takes them."""
        assert all(0 <= slot < self.capacity for slot in slots)
        return [
            [self._base + slot * self.shard_size + offset for offset in self._offsets]
            for slot in slots
        ]

    def copy_in(self, slots: Sequence[int], sources: Sequence[Sequence[int]]) -> list[list[int]]:
        """Copies one shard into each slot (``sources[n]``: shard n's tensor addresses, in
        the layout's order; one native call) and returns the slots' :meth:`addresses`."""
        addresses = self.addresses(slots)
        copy_ranges(
            [address for shard in addresses for address in shard],
            [address for shard in sources for address in shard],
            list(self._sizes) * len(slots),
        )
        return addresses

    def give(self, slots: Sequence[int]) -> list[int]:
        """Returns ``slots``: those the warm bound keeps are free at once; the others are
        returned, to be passed to :meth:`trim` (they are not free until then)."""
        with self._lock:
            self.held -= len(slots)
            assert self.held >= 0
            keep = max(0, max(self._warm_slots, self._largest) - len(self._warm))
            self._warm.extend(slots[:keep])
            return list(slots[keep:])

    def give_back(self, slots: Sequence[int]) -> None:
        """:meth:`give`, then :meth:`trim` of what the warm bound does not keep, on the
        caller's thread."""
        cold = self.give(slots)
        if cold:
            self.trim(cold)

    def trim(self, slots: Sequence[int]) -> None:
        """Gives the whole pages of ``slots`` back to the system, then frees the slots."""
        for start, end in _runs(sorted(slots)):
            first = -(-start * self.shard_size // _PAGE_BYTES) * _PAGE_BYTES
            last = end * self.shard_size // _PAGE_BYTES * _PAGE_BYTES
            if last > first:  # only pages no slot outside the run shares
                self.memory.madvise(mmap.MADV_DONTNEED, first, last - first)
        with self._lock:
            self._cold.extend(slots)


def _runs(slots: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted slot numbers as [start, end) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], slot + 1)
        else:
            runs.append((slot, slot + 1))
    return runs


@dataclass
class _Late:
    """Staging memory a late load may still write: kept until the load is over."""

    store: Store
    task: Task
    staging: Staging | StagingSlots


_LATE: list[_Late] = []
"""Every late load of the process whose staging memory it may still write. Module-wide, so
that the memory outlives the engine's backend object too (a load still running when the store
closed, past its close's wait, is left running)."""
_LATE_LOCK = threading.Lock()


def keep_late(store: Store, task: Task, staging: Staging | StagingSlots) -> None:
    """Keeps ``staging`` until ``task`` (a load into it that ran late, or a dump from it
    still running at close) is over."""
    with _LATE_LOCK:
        _LATE.append(_Late(store, task, staging))


def reap_late() -> None:
    """Frees the staging memory of late loads that are over (of every store)."""
    with _LATE_LOCK:
        if _LATE:
            _LATE[:] = [late for late in _LATE if not late.task.done()]


def late_of(store: Store) -> list[Task]:
    """The late loads of ``store`` still writing staging memory."""
    with _LATE_LOCK:
        return [late.task for late in _LATE if late.store is store]


class BoundedLoads:
    """One engine rank's bounded loads over ``store`` (a worker's store). Thread-safe: an
    engine may load from several threads at once (LMCache's retrieve and its prefetches)."""

    def __init__(self, store: Store, deadline_s: float) -> None:
        self._store = store
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        """Guards the counters."""
        self.late_blocks = 0
        """Blocks that missed the deadline, so far (each failed, for the engine to recompute)."""
        self.staged_blocks = 0
        """Blocks loaded through staging memory, so far (no buffer, or one that could not
        take them)."""

    def load(
        self,
        block_ids: Sequence[bytes],
        shard_index: Sequence[int],
        pointers: Sequence[Sequence[int]],
        *,
        namespace: str | None = None,
        deadline: float | None = None,
    ) -> dict[bytes, BaseException | str]:
        """Loads shard ``shard_index[i]`` of block i into the addresses ``pointers[i]`` (one per
        tensor of the shard, as :meth:`~ucm.Store.load_data` takes them); returns the cause of
        each block that did not load. ``deadline``: a ``time.monotonic()`` instant (default:
        now plus ``deadline_s``). Returns by then, plus the memcpy of what arrived; nothing is
        written into ``pointers`` after it returned."""
        reap_late()
        if deadline is None:
            deadline = time.monotonic() + self.deadline_s
        failed: dict[bytes, BaseException | str] = {}
        if not block_ids:
            return failed
        rest = list(range(len(block_ids)))
        if self._store.buffer is not None:
            rest = self._through_buffer(
                block_ids, shard_index, pointers, namespace, deadline, failed
            )
        if rest:
            self._through_staging(
                block_ids, shard_index, pointers, rest, namespace, deadline, failed
            )
        late = sum(1 for cause in failed.values() if isinstance(cause, LateLoadError))
        if late:
            with self._lock:
                self.late_blocks += late
            logger.warning(
                "UCM: %d of %d block(s) missed the load deadline (%g s); the engine recomputes "
                "them",
                late,
                len(block_ids),
                self.deadline_s,
            )
        return failed

    def _through_buffer(
        self,
        block_ids: Sequence[bytes],
        shard_index: Sequence[int],
        pointers: Sequence[Sequence[int]],
        namespace: str | None,
        deadline: float,
        failed: dict[bytes, BaseException | str],
    ) -> list[int]:
        """Pin what the buffer holds whole, prefetch the rest into it (until the deadline) and
        pin that too, then copy what the pins hold. Returns the positions left to load through
        staging: those the buffer did not get, for a cause other than absence, while time is
        left. A hit costs a pin, the copy and an unpin: no look-up, no prefetch."""
        store = self._store
        every = store.layout.shards_per_block
        unique = list(dict.fromkeys(block_ids))
        causes: dict[bytes, BaseException | str] = {}
        late = False
        # Pinned first: the prefetch of the others cannot evict them from a small buffer.
        pins = store.pin(unique, namespace=namespace)
        try:
            held = {pin.block_id for pin in pins if pin.held == every}
            missing = [block for block in unique if block not in held]
            if missing:
                late = self._prefetch(missing, namespace, deadline, causes)
                more = store.pin(missing, namespace=namespace)
                pins += more
                held.update(pin.block_id for pin in more if pin.held == every)
            chosen = [i for i, block in enumerate(block_ids) if block in held]
            if chosen:
                # Every shard is pinned in the buffer: a memcpy, which no tier can hold up
                # (prefetches, which wait on the tiers, have a queue of their own).
                try:
                    task = store.load_data(
                        [block_ids[i] for i in chosen],
                        [shard_index[i] for i in chosen],
                        [pointers[i] for i in chosen],
                        namespace=namespace,
                        submit_timeout_s=_left(deadline),
                        fill=False,  # pinned: never a read from below
                    )
                except TimeoutError:  # the load queue stayed full: nothing was submitted
                    for i in chosen:
                        failed.setdefault(block_ids[i], self._late("copied"))
                else:
                    try:
                        store.wait(task)
                    except TaskError as exc:
                        _by_block(exc, failed)
        finally:
            store.unpin(pins)
        rest = []
        time_left = not late and time.monotonic() < deadline
        for i, block in enumerate(block_ids):
            if block in held:
                continue
            why = causes.get(block)
            if isinstance(why, KeyMissingError):
                failed[block] = why
            elif late or not time_left:
                failed[block] = self._late("in the CacheBuffer")
            else:
                rest.append(i)
        return rest

    def _prefetch(
        self,
        blocks: list[bytes],
        namespace: str | None,
        deadline: float,
        causes: dict[bytes, BaseException | str],
    ) -> bool:
        """Moves ``blocks`` up into the buffer, waiting until the deadline; records each failed
        block's cause. True when the prefetch was still running at the deadline (it goes on,
        into the buffer only)."""
        store = self._store
        try:
            prefetch = store.prefetch(blocks, namespace=namespace, submit_timeout_s=_left(deadline))
        except TimeoutError as exc:  # the prefetch queue stayed full until the deadline
            logger.warning("UCM prefetch of %d block(s) not started: %s", len(blocks), exc)
            return True
        except UcmError as exc:  # the staging path may still load them
            logger.warning("UCM prefetch of %d block(s) not started: %s", len(blocks), exc)
            return False
        if prefetch is None:
            return False
        try:
            store.wait(prefetch, timeout_s=_left(deadline))
        except TimeoutError:
            return True
        except TaskError as exc:
            _by_block(exc, causes)
        return False

    def _through_staging(
        self,
        block_ids: Sequence[bytes],
        shard_index: Sequence[int],
        pointers: Sequence[Sequence[int]],
        chosen: list[int],
        namespace: str | None,
        deadline: float,
        failed: dict[bytes, BaseException | str],
    ) -> None:
        """Loads the ``chosen`` positions into private memory and copies the ones that arrived
        by the deadline into ``pointers``."""
        store = self._store
        sizes = store.layout.tensor_sizes
        # The store's own check (``load_data`` makes it on the buffer path): this copy writes
        # the addresses itself, so a bad one is refused here, before anything runs.
        addresses = arguments.check_pointers(pointers, len(block_ids), store.layout, "dst_ptrs")
        with self._lock:
            self.staged_blocks += len(chosen)
        # Populated: the pages are faulted in by one call, not one fault each.
        staging = Staging(store.layout, len(chosen))
        staged = staging.addresses
        try:
            task = store.load_data(
                [block_ids[i] for i in chosen],
                [shard_index[i] for i in chosen],
                staged,
                namespace=namespace,
                submit_timeout_s=_left(deadline),
            )
        except TimeoutError:  # the load queue stayed full until the deadline
            for i in chosen:
                failed.setdefault(block_ids[i], self._late("loaded"))
            return
        causes: dict[bytes, BaseException | str] = {}
        try:
            store.wait(task, timeout_s=_left(deadline))
        except TimeoutError:
            keep_late(store, task, staging)
            for i in chosen:
                failed.setdefault(block_ids[i], self._late("loaded"))
            return
        except TaskError as exc:
            _by_block(exc, causes)
        except BaseException:
            if not store.check(task):  # still running: its memory must outlive it
                keep_late(store, task, staging)
            raise
        destinations: list[int] = []
        sources: list[int] = []
        for n, i in enumerate(chosen):
            block = block_ids[i]
            if block in causes:
                failed.setdefault(block, causes[block])
                continue
            destinations.extend(addresses.flat[i * len(sizes) : (i + 1) * len(sizes)])
            sources.extend(staged[n])
        # One native call: the GIL is released once, not once per tensor of every block.
        copy_ranges(destinations, sources, list(sizes) * (len(sources) // len(sizes)))

    def _late(self, what: str) -> LateLoadError:
        return LateLoadError(f"not {what} within the load deadline ({self.deadline_s:g} s)")

    def wait_late(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for the late loads still writing staging memory; True
        once none is left (their memory is then freed)."""
        end = time.monotonic() + timeout_s
        for task in late_of(self._store):
            try:
                self._store.wait(task, timeout_s=max(0.0, end - time.monotonic()))
            except TimeoutError:
                return False
            except TaskError:
                pass  # over: its failures were reported when it ran late
        reap_late()
        return not late_of(self._store)

    @property
    def late_staging_bytes(self) -> int:
        """Staging memory that late loads still hold."""
        with _LATE_LOCK:
            return sum(len(late.staging) for late in _LATE if late.store is self._store)
