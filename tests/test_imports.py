"""Import hygiene of the ``ucm`` package, each check in a fresh interpreter:

- every module of ``ucm`` imports on its own, first (an import circle held together by import
  order fails here);
- ``import ucm``, ``import ucm.testing`` (what plugin authors import) and ``ucm --help`` pull in
  no engine (vllm, sglang, lmcache, mooncake), no test server (moto, the repository's
  ``harness``), no torch and no benchmark module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ucm

ROOT = Path(__file__).resolve().parents[1]
IMPORT_TIMEOUT_S = 600
"""An engine module (vLLM, LMCache) takes tens of seconds to import on a busy 2-core machine."""

FORBIDDEN = ("vllm", "sglang", "lmcache", "mooncake", "moto", "torch", "harness", "ucm.bench")
"""Top-level packages (and ucm.bench) that ``import ucm`` and ``ucm --help`` must not load."""
MOVED_TO_HARNESS = (
    "ucm.soak",
    "ucm.testing.s3",
    "ucm.testing.mooncake",
    "ucm.testing.vllm",
    "ucm.testing.lmcache",
    "ucm.testing.vllm_server",
)
"""Test servers, engine drivers and the soak: in the repository's harness/, not the package."""
FORBIDDEN_MODULES = MOVED_TO_HARNESS


def _modules() -> list[str]:
    """Every Python module of the package (the native library is no Python module)."""
    package = Path(ucm.__file__).parent
    names = []
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), str(ROOT / "backends"), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path)


def _loaded_after(code: str) -> list[str]:
    """The modules loaded in a fresh interpreter after running ``code`` (run from a directory
    that is not the checkout, so nothing is importable by accident of the working directory)."""
    script = (
        "import json, sys\n"
        f"{code}\n"
        "sys.stdout.write('\\nMODULES ' + json.dumps(sorted(sys.modules)) + '\\n')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=_env(),
        cwd="/",
        timeout=IMPORT_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    line = result.stdout.rsplit("\nMODULES ", 1)[1]
    loaded: list[str] = json.loads(line)
    return loaded


def _forbidden(loaded: list[str]) -> list[str]:
    return [
        name
        for name in loaded
        if name in FORBIDDEN_MODULES
        or any(name == top or name.startswith(top + ".") for top in FORBIDDEN)
    ]


def test_the_package_has_the_modules_this_test_walks() -> None:
    modules = _modules()
    assert {"ucm.cli", "ucm.envelope", "ucm.ranks", "ucm.testing.conformance"} <= set(modules)
    assert not [m for m in modules if m in MOVED_TO_HARNESS], "these moved to harness/"


@pytest.mark.timeout(IMPORT_TIMEOUT_S + 60)
@pytest.mark.parametrize("module", _modules())
def test_each_module_imports_first_in_a_fresh_process(module: str) -> None:
    loaded = _loaded_after(f"import {module}")
    assert module in loaded


@pytest.mark.parametrize(
    "code",
    [
        "import ucm",
        "import ucm.testing",
        "import ucm.testing.conformance",
        "import ucm.envelope, ucm.ranks",
    ],
)
def test_import_pulls_in_no_engine_server_torch_or_benchmark(code: str) -> None:
    loaded = _loaded_after(code)
    assert _forbidden(loaded) == []
    assert "ucm" in loaded


def test_ucm_help_pulls_in_no_engine_server_torch_or_benchmark() -> None:
    code = (
        "sys.argv = ['ucm', '--help']\n"
        "from ucm.cli import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exit:\n"
        "    assert exit.code in (0, None), exit.code\n"
    )
    loaded = _loaded_after(code)
    assert "ucm.cli" in loaded
    assert _forbidden(loaded) == []
    assert not [name for name in loaded if name.startswith("ucm_backends")]


def test_the_forbidden_check_sees_what_it_looks_for() -> None:
    # The checks above must be able to fail: a module that does pull these in is caught.
    loaded = _loaded_after("import ucm.bench.mooncake_load")
    assert "ucm.bench" in _forbidden(loaded)
