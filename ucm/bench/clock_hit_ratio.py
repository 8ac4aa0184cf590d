"""Hit ratio of the real native CLOCK buffer against exact LRU and a FIFO ring (issue 3: CLOCK
within 2 percentage points of LRU and never below FIFO), plus library LRUs where installed.

Every policy replays the same access trace with the same capacity (in shards). The native buffer
is driven through the binding, one access at a time (get; on a miss commit Ready; release), so it
is the shipped CLOCK (second chance, accessed bit on hit and on new load, raw-cursor fallback).
Traces (seeded, reproducible):

- Zipf alpha 0.8 and 1.0 over a fixed key population;
- loop plus hot set: a sequential scan over a loop larger than the cache, interleaved with
  accesses to a small hot set;
- batch load then copy (seed §2.2): tasks of many block-shards, each loaded (one access per key)
  and then read again by the copier (a second access per key), half of every task from a hot
  working set, half streaming cold blocks.
"""

from __future__ import annotations

import bisect
import functools
import importlib
import itertools
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence

from ..native.buffer import AnonymousBuffer, Geometry, GetResult, State
from . import BenchOptions, BenchResult, Figure, Plot

Key = tuple[bytes, int]
Trace = list[int]


def zipf_trace(population: int, length: int, alpha: float, seed: int) -> Trace:
    rng = random.Random(seed)
    weights = [1.0 / (rank**alpha) for rank in range(1, population + 1)]
    cumulative = list(itertools.accumulate(weights))
    total = cumulative[-1]
    # Popularity is not tied to the key number: shuffle ranks onto keys.
    keys = list(range(population))
    rng.shuffle(keys)
    return [keys[bisect.bisect_left(cumulative, rng.random() * total)] for _ in range(length)]


def loop_hot_trace(loop: int, hot: int, length: int, seed: int) -> Trace:
    rng = random.Random(seed)
    trace: Trace = []
    position = 0
    while len(trace) < length:
        if rng.random() < 0.5:
            trace.append(loop + rng.randrange(hot))  # hot keys live above the loop's range
        else:
            trace.append(position)
            position = (position + 1) % loop
    return trace


def batch_copy_trace(task: int, hot: int, tasks: int, seed: int) -> Trace:
    rng = random.Random(seed)
    trace: Trace = []
    cold = hot
    for _ in range(tasks):
        keys = rng.sample(range(hot), task // 2) + list(range(cold, cold + task - task // 2))
        cold += task - task // 2
        rng.shuffle(keys)
        trace.extend(keys)  # the dispatcher loads every key of the task
        trace.extend(keys)  # then the copier reads each one
    return trace


def lru_hits(trace: Sequence[int], capacity: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for key in trace:
        if key in cache:
            hits += 1
            cache.move_to_end(key)
        else:
            cache[key] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def fifo_hits(trace: Sequence[int], capacity: int) -> int:
    """The old pure ring: the cursor advances one slot per load, whatever is there goes."""
    ring: list[int | None] = [None] * capacity
    where: dict[int, int] = {}
    cursor = hits = 0
    for key in trace:
        if key in where:
            hits += 1
            continue
        victim = ring[cursor]
        if victim is not None:
            del where[victim]
        ring[cursor] = key
        where[key] = cursor
        cursor = (cursor + 1) % capacity
    return hits


def clock_model_hits(trace: Sequence[int], capacity: int, bit_on_load: bool = True) -> int:
    """Textbook CLOCK in Python: the seed's policy with ``bit_on_load``; without it, the
    variant that gives a freshly loaded key no reprieve (what the seed rules out, to keep the
    copier from losing just-loaded shards). It attributes the native CLOCK's gap to LRU."""
    keys: list[int | None] = [None] * capacity
    accessed = [False] * capacity
    where: dict[int, int] = {}
    hand = filled = hits = 0
    for key in trace:
        slot = where.get(key)
        if slot is not None:
            hits += 1
            accessed[slot] = True
            continue
        if filled < capacity:
            slot = filled
            filled += 1
        else:
            for _ in range(capacity):  # a full lap of set bits falls back to the raw cursor
                if not accessed[hand]:
                    break
                accessed[hand] = False
                hand = (hand + 1) % capacity
            slot = hand
            hand = (hand + 1) % capacity
            victim = keys[slot]
            assert victim is not None
            del where[victim]
        keys[slot] = key
        where[key] = slot
        accessed[slot] = bit_on_load
    return hits


def clock_no_load_bit_hits(trace: Sequence[int], capacity: int) -> int:
    return clock_model_hits(trace, capacity, bit_on_load=False)


def functools_hits(trace: Sequence[int], capacity: int) -> int:
    @functools.lru_cache(maxsize=capacity)
    def load(key: int) -> int:
        return key

    for key in trace:
        load(key)
    return load.cache_info().hits


def cachetools_hits(trace: Sequence[int], capacity: int) -> int:
    # Imported by name: an optional peer (CI may not have it), typed as Any.
    cache = importlib.import_module("cachetools").LRUCache(maxsize=capacity)
    hits = 0
    for key in trace:
        if key in cache:
            hits += 1
            _ = cache[key]  # the read renews the entry
        else:
            cache[key] = None
    return hits


def clock_hits(trace: Sequence[int], capacity: int) -> int:
    """The native CacheBuffer with `capacity` regular slots."""
    geometry = Geometry(shard_size_bytes=64, slot_count_regular=capacity)
    keys: dict[int, Key] = {}
    hits = 0
    with AnonymousBuffer(geometry) as buffer:
        core = buffer.core
        for number in trace:
            key = keys.get(number)
            if key is None:
                key = keys[number] = (number.to_bytes(16, "little"), 0)
            got = core.get([key])
            result = got.results[0]
            if result == GetResult.HIT:
                hits += 1
            else:
                assert result == GetResult.OWNER, result
                core.commit(got.slots, [State.READY])
            core.release(got.slots)
        assert core.stats()["hits"] == hits
    return hits


class ClockHitRatio:
    name = "clock_hit_ratio"
    title = "Hit ratio: native CLOCK vs exact LRU vs FIFO ring (and library LRUs)"

    def run(self, options: BenchOptions) -> BenchResult:
        quick = options.quick
        length = 12_000 if quick else 80_000
        population = 2_000 if quick else 10_000
        traces: dict[str, tuple[Trace, list[int]]] = {}
        fractions = [0.02, 0.05, 0.1, 0.2] if quick else [0.01, 0.02, 0.05, 0.1, 0.2, 0.4]
        sizes = [max(8, int(population * f)) for f in fractions]
        traces["zipf 0.8"] = (zipf_trace(population, length, 0.8, seed=1), sizes)
        traces["zipf 1.0"] = (zipf_trace(population, length, 1.0, seed=2), sizes)
        hot = population // 20
        loop = population // 4
        loop_sizes = [max(8, int(hot * f)) for f in (0.5, 1.0, 2.0, 4.0)]
        traces["loop + hot set"] = (loop_hot_trace(loop, hot, length, seed=3), loop_sizes)
        task = 128 if quick else 256
        batch_sizes = [task, 2 * task, 4 * task, 8 * task]
        batch_tasks = max(4, length // (2 * task))
        traces["batch load then copy"] = (
            batch_copy_trace(task, hot=4 * task, tasks=batch_tasks, seed=4),
            batch_sizes,
        )

        policies: dict[str, Callable[[Sequence[int], int], int]] = {
            "native CLOCK": clock_hits,
            "exact LRU": lru_hits,
            "FIFO ring": fifo_hits,
            "CLOCK model (Python)": clock_model_hits,
            "CLOCK, no bit on load": clock_no_load_bit_hits,
            "functools.lru_cache": functools_hits,
        }
        notes = []
        try:
            importlib.import_module("cachetools")
            policies["cachetools.LRUCache"] = cachetools_hits
        except ImportError:
            notes.append("cachetools is not installed: its LRUCache peer is skipped")

        figures: list[Figure] = []
        plots: list[Plot] = []
        for trace_name, (trace, capacities) in traces.items():
            ratios: dict[str, list[float]] = {policy: [] for policy in policies}
            for capacity in capacities:
                options.progress(f"{trace_name}: capacity {capacity}")
                for policy, simulate in policies.items():
                    ratios[policy].append(simulate(trace, capacity) / len(trace))
            clock, lru, fifo = ratios["native CLOCK"], ratios["exact LRU"], ratios["FIFO ring"]
            gaps = [
                lru_value - clock_value for clock_value, lru_value in zip(clock, lru, strict=True)
            ]
            worst = max(range(len(capacities)), key=lambda index: gaps[index])
            vs_fifo = [c - f for c, f in zip(clock, fifo, strict=True)]
            worst_fifo = min(range(len(capacities)), key=lambda index: vs_fifo[index])
            extra = {
                "worst_gap_to_lru_pp": 100 * gaps[worst],
                "worst_gap_capacity": float(capacities[worst]),
                "min_clock_minus_fifo_pp": 100 * vs_fifo[worst_fifo],
                "trace_accesses": float(len(trace)),
            }
            for policy in policies:
                if policy not in ("native CLOCK", "exact LRU", "FIFO ring"):
                    extra[f"{policy} at worst capacity"] = ratios[policy][worst]
            if ratios["CLOCK model (Python)"] != clock:
                raise RuntimeError(
                    f"{trace_name}: the native CLOCK's hit ratios {clock} differ from the "
                    f"reference model's {ratios['CLOCK model (Python)']}"
                )
            lru_worst = lru[worst]
            figures.append(
                Figure(
                    name=f"{trace_name}: CLOCK hit ratio (capacity {capacities[worst]}, "
                    "its worst gap to LRU)",
                    value=clock[worst],
                    unit="hit ratio",
                    baseline="exact LRU",
                    baseline_value=lru_worst,
                    target="within 2 pp of LRU at every capacity",
                    # Met exactly when clock >= lru - 0.02 at the worst capacity.
                    target_ratio=(lru_worst - 0.02) / lru_worst if lru_worst else 0.0,
                    extra=extra,
                )
            )
            figures.append(
                Figure(
                    name=f"{trace_name}: CLOCK hit ratio (capacity {capacities[worst_fifo]}, "
                    "its worst margin over FIFO)",
                    value=clock[worst_fifo],
                    unit="hit ratio",
                    baseline="FIFO ring",
                    baseline_value=fifo[worst_fifo],
                    target="never below FIFO",
                    target_ratio=1.0,
                )
            )
            plots.append(
                Plot(
                    filename=f"clock_hit_ratio_{trace_name.replace(' ', '_').replace('.', '')}.png",
                    title=f"Hit ratio vs cache size: {trace_name}",
                    xlabel="cache size (shards)",
                    ylabel="hit ratio",
                    series={
                        policy: ([float(c) for c in capacities], values)
                        for policy, values in ratios.items()
                    },
                    logx=True,
                )
            )
        notes.append(
            "functools.lru_cache and cachetools.LRUCache are exact LRUs: they match 'exact LRU' "
            "and check the reference simulation"
        )
        notes.append(
            "the native CLOCK matched a textbook Python CLOCK model hit for hit on every trace "
            "and size; 'CLOCK, no bit on load' is that model without the seed's reprieve for "
            "freshly loaded keys: where it beats the native CLOCK, the gap to LRU is the price "
            "of that reprieve (on a loop, every scanned key gets a second chance)"
        )
        return BenchResult(name=self.name, figures=figures, plots=plots, notes=notes)


BENCHMARK = ClockHitRatio()
