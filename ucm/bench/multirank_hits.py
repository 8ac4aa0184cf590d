"""Four ranks loading the same warm blocks (issue 13): four rank processes share one buffer
holding 128 MiB of Ready shards and each loads all of them into its own memory at the same
moment. Aggregate hit bandwidth (4 x 128 MiB over the slowest rank's wall time), against four
processes each doing one memcpy of the same 128 MiB out of the same shared slots, same run.
The C++ UCM got 0.87x at 256 KiB shards and 0.75x at 2 MiB.
"""

from __future__ import annotations

import ctypes
import time
import uuid
from typing import Any

from ..errors import UcmError
from ..ranks import RankGroup
from . import BenchOptions, BenchResult, Figure, Plot

RANKS = 4
TASK_BYTES = 128 << 20
QUICK_TASK_BYTES = 16 << 20
CASES = (256 * 1024, 2 * 1024 * 1024)
CPP_RATIOS = {256 * 1024: 0.87, 2 * 1024 * 1024: 0.75}


def _config(unique_id: str, size: int, total: int) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "shard_size": size,
        "shards_per_block": 1,
        "tiers": [{"type": "buffer", "capacity": total, "populate_threads": 0}],
    }


def _rank(rank: int, config: dict[str, Any], rounds: int, barrier: Any, out: Any) -> None:
    """Loads every shard once per round, after the barrier; then memcpys the same slots."""
    import ucm

    report: dict[str, Any] = {"rank": rank}
    try:
        size = config["shard_size"]
        total = config["tiers"][0]["capacity"]
        n = total // size
        ids = [i.to_bytes(16, "big") for i in range(n)]
        with ucm.open(config, device_id=rank, local_rank_size=RANKS) as store:
            target = (ctypes.c_ubyte * total)()
            ctypes.memset(target, 0, total)  # resident destination pages
            base = ctypes.addressof(target)
            pointers = [[base + i * size] for i in range(n)]
            buffer: Any = store.tiers[0]
            slots = buffer.core.ready_slots([(block_id, 0) for block_id in ids])
            # The seed's dump claimed fresh slots in order: one contiguous run to memcpy.
            if slots != list(range(slots[0], slots[0] + n)):
                raise UcmError(f"rank {rank}: the shards are not in consecutive slots")
            ((segment, offset),) = buffer.core.slot_locations([slots[0]])
            source = buffer.bases[segment] + offset
            loads, copies = [], []
            for _ in range(rounds + 1):
                barrier.wait(timeout=120)
                started = time.perf_counter()
                store.wait(store.load_data(ids, 0, pointers))
                loads.append(time.perf_counter() - started)
                barrier.wait(timeout=120)
                started = time.perf_counter()
                ctypes.memmove(base, source, total)
                copies.append(time.perf_counter() - started)
            store.wait(store.load_data(ids[-1:], 0, pointers[-1:]))
            last = bytes(target[(n - 1) * size : (n - 1) * size + 16])
            if last != ids[-1]:
                raise UcmError(f"rank {rank}: wrong bytes loaded")
            report["loads"] = loads[1:]
            report["copies"] = copies[1:]
            barrier.wait(timeout=120)  # keep the buffer mapped until every rank is done
    except Exception as exc:
        report["error"] = repr(exc)
        barrier.abort()
    out.put(report)


def _measure(size: int, total: int, rounds: int) -> tuple[float, float]:
    """Aggregate GB/s of the ranks' loads and of their memcpys (median round)."""
    import statistics

    import ucm
    from ucm.native import segments

    unique_id = f"bench-mr-{uuid.uuid4().hex[:10]}"
    config = _config(unique_id, size, total)
    n = total // size
    ids = [i.to_bytes(16, "big") for i in range(n)]
    source = (ctypes.c_ubyte * total)()
    for i, block_id in enumerate(ids):  # each shard starts with its own id
        ctypes.memmove(ctypes.addressof(source) + i * size, block_id, 16)
    base = ctypes.addressof(source)
    try:
        with ucm.open(config, device_id=0, local_rank_size=RANKS) as seed:
            seed.wait(seed.dump_data(ids, 0, [[base + i * size] for i in range(n)]))
            with RankGroup(parties=RANKS, join_timeout=60) as group:
                for r in range(RANKS):
                    group.spawn(_rank, r, config, rounds, group.barrier, group.results)
                reports = group.reports(timeout=600)
    finally:
        segments.unlink(unique_id)
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise UcmError(f"rank processes failed: {errors}")
    moved = RANKS * total / 1e9
    loads = [max(r["loads"][k] for r in reports) for k in range(rounds)]
    copies = [max(r["copies"][k] for r in reports) for k in range(rounds)]
    return moved / statistics.median(loads), moved / statistics.median(copies)


class MultirankHits:
    name = "multirank_hits"
    title = "Four ranks loading the same warm blocks vs four processes' memcpys"

    def run(self, options: BenchOptions) -> BenchResult:
        total = QUICK_TASK_BYTES if options.quick else TASK_BYTES
        rounds = 2 if options.quick else 7
        figures = []
        ours_series: tuple[list[float], list[float]] = ([], [])
        copy_series: tuple[list[float], list[float]] = ([], [])
        for size in CASES:
            label = f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
            options.progress(f"{RANKS} ranks x {total >> 20} MiB of {label} shards")
            ours, copies = _measure(size, total, rounds)
            figures.append(
                Figure(
                    name=f"{RANKS} ranks load the same {total >> 20} MiB of warm {label} "
                    "shards (aggregate)",
                    value=ours,
                    unit="GB/s",
                    baseline=f"{RANKS} processes each memcpy the same {total >> 20} MiB out "
                    "of the shared slots",
                    baseline_value=copies,
                    target=f">= {CPP_RATIOS[size]}x (the C++ UCM)",
                    target_ratio=CPP_RATIOS[size],
                )
            )
            for series, value in ((ours_series, ours), (copy_series, copies)):
                series[0].append(size / 1024)
                series[1].append(value)
        plot = Plot(
            filename="multirank_hits.png",
            title=f"{RANKS} ranks, same warm blocks",
            xlabel="shard size (KiB)",
            ylabel="aggregate GB/s",
            series={"store.load_data": ours_series, "memcpy": copy_series},
            kind="bar",
        )
        notes = [
            f"median of {rounds} rounds; each round starts all {RANKS} ranks at a barrier and "
            "ends with the slowest; each rank uses its buffer tier's default 4 copy threads",
        ]
        return BenchResult(name=self.name, figures=figures, plots=[plot], notes=notes)


BENCHMARK = MultirankHits()
