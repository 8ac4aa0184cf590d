"""Runs benchmarks for ``ucm bench``: isolation of failures, timing against the quick budget,
machine info, JSON and PNG plots. The CLI (``ucm.cli_ops``) adds the progress bar and table.

Underscore-prefixed so that :func:`ucm.bench.discover` does not take it for a benchmark.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import re
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import Benchmark, BenchOptions, BenchResult, Figure, Plot

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")

QUICK_SUITE_BUDGET_S = 120.0
"""``--quick`` promise: the whole suite in under 2 minutes on 2 cores."""
QUICK_BENCHMARK_BUDGET_S = 15.0
"""Each benchmark's share of it in quick mode (``BenchOptions.quick``)."""


@dataclass
class BenchOutcome:
    """One benchmark's run: its result, or why it failed."""

    name: str
    title: str
    seconds: float
    result: BenchResult | None = None
    error: str | None = None
    """``Type: message`` of the exception, or what is wrong with the result."""
    traceback: str | None = None
    plot_paths: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    """Progress messages, in order (the last one says where a failure happened)."""
    budget_s: float | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def over_budget(self) -> bool:
        return self.budget_s is not None and self.seconds > self.budget_s

    def to_json(self) -> dict[str, Any]:
        result = self.result
        return {
            "name": self.name,
            "title": self.title,
            "status": "failed" if self.failed else "ok",
            "error": self.error,
            "traceback": self.traceback,
            "seconds": self.seconds,
            "budget_s": self.budget_s,
            "over_budget": self.over_budget,
            "figures": [_finite_json(f.to_json()) for f in result.figures] if result else [],
            "notes": list(result.notes) if result else [],
            "plots": [
                {**_finite_json(asdict(plot)), "path": path}
                for plot, path in zip(result.plots if result else [], self._paths(), strict=True)
            ],
            "last_message": self.messages[-1] if self.messages else None,
        }

    def _paths(self) -> list[str | None]:
        count = len(self.result.plots) if self.result else 0
        paths: list[str | None] = list(self.plot_paths)
        return paths + [None] * (count - len(paths))


@dataclass
class SuiteReport:
    quick: bool
    machine: dict[str, Any]
    started_at: float
    outcomes: list[BenchOutcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> list[BenchOutcome]:
        return [outcome for outcome in self.outcomes if outcome.failed]

    @property
    def budget_s(self) -> float | None:
        return QUICK_SUITE_BUDGET_S if self.quick else None

    def figures(self) -> list[tuple[str, Figure]]:
        return [
            (outcome.name, figure)
            for outcome in self.outcomes
            if outcome.result is not None
            for figure in outcome.result.figures
        ]

    def to_json(self) -> dict[str, Any]:
        targets = [figure.met for _, figure in self.figures() if figure.met is not None]
        return {
            "ucm_version": _version("ucm"),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started_at)),
            "quick": self.quick,
            "seconds": self.seconds,
            "budget_s": self.budget_s,
            "within_budget": None if self.budget_s is None else self.seconds <= self.budget_s,
            "machine": self.machine,
            "summary": {
                "benchmarks": len(self.outcomes),
                "failed": [outcome.name for outcome in self.failed],
                "figures": len(self.figures()),
                "targets_met": sum(1 for met in targets if met),
                "targets_missed": sum(1 for met in targets if not met),
            },
            "benchmarks": [outcome.to_json() for outcome in self.outcomes],
        }


def _finite_json(value: Any) -> Any:
    """JSON has no Infinity/NaN: non-finite numbers become null (and are reported as failures
    by :func:`check_result` before they get here)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(item) for item in value]
    return value


def check_result(benchmark: Benchmark, result: object) -> str | None:
    """What is wrong with a benchmark's result (None when nothing): the table and the JSON need
    a BenchResult whose figures are finite numbers beside a finite, non-zero baseline."""
    if not isinstance(result, BenchResult):
        return f"run() returned {type(result).__name__}, expected BenchResult"
    if not result.figures:
        return "the result has no figures"
    for figure in result.figures:
        if not isinstance(figure, Figure):
            return f"figures holds a {type(figure).__name__}, expected Figure"
        for label, number in (("value", figure.value), ("baseline_value", figure.baseline_value)):
            if (
                isinstance(number, bool)
                or not isinstance(number, int | float)
                or not math.isfinite(number)
            ):
                return f"figure {figure.name!r}: {label}={number!r} is not a finite number"
        if not math.isfinite(figure.ratio):
            return (
                f"figure {figure.name!r}: ratio is not finite (value={figure.value!r}, "
                f"baseline_value={figure.baseline_value!r})"
            )
    for plot in result.plots:
        if not isinstance(plot, Plot):
            return f"plots holds a {type(plot).__name__}, expected Plot"
    return None


def run_one(
    benchmark: Benchmark,
    *,
    quick: bool,
    workdir: Path,
    progress: Callable[[str], None],
) -> BenchOutcome:
    """Runs one benchmark in its own scratch directory; an exception is captured, not raised
    (KeyboardInterrupt still stops the suite)."""
    name = str(getattr(benchmark, "name", type(benchmark).__name__))
    title = str(getattr(benchmark, "title", name))
    outcome = BenchOutcome(
        name=name, title=title, seconds=0.0, budget_s=QUICK_BENCHMARK_BUDGET_S if quick else None
    )

    def report(message: str) -> None:
        outcome.messages.append(str(message))
        progress(str(message))

    scratch = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=workdir))
    started = time.perf_counter()
    try:
        result = benchmark.run(BenchOptions(quick=quick, progress=report, workdir=str(scratch)))
    except Exception as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.traceback = traceback.format_exc()
    else:
        problem = check_result(benchmark, result)
        if problem is None:
            assert isinstance(result, BenchResult)
            outcome.result = result
        else:
            outcome.error = f"invalid result: {problem}"
            if isinstance(result, BenchResult):
                outcome.result = result
    finally:
        outcome.seconds = time.perf_counter() - started
        shutil.rmtree(scratch, ignore_errors=True)
    return outcome


def select(benchmarks: Sequence[Benchmark], only: Sequence[str]) -> list[Benchmark]:
    """The benchmarks named in ``only`` (all when empty), in discovery order; an unknown name
    raises ValueError listing the valid ones."""
    if not only:
        return list(benchmarks)
    names = [benchmark.name for benchmark in benchmarks]
    unknown = [name for name in only if name not in names]
    if unknown:
        raise ValueError(
            f"--only {', '.join(unknown)}: no such benchmark; choose from {', '.join(names)}"
        )
    return [benchmark for benchmark in benchmarks if benchmark.name in set(only)]


# ---- plots ---------------------------------------------------------------------------------------


def write_plots(outcome: BenchOutcome, directory: Path, taken: set[str]) -> None:
    """Writes each of the outcome's plots as a PNG under ``directory``; a plot that fails to
    draw marks the benchmark failed. ``taken`` holds file names already written this run (a
    clash gets the benchmark's name as a prefix)."""
    if outcome.result is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    for plot in outcome.result.plots:
        filename = plot.filename if plot.filename.endswith(".png") else f"{plot.filename}.png"
        # Never outside the plot directory, and a name that is safe in URLs and Markdown.
        filename = re.sub("_{2,}", "_", _SAFE_NAME.sub("_", Path(filename).name))
        if filename in taken:
            filename = f"{outcome.name}-{filename}"
        taken.add(filename)
        path = directory / filename
        try:
            draw_plot(plot, path)
        except Exception as exc:
            outcome.error = outcome.error or f"plot {plot.filename!r}: {type(exc).__name__}: {exc}"
            outcome.traceback = outcome.traceback or traceback.format_exc()
            return
        outcome.plot_paths.append(str(path))


def draw_plot(plot: Plot, path: Path) -> None:
    """One PNG (matplotlib, Agg backend: no display needed).

    ``line``: each series is a curve through (xs, ys). ``cdf``: each series is an empirical CDF;
    with ``ys`` empty, ``xs`` are raw samples (sorted here), otherwise (xs, ys) already are the
    CDF's points. ``bar``: grouped bars, one group per x, one bar per series.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7.0, 4.5), dpi=110)
    try:
        labels = list(plot.series)
        if plot.kind == "bar":
            xs_all = sorted({float(x) for xs, _ in plot.series.values() for x in xs})
            width = 0.8 / max(1, len(labels))
            for index, label in enumerate(labels):
                xs, ys = plot.series[label]
                positions = [xs_all.index(float(x)) + index * width for x in xs]
                axes.bar(positions, ys, width=width, label=label)
            axes.set_xticks([i + 0.4 - width / 2 for i in range(len(xs_all))])
            axes.set_xticklabels([f"{x:g}" for x in xs_all])
        else:
            for label in labels:
                xs, ys = plot.series[label]
                if plot.kind == "cdf":
                    if not ys:
                        xs = sorted(xs)
                        ys = [(i + 1) / len(xs) for i in range(len(xs))]
                    axes.step(xs, ys, where="post", label=label)
                else:
                    axes.plot(xs, ys, marker="o", markersize=3, label=label)
        if plot.logx:
            axes.set_xscale("log")
        if plot.logy:
            axes.set_yscale("log")
        axes.set_title(plot.title)
        axes.set_xlabel(plot.xlabel)
        axes.set_ylabel(plot.ylabel if plot.kind != "cdf" or plot.ylabel else "fraction")
        axes.grid(True, alpha=0.3)
        if labels:
            axes.legend()
        figure.tight_layout()
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)


# ---- machine info --------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """What the figures depend on; read from /proc and the interpreter, nothing imported that
    is not already needed (torch's version comes from its metadata)."""
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": _meminfo_bytes("MemTotal"),
        "memory_available_bytes": _meminfo_bytes("MemAvailable"),
        "kernel": platform.release(),
        "os": platform.system(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "ucm": _version("ucm"),
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        shm = shutil.disk_usage("/dev/shm")
        info["dev_shm_bytes"] = shm.total
        info["dev_shm_free_bytes"] = shm.free
    except OSError:
        info["dev_shm_bytes"] = info["dev_shm_free_bytes"] = None
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _meminfo_bytes(field_name: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            for line in meminfo:
                if line.startswith(f"{field_name}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- markdown ------------------------------------------------------------------------------------


def markdown_report(report: SuiteReport, relative_to: Path | None = None) -> str:
    """The run as Markdown (machine, one table of every figure, notes, plots), for docs.
    Plot links are relative to ``relative_to`` (the Markdown file's folder) when given."""
    machine = report.machine
    memory = machine.get("memory_bytes") or 0
    shm = machine.get("dev_shm_bytes") or 0
    lines = [
        f"Run of {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(report.started_at))}"
        f"{' (--quick)' if report.quick else ''}, {report.seconds:.0f} s: "
        f"{machine.get('cpu_model')}, {machine.get('cores')} cores, {memory / 2**30:.1f} GiB "
        f"memory, /dev/shm {shm / 2**30:.1f} GiB, Linux {machine.get('kernel')}, "
        f"Python {machine.get('python')}, torch {machine.get('torch')}, 1-minute load "
        f"{machine.get('loadavg_1m') or 0:.2f} at the start.",
        "",
        "| benchmark | figure | value | baseline | baseline value | ratio | target | met |",
        "|---|---|---:|---|---:|---:|---|:-:|",
    ]
    for outcome in report.outcomes:
        if outcome.failed:
            lines.append(f"| {outcome.name} | **FAILED**: {_cell(outcome.error or '')} |||||||")
            continue
        assert outcome.result is not None
        for figure in outcome.result.figures:
            met = "–" if figure.met is None else ("✓" if figure.met else "✗")
            lines.append(
                f"| {outcome.name} | {_cell(figure.name)} | {format_number(figure.value)} "
                f"{_cell(figure.unit)} | {_cell(figure.baseline)} | "
                f"{format_number(figure.baseline_value)} {_cell(figure.unit)} | "
                f"{figure.ratio:.2f}× | {_cell(figure.target or '')} | {met} |"
            )
    notes = [
        f"- **{outcome.name}**: {_cell(note)}"
        for outcome in report.outcomes
        if outcome.result is not None
        for note in outcome.result.notes
    ]
    if notes:
        lines += ["", "Notes from the benchmarks:", "", *notes]
    for outcome in report.outcomes:
        if outcome.result is None:
            continue
        for plot, path in zip(outcome.result.plots, outcome.plot_paths, strict=False):
            shown = Path(os.path.relpath(path, relative_to)) if relative_to else Path(path)
            lines += ["", f"![{_cell(plot.title)}]({shown.as_posix()})"]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_number(value: float) -> str:
    """Four significant digits, thousands separated, scientific when very large or small."""
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
