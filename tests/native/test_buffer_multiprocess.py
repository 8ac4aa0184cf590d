"""The native CacheBuffer shared by real processes (forked, each mapping the /dev/shm files again
and attaching with validation): seed Scenario B with futex wake-up, the completion that lands
between "read version" and "block", one owner per key, byte-exact sharing, and recovery from a
SIGKILLed owner or lock holder."""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier

from buffer_shm import SharedBuffer, block, payload, shared_buffer

from ucm.native.buffer import Geometry, GetResult, State, WaitResult, set_wait_pause_ns

CTX = multiprocessing.get_context("fork")
SHARD = 4096


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _scenario_b_waiter(shared: SharedBuffer, pause_ns: int, conn: Connection) -> None:
    rank = shared.attach_in_child()
    x = (block("X"), 0)
    got = rank.core.get([x])
    set_wait_pause_ns(pause_ns)
    conn.send(("registered", int(got.results[0])))
    cpu_before, start = cpu_s(), time.monotonic()
    (state,) = rank.core.wait(got.slots, timeout_s=5.0)
    elapsed, cpu = time.monotonic() - start, cpu_s() - cpu_before
    data = rank.read_slot(got.slots[0])
    rank.core.release(got.slots)
    conn.send((int(state), start, elapsed, cpu, data == payload(x, SHARD)))


@dataclass(frozen=True)
class WaitRun:
    """One Scenario B run, as the waiter and the buffer's counters saw it."""

    started: float
    """time.monotonic() (system-wide) when the waiter entered wait()."""
    committed: float
    """time.monotonic() when the owner committed."""
    elapsed: float
    cpu: float
    wakeups: int
    """Blocked waiters the commit woke (FUTEX_WAKE's count)."""
    slices: int
    """Futex slices the waiter slept out without a change."""


def _run_scenario_b(pause_ns: int, commit_after_s: float) -> WaitRun:
    geometry = Geometry(shard_size_bytes=SHARD, slot_count_regular=4, bucket_count=4)
    x = (block("X"), 0)
    with shared_buffer(geometry) as shared:
        owner = shared.core.get([x])  # rank 0 wins X at step 0
        assert list(owner.results) == [GetResult.OWNER]
        parent, child = CTX.Pipe()
        process = CTX.Process(target=_scenario_b_waiter, args=(shared, pause_ns, child))
        process.start()
        assert parent.poll(60) and parent.recv() == ("registered", GetResult.WAITER)
        time.sleep(commit_after_s)
        shared.write_slot(owner.slots[0], payload(x, SHARD))
        committed = time.monotonic()
        shared.core.commit(owner.slots, [State.READY])
        assert parent.poll(60)
        state, started, elapsed, cpu, exact = parent.recv()
        process.join(60)
        assert process.exitcode == 0
        # Whatever the timing: the waiter saw the committed bytes, and only after the commit.
        assert (state, exact) == (WaitResult.READY, True)
        assert started + elapsed >= committed
        shared.core.release(owner.slots)
        stats = shared.core.stats()
        return WaitRun(started, committed, elapsed, cpu, stats["wakeups"], stats["wait_slices"])


SCENARIO_ATTEMPTS = 5
"""Runs a timing-dependent premise gets: on a busy machine a run may miss it (the commit lands
at a slice boundary, or after the window); a missed premise is retried, never asserted on."""


def test_scenario_b_waiter_blocks_without_cpu_and_wakes_on_commit() -> None:
    # The premise is a commit that finds the waiter blocked inside a futex slice (slices are
    # 100 ms): then the committer's FUTEX_WAKE wakes exactly it. At a slice boundary the waiter
    # is briefly out of the futex checking the owner's liveness and sees the commit itself;
    # such a run proves nothing about wake-ups and is retried.
    runs = []
    for _ in range(SCENARIO_ATTEMPTS):
        run = _run_scenario_b(pause_ns=0, commit_after_s=0.35)
        runs.append(run)
        assert run.cpu < 0.05, run  # blocked on the futex, never polling, in every run
        if run.wakeups == 1:
            break
        assert run.wakeups == 0, run
    assert runs[-1].wakeups == 1, f"no run's commit found the waiter blocked: {runs}"


def test_scenario_b_completion_between_read_version_and_block_is_not_missed() -> None:
    # The waiter reads version g0 and state Idle, then (test hook) pauses 300 ms before
    # blocking; the owner commits 100 ms into that pause. Blocking "on g0" must return at once
    # (the version changed): the wait sleeps no futex slice out and nobody needs waking. The
    # premise is the commit landing inside the pause; a run that misses it is retried.
    pause_s = 0.3
    runs = []
    for _ in range(SCENARIO_ATTEMPTS):
        run = _run_scenario_b(pause_ns=int(pause_s * 1e9), commit_after_s=0.1)
        runs.append(run)
        if run.committed < run.started + pause_s:
            assert (run.slices, run.wakeups) == (0, 0), run
            assert run.elapsed >= pause_s, run
            return
    raise AssertionError(f"no run's commit landed inside the waiter's pause: {runs}")


def _rank_loop(
    shared: SharedBuffer,
    keys: list[tuple[bytes, int]],
    rank_index: int,
    ranks: int,
    barrier: Barrier,
    conn: Connection,
) -> None:
    rank = shared.attach_in_child()
    # RearrangeIndex order: own stride first, then rotate.
    order = [
        i for start in range(ranks) for i in range((rank_index + start) % ranks, len(keys), ranks)
    ]
    mine = [keys[i] for i in order]
    barrier.wait(10)
    got = rank.core.get(mine)
    results = [int(result) for result in got.results]
    barrier.wait(10)  # every rank has its outcome before any owner commits
    owned = [slot for result, slot in zip(got.results, got.slots, strict=True) if result == 1]
    for key, result, slot in zip(mine, got.results, got.slots, strict=True):
        if result == GetResult.OWNER:
            rank.write_slot(slot, payload(key, SHARD))
    rank.core.commit(owned, [State.READY] * len(owned))
    waiting = [slot for result, slot in zip(got.results, got.slots, strict=True) if result == 2]
    states = rank.core.wait(waiting, timeout_s=10.0)
    exact = all(
        rank.read_slot(slot) == payload(key, SHARD)
        for key, slot in zip(mine, got.slots, strict=True)
    )
    rank.core.release(got.slots)
    conn.send((dict(zip(mine, results, strict=True)), [int(s) for s in states], exact))


def test_ranks_share_one_buffer_one_owner_per_key_byte_exact() -> None:
    ranks = 6
    geometry = Geometry(shard_size_bytes=SHARD, slot_count_regular=64, bucket_count=32)
    keys = [(block(f"K{i}"), i % 3) for i in range(24)]
    with shared_buffer(geometry) as shared:
        barrier = CTX.Barrier(ranks)
        pipes = [CTX.Pipe() for _ in range(ranks)]
        processes = [
            CTX.Process(target=_rank_loop, args=(shared, keys, r, ranks, barrier, pipes[r][1]))
            for r in range(ranks)
        ]
        for process in processes:
            process.start()
        reports = []
        for parent, _ in pipes:
            assert parent.poll(60)
            reports.append(parent.recv())
        for process in processes:
            process.join(10)
            assert process.exitcode == 0
        for key in keys:
            outcomes = sorted(report[0][key] for report in reports)
            assert outcomes == [GetResult.OWNER] + [GetResult.WAITER] * (ranks - 1), key
        assert all(state == WaitResult.READY for report in reports for state in report[1])
        assert all(report[2] for report in reports)  # every rank read every shard byte-exact
        owners = [sum(1 for r in report[0].values() if r == GetResult.OWNER) for report in reports]
        assert sum(owners) == len(keys)
        stats = shared.core.stats()
        assert stats["commits_ready"] == len(keys)
        assert shared.core.lookup(keys) == [True] * len(keys)
        assert all(shared.core.slot_info(slot).refcount == 0 for slot in range(64))


def _reader(shared: SharedBuffer, keys: list[tuple[bytes, int]], conn: Connection) -> None:
    rank = shared.attach_in_child()
    got = rank.core.get(keys)
    exact = [
        rank.read_slot(slot) == payload(key, SHARD)
        for key, slot in zip(keys, got.slots, strict=True)
    ]
    rank.core.release(got.slots)
    conn.send(([int(r) for r in got.results], exact))


def test_one_rank_fills_all_ranks_read_byte_exact() -> None:
    geometry = Geometry(shard_size_bytes=SHARD, slot_count_regular=16, bucket_count=16)
    keys = [(block(f"F{i}"), 0) for i in range(12)]
    with shared_buffer(geometry) as shared:
        got = shared.core.get(keys)
        for key, slot in zip(keys, got.slots, strict=True):
            shared.write_slot(slot, payload(key, SHARD))
        shared.core.commit(got.slots, [State.READY] * len(keys))
        shared.core.release(got.slots)
        pipes = [CTX.Pipe() for _ in range(5)]
        processes = [CTX.Process(target=_reader, args=(shared, keys, p[1])) for p in pipes]
        for process in processes:
            process.start()
        for parent, _ in pipes:
            assert parent.poll(30)
            results, exact = parent.recv()
            assert results == [GetResult.HIT] * len(keys)
            assert exact == [True] * len(keys)
        for process in processes:
            process.join(10)
        assert shared.core.stats()["hits"] == 5 * len(keys)


def _doomed_owner(shared: SharedBuffer, conn: Connection) -> None:
    rank = shared.attach_in_child()
    got = rank.core.get([(block("X"), 0)])
    rank.write_slot(got.slots[0], b"\xee" * (SHARD // 2) + b"\x00" * (SHARD // 2))  # half-written
    conn.send(int(got.results[0]))
    time.sleep(60)  # "loading" until SIGKILLed


WAIT_AFTER_DEATH_S = 60.0
"""The waiters' timeout: a dead owner must be noticed from its liveness, not this deadline."""


def _waiter_after_death(shared: SharedBuffer, conn: Connection) -> None:
    rank = shared.attach_in_child()
    x = (block("X"), 0)
    got = rank.core.get([x])
    conn.send(("registered", int(got.results[0])))
    start = time.monotonic()
    (state,) = rank.core.wait(got.slots, timeout_s=WAIT_AFTER_DEATH_S)
    if state == WaitResult.TAKEOVER:
        rank.write_slot(got.slots[0], payload(x, SHARD))  # reload from below, then publish
        rank.core.commit(got.slots, [State.READY])
        state = WaitResult.READY
        took_over = True
    else:
        took_over = False
    exact = rank.read_slot(got.slots[0]) == payload(x, SHARD)
    rank.core.release(got.slots)
    conn.send((int(state), took_over, time.monotonic() - start, exact))


def test_owner_sigkilled_mid_load_waiters_recover_within_timeout() -> None:
    geometry = Geometry(shard_size_bytes=SHARD, slot_count_regular=4, bucket_count=4)
    x = (block("X"), 0)
    with shared_buffer(geometry) as shared:
        owner_pipe = CTX.Pipe()
        owner = CTX.Process(target=_doomed_owner, args=(shared, owner_pipe[1]))
        owner.start()
        assert owner_pipe[0].poll(20) and owner_pipe[0].recv() == GetResult.OWNER
        pipes = [CTX.Pipe() for _ in range(3)]
        waiters = [CTX.Process(target=_waiter_after_death, args=(shared, p[1])) for p in pipes]
        for waiter in waiters:
            waiter.start()
        for parent, _ in pipes:
            assert parent.poll(20) and parent.recv() == ("registered", GetResult.WAITER)
        os.kill(owner.pid, signal.SIGKILL)  # not reaped yet: a zombie counts as dead
        outcomes = []
        for parent, _ in pipes:
            assert parent.poll(20)
            outcomes.append(parent.recv())
        owner.join(10)
        for waiter in waiters:
            waiter.join(10)
            assert waiter.exitcode == 0
        assert sum(1 for _, took_over, _, _ in outcomes if took_over) == 1
        assert all(state == WaitResult.READY for state, _, _, _ in outcomes)
        # The death was seen within slices of the wait, long before its deadline.
        assert all(elapsed < WAIT_AFTER_DEATH_S / 2 for _, _, elapsed, _ in outcomes)
        assert all(exact for _, _, _, exact in outcomes)  # nobody read the half-written slot
        stats = shared.core.stats()
        assert stats["takeovers"] == 1
        # The slot is consistent and reusable: the dead owner's reference was dropped.
        slot = shared.core.slot_of(x)
        assert slot is not None
        info = shared.core.slot_info(slot)
        assert (info.refcount, info.state) == (0, State.READY)
        hit = shared.core.get([x])
        assert list(hit.results) == [GetResult.HIT]
        shared.core.release(hit.slots)
        assert shared.core.remove([x]) == 1


def _lock_holder(shared: SharedBuffer, bucket: int, conn: Connection) -> None:
    rank = shared.attach_in_child()
    rank.core.debug_hold_lock(bucket)
    conn.send("holding")
    time.sleep(60)


def test_lock_holder_sigkilled_lock_recovered() -> None:
    geometry = Geometry(shard_size_bytes=SHARD, slot_count_regular=4, bucket_count=4)
    x = (block("X"), 0)
    with shared_buffer(geometry) as shared:
        bucket = shared.core.bucket_of(x[0])
        parent, child = CTX.Pipe()
        holder = CTX.Process(target=_lock_holder, args=(shared, bucket, child))
        holder.start()
        assert parent.poll(20) and parent.recv() == "holding"
        os.kill(holder.pid, signal.SIGKILL)
        start = time.monotonic()
        got = shared.core.get([x])
        assert list(got.results) == [GetResult.OWNER]
        # Recovered from the holder's death, not timed out (a live holder: 10 s, LOCK_TIMEOUT).
        assert time.monotonic() - start < 9.0
        assert shared.core.stats()["lock_recoveries"] == 1
        shared.core.commit(got.slots, [State.READY])
        shared.core.release(got.slots)
        assert shared.core.lookup([x]) == [True]
        holder.join(10)
