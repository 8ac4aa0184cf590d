"""``UcmConnector``, the class vLLM loads: it checks the configuration, opens the store of its
role, and hands each hook to the scheduler side (:mod:`.scheduler`) or the worker side
(:mod:`.worker`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ucm.affinity import NewThreads, background_cpus
from ucm.breaker import LOOKUP_THREADS, DaemonPool
from ucm.errors import ConfigError
from ucm.native.buffer import SLOT_NONE
from ucm.threadname import bind_new_threads

from ..addresses import BlockAddresses, block_view
from ..claims import ComputeClaims
from ..endpoint import serve_rank_metrics
from ..keys import Epochs, EpochState, warn_node_local
from ..tenants import TenantMapping
from .config import (
    STACK_KEY_NAME,
    check_full_attention,
    compute_wait_s,
    extra_key,
    load_deadline_s,
    logger,
    lookup_wait_s,
    open_store,
    ranks_per_node,
)
from .geometry import engine_geometry, key_space, transfer_layers
from .metadata import UcmConnectorMetadata, UcmWorkerMetadata
from .metrics import UcmConnectorStats, UcmPromMetrics
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from ucm.metrics import MetricsServer
    from ucm.store import Store


class UcmConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """UCM's vLLM v1 KV connector (see the package docstring and docs/vllm.md)."""

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
        check_full_attention(kv_cache_config)
        self._geometry = engine_geometry(vllm_config, kv_cache_config)
        _, self._layers = transfer_layers(kv_cache_config)
        self._block_tokens = int(vllm_config.cache_config.block_size)
        self._async_scheduling = bool(
            getattr(vllm_config.scheduler_config, "async_scheduling", False)
        )
        """vLLM's asynchronous scheduling (CUDA vLLM's default): step K+1 is scheduled before
        step K's output is processed, so a synchronous load that fails costs a token."""
        if self._async_scheduling and self._extra.get("ucm_async_load") is False:
            raise ConfigError(
                f"{extra_key('ucm_async_load')}: False is not valid under vLLM's asynchronous "
                "scheduling (CUDA vLLM's default): vLLM schedules each step before it learns "
                "that the last one's load failed, so a synchronous load that fails (a block "
                "missing, corrupt, or on a dead tier) would cost its request a wrong token. "
                "Leave ucm_async_load true (the default), or turn asynchronous scheduling off "
                "(--no-async-scheduling)"
            )
        self._stats = UcmConnectorStats()
        self._closed = False
        self._rank = -1
        self._store: Store
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
        self._side_stats(self._stats)
        return stats

    def _side_stats(self, stats: UcmConnectorStats) -> None:
        side = getattr(self, "_sched", None) or getattr(self, "_worker", None)
        if side is not None:
            side.stats = stats

    # ---- scheduler side ------------------------------------------------------------------

    def _init_scheduler(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        with NewThreads() as started:
            self._store = open_store(vllm_config, self._geometry, -1, ranks_per_node(vllm_config))
        self._pin_background(started)
        self._key_space = key_space(vllm_config, kv_cache_config)
        self._epochs = EpochState(Epochs(self._key_space.salt()), self._store)
        nodes = int(getattr(vllm_config.parallel_config, "nnodes", 1) or 1)
        warn_node_local("vLLM", nodes, self._geometry.shards_per_block, self._store.config)
        transfer = self._kv_transfer_config
        # Look-ups that may reach a tier below the CacheBuffer (network, disk) run on a pool,
        # so that a slow or black-holed tier never holds the scheduler thread beyond
        # ucm_lookup_wait_ms; a stack of a CacheBuffer alone answers on the scheduler thread.
        self._lookup_pool = (
            DaemonPool("ucm-sched-lookup", LOOKUP_THREADS)
            if any(tier is not self._store.buffer for tier in self._store.tiers)
            else None
        )
        # Compute claims go through the CacheBuffer's lock file: without a buffer nothing on
        # the node is shared, and with ucm_compute_wait_ms 0 nobody waits for them.
        self._claims = (
            ComputeClaims.open(self._store.config.unique_id)
            if self._store.buffer is not None
            and compute_wait_s(self._extra) > 0
            and transfer.is_kv_producer
            else None
        )
        self._sched = SchedulerSide(
            lookup_pool=self._lookup_pool,
            lookup_wait_s=lookup_wait_s(self._extra),
            claims=self._claims,
            compute_wait_s=compute_wait_s(self._extra),
            lookup=self._store.lookup,
            lookup_prefix=self._store.lookup_on_prefix,
            key_space=self._key_space,
            block_tokens=self._block_tokens,
            shards_per_block=self._geometry.shards_per_block,
            block_table=self._block_table,
            consumer=bool(transfer.is_kv_consumer),
            producer=bool(transfer.is_kv_producer),
            report_ids=bool(self._extra.get("ucm_report_block_ids", False)),
            stats=self._stats,
            epoch=self._epochs.start(),
            tenants=TenantMapping.parse(self._extra.get("ucm_namespace"), "ucm_namespace"),
            # Under vLLM's asynchronous scheduling a synchronous load that fails costs its
            # request a token, and may leave vLLM 0.32 never scheduling it again: every load
            # is asynchronous there (``ucm_async_load: false`` is refused above). Under
            # synchronous scheduling CacheBuffer hits load before the forward pass, held from
            # the look-up so that no eviction fails them.
            hold=self._hold if self._async_loads() and not self._async_scheduling else None,
            every_load_async=self._async_scheduling or self._direct_loads(),
        )
        if transfer.is_kv_consumer and transfer.kv_load_failure_policy != "recompute":
            logger.warning(
                "UCM: kv_load_failure_policy=%r: a block that fails to load (missing, corrupt, "
                "dead tier) fails its request; set kv_load_failure_policy='recompute' to have "
                "vLLM recompute it instead",
                transfer.kv_load_failure_policy,
            )
        logger.info(
            "UCM scheduler: stack %r, %s, key space %s",
            self._store.config.unique_id,
            self._geometry.explain(),
            self._key_space,
        )

    def _async_load_on(self) -> bool:
        return bool(self._extra.get("ucm_async_load", True))

    def _async_loads(self) -> bool:
        """Whether loads of blocks not all in the CacheBuffer are asynchronous, moved up into
        it first (a prefetch with a deadline): then the synchronous ones are buffer hits, which
        must cost a memcpy and never a read from below. With TP > 1 each rank prefetches,
        pins and copies its own shard of each block, and vLLM recomputes a block any rank
        reports failed. Without a CacheBuffer an asynchronous load has nowhere to put the
        bytes that arrive after a deadline but vLLM's blocks: see :meth:`_direct_loads`."""
        return self._async_load_on() and self._store.buffer is not None

    def _direct_loads(self) -> bool:
        """Whether every load is asynchronous and *direct* (read from the tiers, not through
        a CacheBuffer), off the step: when loads cannot go through the CacheBuffer
        (:meth:`_async_loads`: no CacheBuffer), under either scheduling. Every such load
        reads a lower tier, so a synchronous one would hold the forward pass for the read
        (and under vLLM's asynchronous scheduling, one that failed would cost its request a
        token). A direct load reads into the worker's staging memory and is copied into
        vLLM's blocks once over; past ``ucm_load_deadline_s`` it is reported failed and its
        late bytes end in the staging memory (:class:`~ucm.integration.vllm.worker._AsyncLoad`)."""
        return self._async_load_on() and self._store.buffer is None

    def _hold(self, ids: Sequence[bytes]) -> Callable[[], None] | None:
        """Holds every shard of the blocks in the CacheBuffer, so that no eviction on the node
        takes one before the workers' synchronous load of them has run: the release, or None
        (nothing held) when a shard is not there."""
        buffer = self._store.buffer
        assert buffer is not None
        keys = self._store.layout.keys_of_blocks(list(ids))
        if not buffer.holdable():
            # No worker of the buffer in this process (a hold would count a second hit per
            # load), or two (two engines in one test process): present is all that is known.
            return _unheld if all(buffer.lookup(keys)) else None
        slots = buffer.hold(keys)
        if SLOT_NONE not in slots:
            return lambda: buffer.unhold(slots)
        buffer.unhold(slots)
        return None

    def _block_table(self, block_state: Any, req_id: str) -> list[int] | None:
        groups = None
        if block_state is not None:
            groups = block_state.get_block_ids(req_id)
        if groups is None and self._kv_cache_manager is not None:
            groups = self._kv_cache_manager.get_block_ids(req_id)
        return list(groups[0]) if groups else None

    def on_new_request(self, request: Request) -> None:
        self._sched.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> UcmConnectorMetadata:
        meta = self._sched.build_connector_meta(scheduler_output)
        # An epoch unknown at start (or at a reset) is adopted between steps, as a reset is;
        # a reset's record that some tier did not take is raised again from here.
        adopted = self._epochs.poll()
        if adopted is not None:
            self._sched.reset(adopted)
        return meta

    def reset_cache(self) -> bool:
        """``reset_prefix_cache(reset_connector=True)``: UCM serves nothing saved before it.

        The key space moves to a new epoch (:class:`~ucm.integration.keys.Epochs`): every id
        computed from now on differs from every id saved before, on every tier. Requests that
        vLLM still tracks keep a throwaway salt of their own (:meth:`SchedulerSide.reset`).
        The scheduler records the new epoch in the stack's control record (the buffer's
        node-wide table and every lower tier) before this returns, so later engines on this
        stack start in it. When the stack's epoch cannot be read now (a tier does not answer),
        the reset is pending (:class:`~ucm.integration.keys.EpochState`): ids carry a new
        nonce at once, and the epoch follows once the tier answers.
        """
        if self._role != KVConnectorRole.SCHEDULER:
            return True
        epoch = self._epochs.reset()
        self._sched.reset(epoch)
        if epoch is not None:
            logger.info(
                "UCM reset: key space epoch %d; blocks saved before are never served", epoch
            )
        return True

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    # ---- worker side ---------------------------------------------------------------------

    def _init_worker(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self._rank = int(get_tensor_model_parallel_rank())
        per_node = ranks_per_node(vllm_config)
        with NewThreads() as started:
            self._store = open_store(vllm_config, self._geometry, self._rank % per_node, per_node)
        self._pin_background(started)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._worker = WorkerSide(
            self._store,
            rank=self._rank,
            shard_size=self._geometry.shard_size,
            stats=self._stats,
            load_deadline_s=load_deadline_s(self._extra),
            hits_only=self._async_loads(),
            direct_async=self._direct_loads(),
            # Without a CacheBuffer a dump writes to a tier; over one that writes back, a
            # dump may wait for write-back debt or go straight down. Either way a tier that
            # holds a write would hold vLLM's blocks: such saves are staged.
            stage_saves=self._store.buffer is None or self._store.buffer.writes_back,
        )
        self._metrics_server: MetricsServer | None = None
        port = self._extra.get("ucm_metrics_port")
        if port is not None:
            try:
                self._metrics_server = serve_rank_metrics(
                    self._store,
                    int(port),
                    self._rank,
                    extra_key("ucm_metrics_port"),
                    f"rank {self._rank}",
                )
            except ConfigError:
                self._store.close()
                raise
        logger.info(
            "UCM worker rank %d: stack %r, %s",
            self._rank,
            self._store.config.unique_id,
            self._geometry.explain(),
        )

    def _pin_background(self, started: NewThreads) -> None:
        """UCM's threads leave the CPUs vLLM binds its compute threads to
        (``VLLM_CPU_OMP_THREADS_BIND``, or the CPUs its ``auto`` binding chose) for the CPUs
        it leaves free, when there are any: the threads the store started, and every UCM
        thread this process starts later (a tier's I/O pool, a look-up pool: started on
        demand, perhaps from a thread bound to the compute CPUs). In the scheduler's process
        too, whose look-ups reach the tiers below from such threads."""
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        role = "scheduler" if self._rank < 0 else f"rank {self._rank}"
        try:
            cpus = background_cpus(bind)
        except ConfigError as exc:
            logger.warning("UCM %s: background threads not bound: %s", role, exc)
            return
        if cpus is None:
            return
        bind_new_threads(cpus)
        pinned = started.pin(cpus)
        logger.info(
            "UCM %s: %d background threads on CPUs %s, and every thread UCM starts later "
            "(VLLM_CPU_OMP_THREADS_BIND=%r)",
            role,
            pinned,
            sorted(cpus),
            bind,
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        views = []
        for index, name in enumerate(self._layers):
            kv = kv_caches.get(name)
            if kv is None:
                raise ConfigError(
                    f"{STACK_KEY_NAME}: vLLM registered no KV cache for layer {name!r}"
                )
            views.append(
                block_view(
                    kv,
                    self._num_blocks,
                    self._geometry.tensor_sizes[index],
                    f"{STACK_KEY_NAME}: vLLM's KV cache of layer {name!r}",
                )
            )
        devices = {view.device.type for view in views}
        if len(devices) > 1:
            raise ConfigError(
                f"{STACK_KEY_NAME}: vLLM's KV cache layers are on several devices "
                f"({sorted(devices)}); UCM transfers one rank's layers from one device"
            )
        addresses = None
        if devices == {"cpu"}:  # a CUDA cache goes through the tensor views (device copies)
            addresses = BlockAddresses(
                views,
                self._geometry.tensor_sizes,
                self._layers,
                self._num_blocks,
                what=f"{STACK_KEY_NAME}: vLLM's KV cache",
            )
        self._worker.set_block_views(views, addresses)

    def _bound_meta(self) -> UcmConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, UcmConnectorMetadata) else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, UcmConnectorMetadata):
            # So the tiers place their keys, and the buffer counts them (and applies their
            # quota: `quotas.others` for a namespace the stack does not name) as their own.
            for name in connector_metadata.namespaces:
                self._store.use_namespace(name)
            self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        # vLLM may skip wait_for_save (a step without a forward pass): the step's dumps are
        # still submitted, so that the requests they belong to are reported finished.
        worker = getattr(self, "_worker", None)
        if worker is not None:
            worker.submit_saves()
        super().clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, UcmConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._bound_meta()
        if meta is None:
            return
        self._worker.start_load(meta)

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
        self._worker.submit_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return (self._worker.get_finished() or None), (self._worker.finished_recving() or None)

    def build_connector_worker_meta(self) -> UcmWorkerMetadata | None:
        return self._worker.build_worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors()

    # ---- both ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        server = getattr(self, "_metrics_server", None)
        if server is not None:
            server.close()
        pool = getattr(self, "_lookup_pool", None)
        if pool is not None:  # look-ups nobody will ask for again: never waited for
            pool.close()
        epochs = getattr(self, "_epochs", None)
        if epochs is not None:
            epochs.close()
        claims = getattr(self, "_claims", None)
        if claims is not None:
            claims.close()
        worker = getattr(self, "_worker", None)
        if worker is not None:  # direct loads still running keep their staging memory
            worker.close()
        # Pending dumps and write-through work finish before the store closes.
        started = time.perf_counter()
        self._store.close()
        logger.info(
            "UCM %s closed its store in %.3f s",
            "scheduler" if self._role == KVConnectorRole.SCHEDULER else f"rank {self._rank}",
            time.perf_counter() - started,
        )


def _unheld() -> None:
    """The release of blocks found present but not held (``UcmConnector._hold``)."""
