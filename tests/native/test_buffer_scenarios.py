"""The native CacheBuffer in one process: seed Scenarios C, D and E with the exact slots, bits and
cursor positions the seed narrates, plus addressing, geometry validation, lookup, touch and the
batched remove of seed 003."""

from __future__ import annotations

import os
import re
from array import array
from typing import Any

import pytest
from buffer_shm import RemoteRank, ShmRegion, block, shared_buffer

from ucm.errors import InvalidArgumentError
from ucm.native.buffer import (
    CTRL_LAYOUT_VERSION,
    DETACHED,
    SLOT_NONE,
    BufferCore,
    CommitResult,
    Geometry,
    GetResult,
    Pool,
    PreallocResult,
    State,
    WaitResult,
)

H, OWN, W, NO = GetResult.HIT, GetResult.OWNER, GetResult.WAITER, GetResult.NO_SLOT


def bits(core: BufferCore, count: int) -> list[int]:
    return [int(core.slot_info(slot).accessed) for slot in range(count)]


def load(core: BufferCore, keys: list[tuple[bytes, int]]) -> list[int]:
    """Misses that this rank owns: claim, commit Ready, release. Returns the slots."""
    got = core.get(keys)
    assert list(got.results) == [OWN] * len(keys)
    assert core.commit(got.slots, [State.READY] * len(keys)) == [CommitResult.OK] * len(keys)
    core.release(got.slots)
    return list(got.slots)


def test_scenario_c_clock_preserves_a_hit_block() -> None:
    geometry = Geometry(shard_size_bytes=64, slot_count_regular=4, bucket_count=16)
    a, b, c, d, e, f = ((block(name), 0) for name in "ABCDEF")
    with shared_buffer(geometry) as shared:
        core = shared.core
        # Loaded A/B/C/D in turn: each new load sets its bit; the cursor stays at slot 0.
        assert [load(core, [key])[0] for key in (a, b, c, d)] == [0, 1, 2, 3]
        assert bits(core, 4) == [1, 1, 1, 1]
        assert core.cursor() == 0

        # Miss E: one lap clears every bit, falls back to the raw cursor: slot 0 (A) is the victim.
        got = core.get([e])
        assert (list(got.results), list(got.slots)) == ([OWN], [0])
        assert core.slot_of(a) is None  # a was the victim
        assert bits(core, 4) == [1, 0, 0, 0]  # E just loaded; B/C/D swept
        assert core.cursor() == 1
        core.commit(got.slots, [State.READY])
        core.release(got.slots)

        # Someone Gets B (slot 1): the hit sets slot 1's bit again.
        hit = core.get([b])
        assert (list(hit.results), list(hit.slots)) == ([H], [1])
        assert bits(core, 4) == [1, 1, 0, 0]
        core.release(hit.slots)

        # Miss F: slot 1 (B) gets its second chance, slot 2 (C, bit 0) is the victim.
        got = core.get([f])
        assert (list(got.results), list(got.slots)) == ([OWN], [2])
        assert core.slot_of(c) is None  # c was the victim
        assert core.cursor() == 3
        assert bits(core, 4) == [1, 0, 1, 0]
        core.commit(got.slots, [State.READY])
        core.release(got.slots)
        assert core.lookup([a, b, c, d, e, f]) == [False, True, False, True, True, True]
        stats = core.stats()
        assert (stats["hits"], stats["misses"], stats["evictions"]) == (1, 6, 2)


def test_scenario_d_touch_preserves_all_shards_of_a_block() -> None:
    geometry = Geometry(shard_size_bytes=64, slot_count_regular=6, bucket_count=16)
    t = block("T")
    t_keys = [(t, 0), (t, 1), (t, 2)]
    u, v, w, m, x = ((block(name), 0) for name in "UVWMX")
    with shared_buffer(geometry) as shared:
        core = shared.core
        got = core.get([*t_keys, u, v, w])
        assert list(got.results) == [OWN] * 6
        assert list(got.slots) == [0, 1, 2, 3, 4, 5]
        core.commit(got.slots, [State.READY] * 6)
        assert bits(core, 6) == [1] * 6
        # One miss sweeps every new-load bit clear. The copier still holds all six slots, so
        # there is no victim: the miss reports NO_SLOT and the cursor is back at slot 0.
        swept = core.get([m])
        assert (list(swept.results), list(swept.slots)) == ([NO], [SLOT_NONE])
        assert bits(core, 6) == [0] * 6
        assert core.cursor() == 0
        core.release(got.slots)

        # Touch T: walk T's bucket chain and set the bit of every resident shard of T.
        assert core.touch([t]) == 3
        assert bits(core, 6) == [1, 1, 1, 0, 0, 0]

        # Miss X: T.s0/s1/s2 get second chances, slot 3 (U) is the victim.
        got_x = core.get([x])
        assert (list(got_x.results), list(got_x.slots)) == ([OWN], [3])
        assert core.slot_of(u) is None  # u was the victim
        assert core.cursor() == 4
        assert bits(core, 6) == [0, 0, 0, 1, 0, 0]
        core.commit(got_x.slots, [State.READY])
        core.release(got_x.slots)
        assert core.lookup_blocks([t, u[0], v[0]], shards_per_block=3) == [True, False, False]
        assert core.lookup([*t_keys, u, v, w, x]) == [True, True, True, False, True, True, True]
        assert core.stats()["no_slot"] == 1


def test_scenario_e_prealloc_from_reserved_pool_then_fast_path() -> None:
    geometry = Geometry(
        shard_size_bytes=64, slot_count_regular=3, slot_count_reserved=3, bucket_count=16
    )
    b0, b1, b2, b3, b5 = (block(name) for name in ("B0", "B1", "B2", "B3", "B5"))
    s = 0
    with shared_buffer(geometry) as shared:
        core = shared.core
        # The task B0.s/B1.s/B2.s fills the regular pool.
        assert load(core, [(b0, s), (b1, s), (b2, s)]) == [0, 1, 2]
        # Idle window: prewarm (block, s+1) for each block of the task -> reserved pool.
        nxt = [(b0, s + 1), (b1, s + 1), (b2, s + 1)]
        assert core.prealloc(nxt) == [PreallocResult.ALLOCATED] * 3
        slots = [core.slot_of(key) for key in nxt]
        assert slots == [3, 4, 5]
        for slot in slots:
            assert slot is not None
            info = core.slot_info(slot)
            assert (info.refcount, info.state, info.reserved, info.preallocated) == (
                0,
                State.IDLE,
                True,
                True,
            )
        # Normal capacity was not crowded: the regular pool still holds the task, no eviction.
        assert core.lookup([(b0, s), (b1, s), (b2, s)]) == [True, True, True]
        assert core.lookup(nxt) == [False, False, False]  # idle is not "present"
        assert core.stats()["evictions"] == 0
        assert core.prealloc([nxt[0]]) == [PreallocResult.EXISTS]

        # Next task asks (B0, s+1): found idle with ref 0 on the chain -> owner, no victim search.
        cursor_before = core.cursor()
        got = core.get([nxt[0]])
        assert (list(got.results), list(got.slots)) == ([OWN], [3])
        assert core.cursor() == cursor_before
        assert core.stats()["prealloc_hits"] == 1
        assert not core.slot_info(3).preallocated

        # (B1, s+1) was already taken by another rank: ref > 0 -> waiter via the fast path.
        other = core.get([nxt[1]])
        assert (list(other.results), list(other.slots)) == ([OWN], [4])
        rank = RemoteRank(shared)
        assert rank.get([nxt[1]]) == ([W], [4])
        assert core.stats()["prealloc_hits"] == 2
        # This process already holds (B1, s+1): one reference per process, nothing taken.
        again = core.get([nxt[1]])
        assert (list(again.results), list(again.slots)) == ([GetResult.HELD], [4])
        assert list(again.held_slots()) == []
        assert core.slot_info(4).refcount == 2
        # B3 was not in the task: nothing was prewarmed for it.
        assert core.slot_of((b3, s + 1)) is None

        # The reserved pool is full: a new prealloc replaces the unused prewarmed (B2, s+1),
        # never a slot in use.
        assert core.prealloc([(b5, s + 1)]) == [PreallocResult.ALLOCATED]
        assert core.slot_of((b5, s + 1)) == 5
        assert core.slot_of(nxt[2]) is None
        assert core.cursor(Pool.RESERVED) == 0  # swept slots 3, 4 (in use), took 5, wrapped

        core.commit([3, 4], [State.READY, State.READY])
        assert rank.call("wait", [4], 1.0) == [WaitResult.READY]
        core.release([3, 4])
        rank.call("release", [4])
        rank.close()
        assert core.lookup(nxt[:2]) == [True, True]
        assert [core.slot_info(slot).refcount for slot in (3, 4)] == [0, 0]


@pytest.mark.parametrize(("slots_per_segment", "fast_path"), [(4, True), (3, False)])
def test_slot_addressing_shift_mask_and_div_mod(slots_per_segment: int, fast_path: bool) -> None:
    geometry = Geometry(
        shard_size_bytes=4096,
        slot_count_regular=8,
        slot_count_reserved=2,
        slots_per_segment=slots_per_segment,
    )
    region = ShmRegion(geometry.ctrl_size_bytes)
    try:
        core = BufferCore.create(region.address, region.size_bytes, geometry)
        header_shift = int.from_bytes(region.read(52, 4), "little")  # slots_per_segment_shift
        assert (header_shift != SLOT_NONE) == fast_path
        slots = list(range(10))
        expected = [(i // slots_per_segment, (i % slots_per_segment) * 4096) for i in slots]
        assert core.slot_locations(slots) == expected
        bases = [0x10_0000 * (segment + 1) for segment in range(geometry.segment_count)]
        bases[1] = 0  # a segment this process did not map: address 0
        addresses = list(core.slot_addresses(slots, bases))
        assert addresses == [
            0 if segment == 1 else bases[segment] + offset for segment, offset in expected
        ]
        with pytest.raises(InvalidArgumentError, match=re.escape("slots[1]=10 is not valid")):
            core.slot_locations([0, 10])
    finally:
        region.close()


def test_bad_geometry_says_what_to_change() -> None:
    with pytest.raises(InvalidArgumentError, match=r"shard_size_bytes=0 is not valid: expected"):
        Geometry(shard_size_bytes=0, slot_count_regular=4)
    with pytest.raises(
        InvalidArgumentError,
        match=r"slot_count_regular=0 is not valid: .*give the buffer a capacity of at least one",
    ):
        Geometry(shard_size_bytes=64, slot_count_regular=0)
    with pytest.raises(
        InvalidArgumentError,
        match=re.escape(
            "capacity_bytes=1000 is below one slot: a slot holds one shard of "
            "shard_size_bytes=4096; set the capacity to at least 4096 bytes (4.0 KiB)"
        ),
    ):
        Geometry.from_capacity(1000, 4096)
    geometry = Geometry.from_capacity(16 * 4096, 4096, reserved_slots=2)
    assert (geometry.slot_count_regular, geometry.slot_count_reserved) == (16, 2)
    assert geometry.bucket_count == 32 and geometry.segment_count == 1


def test_attach_refuses_bad_magic_layout_and_geometry() -> None:
    geometry = Geometry(shard_size_bytes=64, slot_count_regular=4, bucket_count=4)
    region = ShmRegion(geometry.ctrl_size_bytes)
    try:
        with pytest.raises(InvalidArgumentError, match=r"not an initialised UCM CacheBuffer"):
            BufferCore.attach(region.address, region.size_bytes, geometry)
        BufferCore.create(region.address, region.size_bytes, geometry)
        attached = BufferCore.attach(region.address, region.size_bytes)
        assert attached.geometry == geometry
        other = Geometry(shard_size_bytes=128, slot_count_regular=4, bucket_count=4)
        with pytest.raises(
            InvalidArgumentError,
            match=r"existing buffer has Geometry\(shard_size_bytes=64.*this rank expects "
            r"Geometry\(shard_size_bytes=128.*must use the same shard size",
        ):
            BufferCore.attach(region.address, region.size_bytes, other)
        # The binding's layout version is the one the native core writes (the segment layer
        # refuses an old segment up front by it).
        layout_version = int.from_bytes(region.read(8, 4), "little")
        assert layout_version == CTRL_LAYOUT_VERSION == 6
        region.write(8, (99).to_bytes(4, "little"))  # layout_version
        with pytest.raises(InvalidArgumentError, match=r"layout version 99"):
            BufferCore.attach(region.address, region.size_bytes, geometry)
        with pytest.raises(InvalidArgumentError, match=r"ctrl_address=3 is not valid"):
            BufferCore.attach(3, region.size_bytes)
    finally:
        region.close()


@pytest.mark.parametrize(
    ("final", "seen"),
    [(State.FAILED, WaitResult.FAILED), (State.MISSING, WaitResult.MISSING)],
)
def test_failed_load_is_not_remembered(final: State, seen: WaitResult) -> None:
    # MISSING (the owner found the key in no tier) behaves like FAILED, and says so to waiters.
    geometry = Geometry(shard_size_bytes=64, slot_count_regular=4, bucket_count=4)
    x = (block("X"), 0)
    with shared_buffer(geometry) as shared:
        core = shared.core
        owner = core.get([x])
        rank = RemoteRank(shared)
        waiter_results, waiter_slots = rank.get([x])
        assert list(owner.results) == [OWN] and waiter_results == [W]
        slot = owner.slots[0]
        assert waiter_slots == [slot]
        assert core.commit([slot], [final]) == [CommitResult.OK]
        assert core.commit([slot], [State.READY]) == [CommitResult.NOT_IDLE]
        assert rank.call("wait", waiter_slots, 1.0) == [seen]
        # Unlinked at once: nobody finds the failure, a later get retries in another slot.
        assert core.slot_info(slot).bucket == DETACHED
        assert core.lookup([x]) == [False]
        retry = core.get([x])
        assert list(retry.results) == [OWN] and retry.slots[0] != slot
        core.release([slot])
        assert core.slot_info(slot).bucket == DETACHED  # the other rank still holds it
        rank.call("release", [slot])
        rank.close()
        assert core.slot_info(slot).bucket is None  # freed by its last release
        core.commit(retry.slots, [State.READY])
        core.release(retry.slots)
        assert core.lookup([x]) == [True]


def test_owner_giving_up_lets_a_waiter_take_over() -> None:
    geometry = Geometry(shard_size_bytes=64, slot_count_regular=4, bucket_count=4)
    x = (block("X"), 0)
    with shared_buffer(geometry) as shared:
        core = shared.core
        owner = core.get([x])
        assert core.slot_info(owner.slots[0]).owner_pid == os.getpid()
        rank = RemoteRank(shared)
        _, waiter_slots = rank.get([x])
        core.release(owner.slots)  # released without committing
        assert core.slot_info(owner.slots[0]).owner_pid == 0
        assert rank.call("wait", waiter_slots, 1.0) == [WaitResult.TAKEOVER]
        assert core.stats()["takeovers"] == 1
        assert core.slot_info(owner.slots[0]).owner_pid == rank.pid
        assert rank.call("commit", waiter_slots, [State.READY]) == [CommitResult.OK]
        rank.call("release", waiter_slots)
        rank.close()
        info = core.slot_info(owner.slots[0])
        assert (info.refcount, info.state) == (0, State.READY)


def test_wait_times_out_with_live_owner() -> None:
    geometry = Geometry(shard_size_bytes=64, slot_count_regular=4, bucket_count=4)
    x = (block("X"), 0)
    with shared_buffer(geometry) as shared:
        core = shared.core
        owner = core.get([x])
        rank = RemoteRank(shared)
        _, waiter_slots = rank.get([x])
        assert rank.call("wait", waiter_slots, 0.05) == [WaitResult.IDLE]
        assert core.stats()["wait_timeouts"] == 1
        core.commit(owner.slots, [State.READY])
        core.release(owner.slots)
        rank.call("release", waiter_slots)
        rank.close()
        assert core.slot_info(owner.slots[0]).refcount == 0


def test_batched_remove_counts_and_pins() -> None:
    geometry = Geometry(shard_size_bytes=64, slot_count_regular=8, bucket_count=8)
    keys = [(block(f"R{i}"), i % 2) for i in range(6)]
    with shared_buffer(geometry) as shared:
        core = shared.core
        assert core.remove([]) == 0
        load(core, keys)
        pinned = core.get(keys[:2])  # in use: kept unless force
        assert list(pinned.results) == [H, H]
        missing = (block("absent"), 0)
        assert core.remove([*keys, keys[3], missing]) == 4  # duplicates and absent count 0
        assert core.lookup(keys) == [True, True, False, False, False, False]
        assert core.remove(keys[:2], force=True) == 2
        assert core.lookup(keys[:2]) == [False, False]
        assert [core.slot_info(slot).bucket for slot in pinned.slots] == [DETACHED, DETACHED]
        core.release(pinned.slots)
        assert [core.slot_info(slot).bucket for slot in pinned.slots] == [None, None]
        # Whole blocks: every resident shard of each block goes.
        t = block("T")
        load(core, [(t, 0), (t, 1), (t, 2)])
        assert core.remove_blocks([t, block("absent")]) == 3
        assert core.lookup_blocks([t], 3) == [False]
        assert core.stats()["removed"] == 9


def test_batched_remove_takes_one_lock_per_chunk() -> None:
    # One bucket: every key of a chunk shares the lock, so N keys take ceil(N / 1024) locks.
    geometry = Geometry(shard_size_bytes=64, slot_count_regular=3000, bucket_count=1)
    keys = [(i.to_bytes(16, "little"), 0) for i in range(3000)]
    with shared_buffer(geometry) as shared:
        core = shared.core
        for start in range(0, 3000, 1000):
            load(core, keys[start : start + 1000])
        before = core.stats()["lock_acquisitions"]
        assert core.remove(keys) == 3000
        assert core.stats()["lock_acquisitions"] - before == 3
        assert core.stats()["remove_lock_acquisitions"] == 3
        load(core, keys[:2048])
        before = core.stats()["lock_acquisitions"]
        assert core.remove_blocks([key[0] for key in keys[:2048]]) == 2048
        assert core.stats()["lock_acquisitions"] - before == 2


def test_bad_arguments_name_argument_and_value() -> None:
    geometry = Geometry(shard_size_bytes=64, slot_count_regular=4, bucket_count=4)
    with shared_buffer(geometry) as shared:
        core = shared.core
        with pytest.raises(InvalidArgumentError, match=r"keys\[1\] block id b'short' is not valid"):
            core.get([(block("A"), 0), (b"short", 0)])
        with pytest.raises(InvalidArgumentError, match=r"keys\[0\] shard index -1 is not valid"):
            core.lookup([(block("A"), -1)])
        with pytest.raises(InvalidArgumentError, match=r"block_ids\[0\]=b'x' is not valid"):
            core.touch([b"x"])
        with pytest.raises(
            InvalidArgumentError,
            match=r"slots\[0\]=2 is not valid for release: this process holds no reference",
        ):
            core.release([2])
        got = core.get([(block("A"), 0)])
        with pytest.raises(
            InvalidArgumentError, match=r"slots\[1\]=0 is not valid for release: listed twice"
        ):
            core.release([got.slots[0], got.slots[0]])
        assert core.slot_info(got.slots[0]).refcount == 0  # the first was released
        with pytest.raises(InvalidArgumentError, match=r"states\[0\]=<State.IDLE: 0> is not"):
            core.commit([0], [State.IDLE])
        with pytest.raises(InvalidArgumentError, match=r"states\[1\]='x' is not valid"):
            core.commit([0, 1], [State.READY, "x"])  # type: ignore[list-item]
        with pytest.raises(InvalidArgumentError, match=r"states\[0\]=1.0 is not valid"):
            core.commit([0], [1.0])  # type: ignore[list-item]
        with pytest.raises(InvalidArgumentError, match=r"states\[0\]=300 is not valid"):
            core.commit([0], [300])  # type: ignore[list-item]
        with pytest.raises(InvalidArgumentError, match="states has 2 entries, slots has 1"):
            core.commit([0], [State.READY, State.READY])
        assert core.slot_info(0).state == State.IDLE  # nothing was committed
        # One slot takes an array-free native call; its refusals read like the batch ones.
        with pytest.raises(
            InvalidArgumentError,
            match=r"slots\[0\]=99 is not valid: expected a slot index in \[0, 4\)",
        ):
            core.commit([99], [State.READY])
        with pytest.raises(InvalidArgumentError, match=r"slots=\[4294967297\] is not valid"):
            core.commit([2**32 + 1], [State.READY])  # never masked down to slot 1
        with pytest.raises(
            InvalidArgumentError,
            match=r"slots\[0\]=3 is not valid for wait: this process holds no reference",
        ):
            core.wait([3], 0.1)
        assert [core.slot_info(slot).state for slot in range(4)] == [State.IDLE] * 4
        with pytest.raises(InvalidArgumentError, match=r"shards_per_block=0 is not valid"):
            core.lookup_blocks([block("A")], 0)
        assert core.get([]).results.tolist() == []


def test_too_many_slots_says_to_use_larger_shards() -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=re.escape(
            f"slot_count_regular={(1 << 30) + 1} is not valid: expected an integer in "
            f"[1, {1 << 30}]; use larger shards or a smaller capacity"
        ),
    ):
        Geometry.from_capacity(((1 << 30) + 1) * 64, 64)


def test_segments_of_an_odd_shard_size_are_padded_to_whole_pages() -> None:
    # 4 slots of 100 bytes end mid-page: each segment is one whole page, and slot addresses
    # count from their own segment's base, never into the padding.
    geometry = Geometry(shard_size_bytes=100, slot_count_regular=16, slots_per_segment=4)
    page = os.sysconf("SC_PAGE_SIZE")
    assert geometry.segment_size_bytes == page
    assert geometry.segment_count == 4
    with shared_buffer(geometry) as shared:
        bases = [0x10000000 + index * geometry.segment_size_bytes for index in range(4)]
        addresses = shared.core.slot_addresses(list(range(16)), bases).tolist()
        assert addresses == [bases[slot // 4] + (slot % 4) * 100 for slot in range(16)]


class _NativeSpy:
    """Records which native entry points a BufferCore calls."""

    def __init__(self, native: Any) -> None:
        self.native = native
        self.called: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.called.append(name)
        return getattr(self.native, name)

    def wrap(self, name: str, function: Any) -> Any:
        def recorded(*args: Any) -> Any:
            self.called.append(name)
            return function(*args)

        return recorded


@pytest.mark.parametrize("container", [list, tuple, lambda v: array("I", v)])
def test_single_slot_commit_and_wait_match_the_batch_path(container: Any) -> None:
    geometry = Geometry(shard_size_bytes=64, slot_count_regular=4, bucket_count=4)
    with shared_buffer(geometry) as shared:
        core = shared.core
        keys = [(block("A"), 0), (block("B"), 0)]
        got = core.get(keys)
        single = container([got.slots[0]])
        spy = _NativeSpy(core._native)
        core._native = spy  # type: ignore[assignment]
        core._commit_one = spy.wrap("ucm_buffer_commit_one", core._commit_one)
        core._wait_one = spy.wrap("ucm_buffer_wait_one", core._wait_one)
        assert core.commit(single, [State.READY]) == [CommitResult.OK]
        assert core.wait(single, 0.1) == [WaitResult.READY]
        assert spy.called == ["ucm_buffer_commit_one", "ucm_buffer_wait_one"]
        assert core.commit(single, [State.READY]) == [CommitResult.NOT_IDLE]
        assert core.commit(got.slots, [State.READY] * 2) == [CommitResult.NOT_IDLE, CommitResult.OK]
        assert core.wait(single, 0.1) == [WaitResult.READY]
        core.release(got.slots)
        other = core.get([(block("C"), 0)])
        rank = RemoteRank(shared)
        _, waiter_slots = rank.get([(block("C"), 0)])
        # Not this process's slot to commit (the remote rank is a waiter, not the owner).
        assert rank.call("commit", waiter_slots, [State.READY]) == [CommitResult.NOT_OWNER]
        assert core.commit(container(list(other.slots)), [State.FAILED]) == [CommitResult.OK]
        assert rank.call("wait", waiter_slots, 1.0) == [WaitResult.FAILED]
        rank.call("release", waiter_slots)
        rank.close()
        core.release(other.slots)


def test_dirty_slots_are_never_victims_and_flushers_partition_the_debt() -> None:
    """Write-back debt in the control plane: a dirty slot survives every eviction, flushers of
    two processes never claim the same slot, a failed write-down keeps the debt, a killed
    flusher's claims pass on, remove pays the debt, and the last holder to close is told so."""
    geometry = Geometry(shard_size_bytes=64, slot_count_regular=4, bucket_count=16)
    a, b, c, d, e, f = ((block(name), 0) for name in "ABCDEF")
    with shared_buffer(geometry) as shared:
        core = shared.core
        got = core.get([a, b])
        assert core.commit(got.slots, [State.READY] * 2, dirty=True) == [CommitResult.OK] * 2
        core.release(got.slots)
        dirty_slots = list(got.slots)
        assert [core.slot_info(s).dirty for s in dirty_slots] == [True, True]
        assert core.stats()["dirty_slots"] == 2
        load(core, [c, d])  # clean
        for miss in (e, f):  # two misses evict: never A or B, whatever the CLOCK bits say
            load(core, [miss])
            assert core.lookup([a, b]) == [True, True]
        assert core.lookup([c, d]) == [False, False]
        # Flushers in two processes partition the debt.
        rank = RemoteRank(shared)
        try:
            mine = core.take_dirty(1)
            theirs = rank.call("take_dirty", 8)
            assert len(mine.keys) == len(theirs.keys) == 1
            assert {mine.keys[0], theirs.keys[0]} == {a, b}
            assert core.take_dirty(8).keys == []  # both claimed
            assert core.slot_info(mine.slots[0]).flusher_holder == core.holder
            # A failed write-down keeps the debt; a written one pays it.
            assert core.clean(mine.slots, [False]) == 0
            core.release(mine.slots)
            assert core.slot_info(mine.slots[0]).dirty
            # The other flusher dies mid-write: its claim passes on to the next flusher.
            rank.kill()
            again = core.take_dirty(8)
            assert sorted(again.keys) == sorted([a, b])
            assert core.clean(again.slots, [True, True]) == 2
            core.release(again.slots)
            stats = core.stats()
            assert (stats["dirty_slots"], stats["flushed"]) == (0, 2)
        finally:
            rank.close()
        # Remove pays the debt too (the data is gone on purpose), in use or not.
        got = core.get([e])
        assert list(got.results) == [H]
        load_dirty = core.get([c])
        core.commit(load_dirty.slots, [State.READY], dirty=True)
        assert core.stats()["dirty_slots"] == 1
        assert core.remove([c], force=True) == 1
        core.release(load_dirty.slots)
        core.release(got.slots)
        assert core.stats()["dirty_slots"] == 0
        # The only live holder is the last one; marking it open again resets the mark.
        assert core.mark_closing(True) is True
        assert core.holders()[core.holder].closing
        assert core.mark_closing(False) is False
        assert not core.holders()[core.holder].closing


def test_of_two_holders_only_the_one_closing_last_is_told_to_pay() -> None:
    geometry = Geometry(shard_size_bytes=64, slot_count_regular=4, bucket_count=4)
    with shared_buffer(geometry) as shared:
        core = shared.core
        rank = RemoteRank(shared)
        try:
            assert core.mark_closing(True) is False  # the other rank is live, not closing
            assert rank.call("mark_closing", True) is True  # it closes last
        finally:
            rank.close()
        core.mark_closing(False)
        rank = RemoteRank(shared)
        try:
            rank.kill()  # a killed rank is not waited for
            assert core.mark_closing(True) is True
        finally:
            rank.close()


def test_a_dirty_commit_on_a_force_removed_slot_leaves_no_debt() -> None:
    """The owner's slot is force-removed while it fills it; its dirty commit then owes nothing
    (no flusher could take a detached slot, and a last close would wait for it in vain)."""
    geometry = Geometry(shard_size_bytes=64, slot_count_regular=4, bucket_count=4)
    key = (block("Z"), 0)
    with shared_buffer(geometry) as shared:
        core = shared.core
        got = core.get([key])
        assert list(got.results) == [OWN]
        assert core.remove([key], force=True) == 0  # it was not Ready yet
        assert core.commit(got.slots, [State.READY], dirty=True) == [CommitResult.OK]
        assert not core.slot_info(got.slots[0]).dirty
        assert core.stats()["dirty_slots"] == 0
        core.release(got.slots)
        assert core.slot_info(got.slots[0]).bucket is None  # freed by its last release
