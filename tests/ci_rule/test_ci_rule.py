"""Under CI=true a skipped test or module fails the run (CUDA-only tests excepted), and an
assertion failing in a thread fails its test instead of becoming a warning."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def run_probe(path: str | Path, ci: bool) -> subprocess.CompletedProcess[str]:
    """pytest on one probe file with the project's configuration (pyproject.toml)."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    target = HERE / path if isinstance(path, str) else path
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(ROOT / "pyproject.toml"),
            str(target),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_skips_fail_under_ci_except_cuda() -> None:
    local = run_probe("probe_skips.py", ci=False)
    assert local.returncode == 0, local.stdout
    assert "1 passed, 2 skipped, 1 xfailed" in local.stdout
    ci = run_probe("probe_skips.py", ci=True)
    assert ci.returncode == 1, ci.stdout
    assert "1 failed, 1 passed, 1 skipped, 1 xfailed" in ci.stdout
    assert (
        "skipped under CI=true, where only CUDA tests (marker `cuda`) may skip: "
        "Skipped: an optional dependency is missing" in ci.stdout
    )


def test_a_skipped_module_fails_under_ci() -> None:
    local = run_probe("probe_module_skip.py", ci=False)
    assert local.returncode == 5 and "1 skipped" in local.stdout, local.stdout  # no tests ran
    ci = run_probe("probe_module_skip.py", ci=True)
    assert ci.returncode != 0, ci.stdout
    assert "skipped under CI=true, where whole modules never skip" in ci.stdout
    assert "a_module_that_does_not_exist_anywhere" in ci.stdout


def test_an_assertion_in_a_thread_fails_the_test(tmp_path: Path) -> None:
    probe = tmp_path / "probe_thread.py"
    probe.write_text(
        textwrap.dedent(
            """
            import threading

            def test_thread_asserts() -> None:
                def work() -> None:
                    assert 1 == 2, "checked in a worker thread"
                thread = threading.Thread(target=work)
                thread.start()
                thread.join()
            """
        )
    )
    result = run_probe(probe, ci=False)
    assert result.returncode == 1, result.stdout
    assert "1 failed" in result.stdout
    assert "checked in a worker thread" in result.stdout
