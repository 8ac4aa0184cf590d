"""Codecs of the lower tiers: how a shard's bytes are stored below the CacheBuffer.

A lower tier's ``codec:`` (one of the models below) says how the shards *it writes* are
encoded; the codec's id and parameters go into each shard's envelope (``ucm.envelope``), and a
read decodes with what the envelope says, never with the tier's current setting: a shard
written under one codec stays readable after the tier's codec changes.

- ``none``: the shard as it is (the default).
- ``lz4``: LZ4 block format (the ``lz4`` package).
- ``zstd``: Zstandard at ``level`` (the ``zstandard`` package); ``shuffle: N`` first
  transposes the shard's bytes by element of N bytes (2 for float16/bfloat16 KV: all the
  high bytes, whose sign and exponent repeat, then all the low bytes), which is what makes
  floating-point KV compress at all.
- ``fp8`` (lossy, opt-in): each ``block_elements`` elements of ``source_dtype`` become one
  float32 scale (the block's largest magnitude / 448) and one e4m3 byte per element. The
  decoded shard is an approximation of the dumped one; its checksum is that of the decoded
  bytes, so corruption is still caught.

A codec that would not shrink a shard (random bytes, a shard whose size is no multiple of the
element, an fp8 shard holding an infinity or a NaN) stores it as ``none``: the envelope
records that too. lz4 and zstandard release the
GIL while they run, numpy does for the shuffle and the fp8 arithmetic; the tiers call the codec
on their own I/O threads, never on the engine's.

Stored bytes are untrusted (anyone who can write a tier's directory or bucket writes them):
``decode`` bounds every codec's output by the shard length the caller expects before it
allocates, so a payload claiming more costs no memory. lz4 blocks carry no size and decode into
``length`` bytes at most; a zstd frame must declare exactly ``length`` content bytes in its
header, read before decoding (python-zstandard would otherwise allocate what the frame declares),
and nothing may follow it; an fp8 payload's size is checked against the one ``length`` implies.

Leaf module: ``lz4``, ``zstandard`` and ``numpy`` are imported when a codec first runs, so
``import ucm`` stays light (and never imports torch).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)
from pydantic_core import PydanticCustomError

from .fieldtypes import Int

if TYPE_CHECKING:
    import numpy as np

Buffer = bytes | bytearray | memoryview


class CodecId(enum.IntEnum):
    """The codec byte of an envelope."""

    NONE = 0
    LZ4 = 1
    ZSTD = 2
    FP8 = 3


class CodecError(Exception):
    """A payload that does not decode (the envelope reports it as corrupt)."""


# ------------------------------------------------------------------------------ configuration


class _CodecModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NoCodec(_CodecModel):
    """Shards are stored as they are."""

    type: Literal["none"] = "none"


class Lz4Codec(_CodecModel):
    """LZ4 block compression: fast, modest ratios on KV."""

    type: Literal["lz4"] = "lz4"


ZSTD_LEVEL_MIN = -7
ZSTD_LEVEL_MAX = 22


class ZstdCodec(_CodecModel):
    """Zstandard at ``level``, optionally over byte-shuffled elements."""

    type: Literal["zstd"] = "zstd"
    level: Int = Field(
        default=3,
        ge=ZSTD_LEVEL_MIN,
        le=ZSTD_LEVEL_MAX,
        description="Compression level (negative: faster; 1-22: smaller).",
    )
    shuffle: Literal[0, 2, 4] = Field(
        default=0,
        description="Byte-shuffle by elements of this many bytes before compressing (2 for "
        "float16/bfloat16 KV, 4 for float32; 0: no shuffle).",
    )


FP8_DTYPES: dict[str, int] = {"float16": 1, "bfloat16": 2, "float32": 3}
"""fp8 source dtypes and their codes in the envelope's parameters."""
_DTYPE_BYTES = {1: 2, 2: 2, 3: 4}
FP8_MAX = 448.0
"""Largest finite e4m3 (fn) value."""


class Fp8Codec(_CodecModel):
    """LOSSY: e4m3 with one float32 scale per block of elements. Opt-in; a load returns an
    approximation of what was dumped."""

    type: Literal["fp8"] = "fp8"
    source_dtype: Literal["float16", "bfloat16", "float32"] = Field(
        description="Element type of the shards (the KV cache dtype); required, since a tier "
        "sees only bytes."
    )
    block_elements: Int = Field(
        default=128,
        ge=16,
        le=1 << 16,
        description="Elements sharing one scale (a power of two).",
    )

    @field_validator("block_elements")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be a power of two, got {value}")
        return value


_CODEC_MODELS: dict[str, type[_CodecModel]] = {
    "none": NoCodec,
    "lz4": Lz4Codec,
    "zstd": ZstdCodec,
    "fp8": Fp8Codec,
}


def _dispatch_codec(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    # By hand rather than a pydantic discriminated union, so an error's YAML path is
    # `tiers[1].codec.level`, not `tiers[1].codec.zstd.level`. `codec: lz4` means
    # `codec: {type: lz4}`.
    if isinstance(value, _CodecModel):
        return value
    if isinstance(value, str):
        value = {"type": value}
    valid = ", ".join(_CODEC_MODELS)
    if not isinstance(value, Mapping):
        raise PydanticCustomError(
            "codec_type",
            "a codec is a name or a mapping with a 'type' key; codecs: {valid}",
            {"valid": valid},
        )
    model = _CODEC_MODELS.get(value.get("type"))  # type: ignore[arg-type]
    if model is None:
        raise PydanticCustomError(
            "codec_type",
            "unknown codec {type}; codecs: {valid}",
            {"type": repr(value.get("type")), "valid": valid},
        )
    return model.model_validate(dict(value))


CodecConfig = Annotated[
    NoCodec | Lz4Codec | ZstdCodec | Fp8Codec,
    WrapValidator(_dispatch_codec),
]
"""A lower tier's ``codec:`` setting: a name (``lz4``) or a mapping with ``type``."""


# --------------------------------------------------------------------------------- parameters


def pack(config: NoCodec | Lz4Codec | ZstdCodec | Fp8Codec) -> tuple[CodecId, int]:
    """The envelope's (codec id, u64 parameters) of a configured codec."""
    if isinstance(config, Lz4Codec):
        return CodecId.LZ4, 0
    if isinstance(config, ZstdCodec):
        return CodecId.ZSTD, (config.level & 0xFFFF_FFFF) | (config.shuffle << 32)
    if isinstance(config, Fp8Codec):
        shift = config.block_elements.bit_length() - 1
        return CodecId.FP8, FP8_DTYPES[config.source_dtype] | (shift << 8)
    return CodecId.NONE, 0


def describe(codec: int, params: int) -> str:
    """A short label (``zstd-3+shuffle2``) of an envelope's codec; raises CodecError when the
    parameters are not ones this UCM writes."""
    if codec == CodecId.NONE:
        if params:
            raise CodecError(f"parameters {params:#x} without a codec")
        return "none"
    if codec == CodecId.LZ4:
        if params:
            raise CodecError(f"lz4 parameters {params:#x}")
        return "lz4"
    if codec == CodecId.ZSTD:
        level, shuffle = _zstd_params(params)
        return f"zstd-{level}" + (f"+shuffle{shuffle}" if shuffle else "")
    if codec == CodecId.FP8:
        dtype, block = _fp8_params(params)
        name = {code: name for name, code in FP8_DTYPES.items()}[dtype]
        return f"fp8-{name}/{block}"
    raise CodecError(f"unknown codec {codec}")


def _zstd_params(params: int) -> tuple[int, int]:
    low = params & 0xFFFF_FFFF
    level = low - (1 << 32) if low & 0x8000_0000 else low
    shuffle = params >> 32
    if not ZSTD_LEVEL_MIN <= level <= ZSTD_LEVEL_MAX or shuffle not in (0, 2, 4):
        raise CodecError(f"zstd parameters {params:#x}")
    return level, shuffle


def _fp8_params(params: int) -> tuple[int, int]:
    dtype = params & 0xFF
    shift = (params >> 8) & 0xFF
    if dtype not in _DTYPE_BYTES or not 4 <= shift <= 16 or params >> 16:
        raise CodecError(f"fp8 parameters {params:#x}")
    return dtype, 1 << shift


def check(codec: int, params: int) -> None:
    """Raises CodecError unless (codec, params) is one this UCM decodes."""
    describe(codec, params)


# ------------------------------------------------------------------------------------ codecs

_local = threading.local()


def _zstd_compressor(level: int) -> Any:
    # A zstandard (de)compressor is not thread-safe: one per thread and level.
    cache: dict[int, Any] | None = getattr(_local, "zstd", None)
    if cache is None:
        cache = _local.zstd = {}
    compressor = cache.get(level)
    if compressor is None:
        import zstandard

        compressor = cache[level] = zstandard.ZstdCompressor(level=level)
    return compressor


def _zstd_decompressor() -> Any:
    decompressor = getattr(_local, "unzstd", None)
    if decompressor is None:
        import zstandard

        decompressor = _local.unzstd = zstandard.ZstdDecompressor()
    return decompressor


def _joined(shard: Sequence[Buffer]) -> Buffer:
    if len(shard) == 1:
        return shard[0]
    return b"".join(shard)


_ELEMENT_DTYPES = {2: "<u2", 4: "<u4"}


def _shuffle(data: Buffer, element: int) -> bytes:
    """Byte ``k`` of every element, for k = 0 .. element-1, one row after the other (the
    transpose of the shard seen as rows of ``element`` bytes), by shifts and masks: contiguous
    numpy passes, several times faster than a strided transpose."""
    import numpy as np

    values = np.frombuffer(data, dtype=_ELEMENT_DTYPES[element])
    out = np.empty((element, values.size), dtype=np.uint8)
    for k in range(element):
        np.bitwise_and(values >> (8 * k), 0xFF, out=out[k], casting="unsafe")
    return out.tobytes()


def _unshuffle(data: Buffer, element: int) -> bytes:
    import numpy as np

    rows = np.frombuffer(data, dtype=np.uint8).reshape(element, -1)
    values = rows[0].astype(_ELEMENT_DTYPES[element])
    for k in range(1, element):
        values |= rows[k].astype(_ELEMENT_DTYPES[element]) << (8 * k)
    return bytes(values.tobytes())


def encode(codec: int, params: int, shard: Sequence[Buffer], length: int) -> Buffer | None:
    """The payload of a ``length``-byte shard (its views, in order) under the codec, or None
    when the codec does not apply (the shard is then stored as ``none``): no smaller, or a size
    that is no multiple of the codec's element."""
    if codec == CodecId.NONE:
        return None
    if codec == CodecId.LZ4:
        import lz4.block

        payload: Buffer = lz4.block.compress(_joined(shard), store_size=False)
    elif codec == CodecId.ZSTD:
        level, shuffle = _zstd_params(params)
        data = _joined(shard)
        if shuffle:
            if length % shuffle:
                return None
            data = _shuffle(data, shuffle)
        payload = _zstd_compressor(level).compress(data)
    elif codec == CodecId.FP8:
        dtype, block = _fp8_params(params)
        if length % _DTYPE_BYTES[dtype]:
            return None
        fp8 = _fp8_encode(_joined(shard), dtype, block)
        if fp8 is None:
            return None
        payload = fp8
    else:
        raise CodecError(f"unknown codec {codec}")
    return payload if len(payload) < length else None


def _zstd_decode(payload: Buffer, length: int) -> Buffer:
    """The one zstd frame of ``payload``, which must declare ``length`` content bytes.
    python-zstandard sizes its output by the size a frame declares and ignores
    ``max_output_size`` then: a frame of 32 KiB declaring 1 GiB (and holding it, 4 bytes per
    run of 128 KiB) would be decoded to 1 GiB before any length check. So the declared size is
    read from the frame's header first; a frame declaring another size, or none (UCM's frames
    always declare it), is refused before any output is allocated, and so are bytes after
    the frame."""
    import zstandard

    declared = zstandard.frame_content_size(payload)
    if declared == -1:
        raise CodecError("zstd frame declares no content size")
    if declared != length:
        raise CodecError(f"zstd frame declares {declared} bytes, expected {length}")
    data: Buffer = _zstd_decompressor().decompress(payload, allow_extra_data=False)
    return data


def decode(codec: int, params: int, payload: Buffer, length: int) -> Buffer:
    """The ``length`` decoded bytes of a payload; raises CodecError when it does not decode.
    Stored bytes are untrusted: no codec allocates more than ``length`` bytes of output (and
    working memory proportional to it) whatever the payload claims, so a hostile payload costs
    a reader no more memory than a shard."""
    if codec == CodecId.NONE:
        return payload
    try:
        if codec == CodecId.LZ4:
            import lz4.block

            # A block carries no size of its own: the output is ``length`` bytes at most.
            data: Buffer = lz4.block.decompress(payload, uncompressed_size=length)
        elif codec == CodecId.ZSTD:
            _level, shuffle = _zstd_params(params)
            data = _zstd_decode(payload, length)
            if shuffle and len(data) == length:
                data = _unshuffle(data, shuffle)
        elif codec == CodecId.FP8:
            dtype, block = _fp8_params(params)
            data = _fp8_decode(payload, dtype, block, length)
        else:
            raise CodecError(f"unknown codec {codec}")
    except CodecError:
        raise
    except Exception as exc:  # lz4.block.LZ4BlockError, zstandard.ZstdError, numpy's ValueError
        raise CodecError(f"{describe(codec, params)} payload does not decode: {exc}") from None
    if len(data) != length:
        raise CodecError(f"{describe(codec, params)} payload decodes to {len(data)} bytes")
    return data


# ------------------------------------------------------------------------------------- fp8


def _to_float32(data: Buffer, dtype: int) -> np.ndarray[Any, Any]:
    import numpy as np

    if dtype == 1:
        return np.frombuffer(data, dtype=np.float16).astype(np.float32)
    if dtype == 2:
        return (np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(data, dtype=np.float32).copy()


def _from_float32(values: np.ndarray[Any, Any], dtype: int) -> bytes:
    import numpy as np

    if dtype == 1:
        return values.astype(np.float16).tobytes()
    if dtype == 2:
        bits = values.view(np.uint32)
        rounded = bits + (((bits >> 16) & 1) + 0x7FFF)  # round to nearest even
        return (rounded >> 16).astype(np.uint16).tobytes()
    return values.astype(np.float32).tobytes()


def _e4m3_table() -> np.ndarray[Any, Any]:
    """The float32 value of each e4m3fn byte (0x7F and 0xFF are NaN)."""
    table = getattr(_local, "e4m3", None)
    if table is None:
        import numpy as np

        codes = np.arange(256, dtype=np.uint32)
        exponent = (codes >> 3) & 0xF
        mantissa = (codes & 7).astype(np.float32)
        magnitude = np.where(
            exponent == 0,
            mantissa / 8.0 * 2.0**-6,
            (1.0 + mantissa / 8.0) * np.exp2(exponent.astype(np.float32) - 7.0),
        ).astype(np.float32)
        table = np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32)
        table[0x7F] = table[0xFF] = np.nan
        _local.e4m3 = table
    return table


def _fp8_blocks(count: int, block: int) -> int:
    return -(-count // block)


def _fp8_encode(data: Buffer, dtype: int, block: int) -> bytes | None:
    """Scales and e4m3 codes; None when the shard holds an infinity or a NaN (kept lossless
    rather than turned into numbers)."""
    import numpy as np

    values = _to_float32(data, dtype)
    count = values.size
    blocks = _fp8_blocks(count, block)
    padded = np.zeros(blocks * block, dtype=np.float32)
    padded[:count] = values
    grid = padded.reshape(blocks, block)
    amax = np.max(np.abs(grid), axis=1)
    if not np.isfinite(amax).all():
        return None
    scales = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    scaled = np.clip(grid / scales[:, None], -FP8_MAX, FP8_MAX).astype(np.float32).ravel()
    sign = (scaled.view(np.uint32) >> 24) & 0x80
    magnitude = np.abs(scaled)
    # Normal range (>= 2^-6): round the float32 mantissa to 3 bits, to nearest even.
    raw_bits = magnitude.view(np.uint32)
    bits = (raw_bits + (((raw_bits >> 20) & 1) + np.uint32(0x7_FFFF))) & np.uint32(0xFFF0_0000)
    exponent = (bits >> 23).astype(np.int32) - 127 + 7
    normal = (np.clip(exponent, 1, 15).astype(np.uint32) << 3) | ((bits >> 20) & 7)
    # Subnormal range: multiples of 2^-9 (np.rint rounds to even); 8 * 2^-9 is 2^-6, the
    # first normal, whose code is 8 too.
    subnormal = np.rint(magnitude * 512.0).astype(np.uint32)
    codes = (np.where(magnitude < 2.0**-6, subnormal, normal) | sign).astype(np.uint8)
    return bytes(scales.tobytes() + codes[:count].tobytes())


def _fp8_decode(payload: Buffer, dtype: int, block: int, length: int) -> bytes:
    import numpy as np

    count = length // _DTYPE_BYTES[dtype]
    blocks = _fp8_blocks(count, block)
    view = memoryview(payload).cast("B")
    if view.nbytes != 4 * blocks + count:
        raise CodecError(f"fp8 payload of {view.nbytes} bytes, expected {4 * blocks + count}")
    scales = np.frombuffer(view[: 4 * blocks], dtype=np.float32)
    codes = np.frombuffer(view[4 * blocks :], dtype=np.uint8)
    values = _e4m3_table()[codes]
    padded = np.zeros(blocks * block, dtype=np.float32)
    padded[:count] = values
    decoded = (padded.reshape(blocks, block) * scales[:, None]).ravel()[:count]
    return _from_float32(decoded, dtype)


def fp8_block_errors(original: Buffer, decoded: Buffer, dtype: str, block: int) -> list[float]:
    """Per block of ``block`` elements: the largest |original - decoded| over the block's
    largest |original| (0 for an all-zero block); what ``ucm bench --only codecs`` reports."""
    import numpy as np

    code = FP8_DTYPES[dtype]
    a = _to_float32(original, code)
    b = _to_float32(decoded, code)
    blocks = _fp8_blocks(a.size, block)
    pad_a = np.zeros(blocks * block, dtype=np.float64)
    pad_b = np.zeros(blocks * block, dtype=np.float64)
    pad_a[: a.size] = a
    pad_b[: b.size] = b
    error = np.max(np.abs(pad_a - pad_b).reshape(blocks, block), axis=1)
    amax = np.max(np.abs(pad_a).reshape(blocks, block), axis=1)
    return [float(e / m) if m > 0 else 0.0 for e, m in zip(error, amax, strict=True)]


__all__ = [
    "FP8_DTYPES",
    "FP8_MAX",
    "CodecConfig",
    "CodecError",
    "CodecId",
    "Fp8Codec",
    "Lz4Codec",
    "NoCodec",
    "ZstdCodec",
    "check",
    "decode",
    "describe",
    "encode",
    "fp8_block_errors",
    "pack",
]
