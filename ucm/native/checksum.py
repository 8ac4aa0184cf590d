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
from .pybuffer import PyBuffer, get_buffer, release_buffer

_MAX_PARTS = 1 << 16  # constants.checksum_parts_max


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
    held: list[PyBuffer] = []
    copies: list[bytes] = []
    try:
        for index, part in enumerate(parts):
            # Read-only buffers (bytes, a read-only view of a tensor) have no ctypes address;
            # the buffer protocol itself hands out the pointer without a copy.
            try:
                view = get_buffer(part)
            except BufferError:  # not contiguous: hash a contiguous copy
                copies.append(bytes(memoryview(part)))
                view = get_buffer(copies[-1])
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
            release_buffer(view)
