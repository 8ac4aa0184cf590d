"""posix tier sequential load against ``dd`` reading the same bytes on the same filesystem.

Neither may be served from the page cache, and dropping caches is not an option on a shared
machine, so both bypass it: the posix tier with ``o_direct: true`` and ``dd iflag=direct``. The
tier reads blocks of 8 shards of 256 KiB (2 MiB) in batches of 16 blocks into page-aligned
destinations (what buffer slots are); ``dd`` reads one file holding the same bytes with
``bs=2M``. A third reader, a bare loop over the tier's own block files into the same
destinations (open, one preadv, close; no checksum), separates the tier's own cost from the
layout's. After one unmeasured pass of each, the rounds interleave the readers and rotate
which goes first. The figure is the tier's median GB/s as a fraction of dd's (target >= 0.8).

Peer: the fsspec tier over ``file://`` (page cache, warm) against fsspec's own ``blockcache``
over the same objects, when it can be set up.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..layout import Key, Layout
from ..plugins import tier_types
from ..testing import make_context
from ..tier import Tier
from . import BenchOptions, BenchResult, Figure, Plot

SHARD_BYTES = 256 * 1024
SHARDS_PER_BLOCK = 8
LAYOUT = Layout(
    shard_size=SHARD_BYTES, shards_per_block=SHARDS_PER_BLOCK, tensor_sizes=(SHARD_BYTES,)
)
BLOCKS_PER_BATCH = 16
TARGET_RATIO = 0.8
DD_TIMEOUT_S = 300.0


def _make(type_name: str, settings: dict[str, object]) -> Tier:
    cls: type[Tier] = tier_types()[type_name]
    config = cls.config_model.model_validate({"type": type_name, **settings})
    return cls(config, make_context(LAYOUT))


def _blocks(count: int) -> list[bytes]:
    return [b"posixread" + index.to_bytes(7, "big") for index in range(count)]


def _payload(index: int) -> bytes:
    # Cheap, distinct per shard (content does not matter to the disk, only that it is real).
    return (index.to_bytes(8, "big") * (SHARD_BYTES // 8))[:SHARD_BYTES]


def _fill(tier: Tier, blocks: Sequence[bytes]) -> None:
    for start in range(0, len(blocks), BLOCKS_PER_BATCH):
        keys = LAYOUT.keys_of_blocks(list(blocks[start : start + BLOCKS_PER_BATCH]))
        sources = [[memoryview(_payload(start * SHARDS_PER_BLOCK + i))] for i in range(len(keys))]
        outcomes = tier.dump(keys, sources)
        if any(o is not None for o in outcomes):
            raise RuntimeError(f"benchmark setup: dump failed: {outcomes}")


def _load_all(tier: Tier, blocks: Sequence[bytes], destination: mmap.mmap) -> float:
    """Loads every shard of the blocks, batch after batch; returns the seconds taken."""
    whole = memoryview(destination)
    batch_keys = BLOCKS_PER_BATCH * SHARDS_PER_BLOCK
    views = [[whole[i * SHARD_BYTES : (i + 1) * SHARD_BYTES]] for i in range(batch_keys)]
    started = time.perf_counter()
    for start in range(0, len(blocks), BLOCKS_PER_BATCH):
        keys: list[Key] = LAYOUT.keys_of_blocks(list(blocks[start : start + BLOCKS_PER_BATCH]))
        outcomes = tier.load(keys, views[: len(keys)])
        if any(o is not None for o in outcomes):
            raise RuntimeError(f"posix load failed: {next(o for o in outcomes if o)}")
    return time.perf_counter() - started


def _bare_loop(paths: Sequence[str], destination: mmap.mmap, tail_bytes: int) -> float:
    """Seconds a bare loop takes to read the same block files into the same destinations, the
    way the tier does (open with O_DIRECT, one preadv of the shards and the footer, close), on
    one thread, with nothing else: no footer decoding, no checksum, no thread pool."""
    whole = memoryview(destination)
    block_bytes = SHARDS_PER_BLOCK * SHARD_BYTES
    slots = [whole[i * block_bytes : (i + 1) * block_bytes] for i in range(BLOCKS_PER_BATCH)]
    tail = mmap.mmap(-1, tail_bytes)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT
    started = time.perf_counter()
    for index, path in enumerate(paths):
        fd = os.open(path, flags)
        try:
            os.preadv(fd, [slots[index % BLOCKS_PER_BATCH], tail], 0)
        finally:
            os.close(fd)
    elapsed = time.perf_counter() - started
    tail.close()
    return elapsed


def _dd(path: str) -> float:
    """Seconds ``dd iflag=direct bs=2M`` takes to read ``path``, as dd itself reports them
    (process start-up excluded, which only makes dd look faster)."""
    done = subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=2M", "iflag=direct"],
        capture_output=True,
        text=True,
        timeout=DD_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"dd failed: {done.stderr.strip()}")
    # e.g. "134217728 bytes (134 MB, 128 MiB) copied, 0.105843 s, 1.3 GB/s"
    match = re.search(r"copied, ([0-9.eE+-]+) s", done.stderr)
    if match is None:
        raise RuntimeError(f"cannot read dd's time from: {done.stderr.strip()!r}")
    return float(match.group(1))


def _write_plain(path: str, blocks: int) -> int:
    with open(path, "wb") as handle:
        for index in range(blocks * SHARDS_PER_BLOCK):
            handle.write(_payload(index))
        handle.flush()
        os.fsync(handle.fileno())
    return blocks * SHARDS_PER_BLOCK * SHARD_BYTES


def _posix_vs_dd(options: BenchOptions, notes: list[str]) -> tuple[list[Figure], Plot]:
    blocks = _blocks(64 if options.quick else 256)  # 128 MiB / 512 MiB
    rounds = 7 if options.quick else 9
    with tempfile.TemporaryDirectory(prefix="ucm-bench-posix-", dir=options.workdir) as root:
        tier = _make("posix", {"path": f"{root}/nvme", "o_direct": True})  # default io_threads
        try:
            if not tier.stats().get("o_direct_active"):
                notes.append("posix: O_DIRECT not active on this filesystem; figures are cached")
            options.progress("posix_read: writing the block files")
            _fill(tier, blocks)
            plain = f"{root}/plain.bin"
            total = _write_plain(plain, len(blocks))
            destination = mmap.mmap(-1, BLOCKS_PER_BATCH * SHARDS_PER_BLOCK * SHARD_BYTES)
            posix: Any = tier  # the posix tier's own attributes, beyond the Tier API
            paths = [posix.block_path(block) for block in blocks]
            tail_bytes = posix.file_size - SHARDS_PER_BLOCK * SHARD_BYTES
            readers: dict[str, Callable[[], float]] = {
                "dd": lambda: _dd(plain),
                "tier": lambda: _load_all(tier, blocks, destination),
                "bare": lambda: _bare_loop(paths, destination, tail_bytes),
            }
            gbs: dict[str, list[float]] = {name: [] for name in readers}
            # One unmeasured pass of each first: every set of bytes has then been written and
            # read once, whatever a cache below the filesystem (a VM host's) kept of either.
            options.progress("posix_read: one unmeasured pass of each reader")
            for read in readers.values():
                read()
            order = list(readers)
            for round_ in range(rounds):
                # Interleaved, so all see the same machine load, and rotating who goes first,
                # so none always follows the same reader's I/O.
                options.progress(f"posix_read: round {round_ + 1}/{rounds}")
                for name in order[round_ % 3 :] + order[: round_ % 3]:
                    gbs[name].append(total / readers[name]() / 1e9)
            destination.close()
            tier_gbs, dd_gbs, bare_gbs = gbs["tier"], gbs["dd"], gbs["bare"]
        finally:
            tier.close()
    for values in (tier_gbs, dd_gbs, bare_gbs):
        values.sort()
    figure = Figure(
        name=f"posix tier sequential load, O_DIRECT ({total >> 20} MiB, 2 MiB blocks)",
        value=tier_gbs[len(tier_gbs) // 2],
        unit="GB/s",
        baseline="dd iflag=direct bs=2M, same bytes, same filesystem",
        baseline_value=dd_gbs[len(dd_gbs) // 2],
        target=f">= {TARGET_RATIO:g}x dd",
        target_ratio=TARGET_RATIO,
        extra={"rounds": float(rounds), "tier_best": tier_gbs[-1], "dd_best": dd_gbs[-1]},
    )
    bare = Figure(
        name="posix tier vs a bare read loop over its own block files, same destinations",
        value=tier_gbs[len(tier_gbs) // 2],
        unit="GB/s",
        baseline="open + one O_DIRECT preadv + close per block file, one thread, no checksum",
        baseline_value=bare_gbs[len(bare_gbs) // 2],
        extra={"bare_best": bare_gbs[-1]},
    )
    plot = Plot(
        filename="posix_read",
        title="posix tier sequential load vs dd (O_DIRECT)",
        xlabel="round (sorted)",
        ylabel="GB/s",
        series={
            "posix tier": ([float(i) for i in range(rounds)], tier_gbs),
            "bare read loop, same files": ([float(i) for i in range(rounds)], bare_gbs),
            "dd": ([float(i) for i in range(rounds)], dd_gbs),
        },
    )
    return [figure, bare], plot


def _fsspec_vs_blockcache(options: BenchOptions, notes: list[str]) -> list[Figure]:
    try:
        import fsspec  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        notes.append("peer fsspec blockcache skipped: fsspec not installed")
        return []
    blocks = _blocks(16 if options.quick else 64)
    with tempfile.TemporaryDirectory(prefix="ucm-bench-fsspec-", dir=options.workdir) as root:
        tier: Any = _make("fsspec", {"url": f"file://{root}/objects", "io_threads": 4})
        try:
            options.progress("posix_read: fsspec tier over file:// and blockcache")
            _fill(tier, blocks)
            keys = LAYOUT.keys_of_blocks(blocks)
            paths = [tier.object_path(key) for key in keys]
            total = len(keys) * SHARD_BYTES
            destination = mmap.mmap(-1, BLOCKS_PER_BATCH * SHARDS_PER_BLOCK * SHARD_BYTES)
            _load_all(tier, blocks, destination)  # warm the page cache for both readers
            tier_s = min(_load_all(tier, blocks, destination) for _ in range(3))
            destination.close()
        finally:
            tier.close()
        try:
            cache = f"{root}/blockcache"
            fs = fsspec.filesystem(
                "blockcache", target_protocol="file", cache_storage=cache, check_files=False
            )
            for path in paths:  # first pass fills the block cache
                with fs.open(path, "rb") as handle:
                    handle.read()
            peer_s = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                for path in paths:
                    with fs.open(path, "rb") as handle:
                        handle.read()
                peer_s = min(peer_s, time.perf_counter() - started)
        except Exception as exc:  # an optional peer: note why and go on
            notes.append(f"peer fsspec blockcache skipped: {type(exc).__name__}: {exc}")
            return []
        finally:
            shutil.rmtree(f"{root}/blockcache", ignore_errors=True)
    return [
        Figure(
            name="fsspec tier over file://, warm page cache",
            value=total / tier_s / 1e9,
            unit="GB/s",
            baseline="fsspec blockcache::file:// (peer), warm",
            baseline_value=total / peer_s / 1e9,
            extra={"bytes": float(total)},
        )
    ]


class PosixReadBenchmark:
    name = "posix_read"
    title = "posix tier sequential load vs dd (O_DIRECT); fsspec tier vs fsspec blockcache"

    def run(self, options: BenchOptions) -> BenchResult:
        notes = [
            "both sides bypass the page cache with O_DIRECT (dropping caches is not an option "
            "on a shared machine); dd reads one file holding the same bytes as the block files",
            "after one unmeasured pass of each, rounds interleave the readers and rotate who "
            "goes first; the bare loop reads the tier's own files into the tier's "
            "destinations, so tier/bare is the tier's own cost and bare/dd the layout's and "
            "the memory's (dd reads into one freshly mapped 2 MiB buffer)",
        ]
        figures, plot = _posix_vs_dd(options, notes)
        figures += _fsspec_vs_blockcache(options, notes)
        return BenchResult(name=self.name, figures=figures, plots=[plot], notes=notes)


BENCHMARK = PosixReadBenchmark()
