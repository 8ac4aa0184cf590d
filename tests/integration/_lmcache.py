"""Helpers for the LMCache integration tests: LMCache configs and metadata for a small CPU model,
deterministic chunk bytes, a log catcher for LMCache's own (non-propagating) loggers, and the
body of the worker processes of the two-process test (spawned, so it lives in a module)."""

from __future__ import annotations

import logging
import os
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager

MODEL = "ucm-test/tiny"
CHUNK = 16
LAYERS = 2
HEADS = 2
HEAD_SIZE = 32
HIDDEN = HEADS * HEAD_SIZE
DTYPE = torch.bfloat16
CHUNK_BYTES = 2 * LAYERS * CHUNK * HIDDEN * DTYPE.itemsize
"""One worker's KV of one chunk: [2, layers, chunk, hidden] bf16 = 8 KiB."""

PLUGIN = {
    "storage_plugin.ucm.module_path": "ucm.integration.lmcache",
    "storage_plugin.ucm.class_name": "UcmStorageBackend",
}


def config(
    stack: Any = None,
    *,
    local_cpu: bool = True,
    cpu_gb: float = 0.03,
    plugin: bool = True,
    **options: Any,
) -> Any:
    """An LMCacheEngineConfig with UCM as its storage plugin (``stack`` under the plugin's key)."""
    extra: dict[str, Any] = dict(PLUGIN) if plugin else {}
    if plugin and stack is not None:
        extra["storage_plugin.ucm.stack"] = stack
    extra.update(options.pop("extra_config", {}))
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=local_cpu,
        max_local_cpu_size=cpu_gb,
        storage_plugins=["ucm"] if plugin else None,
        extra_config=extra or None,
        lmcache_instance_id=f"ucm-test-{uuid.uuid4().hex[:8]}",
        **options,
    )


def metadata(world_size: int = 1, worker_id: int = 0, **options: Any) -> Any:
    return LMCacheMetadata(
        model_name=MODEL,
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=DTYPE,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_SIZE),
        chunk_size=CHUNK,
        **options,
    )


def storage_manager(cfg: Any, meta: Any) -> Any:
    return StorageManager(cfg, meta, EventManager())


def key(chunk_hash: int, world_size: int = 1, worker_id: int = 0) -> Any:
    return CacheEngineKey(MODEL, world_size, worker_id, chunk_hash, DTYPE)


def chunk_bytes(chunk_hash: int, worker_id: int = 0) -> bytes:
    """Distinct, deterministic bytes for one worker's chunk (a repeating 251-byte pattern)."""
    seed = (chunk_hash * 7 + worker_id * 131) % 251
    pattern = bytes((seed + i) % 251 for i in range(251))
    return (pattern * (CHUNK_BYTES // 251 + 1))[:CHUNK_BYTES]


def filled(manager: Any, chunk_hash: int, worker_id: int = 0) -> Any:
    """A full-chunk MemoryObj from the manager's allocator, holding chunk_bytes(...)."""
    meta = manager.metadata
    obj = manager.allocate(meta.get_shapes(), meta.get_dtypes())
    assert obj is not None, "LMCache's CPU allocator is full"
    payload = torch.frombuffer(bytearray(chunk_bytes(chunk_hash, worker_id)), dtype=torch.uint8)
    obj.raw_tensor[:CHUNK_BYTES].copy_(payload)
    return obj


def content(obj: MemoryObj) -> bytes:
    return bytes(obj.raw_tensor[:CHUNK_BYTES].numpy().tobytes())


def active_allocations(manager: Any) -> int:
    """Live allocations in LMCache's pinned CPU pool (leak and double-free checks)."""
    allocator = manager.storage_backends["LocalCPUBackend"].memory_allocator
    return int(allocator.pin_allocator.num_active_allocations)


class Catch(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self) -> list[str]:
        return [record.getMessage() for record in self.records]


@contextmanager
def lmcache_logs() -> Iterator[Catch]:
    """Warnings and errors of LMCache's loggers (they do not propagate to the root logger)."""
    catch = Catch()
    names = [name for name in logging.Logger.manager.loggerDict if name.startswith("lmcache")]
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addHandler(catch)
    try:
        yield catch
    finally:
        for logger in loggers:
            logger.removeHandler(catch)


# ---- the two-process test: one LMCache worker per process, world size 2, one node ----------


def worker(worker_id: int, stack: dict[str, Any], barrier: Any, out: Any) -> None:
    """Stores this worker's shard of 6 chunks, waits for the other worker, then reads both
    workers' shards of them (its own through LMCache's StorageManager, the peer's through the
    plugin with the peer's key), removes one chunk (worker 0) and reports what it saw."""
    try:
        report = _worker(worker_id, stack, barrier)
    except BaseException:
        report = {"worker": worker_id, "error": traceback.format_exc()}
        barrier.abort()
    out.put(report)


def _worker(worker_id: int, stack: dict[str, Any], barrier: Any) -> dict[str, Any]:
    peer = 1 - worker_id
    manager = storage_manager(config(stack, local_cpu=False), metadata(2, worker_id))
    try:
        backend = manager.storage_backends["ucm"]
        chunks = list(range(100, 106))
        mine = [key(c, 2, worker_id) for c in chunks]
        objs = [filled(manager, c, worker_id) for c in chunks]
        barrier.wait(timeout=120)  # both workers are up
        before_peer = None
        if worker_id == 0:  # worker 0 stores first: its chunks lack worker 1's shards
            manager.batched_put(mine, objs)
            assert backend.flush(timeout_s=120)
            before_peer = backend.batched_contains(mine)
        barrier.wait(timeout=120)
        if worker_id == 1:
            manager.batched_put(mine, objs)
            assert backend.flush(timeout_s=120)
        barrier.wait(timeout=120)  # both have stored
        hits = backend.batched_contains(mine)
        got = manager.batched_get(mine, location="ucm")
        own_exact = [
            g is not None and content(g) == chunk_bytes(c, worker_id)
            for g, c in zip(got, chunks, strict=True)
        ]
        for g in got:
            if g is not None:
                g.ref_count_down()
        theirs = backend.batched_get_blocking([key(c, 2, peer) for c in chunks])
        peer_exact = [
            g is not None and content(g) == chunk_bytes(c, peer)
            for g, c in zip(theirs, chunks, strict=True)
        ]
        for g in theirs:
            if g is not None:
                g.ref_count_down()
        ucm_stats = backend.stats()["ucm"]
        barrier.wait(timeout=120)  # both have read
        # Removing a chunk removes every worker's shard of it: worker 0 removes chunk 100, and
        # worker 1 then finds it gone (its own shard included) and has nothing left to remove.
        removed = backend.batched_remove([mine[0]], force=False) if worker_id == 0 else None
        barrier.wait(timeout=120)
        after_remove = (backend.contains(mine[0]), backend.batched_contains(mine[1:]))
        removed_again = backend.batched_remove([mine[0]], force=False) if worker_id == 1 else None
        barrier.wait(timeout=120)  # both are done before either closes
        return {
            "worker": worker_id,
            "before_peer": before_peer,
            "hits": hits,
            "own_exact": own_exact,
            "peer_exact": peer_exact,
            "unique_id": backend.store.config.unique_id,
            "tiers": [tier["type"] for tier in ucm_stats["tiers"]],
            "removed": removed,
            "after_remove": after_remove,
            "removed_again": removed_again,
            "leaked": active_allocations(manager),
        }
    finally:
        manager.close()


# ---- LMCacheEngine with the CPU connector ----------------------------------------------------


def _no_broadcast(*args: Any) -> Any:
    raise AssertionError("broadcast is only used with MLA's save_only_first_rank")


def engine(cfg: Any, meta: Any) -> Any:
    """An LMCacheEngine (not yet post_init-ed) whose GPU connector is ucm.testing's CPU one."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from harness.lmcache import CpuKVConnector

    return LMCacheEngineBuilder.get_or_create(
        cfg.lmcache_instance_id,
        cfg,
        meta,
        CpuKVConnector(LAYERS, HIDDEN),
        _no_broadcast,
        _no_broadcast,
    )


def destroy(engine_: Any) -> None:
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    LMCacheEngineBuilder.destroy(engine_.config.lmcache_instance_id)


def paged_kv(tokens: int, slots: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A paged host KV cache (one [2, slots, hidden] tensor per layer) with random contents and
    a scattered slot mapping for ``tokens`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    caches = [torch.randn(2, slots, HIDDEN, generator=generator).to(DTYPE) for _ in range(LAYERS)]
    mapping = torch.randperm(slots, generator=generator)[:tokens]
    return caches, mapping
