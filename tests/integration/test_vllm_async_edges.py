"""Edge cases of asynchronous loading (``ucm_async_load``) under vLLM 0.32's own ``Scheduler``
and ``AsyncScheduler`` (``_vllm_sched.py``): a prefetch the full queue refuses, a synchronous
load (a CacheBuffer hit at look-up) whose block another process of the node is refilling from
a stalled tier, a block evicted from the CacheBuffer between look-up and synchronous load
under the AsyncScheduler, and the hold that keeps an eviction from doing that.

The tier below the CacheBuffer is an in-process ``recording`` tier (``loadpath._tiers``) whose
loads a test holds at a gate: events are ordered by what the tier is doing, never by sleeping.
Tests assert outcomes (tokens, states, counts, which load failed), never timings."""

from __future__ import annotations

import importlib.util
import os
import random
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        raise RuntimeError("vllm is not installed, and CI must run the vLLM tests")
    pytest.skip("vllm is not installed", allow_module_level=True)

from loadpath import _tiers

from ._vllm_sched import BLOCK, Harness

pytestmark = pytest.mark.timeout(600)

STEPS_MAX = 300_000
GATE_WAIT_S = 120.0
"""Bound on waiting for a gated load to reach its gate."""


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(count)]


A = tokens(1, 8 * BLOCK + 5)
F = tokens(2, 8 * BLOCK + 5)
G = tokens(3, 8 * BLOCK + 5)
E = tokens(5, 2 * BLOCK + 7)


class Space:
    """One recording tier's contents and gate (unique per test)."""

    def __init__(self) -> None:
        self.name = f"edges-{uuid.uuid4().hex[:10]}"
        _tiers.GATES[self.name] = threading.Event()
        _tiers.ENTERED[self.name] = threading.Event()

    def tier(self, gated: bool) -> dict[str, Any]:
        return {"type": "recording", "space": self.name, "gated": gated}

    def open_gate(self) -> None:
        _tiers.GATES[self.name].set()

    def gate_open(self) -> bool:
        return _tiers.GATES[self.name].is_set()

    def close_gate(self) -> None:
        """Holds the tier's next loads and dumps again (ENTERED is set by the next one)."""
        _tiers.ENTERED[self.name].clear()
        _tiers.GATES[self.name].clear()

    def wait_entered(self) -> None:
        assert _tiers.ENTERED[self.name].wait(GATE_WAIT_S), "no load reached the gate"

    def close(self) -> None:
        self.open_gate()
        _tiers.CONTENTS.pop(self.name, None)
        _tiers.RECORDED.pop(self.name, None)


Make = Callable[..., Harness]


@pytest.fixture
def space() -> Iterator[Space]:
    _tiers.register()
    made = Space()
    yield made
    made.close()
    _tiers.unregister()


@pytest.fixture
def make(tmp_path: Path, space: Space) -> Iterator[Make]:
    made: list[Harness] = []

    def factory(
        gated: bool = False,
        buffer: dict[str, Any] | None = None,
        lower: dict[str, Any] | None = None,
        unique_id: str | None = None,
        **kwargs: Any,
    ) -> Harness:
        tiers = [
            {"type": "buffer", "capacity": "16MiB", **(buffer or {})},
            {**space.tier(gated), **(lower or {})},
        ]
        harness = Harness(
            tmp_path / f"h{len(made)}",
            tiers=tiers,
            unique_id=unique_id or f"vllm-edges-{uuid.uuid4().hex[:10]}",
            **kwargs,
        )
        made.append(harness)
        return harness

    yield factory
    space.open_gate()  # a test that failed at a gate: its loads finish, the stores close
    for harness in made:
        harness.close()


def _store(make: Make, *prompts: list[int]) -> None:
    """The prompts' full blocks in the recording tier (written through by another engine)."""
    h = make(async_scheduling=False)
    for index, prompt in enumerate(prompts):
        h.add(f"s{index}", prompt, 2)
    h.run(STEPS_MAX)
    h.worker._store.drain()
    for index, prompt in enumerate(prompts):
        assert h.stored_count(f"s{index}") == len(prompt) // BLOCK


def _bufferless(tmp_path: Path, space: Space, **kwargs: Any) -> Harness:
    """A harness over the gated recording tier alone (no CacheBuffer); the test closes it."""
    return Harness(
        tmp_path / "h",
        tiers=[space.tier(True)],
        unique_id=f"vllm-edges-{uuid.uuid4().hex[:10]}",
        **kwargs,
    )


def _step_until(h: Harness, done: Callable[[], bool], settle: bool = True) -> None:
    """Steps until ``done()``; ``settle``: waits for the step's dumps after each step."""
    for _ in range(STEPS_MAX):
        if done():
            return
        if not h.scheduler.has_requests():
            h.flush()
            continue
        h.step()
        if settle:
            h.settle_dumps()
    raise AssertionError(f"not done after {STEPS_MAX} steps: {list(h.scheduler.requests)}")


def _unfinished_waits(h: Harness, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """From now on, every task the worker's store is asked to wait for while it is still
    unfinished (a step that waits on a dump, say) is appended to the returned list."""
    store = h.worker._store
    real_wait = store.wait
    waited: list[object] = []

    def wait(task: Any, *args: Any, **kwargs: Any) -> Any:
        if not store.check(task):
            waited.append(task)
        return real_wait(task, *args, **kwargs)

    monkeypatch.setattr(store, "wait", wait)
    return waited


def _async_table(h: Harness, req_id: str) -> list[int]:
    (table,) = [r.async_loads[req_id] for r in h.records if req_id in r.async_loads]
    return table


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_prefetch_the_full_queue_refuses_is_recomputed_and_reported_once(
    make: Make, space: Space, async_scheduling: bool
) -> None:
    """load_queue_depth 1: b's prefetch holds the dispatcher at the tier's gate, c's waits in
    the prefetch queue, d's is refused at submit (the step never waits on UCM's backlog). d is
    reported in finished_recving with every block a load error and computes its prompt; b and
    c are served every block once the gate opens."""
    _store(make, A, F, G)
    h = make(
        gated=True,
        async_scheduling=async_scheduling,
        buffer={"load_queue_depth": 1},
        extra_config={"ucm_load_deadline_s": 600.0},
    )
    h.add("b", A, 3)
    _step_until(h, lambda: h.status("b") == "WAITING_FOR_REMOTE_KVS")
    space.wait_entered()  # b's prefetch holds the dispatcher: the prefetch queue is empty
    h.add("c", F, 3)
    _step_until(h, lambda: h.status("c") == "WAITING_FOR_REMOTE_KVS")
    h.add("d", G, 3)
    _step_until(h, lambda: "d" in h.finished_recving)
    assert not space.gate_open()
    (done,) = [r for r in h.records if "d" in r.finished_recving]
    assert done.invalid == set(_async_table(h, "d"))  # every block of d: none reached the buffer
    assert "b" not in h.finished_recving and "c" not in h.finished_recving
    space.open_gate()
    h.run(STEPS_MAX)
    assert h.finished_recving == {"b": 1, "c": 1, "d": 1}
    if not async_scheduling:  # see test_vllm_scheduler: the simulated runner's token recovery
        for req_id, prompt in (("b", A), ("c", F), ("d", G)):
            assert h.outputs[req_id] == Harness.expected_outputs(prompt, 3), req_id
    assert h.cached_tokens["b"] == 8 * BLOCK
    assert h.cached_tokens["c"] == 8 * BLOCK
    assert h.cached_tokens["d"] == 0  # its first block failed: looked up again, not served
    stats = h.worker._worker.stats.data
    assert stats["load_failed_blocks"] == 8
    assert stats["loaded_blocks"] == 16
    h.assert_clean()


def test_a_buffer_hit_this_engines_prefetch_is_refilling_is_recomputed_not_waited_for(
    make: Make, space: Space
) -> None:
    """b and c are admitted in one step. c's 2 blocks were in the CacheBuffer at its look-up:
    its load is synchronous, run before the forward pass. b (c's prompt and 4 more blocks, those
    only in the tier below) loads asynchronously. Between the look-ups and the loads c's block
    1 leaves the buffer, and b's prefetch starts bringing it back up from a tier that does not
    answer (held at the gate). c's load must not wait for that fill inside the step: block 1
    fails and vLLM recomputes it. On the code before, the step waited until the gate opened."""
    h = make(
        gated=True,
        lower={"write": "none"},  # h's own dumps stay in its CacheBuffer: none reach the gate
        async_scheduling=False,
        extra_config={"ucm_load_deadline_s": 600.0, "ucm_lookup_wait_ms": 10_000},
    )
    h.add("e", E, 2)
    h.run(STEPS_MAX)  # E's 2 blocks: in h's CacheBuffer only
    b_prompt = E[: 2 * BLOCK] + tokens(7, 4 * BLOCK + 3)
    _store(make, b_prompt)  # b's 6 blocks in the tier below (2 of them E's)
    ids = h.block_ids_for(E)
    assert h.block_ids_for(b_prompt)[:2] == ids
    store = h.worker._store
    prefetch = store.prefetch

    def prefetch_reaching_the_gate(*args: Any, **kwargs: Any) -> Any:
        task = prefetch(*args, **kwargs)
        space.wait_entered()  # b's prefetch owns its slots and waits at the gate
        return task

    store.prefetch = prefetch_reaching_the_gate  # type: ignore[method-assign]
    h.evict_buffer[h._step + 1] = [ids[1]]  # after the step's look-ups, before its loads
    # Bounds the wait of the code before (up to 8 rounds of wait_timeout_s otherwise).
    opener = threading.Timer(20.0, space.open_gate)
    opener.start()
    try:
        h.add("b", b_prompt, 3)
        h.add("c", E, 3)
        record = h.step()
        assert set(record.async_loads) == {"b"}
        assert set(record.loads) == {"c"}
        assert not space.gate_open(), "c's synchronous load waited for b's prefetch"
        assert record.invalid == {record.loads["c"][1]}
    finally:
        opener.cancel()
        space.open_gate()
    store.prefetch = prefetch  # type: ignore[method-assign]
    h.run(STEPS_MAX)
    assert h.finished_recving == {"b": 1}
    stats = h.worker._worker.stats.data
    assert stats["load_failed_blocks"] == 1  # c's block 1
    assert stats["loaded_blocks"] == 1 + 6  # c's block 0 (a memcpy), b's 6 blocks
    assert h.outputs["c"] == Harness.expected_outputs(E, 3)
    assert h.outputs["b"] == Harness.expected_outputs(b_prompt, 3)
    assert h.cached_tokens["b"] == 6 * BLOCK
    h.assert_clean()


@pytest.mark.parametrize("force", [True, False], ids=["forced-removal", "eviction"])
def test_under_the_async_scheduler_a_buffer_hit_loads_asynchronously_so_a_removal_costs_no_token(
    make: Make, space: Space, force: bool
) -> None:
    """Under the AsyncScheduler a synchronous load that failed cost its request a token (vLLM
    keeps the token the next step, scheduled before the failure was known, decoded over the
    failed block), and vLLM 0.32 may never schedule it again. So even c's load of blocks all
    in the CacheBuffer is asynchronous there, and nothing is held for it. A removal of one of
    them between the look-up and the load (forced, or an eviction's) only sends the prefetch
    below for it, in the background: c's load succeeds, and its tokens are right. (Before,
    the load was synchronous: the forced removal failed it and c's tokens were wrong.)"""
    h = make(async_scheduling=True)
    h.add("e", E, 2)
    h.run(STEPS_MAX)
    h.worker._store.drain()
    read_below = len(_tiers.RECORDED.get(space.name, []))
    ids = h.block_ids_for(E)
    removals = h.evict_buffer if force else h.remove_buffer
    removals[h._step + 1] = [ids[1]]  # c's step: after its look-up, before its load
    first = len(h.records)
    h.add("c", E, 3)
    h.run(STEPS_MAX)
    assert h.outputs["c"] == Harness.expected_outputs(E, 3)
    records = h.records[first:]
    assert not any(r.loads for r in records)
    assert [list(r.async_loads) for r in records if r.async_loads] == [["c"]]
    assert not any(r.invalid for r in records)
    stats = h.worker._worker.stats.data
    assert stats["load_failed_blocks"] == 0
    assert stats["loaded_blocks"] == 2
    assert len(_tiers.RECORDED.get(space.name, [])) == read_below + 1  # the removed one
    h.assert_clean()


def test_a_buffer_hit_is_held_from_its_look_up_to_its_load_so_no_eviction_fails_it(
    make: Make, space: Space
) -> None:
    """Under the synchronous scheduler c's blocks, all in the CacheBuffer at its look-up, load
    synchronously; an eviction (a removal that keeps what a process holds) comes between the
    look-up and the load. The scheduler holds them from the look-up until the load's outcome
    is known: the load does not fail (vLLM would recompute the block), c's tokens are right,
    and the hold is gone afterwards."""
    h = make(async_scheduling=False)
    h.add("e", E, 2)
    h.run(STEPS_MAX)
    h.worker._store.drain()
    ids = h.block_ids_for(E)
    h.remove_buffer[h._step + 1] = [ids[1]]  # c's step: after its look-up, before its load
    first = len(h.records)
    h.add("c", E, 3)
    h.run(STEPS_MAX)
    assert [r.step for r in h.records[first:] if "c" in r.loads]  # a synchronous load
    assert not any(r.async_loads for r in h.records[first:])
    assert not any(r.invalid for r in h.records[first:])
    stats = h.worker._worker.stats.data
    assert stats["load_failed_blocks"] == 0
    assert stats["loaded_blocks"] == 2
    assert h.outputs["c"] == Harness.expected_outputs(E, 3)
    # Released once the load was confirmed: the same removal now takes the block.
    store = h.connector._store
    keys = store.layout.keys_of_blocks([ids[1]])
    assert store.tiers[0].batched_remove(keys, force=False) == 1
    h.assert_clean()


def test_a_load_of_a_block_this_rank_is_still_dumping_waits_at_most_the_load_deadline(
    tmp_path: Path, space: Space
) -> None:
    """With ``ucm_async_load: false`` every load is synchronous (without it, a load from this
    stack without a CacheBuffer would be direct). e's dumps are held by a tier that does
    not answer (the gate), and c asks for e's blocks: the scheduler serves them (they are being
    dumped), and the worker's load must wait for that dump, but at most ucm_load_deadline_s.
    Then both blocks fail, vLLM recomputes them, and c's tokens are right; so for d, a step
    later (the worker does not wait for that dump again). On the code before, the step waited
    for the dump until the gate opened."""
    h = _bufferless(
        tmp_path,
        space,
        async_scheduling=False,
        extra_config={"ucm_load_deadline_s": 0.5, "ucm_async_load": False},
    )
    opener = threading.Timer(60.0, space.open_gate)  # bounds the wait of the code before
    opener.start()
    try:
        h.add("e", E, 2)
        for _ in range(50):
            if len(h.outputs.get("e", [])) == 2:
                break
            h.step()
        assert h.outputs["e"] == Harness.expected_outputs(E, 2)
        space.wait_entered()  # e's dump waits at the gate
        for req_id in ("c", "d"):
            h.add(req_id, E, 3)
            record = h.step()
            assert not space.gate_open(), f"{req_id}'s load waited for e's dump"
            assert set(record.loads) == {req_id}
            assert record.invalid == set(record.loads[req_id])  # both blocks: recomputed
            for _ in range(50):
                if len(h.outputs.get(req_id, [])) == 3:
                    break
                h.step()
            assert not space.gate_open()
            assert h.outputs[req_id] == Harness.expected_outputs(E, 3)
    finally:
        opener.cancel()
        space.open_gate()
    try:
        h.run(STEPS_MAX)
        stats = h.worker._worker.stats.data
        assert stats["load_failed_blocks"] == 4
        assert stats["loaded_blocks"] == 0
        h.assert_clean()
    finally:
        h.close()


def _preempt_one_of_two_while_the_gate_is_closed(
    h: Harness, space: Space, seed: int, what: str
) -> None:
    """Two requests (prompts of seeds ``seed`` and ``seed + 1``) growing to 10 blocks each,
    in a KV cache that holds 15: vLLM preempts one while a ``what`` (dump, write) waits at
    the tier's gate. Both finish, with the right tokens, while the gate is still closed; the
    gate opens on the way out (a 60 s timer bounds the wait of the code before)."""
    p1, p2 = tokens(seed, 5 * BLOCK + 10), tokens(seed + 1, 5 * BLOCK + 10)
    opener = threading.Timer(60.0, space.open_gate)
    opener.start()
    try:
        h.add("p1", p1, 60)
        h.add("p2", p2, 60)
        _step_until(h, lambda: any(r.preempted for r in h.records), settle=False)
        space.wait_entered()  # a dump or write waits at the gate
        assert not space.gate_open(), f"the preemption waited for a {what} the tier holds"
        _step_until(h, lambda: {"p1", "p2"} <= set(h.finished_sending), settle=False)
        assert not space.gate_open(), f"a request waited for a {what} the tier holds"
        assert h.outputs["p1"] == Harness.expected_outputs(p1, 60)
        assert h.outputs["p2"] == Harness.expected_outputs(p2, 60)
        assert h.violations == []
    finally:
        opener.cancel()
        space.open_gate()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_preemption_never_waits_for_a_dump_that_a_tier_holds(
    tmp_path: Path, space: Space, async_scheduling: bool
) -> None:
    """No CacheBuffer, and a tier that holds every dump (the gate stays closed). 15 usable
    vLLM blocks and two requests growing to 10 blocks each: vLLM preempts one, whose blocks
    a dump still has to write. The worker copied them into staging memory when it submitted
    the dump, so the preemption waits for nothing: both requests finish with the right
    tokens while the gate is still closed, and no dump reads a block vLLM freed. On the code
    before, ``handle_preemptions`` waited for the dump until the gate opened (the test's
    60 s timer), and a finished request's blocks stayed held as long."""
    h = _bufferless(
        tmp_path,
        space,
        async_scheduling=async_scheduling,
        num_blocks=16,
        # The victim's blocks are being dumped when it resumes: its load fails them then.
        extra_config={"ucm_load_deadline_s": 0.5},
    )
    _preempt_one_of_two_while_the_gate_is_closed(h, space, 11, "dump")
    try:
        h.run(STEPS_MAX)
        h.settle_dumps()  # the dumps held at the gate write what was copied before the free
        assert h.stored_count("p1") > 0 and h.stored_count("p2") > 0
        h.assert_clean()  # every stored block is its prefix's KV
    finally:
        h.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_preemption_never_waits_for_write_back_a_tier_holds(
    make: Make, space: Space, async_scheduling: bool
) -> None:
    """A CacheBuffer of 2 slots over a ``write: back`` tier that holds every write (the gate
    stays closed): a dump finds the slots dirty and goes straight down, or waits for the
    write-back debt to be paid, so its task waits at the gate. Two requests growing to 10
    blocks each in 15 usable vLLM blocks: vLLM preempts one. Saves over a buffer that writes
    back are staged, so the preemption waits for nothing: both requests finish with the right
    tokens while the gate is closed, and no dump reads a block vLLM freed. On the code
    before, a dump read vLLM's blocks until the tier took it, and ``handle_preemptions``
    waited for it until the gate opened (the test's 60 s timer)."""
    h = make(
        gated=True,
        buffer={"capacity": "32KiB"},
        lower={"write": "back"},
        async_scheduling=async_scheduling,
        num_blocks=16,
        extra_config={"ucm_load_deadline_s": 0.5},
    )
    assert h.worker._store.buffer.stats()["capacity_slots"] == 2
    _preempt_one_of_two_while_the_gate_is_closed(h, space, 13, "write")
    h.run(STEPS_MAX)
    h.settle_dumps()
    h.assert_clean()  # every stored block is its prefix's KV


def test_staged_saves_hold_at_most_the_kv_caches_size_and_skip_the_rest(
    tmp_path: Path, space: Space
) -> None:
    """No CacheBuffer, a tier that holds every dump: four requests of 5 full blocks each,
    one after the other, in a KV cache of 16 blocks. The first three saves are copied into
    staging memory (15 blocks); the fourth would take it past the KV cache's size, so it is
    skipped and counted failed, never waited for: every request finishes while the gate is
    closed. Once it opens, the 15 staged blocks are written, each its prefix's KV."""
    h = _bufferless(
        tmp_path,
        space,
        async_scheduling=True,
        num_blocks=16,
    )
    prompts = {f"r{i}": tokens(30 + i, 5 * BLOCK + 3) for i in range(4)}
    opener = threading.Timer(60.0, space.open_gate)  # bounds a wait for the gate
    opener.start()
    try:
        for req_id, prompt in prompts.items():
            h.add(req_id, prompt, 1)
            _step_until(h, lambda r=req_id: r in h.finished_sending, settle=False)
            assert h.outputs[req_id] == Harness.expected_outputs(prompt, 1)
        assert not space.gate_open(), "a request waited for a dump the tier holds"
        stats = h.worker._worker.stats.data
        assert stats["save_failed_blocks"] == 5
        assert stats["saved_blocks"] == 0
    finally:
        opener.cancel()
        space.open_gate()
    try:
        h.run(STEPS_MAX)
        h.settle_dumps()
        assert [h.stored_count(req_id) for req_id in prompts] == [5, 5, 5, 0]
        h.assert_clean()
    finally:
        h.close()


@pytest.mark.parametrize("dump_ends", [False, True], ids=["deadline-passes", "dump-ends"])
def test_a_direct_load_of_blocks_this_rank_is_still_dumping_never_holds_the_step(
    tmp_path: Path, space: Space, monkeypatch: pytest.MonkeyPatch, dump_ends: bool
) -> None:
    """As above under the AsyncScheduler, where the load is direct (asynchronous, straight
    into vLLM's blocks): no step waits for e's dump, which waits at the gate (the worker
    never waits on an unfinished task). c's load is submitted once that dump is over
    (``dump-ends``: the gate opens, both blocks load) or fails its blocks once
    ucm_load_deadline_s has passed (``deadline-passes``: vLLM recomputes them); c's tokens
    are right either way. (Before, the step waited for the dump up to the deadline.)"""
    h = _bufferless(
        tmp_path,
        space,
        async_scheduling=True,
        extra_config={"ucm_load_deadline_s": 120.0 if dump_ends else 0.5},
    )
    opener = threading.Timer(60.0, space.open_gate)  # bounds the wait of the code before
    opener.start()
    try:
        h.add("e", E, 2)
        _step_until(h, lambda: len(h.outputs.get("e", [])) == 2, settle=False)
        assert h.outputs["e"] == Harness.expected_outputs(E, 2)
        space.wait_entered()  # e's dump waits at the gate
        waited = _unfinished_waits(h, monkeypatch)
        h.add("c", E, 3)
        h.step()
        h.step()  # under the AsyncScheduler, the first step's record is processed with this
        assert not space.gate_open(), "c's step waited for e's dump"
        assert waited == []
        (table,) = [r.async_loads["c"] for r in h.records if "c" in r.async_loads]
        if dump_ends:
            space.open_gate()
        _step_until(h, lambda: "c" in h.finished_recving, settle=False)
        (done,) = [r for r in h.records if "c" in r.finished_recving]
        assert done.invalid == (set() if dump_ends else set(table))
        _step_until(h, lambda: len(h.outputs.get("c", [])) == 3, settle=False)
        assert space.gate_open() == dump_ends
        assert waited == []
        assert h.outputs["c"] == Harness.expected_outputs(E, 3)
    finally:
        opener.cancel()
        space.open_gate()
    try:
        h.run(STEPS_MAX)
        stats = h.worker._worker.stats.data
        assert stats["load_failed_blocks"] == (0 if dump_ends else 2)
        assert stats["load_late_blocks"] == (0 if dump_ends else 2)
        assert stats["loaded_blocks"] == (2 if dump_ends else 0)
        h.assert_clean()
    finally:
        h.close()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_direct_load_past_its_deadline_is_recomputed_and_its_late_bytes_reach_no_vllm_block(
    tmp_path: Path, space: Space, async_scheduling: bool
) -> None:
    """No CacheBuffer, so c's load of e's blocks is direct, and the tier holds it at the gate.
    Past ucm_load_deadline_s c is reported with both blocks failed (late) while the gate stays
    closed, vLLM recomputes them, and c's tokens are right. c's blocks then go to d, a new
    prompt in a KV cache just big enough for it; only then does the gate open, and the late
    load ends in its staging memory (freed once it is over), never in d's blocks: d's tokens
    are right. On the code before, c's load had no deadline: c waited for the gate."""
    h = _bufferless(
        tmp_path,
        space,
        async_scheduling=async_scheduling,
        num_blocks=8,
        extra_config={"ucm_load_deadline_s": 0.5},
    )
    from ucm.integration import bounded

    store = h.worker._store
    space.open_gate()
    d_prompt = tokens(6, 6 * BLOCK + 3)  # 7 of the 7 usable blocks, with its decode
    opener = threading.Timer(60.0, space.open_gate)  # bounds the wait of the code before
    try:
        h.add("e", E, 2)
        _step_until(h, lambda: len(h.outputs.get("e", [])) == 2)
        h.run(STEPS_MAX)
        assert h.stored_count("e") == 2
        space.close_gate()
        opener.start()
        h.add("c", E, 3)
        _step_until(h, lambda: "c" in h.finished_recving, settle=False)
        assert not space.gate_open(), "c's load waited for the gate"
        (table,) = [r.async_loads["c"] for r in h.records if "c" in r.async_loads]
        (done,) = [r for r in h.records if "c" in r.finished_recving]
        assert done.invalid == set(table)
        late = bounded.late_of(store)
        assert len(late) == 1 and not store.check(late[0])  # still at the gate
        _step_until(h, lambda: len(h.outputs.get("c", [])) == 3, settle=False)
        assert h.outputs["c"] == Harness.expected_outputs(E, 3)
        _step_until(h, lambda: "c" not in h.scheduler.requests, settle=False)
        h.add("d", d_prompt, 4)
        _step_until(h, lambda: len(h.outputs.get("d", [])) >= 1, settle=False)
        freed_c = set(next(iter(h._held_blocks().values()), []))  # d's blocks
        assert set(table) <= freed_c, (table, freed_c)  # d holds c's former blocks
        assert not space.gate_open()
    finally:
        opener.cancel()
        space.open_gate()
    try:
        store.wait(late[0], timeout_s=GATE_WAIT_S)  # the late load ends: into staging
        bounded.reap_late()
        assert bounded.late_of(store) == []
        h.run(STEPS_MAX)
        assert h.outputs["d"] == Harness.expected_outputs(d_prompt, 4)
        stats = h.worker._worker.stats.data
        assert stats["load_late_blocks"] == 2
        assert stats["load_failed_blocks"] == 2
        h.assert_clean()
    finally:
        h.close()


def test_an_async_load_of_blocks_this_rank_is_still_dumping_starts_its_prefetch_after_them(
    make: Make, space: Space, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CacheBuffer of 2 slots, both dirty (f's blocks, whose write-back waits at the
    gate): e's dumps find no slot and go straight down, where they wait at the gate too. c
    asks for e's blocks under the AsyncScheduler (served: they are being dumped): no step
    waits for e's dump (the worker never waits on an unfinished task); c's prefetch waits
    for it, and past ucm_load_deadline_s c's blocks fail, vLLM recomputes them, and c's
    tokens are right. (Before, the step waited for the dump up to the deadline.)"""
    h = make(
        gated=True,
        buffer={"capacity": "32KiB"},
        lower={"write": "back"},
        async_scheduling=True,
        extra_config={"ucm_load_deadline_s": 0.5},
    )
    assert h.worker._store.buffer.stats()["capacity_slots"] == 2
    opener = threading.Timer(60.0, space.open_gate)  # bounds the wait of the code before
    opener.start()
    try:
        f = tokens(12, 2 * BLOCK + 3)
        h.add("f", f, 1)
        _step_until(h, lambda: "f" in h.outputs, settle=False)
        h.add("e", E, 2)
        _step_until(h, lambda: len(h.outputs.get("e", [])) == 2, settle=False)
        for _ in range(3):  # e's dump is submitted after its last step
            h.step()
        assert any(not h.worker._worker.save_done(p) for p in h.worker._worker._saves)
        waited = _unfinished_waits(h, monkeypatch)
        h.add("c", E, 3)
        _step_until(h, lambda: "c" in h.finished_recving, settle=False)
        (table,) = [r.async_loads["c"] for r in h.records if "c" in r.async_loads]
        (done,) = [r for r in h.records if "c" in r.finished_recving]
        assert done.invalid == set(table)  # both blocks: recomputed
        _step_until(h, lambda: len(h.outputs.get("c", [])) == 3, settle=False)
        assert not space.gate_open()
        assert waited == []
        assert h.outputs["c"] == Harness.expected_outputs(E, 3)
    finally:
        opener.cancel()
        space.open_gate()
    h.run(STEPS_MAX)
    stats = h.worker._worker.stats.data
    assert stats["load_late_blocks"] == 2
    h.assert_clean()


X = tokens(9, 5 * BLOCK + 3)
"""6 blocks: beside b's 9 only once b's are freed, and then in 4 of them."""


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_aborted_async_loads_blocks_are_reused_and_its_late_bytes_never_reach_them(
    make: Make, space: Space, async_scheduling: bool
) -> None:
    """b is aborted while its prefetch waits at the tier's gate, and its load passes its
    deadline: it is reported in finished_recving (every block failed), vLLM frees its blocks,
    and x, which could not fit beside it, computes in them. The gate opens while x runs: b's
    late bytes land in the CacheBuffer, never in the vLLM blocks x now holds."""
    _store(make, A)
    h = make(
        gated=True,
        lower={"write": "none"},  # x's dumps stay in the CacheBuffer: none reach the gate
        async_scheduling=async_scheduling,
        num_blocks=12,  # 11 usable: b's 9 and x's 6 do not fit together
        extra_config={"ucm_load_deadline_s": 0.05},
    )
    h.add("b", A, 3)
    _step_until(h, lambda: h.status("b") == "WAITING_FOR_REMOTE_KVS")
    space.wait_entered()  # b's prefetch waits at the gate
    h.abort("b")
    h.add("x", X, 20)
    _step_until(h, lambda: len(h.outputs.get("x", [])) >= 2)
    b_table = _async_table(h, "b")
    x_table = list(h.scheduler.kv_cache_manager.get_block_ids("x")[0])
    assert set(b_table) & set(x_table), "x must compute in blocks b held"
    assert h.finished_recving == {"b": 1}
    (done,) = [r for r in h.records if "b" in r.finished_recving]
    assert done.invalid == set(b_table)
    space.open_gate()
    h.worker._store.wait_prefetches()  # b's late bytes: into the CacheBuffer only
    h.run(STEPS_MAX)
    if not async_scheduling:  # see test_vllm_scheduler: the simulated runner's token recovery
        assert h.outputs["x"] == Harness.expected_outputs(X, 20)
    assert "b" not in h.outputs or h.outputs["b"] == []
    assert h.worker._worker.stats.data["load_late_blocks"] == 8  # b's 8 full blocks
    h.assert_clean()
