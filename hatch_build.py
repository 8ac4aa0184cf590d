"""Hatchling build hook: compiles the Zig core into ``ucm/native/libucm_core.so`` and writes
``ucm/native/_abi.py``, the Python mirror of its C ABI, from the Zig sources (``zig build abi``).

The Zig toolchain comes from the pinned ``ziglang`` build requirement, so a user never installs
Zig by hand. The library is written into the source tree (where an editable install finds it) and
shipped in the wheel, which is tagged for the platform because it carries native code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

LIBRARY_NAME = "libucm_core.so"
TEST_LIBRARY_NAME = "libucm_core_test.so"
"""The test build (``-Ddebug-hooks=true``: the release library plus the ``*_debug_*`` hooks),
built beside the release one for the test suite and the soak; never shipped in a wheel."""
ABI_MODULE = "_abi.py"


def build_test_library(source: Path, target: Path, env: dict[str, str] | None = None) -> None:
    """Builds the test variant of the core into ``target`` (replaced atomically)."""
    with tempfile.TemporaryDirectory(prefix="ucm-zig-test-") as prefix:
        command = [sys.executable, "-m", "ziglang", "build", "--prefix", prefix]
        command += ["--release=safe", "-Ddebug-hooks=true"]
        subprocess.run(command, cwd=source, env=env, check=True)
        staged = target.with_suffix(".so.tmp")
        shutil.copyfile(Path(prefix) / "lib" / TEST_LIBRARY_NAME, staged)
        os.replace(staged, target)


def generate_abi(source: Path, target: Path, env: dict[str, str] | None = None) -> None:
    """Writes the generated ABI mirror (``core-native/src/abi_gen.zig``) to ``target``; the
    file is replaced atomically. By hand: ``python hatch_build.py`` (or ``cd core-native &&
    python -m ziglang build abi -- ../ucm/native/_abi.py``)."""
    staged = target.with_suffix(".py.tmp")
    command = [sys.executable, "-m", "ziglang", "build", "abi", "--", str(staged.resolve())]
    subprocess.run(command, cwd=source, env=env, check=True)
    os.replace(staged, target)


class CustomBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        root = Path(self.root)
        source = root / "core-native"
        target = root / "ucm" / "native" / LIBRARY_NAME
        with tempfile.TemporaryDirectory(prefix="ucm-zig-") as prefix:
            command = [
                sys.executable,
                "-m",
                "ziglang",
                "build",
                "--prefix",
                prefix,
                "--release=safe",
            ]
            env = dict(os.environ)
            # A private cache keeps concurrent builds (pip's isolated envs, CI) from racing.
            env.setdefault("ZIG_GLOBAL_CACHE_DIR", str(source / ".zig-cache" / "global"))
            self.app.display_info(f"building the native core: {' '.join(command)}")
            try:
                subprocess.run(command, cwd=source, env=env, check=True)
            except (OSError, subprocess.CalledProcessError) as exc:
                raise RuntimeError(
                    f"building core-native/ with Zig failed ({exc}); the build needs the "
                    "'ziglang==0.15.1' package, which pip installs as a build requirement"
                ) from exc
            try:
                generate_abi(source, target.with_name(ABI_MODULE), env)
                build_test_library(source, target.with_name(TEST_LIBRARY_NAME), env)
            except (OSError, subprocess.CalledProcessError) as exc:
                raise RuntimeError(
                    f"generating ucm/native/{ABI_MODULE} or building {TEST_LIBRARY_NAME} failed "
                    f"({exc})"
                ) from exc
            built = Path(prefix) / "lib" / LIBRARY_NAME
            # Replace, never overwrite in place: a process that has the old library mapped
            # (a test run, a live rank) would crash if its pages changed under it.
            staged = target.with_suffix(".so.tmp")
            shutil.copyfile(built, staged)
            os.replace(staged, target)
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version != "editable":
            # An editable install finds the library in the source tree; force-including it there
            # would create a `ucm` directory in site-packages that shadows the source package.
            build_data["force_include"][str(target)] = f"ucm/native/{LIBRARY_NAME}"


if (
    __name__ == "__main__"
):  # by hand: regenerate ucm/native/_abi.py (--test-library: the test build)
    here = Path(__file__).resolve().parent
    if "--test-library" in sys.argv[1:]:
        build_test_library(here / "core-native", here / "ucm" / "native" / TEST_LIBRARY_NAME)
    else:
        generate_abi(here / "core-native", here / "ucm" / "native" / ABI_MODULE)
