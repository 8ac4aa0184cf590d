"""UCM as SGLang's HiCache L3 storage, against the real sglang 0.5.23 (docs/sglang.md).

Every backend here is made the way SGLang's cache controller makes it: ``StorageBackendFactory``'s
dynamic path with a ``HiCacheStorageConfig`` of the controller's defaults, then
``register_mem_pool_host`` with a real CPU host KV pool (``MHATokenToKVPoolHost`` over a CPU
``MHATokenToKVPool``, or the MLA pair). Skipped only when sglang is missing and ``CI`` is unset.
"""

from __future__ import annotations

import json
import logging
import selectors
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import ucm
from ucm.native import segments

from ._sglang import (
    PAGE_TOKENS,
    SGLang,
    ci,
    create_backend,
    fill,
    host_pool,
    import_sglang,
    mla_host_pool,
    page_bytes,
    page_keys,
    sglang_installed,
    storage_config,
)

HERE = Path(__file__).parent
UNKNOWN = "0" * 64  # a page key no test stores


@pytest.fixture(scope="module")
def sgl() -> SGLang:
    if not sglang_installed():
        if ci():
            pytest.fail("sglang is not installed and CI is set: bash tools/install-test-env")
        pytest.skip("sglang is not installed (bash tools/install-test-env installs it)")
    return import_sglang()


@pytest.fixture
def unique_id() -> Iterator[Callable[[], str]]:
    made: list[str] = []

    def make() -> str:
        made.append(f"sgl-{uuid.uuid4().hex[:12]}")
        return made[-1]

    yield make
    for name in made:
        segments.unlink(name)


def buffer_stack(unique_id: str, lower: Path | None = None) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"type": "buffer", "capacity": "4MiB"}]
    if lower is not None:
        tiers.append({"type": "posix", "path": str(lower)})
    return {"unique_id": unique_id, "tiers": tiers}


def pages_at(pool: Any, pages: list[int]) -> Any:
    """host_indices of the given host-pool pages, in that order (SGLang passes page-aligned
    slot runs, one per page)."""
    import torch

    return torch.cat(
        [
            torch.arange(p * pool.page_size, (p + 1) * pool.page_size, dtype=torch.int64)
            for p in pages
        ]
    )


def keys_of(sgl: SGLang, count: int) -> list[str]:
    """SGLang page keys of fresh random tokens (SGLang's own hash of each page's prefix)."""
    return page_keys(sgl, count, seed=uuid.uuid4().int)


def test_the_factory_builds_it_from_the_default_config(
    sgl: SGLang, tmp_path: Path, unique_id: Callable[[], str]
) -> None:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    from ucm.integration.sglang import UcmHiCacheStorage

    stack_file = tmp_path / "stack.yaml"
    stack_file.write_text(
        f"unique_id: {unique_id()}\ntiers:\n  - type: buffer\n    capacity: 1MiB\n"
    )
    pool = host_pool(sgl)
    config = storage_config(sgl, {"ucm_stack": str(stack_file)})
    assert config.tp_lcm_size is None  # what the controller passes unless told otherwise
    backend = create_backend(sgl, config, pool)
    try:
        assert type(backend) is UcmHiCacheStorage and isinstance(backend, HiCacheStorage)
        _pointers, sizes = pool.get_page_buffer_meta(torch.arange(PAGE_TOKENS))
        layout = backend.store.layout
        # layer_first: K and V of each of the 4 layers, 16 tokens x 4 heads x 32 dims x 2 bytes.
        assert list(layout.tensor_sizes) == sizes == [4096] * 8
        assert layout.shards_per_block == 1 and layout.shard_size == 32768
        assert backend.batch_exists(keys_of(sgl, 3)) == 0
    finally:
        backend.close()


def test_the_torchvision_standin_leaves_nothing_behind(sgl: SGLang) -> None:
    """After SGLang's import, torchvision is what the environment has: here, nothing."""
    import importlib.util

    from transformers.utils import import_utils

    if importlib.util.find_spec("torchvision") is not None:  # a real one: SGLang imported it
        assert getattr(sys.modules["torchvision"], "__file__", None) is not None
        return
    assert not [name for name in sys.modules if name.split(".")[0] == "torchvision"]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("torchvision")
    assert import_utils.is_torchvision_available() is False


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_v1_set_then_get_restores_host_pool_pages_byte_exact(
    sgl: SGLang, layout: str, unique_id: Callable[[], str]
) -> None:
    pool = host_pool(sgl, layout)
    backend = create_backend(
        sgl, storage_config(sgl, {"ucm_stack": buffer_stack(unique_id())}), pool
    )
    try:
        keys = keys_of(sgl, 5)
        source = pages_at(pool, [3, 0, 7, 1, 4])
        fill(pool, seed=1)
        expected = [page_bytes(pool, source, i) for i in range(len(keys))]
        assert backend.batch_set_v1(keys, source) == [True] * 5
        fill(pool, seed=2)  # every page of the pool now holds other bytes
        target = pages_at(pool, [9, 12, 2, 15, 6])
        assert [page_bytes(pool, target, i) for i in range(5)] != expected
        assert backend.batch_get_v1(keys, target) == [True] * 5
        assert [page_bytes(pool, target, i) for i in range(5)] == expected
        stats = backend.store.stats()
        assert (stats["dumped_shards"], stats["loaded_shards"]) == (5, 5)
    finally:
        backend.close()


def test_two_engines_in_fixed_namespaces_never_share_a_page(
    sgl: SGLang, unique_id: Callable[[], str]
) -> None:
    """``ucm_namespace: fixed:<name>``: the same page keys from two engines on one node's
    buffer are two namespaces: no hit across, each purged on its own with exact counts."""
    pool = host_pool(sgl)
    stack = buffer_stack(unique_id())
    keys = keys_of(sgl, 4)
    fill(pool, seed=5)
    team_a = create_backend(
        sgl, storage_config(sgl, {"ucm_stack": stack, "ucm_namespace": "fixed:team-a"}), pool
    )
    try:
        assert team_a.store.namespace == "team-a"
        assert team_a.batch_set_v1(keys, pages_at(pool, [0, 1, 2, 3])) == [True] * 4
        team_b = create_backend(
            sgl, storage_config(sgl, {"ucm_stack": stack, "ucm_namespace": "fixed:team-b"}), pool
        )
        try:
            assert team_b.batch_exists(keys) == 0
            assert team_b.batch_get_v1(keys, pages_at(pool, [4, 5, 6, 7])) == [False] * 4
            usage = team_b.store.namespaces()
            assert list(usage) == ["team-a"] and usage["team-a"][0] == 4
            assert team_b.store.purge("team-b")[0] == 0
            assert team_a.batch_exists(keys) == 4
            assert team_b.store.purge("team-a")[0] == 4
            assert team_a.batch_exists(keys) == 0
        finally:
            team_b.close()
    finally:
        team_a.close()


def test_two_cache_salts_in_one_engine_are_apart_but_share_its_namespace(
    sgl: SGLang, unique_id: Callable[[], str]
) -> None:
    """Why SGLang has one namespace per engine: SGLang 0.5.23 seeds its page hashes with a
    request's ``extra_key`` and ``cache_salt`` (``get_storage_hash_str`` of a ``RadixKey``), so
    two salts' pages never meet, but the storage calls get those hashes and a
    ``HiCacheStorageExtraInfo`` of prefix keys only: both salts' pages land in the engine's one
    namespace, whose cap (4 pages) both salts' 6 pages share."""
    import dataclasses
    from array import array

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.radix_cache import RadixKey

    assert [f.name for f in dataclasses.fields(HiCacheStorageExtraInfo)] == [
        "prefix_keys",
        "extra_info",
    ]
    tokens = array("q", range(100, 100 + 3 * PAGE_TOKENS))
    salted = {
        salt: sgl.get_storage_hash_str(RadixKey(tokens, cache_salt=salt), None, PAGE_TOKENS)
        for salt in ("t-a", "t-b")
    }
    assert not set(salted["t-a"]) & set(salted["t-b"])
    pool = host_pool(sgl)
    fill(pool, seed=8)
    cap = {"buffer": {"cap": "128KiB"}}  # 4 pages of 32 KiB
    stack = {**buffer_stack(unique_id()), "quotas": {"namespaces": {"team": cap}}}
    backend = create_backend(
        sgl, storage_config(sgl, {"ucm_stack": stack, "ucm_namespace": "fixed:team"}), pool
    )
    try:
        info = HiCacheStorageExtraInfo(prefix_keys=[])
        assert backend.batch_set_v1(salted["t-a"], pages_at(pool, [0, 1, 2]), info) == [True] * 3
        assert backend.batch_exists(salted["t-b"], info) == 0
        assert backend.batch_set_v1(salted["t-b"], pages_at(pool, [3, 4, 5]), info) == [True] * 3
        assert backend.store.lookup([backend.block_id(k) for k in salted["t-a"]]).count(True) == 1
        assert backend.store.namespaces() == {"team": [4]}
        figures = backend.store.stats()["namespaces"]["team"]
        assert (figures["cap_slots"], figures["occupancy_slots"], figures["evictions"]) == (4, 4, 2)
    finally:
        backend.close()


def test_batch_exists_counts_the_present_prefix(sgl: SGLang, unique_id: Callable[[], str]) -> None:
    pool = host_pool(sgl)
    backend = create_backend(
        sgl, storage_config(sgl, {"ucm_stack": buffer_stack(unique_id())}), pool
    )
    try:
        keys = keys_of(sgl, 6)
        fill(pool, seed=3)
        stored = [0, 1, 2, 4]
        assert backend.batch_set_v1([keys[i] for i in stored], pages_at(pool, stored)) == [True] * 4
        assert backend.batch_exists(keys) == 3  # page 3 is missing: 4 does not count
        assert backend.batch_exists(keys[3:]) == 0
        assert backend.batch_exists(keys[4:5]) == 1
        assert backend.batch_exists([]) == 0
        assert [backend.exists(k) for k in keys] == [True, True, True, False, True, False]
    finally:
        backend.close()


def test_a_miss_and_a_corrupt_posix_shard_come_back_as_not_found(
    sgl: SGLang, tmp_path: Path, unique_id: Callable[[], str]
) -> None:
    disk = tmp_path / "nvme"
    pool = host_pool(sgl)
    keys = keys_of(sgl, 4)
    fill(pool, seed=4)
    source = pages_at(pool, [0, 1, 2, 3])
    expected = [page_bytes(pool, source, i) for i in range(4)]
    writer = create_backend(
        sgl, storage_config(sgl, {"ucm_stack": buffer_stack(unique_id(), disk)}), pool
    )
    assert writer.batch_set_v1(keys, source) == [True] * 4
    corrupt = writer.block_id(keys[1])
    writer.close()  # finishes the write-through to the posix tier
    block_file = disk / corrupt.hex()[:2] / f"{corrupt.hex()}.blk"
    with open(block_file, "r+b") as file:  # flip one bit of the page's bytes
        file.seek(100)
        byte = file.read(1)
        file.seek(100)
        file.write(bytes([byte[0] ^ 0x10]))

    # A fresh node buffer over the same disk: every page comes from the posix tier.
    reader = create_backend(
        sgl, storage_config(sgl, {"ucm_stack": buffer_stack(unique_id(), disk)}), pool
    )
    try:
        fill(pool, seed=5)
        target = pages_at(pool, [4, 5, 6, 7, 8])
        wanted = [keys[0], keys[1], keys[2], UNKNOWN, keys[3]]
        assert reader.batch_get_v1(wanted, target) == [True, False, True, False, True]
        assert page_bytes(pool, target, 0) == expected[0]
        assert page_bytes(pool, target, 2) == expected[2]
        assert page_bytes(pool, target, 4) == expected[3]
        # The tensor interface says the same: no data for the corrupt page or the unknown one.
        assert reader.get(keys[1]) is None and reader.get(UNKNOWN) is None
        assert reader.exists(keys[0]) and not reader.exists(UNKNOWN)
        assert reader.store.stats()["tiers"][1]["corrupt"] >= 1
    finally:
        reader.close()


def test_its_counters_and_sglangs_storage_metrics_count_every_page(
    sgl: SGLang, tmp_path: Path, unique_id: Callable[[], str]
) -> None:
    """``stats()`` counts each get's pages by outcome and each set's; with
    ``enable_storage_metrics`` (``--enable-storage-metrics``), ``get_stats()`` hands SGLang's
    own ``StorageMetricsCollector`` one page count and one bandwidth per call, drained."""
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from sglang.srt.observability.metrics_collector import StorageMetricsCollector

    disk = tmp_path / "nvme"
    pool = host_pool(sgl)
    keys = keys_of(sgl, 4)
    fill(pool, seed=21)
    source = pages_at(pool, [0, 1, 2, 3])
    config = {"ucm_stack": buffer_stack(unique_id(), disk)}
    writer = create_backend(sgl, storage_config(sgl, config), pool)
    assert writer.get_stats() is None  # the metrics are off: SGLang's base-class answer
    assert writer.batch_set_v1(keys, source) == [True] * 4
    assert writer.stats()["sglang"] == {
        **dict.fromkeys(writer.stats()["sglang"], 0),
        "sets": 1,
        "set_pages": 4,
        "set_stored": 4,
    }
    corrupt = writer.block_id(keys[1])
    writer.close()
    block_file = disk / corrupt.hex()[:2] / f"{corrupt.hex()}.blk"
    with open(block_file, "r+b") as file:
        file.seek(100)
        byte = file.read(1)
        file.seek(100)
        file.write(bytes([byte[0] ^ 0x10]))

    reader = create_backend(
        sgl,
        storage_config(
            sgl, {"ucm_stack": buffer_stack(unique_id(), disk)}, enable_storage_metrics=True
        ),
        pool,
    )
    try:
        target = pages_at(pool, [4, 5, 6, 7, 8])
        wanted = [keys[0], keys[1], keys[2], UNKNOWN, keys[3]]
        assert reader.batch_get_v1(wanted, target) == [True, False, True, False, True]
        assert reader.get(UNKNOWN) is None
        assert reader.batch_set_v1(keys[:2], pages_at(pool, [9, 10])) == [True, True]
        assert reader.stats()["sglang"] == {
            "gets": 2,
            "get_pages": 6,
            "get_hits": 3,
            "get_misses": 2,
            "get_late": 0,
            "get_errors": 1,  # the corrupt shard
            "sets": 1,
            "set_pages": 2,
            "set_stored": 2,
            "set_failed": 0,
            "set_late": 0,
        }
        assert reader.stats()["ucm"]["loaded_shards"] == 3

        metrics = reader.get_stats()
        assert (metrics.prefetch_pgs, metrics.backup_pgs) == ([5, 1], [2])
        assert metrics.prefetch_bandwidth[0] > 0 and metrics.prefetch_bandwidth[1] == 0
        assert len(metrics.backup_bandwidth) == 1 and metrics.backup_bandwidth[0] > 0
        drained = reader.get_stats()  # drained: SGLang calls it every scheduler step
        assert (drained.prefetch_pgs, drained.backup_pgs) == ([], [])

        # SGLang's own collector takes them, on a private registry (its DI hooks).
        registry = CollectorRegistry()

        class Collector(StorageMetricsCollector):  # type: ignore[misc]
            _counter_cls = partial(Counter, registry=registry)
            _gauge_cls = partial(Gauge, registry=registry)
            _histogram_cls = partial(Histogram, registry=registry)

        Collector(labels={"tp_rank": "0"}).log_storage_metrics(metrics)
        labels = {"tp_rank": "0"}
        assert registry.get_sample_value("sglang:prefetch_pgs_count", labels) == 2
        assert registry.get_sample_value("sglang:prefetch_pgs_sum", labels) == 6
        assert registry.get_sample_value("sglang:backup_pgs_sum", labels) == 2
        assert registry.get_sample_value("sglang:backup_bandwidth_count", labels) == 1
    finally:
        reader.close()


def test_each_rank_serves_ucm_prometheus_metrics_with_the_backends_counters(
    sgl: SGLang, unique_id: Callable[[], str]
) -> None:
    """``ucm_metrics_port``: each rank serves UCM's own Prometheus endpoint (127.0.0.1, port
    plus its rank on the node), with this process's store counters and the backend's; the
    endpoint closes with the backend. A port in use is refused naming the key."""
    import socket
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    def scrape(url: str) -> dict[str, float]:
        with urllib.request.urlopen(url, timeout=30) as response:
            text = response.read().decode()
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    pool = host_pool(sgl)
    keys = keys_of(sgl, 3)
    fill(pool, seed=31)
    stack = buffer_stack(unique_id())
    extra = {"ucm_stack": stack, "ucm_metrics_port": 0}
    backend = create_backend(sgl, storage_config(sgl, extra), pool)
    try:
        url = backend.metrics_url
        assert url is not None and url.startswith("http://127.0.0.1:")
        assert backend.batch_set_v1(keys[:2], pages_at(pool, [0, 1])) == [True, True]
        assert backend.batch_get_v1(keys, pages_at(pool, [4, 5, 6])) == [True, True, False]
        scraped = scrape(url)
        assert scraped["ucm_sglang_get_pages_total"] == 3
        assert scraped["ucm_sglang_get_hits_total"] == 2
        assert scraped["ucm_sglang_get_misses_total"] == 1
        assert scraped["ucm_sglang_get_late_total"] == 0
        assert scraped["ucm_sglang_set_stored_total"] == 2
        assert scraped["ucm_store_loaded_shards_total"] == 2
        assert scraped["ucm_store_dumped_shards_total"] == 2

        # TP rank 1 of 2 serves on the port plus 1; that port taken, its start is refused.
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            base = taken.getsockname()[1] - 1
            rank1 = storage_config(
                sgl, {"ucm_stack": stack, "ucm_metrics_port": base}, tp_rank=1, tp_size=2
            )
            with pytest.raises(
                ucm.ConfigError,
                match=rf"^hicache_storage_backend_extra_config\['ucm_metrics_port'\]: "
                rf"port={base + 1} is not valid: cannot listen on it",
            ):
                create_backend(sgl, rank1, pool)
    finally:
        backend.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_the_tensor_interface_reads_and_writes_the_same_pages_as_v1(
    sgl: SGLang, unique_id: Callable[[], str]
) -> None:
    """SGLang's generic path (flat pages: get_data_page / set_from_flat_data_page) and the
    zero-copy path store one format: each reads what the other wrote."""
    import torch

    pool = host_pool(sgl)  # layer_first: the flat page orders K and V differently from v1
    backend = create_backend(
        sgl, storage_config(sgl, {"ucm_stack": buffer_stack(unique_id())}), pool
    )
    try:
        fill(pool, seed=6)
        flat_keys, v1_keys = keys_of(sgl, 2), keys_of(sgl, 2)
        source = pages_at(pool, [0, 1])
        expected = [page_bytes(pool, source, i) for i in range(2)]
        flat_pages = [pool.get_data_page(int(source[i * PAGE_TOKENS]), flat=True) for i in (0, 1)]
        assert backend.batch_set(flat_keys, flat_pages) is True
        assert backend.set(v1_keys[0], flat_pages[0]) is True
        assert backend.batch_set_v1(v1_keys[1:], pages_at(pool, [1])) == [True]

        fill(pool, seed=7)
        target = pages_at(pool, [10, 11])
        assert backend.batch_get_v1(flat_keys, target) == [True, True]
        assert [page_bytes(pool, target, i) for i in range(2)] == expected

        pages = backend.batch_get(v1_keys)
        assert [bytes(p.view(torch.uint8).numpy()) for p in pages] == expected
        into = pool.get_dummy_flat_data_page()
        assert backend.get(v1_keys[1], into) is into
        assert bytes(into.view(torch.uint8).numpy()) == expected[1]
        pool.set_from_flat_data_page(int(target[0]), into)  # what SGLang does with the page
        assert page_bytes(pool, target, 0) == expected[1]
        assert backend.batch_get([v1_keys[0], UNKNOWN])[1] is None
    finally:
        backend.close()


def test_mla_pages_are_one_shard_that_every_tp_rank_reads(
    sgl: SGLang, tmp_path: Path, unique_id: Callable[[], str]
) -> None:
    """MLA KV is the same on every TP rank (SGLang lets rank 0 write it): one shard per page."""
    stack = {"unique_id": unique_id(), "tiers": [{"type": "posix", "path": str(tmp_path)}]}
    writer_pool, reader_pool = mla_host_pool(sgl), mla_host_pool(sgl)
    fields = {"tp_size": 2, "is_mla_model": True}
    writer = create_backend(
        sgl, storage_config(sgl, {"ucm_stack": stack}, tp_rank=0, **fields), writer_pool
    )
    reader = create_backend(
        sgl, storage_config(sgl, {"ucm_stack": stack}, tp_rank=1, **fields), reader_pool
    )
    try:
        assert writer.plan.shards_per_block == reader.plan.shards_per_block == 1
        assert list(writer.store.layout.tensor_sizes) == [16 * 80 * 2] * 4  # one per layer
        keys = keys_of(sgl, 3)
        fill(writer_pool, seed=8)
        source = pages_at(writer_pool, [0, 1, 2])
        assert writer.batch_set_v1(keys, source) == [True] * 3
        assert reader.batch_exists(keys) == 3
        target = pages_at(reader_pool, [5, 3, 4])
        assert reader.batch_get_v1(keys, target) == [True] * 3
        assert [page_bytes(reader_pool, target, i) for i in range(3)] == [
            page_bytes(writer_pool, source, i) for i in range(3)
        ]
    finally:
        writer.close()
        reader.close()


def test_pipeline_stages_get_a_buffer_and_a_key_space_each(
    sgl: SGLang, unique_id: Callable[[], str]
) -> None:
    """Each PP stage holds other layers: its own CacheBuffer (unique_id + -pp<rank>) and ids."""
    base = unique_id()
    pool = host_pool(sgl)
    stages = []
    try:
        for stage in range(2):
            config = storage_config(
                sgl, {"ucm_stack": buffer_stack(base)}, pp_rank=stage, pp_size=2
            )
            stages.append(create_backend(sgl, config, pool))
        assert [b.store.config.unique_id for b in stages] == [f"{base}-pp0", f"{base}-pp1"]
        key = keys_of(sgl, 1)[0]
        assert stages[0].block_id(key) != stages[1].block_id(key)
        fill(pool, seed=10)
        assert stages[0].batch_set_v1([key], pages_at(pool, [0])) == [True]
        assert (stages[0].exists(key), stages[1].exists(key)) == (True, False)
    finally:
        for backend in stages:
            backend.close()
        for stage in range(2):
            segments.unlink(f"{base}-pp{stage}")


def test_tp_ranks_are_shards_of_one_block(sgl: SGLang, unique_id: Callable[[], str]) -> None:
    from ucm.integration.sglang import ShardPlan

    plans = [ShardPlan.of(storage_config(sgl, {}, tp_rank=r, tp_size=4)) for r in range(4)]
    assert [(p.shard_index, p.shards_per_block, p.device_id, p.local_rank_size) for p in plans] == [
        (r, 4, r, 4) for r in range(4)
    ]
    mla = [
        ShardPlan.of(storage_config(sgl, {}, tp_rank=r, tp_size=4, is_mla_model=True))
        for r in (0, 3)
    ]
    assert [(p.shard_index, p.shards_per_block, p.device_id) for p in mla] == [(0, 1, 0), (0, 1, 3)]
    # Every rank names a page by the same block id: the key space has no rank in it.
    stack = buffer_stack(unique_id())
    pools = [host_pool(sgl), host_pool(sgl)]
    ranks = [
        create_backend(
            sgl, storage_config(sgl, {"ucm_stack": stack}, tp_rank=r, tp_size=2), pools[r]
        )
        for r in range(2)
    ]
    try:
        key = keys_of(sgl, 1)[0]
        assert ranks[0].block_id(key) == ranks[1].block_id(key)
        assert ranks[0].store.layout.shards_per_block == 2
    finally:
        for backend in ranks:
            backend.close()


RANK = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import _sglang as h
rank, size, pages = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
stack = json.loads(sys.argv[4])
sgl = h.import_sglang()
keys = h.page_keys(sgl, pages, seed=int(sys.argv[6]))  # the same pages on both ranks
pool = h.host_pool(sgl)
h.fill(pool, seed=100 + rank)
source = pool.alloc(pages * h.PAGE_TOKENS)
expected = [h.page_bytes(pool, source, i) for i in range(pages)]
config = h.storage_config(sgl, {"ucm_stack": stack}, tp_rank=rank, tp_size=size)
backend = h.create_backend(sgl, config, pool)
stored = backend.batch_set_v1(keys, source)
print(json.dumps({"stored": stored, "shard": backend.plan.shard_index}), flush=True)
sys.stdin.readline()  # every rank has stored its shard
present = backend.batch_exists(keys)
h.fill(pool, seed=200 + rank)
target = pool.alloc(pages * h.PAGE_TOKENS)
loaded = backend.batch_get_v1(keys, target)
exact = [h.page_bytes(pool, target, i) == expected[i] for i in range(pages)]
# The peer's shard, read through this rank's store from the node buffer: the bytes the peer's
# seeded pool held (rebuilt here from its seed).
peer = 1 - rank
peer_pool = h.host_pool(sgl)
h.fill(peer_pool, seed=100 + peer)
peer_source = peer_pool.alloc(pages * h.PAGE_TOKENS)
peer_expected = [h.page_bytes(peer_pool, peer_source, i) for i in range(pages)]
h.fill(peer_pool, seed=300)
scratch = peer_pool.alloc(pages * h.PAGE_TOKENS)
pointers, _ = peer_pool.get_page_buffer_meta(scratch)
per_page = len(pointers) // pages
ids = [backend.block_id(k) for k in keys]
backend.store.wait(backend.store.load_data(
    ids, [peer] * pages, [pointers[i * per_page:(i + 1) * per_page] for i in range(pages)]))
peer_exact = [h.page_bytes(peer_pool, scratch, i) == peer_expected[i] for i in range(pages)]
print(json.dumps({"present": present, "loaded": loaded, "exact": exact, "peer_exact": peer_exact}),
      flush=True)
sys.stdin.readline()  # every rank has checked
backend.close()
print(json.dumps({"closed": True}), flush=True)
"""


class Rank:
    """One SGLang TP rank in its own process, stepped through stdin/stdout lines."""

    def __init__(self, rank: int, size: int, stack: dict[str, Any], pages: int, seed: int) -> None:
        arguments = [str(HERE), str(rank), str(size), json.dumps(stack), str(pages), str(seed)]
        self.process = subprocess.Popen(
            [sys.executable, "-c", RANK, *arguments],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def read(self, timeout_s: float = 240.0) -> dict[str, Any]:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if selector.select(timeout=1.0):
                    line = self.process.stdout.readline()
                    if not line:
                        break
                    if line.startswith("{"):
                        return dict(json.loads(line))
                elif self.process.poll() is not None:
                    break
        self.process.kill()
        _out, err = self.process.communicate(timeout=60)
        raise AssertionError(f"rank gave no result (exit {self.process.returncode}): {err[-3000:]}")

    def step(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate(timeout=60)


def test_two_tp_ranks_of_a_node_share_one_buffer(sgl: SGLang, unique_id: Callable[[], str]) -> None:
    """Two SGLang TP ranks in two processes: each stores its shard of the same pages into one
    node buffer (the stack has no other tier), sees every page complete, restores its own pages
    byte-exact and reads the peer's shard from the buffer."""
    pages = 6
    stack = buffer_stack(unique_id())
    seed = uuid.uuid4().int % 2**32
    ranks = [Rank(r, 2, stack, pages, seed) for r in range(2)]
    try:
        assert [rank.read() for rank in ranks] == [
            {"stored": [True] * pages, "shard": 0},
            {"stored": [True] * pages, "shard": 1},
        ]
        for rank in ranks:
            rank.step()
        results = [rank.read() for rank in ranks]
        for result in results:
            assert result == {
                "present": pages,  # a page counts only once both ranks' shards are in the buffer
                "loaded": [True] * pages,
                "exact": [True] * pages,
                "peer_exact": [True] * pages,
            }
        for rank in ranks:
            rank.step()
        assert [rank.read() for rank in ranks] == [{"closed": True}] * 2
        for rank in ranks:
            assert rank.process.wait(timeout=120) == 0
    finally:
        for rank in ranks:
            rank.stop()


@pytest.mark.parametrize(
    ("extra", "fields", "message"),
    [
        ({}, {}, r"^hicache_storage_backend_extra_config\['ucm_stack'\] is missing"),
        (
            {"ucm_stack": 42},
            {},
            r"\['ucm_stack'\] must be the path of a YAML stack or a mapping, got int",
        ),
        (
            {"ucm_stak": "x.yaml"},
            {},
            r"unknown key\(s\) \['ucm_stak'\]; the UCM backend reads "
            r"\['ucm_stack', 'ucm_kv_dtype', 'ucm_weights_id', 'ucm_namespace', "
            r"'ucm_load_deadline_s', 'ucm_set_deadline_s', 'ucm_metrics_port'\]",
        ),
        *(
            (
                {"ucm_stack": {}, "ucm_metrics_port": bad},
                {},
                r"^hicache_storage_backend_extra_config\['ucm_metrics_port'\]: "
                + shown
                + r" is not valid: expected an integer port in \[0, 65535\] \(0: a free port\)$",
            )
            for bad, shown in ((-1, "-1"), (65536, "65536"), ("9000", "'9000'"), (True, "True"))
        ),
        *(
            (
                {"ucm_stack": {}, "ucm_load_deadline_s": bad},
                {},
                r"^hicache_storage_backend_extra_config\['ucm_load_deadline_s'\]: "
                + shown
                + r" is not valid: expected a number of seconds in \(0, 3600\] \(default 10\)$",
            )
            for bad, shown in (
                (0, "0"),
                (-1.5, "-1.5"),
                (7200, "7200"),
                ("5", "'5'"),
                (True, "True"),
            )
        ),
        *(
            (
                {"ucm_stack": {}, "ucm_set_deadline_s": bad},
                {},
                r"^hicache_storage_backend_extra_config\['ucm_set_deadline_s'\]: "
                + shown
                + r" is not valid: expected a number of seconds in \(0, 3600\] \(default 30\)$",
            )
            for bad, shown in ((0, "0"), (float("nan"), "nan"), ("30", "'30'"))
        ),
        (
            {"ucm_stack": {}, "ucm_namespace": "lora"},
            {},
            r"^hicache_storage_backend_extra_config\['ucm_namespace'\]='lora' is not available "
            r"with SGLang's HiCache storage backend: sglang 0\.5\.23 hashes a request's "
            r"extra_key \(its LoRA id\) and cache_salt into the page keys \(sglang/srt/mem_cache/"
            r"utils\.py: storage_namespace_seed, get_storage_hash_str\).* never the cache salt or "
            r"the adapter, so no per-request namespace can be chosen\. Use fixed:<name>",
        ),
        (
            {"ucm_stack": {}, "ucm_namespace": "cache_salt"},
            {},
            r"^hicache_storage_backend_extra_config\['ucm_namespace'\]='cache_salt' is not "
            r"available with SGLang's HiCache storage backend: .*HiCacheStorageExtraInfo whose "
            r"prefix_keys are more of them",
        ),
        (
            {"ucm_stack": {}, "ucm_namespace": "fixed:no/slash"},
            {},
            r"^hicache_storage_backend_extra_config\['ucm_namespace'\]='no/slash' is not a "
            r"valid namespace name",
        ),
        (
            {"ucm_stack": {}},
            {"tp_lcm_size": 4, "tp_size": 2},
            r"\['tp_lcm_size'\]=4: UCM stores one shard per TP rank",
        ),
        (
            {"ucm_stack": {}},
            {"attn_cp_size": 2},
            r"attn_cp_size=2, dcp_size=1: .*context parallelism",
        ),
    ],
)
def test_a_bad_configuration_is_refused_at_creation(
    sgl: SGLang, extra: dict[str, Any], fields: dict[str, Any], message: str
) -> None:
    config = storage_config(sgl, extra, **fields)
    with pytest.raises(ucm.ConfigError, match=message):
        sgl.StorageBackendFactory.create_backend("dynamic", config, None)


def test_a_stack_that_contradicts_the_host_pool_is_refused(sgl: SGLang, tmp_path: Path) -> None:
    pool = host_pool(sgl)
    key = r"^hicache_storage_backend_extra_config\['ucm_stack'\]"
    stated = {
        "unique_id": "u",
        "shard_size": 4096,
        "tiers": [{"type": "posix", "path": str(tmp_path)}],
    }
    with pytest.raises(
        ucm.ConfigError,
        match=key
        + r": the stack states shard_size: 4096, but SGLang's KV cache has shard_size 32768",
    ) as info:
        create_backend(sgl, storage_config(sgl, {"ucm_stack": stated}), pool)
    assert "MHATokenToKVPoolHost, layout layer_first, 4 layers, page_size 16 tokens" in str(
        info.value
    )
    with pytest.raises(ucm.ConfigError, match=key + r": cannot read stack file"):
        create_backend(sgl, storage_config(sgl, {"ucm_stack": str(tmp_path / "absent.yaml")}), pool)


def test_bad_arguments_raise_naming_the_argument(sgl: SGLang, unique_id: Callable[[], str]) -> None:
    import torch

    pool = host_pool(sgl)
    backend = sgl.StorageBackendFactory.create_backend(
        "dynamic", storage_config(sgl, {"ucm_stack": buffer_stack(unique_id())}), pool
    )
    with pytest.raises(ucm.InvalidArgumentError, match="register_mem_pool_host"):
        backend.batch_exists(["a"])  # the host pool fixes the geometry: not registered yet
    backend.register_mem_pool_host(pool)
    try:
        with pytest.raises(
            ucm.InvalidArgumentError, match=r"host_indices has 8 slots for 1 key\(s\): expected 16"
        ):
            backend.batch_get_v1(["a"], torch.arange(8))
        with pytest.raises(ucm.InvalidArgumentError, match=r"keys\[1\] must be a page hash string"):
            backend.batch_set_v1(["a", 7], pages_at(pool, [0, 1]))
        with pytest.raises(
            ucm.InvalidArgumentError,
            match=r"values\[0\] has 16384 bytes, expected one page of 32768",
        ):
            backend.batch_set(["a"], [torch.zeros(8192, dtype=torch.bfloat16)])
        with pytest.raises(
            ucm.InvalidArgumentError, match=r"target_locations\[0\] is not contiguous"
        ):
            backend.get("a", torch.zeros(2, 32768, dtype=torch.uint8)[:, :16384].T)
        assert backend.batch_exists(["a"]) == 0  # nothing was touched
    finally:
        backend.close()


def test_closing_the_backend_finishes_write_through(
    sgl: SGLang, tmp_path: Path, unique_id: Callable[[], str]
) -> None:
    """SGLang calls close() on detach: every page stored before is on the posix tier then."""
    pool = host_pool(sgl)
    disk = tmp_path / "nvme"
    keys = keys_of(sgl, 8)
    fill(pool, seed=9)
    backend = create_backend(
        sgl, storage_config(sgl, {"ucm_stack": buffer_stack(unique_id(), disk)}), pool
    )
    assert backend.batch_set_v1(keys, pages_at(pool, list(range(8)))) == [True] * 8
    backend.close()
    posix_only = {"unique_id": unique_id(), "tiers": [{"type": "posix", "path": str(disk)}]}
    after = create_backend(sgl, storage_config(sgl, {"ucm_stack": posix_only}), pool)
    try:
        assert after.batch_exists(keys) == 8
    finally:
        after.close()


CLOSED = "the store is closed; open a new one with ucm.open()"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "ucm.integration.sglang" and r.levelno >= logging.WARNING
    ]


def test_gets_and_sets_on_a_closed_store_fail_every_page_and_count_them(
    sgl: SGLang, unique_id: Callable[[], str], caplog: pytest.LogCaptureFixture
) -> None:
    """A get whose load raises and a set whose dump raises (here: the store closed under
    SGLang's prefetch and backup threads) do not raise into SGLang's thread, which would fail
    the batch anyway: every page is False (a miss; not stored), counted in ``get_errors`` /
    ``set_failed`` and SGLang's storage metrics, with one warning per call. Before, nothing was
    counted, not even the call."""
    pool = host_pool(sgl)
    keys = keys_of(sgl, 3)
    fill(pool, seed=31)
    config = storage_config(
        sgl, {"ucm_stack": buffer_stack(unique_id())}, enable_storage_metrics=True
    )
    backend = create_backend(sgl, config, pool)
    assert backend.batch_set_v1(keys, pages_at(pool, [0, 1, 2])) == [True] * 3
    backend.close()  # SGLang's detach, while its threads may still call
    target = pages_at(pool, [4, 5, 6])
    before = [page_bytes(pool, target, i) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="ucm.integration.sglang"):
        assert backend.batch_get_v1(keys, target) == [False] * 3
        assert backend.get(keys[0]) is None  # the tensor interface: the same load
        assert backend.batch_set_v1(keys[:2], pages_at(pool, [0, 1])) == [False] * 2
    assert [page_bytes(pool, target, i) for i in range(3)] == before
    assert _warnings(caplog) == [
        f"UCM HiCache: a get of 3 page(s) failed, none loaded: {CLOSED}",
        f"UCM HiCache: a get of 1 page(s) failed, none loaded: {CLOSED}",
        f"UCM HiCache: a set of 2 page(s) failed, none stored: {CLOSED}",
    ]
    assert backend.stats()["sglang"] == {
        "gets": 2,
        "get_pages": 4,
        "get_hits": 0,
        "get_misses": 0,
        "get_late": 0,
        "get_errors": 4,
        "sets": 2,
        "set_pages": 5,
        "set_stored": 3,
        "set_failed": 2,
        "set_late": 0,
    }
    metrics = backend.get_stats()
    assert (metrics.prefetch_pgs, metrics.backup_pgs) == ([3, 1], [3, 2])
    assert metrics.prefetch_bandwidth == [0, 0] and metrics.backup_bandwidth[1] == 0


def test_a_set_refused_by_a_full_dump_queue_fails_its_pages_and_counts_them(
    sgl: SGLang, unique_id: Callable[[], str], caplog: pytest.LogCaptureFixture
) -> None:
    """A dump queue that stays full past ``dump_submit_timeout_s`` (the dump thread waits for
    write-through room behind a stalled tier) refuses a set's dump with TimeoutError: the set
    returns all False and counts its pages in ``set_failed``, and the same pages are stored
    once the tier drains. Before, the TimeoutError reached SGLang's backup thread uncounted."""
    import torch
    from loadpath import _tiers
    from loadpath._tiers import ENTERED, GATES

    _tiers.register()
    space = f"sgl-full-{uuid.uuid4().hex[:8]}"
    GATES[space] = threading.Event()
    ENTERED[space] = threading.Event()
    pool = host_pool(sgl)
    keys = keys_of(sgl, 3)
    fill(pool, seed=41)
    shard = len(page_bytes(pool, pages_at(pool, [0]), 0))  # one TP rank: a page is a shard
    buffer = {
        "type": "buffer",
        "capacity": "4MiB",
        "write_queue_bytes": shard,  # the write-through held at the gate fills it
        "write_through_wait_s": 60.0,  # a dump waits that long for write-through room
        "dump_queue_depth": 1,
        "dump_submit_timeout_s": 2.0,
    }
    lower = {"type": "recording", "space": space, "write": "through", "gated": True}
    stack = {"unique_id": unique_id(), "tiers": [buffer, lower]}
    backend = create_backend(sgl, storage_config(sgl, {"ucm_stack": stack}), pool)
    try:
        assert backend.batch_set_v1(keys[:1], pages_at(pool, [0])) == [True]  # in the buffer
        assert ENTERED[space].wait(60)  # its write-through waits at the gate
        store = backend.store
        zeros = [torch.zeros(size, dtype=torch.uint8) for size in store.config.tensor_size_list]
        # The dump thread takes the first and waits for room; the second fills the queue.
        held = [store.dump([bytes([n]) * 16], [0], [zeros]) for n in (1, 2)]
        with caplog.at_level(logging.WARNING, logger="ucm.integration.sglang"):
            assert backend.batch_set_v1(keys[1:], pages_at(pool, [1, 2])) == [False, False]
        assert _warnings(caplog) == [
            "UCM HiCache: a set of 2 page(s) failed, none stored: the dump queue stayed full "
            "for 2.0 s: the rank submits faster than the cache drains; wait for earlier tasks "
            "or raise dump_queue_depth / dump_submit_timeout_s"
        ]
        assert backend.batch_exists(keys) == 1
        GATES[space].set()
        for task in held:
            store.wait(task, timeout_s=60)
        assert backend.batch_set_v1(keys[1:], pages_at(pool, [1, 2])) == [True, True]
        assert backend.batch_exists(keys) == 3
        counted = backend.stats()["sglang"]
        assert {name: counted[name] for name in ("sets", "set_pages")} == {
            "sets": 3,
            "set_pages": 5,
        }
        assert (counted["set_stored"], counted["set_failed"]) == (3, 2)
    finally:
        GATES[space].set()
        backend.close()
        _tiers.unregister()


@pytest.mark.parametrize("with_buffer", [True, False], ids=["buffer", "no-buffer"])
def test_a_get_from_a_stalled_tier_returns_by_the_load_deadline_and_never_writes_later(
    sgl: SGLang, unique_id: Callable[[], str], with_buffer: bool
) -> None:
    """A tier that answers the look-up and then stalls (a black-holed S3) holds a get for no
    longer than ``ucm_load_deadline_s``: its pages come back False (SGLang recomputes them),
    and the bytes that arrive later never reach the host pool, which SGLang reuses."""
    from loadpath import _tiers
    from loadpath._tiers import ENTERED, GATES

    _tiers.register()
    space = f"sgl-stall-{uuid.uuid4().hex[:8]}"
    GATES[space] = threading.Event()
    ENTERED[space] = threading.Event()
    lower = {"type": "recording", "space": space}
    pool = host_pool(sgl)
    keys = keys_of(sgl, 4)
    fill(pool, seed=11)
    source = pages_at(pool, [0, 1, 2, 3])
    expected = [page_bytes(pool, source, i) for i in range(4)]
    writer_stack = {
        "unique_id": unique_id(),
        "tiers": [{"type": "buffer", "capacity": "4MiB"}, lower],
    }
    writer = create_backend(sgl, storage_config(sgl, {"ucm_stack": writer_stack}), pool)
    assert writer.batch_set_v1(keys, source) == [True] * 4
    writer.close()  # the pages are in the recording tier now

    tiers: list[dict[str, Any]] = [{**lower, "gated": True}]
    if with_buffer:
        tiers.insert(0, {"type": "buffer", "capacity": "4MiB"})
    extra = {"ucm_stack": {"unique_id": unique_id(), "tiers": tiers}, "ucm_load_deadline_s": 0.5}
    reader = create_backend(sgl, storage_config(sgl, extra), pool)
    try:
        fill(pool, seed=12)
        target = pages_at(pool, [4, 5, 6, 7])
        before = [page_bytes(pool, target, i) for i in range(4)]
        assert reader.batch_exists(keys) == 4  # the tier answers look-ups
        started = time.monotonic()
        assert reader.batch_get_v1(keys, target) == [False] * 4
        assert time.monotonic() - started < 60  # the stalled tier holds its load for 120 s
        assert ENTERED[space].is_set()
        assert reader.get(keys[0]) is None  # the tensor interface is bounded the same way

        GATES[space].set()  # the tier answers now: its bytes land in UCM's memory only
        if with_buffer:
            reader.store.wait_prefetches()
        assert reader._loads.wait_late(60)
        assert [page_bytes(pool, target, i) for i in range(4)] == before

        assert reader.batch_get_v1(keys, target) == [True] * 4
        assert [page_bytes(pool, target, i) for i in range(4)] == expected
        counted = reader.stats()["sglang"]
        assert (counted["gets"], counted["get_pages"], counted["get_hits"]) == (3, 9, 4)
        assert (counted["get_late"], counted["get_misses"], counted["get_errors"]) == (5, 0, 0)
    finally:
        GATES[space].set()
        reader.close()
        _tiers.unregister()


def test_a_set_to_a_stalled_tier_returns_by_the_set_deadline_and_stores_the_bytes_it_was_given(
    sgl: SGLang, unique_id: Callable[[], str], caplog: pytest.LogCaptureFixture
) -> None:
    """Without a CacheBuffer a set waits for the tier: one that stalls (a hung NFS, a
    black-holed S3) held SGLang's backup thread, and the pages' host lock, until the tier
    gave up (here the gate's 120 s; a hung posix never does). Now each set returns False by
    ``ucm_set_deadline_s`` and its dump goes on from staging memory: the bytes stored are the
    ones the set was given, though SGLang rewrote those host pages once it returned. While
    ``SETS_LATE_MAX`` late sets are held, another set fails at once."""
    from loadpath import _tiers
    from loadpath._tiers import ENTERED, GATES

    from ucm.integration.sglang import SETS_LATE_MAX

    _tiers.register()
    space = f"sgl-set-stall-{uuid.uuid4().hex[:8]}"
    GATES[space] = threading.Event()
    ENTERED[space] = threading.Event()
    pool = host_pool(sgl)
    keys = keys_of(sgl, SETS_LATE_MAX + 1)
    fill(pool, seed=51)
    given: list[bytes] = []  # what each set was given
    stack = {
        "unique_id": unique_id(),
        "tiers": [{"type": "recording", "space": space, "gated": True}],
    }
    extra = {"ucm_stack": stack, "ucm_set_deadline_s": 0.5}
    backend = create_backend(sgl, storage_config(sgl, extra), pool)
    try:
        with caplog.at_level(logging.WARNING, logger="ucm.integration.sglang"):
            for n in range(SETS_LATE_MAX):
                given.append(page_bytes(pool, pages_at(pool, [n]), 0))
                started = time.monotonic()
                assert backend.batch_set_v1([keys[n]], pages_at(pool, [n])) == [False]
                assert time.monotonic() - started < 60  # the gate holds the dump for 120 s
                fill(pool, seed=52 + n)  # SGLang reuses the pages once the set returned
            assert ENTERED[space].is_set()
            slots = backend._set_slots  # one reservation: the late sets hold their slots
            assert slots is not None and slots.held == SETS_LATE_MAX
            last = pages_at(pool, [SETS_LATE_MAX])
            # Failed at once, without a copy or a dump: the warning below says which way.
            assert backend.batch_set_v1(keys[SETS_LATE_MAX:], last) == [False]
        late = (
            "UCM HiCache: a set of 1 page(s) was not stored within ucm_set_deadline_s (0.5 s); "
            "its dump goes on from UCM's staging memory, not SGLang's pages"
        )
        assert _warnings(caplog) == [late] * SETS_LATE_MAX + [
            f"UCM HiCache: a set of 1 page(s) not stored: the tiers still hold {SETS_LATE_MAX} "
            "earlier sets past ucm_set_deadline_s (0.5 s)"
        ]
        assert backend.batch_exists(keys) == 0

        GATES[space].set()  # the tier takes the late dumps now, from the staging memory
        deadline = time.monotonic() + 60
        while backend.batch_exists(keys) < SETS_LATE_MAX and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.batch_exists(keys) == SETS_LATE_MAX
        target = pages_at(pool, list(range(8, 8 + SETS_LATE_MAX)))
        assert backend.batch_get_v1(keys[:SETS_LATE_MAX], target) == [True] * SETS_LATE_MAX
        assert [page_bytes(pool, target, n) for n in range(SETS_LATE_MAX)] == given
        assert backend.batch_set_v1(keys[SETS_LATE_MAX:], last) == [True]  # none held now
        assert backend._set_slots is slots and slots.held == 0  # the late sets' slots freed
        counted = backend.stats()["sglang"]
        assert {name: counted[name] for name in ("sets", "set_pages", "set_stored")} == {
            "sets": SETS_LATE_MAX + 2,
            "set_pages": SETS_LATE_MAX + 2,
            "set_stored": 1,
        }
        assert (counted["set_failed"], counted["set_late"]) == (SETS_LATE_MAX + 1,) * 2
    finally:
        GATES[space].set()
        backend.close()
        _tiers.unregister()


def test_staged_sets_store_each_page_byte_exact_in_reused_staging_memory(
    sgl: SGLang, unique_id: Callable[[], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sets without a CacheBuffer (posix only) are staged in slots reused from set to set:
    sets of 3, 1, 2 and 4 pages, with the host pages rewritten after each, store the bytes
    each set was given. The slots are reserved for ``SETS_LATE_MAX`` + 1 sets of SGLang's
    storage batch (here 2 pages) or of the largest set so far: the 3-page set reserves 15
    slots, and the 4-page set 20 anew."""
    from ucm.integration import sglang as ucm_sglang

    monkeypatch.setattr(ucm_sglang, "SET_BATCH_PAGES", 2)
    pool = host_pool(sgl)
    keys = keys_of(sgl, 10)
    stack = {"unique_id": unique_id(), "tiers": [{"type": "posix", "path": str(tmp_path)}]}
    backend = create_backend(sgl, storage_config(sgl, {"ucm_stack": stack}), pool)
    try:
        given: list[bytes] = []
        first = 0
        reserved = []
        for seed, count in enumerate((3, 1, 2, 4)):
            fill(pool, seed=70 + seed)
            pages = pages_at(pool, list(range(count)))
            given += [page_bytes(pool, pages, n) for n in range(count)]
            assert backend.batch_set_v1(keys[first : first + count], pages) == [True] * count
            first += count
            slots = backend._set_slots
            assert slots is not None and slots.held == 0  # given back once the dump ended
            if not reserved or reserved[-1][0] is not slots:
                reserved.append((slots, slots.capacity))
        assert [capacity for _slots, capacity in reserved] == [15, 20]
        assert reserved[0][0].high_water == 3 and reserved[1][0].high_water == 4
        fill(pool, seed=80)
        for start in (0, 5):  # 5 pages at a time, into other host pages
            target = pages_at(pool, list(range(8, 13)))
            assert backend.batch_get_v1(keys[start : start + 5], target) == [True] * 5
            assert [page_bytes(pool, target, n) for n in range(5)] == given[start : start + 5]
        counted = backend.stats()["sglang"]
        assert (counted["set_stored"], counted["set_late"]) == (10, 0)
    finally:
        backend.close()


def test_a_staged_set_whose_dump_raises_fails_its_pages_and_frees_its_slots(
    sgl: SGLang, unique_id: Callable[[], str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A staged set whose dump raises (here: the store closed under SGLang's backup thread)
    fails every page, with the closed store's warning, and gives its staging slots back: no
    dump reads them."""
    pool = host_pool(sgl)
    keys = keys_of(sgl, 4)
    fill(pool, seed=90)
    stack = {"unique_id": unique_id(), "tiers": [{"type": "posix", "path": str(tmp_path)}]}
    backend = create_backend(sgl, storage_config(sgl, {"ucm_stack": stack}), pool)
    assert backend.batch_set_v1(keys[:2], pages_at(pool, [0, 1])) == [True, True]
    slots = backend._set_slots
    assert slots is not None and slots.held == 0
    backend.close()
    with caplog.at_level(logging.WARNING, logger="ucm.integration.sglang"):
        assert backend.batch_set_v1(keys[2:], pages_at(pool, [2, 3])) == [False, False]
    assert _warnings(caplog) == [f"UCM HiCache: a set of 2 page(s) failed, none stored: {CLOSED}"]
    assert backend._set_slots is slots and slots.held == 0 and slots.high_water == 2
    counted = backend.stats()["sglang"]
    assert (counted["set_stored"], counted["set_failed"], counted["set_late"]) == (2, 2, 0)


def test_a_set_over_a_buffer_that_writes_back_never_waits_for_a_tier_that_holds_writes(
    sgl: SGLang, unique_id: Callable[[], str]
) -> None:
    """A CacheBuffer of 2 slots over a ``write: back`` tier that holds every write: once the
    slots are dirty, a dump goes straight down or waits for the write-back debt, at the
    tier's gate. Sets over such a buffer are staged, so each returns by
    ``ucm_set_deadline_s``, and every page is stored with the bytes its set was given once
    the tier takes the writes. On the code before, the third set waited at the gate (120 s)."""
    from loadpath import _tiers
    from loadpath._tiers import ENTERED, GATES

    _tiers.register()
    space = f"sgl-set-back-{uuid.uuid4().hex[:8]}"
    GATES[space] = threading.Event()
    ENTERED[space] = threading.Event()
    pool = host_pool(sgl)
    keys = keys_of(sgl, 4)
    fill(pool, seed=61)
    shard = len(page_bytes(pool, pages_at(pool, [0]), 0))  # one TP rank: a page is a shard
    given: list[bytes] = []  # what each set was given
    buffer = {"type": "buffer", "capacity": 2 * shard}
    lower = {"type": "recording", "space": space, "gated": True, "write": "back"}
    stack = {"unique_id": unique_id(), "tiers": [buffer, lower]}
    extra = {"ucm_stack": stack, "ucm_set_deadline_s": 0.5}
    backend = create_backend(sgl, storage_config(sgl, extra), pool)
    try:
        assert backend.store.buffer.stats()["capacity_slots"] == 2
        stored = []
        for n in range(4):
            given.append(page_bytes(pool, pages_at(pool, [n]), 0))
            started = time.monotonic()
            stored += backend.batch_set_v1([keys[n]], pages_at(pool, [n]))
            assert time.monotonic() - started < 60  # the gate holds a write for 120 s
            fill(pool, seed=62 + n)  # SGLang reuses the pages once the set returned
        assert ENTERED[space].is_set() and not all(stored)

        GATES[space].set()
        deadline = time.monotonic() + 60
        while backend.batch_exists(keys) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        target = pages_at(pool, [8, 9, 10, 11])
        assert backend.batch_get_v1(keys, target) == [True] * 4
        assert [page_bytes(pool, target, n) for n in range(4)] == given
        counted = backend.stats()["sglang"]
        assert (counted["set_stored"], counted["set_late"]) == (sum(stored), 4 - sum(stored))
    finally:
        GATES[space].set()
        backend.close()
        _tiers.unregister()


def test_a_get_from_a_black_holed_s3_returns_by_the_load_deadline(
    sgl: SGLang, unique_id: Callable[[], str]
) -> None:
    """The same over the network: pages written through to a real S3 (moto), then the
    endpoint black-holed (a TCP proxy on 127.0.0.1 that accepts and never answers). The get
    returns by ``ucm_load_deadline_s`` instead of s3fs's ~106 s, and the host pool is unchanged
    once the late load has failed."""
    from harness.faults import FaultProxy
    from harness.s3 import shared_server

    s3 = shared_server()
    pool = host_pool(sgl)
    keys = keys_of(sgl, 4)
    fill(pool, seed=13)
    source = pages_at(pool, [0, 1, 2, 3])
    with FaultProxy(("127.0.0.1", s3.port)) as proxy:
        lower = {
            "type": "fsspec",
            "url": s3.url(f"sgl-hole-{uuid.uuid4().hex[:8]}"),
            "storage_options": {**s3.storage_options, "endpoint_url": proxy.endpoint},
            "write": "through",
        }
        writer_stack = {
            "unique_id": unique_id(),
            "tiers": [{"type": "buffer", "capacity": "4MiB"}, lower],
        }
        writer = create_backend(sgl, storage_config(sgl, {"ucm_stack": writer_stack}), pool)
        assert writer.batch_set_v1(keys, source) == [True] * 4
        writer.close()  # written through to S3
        before_hole = s3.requests()["PUT"]
        assert before_hole >= 4

        proxy.set_mode("blackhole")  # every connection from now on: accepted, never answered
        reader_stack = {
            "unique_id": unique_id(),
            "tiers": [{"type": "buffer", "capacity": "4MiB"}, lower],
        }
        extra = {"ucm_stack": reader_stack, "ucm_load_deadline_s": 1.0}
        reader = create_backend(sgl, storage_config(sgl, extra), pool)
        try:
            fill(pool, seed=14)
            target = pages_at(pool, [4, 5, 6, 7])
            before = [page_bytes(pool, target, i) for i in range(4)]
            started = time.monotonic()
            assert reader.batch_get_v1(keys, target) == [False] * 4
            assert time.monotonic() - started < 30  # s3fs alone waits ~106 s per request
            assert proxy.accepted_by_mode["blackhole"] >= 1  # the load reached the hole
            proxy.stop()  # its sockets close: the late prefetch fails now, not in ~106 s
            reader.store.wait_prefetches()
            assert reader._loads.wait_late(60)
            assert [page_bytes(pool, target, i) for i in range(4)] == before
        finally:
            reader.close()
