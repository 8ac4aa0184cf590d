"""RearrangeIndex scaling (issue 4, seed 000 Scenario A): rank processes on one CacheBuffer load
the same cold 48-shard tasks from a tier with 2 ms latency per shard that serves concurrent
requests. Throughput with RearrangeIndex against natural order, same run (target >= 3.6x at 4
ranks, issue 13; ideal 4x), and a scaling plot over 1/2/4/8 ranks.

Each rank's dispatcher claims one step (a stride of ceil(48 / ranks) keys) and finishes what it
claimed before claiming more. In natural order every rank's first step is the same 12 keys: one
rank owns them, the others wait, step after step (one rank loading at a time). With rotation,
each rank's first step is its own stride: all ranks own disjoint keys and load concurrently,
then find the other strides Ready.
"""

from __future__ import annotations

import ctypes
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import Field

from ..config import LowerTierConfig
from ..errors import UcmError
from ..hookspecs import hookimpl
from ..layout import Key
from ..ranks import RankGroup
from ..tier import Outcome, ShardViews, Tier, TierContext, scatter
from . import BenchOptions, BenchResult, Figure, Plot

SHARD = 4096
TASK_SHARDS = 48
DELAY_S = 0.002
TARGET_RATIO = 3.6
PLUGIN_NAME = "ucm-bench-latency-tier"


class LatencyTierConfig(LowerTierConfig):
    type: Literal["bench-latency"] = "bench-latency"
    delay_s: float = Field(default=DELAY_S, ge=0, description="Latency per shard loaded.")


class LatencyTier(Tier):
    """Holds every key (synthesised: the block id repeated); each shard loaded costs ``delay_s``
    of sleep, one after another within a call; calls from other threads or processes overlap,
    like a remote store serving concurrent requests."""

    type_name = "bench-latency"
    config_model = LatencyTierConfig

    def __init__(self, config: Any, context: TierContext) -> None:
        super().__init__(config, context)
        self.delay_s = float(config.delay_s)
        self.loads = 0

    def lookup(self, keys: Sequence[Key]) -> list[bool]:
        return [True] * len(keys)

    def load(self, keys: Sequence[Key], destinations: Sequence[ShardViews]) -> list[Outcome]:
        for key, views in zip(keys, destinations, strict=True):
            time.sleep(self.delay_s)
            data = key[0] * (self.layout.shard_size // 16 + 1)
            scatter(data[: self.layout.shard_size], views)
            self.loads += 1
        return [None] * len(keys)

    def dump(self, keys: Sequence[Key], sources: Sequence[ShardViews]) -> list[Outcome]:
        return [None] * len(keys)

    def touch(self, block_ids: Sequence[bytes]) -> None:
        pass

    def batched_remove(self, keys: Sequence[Key], force: bool = False) -> int:
        return 0

    def stats(self) -> dict[str, int | float]:
        return {"hits": self.loads, "misses": 0, "remove_lock_acquisitions": 0}


class _Plugin:
    @hookimpl
    def register_tiers(self, register: Callable[[type[Tier]], None]) -> None:
        register(LatencyTier)


def register_latency_tier() -> None:
    """Registers ``type: bench-latency`` in this process (idempotent)."""
    from ..plugins import pm

    if pm.get_plugin(PLUGIN_NAME) is None:
        pm.register(_Plugin(), name=PLUGIN_NAME)


def _config(unique_id: str, rearrange: bool, tasks: int, workers: int) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [
            {
                "type": "buffer",
                "capacity": (tasks * TASK_SHARDS + 64) * SHARD,
                "rearrange": rearrange,
                "prealloc": False,
                "load_workers": workers,
            },
            {"type": "bench-latency", "delay_s": DELAY_S},
        ],
    }


def _rank(
    rank: int,
    ranks: int,
    runs: list[tuple[str, dict[str, Any]]],
    tasks: int,
    barrier: Any,
    out: Any,
) -> None:
    """One rank process: for each run, the same sequence of cold tasks as every other rank."""
    import ucm

    register_latency_tier()
    report: dict[str, Any] = {"rank": rank}
    try:
        for label, config in runs:
            with ucm.open(config, device_id=rank, local_rank_size=ranks) as store:
                targets = [(ctypes.c_ubyte * SHARD)() for _ in range(TASK_SHARDS)]
                pointers = [[ctypes.addressof(t)] for t in targets]
                barrier.wait(timeout=120)
                started = time.perf_counter()
                for task in range(tasks):
                    ids = [(task * TASK_SHARDS + i).to_bytes(16, "big") for i in range(TASK_SHARDS)]
                    store.wait(store.load_data(ids, 0, pointers))
                    if bytes(targets[-1][:16]) != ids[-1]:
                        raise UcmError(f"rank {rank}: wrong bytes loaded in task {task}")
                report[label] = time.perf_counter() - started
                report[f"{label}_owned"] = store.stats()["tiers"][0]["owned"]
                barrier.wait(timeout=120)  # keep the buffer mapped until every rank is done
    except Exception as exc:
        report["error"] = repr(exc)
        barrier.abort()
    out.put(report)


def _run_ranks(ranks: int, tasks: int, workers: int) -> dict[str, float]:
    """Shards per second, per order, for ``ranks`` rank processes."""
    from ..native import segments

    runs = [
        (
            label,
            _config(f"bench-ri-{uuid.uuid4().hex[:10]}", label == "rearranged", tasks, workers),
        )
        for label in ("rearranged", "natural")
    ]
    try:
        with RankGroup(parties=ranks) as group:
            for r in range(ranks):
                group.spawn(_rank, r, ranks, runs, tasks, group.barrier, group.results)
            reports = group.reports(timeout=300)
    finally:
        for _, config in runs:
            segments.unlink(config["unique_id"])
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise UcmError(f"rank processes failed: {errors}")
    result = {}
    for label, _ in runs:
        slowest = max(r[label] for r in reports)
        result[label] = tasks * TASK_SHARDS / slowest
        owned = [r[f"{label}_owned"] for r in reports]
        result[f"{label}_owned_min"] = min(owned) / (tasks * TASK_SHARDS)
        result[f"{label}_owned_max"] = max(owned) / (tasks * TASK_SHARDS)
    return result


class RearrangeScaling:
    name = "rearrange_scaling"
    title = "RearrangeIndex vs natural order: cold multi-rank loads over a 2 ms/shard tier"

    def run(self, options: BenchOptions) -> BenchResult:
        tasks = 6 if options.quick else 20
        counts = [4] if options.quick else [1, 2, 4, 8]
        measured: dict[int, dict[str, float]] = {}
        for ranks in counts:
            options.progress(f"{ranks} rank process(es), {tasks} tasks of {TASK_SHARDS} shards")
            measured[ranks] = _run_ranks(ranks, tasks, workers=1)
        options.progress("4 ranks, load_workers=4")
        parallel = _run_ranks(4, tasks, workers=4)
        four = measured[4]
        figures = [
            Figure(
                name=f"4 ranks, {TASK_SHARDS}-shard cold tasks, RearrangeIndex (1 load per rank "
                "in flight)",
                value=four["rearranged"],
                unit="shards/s",
                baseline="natural order (same ranks, same tier, same run)",
                baseline_value=four["natural"],
                target=f">= {TARGET_RATIO}x natural order (ideal 4x)",
                target_ratio=TARGET_RATIO,
                extra={
                    "owned_share_min": four["rearranged_owned_min"],
                    "owned_share_max": four["rearranged_owned_max"],
                    "natural_owned_share_max": four["natural_owned_max"],
                    "ideal_shards_per_s": 4 / DELAY_S,
                },
            ),
            Figure(
                name=f"4 ranks, {TASK_SHARDS}-shard cold tasks, RearrangeIndex (load_workers=4)",
                value=parallel["rearranged"],
                unit="shards/s",
                baseline="natural order, load_workers=4",
                baseline_value=parallel["natural"],
                extra={"ideal_shards_per_s": 16 / DELAY_S},
            ),
        ]
        for ranks in counts:
            if ranks != 4:
                figures.append(
                    Figure(
                        name=f"{ranks} rank(s), RearrangeIndex (1 load per rank in flight)",
                        value=measured[ranks]["rearranged"],
                        unit="shards/s",
                        baseline="natural order",
                        baseline_value=measured[ranks]["natural"],
                        extra={"ideal_shards_per_s": ranks / DELAY_S},
                    )
                )
        plot = Plot(
            filename="rearrange_scaling.png",
            title=f"Cold {TASK_SHARDS}-shard tasks over a {DELAY_S * 1000:g} ms/shard tier",
            xlabel="ranks sharing the buffer",
            ylabel="shards/s",
            series={
                "RearrangeIndex": (
                    [float(r) for r in counts],
                    [measured[r]["rearranged"] for r in counts],
                ),
                "natural order": (
                    [float(r) for r in counts],
                    [measured[r]["natural"] for r in counts],
                ),
            },
        )
        notes = [
            "the target figure gives each rank one load in flight (load_workers=1), the seed's "
            "model: throughput then scales only with how many ranks load at once",
            f"{tasks} tasks per order; throughput = shards / slowest rank's wall time",
        ]
        return BenchResult(name=self.name, figures=figures, plots=[plot], notes=notes)


BENCHMARK = RearrangeScaling()
