"""``ucm.native.pybuffer``: addresses of Python buffers and the GIL-free copy the posix tier
uses to build a block's file image."""

from __future__ import annotations

import mmap
import sys
import threading

import pytest

from ucm.native.pybuffer import buffer_address, copy_into


def test_copy_into_places_every_byte_and_leaves_the_rest() -> None:
    image = mmap.mmap(-1, 1 << 20)
    image[:] = b"\xaa" * (1 << 20)
    source = bytes(range(256)) * 1024  # 256 KiB, read-only
    assert copy_into(image, 4096, source) == len(source)
    assert copy_into(image, 4096 + len(source), memoryview(bytearray(b"tail"))) == 4
    assert image[:4096] == b"\xaa" * 4096
    assert image[4096 : 4096 + len(source)] == source
    assert image[4096 + len(source) : 4100 + len(source)] == b"tail"
    assert image[4100 + len(source) :] == b"\xaa" * ((1 << 20) - 4100 - len(source))
    assert copy_into(image, 1 << 20, b"") == 0  # empty at the very end: nothing to do


@pytest.mark.parametrize(
    ("offset", "size", "message"),
    [
        (-1, 8, "copy_into: 8 bytes at offset -1 do not fit a destination of 64 bytes"),
        (57, 8, "copy_into: 8 bytes at offset 57 do not fit a destination of 64 bytes"),
        (0, 65, "copy_into: 65 bytes at offset 0 do not fit a destination of 64 bytes"),
    ],
)
def test_copy_into_refuses_what_does_not_fit(offset: int, size: int, message: str) -> None:
    destination = bytearray(64)
    with pytest.raises(ValueError) as caught:
        copy_into(destination, offset, b"x" * size)
    assert str(caught.value) == message
    assert destination == bytearray(64)


def test_copy_into_refuses_a_read_only_destination() -> None:
    with pytest.raises(TypeError, match="copy_into: destination is read-only"):
        copy_into(b"\0" * 8, 0, b"x")


def test_copy_into_releases_the_gil() -> None:
    # With a 5 s switch interval, a thread that holds the GIL keeps it: another thread woken
    # by an event runs only when the holder releases it. copy_into's memmove does; a slice
    # assignment (what the posix tier did) holds it for the whole copy.
    image = mmap.mmap(-1, 16 << 20)
    source = bytes(16 << 20)
    go = threading.Event()
    ran: list[bool] = []
    released = False

    def other() -> None:
        go.wait(60)
        ran.append(True)

    interval = sys.getswitchinterval()
    thread = threading.Thread(target=other)
    thread.start()
    sys.setswitchinterval(5.0)
    try:
        go.set()
        for _ in range(200):  # bounded: about 1 s of copies, well under the interval
            copy_into(image, 0, source)
            if ran:
                break
        released = bool(ran)  # read before the interval goes back and the join lets it run
    finally:
        sys.setswitchinterval(interval)
        go.set()
        thread.join(60)
    assert released
    assert image[:16] == source[:16]
    assert buffer_address(image) != 0
