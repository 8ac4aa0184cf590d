"""References of processes that die while holding slots (issue 3, dead peers; issue 7's kill
soak): every process is a holder (pid + start time) and a slot records its holders, so the
references of a SIGKILLed waiter, reader or owner are dropped and the slot becomes evictable
again, and a reused pid is never mistaken for the dead process."""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import time
from multiprocessing.connection import Connection

import pytest
from buffer_shm import RemoteRank, SharedBuffer, block, payload, shared_buffer

from harness.soak import audit_slots
from ucm.errors import InvalidArgumentError
from ucm.native.buffer import (
    HOLDERS_MAX,
    BufferCore,
    Geometry,
    GetResult,
    HolderState,
    ReclaimReport,
    State,
    WaitResult,
)

CTX = multiprocessing.get_context("fork")
SHARD = 256


def fill(core: BufferCore, keys: list[tuple[bytes, int]]) -> list[int]:
    got = core.get(keys)
    assert list(got.results) == [GetResult.OWNER] * len(keys)
    core.commit(got.slots, [State.READY] * len(keys))
    core.release(got.slots)
    return list(got.slots)


def live_holders(core: BufferCore) -> dict[int, int]:
    """pid -> holder index of every live entry."""
    return {row.pid: row.index for row in core.holders() if row.state == HolderState.LIVE}


def test_sigkilled_waiter_reference_is_reclaimed_and_slot_becomes_evictable() -> None:
    geometry = Geometry(shard_size_bytes=SHARD, slot_count_regular=2, bucket_count=4)
    x, y, z = ((block(name), 0) for name in "XYZ")
    with shared_buffer(geometry) as shared:
        core = shared.core
        owner = core.get([x])
        rank = RemoteRank(shared)
        assert rank.get([x]) == ([GetResult.WAITER], [owner.slots[0]])
        rank.start("wait", list(owner.slots), 30.0)  # blocks on the futex
        time.sleep(0.1)
        rank.kill()  # SIGKILLed while waiting, holding its reference
        core.commit(owner.slots, [State.READY])
        core.release(owner.slots)
        slot = owner.slots[0]
        assert core.slot_info(slot).refcount == 1  # the dead waiter's, nobody will release it
        assert core.slot_info(slot).holders == 1 << rank.holder

        report = core.reclaim_dead()
        assert report == ReclaimReport(holders=1, refs=1)
        info = core.slot_info(slot)
        assert (info.refcount, info.holders, info.state) == (0, 0, State.READY)
        assert rank.pid not in live_holders(core)
        assert core.holders()[rank.holder].state == HolderState.FREE
        stats = core.stats()
        assert (stats["dead_holders"], stats["refs_reclaimed"], stats["holders_freed"]) == (1, 1, 1)
        assert core.reclaim_dead() == ReclaimReport(holders=0, refs=0)

        # Evictable again: two misses in a 2-slot buffer take X's slot.
        fill(core, [y])
        got = core.get([z])
        assert list(got.results) == [GetResult.OWNER]
        assert core.slot_of(x) is None and got.slots[0] == slot
        core.commit(got.slots, [State.READY])
        core.release(got.slots)


def test_dead_reader_pin_is_dropped_by_the_miss_of_a_full_buffer() -> None:
    # No explicit sweep: the miss finds no victim, scans the holders, finds the reader dead
    # and evicts its slot after dropping the dead reference under the bucket lock.
    geometry = Geometry(shard_size_bytes=SHARD, slot_count_regular=1, bucket_count=4)
    x, y = (block("X"), 0), (block("Y"), 0)
    with shared_buffer(geometry) as shared:
        core = shared.core
        (slot,) = fill(core, [x])
        rank = RemoteRank(shared)
        assert rank.get([x]) == ([GetResult.HIT], [slot])  # reading it...
        rank.kill()  # ...when SIGKILLed
        assert core.slot_info(slot).refcount == 1
        got = core.get([y])
        assert (list(got.results), list(got.slots)) == ([GetResult.OWNER], [slot])
        assert core.slot_of(x) is None  # x was the victim
        stats = core.stats()
        assert (stats["dead_holders"], stats["refs_reclaimed"], stats["no_slot"]) == (1, 1, 0)
        core.commit(got.slots, [State.READY])
        core.release(got.slots)
        assert core.slot_info(slot).refcount == 0
        # The entry stays marked dead (no bits left) until a sweep frees it.
        assert core.holders()[rank.holder].state == HolderState.DEAD
        assert core.reclaim_dead() == ReclaimReport(holders=1, refs=0)


def test_dead_reader_pin_does_not_keep_a_shard_from_remove_or_a_get() -> None:
    geometry = Geometry(shard_size_bytes=SHARD, slot_count_regular=4, bucket_count=4)
    x, y = (block("X"), 0), (block("Y"), 0)
    with shared_buffer(geometry) as shared:
        core = shared.core
        slot_x, slot_y = fill(core, [x, y])
        rank = RemoteRank(shared)
        assert rank.get([x, y]) == ([GetResult.HIT] * 2, [slot_x, slot_y])
        rank.kill()
        assert core.remove([x]) == 0  # pinned, and nobody knows yet that the reader died
        assert core.scan_holders() == 1 << rank.holder
        # A hit on Y drops the dead reference it meets; remove of X now succeeds unforced.
        hit = core.get([y])
        assert list(hit.results) == [GetResult.HIT]
        assert core.slot_info(slot_y).holders == 1 << core.holder
        core.release(hit.slots)
        assert core.remove([x]) == 1
        assert core.slot_info(slot_x).bucket is None
        assert core.stats()["refs_reclaimed"] == 2


def test_owner_sigkilled_with_nobody_waiting_leaves_a_takeover_able_slot() -> None:
    geometry = Geometry(shard_size_bytes=SHARD, slot_count_regular=4, bucket_count=4)
    x = (block("X"), 0)
    with shared_buffer(geometry) as shared:
        core = shared.core
        rank = RemoteRank(shared)
        results, (slot,) = rank.get([x])
        assert results == [GetResult.OWNER]
        assert core.slot_info(slot).owner_pid == rank.pid
        rank.kill()
        assert core.reclaim_dead() == ReclaimReport(holders=1, refs=1)
        info = core.slot_info(slot)
        assert (info.refcount, info.owner_pid, info.state) == (0, 0, State.IDLE)
        # The kill soak's audit counts it as abandoned (reusable), not as a leak.
        audit = audit_slots(core)
        assert audit.problems == []
        assert (audit.abandoned, audit.free) == (1, 3)
        got = core.get([x])  # the hit-or-takeover fast path
        assert (list(got.results), list(got.slots)) == ([GetResult.OWNER], [slot])
        shared.write_slot(slot, payload(x, SHARD))
        core.commit(got.slots, [State.READY])
        core.release(got.slots)
        assert shared.read_slot(slot) == payload(x, SHARD)


def _reused_pid_holder(shared: SharedBuffer, conn: Connection) -> None:
    rank = shared.attach_in_child()
    got = rank.core.get([(block("X"), 0)])
    conn.send((rank.core.holder, int(got.results[0]), list(got.slots)))
    assert conn.poll(30)
    conn.recv()
    try:
        rank.core.release(got.slots)
        conn.send("released")
    except InvalidArgumentError as exc:
        conn.send(str(exc))


def test_pid_reuse_is_detected_by_the_start_time() -> None:
    # A live process whose recorded start time differs is a reused pid: the process that
    # registered is dead and its references go, although kill(pid, 0) succeeds.
    geometry = Geometry(shard_size_bytes=SHARD, slot_count_regular=4, bucket_count=4)
    x = (block("X"), 0)
    with shared_buffer(geometry) as shared:
        core = shared.core
        (slot,) = fill(core, [x])
        parent, child = CTX.Pipe()
        process = CTX.Process(target=_reused_pid_holder, args=(shared, child))
        process.start()
        try:
            assert parent.poll(20)
            holder, result, slots = parent.recv()
            assert (result, slots) == (GetResult.HIT, [slot])
            row = core.holders()[holder]
            assert (row.state, row.pid) == (HolderState.LIVE, process.pid)
            assert core.scan_holders() == 0  # alive: same pid, same start time
            core.debug_set_holder_start_time(holder, row.start_time + 1)
            assert core.scan_holders() == 1 << holder
            assert core.reclaim_dead() == ReclaimReport(holders=1, refs=1)
            assert core.slot_info(slot).refcount == 0
            parent.send("release now")
            assert parent.poll(20)
            message = parent.recv()
            assert re.fullmatch(
                rf"release: holder {holder} is no longer registered to this process \(pid "
                rf"{process.pid}\): it was judged dead and its references were reclaimed",
                message,
            ), message
        finally:
            process.join(10)
        assert process.exitcode == 0
        assert core.slot_info(slot).refcount == 0


def _report_holder(shared: SharedBuffer, conn: Connection) -> None:
    rank = shared.attach_in_child()
    conn.send((shared.core.holder, rank.core.holder))


def test_one_holder_per_process_and_a_new_one_after_fork() -> None:
    geometry = Geometry(shard_size_bytes=SHARD, slot_count_regular=4, bucket_count=4)
    with shared_buffer(geometry) as shared:
        mine = shared.core.holder
        again = BufferCore.attach(shared.ctrl.address, shared.ctrl.size_bytes)
        assert again.holder == mine  # the same process: the same entry
        parent, child = CTX.Pipe()
        process = CTX.Process(target=_report_holder, args=(shared, child))
        process.start()
        assert parent.poll(20)
        inherited, fresh = parent.recv()
        process.join(10)
        # Both objects in the child (the inherited one and its own attach) re-registered.
        assert inherited == fresh != mine
        assert live_holders(shared.core)[os.getpid()] == mine
        assert shared.core.reclaim_dead() == ReclaimReport(holders=1, refs=0)
        assert len(live_holders(shared.core)) == 1
        assert HOLDERS_MAX == 64


def _soak_worker(
    shared: SharedBuffer, keys: list[tuple[bytes, int]], seed: int, conn: Connection
) -> None:
    rank = shared.attach_in_child()
    core = rank.core
    rng = random.Random(seed)
    deadline = time.monotonic() + 20
    iterations = 0
    while time.monotonic() < deadline:
        if iterations == 1:
            conn.send("ready")  # registered, and one full round done
        iterations += 1
        batch = list(dict.fromkeys(rng.sample(keys, 3)))
        got = core.get(batch)
        owned = [s for r, s in zip(got.results, got.slots, strict=True) if r == GetResult.OWNER]
        for key, result, slot in zip(batch, got.results, got.slots, strict=True):
            if result == GetResult.OWNER:
                rank.write_slot(slot, payload(key, SHARD))
        core.commit(owned, [State.READY] * len(owned))
        waiting = [s for r, s in zip(got.results, got.slots, strict=True) if r == GetResult.WAITER]
        states = core.wait(waiting, timeout_s=0.2)
        waiting_keys = [k for k, r in zip(batch, got.results, strict=True) if r == GetResult.WAITER]
        takeover = []
        for key, slot, state in zip(waiting_keys, waiting, states, strict=True):
            if state == WaitResult.TAKEOVER:
                rank.write_slot(slot, payload(key, SHARD))  # reload it, as its owner died
                takeover.append(slot)
        core.commit(takeover, [State.READY] * len(takeover))
        core.release(got.held_slots())


def test_kill_soak_refcounts_return_to_zero_and_no_slot_leaks() -> None:
    # Four ranks hammer a small buffer; each is SIGKILLed at a random instant (mid-get,
    # mid-commit, holding references, possibly holding a bucket lock). After one sweep every
    # refcount is 0, every holder but ours is free, and the buffer serves every key again.
    geometry = Geometry(shard_size_bytes=SHARD, slot_count_regular=8, bucket_count=4)
    keys = [(block(f"S{i}"), i % 2) for i in range(12)]
    rng = random.Random(7)
    with shared_buffer(geometry) as shared:
        core = shared.core
        mine = core.holder
        for round_index in range(4):
            pipes = [CTX.Pipe() for _ in range(4)]
            workers = [
                CTX.Process(target=_soak_worker, args=(shared, keys, 10 * round_index + i, p[1]))
                for i, p in enumerate(pipes)
            ]
            for worker in workers:
                worker.start()
            for parent, _ in pipes:
                assert parent.poll(20) and parent.recv() == "ready"
            for worker in workers:
                time.sleep(rng.uniform(0.02, 0.15))
                os.kill(worker.pid or 0, 9)
            for worker in workers:
                worker.join(10)
                assert worker.exitcode == -9
            report = core.reclaim_dead()
            assert report.holders == 4
            assert [core.slot_info(s).refcount for s in range(8)] == [0] * 8
            assert live_holders(core) == {os.getpid(): mine}
        # Consistent and usable: every key loads (hit or owner), byte-exact.
        for key in keys:
            got = core.get([key])
            (result,), (slot,) = list(got.results), list(got.slots)
            if result == GetResult.OWNER:
                shared.write_slot(slot, payload(key, SHARD))
                core.commit(got.slots, [State.READY])
            else:
                assert result == GetResult.HIT
            assert shared.read_slot(slot) == payload(key, SHARD)
            core.release(got.slots)
        assert [core.slot_info(s).refcount for s in range(8)] == [0] * 8
        stats = core.stats()
        assert stats["dead_holders"] == 16 and stats["holders_freed"] == 16
        assert stats["commits_ready"] + stats["hits"] >= 16


@pytest.mark.parametrize("operation", ["commit", "wait", "release"])
def test_slots_not_held_by_this_process_are_refused(operation: str) -> None:
    geometry = Geometry(shard_size_bytes=SHARD, slot_count_regular=4, bucket_count=4)
    with shared_buffer(geometry) as shared:
        rank = RemoteRank(shared)
        _, (slot,) = rank.get([(block("X"), 0)])
        core = shared.core
        if operation == "commit":
            assert core.commit([slot], [State.READY]) == [1]  # NOT_OWNER
        else:
            with pytest.raises(
                InvalidArgumentError,
                match=rf"slots\[0\]={slot} is not valid for {operation}: this process holds no "
                "reference on it",
            ):
                getattr(core, operation)(*([[slot], 1.0] if operation == "wait" else [[slot]]))
        rank.call("release", [slot])
        rank.close()
