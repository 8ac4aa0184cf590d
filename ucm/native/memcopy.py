"""Batched host copies (``core-native/src/memcopy.zig``): every tensor of a task moved in one
native call with the GIL released, instead of one ``ctypes.memmove`` per tensor."""

from __future__ import annotations

import ctypes
from array import array

from ..errors import InvalidArgumentError
from . import lib

ADDRESS_TYPECODE = "Q"
"""``array`` typecode of a ``size_t`` (addresses and lengths) on the 64-bit Linux we support."""
assert array(ADDRESS_TYPECODE).itemsize == ctypes.sizeof(ctypes.c_size_t)
_MAX_RANGES = 1 << 20  # constants.copy_ranges_max
_LIBC_MEMMOVE = ctypes.cast(ctypes.memmove, ctypes.c_void_p).value
"""The C library's memmove, the function ``ctypes.memmove`` calls: the native core copies
through it (tuned per CPU; a few % faster than compiler-rt's memcpy at 256 KiB)."""


def copy_ranges(targets: array[int], sources: array[int], lengths: array[int]) -> None:
    """Copies ``lengths[i]`` bytes from address ``sources[i]`` to ``targets[i]`` for every i.

    The caller vouches that every range is mapped and that no two overlap (a buffer slot and
    the destination tensors of its shard). Arrays use :data:`ADDRESS_TYPECODE`.
    """
    count = len(targets)
    if len(sources) != count or len(lengths) != count:
        raise InvalidArgumentError(
            f"targets, sources and lengths have {count}, {len(sources)} and {len(lengths)} "
            "entries: one of each per range"
        )
    if count > _MAX_RANGES:
        raise InvalidArgumentError(f"{count} ranges is not valid: at most {_MAX_RANGES} per call")
    for name, values in (("targets", targets), ("sources", sources), ("lengths", lengths)):
        if values.typecode != ADDRESS_TYPECODE:
            raise InvalidArgumentError(
                f"{name} has typecode {values.typecode!r}, which is not valid: expected "
                f"array({ADDRESS_TYPECODE!r}, ...) of size_t values"
            )
    if not count:
        return
    status = lib().ucm_copy_ranges(
        count,
        targets.buffer_info()[0],
        sources.buffer_info()[0],
        lengths.buffer_info()[0],
        _LIBC_MEMMOVE,
    )
    if status != 0:
        index = next(i for i in range(count) if lengths[i] and not (targets[i] and sources[i]))
        raise InvalidArgumentError(
            f"range {index} is not valid: {lengths[index]} bytes from {sources[index]:#x} to "
            f"{targets[index]:#x} (a null address)"
        )


class CopyRanges:
    """(target, source, length) byte ranges gathered for one :func:`copy_ranges` call."""

    def __init__(self) -> None:
        self.targets = array(ADDRESS_TYPECODE)
        self.sources = array(ADDRESS_TYPECODE)
        self.lengths = array(ADDRESS_TYPECODE)

    def add(self, target: int, source: int, length: int) -> None:
        self.targets.append(target)
        self.sources.append(source)
        self.lengths.append(length)

    def copy(self) -> None:
        """Copies every range gathered so far (none: no native call)."""
        if self.targets:
            copy_ranges(self.targets, self.sources, self.lengths)
