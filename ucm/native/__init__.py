"""ctypes binding to libucm_core.so, the Zig core built by ``pip install``.

``UCM_NATIVE_LIB`` may point at another build of the library (e.g. ``core-native/zig-out``).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

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
    version: Any = handle.ucm_abi_version
    version.restype, version.argtypes = _abi.SIGNATURES["ucm_abi_version"]
    found = version()
    if found != ABI_VERSION:
        raise NativeLibraryError(
            f"the UCM native core at {path} has ABI version {found}, this package needs "
            f"{ABI_VERSION}; {_REBUILD_HINT}"
        )
    _declare(handle)
    return handle


def _declare(handle: ctypes.CDLL) -> None:
    """Declares every export from the generated signatures (``_abi.SIGNATURES``, reflected
    from exports.zig). A ``*_debug_*`` hook the library lacks (a release build) becomes a
    function that raises, naming the test build."""
    for name, (restype, argtypes) in _abi.SIGNATURES.items():
        try:
            function: Any = getattr(handle, name)
        except AttributeError:
            raise NativeLibraryError(f"the UCM native core lacks {name}; {_REBUILD_HINT}") from None
        function.restype = restype
        function.argtypes = argtypes
    for name, (restype, argtypes) in _abi.DEBUG_SIGNATURES.items():
        try:
            function = getattr(handle, name)
        except AttributeError:
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
