"""Codecs on the real lower tiers (posix, fsspec on file://, memory:// and S3 through moto),
through the public Store: byte-exact round trips of every lossless codec over every shard
layout, a corrupt compressed shard failing and repaired from the tier below, shards of an
earlier codec read after the tier's codec changed, fp8's bounded error, and the codecs running
on the tiers' threads, never the caller's."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ucm_backends.fsspec_tier import FsspecTier
from ucm_backends.posix import PosixTier

import ucm
from ucm import codecs, envelope

LAYOUTS = {
    "one tensor": {"shard_size": 8192},
    "K and V": {"tensor_size_list": [4096, 4096]},
    "layer plus chunk": {"tensor_size_list": [1024] * 8},
    "different sizes": {"tensor_size_list": [4000, 4096, 96]},
}
LOSSLESS: dict[str, Any] = {
    "lz4": "lz4",
    "zstd": {"type": "zstd", "level": 3},
    "zstd-shuffle": {"type": "zstd", "level": 1, "shuffle": 2},
}


def kv_like(block_id: bytes, shard: int, size: int) -> bytes:
    """Float16 noise over a repeating pattern of the key: every lossless codec shrinks it, and
    no two keys hold the same bytes."""
    seed = int.from_bytes(block_id[:8], "big") * 31 + shard
    noise = (np.random.default_rng(seed).standard_normal(size // 8) * 0.1).astype(np.float16)
    unit = block_id + shard.to_bytes(4, "big") + b"kv!!"
    head = (unit * (size // len(unit) + 1))[: size - noise.nbytes]
    return head + noise.tobytes()


def block(n: int) -> bytes:
    return n.to_bytes(16, "big")


def split(data: bytes, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    out, offset = [], 0
    for n in sizes:
        out.append(torch.frombuffer(bytearray(data[offset : offset + n]), dtype=torch.uint8))
        offset += n
    return out


def sources(data: list[bytes]) -> list[list[torch.Tensor]]:
    return [[torch.frombuffer(bytearray(d), dtype=torch.uint8)] for d in data]


def joined(tensors: list[torch.Tensor]) -> bytes:
    return b"".join(t.numpy().tobytes() for t in tensors)


def tier_for(kind: str, where: str, codec: Any, **extra: Any) -> dict[str, Any]:
    if kind == "posix":
        return {"type": "posix", "path": where, "codec": codec, **extra}
    if kind == "posix-direct":
        return {"type": "posix", "path": where, "codec": codec, "o_direct": True, **extra}
    return {"type": "fsspec", "url": where, "codec": codec, **extra}


def where_for(kind: str, tmp_path: Path, s3: dict[str, Any] | None = None) -> str:
    if kind.startswith("posix"):
        return str(tmp_path / "nvme")
    if kind == "fsspec-file":
        return f"file://{tmp_path / 'fs'}"
    if kind == "fsspec-s3":
        return f"s3://ucm-test/{uuid.uuid4().hex}"
    return f"memory://ucm-codecs-{uuid.uuid4().hex}"


def stored_codec(tier: Any, key: tuple[bytes, int]) -> envelope.Envelope:
    """The envelope a tier holds for ``key`` (read from its own storage)."""
    if isinstance(tier, PosixTier):
        footer = tier._footer_of(key[0])
        assert footer is not None
        parsed = footer.envelopes[key[1]]
        assert parsed is not None
        return parsed
    assert isinstance(tier, FsspecTier)
    raw = tier.fs.cat_file(tier.object_path(key))
    return envelope.parse(raw, key, tier.layout.shard_size)


@pytest.mark.parametrize("codec", LOSSLESS.values(), ids=LOSSLESS.keys())
@pytest.mark.parametrize("kind", ["posix", "posix-direct", "fsspec-file", "fsspec-memory"])
@pytest.mark.parametrize("geometry", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_lossless_codecs_round_trip_byte_exact_over_every_layout(
    tmp_path: Path, kind: str, geometry: dict[str, Any], codec: Any
) -> None:
    config = {
        "unique_id": "codec-rt",
        "shards_per_block": 4,
        **geometry,
        "tiers": [tier_for(kind, where_for(kind, tmp_path), codec)],
    }
    with ucm.open(config) as store:
        sizes, size = store.layout.tensor_sizes, store.layout.shard_size
        blocks = [block(i) for i in range(5)]
        shards = [0, 1, 2, 3, 1]
        data = [kv_like(b, s, size) for b, s in zip(blocks, shards, strict=True)]
        store.wait(store.dump(blocks, shards, [split(d, sizes) for d in data]))
        tier = store.tiers[0]
        codec_id, params = codecs.pack(tier.config.codec)  # type: ignore[attr-defined]
        for b, s in zip(blocks, shards, strict=True):
            held = stored_codec(tier, (b, s))
            assert (held.codec, held.codec_params) == (codec_id, params)
            assert held.stored < size
        dst = [[torch.zeros(n, dtype=torch.uint8) for n in sizes] for _ in blocks]
        store.wait(store.load(blocks, shards, dst))
        assert [joined(tensors) for tensors in dst] == data


@pytest.mark.parametrize("codec", LOSSLESS.values(), ids=LOSSLESS.keys())
def test_lossless_codecs_round_trip_on_s3(
    tmp_path: Path, s3_options: dict[str, Any], codec: Any
) -> None:
    config = {
        "unique_id": "codec-s3",
        "shards_per_block": 2,
        "tensor_size_list": [4096, 4096],
        "tiers": [
            tier_for(
                "fsspec-s3", where_for("fsspec-s3", tmp_path), codec, storage_options=s3_options
            )
        ],
    }
    with ucm.open(config) as store:
        blocks = [block(i) for i in range(4)]
        data = [kv_like(b, 1, 8192) for b in blocks]
        store.wait(store.dump(blocks, 1, [split(d, (4096, 4096)) for d in data]))
        assert stored_codec(store.tiers[0], (blocks[0], 1)).codec != envelope.Codec.NONE
        dst = [[torch.zeros(4096, dtype=torch.uint8) for _ in range(2)] for _ in blocks]
        store.wait(store.load(blocks, 1, dst))
        assert [joined(tensors) for tensors in dst] == data


def _damage(tier: Any, key: tuple[bytes, int]) -> None:
    """Flips a byte in the middle of the key's stored (compressed) payload."""
    held = stored_codec(tier, key)
    assert held.codec != envelope.Codec.NONE
    if isinstance(tier, PosixTier):
        path = tier.block_path(key[0])
        offset = key[1] * tier.shard_size + held.stored // 2
    else:
        path = tier.object_path(key).removeprefix("file://")
        offset = envelope.HEADER_BYTES + held.stored // 2
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xA5]))


@pytest.mark.parametrize("kind", ["posix", "fsspec-file"])
@pytest.mark.parametrize("codec", LOSSLESS.values(), ids=LOSSLESS.keys())
def test_a_corrupt_compressed_shard_is_never_data_and_is_repaired_from_below(
    tmp_path: Path, kind: str, codec: Any
) -> None:
    """posix or fsspec (with a codec) above an fsspec tier (zstd): a byte flipped in the upper
    tier's compressed payload fails that key there (counted corrupt), the load is served
    byte-exact from below, and the upper tier holds a good copy again afterwards."""
    top = tier_for(kind, where_for(kind, tmp_path), codec)
    below = tier_for("fsspec-file", f"file://{tmp_path / 'below'}", {"type": "zstd"})
    config = {
        "unique_id": f"codec-repair-{uuid.uuid4().hex[:8]}",
        "shards_per_block": 2,
        "shard_size": 16384,
        "tiers": [top, below],
    }
    blocks = [block(i) for i in range(3)]
    data = [kv_like(b, 0, 16384) for b in blocks]
    with ucm.open(config) as store:
        store.wait(store.dump(blocks, 0, sources(data)))
    with ucm.open(config) as store:
        upper = store.tiers[0]
        _damage(upper, (blocks[1], 0))
        dst = [[torch.zeros(16384, dtype=torch.uint8)] for _ in blocks]
        store.wait(store.load(blocks, 0, dst))
        assert [joined(t) for t in dst] == data
        assert upper.stats()["corrupt"] == 1
        assert store.tiers[1].stats()["hits"] == 1  # only the damaged key came from below
    with ucm.open(config) as store:
        upper = store.tiers[0]
        held = stored_codec(upper, (blocks[1], 0))  # repaired, under the tier's codec
        assert held.codec == codecs.pack(upper.config.codec)[0]  # type: ignore[attr-defined]
        dst = [[torch.zeros(16384, dtype=torch.uint8)] for _ in blocks]
        store.wait(store.load(blocks, 0, dst))
        assert [joined(t) for t in dst] == data
        assert upper.stats()["hits"] == 3 and upper.stats()["corrupt"] == 0
        assert store.tiers[1].stats()["hits"] == 0


@pytest.mark.parametrize("kind", ["posix", "fsspec-file"])
def test_shards_of_an_earlier_codec_stay_readable_after_a_codec_change(
    tmp_path: Path, kind: str
) -> None:
    """One tier reopened under none, lz4, zstd+shuffle and zstd in turn, each writing shards
    of its own (posix: into the same block files, which keep the other shards' payloads as
    they were written): every shard loads byte-exact under every later setting, and each keeps
    the codec it was written with."""
    where = where_for(kind, tmp_path)
    settings: list[Any] = ["none", "lz4", {"type": "zstd", "shuffle": 2}, {"type": "zstd"}]
    written: dict[tuple[bytes, int], tuple[bytes, Any]] = {}
    for round_, codec in enumerate(settings):
        config = {
            "unique_id": "codec-change",
            "shards_per_block": 4,
            "shard_size": 8192,
            "tiers": [tier_for(kind, where, codec)],
        }
        with ucm.open(config) as store:
            blocks = [block(i) for i in range(3)]
            data = [kv_like(b, round_, 8192) for b in blocks]
            store.wait(store.dump(blocks, round_, sources(data)))
            for b, d in zip(blocks, data, strict=True):
                written[(b, round_)] = (d, store.tiers[0].config.codec)  # type: ignore[attr-defined]
            keys = list(written)
            dst = [[torch.zeros(8192, dtype=torch.uint8)] for _ in keys]
            for key, views in zip(keys, dst, strict=True):
                store.wait(store.load([key[0]], key[1], [views]))
            assert [joined(t) for t in dst] == [written[k][0] for k in keys]
            for key in keys:
                held = stored_codec(store.tiers[0], key)
                assert held.codec == codecs.pack(written[key][1])[0]
    assert {codecs.describe(*codecs.pack(c)) for _d, c in written.values()} == {
        "none",
        "lz4",
        "zstd-3+shuffle2",
        "zstd-3",
    }


def test_a_shard_written_before_codecs_reads_under_any_codec(tmp_path: Path) -> None:
    """A version-1 envelope without a codec (what UCM wrote before codecs, byte for byte:
    ``envelope.seal``) is read by a tier configured with a codec."""
    layout_config = {"unique_id": "codec-old", "shards_per_block": 1, "shard_size": 4096}
    url = f"file://{tmp_path / 'fs'}"
    key = (block(7), 0)
    shard = kv_like(*key, 4096)
    with ucm.open({**layout_config, "tiers": [tier_for("fsspec-file", url, "zstd")]}) as store:
        tier = store.tiers[0]
        assert isinstance(tier, FsspecTier)
        tier.fs.pipe_file(tier.object_path(key), envelope.seal(key, [shard]) + shard)
        dst = [torch.zeros(4096, dtype=torch.uint8)]
        store.wait(store.load([key[0]], 0, [dst]))
        assert joined(dst) == shard


@pytest.mark.parametrize("kind", ["posix", "fsspec-memory"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fp8_tier_returns_kv_within_e4m3_precision(tmp_path: Path, kind: str, dtype: str) -> None:
    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    codec = {"type": "fp8", "source_dtype": dtype, "block_elements": 64}
    config = {
        "unique_id": "codec-fp8",
        "shards_per_block": 1,
        "tensor_size_list": [8192, 8192],
        "tiers": [tier_for(kind, where_for(kind, tmp_path), codec)],
    }
    generator = torch.Generator().manual_seed(3)
    with ucm.open(config) as store:
        blocks = [block(i) for i in range(4)]
        src = [
            [(torch.randn(4096, generator=generator) * (i + 1)).to(torch_dtype) for _ in range(2)]
            for i in range(len(blocks))
        ]
        store.wait(store.dump(blocks, 0, src))
        held = stored_codec(store.tiers[0], (blocks[0], 0))
        assert codecs.describe(held.codec, held.codec_params) == f"fp8-{dtype}/64"
        assert held.stored == 8192 + 4 * (8192 // 64)
        dst = [[torch.zeros(4096, dtype=torch_dtype) for _ in range(2)] for _ in blocks]
        store.wait(store.load(blocks, 0, dst))
    for tensors, originals in zip(dst, src, strict=True):
        for got, want in zip(tensors, originals, strict=True):
            assert not torch.equal(got, want)  # lossy
            errors = codecs.fp8_block_errors(
                want.view(torch.uint8).numpy().tobytes(),
                got.view(torch.uint8).numpy().tobytes(),
                dtype,
                64,
            )
            assert max(errors) <= 1 / 16 + 1 / 256


def test_codecs_run_on_the_tiers_threads_never_the_callers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every encode and decode of a dump and a load through posix and fsspec tiers runs on a
    thread of UCM's (the tiers' I/O pools, the loader and writer threads), not the thread that
    called dump/load/wait."""
    threads: list[str] = []
    real_encode, real_decode = codecs.encode, codecs.decode

    def encode(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real_encode(*args)

    def decode(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real_decode(*args)

    monkeypatch.setattr(codecs, "encode", encode)
    monkeypatch.setattr(codecs, "decode", decode)
    config = {
        "unique_id": "codec-threads",
        "shards_per_block": 1,
        "shard_size": 8192,
        "tiers": [
            tier_for("posix", str(tmp_path / "nvme"), "lz4"),
            tier_for("fsspec-file", f"file://{tmp_path / 'fs'}", "zstd", write="through"),
        ],
    }
    blocks = [block(i) for i in range(16)]
    data = [kv_like(b, 0, 8192) for b in blocks]
    with ucm.open(config) as store:
        store.wait(store.dump(blocks, 0, sources(data)))
    with ucm.open(config) as store:
        # Half the blocks come from the fsspec tier.
        assert store.tiers[0].batched_remove([(b, 0) for b in blocks[:8]]) == 8
        dst = [[torch.zeros(8192, dtype=torch.uint8)] for _ in blocks]
        store.wait(store.load(blocks, 0, dst))
    assert [joined(t) for t in dst] == data
    assert len(threads) >= 2 * 16 + 16  # both tiers encoded every block; every load decoded
    caller = threading.current_thread().name
    assert caller not in threads, sorted(set(threads))


# ------------------------------------------------------------------------------- mooncake


def _mooncake_load(tier: Any, keys: list[tuple[bytes, int]]) -> tuple[list[Any], list[bytes]]:
    buffers = [bytearray(tier.shard_size) for _ in keys]
    outcomes = tier.load(keys, [[memoryview(b)] for b in buffers])
    return outcomes, [bytes(b) for b in buffers]


@pytest.mark.parametrize("codec", LOSSLESS.values(), ids=LOSSLESS.keys())
def test_mooncake_stores_compressed_objects_and_reads_every_codec(
    mooncake_master: Any, codec: Any
) -> None:
    """A mooncake tier with a codec puts smaller objects and loads them byte-exact; a tier
    without one (another node, say) reads them too, and the first reads the second's plain
    objects; a damaged compressed object fails and is removed, never data."""
    from ucm_backends.mooncake import HEADER_BYTES

    from ucm.layout import Layout

    from .conftest import mooncake_tier

    layout = Layout(shard_size=8192, shards_per_block=2, tensor_sizes=(4096, 4096))
    namespace = f"codec{uuid.uuid4().hex[:12]}"
    writer = mooncake_tier(mooncake_master, layout, key_prefix=namespace, codec=codec)
    config = writer.config.codec  # type: ignore[attr-defined]
    plain = mooncake_tier(mooncake_master, layout, key_prefix=namespace)
    try:
        keys = [(block(i), i % 2) for i in range(6)]
        data = [kv_like(*key, 8192) for key in keys]
        views = [[memoryview(d)[:4096], memoryview(d)[4096:]] for d in data]
        assert writer.dump(keys[:4], views[:4]) == [None] * 4
        assert plain.dump(keys[4:], views[4:]) == [None] * 2
        sizes = [writer.client.get_size(writer.object_name(key)) for key in keys]
        assert all(HEADER_BYTES < size < HEADER_BYTES + 8192 for size in sizes[:4])
        assert sizes[4:] == [HEADER_BYTES + 8192] * 2
        for tier in (writer, plain):
            outcomes, loaded = _mooncake_load(tier, keys)
            assert outcomes == [None] * 6
            assert loaded == data
        # Unchanged bytes under the same codec are not put again.
        assert writer.dump(keys[:1], views[:1]) == [None]
        assert writer.stats()["unchanged"] == 1
        # A compressed object with a flipped payload byte: corrupt, removed.
        name = writer.object_name(keys[0])
        sealed = envelope.encode(keys[0], views[0], config)
        damaged = bytearray(sealed.header + b"".join(sealed.payload))
        damaged[HEADER_BYTES + sealed.stored // 2] ^= 0x5A
        assert writer.client.batch_remove([name], True) == [0]
        assert writer.client.put(name, bytes(damaged)) == 0
        outcomes, _ = _mooncake_load(plain, keys[:1])
        assert str(outcomes[0]).startswith(
            f"mooncake tier 'mooncake': block {keys[0][0].hex()} shard 0 is corrupt ("
        )
        assert str(outcomes[0]).endswith("; it was removed")
        assert writer.lookup(keys[:1]) == [False]
        assert plain.stats()["corrupt"] == 1
    finally:
        writer.close()
        plain.close()
