"""ucm.sizes: byte sizes written the way people write them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ucm.sizes import VALID_SIZE_HINT, format_size, parse_size

BINARY_UNITS = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
DECIMAL_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 1000**2, "MB": 1000**2}
DECIMAL_UNITS |= {"G": 1000**3, "GB": 1000**3, "T": 1000**4, "TB": 1000**4}
ALL_UNITS = BINARY_UNITS | DECIMAL_UNITS


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("8GiB", 8 * 1024**3),
        ("8gib", 8 * 1024**3),
        ("512 MiB", 512 * 1024**2),
        ("  64KiB  ", 64 * 1024),
        ("1.5GB", 1_500_000_000),
        ("1.5KiB", 1536),
        ("2T", 2 * 1000**4),
        ("10b", 10),
        ("500GiB", 500 * 1024**3),
    ],
)
def test_parse_size_accepts(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("8 GiBs", f"invalid size '8 GiBs': expected {VALID_SIZE_HINT}"),
        ("lots", f"invalid size 'lots': expected {VALID_SIZE_HINT}"),
        ("", f"invalid size '': expected {VALID_SIZE_HINT}"),
        ("-5", f"invalid size '-5': expected {VALID_SIZE_HINT}"),
        ("1e9", f"invalid size '1e9': expected {VALID_SIZE_HINT}"),
        ("8 PiB", f"invalid size '8 PiB': expected {VALID_SIZE_HINT}"),
        ("0.5B", "invalid size '0.5B': not a whole number of bytes"),
        ("1.0001KiB", "invalid size '1.0001KiB': not a whole number of bytes"),
        (-1, "invalid size -1: must not be negative"),
        (True, f"invalid size True: expected {VALID_SIZE_HINT}"),
        (1.5, f"invalid size 1.5: expected {VALID_SIZE_HINT}"),
        (None, f"invalid size None: expected {VALID_SIZE_HINT}"),
        ([8], f"invalid size [8]: expected {VALID_SIZE_HINT}"),
    ],
)
def test_parse_size_rejects_with_the_value_named(value: object, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        parse_size(value)
    assert str(excinfo.value) == message


# Kept below 2**53 bytes (8 PiB), where the current float-based parser is exact; larger values
# are covered by test_parse_size_is_exact_beyond_float_precision.
@given(number=st.integers(min_value=0, max_value=2048), unit=st.sampled_from(sorted(ALL_UNITS)))
def test_parse_size_round_trips_integer_amounts(number: int, unit: str) -> None:
    expected = number * ALL_UNITS[unit]
    assert parse_size(f"{number}{unit}") == expected
    assert parse_size(f" {number} {unit.lower()} ") == expected
    assert parse_size(expected) == expected
    assert parse_size(str(expected)) == expected


@given(num_bytes=st.integers(min_value=0, max_value=2**53))
def test_parse_size_round_trips_byte_counts(num_bytes: int) -> None:
    assert parse_size(num_bytes) == num_bytes
    assert parse_size(str(num_bytes)) == num_bytes
    assert parse_size(f"{num_bytes}B") == num_bytes
    if num_bytes % 1024 == 0:
        assert parse_size(f"{num_bytes // 1024}KiB") == num_bytes


@given(garbage=st.text(alphabet=st.characters(exclude_categories=("Nd",)), max_size=20))
def test_parse_size_rejects_text_without_digits_naming_it(garbage: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        parse_size(garbage)
    assert str(excinfo.value) == f"invalid size {garbage!r}: expected {VALID_SIZE_HINT}"


@given(
    number=st.integers(min_value=0, max_value=10**6),
    unit=st.text(alphabet="abcdefghijklmnopqrstuvwxyzIKMGTB", min_size=1, max_size=4).filter(
        lambda unit: unit.lower() not in {u.lower() for u in ALL_UNITS}
    ),
)
def test_parse_size_rejects_unknown_units_naming_the_value(number: int, unit: str) -> None:
    value = f"{number}{unit}"
    with pytest.raises(ValueError) as excinfo:
        parse_size(value)
    assert str(excinfo.value) == f"invalid size {value!r}: expected {VALID_SIZE_HINT}"


# Exact decimal sizes: parse_size computes with Fraction, never through float.
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4.1MB", 4_100_000),
        ("9007199254740993", 2**53 + 1),
        ("12345678901234567B", 12345678901234567),
    ],
)
def test_parse_size_is_exact_beyond_float_precision(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (262144, "256.0 KiB"),
        (1536 * 1024**2, "1.5 GiB"),
        (8 * 1024**3, "8.0 GiB"),
        (3 * 1024**5, "3072.0 TiB"),
    ],
)
def test_format_size(num_bytes: int, text: str) -> None:
    assert format_size(num_bytes) == text
