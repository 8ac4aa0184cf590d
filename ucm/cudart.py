"""Batched CUDA copies for UCM's CUDA paths: ``cudaMemcpyBatchAsync`` of the CUDA runtime that
torch loaded, one call for many (destination, source, size) triples.

A vLLM block is one tensor per layer (32 to 80 of them), so a CUDA load or save is thousands of
small copies. Queued one by one (torch's ``copy_``, ``torch._foreach_copy_`` or
``cudaMemcpyAsync`` through ctypes alike) each costs about 3.7 us to launch: 16,384 copies of
64 KiB moved 17 GB/s on an H200; in batches of 2,048, 52 GB/s, against 55 GB/s for one copy of
the same 1 GiB (docs/benchmarks.md, "CUDA paths").

:func:`batch_copier` finds the runtime in the process's mappings (the ``libcudart`` torch
loaded, never another one) and returns None where there is none or where it is older than
CUDA 13.0: CUDA 12.8 has the same function with another signature, and only 13.0's was run
here. Callers then copy tensor by tensor. Imported only by the CUDA paths: ``import ucm``
never loads CUDA.
"""

from __future__ import annotations

import ctypes
import threading
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from .errors import TierError

BATCH_COPIES_MAX = 4096
"""Copies per ``cudaMemcpyBatchAsync`` call: a task's copies are cut into calls of at most this
many."""
RUNTIME_VERSION_MIN = 13000
"""The least CUDA runtime whose ``cudaMemcpyBatchAsync`` signature this module calls."""
_ACCESS_ORDER_STREAM = 1
"""``cudaMemcpySrcAccessOrderStream``: the sources are read in stream order."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    """``cudaMemcpyAttributes``: access order, source and destination location hints (none),
    flags."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_location_hint", _Location),
        ("dst_location_hint", _Location),
        ("flags", ctypes.c_uint),
    ]


class BatchCopier:
    """Queues copies on a stream, :data:`BATCH_COPIES_MAX` per runtime call. ``function`` is
    the runtime's ``cudaMemcpyBatchAsync`` (CUDA 13 signature: destinations, sources, sizes,
    count, attributes, attribute indexes, attribute count, stream)."""

    def __init__(self, function: Callable[..., int]) -> None:
        self._function = function
        self._attributes = _Attributes(_ACCESS_ORDER_STREAM, _Location(0, 0), _Location(0, 0), 0)
        self._indexes = (ctypes.c_size_t * 1)(0)

    def copy(
        self, targets: Sequence[int], sources: Sequence[int], sizes: Sequence[int], stream: int
    ) -> None:
        """Queues ``sizes[i]`` bytes from ``sources[i]`` to ``targets[i]`` for every i on
        ``stream`` (device or pinned host addresses, in any direction); raises
        :class:`~ucm.errors.TierError` naming the runtime's error code."""
        count = len(targets)
        if len(sources) != count or len(sizes) != count:
            raise ValueError(
                f"{count} targets, {len(sources)} sources and {len(sizes)} sizes: one of each "
                "per copy"
            )
        packed_targets = array("Q", targets)
        packed_sources = array("Q", sources)
        packed_sizes = array("Q", sizes)
        item = packed_targets.itemsize
        target_base = packed_targets.buffer_info()[0]
        source_base = packed_sources.buffer_info()[0]
        size_base = packed_sizes.buffer_info()[0]
        for start in range(0, count, BATCH_COPIES_MAX):
            n = min(BATCH_COPIES_MAX, count - start)
            error = self._function(
                ctypes.c_void_p(target_base + start * item),
                ctypes.c_void_p(source_base + start * item),
                ctypes.c_void_p(size_base + start * item),
                ctypes.c_size_t(n),
                ctypes.byref(self._attributes),
                self._indexes,
                ctypes.c_size_t(1),
                ctypes.c_void_p(stream),
            )
            if error:
                raise TierError(
                    f"cudaMemcpyBatchAsync of {n} copies failed with CUDA error {error}"
                )


_COPIER: list[BatchCopier | None] = []
_COPIER_LOCK = threading.Lock()


def _mapped_runtime() -> str | None:
    """The path of the ``libcudart`` mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if "/libcudart.so" in path:
                    return path
    except OSError:
        return None
    return None


def batch_copier() -> BatchCopier | None:
    """The process's :class:`BatchCopier` over the CUDA runtime torch loaded, made on first use;
    None without one of CUDA 13.0 or later (callers copy tensor by tensor)."""
    with _COPIER_LOCK:
        if not _COPIER:
            _COPIER.append(_load())
        return _COPIER[0]


def _load() -> BatchCopier | None:
    path = _mapped_runtime()
    if path is None:
        return None
    try:
        runtime: Any = ctypes.CDLL(path)
        version = ctypes.c_int()
        if runtime.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
            return None
        if version.value < RUNTIME_VERSION_MIN:
            return None
        function = runtime.cudaMemcpyBatchAsync
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_int
    return BatchCopier(function)


__all__ = ["BATCH_COPIES_MAX", "RUNTIME_VERSION_MIN", "BatchCopier", "batch_copier"]
