"""The ``buffer`` tier: the node-wide shared-memory CacheBuffer (native core).

Every rank of a node that opens the same ``unique_id`` maps the same control segment and data
segments (``ucm.native.segments``); the slot logic (owner/waiter, CLOCK, Touch, Prealloc,
batched remove) is ``ucm.native.buffer``. Beyond the plain Tier interface this tier offers
:meth:`BufferTier.load_through`, the owner/waiter load path the Store uses when the buffer is the
top of the stack: each missing shard is loaded from below exactly once node-wide, by whichever
rank claims its slot first, while every other rank asking for it sleeps on the slot's futex.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import Field, PositiveFloat

import ucm
from ucm.config import Size, TierConfig
from ucm.errors import KeyMissingError, TierError
from ucm.layout import Key
from ucm.native.buffer import BufferCore, Geometry, GetResult, State, WaitResult
from ucm.native.segments import SharedRegion
from ucm.tier import EvictSink, Outcome, ShardViews, Tier, TierContext

SEGMENT_TARGET_BYTES = 1 << 30
"""Data segments of at most ~1 GiB: small enough to create quickly, large enough to be few."""

BUFFER_CTRL_LAYOUT_VERSION = 1

Fill = Callable[[list[Key], list[ShardViews]], tuple[dict[Key, BaseException], list[int]]]
"""Loads keys from the tiers below into the views; returns failures and, per key, the position
of the tier that served it (-1 if none)."""


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
        self.core = BufferCore.attach(self.region.ctrl_address, self.region.ctrl_bytes, geometry)
        self.bases = [self.region.segment_address(i) for i in range(geometry.segment_count)]
        # Slot ownership is recorded per process: threads of one rank go through one at a time.
        self._lock = threading.Lock()
        self._counts = {"bypassed": 0, "waited": 0, "owned": 0, "write_back_failures": 0}

    # ---- slot memory ------------------------------------------------------------------------

    def _slot_views(self, slots: Sequence[int]) -> list[memoryview]:
        if not slots:
            return []
        size = self.layout.shard_size
        addresses = self.core.slot_addresses(list(slots), self.bases)
        if any(address == 0 for address in addresses):
            raise TierError("the scheduler role has no data plane: it cannot move shard bytes")
        return [
            memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")
            for address in addresses
        ]

    @staticmethod
    def _copy_out(slot: memoryview, views: ShardViews) -> None:
        offset = 0
        for view in views:
            view[:] = slot[offset : offset + len(view)]
            offset += len(view)

    @staticmethod
    def _copy_in(slot: memoryview, views: ShardViews) -> None:
        offset = 0
        for view in views:
            slot[offset : offset + len(view)] = view
            offset += len(view)

    def _write_back(self, slots: Sequence[int], victims: list[tuple[int, Key]]) -> None:
        """Writes evicted Ready shards (still in their old slot) to `write: back` tiers."""
        sink: EvictSink | None = self.context.evict_sink
        if sink is None or not victims:
            return
        slot_views = self._slot_views([slots[i] for i, _ in victims])
        outcomes = sink([key for _, key in victims], [[view] for view in slot_views])
        self._counts["write_back_failures"] += sum(1 for o in outcomes if o is not None)

    # ---- the owner/waiter load path ---------------------------------------------------------

    def _chunk_keys(self) -> int:
        # A batch holds a reference on every slot it gets until it releases them: keep batches
        # to half the regular pool so a task larger than the buffer still finds free slots.
        return max(1, min(1024, self.geometry.slot_count_regular // 2))

    def load_through(
        self, keys: Sequence[Key], destinations: Sequence[ShardViews], fill: Fill
    ) -> tuple[dict[Key, BaseException], list[int]]:
        """Loads keys into caller memory through the buffer: hits are copied out, claimed slots
        are filled from below (``fill``) and published, keys another rank is filling are
        waited for. Returns failures and per key the position that served it (0 = buffer)."""
        failures: dict[Key, BaseException] = {}
        served_by: list[int] = []
        size = self._chunk_keys()
        for start in range(0, len(keys), size):
            chunk_failures, chunk_served = self._load_chunk(
                keys[start : start + size], destinations[start : start + size], fill
            )
            failures.update(chunk_failures)
            served_by.extend(chunk_served)
        return failures, served_by

    def _load_chunk(
        self, keys: Sequence[Key], destinations: Sequence[ShardViews], fill: Fill
    ) -> tuple[dict[Key, BaseException], list[int]]:
        served_by = [-1] * len(keys)
        failures: dict[Key, BaseException] = {}
        with self._lock:
            batch = self.core.get(list(keys), evicted=self.context.evict_sink is not None)
            slots = list(batch.slots)
            results = [GetResult(code) for code in batch.results]
            self._write_back(slots, batch.evicted)
            owned = [i for i, r in enumerate(results) if r is GetResult.OWNER]
            waiting = [i for i, r in enumerate(results) if r is GetResult.WAITER]
            bypass = [i for i, r in enumerate(results) if r > GetResult.WAITER]
            try:
                for i in (i for i, r in enumerate(results) if r is GetResult.HIT):
                    served_by[i] = 0
                self._copy_hits(slots, keys, destinations, served_by)
                self._fill_owned(owned, slots, keys, destinations, fill, served_by, failures)
                if waiting:
                    self._counts["waited"] += len(waiting)
                    states = self.core.wait([slots[i] for i in waiting], self.cfg.wait_timeout_s)
                    takeover = []
                    for i, state in zip(waiting, states, strict=True):
                        if state is WaitResult.READY:
                            served_by[i] = 0
                        elif state is WaitResult.TAKEOVER:
                            takeover.append(i)
                        else:  # failed by its owner, timed out, or lock trouble: load it here
                            bypass.append(i)
                    self._copy_hits(slots, keys, destinations, served_by, only=waiting)
                    self._fill_owned(takeover, slots, keys, destinations, fill, served_by, failures)
            finally:
                self.core.release(batch.held_slots())
        if bypass:
            # No slot for them (all in use) or their owner failed: straight from below.
            self._counts["bypassed"] += len(bypass)
            bypass_failures, bypass_served = fill(
                [keys[i] for i in bypass], [destinations[i] for i in bypass]
            )
            failures.update(bypass_failures)
            for i, position in zip(bypass, bypass_served, strict=True):
                served_by[i] = position
        return failures, served_by

    def _copy_hits(
        self,
        slots: list[int],
        keys: Sequence[Key],
        destinations: Sequence[ShardViews],
        served_by: list[int],
        only: Sequence[int] | None = None,
    ) -> None:
        chosen = [i for i in (only if only is not None else range(len(keys))) if served_by[i] == 0]
        for i, view in zip(chosen, self._slot_views([slots[i] for i in chosen]), strict=True):
            self._copy_out(view, destinations[i])

    def _fill_owned(
        self,
        owned: list[int],
        slots: list[int],
        keys: Sequence[Key],
        destinations: Sequence[ShardViews],
        fill: Fill,
        served_by: list[int],
        failures: dict[Key, BaseException],
    ) -> None:
        if not owned:
            return
        self._counts["owned"] += len(owned)
        slot_views = self._slot_views([slots[i] for i in owned])
        owned_failures, owned_served = fill(
            [keys[i] for i in owned], [[view] for view in slot_views]
        )
        states = []
        for i, view, position in zip(owned, slot_views, owned_served, strict=True):
            if position >= 0:
                self._copy_out(view, destinations[i])
                served_by[i] = position
                states.append(State.READY)
            else:
                failures[keys[i]] = owned_failures[keys[i]]
                states.append(State.FAILED)
        self.core.commit([slots[i] for i in owned], states)

    # ---- the Tier interface ----------------------------------------------------------------

    def lookup(self, keys: Sequence[Key]) -> list[bool]:
        return self.core.lookup(list(keys))

    def lookup_blocks(self, block_ids: Sequence[bytes]) -> list[bool]:
        return self.core.lookup_blocks(list(block_ids), self.layout.shards_per_block)

    def load(self, keys: Sequence[Key], destinations: Sequence[ShardViews]) -> list[Outcome]:
        """Copies out the keys that are Ready; everything else is a miss (nothing is claimed)."""

        def nothing_below(
            keys_below: list[Key], _views: list[ShardViews]
        ) -> tuple[dict[Key, BaseException], list[int]]:
            miss = KeyMissingError("not in the buffer")
            return {key: miss for key in keys_below}, [-1] * len(keys_below)

        failures, _ = self.load_through(keys, destinations, nothing_below)
        return [failures.get(key) for key in keys]

    def dump(self, keys: Sequence[Key], sources: Sequence[ShardViews]) -> list[Outcome]:
        """Writes each shard into a claimed slot and publishes it Ready. A key that is already
        Ready (or being filled by another rank) is left as it is: a key's bytes never change."""
        outcomes: list[Outcome] = []
        size = self._chunk_keys()
        for start in range(0, len(keys), size):
            outcomes.extend(
                self._dump_chunk(keys[start : start + size], sources[start : start + size])
            )
        return outcomes

    def _dump_chunk(self, keys: Sequence[Key], sources: Sequence[ShardViews]) -> list[Outcome]:
        outcomes: list[Outcome] = [None] * len(keys)
        with self._lock:
            batch = self.core.get(list(keys), evicted=self.context.evict_sink is not None)
            slots = list(batch.slots)
            results = [GetResult(code) for code in batch.results]
            try:
                self._write_back(slots, batch.evicted)
                owned = [i for i, r in enumerate(results) if r is GetResult.OWNER]
                for i, view in zip(owned, self._slot_views([slots[i] for i in owned]), strict=True):
                    self._copy_in(view, sources[i])
                self.core.commit([slots[i] for i in owned], [State.READY] * len(owned))
                for i, result in enumerate(results):
                    if result > GetResult.WAITER:
                        outcomes[i] = TierError(
                            f"no buffer slot for the shard ({result.name}): every slot is in use"
                        )
            finally:
                self.core.release(batch.held_slots())
        return outcomes

    def prealloc(self, keys: Sequence[Key]) -> None:
        with self._lock:
            self.core.prealloc(list(keys))

    def touch(self, block_ids: Sequence[bytes]) -> None:
        self.core.touch(list(block_ids))

    def batched_remove(self, keys: Sequence[Key], force: bool = False) -> int:
        with self._lock:
            return self.core.remove(list(dict.fromkeys(keys)), force=force)

    def stats(self) -> dict[str, int | float]:
        counters: dict[str, int | float] = dict(self.core.stats())
        counters.update(self._counts)
        counters["capacity_slots"] = self.geometry.slot_count_regular
        counters["reserved_slots"] = self.geometry.slot_count_reserved
        return counters

    def close(self) -> None:
        self.region.close()


@ucm.hookimpl
def register_tiers(register: Callable[[type[Tier]], None]) -> None:
    register(BufferTier)
