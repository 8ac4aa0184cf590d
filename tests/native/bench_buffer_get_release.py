"""Benchmark (not a test): batched all-hit Get + Release through the Python binding at batch 1024.
Issue target: <= 1 us per shard amortized. Run from tests/native/ with
UCM_NATIVE_LIB pointing at core-native/zig-out/lib/libucm_core.so:
    python bench_buffer_get_release.py
"""

from __future__ import annotations

import time

from buffer_shm import shared_buffer

from ucm.native.buffer import Geometry, KeyBatch, State

BATCH = 1024
ROUNDS = 200


def main() -> None:
    geometry = Geometry(shard_size_bytes=4096, slot_count_regular=BATCH, bucket_count=BATCH)
    keys = [(i.to_bytes(16, "little"), i % 8) for i in range(BATCH)]
    with shared_buffer(geometry) as shared:
        core = shared.core
        got = core.get(keys)
        core.commit(got.slots, [State.READY] * BATCH)
        core.release(got.slots)
        for label, make in (("tuples packed per call", lambda: keys), ("prebuilt KeyBatch", None)):
            batch = KeyBatch.of(keys)
            samples = []
            for _ in range(ROUNDS):
                start = time.perf_counter_ns()
                hit = core.get(make() if make else batch)
                core.release(hit.slots)
                samples.append(time.perf_counter_ns() - start)
            samples.sort()
            median_ns = samples[len(samples) // 2]
            print(
                f"get+release, batch {BATCH}, {label}: {median_ns / BATCH / 1000:.3f} us/shard "
                f"(median of {ROUNDS}; p90 {samples[ROUNDS * 9 // 10] / BATCH / 1000:.3f})"
            )


if __name__ == "__main__":
    main()
