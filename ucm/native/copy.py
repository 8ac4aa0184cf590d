"""Copies of many caller memory ranges in one native call (``ucm_copy_ranges``), with the GIL
released once for all of them.

One ``ctypes.memmove`` per range releases the GIL and then waits to take it back after every
range. While another Python thread runs (an engine's scheduler loop, its forward pass's glue),
each of those waits can last a whole switch interval (5 ms), so a copy of a load's blocks,
one range per block per layer, took tens of milliseconds for a few kilobytes. Used wherever
an engine's memory is copied to or from staging memory: vLLM's direct loads and its saves
without a CacheBuffer, and the bounded loads of SGLang and LMCache.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from ..errors import InvalidArgumentError
from . import _abi, lib

_ITEM_BYTES = 8  # array('Q')


def copy_ranges(
    destinations: Sequence[int], sources: Sequence[int], lengths_bytes: Sequence[int]
) -> None:
    """Copies ``lengths_bytes[i]`` bytes from address ``sources[i]`` to address
    ``destinations[i]`` for every i, in order. The caller owns both sides of every range (they
    are raw addresses: nothing here can check that they are mapped). Raises
    :class:`~ucm.errors.InvalidArgumentError`, having copied nothing, for sequences of unequal
    length, or a range that is null, wraps the address space, or overlaps itself."""
    count = len(destinations)
    if not count == len(sources) == len(lengths_bytes):
        raise InvalidArgumentError(
            f"destinations has {count} addresses, sources {len(sources)} and lengths_bytes "
            f"{len(lengths_bytes)}, which is not valid: give one source and one length per "
            "destination"
        )
    if count == 0:
        return
    try:
        columns = [_as_array(destinations), _as_array(sources), _as_array(lengths_bytes)]
    except (OverflowError, TypeError) as exc:
        raise InvalidArgumentError(
            f"copy_ranges: an address or length is not an int in [0, 2**64): {exc}"
        ) from None
    bases = [column.buffer_info()[0] for column in columns]
    step = _abi.COPY_RANGES_MAX
    if count > step:  # over several native calls: checked whole first, so none copies a part
        _check(columns, 0, count)
    for start in range(0, count, step):
        n = min(count, start + step) - start
        offset = start * _ITEM_BYTES
        # The native call checks its ranges before it copies any (nothing copied on an error).
        if lib().ucm_copy_ranges(n, *(base + offset for base in bases)) != 0:
            _check(columns, start, start + n)
            raise AssertionError("ucm_copy_ranges refused ranges that pass the same checks")


def _as_array(values: Sequence[int]) -> array[int]:
    if isinstance(values, array) and values.typecode == "Q":
        return values
    return array("Q", values)


def _check(columns: list[array[int]], start: int, end: int) -> None:
    destinations, sources, lengths_bytes = columns
    for i in range(start, end):
        destination, source, length = destinations[i], sources[i], lengths_bytes[i]
        if length == 0:
            continue
        if destination == 0 or source == 0:
            reason = "a null address with a non-zero length"
        elif max(destination, source) + length >= 2**64:  # as the native check: no end past it
            reason = "the range wraps the address space"
        elif destination < source + length and source < destination + length:
            reason = "the source and destination overlap"
        else:
            continue
        raise InvalidArgumentError(
            f"range {i} (destination=0x{destination:x}, source=0x{source:x}, "
            f"length_bytes={length}) is not valid: {reason}"
        )


__all__ = ["copy_ranges"]
