"""The promises checked together (``harness/invariants.py``): random stacks and operation
sequences against a reference model. A CI-sized run; ``python -m harness.invariants --minutes N``
runs longer. It runs in a process of its own with the release build of the core, the library
users run (the test build's debug hooks must not be what makes a promise hold)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RELEASE_LIBRARY = ROOT / "ucm" / "native" / "libucm_core.so"
RUN_TIMEOUT_S = 900
"""Bound on the run: generous for a busy 2-core machine, still catches a hang."""


def test_the_promises_hold_together_over_random_stacks_and_operations() -> None:
    env = dict(os.environ, UCM_NATIVE_LIB=str(RELEASE_LIBRARY))
    command = [sys.executable, "-m", "harness.invariants", "--minutes", "0", "--seed", "1"]
    command += ["--examples", "40", "--steps", "25"]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    broken = [line for line in done.stderr.splitlines() if "promise broken" in line]
    assert done.returncode == 0, f"{summary}\n{broken}\n{done.stderr[-6000:]}"
    assert summary.endswith("violations 0"), summary
    # The run covered what it is for: every operation ran and blocks were served.
    counts = dict(part.rsplit(" ", 1) for part in summary.split(", ")[1:])
    for name in (
        "resets",
        "purges",
        "removes",
        "reopens",
        "loads served",
        "cli purges",
        "ranks killed",
        "objects damaged",
    ):
        assert int(counts[name]) > 0, summary
