"""Compute claims across real processes (``ucm.integration.claims``, used by the vLLM
connector): another process's claim is seen and not taken, and a claim of a process killed with
SIGKILL is gone at once (the kernel drops its locks), so a dead engine never holds another one
up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ucm.integration.claims import ComputeClaims

HOLDER = """
import sys, time
from pathlib import Path
from ucm.integration.claims import ComputeClaims
claims = ComputeClaims(Path(sys.argv[1]))
ids = [bytes.fromhex(h) for h in sys.argv[2:]]
assert claims.claim(ids) == ids
print("claimed", flush=True)
time.sleep(600)
"""


def test_a_claim_is_seen_by_other_processes_and_dies_with_its_process(tmp_path: Path) -> None:
    path = tmp_path / "ucm-test.lock"
    path.touch()
    held, free = os.urandom(16), os.urandom(16)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), held.hex()],
        stdout=subprocess.PIPE,
        text=True,
    )
    claims = ComputeClaims(path)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "claimed"
        assert claims.claimed_elsewhere(held) and not claims.claimed_elsewhere(free)
        assert claims.claim([held, free]) == [free]  # another process's claim is not taken
        assert not claims.claimed_elsewhere(free)  # this process's own claims never count
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=60)
        began = time.monotonic()
        while claims.claimed_elsewhere(held) and time.monotonic() - began < 30:
            time.sleep(0.01)
        assert not claims.claimed_elsewhere(held)
        assert claims.claim([held]) == [held]
        claims.release([held, free])
        assert claims.held == frozenset()
    finally:
        claims.close()
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=60)


def test_a_stack_without_a_live_buffer_has_no_claims() -> None:
    assert ComputeClaims.open(f"no-such-buffer-{uuid.uuid4().hex}") is None
