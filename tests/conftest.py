"""Plugin fixtures, the way simonw/llm tests plugins: register a plugin object on
``ucm.plugins.pm`` for one test and unregister it afterwards. Other suites keep their helpers in
their own conftest files. Also the CI rule: under ``CI=true`` a skipped test fails, unless it
is marked ``cuda``."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

_ROOT = Path(__file__).resolve().parents[1]
_TEST_LIBRARY = _ROOT / "ucm" / "native" / "libucm_core_test.so"


def _use_the_test_build() -> None:
    """The tests (and the ranks and soak processes they spawn, which inherit the environment)
    load the test build of the core: the release library plus the ``*_debug_*`` hooks. Built
    here when it is missing or older than the Zig sources (``python hatch_build.py
    --test-library``); ``UCM_NATIVE_LIB`` set by the caller wins."""
    if "UCM_NATIVE_LIB" in os.environ:
        return
    sources = [*(_ROOT / "core-native" / "src").glob("*.zig"), _ROOT / "core-native" / "build.zig"]
    newest = max(path.stat().st_mtime for path in sources)
    if not _TEST_LIBRARY.exists() or _TEST_LIBRARY.stat().st_mtime < newest:
        subprocess.run(
            [sys.executable, str(_ROOT / "hatch_build.py"), "--test-library"],
            cwd=_ROOT,
            check=True,
            timeout=900,
        )
    os.environ["UCM_NATIVE_LIB"] = str(_TEST_LIBRARY)


_use_the_test_build()

import ucm  # noqa: E402  (imported once the environment names the test build)
from ucm import plugins  # noqa: E402
from ucm.config import Size  # noqa: E402
from ucm.layout import Key  # noqa: E402
from ucm.tier import Outcome, ShardViews, chunks, scatter  # noqa: E402


class ScratchTierConfig(ucm.LowerTierConfig):
    """``type: scratch``: a tier that only exists while a test registers it."""

    type: Literal["scratch"]
    capacity: Size | None = Field(default=None, description="Informational only.")


class ScratchTier(ucm.Tier):
    """A small in-process dict tier: enough for a stack to validate and run in a test."""

    type_name = "scratch"
    config_model = ScratchTierConfig

    def __init__(self, config: ucm.TierConfig, context: ucm.TierContext) -> None:
        super().__init__(config, context)
        self._lock = threading.Lock()
        self._shards: dict[Key, bytes] = {}
        self.lock_acquisitions = 0

    def lookup(self, keys: Sequence[Key]) -> list[bool]:
        with self._lock:
            return [key in self._shards for key in keys]

    def load(self, keys: Sequence[Key], destinations: Sequence[ShardViews]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for key, views in zip(keys, destinations, strict=True):
            with self._lock:
                data = self._shards.get(key)
            if data is None:
                outcomes.append(ucm.KeyMissingError(f"{key!r} not in scratch tier"))
                continue
            scatter(data, views)
            outcomes.append(None)
        return outcomes

    def dump(self, keys: Sequence[Key], sources: Sequence[ShardViews]) -> list[Outcome]:
        blobs = [b"".join(views) for views in sources]
        with self._lock:
            self._shards.update(zip(keys, blobs, strict=True))
        return [None] * len(keys)

    def touch(self, block_ids: Sequence[bytes]) -> None:
        pass  # no eviction, so nothing to renew

    def batched_remove(self, keys: Sequence[Key], force: bool = False) -> int:
        removed = 0
        for part in chunks(list(dict.fromkeys(keys))):
            with self._lock:
                self.lock_acquisitions += 1
                for key in part:
                    if (force or not self.pins.is_pinned(key)) and key in self._shards:
                        del self._shards[key]
                        removed += 1
        return removed


class ScratchPlugin:
    """A plugin object with a hook implementation, as a third-party module would have."""

    @ucm.hookimpl
    def register_tiers(self, register: Callable[[type[ucm.Tier]], None]) -> None:
        register(ScratchTier)


RegisterPlugin = Callable[[object, str], None]


@pytest.fixture
def register_plugin() -> Iterator[RegisterPlugin]:
    """``register_plugin(plugin, name)`` registers on ``ucm.plugins.pm`` until the test ends."""
    names: list[str] = []

    def register(plugin: object, name: str) -> None:
        try:
            plugins.pm.register(plugin, name=name)
        except Exception:
            # pluggy < 1.7 keeps a plugin whose hookimpl failed validation registered; it would
            # then break every later test that lists tier types.
            if plugins.pm.is_registered(plugin):
                plugins.pm.unregister(plugin)
            raise
        names.append(name)

    try:
        yield register
    finally:
        for name in reversed(names):
            plugins.pm.unregister(name=name)


@pytest.fixture
def scratch_tier(register_plugin: RegisterPlugin) -> type[ScratchTier]:
    """Registers the ``scratch`` tier type for this test; returns its class."""
    register_plugin(ScratchPlugin(), "scratch-plugin")
    return ScratchTier


# ---- environment a library leaves behind ---------------------------------------------------

_PROMETHEUS_DIR_AT_START = os.environ.get("PROMETHEUS_MULTIPROC_DIR")


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Puts ``PROMETHEUS_MULTIPROC_DIR`` back after each test. LMCache's storage manager sets it
    (to /tmp/lmcache_prometheus, never wiped) in the test process; every process a later test
    starts would inherit it, and vLLM servers sharing that directory sum each other's metrics."""
    if _PROMETHEUS_DIR_AT_START is None:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = _PROMETHEUS_DIR_AT_START


# ---- CI: no silent skips ---------------------------------------------------------------------


def on_ci() -> bool:
    """CI sets CI=true: there every test runs, CUDA-only tests (marker ``cuda``) excepted."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _skip_reason(longrepr: object) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not (report.skipped and on_ci()) or hasattr(report, "wasxfail"):
        return
    if item.get_closest_marker("cuda") is not None:
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI=true, where only CUDA tests (marker `cuda`) may skip: "
        f"{_skip_reason(report.longrepr)}"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and on_ci():
        report.outcome = "failed"
        report.longrepr = (
            f"{collector.nodeid} skipped under CI=true, where whole modules never skip: "
            f"{_skip_reason(report.longrepr)}"
        )
