"""UCM as SGLang's HiCache L3 storage (sglang 0.5.23), behind SGLang's dynamic backend.

SGLang loads it by name (see ``docs/sglang.md``)::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "ucm",
        "module_path": "ucm.integration.sglang", "class_name": "UcmHiCacheStorage",
        "interface_v1": true, "ucm_stack": "stack.yaml"}'

``StorageBackendFactory`` builds it as ``UcmHiCacheStorage(storage_config, kwargs)`` and then
hands it the host KV pool (``register_mem_pool_host``); the stack is opened there, because the
pool fixes the geometry.

- **Keys.** SGLang names a page by a hash string of its whole token prefix (seeded with the
  request's LoRA id and ``cache_salt``), the same string on every TP rank. A page is one UCM block
  (:func:`~ucm.integration.keys.named_block_id`, salted with the model, the *logical* KV dtype
  (fp8 e4m3 and e5m2 both live in a ``torch.uint8`` host pool), the weights, model overrides and
  KV-scale file when SGLang's server args are published, page size, host-pool layout, TP size
  and the reset epoch of :meth:`UcmHiCacheStorage.clear`); the shard index is the TP rank,
  and ``shards_per_block`` is the TP size, so the TP ranks of a node fill one block of one shared
  CacheBuffer. An MLA model's KV is the same on every rank (SGLang lets rank 0 write it): one
  shard per page, read by every rank.
- **Geometry.** A shard is one page of one rank, laid out as the host pool's zero-copy page
  pointers give it (``get_page_buffer_meta``: K and V of each layer for ``layer_first``, the K
  and the V page for the page-first layouts), so ``batch_get_v1``/``batch_set_v1`` move pages
  straight between UCM and the host pool (``load_data``/``dump_data`` with the pool's page
  addresses: no Python copy). The tensor interface (``get``/``set``, flat pages) stores the same
  bytes in the same order, so both interfaces read each other's pages.
- **Namespaces.** One per engine: ``ucm_namespace: fixed:<name>``, else the default namespace.
  A per-request mode (``cache_salt``, ``lora``) is refused with :data:`NO_TENANT_KEY`: SGLang
  seeds the page hashes with the request's ``extra_key`` and ``cache_salt`` but hands this
  backend the hashes only.
- **Failures.** A missing page, a corrupt shard, a failed tier or a page not loaded within
  ``ucm_load_deadline_s`` (:mod:`~ucm.integration.bounded`: nothing is written into the host
  pool after a get returned) comes back as ``False`` (or ``None``) for that page only, so
  SGLang recomputes it; a load or dump that raises (:data:`STORE_ERRORS`: a closed store, a
  full dump queue) fails every page of its call, counted, with one warning; bad arguments
  raise.
- **Sets never wait on a tier without bound.** Without a CacheBuffer, or over one with
  ``write: back`` tiers below (where a dump may wait for write-back debt or go straight down),
  a set copies its pages out of the host pool into staging slots first (one native call;
  :class:`~ucm.integration.bounded.StagingSlots`, reused from set to set) and dumps from
  there, waiting at most ``ucm_set_deadline_s``: past it, its pages come back False (SGLang
  logs a failed backup and frees them) while the dump goes on from the staging slots, kept
  until it ends. While :data:`SETS_LATE_MAX` such late sets are still held by a tier,
  further sets fail at once, so a hung tier holds a bounded amount of memory. With a
  CacheBuffer whose tiers write through, a set is done once in the buffer (a slow
  write-through is skipped), so it is not staged.
- **Counters.** :meth:`UcmHiCacheStorage.stats` counts each get's pages by outcome and each
  set's; with ``--enable-storage-metrics``, :meth:`UcmHiCacheStorage.get_stats` feeds SGLang's
  own storage histograms.

Importing this module imports sglang and torch; ``import ucm`` and ``import ucm.integration``
import neither.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

import ucm
from ucm.errors import (
    ConfigError,
    InvalidArgumentError,
    KeyMissingError,
    TaskError,
    TierError,
    UcmError,
)
from ucm.metrics import CountersCollector, MetricsServer
from ucm.stack import parse_stack

from .bounded import (
    LOAD_DEADLINE_S_DEFAULT,
    BoundedLoads,
    LateLoadError,
    StagingSlots,
    check_load_deadline_s,
    keep_late,
    reap_late,
)
from .endpoint import check_metrics_port, serve_rank_metrics
from .keys import (
    EngineGeometry,
    Epochs,
    EpochState,
    KeySpace,
    engine_stack,
    named_block_id,
    provisional_salt,
    warn_node_local,
)
from .salts import config_digest, weights_fingerprint
from .tenants import TenantMapping

logger = logging.getLogger(__name__)

STACK_KEY = "hicache_storage_backend_extra_config['ucm_stack']"
"""Where the stack is given; every configuration error starts with it."""
METRICS_PORT_KEY = "hicache_storage_backend_extra_config['ucm_metrics_port']"

EXTRA_CONFIG_KEYS = (
    "ucm_stack",
    "ucm_kv_dtype",
    "ucm_weights_id",
    "ucm_namespace",
    "ucm_load_deadline_s",
    "ucm_set_deadline_s",
    "ucm_metrics_port",
)
"""The ``ucm_*`` keys of the extra config this backend reads; any other ``ucm_*`` key is a typo."""

KV_DTYPES = ("fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "bf16", "bfloat16", "fp16", "float16", "fp32")
"""Values of ``ucm_kv_dtype``: SGLang's ``--kv-cache-dtype`` names of a KV format."""

NO_TENANT_KEY = (
    "sglang 0.5.23 hashes a request's extra_key (its LoRA id) and cache_salt into the page keys "
    "(sglang/srt/mem_cache/utils.py: storage_namespace_seed, get_storage_hash_str), so tenants "
    "never share pages, but the storage calls carry only those hashes: batch_get_v1, "
    "batch_set_v1 and batch_exists get page hash strings and a HiCacheStorageExtraInfo whose "
    "prefix_keys are more of them (sglang/srt/managers/cache_controller.py), never the cache "
    "salt or the adapter, so no per-request namespace can be chosen"
)
"""Why ``ucm_namespace: cache_salt`` or ``lora`` is refused (the message names the key and
this)."""

COUNTER_NAMES = (
    "gets",
    "get_pages",
    "get_hits",
    "get_misses",
    "get_late",
    "get_errors",
    "sets",
    "set_pages",
    "set_stored",
    "set_failed",
    "set_late",
)
"""The backend's own counters (:meth:`UcmHiCacheStorage.stats`): calls and pages of the gets
(``batch_get_v1``, ``batch_get``, ``get``) and sets. A page not loaded is a miss (no tier has
it), late (past ``ucm_load_deadline_s``) or an error (a corrupt shard, a failed tier). A set's
page not stored is counted in ``set_failed``, and also in ``set_late`` when it was a staged set
that ran past ``ucm_set_deadline_s``, or that found :data:`SETS_LATE_MAX` late sets held (or
too few staging slots free: sets from several threads at once)."""

SET_DEADLINE_S_DEFAULT = 30.0
"""Seconds a staged set (no CacheBuffer, or one that writes back) may wait for its dump, by
default; SGLang's backup thread waits that long at most."""
SETS_LATE_MAX = 4
"""Late sets (past ``ucm_set_deadline_s``) whose dumps a tier may still hold, each with its
staging slots (a set's pages: at most SGLang's storage batch); past it, sets fail at once."""
SET_BATCH_PAGES = 128
"""Pages of SGLang's storage batch (``STORAGE_BATCH_SIZE`` in ``sglang.srt.mem_cache.
hicache_storage``): a backup's ``batch_set_v1`` holds at most this many. Staging slots are
reserved for :data:`SETS_LATE_MAX` + 1 such sets (address space only: no page until written)."""


@dataclass(frozen=True)
class _LateSet:
    """A staged set past ``ucm_set_deadline_s``: its dump and the slots it reads."""

    task: ucm.Task
    slots: StagingSlots
    staging: list[int]


STORE_ERRORS = (UcmError, TimeoutError)
"""What a get's load or a set's dump may raise that fails the call's pages instead: UCM's errors
(a closed store, a failed tier) and ``TimeoutError`` (a load or dump queue that stayed full).
SGLang 0.5.23's cache controller treats a raising ``batch_get_v1`` as no page found and a
raising ``batch_set_v1`` as a failed backup, logging a traceback each time; the backend counts
such a call's pages as ``get_errors`` / ``set_failed``, logs one warning, and returns all False
(a miss; not stored). Any other exception is counted the same way and raised."""

METRICS_KEPT = 4096
"""Per-call samples kept for SGLang's storage metrics between two of its ``get_stats`` calls
(it drains them every scheduler step); older ones are dropped."""

ONE_BYTE_DTYPES = ("torch.uint8", "torch.int8")
"""Host-pool dtypes SGLang stores several logical KV formats in (every fp8 format is uint8)."""


def server_args() -> Any | None:
    """SGLang's process-wide ``ServerArgs`` when the engine has published them (every SGLang
    scheduler process does before it builds its cache), else None."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:  # not published (a backend built outside an engine) or an older SGLang
        return None


@dataclass(frozen=True)
class ShardPlan:
    """How one SGLang rank maps onto UCM: its shard of each page and its rank parameters."""

    shard_index: int
    shards_per_block: int
    device_id: int
    local_rank_size: int
    salt_tp_size: int
    """TP size in the key space: 1 for MLA, whose pages do not depend on it."""
    unique_id_suffix: str
    """Appended to the stack's ``unique_id`` (one buffer per pipeline stage)."""
    salt_extra: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, config: HiCacheStorageConfig) -> ShardPlan:
        """The plan for the rank ``config`` describes (SGLang's own HiCacheStorageConfig)."""
        tp_rank, tp_size = config.tp_rank, config.tp_size
        if not (isinstance(tp_size, int) and tp_size >= 1 and 0 <= tp_rank < tp_size):
            raise ConfigError(
                f"HiCacheStorageConfig: tp_rank={tp_rank!r}, tp_size={tp_size!r}: expected "
                "0 <= tp_rank < tp_size"
            )
        lcm = config.tp_lcm_size
        if lcm is not None and lcm != tp_size:
            raise ConfigError(
                f"hicache_storage_backend_extra_config['tp_lcm_size']={lcm!r}: UCM stores one "
                f"shard per TP rank (tp_size {tp_size}) and does not split heads for deployments "
                "of other TP sizes; leave tp_lcm_size out (pages of other TP sizes are misses)"
            )
        if config.attn_cp_size != 1 or config.dcp_size != 1:
            raise ConfigError(
                f"HiCacheStorageConfig: attn_cp_size={config.attn_cp_size}, dcp_size="
                f"{config.dcp_size}: the UCM backend supports tensor and pipeline parallelism; "
                "context parallelism (each rank holding a slice of every page) is not supported"
            )
        pp_rank, pp_size = config.pp_rank, config.pp_size
        stage = pp_size > 1
        if config.is_mla_model:
            shard_index, shards, salt_tp = 0, 1, 1
        else:
            shard_index, shards, salt_tp = tp_rank, tp_size, tp_size
        return cls(
            shard_index=shard_index,
            shards_per_block=shards,
            device_id=tp_rank,
            local_rank_size=tp_size,
            salt_tp_size=salt_tp,
            unique_id_suffix=f"-pp{pp_rank}" if stage else "",
            salt_extra=(("pipeline_stage", f"{pp_rank}/{pp_size}"),) if stage else (),
        )


class UcmHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # sglang ships no type hints
    """SGLang ``HiCacheStorage`` over a UCM stack: one instance per SGLang rank."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None
    ) -> None:
        # ``kwargs``: the factory's extra keyword arguments (none from SGLang's controller).
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(k for k in extra if k.startswith("ucm_") and k not in EXTRA_CONFIG_KEYS)
        if unknown:
            raise ConfigError(
                f"hicache_storage_backend_extra_config: unknown key(s) {unknown}; the UCM "
                f"backend reads {list(EXTRA_CONFIG_KEYS)}"
            )
        source = extra.get("ucm_stack")
        if source is None:
            raise ConfigError(
                f"{STACK_KEY} is missing: give the path of a YAML stack or the stack itself "
                "(unique_id and tiers; UCM derives the geometry from SGLang's host KV pool)"
            )
        if not isinstance(source, str | Mapping):
            raise ConfigError(
                f"{STACK_KEY} must be the path of a YAML stack or a mapping, got "
                f"{type(source).__name__}"
            )
        if not (isinstance(storage_config.model_name, str) and storage_config.model_name.strip()):
            raise ConfigError(
                f"HiCacheStorageConfig.model_name={storage_config.model_name!r}: the UCM backend "
                "salts every page key with the model name, and an empty name would let two "
                "models share pages; SGLang sets it from --served-model-name or --model-path"
            )
        kv_dtype = extra.get("ucm_kv_dtype")
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise ConfigError(
                f"hicache_storage_backend_extra_config['ucm_kv_dtype']={kv_dtype!r}: expected "
                f"one of {list(KV_DTYPES)} (SGLang's --kv-cache-dtype names)"
            )
        weights_id = extra.get("ucm_weights_id")
        if weights_id is not None and (not isinstance(weights_id, str) or not weights_id):
            raise ConfigError(
                f"hicache_storage_backend_extra_config['ucm_weights_id']={weights_id!r}: expected "
                "a non-empty string naming the weights"
            )
        namespace_key = "hicache_storage_backend_extra_config['ucm_namespace']"
        self._namespace = TenantMapping.parse(
            extra.get("ucm_namespace"), namespace_key
        ).engine_namespace(namespace_key, "SGLang's HiCache storage backend", NO_TENANT_KEY)
        self._load_deadline_s = check_load_deadline_s(
            extra.get("ucm_load_deadline_s", LOAD_DEADLINE_S_DEFAULT),
            "hicache_storage_backend_extra_config['ucm_load_deadline_s']",
        )
        self._set_deadline_s = check_load_deadline_s(
            extra.get("ucm_set_deadline_s", SET_DEADLINE_S_DEFAULT),
            "hicache_storage_backend_extra_config['ucm_set_deadline_s']",
            SET_DEADLINE_S_DEFAULT,
        )
        self._stage_sets = False
        """Sets are staged (see the module's notes): no CacheBuffer, or one that writes back."""
        self._set_slots: StagingSlots | None = None
        """Staging memory of staged sets, reused from set to set (warm pages: no page faults
        in the copy); reserved at the first staged set (:meth:`_take_set_slots`)."""
        self._late_sets: list[_LateSet] = []
        """Staged sets that ran past the deadline, whose dumps may still be running."""
        self._sets_lock = threading.Lock()
        """Guards ``_set_slots`` and ``_late_sets`` (SGLang sets from one backup thread, but the
        tensor interface may be called from any)."""
        self._metrics_port = check_metrics_port(extra.get("ucm_metrics_port"), METRICS_PORT_KEY)
        self._metrics_server: MetricsServer | None = None
        self._loads: BoundedLoads | None = None
        self._kv_dtype: str | None = kv_dtype
        self._weights_id: str | None = weights_id
        self.storage_config = storage_config
        self.plan = ShardPlan.of(storage_config)
        self._source: str | Mapping[str, Any] = source
        self._store: ucm.Store | None = None
        self._salt = b""
        self._space: KeySpace | None = None
        self._epochs: EpochState | None = None
        self.epoch: int | None = 0
        """The reset epoch this rank's page ids are in (see :meth:`clear`); None while it is
        unknown (:class:`~ucm.integration.keys.EpochState`)."""
        self._page_size = 0
        self._pointers_per_page = 0
        self._flat_offsets: list[int] | None = None
        self._flat_problem = ""
        self._counters: Counter[str] = Counter({name: 0 for name in COUNTER_NAMES})
        self._counters_lock = threading.Lock()
        """Guards the counters and the samples: SGLang gets on its prefetch thread and sets on
        its backup thread."""
        # SGLang's storage metrics, per call (only with --enable-storage-metrics).
        self._samples: dict[str, deque[float]] = {
            name: deque(maxlen=METRICS_KEPT)
            for name in ("prefetch_pgs", "prefetch_bandwidth", "backup_pgs", "backup_bandwidth")
        }

    # ---- set-up: the host pool fixes the geometry -----------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Opens the stack with the geometry of ``mem_pool_host`` (SGLang's host KV pool)."""
        super().register_mem_pool_host(mem_pool_host)
        page_size = int(mem_pool_host.page_size)
        first_page = torch.arange(page_size, dtype=torch.int64)
        pointers, sizes = mem_pool_host.get_page_buffer_meta(first_page)
        if not sizes or len(pointers) != len(sizes):
            raise ConfigError(
                f"{type(mem_pool_host).__name__}.get_page_buffer_meta gave {len(pointers)} "
                f"pointers and {len(sizes)} sizes for one page: the UCM backend needs the host "
                "pool's zero-copy page layout"
            )
        description = (
            f"SGLang {type(mem_pool_host).__name__}, layout {mem_pool_host.layout}, "
            f"{mem_pool_host.layer_num} layers, page_size {page_size} tokens, "
            f"dtype {mem_pool_host.dtype}"
        )
        geometry = EngineGeometry(
            tensor_sizes=tuple(int(s) for s in sizes),
            shards_per_block=self.plan.shards_per_block,
            description=description,
        )
        stack = engine_stack(self._source, geometry, key=STACK_KEY, engine="SGLang")
        if self.plan.unique_id_suffix:
            data = stack.model_dump(exclude_none=True)
            data["unique_id"] = f"{stack.unique_id}{self.plan.unique_id_suffix}"
            stack = parse_stack(data, source=f"{STACK_KEY} (pipeline stage)")
        args = server_args()
        space = KeySpace(
            engine="sglang",
            model=self.storage_config.model_name,
            dtype=self._logical_dtype(str(mem_pool_host.dtype), args),
            block_tokens=page_size,
            kv_layout=(
                f"{type(mem_pool_host).__name__}:{mem_pool_host.layout}:"
                f"{mem_pool_host.layer_num} layers:{list(geometry.tensor_sizes)}"
            ),
            tp_size=self.plan.salt_tp_size,
            extra=self.plan.salt_extra + self._model_fields(args),
        )
        self._flat_offsets, self._flat_problem = _flat_page_offsets(
            mem_pool_host, [int(p) for p in pointers], geometry.tensor_sizes
        )
        self._close_store()
        self._page_size = page_size
        self._pointers_per_page = len(sizes)
        self._store = ucm.open(
            stack,
            device_id=self.plan.device_id,
            local_rank_size=self.plan.local_rank_size,
            namespace=self._namespace,
        )
        self._loads = BoundedLoads(self._store, self._load_deadline_s)
        buffer = self._store.buffer
        self._stage_sets = buffer is None or buffer.writes_back
        config = self.storage_config
        if self._metrics_port is not None:
            # One endpoint per rank of the node: TP ranks first, then pipeline stages, then
            # data-parallel ranks (each is a scheduler process of its own).
            offset = config.tp_rank + config.tp_size * (
                config.pp_rank + config.pp_size * config.dp_rank
            )
            counters = CountersCollector("sglang", stack.unique_id, self._counts)
            try:
                self._metrics_server = serve_rank_metrics(
                    self._store,
                    self._metrics_port,
                    offset,
                    METRICS_PORT_KEY,
                    f"SGLang dp{config.dp_rank}-pp{config.pp_rank}-tp{config.tp_rank}",
                    counters,
                )
            except ConfigError:
                self._close_store()
                raise
        self._space = space
        if self._epochs is not None:
            self._epochs.close()
        self._epochs = EpochState(
            Epochs(space.salt(), writer=f"dp{config.dp_rank}-tp{config.tp_rank}"), self._store
        )
        self._set_epoch(self._epochs.start())
        nodes = int(getattr(args, "nnodes", 1) or 1) if args is not None else 1
        warn_node_local("SGLang", nodes, self.plan.shards_per_block, stack)

    def _logical_dtype(self, host_dtype: str, args: Any | None) -> str:
        """The KV format the pages hold: the host pool's dtype, and for a one-byte pool the fp8
        (or fp4) format from SGLang's ``--kv-cache-dtype`` or ``ucm_kv_dtype``."""
        engine = getattr(args, "kv_cache_dtype", None) if args is not None else None
        engine = None if engine in (None, "auto") else str(engine)
        stated = self._kv_dtype
        if engine is not None and stated is not None and engine != stated:
            raise ConfigError(
                f"hicache_storage_backend_extra_config['ucm_kv_dtype']={stated!r}, but SGLang "
                f"runs with --kv-cache-dtype {engine}: leave ucm_kv_dtype out or make it match"
            )
        logical = engine or stated
        if host_dtype in ONE_BYTE_DTYPES and logical is None:
            raise ConfigError(
                f"SGLang's host KV pool stores {host_dtype}, which holds every fp8 format alike, "
                "and SGLang's server args (--kv-cache-dtype) are not available to say which one: "
                "state it as hicache_storage_backend_extra_config['ucm_kv_dtype'] = 'fp8_e4m3' "
                "or 'fp8_e5m2', so that pages of two formats never share a key"
            )
        return f"{host_dtype}/{logical}" if logical is not None else host_dtype

    def _model_fields(self, args: Any | None) -> tuple[tuple[str, str], ...]:
        """Key-space fields naming the weights, config overrides and KV scales. Without
        SGLang's server args only ``ucm_weights_id`` can name them: refused without it."""
        if args is None and self._weights_id is None:
            raise ConfigError(
                "SGLang's server args are not available (a backend created outside an SGLang "
                "scheduler process), so UCM's page ids cannot cover the model's weights, its "
                "config overrides (--json-model-override-args) or its quantization: state "
                "hicache_storage_backend_extra_config['ucm_weights_id'] = '<an id of the "
                "weights, overrides and quantization>', so that two models' pages never share "
                "a key"
            )
        fields: dict[str, str] = {}
        if args is not None:
            fields["model_path"] = str(args.model_path)
            fields["revision"] = str(getattr(args, "revision", None) or "")
            fields["model_overrides"] = config_digest(
                getattr(args, "json_model_override_args", None) or "{}"
            )
            fields["quantization"] = str(getattr(args, "quantization", None) or "")
            fields["model_dtype"] = str(getattr(args, "dtype", None) or "")
            scales = getattr(args, "quantization_param_path", None)
            if scales:
                fields["kv_scales"] = weights_fingerprint(str(scales))
        if self._weights_id is not None:
            fields["weights"] = self._weights_id
        elif args is not None:
            fields["weights"] = weights_fingerprint(
                str(args.model_path), getattr(args, "revision", None)
            )
        return tuple(sorted(fields.items()))

    def clear(self) -> None:
        """SGLang's ``clear_hicache_storage``: no page stored before it is served again.

        Moves this rank's key space to a new reset epoch and records it in the stack's control
        record (:class:`~ucm.integration.keys.Epochs`: the buffer's node-wide table and every
        lower tier, outside admission, quotas and eviction): every page id computed from now on
        differs from every id stored before, on every tier, and a backend opened later on this
        stack (a restart, another node sharing a lower tier) starts in the new epoch. Old pages
        are not deleted: they stay until their tiers evict them. Raises if the epoch could not
        be recorded in every tier (this rank is in it, and records it again until it is), so
        that SGLang does not report a clear that a restart might not see.
        """
        self._require_store()
        assert self._epochs is not None
        epoch = self._epochs.reset()
        self._set_epoch(epoch)
        if epoch is None:  # pending: the epoch follows when the tier answers
            return
        if self._epochs.unrecorded is not None:
            raise TierError(
                f"UCM HiCache rank {self.storage_config.tp_rank}: clear: epoch {epoch} could "
                "not be recorded in every tier of the stack (this rank is in it and records it "
                "again; a backend started before then may not be)"
            )
        logger.info(
            "UCM HiCache rank %d: cleared (key space epoch %d): pages stored before are never "
            "served; they stay in the tiers until evicted",
            self.storage_config.tp_rank,
            epoch,
        )

    def _set_epoch(self, epoch: int | None) -> None:
        assert self._epochs is not None and self._space is not None
        self.epoch = epoch
        self._salt = (
            provisional_salt(self._space.salt(), self._epochs.nonce)
            if epoch is None
            else self._space.salt(epoch=epoch)
        )

    def _poll_epoch(self) -> None:
        """Adopts the reset epoch once a tier that did not answer at start (or at a clear)
        has, and records a clear's epoch that some tier did not take
        (:class:`~ucm.integration.keys.EpochState`)."""
        if self._epochs is None:
            return
        adopted = self._epochs.poll()
        if adopted is not None:
            self._set_epoch(adopted)

    @property
    def store(self) -> ucm.Store:
        """The UCM store of this rank (opened when SGLang registers its host pool)."""
        return self._require_store()

    def _require_store(self) -> ucm.Store:
        if self._store is None:
            raise InvalidArgumentError(
                "the UCM HiCache backend has no host pool yet: SGLang calls "
                "register_mem_pool_host(host_pool) after creating the backend; call it first"
            )
        return self._store

    def block_id(self, key: str) -> bytes:
        """The UCM block id of SGLang page ``key``."""
        return self._block_ids([key])[0]

    # ---- zero-copy v1 interface ------------------------------------------------------------

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Loads page ``keys[i]`` into the host pool at ``host_indices[i * page_size]``."""
        ids = self._block_ids(keys)
        pointers = self._page_pointers(len(ids), host_indices)
        return self._load(ids, pointers)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Stores the host pool's pages at ``host_indices`` as pages ``keys``."""
        started = time.monotonic()
        ids = self._block_ids(keys)
        pointers = self._page_pointers(len(ids), host_indices)
        return self._dump(ids, pointers, started)

    # ---- tensor interface (flat pages, SGLang's generic path) ------------------------------

    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        """Page ``key`` as a flat page (into ``target_location`` when given); None if absent."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Each page as a flat page, or None where it is absent or failed to load."""
        ids = self._block_ids(keys)
        if target_locations is None:
            targets = [self.mem_pool_host.get_dummy_flat_data_page() for _ in ids]
        else:
            targets = list(target_locations)
        pointers = self._flat_pointers(targets, len(ids), "target_locations", for_load=True)
        found = self._load(ids, pointers)
        return [target if ok else None for target, ok in zip(targets, found, strict=True)]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Stores the flat page ``value`` as page ``key``."""
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Stores the flat pages ``values``; True when every page was stored."""
        started = time.monotonic()
        ids = self._block_ids(keys)
        if values is None:
            raise InvalidArgumentError("values is None: batch_set needs one flat page per key")
        sources = list(values)
        pointers = self._flat_pointers(sources, len(ids), "values", for_load=False)
        return all(self._dump(ids, pointers, started))

    # ---- lookups ---------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether page ``key`` is stored (every TP rank's shard of it)."""
        return self.store.lookup(self._block_ids([key]))[0]

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many pages from the start of ``keys`` are stored, consecutively."""
        ids = self._block_ids(keys)
        return self.store.lookup_on_prefix(ids) + 1 if ids else 0

    def get_stats(self) -> Any | None:
        """SGLang's storage metrics (``--enable-storage-metrics``), drained: each get's and
        set's page count and bandwidth (GB/s of pages loaded or stored, over the call's wall
        time) since the last call. None when the metrics are off, as SGLang's base class."""
        if not self.storage_config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        with self._counters_lock:
            for name, samples in self._samples.items():
                getattr(metrics, name).extend(samples)
                samples.clear()
        return metrics

    def stats(self) -> dict[str, Any]:
        """This backend's counters (``sglang``, :data:`COUNTER_NAMES`) beside the store's
        (``ucm``, :meth:`ucm.Store.stats`)."""
        return {"sglang": self._counts(), "ucm": self.store.stats()}

    @property
    def metrics_url(self) -> str | None:
        """Where this rank serves UCM's Prometheus metrics (``ucm_metrics_port``), or None."""
        return self._metrics_server.url if self._metrics_server is not None else None

    def _counts(self) -> dict[str, int]:
        with self._counters_lock:
            return dict(self._counters)

    def _record(self, kind: str, pages: int, done: int, started: float) -> None:
        """One call's SGLang metrics sample (``kind``: prefetch or backup), when they are on."""
        if not self.storage_config.enable_storage_metrics:
            return
        elapsed = max(time.monotonic() - started, 1e-9)
        gigabytes = done * self.store.layout.shard_size / 1e9
        with self._counters_lock:
            self._samples[f"{kind}_pgs"].append(pages)
            self._samples[f"{kind}_bandwidth"].append(gigabytes / elapsed)

    def _count(self, **amounts: int) -> None:
        with self._counters_lock:
            self._counters.update(amounts)

    def close(self) -> None:
        """Finishes pending writes and closes the store (SGLang calls it on detach)."""
        if self._epochs is not None:
            self._epochs.close()
        self._close_store()

    def _close_store(self) -> None:
        """Closes the metrics endpoint and the store (the closed store stays, for its stats)."""
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        if self._store is not None:
            self._store.close()

    # ---- internals -------------------------------------------------------------------------

    def _block_ids(self, keys: Sequence[str]) -> list[bytes]:
        if isinstance(keys, str) or not isinstance(keys, Sequence):
            raise InvalidArgumentError(
                f"keys must be a list of page hash strings, got {type(keys).__name__}"
            )
        self._require_store()  # the salt exists once the host pool is registered
        self._poll_epoch()
        ids = []
        for i, key in enumerate(keys):
            if not isinstance(key, str):
                raise InvalidArgumentError(f"keys[{i}] must be a page hash string, got {key!r}")
            ids.append(named_block_id(self._salt, key))
        return ids

    def _page_pointers(self, pages: int, host_indices: Any) -> list[list[int]]:
        """The host pool's address of every tensor of each page, in the shard's order."""
        if not isinstance(host_indices, torch.Tensor):
            raise InvalidArgumentError(
                f"host_indices must be a torch.Tensor of host pool slots, got "
                f"{type(host_indices).__name__}"
            )
        if host_indices.numel() != pages * self._page_size:
            raise InvalidArgumentError(
                f"host_indices has {host_indices.numel()} slots for {pages} key(s): expected "
                f"{pages * self._page_size} (page_size {self._page_size} per key)"
            )
        if pages == 0:
            return []
        flat, _sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per_page = self._pointers_per_page
        return [flat[i * per_page : (i + 1) * per_page] for i in range(pages)]

    def _flat_pointers(
        self, pages: Sequence[Any], count: int, name: str, for_load: bool
    ) -> list[list[int]]:
        """Addresses of each shard tensor inside flat pages (SGLang's generic page format)."""
        if self._flat_offsets is None:
            raise InvalidArgumentError(
                f"{name}: flat pages are not supported for this host pool ({self._flat_problem}); "
                'use the zero-copy interface ("interface_v1": true)'
            )
        if len(pages) != count:
            raise InvalidArgumentError(
                f"{name} has {len(pages)} entries for {count} key(s): give one flat page per key"
            )
        shard_size = self.store.layout.shard_size
        pointers = []
        for i, page in enumerate(pages):
            if not isinstance(page, torch.Tensor):
                raise InvalidArgumentError(
                    f"{name}[{i}] must be a torch.Tensor flat page, got {type(page).__name__}"
                )
            nbytes = page.numel() * page.element_size()
            problem = ""
            if page.device.type != "cpu":
                problem = f"is on {page.device}, expected a host (CPU) tensor"
            elif not page.is_contiguous():
                problem = "is not contiguous"
            elif nbytes != shard_size:
                problem = f"has {nbytes} bytes, expected one page of {shard_size}"
            elif for_load and page.requires_grad:
                problem = "requires grad"
            if problem:
                raise InvalidArgumentError(f"{name}[{i}] {problem}")
            base = page.data_ptr()
            pointers.append([base + offset for offset in self._flat_offsets])
        return pointers

    def _load(self, ids: list[bytes], pointers: list[list[int]]) -> list[bool]:
        """Loads the pages within the load deadline; each is True unless it failed (missing,
        corrupt, late...). Nothing is written into the host pool after it returns. A load that
        raises (a closed store, a full load queue) fails every page: see :data:`STORE_ERRORS`."""
        self._require_store()
        assert self._loads is not None
        started = time.monotonic()
        try:
            failed = self._loads.load(ids, [self.plan.shard_index] * len(ids), pointers)
        except Exception as exc:
            self._count(gets=1, get_pages=len(ids), get_errors=len(ids))
            self._record("prefetch", len(ids), 0, started)
            if not isinstance(exc, STORE_ERRORS):
                raise
            logger.warning(
                "UCM HiCache: a get of %d page(s) failed, none loaded: %s", len(ids), exc
            )
            return [False] * len(ids)
        if failed:
            logger.debug("UCM HiCache: %d of %d page(s) not loaded", len(failed), len(ids))
        loaded = [block not in failed for block in ids]
        causes = [failed.get(block) for block in ids]
        late = sum(1 for cause in causes if isinstance(cause, LateLoadError))
        misses = sum(1 for cause in causes if isinstance(cause, KeyMissingError))
        hits = sum(loaded)
        self._count(
            gets=1,
            get_pages=len(ids),
            get_hits=hits,
            get_misses=misses,
            get_late=late,
            get_errors=len(ids) - hits - misses - late,
        )
        self._record("prefetch", len(ids), hits, started)
        return loaded

    def _dump(self, ids: list[bytes], pointers: list[list[int]], started: float) -> list[bool]:
        """Stores the pages; each is True unless its key failed. SGLang writes on its own
        backup thread, off the requests' path, and keeps the pages' host lock until this
        returns. With a CacheBuffer whose tiers write through, a dump is done once in the
        buffer (a slow write-through tier is skipped, never waited for), and the set waits for
        it. Otherwise the set is staged (:meth:`_staged_dump`) and waits at most
        ``ucm_set_deadline_s``. A dump that raises (a dump queue full past
        ``dump_submit_timeout_s``, a closed store) fails every page: see
        :data:`STORE_ERRORS`."""
        shards = [self.plan.shard_index] * len(ids)
        try:
            if self._stage_sets:
                return self._staged_dump(ids, shards, pointers, started)
            self.store.wait(self.store.dump_data(ids, shards, pointers))
        except TaskError as error:
            return self._stored(ids, error, started)
        except Exception as exc:
            self._count(sets=1, set_pages=len(ids), set_failed=len(ids))
            self._record("backup", len(ids), 0, started)
            if not isinstance(exc, STORE_ERRORS):
                raise
            logger.warning(
                "UCM HiCache: a set of %d page(s) failed, none stored: %s", len(ids), exc
            )
            return [False] * len(ids)
        return self._stored(ids, None, started)

    def _staged_dump(
        self, ids: list[bytes], shards: list[int], pointers: list[list[int]], started: float
    ) -> list[bool]:
        """Copies the pages into staging slots and dumps them from there, waiting until
        ``ucm_set_deadline_s`` after ``started``: past it the pages are not stored as far as
        SGLang knows (all False, counted ``set_late``) and the dump goes on from the slots,
        kept until it ends (:func:`~ucm.integration.bounded.keep_late`). While
        :data:`SETS_LATE_MAX` late dumps are still running, the set fails at once."""
        store = self.store
        reap_late()
        with self._sets_lock:
            self._give_back_late_sets()
            held = len(self._late_sets)
            taken = None if held >= SETS_LATE_MAX else self._take_set_slots(len(ids))
        if held >= SETS_LATE_MAX:
            return self._late_set(
                ids,
                started,
                f"not stored: the tiers still hold {held} earlier sets past ucm_set_deadline_s "
                f"({self._set_deadline_s:g} s)",
            )
        if taken is None:
            return self._late_set(
                ids,
                started,
                "not stored: the staging memory for sets is held by sets still being dumped",
            )
        slots, staging = taken
        try:
            addresses = slots.copy_in(staging, pointers)
            # SGLang's pages are read no more: whatever the tier does, the set returns by the
            # deadline and SGLang may reuse them.
            task = store.dump_data(ids, shards, addresses)
        except BaseException:  # no dump reads the slots
            slots.give_back(staging)
            raise
        left_s = max(0.0, started + self._set_deadline_s - time.monotonic())
        try:
            store.wait(task, timeout_s=left_s)
        except TimeoutError:
            keep_late(store, task, slots)
            with self._sets_lock:
                self._late_sets.append(_LateSet(task, slots, staging))
            return self._late_set(
                ids,
                started,
                f"was not stored within ucm_set_deadline_s ({self._set_deadline_s:g} s); its "
                "dump goes on from UCM's staging memory, not SGLang's pages",
            )
        except TaskError as error:
            slots.give_back(staging)
            return self._stored(ids, error, started)
        slots.give_back(staging)
        return self._stored(ids, None, started)

    def _take_set_slots(self, pages: int) -> tuple[StagingSlots, list[int]] | None:
        """``pages`` slots for a staged set (the caller holds ``_sets_lock``), or None when
        the sets in flight hold too many. The reservation holds :data:`SETS_LATE_MAX` late
        sets and one more of SGLang's storage batch (:data:`SET_BATCH_PAGES`), or of the
        largest set so far: a larger set reserves anew, and the slots the late sets hold in
        the old reservation stay theirs until their dumps end."""
        slots = self._set_slots
        if slots is None or pages * (SETS_LATE_MAX + 1) > slots.capacity:
            wanted = (SETS_LATE_MAX + 1) * max(pages, SET_BATCH_PAGES)
            slots = StagingSlots.reserve(
                self.store.layout,
                wanted,
                "pages wanted for SGLang's sets",
                "a set that finds too few free is not stored",
            )
            self._set_slots = slots
        staging = slots.take(pages)
        return None if staging is None else (slots, staging)

    def _give_back_late_sets(self) -> None:
        """Frees the slots of late sets whose dumps are over (the caller holds
        ``_sets_lock``)."""
        running = []
        for late in self._late_sets:
            if late.task.done():
                late.slots.give_back(late.staging)
            else:
                running.append(late)
        self._late_sets = running

    def _late_set(self, ids: list[bytes], started: float, what: str) -> list[bool]:
        """Counts a staged set whose pages SGLang is told are not stored (``set_late``),
        warns with ``what`` happened, and returns all False."""
        self._count(sets=1, set_pages=len(ids), set_failed=len(ids), set_late=len(ids))
        self._record("backup", len(ids), 0, started)
        logger.warning("UCM HiCache: a set of %d page(s) %s", len(ids), what)
        return [False] * len(ids)

    def _stored(self, ids: list[bytes], error: TaskError | None, started: float) -> list[bool]:
        """Counts a set whose dump ended (``error``: the keys that failed) and says which
        pages were stored."""
        if error is None:
            stored = [True] * len(ids)
        else:
            failed = {block for block, _shard in error.failures}
            logger.debug("UCM HiCache: %s", error)
            stored = [block not in failed for block in ids]
        done = sum(stored)
        self._count(sets=1, set_pages=len(ids), set_stored=done, set_failed=len(ids) - done)
        self._record("backup", len(ids), done, started)
        return stored


def _flat_page_offsets(
    host_pool: Any, pointers: Sequence[int], sizes: Sequence[int]
) -> tuple[list[int] | None, str]:
    """Where each shard tensor of page 0 lies inside the pool's flat page (byte offsets).

    SGLang's flat page is ``get_data_page(index, flat=True)``: the pool's view of one page,
    flattened. The zero-copy pointers (``get_page_buffer_meta``) address the same bytes in the
    pool, in the shard's order; reading the view's strides maps each pointer to its place in the
    flat page. Returns (None, why) when the pool's page is not such a view.
    """
    try:
        view = host_pool.get_data_page(0, flat=False)
    except (AttributeError, NotImplementedError, ValueError) as exc:
        return None, f"get_data_page: {exc}"
    if not isinstance(view, torch.Tensor):
        return None, "get_data_page does not return a tensor"
    storage = getattr(host_pool, "kv_buffer", None)
    if not (
        isinstance(storage, torch.Tensor)
        and view.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
    ):
        return None, "its data page is not a view of its kv_buffer"
    itemsize = view.element_size()
    # Runs: the view's contiguous stretches (its trailing dense dims), in flat order.
    shape, strides = list(view.shape), list(view.stride())
    run = 1
    dims = len(shape)
    while dims > 0 and strides[dims - 1] == run:
        run *= shape[dims - 1]
        dims -= 1
    run_bytes = run * itemsize
    starts: list[tuple[int, int]] = []  # (address, flat byte offset)
    for flat_run, coords in enumerate(itertools.product(*(range(n) for n in shape[:dims]))):
        address = view.data_ptr() + sum(c * s for c, s in zip(coords, strides, strict=False)) * (
            itemsize
        )
        starts.append((address, flat_run * run_bytes))
    starts.sort()
    addresses = [a for a, _ in starts]
    offsets = []
    for pointer, size in zip(pointers, sizes, strict=True):
        place = bisect.bisect_right(addresses, pointer) - 1
        if place < 0 or pointer + size > addresses[place] + run_bytes:
            return None, "a zero-copy tensor does not lie in one stretch of its flat page"
        offsets.append(starts[place][1] + (pointer - addresses[place]))
    covered = sorted(zip(offsets, sizes, strict=True))
    position = 0
    for offset, size in covered:
        if offset != position:
            return None, "its zero-copy tensors do not tile its flat page"
        position += size
    if position != view.numel() * itemsize:
        return None, "its zero-copy tensors do not cover its flat page"
    return offsets, ""


__all__ = ["EXTRA_CONFIG_KEYS", "STACK_KEY", "ShardPlan", "UcmHiCacheStorage"]
