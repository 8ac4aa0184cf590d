"""``ucm.native.copy.copy_ranges``: many ranges in one native call (``ucm_copy_ranges``), byte
for byte, and bad ranges refused whole, with nothing copied and the range named."""

from __future__ import annotations

import ctypes
import mmap
import random
from array import array

import pytest

from ucm.errors import InvalidArgumentError
from ucm.native import _abi
from ucm.native.copy import copy_ranges


def _memory(size: int) -> tuple[mmap.mmap, int]:
    memory = mmap.mmap(-1, size)
    return memory, ctypes.addressof(ctypes.c_char.from_buffer(memory))


def test_every_range_is_copied_byte_for_byte() -> None:
    rng = random.Random(5)
    source, source_base = _memory(1 << 20)
    target, target_base = _memory(1 << 20)
    source[:] = rng.randbytes(1 << 20)
    # Scattered ranges of every size class: empty, a few bytes, past the non-temporal bound.
    lengths = [0, 1, 7, 63, 64, 4095, 4096, 70_000]
    sources = [source_base + rng.randrange(0, 500_000) for _ in lengths]
    targets = [target_base + offset for offset in range(0, 8 * 100_000, 100_000)]
    copy_ranges(array("Q", targets), sources, lengths)
    for destination, origin, length in zip(targets, sources, lengths, strict=True):
        at, start = destination - target_base, origin - source_base
        assert target[at : at + length] == source[start : start + length]
    assert target[100_000 + 1 : 200_000] == bytes(100_000 - 1)  # nothing past a range
    copy_ranges([], [], [])


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "overlap",
            "range 1 (destination=0x{t:x}, source=0x{t5:x}, length_bytes=10) is not "
            "valid: the source and destination overlap",
        ),
        (
            "null",
            "range 1 (destination=0x0, source=0x{s:x}, length_bytes=10) is not valid: a "
            "null address with a non-zero length",
        ),
        (
            "wraps",
            "range 1 (destination=0x{w:x}, source=0x{s:x}, length_bytes=10) is not "
            "valid: the range wraps the address space",
        ),
    ],
)
def test_a_bad_range_is_named_and_nothing_is_copied(case: str, message: str) -> None:
    source, s = _memory(4096)
    target, t = _memory(4096)
    source[:] = b"\x01" * 4096
    wrap = 2**64 - 4
    bad = {"overlap": (t, t + 5), "null": (0, s), "wraps": (wrap, s)}[case]
    with pytest.raises(InvalidArgumentError) as raised:
        copy_ranges([t + 100, bad[0]], [s, bad[1]], [10, 10])
    assert str(raised.value) == message.format(t=t, t5=t + 5, s=s, w=wrap)
    assert target[:] == bytes(4096)  # the good first range was not copied either


def test_arguments_of_unequal_length_or_not_addresses_are_refused() -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        copy_ranges([1], [2], [3, 4])
    assert str(raised.value) == (
        "destinations has 1 addresses, sources 1 and lengths_bytes 2, which is not valid: give "
        "one source and one length per destination"
    )
    with pytest.raises(InvalidArgumentError, match=r"not an int in \[0, 2\*\*64\)"):
        copy_ranges([-1], [2], [3])


def test_more_ranges_than_one_call_takes_are_checked_whole_before_any_is_copied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_abi, "COPY_RANGES_MAX", 3)  # 8 ranges: three native calls
    source, s = _memory(4096)
    target, t = _memory(4096)
    source[:] = bytes(range(256)) * 16
    targets = [t + 100 * i for i in range(8)]
    sources = [s + 10 * i for i in range(8)]
    with pytest.raises(InvalidArgumentError, match=r"^range 7 "):
        copy_ranges(targets, [*sources[:7], 0], [10] * 8)
    assert target[:] == bytes(4096)
    copy_ranges(targets, sources, [10] * 8)
    for i in range(8):
        assert target[100 * i : 100 * i + 10] == source[10 * i : 10 * i + 10]
