"""Copies out of staging memory beside a busy Python thread: one native call for every range
(``ucm.native.copy.copy_ranges``) against one ``ctypes.memmove`` per range.

vLLM's direct loads, and the bounded loads of SGLang and LMCache, read blocks into private
staging memory and then copy each block's tensors into the engine's memory: one range per
tensor per block (a real model: 32-80 layers, so a few thousand ranges for a long prefix).
``ctypes.memmove`` releases the GIL for every range and then has to take it back; while
another Python thread runs (the engine's scheduler loop), each take-back can wait a whole
switch interval (5 ms). Measured here with 8 KiB ranges, idle and beside a thread that spins
in Python, median of a few rounds. No target: the figure is how much of a load's time the
copy's GIL round trips cost.
"""

from __future__ import annotations

import ctypes
import mmap
import statistics
import threading
import time
from collections.abc import Callable

from . import BenchOptions, BenchResult, Figure, Plot

RANGE_BYTES = 8 * 1024
"""One tensor of one block: the issue's 32 x 8 KiB shard."""


def _time_beside(copy: Callable[[], None], busy: bool) -> float:
    """Seconds ``copy`` took on a thread of its own, with the caller's thread spinning in
    Python meanwhile (``busy``) or waiting on the thread (idle)."""
    finished = threading.Event()
    took: list[float] = []

    def run() -> None:
        started = time.perf_counter()
        copy()
        took.append(time.perf_counter() - started)
        finished.set()

    thread = threading.Thread(target=run, name="bench-staging-copy")
    thread.start()
    if busy:
        spins = 0
        while not finished.is_set():  # bounded by the copy, which always ends
            spins += 1
    thread.join()
    return took[0]


class StagingCopy:
    name = "staging_copy"
    title = (
        "Copies out of staging memory beside a busy Python thread: one native call vs a "
        "memmove per range"
    )

    def run(self, options: BenchOptions) -> BenchResult:
        from ..native.copy import copy_ranges

        counts = [64, 256] if options.quick else [256, 1024, 2048]
        rounds = 3
        figures: list[Figure] = []
        series: dict[str, tuple[list[float], list[float]]] = {}
        for count in counts:
            source = mmap.mmap(-1, count * RANGE_BYTES)
            target = mmap.mmap(-1, count * RANGE_BYTES)
            source[:] = bytes(range(256)) * (count * RANGE_BYTES // 256)
            source_base = ctypes.addressof(ctypes.c_char.from_buffer(source))
            target_base = ctypes.addressof(ctypes.c_char.from_buffer(target))
            sources = [source_base + i * RANGE_BYTES for i in range(count)]
            targets = [target_base + i * RANGE_BYTES for i in range(count)]
            lengths = [RANGE_BYTES] * count

            def per_range(targets: list[int] = targets, sources: list[int] = sources) -> None:
                for destination, origin in zip(targets, sources, strict=True):
                    ctypes.memmove(destination, origin, RANGE_BYTES)

            def native(
                targets: list[int] = targets,
                sources: list[int] = sources,
                lengths: list[int] = lengths,
            ) -> None:
                copy_ranges(targets, sources, lengths)

            medians: dict[tuple[str, bool], float] = {}
            for busy in (False, True):
                for label, copy in (("memmove", per_range), ("native", native)):
                    options.progress(f"{count} ranges, {label}, {'busy' if busy else 'idle'}")
                    times = []
                    for _ in range(rounds):
                        target[:] = bytes(len(target))
                        times.append(_time_beside(copy, busy))
                        if target[:] != source[:]:
                            raise AssertionError(f"{label} copied wrong bytes")
                    medians[label, busy] = statistics.median(times)
            for busy in (False, True):
                where = "beside a thread spinning in Python" if busy else "idle"
                figures.append(
                    Figure(
                        name=f"copy {count} ranges of 8 KiB out of staging, {where}",
                        value=medians["native", busy] * 1000,
                        unit="ms",
                        baseline="one ctypes.memmove per range",
                        baseline_value=medians["memmove", busy] * 1000,
                        higher_is_better=False,
                        extra={"rounds": float(rounds)},
                    )
                )
                for label, what in (("memmove", "memmove per range"), ("native", "one call")):
                    key = f"{what}, {'busy' if busy else 'idle'}"
                    xs, ys = series.setdefault(key, ([], []))
                    xs.append(float(count))
                    ys.append(medians[label, busy] * 1000)
            source.close()
            target.close()
        plot = Plot(
            filename="staging_copy",
            title="Copy out of staging memory (8 KiB ranges)",
            xlabel="ranges",
            ylabel="ms (median)",
            series=series,
            kind="line",
            logx=True,
            logy=True,
        )
        return BenchResult(
            name=self.name,
            figures=figures,
            plots=[plot],
            notes=[
                "busy: the benchmark's main thread spins in Python while the copy runs on "
                "another thread, as an engine's scheduler loop does beside a placing thread"
            ],
        )


BENCHMARK = StagingCopy()
