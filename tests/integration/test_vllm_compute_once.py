"""Two engines on one CacheBuffer compute a shared prefix once (issue 21: "with two replicas,
every document computed once on the node"), driven through vLLM 0.32's own ``Scheduler``
(``_vllm_sched.py``): engine A is computing a prompt (chunked prefill, several steps) when the
same prompt reaches engine B. B waits for A's blocks (``compute_waits``) instead of computing
them, and is then served all of them; tokens equal the right ones. A claim never holds B past
``ucm_compute_wait_ms``, and ends with A's request or A's connector.

The two connectors are two file descriptions of the buffer's lock file, as two processes'
are; a claim that a killed process leaves is the kernel's to drop
(``tests/integration/test_claims.py`` checks that across real processes)."""

from __future__ import annotations

import importlib.util
import os
import random
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        raise RuntimeError("vllm is not installed, and CI must run the vLLM tests")
    pytest.skip("vllm is not installed", allow_module_level=True)

from ._vllm_sched import BLOCK, LOOKUP_TIMEOUT_MS, Harness

BOUND_S = 240.0


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(count)]


def _pair(tmp_path: Path, wait_ms: int = 240_000) -> tuple[Harness, Harness, list[Counter[str]]]:
    """Two engines on one CacheBuffer. ``wait_ms`` (``ucm_compute_wait_ms``) is longer than
    any wait of a test that expects B to be served A's blocks, on a busy machine too; the
    posix tier's look-up deadline is the harness's (a busy machine's posix look-up can pass
    the default 1 s: the epoch of an engine started then is unknown, and it salts its ids
    with a nonce of its own, so it finds nothing of the other's)."""
    unique_id = f"compute-once-{uuid.uuid4().hex[:10]}"
    tiers = [
        {"type": "buffer", "capacity": "64MiB"},
        {
            "type": "posix",
            "path": str(tmp_path / "posix"),
            "lookup_timeout_ms": LOOKUP_TIMEOUT_MS,
        },
    ]
    extra = {"ucm_compute_wait_ms": wait_ms}
    engines, counts = [], []
    for _ in range(2):
        h = Harness(
            tmp_path,
            async_scheduling=False,
            unique_id=unique_id,
            tiers=tiers,
            extra_config=extra,
            max_num_batched_tokens=3 * BLOCK,  # a 10-block prompt takes 4 steps
        )
        counted: Counter[str] = Counter()
        collect = h.connector.get_kv_connector_stats

        def collecting(collect: Any = collect, counted: Counter[str] = counted) -> Any:
            stats = collect()
            if stats is not None:
                counted.update(stats.data)
            return stats

        h.connector.get_kv_connector_stats = collecting  # type: ignore[method-assign]
        engines.append(h)
        counts.append(counted)
    return engines[0], engines[1], counts


def _step(h: Harness) -> None:
    if h.scheduler.has_requests():
        h.step()
        h.settle_dumps()


def _until_computing(h: Harness, req_id: str) -> None:
    """Steps until the request has computed some tokens (its look-up runs on the pool first)."""
    began = time.monotonic()
    while h.scheduler.requests[req_id].num_computed_tokens == 0:
        assert time.monotonic() - began < BOUND_S, f"{req_id} was never scheduled"
        _step(h)
        time.sleep(0.002)


def _until_done(*engines: Harness) -> None:
    began = time.monotonic()
    while any(h.scheduler.has_requests() for h in engines):
        assert time.monotonic() - began < BOUND_S, "the engines did not finish in time"
        for h in engines:
            _step(h)
        time.sleep(0.002)
    for h in engines:
        assert not h.violations, h.violations


@pytest.mark.timeout(600)
def test_a_prompt_another_engine_is_computing_is_waited_for_and_served(tmp_path: Path) -> None:
    a, b, (count_a, count_b) = _pair(tmp_path)
    prompt = tokens(1, 10 * BLOCK + 3)
    try:
        a.add("a", prompt, 4)
        _until_computing(a, "a")  # A computes the first 3 blocks (and claims all 10)
        b.add("b", prompt, 4)
        began = time.monotonic()  # B's look-up runs on its pool; then B waits: A claims its
        while not count_b["compute_waits"] and time.monotonic() - began < BOUND_S:
            _step(b)  # first missing block
            time.sleep(0.01)
        for _ in range(3):
            _step(b)
        assert count_b["compute_waits"] == 1
        assert "b" not in b.outputs and b.scheduler.requests["b"].num_computed_tokens == 0
        _until_done(a, b)
        expected = Harness.expected_outputs(prompt, 4)
        assert a.outputs["a"] == expected and b.outputs["b"] == expected
        assert a.cached_tokens["a"] == 0
        assert b.cached_tokens["b"] == 10 * BLOCK  # every full block from A: computed once
        assert count_a["compute_waits"] == 0
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(600)
def test_a_claim_holds_another_engine_at_most_ucm_compute_wait_ms(tmp_path: Path) -> None:
    a, b, (_, count_b) = _pair(tmp_path, wait_ms=1_000)
    prompt = tokens(2, 10 * BLOCK + 3)
    try:
        a.add("a", prompt, 4)
        _until_computing(a, "a")  # 3 blocks computed, 10 claimed; then A stalls
        b.add("b", prompt, 4)
        began = time.monotonic()
        _until_done(b)
        waited = time.monotonic() - began
        assert count_b["compute_waits"] == 1
        assert waited >= 1.0  # it did wait for A ...
        assert b.outputs["b"] == Harness.expected_outputs(prompt, 4)  # ... then computed
        assert b.cached_tokens["b"] == 3 * BLOCK  # what A had saved
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(600)
def test_claims_end_with_the_request_and_with_the_connector(tmp_path: Path) -> None:
    a, b, (_, count_b) = _pair(tmp_path)
    first, second = tokens(3, 10 * BLOCK + 3), tokens(4, 10 * BLOCK + 3)
    try:
        claims = a.connector._claims
        assert claims is not None
        a.add("a", first, 4)
        _until_computing(a, "a")
        ids = a.block_ids_for(first)
        assert set(ids[3:]) <= claims.held <= set(ids)  # the first 3: until their dumps report
        a.abort("a")  # an abort: the blocks it will never compute are not claimed any more
        _until_done(a)
        assert claims.held <= set(ids[:3])  # at most blocks in the store (not waited for)
        b.add("b", first, 4)
        _until_done(b)
        assert count_b["compute_waits"] == 0 and b.cached_tokens["b"] == 3 * BLOCK
        a.add("a2", second, 4)
        _until_computing(a, "a2")
        assert set(a.block_ids_for(second)[3:]) <= claims.held
        a.close()  # the connector's file description is closed: its claims are gone
        b.add("b2", second, 4)
        _until_done(b)
        assert count_b["compute_waits"] == 0
        assert b.outputs["b2"] == Harness.expected_outputs(second, 4)
    finally:
        b.close()
