"""Fixtures of the cascade tests: the test S3 server (harness.s3, shared with tests/tiers),
a fresh S3 prefix and posix directories per test, and rank processes."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.s3 import S3Server, shared_server
from ucm.ranks import RankGroup

from ._nodes import QUEUE_TIMEOUT_S


@pytest.fixture(scope="session")
def s3() -> S3Server:
    """A real S3-compatible server (moto) on 127.0.0.1, one per test process."""
    pytest.importorskip("s3fs")
    return shared_server()


@pytest.fixture
def s3_url(s3: S3Server) -> str:
    return s3.url()


@pytest.fixture
def unique() -> Callable[[str], str]:
    """``unique("A")``: a unique_id for node A of this test (buffer segments are per id)."""
    run = uuid.uuid4().hex[:10]
    return lambda node: f"cascade-{run}-{node}"


@pytest.fixture
def nvme(tmp_path: Path) -> Callable[[str], str]:
    """``nvme("A")``: node A's own posix directory."""
    return lambda node: str(tmp_path / f"nvme-{node}")


RunRanks = Callable[..., dict[int, dict[str, Any]]]


@pytest.fixture
def run_ranks() -> Iterator[RunRanks]:
    """``run_ranks(target, [args of rank 0, args of rank 1, ...])`` runs one spawned process
    per rank at once; ``target(*args, barrier, out)`` reports ``(device_id, report)`` on
    ``out``. Returns the reports by device id after checking every process exited cleanly."""
    groups: list[RankGroup] = []

    def run(target: Callable[..., None], rank_args: list[tuple[Any, ...]]) -> dict[int, Any]:
        group = RankGroup(parties=len(rank_args), join_timeout=QUEUE_TIMEOUT_S)
        groups.append(group)
        for args in rank_args:
            group.spawn(target, *args, group.barrier, group.results)
        reports = dict(group.reports(timeout=QUEUE_TIMEOUT_S))
        exit_codes = group.join()
        errors = [r["error"] for r in reports.values() if "error" in r]
        assert not errors, "\n".join(errors)
        assert exit_codes == [0] * len(rank_args)
        return reports

    yield run
    for group in groups:
        group.join()
