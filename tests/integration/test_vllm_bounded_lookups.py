"""vLLM's scheduler over a black-holed tier (issue 21, bounded look-ups): an fsspec tier whose S3
endpoint accepts connections and never answers sits below the posix tier. The scheduler thread
never waits on it past the tier's deadline: one request decodes while a second one with a new
long prompt is admitted, and both are computed (tokens identical to a run without a connector),
driven through vLLM 0.32's own ``Scheduler`` (``_vllm_sched.py``).

Bounds here are generous outcome checks (the step came back instead of waiting for s3fs's own
~106 s time-out), not speed measurements (those are in ``ucm bench``)."""

from __future__ import annotations

import importlib.util
import os
import random
import threading
import time
import uuid
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        raise RuntimeError("vllm is not installed, and CI must run the vLLM tests")
    pytest.skip("vllm is not installed", allow_module_level=True)

from harness.faults import BlackHole
from ucm.breaker import LOOKUP_THREADS

from ._vllm_sched import BLOCK, Harness

DEADLINE_S = 1.0
"""``lookup_timeout_ms``'s default: the stack below states no deadline or breaker keys."""
SLACK_S = 15.0


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(count)]


@pytest.mark.timeout(400)
def test_a_black_holed_tier_never_stalls_the_scheduler(tmp_path: Path) -> None:
    hole = BlackHole()
    fsspec = {
        "type": "fsspec",
        "url": f"s3://ucm-test/{uuid.uuid4().hex}",
        "storage_options": hole.storage_options,
    }
    harness: list[Harness] = []
    steps: list[float] = []
    failure: list[BaseException] = []
    built = threading.Event()
    first, second = tokens(1, 4 * BLOCK + 3), tokens(2, 12 * BLOCK + 7)

    def drive() -> None:
        try:
            h = Harness(tmp_path, async_scheduling=False, extra_tiers=[fsspec])
            harness.append(h)
            built.set()
            h.add("decoding", first, 24)
            # Its look-up (on the look-up pool), its prefill, then decode steps; a step with
            # nothing to schedule while the look-up runs is quick, so the loops are bounded in
            # time, not in steps.
            began = time.monotonic()
            while len(h.outputs.get("decoding", [])) < 3 and time.monotonic() - began < 60:
                started = time.monotonic()
                h.step()
                h.settle_dumps()
                steps.append(time.monotonic() - started)
            h.add("new", second, 4)  # admitted while the first one decodes
            began = time.monotonic()
            while time.monotonic() - began < 60:
                if not h.scheduler.has_requests():
                    break
                started = time.monotonic()
                h.step()
                h.settle_dumps()
                steps.append(time.monotonic() - started)
        except BaseException as exc:
            failure.append(exc)
            built.set()

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    try:
        # vLLM's imports and set-up (minutes on a loaded 2-core machine), and the epoch
        # look-up at the connector's start, bounded by the tier's deadline.
        built.wait(240)
        assert built.is_set(), "the connector's start-up is still waiting on the tier"
        # Three look-ups at most wait their deadline (the breaker then opens); everything
        # else is local (posix, the simulated model).
        thread.join(3 * DEADLINE_S + 2 * SLACK_S)
        assert not thread.is_alive(), (
            f"the scheduler is still waiting on the black-holed tier ({len(steps)} steps done)"
        )
        if failure:
            raise failure[0]
        (h,) = harness
        assert not h.scheduler.has_requests()
        assert max(steps) < DEADLINE_S + SLACK_S, steps
        # Both computed, tokens as without a connector, nothing served from UCM.
        assert h.outputs["decoding"] == Harness.expected_outputs(first, 24)
        assert h.outputs["new"] == Harness.expected_outputs(second, 4)
        assert h.cached_tokens == {"decoding": 0, "new": 0}
        assert not any(record.loads for record in h.records)
        assert not h.violations and not h.wrong_stored_blocks()
        # The scheduler's store: the epoch look-up at start-up, the first request's prefix
        # look-up and its save filter timed out (3, the default breaker.failures; look-ups
        # already running on the look-up pool when the breaker opened time out too); every
        # look-up after that was answered "miss" by the open breaker without asking.
        (tier,) = [t for t in h.connector._store.stats()["tiers"] if t["type"] == "fsspec"]
        assert 3 <= tier["lookup_timeouts"] <= 3 + LOOKUP_THREADS, tier
        assert tier["breaker_opens"] == 1, tier
        assert tier["breaker_state"] == "open"
        assert tier["breaker_skips"] >= 1  # the second request's prefix look-up at least
    finally:
        hole.close()  # requests still hanging fail now
        for h in harness:
            h.close()


@pytest.mark.timeout(400)
def test_a_look_up_a_tier_holds_up_never_holds_the_other_requests(tmp_path: Path) -> None:
    """With the breaker kept shut, every look-up of the black-holed tier runs to its deadline:
    the second request's look-up runs on the look-up pool while the first one keeps decoding,
    step after step; it is scheduled (a miss, recomputed) once the look-up has answered."""
    hole = BlackHole()
    fsspec = {
        "type": "fsspec",
        "url": f"s3://ucm-test/{uuid.uuid4().hex}",
        "storage_options": hole.storage_options,
        "breaker": {"failures": 1000},
    }
    first, second = tokens(3, 2 * BLOCK + 3), tokens(4, 6 * BLOCK + 5)
    h = None
    try:
        h = Harness(tmp_path, async_scheduling=False, extra_tiers=[fsspec])
        h.add("decoding", first, 400)
        started = time.monotonic()
        while "decoding" not in h.outputs and time.monotonic() - started < 120:
            h.step()  # its own look-up is deferred: steps with nothing scheduled, then it runs
            h.settle_dumps()
        assert "decoding" in h.outputs
        h.add("new", second, 4)
        added = len(h.records)
        started = time.monotonic()
        while h.scheduler.has_requests() and time.monotonic() - started < 240:
            h.step()
            h.settle_dumps()
        assert not h.scheduler.has_requests()
        after = [record.scheduled for record in h.records[added:]]
        first_new = next(i for i, scheduled in enumerate(after) if "new" in scheduled)
        # Before the fix the step that admitted "new" waited out the look-up (1 s) and
        # scheduled it at once: "decoding" never ran a step while "new" was being looked up.
        decoded_meanwhile = sum("decoding" in scheduled for scheduled in after[:first_new])
        assert decoded_meanwhile >= 2, after[:4]
        assert h.outputs["decoding"] == Harness.expected_outputs(first, 400)
        assert h.outputs["new"] == Harness.expected_outputs(second, 4)
        assert h.cached_tokens == {"decoding": 0, "new": 0}
        assert not h.violations and not h.wrong_stored_blocks()
    finally:
        hole.close()
        if h is not None:
            h.close()
