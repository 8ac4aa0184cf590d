"""The connector's configuration: the ``ucm_*`` keys of ``kv_connector_extra_config``, the
parallelism UCM supports, and opening the stack."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ucm
from ucm.affinity import follow_binding
from ucm.errors import ConfigError, UcmError

from ..bounded import LOAD_DEADLINE_S_DEFAULT, check_load_deadline_s
from ..endpoint import check_metrics_port
from ..keys import EngineGeometry, engine_stack
from ..tenants import TenantMapping

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from ucm.store import Store

logger = logging.getLogger("vllm.ucm")  # a child of vLLM's logger: printed like vLLM's own lines

STACK_KEY = "ucm_stack"
EXTRA_KEYS = {
    STACK_KEY: "the stack: a YAML path or a dict (unique_id and tiers)",
    "ucm_metrics_port": "serve UCM's Prometheus metrics from each worker on port + TP rank "
    "(0: a free port, logged)",
    "ucm_report_block_ids": "true: each finished request's kv_transfer_params lists the UCM ids "
    "of its full blocks (hex), for use with the UCM API",
    "ucm_namespace": "how requests map to UCM namespaces: cache_salt (default: each request's "
    "cache_salt names its namespace), lora (its LoRA adapter's name) or fixed:<name>",
    "ucm_weights_id": "a string naming the weights, instead of UCM's fingerprint of the model "
    "files (for copies of one checkpoint on several nodes; change it with the weights)",
    "ucm_async_load": "true (default): a request whose matched blocks are not all in the "
    "CacheBuffer loads them asynchronously, waiting in WAITING_FOR_REMOTE_KVS while the others "
    "run (under vLLM's asynchronous scheduling every load does); false: every load finishes "
    "before the forward pass (refused under vLLM's asynchronous scheduling, where a failed one "
    "would cost a wrong token)",
    "ucm_load_deadline_s": "seconds an asynchronous load may take (default "
    "10); blocks not in the CacheBuffer (without one: not loaded) by then are reported failed "
    "and recomputed; also the most a step's load waits for this rank's own dumps of its blocks",
    "ucm_lookup_wait_ms": "milliseconds the scheduler waits for a look-up that reaches a tier "
    "below the CacheBuffer (default 20); a slower one finishes in the background while vLLM "
    "schedules the other requests, and its request is scheduled on a later step",
    "ucm_compute_wait_ms": "milliseconds a request waits, at most, for another engine on the "
    "node that is computing its first missing block, instead of computing it a second time "
    "(default 20000; 0: never waits); needs a CacheBuffer",
}
"""The ``ucm_*`` keys of ``kv_connector_extra_config``; any other ``ucm_*`` key is refused."""


def extra_key(name: str) -> str:
    return f"kv_connector_extra_config[{name!r}]"


STACK_KEY_NAME = extra_key(STACK_KEY)


def check_extra_config(extra: Mapping[str, Any]) -> None:
    unknown = sorted(key for key in extra if key.startswith("ucm_") and key not in EXTRA_KEYS)
    if unknown:
        valid = "; ".join(f"{key}: {meaning}" for key, meaning in EXTRA_KEYS.items())
        raise ConfigError(
            f"{extra_key(unknown[0])}: unknown UCM key (misspelled?); the UCM keys are: {valid}"
        )
    check_metrics_port(extra.get("ucm_metrics_port"), extra_key("ucm_metrics_port"))
    weights_id = extra.get("ucm_weights_id")
    if weights_id is not None and (not isinstance(weights_id, str) or not weights_id):
        raise ConfigError(
            f"{extra_key('ucm_weights_id')}: {weights_id!r} is not valid: expected a non-empty "
            "string naming the weights"
        )
    TenantMapping.parse(extra.get("ucm_namespace"), extra_key("ucm_namespace"))
    async_load = extra.get("ucm_async_load")
    if async_load is not None and not isinstance(async_load, bool):
        raise ConfigError(
            f"{extra_key('ucm_async_load')}: {async_load!r} is not valid: expected true or false"
        )
    load_deadline_s(extra)
    lookup_wait_s(extra)
    compute_wait_s(extra)
    report = extra.get("ucm_report_block_ids")
    if report is not None and not isinstance(report, bool):
        raise ConfigError(
            f"{extra_key('ucm_report_block_ids')}: {report!r} is not valid: expected true or false"
        )


def load_deadline_s(extra: Mapping[str, Any]) -> float:
    """``ucm_load_deadline_s``: how long an asynchronous load may take, in seconds."""
    return check_load_deadline_s(
        extra.get("ucm_load_deadline_s", LOAD_DEADLINE_S_DEFAULT), extra_key("ucm_load_deadline_s")
    )


LOOKUP_WAIT_MS_DEFAULT = 20
LOOKUP_WAIT_MS_MAX = 10_000


def _milliseconds_s(extra: Mapping[str, Any], key: str, default: int, maximum: int) -> float:
    """The ``key`` of ``kv_connector_extra_config``: milliseconds in [0, maximum], in seconds."""
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= maximum:
        raise ConfigError(
            f"{extra_key(key)}: {value!r} is not valid: expected a number of "
            f"milliseconds in [0, {maximum}] (default {default})"
        )
    return float(value) / 1000


def lookup_wait_s(extra: Mapping[str, Any]) -> float:
    """``ucm_lookup_wait_ms``: how long the scheduler waits for a look-up, in seconds."""
    return _milliseconds_s(extra, "ucm_lookup_wait_ms", LOOKUP_WAIT_MS_DEFAULT, LOOKUP_WAIT_MS_MAX)


COMPUTE_WAIT_MS_DEFAULT = 20_000
COMPUTE_WAIT_MS_MAX = 600_000


def compute_wait_s(extra: Mapping[str, Any]) -> float:
    """``ucm_compute_wait_ms``: how long a request waits for another engine's compute of its
    first missing block (:mod:`ucm.integration.claims`), in seconds."""
    return _milliseconds_s(
        extra, "ucm_compute_wait_ms", COMPUTE_WAIT_MS_DEFAULT, COMPUTE_WAIT_MS_MAX
    )


def check_full_attention(kv_cache_config: KVCacheConfig) -> None:
    """Refuses KV cache specs other than full attention. A sliding-window (or chunked-local,
    circular, Mamba, sparse) group frees the blocks behind its window and points the block
    table at vLLM's null block: a block id would no longer name the KV of its token prefix,
    and UCM would load into, and save from, the shared null block."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
            raise ConfigError(
                f"{STACK_KEY_NAME}: UCM's vLLM connector stores full-attention KV caches only; "
                f"this model has a {type(spec).__name__} group (layers "
                f"{', '.join(group.layer_names[:4])}{', ...' if len(group.layer_names) > 4 else ''}"
                f"{_window(spec)}): its block table holds vLLM's null block for the blocks "
                "outside the window, which UCM cannot store or serve"
            )


def _window(spec: object) -> str:
    window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
    return f", window {window} tokens" if window else ""


def _check_parallelism(vllm_config: VllmConfig) -> None:
    parallel = vllm_config.parallel_config
    for name in (
        "pipeline_parallel_size",
        "data_parallel_size",
        "decode_context_parallel_size",
        "prefill_context_parallel_size",
    ):
        value = int(getattr(parallel, name, 1) or 1)
        if value != 1:
            raise ConfigError(
                f"{STACK_KEY_NAME}: UCM's vLLM connector supports tensor parallelism only; "
                f"{name}={value} is not supported (a shard is one TP rank's part of a block "
                "over all layers)"
            )


def open_store(
    vllm_config: VllmConfig,
    geometry: EngineGeometry,
    device_id: int,
    local_rank_size: int,
) -> Store:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    check_extra_config(extra)
    _check_parallelism(vllm_config)
    stack = engine_stack(extra.get(STACK_KEY), geometry, key=STACK_KEY_NAME, engine="vLLM")
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    try:
        stack, sized = follow_binding(stack, bind)
    except ConfigError:
        sized = {}  # a binding UCM cannot read: the worker logs it and leaves threads unbound
    if sized:
        logger.info(
            "UCM rank %d: %s sized to the CPUs the engine's binding leaves free "
            "(VLLM_CPU_OMP_THREADS_BIND=%r)",
            device_id,
            ", ".join(f"{key}={value}" for key, value in sized.items()),
            bind,
        )
    try:
        return ucm.open(stack, device_id=device_id, local_rank_size=local_rank_size)
    except UcmError as exc:
        raise ConfigError(f"{STACK_KEY_NAME}: {exc}") from exc


def ranks_per_node(vllm_config: VllmConfig) -> int:
    """TP ranks that share this node's CacheBuffer."""
    parallel = vllm_config.parallel_config
    tp_size = int(parallel.tensor_parallel_size)
    nodes = int(getattr(parallel, "nnodes", 1) or 1)
    if nodes > 1 and tp_size % nodes == 0:
        return tp_size // nodes
    return tp_size
