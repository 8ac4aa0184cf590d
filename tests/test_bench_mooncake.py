"""The mooncake_load benchmark where Mooncake is missing: a note and the peers' figure outside
CI, an error under CI (the benchmark itself runs with Mooncake in tests/test_bench.py)."""

from __future__ import annotations

import pytest

import harness.mooncake
from ucm.bench import BenchOptions
from ucm.bench._runner import check_result
from ucm.bench.mooncake_load import BENCHMARK

REASON = "Mooncake is not installed (a test stands in for the missing package)"


def test_without_mooncake_it_notes_why_and_measures_the_peers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(harness.mooncake, "missing_reason", lambda: REASON)
    result = BENCHMARK.run(BenchOptions(quick=True, workdir=str(tmp_path)))
    assert check_result(BENCHMARK, result) is None
    assert f"mooncake figures skipped: {REASON}" in result.notes
    (figure,) = result.figures
    assert figure.name.startswith("fsspec tier over S3 (moto) load, 2 MiB shards")
    assert figure.baseline.startswith("posix tier, O_DIRECT")
    assert figure.value > 0 and figure.baseline_value > 0


def test_without_mooncake_under_ci_it_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(harness.mooncake, "missing_reason", lambda: REASON)
    with pytest.raises(RuntimeError, match="CI must run the mooncake benchmark: Mooncake is not"):
        BENCHMARK.run(BenchOptions(quick=True))
