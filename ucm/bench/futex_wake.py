"""Cross-process wake-up of a waiter when the owner commits (seed Scenario B, issue 3: p50 >= 100x
lower than a 10 ms polling waiter, waiter CPU while blocked <= 1% of wall time).

Two real processes share one CacheBuffer. Per round the owner (this process) claims a fresh key,
the waiter (a forked process) registers on it, the owner lets it block, then stamps
CLOCK_MONOTONIC and commits; the waiter stamps the clock when it sees Ready. Latency is the
difference (one clock, two processes). The waiter's CPU time over the wait is measured with its
thread CPU clock. Same run, four waiters:

- futex: ``BufferCore.wait`` (reads the version, then the state, blocks on the version);
- raw: FUTEX_WAIT/WAKE on a bare word through the same harness: the machine's floor;
- polling: the old loop of seed §2.3: lock, read the state, unlock (``lookup``), sleep 10 ms;
- spin+yield: the same check in a loop with ``sched_yield`` between checks.

How long the waiter blocks matters on a virtual machine: a vCPU that has halted for
milliseconds takes longer to wake (this machine: a raw futex word wakes in ~20-40 us after
2 ms, ~100-180 us after 20 ms). So every waiter is measured at two block lengths: a short one
(one block loaded from the next tier) and a long one (a whole task's batch).
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing
import os
import random
import statistics
import time
from multiprocessing.connection import Connection

from ..native import futex
from ..native.buffer import AnonymousBuffer, BufferCore, Geometry, GetResult, State, WaitResult
from . import BenchOptions, BenchResult, Figure, Plot

SHORT_BLOCK_S = 0.002
"""Short block: about one 2 MiB block read from the posix tier (see posix_read)."""
LONG_BLOCK_S = 0.020
"""Long block: a batch of blocks from below. The waiter's CPU share is measured here: it is
the cost of being blocked, not of the fixed entry and exit of a ``wait`` call."""
BLOCKS = {"short": SHORT_BLOCK_S, "long": LONG_BLOCK_S}
POLL_S = 0.010
ANSWER_TIMEOUT_S = 20.0


def _key(round_index: int, mode: str) -> tuple[bytes, int]:
    return (f"{mode[:4]}{round_index}".encode().ljust(16, b"."), 0)


def _waiter(core: BufferCore, word_address: int, conn: Connection) -> None:
    """Runs in the forked process: one request per round, answers (woke_ns, cpu_ns, wall_ns)."""
    while conn.poll(60):
        request = conn.recv()
        if request is None:
            return
        mode, key, phase_s = request
        if mode == "raw":
            expected = futex.load(word_address)
            conn.send("registered")
            cpu0, wall0 = time.thread_time_ns(), time.monotonic_ns()
            changed = futex.wait(word_address, expected, 10.0)
            woke = time.monotonic_ns()
            cpu1 = time.thread_time_ns()
            assert changed
        elif mode == "futex":
            got = core.get([key])
            assert got.results[0] == GetResult.WAITER, got.results
            conn.send("registered")
            cpu0, wall0 = time.thread_time_ns(), time.monotonic_ns()
            (state,) = core.wait(got.slots, timeout_s=10.0)
            woke = time.monotonic_ns()
            cpu1 = time.thread_time_ns()
            assert state == WaitResult.READY, state
            core.release(got.slots)
        else:
            conn.send("registered")
            cpu0, wall0 = time.thread_time_ns(), time.monotonic_ns()
            deadline = wall0 + 10 * 10**9
            sleep_s = phase_s  # a poller's checks fall at an arbitrary phase to the commit
            while not core.lookup([key])[0]:
                if time.monotonic_ns() > deadline:
                    raise TimeoutError(f"{mode} waiter saw no commit of {key!r}")
                if mode == "poll":
                    time.sleep(sleep_s)
                    sleep_s = POLL_S
                else:
                    os.sched_yield()
            woke = time.monotonic_ns()
            cpu1 = time.thread_time_ns()
        conn.send((woke, cpu1 - cpu0, woke - wall0))


class FutexWake:
    name = "futex_wake"
    title = "Cross-process wake latency: futex vs 10 ms polling vs spin+yield"

    def run(self, options: BenchOptions) -> BenchResult:
        # (block, mode) -> rounds. spin+yield burns a core whatever the block: short only.
        per_block = {"futex": 60, "raw": 40, "poll": 30}
        if not options.quick:
            per_block = {"futex": 300, "raw": 200, "poll": 100}
        plan = [(block, mode, count) for block in BLOCKS for mode, count in per_block.items()]
        plan.append(("short", "spin", 30 if options.quick else 100))
        geometry = Geometry(shard_size_bytes=64, slot_count_regular=1024)
        context = multiprocessing.get_context("fork")
        rng = random.Random(1)
        latencies: dict[tuple[str, str], list[float]] = {}
        cpu_percent: dict[tuple[str, str], float] = {}
        cpu_per_wait_us: dict[tuple[str, str], float] = {}
        word_page = mmap.mmap(-1, mmap.PAGESIZE)  # shared with the forked waiter
        word_anchor = ctypes.c_uint32.from_buffer(word_page)
        word_address = ctypes.addressof(word_anchor)
        with AnonymousBuffer(geometry) as buffer:
            core = buffer.core
            parent, child = context.Pipe()
            process = context.Process(target=_waiter, args=(core, word_address, child), daemon=True)
            process.start()
            key_index = 0
            try:
                for block, mode, count in plan:
                    options.progress(f"{mode} waiter, {block} block, {count} rounds")
                    samples: list[float] = []
                    cpu_total = wall_total = 0
                    for _ in range(count):
                        key_index += 1
                        key = _key(key_index, mode)
                        own = core.get([key])
                        assert own.results[0] == GetResult.OWNER
                        parent.send((mode, key, rng.uniform(0, POLL_S)))
                        if not parent.poll(ANSWER_TIMEOUT_S):
                            raise TimeoutError(f"the {mode} waiter did not register")
                        assert parent.recv() == "registered"
                        time.sleep(BLOCKS[block] * rng.uniform(1.0, 1.5))
                        committed = time.monotonic_ns()
                        if mode == "raw":
                            futex.bump(word_address)
                        else:
                            core.commit(own.slots, [State.READY])
                        if not parent.poll(ANSWER_TIMEOUT_S):
                            raise TimeoutError(f"the {mode} waiter did not wake")
                        woke, cpu_ns, wall_ns = parent.recv()
                        if mode == "raw":
                            core.commit(own.slots, [State.READY])
                        core.release(own.slots)
                        samples.append((woke - committed) / 1000)
                        cpu_total += cpu_ns
                        wall_total += wall_ns
                    latencies[block, mode] = samples
                    cpu_percent[block, mode] = 100.0 * cpu_total / wall_total
                    cpu_per_wait_us[block, mode] = cpu_total / count / 1000
                parent.send(None)
            finally:
                process.join(5)
                if process.is_alive():
                    process.kill()
                    process.join(5)
            stats = core.stats()
        del word_anchor
        word_page.close()

        def pct(values: list[float], q: float) -> float:
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        p50 = {run: statistics.median(values) for run, values in latencies.items()}
        p99 = {run: pct(values, 0.99) for run, values in latencies.items()}
        ms = {block: f"{seconds * 1000:g} ms" for block, seconds in BLOCKS.items()}
        labels = {
            "futex": "BufferCore.wait",
            "raw": "raw futex word",
            "poll": "10 ms polling",
            "spin": "spin+yield",
        }
        cdf_series: dict[str, tuple[list[float], list[float]]] = {}
        for (block, mode), values in latencies.items():
            ordered = sorted(values)
            cdf_series[f"{labels[mode]}, {ms[block]} block"] = (
                ordered,
                [(index + 1) / len(ordered) for index in range(len(ordered))],
            )
        figures: list[Figure] = []
        for block in BLOCKS:
            short = block == "short"
            figures.append(
                Figure(
                    name=f"wake latency p50, futex waiter, {ms[block]} block",
                    value=p50[block, "futex"],
                    unit="us",
                    baseline="10 ms polling waiter (lock, read, unlock, sleep)",
                    baseline_value=p50[block, "poll"],
                    higher_is_better=False,
                    target=">= 100x lower than polling" if short else None,
                    target_ratio=100.0 if short else None,
                    extra={
                        "futex_p99_us": p99[block, "futex"],
                        "poll_p99_us": p99[block, "poll"],
                        # What even a bare futex word reaches against this poller here.
                        "machine_floor_ratio": p50[block, "poll"] / p50[block, "raw"],
                    },
                )
            )
            figures.append(
                Figure(
                    name=f"wake latency p50, BufferCore.wait vs raw futex word, {ms[block]} block",
                    value=p50[block, "futex"],
                    unit="us",
                    baseline="raw FUTEX_WAIT/WAKE on a bare word, same harness (machine floor)",
                    baseline_value=p50[block, "raw"],
                    higher_is_better=False,
                    extra={"raw_p99_us": p99[block, "raw"]},
                )
            )
        figures.append(
            Figure(
                name=f"wake latency p50, futex vs spin+yield, {ms['short']} block",
                value=p50["short", "futex"],
                unit="us",
                baseline="spin+yield waiter",
                baseline_value=p50["short", "spin"],
                higher_is_better=False,
                extra={"spin_p99_us": p99["short", "spin"]},
            )
        )
        figures.append(
            Figure(
                name=f"waiter CPU while blocked, futex, {ms['long']} block",
                value=cpu_percent["long", "futex"],
                unit="% of wall",
                baseline="spin+yield waiter CPU",
                baseline_value=cpu_percent["short", "spin"],
                higher_is_better=False,
                target="<= 1% of wall time (absolute)",
                # Met exactly when value <= 1 %: baseline/value >= baseline/1 %.
                target_ratio=cpu_percent["short", "spin"] / 1.0,
                extra={
                    "poll_cpu_percent": cpu_percent["long", "poll"],
                    "futex_cpu_us_per_wait": cpu_per_wait_us["long", "futex"],
                    "futex_cpu_percent_short_block": cpu_percent["short", "futex"],
                },
            )
        )
        return BenchResult(
            name=self.name,
            figures=figures,
            plots=[
                Plot(
                    filename="futex_wake_cdf.png",
                    title="Cross-process wake latency (owner commit -> waiter sees Ready)",
                    xlabel="latency (us)",
                    ylabel="fraction of wake-ups",
                    series=cdf_series,
                    kind="cdf",
                    logx=True,
                )
            ],
            notes=[
                "the waiter blocks 1-1.5x the block length per round before the commit; a "
                "poller's first check falls at a random phase; rounds per block: "
                + ", ".join(f"{mode} {count}" for mode, count in per_block.items()),
                "a vCPU halted for milliseconds wakes slower: the raw futex word's p50 is "
                f"{p50['short', 'raw']:.0f} us after a {ms['short']} block and "
                f"{p50['long', 'raw']:.0f} us after a {ms['long']} block, which caps the "
                f"{ms['long']} ratio against polling at "
                f"{p50['long', 'poll'] / p50['long', 'raw']:.0f}x for any futex waiter",
                f"buffer counters: waits {stats['waits']}, wakeups {stats['wakeups']}",
            ],
        )


BENCHMARK = FutexWake()
