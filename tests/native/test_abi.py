"""``ucm/native/_abi.py`` is generated from the Zig sources (``core-native/src/abi_gen.zig``):
regenerating it must give the committed file, so no limit, enum or structure of the C ABI is
ever copied (and left stale) by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATE_TIMEOUT_S = 600


@pytest.mark.timeout(GENERATE_TIMEOUT_S + 60)
def test_regenerating_the_abi_module_gives_the_committed_file(tmp_path: Path) -> None:
    target = tmp_path / "_abi.py"
    result = subprocess.run(
        [sys.executable, "-m", "ziglang", "build", "abi", "--", str(target)],
        cwd=ROOT / "core-native",
        capture_output=True,
        text=True,
        timeout=GENERATE_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    committed = (ROOT / "ucm" / "native" / "_abi.py").read_text()
    assert target.read_text() == committed, (
        "ucm/native/_abi.py is stale: regenerate it with `python hatch_build.py`"
    )


def test_the_binding_takes_its_limits_and_enums_from_the_generated_module() -> None:
    from ucm.native import _abi, buffer, queue
    from ucm.tier import REMOVE_CHUNK_KEYS

    assert queue.STEP_KEYS_MAX == _abi.QUEUE_STEP_KEYS_MAX == 1 << 15
    assert queue.TaskKind is _abi.TaskKind and queue.WorkState is _abi.WorkState
    assert queue.COUNTER_NAMES == _abi.QUEUE_COUNTER_NAMES
    assert buffer.State is _abi.State and buffer.COUNTER_NAMES == _abi.BUFFER_COUNTER_NAMES
    assert buffer.CTRL_LAYOUT_VERSION == _abi.BUFFER_LAYOUT_VERSION
    assert REMOVE_CHUNK_KEYS == _abi.BUFFER_REMOVE_CHUNK_KEYS
