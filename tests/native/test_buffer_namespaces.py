"""Namespace quotas in the native CacheBuffer, with real processes: occupancy counters stay
exact through a kill -9 of a rank in the middle of inserts (after ``reclaim_dead``), and a
namespace's guarantee holds while other processes flood the buffer."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from collections import Counter
from multiprocessing.connection import Connection

import pytest
from buffer_shm import SharedBuffer, shared_buffer

from ucm.errors import InvalidArgumentError
from ucm.native.buffer import DETACHED, BufferCore, Geometry, GetResult, State

CTX = multiprocessing.get_context("fork")
SHARD = 64
TAG_A = bytes.fromhex("a1a1a1a1a1a1a1a1")
TAG_B = bytes.fromhex("b2b2b2b2b2b2b2b2")


def key(tag: bytes, number: int) -> tuple[bytes, int]:
    return (tag + number.to_bytes(8, "little"), 0)


def insert(core: BufferCore, keys: list[tuple[bytes, int]]) -> list[GetResult]:
    """Gets the keys, commits the owned ones Ready, releases every slot taken."""
    got = core.get(keys)
    owned = [
        slot
        for slot, result in zip(got.slots, got.results, strict=True)
        if result == GetResult.OWNER
    ]
    if owned:
        core.commit(owned, [State.READY] * len(owned))
    held = list(got.held_slots())
    if held:
        core.release(held)
    return [GetResult(result) for result in got.results]


def linked_by_namespace(shared: SharedBuffer) -> Counter[int]:
    """The exact occupancy: slots linked into a chain, by the namespace index their key's tag
    has in the table (0 for any other tag), counted from the slots themselves."""
    indices = {row.tag: row.index for row in shared.core.namespaces()}
    counts: Counter[int] = Counter()
    for slot in range(shared.geometry.slot_count_total):
        info = shared.core.slot_info(slot)
        if info.bucket is None or info.bucket == DETACHED:
            assert info.namespace is None, (slot, info)
            continue
        index = indices.get(info.block_id[:8], 0)
        assert info.namespace == index, (slot, info)
        counts[index] += 1
    return counts


def occupancy(shared: SharedBuffer) -> Counter[int]:
    return Counter({row.index: row.occupancy_slots for row in shared.core.namespaces()})


def test_registration_resolves_tags_and_names_its_errors() -> None:
    geometry = Geometry(shard_size_bytes=SHARD, slot_count_regular=16, bucket_count=8)
    with shared_buffer(geometry) as shared:
        core = shared.core
        assert core.register_namespace(bytes(8), 2, 16) == 0  # the default namespace
        assert core.register_namespace(TAG_A, 8, 12) == 1
        assert core.register_namespace(TAG_A, 6, 12) == 1  # an update keeps the index
        rows = core.namespaces()
        assert [(row.index, row.tag, row.guarantee_slots, row.cap_slots) for row in rows] == [
            (0, bytes(8), 2, 16),
            (1, TAG_A, 6, 12),
        ]
        with pytest.raises(InvalidArgumentError, match=r"guarantee_slots=13 is not valid: .*"):
            core.register_namespace(TAG_B, 13, 12)
        with pytest.raises(InvalidArgumentError, match=r"cap_slots=17 is not valid: .*"):
            core.register_namespace(TAG_B, 0, 17)
        with pytest.raises(
            InvalidArgumentError,
            match=r"cannot register namespace tag b2b2b2b2b2b2b2b2 with guarantee_slots=9: the "
            r"registered guarantees would exceed the 16 regular slots",
        ):
            core.register_namespace(TAG_B, 9, 16)
        with pytest.raises(InvalidArgumentError, match=r"tag=b'ab' is not valid: expected 8"):
            core.register_namespace(b"ab", 0, 1)


def _flood(shared: SharedBuffer, seed: int, count: int, conn: Connection) -> None:
    rank = shared.attach_in_child()
    rng = random.Random(seed)
    results: Counter[str] = Counter()
    for _ in range(count):
        (result,) = insert(rank.core, [key(TAG_B, rng.randrange(1 << 30))])
        results[result.name] += 1
    conn.send(dict(results))


def test_a_guarantee_holds_while_three_processes_flood_the_buffer() -> None:
    geometry = Geometry(shard_size_bytes=SHARD, slot_count_regular=32, bucket_count=16)
    with shared_buffer(geometry) as shared:
        a = shared.core.register_namespace(TAG_A, 8, 12)
        b = shared.core.register_namespace(TAG_B, 0, 32)
        working_set = [key(TAG_A, number) for number in range(8)]
        assert insert(shared.core, working_set) == [GetResult.OWNER] * 8
        pipes = []
        for seed in range(3):
            parent, child = CTX.Pipe()
            process = CTX.Process(target=_flood, args=(shared, seed, 1000, child))
            process.start()
            pipes.append((process, parent))
        for process, parent in pipes:
            assert parent.poll(120)
            results = parent.recv()
            process.join(30)
            assert process.exitcode == 0
            # B never runs out of slots: 24 of them are its to cycle through.
            assert results == {"OWNER": 1000}, results
        # A kept all 8 of its blocks (its guarantee), B has the other 24 slots.
        assert shared.core.lookup(working_set) == [True] * 8
        assert occupancy(shared) == Counter({a: 8, b: 24})
        assert linked_by_namespace(shared) == Counter({a: 8, b: 24})
        assert shared.core.stats()["evictions"] == 3000 - 24


def _insert_forever(shared: SharedBuffer, seed: int, conn: Connection) -> None:
    rank = shared.attach_in_child()
    rng = random.Random(seed)
    conn.send("inserting")
    while True:
        tag = TAG_A if rng.random() < 0.5 else TAG_B
        keys = [key(tag, rng.randrange(200)) for _ in range(rng.randrange(1, 6))]
        got = rank.core.get(list(dict.fromkeys(keys)))
        owned = [s for s, r in zip(got.slots, got.results, strict=True) if r == GetResult.OWNER]
        if owned and rng.random() < 0.8:  # some owners never commit: Idle slots stay linked
            state = State.READY if rng.random() < 0.9 else State.FAILED
            rank.core.commit(owned, [state] * len(owned))
        held = list(got.held_slots())
        if held and rng.random() < 0.7:  # some references die with the process
            rank.core.release(held)


def test_counters_are_exact_after_a_kill_9_in_the_middle_of_inserts() -> None:
    geometry = Geometry(
        shard_size_bytes=SHARD, slot_count_regular=48, slot_count_reserved=4, bucket_count=8
    )
    with shared_buffer(geometry) as shared:
        a = shared.core.register_namespace(TAG_A, 12, 24)
        b = shared.core.register_namespace(TAG_B, 4, 52)
        rng = random.Random(22)
        for round_index in range(6):
            ranks = []
            for rank_index in range(2):
                parent, child = CTX.Pipe()
                seed = round_index * 10 + rank_index
                process = CTX.Process(target=_insert_forever, args=(shared, seed, child))
                process.start()
                assert parent.poll(30) and parent.recv() == "inserting"
                ranks.append(process)
            time.sleep(rng.uniform(0.05, 0.3))
            for process in ranks:
                os.kill(process.pid, signal.SIGKILL)  # mid-insert: locks, owners, references
                process.join(10)
            report = shared.core.reclaim_dead()
            assert report.holders == 2
            # Exact: every namespace counts exactly the linked slots of its keys.
            exact = linked_by_namespace(shared)
            assert occupancy(shared) == exact + Counter({a: 0, b: 0}), (round_index, exact)
            assert exact[a] <= 24
            # The buffer still works and stays exact for a surviving rank.
            insert(shared.core, [key(TAG_A, 1000 + round_index), key(TAG_B, 1000 + round_index)])
            assert occupancy(shared) == linked_by_namespace(shared) + Counter({a: 0, b: 0})
