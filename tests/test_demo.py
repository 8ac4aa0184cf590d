"""ucm demo's parent process: it stops waiting as soon as every rank has exited."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ucm.demo import DemoSettings, RankReport, run_demo
from ucm.native import segments


@pytest.mark.timeout(120)
def test_parent_stops_waiting_when_every_rank_died_before_reporting(tmp_path: Path) -> None:
    # Far more work than the test lets happen: without the early stop the parent would sit
    # out its 600 s deadline once the ranks are gone.
    settings = DemoSettings(ranks=2, requests=100_000, documents=4, blocks_per_document=4)
    outcome: list[list[RankReport]] = []
    runner = threading.Thread(
        target=lambda: outcome.append(run_demo(settings, workdir=str(tmp_path))), daemon=True
    )
    try:
        runner.start()
        deadline = time.monotonic() + 60
        ranks: list[multiprocessing.process.BaseProcess] = []
        while len(ranks) < 2 and time.monotonic() < deadline:
            ranks = [p for p in multiprocessing.active_children() if p.name.startswith("ucm-demo")]
            time.sleep(0.05)
        assert len(ranks) == 2, "the demo did not start its ranks"
        time.sleep(1.0)  # let them get going
        killed_at = time.monotonic()
        for rank in ranks:
            assert rank.pid is not None
            os.kill(rank.pid, signal.SIGKILL)
        runner.join(timeout=45)
        assert not runner.is_alive(), "run_demo kept waiting after every rank died"
        assert time.monotonic() - killed_at < 45
        (reports,) = outcome
        assert [(r.rank, r.errors) for r in reports] == [(0, ["no report"]), (1, ["no report"])]
    finally:
        segments.unlink(f"ucm-demo-{os.getpid()}")  # killed ranks cannot clean up
