"""Batched remove of the native buffer against the per-key path (seed 003, issue 3: 10,000 keys
>= 10x faster than one call per key, lock acquisitions counted).

Both paths remove the same Ready keys from the same geometry, reloaded before every run:

- batched: one ``remove(keys)`` call; inside, chunks of 1024 keys sorted by bucket, one lock
  acquisition per distinct bucket per chunk;
- per key: one ``remove([key])`` call per key (one binding crossing and one lock each), the
  shape of a store that takes the lock once per key.

Lock acquisitions come from the buffer's own ``lock_acquisitions`` counter. Two geometries: one
bucket per slot (the default) and 16 buckets (a lock-bound store, where one lock pass per chunk
shows as ceil(N / 1024) x 16 acquisitions instead of N).
"""

from __future__ import annotations

import statistics
import time

from ..native.buffer import AnonymousBuffer, BufferCore, Geometry, GetResult, KeyBatch, State
from . import BenchOptions, BenchResult, Figure

Key = tuple[bytes, int]
LOAD_BATCH = 1024


def _load(core: BufferCore, keys: list[Key]) -> None:
    for start in range(0, len(keys), LOAD_BATCH):
        chunk = keys[start : start + LOAD_BATCH]
        got = core.get(chunk)
        assert list(got.results) == [GetResult.OWNER] * len(chunk)
        core.commit(got.slots, [State.READY] * len(chunk))
        core.release(got.slots)


def _time_remove(core: BufferCore, keys: list[Key], batched: bool) -> tuple[float, int]:
    """Seconds and lock acquisitions of removing every key (all Ready)."""
    _load(core, keys)
    before = core.stats()["remove_lock_acquisitions"]
    start = time.perf_counter()
    if batched:
        removed = core.remove(KeyBatch.of(keys))
    else:
        removed = 0
        for key in keys:
            removed += core.remove([key])
    elapsed = time.perf_counter() - start
    assert removed == len(keys), (removed, len(keys))
    return elapsed, core.stats()["remove_lock_acquisitions"] - before


class BufferRemove:
    name = "buffer_remove"
    title = "Batched remove vs one call per key (native buffer, locks counted)"

    def run(self, options: BenchOptions) -> BenchResult:
        repeats = 3 if options.quick else 9
        sizes = [100, 1_000, 10_000]
        figures: list[Figure] = []
        extra_by_size: dict[str, float] = {}
        for bucket_label, bucket_count in (("bucket per slot", 0), ("16 buckets", 16)):
            geometry = Geometry(
                shard_size_bytes=64, slot_count_regular=10_000, bucket_count=bucket_count
            )
            with AnonymousBuffer(geometry) as buffer:
                core = buffer.core
                for size in sizes:
                    if bucket_count and size != 10_000:
                        continue
                    keys = [(i.to_bytes(16, "little"), i % 4) for i in range(size)]
                    options.progress(f"{bucket_label}: remove {size} keys")
                    batched = [_time_remove(core, keys, batched=True) for _ in range(repeats)]
                    per_key = [_time_remove(core, keys, batched=False) for _ in range(repeats)]
                    batched_s = statistics.median(seconds for seconds, _ in batched)
                    per_key_s = statistics.median(seconds for seconds, _ in per_key)
                    batched_locks, per_key_locks = batched[0][1], per_key[0][1]
                    if size != 10_000:
                        extra_by_size[f"N={size} speedup"] = per_key_s / batched_s
                        extra_by_size[f"N={size} locks batched"] = float(batched_locks)
                        extra_by_size[f"N={size} locks per key"] = float(per_key_locks)
                        continue
                    figures.append(
                        Figure(
                            name=f"remove 10,000 keys, batched ({bucket_label})",
                            value=batched_s * 1000,
                            unit="ms",
                            baseline="one remove call per key",
                            baseline_value=per_key_s * 1000,
                            higher_is_better=False,
                            # The target is on the default geometry; with 16 buckets both paths
                            # walk 625-long chains, which dominates.
                            target=">= 10x faster" if not bucket_count else None,
                            target_ratio=10.0 if not bucket_count else None,
                            extra={
                                "lock_acquisitions_batched": float(batched_locks),
                                "lock_acquisitions_per_key": float(per_key_locks),
                                "chunks": float(-(-size // 1024)),
                            },
                        )
                    )
                    figures.append(
                        Figure(
                            name=f"lock acquisitions removing 10,000 keys ({bucket_label})",
                            value=float(batched_locks),
                            unit="locks",
                            baseline="one remove call per key",
                            baseline_value=float(per_key_locks),
                            higher_is_better=False,
                        )
                    )
        figures[0].extra.update(extra_by_size)
        return BenchResult(
            name=self.name,
            figures=figures,
            notes=[
                f"median of {repeats} runs per path; keys reloaded Ready before every run; "
                "N = 100 / 1,000 speedups and lock counts are in the first figure's extras"
            ],
        )


BENCHMARK = BufferRemove()
