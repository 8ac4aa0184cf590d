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
            for _ in range(4):  # its prefill, then decode steps
                started = time.monotonic()
                h.step()
                h.settle_dumps()
                steps.append(time.monotonic() - started)
            h.add("new", second, 4)  # admitted while the first one decodes
            for _ in range(200):
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
        # look-up and its save filter timed out (3, the default breaker.failures); every
        # look-up after that was answered "miss" by the open breaker without asking.
        (tier,) = [t for t in h.connector._store.stats()["tiers"] if t["type"] == "fsspec"]
        assert (tier["lookup_timeouts"], tier["breaker_opens"]) == (3, 1), tier
        assert tier["breaker_state"] == "open"
        assert tier["breaker_skips"] >= 2  # the second request's prefix look-up, save filters
    finally:
        hole.close()  # requests still hanging fail now
        for h in harness:
            h.close()
