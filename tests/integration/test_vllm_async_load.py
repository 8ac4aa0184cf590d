"""Asynchronous loads (issue 21) under vLLM 0.32's own ``Scheduler`` and ``AsyncScheduler``
(``_vllm_sched.py``): a request whose matched blocks are not all in the CacheBuffer waits in
``WAITING_FOR_REMOTE_KVS`` while the others run, and is promoted when the worker reports its
load in ``finished_recving``; a load that fails or passes its deadline is recomputed; an abort,
a preemption or a connector reset during a load leaks no block, never hangs, and nothing is
written into a vLLM block after the load is reported over.

The lower tier is a real posix tier with a per-shard read latency (``slowposix`` of the
load-path tests); the CacheBuffer of the engine that loads is empty (another ``unique_id``), so
every block comes from below. Tests assert outcomes (tokens, states, counts), never timings."""

from __future__ import annotations

import importlib.util
import os
import random
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

from ._vllm_sched import BLOCK, LOOKUP_TIMEOUT_MS, Harness

pytestmark = pytest.mark.timeout(600)

STEPS_MAX = 300_000
"""Bound on the steps of one wait: a step with nothing to compute takes well under a
millisecond, and a load may take up to its deadline (10 s by default) on a busy machine."""


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(count)]


A = tokens(1, 8 * BLOCK + 5)
"""8 full blocks and 5 tokens."""
D = tokens(9, 2 * BLOCK + 3)
"""The decoder's prompt: nothing of it is in UCM."""
E = tokens(5, 2 * BLOCK + 7)
"""A prompt the loading engine computed itself: its 2 full blocks are in its CacheBuffer."""

Make = Callable[..., Harness]


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Make]:
    _tiers.register()
    made: list[Harness] = []
    posix = tmp_path / "posix"

    def factory(
        delay_s: float = 0.0, buffer: dict[str, Any] | None = None, **kwargs: Any
    ) -> Harness:
        tiers = [
            {"type": "buffer", "capacity": "16MiB", **(buffer or {})},
            {
                "type": "slowposix",
                "path": str(posix),
                "delay_s": delay_s,
                "lookup_timeout_ms": LOOKUP_TIMEOUT_MS,
            },
        ]
        harness = Harness(
            tmp_path / f"h{len(made)}",
            tiers=tiers,
            unique_id=f"vllm-async-{uuid.uuid4().hex[:10]}",  # an empty CacheBuffer each
            **kwargs,
        )
        made.append(harness)
        return harness

    yield factory
    for harness in made:
        harness.close()
    _tiers.unregister()


def _store_a(make: Make) -> None:
    """A's 8 full blocks in the posix tier (written through by another engine)."""
    h = make(async_scheduling=False)
    h.add("a", A, 2)
    h.run(STEPS_MAX)
    assert h.stored_count("a") == 8
    assert not any(record.async_loads for record in h.records)
    h.worker._store.drain()  # the write-through to posix is done


def _step_until(h: Harness, done: Callable[[], bool]) -> None:
    for _ in range(STEPS_MAX):
        if done():
            return
        if not h.scheduler.has_requests():
            h.flush()
            continue
        h.step()
        h.settle_dumps()
    raise AssertionError(f"not done after {STEPS_MAX} steps: {list(h.scheduler.requests)}")


def _async_steps(h: Harness, req_id: str) -> list[int]:
    return [r.step for r in h.records if req_id in r.async_loads]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_load_from_below_the_buffer_is_async_and_the_decoder_keeps_running(
    make: Make, async_scheduling: bool
) -> None:
    _store_a(make)
    h = make(delay_s=0.05, async_scheduling=async_scheduling)
    h.add("d", D, 60)
    h.step()  # d prefills
    h.add("b", A, 3)
    _step_until(h, lambda: h.status("b") == "WAITING_FOR_REMOTE_KVS")
    (load_step,) = _async_steps(h, "b")
    assert not any("b" in r.loads for r in h.records)  # nothing loaded before a forward pass
    _step_until(h, lambda: "b" in h.finished_recving)
    waiting = [r for r in h.records if r.step >= load_step and "b" not in r.scheduled]
    # The decoder ran while b's blocks came up from the slow tier.
    assert any(r.scheduled.get("d") == 1 for r in waiting)
    (done,) = [r for r in h.records if "b" in r.finished_recving]
    assert done.invalid == set()
    h.run(STEPS_MAX)
    assert h.outputs["b"] == Harness.expected_outputs(A, 3)
    assert h.cached_tokens["b"] == 8 * BLOCK
    if not async_scheduling:  # see test_vllm_scheduler: the simulated runner's token recovery
        assert h.outputs["d"] == Harness.expected_outputs(D, 60)
    assert h.finished_recving == {"b": 1}
    h.assert_clean()


def test_a_buffer_hit_stays_synchronous(make: Make) -> None:
    """Blocks all in the CacheBuffer: one memcpy before the forward pass, no waiting state."""
    h = make(async_scheduling=False)
    h.add("a", A, 2)
    h.run(STEPS_MAX)
    h.add("b", A, 3)
    h.run(STEPS_MAX)
    assert [r.step for r in h.records if "b" in r.loads]
    assert not any(r.async_loads for r in h.records)
    assert h.outputs["b"] == Harness.expected_outputs(A, 3)
    assert h.cached_tokens["b"] == 8 * BLOCK
    h.assert_clean()


def test_a_buffer_hit_is_not_held_up_by_an_async_load_from_a_slow_tier(make: Make) -> None:
    """b's blocks come up from a tier that takes seconds per shard; c, admitted meanwhile, is
    all in the CacheBuffer: its synchronous load (before a forward pass) is a memcpy and does not
    wait for b's prefetch, which the native queue walks in a lane of its own."""
    _store_a(make)
    h = make(
        delay_s=3.0,
        async_scheduling=False,
        extra_config={"ucm_load_deadline_s": 600.0},
        buffer={"wait_timeout_s": 600.0},  # a prefetch's step may wait that long for its fills
    )
    h.add("e", E, 2)
    h.run(STEPS_MAX)  # e's blocks are now in this engine's CacheBuffer
    h.add("b", A, 3)
    _step_until(h, lambda: h.status("b") == "WAITING_FOR_REMOTE_KVS")
    h.add("c", E, 3)
    _step_until(h, lambda: "c" in h.finished)
    # c was served and finished while b's blocks were still on their way up.
    assert "b" not in h.finished_recving
    assert [r.step for r in h.records if "c" in r.loads]  # a synchronous load
    assert h.outputs["c"] == Harness.expected_outputs(E, 3)
    assert h.cached_tokens["c"] == 2 * BLOCK
    _step_until(h, lambda: "b" in h.finished_recving)
    h.run(STEPS_MAX)
    assert h.outputs["b"] == Harness.expected_outputs(A, 3)
    assert h.cached_tokens["b"] == 8 * BLOCK
    h.assert_clean()


def test_a_buffer_hit_evicted_before_its_load_is_recomputed_not_read_from_below(
    make: Make,
) -> None:
    """c's blocks were all in the CacheBuffer at its look-up, so its load is synchronous, run
    before the forward pass; one of them leaves the buffer before the load (still in posix, which
    takes seconds a shard here). The load does not read it from below inside the step: it fails,
    and vLLM recomputes it."""
    h = make(delay_s=3.0, async_scheduling=False)
    h.add("e", E, 2)
    h.run(STEPS_MAX)
    h.worker._store.drain()  # e's 2 blocks are in the CacheBuffer and in posix
    ids = h.block_ids_for(E)
    h.evict_buffer[h._step + 1] = [ids[1]]  # c's step: after its look-up, before its load
    h.add("c", E, 3)
    h.run(STEPS_MAX)
    assert [r.step for r in h.records if "c" in r.loads]  # a synchronous load
    assert not any(r.async_loads for r in h.records)
    (failed_step,) = [r for r in h.records if r.invalid]
    assert len(failed_step.invalid) == 1
    stats = h.worker._worker.stats.data
    assert stats["load_failed_blocks"] == 1
    assert stats["loaded_blocks"] == 1  # c's first block, a memcpy
    assert h.outputs["c"] == Harness.expected_outputs(E, 3)
    h.assert_clean()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("bad", [0, 3], ids=["first", "middle"])
def test_a_failed_async_load_is_recomputed_once(
    make: Make, async_scheduling: bool, bad: int
) -> None:
    """Block ``bad`` disappears from every tier between the lookup and the load: its load
    fails, vLLM recomputes from it, and the request is not served the failed blocks again."""
    _store_a(make)
    h = make(async_scheduling=async_scheduling)
    ids = h.block_ids_for(A)
    h.evict[1] = [ids[bad]]
    h.add("b", A, 3)
    h.run(STEPS_MAX)
    assert len(_async_steps(h, "b")) == 1  # one load: never looked up and loaded again
    (done,) = [r for r in h.records if "b" in r.finished_recving]
    table = next(r.async_loads["b"] for r in h.records if "b" in r.async_loads)
    assert table[bad] in done.invalid
    assert done.invalid <= set(table)
    if not async_scheduling:
        assert h.outputs["b"] == Harness.expected_outputs(A, 3)
    # Only block ``bad`` failed (vLLM's num_cached_tokens counts the planned hit, as
    # it was when the request was admitted, unless it was looked up again: bad == 0).
    assert h.worker._worker.stats.data["load_failed_blocks"] == 1
    assert h.cached_tokens["b"] == (0 if bad == 0 else 8 * BLOCK)
    h.assert_clean()
    # What b recomputed was saved right: a later request is served all 8 blocks.
    h.add("c", A, 3)
    h.run(STEPS_MAX)
    assert h.outputs["c"] == Harness.expected_outputs(A, 3)
    assert h.cached_tokens["c"] == 8 * BLOCK
    h.assert_clean()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_load_past_its_deadline_is_recomputed_and_its_late_bytes_touch_no_vllm_block(
    make: Make, async_scheduling: bool
) -> None:
    _store_a(make)
    h = make(
        delay_s=0.5,
        async_scheduling=async_scheduling,
        extra_config={"ucm_load_deadline_s": 0.05},
    )
    h.add("d", D, 30)
    h.add("b", A, 3)
    _step_until(h, lambda: "b" in h.finished_recving)
    (done,) = [r for r in h.records if "b" in r.finished_recving]
    table = next(r.async_loads["b"] for r in h.records if "b" in r.async_loads)
    assert table[0] in done.invalid  # the first block was late: every block is recomputed
    assert h.worker._worker.stats.data["load_late_blocks"] >= 1
    h.run(STEPS_MAX)
    # The late bytes arrive now: into the CacheBuffer only.
    before = {name: tensor.clone() for name, tensor in h.kv.items()}
    h.worker._store.wait_prefetches()
    assert all(before[name].equal(tensor) for name, tensor in h.kv.items())
    assert h.outputs["b"] == Harness.expected_outputs(A, 3)
    if not async_scheduling:
        assert h.outputs["d"] == Harness.expected_outputs(D, 30)
    assert h.cached_tokens["b"] == 0
    h.assert_clean()
    # They warmed the CacheBuffer: the next request is served all 8 blocks from it,
    # synchronously under the synchronous scheduler. Under the AsyncScheduler a synchronous
    # load must be held in the CacheBuffer, and with two engines' workers in this process
    # (``_store_a``'s and this one) nothing can be: the hit loads asynchronously.
    first = len(h.records)
    h.add("c", A, 3)
    h.run(STEPS_MAX)
    assert any(r.async_loads for r in h.records[first:]) == async_scheduling
    assert h.cached_tokens["c"] == 8 * BLOCK
    assert h.outputs["c"] == Harness.expected_outputs(A, 3)
    h.assert_clean()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_abort_during_an_async_load_frees_every_block_once_the_load_is_over(
    make: Make, async_scheduling: bool
) -> None:
    _store_a(make)
    h = make(delay_s=0.1, async_scheduling=async_scheduling)
    h.add("b", A, 3)
    _step_until(h, lambda: h.status("b") == "WAITING_FOR_REMOTE_KVS")
    h.abort("b")
    assert "b" in h.scheduler.requests  # vLLM keeps its blocks while the load runs
    h.run(STEPS_MAX)
    assert h.finished_recving == {"b": 1}
    assert "b" not in h.outputs or h.outputs["b"] == []
    h.assert_clean()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_connector_reset_during_an_async_load(make: Make, async_scheduling: bool) -> None:
    """vLLM refuses to reset its own prefix cache while the load holds blocks, and resets the
    connector: the load still completes, the request's tokens are right, and nothing it
    computes is served under the new epoch."""
    _store_a(make)
    h = make(delay_s=0.1, async_scheduling=async_scheduling)
    h.add("b", A, 3)
    _step_until(h, lambda: h.status("b") == "WAITING_FOR_REMOTE_KVS")
    assert h.scheduler.reset_prefix_cache(reset_connector=True) is False
    h.run(STEPS_MAX)
    assert h.finished_recving == {"b": 1}
    assert h.outputs["b"] == Harness.expected_outputs(A, 3)
    h.assert_clean()
    h.add("c", A, 3)
    h.run(STEPS_MAX)
    assert h.cached_tokens["c"] == 0  # nothing saved before the reset is served
    assert h.outputs["c"] == Harness.expected_outputs(A, 3)
    h.assert_clean()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_preempted_request_resumes_through_an_async_load(
    make: Make, async_scheduling: bool
) -> None:
    """d is preempted (vLLM's reset_prefix_cache(reset_running_requests=True)) after its
    blocks left the CacheBuffer: it comes back through WAITING_FOR_REMOTE_KVS as a preempted
    request, from the posix tier, with its tokens unchanged."""
    h = make(delay_s=0.02, async_scheduling=async_scheduling)
    prompt = A
    h.add("d", prompt, 40)
    _step_until(h, lambda: len(h.outputs.get("d", [])) >= 20)
    h.settle_dumps()
    h.worker._store.drain()
    ids = h.block_ids_for(prompt)
    buffer = h.side_store().tiers[0]
    removed = buffer.batched_remove(h.side_store().layout.keys_of_blocks(ids), force=True)
    assert removed == 8
    # With asynchronous scheduling on, vLLM frees a preempted request's blocks only once the
    # steps in flight are processed (deferred frees): its reset needs them processed first.
    h.flush()
    assert h.scheduler.reset_prefix_cache(reset_running_requests=True) is True
    assert h.status("d") == "PREEMPTED"
    _step_until(h, lambda: h.status("d") == "WAITING_FOR_REMOTE_KVS")
    assert h.scheduler.requests["d"].num_preemptions == 1
    h.run(STEPS_MAX)
    assert h.finished_recving == {"d": 1}
    if not async_scheduling:
        assert h.outputs["d"] == Harness.expected_outputs(prompt, 40)
    h.assert_clean()


def test_an_async_loads_copy_into_vllms_blocks_never_holds_up_a_step(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the prefetch is over, the copy from the CacheBuffer into vLLM's blocks is submitted
    and collected when done: ``get_finished`` never waits for an unfinished task (before the
    change it copied the whole prefix there and waited for the copy, inside the step)."""
    _store_a(make)
    h = make(delay_s=0.05, async_scheduling=False)
    store = h.worker._store
    connector = h.worker
    inside: list[bool] = []
    waited_unfinished: list[object] = []
    real_wait, real_get_finished = store.wait, connector.get_finished

    def wait(task: object, *args: object, **kwargs: object) -> object:
        if inside and not store.check(task):
            waited_unfinished.append(task)
        return real_wait(task, *args, **kwargs)

    def get_finished(*args: object, **kwargs: object) -> object:
        inside.append(True)
        try:
            return real_get_finished(*args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(store, "wait", wait)
    monkeypatch.setattr(connector, "get_finished", get_finished)
    h.add("d", D, 60)
    h.step()
    h.add("b", A, 3)
    _step_until(h, lambda: "b" in h.finished_recving)
    (done,) = [r for r in h.records if "b" in r.finished_recving]
    assert done.invalid == set()
    assert waited_unfinished == []
    h.run(STEPS_MAX)
    assert h.outputs["b"] == Harness.expected_outputs(A, 3)
    assert h.cached_tokens["b"] == 8 * BLOCK
    assert h.outputs["d"] == Harness.expected_outputs(D, 60)
    h.assert_clean()
