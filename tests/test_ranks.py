"""ucm.ranks.RankGroup, the one multi-rank launcher (demo, benchmarks, multi-process tests):
real spawned processes meeting at its Barrier and reporting on its queue."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from ucm.ranks import RankError, RankGroup


def _meet_and_report(rank: int, barrier: Any, results: Any) -> None:
    barrier.wait(timeout=120)
    results.put((rank, os.getpid()))


def _exit_silently(code: int) -> None:
    os._exit(code)


def _report_then_hang(results: Any) -> None:
    results.put("here")
    time.sleep(3600)


def test_ranks_meet_at_the_barrier_and_each_reports_once() -> None:
    with RankGroup(parties=3) as group:
        processes = [
            group.spawn(_meet_and_report, r, group.barrier, group.results) for r in range(3)
        ]
        reports = sorted(group.reports(timeout=120))
    assert [rank for rank, _ in reports] == [0, 1, 2]
    assert sorted(pid for _, pid in reports) == sorted(p.pid for p in processes)
    assert len({pid for _, pid in reports} | {os.getpid()}) == 4  # separate processes
    assert group.join() == [0, 0, 0]


def test_ranks_that_exit_without_a_report_fail_at_once_naming_their_exit_codes() -> None:
    started = time.monotonic()
    with RankGroup(parties=2) as group:
        group.spawn(_meet_and_report, 0, group.barrier, group.results)
        group.spawn(_exit_silently, 3)
        with pytest.raises(RankError) as info:
            group.reports(timeout=600)
    # Rank 0 waited at the barrier (up to 120 s) for a rank that died: the group broke the
    # barrier when it saw the death, so rank 0 failed at once too.
    assert time.monotonic() - started < 100
    assert str(info.value) == (
        "0 of 2 rank report(s) arrived before every rank process exited; exit codes [1, 3]"
    )


def test_partial_returns_what_arrived_and_leaving_kills_stragglers() -> None:
    with RankGroup(parties=1, join_timeout=0) as group:
        group.spawn(_report_then_hang, group.results)
        assert group.reports(timeout=60) == ["here"]
        assert group.reports(timeout=1, expected=1, partial=True) == []
    codes = group.join()
    assert codes == [-9]  # SIGKILLed on leaving the group


def test_parties_must_be_positive() -> None:
    with pytest.raises(ValueError) as info:
        RankGroup(parties=0)
    assert str(info.value) == "parties=0 is not valid: expected an int >= 1"
