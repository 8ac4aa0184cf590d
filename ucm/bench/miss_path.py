"""Miss path (issue 21): what UCM's own threads take from the CPUs when loads miss and the CPUs
are busy. A rank loads tasks of keys no tier holds (a buffer over an empty posix tier) while
one CPU burner process per core runs; the profile is each thread's CPU time read from
``/proc/self/task/<tid>/stat`` over the run, so every UCM thread is counted: the Python loader
threads (named through ``threading``) and the native ones (dispatcher, copy and populate
threads: ``native``).

Figures, same run:

- CPU time of UCM's background threads per missed key, against the caller thread's own CPU
  time per missed key (the part a runtime pays on its own thread anyway);
- the burners' work rate while the rank misses, against their rate alone (what the misses took
  from the engine's compute CPUs, all of UCM together);
- per thread (notes): CPU seconds by thread, largest first.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

from . import BenchOptions, BenchResult, Figure

SHARD = 256 * 1024
KEYS_PER_TASK = 32
BURN_S, QUICK_BURN_S = 6.0, 1.5
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _burn(seconds: float, counts: Any, index: int, cpus: set[int] | None) -> None:
    """A CPU burner: counts loop passes for ``seconds`` (its work rate), on ``cpus``."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    deadline = time.monotonic() + seconds
    count = 0
    while True:
        for _ in range(10_000):
            count += 1
        if time.monotonic() >= deadline:
            break
    counts[index] = count


def _burners(
    seconds: float, during: Callable[[], None] | None = None, cpus: set[int] | None = None
) -> float:
    """Runs one burner per CPU (per CPU of ``cpus``, bound there, when given) for ``seconds``,
    and ``during()`` meanwhile in this process; returns their summed loop passes per second."""
    context = multiprocessing.get_context("fork")
    count = len(cpus) if cpus is not None else os.cpu_count() or 1
    counts = context.Array("q", count)
    processes = [
        context.Process(target=_burn, args=(seconds, counts, i, cpus)) for i in range(count)
    ]
    for process in processes:
        process.start()
    try:
        if during is not None:
            during()
    finally:
        for process in processes:
            process.join(seconds + 60)
    return float(sum(counts[:])) / seconds


def _thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of each thread of this process."""
    cpu: dict[int, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:  # the thread ended
            continue
        cpu[int(tid)] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return cpu


def _misses(seconds: float, bind: str | None) -> dict[str, Any]:
    """Opens a rank whose loads all miss and loads for ``seconds``, with the threads the open
    started moved off the binding's CPUs (``VLLM_CPU_OMP_THREADS_BIND`` syntax) when given;
    returns the threads' CPU times over the loads."""
    import torch

    import ucm
    from ucm.affinity import NewThreads, background_cpus
    from ucm.errors import TaskError
    from ucm.native import segments

    unique_id = f"bench-miss-{uuid.uuid4().hex[:10]}"
    measured: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ucm-miss-") as root:
        stack = {
            "unique_id": unique_id,
            "shard_size": SHARD,
            "shards_per_block": 1,
            "tiers": [
                {"type": "buffer", "capacity": 64 * SHARD},
                {"type": "posix", "path": os.path.join(root, "p")},
            ],
        }
        try:
            with NewThreads() as started:
                store = ucm.open(stack, device_id=0)
            with store:
                cpus = background_cpus(bind)
                if cpus is not None:
                    started.pin(cpus)
                dst = [torch.empty(SHARD, dtype=torch.uint8) for _ in range(KEYS_PER_TASK)]
                base = uuid.uuid4().int
                deadline = time.monotonic() + seconds
                before = _thread_cpu()
                caller = time.thread_time()
                missed = 0
                while time.monotonic() < deadline:
                    ids = [
                        ((base + missed + i) % (1 << 128)).to_bytes(16, "big")
                        for i in range(KEYS_PER_TASK)
                    ]
                    try:
                        store.wait(store.load(ids, 0, dst))
                    except TaskError:
                        missed += KEYS_PER_TASK
                measured["caller_s"] = time.thread_time() - caller
                measured["before"] = before
                measured["after"] = _thread_cpu()
                measured["names"] = {
                    t.native_id: t.name for t in threading.enumerate() if t.native_id
                }
                measured["missed"] = missed
        finally:
            segments.unlink(unique_id)
    return measured


def _run_misses(seconds: float, bind: str | None) -> None:
    _misses(seconds, bind)


class MissPath:
    name = "miss_path"
    title = "Miss path: UCM's threads' CPU while loads miss on busy CPUs"

    def run(self, options: BenchOptions) -> BenchResult:
        seconds = QUICK_BURN_S if options.quick else BURN_S
        options.progress(f"burners alone, {seconds:g} s")
        alone = _burners(seconds)
        measured: dict[str, Any] = {}

        def unbound() -> None:
            measured.update(_misses(seconds, None))

        options.progress(f"burners while the rank misses, {seconds:g} s")
        busy = _burners(seconds, unbound)
        options.progress(f"burners alone again, {seconds:g} s")
        alone = (alone + _burners(seconds)) / 2  # before and after: the machine is shared
        me = threading.get_native_id()
        names = measured["names"]
        before, after = measured["before"], measured["after"]
        per_thread: Counter[str] = Counter()
        for tid, cpu in after.items():
            if tid == me:
                continue
            name = names.get(tid, "native")
            # Pools of one kind (ucm-loader-0, ucm-posix_3, ...) summed under their kind.
            per_thread[name.rstrip("0123456789").rstrip("-_")] += cpu - before.get(tid, 0.0)
        background = sum(per_thread.values())
        missed = max(1, measured["missed"])
        figures = [
            Figure(
                name=f"CPU time of UCM's background threads per missed key ({SHARD // 1024} KiB "
                f"shards, {KEYS_PER_TASK} keys per task, one burner per CPU)",
                value=background / missed * 1e6,
                unit="us",
                baseline="the caller thread's CPU time per missed key",
                baseline_value=measured["caller_s"] / missed * 1e6,
                higher_is_better=False,
                extra={"missed_keys": float(missed)},
            ),
            Figure(
                name="burners' work rate while the rank misses",
                value=busy,
                unit="loops/s",
                baseline="the burners alone",
                baseline_value=alone,
            ),
        ]
        shown = ", ".join(f"{name} {cpu:.3f} s" for name, cpu in per_thread.most_common())
        notes = [
            f"{os.cpu_count()} CPUs, {seconds:g} s per phase; CPU per thread from "
            f"/proc/self/task/*/stat (tick {1 / CLOCK_TICKS:g} s): {shown}",
            "threads of one pool summed; 'native' are the threads Python did not start (the "
            "native queue's dispatcher, copy and populate threads); the burners' rate alone "
            "is the mean of a run before and one after",
        ]
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) >= 2:
            figures.append(self._bound(options, seconds, allowed))
            notes.append(
                f"bound: the caller and one burner on CPU {allowed[0]} (an engine's compute "
                f"CPU), VLLM_CPU_OMP_THREADS_BIND={allowed[0]!s} moves UCM's threads to the "
                "others (ucm.affinity), against the same run with UCM's threads inheriting the "
                "caller's binding"
            )
        return BenchResult(name=self.name, figures=figures, plots=[], notes=notes)

    def _bound(self, options: BenchOptions, seconds: float, allowed: list[int]) -> Figure:
        """The engine's compute CPU (one burner bound there, and the caller, as vLLM binds its
        worker's thread) while the rank misses: UCM's threads bound off it, or inheriting."""
        compute = {allowed[0]}
        own = os.sched_getaffinity(0)
        rates: dict[str, float] = {}
        os.sched_setaffinity(0, compute)  # this (the caller's) thread only
        try:
            for label, bind in (("inherit", None), ("bound", str(allowed[0]))):
                options.progress(f"compute CPU burner, UCM threads {label}, {seconds:g} s")
                rates[label] = _burners(seconds, partial(_run_misses, seconds, bind), compute)
        finally:
            os.sched_setaffinity(0, own)
        return Figure(
            name="the compute CPU's burner while the rank misses, UCM's threads bound off it "
            "(VLLM_CPU_OMP_THREADS_BIND)",
            value=rates["bound"],
            unit="loops/s",
            baseline="same, UCM's threads inheriting the caller's binding",
            baseline_value=rates["inherit"],
        )


BENCHMARK = MissPath()
