"""``harness.slow_tier_tpot --forward-times``: the module that times vLLM's model forward wraps
the real ``GPUModelRunner`` in a fresh interpreter, and the harness's selection of forwards
(before the admission; during the load, without ``long``'s step) is exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import slow_tier_tpot

ROOT = Path(__file__).resolve().parents[2]


def _python_with_the_timing_module(
    code: str, cwd: Path, times: Path | None
) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter with ``harness/forward_times`` on its path, and
    ``UCM_HARNESS_FORWARD_TIMES`` set to ``times`` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "UCM_HARNESS_FORWARD_TIMES"}
    env["PYTHONPATH"] = os.pathsep.join([str(slow_tier_tpot.FORWARD_TIMES), str(ROOT)])
    if times is not None:
        env["UCM_HARNESS_FORWARD_TIMES"] = str(times)
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
        check=True,
    )


def test_the_timing_module_wraps_vllms_model_forward_and_writes_one_line_per_call(
    tmp_path: Path,
) -> None:
    pytest.importorskip("vllm")
    code = (
        "import json, os\n"
        "from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n"
        "class Runner:\n"
        "    pass\n"
        "runner = Runner()\n"
        "forward = GPUModelRunner._model_forward\n"
        # The wrapped method calls the original: here a stand-in receiver whose original
        # raises (it has no model), which must still leave one line.
        "try:\n"
        "    forward(runner)\n"
        "except Exception as exc:\n"
        "    kind = type(exc).__name__\n"
        "print(json.dumps({'wrapped': forward.__name__, 'raised': kind}))\n"
    )
    out = _python_with_the_timing_module(code, tmp_path, times=tmp_path)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["wrapped"] == "timed", out.stderr[-2000:]
    files = list(tmp_path.glob("forward-*.txt"))
    assert len(files) == 1
    (line,) = files[0].read_text().splitlines()
    start, end, cpu = (float(x) for x in line.split())
    assert end >= start and cpu >= 0


def test_without_the_variable_nothing_is_wrapped(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    code = (
        "from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n"
        "print(GPUModelRunner._model_forward.__name__)\n"
    )
    out = _python_with_the_timing_module(code, tmp_path, times=None)
    assert out.stdout.strip().splitlines()[-1] == "_model_forward"


def test_the_harness_takes_the_forwards_before_the_admission_and_the_loads_without_longs_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Times in seconds. The decoder's tokens arrive at 1, 2, 3, 4 (before the admission at
    # 4.5), then 5.1, 6.1 during the load, and 7.2 out of ``long``'s step.
    calls = [
        (0.0, 0.9, 0.8),  # the decoder's first two tokens: not counted
        (1.1, 1.9, 0.7),
        (2.1, 2.9, 0.7),
        (3.1, 3.7, 0.5),
        (4.2, 4.8, 0.6),  # spans the admission: in neither part
        (4.9, 5.05, 0.1),
        (5.2, 6.0, 0.6),
        (6.2, 7.1, 0.9),  # ``long``'s step: ends after the token before it
    ]
    (tmp_path / "forward-1.txt").write_text("".join(f"{s} {e} {c}\n" for s, e, c in calls[:4]))
    (tmp_path / "forward-2.txt").write_text("".join(f"{s} {e} {c}\n" for s, e, c in calls[4:]))
    monkeypatch.setenv("UCM_HARNESS_FORWARD_TIMES", str(tmp_path))
    out = slow_tier_tpot._forward_times([1.0, 2.0, 3.0, 4.0], 4.5, [5.1, 6.1, 7.2])
    assert out == {
        "forward_ms_before_admission": round(1000 * (0.8 + 0.6) / 2, 2),
        "forward_cpu_ms_before_admission": round(1000 * (0.7 + 0.5) / 2, 2),
        "forward_ms_during_load": round(1000 * (0.15 + 0.8) / 2, 2),
        "forward_cpu_ms_during_load": round(1000 * (0.1 + 0.6) / 2, 2),
        "forward_ratio_during_load": round(
            round(1000 * (0.15 + 0.8) / 2, 2) / round(1000 * (0.8 + 0.6) / 2, 2), 3
        ),
    }
    # A window of one token (only ``long``'s step): nothing during the load.
    only_long = slow_tier_tpot._forward_times([1.0, 2.0, 3.0, 4.0], 4.5, [7.2])
    assert "forward_ms_during_load" not in only_long
    assert "forward_ratio_during_load" not in only_long
