"""Packaging: the sdist carries core-native/, the wheel carries the built native library under a
platform tag, built-in tiers install as `ucm_backends` (never a generic `backends`), and a
missing library is reported with how to rebuild it."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_sdist_carries_the_zig_sources(tmp_path: Path) -> None:
    from hatchling.builders.sdist import SdistBuilder

    archive = Path(next(iter(SdistBuilder(str(ROOT)).build(directory=str(tmp_path)))))
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for required in (
        "core-native/build.zig",
        "core-native/src/constants.zig",
        "core-native/src/exports.zig",
        "core-native/src/futex.zig",
        "hatch_build.py",
        "backends/ucm_backends/__init__.py",
        "ucm/__init__.py",
        "ucm/py.typed",
        "constraints.txt",
    ):
        assert required in names, required
    assert not any(".zig-cache" in name or "zig-out" in name for name in names)


@pytest.mark.timeout(900)
def test_wheel_is_platform_tagged_and_ships_the_native_library(tmp_path: Path) -> None:
    from hatchling.builders.wheel import WheelBuilder

    wheel = Path(next(iter(WheelBuilder(str(ROOT)).build(directory=str(tmp_path)))))
    assert "-py3-none-any" not in wheel.name
    assert "linux" in wheel.name, wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        console = archive.read(entry_points).decode()
    assert "ucm/native/libucm_core.so" in names
    assert "ucm/native/_abi.py" in names  # generated from the Zig sources at build time
    assert "ucm/native/libucm_core_test.so" not in names  # the test build never ships
    assert "ucm_backends/__init__.py" in names
    assert "ucm/py.typed" in names
    assert not any(name.startswith("backends/") for name in names)
    assert "ucm = ucm.cli:main" in console
    # Nothing that only tests and benchmarks use: the harness (test servers, the soak) and the
    # tests stay in the repository; ucm.testing keeps what plugin authors use.
    assert not any(name.startswith(("harness/", "tests/")) for name in names), sorted(names)
    for moved in HARNESS_ONLY:
        assert moved not in names, moved
    assert {"ucm/testing/__init__.py", "ucm/testing/conformance.py"} <= names
    assert "ucm/envelope.py" in names and "ucm/ranks.py" in names


HARNESS_ONLY = (
    "ucm/soak.py",
    "ucm/testing/s3.py",
    "ucm/testing/mooncake.py",
    "ucm/testing/vllm.py",
    "ucm/testing/lmcache.py",
    "ucm/testing/vllm_server.py",
)
"""Modules that moved to the repository's harness/ (not shipped)."""


def test_sdist_carries_the_harness_the_tests_import(tmp_path: Path) -> None:
    from hatchling.builders.sdist import SdistBuilder

    archive = Path(next(iter(SdistBuilder(str(ROOT)).build(directory=str(tmp_path)))))
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    harness = {"__init__", "s3", "mooncake", "soak", "vllm", "lmcache", "vllm_server"}
    assert {f"harness/{name}.py" for name in harness} <= names
    assert "tests/conftest.py" in names


def test_missing_native_library_says_how_to_rebuild(tmp_path: Path) -> None:
    code = "from ucm.native import lib\nlib()"
    env = dict(os.environ, UCM_NATIVE_LIB=str(tmp_path / "nope.so"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 1
    assert f"the UCM native core is missing at {tmp_path / 'nope.so'}" in result.stderr
    assert "reinstall the package to rebuild it (`pip install -e .`" in result.stderr
    assert "NativeLibraryError" in result.stderr
