"""UCM as a vLLM KV connector: ``UcmConnector``, a ``KVConnectorBase_V1`` (vLLM 0.32).

vLLM loads it through its out-of-tree path::

    KVTransferConfig(kv_connector="UcmConnector", kv_connector_module_path="ucm.integration.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"ucm_stack": "stack.yaml"})

``ucm_stack`` is a YAML path or the stack as a dict, stating ``unique_id`` and ``tiers``; the
geometry comes from vLLM's KV cache (:func:`engine_geometry`): a shard is one vLLM block of one
TP rank over all layers, one tensor per layer, ``shards_per_block`` = TP size, shard index = TP
rank. docs/vllm.md is the full contract; this docstring is the map of the code.

**Scheduler process** (``role=SCHEDULER``): a scheduler-role store (``device_id=-1``, control
plane only). Block ids hash each full block's token prefix (:func:`ucm.integration.keys.
chain_block_ids`) under the salt of :func:`key_space` (model, dtype, block size, KV layout, TP
size) and the request's ``cache_salt`` / LoRA. ``get_num_new_matched_tokens`` answers the longest
present prefix of full blocks, never the whole prompt; ``update_state_after_alloc`` plans the
load into the vLLM blocks just allocated; ``build_connector_meta`` sends the step's loads and
saves to the workers (:class:`UcmConnectorMetadata`); ``request_finished`` keeps a request's
blocks until the workers have dumped them.

**Saves.** Every block is saved in the step that fills it (prefill chunks, and decode blocks as
they fill), except in a step where the request also *loads*: a load that fails (on any TP rank)
leaves garbage in the failed block, and every block computed in that step attended to it, so
those blocks wait one step, until the scheduler knows the load held. Blocks already present in
the store are not dumped again (one lookup per step).

**Worker processes** (``role=WORKER``, one per TP rank): a worker store (``device_id`` = the
rank on this node). ``start_load_kv`` loads the step's blocks straight into vLLM's KV cache
tensors (``store.load`` with each layer's block as a tensor view: no staging copy) and waits for
them before the forward; blocks that fail (missing, corrupt, dead tier) are returned by
``get_block_ids_with_load_errors`` so that vLLM recomputes them. ``wait_for_save`` submits the
step's dumps as a task and returns: the forward pass never waits for a dump. A finished
request's blocks are freed when its dumps are done (``get_finished``); blocks of a preempted
request are dumped before vLLM can reuse them (``handle_preemptions``).

**Stats**: :class:`UcmConnectorStats` through ``get_kv_connector_stats`` (vLLM's logging and
its Prometheus metrics ``vllm:ucm_*``, :class:`UcmPromMetrics`), and, with
``ucm_metrics_port`` in the extra config, UCM's own Prometheus endpoint (``ucm.metrics``) served
by each worker.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

import ucm
from ucm.errors import ConfigError, TaskError, UcmError

from .keys import (
    EngineGeometry,
    Epochs,
    KeySpace,
    chain_block_ids,
    engine_stack,
    warn_node_local,
    write_marker,
)
from .salts import lora_identity, vllm_fields

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from ucm.metrics import MetricsServer
    from ucm.store import Store
    from ucm.task import Task

logger = logging.getLogger("vllm.ucm")  # a child of vLLM's logger: printed like vLLM's own lines

STACK_KEY = "ucm_stack"
EXTRA_KEYS = {
    STACK_KEY: "the stack: a YAML path or a dict (unique_id and tiers)",
    "ucm_metrics_port": "serve UCM's Prometheus metrics from each worker on port + TP rank "
    "(0: a free port, logged)",
    "ucm_report_block_ids": "true: each finished request's kv_transfer_params lists the UCM ids "
    "of its full blocks (hex), for use with the UCM API",
    "ucm_weights_id": "a string naming the weights, instead of UCM's fingerprint of the model "
    "files (for copies of one checkpoint on several nodes; change it with the weights)",
}
"""The ``ucm_*`` keys of ``kv_connector_extra_config``; any other ``ucm_*`` key is refused."""


SALTS_KEPT = 4096
"""Distinct (cache_salt, LoRA) salts the scheduler memoises."""


def _extra_key(name: str) -> str:
    return f"kv_connector_extra_config[{name!r}]"


STACK_KEY_NAME = _extra_key(STACK_KEY)


# ---- keys and geometry (derived once per process from vLLM's configs) ----------------------


def _transfer_layers(kv_cache_config: KVCacheConfig) -> tuple[Any, list[str]]:
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


def _block_shape_bytes(spec: Any) -> tuple[int, int, int]:
    """``(kv_heads, rows, bytes per row)`` of one layer's block of this rank."""
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

    _, heads, rows, row_bytes = compute_layer_kv_cache_shape_bytes(spec, 1)
    return int(heads), int(rows), int(row_bytes)


def _layout_name(vllm_config: VllmConfig) -> str:
    return str(vllm_config.cache_config.get_resolved_kv_cache_layout().name)


def engine_geometry(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> EngineGeometry:
    """The shard geometry vLLM's KV cache fixes: one tensor per layer (one vLLM block of this TP
    rank), one shard per TP rank."""
    spec, layers = _transfer_layers(kv_cache_config)
    heads, rows, row_bytes = _block_shape_bytes(spec)
    per_layer = heads * rows * row_bytes
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    return EngineGeometry(
        tensor_sizes=(per_layer,) * len(layers),
        shards_per_block=tp_size,
        description=(
            f"{len(layers)} layers, one tensor per layer: a {spec.block_size}-token vLLM block "
            f"of one TP rank, [{heads} kv heads, {rows} rows, {row_bytes} bytes] = {per_layer} "
            f"bytes of {spec.dtype}, layout {_layout_name(vllm_config)}; one shard per TP rank "
            f"(TP size {tp_size})"
        ),
    )


def key_space(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KeySpace:
    """Everything that makes this engine's KV incompatible with another's: the salt of every
    block id the connector computes."""
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    spec, layers = _transfer_layers(kv_cache_config)
    heads, rows, row_bytes = _block_shape_bytes(spec)
    backend = _attention_backend(vllm_config)
    kv_layout = (
        f"{backend}/{_layout_name(vllm_config)}/{type(spec).__name__}/layers={len(layers)}/"
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


def _attention_backend(vllm_config: VllmConfig) -> str:
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backend

    return str(get_current_attn_backend(vllm_config).get_name())


def _check_extra_config(extra: Mapping[str, Any]) -> None:
    unknown = sorted(key for key in extra if key.startswith("ucm_") and key not in EXTRA_KEYS)
    if unknown:
        valid = "; ".join(f"{key}: {meaning}" for key, meaning in EXTRA_KEYS.items())
        raise ConfigError(
            f"{_extra_key(unknown[0])}: unknown UCM key (misspelled?); the UCM keys are: {valid}"
        )
    port = extra.get("ucm_metrics_port")
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535
    ):
        raise ConfigError(
            f"{_extra_key('ucm_metrics_port')}: {port!r} is not valid: expected an integer port "
            "in [0, 65535] (0: a free port)"
        )
    weights_id = extra.get("ucm_weights_id")
    if weights_id is not None and (not isinstance(weights_id, str) or not weights_id):
        raise ConfigError(
            f"{_extra_key('ucm_weights_id')}: {weights_id!r} is not valid: expected a non-empty "
            "string naming the weights"
        )
    report = extra.get("ucm_report_block_ids")
    if report is not None and not isinstance(report, bool):
        raise ConfigError(
            f"{_extra_key('ucm_report_block_ids')}: {report!r} is not valid: expected true or false"
        )


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


def _open_store(
    vllm_config: VllmConfig,
    geometry: EngineGeometry,
    device_id: int,
    local_rank_size: int,
) -> Store:
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    _check_extra_config(extra)
    _check_parallelism(vllm_config)
    stack = engine_stack(extra.get(STACK_KEY), geometry, key=STACK_KEY_NAME, engine="vLLM")
    try:
        return ucm.open(stack, device_id=device_id, local_rank_size=local_rank_size)
    except UcmError as exc:
        raise ConfigError(f"{STACK_KEY_NAME}: {exc}") from exc


# ---- scheduler → worker metadata ---------------------------------------------------------------


@dataclass
class BlockTransfer:
    """One request's blocks to load or save in one step: vLLM block ids and UCM block ids."""

    req_id: str
    vllm_blocks: list[int]
    ucm_ids: list[bytes]


@dataclass
class UcmConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler asks every worker to do in one step."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    """Requests preempted this step: their blocks are freed, so pending dumps must finish
    before this step's forward pass can overwrite them."""
    reset_marker: bytes | None = None
    """The epoch marker of a reset_cache since the last step: TP rank 0 writes it."""


@dataclass
class UcmWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """What the workers tell the scheduler after a step: the dumps they finished, so that the
    scheduler counts a block as present from the moment it asks for its dump (a request right
    behind another with the same prefix gets a hit) until every rank is done with it."""

    dumped: dict[bytes, int] = field(default_factory=dict)
    """Block id → ranks that finished dumping their shard of it."""
    failed: set[bytes] = field(default_factory=set)
    """Blocks a rank failed to dump."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> UcmWorkerMetadata:
        if isinstance(other, UcmWorkerMetadata):
            for block_id, ranks in other.dumped.items():
                self.dumped[block_id] = self.dumped.get(block_id, 0) + ranks
            self.failed |= other.failed
        return self


# ---- stats ---------------------------------------------------------------------------------------

STAT_NAMES: dict[str, str] = {
    "lookups": "requests looked up in UCM (scheduler)",
    "lookup_errors": "lookups that failed (answered as misses)",
    "hit_tokens": "prompt tokens served from UCM",
    "hit_blocks": "blocks planned for loading from UCM",
    "loaded_blocks": "blocks loaded into vLLM's KV cache (summed over TP ranks)",
    "loaded_bytes": "bytes loaded into vLLM's KV cache",
    "load_failed_blocks": "blocks whose load failed and that vLLM recomputes",
    "load_seconds": "seconds spent loading (summed over TP ranks)",
    "saved_blocks": "blocks dumped to UCM (summed over TP ranks)",
    "saved_bytes": "bytes dumped to UCM",
    "save_failed_blocks": "blocks whose dump failed",
}


@dataclass
class UcmConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """The connector's counters over one interval: sums, from the scheduler and every rank."""

    def __post_init__(self) -> None:
        for name in STAT_NAMES:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data: dict[str, Any] = dict.fromkeys(STAT_NAMES, 0)

    def aggregate(self, other: KVConnectorStats) -> UcmConnectorStats:
        for name, value in (other.data or {}).items():
            if name in STAT_NAMES:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = {name: self.data.get(name, 0) for name in STAT_NAMES}
        seconds = float(self.data.get("load_seconds", 0))
        if seconds > 0:
            reduced["load_GBps"] = round(self.data.get("loaded_bytes", 0) / seconds / 1e9, 3)
        reduced["load_seconds"] = round(seconds, 6)
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in STAT_NAMES)


class UcmPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """``vllm:ucm_<stat>`` counters (one per :data:`STAT_NAMES` entry) in vLLM's Prometheus
    registry, fed from the stats the workers and the scheduler report."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, documentation in STAT_NAMES.items():
            counter = self._counter_cls(
                name=f"vllm:ucm_{name}",
                documentation=f"UCM connector: {documentation}.",
                labelnames=labelnames,
            )
            self._counters[name] = {
                engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)


# ---- the connector -------------------------------------------------------------------------------


@dataclass
class _RequestState:
    """The scheduler's bookkeeping of one request."""

    request: Request
    salt: bytes
    ids: list[bytes] = field(default_factory=list)
    """UCM ids of the request's full blocks hashed so far (the chain grows as blocks fill)."""
    saved: int = 0
    """Blocks [0, saved) are in UCM, being dumped, or were in vLLM's cache before the request:
    never dumped again by this request."""
    planned: tuple[int, int] | None = None
    """(first block, tokens) of the last answer of get_num_new_matched_tokens."""
    loading: bool = False
    """A load was planned for the step being built: its new blocks are saved one step later."""
    dumping: bool = False
    """A dump of this request's blocks was sent to the workers: they report it in get_finished
    and vLLM keeps its blocks until then."""


class UcmConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """UCM's vLLM v1 KV connector (see the module docstring and docs/vllm.md)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ConfigError(f"{STACK_KEY_NAME}: vLLM gave the connector no KV cache config")
        transfer = self._kv_transfer_config
        self._extra: dict[str, Any] = dict(transfer.kv_connector_extra_config or {})
        self._geometry = engine_geometry(vllm_config, kv_cache_config)
        _, self._layers = _transfer_layers(kv_cache_config)
        self._block_tokens = int(vllm_config.cache_config.block_size)
        self._stats = UcmConnectorStats()
        self._closed = False
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config, kv_cache_config)
        else:
            self._init_worker(vllm_config, kv_cache_config)

    # ---- vLLM class-level hooks --------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never a lost hand-off

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> UcmConnectorStats | None:
        return UcmConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> UcmPromMetrics:
        return UcmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> UcmConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, UcmConnectorStats()
        return stats

    # ---- scheduler side ------------------------------------------------------------------

    def _init_scheduler(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        self._store = _open_store(vllm_config, self._geometry, -1, _ranks_per_node(vllm_config))
        self._key_space = key_space(vllm_config, kv_cache_config)
        self._epochs = Epochs(self._key_space.salt())
        self._epoch = self._epochs.current(self._store)
        self._reset_marker: bytes | None = None
        nodes = int(getattr(vllm_config.parallel_config, "nnodes", 1) or 1)
        warn_node_local("vLLM", nodes, self._geometry.shards_per_block, self._store.config)
        self._salts: dict[tuple[str | None, str | None], bytes] = {}
        self._requests: dict[str, _RequestState] = {}
        self._loads: dict[str, BlockTransfer] = {}
        self._final_saves: list[BlockTransfer] = []
        self._dumping_ids: dict[bytes, int] = {}
        """Blocks the workers were asked to dump → ranks not done yet: present for lookups."""
        self._consumer = bool(self._kv_transfer_config.is_kv_consumer)
        self._producer = bool(self._kv_transfer_config.is_kv_producer)
        self._report_ids = bool(self._extra.get("ucm_report_block_ids", False))
        if self._consumer and self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning(
                "UCM: kv_load_failure_policy=%r: a block that fails to load (missing, corrupt, "
                "dead tier) fails its request; set kv_load_failure_policy='recompute' to have "
                "vLLM recompute it instead",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        logger.info(
            "UCM scheduler: stack %r, %s, key space %s",
            self._store.config.unique_id,
            self._geometry.explain(),
            self._key_space,
        )

    def on_new_request(self, request: Request) -> None:
        self._state(request)

    def _state(self, request: Request) -> _RequestState | None:
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        embeds = getattr(request, "prompt_embeds", None)
        if getattr(request, "mm_features", None) or embeds is not None:
            return None  # token ids alone do not name this KV: never cached
        lora = lora_identity(getattr(request, "lora_request", None))
        cache_salt = getattr(request, "cache_salt", None)
        salt = self._salts.get((cache_salt, lora))
        if salt is None:
            space = self._key_space
            if lora is not None:
                space = replace(space, extra=(*space.extra, ("lora", lora)))
            salt = space.salt(cache_salt, self._epoch)
            if len(self._salts) >= SALTS_KEPT:  # per-user salts: keep the memo bounded
                self._salts.clear()
            self._salts[(cache_salt, lora)] = salt
        state = _RequestState(request=request, salt=salt)
        self._requests[request.request_id] = state
        return state

    def _chain(self, state: _RequestState, blocks: int) -> list[bytes]:
        """The ids of the request's first ``blocks`` full blocks (extending the chain)."""
        have = len(state.ids)
        if blocks > have:
            bs = self._block_tokens
            tokens = list(state.request.all_token_ids[: blocks * bs])
            parent = state.ids[-1] if have else None
            state.ids.extend(
                chain_block_ids(state.salt, tokens, bs, parent=parent, start_block=have)
            )
        return state.ids[:blocks]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self._consumer:
            return 0, False
        state = self._state(request)
        if state is None:
            return 0, False
        state.planned = None
        bs = self._block_tokens
        start = num_computed_tokens // bs
        full = int(request.num_tokens) // bs
        if full <= start:
            return 0, False
        ids = self._chain(state, full)
        self._stats.data["lookups"] += 1
        try:
            present = self._present(ids[start:])
        except Exception as exc:  # a lookup never fails a request: it is a miss
            self._stats.data["lookup_errors"] += 1
            logger.warning("UCM lookup failed (served as a miss): %s", exc)
            return 0, False
        found = present.index(False) if False in present else len(present)
        # vLLM must compute at least one token: never claim the whole prompt.
        hit = min((start + found) * bs, int(request.num_tokens) - 1)
        external = hit - num_computed_tokens
        if external <= 0:
            return 0, False
        state.planned = (start, external)
        return external, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        self._loads.pop(request.request_id, None)
        planned, state.planned = state.planned, None
        if num_external_tokens <= 0 or planned is None:
            return
        start = planned[0]
        bs = self._block_tokens
        end = math.ceil((start * bs + num_external_tokens) / bs)
        table = list(blocks.get_block_ids()[0])
        ids = self._chain(state, end)
        self._loads[request.request_id] = BlockTransfer(
            req_id=request.request_id,
            vllm_blocks=table[start:end],
            ucm_ids=ids[start:end],
        )
        state.saved = max(state.saved, end)
        state.loading = True
        self._stats.data["hit_tokens"] += num_external_tokens
        self._stats.data["hit_blocks"] += end - start

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UcmConnectorMetadata:
        meta = UcmConnectorMetadata(
            loads=list(self._loads.values()),
            preempted=set(scheduler_output.preempted_req_ids or ()),
            reset_marker=self._reset_marker,
        )
        self._reset_marker = None
        self._loads.clear()
        computed_before: dict[str, int] = {
            new.req_id: int(new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs
        }
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed_before[req_id] = int(cached.num_computed_tokens[i])
        candidates: list[tuple[_RequestState, BlockTransfer]] = []
        if self._producer:
            bs = self._block_tokens
            block_state = getattr(scheduler_output, "kv_connector_block_state", None)
            for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
                state = self._requests.get(req_id)
                if state is None:
                    continue
                before = computed_before.get(req_id, int(state.request.num_computed_tokens))
                if math.ceil(before / bs) < state.saved:
                    # vLLM went back (a block failed to load, or the request was preempted):
                    # what it recomputes from here on is saved again.
                    state.saved = before // bs
                valid = before if state.loading else before + int(scheduled)
                state.loading = False
                ready = min(valid, int(state.request.num_tokens)) // bs
                if ready <= state.saved:
                    continue
                table = self._block_table(block_state, req_id)
                if table is None or len(table) < ready:
                    continue
                ids = self._chain(state, ready)
                candidates.append(
                    (
                        state,
                        BlockTransfer(req_id, table[state.saved : ready], ids[state.saved : ready]),
                    )
                )
                state.saved = ready
        meta.saves = self._absent_only(candidates) + self._final_saves
        self._final_saves = []
        return meta

    def reset_cache(self) -> bool:
        """``reset_prefix_cache(reset_connector=True)``: UCM serves nothing saved before it.

        The key space moves to a new epoch (:class:`~ucm.integration.keys.Epochs`): every id
        computed from now on differs from every id saved before, on every tier. Requests that
        vLLM still tracks keep a throwaway salt of their own, so what they computed before the
        reset is neither served nor saved under the new epoch. TP rank 0 writes the epoch's
        marker with the next step, so later engines on this stack start in the new epoch.
        """
        if self._role != KVConnectorRole.SCHEDULER:
            return True
        try:
            stack_epoch = self._epochs.current(self._store)
        except UcmError as exc:
            logger.warning("UCM reset: could not read the stack's epoch (%s): going on", exc)
            stack_epoch = 0
        self._epoch = max(stack_epoch, self._epoch) + 1
        self._reset_marker = self._epochs.marker(self._epoch)
        self._salts.clear()
        for state in self._requests.values():
            state.salt = os.urandom(32)
            state.ids = []
        logger.info(
            "UCM reset: key space epoch %d; blocks saved before are never served", self._epoch
        )
        return True

    def _present(self, ids: Sequence[bytes]) -> list[bool]:
        """Whether each block is in the store or being dumped into it right now."""
        asked = [block_id for block_id in ids if block_id not in self._dumping_ids]
        answers = dict(zip(asked, self._store.lookup(asked), strict=True)) if asked else {}
        return [block_id in self._dumping_ids or answers[block_id] for block_id in ids]

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, UcmWorkerMetadata):
            return
        for block_id, ranks in meta.dumped.items():
            left = self._dumping_ids.get(block_id, 0) - ranks
            if left > 0:
                self._dumping_ids[block_id] = left
            else:
                self._dumping_ids.pop(block_id, None)
        for block_id in meta.failed:  # not whole in the store: ask the store from now on
            self._dumping_ids.pop(block_id, None)

    def _block_table(self, block_state: Any, req_id: str) -> list[int] | None:
        groups = None
        if block_state is not None:
            groups = block_state.get_block_ids(req_id)
        if groups is None and self._kv_cache_manager is not None:
            groups = self._kv_cache_manager.get_block_ids(req_id)
        return list(groups[0]) if groups else None

    def _absent_only(
        self, candidates: Sequence[tuple[_RequestState, BlockTransfer]]
    ) -> list[BlockTransfer]:
        """The transfers without the blocks the store already holds; marks the requests whose
        blocks the workers will dump."""
        if not candidates:
            return []
        every = list(
            dict.fromkeys(block_id for _, transfer in candidates for block_id in transfer.ucm_ids)
        )
        try:
            present = dict(zip(every, self._present(every), strict=True))
        except Exception as exc:
            self._stats.data["lookup_errors"] += 1
            logger.warning("UCM lookup before saving failed (saving every block): %s", exc)
            present = {}
        kept: list[BlockTransfer] = []
        for state, transfer in candidates:
            pairs = [
                (vllm_block, block_id)
                for vllm_block, block_id in zip(transfer.vllm_blocks, transfer.ucm_ids, strict=True)
                if not present.get(block_id, False)
            ]
            if pairs:
                kept.append(
                    BlockTransfer(transfer.req_id, [p[0] for p in pairs], [p[1] for p in pairs])
                )
                state.dumping = True
                for _, block_id in pairs:
                    present[block_id] = True  # a second request of this step does not dump it
                    self._dumping_ids[block_id] = (
                        self._dumping_ids.get(block_id, 0) + self._geometry.shards_per_block
                    )
        return kept

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        if state is None:
            return False, None
        if self._producer:
            # Blocks computed in the request's last step, when that step also loaded, wait for
            # the step after it (see the module docstring): send them with the next step.
            bs = self._block_tokens
            ready = min(int(request.num_computed_tokens), int(request.num_tokens)) // bs
            if ready > state.saved and len(block_ids) >= ready:
                ids = self._chain(state, ready)
                transfer = BlockTransfer(
                    request.request_id,
                    list(block_ids[state.saved : ready]),
                    ids[state.saved : ready],
                )
                self._final_saves.extend(self._absent_only([(state, transfer)]))
        params = None
        if self._report_ids:
            full = int(request.num_computed_tokens) // self._block_tokens
            params = {"ucm_block_ids": [block_id.hex() for block_id in self._chain(state, full)]}
        return state.dumping, params

    # ---- worker side ---------------------------------------------------------------------

    def _init_worker(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._rank = int(get_tensor_model_parallel_rank())
        per_node = _ranks_per_node(vllm_config)
        self._store = _open_store(vllm_config, self._geometry, self._rank % per_node, per_node)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._block_views: list[torch.Tensor] = []
        self._invalid: set[int] = set()
        self._saves: list[_PendingSave] = []
        self._dumping: Counter[str] = Counter()
        """Per request, dump tasks in flight."""
        self._save_requests: set[str] = set()
        """Requests the scheduler sent dumps for: each is reported once in get_finished."""
        self._finishing: set[str] = set()
        self._dumped: Counter[bytes] = Counter()
        self._dump_failed: set[bytes] = set()
        """Dumps finished since the last step's worker metadata (see UcmWorkerMetadata)."""
        self._metrics_server: MetricsServer | None = None
        port = self._extra.get("ucm_metrics_port")
        if port is not None:
            from ucm import metrics

            try:
                self._metrics_server = metrics.serve(
                    self._store, port=int(port) + self._rank if port else 0
                )
            except UcmError as exc:
                self._store.close()
                raise ConfigError(f"{_extra_key('ucm_metrics_port')}: {exc}") from exc
            logger.info(
                "UCM rank %d: Prometheus metrics on %s", self._rank, self._metrics_server.url
            )
        logger.info(
            "UCM worker rank %d: stack %r, %s",
            self._rank,
            self._store.config.unique_id,
            self._geometry.explain(),
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        views = []
        for index, name in enumerate(self._layers):
            kv = kv_caches.get(name)
            if kv is None:
                raise ConfigError(
                    f"{STACK_KEY_NAME}: vLLM registered no KV cache for layer {name!r}"
                )
            views.append(self._block_view(name, kv, self._geometry.tensor_sizes[index]))
        self._block_views = views

    def _block_view(self, name: str, kv: torch.Tensor, nbytes: int) -> torch.Tensor:
        """``kv`` ([blocks, ...]) with its per-block dimensions in memory order, so that
        ``view[b]`` is block b of the layer as one contiguous tensor."""
        if kv.dim() < 2 or kv.shape[0] != self._num_blocks:
            raise ConfigError(
                f"{STACK_KEY_NAME}: vLLM's KV cache of layer {name!r} has shape "
                f"{tuple(kv.shape)}; UCM expects {self._num_blocks} blocks in dimension 0"
            )
        inner = sorted(range(1, kv.dim()), key=lambda d: kv.stride(d), reverse=True)
        view = kv.permute(0, *inner)
        block = view[0]
        if not block.is_contiguous() or block.nbytes != nbytes:
            raise ConfigError(
                f"{STACK_KEY_NAME}: vLLM's KV cache of layer {name!r} (shape {tuple(kv.shape)}, "
                f"strides {kv.stride()}, {kv.dtype}) does not keep one block in {nbytes} "
                "contiguous bytes, which UCM's shard layout needs; use a block-contiguous "
                "KV cache layout (VLLM_KV_CACHE_LAYOUT, e.g. LBHNC)"
            )
        return view

    def _block_tensors(self, vllm_block: int) -> list[torch.Tensor]:
        return [view[vllm_block] for view in self._block_views]

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(kv_connector_metadata, UcmConnectorMetadata):
            return
        preempted = kv_connector_metadata.preempted
        if not preempted:
            return
        # Their blocks are free from this step on: every dump still reading them must finish
        # before the forward pass can write into them.
        for pending in list(self._saves):
            if pending.requests & preempted:
                self._finish_save(pending)
        self._saves = [pending for pending in self._saves if not pending.finished]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, UcmConnectorMetadata) and meta.reset_marker and self._rank == 0:
            try:
                write_marker(self._store, meta.reset_marker)
            except UcmError as exc:
                logger.warning("UCM: could not persist a reset's epoch marker: %s", exc)
        if not isinstance(meta, UcmConnectorMetadata) or not meta.loads:
            return
        started = time.perf_counter()
        wanted = {block_id for transfer in meta.loads for block_id in transfer.ucm_ids}
        for pending in self._saves:
            if not wanted.isdisjoint(pending.ids):  # a block this rank is still dumping
                self._finish_save(pending)
        submitted: list[tuple[Task | None, list[tuple[bytes, int]]]] = []
        for group in _unique_key_groups(meta.loads):
            ids = [block_id for block_id, _ in group]
            try:
                task = self._store.load(
                    ids,
                    [self._rank] * len(ids),
                    [self._block_tensors(vllm_block) for _, vllm_block in group],
                )
            except Exception as exc:
                logger.warning("UCM load of %d blocks not submitted: %s", len(ids), exc)
                submitted.append((None, group))
            else:
                submitted.append((task, group))
        # The loads finish before the forward pass: vLLM writes this step's new KV into the same
        # blocks' free rows (a prompt whose last block was loaded), and attention reads them.
        for pending_load, group in submitted:
            failed = self._wait_load(pending_load, group)
            self._invalid.update(vllm_block for block_id, vllm_block in group if block_id in failed)
            loaded = len(group) - len([1 for block_id, _ in group if block_id in failed])
            self._stats.data["loaded_blocks"] += loaded
            self._stats.data["loaded_bytes"] += loaded * self._geometry.shard_size
            self._stats.data["load_failed_blocks"] += len(group) - loaded
        self._stats.data["load_seconds"] += time.perf_counter() - started

    def _wait_load(self, task: Task | None, group: list[tuple[bytes, int]]) -> set[bytes]:
        """The ids of the group's blocks that did not load."""
        every = {block_id for block_id, _ in group}
        if task is None:
            return every
        try:
            self._store.wait(task)
        except TaskError as exc:
            failed = {block_id for block_id, _shard in exc.failures}
            logger.warning(
                "UCM: %d of %d blocks failed to load; vLLM recomputes them: %s",
                len(failed),
                len(group),
                exc,
            )
            return failed
        except Exception as exc:
            logger.warning(
                "UCM: a load of %d blocks failed; vLLM recomputes them: %s", len(group), exc
            )
            return every
        return set()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv waits for its loads: a shard holds every layer of a block

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # a shard holds every layer: wait_for_save dumps whole blocks after the forward

    def wait_for_save(self) -> None:
        self._reap_saves()
        meta = self._connector_metadata
        if not isinstance(meta, UcmConnectorMetadata) or not meta.saves:
            return
        requests: set[str] = set()
        seen: set[bytes] = set()
        ids: list[bytes] = []
        sources: list[list[torch.Tensor]] = []
        for transfer in meta.saves:
            requests.add(transfer.req_id)
            for vllm_block, block_id in zip(transfer.vllm_blocks, transfer.ucm_ids, strict=True):
                if block_id in seen:  # two requests of one step filled the same block
                    continue
                seen.add(block_id)
                ids.append(block_id)
                sources.append(self._block_tensors(vllm_block))
        self._save_requests.update(requests)
        try:
            task = self._store.dump(ids, [self._rank] * len(ids), sources)
        except Exception as exc:
            logger.warning("UCM dump of %d blocks not submitted: %s", len(ids), exc)
            self._stats.data["save_failed_blocks"] += len(ids)
            self._dump_failed.update(ids)
            return
        self._saves.append(_PendingSave(task=task, requests=requests, ids=ids))
        self._dumping.update(requests)

    def _reap_saves(self) -> None:
        for pending in self._saves:
            if self._store.check(pending.task):
                self._finish_save(pending)
        self._saves = [pending for pending in self._saves if not pending.finished]

    def _finish_save(self, pending: _PendingSave) -> None:
        if pending.finished:
            return
        failed: set[bytes] = set()
        try:
            self._store.wait(pending.task)  # at once when reaped; blocks for a preemption
        except TaskError as exc:
            failed = {block_id for block_id, _shard in exc.failures}
            logger.warning(
                "UCM: %d of %d blocks failed to save: %s", len(failed), len(pending.ids), exc
            )
        except Exception as exc:
            failed = set(pending.ids)
            logger.warning("UCM: a dump of %d blocks failed: %s", len(pending.ids), exc)
        pending.finished = True
        saved = len(pending.ids) - len(failed)
        self._stats.data["saved_blocks"] += saved
        self._stats.data["saved_bytes"] += saved * self._geometry.shard_size
        self._stats.data["save_failed_blocks"] += len(failed)
        self._dumped.update(block_id for block_id in pending.ids if block_id not in failed)
        self._dump_failed |= failed
        self._dumping.subtract(pending.requests)
        for req_id in pending.requests:
            if self._dumping[req_id] <= 0:
                del self._dumping[req_id]

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._reap_saves()
        self._finishing.update(finished_req_ids & self._save_requests)
        done = {req_id for req_id in self._finishing if not self._dumping.get(req_id)}
        self._finishing -= done
        self._save_requests -= done
        return (done or None), None

    def build_connector_worker_meta(self) -> UcmWorkerMetadata | None:
        if not self._dumped and not self._dump_failed:
            return None
        meta = UcmWorkerMetadata(dumped=dict(self._dumped), failed=set(self._dump_failed))
        self._dumped = Counter()
        self._dump_failed = set()
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    # ---- both ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        server = getattr(self, "_metrics_server", None)
        if server is not None:
            server.close()
        # Pending dumps and write-through work finish before the store closes.
        started = time.perf_counter()
        self._store.close()
        logger.info(
            "UCM %s closed its store in %.3f s",
            "scheduler" if self._role == KVConnectorRole.SCHEDULER else f"rank {self._rank}",
            time.perf_counter() - started,
        )


@dataclass(eq=False)
class _PendingSave:
    task: Task
    requests: set[str]
    ids: list[bytes]
    finished: bool = False


def _unique_key_groups(loads: Iterable[BlockTransfer]) -> list[list[tuple[bytes, int]]]:
    """The step's (UCM id, vLLM block) pairs split into tasks without a repeated id (two
    requests of one step may load the same block into two vLLM blocks)."""
    groups: list[list[tuple[bytes, int]]] = []
    seen: list[set[bytes]] = []
    for transfer in loads:
        for vllm_block, block_id in zip(transfer.vllm_blocks, transfer.ucm_ids, strict=True):
            for index, ids in enumerate(seen):
                if block_id not in ids:
                    ids.add(block_id)
                    groups[index].append((block_id, vllm_block))
                    break
            else:
                seen.append({block_id})
                groups.append([(block_id, vllm_block)])
    return groups


def _ranks_per_node(vllm_config: VllmConfig) -> int:
    """TP ranks that share this node's CacheBuffer."""
    parallel = vllm_config.parallel_config
    tp_size = int(parallel.tensor_parallel_size)
    nodes = int(getattr(parallel, "nnodes", 1) or 1)
    if nodes > 1 and tp_size % nodes == 0:
        return tp_size // nodes
    return tp_size


__all__ = [
    "EXTRA_KEYS",
    "STACK_KEY",
    "STAT_NAMES",
    "BlockTransfer",
    "UcmConnector",
    "UcmConnectorMetadata",
    "UcmConnectorStats",
    "UcmPromMetrics",
    "UcmWorkerMetadata",
    "engine_geometry",
    "key_space",
]
