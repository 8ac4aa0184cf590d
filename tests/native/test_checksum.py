"""ucm.native.checksum: XXH3-64 streamed over a shard's views by the native core."""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ucm.errors import InvalidArgumentError
from ucm.native.checksum import checksum


def test_reference_vectors() -> None:
    # xxhsum -H3 (XXH3_64bits, seed 0) of "" and of "abc".
    assert checksum([]) == 0x2D06800538D394C2
    assert checksum([b""]) == 0x2D06800538D394C2
    assert checksum([b"abc"]) == 0x78AF5F94892F3950


@given(st.binary(max_size=5000), st.lists(st.integers(0, 5000), max_size=4))
def test_views_hash_like_their_concatenation(data: bytes, cuts: list[int]) -> None:
    bounds = sorted({0, len(data), *(min(cut, len(data)) for cut in cuts)})
    view = memoryview(data)
    parts = [view[a:b] for a, b in itertools.pairwise(bounds)]
    assert checksum(parts) == checksum([data])


def test_any_buffer_kind_and_seed() -> None:
    data = os.urandom(1 << 16)
    writable = bytearray(data)
    expected = checksum([data])
    assert checksum([writable]) == expected
    assert checksum([memoryview(writable)]) == expected
    assert checksum([memoryview(data).toreadonly()]) == expected
    # Not contiguous: hashed as its contiguous bytes.
    assert checksum([memoryview(writable)[::2]]) == checksum([data[::2]])
    assert checksum([data], seed=1) != expected


def test_a_flipped_bit_changes_the_digest() -> None:
    data = bytearray(os.urandom(256 * 1024))
    clean = checksum([data])
    data[123_456] ^= 0x10
    assert checksum([data]) != clean


def test_bad_input_is_named() -> None:
    with pytest.raises(InvalidArgumentError, match=r"parts\[1\] is a int, which is not valid"):
        checksum([b"x", 3])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match=r"seed=-1 is not valid"):
        checksum([b"x"], seed=-1)
    with pytest.raises(InvalidArgumentError, match="at most 65536 per checksum"):
        checksum([b""] * 65537)
