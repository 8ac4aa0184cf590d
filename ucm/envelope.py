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
key's name fails).

Codecs (``ucm.codecs``: ``none``, ``lz4``, ``zstd`` with a level and a byte shuffle, the lossy
``fp8``). With ``NONE`` the payload is the shard itself and ``stored == length``, and the
header is version 1, the format of the UCMs before codecs, which still read it. A shard stored
under a codec has a version-2 header with the codec's id and parameters and ``stored <
length`` (a codec that does not shrink a shard stores it as ``NONE``); a UCM that predates
codecs reads it as a future version, a miss. Reads decode with the envelope's codec, not the
tier's current one, so changing a tier's ``codec:`` leaves its old shards readable. The
checksum covers the decoded bytes (for ``fp8``, the approximation a load returns), so a
corrupt compressed payload is never data: it fails to decode or fails the checksum.

Parsing sorts what it reads into these outcomes:
- an ``Envelope``: a header of this format for this key and geometry; ``verify`` then checks
  the payload;
- ``Foreign``: a shard written in an older format (an older UCM's ``UCMPOSX1``/``UCF2``/
  ``UCMK``): the tier answers a miss and the next dump replaces it;
- ``Newer`` (a ``Foreign``): a shard of a later envelope version, written by a newer UCM that
  shares the tier (a rolling upgrade, a bucket shared by nodes of several versions). A miss
  here too, but never ours to delete or count as corrupt: it is the newer nodes' data. Tiers
  check an object's first bytes with ``newer_version`` before they delete it (a dump of the
  same key may replace it with this node's version, which the newer UCM still reads);
- ``Corrupt``: bytes that claim to be ours but do not hold up: never data; the tier fails the
  key (not a miss), so the stack repairs it from a tier below.

Stored bytes are untrusted: whoever can write a tier's directory or bucket chooses them. So a
reader allocates by what the caller expects, never by what the bytes claim: ``parse`` checks
every field (the shard length against the layout's, the stored size below it) before anything
is allocated; a tier that reads a whole object reads at most ``read_bytes_max(length)`` (the
largest object a shard has, plus one byte to tell a longer one) and ``open_object`` refuses a
longer one; ``decode`` checks the payload's size against the envelope, and the codec bounds its
output by the shard length (``ucm.codecs.decode``). A hostile object is Corrupt, like damage.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from . import codecs
from .codecs import CodecConfig, CodecError, CodecId
from .layout import Key
from .native.checksum import checksum
from .tier import ShardViews, scatter

MAGIC = b"UCME"
VERSION = 2
"""The newest header version: 1 for shards stored as they are (``NONE``), 2 under a codec."""
VERSION_PLAIN = 1
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


Codec = CodecId
"""How a payload is stored (``ucm.codecs.CodecId``)."""

Buffer = bytes | bytearray | memoryview


class EnvelopeError(Exception):
    """A stored shard that is not usable data (see Foreign and Corrupt)."""


class Foreign(EnvelopeError):
    """Written in another format: a miss, replaced by the next dump."""


class Newer(Foreign):
    """Written by a newer UCM (a later envelope version): a miss that this node never deletes
    or counts corrupt, so a rolling upgrade keeps the new nodes' shards."""


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


def seal(key: Key, shard: Sequence[Buffer]) -> bytes:
    """The header for ``shard`` (its views, in order) stored under ``key`` without a codec."""
    length = sum(memoryview(part).nbytes for part in shard)
    return _HEADER.pack(
        MAGIC, VERSION_PLAIN, Codec.NONE, 0, 0, length, length, checksum(shard), key_digest(key)
    )


@dataclass(frozen=True, slots=True)
class Sealed:
    """A shard ready to store: its header, then its payload (one or more views)."""

    header: bytes
    payload: Sequence[Buffer]
    stored: int
    """Bytes of the payload."""


def encode(key: Key, shard: Sequence[Buffer], codec: CodecConfig | None = None) -> Sealed:
    """``shard`` (its views, in order) encoded for ``key`` under ``codec`` (None: ``none``),
    with its header. Without a codec, or when the codec would not shrink the shard, the
    payload is the shard's own views (no copy). Runs the codec on the calling thread: tiers
    call it from their I/O threads."""
    length = sum(memoryview(part).nbytes for part in shard)
    codec_id, params = codecs.pack(codec) if codec is not None else (CodecId.NONE, 0)
    payload = codecs.encode(codec_id, params, shard, length)
    if payload is None:
        return Sealed(seal(key, shard), shard, length)
    if codec_id == CodecId.FP8:
        # Lossy: the checksum is that of what a load will return.
        digest = checksum([codecs.decode(codec_id, params, payload, length)])
    else:
        digest = checksum(shard)
    stored = memoryview(payload).nbytes
    header = _HEADER.pack(
        MAGIC, VERSION, codec_id, 0, params, length, stored, digest, key_digest(key)
    )
    return Sealed(header, [payload], stored)


def legacy_format(raw: bytes | bytearray | memoryview) -> str | None:
    """The name of the pre-envelope format ``raw`` starts with, or None."""
    head = bytes(memoryview(raw)[:LEGACY_PREFIX_BYTES])
    for magic, name in LEGACY_MAGICS.items():
        if head.startswith(magic):
            return name
    return None


NEWER_PREFIX_BYTES = 5
"""Bytes that ``newer_version`` needs: the magic and the version."""


def newer_version(raw: bytes | bytearray | memoryview) -> int | None:
    """The envelope version of ``raw`` when it starts with a header of a later version than
    this UCM reads (a newer UCM's shard: keep it), else None. Reads only the magic and the
    version, so tiers can check an object's first bytes before they delete it."""
    view = memoryview(raw).cast("B")
    if view.nbytes < NEWER_PREFIX_BYTES or bytes(view[:4]) != MAGIC:
        return None
    version = view[4]
    return int(version) if version > VERSION else None


def object_bytes_max(length: int) -> int:
    """The most bytes a stored object of a ``length``-byte shard holds: a header and the shard
    as it is (a codec's payload is smaller)."""
    return HEADER_BYTES + length


def read_bytes_max(length: int) -> int:
    """The most bytes a tier reads of one object of a ``length``-byte shard: one more than the
    largest object, so ``open_object`` tells a longer (hostile) object from a valid one without
    the tier reading the rest of it."""
    return object_bytes_max(length) + 1


def parse(raw: bytes | bytearray | memoryview, key: Key, length: int) -> Envelope:
    """The envelope at the start of ``raw`` for ``key`` holding a ``length``-byte shard;
    raises Foreign (another format: a miss; Newer for a later envelope version) or Corrupt
    (damaged: never data)."""
    view = memoryview(raw).cast("B")
    legacy = legacy_format(view)
    if legacy is not None:
        raise Foreign(f"written in an older format, a {legacy}")
    if view.nbytes < HEADER_BYTES:
        raise Corrupt(f"{view.nbytes} bytes, shorter than a {HEADER_BYTES}-byte envelope")
    magic, version, codec, flags, params, size, stored, digest, keyed = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise Corrupt("not a UCM envelope: bad magic")
    if version > VERSION:
        raise Newer(f"envelope version {version}; this UCM reads up to {VERSION}")
    if version not in (VERSION_PLAIN, VERSION):
        raise Corrupt(f"bad envelope version {version}")
    if flags:
        raise Corrupt(f"unknown flags {flags:#x}")
    try:
        codecs.check(codec, params)
    except CodecError as exc:
        raise Corrupt(str(exc)) from None
    if size != length:
        raise Corrupt(f"shard size {size}, expected {length}")
    if codec == Codec.NONE:
        if version != VERSION_PLAIN or stored != size:
            raise Corrupt(f"version {version} or stored size {stored} invalid without a codec")
    elif version != VERSION or not 0 < stored < size:
        raise Corrupt(f"version {version} or stored size {stored} invalid under a codec")
    if keyed != key_digest(key):
        raise Corrupt("the envelope names another key")
    return Envelope(Codec(codec), params, size, stored, digest, keyed)


def verify(envelope: Envelope, shard: Sequence[Buffer]) -> None:
    """Raises Corrupt unless the decoded ``shard`` matches the envelope's checksum."""
    if checksum(shard) != envelope.checksum:
        raise Corrupt("checksum mismatch")


def decode(envelope: Envelope, payload: Buffer) -> Buffer:
    """The verified decoded shard of a payload stored under ``envelope`` (the payload itself
    without a codec); raises Corrupt. Runs the codec on the calling thread."""
    view = memoryview(payload).cast("B")
    if view.nbytes != envelope.stored:
        raise Corrupt(f"payload of {view.nbytes} bytes, expected {envelope.stored}")
    try:
        shard = codecs.decode(envelope.codec, envelope.codec_params, view, envelope.length)
    except CodecError as exc:
        raise Corrupt(str(exc)) from None
    verify(envelope, [shard])
    return shard


def decode_into(envelope: Envelope, payload: Buffer, views: ShardViews) -> None:
    """Decodes a payload into the shard's destination views, verified; raises Corrupt (the
    views may then hold anything)."""
    scatter(decode(envelope, payload), views)


def open_object(data: Buffer, key: Key, length: int) -> Buffer:
    """The verified, decoded shard of a whole stored object (header followed by payload), for
    tiers that keep one object per shard; raises Foreign or Corrupt. ``data`` may be the first
    ``read_bytes_max(length)`` bytes of a longer object: it is Corrupt."""
    view = memoryview(data).cast("B")
    envelope = parse(view, key, length)
    if view.nbytes > object_bytes_max(length):
        raise Corrupt(
            f"more than {object_bytes_max(length)} bytes, the most a {length}-byte shard's "
            "object holds"
        )
    if view.nbytes != HEADER_BYTES + envelope.stored:
        raise Corrupt(f"{view.nbytes} bytes, expected {HEADER_BYTES + envelope.stored}")
    return decode(envelope, view[HEADER_BYTES:])


__all__ = [
    "HEADER_BYTES",
    "LEGACY_MAGICS",
    "LEGACY_PREFIX_BYTES",
    "MAGIC",
    "NEWER_PREFIX_BYTES",
    "VERSION",
    "VERSION_PLAIN",
    "Codec",
    "Corrupt",
    "Envelope",
    "EnvelopeError",
    "Foreign",
    "Newer",
    "Sealed",
    "decode",
    "decode_into",
    "encode",
    "key_digest",
    "legacy_format",
    "newer_version",
    "object_bytes_max",
    "open_object",
    "parse",
    "read_bytes_max",
    "seal",
    "verify",
]
