"""Load GB/s of 2 MiB shards through the mooncake tier, against Mooncake's own
``batch_get_into`` of the same objects into the same registered memory, beside the fsspec tier
over S3 (a moto server on 127.0.0.1) and the posix tier.

A real ``mooncake_master`` runs on 127.0.0.1 (``harness.mooncake``). Two placements:

- remote segment (the pool's reason to exist): a second process, the "pool node", mounts a
  segment and dumps the shards through its own mooncake tier; this process is a pure client
  (``global_segment_size: 0``) and every read crosses the transfer engine (tcp over loopback).
- local segment: the pool node has left; this process mounts the segment and holds the shards,
  so Mooncake serves reads by copying within the process (memcpy speed).

Readers, in interleaved rounds that rotate who goes first: the tier's ``load`` of batches of
16 shards into page-aligned memory announced as host memory (what the CacheBuffer's slots are,
registered once), and ``batch_get_into`` called directly on the tier's own client for the same
objects, batches and registered memory. The tier checks each object's header and XXH3 checksum
on top of the transfer; that check is most of what it costs over the direct call, and it
matters most at memcpy speed. Figures are medians; the target is tier/direct >= 0.9.
"""

from __future__ import annotations

import mmap
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ..layout import Key, Layout
from ..native.pybuffer import buffer_address
from ..plugins import tier_types
from ..ranks import RankGroup
from ..testing import make_context
from ..tier import HOST_MEMORY_OPTION, Tier, TierContext
from . import BenchOptions, BenchResult, Figure, Plot, need_harness

SHARD_BYTES = 2 * 1024 * 1024
LAYOUT = Layout(shard_size=SHARD_BYTES, shards_per_block=1, tensor_sizes=(SHARD_BYTES,))
BATCH = 16
TARGET_RATIO = 0.9
POOL_NODE_TIMEOUT_S = 120.0
_SLOT_STRIDE = SHARD_BYTES + 4096
"""Direct reads take the whole object (header + shard): one page more per key."""


def _blocks(count: int) -> list[bytes]:
    return [b"mooncakebench" + index.to_bytes(3, "big") for index in range(count)]


def _payload(index: int) -> bytes:
    return (index.to_bytes(8, "big") * (SHARD_BYTES // 8))[:SHARD_BYTES]


def _mooncake_config(address: str, namespace: str, segment: int) -> dict[str, Any]:
    return {
        "type": "mooncake",
        "master_server_address": address,
        "local_hostname": "127.0.0.1",
        "key_prefix": namespace,
        "global_segment_size": segment,
    }


def _segment_for(count: int) -> int:
    return max(16 << 20, count * _SLOT_STRIDE * 5 // 4)


def _make(type_name: str, settings: dict[str, Any], context: TierContext | None = None) -> Tier:
    cls: type[Tier] = tier_types()[type_name]
    config = cls.config_model.model_validate({"type": type_name, **settings})
    return cls(config, context or make_context(LAYOUT))


def _fill(tier: Tier, blocks: Sequence[bytes]) -> None:
    for start in range(0, len(blocks), BATCH):
        keys = LAYOUT.keys_of_blocks(list(blocks[start : start + BATCH]))
        outcomes = tier.dump(keys, [[memoryview(_payload(start + i))] for i in range(len(keys))])
        if any(outcome is not None for outcome in outcomes):
            raise RuntimeError(f"benchmark setup: dump failed: {outcomes}")


def pool_node(address: str, namespace: str, count: int, conn: Any) -> None:
    """The pool node (a spawned process): mounts a segment, dumps the shards through its own
    mooncake tier, then stays up (its segment holds them) until told to leave."""
    tier = _make("mooncake", _mooncake_config(address, namespace, _segment_for(count)))
    try:
        _fill(tier, _blocks(count))
        conn.send("ready")
        conn.recv()
    finally:
        tier.close()
    conn.send("left")


def _load_all(tier: Tier, blocks: Sequence[bytes], slots: Sequence[memoryview]) -> float:
    started = time.perf_counter()
    for start in range(0, len(blocks), BATCH):
        keys: list[Key] = LAYOUT.keys_of_blocks(list(blocks[start : start + BATCH]))
        outcomes = tier.load(keys, [[slot] for slot in slots[: len(keys)]])
        if any(outcome is not None for outcome in outcomes):
            raise RuntimeError(f"load failed: {next(o for o in outcomes if o)}")
    return time.perf_counter() - started


def _direct_all(tier: Any, blocks: Sequence[bytes], base: int) -> float:
    """``batch_get_into`` of the same objects, batches and (registered) memory."""
    client = tier.client
    size = tier.object_bytes
    started = time.perf_counter()
    for start in range(0, len(blocks), BATCH):
        names = [tier.object_name((block, 0)) for block in blocks[start : start + BATCH]]
        addresses = [base + i * _SLOT_STRIDE for i in range(len(names))]
        results = client.batch_get_into(names, addresses, [size] * len(names))
        if any(int(result) != size for result in results):
            raise RuntimeError(f"batch_get_into failed: {list(results)}")
    return time.perf_counter() - started


def _rounds(
    readers: dict[str, Callable[[], float]],
    rounds: int,
    total: int,
    progress: Any,
    label: str,
    cpu: dict[str, float] | None = None,
) -> dict[str, list[float]]:
    """Sorted GB/s of each reader over the rounds; ``cpu`` receives each reader's CPU seconds
    per GB in this process (every thread: Mooncake's transfer threads too), which on a busy
    2-core machine says more about a reader's cost than its wall time."""
    for read in readers.values():  # one unmeasured pass each: connections, first touches
        read()
    gbs: dict[str, list[float]] = {name: [] for name in readers}
    cpu_s: dict[str, float] = dict.fromkeys(readers, 0.0)
    order = list(readers)
    for round_ in range(rounds):
        progress(f"mooncake_load: {label} round {round_ + 1}/{rounds}")
        shift = round_ % len(order)
        for name in order[shift:] + order[:shift]:
            started = time.process_time()
            gbs[name].append(total / readers[name]() / 1e9)
            cpu_s[name] += time.process_time() - started
    for values in gbs.values():
        values.sort()
    if cpu is not None:
        cpu.update({name: seconds / (rounds * total / 1e9) for name, seconds in cpu_s.items()})
    return gbs


def _median(values: list[float]) -> float:
    return values[len(values) // 2]


class _Memory:
    """Page-aligned destinations like buffer slots: the tier's, then the direct call's."""

    def __init__(self) -> None:
        self.tier_map = mmap.mmap(-1, BATCH * SHARD_BYTES)
        self.direct_map = mmap.mmap(-1, BATCH * _SLOT_STRIDE)
        tier_view, direct_view = memoryview(self.tier_map), memoryview(self.direct_map)
        self.slots = [tier_view[i * SHARD_BYTES : (i + 1) * SHARD_BYTES] for i in range(BATCH)]
        self.direct_base = buffer_address(direct_view)
        self.host_memory = (
            (buffer_address(tier_view), BATCH * SHARD_BYTES),
            (self.direct_base, BATCH * _SLOT_STRIDE),
        )

    def context(self) -> TierContext:
        return TierContext(
            layout=LAYOUT,
            unique_id="mooncake-bench",
            device_id=0,
            local_rank_size=1,
            position=1,
            options={HOST_MEMORY_OPTION: self.host_memory},
        )


def _mooncake_figures(
    options: BenchOptions, notes: list[str], count: int, rounds: int
) -> tuple[list[Figure], dict[str, float]]:
    need_harness("mooncake_load")
    from harness.mooncake import MooncakeMaster

    blocks = _blocks(count)
    total = count * SHARD_BYTES
    memory = _Memory()
    figures: list[Figure] = []
    medians: dict[str, float] = {}
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    with MooncakeMaster() as master:
        options.progress("mooncake_load: the pool node dumps the shards")
        with RankGroup(parties=1, join_timeout=POOL_NODE_TIMEOUT_S) as group:
            conn, child = group.context.Pipe()
            group.spawn(pool_node, master.address, namespace, count, child)
            if not conn.poll(POOL_NODE_TIMEOUT_S) or conn.recv() != "ready":
                raise RuntimeError("the pool node did not get ready")
            client = _make(
                "mooncake", _mooncake_config(master.address, namespace, 0), memory.context()
            )
            cpu: dict[str, float] = {}
            try:
                gbs = _rounds(
                    {
                        "tier": lambda: _load_all(client, blocks, memory.slots),
                        "direct": lambda: _direct_all(client, blocks, memory.direct_base),
                    },
                    rounds,
                    total,
                    options.progress,
                    "remote segment",
                    cpu,
                )
            finally:
                client.close()
            conn.send("leave")
            if not conn.poll(POOL_NODE_TIMEOUT_S) or conn.recv() != "left":
                raise RuntimeError("the pool node did not leave")
        medians["remote tier"], medians["remote direct"] = (
            _median(gbs["tier"]),
            _median(gbs["direct"]),
        )
        figures.append(
            Figure(
                name=f"mooncake tier load, remote segment over tcp ({total >> 20} MiB, "
                f"2 MiB shards, batches of {BATCH})",
                value=medians["remote tier"],
                unit="GB/s",
                baseline="Mooncake batch_get_into, same objects, client and registered memory",
                baseline_value=medians["remote direct"],
                target=f">= {TARGET_RATIO:g}x the direct call",
                target_ratio=TARGET_RATIO,
                extra={
                    "tier_best": gbs["tier"][-1],
                    "direct_best": gbs["direct"][-1],
                    "tier_cpu_s_per_gb": cpu["tier"],
                    "direct_cpu_s_per_gb": cpu["direct"],
                },
            )
        )
        options.progress("mooncake_load: this process holds the shards (local segment)")
        local = _make(
            "mooncake",
            _mooncake_config(master.address, namespace, _segment_for(count)),
            memory.context(),
        )
        try:
            _fill(local, blocks)
            gbs = _rounds(
                {
                    "tier": lambda: _load_all(local, blocks, memory.slots),
                    "direct": lambda: _direct_all(local, blocks, memory.direct_base),
                },
                rounds,
                total,
                options.progress,
                "local segment",
                cpu,
            )
        finally:
            local.close()
    medians["local tier"], medians["local direct"] = _median(gbs["tier"]), _median(gbs["direct"])
    figures.append(
        Figure(
            name=f"mooncake tier load, local segment ({total >> 20} MiB, 2 MiB shards)",
            value=medians["local tier"],
            unit="GB/s",
            baseline="Mooncake batch_get_into (an in-process copy), same objects and memory",
            baseline_value=medians["local direct"],
            target=f">= {TARGET_RATIO:g}x the direct call",
            target_ratio=TARGET_RATIO,
            extra={
                "tier_best": gbs["tier"][-1],
                "direct_best": gbs["direct"][-1],
                "tier_cpu_s_per_gb": cpu["tier"],
                "direct_cpu_s_per_gb": cpu["direct"],
            },
        )
    )
    notes.append(
        "the tier verifies each object's header and XXH3 checksum on top of the transfer, a "
        "second pass over the bytes (extra: CPU seconds per GB of each reader in this process): "
        "small beside a tcp transfer, large beside an in-process copy (local segment)"
    )
    return figures, medians


def _peer_gbs(options: BenchOptions, notes: list[str], count: int, rounds: int) -> dict[str, float]:
    """Median GB/s of the posix tier (O_DIRECT) and the fsspec tier over S3 (moto)."""
    blocks = _blocks(count)
    total = count * SHARD_BYTES
    destination = mmap.mmap(-1, BATCH * SHARD_BYTES)
    whole = memoryview(destination)
    slots = [whole[i * SHARD_BYTES : (i + 1) * SHARD_BYTES] for i in range(BATCH)]
    found: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="ucm-bench-mooncake-", dir=options.workdir) as root:
        options.progress("mooncake_load: posix tier")
        posix = _make("posix", {"path": f"{root}/nvme", "o_direct": True})
        try:
            _fill(posix, blocks)
            found["posix"] = _median(
                _rounds(
                    {"posix": lambda: _load_all(posix, blocks, slots)},
                    rounds,
                    total,
                    options.progress,
                    "posix",
                )["posix"]
            )
        finally:
            posix.close()
    try:
        need_harness("mooncake_load")
        from harness.s3 import shared_server

        server = shared_server()
    except Exception as exc:  # an optional peer: note why and go on
        notes.append(f"peer fsspec S3 skipped: {type(exc).__name__}: {exc}")
        return found
    options.progress("mooncake_load: fsspec tier over S3 (moto)")
    s3_blocks = blocks[: max(BATCH, count // 4)]  # moto is slow: fewer shards, same batches
    s3 = _make("fsspec", {"url": server.url(), "storage_options": server.storage_options})
    try:
        _fill(s3, s3_blocks)
        found["s3"] = _median(
            _rounds(
                {"s3": lambda: _load_all(s3, s3_blocks, slots)},
                max(2, rounds // 3),
                len(s3_blocks) * SHARD_BYTES,
                options.progress,
                "s3",
            )["s3"]
        )
    finally:
        s3.close()
    return found


class MooncakeLoadBenchmark:
    name = "mooncake_load"
    title = "mooncake tier load of 2 MiB shards vs Mooncake's batch_get_into; S3 and posix"

    def run(self, options: BenchOptions) -> BenchResult:
        need_harness("mooncake_load")
        from harness.mooncake import missing_reason, on_ci

        count = 16 if options.quick else 256
        rounds = 3 if options.quick else 9
        notes: list[str] = []
        figures: list[Figure] = []
        medians: dict[str, float] = {}
        reason = missing_reason()
        if reason is None:
            figures, medians = _mooncake_figures(options, notes, count, rounds)
        elif on_ci():
            raise RuntimeError(f"CI must run the mooncake benchmark: {reason}")
        else:
            notes.append(f"mooncake figures skipped: {reason}")
        peers = _peer_gbs(options, notes, min(count, 64), rounds)
        ours = medians.get("remote tier")
        for peer, label in (
            ("s3", "fsspec tier over S3 (moto on 127.0.0.1)"),
            ("posix", "posix tier, O_DIRECT"),
        ):
            if peer not in peers:
                continue
            if ours is not None:
                figures.append(
                    Figure(
                        name="mooncake tier load (remote segment) beside another lower tier",
                        value=ours,
                        unit="GB/s",
                        baseline=f"{label}, same shards and batches",
                        baseline_value=peers[peer],
                    )
                )
        if ours is None and {"s3", "posix"} <= set(peers):
            figures.append(
                Figure(
                    name="fsspec tier over S3 (moto) load, 2 MiB shards (no Mooncake here)",
                    value=peers["s3"],
                    unit="GB/s",
                    baseline="posix tier, O_DIRECT, same shards and batches",
                    baseline_value=peers["posix"],
                )
            )
        series: dict[str, tuple[list[float], list[float]]] = {}
        if medians:
            series["mooncake tier"] = ([1.0, 2.0], [medians["remote tier"], medians["local tier"]])
            series["batch_get_into direct"] = (
                [1.0, 2.0],
                [medians["remote direct"], medians["local direct"]],
            )
        for peer, label in (("s3", "fsspec S3 tier"), ("posix", "posix tier")):
            if peer in peers:
                series[label] = ([3.0], [peers[peer]])
        plot = Plot(
            filename="mooncake_load",
            title="Load GB/s, 2 MiB shards: 1 = remote segment, 2 = local segment, 3 = peers",
            xlabel="placement",
            ylabel="GB/s",
            series=series,
            kind="bar",
            logy=True,  # S3 through moto is ~50x slower than the rest
        )
        return BenchResult(name=self.name, figures=figures, plots=[plot], notes=notes)


BENCHMARK = MooncakeLoadBenchmark()
