"""`ucm bench`: the runner, the table, JSON and plots, failure handling, and one quick run of every
benchmark module that exists (whatever discover() finds)."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import ucm
import ucm.bench
from ucm.bench import BenchOptions, BenchResult, Figure, Plot
from ucm.bench._runner import QUICK_SUITE_BUDGET_S, check_result, select
from ucm.cli import app

ROOT = Path(__file__).resolve().parents[1]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class TinyBenchmark:
    """Measures something real but tiny: summing a list vs a loop, with a line plot and a CDF."""

    name = "tiny"
    title = "sum() vs a Python loop"

    def __init__(self) -> None:
        self.options: BenchOptions | None = None

    def run(self, options: BenchOptions) -> BenchResult:
        self.options = options
        values = list(range(20_000 if options.quick else 200_000))
        options.progress("timing sum()")
        samples_sum = _time(lambda: sum(values))
        options.progress("timing the loop")

        def loop() -> int:
            total = 0
            for value in values:
                total += value
            return total

        samples_loop = _time(loop)
        median_sum = sorted(samples_sum)[len(samples_sum) // 2]
        median_loop = sorted(samples_loop)[len(samples_loop) // 2]
        assert options.workdir is not None and Path(options.workdir).is_dir()
        return BenchResult(
            name=self.name,
            figures=[
                Figure(
                    name="sum() time",
                    value=median_sum * 1e6,
                    unit="µs",
                    baseline="Python loop",
                    baseline_value=median_loop * 1e6,
                    higher_is_better=False,
                    target=">= 1.5x the loop",
                    target_ratio=1.5,
                ),
                Figure(
                    name="impossible",
                    value=1.0,
                    unit="x",
                    baseline="itself",
                    baseline_value=1.0,
                    target=">= 1000x",
                    target_ratio=1000.0,
                ),
                Figure(name="no target", value=2.0, unit="op", baseline="b", baseline_value=4.0),
            ],
            plots=[
                Plot(
                    filename="tiny_line.png",
                    title="line",
                    xlabel="n",
                    ylabel="µs",
                    series={"sum": ([1, 2, 3], [1.0, 2.0, 3.0]), "loop": ([1, 2, 3], [3, 6, 9])},
                    logy=True,
                ),
                Plot(
                    filename="tiny_cdf",
                    title="cdf",
                    xlabel="µs",
                    ylabel="",
                    series={"sum": ([s * 1e6 for s in samples_sum], [])},
                    kind="cdf",
                ),
                Plot(
                    filename="tiny_bar.png",
                    title="bar",
                    xlabel="n",
                    ylabel="count",
                    series={"a": ([100, 1000], [1, 2]), "b": ([100, 1000], [3, 4])},
                    kind="bar",
                ),
            ],
            notes=["peer 'nothing' skipped: not installable here (a note, as the issue asks)"],
        )


class FailingBenchmark:
    name = "broken"
    title = "raises half-way"

    def run(self, options: BenchOptions) -> BenchResult:
        options.progress("about to fail")
        raise RuntimeError("disk vanished")


class NanBenchmark:
    name = "nan"
    title = "returns a NaN figure"

    def run(self, options: BenchOptions) -> BenchResult:
        return BenchResult(
            name=self.name,
            figures=[Figure("x", math.nan, "s", "y", 1.0)],
        )


def _time(function: Any, repeats: int = 9) -> list[float]:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        samples.append(time.perf_counter() - started)
    return samples


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> Any:
    def register(*benchmarks: object) -> None:
        monkeypatch.setattr(ucm.bench, "discover", lambda: list(benchmarks))

    return register


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_quick_run_writes_table_json_and_plots(registered: Any, tmp_path: Path) -> None:
    tiny = TinyBenchmark()
    registered(tiny)
    out = tmp_path / "out" / "bench.json"
    plots = tmp_path / "plots"
    markdown = tmp_path / "docs" / "results.md"
    result = CliRunner().invoke(
        app,
        ["bench", "--quick", "--json", str(out), "--plot", str(plots), "--markdown", str(markdown)],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert tiny.options is not None and tiny.options.quick is True
    # The scratch directory each benchmark gets is removed afterwards.
    assert tiny.options.workdir is not None and not Path(tiny.options.workdir).exists()
    data = json.loads(out.read_text())
    assert data["quick"] is True and data["budget_s"] == QUICK_SUITE_BUDGET_S
    assert data["within_budget"] is True
    machine = data["machine"]
    assert machine["cores"] == os.cpu_count()
    assert machine["python"] == ".".join(map(str, sys.version_info[:3]))
    assert machine["kernel"] == os.uname().release
    assert machine["dev_shm_bytes"] > 0 and machine["memory_bytes"] > 0
    assert machine["cpu_model"]
    assert data["summary"] == {
        "benchmarks": 1,
        "failed": [],
        "figures": 3,
        "targets_met": 1,
        "targets_missed": 1,
    }
    (entry,) = data["benchmarks"]
    assert entry["name"] == "tiny" and entry["status"] == "ok" and entry["error"] is None
    assert entry["last_message"] == "timing the loop"
    figures = {figure["name"]: figure for figure in entry["figures"]}
    timing = figures["sum() time"]
    assert timing["ratio"] == pytest.approx(timing["baseline_value"] / timing["value"])
    assert timing["met"] is (timing["ratio"] >= 1.5)
    assert figures["impossible"]["ratio"] == 1.0 and figures["impossible"]["met"] is False
    assert figures["no target"]["ratio"] == 0.5 and figures["no target"]["met"] is None
    assert entry["notes"] == [
        "peer 'nothing' skipped: not installable here (a note, as the issue asks)"
    ]
    paths = [Path(plot["path"]) for plot in entry["plots"]]
    assert [p.name for p in paths] == ["tiny_line.png", "tiny_cdf.png", "tiny_bar.png"]
    for path in paths:
        assert path.parent == plots
        assert _png_size(path) == (770, 495)  # 7 x 4.5 inches at 110 dpi
    assert entry["plots"][0]["series"]["loop"] == [[1, 2, 3], [3, 6, 9]]
    # The table: every figure with value, baseline, ratio and the met marks.
    assert "sum() time" in result.output and "Python loop" in result.output
    assert "1.00×" in result.output and "0.50×" in result.output
    assert "✗" in result.output
    assert "targets met 1, missed 1; 0 failed" in result.output
    assert "within the 120 s quick budget" in result.output
    # The Markdown report: one row per figure, plots linked relative to the document.
    text = markdown.read_text()
    assert "| tiny | impossible | 1 x | itself | 1 x | 1.00× | >= 1000x | ✗ |" in text
    assert "| tiny | no target | 2 op | b | 4 op | 0.50× |  | – |" in text
    assert "![line](../plots/tiny_line.png)" in text
    assert "- **tiny**: peer 'nothing' skipped" in text


def test_failed_benchmark_is_reported_and_the_rest_still_run(
    registered: Any, tmp_path: Path
) -> None:
    tiny = TinyBenchmark()
    registered(FailingBenchmark(), NanBenchmark(), tiny)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "--quick", "--json", str(out)])
    assert result.exit_code == 1, result.output
    assert tiny.options is not None  # ran after the failures
    data = json.loads(out.read_text())
    assert data["summary"]["failed"] == ["broken", "nan"]
    broken, nan, ok = data["benchmarks"]
    assert broken["status"] == "failed"
    assert broken["error"] == "RuntimeError: disk vanished"
    assert "raise RuntimeError" in broken["traceback"]
    assert broken["last_message"] == "about to fail"
    assert nan["error"] == "invalid result: figure 'x': value=nan is not a finite number"
    assert ok["status"] == "ok"
    assert "FAILED broken: RuntimeError: disk vanished" in result.output


def test_only_selects_and_rejects_unknown_names(registered: Any) -> None:
    tiny = TinyBenchmark()
    registered(FailingBenchmark(), tiny)
    result = CliRunner().invoke(app, ["bench", "--quick", "--only", "tiny"])
    assert result.exit_code == 0, result.output
    assert "broken" not in result.output
    result = CliRunner().invoke(app, ["bench", "--only", "tiny", "--only", "nope"])
    assert result.exit_code == 2
    assert "--only nope: no such benchmark; choose from broken, tiny" in result.output
    listed = CliRunner().invoke(app, ["bench", "--list"])
    assert listed.exit_code == 0
    assert listed.output.splitlines() == ["broken\traises half-way", "tiny\tsum() vs a Python loop"]


def test_check_result_names_what_is_wrong() -> None:
    tiny = TinyBenchmark()
    assert check_result(tiny, "x") == "run() returned str, expected BenchResult"
    assert check_result(tiny, BenchResult("t", [])) == "the result has no figures"
    zero = BenchResult("t", [Figure("f", 1.0, "s", "b", 0.0)])
    assert check_result(tiny, zero) == (
        "figure 'f': ratio is not finite (value=1.0, baseline_value=0.0)"
    )
    assert select([tiny], []) == [tiny]
    with pytest.raises(ValueError, match="--only x: no such benchmark; choose from tiny"):
        select([tiny], ["x"])


QUICK_SUITE_TIMEOUT_S = 1200
"""Bound on the whole quick suite in a subprocess: a hang fails, a busy machine does not."""


@pytest.mark.timeout(QUICK_SUITE_TIMEOUT_S + 60)
def test_every_discovered_benchmark_runs_quick_with_finite_figures(tmp_path: Path) -> None:
    """The real suite, as a user runs it: a subprocess, --quick, JSON and plots. Robust to the set
    of modules: it checks whatever discover() finds."""
    names = [benchmark.name for benchmark in ucm.bench.discover()]
    assert names, "no benchmark modules in ucm.bench"
    out = tmp_path / "bench.json"
    plots = tmp_path / "plots"
    started = time.monotonic()
    # A user's install has the release library only: the benchmarks may not use the test
    # build's debug hooks (the suite's conftest points UCM_NATIVE_LIB at that build).
    release = {name: value for name, value in os.environ.items() if name != "UCM_NATIVE_LIB"}
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "ucm.cli",
            "bench",
            "--quick",
            "--json",
            str(out),
            "--plot",
            str(plots),
        ],
        capture_output=True,
        text=True,
        timeout=QUICK_SUITE_TIMEOUT_S,
        check=False,
        env=release,
    )
    elapsed = time.monotonic() - started
    assert completed.returncode == 0, completed.stdout + completed.stderr
    data = json.loads(out.read_text())
    assert [entry["name"] for entry in data["benchmarks"]] == names
    for entry in data["benchmarks"]:
        assert entry["status"] == "ok", entry
        assert entry["figures"], entry["name"]
        for figure in entry["figures"]:
            for key in ("value", "baseline_value", "ratio"):
                assert isinstance(figure[key], int | float) and math.isfinite(figure[key]), (
                    entry["name"],
                    figure,
                )
            assert figure["baseline"], figure
        for plot in entry["plots"]:
            assert _png_size(Path(plot["path"]))[0] > 0
    # How long the quick suite took is a figure of the JSON (within_budget), not an assertion:
    # a busy machine may take longer. Finishing at all, within the generous bound of the
    # subprocess timeout above, is what this test holds it to.
    assert data["seconds"] <= elapsed


def test_a_benchmark_finds_the_harness_in_the_checkout_or_says_it_needs_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # harness/ (test servers) is not in the wheel: from a checkout it is put on the path ...
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != ROOT])
    real_find_spec = ucm.bench.importlib.util.find_spec
    monkeypatch.setattr(
        ucm.bench.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "harness" else real_find_spec(name, *a),
    )
    ucm.bench.need_harness("mooncake_load")
    assert sys.path[0] == str(ROOT)
    # ... and an installed wheel (no checkout around it) is told what is missing.
    monkeypatch.setattr(ucm.bench, "__file__", str(tmp_path / "site" / "ucm" / "bench" / "x.py"))
    with pytest.raises(ucm.UcmError) as info:
        ucm.bench.need_harness("mooncake_load")
    assert str(info.value) == (
        "benchmark 'mooncake_load' needs the repository's test harness (harness/: test servers "
        "and engine drivers, which the wheel does not ship); run it from a UCM checkout "
        "(pip install -e .)"
    )


@pytest.mark.parametrize("ci", [False, True], ids=["outside-ci", "ci"])
def test_an_engine_benchmark_without_its_engine_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, ci: bool
) -> None:
    """vLLM's benchmarks with ``pandas`` (what ``vllm bench serve`` needs) made absent: one
    figure that says so, and no measurement; under CI, which installs every engine, an error."""
    from ucm.bench.vllm_serving import BENCHMARK

    real_find_spec = ucm.bench.importlib.util.find_spec
    monkeypatch.setattr(
        ucm.bench.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "pandas" else real_find_spec(name, *a),
    )
    monkeypatch.delenv("CI", raising=False)
    if ci:
        monkeypatch.setenv("CI", "true")
        with pytest.raises(RuntimeError) as info:
            BENCHMARK.run(BenchOptions(quick=True))
        assert str(info.value) == (
            "pandas not installed: `bash tools/install-test-env` installs every engine and "
            "what its benchmarks need, and CI runs benchmark 'vllm_serving'"
        )
        return
    result = BENCHMARK.run(BenchOptions(quick=True))
    assert [figure.name for figure in result.figures] == ["not measured: pandas not installed"]
    assert result.notes == [
        "pandas not installed: `bash tools/install-test-env` installs every engine and what "
        "its benchmarks need"
    ]
    assert check_result(BENCHMARK, result) is None
