"""Bounded loads (``ucm.integration.bounded``), the gets of SGLang and LMCache: a load returns by
its deadline when a tier below holds it up, and nothing is written into the engine's memory
after it returned; with a CacheBuffer (prefetch, pin, copy) and without one (staging memory).
No engine here: the engines' own tests drive it through SGLang's and LMCache's classes."""

from __future__ import annotations

import ctypes
import math
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from loadpath import _tiers
from loadpath._tiers import CONTENTS, CORRUPT, ENTERED, GATES, RECORDED, block, payload

import ucm
from ucm import namespaces
from ucm.errors import ConfigError, InvalidArgumentError, KeyMissingError, TierError
from ucm.integration.bounded import BoundedLoads, LateLoadError, check_load_deadline_s

TENSORS = (1536, 2560)
"""Two tensors per shard, so that a staged shard is copied out tensor by tensor."""
SHARD = sum(TENSORS)
BOUND_S = 60.0
"""A returned load took less than this; the gate holds a load for up to 120 s."""


@pytest.fixture
def space() -> Iterator[str]:
    """A fresh recording-tier space; its gate is opened at teardown (no thread left waiting)."""
    _tiers.register()
    name = f"bounded-{uuid.uuid4().hex[:8]}"
    GATES[name] = threading.Event()
    ENTERED[name] = threading.Event()
    try:
        yield name
    finally:
        GATES[name].set()
        for table in (GATES, ENTERED, CONTENTS, CORRUPT, RECORDED):
            table.pop(name, None)  # type: ignore[attr-defined]
        _tiers.unregister()


def stack(
    space: str, with_buffer: bool, gated: bool = False, slots: int = 64, **buffer: Any
) -> dict[str, Any]:
    """``buffer``: more keys of the buffer (or, without one, of the ``load:`` section)."""
    tiers: list[dict[str, Any]] = [{"type": "recording", "space": space, "gated": gated}]
    if with_buffer:
        tiers.insert(0, {"type": "buffer", "capacity": slots * SHARD, **buffer})
    elif buffer:
        return {
            "unique_id": f"bl-{uuid.uuid4().hex[:12]}",
            "tensor_size_list": list(TENSORS),
            "shards_per_block": 1,
            "tiers": tiers,
            "load": buffer,
        }
    return {
        "unique_id": f"bl-{uuid.uuid4().hex[:12]}",
        "tensor_size_list": list(TENSORS),
        "shards_per_block": 1,
        "tiers": tiers,
    }


def stored(space: str, blocks: list[bytes]) -> None:
    CONTENTS.setdefault(space, {}).update({(b, 0): payload(b, 0, SHARD) for b in blocks})


class Destinations:
    """The engine's memory: one zeroed shard per block, each tensor at its own address."""

    def __init__(self, count: int) -> None:
        self.tensors = [
            [ctypes.create_string_buffer(size) for size in TENSORS] for _ in range(count)
        ]
        self.pointers = [[ctypes.addressof(t) for t in shard] for shard in self.tensors]

    def shard(self, i: int) -> bytes:
        return b"".join(t.raw for t in self.tensors[i])

    def untouched(self) -> bool:
        return all(not any(t.raw) for shard in self.tensors for t in shard)


@pytest.mark.parametrize("with_buffer", [True, False], ids=["buffer", "no-buffer"])
def test_a_load_held_below_returns_by_its_deadline_and_late_bytes_never_reach_the_engine(
    space: str, with_buffer: bool
) -> None:
    blocks = [block(i) for i in range(4)]
    stored(space, blocks)
    with ucm.open(stack(space, with_buffer, gated=True)) as store:
        loads = BoundedLoads(store, deadline_s=0.3)
        dst = Destinations(len(blocks))
        started = time.monotonic()
        failed = loads.load(blocks, [0] * 4, dst.pointers)
        assert time.monotonic() - started < BOUND_S
        assert ENTERED[space].is_set()  # the tier has the load, held at its gate
        assert sorted(failed) == sorted(blocks)
        assert all(isinstance(cause, LateLoadError) for cause in failed.values())
        assert "within the load deadline (0.3 s)" in str(failed[blocks[0]])
        assert loads.late_blocks == 4
        # Without a buffer the late load writes staging memory, kept until it is over.
        assert loads.late_staging_bytes == (0 if with_buffer else 4 * SHARD)

        GATES[space].set()  # the tier answers now
        if with_buffer:
            store.wait_prefetches()  # the late bytes land in the buffer
        assert loads.wait_late(BOUND_S)
        assert loads.late_staging_bytes == 0
        assert dst.untouched()  # nothing written after the load returned

        again = Destinations(len(blocks))
        assert loads.load(blocks, [0] * 4, again.pointers) == {}
        assert [again.shard(i) for i in range(4)] == [payload(b, 0, SHARD) for b in blocks]
        # With a buffer the late prefetch served the second load: the tier was read once.
        assert len(RECORDED[space]) == (4 if with_buffer else 8)
        assert loads.staged_blocks == (0 if with_buffer else 8)
        assert dst.untouched()


def test_a_get_of_blocks_the_buffer_holds_returns_at_once_behind_a_late_get(space: str) -> None:
    """A late get leaves its prefetch running, its step waiting on the stalled tier for up to
    ``wait_timeout_s``; the next get, of blocks the buffer holds, copies them at once: loads
    are not queued behind prefetches."""
    held, stalled = block(1), block(2)
    stored(space, [held, stalled])
    config = stack(space, with_buffer=True, gated=True, wait_timeout_s=600.0)
    with ucm.open(config) as store:
        loads = BoundedLoads(store, deadline_s=0.3)
        GATES[space].set()
        assert loads.load([held], [0], Destinations(1).pointers) == {}  # now in the buffer
        GATES[space].clear()
        late = loads.load([stalled], [0], Destinations(1).pointers)
        assert isinstance(late[stalled], LateLoadError)
        assert ENTERED[space].is_set()  # its prefetch is held at the gate

        dst = Destinations(1)
        done: list[dict[bytes, Any]] = []
        getter = threading.Thread(target=lambda: done.append(loads.load([held], [0], dst.pointers)))
        getter.start()
        getter.join(BOUND_S)
        released = not getter.is_alive()
        GATES[space].set()  # on the code before: the get waited for the prefetch's step
        getter.join(BOUND_S)
        assert released, f"a get of a block the buffer holds waited {BOUND_S} s behind a late get"
        assert done == [{}]
        assert dst.shard(0) == payload(held, 0, SHARD)
        store.wait_prefetches()
        assert loads.late_blocks == 1


@pytest.mark.parametrize("with_buffer", [True, False], ids=["buffer", "no-buffer"])
def test_gets_behind_a_full_queue_return_by_their_deadline(space: str, with_buffer: bool) -> None:
    """With the tier stalled, late tasks fill the rank's queue (a depth of 1 here): a get whose
    prefetch (with a buffer) or load (without one) finds it full fails its blocks as late by its
    deadline, rather than wait ``queue_timeout_s`` and raise ``TimeoutError`` into the engine."""
    blocks = [block(i) for i in range(1, 5)]
    stored(space, blocks)
    queue = {"load_queue_depth": 1, "queue_timeout_s": 600.0, "wait_timeout_s": 600.0}
    with ucm.open(stack(space, with_buffer, gated=True, **queue)) as store:
        loads = BoundedLoads(store, deadline_s=0.3)
        outcomes: list[Any] = []

        def gets() -> None:
            for b in blocks:
                try:
                    outcomes.append(loads.load([b], [0], Destinations(1).pointers))
                except BaseException as exc:  # the outcome under test
                    outcomes.append(exc)

        getter = threading.Thread(target=gets)
        getter.start()
        getter.join(BOUND_S)
        released = not getter.is_alive()
        GATES[space].set()
        getter.join(BOUND_S)
        assert released, f"4 gets of 0.3 s each took more than {BOUND_S} s"
        assert len(outcomes) == 4
        for b, outcome in zip(blocks, outcomes, strict=True):
            assert isinstance(outcome, dict), outcome
            assert list(outcome) == [b] and isinstance(outcome[b], LateLoadError)
        assert loads.late_blocks == 4
        if with_buffer:
            store.wait_prefetches()
        assert loads.wait_late(BOUND_S)


@pytest.mark.parametrize("namespace", [None, "tenant-a"], ids=["default", "tenant"])
def test_a_block_absent_from_every_tier_is_read_once(space: str, namespace: str | None) -> None:
    """The prefetch's miss fails it at once, in any namespace (its failures name the caller's
    ids, not the ids the tiers store): it is not read again through staging memory."""
    present, absent = block(1), block(2)
    # What the tier holds: the block under the id it stores in that namespace.
    (stored_id,) = namespaces.scope(namespace or namespaces.DEFAULT_NAMESPACE, [present])
    CONTENTS.setdefault(space, {})[(stored_id, 0)] = payload(present, 0, SHARD)
    with ucm.open(stack(space, with_buffer=True)) as store:
        loads = BoundedLoads(store, deadline_s=BOUND_S)
        dst = Destinations(2)
        failed = loads.load([present, absent], [0, 0], dst.pointers, namespace=namespace)
        assert list(failed) == [absent] and isinstance(failed[absent], KeyMissingError)
        assert dst.shard(0) == payload(present, 0, SHARD)
        assert loads.staged_blocks == 0
        assert len(RECORDED[space]) == 2  # each block asked of the tier once


def test_blocks_a_full_buffer_cannot_hold_are_loaded_through_staging(space: str) -> None:
    blocks = [block(i) for i in range(12)]
    stored(space, blocks)
    with ucm.open(stack(space, with_buffer=True, slots=3)) as store:
        loads = BoundedLoads(store, deadline_s=BOUND_S)
        dst = Destinations(len(blocks))
        assert loads.load(blocks, [0] * len(blocks), dst.pointers) == {}
        assert [dst.shard(i) for i in range(len(blocks))] == [payload(b, 0, SHARD) for b in blocks]
        assert loads.late_blocks == 0 and loads.late_staging_bytes == 0
        assert 0 < loads.staged_blocks < len(blocks)  # the buffer held some of them


@pytest.mark.parametrize("with_buffer", [True, False], ids=["buffer", "no-buffer"])
def test_an_absent_and_a_corrupt_block_fail_with_their_cause_and_the_rest_loads(
    space: str, with_buffer: bool
) -> None:
    present, absent, corrupt = block(1), block(2), block(3)
    stored(space, [present, corrupt])
    CORRUPT.setdefault(space, set()).add((corrupt, 0))
    with ucm.open(stack(space, with_buffer)) as store:
        loads = BoundedLoads(store, deadline_s=BOUND_S)
        dst = Destinations(3)
        failed = loads.load([absent, present, corrupt], [0] * 3, dst.pointers)
        assert sorted(failed) == sorted([absent, corrupt])
        assert isinstance(failed[absent], KeyMissingError)
        assert isinstance(failed[corrupt], TierError)
        assert not isinstance(failed[corrupt], KeyMissingError | LateLoadError)
        assert dst.shard(1) == payload(present, 0, SHARD)
        assert dst.shard(0) == bytes(SHARD) and dst.shard(2) == bytes(SHARD)
        assert loads.late_blocks == 0


@pytest.mark.parametrize("with_buffer", [True, False], ids=["buffer", "no-buffer"])
def test_the_same_shard_twice_in_one_load_is_refused_as_the_store_refuses_it(
    space: str, with_buffer: bool
) -> None:
    blocks = [block(5), block(6), block(5)]
    stored(space, blocks[:2])
    with ucm.open(stack(space, with_buffer)) as store:
        dst = Destinations(3)
        with pytest.raises(
            InvalidArgumentError, match=r"block_ids\[2\] with shard_index 0 repeats"
        ):
            BoundedLoads(store, deadline_s=BOUND_S).load(blocks, [0] * 3, dst.pointers)
        assert dst.untouched()
        stats = store.stats()  # every pin released (no pins without a buffer)
        assert stats.get("pinned_shards", 0) == stats.get("unpinned_shards", 0)


def test_late_loads_from_several_threads_keep_their_staging_until_each_is_over(space: str) -> None:
    threads_n = 4
    blocks = [block(20 + i) for i in range(threads_n * 2)]
    stored(space, blocks)
    with ucm.open(stack(space, with_buffer=False, gated=True)) as store:
        loads = BoundedLoads(store, deadline_s=0.3)
        results: list[dict[bytes, Any]] = []
        dsts = [Destinations(2) for _ in range(threads_n)]

        def run(n: int) -> None:
            results.append(loads.load(blocks[2 * n : 2 * n + 2], [0, 0], dsts[n].pointers))

        threads = [threading.Thread(target=run, args=(n,)) for n in range(threads_n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(BOUND_S)
        assert not any(thread.is_alive() for thread in threads)
        assert len(results) == threads_n
        assert all(isinstance(c, LateLoadError) for r in results for c in r.values())
        assert loads.late_blocks == 2 * threads_n
        assert loads.late_staging_bytes == 2 * threads_n * SHARD
        GATES[space].set()
        assert loads.wait_late(BOUND_S)
        assert loads.late_staging_bytes == 0
        assert all(dst.untouched() for dst in dsts)


@pytest.mark.parametrize("with_buffer", [True, False], ids=["buffer", "no-buffer"])
@pytest.mark.parametrize(
    ("pointers", "message"),
    [
        (
            [[8192, 12288], [16384]],
            r"^dst_ptrs\[1\] must list 2 address\(es\) \(tensor_size_list=\[1536, 2560\]\), "
            r"got \[16384\]$",
        ),
        (
            [[0, 8192], [12288, 16384]],
            r"^dst_ptrs\[0\]\[0\]=0 is not valid: expected an integer address \(at least 4096: "
            r"below is the null page\)$",
        ),
    ],
    ids=["count", "null-page"],
)
def test_pointers_that_do_not_match_the_shard_are_refused_before_anything_runs(
    space: str, with_buffer: bool, pointers: list[list[int]], message: str
) -> None:
    """The store's own pointer check, on both paths: ``load_data`` makes it on the buffer's,
    and the staging copy, which writes these addresses itself, before anything runs."""
    stored(space, [block(1), block(2)])
    with ucm.open(stack(space, with_buffer)) as store:
        loads = BoundedLoads(store, deadline_s=BOUND_S)
        with pytest.raises(InvalidArgumentError, match=message):
            loads.load([block(1), block(2)], [0, 0], pointers)
        if not with_buffer:  # refused before the load: the tier was never asked
            assert RECORDED.get(space, []) == [] and loads.staged_blocks == 0


@pytest.mark.parametrize("value", [0, -1, 3600.5, math.nan, math.inf, "5", True, None])
def test_a_bad_deadline_is_refused_naming_the_key_and_the_valid_range(value: Any) -> None:
    with pytest.raises(ConfigError) as refused:
        check_load_deadline_s(value, "extra['load_deadline_s']")
    assert str(refused.value) == (
        f"extra['load_deadline_s']: {value!r} is not valid: expected a number of seconds in "
        "(0, 3600] (default 10)"
    )


def test_a_good_deadline_is_taken_as_seconds() -> None:
    assert check_load_deadline_s(3600, "k") == 3600.0
    assert check_load_deadline_s(0.05, "k") == 0.05
