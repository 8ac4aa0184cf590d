"""What vLLM's configs fix for UCM: the layers UCM stores, the shard geometry and the key space
(the salt of every block id). Derived once per process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ucm.errors import ConfigError

from ..keys import EngineGeometry, KeySpace
from ..salts import vllm_fields
from .config import STACK_KEY_NAME

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def transfer_layers(kv_cache_config: KVCacheConfig) -> tuple[Any, list[str]]:
    """The KV cache spec and the layer names whose KV UCM stores, in a fixed order: the layers
    that own KV memory (``kv_cache_tensors``), not layers reusing another layer's cache."""
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        kinds = ", ".join(type(group.kv_cache_spec).__name__ for group in groups)
        raise ConfigError(
            f"{STACK_KEY_NAME}: UCM's vLLM connector stores models with one KV cache group "
            f"(every layer full attention); this model has {len(groups)} ({kinds})"
        )
    group = groups[0]
    members = set(group.layer_names)
    layers = [
        name for tensor in kv_cache_config.kv_cache_tensors for name in tensor.layers
    ] or list(group.layer_names)
    layers = [name for name in dict.fromkeys(layers) if name in members]
    if not layers:
        raise ConfigError(f"{STACK_KEY_NAME}: vLLM's KV cache has no attention layers to store")
    return group.kv_cache_spec, layers


def block_shape_bytes(spec: Any) -> tuple[int, int, int]:
    """``(kv_heads, rows, bytes per row)`` of one layer's block of this rank."""
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

    _, heads, rows, row_bytes = compute_layer_kv_cache_shape_bytes(spec, 1)
    return int(heads), int(rows), int(row_bytes)


def layout_name(vllm_config: VllmConfig) -> str:
    return str(vllm_config.cache_config.get_resolved_kv_cache_layout().name)


def engine_geometry(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> EngineGeometry:
    """The shard geometry vLLM's KV cache fixes: one tensor per layer (one vLLM block of this TP
    rank), one shard per TP rank."""
    spec, layers = transfer_layers(kv_cache_config)
    heads, rows, row_bytes = block_shape_bytes(spec)
    per_layer = heads * rows * row_bytes
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    return EngineGeometry(
        tensor_sizes=(per_layer,) * len(layers),
        shards_per_block=tp_size,
        description=(
            f"{len(layers)} layers, one tensor per layer: a {spec.block_size}-token vLLM block "
            f"of one TP rank, [{heads} kv heads, {rows} rows, {row_bytes} bytes] = {per_layer} "
            f"bytes of {spec.dtype}, layout {layout_name(vllm_config)}; one shard per TP rank "
            f"(TP size {tp_size})"
        ),
        dtype=str(spec.dtype),
    )


def key_space(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KeySpace:
    """Everything that makes this engine's KV incompatible with another's: the salt of every
    block id the connector computes."""
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    spec, layers = transfer_layers(kv_cache_config)
    heads, rows, row_bytes = block_shape_bytes(spec)
    backend = attention_backend(vllm_config)
    kv_layout = (
        f"{backend}/{layout_name(vllm_config)}/{type(spec).__name__}/layers={len(layers)}/"
        f"block=[{heads},{rows},{row_bytes}B]/head_size={getattr(spec, 'head_size', '')}"
    )
    connector_extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    extra = vllm_fields(vllm_config, connector_extra.get("ucm_weights_id"))
    return KeySpace(
        engine="vllm",
        model=str(model_config.model),
        dtype=str(spec.dtype),
        block_tokens=int(cache_config.block_size),
        kv_layout=kv_layout,
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        extra=extra,
    )


def attention_backend(vllm_config: VllmConfig) -> str:
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backend

    return str(get_current_attn_backend(vllm_config).get_name())
