"""Addresses of Python buffers (``bytes``, ``bytearray``, memoryviews of tensors or slots)
without a copy, through CPython's buffer protocol.

``ctypes.c_char.from_buffer`` refuses read-only buffers (a ``bytes`` snapshot, a read-only view
of a tensor); ``PyObject_GetBuffer`` hands out the pointer of any contiguous buffer. Used by the
checksum binding and by tiers that move bytes natively at their addresses (registered memory).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_PYBUF_SIMPLE = 0


class PyBuffer(ctypes.Structure):
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


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(PyBuffer)]
_release_buffer.restype = None


def get_buffer(obj: Any) -> PyBuffer:
    """Takes a simple (contiguous) buffer of ``obj``; release it with :func:`release_buffer`.
    Raises BufferError for a non-contiguous buffer, TypeError for a non-buffer."""
    view = PyBuffer()
    _get_buffer(obj, ctypes.byref(view), _PYBUF_SIMPLE)
    return view


def release_buffer(view: PyBuffer) -> None:
    _release_buffer(ctypes.byref(view))


@contextmanager
def held(obj: Any) -> Iterator[PyBuffer]:
    """The buffer of ``obj`` for the duration of the block."""
    view = get_buffer(obj)
    try:
        yield view
    finally:
        release_buffer(view)


def buffer_address(obj: Any) -> int:
    """The address of the first byte of a contiguous buffer (0 for an empty one).

    The pointer stays valid as long as the caller keeps ``obj`` (or the memoryview it came
    from) alive and does not resize it: a memoryview pins its exporter's memory."""
    with held(obj) as view:
        return int(view.buf or 0)


def copy_into(destination: Any, offset: int, source: Any) -> int:
    """Copies the contiguous buffer ``source`` into the writable buffer ``destination`` at byte
    ``offset``; returns the bytes copied. The same as ``memoryview(destination)[offset:offset
    + n] = source`` except that the copy runs with the GIL released (``ctypes.memmove`` is a
    foreign call), so a 16 MiB shard written by an I/O thread does not hold up the process's
    other Python threads (the engine's forward pass) for the length of a memcpy."""
    with held(source) as src:
        size = int(src.len)
        target = memoryview(destination)
        if target.readonly:
            raise TypeError("copy_into: destination is read-only")
        if not 0 <= offset <= target.nbytes - size:
            raise ValueError(
                f"copy_into: {size} bytes at offset {offset} do not fit a destination of "
                f"{target.nbytes} bytes"
            )
        if size:
            with held(target) as dst:
                ctypes.memmove(int(dst.buf) + offset, src.buf, size)
        return size
