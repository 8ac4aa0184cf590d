"""A vLLM scheduler that starts while the tier holding the reset epoch's record does not answer
(issue 21's bounded look-ups met issue 12's reset epochs), driven through vLLM 0.32's own
``Scheduler`` (``_vllm_sched.py``).

Engine A saves prompt P's blocks, then resets (``reset_cache``: what an RL weight sync calls) and
saves prompt R in the new epoch 1. P's epoch-0 blocks are then overwritten with other KV, as the
old weights' KV is to the new weights. Engine B opens the same posix tier with its look-ups
answering past their deadline (its control record reads too). Before the fix, B read "no
marker" (the bounded look-up's "absent"), started in epoch 0, and once the tier answered again
served P's epoch-0 blocks: wrong tokens. Now B starts with a nonce (it is served only what it
saved itself), adopts epoch 1 once the tier answers, and is then served R's epoch-1 blocks and
none of P's.
"""

from __future__ import annotations

import importlib.util
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        raise RuntimeError("vllm is not installed, and CI must run the vLLM tests")
    pytest.skip("vllm is not installed", allow_module_level=True)

import torch

from ._vllm_sched import BLOCK, HEAD_SIZE, KV_HEADS, LAYERS, Harness

DEADLINE_MS = 200
ADOPT_BOUND_S = 60.0
RUN_BOUND_S = 120.0


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(count)]


def _run_one(h: Harness, req_id: str, prompt: list[int], max_tokens: int = 4) -> list[int]:
    """Steps until vLLM holds no request; bounded in time, not steps: while a look-up runs on
    the connector's pool past the scheduler's wait, a step schedules nothing and is quick."""
    h.add(req_id, prompt, max_tokens)
    began = time.monotonic()
    while h.scheduler.has_requests() and time.monotonic() - began < RUN_BOUND_S:
        h.step()
        h.settle_dumps()
        time.sleep(0.002)
    assert not h.scheduler.has_requests(), f"{req_id} did not finish in {RUN_BOUND_S} s"
    assert not h.violations, h.violations
    return h.outputs[req_id]


@pytest.mark.timeout(600)
def test_an_engine_started_while_the_records_tier_is_slow_never_serves_an_older_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ucm_backends.posix import PosixTier

    posix = [
        {
            "type": "posix",
            "path": str(tmp_path / "posix"),
            "lookup_timeout_ms": DEADLINE_MS,
            "breaker": {"probe_interval_ms": 500},
        }
    ]
    p, r, s = tokens(1, 4 * BLOCK + 5), tokens(2, 3 * BLOCK + 2), tokens(3, 2 * BLOCK + 1)

    a = Harness(tmp_path, async_scheduling=False, unique_id="epoch-a", tiers=posix)
    try:
        assert _run_one(a, "a_p", p) == Harness.expected_outputs(p, 4)
        old_ids = a.block_ids_for(p)
        assert a.side_store().lookup(old_ids) == [True] * 4
        assert a.connector.reset_cache() is True
        assert _run_one(a, "a_r", r) == Harness.expected_outputs(r, 4)  # saved in epoch 1
        assert a.connector._sched.epoch == 1
        # P's epoch-0 blocks become the KV of other weights.
        side = a.side_store()
        side.remove(old_ids, force=True)
        nbytes = KV_HEADS * BLOCK * 2 * HEAD_SIZE * 4
        other = [torch.randint(0, 1 << 30, (nbytes // 4,), dtype=torch.int32) for _ in LAYERS]
        for block_id in old_ids:
            side.wait(side.dump([block_id], [0], [[t.view(torch.uint8) for t in other]]))
        side.drain()
        assert side.lookup(old_ids) == [True] * 4
    finally:
        a.close()

    slow = threading.Event()
    slow.set()
    answer = PosixTier.lookup

    def lookup(self: PosixTier, keys: Sequence[Any]) -> list[bool]:
        if slow.is_set():
            time.sleep(DEADLINE_MS / 1000 * 3)
        return answer(self, keys)

    read_records = PosixTier.read_control

    def read_control(self: PosixTier, names: Sequence[bytes]) -> list[int | None]:
        if slow.is_set():
            time.sleep(DEADLINE_MS / 1000 * 3)
        return read_records(self, names)

    monkeypatch.setattr(PosixTier, "lookup", lookup)
    monkeypatch.setattr(PosixTier, "read_control", read_control)
    b = Harness(tmp_path, async_scheduling=False, unique_id="epoch-b", tiers=posix)
    counted: Counter[str] = Counter()  # what vLLM collects from the connector each step
    collect = b.connector.get_kv_connector_stats

    def collecting() -> Any:
        stats = collect()
        if stats is not None:
            counted.update(stats.data)
        return stats

    b.connector.get_kv_connector_stats = collecting  # type: ignore[method-assign]
    try:
        assert b.connector._sched.epoch is None  # unknown: ids carry a nonce
        assert _run_one(b, "b_s", s) == Harness.expected_outputs(s, 4)
        assert b.cached_tokens["b_s"] == 0
        assert counted["requests_epoch_unknown"] == 1
        slow.clear()
        began = time.monotonic()
        while b.connector._sched.epoch is None and time.monotonic() - began < ADOPT_BOUND_S:
            b.step()  # steps without requests: the epoch is adopted between steps
            time.sleep(0.05)
        assert b.connector._sched.epoch == 1, "the epoch was not adopted once the tier answered"
        # P as saved before the reset is never served: computed, right tokens.
        assert _run_one(b, "b_p", p) == Harness.expected_outputs(p, 4)
        assert b.cached_tokens["b_p"] == 0
        # R as saved after it is served from A's epoch-1 blocks.
        assert _run_one(b, "b_r", r) == Harness.expected_outputs(r, 4)
        assert b.cached_tokens["b_r"] == 3 * BLOCK
        assert counted["requests_epoch_unknown"] == 1  # b_s only
    finally:
        b.close()
