"""``ucm.affinity``: UCM's threads leave the CPUs an engine binds its compute threads to."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest

import ucm
from ucm.affinity import (
    OMP_BINDING_VARIABLES,
    NewThreads,
    background_cpus,
    engine_binding,
    engine_cpus,
    omp_cpus,
    parse_cpu_list,
)
from ucm.errors import ConfigError
from ucm.native import segments
from ucm.threadname import bind_new_threads


def test_binding_lists_parse_like_vllms() -> None:
    assert parse_cpu_list("5,2-4", "X") == {2, 3, 4, 5}
    assert engine_cpus("0-3|8,10") == {0, 1, 2, 3, 8, 10}
    assert engine_cpus("auto") is None and engine_cpus("nobind") is None
    assert engine_cpus(None) is None and engine_cpus(" ") is None
    with pytest.raises(ConfigError, match=r"VLLM_CPU_OMP_THREADS_BIND='0-x': '0-x' is not a CPU"):
        engine_cpus("0-x")
    with pytest.raises(ConfigError, match=r"'4-2' is not a valid CPU range"):
        engine_cpus("4-2")


def test_background_cpus_are_the_ones_the_binding_leaves() -> None:
    assert background_cpus("0-1|4", {0, 1, 2, 3, 4, 5}) == {2, 3, 5}
    assert background_cpus("0-5", {0, 1, 2, 3}) is None  # nowhere else to go
    assert background_cpus("auto", {0, 1}) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_threads_a_store_starts_are_moved_off_the_engines_cpus() -> None:
    """The caller bound to one CPU (as vLLM binds a worker's thread): the threads ucm.open
    started, native and Python, run on the others; the caller's own binding is untouched."""
    own = os.sched_getaffinity(0)
    compute = min(own)
    unique_id = f"affinity-{uuid.uuid4().hex[:10]}"
    stack = {
        "unique_id": unique_id,
        "shard_size": 4096,
        "shards_per_block": 1,
        "tiers": [{"type": "buffer", "capacity": 64 * 4096}],
    }
    os.sched_setaffinity(0, {compute})
    try:
        with NewThreads() as started:
            store = ucm.open(stack, device_id=0)
        with store:
            cpus = background_cpus(str(compute))
            assert cpus == own - {compute}
            assert started.started, "ucm.open started no thread"
            assert started.pin(cpus) == len(started.started)
            python = {t.native_id for t in threading.enumerate() if t.name.startswith("ucm-")}
            assert python & started.started  # the loaders are among them (and natives)
            for tid in started.started:
                assert os.sched_getaffinity(tid) == cpus
            assert os.sched_getaffinity(0) == {compute}
    finally:
        os.sched_setaffinity(0, own)
        segments.unlink(unique_id)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_threads_ucm_starts_later_from_a_bound_thread_leave_the_engines_cpus(
    tmp_path: os.PathLike[str],
) -> None:
    """Pools start their threads on demand, from the calling thread: a look-up from a thread
    bound to the engine's compute CPU (vLLM's worker, or its scheduler) starts the look-up
    pool's and the posix tier's I/O threads, which would inherit that binding. With
    bind_new_threads they bind themselves to the free CPUs instead; without it they keep the
    caller's binding, as before."""
    own = os.sched_getaffinity(0)
    compute = min(own)
    free = own - {compute}
    stack = {
        "unique_id": f"affinity-late-{uuid.uuid4().hex[:10]}",
        "shard_size": 4096,
        "shards_per_block": 1,
        "tiers": [
            {"type": "buffer", "capacity": 64 * 4096},
            {"type": "posix", "path": str(tmp_path), "io_threads": 4},
        ],
    }
    blocks = [bytes([n]) * 16 for n in range(1, 9)]

    def late_threads(bound: set[int] | None) -> dict[str, frozenset[int]]:
        """The affinity of each UCM thread a look-up of blocks absent from the buffer
        started, in a fresh store opened by a thread bound to ``compute``."""
        stack["unique_id"] = f"affinity-late-{uuid.uuid4().hex[:10]}"
        os.sched_setaffinity(0, {compute})
        bind_new_threads(bound)
        try:
            with ucm.open(stack, device_id=0) as store:
                before = {t.native_id for t in threading.enumerate()}
                assert store.lookup(blocks) == [False] * len(blocks)
                late = {
                    t.name: frozenset(os.sched_getaffinity(t.native_id))
                    for t in threading.enumerate()
                    if t.native_id not in before and t.name.startswith("ucm-")
                }
        finally:
            bind_new_threads(None)
            os.sched_setaffinity(0, own)
            segments.unlink(str(stack["unique_id"]))
        assert any(name.startswith("ucm-posix") for name in late), sorted(late)
        return late

    assert set(late_threads(free).values()) == {frozenset(free)}
    assert set(late_threads(None).values()) == {frozenset({compute})}


def _stack(**buffer: object) -> ucm.StackConfig:
    from ucm.stack import parse_stack

    return parse_stack(
        {
            "unique_id": "affinity-sizes",
            "shard_size": 4096,
            "shards_per_block": 1,
            "buffer": {"capacity": "1MiB", **buffer},
        }
    )


def test_thread_counts_follow_the_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffer's copy and populate threads are cut to the CPUs the binding leaves free
    (1 when it takes them all), unless the stack states them; no binding changes nothing."""
    import ucm.affinity as affinity

    monkeypatch.setattr(affinity, "process_cpus", lambda: set(range(8)))
    stack = _stack()
    assert (stack.buffer.copy_threads, stack.buffer.populate_threads) == (4, 2)
    sized, changed = affinity.follow_binding(stack, "0-6")  # one CPU left
    assert changed == {"copy_threads": 1, "populate_threads": 1}
    assert (sized.buffer.copy_threads, sized.buffer.populate_threads) == (1, 1)
    assert sized.buffer.capacity == stack.buffer.capacity and sized.tiers == [sized.buffer]
    sized, changed = affinity.follow_binding(stack, "0-7")  # none left: one of each
    assert changed == {"copy_threads": 1, "populate_threads": 1}
    sized, changed = affinity.follow_binding(stack, "0-4")  # three left
    assert changed == {"copy_threads": 3}
    assert (sized.buffer.copy_threads, sized.buffer.populate_threads) == (3, 2)
    assert affinity.follow_binding(stack, "0-1") == (stack, {})  # six left: enough
    assert affinity.follow_binding(stack, None) == (stack, {})
    assert affinity.follow_binding(stack, "auto") == (stack, {})
    stated = _stack(copy_threads=4)
    sized, changed = affinity.follow_binding(stated, "0-6")
    assert changed == {"populate_threads": 1} and sized.buffer.copy_threads == 4


def test_under_auto_the_engine_cpus_are_the_ones_vllm_gave_openmp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's ``auto`` binding (its default, also when unset) writes each worker's CPU list into
    its OpenMP environment: those are the engine's, the rest UCM's; ``nobind`` or no OpenMP
    binding names none."""
    for name in OMP_BINDING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert engine_binding("auto") is None and background_cpus(None, {0, 1, 2, 3}) is None
    assert omp_cpus({"GOMP_CPU_AFFINITY": "0 1 4-5"}) == {0, 1, 4, 5}
    assert omp_cpus({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[2,3]"}) == {2, 3}
    assert omp_cpus({"OMP_PLACES": "{0,1}"}) == {0, 1}
    assert omp_cpus({"GOMP_CPU_AFFINITY": "x"}) is None  # unreadable: no claim
    monkeypatch.setenv("GOMP_CPU_AFFINITY", "0")
    assert engine_binding("auto") == engine_binding(None) == {0}
    assert background_cpus("auto", {0, 1, 2}) == {1, 2}
    assert background_cpus("0-1", {0, 1, 2}) == {2}  # an explicit binding wins
    assert engine_binding("nobind") is None and background_cpus("nobind", {0, 1}) is None
    monkeypatch.setenv("GOMP_CPU_AFFINITY", "0 1")  # vLLM on 2 CPUs: nowhere else to go
    assert background_cpus("auto", {0, 1}) is None


def _os_names() -> dict[int, str]:
    names = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                names[int(tid)] = comm.read().strip()
        except FileNotFoundError:  # the thread exited since the listing (an earlier test's)
            continue
    return names


def test_ucms_threads_carry_their_names_to_the_os(tmp_path: os.PathLike[str]) -> None:
    """`top -H` and `perf` of an engine's process tell UCM's threads from the engine's: every
    thread a store starts, native or Python, has an OS name (its comm) that says what it is."""
    unique_id = f"names-{uuid.uuid4().hex[:10]}"
    stack = {
        "unique_id": unique_id,
        "shard_size": 4096,
        "shards_per_block": 1,
        "tiers": [
            {"type": "buffer", "capacity": 64 * 4096, "populate_threads": 1},
            {"type": "posix", "path": str(tmp_path)},
        ],
    }
    before = _os_names()
    try:
        with NewThreads() as started:
            store = ucm.open(stack, device_id=0)
        with store:
            import torch

            store.wait(store.dump([b"\x01" * 16], 0, [[torch.full((4096,), 7, dtype=torch.uint8)]]))
            # A thread names itself as it starts: bounded wait for the last to get there.
            for _ in range(100):
                names = _os_names()
                if "ucm-write-throu" in names.values():
                    break
                time.sleep(0.05)
            new = {names[tid] for tid in started.started if tid in names}
            # The native queue's threads (named at spawn) and the store's Python threads.
            for name in (
                "ucm-load-lane",
                "ucm-prefetch",
                "ucm-dump-lane",
                "ucm-copy",
                "ucm-loader-0",
                "ucm-dump",
            ):
                assert name in new, f"{name} not among the new threads' OS names {sorted(new)}"
            # Python's threads, cut to the kernel's 15 bytes ("ucm-write-through").
            assert "ucm-write-throu" in new, sorted(new)
            # Nothing a store started is left with the process's own name.
            assert before[os.getpid()] not in new, sorted(new)
    finally:
        segments.unlink(unique_id)


def _nice_of_new_threads(started: NewThreads) -> dict[str, list[int]]:
    """The OS name -> nice values of the threads started inside ``started`` (still alive)."""
    nices: dict[str, list[int]] = {}
    for tid in started.started:
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                text = stat.read()
        except FileNotFoundError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        nices.setdefault(name, []).append(int(text[text.rindex(")") + 2 :].split()[16]))
    return nices


@pytest.mark.parametrize(
    ("tiers", "writer"),
    [
        ("posix", False),  # one tier: nothing is ever written through
        ("buffer+posix-back", False),  # written back by the flusher, not the writer
        ("buffer+posix-through", True),
    ],
)
def test_only_a_stack_with_write_through_tiers_starts_the_low_priority_writer(
    tmp_path: os.PathLike[str], tiers: str, writer: bool
) -> None:
    """The write-through writer runs at nice 19. An idle one still costs: a process is reaped
    only once all its threads have exited, and on a busy machine a nice-19 thread is the last
    to get a CPU for that (a SIGKILLed posix-only writer took up to 0.4 s instead of 0.02 s to
    be reaped beside three CPU burners, seconds with more). So only a stack with a
    ``write: through`` tier below its top starts one."""
    unique_id = f"writer-{uuid.uuid4().hex[:10]}"
    posix: dict[str, object] = {"type": "posix", "path": str(tmp_path)}
    stack_tiers: list[dict[str, object]] = [posix]
    if tiers != "posix":
        posix["write"] = "through" if writer else "back"
        stack_tiers = [{"type": "buffer", "capacity": 16 * 4096, "populate_threads": 1}, posix]
    stack = {"unique_id": unique_id, "shard_size": 4096, "shards_per_block": 1}
    try:
        with NewThreads() as started:
            store = ucm.open({**stack, "tiers": stack_tiers})
        with store:
            # A thread names itself, then lowers its priority, as it starts: bounded wait for
            # the writer to get there.
            for _ in range(100 if writer else 10):
                nices = _nice_of_new_threads(started)
                if nices.get("ucm-write-throu") == [19]:
                    break
                time.sleep(0.05)
            assert ("ucm-write-throu" in nices) is writer, sorted(nices)
            if writer:
                assert nices["ucm-write-throu"] == [19]
            # No other thread a store starts runs at a lowered priority: each keeps the nice
            # value of the thread that opened the store.
            own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            others = {n for name, ns in nices.items() if name != "ucm-write-throu" for n in ns}
            assert others == {own}, nices
    finally:
        segments.unlink(unique_id)
