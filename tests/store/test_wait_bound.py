"""``store.wait(task, timeout_s=...)``: a bounded wait on a task a tier holds up, on both
completions (the native queue's, with a buffer tier; Python's, without one)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ucm

from .conftest import SHARED, DictTier, block, payload

SHARD = 4096
GATE_S = 60.0
"""Longest a held-up tier load waits for the test to let it go (a failing test never hangs)."""


def stack(with_buffer: bool) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"type": "dict", "space": "low"}]
    if with_buffer:
        tiers.insert(0, {"type": "buffer", "capacity": 16 * SHARD})
    return {
        "unique_id": f"t-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": tiers,
    }


@pytest.fixture
def gate(dict_tier: type[DictTier], monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Holds every dict-tier load until set; set at teardown so no thread is left waiting."""
    opened = threading.Event()
    load = DictTier.load

    def held_load(self: DictTier, keys: Any, destinations: Any) -> Any:
        assert opened.wait(GATE_S), "the test never let the held load go"
        return load(self, keys, destinations)

    monkeypatch.setattr(DictTier, "load", held_load)
    try:
        yield opened
    finally:
        opened.set()


@pytest.mark.parametrize("with_buffer", [True, False], ids=["buffer+dict", "dict"])
def test_a_wait_past_its_bound_names_the_task_and_a_later_wait_gets_the_bytes(
    gate: threading.Event, with_buffer: bool
) -> None:
    blocks = [block(1), block(2)]
    for b in blocks:
        SHARED.setdefault("low", {})[(b, 0)] = payload(b, 0, SHARD)
    with ucm.open(stack(with_buffer)) as store:
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
        task = store.load(blocks, [0, 0], dst)
        message = (
            rf"task {task.task_id} \(load of 2 keys\) did not finish within {{}} s; it is still "
            r"running: keep its memory until store.check\(task\) is True"
        )
        with pytest.raises(TimeoutError, match=message.format("0.2")):
            store.wait(task, timeout_s=0.2)
        with pytest.raises(TimeoutError, match=message.format("0")):
            store.wait(task, timeout_s=0)
        assert store.check(task) is False
        assert all(not d[0].any() for d in dst)  # held up: nothing written yet

        gate.set()
        store.wait(task, timeout_s=GATE_S)
        assert store.check(task) is True
        assert [d[0].numpy().tobytes() for d in dst] == [payload(b, 0, SHARD) for b in blocks]
        store.wait(task, timeout_s=0)  # a finished task: no wait, no error


@pytest.mark.parametrize("with_buffer", [True, False], ids=["buffer+dict", "dict"])
def test_a_bounded_wait_still_names_each_failed_key(
    dict_tier: type[DictTier], with_buffer: bool
) -> None:
    present = block(1)
    SHARED.setdefault("low", {})[(present, 0)] = payload(present, 0, SHARD)
    with ucm.open(stack(with_buffer)) as store:
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in range(2)]
        task = store.load([present, block(2)], [0, 0], dst)
        with pytest.raises(ucm.TaskError) as failed:
            store.wait(task, timeout_s=GATE_S)
        assert list(failed.value.failures) == [(block(2), 0)]
        assert dst[0][0].numpy().tobytes() == payload(present, 0, SHARD)
