"""Shard checksums for the lower tiers: XXH3-64 streamed over a shard's views, computed by the
native core (``core-native/src/checksum.zig``) with the GIL released.

Tiers store one per shard and compare it on load, so a torn or corrupted copy is caught. XXH3
rather than ``zlib.crc32``: it runs at tens of GB/s instead of ~2 GB/s per core, so checking
every shard costs next to nothing beside an NVMe read.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from ..errors import InvalidArgumentError
from . import lib

_MAX_PARTS = 1 << 16  # constants.checksum_parts_max
_PYBUF_SIMPLE = 0


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (stable layout since 3.0); only ``buf`` and ``len`` are read."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


# Read-only buffers (bytes, a read-only memoryview of a tensor) have no ctypes address; the
# buffer protocol itself hands out the pointer without a copy.
_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def checksum(parts: Sequence[bytes | bytearray | memoryview], seed: int = 0) -> int:
    """XXH3-64 of the concatenated bytes of ``parts`` (any buffer-protocol objects)."""
    count = len(parts)
    if count > _MAX_PARTS:
        raise InvalidArgumentError(
            f"parts has {count} buffers, which is not valid: at most {_MAX_PARTS} per checksum"
        )
    if not (isinstance(seed, int) and 0 <= seed < 2**64):
        raise InvalidArgumentError(f"seed={seed!r} is not valid: expected an int in [0, 2**64)")
    addresses = (ctypes.c_size_t * count)()
    lengths = (ctypes.c_size_t * count)()
    held: list[_PyBuffer] = []
    copies: list[bytes] = []
    try:
        for index, part in enumerate(parts):
            view = _PyBuffer()
            try:
                _get_buffer(part, ctypes.byref(view), _PYBUF_SIMPLE)
            except BufferError:  # not contiguous: hash a contiguous copy
                copies.append(bytes(memoryview(part)))
                _get_buffer(copies[-1], ctypes.byref(view), _PYBUF_SIMPLE)
            except TypeError:
                raise InvalidArgumentError(
                    f"parts[{index}] is a {type(part).__name__}, which is not valid: expected "
                    "a bytes-like object"
                ) from None
            held.append(view)
            addresses[index] = view.buf or 0
            lengths[index] = view.len
        digest = ctypes.c_uint64()
        status = lib().ucm_checksum(count, addresses, lengths, seed, ctypes.byref(digest))
        assert status == 0, status  # every argument was checked above
        return digest.value
    finally:
        for view in held:
            _release_buffer(ctypes.byref(view))
