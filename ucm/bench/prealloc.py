"""Idle-window Prealloc (issue 4, seed 000 §3.4 / Scenario E): the Get latency of next-index
shards in a streaming workload, with Prealloc against without (target >= 30% lower).

Workload, one rank: the regular pool is full of a hot prefix (other blocks, touched by the
runtime before every step, as a decode loop re-reading its prefix would); ``BLOCKS`` blocks are
streamed shard index by shard index (task s = every block at index s), cold, from a lower tier.
Without Prealloc, each Get of a next-index shard must find a victim: a CLOCK sweep over the hot
pool (every accessed bit set) and an eviction across bucket locks. With Prealloc the dispatcher
hung an idle slot for (block, s + 1) from the reserved pool in the idle window after task s, so
the Get finds it on its chain and takes it over. Measured: native Get time per key of tasks
s >= 1 (the next-index ones), timed inside the buffer tier around the batched native call.
"""

from __future__ import annotations

import ctypes
import statistics
import uuid
from typing import Any

from . import BenchOptions, BenchResult, Figure
from .rearrange_scaling import register_latency_tier

SHARD = 4096
TARGET_REDUCTION = 0.30


def _measure(prealloc: bool, blocks: int, shards: int, hot: int) -> tuple[float, dict[str, int]]:
    """Native Get ns per key over the next-index tasks."""
    import ucm
    from ucm.native import segments

    register_latency_tier()
    unique_id = f"bench-pa-{uuid.uuid4().hex[:10]}"
    config = {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": shards,
        "tiers": [
            {
                "type": "buffer",
                "capacity": hot * SHARD,
                "reserved_slots": blocks * shards,
                "prealloc": prealloc,
            },
            {"type": "bench-latency", "delay_s": 0.0},
        ],
    }
    per_key: list[float] = []
    try:
        with ucm.open(config) as store:
            buffer: Any = store.tiers[0]
            prefix = [(1 << 64 | i).to_bytes(16, "big") for i in range(hot)]
            scratch = (ctypes.c_ubyte * SHARD)()
            store.wait(store.dump_data(prefix, 0, [[ctypes.addressof(scratch)]] * hot))
            ids = [i.to_bytes(16, "big") for i in range(blocks)]
            targets = [(ctypes.c_ubyte * SHARD)() for _ in ids]
            pointers = [[ctypes.addressof(t)] for t in targets]
            for s in range(shards):
                store.touch(prefix)  # the runtime re-reads its hot prefix
                store.drain()
                before = buffer.queue.stats()
                store.wait(store.load_data(ids, s, pointers))
                _wait_idle(store, prealloc and s + 1 < shards, blocks * (s + 1))
                after = buffer.queue.stats()
                if s >= 1:
                    keys = after["get_keys"] - before["get_keys"]
                    per_key.append((after["get_ns"] - before["get_ns"]) / keys)
            stats = buffer.stats()
    finally:
        segments.unlink(unique_id)
    return statistics.median(per_key), stats


def _wait_idle(store: Any, expect_prewarm: bool, prewarmed: int) -> None:
    """Lets the dispatcher's idle window run before the next task arrives (bounded)."""
    import time

    deadline = time.monotonic() + 10
    while expect_prewarm and store.stats().get("prewarmed", 0) < prewarmed:
        if time.monotonic() > deadline:
            raise TimeoutError("the dispatcher did not prewarm within 10 s")
        time.sleep(0.001)


class PreallocBench:
    name = "prealloc"
    title = "Prealloc: Get latency of next-index shards, with vs without"

    def run(self, options: BenchOptions) -> BenchResult:
        blocks, shards, hot = (64, 6, 2048) if options.quick else (128, 16, 8192)
        repeats = 2 if options.quick else 5
        with_ns, without_ns = [], []
        stats_with: dict[str, int] = {}
        stats_without: dict[str, int] = {}
        for repeat in range(repeats):
            options.progress(f"round {repeat + 1}/{repeats}")
            value, stats_without = _measure(False, blocks, shards, hot)
            without_ns.append(value)
            value, stats_with = _measure(True, blocks, shards, hot)
            with_ns.append(value)
        ours, theirs = statistics.median(with_ns), statistics.median(without_ns)
        return BenchResult(
            name=self.name,
            figures=[
                Figure(
                    name="native Get per next-index key, Prealloc on",
                    value=ours,
                    unit="ns/key",
                    baseline="Prealloc off (same workload, same run)",
                    baseline_value=theirs,
                    higher_is_better=False,
                    target=f">= {TARGET_REDUCTION:.0%} lower",
                    target_ratio=1 / (1 - TARGET_REDUCTION),
                    extra={
                        "prealloc_hits": float(stats_with.get("prealloc_hits", 0)),
                        "evictions_with": float(stats_with.get("evictions", 0)),
                        "evictions_without": float(stats_without.get("evictions", 0)),
                    },
                )
            ],
            notes=[
                f"{blocks} blocks x {shards} shard indexes streamed; hot prefix of {hot} slots "
                f"(the whole regular pool) touched before every task; median of {repeats} runs"
            ],
        )


BENCHMARK = PreallocBench()
