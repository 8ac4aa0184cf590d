"""The shard envelope: the one header every lower tier stores with each shard, the one checksum
rule, and the one parser.

A lower tier (posix, fsspec, mooncake, a plugin's) keeps a shard as an envelope header plus the
shard's bytes as stored. The header, 48 bytes, little-endian::

    magic "UCME" | u8 version | u8 codec | u16 flags (0) | u64 codec parameters
    u64 length (decoded shard bytes) | u64 stored (payload bytes as stored)
    u64 XXH3-64 of the decoded shard | u64 XXH3-64 of the key (block id, u32 shard index)

Checksum rule: the XXH3-64 (``ucm.native.checksum``) of the *decoded* shard is recorded on
write and compared on every read, so a torn, corrupted or misplaced copy is never data. The key
digest binds the payload to the key it was written for (an object copied or renamed onto another
key's name fails). With the codec ``NONE`` (the only one today) the payload is the shard itself
and ``stored == length``; a codec records its id and its parameters (a level, a dictionary id)
in the header, and the checksum still covers the decoded bytes.

Parsing sorts what it reads into three outcomes:
- an ``Envelope``: a header of this format for this key and geometry; ``verify`` then checks
  the payload;
- ``Foreign``: a shard written in another format (an older UCM's ``UCMPOSX1``/``UCF2``/``UCMK``,
  or a future envelope version): the tier answers a miss and the next dump replaces it;
- ``Corrupt``: bytes that claim to be ours but do not hold up: never data; the tier fails the
  key (not a miss), so the stack repairs it from a tier below.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from .layout import Key
from .native.checksum import checksum

MAGIC = b"UCME"
VERSION = 1
_HEADER = struct.Struct("<4sBBHQQQQQ")
HEADER_BYTES = _HEADER.size
"""Bytes of an envelope header."""
assert HEADER_BYTES == 48

LEGACY_MAGICS: dict[bytes, str] = {
    b"UCMPOSX1": "posix block file (UCMPOSX1)",
    b"UCF2": "fsspec object (UCF2)",
    b"UCMF": "fsspec object (UCMF)",
    b"UCMK": "mooncake object (UCMK)",
}
"""Leading bytes of the formats that tiers wrote before this envelope: they read as misses."""
LEGACY_PREFIX_BYTES = max(len(magic) for magic in LEGACY_MAGICS)
"""Bytes that ``legacy_format`` needs to recognise any of them."""


class Codec(enum.IntEnum):
    """How a payload is stored. Only ``NONE`` exists today; its parameters are 0."""

    NONE = 0


_CODECS = frozenset(int(codec) for codec in Codec)


class EnvelopeError(Exception):
    """A stored shard that is not usable data (see Foreign and Corrupt)."""


class Foreign(EnvelopeError):
    """Written in another format: a miss, replaced by the next dump."""


class Corrupt(EnvelopeError):
    """Damaged (torn, flipped, misplaced): never data, the key fails and is repaired."""


@dataclass(frozen=True, slots=True)
class Envelope:
    """A parsed header."""

    codec: Codec
    codec_params: int
    length: int
    """Decoded shard bytes."""
    stored: int
    """Payload bytes as stored."""
    checksum: int
    """XXH3-64 of the decoded shard."""
    key_digest: int


def key_digest(key: Key) -> int:
    """XXH3-64 of a key: the block id followed by the shard index as a u32."""
    return checksum([key[0], key[1].to_bytes(4, "little")])


def seal(key: Key, shard: Sequence[bytes | bytearray | memoryview]) -> bytes:
    """The header for ``shard`` (its views, in order) stored under ``key`` without a codec."""
    length = sum(memoryview(part).nbytes for part in shard)
    return _HEADER.pack(
        MAGIC, VERSION, Codec.NONE, 0, 0, length, length, checksum(shard), key_digest(key)
    )


def legacy_format(raw: bytes | bytearray | memoryview) -> str | None:
    """The name of the pre-envelope format ``raw`` starts with, or None."""
    head = bytes(memoryview(raw)[:LEGACY_PREFIX_BYTES])
    for magic, name in LEGACY_MAGICS.items():
        if head.startswith(magic):
            return name
    return None


def parse(raw: bytes | bytearray | memoryview, key: Key, length: int) -> Envelope:
    """The envelope at the start of ``raw`` for ``key`` holding a ``length``-byte shard;
    raises Foreign (another format: a miss) or Corrupt (damaged: never data)."""
    view = memoryview(raw).cast("B")
    legacy = legacy_format(view)
    if legacy is not None:
        raise Foreign(f"written in an older format, a {legacy}")
    if view.nbytes < HEADER_BYTES:
        raise Corrupt(f"{view.nbytes} bytes, shorter than a {HEADER_BYTES}-byte envelope")
    magic, version, codec, flags, params, size, stored, digest, keyed = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise Corrupt("not a UCM envelope: bad magic")
    if version != VERSION:
        if version > VERSION:
            raise Foreign(f"envelope version {version}; this UCM reads {VERSION}")
        raise Corrupt(f"bad envelope version {version}")
    if codec not in _CODECS or flags:
        raise Corrupt(f"unknown codec {codec} or flags {flags:#x}")
    if size != length:
        raise Corrupt(f"shard size {size}, expected {length}")
    if codec == Codec.NONE and (stored != size or params):
        raise Corrupt(f"stored size {stored} or parameters {params} invalid without a codec")
    if keyed != key_digest(key):
        raise Corrupt("the envelope names another key")
    return Envelope(Codec(codec), params, size, stored, digest, keyed)


def verify(envelope: Envelope, shard: Sequence[bytes | bytearray | memoryview]) -> None:
    """Raises Corrupt unless the decoded ``shard`` matches the envelope's checksum."""
    if checksum(shard) != envelope.checksum:
        raise Corrupt("checksum mismatch")


def open_object(data: bytes | bytearray | memoryview, key: Key, length: int) -> memoryview:
    """The verified shard of a whole stored object (header followed by payload), for tiers that
    keep one object per shard; raises Foreign or Corrupt."""
    view = memoryview(data).cast("B")
    envelope = parse(view, key, length)
    if view.nbytes != HEADER_BYTES + envelope.stored:
        raise Corrupt(f"{view.nbytes} bytes, expected {HEADER_BYTES + envelope.stored}")
    payload = view[HEADER_BYTES:]
    verify(envelope, [payload])
    return payload


__all__ = [
    "HEADER_BYTES",
    "LEGACY_MAGICS",
    "LEGACY_PREFIX_BYTES",
    "MAGIC",
    "VERSION",
    "Codec",
    "Corrupt",
    "Envelope",
    "EnvelopeError",
    "Foreign",
    "key_digest",
    "legacy_format",
    "open_object",
    "parse",
    "seal",
    "verify",
]
