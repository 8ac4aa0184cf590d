"""The codecs of the lower tiers (ucm.codecs) through the envelope (ucm.envelope): byte-exact
round trips of every lossless codec, fp8's rounding against torch's own e4m3, its error bound,
what a damaged payload reads as, a payload claiming another size refused before it is
decoded, and the ``codec:`` settings a stack refuses, by YAML path."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from ucm import codecs, envelope
from ucm.errors import ConfigError
from ucm.native.checksum import checksum
from ucm.stack import parse_stack

KEY = (bytes(range(16)), 1)
LOSSLESS = {
    "lz4": codecs.Lz4Codec(),
    "zstd-1": codecs.ZstdCodec(level=1),
    "zstd-19": codecs.ZstdCodec(level=19),
    "zstd-neg": codecs.ZstdCodec(level=-5),
    "zstd-shuffle2": codecs.ZstdCodec(shuffle=2),
    "zstd-shuffle4": codecs.ZstdCodec(level=9, shuffle=4),
}


def kv_like(size: int, seed: int = 0) -> bytes:
    """Half a repeating pattern, half float16 noise: every lossless codec shrinks it."""
    rng = np.random.default_rng(seed)
    noise = (rng.standard_normal(size // 4) * 0.5).astype(np.float16).tobytes()
    pattern = (bytes(range(seed % 7, seed % 7 + 40)) * (size // 40 + 1))[: size - len(noise)]
    return pattern + noise


@pytest.mark.parametrize("codec", LOSSLESS.values(), ids=LOSSLESS.keys())
def test_lossless_codecs_round_trip_byte_exact(codec: codecs.ZstdCodec) -> None:
    shard = kv_like(65536, seed=3)
    views = [memoryview(shard)[:1000], memoryview(shard)[1000:40000], memoryview(shard)[40000:]]
    sealed = envelope.encode(KEY, views, codec)
    assert sealed.stored < len(shard)
    stored = sealed.header + b"".join(sealed.payload)
    parsed = envelope.parse(stored, KEY, len(shard))
    codec_id, params = codecs.pack(codec)
    assert (parsed.codec, parsed.codec_params) == (codec_id, params)
    assert parsed.stored == sealed.stored and parsed.length == len(shard)
    assert parsed.checksum == checksum([shard])  # the decoded bytes
    assert bytes(envelope.open_object(stored, KEY, len(shard))) == shard
    out = [bytearray(10), bytearray(len(shard) - 10)]
    envelope.decode_into(parsed, stored[envelope.HEADER_BYTES :], [memoryview(b) for b in out])
    assert bytes(out[0] + out[1]) == shard


def test_a_shard_a_codec_cannot_shrink_is_stored_as_none() -> None:
    noise = np.random.default_rng(1).bytes(8192)
    sealed = envelope.encode(KEY, [noise], codecs.Lz4Codec())
    assert envelope.parse(sealed.header, KEY, len(noise)).codec == envelope.Codec.NONE
    assert sealed.header[4] == envelope.VERSION_PLAIN  # readable by a UCM before codecs
    assert sealed.payload == [noise] and sealed.stored == len(noise)
    # A shuffle needs whole elements: an odd size is stored as it is.
    odd = kv_like(8191)
    sealed = envelope.encode(KEY, [odd], codecs.ZstdCodec(shuffle=2))
    assert envelope.parse(sealed.header, KEY, len(odd)).codec == envelope.Codec.NONE


def test_codec_shards_have_a_version_2_header_and_plain_ones_version_1() -> None:
    shard = kv_like(4096)
    assert envelope.encode(KEY, [shard]).header == envelope.seal(KEY, [shard])
    assert envelope.seal(KEY, [shard])[4] == 1
    assert envelope.encode(KEY, [shard], codecs.Lz4Codec()).header[4] == 2


@pytest.mark.parametrize("codec", LOSSLESS.values(), ids=LOSSLESS.keys())
def test_a_damaged_payload_is_corrupt_never_data(codec: codecs.ZstdCodec) -> None:
    shard = kv_like(32768, seed=5)
    sealed = envelope.encode(KEY, [shard], codec)
    payload = bytearray(b"".join(sealed.payload))
    for position in (0, len(payload) // 2, len(payload) - 1):
        damaged = bytearray(payload)
        damaged[position] ^= 0x5A
        with pytest.raises(envelope.Corrupt):
            envelope.open_object(sealed.header + bytes(damaged), KEY, len(shard))
    with pytest.raises(envelope.Corrupt, match="bytes, expected"):
        envelope.open_object(sealed.header + bytes(payload[:-1]), KEY, len(shard))


def _zstd_frame(declared: int | None, content: int) -> bytes:
    """A zstd frame declaring ``declared`` content bytes (None: no size), holding ``content``
    zero bytes as RLE blocks of up to 128 KiB (4 bytes each)."""
    if declared is None:
        out = bytearray(struct.pack("<I", 0xFD2FB528)) + bytes([0x00, 0x58])
    else:
        out = bytearray(struct.pack("<IBQ", 0xFD2FB528, 0xE0, declared))
    while content:
        size = min(128 * 1024, content)
        content -= size
        out += struct.pack("<I", (0 if content else 1) | (1 << 1) | (size << 3))[:3] + b"\0"
    return bytes(out)


def test_a_payload_claiming_another_size_is_refused_before_it_is_decoded() -> None:
    """Stored bytes are untrusted: each codec decodes into the shard's length at most, and a
    zstd frame's declared size is checked before zstandard allocates what it declares."""
    import lz4.block

    length = 65536
    zstd = codecs.CodecId.ZSTD, 3
    assert bytes(codecs.decode(*zstd, _zstd_frame(length, length), length)) == bytes(length)
    for declared in (length - 1, length + 1, 1 << 30, 2**62):
        with pytest.raises(
            codecs.CodecError, match=f"^zstd frame declares {declared} bytes, expected {length}$"
        ):
            codecs.decode(*zstd, _zstd_frame(declared, 4096), length)
    for unknown in (None, 2**64 - 1):  # 2**64 - 1 is zstd's "content size unknown"
        with pytest.raises(codecs.CodecError, match=r"^zstd frame declares no content size$"):
            codecs.decode(*zstd, _zstd_frame(unknown, length), length)
    with pytest.raises(codecs.CodecError, match="1 bytes of unused data"):
        codecs.decode(*zstd, _zstd_frame(length, length) + b"\0", length)
    with pytest.raises(codecs.CodecError, match=r"^lz4 payload does not decode: "):
        codecs.decode(
            codecs.CodecId.LZ4, 0, lz4.block.compress(bytes(64 * length), store_size=False), length
        )
    fp8 = codecs.pack(codecs.Fp8Codec(source_dtype="bfloat16", block_elements=128))
    size = 4 * (length // 2 // 128) + length // 2
    with pytest.raises(
        codecs.CodecError, match=f"^fp8 payload of {size + 1} bytes, expected {size}$"
    ):
        codecs.decode(*fp8, bytes(size + 1), length)


def test_a_header_of_a_later_version_is_foreign() -> None:
    header = bytearray(envelope.encode(KEY, [kv_like(4096)], codecs.Lz4Codec()).header)
    header[4] = 3
    with pytest.raises(envelope.Foreign, match="envelope version 3; this UCM reads up to 2"):
        envelope.parse(bytes(header), KEY, 4096)


# ------------------------------------------------------------------------------------- fp8


@pytest.mark.parametrize(
    ("dtype", "torch_dtype"),
    [("float16", torch.float16), ("bfloat16", torch.bfloat16), ("float32", torch.float32)],
)
def test_fp8_rounds_exactly_like_torch_e4m3fn(dtype: str, torch_dtype: torch.dtype) -> None:
    """Our numpy e4m3 encoding is torch's float8_e4m3fn, bit for bit, on values spread over
    many binades (subnormals included), and the decoded shard is within e4m3's precision."""
    generator = torch.Generator().manual_seed(7)
    values = torch.randn(1 << 14, generator=generator) * torch.exp(
        torch.randn(1 << 14, generator=generator) * 3
    )
    values[:128] = 0.0  # an all-zero block
    source = values.clamp(-60000.0, 60000.0).to(torch_dtype)  # finite in float16 too
    raw = source.view(torch.uint8).numpy().tobytes()
    config = codecs.Fp8Codec(source_dtype=dtype, block_elements=128)  # type: ignore[arg-type]
    codec_id, params = codecs.pack(config)
    payload = codecs.encode(codec_id, params, [raw], len(raw))
    assert payload is not None
    blocks = source.numel() // 128
    assert len(payload) == 4 * blocks + source.numel()
    scales = torch.frombuffer(bytearray(payload[: 4 * blocks]), dtype=torch.float32)
    expected = (source.float().reshape(blocks, 128) / scales[:, None]).to(torch.float8_e4m3fn)
    ours = torch.frombuffer(bytearray(payload[4 * blocks :]), dtype=torch.uint8)
    assert torch.equal(ours, expected.view(torch.uint8).reshape(-1))
    decoded = codecs.decode(codec_id, params, payload, len(raw))
    errors = codecs.fp8_block_errors(raw, decoded, dtype, 128)
    assert errors[0] == 0.0
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of a value; the output dtype's own
    # rounding adds bfloat16's 1/256 at most.
    assert max(errors) <= 1 / 16 + 1 / 256


def test_fp8_keeps_a_shard_with_an_infinity_lossless() -> None:
    values = np.ones(1024, dtype=np.float16)
    values[700] = np.inf
    sealed = envelope.encode(KEY, [values.tobytes()], codecs.Fp8Codec(source_dtype="float16"))
    assert envelope.parse(sealed.header, KEY, 2048).codec == envelope.Codec.NONE


def test_fp8_checksum_is_that_of_what_a_load_returns() -> None:
    raw = np.random.default_rng(2).standard_normal(4096).astype(np.float16).tobytes()
    sealed = envelope.encode(KEY, [raw], codecs.Fp8Codec(source_dtype="float16"))
    parsed = envelope.parse(sealed.header, KEY, len(raw))
    decoded = envelope.decode(parsed, b"".join(sealed.payload))
    assert bytes(decoded) != raw  # lossy
    assert parsed.checksum == checksum([decoded]) != checksum([raw])
    assert codecs.describe(parsed.codec, parsed.codec_params) == "fp8-float16/128"


# ---------------------------------------------------------------------------------- config

BASE = {"unique_id": "codecs", "shard_size": 4096, "shards_per_block": 1}


def _tier(codec: object, kind: str = "posix") -> dict[str, object]:
    tier: dict[str, object] = (
        {"type": "posix", "path": "/tmp/ucm-codec-config"}
        if kind == "posix"
        else {"type": "fsspec", "url": "memory://ucm-codec-config"}
    )
    return {**BASE, "tiers": [{"type": "buffer", "capacity": 65536}, {**tier, "codec": codec}]}


@pytest.mark.parametrize(
    ("codec", "expected"),
    [
        ("lz4", codecs.Lz4Codec()),
        ("none", codecs.NoCodec()),
        ("zstd", codecs.ZstdCodec(level=3)),
        ({"type": "zstd", "level": -7, "shuffle": 2}, codecs.ZstdCodec(level=-7, shuffle=2)),
        (
            {"type": "fp8", "source_dtype": "bfloat16", "block_elements": 64},
            codecs.Fp8Codec(source_dtype="bfloat16", block_elements=64),
        ),
    ],
)
def test_codec_settings(codec: object, expected: object) -> None:
    assert parse_stack(_tier(codec)).tiers[1].codec == expected  # type: ignore[attr-defined]
    assert (
        parse_stack({**BASE, "tiers": [{"type": "posix", "path": "/x"}]}).tiers[0].codec
        == codecs.NoCodec()
    )  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("codec", "problem"),
    [
        (
            "brotli",
            "tiers[1].codec: unknown codec 'brotli'; codecs: none, lz4, zstd, fp8 (got 'brotli')",
        ),
        (
            7,
            "tiers[1].codec: a codec is a name or a mapping with a 'type' key; codecs: none, "
            "lz4, zstd, fp8 (got 7)",
        ),
        (
            {"type": "zstd", "level": 23},
            "tiers[1].codec.level: Input should be less than or equal to 22 (got 23)",
        ),
        (
            {"type": "zstd", "shuffle": 3},
            "tiers[1].codec.shuffle: Input should be 0, 2 or 4 (got 3)",
        ),
        (
            {"type": "zstd", "levle": 3},
            "tiers[1].codec.levle: unknown key (misspelled?); not allowed here (got 3)",
        ),
        ("fp8", "tiers[1].codec.source_dtype: Field required (got {'type': 'fp8'})"),
        (
            {"type": "fp8", "source_dtype": "int8"},
            "tiers[1].codec.source_dtype: Input should be 'float16', 'bfloat16' or 'float32' "
            "(got 'int8')",
        ),
        (
            {"type": "fp8", "source_dtype": "float16", "block_elements": 100},
            "tiers[1].codec.block_elements: Value error, must be a power of two, got 100 (got 100)",
        ),
    ],
)
def test_bad_codec_values_name_the_yaml_path(codec: object, problem: str) -> None:
    for kind in ("posix", "fsspec"):
        with pytest.raises(ConfigError) as info:
            parse_stack(_tier(codec, kind))
        assert info.value.problems == [problem]  # type: ignore[attr-defined]


def test_the_buffer_tier_takes_no_codec() -> None:
    """The CacheBuffer keeps fixed shard-sized slots: it stays uncompressed."""
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.codec: unknown key"):
        parse_stack({**BASE, "tiers": [{"type": "buffer", "capacity": 65536, "codec": "lz4"}]})


def test_codec_parameters_pack_into_the_envelope() -> None:
    assert codecs.pack(codecs.ZstdCodec(level=-3, shuffle=2)) == (
        codecs.CodecId.ZSTD,
        struct.unpack("<I", struct.pack("<i", -3))[0] | (2 << 32),
    )
    assert codecs.describe(*codecs.pack(codecs.ZstdCodec(level=-3, shuffle=2))) == (
        "zstd--3+shuffle2"
    )
    assert codecs.pack(codecs.Fp8Codec(source_dtype="float32", block_elements=1 << 16)) == (
        codecs.CodecId.FP8,
        3 | (16 << 8),
    )


@pytest.mark.parametrize("element", [2, 4])
def test_a_shuffled_zstd_payload_is_zstd_of_the_byte_transpose(element: int) -> None:
    """The stored format, independent of how the shuffle is computed: a plain zstd frame of
    the shard seen as rows of ``element`` bytes, transposed (byte 0 of every element first)."""
    import zstandard

    shard = kv_like(65536, seed=element)
    sealed = envelope.encode(KEY, [shard], codecs.ZstdCodec(level=1, shuffle=element))  # type: ignore[arg-type]
    transposed = np.frombuffer(shard, dtype=np.uint8).reshape(-1, element).T.tobytes()
    assert zstandard.ZstdDecompressor().decompress(b"".join(sealed.payload)) == transposed
