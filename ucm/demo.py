"""``ucm demo``: UCM's main job on an embedded default stack.

Several rank processes (tensor parallelism: rank r holds shard r of every block) serve a stream of
requests whose prompts share prefixes, the way a prefix-caching inference server does: for each
request every rank asks how long a prefix is already cached, loads those blocks' KV shards instead
of recomputing them, "computes" the rest (deterministic bytes derived from the key) and dumps
them. Every loaded byte is checked against its key. The command prints hit rate and throughput.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import queue
import random
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .ranks import RankGroup

DEFAULT_STACK_YAML = """\
# The demo's embedded stack: the node-wide shared-memory CacheBuffer over local disk.
unique_id: {unique_id}
tensor_size_list: [131072, 131072]   # K and V: 256 KiB per shard
shards_per_block: 4                  # one shard per TP rank
tiers:
  - type: buffer
    capacity: {hot_capacity}
    reserved_slots: 64
  - type: posix
    name: disk
    path: {cold}
    write: through
"""


def shards_mismatch(shards_per_block: int, ranks: int) -> str:
    """Why a stack of ``shards_per_block`` does not suit a demo of ``ranks`` ranks."""
    return (
        f"shards_per_block is {shards_per_block}, but --ranks is {ranks}: the demo runs one "
        f"rank per shard; give --ranks {shards_per_block}, or leave shards_per_block out of "
        "the stack"
    )


@dataclass(frozen=True)
class DemoSettings:
    ranks: int = 4
    documents: int = 24
    blocks_per_document: int = 16
    requests: int = 60
    zipf_alpha: float = 1.1
    seed: int = 1
    hot_capacity_blocks: int = 128


@dataclass
class RankReport:
    rank: int
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    dumped_bytes: int = 0
    dump_seconds: float = 0.0
    verify_errors: int = 0
    load_failures: int = 0
    errors: list[str] = field(default_factory=list)


def block_id(document: int, index: int) -> bytes:
    """Chained prefix hash, as runtimes derive block ids: equal prefixes, equal ids."""
    digest = b"ucm-demo"
    for i in range(index + 1):
        digest = hashlib.blake2b(digest + f"{document}:{i}".encode(), digest_size=16).digest()
    return digest


def shard_payload(block: bytes, shard: int, nbytes: int) -> bytes:
    """Deterministic bytes for (block, shard): what the "model" would compute."""
    seed = hashlib.blake2b(block + shard.to_bytes(4, "little"), digest_size=32).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def request_stream(settings: DemoSettings) -> list[list[bytes]]:
    rng = random.Random(settings.seed)
    weights = [1.0 / (d + 1) ** settings.zipf_alpha for d in range(settings.documents)]
    stream = []
    for _ in range(settings.requests):
        document = rng.choices(range(settings.documents), weights)[0]
        length = rng.randint(settings.blocks_per_document // 2, settings.blocks_per_document)
        stream.append([block_id(document, i) for i in range(length)])
    return stream


def _rank_main(
    rank: int,
    stack: dict[str, Any],
    settings: DemoSettings,
    barrier: Any,
    progress: Any,
    results: Any,
) -> None:
    import torch

    import ucm
    from ucm.errors import TaskError

    report = RankReport(rank=rank)
    try:
        with ucm.open(stack, device_id=rank, local_rank_size=settings.ranks) as store:
            sizes = store.layout.tensor_sizes
            shard_size = store.layout.shard_size
            # A runtime's paged KV cache is allocated once: loads land in resident pages.
            kv_pages = [
                [torch.zeros(n, dtype=torch.uint8) for n in sizes]
                for _ in range(settings.blocks_per_document)
            ]
            for blocks in request_stream(settings):
                barrier.wait(timeout=120)
                report.requests += 1
                report.blocks += len(blocks)
                cached = store.lookup_on_prefix(blocks) + 1
                hit_blocks = blocks[:cached]
                dst = kv_pages[: len(hit_blocks)]
                failed: set[bytes] = set()
                if hit_blocks:
                    start = time.perf_counter()
                    task = store.load(hit_blocks, rank, dst)
                    try:
                        store.wait(task)
                    except TaskError as exc:
                        failed = {key[0] for key in exc.failures}
                        report.load_failures += len(failed)
                    report.load_seconds += time.perf_counter() - start
                for block, tensors in zip(hit_blocks, dst, strict=True):
                    if block in failed:
                        continue
                    # Read the tensors' bytes without numpy (torch does not require it).
                    data = b"".join(ctypes.string_at(t.data_ptr(), t.numel()) for t in tensors)
                    if data != shard_payload(block, rank, shard_size):
                        report.verify_errors += 1
                    report.loaded_bytes += shard_size
                report.hit_blocks += len(hit_blocks) - len(failed)
                compute = [b for b in blocks[cached:]] + sorted(failed)
                if compute:
                    src = []
                    for block in compute:
                        payload = shard_payload(block, rank, shard_size)
                        tensors, offset = [], 0
                        for n in sizes:
                            chunk = bytearray(payload[offset : offset + n])
                            tensors.append(torch.frombuffer(chunk, dtype=torch.uint8))
                            offset += n
                        src.append(tensors)
                    start = time.perf_counter()
                    store.wait(store.dump(compute, rank, src))
                    report.dump_seconds += time.perf_counter() - start
                    report.dumped_bytes += shard_size * len(compute)
                progress.put(rank)
            barrier.wait(timeout=120)
    except Exception as exc:  # reported to the parent, which fails the command
        report.errors.append(f"{type(exc).__name__}: {exc}")
        barrier.abort()
    results.put(asdict(report))


def run_demo(
    settings: DemoSettings, stack: Mapping[str, Any] | None = None, workdir: str | None = None
) -> list[RankReport]:
    """Runs the workload in ``settings.ranks`` processes and returns their reports; on
    ``stack`` (a stack's mapping, whose ``shards_per_block`` must be ``settings.ranks``: one
    rank per shard) or else on the embedded one."""
    import yaml
    from rich.progress import Progress

    from .errors import ConfigError
    from .stack import load_stack

    with tempfile.TemporaryDirectory(prefix="ucm-demo-", dir=workdir) as cold_dir:
        if stack is None:
            text = DEFAULT_STACK_YAML.format(
                unique_id=f"ucm-demo-{os.getpid()}",
                cold=cold_dir,
                hot_capacity=settings.hot_capacity_blocks * settings.ranks * 256 * 1024,
            )
            stack = {**yaml.safe_load(text), "shards_per_block": settings.ranks}
        stack = dict(stack)
        config = load_stack(stack)  # validate before starting processes
        if config.shards_per_block != settings.ranks:
            raise ConfigError(shards_mismatch(config.shards_per_block, settings.ranks))
        total = settings.requests * settings.ranks
        reports: list[RankReport] = []
        with RankGroup(parties=settings.ranks) as group, Progress(transient=True) as bar:
            progress_queue = group.queue()
            for rank in range(settings.ranks):
                group.spawn(
                    _rank_main,
                    rank,
                    stack,
                    settings,
                    group.barrier,
                    progress_queue,
                    group.results,
                    name=f"ucm-demo-rank{rank}",
                )
            job = bar.add_task("serving requests", total=total)

            def advance() -> None:
                with contextlib.suppress(queue.Empty):
                    while True:
                        progress_queue.get_nowait()
                        bar.advance(job)

            # A rank that died before reporting is listed below as "no report".
            arrived = group.reports(timeout=600, partial=True, tick=advance)
            reports = [RankReport(**report) for report in arrived]
        missing = set(range(settings.ranks)) - {report.rank for report in reports}
        reports += [RankReport(rank=rank, errors=["no report"]) for rank in sorted(missing)]
        return sorted(reports, key=lambda r: r.rank)
