"""Buffer open in constant time (issue 13): ``ucm.open`` of a buffer-only stack at 1, 4 and
16 GiB, and what the data plane costs afterwards.

- **Open**: wall time of ``ucm.open`` (segments created sized, control region initialised,
  background population started), against the time until the whole buffer is resident (the
  background population's own measure at 1 and 4 GiB: what open used to wait for; at 16 GiB the
  1 GiB rate scaled, since faulting in 16 GiB would take most of this machine's memory).
  Target: at most 0.2 s at every capacity.
- **First dump**: ``store.dump`` of 1 GiB of fresh shards into a buffer nobody populated
  (``populate_threads: 0``: every page is allocated by the dump itself), against one thread's
  ``memmove`` into freshly mapped shared memory (the kernel's first-touch rate). Target: at
  least the C++ UCM's first dump, 1.4 GB/s. The same dump with background population running.
"""

from __future__ import annotations

import ctypes
import mmap
import time
import uuid
from typing import Any

from . import BenchOptions, BenchResult, Figure, Plot

GIB = 1 << 30
SHARD = 256 * 1024
OPEN_BOUND_S = 0.2
FIRST_DUMP_BOUND_GBPS = 1.4
"""The C++ UCM's first dump into lazily faulted slots, measured on this machine (issue 13)."""


def _config(unique_id: str, capacity: int, populate_threads: int) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [{"type": "buffer", "capacity": capacity, "populate_threads": populate_threads}],
    }


def _open_seconds(capacity: int, wait_resident: bool) -> tuple[float, float | None]:
    """Seconds ``ucm.open`` took, and (when asked) seconds until the buffer was resident."""
    import ucm
    from ucm.native import segments

    unique_id = f"bench-open-{uuid.uuid4().hex[:10]}"
    try:
        started = time.perf_counter()
        store = ucm.open(_config(unique_id, capacity, 2))
        opened = time.perf_counter() - started
        resident: float | None = None
        try:
            if wait_resident:
                tier: Any = store.tiers[0]
                region = tier.region
                deadline = time.monotonic() + 600
                while region.residency().populate_seconds is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the buffer did not become resident in 600 s")
                    time.sleep(0.01)
                resident = region.residency().populate_seconds
        finally:
            store.close()
    finally:
        segments.unlink(unique_id)
    return opened, resident


def _first_touch_gbps(size: int) -> float:
    """One thread's memmove into shared memory nobody touched yet."""
    source = (ctypes.c_ubyte * size)()
    ctypes.memset(source, 7, size)
    mapping = mmap.mmap(-1, size)
    anchor = ctypes.c_char.from_buffer(mapping)
    try:
        started = time.perf_counter()
        ctypes.memmove(ctypes.addressof(anchor), source, size)
        elapsed = time.perf_counter() - started
    finally:
        del anchor
        mapping.close()
    return size / elapsed / 1e9


def _first_dump_gbps(size: int, populate_threads: int) -> float:
    import ucm
    from ucm.native import segments

    unique_id = f"bench-dump-{uuid.uuid4().hex[:10]}"
    count = size // SHARD
    source = (ctypes.c_ubyte * size)()
    ctypes.memset(source, 9, size)
    base = ctypes.addressof(source)
    pointers = [[base + i * SHARD] for i in range(count)]
    ids = [i.to_bytes(16, "big") for i in range(count)]
    try:
        with ucm.open(_config(unique_id, size, populate_threads)) as store:
            started = time.perf_counter()
            store.wait(store.dump_data(ids, 0, pointers))
            elapsed = time.perf_counter() - started
            assert store.stats()["dumped_shards"] == count, "the first dump lost shards"
    finally:
        segments.unlink(unique_id)
    return size / elapsed / 1e9


class BufferOpen:
    name = "buffer_open"
    title = "Buffer open time vs capacity, and the first dump into unfaulted slots"

    def run(self, options: BenchOptions) -> BenchResult:
        quick = options.quick
        capacities = [GIB // 4, GIB, 4 * GIB] if quick else [GIB, 4 * GIB, 16 * GIB]
        resident_at = {GIB // 4} if quick else {GIB, 4 * GIB}
        figures = []
        opens: dict[int, float] = {}
        residents: dict[int, float] = {}
        for capacity in capacities:
            options.progress(f"open {capacity / GIB:g} GiB")
            opened, resident = _open_seconds(capacity, capacity in resident_at)
            opens[capacity] = opened
            if resident is not None:
                residents[capacity] = resident
        rate = max(residents.items())[1] / max(residents.items())[0]  # seconds per byte
        for capacity in capacities:
            measured = capacity in residents
            baseline = residents[capacity] if measured else rate * capacity
            figures.append(
                Figure(
                    name=f"open a {capacity / GIB:g} GiB buffer",
                    value=opens[capacity],
                    unit="s",
                    baseline="time until the whole buffer is resident (background population)"
                    if measured
                    else "time until resident, the largest measured rate scaled (not run: it "
                    "would fault in the capacity)",
                    baseline_value=baseline,
                    higher_is_better=False,
                    target=f"<= {OPEN_BOUND_S} s at every capacity",
                    target_ratio=baseline / OPEN_BOUND_S,
                )
            )
        size = GIB // 8 if quick else GIB
        options.progress(f"first dump of {size >> 20} MiB into unfaulted slots")
        touch = _first_touch_gbps(size)
        lazy = _first_dump_gbps(size, populate_threads=0)
        background = _first_dump_gbps(size, populate_threads=2)
        figures.append(
            Figure(
                name=f"first dump of {size >> 20} MiB into a buffer nobody populated "
                "(populate_threads 0)",
                value=lazy,
                unit="GB/s",
                baseline="one thread's memmove into fresh shared memory (first touch)",
                baseline_value=touch,
                target=f">= {FIRST_DUMP_BOUND_GBPS} GB/s (the C++ UCM's first dump)",
                target_ratio=FIRST_DUMP_BOUND_GBPS / touch,
            )
        )
        figures.append(
            Figure(
                name=f"first dump of {size >> 20} MiB, background population running "
                "(populate_threads 2)",
                value=background,
                unit="GB/s",
                baseline="one thread's memmove into fresh shared memory (first touch)",
                baseline_value=touch,
            )
        )
        plot = Plot(
            filename="buffer_open.png",
            title="Buffer open time",
            xlabel="capacity (GiB)",
            ylabel="seconds",
            series={
                "ucm.open": ([c / GIB for c in capacities], [opens[c] for c in capacities]),
                "until resident": (
                    [c / GIB for c in sorted(residents)],
                    [residents[c] for c in sorted(residents)],
                ),
            },
            logy=True,
        )
        notes = [
            "open = ucm.open of a buffer-only stack (segments sized, control region "
            "initialised, 2 population threads started); close stops the population",
            f"the first-dump baseline is one memmove of {size >> 20} MiB into a fresh "
            "MAP_SHARED|MAP_ANONYMOUS mapping (shmem, like the memfd segments)",
        ]
        return BenchResult(name=self.name, figures=figures, plots=[plot], notes=notes)


BENCHMARK = BufferOpen()
