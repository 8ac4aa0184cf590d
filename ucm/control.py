"""Control records kept as files (posix) or objects (fsspec): one directory per record.

A control record (:meth:`ucm.tier.Tier.read_control`) is a name of 16 bytes and a monotonic
maximum. Stored as a directory ``control/<name hex>/`` holding one small file per value ever
raised to, named by the value (20 decimal digits, so names sort as values), the record's value
is the largest valid name there. A raise creates the file of its value (written whole under a
temporary name, synced, renamed: never seen torn) and then drops the files of lower values. No
read-modify-write, so concurrent raisers of one record, in any processes or nodes, need no lock:
the largest file wins, and a file is never rewritten.

Each file holds :data:`RECORD_MAGIC`, the value, the name and a checksum of the three; a file
of the largest value whose content does not match (torn by a crash before the rename was
durable, damaged later) makes the read unanswerable (:class:`~ucm.TierError`), never 0.

``control/`` sits beside the tiers' block directories and is outside every listing, scan,
capacity, quota, eviction, codec and namespace of the tiers.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

from .errors import TierError

CONTROL_DIR = "control"
"""The directory, under a tier's root, of its control records."""
NAME_BYTES = 16
RECORD_MAGIC = b"UCMCTRL1"
_FORMAT = struct.Struct("<8sQ16s8s")
RECORD_BYTES = _FORMAT.size
VALUE_DIGITS = 20
"""A value's file name: its decimal digits, zero-padded (a u64 has at most 20)."""
READ_ATTEMPTS = 8
"""Listings one read takes at most: a raise that drops the file a read was about to open
makes it list again (each retry sees a larger value)."""


def check_name(name: object) -> bytes:
    if not isinstance(name, bytes) or len(name) != NAME_BYTES:
        raise TierError(f"name={name!r} is not valid: a control record's name is 16 bytes")
    return name


def check_value(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**64:
        raise TierError(f"value={value!r} is not valid: a control record's value is a u64")
    return value


def record_dir(name: bytes) -> str:
    """``control/<name hex>``, relative to a tier's root."""
    return f"{CONTROL_DIR}/{check_name(name).hex()}"


def value_file(value: int) -> str:
    return f"{check_value(value):0{VALUE_DIGITS}d}"


def encode(name: bytes, value: int) -> bytes:
    """A record file's content."""
    body = RECORD_MAGIC + struct.pack("<Q", value) + name
    return _FORMAT.pack(RECORD_MAGIC, value, name, _digest(body))


def valid(name: bytes, value: int, data: bytes) -> bool:
    """Whether ``data`` is the whole, undamaged file of value ``value`` of record ``name``."""
    if len(data) != RECORD_BYTES:
        return False
    magic, stored, stored_name, digest = _FORMAT.unpack(data)
    body = magic + struct.pack("<Q", stored) + stored_name
    return bool(
        magic == RECORD_MAGIC
        and stored == value
        and stored_name == name
        and digest == _digest(body)
    )


def values_of(names: list[str]) -> list[int]:
    """The values of a record directory's entries (temporary files and strays left out)."""
    return [int(n) for n in names if len(n) == VALUE_DIGITS and n.isdigit()]


def read(
    name: bytes,
    listing: Callable[[], list[str] | None],
    fetch: Callable[[int], bytes | None],
    where: str,
) -> int | None:
    """The record's value: the largest value file, checked. ``listing()`` gives the record
    directory's entry names (None: no directory, the record was never raised here);
    ``fetch(value)`` that file's bytes (None: gone since the listing). Raises TierError when
    the file of the largest value is damaged."""
    for _ in range(READ_ATTEMPTS):
        entries = listing()
        values = values_of(entries) if entries is not None else []
        if not values:
            return None
        top = max(values)
        data = fetch(top)
        if data is None:  # dropped by a raise past it since the listing: list again
            continue
        if not valid(name, top, data):
            raise TierError(
                f"{where}: control record {name.hex()} value {top}: its file is torn or "
                f"corrupt ({len(data)} bytes); the record cannot be read exactly"
            )
        return top
    raise TierError(
        f"{where}: control record {name.hex()}: its files kept changing under {READ_ATTEMPTS} reads"
    )


def prune(values: list[int], keep: int, remove: Callable[[int], object]) -> None:
    """Drops the value files below ``keep`` (the largest one present after a raise)."""
    for value in values:
        if value < keep:
            remove(value)


def _digest(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=8).digest()
