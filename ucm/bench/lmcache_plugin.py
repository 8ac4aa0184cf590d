"""LMCache with UCM as its storage plugin, beside LMCache's own LocalCPU and LocalDisk backends
(issue 14), all in one run through the real lmcache package.

Figures, each beside its same-run baseline:

- **retrieve GB/s**: LMCache's retrieve path for N chunks (2 MiB each) into a paged host KV
  cache, as ``LMCacheEngine.retrieve`` runs it: ``StorageManager.get_block_mapping``, one
  ``batched_get`` per location, then the GPU connector's ``batched_to_gpu``
  (``harness.lmcache.CpuKVConnector``) and the release of the objects. LMCacheEngine itself
  is not built: its token database imports vLLM when vLLM is installed (10-20 s here), the same
  for every backend. The chunks are held by LocalCPU (LMCache's L1 hot cache: its retrieve is one
  copy per chunk into the KV cache), LocalDisk (one file per chunk, page cache warm, L1 off), UCM
  over a buffer and posix (the plugin; L1 off, so every chunk comes from UCM's CacheBuffer) and
  UCM on posix alone (files, like LocalDisk). The median of several rounds, the backends
  interleaved round by round, the first round unmeasured and checked byte-exact;
- **batched_remove of 10,000 keys**: ``StorageManager.batched_remove(keys, locations=[name])``
  on each backend holding the keys: UCM over a buffer and posix beside LocalDisk and LocalCPU,
  UCM on a buffer alone (memory only) beside LocalCPU. Lock acquisitions go in ``extra`` (UCM:
  its pin lock and the posix tier's lock, one per 1,024-key chunk; LocalCPU and LocalDisk:
  LMCache 0.5.6's per-key loop, counted on their locks in a separate, untimed pass), and so
  does UCM's own ``Store.remove`` of the same keys without LMCache (``store_remove_ms``).

Quick mode uses fewer chunks and rounds and 1,000 keys (the result's notes say so). Without
lmcache (outside CI) the benchmark measures UCM's own load path for the same chunks and says so
in a note; in CI a missing lmcache is an error.
"""

from __future__ import annotations

import importlib.util
import math
import os
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..tier import REMOVE_CHUNK_KEYS
from . import BenchOptions, BenchResult, Figure, Plot, need_harness

MODEL = "ucm-bench/lmcache"
# Retrieve geometry: 8 layers, 4 KV heads of 64, bf16, 256-token chunks = 2 MiB per chunk.
LAYERS = 8
HEADS = 4
HEAD_SIZE = 64
CHUNK_TOKENS = 256
RETRIEVE_CHUNKS = 48
QUICK_RETRIEVE_CHUNKS = 8
ROUNDS = 5
QUICK_ROUNDS = 2
# Removal geometry: small chunks (4 KiB), because the work is per key, not per byte.
REMOVE_KEYS = 10_000
QUICK_REMOVE_KEYS = 1_000
REMOVE_ROUNDS = 3
REMOVE_CHUNK_TOKENS = 16
COUNT_KEYS = 1_000
"""Keys of the untimed pass that counts LMCache's own lock acquisitions (a fifth in quick)."""
PUT_BATCH = 1_000
WRITE_TIMEOUT_S = 300.0


def _lmcache_available() -> bool:
    return importlib.util.find_spec("lmcache") is not None


class LmcachePluginBenchmark:
    name = "lmcache_plugin"
    title = "LMCache with UCM as its storage plugin vs LMCache's LocalCPU and LocalDisk"

    def run(self, options: BenchOptions) -> BenchResult:
        if not _lmcache_available():
            if os.environ.get("CI"):
                raise RuntimeError(
                    "lmcache is not installed: CI installs it (bash tools/install-test-env)"
                )
            return _without_lmcache(options)
        with warnings.catch_warnings():
            # Each LMCache logger gets a handler opentelemetry deprecates; not ours to fix.
            warnings.simplefilter("ignore", DeprecationWarning)
            os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
            return _Run(options).run()


BENCHMARK = LmcachePluginBenchmark()


# ---- with lmcache ---------------------------------------------------------------------------


@dataclass
class _Backend:
    label: str
    manager: Any
    """LMCache's StorageManager holding the backend."""
    name: str
    """The StorageManager's name of the backend that holds the chunks."""


class _Run:
    def __init__(self, options: BenchOptions) -> None:
        self.options = options
        self.quick = options.quick
        self.notes: list[str] = []
        self.workdir = options.workdir or tempfile.gettempdir()

    def run(self) -> BenchResult:
        import torch

        torch.set_num_threads(1)  # the same one copy thread for every backend
        figures: list[Figure] = []
        plots: list[Plot] = []
        retrieve = self._retrieve()
        ucm_buffer = retrieve["UCM buffer+posix"]
        for baseline in ("LocalCPU", "LocalDisk"):
            figures.append(
                Figure(
                    name="LMCache retrieve, UCM plugin (buffer over posix)",
                    value=ucm_buffer,
                    unit="GB/s",
                    baseline=f"LMCache {baseline}",
                    baseline_value=retrieve[baseline],
                )
            )
        figures.append(
            Figure(
                name="LMCache retrieve, UCM plugin (posix only)",
                value=retrieve["UCM posix"],
                unit="GB/s",
                baseline="LMCache LocalDisk",
                baseline_value=retrieve["LocalDisk"],
            )
        )
        labels = list(retrieve)
        plots.append(
            Plot(
                filename="lmcache_retrieve",
                title=f"LMCache retrieve of {self._chunks()} chunks (2 MiB each)",
                xlabel="backend",
                ylabel="GB/s",
                series={label: ([float(i)], [retrieve[label]]) for i, label in enumerate(labels)},
                kind="bar",
            )
        )
        removal = self._removal()
        keys = self._remove_keys()
        pairs = [
            ("UCM buffer+posix", "LocalDisk"),
            ("UCM buffer+posix", "LocalCPU"),
            ("UCM buffer", "LocalCPU"),
        ]
        for ours, baseline in pairs:
            ours_s, ours_extra = removal[ours]
            base_s, base_extra = removal[baseline]
            figures.append(
                Figure(
                    name=f"batched_remove of {keys:,} keys, UCM plugin ({_STACKS[ours]})",
                    value=ours_s * 1e3,
                    unit="ms",
                    baseline=f"LMCache {baseline}",
                    baseline_value=base_s * 1e3,
                    higher_is_better=False,
                    extra={**ours_extra, **{f"baseline_{k}": v for k, v in base_extra.items()}},
                )
            )
        plots.append(
            Plot(
                filename="lmcache_batched_remove",
                title=f"batched_remove of {keys:,} keys through LMCache's StorageManager",
                xlabel="backend",
                ylabel="ms",
                series={
                    label: ([float(i)], [seconds * 1e3])
                    for i, (label, (seconds, _)) in enumerate(removal.items())
                },
                kind="bar",
            )
        )
        self.notes.append(
            "LocalCPU's retrieve is one copy per chunk from its hot cache into the KV cache; the "
            "other backends first read the chunk into a fresh LMCache MemoryObj (UCM from its "
            "CacheBuffer or posix files, LocalDisk from its files with a warm page cache)"
        )
        return BenchResult(name=BENCHMARK.name, figures=figures, plots=plots, notes=self.notes)

    # ---- retrieve ---------------------------------------------------------------------------

    def _chunks(self) -> int:
        return QUICK_RETRIEVE_CHUNKS if self.quick else RETRIEVE_CHUNKS

    def _retrieve(self) -> dict[str, float]:
        import torch
        from lmcache.utils import CacheEngineKey

        need_harness("lmcache_plugin")
        from harness.lmcache import CpuKVConnector

        chunks = self._chunks()
        tokens = chunks * CHUNK_TOKENS
        hidden = HEADS * HEAD_SIZE
        chunk_bytes = 2 * LAYERS * CHUNK_TOKENS * hidden * 2
        data_gb = chunks * chunk_bytes / 1e9
        pool_gb = 2.2 * chunks * chunk_bytes / 1024**3
        generator = torch.Generator().manual_seed(14)
        src = [torch.randn(2, tokens, hidden, generator=generator).to(torch.bfloat16)]
        src += [src[0].roll(layer + 1, dims=1) for layer in range(LAYERS - 1)]
        slots = torch.randperm(tokens, generator=generator)
        dst = [torch.empty_like(cache) for cache in src]
        connector = CpuKVConnector(LAYERS, hidden)
        kv = {"slot_mapping": slots}
        keys = [CacheEngineKey(MODEL, 1, 0, 7_000 + i, torch.bfloat16) for i in range(chunks)]
        starts = [i * CHUNK_TOKENS for i in range(chunks)]
        ends = [start + CHUNK_TOKENS for start in starts]
        infos = list(zip(keys, starts, ends, strict=True))
        capacity = 2 * chunks * chunk_bytes
        rounds = QUICK_ROUNDS if self.quick else ROUNDS
        with self._backends(pool_gb, capacity) as backends:
            for backend in backends:
                self.options.progress(f"lmcache_plugin: storing {chunks} chunks in {backend.label}")
                manager = backend.manager
                meta = manager.metadata
                objs = [manager.allocate(meta.get_shapes(), meta.get_dtypes()) for _ in keys]
                if any(obj is None for obj in objs):
                    raise RuntimeError("benchmark set-up: LMCache's CPU pool is full")
                connector.batched_from_gpu(objs, starts, ends, kvcaches=src, **kv)
                manager.batched_put(keys, objs)
                _wait_written(manager, backend.name, keys)
            samples: dict[str, list[float]] = {backend.label: [] for backend in backends}
            for round_ in range(rounds + 1):  # round 0 warms up (first-touch faults) unmeasured
                self.options.progress(f"lmcache_plugin: retrieve round {round_}/{rounds}")
                order = backends[round_ % len(backends) :] + backends[: round_ % len(backends)]
                for backend in order:
                    for cache in dst:
                        cache.zero_()
                    started = time.perf_counter()
                    got = _retrieve_into(backend.manager, connector, infos, dst, kv)
                    elapsed = time.perf_counter() - started
                    if got != {backend.name: chunks}:
                        raise RuntimeError(f"{backend.label}: retrieved {got}, not {chunks}")
                    if round_ == 0 and not all(
                        torch.equal(d.view(torch.int16), s.view(torch.int16))
                        for d, s in zip(dst, src, strict=True)
                    ):
                        raise RuntimeError(f"{backend.label}: retrieved KV is not byte-exact")
                    if round_:
                        samples[backend.label].append(elapsed)
        return {label: data_gb / sorted(s)[len(s) // 2] for label, s in samples.items()}

    @contextmanager
    def _backends(self, pool_gb: float, capacity: int) -> Iterator[list[_Backend]]:
        workdir = tempfile.mkdtemp(prefix="lmcache-retrieve-", dir=self.workdir)
        specs: list[tuple[str, str, dict[str, Any]]] = [
            ("LocalCPU", "LocalCPUBackend", {"local_cpu": True}),
            (
                "LocalDisk",
                "LocalDiskBackend",
                {
                    "local_cpu": False,
                    "local_disk": f"file://{workdir}/lmcache-disk/",
                    "max_local_disk_size": 4 * capacity / 1024**3,
                },
            ),
            ("UCM buffer+posix", "ucm", _plugin(_stack(workdir, "ucm-buffer", capacity))),
            ("UCM posix", "ucm", _plugin(_stack(workdir, "ucm-posix", None))),
        ]
        made: list[_Backend] = []
        try:
            for label, name, settings in specs:
                manager = _manager(
                    _config(CHUNK_TOKENS, pool_gb, settings),
                    _metadata(CHUNK_TOKENS, LAYERS, HEADS, HEAD_SIZE),
                )
                made.append(_Backend(label, manager, name))
                if name not in manager.storage_backends:
                    raise RuntimeError(f"LMCache did not create {label} ({name})")
            yield made
        finally:
            for backend in made:
                backend.manager.close()

    # ---- batched_remove ---------------------------------------------------------------------

    def _remove_keys(self) -> int:
        return QUICK_REMOVE_KEYS if self.quick else REMOVE_KEYS

    def _removal(self) -> dict[str, tuple[float, dict[str, float]]]:
        n = self._remove_keys()
        if self.quick:
            self.notes.append(
                f"quick mode: batched_remove of {n:,} keys, one round (the full run removes "
                f"{REMOVE_KEYS:,}, median of {REMOVE_ROUNDS})"
            )
        rounds = 1 if self.quick else REMOVE_ROUNDS
        workdir = tempfile.mkdtemp(prefix="lmcache-remove-", dir=self.workdir)
        chunk_bytes = 2 * 1 * REMOVE_CHUNK_TOKENS * 64 * 2
        pool_gb = 1.5 * n * chunk_bytes / 1024**3 + 0.01
        disk = {
            "local_cpu": False,
            "local_disk": f"file://{workdir}/lmcache-disk/",
            "max_local_disk_size": 4 * n * chunk_bytes / 1024**3,
        }
        buffer_bytes = 2 * n * chunk_bytes
        specs: list[tuple[str, str, dict[str, Any]]] = [
            ("LocalCPU", "LocalCPUBackend", {"local_cpu": True}),
            ("LocalDisk", "LocalDiskBackend", disk),
            ("UCM buffer+posix", "ucm", _plugin(_stack(workdir, "ucm", buffer_bytes))),
            ("UCM buffer", "ucm", _plugin(_stack(workdir, None, buffer_bytes))),
        ]
        results: dict[str, tuple[float, dict[str, float]]] = {}
        for label, name, settings in specs:
            manager = _manager(
                _config(REMOVE_CHUNK_TOKENS, pool_gb, settings),
                _metadata(REMOVE_CHUNK_TOKENS, 1, 1, 64),
            )
            try:
                backend = manager.storage_backends[name]
                runs = []
                extra: dict[str, float] = {"keys": float(n), "rounds": float(rounds)}
                for round_ in range(rounds):
                    self.options.progress(
                        f"lmcache_plugin: batched_remove {label} round {round_ + 1}/{rounds}"
                    )
                    keys = _put_keys(manager, name, n, seed=round_)
                    before = _ucm_locks(backend) if name == "ucm" else None
                    started = time.perf_counter()
                    removed = manager.batched_remove(keys, locations=[name])
                    runs.append(time.perf_counter() - started)
                    if removed != n:
                        raise RuntimeError(f"{label}: batched_remove removed {removed} of {n}")
                    if before is not None:
                        after = _ucm_locks(backend)
                        extra["lock_acquisitions"] = float(after[0] - before[0])
                        if after[1] >= 0:
                            extra["posix_lock_acquisitions"] = float(after[1] - before[1])
                        extra["expected_lock_acquisitions"] = float(
                            math.ceil(n / REMOVE_CHUNK_KEYS)
                        )
                if name == "ucm":
                    # The same removal straight through UCM's Store (no LMCache, no plugin):
                    # what of the time is the store's and its tiers'.
                    keys = _put_keys(manager, name, n, seed=rounds)
                    blocks = [backend.ucm_key(key)[0] for key in keys]
                    started = time.perf_counter()
                    removed = backend.store.remove(blocks)
                    extra["store_remove_ms"] = (time.perf_counter() - started) * 1e3
                    if removed != n:
                        raise RuntimeError(f"{label}: Store.remove removed {removed} of {n}")
                else:
                    count = COUNT_KEYS // 5 if self.quick else COUNT_KEYS
                    locks = _count_lmcache_locks(manager, name, backend, count)
                    extra["lock_acquisitions_per_key"] = locks / count
                results[label] = (sorted(runs)[len(runs) // 2], extra)
            finally:
                manager.close()
        return results


def _retrieve_into(
    manager: Any, connector: Any, infos: list[Any], dst: list[Any], kv: dict[str, Any]
) -> dict[str, int]:
    """LMCacheEngine.retrieve's data path (``_process_tokens_internal``, then
    ``batched_to_gpu``): the block mapping, one ``batched_get`` per location, the copy into the
    KV cache, and the release of the objects. Returns the chunks retrieved per location."""
    got: dict[str, int] = {}
    for location, blocks in manager.get_block_mapping(infos).items():
        objs = manager.batched_get([key for key, _, _ in blocks], location=location)
        if any(obj is None for obj in objs):
            raise RuntimeError(f"{location}: a chunk LMCache mapped there did not come back")
        starts = [start for _, start, _ in blocks]
        ends = [end for _, _, end in blocks]
        connector.batched_to_gpu(objs, starts, ends, kvcaches=dst, **kv)
        for obj in objs:
            obj.ref_count_down()
        got[location] = len(objs)
    return got


def _wait_written(manager: Any, name: str, keys: list[Any]) -> None:
    """Stores are asynchronous for LocalDisk and UCM: wait until every chunk is written."""
    backend = manager.storage_backends[name]
    if hasattr(backend, "flush") and not backend.flush(timeout_s=WRITE_TIMEOUT_S):
        raise RuntimeError(f"benchmark set-up: {name} writes did not finish")
    deadline = time.monotonic() + WRITE_TIMEOUT_S
    while backend.batched_contains(keys) < len(keys):
        if time.monotonic() > deadline:
            raise RuntimeError(f"benchmark set-up: {name} holds fewer than {len(keys)} chunks")
        time.sleep(0.01)


def _put_keys(manager: Any, name: str, n: int, seed: int) -> list[Any]:
    """Stores ``n`` small chunks in the backend ``name``; returns their keys once written."""
    import torch
    from lmcache.utils import CacheEngineKey

    meta = manager.metadata
    keys = [
        CacheEngineKey(meta.model_name, 1, 0, seed * 1_000_003 + i, torch.bfloat16)
        for i in range(n)
    ]
    for start in range(0, n, PUT_BATCH):
        part = keys[start : start + PUT_BATCH]
        objs = [manager.allocate(meta.get_shapes(), meta.get_dtypes()) for _ in part]
        if any(obj is None for obj in objs):
            raise RuntimeError("benchmark set-up: LMCache's CPU pool is full")
        manager.batched_put(part, objs, location=None)
    _wait_written(manager, name, keys)
    return keys


def _ucm_locks(backend: Any) -> tuple[int, int]:
    """The plugin's pin-lock acquisitions and the posix tier's (-1 without a posix tier)."""
    stats = backend.stats()
    posix = [tier for tier in stats["ucm"]["tiers"] if tier["type"] == "posix"]
    plugin = int(stats["lmcache"].get("remove_lock_acquisitions", 0))
    return plugin, int(posix[0]["remove_lock_acquisitions"]) if posix else -1


class _CountingLock:
    """Stands in for a backend's threading.Lock in the untimed counting pass."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self.acquisitions = 0

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        self.acquisitions += 1
        return bool(self._lock.acquire(*args, **kwargs))

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> _CountingLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _count_lmcache_locks(manager: Any, name: str, backend: Any, count: int) -> int:
    """Lock acquisitions of LMCache's own batched_remove for ``count`` keys."""
    attribute = "cpu_lock" if name == "LocalCPUBackend" else "disk_lock"
    keys = _put_keys(manager, name, count, seed=77)
    original = getattr(backend, attribute)
    counting = _CountingLock(original)
    setattr(backend, attribute, counting)
    try:
        manager.batched_remove(keys, locations=[name])
    finally:
        setattr(backend, attribute, original)
    return counting.acquisitions


# ---- LMCache objects --------------------------------------------------------------------------


_STACKS = {
    "UCM buffer+posix": "buffer over posix",
    "UCM buffer": "buffer only",
    "UCM posix": "posix only",
}


def _stack(workdir: str, posix: str | None, buffer_bytes: int | None) -> dict[str, Any]:
    """A stack of a CacheBuffer of ``buffer_bytes`` (when given) over posix in ``posix``
    (when given; written through below a buffer)."""
    tiers: list[dict[str, Any]] = []
    if buffer_bytes is not None:
        tiers.append({"type": "buffer", "capacity": buffer_bytes})
    if posix is not None:
        tier: dict[str, Any] = {"type": "posix", "path": f"{workdir}/{posix}"}
        tiers.append({**tier, "write": "through"} if tiers else tier)
    return {"unique_id": f"bench-lmc-{uuid.uuid4().hex[:10]}", "tiers": tiers}


def _plugin(stack: dict[str, Any]) -> dict[str, Any]:
    return {
        "local_cpu": False,
        "storage_plugins": ["ucm"],
        "extra_config": {
            "storage_plugin.ucm.module_path": "ucm.integration.lmcache",
            "storage_plugin.ucm.class_name": "UcmStorageBackend",
            "storage_plugin.ucm.stack": stack,
        },
    }


def _config(chunk_tokens: int, pool_gb: float, settings: dict[str, Any]) -> Any:
    from lmcache.v1.config import LMCacheEngineConfig

    return LMCacheEngineConfig.from_defaults(
        chunk_size=chunk_tokens,
        max_local_cpu_size=pool_gb,
        lmcache_instance_id=f"bench-{uuid.uuid4().hex[:10]}",
        **settings,
    )


def _metadata(chunk_tokens: int, layers: int, heads: int, head_size: int) -> Any:
    import torch
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(layers, 2, chunk_tokens, heads, head_size),
        chunk_size=chunk_tokens,
    )


def _manager(config: Any, metadata: Any) -> Any:
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    return StorageManager(config, metadata, EventManager())


# ---- without lmcache ----------------------------------------------------------------------------


def _without_lmcache(options: BenchOptions) -> BenchResult:
    """UCM's own load path for the same chunks (what the plugin's retrieve runs on), beside one
    torch copy of the same bytes: not an LMCache figure, and the note says so."""
    import torch

    import ucm

    chunks = QUICK_RETRIEVE_CHUNKS if options.quick else RETRIEVE_CHUNKS
    chunk_bytes = 2 * LAYERS * CHUNK_TOKENS * HEADS * HEAD_SIZE * 2
    stack = {
        "unique_id": f"bench-lmc-{uuid.uuid4().hex[:10]}",
        "shard_size": chunk_bytes,
        "shards_per_block": 1,
        "tiers": [{"type": "buffer", "capacity": 2 * chunks * chunk_bytes}],
    }
    blocks = [i.to_bytes(16, "big") for i in range(chunks)]
    src = [[torch.randint(0, 255, (chunk_bytes,), dtype=torch.uint8)] for _ in blocks]
    dst = [[torch.empty(chunk_bytes, dtype=torch.uint8)] for _ in blocks]
    loads: list[float] = []
    copies: list[float] = []
    with ucm.open(stack) as store:
        store.wait(store.dump(blocks, [0] * chunks, src))
        for round_ in range(QUICK_ROUNDS + 1):
            options.progress(f"lmcache_plugin (no lmcache): round {round_}")
            started = time.perf_counter()
            store.wait(store.load(blocks, [0] * chunks, dst))
            loads.append(time.perf_counter() - started)
            started = time.perf_counter()
            for d, s in zip(dst, src, strict=True):
                d[0].copy_(s[0])
            copies.append(time.perf_counter() - started)
    gb = chunks * chunk_bytes / 1e9
    return BenchResult(
        name=BENCHMARK.name,
        figures=[
            Figure(
                name="UCM load of LMCache-sized chunks (no LMCache)",
                value=gb / sorted(loads[1:])[len(loads[1:]) // 2],
                unit="GB/s",
                baseline="torch copy of the same bytes",
                baseline_value=gb / sorted(copies[1:])[len(copies[1:]) // 2],
            )
        ],
        notes=[
            "lmcache is not installed, so LMCache's backends and the UCM plugin were not measured "
            "(bash tools/install-test-env installs it); this figure is UCM's own load path for "
            "chunks of the same size"
        ],
    )


__all__ = ["BENCHMARK", "LmcachePluginBenchmark"]
