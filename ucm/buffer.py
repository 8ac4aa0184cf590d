"""The ``buffer`` tier: the node-wide shared-memory CacheBuffer (native core), part of the core
package (not a plugin): the Store holds it as a typed :class:`BufferTier` and runs its native
queue; it registers its ``type: buffer`` through the same hook as the other built-in tiers.

Every rank of a node that opens the same ``unique_id`` maps the same control segment and data
segments (``ucm.native.segments``); the slot logic (owner/waiter, CLOCK, Touch, Prealloc,
batched remove) is ``ucm.native.buffer``. Each worker process runs the buffer's native load
queue (``ucm.native.queue``, :attr:`BufferTier.queue`): it claims slots, copies hits, waits on
slots other ranks fill and hands the keys this rank owns to the Store's loader threads, so each
missing shard is loaded from below exactly once node-wide, by whichever rank claims its slot
first, while every other rank asking for it sleeps on the slot's futex. The tier's own
``load``/``dump`` (the plain Tier interface) are tasks on the same queue. The queue and tuning
keys of this tier's config (``copy_threads``, ``load_workers``, ``step_keys``, queue depths,
``prealloc``...) configure it.

**Write-back debt.** In a stack with ``write: back`` tiers below the buffer, a dump lands in the
buffer only and its slots are committed *dirty* (shared control plane: node-wide). A dirty slot
is never an eviction victim; flushers write it down and clean it:

- every worker rank runs a background flusher that writes dirty slots down while the rank's
  dumps are idle;
- a dump is acknowledged only once the node's dirty bytes are at most ``dirty_max`` (flushing
  more itself if need be), so a kill -9 of every rank loses at most that much;
- the last rank to close the buffer (no other live rank attached that is not closing) writes
  every dirty slot down before ``close()`` returns; a rank closing before others leaves the
  debt in the shared buffer, to them.

A flusher's references to the slots it writes down go through the native queue
(:meth:`NativeQueue.take_dirty`), like every other reference this process takes.

**A remove is final against a flush in flight.** ``remove(force=True)`` (and a purge) takes a
slot out of the buffer even while a flusher writes it down, and then removes the key from the
tiers below, where that write may not have landed yet: the write would bring the removed block
back. So a flush goes through :class:`ucm.finality.Finality`, like every other write to a
lower tier: it reads the node's removal generation before it takes its slots, and once its
write is over, before it lets go of them, removes from the tiers it wrote to each key that a
removal recorded since covers (a purge or a forced remove, by any process: the log is in the
shared control plane) and that no later dump put back in the buffer. A forced remove in this
process also waits, at most ``wait_timeout_s``, for this process's flushes of its keys, so
that when it returns they are over.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import Field

from . import namespaces, shm_gc
from .config import BufferQuota, LoadSettings, Size, TierConfig
from .errors import (
    BufferLockTimeoutError,
    InvalidArgumentError,
    KeyMissingError,
    NoBufferSlotError,
    RoleError,
    TierError,
)
from .fieldtypes import Int, Seconds
from .finality import Finality
from .hookspecs import hookimpl
from .layout import BLOCK_ID_BYTES, Key
from .native import _abi
from .native import buffer as native_buffer
from .native.buffer import SLOT_NONE, BufferCore, Geometry, GetResult
from .native.queue import (
    TASK_FLAG_DIRTY,
    TASK_FLAG_NO_FILL,
    EntryResult,
    NativeQueue,
    TaskKind,
)
from .native.removals import RemovalLog
from .native.segments import SharedRegion
from .threadname import enter_thread
from .tier import EvictSink, Outcome, ShardViews, Tier, TierContext, WriteBackRemove

logger = logging.getLogger("ucm.buffer")

SEGMENT_TARGET_BYTES = 1 << 30
"""Data segments of at most ~1 GiB: small enough to create quickly, large enough to be few."""
SEGMENTS_MAX = _abi.SEG_SEGMENTS_MAX
"""Data segments per buffer the native segment layer accepts (constants.seg_segments_max)."""

BUFFER_CTRL_LAYOUT_VERSION: int = getattr(native_buffer, "CTRL_LAYOUT_VERSION", 1)

FLUSH_BATCH_SLOTS = 64
"""Dirty slots one flush writes down at a time (one batched dump per write-back tier)."""
IDLE_FLUSH_BATCHES_MAX = 64
"""Batches the background flusher writes per wake-up before checking for new dumps again."""
SETTLE_ROUNDS_MAX = 1 << 20
"""Backstop of the flush loops; their real bound is a deadline renewed on progress."""
SETTLE_PAUSE_S = 0.002
"""Pause while other ranks' flushers hold every dirty slot."""


class _ProcessHolds:
    """This process's holds on Ready slots of one CacheBuffer taken by a scheduler-role tier
    (:meth:`BufferTier.hold`). The buffer counts one reference per slot per process (its
    holder), and a worker's native queue counts its own uses of those references. So a
    scheduler in a process that also runs a worker of this buffer (vLLM's in-process executor)
    holds through that worker's queue (the first one opened); a scheduler in a process of its
    own holds through the buffer core, counted here. With two workers of the buffer in one
    process (two engines or stores in one test process; never vLLM), neither can count the
    other's uses of the process's reference, so nothing is held (:meth:`holdable`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queues: list[NativeQueue] = []
        self.queued: dict[int, list[NativeQueue]] = {}
        """Per slot held through a queue, the queue of each hold (unpinned there)."""
        self.core_uses: dict[int, int] = {}
        self.core: BufferCore | None = None

    def live_queues(self) -> list[NativeQueue]:
        self.queues = [queue for queue in self.queues if not queue.destroyed]
        return self.queues

    def attach_queue(self, queue: NativeQueue) -> None:
        """A worker of this buffer opens in this process. Holds taken before are given up
        first: through the core, since a queue would find the process's reference on their
        slots without a use of its own; through another queue, since the new one could not
        count that one's uses either. The loads they guarded may fail and be recomputed. vLLM
        starts its worker before its scheduler, and runs one worker per process."""
        with self.lock:
            self._give_up_core()
            for old in self.live_queues():
                pinned = array(
                    "I", [slot for slot, via in self.queued.items() for q in via if q is old]
                )
                try:
                    if pinned:
                        old.unpin(pinned)
                except Exception as exc:  # they stay until that queue or this process goes
                    logger.warning("UCM: %d CacheBuffer holds not released: %s", len(pinned), exc)
            self.queued.clear()
            self.queues.append(queue)

    def _give_up_core(self) -> None:
        """Releases every hold taken through the buffer core (lock held)."""
        held = sorted(self.core_uses)
        self.core_uses.clear()
        try:
            if held and self.core is not None:
                self.core.release(held)
        except Exception as exc:  # they stay until this process exits (a dead holder's)
            logger.warning("UCM: %d CacheBuffer holds not released: %s", len(held), exc)

    def close_core(self, core: BufferCore) -> None:
        """A scheduler-role tier closes: the holds taken through its core are released
        before its control segment is unmapped, and none is taken through it again."""
        with self.lock:
            if self.core is core:
                self._give_up_core()
                self.core = None

    def detach_queue(self, queue: NativeQueue) -> None:
        """A worker's queue goes: the holds taken through it go with it."""
        with self.lock:
            self.queues = [q for q in self.queues if q is not queue]
            for slot in list(self.queued):
                self.queued[slot] = [q for q in self.queued[slot] if q is not queue]
                if not self.queued[slot]:
                    del self.queued[slot]


_PROCESS_HOLDS: dict[tuple[int, str], _ProcessHolds] = {}
"""Per (process id, buffer unique_id): a forked child starts with none of its parent's."""
_PROCESS_HOLDS_LOCK = threading.Lock()


def _process_holds(unique_id: str) -> _ProcessHolds:
    key = (os.getpid(), unique_id)
    with _PROCESS_HOLDS_LOCK:
        holds = _PROCESS_HOLDS.get(key)
        if holds is None:
            holds = _PROCESS_HOLDS[key] = _ProcessHolds()
        return holds


class BufferTierConfig(TierConfig, LoadSettings):
    """The buffer tier: its own keys, plus the load path's settings (``LoadSettings``, the
    model a stack without a buffer takes in its ``load:`` section)."""

    type: Literal["buffer"] = "buffer"
    capacity: Size = Field(description="Bytes of regular slots (at least one shard).")
    reserved_slots: Int = Field(
        default=0, ge=0, description="Extra slots used by Prealloc and dumps when the pool is full."
    )
    populate_threads: Int = Field(
        default=2,
        ge=0,
        le=_abi.POPULATE_THREADS_MAX,
        description="Native threads that fault the data plane in behind open, in each worker "
        "process (0: every page faults in on its first write). Open never waits for them.",
    )

    dirty_max: Size = Field(
        default=256 * 1024 * 1024,
        description="Most bytes of acknowledged dumps that the `write: back` tiers below may "
        "still lack (write-back debt, node-wide); a dump waits for write-back beyond it, so a "
        "kill -9 of every rank loses at most this much. Capped at half the regular slots.",
    )
    flush_interval_s: Seconds = Field(
        default=0.5,
        description="How often an idle rank's background flusher writes dirty slots down "
        "(after this long without a dump).",
    )


class BufferTier(Tier):
    type_name = "buffer"
    config_model = BufferTierConfig

    def __init__(self, config: TierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        assert isinstance(config, BufferTierConfig)
        self.cfg = config
        shard_size = self.layout.shard_size
        slots_per_segment = 1
        while (slots_per_segment * 2) * shard_size <= SEGMENT_TARGET_BYTES:
            slots_per_segment *= 2
        total = config.capacity // shard_size + config.reserved_slots
        slots_per_segment = min(slots_per_segment, 1 << max(0, (max(total, 1) - 1).bit_length()))
        # A huge buffer gets larger segments rather than more than the native core can pass
        # over its socket, so its size is judged against /dev/shm, not against a segment limit.
        while -(-total // slots_per_segment) > SEGMENTS_MAX:
            slots_per_segment *= 2
        self.geometry = Geometry.from_capacity(
            config.capacity,
            shard_size,
            reserved_slots=config.reserved_slots,
            slots_per_segment=slots_per_segment,
        )
        geometry = self.geometry
        self.segment_bytes = geometry.segment_size_bytes
        role: Literal["worker", "scheduler"] = "scheduler" if context.is_scheduler else "worker"

        def init(region: SharedRegion) -> None:
            BufferCore.create(region.ctrl_address, region.ctrl_bytes, geometry)

        # A UCM start reclaims what dead runs of other buffers left in /dev/shm (bounded).
        shm_gc.sweep_at_open(exclude=context.unique_id)
        try:
            self.region = SharedRegion.open(
                context.unique_id,
                ctrl_bytes=geometry.ctrl_size_bytes,
                data_bytes=self.segment_bytes * geometry.segment_count,
                segment_bytes=self.segment_bytes,
                role=role,
                init=init,
                ctrl_layout_version=BUFFER_CTRL_LAYOUT_VERSION,
            )
        except BaseException:
            shm_gc.collect_one(context.unique_id)  # a refused open leaves no lock file behind
            raise
        self._queue: NativeQueue | None = None
        self._holds_closed = False
        try:
            self.core = BufferCore.attach(
                self.region.ctrl_address, self.region.ctrl_bytes, geometry
            )
            self.bases = [self.region.segment_address(i) for i in range(geometry.segment_count)]
            # The data plane stays mapped until close: tiers below may register it once (RDMA,
            # Mooncake) instead of per call (ucm.tier.HOST_MEMORY_OPTION). A scheduler has none.
            self.host_memory: tuple[tuple[int, int], ...] = (
                ((self.region.data_address, self.region.data_bytes),)
                if self.region.data_address
                else ()
            )
            if not context.is_scheduler:
                # A rank (re)joining frees what ranks killed earlier still held, so a restart
                # never inherits leaked references even if the buffer never fills up.
                self.core.reclaim_dead()
                # Open returns at once; the data plane faults in behind it.
                self.region.populate(config.populate_threads)
                self._queue = NativeQueue(
                    self.core,
                    self.bases,
                    config.load_settings(),
                    device_id=context.device_id,
                    local_rank_size=min(context.local_rank_size, _LOCAL_RANK_SIZE_MAX),
                    shards_per_block=self.layout.shards_per_block,
                    tensor_sizes=self.layout.tensor_sizes,
                    region_handle=self.region.handle,
                    keepalive=self.region,
                )
                _process_holds(context.unique_id).attach_queue(self._queue)
        except BaseException:
            self.region.close()  # a refused attach must not keep the segments mapped
            raise
        self._resolver_lock = threading.Lock()
        self._resolver_open = True
        """False once close() began: the identity table may be unmapped after that."""
        self._counts = {
            "written_back_shards": 0,
            "write_back_failures": 0,
            "written_down_unbuffered": 0,
            "written_down_lock_timeouts": 0,
        }
        self._counts_lock = threading.Lock()
        # Write-back debt: dumps commit dirty when `write: back` tiers below must get them.
        self._sink: EvictSink | None = None if context.is_scheduler else context.evict_sink
        self._retract: WriteBackRemove | None = (
            None if context.is_scheduler else context.write_back_remove
        )
        # A purge or a forced remove is final (ucm.finality): the node's removal log, read by
        # every write of this process to a lower tier.
        self.finality = Finality(RemovalLog.of_buffer(self.core), held=self.core.lookup)
        self._flushing: Counter[Key] = Counter()
        """Keys this process's flushes are writing down right now (a forced remove waits)."""
        self._flushing_changed = threading.Condition()
        self.dirty_limit_slots = min(
            config.dirty_max // shard_size, geometry.slot_count_regular // 2
        )
        self._last_dump_ns = 0
        self._flusher_stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self._last_write_back_error: BaseException | None = None
        if self._sink is not None:
            # Registered now: a rank that reopens a buffer it closed earlier is open again.
            self.core.mark_closing(False)
            self._flusher = threading.Thread(
                target=self._flush_loop, name="ucm-write-back", daemon=True
            )
            self._flusher.start()
        # The buffer's identity table answers which namespace a tag is (ucm/namespaces.py),
        # until close unmaps it.
        namespaces.add_authority(self._resolver)

    def _resolver(self, tag: bytes) -> str | None:
        """The identity table's name for ``tag`` (the process-wide authority this buffer
        lends :mod:`ucm.namespaces`); None once close() began, so a thread that resolves while
        another closes never reads the table after it is unmapped."""
        with self._resolver_lock:
            if not self._resolver_open:
                return None
            return self.core.namespace_name(tag)

    def count(self, name: str, amount: int = 1) -> None:
        with self._counts_lock:
            self._counts[name] = self._counts.get(name, 0) + amount

    @property
    def writes_back(self) -> bool:
        """Whether dumps commit write-back debt (``write: back`` tiers below need them)."""
        return self._sink is not None

    @property
    def queue(self) -> NativeQueue:
        """This worker's native load queue (the scheduler role has none)."""
        if self._queue is None:
            raise RoleError(
                "the scheduler role has no data plane: it cannot move shard bytes (open the "
                "store with device_id >= 0)"
            )
        return self._queue

    # ---- the Tier interface ----------------------------------------------------------------

    def namespace_stats(self) -> dict[str, dict[str, int]]:
        """Node-wide figures of every namespace in the buffer's namespace table, by name: slots
        and bytes it holds, its guarantee and cap in slots, and the Get hits, misses and
        evictions of its keys, named by the buffer's identity table (a tag it does not hold is
        ``#<tag hex>``); ``default`` also holds every namespace not registered in the table."""
        names = self.core.namespace_names()
        names[bytes(namespaces.TAG_BYTES)] = namespaces.DEFAULT_NAMESPACE
        shard = self.layout.shard_size
        return {
            names.get(row.tag, f"#{row.tag.hex()}"): {
                "occupancy_slots": row.occupancy_slots,
                "occupancy_bytes": row.occupancy_slots * shard,
                "guarantee_slots": row.guarantee_slots,
                "cap_slots": row.cap_slots,
                "hits": row.hits,
                "misses": row.misses,
                "evictions": row.evictions,
            }
            for row in self.core.namespaces()
        }

    def register_name(self, namespace: str) -> None:
        """Enters ``namespace`` (tag and name) in the buffer's identity table, which every
        process of the node resolves keys through: before its first key can land here.
        :class:`~ucm.native.buffer.NamespaceNamesFullError` when the table is full."""
        if namespace != namespaces.DEFAULT_NAMESPACE:
            self.core.register_namespace_name(namespaces.tag(namespace), namespace)

    def register_quota(self, namespace: str, quota: BufferQuota | None) -> int:
        """Registers ``namespace`` in the node-wide namespace table with its CacheBuffer quota
        (guarantee and cap, resolved to whole regular slots); returns its index there. Without
        a quota (a stack without ``quotas:``) a namespace already in the table keeps the quota
        another process gave it, and a new one gets none. The default namespace is entry 0
        (its keys carry no tag)."""
        tag = (
            bytes(namespaces.TAG_BYTES)
            if namespace == namespaces.DEFAULT_NAMESPACE
            else namespaces.tag(namespace)
        )
        geometry = self.geometry
        if quota is None:
            for row in self.core.namespaces():
                if row.tag == tag:
                    return row.index
            quota = BufferQuota()
        guarantee, cap = quota.slots(geometry.slot_count_regular, geometry.shard_size_bytes)
        if quota.cap is None:
            cap = geometry.slot_count_total
        return self.core.register_namespace(tag, guarantee, cap)

    def lookup(self, keys: Sequence[Key]) -> list[bool]:
        return self.core.lookup(list(keys))

    def lookup_blocks(self, block_ids: Sequence[bytes]) -> list[bool]:
        return self.core.lookup_blocks(list(block_ids), self.layout.shards_per_block)

    def hold(self, keys: Sequence[Key]) -> list[int]:
        """The scheduler role's pin: holds each key that is Ready in the buffer, so that no
        eviction (of any process on the node) takes it until :meth:`unhold`; one slot per
        key, ``SLOT_NONE`` where nothing is held (not Ready: a hold never allocates a slot).
        ``batched_remove(force=True)`` still removes a held key. A worker pins through its
        store (:meth:`ucm.Store.pin`). The holds of a killed process are reclaimed with it."""
        batch = native_buffer.KeyBatch.of(list(keys))
        count = len(batch)
        out = [SLOT_NONE] * count
        if not count or self._holds_closed:
            return out
        holds = _process_holds(self.region.unique_id)
        with holds.lock:
            queues = holds.live_queues()
            if len(queues) > 1:
                return out
            if queues:
                queue = queues[0]
                slots = queue.pin(batch.ids, batch.shards)
                for index, slot in enumerate(slots):
                    if slot != SLOT_NONE:
                        holds.queued.setdefault(slot, []).append(queue)
                        out[index] = slot
                return out
            holds.core = self.core
            ready = [index for index, hit in enumerate(self.core.lookup(batch)) if hit]
            if not ready:
                return out
            width = BLOCK_ID_BYTES
            wanted = native_buffer.KeyBatch(
                b"".join(batch.ids[i * width : (i + 1) * width] for i in ready),
                array("I", [batch.shards[i] for i in ready]),
            )
            got = self.core.get(wanted)
            give_back: list[int] = []
            for index, result, slot in zip(ready, got.results, got.slots, strict=True):
                if result == GetResult.HIT or (
                    result == GetResult.HELD and holds.core_uses.get(slot, 0) > 0
                ):
                    holds.core_uses[slot] = holds.core_uses.get(slot, 0) + 1
                    out[index] = slot
                elif result in (GetResult.OWNER, GetResult.WAITER):
                    give_back.append(slot)  # evicted and taken again since the look-up
            if give_back:
                self.core.release(give_back)
        return out

    def holdable(self) -> bool:
        """Whether a hold here goes through this process's one worker queue of the buffer
        (vLLM's in-process executor). Without a worker in the process (vLLM's multiprocess
        executor) :meth:`hold` takes a buffer Get, which the buffer counts as a hit, node-wide
        and in the key's namespace, beside the worker's own Get of the same block: the vLLM
        connector does not hold there, so hits stay exact. With two workers of the buffer in
        the process nothing can be held (see ``_ProcessHolds``)."""
        holds = _process_holds(self.region.unique_id)
        with holds.lock:
            return len(holds.live_queues()) == 1

    def unhold(self, slots: Sequence[int]) -> None:
        """Releases holds taken with :meth:`hold` (its slots; ``SLOT_NONE`` and slots this
        process does not hold are skipped, and so is every slot once the tier is closed)."""
        if self._holds_closed:
            return
        holds = _process_holds(self.region.unique_id)
        with holds.lock:
            by_queue: dict[int, tuple[NativeQueue, array[int]]] = {}
            released: list[int] = []
            for slot in slots:
                through = holds.queued.get(slot)
                if through:
                    queue = through.pop()
                    if not through:
                        del holds.queued[slot]
                    by_queue.setdefault(id(queue), (queue, array("I")))[1].append(slot)
                elif holds.core_uses.get(slot, 0) > 0:
                    holds.core_uses[slot] -= 1
                    if not holds.core_uses[slot]:
                        del holds.core_uses[slot]
                        released.append(slot)
            for queue, queue_slots in by_queue.values():
                if not queue.destroyed:
                    queue.unpin(queue_slots)
            if released:
                self.core.release(released)

    def load(self, keys: Sequence[Key], destinations: Sequence[ShardViews]) -> list[Outcome]:
        """Copies out the keys that are Ready (waiting for ones being filled); everything else
        is a miss (nothing below this tier fills it here). One task on the native queue."""
        memory = _TaskMemory(self.layout.tensor_sizes, destinations, for_load=True)
        outcomes = self._run(TaskKind.LOAD, keys, memory, TASK_FLAG_NO_FILL)
        memory.scatter([i for i, outcome in enumerate(outcomes) if outcome is None])
        return outcomes

    def dump(self, keys: Sequence[Key], sources: Sequence[ShardViews]) -> list[Outcome]:
        """Writes each shard into a claimed slot and publishes it Ready. A key already Ready
        is rewritten unless a rank is reading it (then it keeps its bytes, which for a KV block
        id are the same). A key another load is filling right now waits for that fill: Ready
        is the same block (done); Failed or Missing, and the dump writes its own bytes
        (``dump_refills``); a fill still running after ``wait_timeout_s`` is NO_SLOT, like a
        key without a free slot or whose bucket lock timed out, and with ``write: back`` tiers
        below those go straight down to them.

        With ``write: back`` tiers below, the slots are committed dirty, and the call returns
        only once the node's write-back debt is within ``dirty_max`` (see the module doc)."""

        def run(start: int, end: int) -> list[Outcome]:
            memory = _TaskMemory(self.layout.tensor_sizes, sources[start:end], for_load=False)
            flags = TASK_FLAG_DIRTY if self._sink is not None else 0
            return self._run(TaskKind.DUMP, keys[start:end], memory, flags)

        return self.dump_with(keys, run, lambda i: sources[i])

    def dump_with(
        self,
        keys: Sequence[Key],
        run: Callable[[int, int], list[Outcome]],
        views_of: Callable[[int], ShardViews],
    ) -> list[Outcome]:
        """A dump's buffer part, ``run(start, end)`` for keys[start:end] on the native queue,
        within the write-back bound: without ``write: back`` tiers below, one run; with them,
        in chunks that each first make room under ``dirty_max``; a key that got no slot goes
        straight to the write-back tiers; the dump returns once the debt is within the bound
        again. ``views_of(i)`` is key i's source (for those straight writes)."""
        if self._sink is None:
            return run(0, len(keys))
        outcomes: list[Outcome] = []
        since = self.finality.start()  # before the bytes land anywhere (ucm.finality)
        size = max(1, min(self.cfg.step_keys, self.dirty_limit_slots))
        for start in range(0, len(keys), size):
            end = min(len(keys), start + size)
            # Room first: after this chunk's commits the debt must still be within the bound.
            # While the write-back tiers fail, new dumps fail rather than pile up debt that
            # nothing can pay (and that eviction may never take).
            try:
                self.settle(max(0, self.dirty_limit_slots - (end - start)))
            except TierError as exc:
                outcomes.extend([exc] * (end - start))
                continue
            chunk = run(start, end)
            # No slot, or its bucket lock held by a live process past the lock timeout: the
            # key is not in the buffer, so it goes straight to the write-back tiers.
            refused = [
                i
                for i, outcome in enumerate(chunk)
                if isinstance(outcome, (NoBufferSlotError, BufferLockTimeoutError))
            ]
            if refused:
                locked = {i for i in refused if isinstance(chunk[i], BufferLockTimeoutError)}
                written = self._sink(
                    [keys[start + i] for i in refused], [views_of(start + i) for i in refused]
                )
                for i, outcome in zip(refused, written, strict=True):
                    if outcome is None:
                        chunk[i] = None
                if self._retract is not None:
                    self.finality.settle(since, [keys[start + i] for i in refused], self._retract)
                self.count("written_down_unbuffered", sum(1 for o in written if o is None))
                self.count(
                    "written_down_lock_timeouts",
                    sum(
                        1
                        for i, o in zip(refused, written, strict=True)
                        if o is None and i in locked
                    ),
                )
            outcomes.extend(chunk)
        self._last_dump_ns = time.monotonic_ns()
        try:
            self.settle(self.dirty_limit_slots)
        except TierError as exc:
            # The shards are in the buffer (dirty, flushed later) but not acknowledged.
            return [exc if outcome is None else outcome for outcome in outcomes]
        return outcomes

    def _run(
        self, kind: TaskKind, keys: Sequence[Key], memory: _TaskMemory, flags: int
    ) -> list[Outcome]:
        if not keys:
            return []
        blocks = [key[0] for key in keys]
        if any(type(b) is not bytes or len(b) != 16 for b in blocks):
            raise InvalidArgumentError("keys must be (16-byte block id, shard index) pairs")
        queue = self.queue
        # Native threads read these until the task completes: kept alive until `wait` returns.
        ids = b"".join(blocks)
        shards = array("I", [key[1] for key in keys])
        results = bytearray(len(keys))
        token = queue.submit(
            kind,
            ids,
            shards,
            memory.flat,
            results,
            flags=flags,
            timeout_s=self.cfg.queue_timeout_s,
        )
        queue.wait(token, None)
        del ids, shards, memory
        return [_outcome(code) for code in results]

    # ---- write-back debt ---------------------------------------------------------------------

    def dirty_slots(self) -> int:
        """Slots holding write-back debt, node-wide (every rank's dumps)."""
        return self.core.stats()["dirty_slots"]

    def flush_some(self, limit: int = FLUSH_BATCH_SLOTS) -> tuple[int, int]:
        """Claims up to ``limit`` dirty slots, writes them to the ``write: back`` tiers and
        cleans the ones written. Returns (claimed, written): a slot removed while it was being
        written counts as written (its debt went with it), only a tier's failure does not."""
        assert self._sink is not None
        queue = self.queue
        start = self.finality.start()  # before the slots (the bytes written) are taken
        batch = queue.take_dirty(max(1, limit))
        if not batch.keys:
            return 0, 0
        written: list[bool] = [False] * len(batch.keys)
        outcomes: list[Outcome] = []
        with self._flushing_changed:
            self._flushing.update(batch.keys)
        try:
            try:
                size = self.layout.shard_size
                views = [
                    memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")
                    for address in self.core.slot_addresses(batch.slots, self.bases)
                ]
                try:
                    outcomes = list(self._sink(batch.keys, [[view] for view in views]))
                except Exception as exc:  # a raising tier fails the batch, it stays dirty
                    outcomes = [exc] * len(batch.keys)
                written = [outcome is None for outcome in outcomes]
                # Every key of the batch, written or not (a raising tier may have written
                # some): a removal since `start` covers it, its copy below goes again.
                if self._retract is not None:
                    self.finality.settle(start, batch.keys, self._retract)
                cleaned = self.core.clean(batch.slots, written)
            finally:
                queue.release(batch.slots)
        finally:
            with self._flushing_changed:
                self._flushing.subtract(batch.keys)
                self._flushing = +self._flushing  # drops the keys at zero
                self._flushing_changed.notify_all()
        failed = len(batch.keys) - sum(written)
        self.count("written_back_shards", sum(written))
        self.count("write_back_failures", failed)
        if failed:
            self._last_write_back_error = next(o for o in outcomes if o is not None)
        assert cleaned <= sum(written)
        return len(batch.keys), sum(written)

    def _wait_for_flushes(self, keys: Sequence[Key]) -> None:
        """Waits, at most ``wait_timeout_s``, until no flush of this process is writing any of
        ``keys`` down (a forced remove: the flush then removes below what it wrote, and the
        remove returns with it over). Past the bound the flush still does so when its write
        ends; a flush in another process is not waited for."""
        with self._flushing_changed:
            if not self._flushing:
                return
            wanted = set(keys)
            deadline = time.monotonic() + self.cfg.wait_timeout_s
            while any(key in wanted for key in self._flushing):
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning(
                        "UCM: a remove went on after %.1f s while this process still writes "
                        "some of its shards back; the write removes them below once it ends",
                        self.cfg.wait_timeout_s,
                    )
                    return
                self._flushing_changed.wait(left)

    def settle(self, target_slots: int) -> None:
        """Writes dirty slots down until the node's debt is at most ``target_slots``. Raises
        TierError when the write-back tiers fail, or when other ranks' flushes hold the debt
        past ``wait_timeout_s``."""
        deadline = time.monotonic() + self.cfg.wait_timeout_s
        for _round in range(SETTLE_ROUNDS_MAX):
            dirty = self.dirty_slots()
            if dirty <= target_slots:
                return
            claimed, written = self.flush_some(min(dirty - target_slots, FLUSH_BATCH_SLOTS))
            if claimed and not written:
                raise TierError(
                    f"write-back failed: {dirty} dirty shard(s) cannot be written to the "
                    f"`write: back` tier(s) below ({self._last_write_back_error!r}); they stay "
                    "in the buffer and are retried"
                )
            if not claimed:
                if time.monotonic() > deadline:
                    raise TierError(
                        f"write-back stalled: {dirty} dirty shard(s) stayed claimed by other "
                        f"ranks' flushers for {self.cfg.wait_timeout_s} s"
                    )
                time.sleep(SETTLE_PAUSE_S)  # other ranks' flushers hold the debt
        raise TierError(f"write-back did not settle in {SETTLE_ROUNDS_MAX} rounds")

    def _flush_loop(self) -> None:
        """Background flusher: while this rank's dumps are idle, write dirty slots down."""
        enter_thread()
        interval_s = self.cfg.flush_interval_s
        while not self._flusher_stop.wait(interval_s):
            try:
                for _batch in range(IDLE_FLUSH_BATCHES_MAX):
                    idle_ns = time.monotonic_ns() - self._last_dump_ns
                    if self._flusher_stop.is_set() or idle_ns < interval_s * 1e9:
                        break
                    claimed, written = self.flush_some()
                    if not claimed or not written:
                        break
            except Exception as exc:  # never let the thread die silently; retried next round
                self.count("write_back_failures", 1)
                self._last_write_back_error = exc

    def _stop_flusher(self) -> None:
        if self._flusher is not None:
            self._flusher_stop.set()
            self._flusher.join()
            self._flusher = None

    def flush(self) -> None:
        """At close: stops the background flusher; the last rank attached to the buffer then
        writes every dirty slot down (the others leave the debt to the ranks that remain)."""
        if self._sink is None or self._flusher is None:
            return
        self._stop_flusher()
        if not self.core.mark_closing(True):
            return
        deadline = time.monotonic() + self.cfg.wait_timeout_s
        for _round in range(SETTLE_ROUNDS_MAX):
            dirty = self.dirty_slots()
            if not dirty:
                return
            claimed, written = self.flush_some()
            if claimed and not written:
                raise TierError(
                    f"close: {dirty} dirty shard(s) could not be written to the `write: back` "
                    f"tier(s) below ({self._last_write_back_error!r}): they are lost when the "
                    "last process leaves the buffer"
                )
            if claimed:
                deadline = time.monotonic() + self.cfg.wait_timeout_s  # progress
            elif time.monotonic() > deadline:
                raise TierError(
                    f"close: {dirty} dirty shard(s) stayed claimed by other flushers for "
                    f"{self.cfg.wait_timeout_s} s"
                )
            else:
                time.sleep(SETTLE_PAUSE_S)
        raise TierError(f"close: write-back did not finish in {SETTLE_ROUNDS_MAX} rounds")

    def touch(self, block_ids: Sequence[bytes]) -> None:
        self.core.touch(list(block_ids))

    def read_control(self, names: Sequence[bytes]) -> list[int | None]:
        """The node's control records (the native control plane's table, which a scheduler
        reads too): they live while any process of the node keeps the buffer open."""
        return self.core.control_read(list(names))

    def raise_control(self, name: bytes, value: int) -> None:
        self.core.control_raise(name, value)

    def batched_remove(self, keys: Sequence[Key], force: bool = False) -> int:
        """Removes the keys (native: one bucket-lock pass per chunk). Keys pinned through
        ``Tier.pins`` and slots in use by any rank are kept unless ``force``. A forced remove
        takes slots that flushers are writing down, too: it then waits (bounded) for this
        process's flushes of the keys, which remove below what they wrote (module doc)."""
        unique = list(dict.fromkeys(keys))
        if not force:
            unique = [key for key in unique if not self.pins.is_pinned(key)]
        if not unique:
            return 0
        removed = self.core.remove(unique, force=force)
        if force:
            self._wait_for_flushes(unique)
        return removed

    def list_keys(self) -> list[Key]:
        """Every Ready key of the node's buffer (a native scan of the slots, read-only)."""
        return self.core.list_ready()

    def stats(self) -> dict[str, int | float]:
        """Node-wide native counters (Get hits and misses as ``get_hits``/``get_misses``, every
        rank's loads and dumps together) and this process's queue counters: ``hits``/``misses``
        are the keys its loads found Ready here or not (the Tier stats contract)."""
        counters: dict[str, int | float] = dict(self.core.stats())
        counters["get_hits"] = counters.pop("hits")
        counters["get_misses"] = counters.pop("misses")
        queue_counters = (
            self._queue.stats() if self._queue is not None and not self._queue.destroyed else {}
        )
        for name in _QUEUE_TIER_COUNTERS:
            counters[name] = queue_counters.get(name, 0)
        with self._counts_lock:
            counters.update(self._counts)
        counters.update(self.finality.counts())
        residency = self.region.residency()
        counters["resident_bytes"] = residency.resident_bytes
        counters["data_bytes"] = residency.data_bytes
        counters["populated_bytes"] = residency.populated_bytes
        counters["populate_failed"] = int(residency.populate_error is not None)
        counters["capacity_slots"] = self.geometry.slot_count_regular
        counters["reserved_slots"] = self.geometry.slot_count_reserved
        counters["dirty_bytes"] = counters["dirty_slots"] * self.layout.shard_size
        counters["dirty_limit_bytes"] = self.dirty_limit_slots * self.layout.shard_size
        return counters

    def close(self) -> None:
        """Stops the native queue (every task finished), then unmaps the segments. A queue
        with tasks still running after queue_timeout_s keeps the mappings (never freed under
        a running copy)."""
        self._stop_flusher()  # flush() was not called (a failed open, a test)
        with self._resolver_lock:
            self._resolver_open = False
        namespaces.remove_authority(self._resolver)
        queue = self._queue
        self._holds_closed = True
        if queue is not None:
            _process_holds(self.region.unique_id).detach_queue(queue)
        else:
            _process_holds(self.region.unique_id).close_core(self.core)
        if queue is not None and not queue.destroyed:
            # Abandoned: the load path's close gave up on running tasks and left its loaders
            # in the queue; freeing it (or unmapping) under them would be a use after free.
            if queue.abandoned or not queue.drain(self.cfg.queue_timeout_s):
                return
            queue.destroy()
        # A write-through write that close left running still settles (ucm.finality): on a
        # private copy of the log from now on, never on the unmapped control plane.
        self.finality.detach()
        self.region.close()
        # The native close re-creates the lock file when this process is not the last data
        # holder to leave (a scheduler closing after its workers): remove it if now unused.
        shm_gc.collect_one(self.region.unique_id)


_QUEUE_TIER_COUNTERS = (
    "hits",
    "misses",
    "owned",
    "waited",
    "bypassed",
    "held_slots",
    "dump_refills",
)
"""Queue counters reported as the tier's own (its loads' hits and misses, how they resolved)."""

_LOCAL_RANK_SIZE_MAX = _abi.QUEUE_LOCAL_RANK_SIZE_MAX
"""The native queue's bound on ``local_rank_size`` (one holder per process)."""


def _outcome(code: int) -> Outcome:
    if code == EntryResult.OK:
        return None
    if code in (EntryResult.MISSING, EntryResult.OWNER_MISSING, EntryResult.OWNER_FAILED):
        return KeyMissingError("not in the buffer")
    if code == EntryResult.NO_SLOT:
        return NoBufferSlotError("no buffer slot for the shard (NO_SLOT): every slot is in use")
    if code == EntryResult.LOCK_TIMEOUT:
        return BufferLockTimeoutError(
            "a bucket lock of the buffer stayed held by a live process past the lock timeout"
        )
    if code == EntryResult.NO_MEMORY:
        return TierError("out of shared memory (/dev/shm) while faulting the buffer slot in")
    return TierError(f"the buffer could not serve the shard ({EntryResult(code).name})")


class _TaskMemory:
    """A plain Tier call's views as the native queue's flat address array: each view that is
    one of the layout's tensors in place is used directly, other shapes go through a staging
    shard (gathered before a dump, scattered after a load)."""

    def __init__(
        self, sizes: tuple[int, ...], shards: Sequence[ShardViews], *, for_load: bool
    ) -> None:
        self.flat = array("Q")
        self._keep: list[object] = []
        self._staged: list[tuple[int, ShardViews, bytearray]] = []
        for index, views in enumerate(shards):
            addresses = _direct_addresses(views, sizes)
            if addresses is None:
                staging = bytearray(sum(sizes))
                if not for_load:
                    _gather(views, staging)
                self._staged.append((index, views, staging))
                self._keep.append(staging)
                base = ctypes.addressof(ctypes.c_char.from_buffer(staging))
                offset = 0
                addresses = []
                for size in sizes:
                    addresses.append(base + offset)
                    offset += size
            else:
                self._keep.append(views)
            self.flat.extend(addresses)

    def scatter(self, loaded: Sequence[int]) -> None:
        """After a load: staged shards into their views (for the keys in ``loaded``)."""
        chosen = set(loaded)
        for index, views, staging in self._staged:
            if index not in chosen:
                continue
            offset = 0
            for view in views:
                flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
                flat[:] = staging[offset : offset + flat.nbytes]
                offset += flat.nbytes


def _direct_addresses(views: ShardViews, sizes: tuple[int, ...]) -> list[int] | None:
    """Each view's address when the views are exactly the layout's tensors, contiguous and
    writable (a read-only source is staged: no address is taken of it)."""
    if len(views) != len(sizes):
        return None
    addresses = []
    for view, size in zip(views, sizes, strict=True):
        if view.nbytes != size or not view.c_contiguous or view.readonly:
            return None
        addresses.append(ctypes.addressof(ctypes.c_char.from_buffer(view)))
    return addresses


def _gather(views: ShardViews, staging: bytearray) -> None:
    offset = 0
    for view in views:
        data = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        staging[offset : offset + data.nbytes] = data
        offset += data.nbytes


@hookimpl
def register_tiers(register: Callable[[type[Tier]], None]) -> None:
    register(BufferTier)
