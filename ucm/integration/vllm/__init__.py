"""UCM as a vLLM KV connector: ``UcmConnector``, a ``KVConnectorBase_V1`` (vLLM 0.32).

vLLM loads it through its out-of-tree path::

    KVTransferConfig(kv_connector="UcmConnector", kv_connector_module_path="ucm.integration.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"ucm_stack": "stack.yaml"})

``ucm_stack`` is a YAML path or the stack as a dict, stating ``unique_id`` and ``tiers``; the
geometry comes from vLLM's KV cache (:func:`.geometry.engine_geometry`): a shard is one vLLM
block of one TP rank over all layers, one tensor per layer, ``shards_per_block`` = TP size,
shard index = TP rank. docs/vllm.md is the full contract; this docstring is the map of the code.

**Scheduler process** (``role=SCHEDULER``): a scheduler-role store (``device_id=-1``, control
plane only). Block ids hash each full block's token prefix (:func:`ucm.integration.keys.
chain_block_ids`) under the salt of :func:`.geometry.key_space` (model, dtype, block size, KV
layout, TP size) and the request's ``cache_salt`` / LoRA. ``get_num_new_matched_tokens`` answers
the longest present prefix of full blocks, never the whole prompt; ``update_state_after_alloc``
plans the load into the vLLM blocks just allocated; ``build_connector_meta`` sends the step's
loads and saves to the workers (:class:`UcmConnectorMetadata`); ``request_finished`` keeps a
request's blocks until the workers have dumped them.

**Saves.** Every block is saved in the step that computes it (prefill chunks, and decode blocks
as they fill), once its tokens are known, and only once the scheduler knows that no load
beneath it failed: a failed load (on any TP rank) leaves garbage that every later block of the
request attended to. Workers echo the steps whose loads they ran (``loaded_steps``) in the same
output as vLLM's ``invalid_block_ids``; until that output is processed (the next step:
synchronous loads run under synchronous scheduling only; an asynchronous load's outcome
comes before its request is scheduled), blocks at or after the load wait. A finished
request with an unconfirmed load is held until its outcome is known. Blocks already present in
the store are not dumped again (one lookup per step).

**Worker processes** (``role=WORKER``, one per TP rank): a worker store (``device_id`` = the
rank on this node). ``start_load_kv`` loads the step's synchronous loads (CacheBuffer hits)
straight into vLLM's KV cache tensors (no staging copy) and waits for them before the
forward, and starts the asynchronous ones (a prefetch into the CacheBuffer, or without one a
*direct* load into staging memory), reported in ``get_finished`` once copied; blocks that
fail (missing, corrupt, dead tier, late) are returned by ``get_block_ids_with_load_errors`` so
that vLLM recomputes them. ``wait_for_save`` submits the step's dumps as a task (without a
CacheBuffer, or over one that writes back, hands them to the saving thread, which copies them
into staging memory and passes their submission to the submitting thread) and returns: the
forward pass never waits for a dump. The scheduler *releases* each finished
request whose blocks vLLM keeps with the step that carries its last save; ``get_finished``
reports it once no save of it reads its blocks any more (completed, or copied into staging),
whatever order vLLM calls the hooks in. Blocks of a preempted request are dumped (or,
without a CacheBuffer, copied into the staging memory their dump writes from) before vLLM can
reuse them (``handle_preemptions``).

**Stats**: :class:`UcmConnectorStats` through ``get_kv_connector_stats`` (vLLM's logging and
its Prometheus metrics ``vllm:ucm_*``, :class:`UcmPromMetrics`), and, with
``ucm_metrics_port`` in the extra config, UCM's own Prometheus endpoint (``ucm.metrics``) served
by each worker.

**Modules**: :mod:`.connector` (the class vLLM loads; it hands each hook to one side),
:mod:`.scheduler` (the scheduler-side state machine), :mod:`.worker` (the worker-side
transfers), :mod:`.metrics` (stats and Prometheus counters), :mod:`.metadata` (what the two sides
send each other), :mod:`.geometry` (the key space and shard geometry vLLM's configs fix),
:mod:`.config` (the extra-config keys and opening the stack). The two sides need no engine.
"""

from .config import EXTRA_KEYS, STACK_KEY
from .connector import UcmConnector
from .geometry import engine_geometry, key_space
from .metadata import BlockTransfer, UcmConnectorMetadata, UcmWorkerMetadata
from .metrics import STAT_NAMES, UcmConnectorStats, UcmPromMetrics

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
