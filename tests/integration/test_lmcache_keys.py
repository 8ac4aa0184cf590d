"""What an LMCache chunk id covers, against the real lmcache 0.5.6: fp8 formats (LMCache's keys
and metadata say ``torch.uint8`` for both), LoRA (LMCache's keys carry no adapter), multi-node
TP on a node-local stack, and the salt memo's bound. Plugins are built by LMCache's own
``StorageManager`` from its config, as in test_lmcache.py."""

from __future__ import annotations

import logging
import os
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import lmcache  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise
    pytest.skip("lmcache is not installed", allow_module_level=True)

import torch

import ucm

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from . import _lmcache as lm

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning"),
]

FORMAT_KEY = "extra_config['storage_plugin.ucm.kv_dtype']"
FP8_CHUNK_BYTES = 2 * lm.LAYERS * lm.CHUNK * lm.HIDDEN  # one byte per element


@pytest.fixture
def unique_id() -> Iterator[str]:
    from ucm.native import segments

    name = f"lmck-{uuid.uuid4().hex[:12]}"
    yield name
    segments.unlink(name)


def fp8_metadata(world_size: int = 1, local_world_size: int | None = None) -> Any:
    """LMCache's metadata of an fp8 KV cache, as its vLLM adapter builds it: kv_dtype uint8."""
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name=lm.MODEL,
        world_size=world_size,
        local_world_size=local_world_size or world_size,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.uint8,
        kv_shape=(lm.LAYERS, 2, lm.CHUNK, lm.HEADS, lm.HEAD_SIZE),
        chunk_size=lm.CHUNK,
    )


def fp8_key(chunk_hash: int) -> Any:
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(lm.MODEL, 1, 0, chunk_hash, torch.uint8)


def buffer_stack(unique_id: str) -> dict[str, Any]:
    return {"unique_id": unique_id, "tiers": [{"type": "buffer", "capacity": "1MiB"}]}


def fp8_manager(stack: dict[str, Any], kv_dtype: str | None) -> Any:
    extra = {"storage_plugin.ucm.kv_dtype": kv_dtype} if kv_dtype is not None else {}
    return lm.storage_manager(lm.config(stack, extra_config=extra), fp8_metadata())


def test_fp8_e4m3_and_e5m2_chunks_get_different_ids(unique_id: str) -> None:
    stack = buffer_stack(unique_id)
    e4m3 = fp8_manager(stack, "fp8_e4m3")
    e5m2 = fp8_manager(stack, "fp8_e5m2")
    try:
        assert "ucm" in e4m3.storage_backends and "ucm" in e5m2.storage_backends
        keys = [fp8_key(h) for h in (1, 2, 3)]
        objs = [e4m3.allocate(e4m3.metadata.get_shapes(), e4m3.metadata.get_dtypes()) for _ in keys]
        for index, obj in enumerate(objs):
            assert obj is not None and obj.get_size() == FP8_CHUNK_BYTES
            obj.raw_tensor[:FP8_CHUNK_BYTES].fill_(index + 1)
        e4m3.batched_put(keys, objs)
        ucm_e4m3, ucm_e5m2 = e4m3.storage_backends["ucm"], e5m2.storage_backends["ucm"]
        assert ucm_e4m3.flush(timeout_s=60)
        assert ucm_e4m3.batched_contains(keys) == 3
        assert ucm_e5m2.batched_contains(keys) == 0
        assert ucm_e5m2.ucm_key(keys[0]) != ucm_e4m3.ucm_key(keys[0])
        assert ucm_e5m2.batched_get_blocking(keys) == [None, None, None]
    finally:
        e4m3.close()
        e5m2.close()


def test_fp8_alias_is_e4m3(unique_id: str) -> None:
    stack = buffer_stack(unique_id)
    plain, e4m3 = fp8_manager(stack, "fp8"), fp8_manager(stack, "fp8_e4m3")
    try:
        key = fp8_key(9)
        assert plain.storage_backends["ucm"].ucm_key(key) == e4m3.storage_backends["ucm"].ucm_key(
            key
        )
    finally:
        plain.close()
        e4m3.close()


def test_a_uint8_kv_cache_without_a_stated_format_is_refused(unique_id: str) -> None:
    from ucm.integration.lmcache import UcmStorageBackend

    sm = lm.storage_manager(lm.config(plugin=False), lm.metadata())
    try:
        with pytest.raises(ucm.ConfigError) as raised:
            UcmStorageBackend(
                config=lm.config(buffer_stack(unique_id)),
                dst_device="cpu",
                metadata=fp8_metadata(),
                local_cpu_backend=sm.storage_backends["LocalCPUBackend"],
                loop=None,
            )
    finally:
        sm.close()
    assert str(raised.value).startswith(
        f"{FORMAT_KEY} is missing: LMCache hands UCM this KV cache as torch.uint8, the storage "
        "dtype of every fp8 format, so chunks of fp8_e4m3 and fp8_e5m2 would share ids"
    )


def test_a_bad_format_is_refused(unique_id: str) -> None:
    with lm.lmcache_logs() as logs:
        sm = fp8_manager(buffer_stack(unique_id), "e4m3")
    sm.close()
    assert any(
        m.startswith(f"Failed to create backend ucm: {FORMAT_KEY}='e4m3': expected one of")
        for m in logs.messages()
    ), logs.messages()


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not os.environ.get("CI"):
        pytest.importorskip("vllm")
    from harness.vllm import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("lmc-model") / "llama", seed=0)


def _vllm_config(model: Path, **fields: Any) -> Any:
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    cache_dtype = fields.pop("cache_dtype", "auto")
    return VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", skip_tokenizer_init=True),
        cache_config=CacheConfig(block_size=16, cache_dtype=cache_dtype),
        **fields,
    )


def test_inside_a_lora_enabled_vllm_the_plugin_is_refused(unique_id: str, vllm_model: Path) -> None:
    from vllm.config import LoRAConfig, set_current_vllm_config

    config = _vllm_config(vllm_model, lora_config=LoRAConfig())
    with set_current_vllm_config(config), lm.lmcache_logs() as logs:
        sm = lm.storage_manager(lm.config(buffer_stack(unique_id)), lm.metadata())
    try:
        assert "ucm" not in sm.storage_backends
    finally:
        sm.close()
    assert any(
        m.startswith(
            "Failed to create backend ucm: UcmStorageBackend: vLLM runs with LoRA enabled, and "
            "LMCache 0.5.6's chunk keys carry no LoRA adapter"
        )
        for m in logs.messages()
    ), logs.messages()


def test_inside_vllm_a_stated_format_must_match_vllms(unique_id: str, vllm_model: Path) -> None:
    from vllm.config import set_current_vllm_config

    config = _vllm_config(vllm_model, cache_dtype="fp8_e5m2")
    with set_current_vllm_config(config), lm.lmcache_logs() as logs:
        sm = fp8_manager(buffer_stack(unique_id), "fp8_e4m3")
    sm.close()
    assert any(
        m == f"Failed to create backend ucm: {FORMAT_KEY}='fp8_e4m3', but vLLM runs with "
        "kv_cache_dtype 'fp8_e5m2': make them match"
        for m in logs.messages()
    ), logs.messages()


def test_multi_node_tp_on_a_node_local_stack_warns(
    unique_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """World size 4 over 2 nodes (2 workers per node): a chunk's 4 shards are never in one
    node's buffer."""
    meta = lm.metadata(4, 0)
    meta.local_world_size = 2
    with caplog.at_level(logging.WARNING, logger="ucm.integration.keys"):
        sm = lm.storage_manager(lm.config(buffer_stack(unique_id)), meta)
    sm.close()
    assert [r.getMessage() for r in caplog.records if "nodes" in r.getMessage()] == [
        "UCM: LMCache runs tensor parallelism over 2 nodes: a block is 4 shards (one per TP "
        "rank), and a node's buffer holds only its own ranks' shards, so a block is complete "
        "only in a tier shared by every node; this stack has no tier below the buffer, so it "
        "never hits. Fix: give the stack a shared lower tier (posix on a shared filesystem, "
        "s3, mooncake)"
    ]


def test_the_salt_memo_is_bounded(unique_id: str) -> None:
    """One tag tuple per user (LMCache's ``lmcache.tag.*`` request configs): the plugin keeps at
    most 4096 salts, and a salt that fell out is computed again, the same."""
    from lmcache.utils import CacheEngineKey

    def tagged(user: int) -> Any:
        return CacheEngineKey(
            lm.MODEL, 1, 0, 7, lm.DTYPE, request_configs={"lmcache.tag.user": str(user)}
        )

    sm = lm.storage_manager(lm.config(buffer_stack(unique_id)), lm.metadata())
    try:
        backend = sm.storage_backends["ucm"]
        first = backend.ucm_key(tagged(0))
        for user in range(1, 4096 + 500):
            backend.ucm_key(tagged(user))
        memo = backend._salts
        kept = len(memo) if isinstance(memo, dict) else memo.cache_info().currsize
        assert kept <= 4096
        assert backend.ucm_key(tagged(0)) == first  # out of the memo, computed the same
        assert backend.ucm_key(tagged(1)) != first
    finally:
        sm.close()
