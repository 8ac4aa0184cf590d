"""Stored bytes are untrusted: whoever can write a tier's directory or bucket must not be able to
exhaust a reader's memory, crash it or make it serve wrong bytes.

- A zstd frame of 32 KiB that declares (and really decodes to) 1 GiB, stored under a valid key
  and a valid envelope in a posix and an fsspec tier, loads through a Store as the failed key of
  a corrupt shard, and the reader's peak RSS (measured in a child process, so nothing else
  counts) grows far less than the declared size; so does an fsspec object that is 1 GiB long.
- A hypothesis fuzzer feeds the read path of every built-in tier (posix, fsspec on file:// and
  memory://, mooncake where it is installed) corrupted, truncated, oversized and hostile
  objects: valid envelopes with bad fields, wrong codec ids, bad checksums, frames declaring
  huge sizes, random bytes, empty objects, objects longer than declared. Each is a miss (the
  load fails that key, no exception escapes), and another key is served byte-exact every time.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucm
from ucm import codecs, envelope
from ucm.errors import KeyMissingError, TierError
from ucm.layout import Layout
from ucm.native.checksum import checksum
from ucm.testing import make_context

GiB = 1 << 30
HEADER = struct.Struct("<4sBBHQQQQQ")
"""The envelope header (ucm.envelope): magic, version, codec, flags, params, length, stored,
checksum, key digest."""
assert HEADER.size == envelope.HEADER_BYTES
ZSTD_MAGIC = 0xFD2FB528
ZSTD_BLOCK_MAX = 128 * 1024
ZSTD_LEVEL3 = codecs.pack(codecs.ZstdCodec(level=3))[1]


def zstd_rle_frame(declared: int | None, content: int | None = None, fill: int = 0) -> bytes:
    """A zstd frame whose header declares ``declared`` content bytes, then RLE blocks (4 bytes
    per 128 KiB) of ``content`` bytes of ``fill`` (``declared`` by default): the frame of
    ``declared=1 GiB`` is 32 KiB and really decodes to 1 GiB. ``declared=None``: a frame that
    declares no content size."""
    if declared is None:
        out = bytearray(struct.pack("<I", ZSTD_MAGIC)) + bytes([0x00, 0x58])  # window 128 MiB
    else:
        # Frame header descriptor 0xE0: 8-byte content size, single segment.
        out = bytearray(struct.pack("<IBQ", ZSTD_MAGIC, 0xE0, declared))
    remaining = declared if content is None else content
    assert remaining is not None and remaining > 0
    while remaining:
        size = min(ZSTD_BLOCK_MAX, remaining)
        remaining -= size
        last = 0 if remaining else 1
        out += struct.pack("<I", last | (1 << 1) | (size << 3))[:3] + bytes([fill])
    return bytes(out)


def header(
    key: tuple[bytes, int],
    codec: int,
    params: int,
    length: int,
    stored: int,
    digest: int,
    version: int = envelope.VERSION,
) -> bytes:
    return HEADER.pack(
        envelope.MAGIC, version, codec, 0, params, length, stored, digest, envelope.key_digest(key)
    )


def block(n: int) -> bytes:
    return n.to_bytes(16, "big")


# ------------------------------------------------------------------- memory of one reader

READER = r"""
import ctypes, json, resource, sys
import ucm

config = json.loads(sys.argv[1])
block_id = bytes.fromhex(sys.argv[2])

def peak_kib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

with ucm.open(config) as store:
    memory = ctypes.create_string_buffer(store.layout.shard_size)
    before = peak_kib()
    try:
        store.wait(store.load_data([block_id], 0, [[ctypes.addressof(memory)]]))
        error = None
    except ucm.TaskError as exc:
        error = str(exc)
    grown = peak_kib() - before
print(json.dumps({"grown_kib": grown, "error": error}))
"""

RSS_SHARD = 65536
"""A shard larger than the 32 KiB frame that decodes to 1 GiB, so its envelope is valid."""


def read_in_child(config: dict[str, Any], block_id: bytes) -> tuple[int, str | None]:
    """Loads shard 0 of ``block_id`` through a Store in a fresh process; returns how much its
    peak RSS grew during the load (KiB) and the TaskError's message (None: loaded)."""
    completed = subprocess.run(
        [sys.executable, "-c", READER, json.dumps(config), block_id.hex()],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert completed.returncode == 0, (completed.returncode, completed.stderr[-3000:])
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    return int(result["grown_kib"]), result["error"]


def plant_posix(tier: Any, key: tuple[bytes, int], head: bytes, payload: bytes) -> None:
    """Stores ``payload`` under ``head`` (48 bytes) as the shard's envelope, through the posix
    tier's own file writer, as any writer of the directory could."""
    assert len(head) == envelope.HEADER_BYTES and len(payload) <= tier.shard_size
    sealed = envelope.Sealed(head, [payload], len(payload))
    with tier._write_locks(key[0]):
        tier._rewrite_locked(key[0], None, new={key[1]: sealed})


def plant_fsspec(tier: Any, key: tuple[bytes, int], data: bytes) -> str:
    path: str = tier.object_path(key)
    tier.fs.makedirs(tier.block_dir(key[0]), exist_ok=True)
    tier.fs.pipe_file(path, data)
    return path


def rss_config(kind: str, tmp_path: Path) -> dict[str, Any]:
    tier: dict[str, Any] = (
        {"type": "posix", "path": str(tmp_path / "nvme"), "codec": "zstd"}
        if kind == "posix"
        else {"type": "fsspec", "url": f"file://{tmp_path / 'bucket'}", "codec": "zstd"}
    )
    return {
        "unique_id": f"hostile-{uuid.uuid4().hex[:8]}",
        "shard_size": RSS_SHARD,
        "shards_per_block": 1,
        "tiers": [tier],
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["posix", "fsspec"])
def test_a_zstd_frame_declaring_1_gib_is_a_miss_without_the_memory(
    tmp_path: Path, kind: str
) -> None:
    key = (block(7), 0)
    frame = zstd_rle_frame(GiB)
    assert len(frame) < 33 * 1024
    head = header(key, codecs.CodecId.ZSTD, ZSTD_LEVEL3, RSS_SHARD, len(frame), 0)
    config = rss_config(kind, tmp_path)
    with ucm.open(config) as store:
        tier = store.tiers[0]
        if kind == "posix":
            plant_posix(tier, key, head, frame)
        else:
            plant_fsspec(tier, key, head + frame)
    grown_kib, error = read_in_child(config, key[0])
    assert grown_kib < 64 * 1024, f"the reader's peak RSS grew by {grown_kib} KiB"
    why = f"zstd frame declares {GiB} bytes, expected {RSS_SHARD}"
    assert error == (
        f"1 key(s) failed: block {key[0].hex()} shard 0: TierError: {kind} tier {kind!r}: "
        f"block {key[0].hex()} shard 0 is corrupt "
        + (f"({why}; it was removed)" if kind == "posix" else f"({why}); it was removed")
    ), error


@pytest.mark.timeout(300)
def test_an_fsspec_object_1_gib_long_is_a_miss_without_the_memory(tmp_path: Path) -> None:
    """A valid envelope followed by 1 GiB (a sparse file: nothing to write): the reader reads
    no more than the largest object a shard can have, plus one byte to see it is longer."""
    key = (block(8), 0)
    shard = bytes(range(256)) * (RSS_SHARD // 256)
    config = rss_config("fsspec", tmp_path)
    with ucm.open(config) as store:
        tier = store.tiers[0]
        path = plant_fsspec(tier, key, envelope.seal(key, [shard]) + shard)
    os.truncate(path, GiB)
    grown_kib, error = read_in_child(config, key[0])
    assert grown_kib < 64 * 1024, f"the reader's peak RSS grew by {grown_kib} KiB"
    assert error == (
        f"1 key(s) failed: block {key[0].hex()} shard 0: TierError: fsspec tier 'fsspec': "
        f"block {key[0].hex()} shard 0 is corrupt (more than "
        f"{envelope.HEADER_BYTES + RSS_SHARD} bytes, the most a {RSS_SHARD}-byte shard's "
        "object holds); it was removed"
    ), error


# ------------------------------------------------------------------------------- the fuzzer

SHARD = 8192
HOSTILE_KEY = (block(1), 0)
GOOD_KEYS = [(block(2), 0), (block(3), 0)]
ENCODINGS: dict[str, Any] = {
    "lz4": codecs.Lz4Codec(),
    "zstd": codecs.ZstdCodec(level=3),
    "zstd-shuffle2": codecs.ZstdCodec(level=1, shuffle=2),
    "fp8": codecs.Fp8Codec(source_dtype="float16", block_elements=64),
}


FP8_BLOCKS = SHARD // 2 // ENCODINGS["fp8"].block_elements
"""Scales (float32) at the head of an fp8 payload of a float16 shard."""


def kv(seed: int) -> bytes:
    """float16 values, each repeated 8 times: every codec shrinks it, fp8 included."""
    values = np.random.default_rng(seed).standard_normal(SHARD // 16).astype(np.float16)
    return np.repeat(values, 8).tobytes()


SHARD_DATA = kv(1)
GOOD_DATA = [kv(2), kv(3)]


def valid_objects() -> dict[str, tuple[tuple[Any, ...], bytes]]:
    """The header fields and payload of the hostile key's shard under each codec."""
    out = {}
    for name, codec in ENCODINGS.items():
        sealed = envelope.encode(HOSTILE_KEY, [SHARD_DATA], codec)
        assert sealed.stored < SHARD, name
        out[name] = (HEADER.unpack(sealed.header), b"".join(bytes(p) for p in sealed.payload))
    return out


VALID = valid_objects()

# A hostile object is ("envelope", header, payload): a 48-byte header and a payload stored as
# a shard's envelope and payload; or ("raw", kind, ...): the whole stored thing (an fsspec or
# mooncake object, a posix block file) replaced, cut or grown.

FIELD_RANGES = [(0, 255), (0, 255), (0, 0xFFFF)] + [(0, 2**64 - 1)] * 5
"""version, codec, flags, then params, length, stored, checksum, key digest (fields 1-8)."""


@st.composite
def bad_field(draw: st.DrawFn) -> tuple[str, bytes, bytes]:
    """A valid envelope with one field changed to a value that must not read as data."""
    fields, payload = VALID[draw(st.sampled_from(sorted(VALID)))]
    index = draw(st.integers(0, 8))
    new = list(fields)
    if index == 0:
        new[0] = draw(st.binary(min_size=4, max_size=4).filter(lambda m: m != envelope.MAGIC))
    elif index == 4:
        # A zstd frame decodes at any level: its other bits (the shuffle) are changed. lz4
        # has no parameters, and every bit of fp8's (dtype, block) changes what decodes.
        shift = 32 if fields[2] == codecs.CodecId.ZSTD else 0
        new[4] = fields[4] ^ (draw(st.integers(1, 2 ** (64 - shift) - 1)) << shift)
    else:
        low, high = FIELD_RANGES[index - 1]
        new[index] = draw(st.integers(low, high).filter(lambda v: v != fields[index]))
    return "envelope", HEADER.pack(*new), payload


@st.composite
def bad_payload(draw: st.DrawFn) -> tuple[str, bytes, bytes]:
    """A valid header over a payload flipped, cut (the header's stored size kept, or made to
    match) or grown (the stored size made to match: bytes after a payload's stored size are
    the ``raw`` objects' growth)."""
    name = draw(st.sampled_from(sorted(VALID)))
    fields, payload = VALID[name]
    how = draw(st.sampled_from(["flip", "cut", "grow"]))
    if how == "flip":
        # fp8 is lossy: a bit of a float32 scale can change nothing that survives the rounding
        # to float16, so the decoded shard (what the checksum covers) is the same. Its e4m3
        # codes are flipped instead: every code decodes to another value.
        first = 4 * FP8_BLOCKS if name == "fp8" else 0
        position = draw(st.integers(first, len(payload) - 1))
        damaged = bytearray(payload)
        damaged[position] ^= draw(st.integers(1, 255))
        new = bytes(damaged)
    elif how == "cut":
        new = payload[: draw(st.integers(0, len(payload) - 1))]
    else:
        new = payload + draw(st.binary(min_size=1, max_size=64))
    stored = len(new) if how == "grow" or draw(st.booleans()) else fields[6]
    return "envelope", HEADER.pack(*fields[:6], stored, *fields[7:]), new


def _hostile_payloads() -> list[tuple[int, int, bytes]]:
    """(codec, params, payload): frames and blocks that claim, or decode to, other sizes."""
    import lz4.block

    fp8 = codecs.pack(ENCODINGS["fp8"])[1]
    out: list[tuple[int, int, bytes]] = []
    for declared in (1, SHARD - 1, SHARD + 1, 2 * SHARD, GiB, 2**40, 2**64 - 1):
        out.append((codecs.CodecId.ZSTD, ZSTD_LEVEL3, zstd_rle_frame(declared, SHARD)))
        out.append((codecs.CodecId.ZSTD, ZSTD_LEVEL3, zstd_rle_frame(declared, 1)))
    # No declared size, decoding to more or less than the shard.
    out.append((codecs.CodecId.ZSTD, ZSTD_LEVEL3, zstd_rle_frame(None, 64 * SHARD)))
    out.append((codecs.CodecId.ZSTD, ZSTD_LEVEL3, zstd_rle_frame(None, SHARD - 1)))
    # Two frames, each of the shard's size.
    out.append((codecs.CodecId.ZSTD, ZSTD_LEVEL3, zstd_rle_frame(SHARD) * 2))
    # lz4: a block of 64 shards' worth, one with an lz4 size prefix claiming 1 GiB.
    out.append((codecs.CodecId.LZ4, 0, lz4.block.compress(bytes(64 * SHARD), store_size=False)))
    out.append((codecs.CodecId.LZ4, 0, struct.pack("<I", GiB) + lz4.block.compress(bytes(64))))
    # fp8: one byte short and one byte over its size.
    right = 4 * FP8_BLOCKS + SHARD // 2
    out.append((codecs.CodecId.FP8, fp8, bytes(right - 1)))
    out.append(
        (codecs.CodecId.FP8, fp8, bytes(range(256)) * (right // 256) + bytes(right % 256 + 1))
    )
    return out


HOSTILE = _hostile_payloads()


@st.composite
def hostile_payload(draw: st.DrawFn) -> tuple[str, bytes, bytes]:
    codec, params, payload = draw(st.sampled_from(HOSTILE))
    digest = checksum([SHARD_DATA]) if draw(st.booleans()) else checksum([bytes(SHARD)])
    stored = len(payload) if draw(st.booleans()) else draw(st.integers(1, SHARD - 1))
    return "envelope", header(HOSTILE_KEY, codec, params, SHARD, stored, digest), payload


raw_objects = st.one_of(
    st.tuples(st.just("raw"), st.just("random"), st.binary(max_size=SHARD + 256)),
    st.just(("raw", "empty", b"")),
    st.tuples(st.just("raw"), st.just("cut"), st.sampled_from(sorted(VALID)), st.floats(0, 1)),
    st.tuples(
        st.just("raw"),
        st.just("grow"),
        st.sampled_from(sorted(VALID)),
        st.binary(min_size=1, max_size=256),
    ),
)
hostile_objects = st.one_of(
    bad_field(),
    bad_payload(),
    hostile_payload(),
    st.tuples(
        st.just("envelope"),
        st.binary(min_size=envelope.HEADER_BYTES, max_size=envelope.HEADER_BYTES),
        st.binary(max_size=SHARD),
    ),
    raw_objects,
)


class Target:
    """One tier's read path, with the means to store any bytes under the hostile key."""

    def __init__(self, tier: Any) -> None:
        self.tier = tier

    def store_envelope(self, head: bytes, payload: bytes) -> None:
        raise NotImplementedError

    def valid_raw(self, name: str) -> bytes:
        """The whole stored thing of the hostile key under a valid envelope of ``name``."""
        raise NotImplementedError

    def cut_max(self, raw: bytes) -> int:
        """Cutting a stored thing at any length up to this loses data the reader needs."""
        return len(raw) - 1

    def grows(self) -> bool:
        """Whether bytes past the end of a stored thing are past its declared size."""
        return True

    def store_raw(self, data: bytes) -> None:
        raise NotImplementedError

    def load(self, keys: list[tuple[bytes, int]]) -> tuple[list[Any], list[bytes]]:
        buffers = [bytearray(SHARD) for _ in keys]
        outcomes = self.tier.load(keys, [[memoryview(b)] for b in buffers])
        return outcomes, [bytes(b) for b in buffers]


class PosixTarget(Target):
    def store_envelope(self, head: bytes, payload: bytes) -> None:
        plant_posix(self.tier, HOSTILE_KEY, head, payload[:SHARD])

    def valid_raw(self, name: str) -> bytes:
        fields, payload = VALID[name]
        self.store_envelope(HEADER.pack(*fields), payload)
        return Path(self.tier.block_path(HOSTILE_KEY[0])).read_bytes()

    def cut_max(self, raw: bytes) -> int:
        # The footer (at block_size) is what a reader needs; a copy of its head ends the file.
        return int(self.tier.block_size + self.tier.footer_len - 1)

    def grows(self) -> bool:
        return False  # the footer is at a fixed place: bytes after the file's end are unread

    def store_raw(self, data: bytes) -> None:
        path = self.tier.block_path(HOSTILE_KEY[0])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = path + ".hostile"
        Path(temp).write_bytes(data)
        os.replace(temp, path)


class FsspecTarget(Target):
    def store_envelope(self, head: bytes, payload: bytes) -> None:
        self.store_raw(head + payload)

    def valid_raw(self, name: str) -> bytes:
        fields, payload = VALID[name]
        return HEADER.pack(*fields) + payload

    def store_raw(self, data: bytes) -> None:
        plant_fsspec(self.tier, HOSTILE_KEY, data)


class MooncakeTarget(Target):
    def store_envelope(self, head: bytes, payload: bytes) -> None:
        self.store_raw(head + payload)

    def valid_raw(self, name: str) -> bytes:
        fields, payload = VALID[name]
        return HEADER.pack(*fields) + payload

    def store_raw(self, data: bytes) -> None:
        name = self.tier.object_name(HOSTILE_KEY)
        self.tier.client.batch_remove([name], True)
        if data:  # Mooncake holds no empty object: an absent one is the empty case here
            assert self.tier.client.put(name, data) == 0


FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def fuzz_read_path(target: Target) -> None:
    """Every hostile object under one key is a miss of that key; the good keys beside it are
    served byte-exact every time."""
    views = [[memoryview(d)] for d in GOOD_DATA]
    assert target.tier.dump(GOOD_KEYS, views) == [None, None]
    # The valid objects read back as the shard: what the fuzzer damages is data otherwise.
    for name in sorted(VALID):
        target.store_raw(target.valid_raw(name))
        outcomes, loaded = target.load([HOSTILE_KEY])
        assert outcomes == [None], (name, outcomes)
        if name != "fp8":
            assert loaded[0] == SHARD_DATA, name

    @FUZZ
    @given(hostile=hostile_objects)
    def fuzz(hostile: tuple[Any, ...]) -> None:
        if hostile[0] == "envelope":
            target.store_envelope(hostile[1], hostile[2])
        else:
            kind = hostile[1]
            if kind in ("random", "empty"):
                data = hostile[2]
            else:
                raw = target.valid_raw(hostile[2])
                if kind == "cut":
                    data = raw[: int(hostile[3] * target.cut_max(raw))]
                elif target.grows():
                    data = raw + hostile[3]
                else:
                    data = raw[: target.cut_max(raw)]
            target.store_raw(data)
        outcomes, loaded = target.load([HOSTILE_KEY, *GOOD_KEYS])
        assert isinstance(outcomes[0], KeyMissingError | TierError), outcomes[0]
        assert outcomes[1:] == [None, None], outcomes
        assert loaded[1:] == GOOD_DATA

    fuzz()


LAYOUT = Layout(shard_size=SHARD, shards_per_block=1, tensor_sizes=(SHARD,))


@pytest.fixture
def tier_of() -> Iterator[Callable[[Any], Any]]:
    tiers: list[Any] = []

    def keep(tier: Any) -> Any:
        tiers.append(tier)
        return tier

    yield keep
    for tier in tiers:
        tier.close()


@pytest.mark.timeout(300)
def test_posix_reads_every_hostile_object_as_a_miss(
    tmp_path: Path, tier_of: Callable[[Any], Any]
) -> None:
    from ucm_backends.posix import PosixConfig, PosixTier

    config = PosixConfig(path=str(tmp_path / "nvme"), codec={"type": "zstd"})
    fuzz_read_path(PosixTarget(tier_of(PosixTier(config, make_context(LAYOUT)))))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_fsspec_reads_every_hostile_object_as_a_miss(
    tmp_path: Path, scheme: str, tier_of: Callable[[Any], Any]
) -> None:
    from ucm_backends.fsspec_tier import FsspecConfig, FsspecTier

    url = (
        f"file://{tmp_path / 'bucket'}"
        if scheme == "file"
        else f"memory://ucm-hostile-{uuid.uuid4().hex}"
    )
    config = FsspecConfig(url=url, codec={"type": "lz4"})
    fuzz_read_path(FsspecTarget(tier_of(FsspecTier(config, make_context(LAYOUT)))))


@pytest.mark.timeout(300)
def test_mooncake_reads_every_hostile_object_as_a_miss() -> None:
    """A real mooncake_master on 127.0.0.1 (skipped where Mooncake is not installed, except
    under CI, as in the tier suite)."""
    from harness.mooncake import MooncakeMaster, missing_reason, on_ci

    reason = missing_reason()
    if reason is not None:
        if on_ci():
            pytest.fail(f"CI must run the Mooncake tests: {reason}")
        pytest.skip(reason)
    from ucm_backends.mooncake import MooncakeConfig, MooncakeTier

    with MooncakeMaster(lease_ttl_ms=500) as master:
        config = MooncakeConfig(
            master_server_address=master.address,
            local_hostname="127.0.0.1",
            key_prefix=f"hostile{uuid.uuid4().hex[:12]}",
            codec="zstd",
        )
        tier = MooncakeTier(config, make_context(LAYOUT))
        try:
            fuzz_read_path(MooncakeTarget(tier))
        finally:
            tier.close()


def test_the_fuzzers_frames_decode_as_they_claim() -> None:
    """The crafted frames are what their names say (checked with zstandard itself)."""
    import zstandard

    frame = zstd_rle_frame(SHARD, SHARD, fill=0x5A)
    assert zstandard.frame_content_size(frame) == SHARD
    assert zstandard.ZstdDecompressor().decompress(frame) == b"\x5a" * SHARD
    assert zstandard.frame_content_size(zstd_rle_frame(GiB)) == GiB
    undeclared = zstd_rle_frame(None, 3 * SHARD)
    assert zstandard.frame_content_size(undeclared) == -1
    reader = zstandard.ZstdDecompressor().decompressobj()
    assert reader.decompress(undeclared) == bytes(3 * SHARD)
