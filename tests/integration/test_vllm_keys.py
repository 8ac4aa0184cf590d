"""What a vLLM block id covers: ``key_space`` over real vLLM config objects (no engine).

Each case builds vLLM's own ``ModelConfig``/``CacheConfig``/``VllmConfig`` for a random-weight
Llama written locally, and a ``KVCacheConfig`` of one full-attention group as vLLM's CPU runner
makes it, and asserts that the change gives another salt (so no block id is shared). The
engine-level proofs (an ``hf_overrides`` engine shares no block; a reset serves nothing saved
before it) are in test_vllm_reset.py.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        raise RuntimeError("vllm is not installed, and CI must run the vLLM tests")
    pytest.skip("vllm is not installed", allow_module_level=True)

from harness.vllm import write_tiny_llama
from ucm.integration import vllm as connector
from ucm.integration.vllm.config import check_extra_config

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("keys-model") / "llama", seed=0)


def _space(
    model: Path, *, dtype: Any = None, extra: dict[str, Any] | None = None, **kw: Any
) -> Any:
    """key_space of an engine on ``model``: ``kw`` go to ModelConfig, ``cache_dtype`` to
    CacheConfig; ``dtype`` is the KV cache's storage dtype vLLM picks (uint8 for both fp8s)."""
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    cache_dtype = kw.pop("cache_dtype", "auto")
    model_config = ModelConfig(model=str(model), dtype="float32", skip_tokenizer_init=True, **kw)
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=128, cache_dtype=cache_dtype),
        kv_transfer_config=KVTransferConfig(
            kv_connector="UcmConnector",
            kv_connector_module_path="ucm.integration.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"ucm_stack": {}, **(extra or {})},
        ),
    )
    vllm_config.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves on CPU
    spec = FullAttentionSpec(
        block_size=128,
        num_kv_heads=2,
        head_size=32,
        dtype=dtype if dtype is not None else torch.float32,
    )
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    page = spec.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * 16 * len(layers),
                layers=layers,
                layer_stride=page * 16,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)],
    )
    return connector.key_space(vllm_config, kv_cache_config)


def test_rope_and_hf_overrides_change_the_salt(model: Path) -> None:
    base = _space(model)
    assert _space(model).salt() == base.salt()  # deterministic
    salts = {
        base.salt(),
        _space(model, hf_overrides={"rope_theta": 500}).salt(),
        _space(model, hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}).salt(),
        _space(model, hf_overrides={"max_position_embeddings": 2048}).salt(),
    }
    assert len(salts) == 4


def test_fp8_formats_and_kv_dtypes_change_the_salt(model: Path) -> None:
    import torch

    e4m3 = _space(model, cache_dtype="fp8_e4m3", dtype=torch.uint8)
    e5m2 = _space(model, cache_dtype="fp8_e5m2", dtype=torch.uint8)
    assert e4m3.dtype == e5m2.dtype == "torch.uint8"  # what the KV cache spec says
    assert e4m3.salt() != e5m2.salt()
    assert _space(model).salt() != e4m3.salt()


def test_other_weights_at_the_same_path_change_the_salt(model: Path, tmp_path: Path) -> None:
    path = tmp_path / "model"
    shutil.copytree(model, path)
    before = _space(path)
    # A checkpoint overwritten in place: same path, same config, other weights.
    other = write_tiny_llama(tmp_path / "other", seed=1)
    for weights in other.glob("*.safetensors"):
        shutil.copy(weights, path / weights.name)
    after = _space(path)
    assert before.model == after.model
    assert before.salt() != after.salt()
    # Stated weights ids replace the fingerprint: equal ids, equal salts, on any path.
    stated = _space(path, extra={"ucm_weights_id": "ckpt-7"})
    assert stated.salt() != after.salt()
    assert stated.salt() != _space(path, extra={"ucm_weights_id": "ckpt-8"}).salt()


def test_a_lora_adapter_is_named_by_its_files_not_its_name(tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    from ucm.integration.salts import lora_identity

    first, second = tmp_path / "a", tmp_path / "b"
    for directory, content in ((first, b"A" * 64), (second, b"B" * 96)):
        directory.mkdir()
        (directory / "adapter_config.json").write_text('{"r": 8}')
        (directory / "adapter_model.safetensors").write_bytes(content)
    one = LoRARequest("adapter", 1, str(first))
    same_name = LoRARequest("adapter", 1, str(second))
    assert lora_identity(one) != lora_identity(same_name)
    assert lora_identity(one) == lora_identity(LoRARequest("adapter", 2, str(first)))
    # The adapter replaced in place (same name, same path): another identity.
    before = lora_identity(one)
    (first / "adapter_model.safetensors").write_bytes(b"C" * 80)
    assert lora_identity(one) != before
    assert lora_identity(None) is None


def test_a_bad_weights_id_is_refused() -> None:
    from ucm import ConfigError

    with pytest.raises(ConfigError) as raised:
        check_extra_config({"ucm_stack": {}, "ucm_weights_id": 7})
    assert str(raised.value).startswith(
        "kv_connector_extra_config['ucm_weights_id']: 7 is not valid: expected a non-empty string"
    )
