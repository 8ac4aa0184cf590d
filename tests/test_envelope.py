"""The shard envelope (ucm.envelope): one header, one checksum rule, one parser for every
lower tier. What it accepts, and how it sorts what it refuses into Foreign (a miss) and Corrupt
(never data)."""

from __future__ import annotations

import struct

import pytest

from ucm import envelope
from ucm.native.checksum import checksum

KEY = (bytes(range(16)), 3)
SHARD = bytes(range(256)) * 16


def test_seal_then_open_gives_the_shard_back() -> None:
    header = envelope.seal(KEY, [memoryview(SHARD)[:1000], memoryview(SHARD)[1000:]])
    assert len(header) == envelope.HEADER_BYTES == 48
    assert header[:4] == envelope.MAGIC
    parsed = envelope.parse(header, KEY, len(SHARD))
    assert parsed == envelope.Envelope(
        codec=envelope.Codec.NONE,
        codec_params=0,
        length=len(SHARD),
        stored=len(SHARD),
        checksum=checksum([SHARD]),
        key_digest=envelope.key_digest(KEY),
    )
    assert bytes(envelope.open_object(header + SHARD, KEY, len(SHARD))) == SHARD


def _fields(**changes: int | bytes) -> bytes:
    values: dict[str, int | bytes] = {
        "magic": envelope.MAGIC,
        "version": envelope.VERSION_PLAIN,
        "codec": 0,
        "flags": 0,
        "params": 0,
        "length": len(SHARD),
        "stored": len(SHARD),
        "checksum": checksum([SHARD]),
        "key": envelope.key_digest(KEY),
    }
    values.update(changes)
    return struct.pack("<4sBBHQQQQQ", *values.values())


@pytest.mark.parametrize(
    ("header", "problem"),
    [
        (_fields(magic=b"XXXX"), "not a UCM envelope: bad magic"),
        (_fields(version=0), "bad envelope version 0"),
        (_fields(codec=7), "unknown codec 7"),
        (_fields(flags=1), "unknown flags 0x1"),
        (_fields(length=1), f"shard size 1, expected {len(SHARD)}"),
        (_fields(stored=1), "version 1 or stored size 1 invalid without a codec"),
        (_fields(params=5), "parameters 0x5 without a codec"),
        (_fields(version=2), f"version 2 or stored size {len(SHARD)} invalid without a codec"),
        (_fields(codec=1), f"version 1 or stored size {len(SHARD)} invalid under a codec"),
        (_fields(version=2, codec=1, stored=0), "version 2 or stored size 0 invalid under a codec"),
        (_fields(version=2, codec=1, params=1), "lz4 parameters 0x1"),
        (_fields(version=2, codec=2, stored=9, params=23), "zstd parameters 0x17"),
        (_fields(version=2, codec=3, stored=9, params=4), "fp8 parameters 0x4"),
        (_fields(key=1), "the envelope names another key"),
        (b"UCME", "4 bytes, shorter than a 48-byte envelope"),
    ],
)
def test_damaged_headers_are_corrupt(header: bytes, problem: str) -> None:
    with pytest.raises(envelope.Corrupt) as info:
        envelope.parse(header, KEY, len(SHARD))
    assert str(info.value) == problem


def test_payload_that_does_not_match_is_corrupt() -> None:
    header = envelope.seal(KEY, [SHARD])
    flipped = bytearray(SHARD)
    flipped[100] ^= 1
    with pytest.raises(envelope.Corrupt, match=r"^checksum mismatch$"):
        envelope.open_object(header + flipped, KEY, len(SHARD))
    with pytest.raises(envelope.Corrupt) as info:
        envelope.open_object(header + SHARD[:-10], KEY, len(SHARD))
    assert str(info.value) == f"{48 + len(SHARD) - 10} bytes, expected {48 + len(SHARD)}"
    with pytest.raises(envelope.Corrupt, match=r"^the envelope names another key$"):
        envelope.open_object(header + SHARD, (KEY[0], 4), len(SHARD))


@pytest.mark.parametrize(
    ("old", "name"),
    [
        (struct.pack("<8sIIQ", b"UCMPOSX1", 2, 2, 4096), "posix block file (UCMPOSX1)"),
        (struct.pack("<4sQQ", b"UCF2", checksum([SHARD]), len(SHARD)), "fsspec object (UCF2)"),
        (struct.pack("<4sQQ", b"UCMF", 0, len(SHARD)), "fsspec object (UCMF)"),
        (struct.pack("<4sHHQQQ", b"UCMK", 1, 0, len(SHARD), 0, 0), "mooncake object (UCMK)"),
    ],
)
def test_the_formats_before_the_envelope_are_foreign(old: bytes, name: str) -> None:
    assert envelope.legacy_format(old) == name
    with pytest.raises(envelope.Foreign) as info:
        envelope.open_object(old + SHARD, KEY, len(SHARD))
    assert str(info.value) == f"written in an older format, a {name}"


def test_a_later_envelope_version_is_foreign_not_data() -> None:
    with pytest.raises(envelope.Foreign) as info:
        envelope.parse(_fields(version=envelope.VERSION + 1), KEY, len(SHARD))
    assert str(info.value) == f"envelope version {envelope.VERSION + 1}; this UCM reads up to 2"
    # Newer: a newer UCM's shard, which tiers keep (never deleted, replaced or corrupt).
    assert isinstance(info.value, envelope.Newer)


def test_newer_version_tells_a_newer_ucms_object_from_the_first_bytes() -> None:
    later = _fields(version=envelope.VERSION + 1)
    assert envelope.newer_version(later[: envelope.NEWER_PREFIX_BYTES]) == envelope.VERSION + 1
    assert envelope.newer_version(later + SHARD) == envelope.VERSION + 1
    for other in (
        _fields(),  # this version
        _fields(version=envelope.VERSION),
        _fields(version=0),  # corrupt, not newer
        _fields(magic=b"XXXX", version=envelope.VERSION + 1),
        later[: envelope.NEWER_PREFIX_BYTES - 1],  # too short to tell
        b"",
        b"UCF2" + bytes(20),  # an older format
    ):
        assert envelope.newer_version(other) is None, other
    with pytest.raises(envelope.Foreign) as info:  # an older format is not Newer
        envelope.parse(b"UCF2" + bytes(60), KEY, len(SHARD))
    assert not isinstance(info.value, envelope.Newer)


def test_the_key_digest_covers_block_and_shard() -> None:
    digests = {
        envelope.key_digest((bytes(16), 0)),
        envelope.key_digest((bytes(16), 1)),
        envelope.key_digest((b"\x01" + bytes(15), 0)),
    }
    assert len(digests) == 3
    assert envelope.key_digest(KEY) == checksum([KEY[0] + (3).to_bytes(4, "little")])
