"""Cross-process wait/wake on a 32-bit version word in shared memory (seed §3.2).

A waiter reads the version, checks the state it waits for, and blocks only while the version is
unchanged; a writer publishes the state, bumps the version and wakes everyone. See
``core-native/src/futex.zig``.
"""

from __future__ import annotations

from ..errors import InvalidArgumentError
from . import lib


def _check_address(word_address: int) -> None:
    if not isinstance(word_address, int) or word_address <= 0 or word_address % 4:
        raise InvalidArgumentError(
            f"word_address={word_address!r} is not valid: expected the non-zero, 4-byte "
            "aligned address of a 32-bit word in shared memory"
        )


def load(word_address: int) -> int:
    """The current version (acquire)."""
    _check_address(word_address)
    return int(lib().ucm_version_load(word_address))


def wait(word_address: int, expected: int, timeout_s: float) -> bool:
    """Blocks while the word equals ``expected``. Returns True if it changed, False on timeout."""
    _check_address(word_address)
    if not 0 <= expected < 2**32:
        raise InvalidArgumentError(f"expected={expected!r} is not a 32-bit unsigned version")
    if not timeout_s >= 0:
        raise InvalidArgumentError(f"timeout_s={timeout_s!r} must be a number >= 0")
    result = int(lib().ucm_version_wait(word_address, expected, int(timeout_s * 1e9)))
    assert result in (0, 1), result
    return result == 0


def bump(word_address: int) -> int:
    """Increments the version and wakes every waiter; returns the new version."""
    _check_address(word_address)
    return int(lib().ucm_version_bump(word_address))
