"""Cross-process futex wait/wake on a version word (seed §3.2, Scenario B's mechanism).

Real processes share a page of /dev/shm; the waiter blocks in the kernel and the writer's bump
wakes it. Also checks the waiter burns no CPU while blocked and that `zig build test` passes.
"""

from __future__ import annotations

import mmap
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ucm.errors import InvalidArgumentError
from ucm.native import futex

WAITER = """
import mmap, os, sys, time, resource
from ucm.native import futex
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, 4096)
import ctypes
address = ctypes.addressof(ctypes.c_char.from_buffer(m))
expected = futex.load(address)
print("ready", expected, flush=True)
start = time.monotonic()
cpu0 = resource.getrusage(resource.RUSAGE_SELF)
changed = futex.wait(address, expected, float(sys.argv[2]))
cpu1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
elapsed = time.monotonic() - start
print("done", changed, futex.load(address), f"{elapsed:.3f}", f"{cpu:.4f}", flush=True)
"""


@pytest.fixture
def shared_page(tmp_path: Path):
    path = Path("/dev/shm") / f"ucm-test-futex-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    page = mmap.mmap(fd, 4096)
    os.close(fd)
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    try:
        yield path, address
    finally:
        del address
        path.unlink()


def _start_waiter(path: Path, timeout_s: float) -> tuple[subprocess.Popen[str], int]:
    waiter = subprocess.Popen(
        [sys.executable, "-c", WAITER, str(path), str(timeout_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert waiter.stdout is not None
    ready = waiter.stdout.readline().split()
    assert ready[0] == "ready"
    return waiter, int(ready[1])


def test_bump_in_one_process_wakes_a_waiter_in_another(shared_page) -> None:
    path, address = shared_page
    waiter, seen = _start_waiter(path, timeout_s=10.0)
    time.sleep(0.5)  # let it block in the kernel
    assert futex.bump(address) == seen + 1
    out, _ = waiter.communicate(timeout=10)
    _, changed, version, elapsed, cpu_s = out.split()
    assert changed == "True" and int(version) == seen + 1
    assert 0.4 < float(elapsed) < 5.0
    # Blocked in the kernel for ~0.5 s: essentially no CPU (a polling or spinning waiter
    # would use a large part of it).
    assert float(cpu_s) < 0.05


def test_completion_before_blocking_is_not_lost(shared_page) -> None:
    _path, address = shared_page
    expected = futex.load(address)
    futex.bump(address)  # the "owner" finishes between our read of the version and our block
    start = time.monotonic()
    assert futex.wait(address, expected, timeout_s=60.0) is True
    # At once, not at the timeout (a lost completion would sleep the whole 60 s).
    assert time.monotonic() - start < 30.0


def test_wait_times_out_when_nothing_changes(shared_page) -> None:
    _path, address = shared_page
    start = time.monotonic()
    assert futex.wait(address, futex.load(address), timeout_s=0.05) is False
    assert 0.05 <= time.monotonic() - start < 30.0  # the timeout, not a hang


def test_bad_addresses_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"word_address=0 is not valid"):
        futex.load(0)
    with pytest.raises(InvalidArgumentError, match=r"word_address=4099 is not valid: .* aligned"):
        futex.bump(4099)
    with pytest.raises(InvalidArgumentError, match=r"timeout_s=-1 must be a number >= 0"):
        futex.wait(4096, 0, -1)


ZIG_TEST_TIMEOUT_S = 900
"""A cold `zig build test` compiles the whole core in Debug: minutes on a busy 2-core machine."""


def zig_test_declarations(source: Path) -> tuple[int, set[str]]:
    """The ``test "..."`` declarations of core-native/src, and the files tests.zig imports."""
    count = 0
    for path in sorted(source.glob("*.zig")):
        count += len(re.findall(r'^\s*test\s+"', path.read_text(), re.MULTILINE))
    imported = set(re.findall(r'@import\("([a-z_]+\.zig)"\)', (source / "tests.zig").read_text()))
    return count, imported


@pytest.mark.timeout(ZIG_TEST_TIMEOUT_S + 60)
def test_zig_unit_tests_and_fuzzers_pass() -> None:
    root = Path(__file__).resolve().parents[2] / "core-native"
    expected, imported = zig_test_declarations(root / "src")
    # Every source file is pulled into the test build: a module left out would pass silently.
    sources = {path.name for path in (root / "src").glob("*.zig")} - {"tests.zig"}
    assert sources - imported == set(), "core-native/src/tests.zig does not import these"
    # Besides their fixed seeds, the CacheBuffer and queue fuzzers run one fresh seed per run:
    # ours, so that it is printed here and a failure names the seed that reproduces it.
    seed = random.getrandbits(64)
    print(f"zig build test: buffer and queue fuzz seed {seed} (UCM_FUZZ_SEED)")
    result = subprocess.run(
        [sys.executable, "-m", "ziglang", "build", "test", "--summary", "all"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=ZIG_TEST_TIMEOUT_S,
        env={**os.environ, "UCM_FUZZ_SEED": str(seed)},
    )
    fresh = re.search(r"buffer fuzz: seed (\d+), steps (\d+)", result.stderr)
    queue = re.search(r"queue fuzz: seed (\d+), rounds (\d+)", result.stderr)
    reproduce = (
        f"fuzz seed {seed}; reproduce: cd core-native && python -m ziglang build fuzz -- "
        f"buffer --seed {seed} --steps {fresh.group(2) if fresh else 'M'}, or: ... build fuzz "
        f"-- queue --seed {seed} --steps {queue.group(2) if queue else 'M'}"
    )
    assert result.returncode == 0, f"{reproduce}\n{result.stderr[-4000:]}"
    assert fresh is not None and int(fresh.group(1)) == seed, (reproduce, result.stderr[-2000:])
    assert queue is not None and int(queue.group(1)) == seed, (reproduce, result.stderr[-2000:])
    ran = re.search(r"run test (\d+) passed", result.stderr)
    assert ran is not None, result.stderr[-4000:]
    assert int(ran.group(1)) == expected, (int(ran.group(1)), expected, result.stderr[-2000:])
