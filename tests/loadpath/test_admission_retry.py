"""A gated tier (``admit:``) whose write of an admitted shard fails gets the shard again at a
later use: admission is exactly once per residency, so the failed write must give the shard's
admission bit back (``Buffer.unadmit``), or no process of the node would ever retry it. The
tier is a real posix tier (``slowposix``) whose first dumps fail."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ucm

from ._tiers import block, payload

SHARD = 4096
BLOCKS = [0, 1, 2]
BOUND_S = 120.0
"""Generous bound on the admission thread's check of a finished load (a busy machine)."""


def _settled(store: ucm.Store, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The store's stats once ``done(stats)`` holds (``drain`` runs the pending admission
    checks, but one the admission thread took already may still be writing)."""
    store.drain()
    deadline = time.monotonic() + BOUND_S
    while True:
        stats = store.stats()
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


def _dump(store: ucm.Store, numbers: list[int]) -> None:
    blocks = [block(n) for n in numbers]
    src = [[torch.frombuffer(bytearray(payload(b, 0, SHARD)), dtype=torch.uint8)] for b in blocks]
    store.wait(store.dump(blocks, 0, src))


def _load(store: ucm.Store, numbers: list[int]) -> None:
    blocks = [block(n) for n in numbers]
    dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
    store.wait(store.load(blocks, 0, dst))
    for b, d in zip(blocks, dst, strict=True):
        assert d[0].numpy().tobytes() == payload(b, 0, SHARD)


def _posix_holds(path: Path, numbers: list[int]) -> list[bool]:
    """Per block: whether the directory holds it with exactly its payload (read back through a
    posix-only store of its own)."""
    config = {
        "unique_id": f"ar-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [{"type": "posix", "path": str(path)}],
    }
    held = []
    with ucm.open(config) as store:
        for n, there in zip(numbers, store.lookup([block(n) for n in numbers]), strict=True):
            if there:
                dst = [[torch.zeros(SHARD, dtype=torch.uint8)]]
                store.wait(store.load([block(n)], 0, dst))
                assert dst[0][0].numpy().tobytes() == payload(block(n), 0, SHARD), n
            held.append(bool(there))
    return held


@pytest.mark.parametrize("write", ["through", "back"])
def test_a_failed_gated_write_is_admitted_and_written_again_at_a_later_use(
    test_tiers: None, unique_id: str, tmp_path: Path, write: str
) -> None:
    path = tmp_path / "nvme"
    config: dict[str, Any] = {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [
            {"type": "buffer", "capacity": 64 * SHARD, "flush_interval_s": 3600},
            {
                "type": "slowposix",
                "path": str(path),
                "write": write,
                "admit": {"after_reuse": 1},
                "fail_dumps": len(BLOCKS),  # down for the first admission, then back
            },
        ],
    }
    with ucm.open(config) as store:
        _dump(store, BLOCKS)
        store.drain()
        assert _posix_holds(path, BLOCKS) == [False] * len(BLOCKS)  # not admitted yet
        _load(store, BLOCKS)  # the first use: admitted, and the tier fails every write
        stats = _settled(store, lambda s: s["admission_failures"] >= len(BLOCKS))
        assert stats["tiers"][1]["injected_dump_failures"] == len(BLOCKS)
        assert stats["admission_failures"] == len(BLOCKS)
        assert stats["admitted_shards"] == 0
        assert _posix_holds(path, BLOCKS) == [False] * len(BLOCKS)
        _load(store, BLOCKS)  # a later use: admitted again, the tier is back: written now
        stats = _settled(store, lambda s: s["admitted_shards"] >= len(BLOCKS))
        assert stats["admitted_shards"] == len(BLOCKS)
        assert stats["admission_failures"] == len(BLOCKS)
        assert _posix_holds(path, BLOCKS) == [True] * len(BLOCKS)
        _load(store, BLOCKS)  # written once: never again
        store.drain()
        time.sleep(0.2)  # a check the admission thread took (it would write nothing)
        stats = _settled(store, lambda s: True)
        assert stats["admitted_shards"] == len(BLOCKS)
        assert stats["tiers"][1]["injected_dump_failures"] == len(BLOCKS)
    assert _posix_holds(path, BLOCKS) == [True] * len(BLOCKS)
