"""ucm.native.memcopy: the copier's batched slot -> tensor copies."""

from __future__ import annotations

import ctypes
import os
from array import array

import pytest

from ucm.errors import InvalidArgumentError
from ucm.native.memcopy import ADDRESS_TYPECODE, CopyRanges, copy_ranges


def _address(buffer: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))


def test_every_range_lands_byte_exact_and_nothing_else_is_written() -> None:
    source = bytearray(os.urandom(1 << 20))
    target = bytearray(b"\xee" * (1 << 20))
    s, t = _address(source), _address(target)
    # Three tensors of one shard, written out of order into a destination with gaps.
    ranges = [(t + 700_000, s, 300_000), (t, s + 300_000, 1), (t + 10, s + 300_001, 0)]
    copy_ranges(*(array(ADDRESS_TYPECODE, column) for column in zip(*ranges, strict=True)))
    assert target[700_000:1_000_000] == source[:300_000]
    assert target[0:1] == source[300_000:300_001]
    untouched = target[1:700_000] + target[1_000_000:]
    assert untouched == b"\xee" * len(untouched)


def test_no_ranges_is_a_no_op() -> None:
    empty = array(ADDRESS_TYPECODE)
    copy_ranges(empty, empty, empty)


def test_bad_arguments_are_named_and_nothing_is_copied() -> None:
    target = bytearray(4)
    good = array(ADDRESS_TYPECODE, [_address(target)])
    four = array(ADDRESS_TYPECODE, [4])
    with pytest.raises(InvalidArgumentError, match="have 1, 2 and 1 entries"):
        copy_ranges(good, array(ADDRESS_TYPECODE, [1, 2]), four)
    with pytest.raises(InvalidArgumentError, match="sources has typecode 'i', which is not valid"):
        copy_ranges(good, array("i", [1]), four)
    source = bytearray(b"abcd")
    with pytest.raises(InvalidArgumentError, match=r"range 1 is not valid: 4 bytes from 0x0"):
        copy_ranges(
            array(ADDRESS_TYPECODE, [_address(target), _address(target)]),
            array(ADDRESS_TYPECODE, [_address(source), 0]),
            array(ADDRESS_TYPECODE, [4, 4]),
        )
    assert target == bytearray(4)  # checked before any copy


def test_copy_ranges_gathered_one_by_one_land_byte_exact() -> None:
    source = bytearray(b"abcdefgh")
    target = bytearray(8)
    ranges = CopyRanges()
    ranges.copy()  # nothing gathered: no call, no error
    ranges.add(_address(target) + 4, _address(source), 4)
    ranges.add(_address(target), _address(source) + 4, 4)
    ranges.copy()
    assert target == b"efghabcd"
