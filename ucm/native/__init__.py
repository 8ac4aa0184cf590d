"""ctypes binding to libucm_core.so, the Zig core built by ``pip install``.

``UCM_NATIVE_LIB`` may point at another build of the library (e.g. ``core-native/zig-out``).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import NoReturn

from ..errors import NativeLibraryError
from . import _abi

LIBRARY_NAME = "libucm_core.so"
TEST_LIBRARY_NAME = "libucm_core_test.so"
"""The test build of the core (``zig build -Ddebug-hooks=true``): the release library plus the
``*_debug_*`` hooks (fault injection, slot introspection) that only tests and the soak use."""
ABI_VERSION = _abi.ABI_VERSION
_REBUILD_HINT = (
    "reinstall the package to rebuild it (`pip install -e .` or `pip install .` from the "
    "repository; the pinned ziglang build requirement compiles core-native/)"
)


def library_path() -> Path:
    override = os.environ.get("UCM_NATIVE_LIB")
    if override:
        return Path(override)
    return Path(__file__).with_name(LIBRARY_NAME)


@cache
def lib() -> ctypes.CDLL:
    """Loads the library once per process and declares every exported signature."""
    path = library_path()
    if not path.exists():
        raise NativeLibraryError(f"the UCM native core is missing at {path}; {_REBUILD_HINT}")
    try:
        handle = ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeLibraryError(
            f"cannot load the UCM native core {path}: {exc}; {_REBUILD_HINT}"
        ) from exc
    handle.ucm_abi_version.restype = ctypes.c_uint32
    handle.ucm_abi_version.argtypes = []
    found = handle.ucm_abi_version()
    if found != ABI_VERSION:
        raise NativeLibraryError(
            f"the UCM native core at {path} has ABI version {found}, this package needs "
            f"{ABI_VERSION}; {_REBUILD_HINT}"
        )
    _declare(handle)
    return handle


def declare(handle: ctypes.CDLL, signatures: dict[str, tuple[object, list[object]]]) -> None:
    """Declares the signatures of ``handle``'s functions. A ``*_debug_*`` hook the library
    lacks (a release build) becomes a function that raises, naming the test build."""
    for name, (restype, argtypes) in signatures.items():
        try:
            function = getattr(handle, name)
        except AttributeError:
            if "_debug_" not in name:
                raise NativeLibraryError(
                    f"the UCM native core lacks {name}; {_REBUILD_HINT}"
                ) from None
            setattr(handle, name, _missing_hook(name))
            continue
        function.restype = restype
        function.argtypes = argtypes


def _missing_hook(name: str) -> Callable[..., NoReturn]:
    def missing(*_arguments: object) -> NoReturn:
        raise NativeLibraryError(
            f"{name} is a test hook: only the test build of the core exports it "
            f"({TEST_LIBRARY_NAME}, `zig build -Ddebug-hooks=true`); point UCM_NATIVE_LIB at it"
        )

    return missing


def _declare(handle: ctypes.CDLL) -> None:
    u32, u64, i32, i64, usize = (
        ctypes.c_uint32,
        ctypes.c_uint64,
        ctypes.c_int32,
        ctypes.c_int64,
        ctypes.c_size_t,
    )
    signatures: dict[str, tuple[object, list[object]]] = {
        "ucm_version_wait": (i32, [usize, u32, u64]),
        "ucm_version_bump": (i64, [usize]),
        "ucm_version_load": (i64, [usize]),
        "ucm_monotonic_ns": (u64, []),
        "ucm_checksum": (
            i32,
            [u32, ctypes.c_void_p, ctypes.c_void_p, u64, ctypes.POINTER(ctypes.c_uint64)],
        ),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(handle, name)
        function.restype = restype
        function.argtypes = argtypes
