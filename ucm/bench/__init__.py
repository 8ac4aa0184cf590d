"""Benchmarks behind ``ucm bench``: every figure is printed beside a baseline measured in the
same run, as a ratio, because this machine is shared and noisy (absolute times mean little,
ratios within one run mean a lot).

A benchmark is a module in this package exposing ``BENCHMARK``, an object with ``name``,
``title`` and ``run(options) -> BenchResult``. ``ucm bench`` discovers them with
:func:`discover`, runs them with a progress bar, prints a table, writes JSON and plots.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import pkgutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from ..errors import UcmError


@dataclass
class Figure:
    """One measured figure beside its same-run baseline.

    ``ratio`` is "how many times better than the baseline": value/baseline when higher is
    better (bandwidth, hit ratio), baseline/value when lower is better (latency, time).
    ``target_ratio`` is the issue's target on that ratio, when there is one.
    """

    name: str
    value: float
    unit: str
    baseline: str
    baseline_value: float
    higher_is_better: bool = True
    target: str | None = None
    """Human-readable target, e.g. '>= 0.85x memcpy'."""
    target_ratio: float | None = None
    """Minimum ratio that meets the target."""
    extra: dict[str, float] = field(default_factory=dict)
    """Other numbers worth keeping (lock acquisitions, p99, CPU %...)."""

    @property
    def ratio(self) -> float:
        if self.higher_is_better:
            return self.value / self.baseline_value if self.baseline_value else math.inf
        return self.baseline_value / self.value if self.value else math.inf

    @property
    def met(self) -> bool | None:
        if self.target_ratio is None:
            return None
        return self.ratio >= self.target_ratio

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ratio"] = self.ratio
        data["met"] = self.met
        return data


@dataclass
class Plot:
    """A picture of a result: ``series`` maps a label to (xs, ys).

    ``kind="line"``: a curve through (xs, ys) per series. ``kind="cdf"``: an empirical CDF per
    series; give raw samples as xs with ys empty (``ucm bench`` sorts them), or the CDF's own
    points. ``kind="bar"``: grouped bars, one group per distinct x, one bar per series.
    ``ucm bench --plot DIR`` writes ``DIR/<filename>`` (``.png`` added when missing).
    """

    filename: str
    title: str
    xlabel: str
    ylabel: str
    series: dict[str, tuple[list[float], list[float]]]
    kind: Literal["line", "cdf", "bar"] = "line"
    logx: bool = False
    logy: bool = False


@dataclass
class BenchResult:
    name: str
    figures: list[Figure]
    plots: list[Plot] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Peers skipped (with why), environment caveats, ..."""


@dataclass
class BenchOptions:
    quick: bool = False
    """Small sizes: the whole suite finishes in under 2 minutes on 2 cores."""
    progress: Callable[[str], None] = lambda message: None
    """Called with a short status line as the benchmark advances."""
    workdir: str | None = None
    """Where temporary files go (a real filesystem for disk figures)."""


class Benchmark(Protocol):
    name: str
    title: str

    def run(self, options: BenchOptions) -> BenchResult: ...


def discover() -> list[Benchmark]:
    """Every ``BENCHMARK`` in this package, in module-name order."""
    found = []
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        benchmark = getattr(module, "BENCHMARK", None)
        if benchmark is not None:
            found.append(benchmark)
    return found


def not_installed(name: str, modules: tuple[str, ...], unit: str) -> BenchResult | None:
    """What benchmark ``name`` reports when one of ``modules`` (an engine and what drives it)
    is not installed: one figure that says so, and no measurement. None when every one is.
    Under CI, which installs every engine, a missing one raises RuntimeError instead."""
    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    message = (
        f"{' and '.join(missing)} not installed: `bash tools/install-test-env` installs "
        "every engine and what its benchmarks need"
    )
    if os.environ.get("CI"):
        raise RuntimeError(f"{message}, and CI runs benchmark {name!r}")
    return BenchResult(
        name=name,
        figures=[
            Figure(
                name=f"not measured: {' and '.join(missing)} not installed",
                value=0.0,
                unit=unit,
                baseline="(nothing)",
                baseline_value=1.0,
            )
        ],
        notes=[message],
    )


def need_harness(benchmark: str) -> None:
    """Makes the repository's ``harness`` package (test servers, engine drivers: not in the
    wheel) importable for ``benchmark``: already on the path (pytest, ``python -m ucm`` from the
    checkout), or found in the checkout this ``ucm`` is installed from (editable). Raises
    UcmError saying so when there is none."""
    if importlib.util.find_spec("harness") is not None:
        return
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "harness" / "__init__.py").is_file():
        sys.path.insert(0, str(checkout))
        importlib.invalidate_caches()
        return
    raise UcmError(
        f"benchmark {benchmark!r} needs the repository's test harness (harness/: test servers "
        "and engine drivers, which the wheel does not ship); run it from a UCM checkout "
        "(pip install -e .)"
    )
