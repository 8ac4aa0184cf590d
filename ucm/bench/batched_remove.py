"""batched_remove (seed 003): one lock acquisition per chunk of REMOVE_CHUNK_KEYS keys against
the per-key loop (one ``batched_remove([key])`` call, so one lock acquisition, per key).

Figures, each beside its same-run baseline:

- time to remove N = 100 / 1,000 / 10,000 keys, batched (median of 3 runs) vs the per-key
  loop, on the posix tier,
  the fsspec tier over ``memory://`` and the example sqlite tier when it is installed; lock
  acquisitions go in ``extra`` (batched: ceil(N/1024); per-key: N);
- throughput of two threads doing gets (loads) and, separately, puts (dumps) on the posix tier
  while a 10,000-key removal runs: chunked (the default) vs unchunked (one lock for all 10,000)
  and vs the per-key loop, with the longest single operation (a stall behind the lock).

Keys are whole blocks of 16 shards of 256 bytes, so the work is the tier's bookkeeping and its
locking, not bytes. In quick mode the per-key loop at 10,000 keys (about a millisecond per key
on posix) is timed over its first 300 keys and scaled, and the concurrent window of the per-key
variant is its first 300 keys: both say so in the result's notes.
"""

from __future__ import annotations

import math
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ..layout import Key, Layout
from ..plugins import tier_types
from ..testing import make_context
from ..tier import REMOVE_CHUNK_KEYS, Tier
from . import BenchOptions, BenchResult, Figure, Plot

SHARD_BYTES = 256
SHARDS_PER_BLOCK = 16
LAYOUT = Layout(
    shard_size=SHARD_BYTES, shards_per_block=SHARDS_PER_BLOCK, tensor_sizes=(SHARD_BYTES,)
)
SIZES = (100, 1_000, 10_000)
CONCURRENT_KEYS = 10_000
QUICK_PER_KEY_SAMPLE = 300
TARGET_RATIO = 10.0
BATCHED_RUNS = 3
OPS_KEYS = 4
"""Keys per get/put operation of the concurrent threads."""
WORKER_STOP_TIMEOUT_S = 30.0


def _keys(count: int, seed: int) -> list[Key]:
    blocks = [
        seed.to_bytes(4, "big") + index.to_bytes(12, "big")
        for index in range(math.ceil(count / SHARDS_PER_BLOCK))
    ]
    return LAYOUT.keys_of_blocks(blocks)[:count]


_ZERO = memoryview(bytes(SHARD_BYTES))


def _fill(tier: Tier, keys: Sequence[Key]) -> None:
    step = 4096
    for start in range(0, len(keys), step):
        part = keys[start : start + step]
        outcomes = tier.dump(part, [[_ZERO]] * len(part))
        failed = [o for o in outcomes if o is not None]
        if failed:
            raise RuntimeError(f"benchmark setup: dump failed: {failed[0]}")


def _locks(tier: Tier) -> int:
    return int(tier.stats()["remove_lock_acquisitions"])


# ---- the tiers ----------------------------------------------------------------------------


@dataclass
class _TierKind:
    name: str
    make: Callable[[str], Tier]
    """Builds the tier in a fresh directory."""
    set_chunk: Callable[[Tier, int], Callable[[], None]] | None = None
    """Sets the keys per lock acquisition; returns the undo."""


def _make(type_name: str, settings: dict[str, object]) -> Tier:
    """A tier built through the plugin registry, as a stack would build it."""
    cls: type[Tier] = tier_types()[type_name]
    config = cls.config_model.model_validate({"type": type_name, **settings})
    return cls(config, make_context(LAYOUT))


def _posix(directory: str) -> Tier:
    return _make("posix", {"path": directory, "io_threads": 4})


def _fsspec_memory(directory: str) -> Tier:
    return _make("fsspec", {"url": f"memory://ucm-bench{directory}", "io_threads": 4})


def _sqlite(directory: str) -> Tier:
    return _make("sqlite", {"path": f"{directory}/kv.sqlite3"})


def _set_attribute_chunk(tier: Tier, keys: int) -> Callable[[], None]:
    tier.remove_chunk_keys = keys  # type: ignore[attr-defined]
    return lambda: setattr(tier, "remove_chunk_keys", REMOVE_CHUNK_KEYS)


def _kinds() -> tuple[list[_TierKind], list[str]]:
    kinds = [
        _TierKind("posix", _posix, _set_attribute_chunk),
        _TierKind("fsspec memory://", _fsspec_memory, _set_attribute_chunk),
    ]
    notes = []
    if "sqlite" in tier_types():
        kinds.append(_TierKind("sqlite (example plugin)", _sqlite))
    else:
        notes.append(
            "sqlite example tier not installed (pip install -e examples/ucm-tier-sqlite): skipped"
        )
    return kinds, notes


@contextmanager
def _tier(kind: _TierKind, options: BenchOptions) -> Iterator[Tier]:
    with tempfile.TemporaryDirectory(prefix="ucm-bench-remove-", dir=options.workdir) as path:
        tier = kind.make(path)
        try:
            yield tier
        finally:
            tier.close()


# ---- time and lock acquisitions -----------------------------------------------------------


def _time_removal(kind: _TierKind, size: int, options: BenchOptions, notes: list[str]) -> Figure:
    with _tier(kind, options) as tier:
        keys = _keys(size, seed=size)
        # The batched removal is short, so one scheduler hiccup would dominate it: the median
        # of BATCHED_RUNS (the per-key loop runs long enough to average itself out).
        runs: list[float] = []
        for _ in range(BATCHED_RUNS):
            _fill(tier, keys)
            locks = _locks(tier)
            started = time.perf_counter()
            removed = tier.batched_remove(keys)
            runs.append(time.perf_counter() - started)
            batched_locks = _locks(tier) - locks
            if removed != size:
                raise RuntimeError(f"{kind.name}: batched_remove removed {removed} of {size}")
        batched_s = sorted(runs)[len(runs) // 2]

        _fill(tier, keys)
        sample = keys
        if options.quick and size > QUICK_PER_KEY_SAMPLE:
            sample = keys[:QUICK_PER_KEY_SAMPLE]
            notes.append(
                f"{kind.name} N={size}: per-key loop timed over {len(sample)} keys, scaled "
                f"x{size / len(sample):g} (quick mode)"
            )
        locks = _locks(tier)
        started = time.perf_counter()
        removed = sum(tier.batched_remove([key]) for key in sample)
        per_key_s = (time.perf_counter() - started) * size / len(sample)
        per_key_locks = (_locks(tier) - locks) * size // len(sample)
        if removed != len(sample):
            raise RuntimeError(f"{kind.name}: per-key loop removed {removed} of {len(sample)}")
    big = size == max(SIZES)
    return Figure(
        name=f"{kind.name}: remove {size:,} keys",
        value=batched_s * 1e3,
        unit="ms",
        baseline="per-key loop",
        baseline_value=per_key_s * 1e3,
        higher_is_better=False,
        target=f">= {TARGET_RATIO:g}x faster than the per-key loop" if big else None,
        target_ratio=TARGET_RATIO if big else None,
        extra={
            "lock_acquisitions": float(batched_locks),
            "baseline_lock_acquisitions": float(per_key_locks),
            "expected_lock_acquisitions": float(math.ceil(size / REMOVE_CHUNK_KEYS)),
            "batched_runs": float(BATCHED_RUNS),
        },
    )


# ---- throughput of concurrent gets / puts during a removal --------------------------------


@dataclass
class _Window:
    ops: int = 0
    seconds: float = 0.0
    longest_s: float = 0.0

    @property
    def rate(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0


def _concurrent(
    tier: Tier, mode: str, variant: str, options: BenchOptions, notes: list[str], kind: _TierKind
) -> _Window:
    """Two threads get (or put) OPS_KEYS keys at a time, non-stop, while the removal runs
    ROUNDS times (refilled in between); counts the operations that end inside a removal."""
    # The per-key loop over 10,000 keys takes seconds on posix: two rounds give it a long
    # enough window.
    rounds = 1 if options.quick else 2 if variant == "per-key" else 8
    doomed = _keys(CONCURRENT_KEYS, seed=7)
    if variant == "per-key" and options.quick:
        doomed = doomed[:QUICK_PER_KEY_SAMPLE]
        if mode == "get":
            notes.append(
                f"{kind.name}: the per-key variant's concurrent window is its first "
                f"{len(doomed):,} keys (quick mode); a rate, so comparable"
            )
    working = _keys(OPS_KEYS * 64, seed=8)
    _fill(tier, working)
    stop = threading.Event()
    finished: list[list[tuple[float, float]]] = [[], []]  # (end, duration) per operation

    def worker(index: int) -> None:
        position = index * 32
        views = [[memoryview(bytearray(SHARD_BYTES))] for _ in range(OPS_KEYS)]
        while not stop.is_set():
            part = [working[(position + i) % len(working)] for i in range(OPS_KEYS)]
            position += OPS_KEYS
            started = time.perf_counter()
            if mode == "get":
                tier.load(part, views)
            else:
                tier.dump(part, views)
            ended = time.perf_counter()
            finished[index].append((ended, ended - started))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in (0, 1)]
    undo: Callable[[], None] = lambda: None  # noqa: E731
    if variant == "unchunked" and kind.set_chunk is not None:
        undo = kind.set_chunk(tier, len(doomed))
    windows: list[tuple[float, float]] = []
    _fill(tier, doomed)  # the first round's keys, before the threads compete for the lock
    for thread in threads:
        thread.start()
    try:
        time.sleep(0.02)  # both threads running before the removal starts
        for round_ in range(rounds):
            if round_:
                _fill(tier, doomed)
            started = time.perf_counter()
            if variant == "per-key":
                for key in doomed:
                    tier.batched_remove([key])
            else:
                tier.batched_remove(doomed)
            windows.append((started, time.perf_counter()))
    finally:
        stop.set()
        undo()
        for thread in threads:
            thread.join(timeout=WORKER_STOP_TIMEOUT_S)
    total = _Window(seconds=sum(end - start for start, end in windows))
    for ops in finished:
        for ended, took in ops:
            if any(start <= ended <= end for start, end in windows):
                total.ops += 1
                total.longest_s = max(total.longest_s, took)
    return total


def _concurrency_figures(kind: _TierKind, options: BenchOptions, notes: list[str]) -> list[Figure]:
    figures = []
    for mode in ("get", "put"):
        windows: dict[str, _Window] = {}
        for variant in ("chunked", "unchunked", "per-key"):
            options.progress(f"batched_remove: {kind.name} {mode}s during removal ({variant})")
            with _tier(kind, options) as tier:
                windows[variant] = _concurrent(tier, mode, variant, options, notes, kind)
        chunked = windows["chunked"]
        for baseline in ("unchunked", "per-key"):
            other = windows[baseline]
            figures.append(
                Figure(
                    name=f"{kind.name}: {mode}s/s of 2 threads during a 10,000-key removal",
                    value=chunked.rate,
                    unit="ops/s",
                    baseline=f"{baseline} removal",
                    baseline_value=other.rate,
                    extra={
                        "removal_window_ms": chunked.seconds * 1e3,
                        "baseline_removal_window_ms": other.seconds * 1e3,
                        "longest_op_ms": chunked.longest_s * 1e3,
                        "baseline_longest_op_ms": other.longest_s * 1e3,
                        "keys_per_op": float(OPS_KEYS),
                    },
                )
            )
    return figures


class BatchedRemoveBenchmark:
    name = "batched_remove"
    title = "batched_remove: one lock per 1,024-key chunk vs a lock per key (seed 003)"

    def run(self, options: BenchOptions) -> BenchResult:
        kinds, notes = _kinds()
        figures: list[Figure] = []
        series: dict[str, tuple[list[float], list[float]]] = {}
        for kind in kinds:
            xs: list[float] = []
            ys: list[float] = []
            for size in SIZES:
                options.progress(f"batched_remove: {kind.name}, N={size:,}")
                figure = _time_removal(kind, size, options, notes)
                figures.append(figure)
                xs.append(float(size))
                ys.append(figure.ratio)
            series[kind.name] = (xs, ys)
        posix = next(kind for kind in kinds if kind.name == "posix")
        figures += _concurrency_figures(posix, options, notes)
        notes.append(
            "posix and sqlite loads take no tier lock (lock-free readers: files replaced by "
            "rename, SQLite WAL), so gets are never blocked by a removal, only slowed by CPU "
            "and GIL sharing; puts take the lock a removal holds"
        )
        plot = Plot(
            filename="batched_remove_speedup",
            title="batched_remove speed-up over the per-key loop",
            xlabel="keys removed",
            ylabel="x faster than per-key",
            series=series,
            logx=True,
            logy=True,
        )
        return BenchResult(name=self.name, figures=figures, plots=[plot], notes=notes)


BENCHMARK = BatchedRemoveBenchmark()
