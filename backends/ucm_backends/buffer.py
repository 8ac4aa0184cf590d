"""The ``buffer`` tier: the node-wide shared-memory CacheBuffer (native core).

Every rank of a node that opens the same ``unique_id`` maps the same control segment and data
segments (``ucm.native.segments``); the slot logic (owner/waiter, CLOCK, Touch, Prealloc,
batched remove) is ``ucm.native.buffer``. Beyond the plain Tier interface this tier offers the
slot protocol the rank's LoadQueue drives (``ucm.loadqueue``): :meth:`BufferTier.claim` (batched
Get), :meth:`~BufferTier.commit`, :meth:`~BufferTier.wait_slots`, :meth:`~BufferTier.release`,
:meth:`~BufferTier.prewarm` and the slot addresses, so that each missing shard is loaded from
below exactly once node-wide, by whichever rank claims its slot first, while every other rank
asking for it sleeps on the slot's futex. The queue and tuning keys of this tier's config
(``load_workers``, ``step_keys``, queue depths, ``prealloc``...) configure that LoadQueue.

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
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import Field, PositiveFloat

import ucm
from ucm.config import Size, TierConfig
from ucm.errors import KeyMissingError, TierError
from ucm.layout import Key
from ucm.native import buffer as native_buffer
from ucm.native.buffer import (
    BufferCore,
    Geometry,
    GetBatch,
    GetResult,
    KeyBatch,
    PreallocResult,
    State,
    WaitResult,
)
from ucm.native.memcopy import CopyRanges
from ucm.native.segments import SharedRegion
from ucm.tier import EvictSink, Outcome, ShardViews, Tier, TierContext

ShardRanges = Sequence[tuple[int, int]]
"""A shard's source as (address, nbytes) per tensor: what the Store's dump queue holds."""
ShardSource = ShardViews | ShardRanges

SEGMENT_TARGET_BYTES = 1 << 30
"""Data segments of at most ~1 GiB: small enough to create quickly, large enough to be few."""
SEGMENTS_MAX = 256
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


class BufferTierConfig(TierConfig):
    type: Literal["buffer"] = "buffer"
    capacity: Size = Field(description="Bytes of regular slots (at least one shard).")
    reserved_slots: int = Field(
        default=0, ge=0, description="Extra slots used by Prealloc and dumps when the pool is full."
    )
    wait_timeout_s: PositiveFloat = Field(
        default=30.0,
        description="Longest a rank waits for another rank's load before loading it itself.",
    )
    prealloc: bool = Field(
        default=True,
        description="Prewarm (block, index + 1) of each loaded block in the dispatcher's idle "
        "window (seed 3.4).",
    )
    load_queue_depth: int = Field(
        default=64, ge=1, description="Load tasks queued for the dispatcher before load() blocks."
    )
    dump_queue_depth: int = Field(
        default=64, ge=1, description="Dump tasks queued for the dump thread before dump() blocks."
    )
    queue_timeout_s: PositiveFloat = Field(
        default=60.0,
        description="Longest load()/dump() blocks on a full queue before raising TimeoutError.",
    )
    load_workers: int = Field(
        default=4, ge=1, le=256, description="Concurrent loads from the tiers below, per rank."
    )
    step_keys: int = Field(
        default=1024,
        ge=1,
        description="Most keys one dispatcher step claims (one batched Get).",
    )
    rearrange: bool = Field(
        default=True,
        description="Walk each load task in RearrangeIndex order (false: natural order, kept "
        "only to measure what the rotation buys).",
    )
    write_queue_bytes: Size = Field(
        default=256 * 1024 * 1024,
        description="Bytes of dumped shards waiting for write-through before dump tasks block.",
    )
    dirty_max: Size = Field(
        default=256 * 1024 * 1024,
        description="Most bytes of acknowledged dumps that the `write: back` tiers below may "
        "still lack (write-back debt, node-wide); a dump waits for write-back beyond it, so a "
        "kill -9 of every rank loses at most this much. Capped at half the regular slots.",
    )
    flush_interval_s: PositiveFloat = Field(
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
        segment_bytes = geometry.segment_size_bytes
        role: Literal["worker", "scheduler"] = "scheduler" if context.is_scheduler else "worker"

        def init(region: SharedRegion) -> None:
            BufferCore.create(region.ctrl_address, region.ctrl_bytes, geometry)

        self.region = SharedRegion.open(
            context.unique_id,
            ctrl_bytes=geometry.ctrl_size_bytes,
            data_bytes=segment_bytes * geometry.segment_count,
            segment_bytes=segment_bytes,
            role=role,
            init=init,
            ctrl_layout_version=BUFFER_CTRL_LAYOUT_VERSION,
        )
        try:
            self.core = BufferCore.attach(
                self.region.ctrl_address, self.region.ctrl_bytes, geometry
            )
        except BaseException:
            self.region.close()  # a refused attach must not keep the segments mapped
            raise
        if not context.is_scheduler:
            # A rank (re)joining frees what ranks killed earlier still held, so a restart
            # never inherits leaked references even if the buffer never fills up.
            self.core.reclaim_dead()
        self.bases = [self.region.segment_address(i) for i in range(geometry.segment_count)]
        # The data plane stays mapped until close: tiers below may register it once (RDMA,
        # Mooncake) instead of per call (ucm.tier.HOST_MEMORY_OPTION). A scheduler has none.
        self.host_memory: tuple[tuple[int, int], ...] = (
            ((self.region.data_address, self.region.data_bytes),)
            if self.region.data_address
            else ()
        )
        # References and ownership are recorded per process in the native core, so the threads
        # of one rank share them here, under `_lock` together with the native call that changes
        # them: `_refs` counts this process's uses of each slot it holds (the native reference
        # is dropped with the last use: an early release by one thread would read as the owner
        # giving up), `_local_owned` maps each key this process owns and has not committed.
        self._lock = threading.Lock()
        self._local_owned: dict[Key, int] = {}
        self._refs: dict[int, int] = {}
        self._ready: set[int] = set()
        """Slots held here that are known Ready (a Ready shard never changes while held)."""
        self._counts = {
            "bypassed": 0,
            "waited": 0,
            "owned": 0,
            "write_back_failures": 0,
            "get_native_ns": 0,
            "get_native_keys": 0,
            "hits": 0,
            "misses": 0,
            "written_back_shards": 0,
        }
        self._counts_lock = threading.Lock()
        # Write-back debt: dumps commit dirty when `write: back` tiers below must get them.
        self._sink: EvictSink | None = None if context.is_scheduler else context.evict_sink
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

    def count(self, name: str, amount: int = 1) -> None:
        with self._counts_lock:
            self._counts[name] = self._counts.get(name, 0) + amount

    # ---- slot memory ------------------------------------------------------------------------

    def slot_addresses(self, slots: Sequence[int]) -> list[int]:
        if not slots:
            return []
        addresses = list(self.core.slot_addresses(list(slots), self.bases))
        if any(address == 0 for address in addresses):
            raise TierError("the scheduler role has no data plane: it cannot move shard bytes")
        return addresses

    def slot_views(self, slots: Sequence[int]) -> list[memoryview]:
        size = self.layout.shard_size
        return [
            memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")
            for address in self.slot_addresses(slots)
        ]

    def copy_out(self, addresses: Sequence[int], destinations: Sequence[ShardViews]) -> None:
        """Each slot's bytes (``addresses[i]``) into ``destinations[i]``, every view of the
        batch in one native call (one ``ctypes.memmove`` per view would give up and win back
        the GIL once per tensor)."""
        ranges = CopyRanges()
        for address, views in zip(addresses, destinations, strict=True):
            for view in views:
                target = _address_of(view)
                if target is None:
                    raise TierError("cannot load into a read-only destination")
                ranges.add(target, address, view.nbytes)
                address += view.nbytes
        ranges.copy()

    def copy_in(self, addresses: Sequence[int], sources: Sequence[ShardSource]) -> None:
        """Each source's bytes into the slot at ``addresses[i]``, in one native call; read-only
        views (``bytes``) go through a view of the slot instead."""
        ranges = CopyRanges()
        for address, parts in zip(addresses, sources, strict=True):
            for part in parts:
                if type(part) is tuple:
                    source, n = part
                else:
                    assert isinstance(part, memoryview)
                    n = part.nbytes
                    view_address = _address_of(part)
                    if view_address is None:
                        slot = memoryview((ctypes.c_ubyte * n).from_address(address)).cast("B")
                        slot[:] = part.cast("B")
                        address += n
                        continue
                    source = view_address
                ranges.add(address, source, n)
                address += n
        ranges.copy()

    # ---- slot protocol for the load and dump queues ----------------------------------------

    def claim(self, keys: Sequence[Key], for_load: bool = True) -> GetBatch:
        """Batched Get. The native core records one reference per process and slot, so the
        threads of this process share it through a local count (``_refs``): a key this process
        already holds (``HELD``) is reported as HIT when Ready and as WAITER otherwise (another
        rank or thread is filling it), with the local count raised. OWNER results are recorded
        as owned here."""
        batch_keys = KeyBatch.of(keys)
        with self._lock:
            started = time.perf_counter_ns()
            batch = self.core.get(batch_keys)
            self._counts["get_native_ns"] += time.perf_counter_ns() - started
            self._counts["get_native_keys"] += len(batch_keys)
            results = batch.results
            refs = self._refs
            for i, result in enumerate(results):
                if result > _WAITER and result != _HELD:
                    continue  # nothing taken
                slot = batch.slots[i]
                refs[slot] = refs.get(slot, 0) + 1
                if result == _HIT:
                    self._ready.add(slot)
                elif result == _OWNER:
                    self._local_owned[keys[i]] = slot
                elif result == _HELD:
                    ready = slot in self._ready or (
                        keys[i] not in self._local_owned
                        and self.core.slot_info(slot).state is State.READY
                    )
                    results[i] = _HIT if ready else _WAITER
        if for_load:  # this tier's hits/misses: keys a load found Ready here, or not
            hits = sum(1 for r in batch.results if r == _HIT)
            waiting = sum(1 for r in batch.results if r == _WAITER)
            self.count("hits", hits)
            self.count("misses", len(batch.results) - hits - waiting)
        return batch

    def commit(
        self,
        keys: Sequence[Key],
        slots: Sequence[int],
        states: Sequence[State],
        dirty: bool = False,
    ) -> None:
        """Publishes owned slots; ``dirty`` marks the Ready ones as write-back debt."""
        with self._lock:
            self.core.commit(list(slots), list(states), dirty=dirty)
            for key in keys:
                self._local_owned.pop(key, None)
            self._ready.update(
                slot for slot, s in zip(slots, states, strict=True) if s is State.READY
            )

    def adopt(self, keys: Sequence[Key], slots: Sequence[int]) -> None:
        """Records slots taken over from a dead owner (Wait returned TAKEOVER)."""
        with self._lock:
            for key, slot in zip(keys, slots, strict=True):
                self._local_owned[key] = slot

    def owned_here(self, key: Key) -> bool:
        with self._lock:
            return key in self._local_owned

    def release(self, slots: Sequence[int]) -> None:
        """Drops this process's uses of the slots; the native reference goes with the last."""
        with self._lock:
            last = []
            refs = self._refs
            for slot in slots:
                count = refs.get(slot, 0)
                if count <= 1:
                    refs.pop(slot, None)
                    self._ready.discard(slot)
                    last.append(slot)
                else:
                    refs[slot] = count - 1
            if last:
                self.core.release(last)

    def wait_slots(self, keys: Sequence[Key], slots: Sequence[int]) -> list[WaitResult]:
        """Waits (futex) for slots another rank or thread fills. A timeout while the owner is a
        thread of this process is waited out again (a bounded number of times): releasing it
        Idle would hand the slot to another owner mid-fill."""
        states = self.core.wait(list(slots), self.cfg.wait_timeout_s)
        for _round in range(WAIT_ROUNDS_MAX):
            again = [
                i
                for i, state in enumerate(states)
                if state is WaitResult.IDLE and self.owned_here(keys[i])
            ]
            if not again:
                break
            retried = self.core.wait([slots[i] for i in again], self.cfg.wait_timeout_s)
            for i, state in zip(again, retried, strict=True):
                states[i] = state
        ready = sum(1 for state in states if state is WaitResult.READY)
        self.count("hits", ready)
        self.count("misses", len(states) - ready)
        takeover = [i for i, state in enumerate(states) if state is WaitResult.TAKEOVER]
        if takeover:
            self.adopt([keys[i] for i in takeover], [slots[i] for i in takeover])
        return states

    def prewarm(self, keys: Sequence[Key]) -> list[PreallocResult]:
        """Prealloc (seed 3.4): idle slots hung for keys a later Get will probably ask for."""
        return self.core.prealloc(list(keys))

    # ---- the Tier interface ----------------------------------------------------------------

    def lookup(self, keys: Sequence[Key]) -> list[bool]:
        return self.core.lookup(list(keys))

    def lookup_blocks(self, block_ids: Sequence[bytes]) -> list[bool]:
        return self.core.lookup_blocks(list(block_ids), self.layout.shards_per_block)

    def _chunk_keys(self) -> int:
        # A batch holds a reference on every slot it gets until it releases them: keep batches
        # to half the regular pool so a task larger than the buffer still finds free slots.
        return max(1, min(self.cfg.step_keys, self.geometry.slot_count_regular // 2))

    def _chunked(
        self,
        run: Callable[[Sequence[Key], Sequence[Any]], list[Outcome]],
        keys: Sequence[Key],
        views: Sequence[Any],
    ) -> list[Outcome]:
        """``run`` over chunks of at most ``_chunk_keys()`` keys, outcomes in key order."""
        outcomes: list[Outcome] = []
        size = self._chunk_keys()
        for start in range(0, len(keys), size):
            outcomes.extend(run(keys[start : start + size], views[start : start + size]))
        return outcomes

    def load(self, keys: Sequence[Key], destinations: Sequence[ShardViews]) -> list[Outcome]:
        """Copies out the keys that are Ready (waiting for ones being filled); everything else
        is a miss. A key claimed here with nothing to fill it is failed at once (not kept)."""
        return self._chunked(self._load_chunk, keys, destinations)

    def _load_chunk(self, keys: Sequence[Key], destinations: Sequence[ShardViews]) -> list[Outcome]:
        miss = KeyMissingError("not in the buffer")
        outcomes: list[Outcome] = [miss] * len(keys)
        batch = self.claim(keys)
        slots = list(batch.slots)
        results = [GetResult(code) for code in batch.results]
        ready = [i for i, r in enumerate(results) if r is GetResult.HIT]
        owned = [i for i, r in enumerate(results) if r is GetResult.OWNER]
        waiting = [i for i, r in enumerate(results) if r is GetResult.WAITER]
        try:
            if owned:  # nothing below this tier here: give the claimed slots back as failed
                self.commit(
                    [keys[i] for i in owned], [slots[i] for i in owned], [State.FAILED] * len(owned)
                )
            if waiting:
                states = self.wait_slots([keys[i] for i in waiting], [slots[i] for i in waiting])
                taken = []
                for i, state in zip(waiting, states, strict=True):
                    if state is WaitResult.READY:
                        ready.append(i)
                    elif state is WaitResult.TAKEOVER:
                        taken.append(i)
                if taken:
                    self.commit(
                        [keys[i] for i in taken],
                        [slots[i] for i in taken],
                        [State.FAILED] * len(taken),
                    )
            self.copy_out(
                self.slot_addresses([slots[i] for i in ready]), [destinations[i] for i in ready]
            )
            for i in ready:
                outcomes[i] = None
        finally:
            self.release(batch.held_slots())
        return outcomes

    def dump(self, keys: Sequence[Key], sources: Sequence[ShardViews]) -> list[Outcome]:
        """Writes each shard into a claimed slot and publishes it Ready. A key already Ready
        is rewritten unless a rank is reading it (then it keeps its bytes, which for a KV block
        id are the same); a key another rank is filling right now is left to that rank.

        With ``write: back`` tiers below, the slots are committed dirty, and the call returns
        only once the node's write-back debt is within ``dirty_max`` (see the module doc)."""
        return self._dump(keys, sources)

    def dump_ranges(self, keys: Sequence[Key], sources: Sequence[ShardRanges]) -> list[Outcome]:
        """``dump`` from (address, nbytes) ranges: the Store's dump queue already holds its
        tensors' addresses, and a view per tensor, made and read back, costs ~3 us each."""
        return self._dump(keys, sources)

    def _dump(self, keys: Sequence[Key], sources: Sequence[ShardSource]) -> list[Outcome]:
        outcomes = self._chunked(self._dump_chunk, keys, sources)
        if self._sink is not None:
            self._last_dump_ns = time.monotonic_ns()
            try:
                self.settle(self.dirty_limit_slots)
            except TierError as exc:
                # The shards are in the buffer (dirty, flushed later) but not acknowledged.
                return [exc if outcome is None else outcome for outcome in outcomes]
        return outcomes

    def _dump_chunk(self, keys: Sequence[Key], sources: Sequence[ShardSource]) -> list[Outcome]:
        outcomes: list[Outcome] = [None] * len(keys)
        if self._sink is not None:
            # Room first: after this chunk's commits the debt must still be within the bound.
            # While the write-back tiers fail, new dumps fail rather than pile up debt that
            # nothing can pay (and that eviction may never take).
            try:
                self.settle(max(0, self.dirty_limit_slots - len(keys)))
            except TierError as exc:
                return [exc] * len(keys)
        # Keys a thread of this process is filling right now get the same bytes from it.
        with self._lock:
            chosen = [keys[i] for i, key in enumerate(keys) if key not in self._local_owned]
        source_of = {key: sources[i] for i, key in enumerate(keys)}
        index_of = {key: i for i, key in enumerate(keys)}
        batch = self.claim(chosen, for_load=False)
        present = [key for key, r in zip(chosen, batch.results, strict=True) if r == _HIT]
        self._fill_claimed(chosen, batch, source_of, index_of, outcomes)
        if present:
            # Already Ready: a dump replaces a key's bytes (the Tier contract). Its slot may be
            # in use (another rank copying out of it): remove only what is not in use, then
            # claim the removed keys afresh; a key still in use keeps its (equal) bytes.
            self.core.remove(present, force=False)
            again = self.claim(present, for_load=False)
            self._fill_claimed(present, again, source_of, index_of, outcomes)
        return outcomes

    def _fill_claimed(
        self,
        keys: list[Key],
        batch: GetBatch,
        source_of: dict[Key, ShardSource],
        index_of: dict[Key, int],
        outcomes: list[Outcome],
    ) -> None:
        """Copies the sources into the slots claimed as OWNER, publishes them Ready (dirty,
        with write-back tiers below) and releases every reference the batch took. A key that
        got no slot goes straight to the write-back tiers when there are any."""
        slots = list(batch.slots)
        try:
            owned = [j for j, r in enumerate(batch.results) if r == _OWNER]
            self.copy_in(
                self.slot_addresses([slots[j] for j in owned]), [source_of[keys[j]] for j in owned]
            )
            self.commit(
                [keys[j] for j in owned],
                [slots[j] for j in owned],
                [State.READY] * len(owned),
                dirty=self._sink is not None,
            )
            refused = [j for j, result in enumerate(batch.results) if result > _WAITER]
            for j in refused:
                outcomes[index_of[keys[j]]] = TierError(
                    f"no buffer slot for the shard ({GetResult(batch.results[j]).name}): every "
                    "slot is in use"
                )
            if refused and self._sink is not None:
                written = self._sink(
                    [keys[j] for j in refused], [_views_of(source_of[keys[j]]) for j in refused]
                )
                for j, outcome in zip(refused, written, strict=True):
                    if outcome is None:
                        outcomes[index_of[keys[j]]] = None
                self.count("written_down_unbuffered", sum(1 for o in written if o is None))
        finally:
            self.release(batch.held_slots())

    # ---- write-back debt ---------------------------------------------------------------------

    def dirty_slots(self) -> int:
        """Slots holding write-back debt, node-wide (every rank's dumps)."""
        return self.core.stats()["dirty_slots"]

    def flush_some(self, limit: int = FLUSH_BATCH_SLOTS) -> tuple[int, int]:
        """Claims up to ``limit`` dirty slots, writes them to the ``write: back`` tiers and
        cleans the ones written. Returns (claimed, written): a slot removed while it was being
        written counts as written (its debt went with it), only a tier's failure does not."""
        assert self._sink is not None
        with self._lock:
            batch = self.core.take_dirty(max(1, limit))
            for slot in batch.slots:  # this process's uses of the slot (see claim)
                self._refs[slot] = self._refs.get(slot, 0) + 1
                self._ready.add(slot)
        if not batch.keys:
            return 0, 0
        try:
            views = self.slot_views(list(batch.slots))
            try:
                outcomes = list(self._sink(batch.keys, [[view] for view in views]))
            except Exception as exc:  # a raising tier fails the batch, it stays dirty
                outcomes = [exc] * len(batch.keys)
            written = [outcome is None for outcome in outcomes]
            cleaned = self.core.clean(batch.slots, written)
        finally:
            self.release(list(batch.slots))
        failed = len(batch.keys) - sum(written)
        self.count("written_back_shards", sum(written))
        self.count("write_back_failures", failed)
        if failed:
            first = next(o for o in outcomes if o is not None)
            self._last_write_back_error = first
        assert cleaned <= sum(written)
        return len(batch.keys), sum(written)

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

    def flush(self) -> None:
        """At close: stops the background flusher; the last rank attached to the buffer then
        writes every dirty slot down (the others leave the debt to the ranks that remain)."""
        if self._sink is None or self._flusher is None:
            return
        self._flusher_stop.set()
        self._flusher.join()
        self._flusher = None
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

    def batched_remove(self, keys: Sequence[Key], force: bool = False) -> int:
        """Removes the keys (native: one bucket-lock pass per chunk). Keys pinned through
        ``Tier.pins`` and slots in use by any rank are kept unless ``force``."""
        unique = list(dict.fromkeys(keys))
        if not force:
            unique = [key for key in unique if not self.pins.is_pinned(key)]
        if not unique:
            return 0
        return self.core.remove(unique, force=force)

    def stats(self) -> dict[str, int | float]:
        """Node-wide native counters (Get hits and misses as ``get_hits``/``get_misses``, every
        rank's loads and dumps together) and this process's counters: ``hits``/``misses`` are
        the keys its loads found Ready here or not (the Tier stats contract)."""
        counters: dict[str, int | float] = dict(self.core.stats())
        counters["get_hits"] = counters.pop("hits")
        counters["get_misses"] = counters.pop("misses")
        with self._counts_lock:
            counters.update(self._counts)
        counters["capacity_slots"] = self.geometry.slot_count_regular
        counters["reserved_slots"] = self.geometry.slot_count_reserved
        counters["dirty_bytes"] = counters["dirty_slots"] * self.layout.shard_size
        counters["dirty_limit_bytes"] = self.dirty_limit_slots * self.layout.shard_size
        return counters

    def close(self) -> None:
        if self._flusher is not None:  # flush() was not called (a failed open, a test)
            self._flusher_stop.set()
            self._flusher.join()
            self._flusher = None
        self.region.close()


_HIT, _OWNER, _WAITER = int(GetResult.HIT), int(GetResult.OWNER), int(GetResult.WAITER)
_HELD = 5
"""``GetResult.HELD`` of the native core: this process already holds the slot."""

WAIT_ROUNDS_MAX = 8
"""Times a wait on a slot owned by a thread of this process is renewed before giving up."""


def _views_of(source: ShardSource) -> list[memoryview]:
    """A shard's source (views, or (address, nbytes) ranges) as memoryviews."""
    views = []
    for part in source:
        if type(part) is tuple:
            address, nbytes = part
            views.append(memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B"))
        else:
            assert isinstance(part, memoryview)
            views.append(part)
    return views


def _address_of(view: memoryview) -> int | None:
    """Address of a writable contiguous memoryview's first byte (None if read-only or empty)."""
    if view.readonly or not view.nbytes:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@ucm.hookimpl
def register_tiers(register: Callable[[type[Tier]], None]) -> None:
    register(BufferTier)
