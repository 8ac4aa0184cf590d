"""``ucm/native/_abi.py`` is generated from the Zig sources (``core-native/src/abi_gen.zig``):
regenerating it must give the committed file, so no limit, enum or structure of the C ABI is
ever copied (and left stale) by hand. And the ``*_debug_*`` hooks live only in the test build
of the core, never in the release library."""

from __future__ import annotations

import ctypes
import os
import re
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


def _exports() -> list[str]:
    text = (ROOT / "core-native" / "src" / "exports.zig").read_text()
    return re.findall(r"^pub export fn (ucm_\w+)\(", text, re.MULTILINE)


def test_every_export_is_declared_from_the_generated_signatures() -> None:
    """One signature per export of exports.zig (reflected, not written by hand), each declared
    on the loaded library exactly as generated; the debug hooks only where the build has them."""
    from ucm.native import _abi, lib

    exports = _exports()
    # saves: ucm_buffer_count_write_through_skipped; namespaces: ucm_buffer_list_ready;
    # admission: ucm_buffer_reuses, ucm_queue_take_admitted, ucm_queue_unadmit; quotas:
    # ucm_buffer_register_namespace, ucm_buffer_namespace_info; staging copies: ucm_copy_ranges;
    # reset epochs: ucm_buffer_control_read, ucm_buffer_control_raise; removal log:
    # ucm_buffer_removal_log, ucm_removal_log_{init,generation,append,read}; identities:
    # ucm_buffer_register_namespace_name, ucm_buffer_namespace_name(s)
    assert len(exports) == 76
    assert _abi.SIGNATURES["ucm_queue_unadmit"] == (
        ctypes.c_int64,
        [ctypes.c_size_t, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32],
    )
    assert _abi.SIGNATURES["ucm_buffer_reuses"] == (
        ctypes.c_int32,
        [ctypes.c_size_t, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p],
    )
    assert list(_abi.SIGNATURES) == exports
    assert list(_abi.DEBUG_SIGNATURES) == _debug_hooks()
    assert _abi.SIGNATURES["ucm_queue_pin"] == (
        ctypes.c_int64,
        [ctypes.c_size_t, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p],
    )
    assert _abi.SIGNATURES["ucm_buffer_header"][1][1] == ctypes.POINTER(_abi.Header)
    assert _abi.DEBUG_SIGNATURES["ucm_buffer_debug_set_wait_pause_ns"] == (
        None,
        [ctypes.c_uint64],
    )
    handle = lib()
    for name, (restype, argtypes) in {**_abi.SIGNATURES, **_abi.DEBUG_SIGNATURES}.items():
        function = getattr(handle, name)
        assert (function.restype, function.argtypes) == (restype, argtypes), name
    # No hand-written signature is left in the binding.
    for module in ("__init__", "buffer", "queue", "segments", "checksum", "futex"):
        source = (ROOT / "ucm" / "native" / f"{module}.py").read_text()
        assert ".argtypes = [" not in source and "signatures: dict" not in source, module


def _debug_hooks() -> list[str]:
    text = (ROOT / "core-native" / "src" / "exports.zig").read_text()
    # Every hook is a plain function exported only under build_options.debug_hooks.
    assert not re.search(r"^(pub )?export fn \w*_debug_", text, re.MULTILINE)
    return re.findall(r"@export\(&(ucm_\w*_debug_\w*),", text)


def test_the_release_library_exports_no_debug_hook_and_the_test_build_all() -> None:
    hooks = _debug_hooks()
    assert len(hooks) == 10
    release = ctypes.CDLL(str(ROOT / "ucm" / "native" / "libucm_core.so"))
    assert [hook for hook in hooks if hasattr(release, hook)] == []
    test_build = ctypes.CDLL(str(ROOT / "ucm" / "native" / "libucm_core_test.so"))
    assert [hook for hook in hooks if not hasattr(test_build, hook)] == []
    assert os.environ["UCM_NATIVE_LIB"].endswith("libucm_core_test.so")  # the suite's build


def test_a_debug_hook_on_the_release_library_names_the_test_build() -> None:
    code = (
        "from ucm.errors import NativeLibraryError\n"
        "from ucm.native import buffer\n"
        "try:\n"
        "    buffer.set_wait_pause_ns(0)\n"
        "except NativeLibraryError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "UCM_NATIVE_LIB": str(ROOT / "ucm" / "native" / "libucm_core.so")}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        "ucm_buffer_debug_set_wait_pause_ns is a test hook: only the test build of the core "
        "exports it (libucm_core_test.so, `zig build -Ddebug-hooks=true`)"
    ), result.stdout
