"""Byte sizes written the way people write them: ``8GiB``, ``512 MiB``, ``1.5GB``, ``4096``."""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$", re.ASCII)
VALID_SIZE_HINT = "an integer byte count or a string like '64GiB', '512MiB', '4096', '1.5GB'"


def parse_size(value: object) -> int:
    """Returns the number of bytes ``value`` stands for; raises ValueError naming the value."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}: expected {VALID_SIZE_HINT}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid size {value!r}: must not be negative")
        return value
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match:
            number, unit = match.groups()
            multiplier = _UNITS.get(unit.lower())
            if multiplier is not None:
                size = Fraction(number) * multiplier
                if size.denominator != 1:
                    raise ValueError(f"invalid size {value!r}: not a whole number of bytes")
                return int(size)
    raise ValueError(f"invalid size {value!r}: expected {VALID_SIZE_HINT}")


def format_size(num_bytes: int) -> str:
    """Human-readable binary size (``262144`` → ``256.0 KiB``)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
