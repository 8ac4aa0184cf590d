"""UCM as an LMCache storage plugin (``lmcache==0.5.6``): ``UcmStorageBackend``.

Configure LMCache with::

    storage_plugins: ["ucm"]
    extra_config:
      storage_plugin.ucm.module_path: ucm.integration.lmcache
      storage_plugin.ucm.class_name: UcmStorageBackend
      storage_plugin.ucm.stack: /etc/ucm/lmcache-node.yaml   # or the stack itself, as a dict

LMCache builds the plugin in every worker (and scheduler) process as
``UcmStorageBackend(config=, dst_device=, metadata=, local_cpu_backend=, loop=)``. The plugin is a
thin layer over the public Store API (``ucm.open``, ``lookup``, ``load_data``, ``dump_data``,
``remove``, ``wait``, ``stats``, ``close``); docs/lmcache.md is the user's page.

**Keys.** An LMCache chunk is one UCM *block*; each worker's part of it is one *shard*. The block
id is :func:`~ucm.integration.keys.named_block_id` of the chunk hash, salted with a
:class:`~ucm.integration.keys.KeySpace` of everything else in the :class:`CacheEngineKey` but
the worker id (model, world size, dtype, tags) plus the chunk geometry and, for a one-byte KV cache,
its logical format (:func:`kv_format`: LMCache says ``uint8`` for every fp8); the shard index is the
worker id and ``shards_per_block`` is the key's world size. So the workers of one node share one
CacheBuffer (one ``unique_id``) and a chunk's parts live together in every tier. A chunk counts
as present only when every worker's shard is (the workers agree on hits), and removing a chunk
removes every worker's shard of it (a chunk missing one part is useless to all of them). With
MLA and ``save_only_first_rank`` LMCache collapses the key's world size to 1: one shard, index 0.

**Geometry.** A shard is one worker's KV of one full chunk, the bytes of the chunk's MemoryObj:
one tensor per KV group of shape ``[kv_size, num_layers, chunk_size, hidden_dim]`` (LMCache's
``metadata.get_shapes(chunk_size)`` and ``get_dtypes()``), so ``tensor_size_list`` holds each
group's byte size. A stack states only ``unique_id`` and ``tiers``.

**Ref counts.** ``StorageManager.batched_put`` calls ``ref_count_down()`` on every object once it
has handed them to every backend; this plugin writes asynchronously, so it takes its own
reference (``ref_count_up``) at submit time and drops it when UCM's dump task has finished with
the object's memory, or, for a staged put (no CacheBuffer, or one that writes back), once the
chunk is copied into UCM's staging slots, before the submit returns. Retrieved objects are
allocated from ``local_cpu_backend.allocate`` and handed to LMCache with the single reference
the allocation made (a miss frees its allocation).

**Errors.** A get never raises on a worker: any error of a load is a miss for its batch (every
allocation freed), and a prefetch always answers and releases its lookup's pins. A get returns
within ``storage_plugin.<name>.load_deadline_s`` (:mod:`~ucm.integration.bounded`): a chunk
not loaded by then is a miss, and nothing is written into its MemoryObj afterwards.

**Namespaces.** ``storage_plugin.<name>.namespace`` (:mod:`~ucm.integration.tenants`) maps a
chunk to a UCM namespace from its key's request tags (LMCache's ``lmcache.tag.*`` request
configs, which ``CacheEngineKey`` carries as ``tags``): ``cache_salt`` (the default) reads the
tag ``cache_salt``, ``tag:<name>`` the tag ``<name>``, a chunk without that tag is in the
default namespace; ``fixed:<name>`` puts every chunk in ``<name>``. ``lora`` is refused: the
key carries no adapter. Every store call goes to the namespace of its chunks (a batch of
several namespaces is one call per namespace), so quotas apply per tenant. vLLM's own
``cache_salt`` never reaches LMCache 0.5.6's keys (see docs/lmcache.md).

**Pins.** A pin is a :meth:`~ucm.Store.pin` of the chunk's block: every worker's shard of it that
is Ready in the CacheBuffer stays there (no eviction, node-wide) until the pin is released;
shards below the buffer are not held. Pins of async lookups whose prefetch never comes expire.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import queue
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from .. import DEFAULT_NAMESPACE, REMOVE_CHUNK_KEYS, Pin, Store, TaskError
from .. import open as open_store
from ..errors import ConfigError, InvalidArgumentError, KeyMissingError, RoleError, UcmError
from ..metrics import CountersCollector, MetricsServer
from ..threadname import enter_thread
from .bounded import (
    LOAD_DEADLINE_S_DEFAULT,
    BoundedLoads,
    LateLoadError,
    StagingSlots,
    check_load_deadline_s,
)
from .endpoint import check_metrics_port, serve_rank_metrics
from .keys import EngineGeometry, KeySpace, engine_stack, named_block_id, warn_node_local
from .tenants import TenantMapping

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

logger = logging.getLogger(__name__)

CLASS_NAME = "UcmStorageBackend"
MODULE_PATH = __name__
DEFAULT_PLUGIN_NAME = "ucm"
FLUSH_TIMEOUT_S = 600.0
"""flush() waits at most this long by default for puts still being written; close() waits the
stack's ``queue_timeout_s``."""
LOOKUP_PIN_TTL_S = 300.0
"""The pins an async lookup took are released by its prefetch; when no prefetch comes for this
long, they are released anyway (a plugin's ``lookup_pin_ttl_s``)."""
LOOKUP_PINS_MAX = 4096
"""Most async lookups whose pins wait for their prefetch at once; beyond it the oldest lookup's
pins are released (a plugin's ``lookup_pins_max``)."""

PUT_MEMORY_SHARE = 0.5
"""Puts still being written, at most, as a share of LMCache's CPU memory in chunks. A staged
put holds one of that many staging slots of UCM's until the tier has its bytes; an unstaged
put holds its MemoryObj until the CacheBuffer has them. Past it a put is skipped
(``put_skipped_memory``)."""

UcmKey = tuple[bytes, int]
T = TypeVar("T")

LORA_REFUSED = (
    "LMCache 0.5.6's CacheEngineKey (lmcache/utils.py) holds model name, world size, worker id, "
    "chunk hash, dtype and request configs: no LoRA adapter (LMCache #2961), so its storage "
    "plugin calls carry none"
)
"""Why ``namespace: lora`` is refused (the message names the key and this)."""

GAUGE_COUNTERS = frozenset({"puts_in_flight", "pinned_keys", "lookups_pinned"})
"""Of :meth:`UcmStorageBackend.stats`' ``lmcache`` counters, the levels (Prometheus gauges);
the others only grow."""

SALTS_KEPT = 4096
"""Distinct (model, world size, dtype, tags) salts memoised per plugin (least recently used
first out)."""

KV_DTYPES = ("fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "int8")
"""Values of ``storage_plugin.<name>.kv_dtype``: the logical format of a one-byte KV cache
(vLLM's ``--kv-cache-dtype`` names; ``fp8`` is ``fp8_e4m3``)."""

_FP8_ALIASES = {"fp8": "fp8_e4m3"}


def plugin_name(config: LMCacheEngineConfig) -> str:
    """The name under which ``config.storage_plugins`` lists this plugin (``ucm`` normally).

    LMCache builds a plugin without telling it its name; the name is the one whose
    ``storage_plugin.<name>.class_name`` / ``.module_path`` point at this class.
    """
    extra = config.extra_config or {}
    names = list(config.storage_plugins or [])
    ours = [
        name
        for name in names
        if extra.get(f"storage_plugin.{name}.class_name") == CLASS_NAME
        and extra.get(f"storage_plugin.{name}.module_path") == MODULE_PATH
    ]
    if DEFAULT_PLUGIN_NAME in ours or not ours:
        return DEFAULT_PLUGIN_NAME
    if len(ours) > 1:
        raise ConfigError(
            f"storage_plugins lists {ours}, all with class_name {CLASS_NAME!r}: LMCache does not "
            "tell a plugin its name, so give one UCM plugin per LMCache config"
        )
    return str(ours[0])


def save_only_first_rank(config: LMCacheEngineConfig, metadata: LMCacheMetadata) -> bool:
    """LMCache's own rule (token_database.py): MLA KV is saved by the first rank only, under keys
    whose world size is 1."""
    return bool(
        config.get_extra_config_value("save_only_first_rank", metadata.use_mla) and metadata.use_mla
    )


@dataclass(frozen=True)
class ChunkLayout:
    """What one full LMCache chunk of one worker looks like in memory."""

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    fmt: MemoryFormat
    geometry: EngineGeometry

    @property
    def shard_size(self) -> int:
        return self.geometry.shard_size

    def describe(self) -> str:
        return _describe(self.fmt, self.shapes, self.dtypes)


def _describe(
    fmt: MemoryFormat, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype]
) -> str:
    groups = ", ".join(f"{list(s)} {d}" for s, d in zip(shapes, dtypes, strict=True))
    return f"{fmt.name} {groups}"


def chunk_layout(config: LMCacheEngineConfig, metadata: LMCacheMetadata) -> ChunkLayout:
    """The shard geometry of one full chunk, from LMCache's metadata (shapes, dtypes, chunk size)
    and world size."""
    if config.use_layerwise:
        raise ConfigError(
            f"use_layerwise: {config.use_layerwise!r} is not supported by {CLASS_NAME}: it "
            "stores whole chunks (all layers of a chunk in one shard); set use_layerwise: false"
        )
    chunk_tokens = int(config.chunk_size)
    shapes = tuple(torch.Size(shape) for shape in metadata.get_shapes(chunk_tokens))
    dtypes = tuple(metadata.get_dtypes())
    if len(dtypes) == 1 and len(shapes) > 1:
        dtypes = dtypes * len(shapes)
    fmt = MemoryFormat.KV_MLA_FMT if metadata.use_mla else MemoryFormat.KV_2LTD
    sizes = tuple(
        int(shape.numel()) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)
    )
    shards = 1 if save_only_first_rank(config, metadata) else int(metadata.world_size)
    description = (
        f"one LMCache chunk of {chunk_tokens} tokens per worker, "
        f"{_describe(fmt, shapes, dtypes)}; "
        f"{shards} worker shard(s) per chunk"
    )
    return ChunkLayout(
        shapes=shapes,
        dtypes=dtypes,
        fmt=fmt,
        geometry=EngineGeometry(
            tensor_sizes=sizes, shards_per_block=shards, description=description
        ),
    )


def kv_format(config: LMCacheEngineConfig, layout: ChunkLayout, name: str) -> str | None:
    """The logical format of a one-byte KV cache (None for wider dtypes, which name themselves).

    LMCache's metadata and keys give ``torch.uint8`` for both fp8 formats (vLLM's
    ``get_kv_cache_torch_dtype``), so the format must be stated as ``storage_plugin.<name>.
    kv_dtype``. When the plugin runs inside a vLLM process whose config is current, vLLM's
    ``cache_dtype`` is checked against it. Also refuses a LoRA-enabled vLLM: LMCache's keys carry
    no adapter, so adapter A's KV would be served to adapter B.
    """
    key = f"extra_config['storage_plugin.{name}.kv_dtype']"
    stated = (config.extra_config or {}).get(f"storage_plugin.{name}.kv_dtype")
    stated = _FP8_ALIASES.get(stated, stated) if isinstance(stated, str) else stated
    if stated is not None and stated not in KV_DTYPES:
        raise ConfigError(f"{key}={stated!r}: expected one of {list(KV_DTYPES)}")
    vllm_config = _current_vllm_config()
    engine: str | None = None
    if vllm_config is not None:
        if getattr(vllm_config, "lora_config", None) is not None:
            raise ConfigError(
                f"{CLASS_NAME}: vLLM runs with LoRA enabled, and LMCache 0.5.6's chunk keys carry "
                "no LoRA adapter (LMCache #2961): one adapter's KV would be served to another. "
                "Use UCM's own vLLM connector (ucm.integration.vllm), whose keys carry the "
                "adapter, or serve without LoRA"
            )
        engine = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
        engine = _FP8_ALIASES.get(engine, engine)
    one_byte = [
        dtype for dtype in layout.dtypes if dtype.itemsize == 1 and not dtype.is_floating_point
    ]
    if not one_byte:
        return None
    if engine is not None and engine != "auto" and stated is not None and engine != stated:
        raise ConfigError(
            f"{key}={stated!r}, but vLLM runs with kv_cache_dtype {engine!r}: make them match"
        )
    if stated is None:
        raise ConfigError(
            f"{key} is missing: LMCache hands UCM this KV cache as {one_byte[0]}, the storage "
            "dtype of every fp8 format, so chunks of fp8_e4m3 and fp8_e5m2 would share ids; "
            f"state the format ({', '.join(repr(d) for d in KV_DTYPES)}; vLLM's "
            "--kv-cache-dtype)"
        )
    return str(stated)


def _current_vllm_config() -> Any | None:
    """vLLM's current config when this process is a vLLM process that set one (never imports
    vLLM)."""
    module = sys.modules.get("vllm.config")
    getter = getattr(module, "get_current_vllm_config_or_none", None)
    if getter is None:
        return None
    try:
        return getter()
    except Exception:
        return None


@dataclass
class _Put:
    key: CacheEngineKey
    ucm_key: UcmKey
    namespace: str
    obj: MemoryObj | None
    """None once a staged put copied it and dropped this plugin's reference."""
    future: Future[bool]


def _runs(spaces: Sequence[str]) -> Iterator[tuple[str, int, int]]:
    """(namespace, start, end) of each run of equal consecutive namespaces."""
    start = 0
    for index in range(1, len(spaces) + 1):
        if index == len(spaces) or spaces[index] != spaces[start]:
            yield spaces[start], start, index
            start = index


def _grouped(items: Iterable[T], space_of: Callable[[T], str]) -> dict[str, list[T]]:
    """``items`` by namespace, each namespace's in order (namespaces in order of first use)."""
    groups: dict[str, list[T]] = {}
    for item in items:
        groups.setdefault(space_of(item), []).append(item)
    return groups


@dataclass
class _PutBatch:
    task: Any
    puts: list[_Put]
    on_complete: Any
    slots: StagingSlots | None = None
    """A staged batch's staging slots (``staging``), given back once its dump is over."""
    staging: list[int] | None = None


class UcmStorageBackend(StoragePluginInterface):  # type: ignore[misc]
    """LMCache storage plugin over a UCM stack. See the module docstring and docs/lmcache.md."""

    def __init__(
        self,
        dst_device: str = "cpu",
        config: LMCacheEngineConfig | None = None,
        metadata: LMCacheMetadata | None = None,
        local_cpu_backend: LocalCPUBackend | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(
            dst_device=dst_device,
            config=config,
            metadata=metadata,
            local_cpu_backend=local_cpu_backend,
            loop=loop,
        )
        if config is None or metadata is None:
            raise ConfigError(
                f"{CLASS_NAME} needs LMCache's config and metadata (LMCache passes both when it "
                "builds a storage plugin listed in storage_plugins)"
            )
        self.name = plugin_name(config)
        self.stack_key = f"storage_plugin.{self.name}.stack"
        self.layout = chunk_layout(config, metadata)
        self.chunk_tokens = int(config.chunk_size)
        stack = engine_stack(
            (config.extra_config or {}).get(self.stack_key),
            self.layout.geometry,
            key=f"extra_config[{self.stack_key!r}]",
            engine="LMCache",
        )
        namespace_key = f"extra_config['storage_plugin.{self.name}.namespace']"
        self.tenants = TenantMapping.parse(
            (config.extra_config or {}).get(f"storage_plugin.{self.name}.namespace"),
            namespace_key,
            tags=True,
        )
        if self.tenants.mode == "lora":
            raise ConfigError(
                f"{namespace_key}='lora' is not available with LMCache's storage plugin: "
                f"{LORA_REFUSED}. Use cache_salt (the request tag lmcache.tag.cache_salt), "
                "tag:<name> (the request tag lmcache.tag.<name>) or fixed:<name>"
            )
        namespace = self.tenants.fixed if self.tenants.mode == "fixed" else DEFAULT_NAMESPACE
        deadline_key = f"storage_plugin.{self.name}.load_deadline_s"
        load_deadline_s = check_load_deadline_s(
            (config.extra_config or {}).get(deadline_key, LOAD_DEADLINE_S_DEFAULT),
            f"extra_config[{deadline_key!r}]",
        )
        port_key = f"extra_config['storage_plugin.{self.name}.metrics_port']"
        port = check_metrics_port(
            (config.extra_config or {}).get(f"storage_plugin.{self.name}.metrics_port"), port_key
        )
        self.is_scheduler = metadata.role == "scheduler"
        device_id = -1 if self.is_scheduler else int(metadata.local_worker_id)
        if not self.is_scheduler and local_cpu_backend is None:
            raise ConfigError(
                f"{CLASS_NAME} retrieves into memory from LMCache's LocalCPUBackend, and this "
                "worker has none: set max_local_cpu_size > 0 (local_cpu may stay false: LMCache "
                "then uses it as the allocator only)"
            )
        # Every check that can refuse the config runs before anything is opened: LMCache's
        # storage_plugin_launcher logs a constructor's error and runs on without the plugin,
        # and nothing would close a store or an endpoint opened before the refusal.
        self._space = (
            f"{self.layout.describe()}; use_mla={metadata.use_mla}; "
            f"save_only_first_rank={save_only_first_rank(config, metadata)}"
        )
        self.kv_format = kv_format(config, self.layout, self.name)
        self._salts = functools.lru_cache(maxsize=SALTS_KEPT)(self._compute_salt)
        self._tag_namespaces = functools.lru_cache(maxsize=SALTS_KEPT)(self._tag_namespace)
        self._counters: Counter[str] = Counter()
        self._counters_lock = threading.Lock()
        # Puts: keys being written (an unstaged put's MemoryObj holds this plugin's reference
        # meanwhile; a staged put's chunk is in UCM's staging slots).
        self._put_lock = threading.Condition()
        self._loads_running = 0
        """Gets between their first allocation and their return (guarded by ``_put_lock``):
        each may still write a MemoryObj of LMCache's."""
        self._in_flight: set[CacheEngineKey] = set()
        self._puts_max = _puts_max(local_cpu_backend, config, self.layout.shard_size)
        """Most puts in flight at once (:data:`PUT_MEMORY_SHARE` of LMCache's CPU memory)."""
        self._stage_puts = False
        """Puts are staged (see :meth:`batched_submit_put_task`): no CacheBuffer, or one
        that writes back."""
        self._put_slots: StagingSlots | None = None
        """Staged puts' copies of their chunks: ``_puts_max`` slots."""
        self._completions: queue.Queue[_PutBatch | None] = queue.Queue()
        self._completer = threading.Thread(
            target=self._complete_puts, name="ucm-lmcache-puts", daemon=True
        )
        # Pins: LMCache's lookup pins (and explicit pin()), counted per key.
        self._pin_lock = threading.Lock()
        # key -> one Store pin per pin of the key (the shards it holds in the CacheBuffer).
        self._pins: dict[CacheEngineKey, list[Pin]] = {}
        # lookup id -> (when it pinned, the keys): released by that lookup's prefetch, or,
        # for a prefetch that never runs, once older than lookup_pin_ttl_s or beyond
        # lookup_pins_max lookups (oldest first).
        self._lookup_pins: dict[str, tuple[float, list[CacheEngineKey]]] = {}
        self.lookup_pin_ttl_s = LOOKUP_PIN_TTL_S
        self.lookup_pins_max = LOOKUP_PINS_MAX
        self._closed = False
        self._warned: set[str] = set()
        self._metrics_server: MetricsServer | None = None
        # Async lookups and prefetches run here, off LMCache's event loop (threads start with
        # the first task).
        self._executor = ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="ucm-lmcache", initializer=enter_thread
        )
        try:
            self.store: Store = open_store(
                stack,
                device_id=device_id,
                local_rank_size=int(metadata.local_world_size),
                namespace=namespace,
            )
        except UcmError as exc:  # e.g. a buffer larger than /dev/shm: say which key to change
            raise ConfigError(f"extra_config[{self.stack_key!r}]: {exc}") from exc
        try:
            self._loads = BoundedLoads(self.store, load_deadline_s)
            buffer = self.store.buffer
            self._stage_puts = not self.is_scheduler and (buffer is None or buffer.writes_back)
            if self._stage_puts:  # address space only, until a slot is first written
                self._put_slots = StagingSlots.reserve(
                    self.store.layout,
                    self._puts_max,
                    "LMCache chunks allowed in flight",
                    "a put that finds every slot taken fails",
                )
            self._completer.start()
            if local_cpu_backend is not None and not self.is_scheduler:
                _finish_lmcache_use_before_close(local_cpu_backend, self)
            nodes = max(1, int(metadata.world_size) // max(1, int(metadata.local_world_size)))
            warn_node_local("LMCache", nodes, self.layout.geometry.shards_per_block, stack)
            # Last: a scrape reads every counter and lock above (a port in use raises here).
            if port is not None and not self.is_scheduler:
                counters = CountersCollector(
                    "lmcache", stack.unique_id, self._plugin_counters, GAUGE_COUNTERS
                )
                self._metrics_server = serve_rank_metrics(
                    self.store, port, device_id, port_key, f"LMCache worker {device_id}", counters
                )
        except BaseException:
            self._close_opened()
            raise

    def __str__(self) -> str:
        return CLASS_NAME

    # ---- keys ---------------------------------------------------------------------------------

    def ucm_key(self, key: CacheEngineKey) -> UcmKey:
        """The (block id, shard index) that holds ``key``'s chunk of KV for its worker."""
        shards = self.layout.geometry.shards_per_block
        if int(key.world_size) != shards:
            raise InvalidArgumentError(
                f"key {key.to_string()}: world size {key.world_size}, but this LMCache worker "
                f"stores {shards} worker shard(s) per chunk (its metadata's world size, or 1 "
                "with MLA's save_only_first_rank)"
            )
        shard = int(key.worker_id) if shards > 1 else 0
        if not 0 <= shard < shards:
            raise InvalidArgumentError(
                f"key {key.to_string()}: worker id {key.worker_id} is not in [0, {shards})"
            )
        return named_block_id(self._salt(key), int(key.chunk_hash)), shard

    def namespace_of(self, key: CacheEngineKey) -> str:
        """The UCM namespace of ``key``'s chunk: from its request tag (``cache_salt`` mode: the
        tag ``cache_salt``; ``tag:<name>``: the tag ``<name>``; none: the default namespace),
        or the fixed one."""
        if self.tenants.tag_name is None:
            return self.store.namespace
        return self._tag_namespaces(key.tags)

    def _tag_namespace(self, tags: tuple[tuple[Any, Any], ...] | None) -> str:
        wanted = self.tenants.tag_name
        value = next((str(v) for k, v in tags or () if str(k) == wanted), None)
        return self.tenants.namespace(cache_salt=value)

    def _salt(self, key: CacheEngineKey) -> bytes:
        tags = tuple(tuple(map(str, tag)) for tag in key.tags) if key.tags else ()
        return self._salts(str(key.model_name), int(key.world_size), str(key.dtype), tags)

    def _compute_salt(
        self, model: str, world_size: int, dtype: str, tags: tuple[tuple[str, ...], ...]
    ) -> bytes:
        space = KeySpace(
            engine="lmcache",
            model=model,
            # The logical format of a one-byte KV cache: LMCache's key says uint8 for every fp8.
            dtype=f"{dtype}/{self.kv_format}" if self.kv_format else dtype,
            block_tokens=self.chunk_tokens,
            kv_layout=self._space,
            tp_size=world_size,
        )
        cache_salt = json.dumps([list(tag) for tag in tags]) if tags else None
        return space.salt(cache_salt)

    # ---- lookups ------------------------------------------------------------------------------

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        return self._prefix([key], pin, None) == 1

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """How many of ``keys``, from the first, UCM holds (LMCache's prefix match)."""
        return self._prefix(list(keys), pin, None)

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        """``batched_contains`` off LMCache's event loop; pins taken here for ``lookup_id`` are
        released when ``batched_get_non_blocking`` for that lookup has loaded the keys."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._prefix, list(keys), pin, lookup_id)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._put_lock:
            return key in self._in_flight

    def _prefix(self, keys: list[CacheEngineKey], pin: bool, lookup_id: str | None) -> int:
        if not keys:
            return 0
        blocks = [self.ucm_key(key)[0] for key in keys]
        spaces = [self.namespace_of(key) for key in keys]
        holds: list[Pin] = []
        hits = 0
        try:
            for namespace, start, end in _runs(spaces):  # one run unless tenants mix
                run = blocks[start:end]
                # Pinned before the look-up: what the buffer holds then cannot be evicted after.
                if pin:
                    holds.extend(self.store.pin(run, namespace=namespace))
                found = self.store.lookup_on_prefix(run, namespace=namespace) + 1
                hits += found
                if found < len(run):
                    break
        except BaseException:
            self.store.unpin(holds)
            raise
        self.store.unpin(holds[hits:])
        self._count("lookups")
        self._count("lookup_keys", len(keys))
        self._count("lookup_hits", hits)
        if pin and hits:
            expired: list[CacheEngineKey] = []
            with self._pin_lock:
                for key, hold in zip(keys[:hits], holds[:hits], strict=True):
                    self._pins.setdefault(key, []).append(hold)
                if lookup_id is not None:
                    _, earlier = self._lookup_pins.pop(lookup_id, (0.0, []))
                    self._lookup_pins[lookup_id] = (time.monotonic(), [*earlier, *keys[:hits]])
                    expired = self._expire_lookup_pins()
            for key in expired:
                self.unpin(key)
        return hits

    def _expire_lookup_pins(self) -> list[CacheEngineKey]:
        """Drops the lookups whose prefetch never came (older than ``lookup_pin_ttl_s``, or
        the oldest beyond ``lookup_pins_max``); returns their keys, to unpin. Pin lock held."""
        deadline = time.monotonic() - self.lookup_pin_ttl_s
        keys: list[CacheEngineKey] = []
        expired = 0
        for lookup_id in list(self._lookup_pins):  # oldest first (insertion order)
            pinned_at, pinned = self._lookup_pins[lookup_id]
            if pinned_at > deadline and len(self._lookup_pins) <= self.lookup_pins_max:
                break
            del self._lookup_pins[lookup_id]
            keys.extend(pinned)
            expired += 1
        if expired:
            self._count("lookup_pins_expired", expired)
            logger.warning(
                "UCM released the pins of %d LMCache lookup(s) whose prefetch never came "
                "(older than %.0f s, or beyond %d lookups pinned at once)",
                expired,
                self.lookup_pin_ttl_s,
                self.lookup_pins_max,
            )
        return keys

    # ---- pins ---------------------------------------------------------------------------------

    def pin(self, key: CacheEngineKey) -> bool:
        """Holds ``key``'s chunk: every worker's shard of it that is in the CacheBuffer stays
        there (no eviction, on any rank of the node) and ``remove``/``batched_remove`` without
        ``force`` keep it, until :meth:`unpin`. False if absent."""
        return self._prefix([key], True, None) == 1

    def unpin(self, key: CacheEngineKey) -> bool:
        """Releases one pin of ``key``; False if it had none."""
        with self._pin_lock:
            holds = self._pins.get(key)
            if not holds:
                return False
            hold = holds.pop()
            if not holds:
                del self._pins[key]
        self.store.unpin([hold])
        return True

    def pinned(self, key: CacheEngineKey) -> int:
        """How many pins ``key`` holds (0 when none)."""
        with self._pin_lock:
            return len(self._pins.get(key, ()))

    def held_shards(self, key: CacheEngineKey) -> int:
        """How many shards of ``key``'s chunk its newest pin holds in the CacheBuffer (0 when
        it has no pin, or the chunk is below the buffer only)."""
        with self._pin_lock:
            holds = self._pins.get(key)
            return holds[-1].held if holds else 0

    # ---- puts ---------------------------------------------------------------------------------

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Any = None,
    ) -> list[Future[bool]] | None:
        """Starts writing the chunks to UCM; returns one future per chunk written (True once it
        is stored, False if UCM failed it), or None when there was nothing to write.

        Each object written gets a reference of its own here (ref_count_up): LMCache's
        batched_put drops its reference as soon as this returns. Over a CacheBuffer whose tiers
        write through, the dump reads the object until the buffer has it, and the reference is
        dropped then. Otherwise (no CacheBuffer, or one that writes back, where a dump may
        wait on a tier) the put is *staged*: the chunk is copied into UCM's staging slots
        before this returns, the reference dropped, and the dump reads only the copy. A tier
        that holds the write then holds no memory of LMCache's, and nothing reads that memory
        after LMCache freed it (its close frees its CPU memory before it closes this plugin)."""
        self._check_worker("put")
        if len(keys) != len(objs):
            raise InvalidArgumentError(
                f"keys has {len(keys)} entries but objs has {len(objs)}: one object per key"
            )
        puts: list[_Put] = []
        batches: list[_PutBatch] = []  # one per namespace (one unless tenants mix)
        handled: set[int] = set()  # ids of the puts released or in a batch
        try:
            with self._put_lock:
                for key, obj in zip(keys, objs, strict=True):
                    if key in self._in_flight:
                        continue  # already being written
                    if not self._writable(obj):
                        continue
                    if len(self._in_flight) >= self._puts_max:
                        self._skip(
                            "put_skipped_memory",
                            f"a chunk while {self._puts_max} puts are being written (half of "
                            "LMCache's CPU memory: a tier that does not keep up must not hold "
                            "the memory a retrieve waits for)",
                        )
                        continue
                    ucm_key = self.ucm_key(key)
                    namespace = self.namespace_of(key)
                    obj.ref_count_up()
                    self._in_flight.add(key)
                    puts.append(_Put(key, ucm_key, namespace, obj, Future()))
            for namespace, group in _grouped(puts, lambda put: put.namespace).items():
                present = self.store.lookup([put.ucm_key[0] for put in group], namespace=namespace)
                already = [put for put, hit in zip(group, present, strict=True) if hit]
                group = [put for put, hit in zip(group, present, strict=True) if not hit]
                self._release(already, stored=None)
                handled.update(id(put) for put in already)
                self._count("put_chunks_present", len(already))
                if group:
                    batches.append(self._submit_puts(group, namespace, on_complete_callback))
                    handled.update(id(put) for put in group)
        except Exception:
            left = [put for put in puts if id(put) not in handled]
            self._release(left, stored=False)
            logger.exception("UCM could not start writing %d LMCache chunk(s)", len(left))
        in_batches = {id(put) for batch in batches for put in batch.puts}
        submitted = [put for put in puts if id(put) in in_batches]
        if not submitted:
            return None
        self._count("put_chunks_submitted", len(submitted))
        for batch in batches:
            self._completions.put(batch)
        return [put.future for put in submitted]

    def _submit_puts(self, group: list[_Put], namespace: str, on_complete: Any) -> _PutBatch:
        """Submits the dump of one namespace's puts, staged or not (see
        :meth:`batched_submit_put_task`)."""
        ids = [put.ucm_key[0] for put in group]
        shards = [put.ucm_key[1] for put in group]
        objs = [put.obj for put in group]
        assert all(obj is not None for obj in objs)  # each holds this plugin's reference
        sources = [self._pointers(obj) for obj in objs if obj is not None]
        if not self._stage_puts:
            task = self.store.dump_data(ids, shards, sources, namespace=namespace)
            return _PutBatch(task=task, puts=group, on_complete=on_complete)
        slots = self._put_slots
        assert slots is not None
        staging = slots.take(len(group))
        if staging is None:  # only past a refused reservation: puts in flight never exceed it
            raise UcmError(
                f"UCM's staging memory for puts holds {slots.capacity} chunks, all in flight"
            )
        try:
            addresses = slots.copy_in(staging, sources)
            for put in group:  # LMCache's memory is read no more
                if put.obj is not None:
                    put.obj.ref_count_down()
                    put.obj = None
            task = self.store.dump_data(ids, shards, addresses, namespace=namespace)
        except BaseException:
            slots.give_back(staging)
            raise
        return _PutBatch(task, group, on_complete, slots, staging)

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Blocks until every put submitted so far is written, to the stack's top tier and to
        every ``write: through`` tier below it; False if ``timeout_s`` ran out first."""
        if not self._wait_puts(timeout_s):
            return False
        if not self.is_scheduler:
            self.store.drain()
        return True

    def _wait_puts(self, timeout_s: float) -> bool:
        """Blocks until no put is in flight (each written to the stack's top tier, or
        failed); False if ``timeout_s`` ran out first."""
        with self._put_lock:
            return self._put_lock.wait_for(lambda: not self._in_flight, timeout_s)

    def _before_lmcache_frees(self) -> bool:
        """Runs before LocalCPUBackend's close frees LMCache's CPU memory (see
        :func:`_finish_lmcache_use_before_close`). Waits for the gets running, which may still
        write a MemoryObj (``load_deadline_s`` plus the stack's ``queue_timeout_s`` at most),
        and for the puts whose dumps still read one (``queue_timeout_s`` at most). A staged
        put read its chunk before its submit returned, so only unstaged puts (over a
        CacheBuffer that writes through) are waited for, until the buffer has their bytes.
        False if a get or an unstaged put is still running past those bounds: the memory must
        then not be freed."""
        timeout_s = self.store.settings.queue_timeout_s
        loads_timeout_s = self._loads.deadline_s + timeout_s
        with self._put_lock:
            self._put_lock.wait_for(lambda: not self._loads_running, loads_timeout_s)
            loads = self._loads_running
        if loads:
            logger.error(
                "UCM: %d LMCache get(s) still running after %g s when LMCache frees its CPU memory",
                loads,
                loads_timeout_s,
            )
        if self._stage_puts or self._wait_puts(timeout_s):
            return not loads
        with self._put_lock:
            left = len(self._in_flight)
        logger.error(
            "UCM: %d LMCache chunk(s) still being copied into the CacheBuffer after %g s "
            "(queue_timeout_s) when LMCache frees its CPU memory",
            left,
            timeout_s,
        )
        return False

    def _writable(self, obj: MemoryObj) -> bool:
        """Only full chunks in host memory fit a shard; anything else stays in LMCache's other
        backends (a partial chunk exists only with save_unfull_chunk)."""
        tensor = obj.raw_tensor
        if tensor is None or tensor.device.type != "cpu":
            self._skip("put_skipped_not_host", "a MemoryObj that is not in host memory")
            return False
        if int(obj.get_size()) != self.layout.shard_size:
            self._skip(
                "put_skipped_partial_chunks",
                f"a MemoryObj of {obj.get_size()} bytes (a full chunk is "
                f"{self.layout.shard_size}: {self.layout.describe()})",
            )
            return False
        return True

    def _pointers(self, obj: MemoryObj) -> list[int]:
        address = int(obj.data_ptr)
        pointers = []
        for size in self.layout.geometry.tensor_sizes:
            pointers.append(address)
            address += size
        return pointers

    def _complete_puts(self) -> None:
        enter_thread()
        while True:
            batch = self._completions.get()
            if batch is None:
                return
            failed: dict[UcmKey, Any] = {}
            try:
                self.store.wait(batch.task)
            except TaskError as exc:
                failed = dict(exc.failures)
            except Exception as exc:
                failed = {put.ucm_key: exc for put in batch.puts}
            if batch.slots is not None and batch.staging is not None:
                batch.slots.give_back(batch.staging)
            if failed:
                cause = next(iter(failed.values()))
                logger.warning(
                    "UCM failed to store %d of %d LMCache chunk(s) (they stay in LMCache's "
                    "other backends only), e.g. %s",
                    len(failed),
                    len(batch.puts),
                    cause,
                )
            stored = [put for put in batch.puts if put.ucm_key not in failed]
            self._count("put_chunks_stored", len(stored))
            self._count("put_chunks_failed", len(failed))
            if batch.on_complete is not None:  # before the release: flush() implies them
                for put in stored:
                    try:
                        batch.on_complete(put.key)
                    except Exception:
                        logger.exception("on_complete_callback failed for %s", put.key)
            self._release([put for put in batch.puts if put.ucm_key in failed], stored=False)
            self._release(stored, stored=True)

    def _release(self, puts: Sequence[_Put], stored: bool | None) -> None:
        """Drops this plugin's reference on each object (unless a staged put dropped it) and
        forgets the put."""
        for put in puts:
            if put.obj is not None:
                put.obj.ref_count_down()
                put.obj = None
        with self._put_lock:
            for put in puts:
                self._in_flight.discard(put.key)
            self._put_lock.notify_all()
        for put in puts:
            put.future.set_result(bool(stored))

    # ---- gets ---------------------------------------------------------------------------------

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        return self._load([key], busy_loop=True)[0]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """One UCM load task for all keys; None where UCM misses (or memory ran out)."""
        return self._load(list(keys), busy_loop=True)

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        """Prefetch (LMCache's async loading): the loaded prefix of ``keys``. Never raises
        (LMCache answers the scheduler from this result): a failure is an empty prefix, and the
        lookup's pins are released either way."""
        try:
            loop = asyncio.get_running_loop()
            objs = await loop.run_in_executor(self._executor, self._load, list(keys), False)
        except Exception as exc:  # e.g. the plugin closed under the prefetch
            self._count("get_misses", len(keys))
            self._count("get_errors", len(keys))
            logger.warning(
                "UCM could not prefetch %d LMCache chunk(s) for lookup %s, answering misses: "
                "%s: %s",
                len(keys),
                lookup_id,
                type(exc).__name__,
                exc,
            )
            objs = []
        finally:
            self._release_lookup_pins(lookup_id, keys)
        loaded: list[MemoryObj] = []
        for obj in objs:
            if obj is None:
                break
            loaded.append(obj)
        for obj in objs[len(loaded) :]:
            if obj is not None:
                obj.ref_count_down()  # past a hole: LMCache uses prefixes only
        return loaded

    def _load(self, keys: list[CacheEngineKey], busy_loop: bool) -> list[MemoryObj | None]:
        """One UCM load for ``keys``: an object per hit, None per miss. Never raises once the
        role is checked: any failure (a load queue full past ``queue_timeout_s``, a closed
        store, an error of UCM's or of LMCache's allocator) is a miss for the keys it hit,
        and every object allocated for them is freed (LMCache recomputes misses)."""
        self._check_worker("get")
        allocated: list[MemoryObj] = []
        with self._put_lock:
            self._loads_running += 1
        try:
            return self._load_into(keys, busy_loop, allocated)
        except Exception as exc:
            for obj in allocated:
                obj.ref_count_down()  # frees the allocation
            self._count("get_misses", len(keys))
            self._count("get_errors", len(keys))
            logger.warning(
                "UCM could not load %d LMCache chunk(s), answering misses: %s: %s",
                len(keys),
                type(exc).__name__,
                exc,
            )
            return [None] * len(keys)
        finally:
            with self._put_lock:
                self._loads_running -= 1
                self._put_lock.notify_all()

    def _load_into(
        self, keys: list[CacheEngineKey], busy_loop: bool, allocated: list[MemoryObj]
    ) -> list[MemoryObj | None]:
        """The body of :meth:`_load`; each allocation is appended to ``allocated`` as soon as
        it is made, so that the caller can free them all when anything raises."""
        allocator = self.local_cpu_backend
        assert allocator is not None
        ucm_keys = [self.ucm_key(key) for key in keys]
        spaces = [self.namespace_of(key) for key in keys]
        results: list[MemoryObj | None] = [None] * len(keys)
        first: dict[tuple[str, UcmKey], int] = {}
        duplicates: list[tuple[int, int]] = []
        chosen: list[int] = []
        chosen_keys: list[UcmKey] = []
        for index, ucm_key in enumerate(ucm_keys):
            if (spaces[index], ucm_key) in first:
                duplicates.append((index, first[spaces[index], ucm_key]))
                continue
            obj = allocator.allocate(
                list(self.layout.shapes),
                list(self.layout.dtypes),
                fmt=self.layout.fmt,
                busy_loop=busy_loop,
            )
            if obj is None:
                logger.warning(
                    "LMCache's local CPU memory is full: %d of %d chunk(s) not retrieved from UCM",
                    len(keys) - index,
                    len(keys),
                )
                break
            allocated.append(obj)
            first[spaces[index], ucm_key] = index
            chosen.append(index)
            chosen_keys.append(ucm_key)
        failed = self._load_chosen(
            [spaces[index] for index in chosen], chosen_keys, [self._pointers(o) for o in allocated]
        )
        for index, ucm_key, obj in zip(chosen, chosen_keys, allocated, strict=True):
            if (spaces[index], ucm_key) in failed:
                obj.ref_count_down()  # frees the allocation
            else:
                results[index] = obj
        allocated.clear()  # from here on every object is the caller's (or freed above)
        for index, source in duplicates:  # the same chunk twice: one object, two references
            original = results[source]
            if original is not None:
                original.ref_count_up()
                results[index] = original
        hits = sum(1 for obj in results if obj is not None)
        self._count("get_hits", hits)
        self._count("get_misses", len(keys) - hits)
        # A failure other than a miss (a corrupt or unreadable shard) is a miss to LMCache too.
        self._count(
            "get_errors",
            sum(1 for c in failed.values() if not isinstance(c, KeyMissingError | LateLoadError)),
        )
        self._count("get_late", sum(1 for c in failed.values() if isinstance(c, LateLoadError)))
        return results

    def _load_chosen(
        self, spaces: list[str], ucm_keys: list[UcmKey], pointers: list[list[int]]
    ) -> dict[tuple[str, UcmKey], Any]:
        """One bounded UCM load per namespace (one unless tenants mix), all within one load
        deadline; nothing is written into ``pointers`` once it returned. Returns each failed
        key's cause (a :class:`~ucm.integration.bounded.LateLoadError` for one that missed the
        deadline)."""
        failed: dict[tuple[str, UcmKey], Any] = {}
        deadline = time.monotonic() + self._loads.deadline_s
        for namespace, group in _grouped(range(len(ucm_keys)), spaces.__getitem__).items():
            self._count("loads")
            causes = self._loads.load(
                [ucm_keys[i][0] for i in group],
                [ucm_keys[i][1] for i in group],
                [pointers[i] for i in group],
                namespace=namespace,
                deadline=deadline,
            )
            for i in group:
                cause = causes.get(ucm_keys[i][0])
                if cause is not None:
                    failed[namespace, ucm_keys[i]] = cause
        return failed

    def _release_lookup_pins(self, lookup_id: str, keys: Sequence[CacheEngineKey]) -> None:
        with self._pin_lock:
            _, pinned = self._lookup_pins.pop(lookup_id, (0.0, []))
        if not pinned:
            return
        # Keys this lookup pinned but did not fetch (a tail LMCache rounded off) are unpinned
        # by LMCache itself.
        wanted = set(keys)
        for key in pinned:
            if key in wanted:
                self.unpin(key)

    # ---- removal ------------------------------------------------------------------------------

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self.batched_remove([key], force=force) == 1

    def batched_remove(self, keys: list[CacheEngineKey], force: bool = True) -> int:
        """Removes the keys' chunks (every worker's shard of each) from every UCM tier,
        REMOVE_CHUNK_KEYS keys per lock acquisition (seed 003); pinned keys are kept unless
        ``force`` (which drops their pins). Returns how many of the chunks UCM held (every
        worker's shard present) are gone."""
        unique = list(dict.fromkeys(keys))
        removed = 0
        for start in range(0, len(unique), REMOVE_CHUNK_KEYS):
            part = unique[start : start + REMOVE_CHUNK_KEYS]
            with self._pin_lock:
                self._count("remove_lock_acquisitions")
                if force:
                    dropped = [hold for key in part for hold in self._pins.pop(key, ())]
                    self.store.unpin(dropped)
                    chosen = part
                else:
                    chosen = [key for key in part if key not in self._pins]
                    self._count("remove_kept_pinned", len(part) - len(chosen))
                for namespace, group in _grouped(chosen, self.namespace_of).items():
                    removed += self._remove_chunks(group, namespace, force)
        self._count("removed_chunks", removed)
        return removed

    def _remove_chunks(self, keys: list[CacheEngineKey], namespace: str, force: bool) -> int:
        """Removes the chunks of ``keys`` (all in ``namespace``); how many were held and are
        gone."""
        blocks = list(dict.fromkeys(self.ucm_key(key)[0] for key in keys))
        if self.layout.geometry.shards_per_block == 1:
            # One shard per chunk: the store's count of shards removed is the count.
            return self.store.remove(blocks, force=force, namespace=namespace)
        # A chunk of several workers' shards counts when it was complete and is gone.
        before = self.store.lookup(blocks, namespace=namespace)
        self.store.remove(blocks, force=force, namespace=namespace)
        after = self.store.lookup(blocks, namespace=namespace)
        gone = {
            block
            for block, was, still in zip(blocks, before, after, strict=True)
            if was and not still
        }
        return sum(1 for key in keys if self.ucm_key(key)[0] in gone)

    # ---- the rest of the interface ------------------------------------------------------------

    def get_allocator_backend(self) -> LocalCPUBackend:
        if self.local_cpu_backend is None:
            raise RoleError(
                f"{CLASS_NAME} on LMCache's scheduler has no allocator backend: the scheduler "
                "only answers lookups"
            )
        return self.local_cpu_backend

    def stats(self) -> dict[str, Any]:
        """This plugin's counters (``lmcache``) beside the store's (``ucm``)."""
        return {"lmcache": self._plugin_counters(), "ucm": self.store.stats()}

    @property
    def metrics_url(self) -> str | None:
        """Where this worker serves UCM's Prometheus metrics (``metrics_port``), or None."""
        return self._metrics_server.url if self._metrics_server is not None else None

    def _plugin_counters(self) -> dict[str, int]:
        with self._counters_lock:
            counters = dict(self._counters)
        with self._put_lock:
            counters["puts_in_flight"] = len(self._in_flight)
        with self._pin_lock:
            counters["pinned_keys"] = len(self._pins)
            counters["lookups_pinned"] = len(self._lookup_pins)
        return counters

    def close(self) -> None:
        """Finishes the puts in flight, waiting the stack's ``queue_timeout_s`` at most, then
        closes the store (which finishes its own write-through work: nothing acknowledged is
        lost on a clean close). Puts a tier still holds then are left running (staged: they
        read UCM's copy, never LMCache's memory), and end when the tier answers."""
        if self._closed:
            return
        self._closed = True
        timeout_s = self.store.settings.queue_timeout_s
        flushed = self.flush(timeout_s)
        if not flushed:
            with self._put_lock:
                left = len(self._in_flight)
            logger.error(
                "UCM: %d LMCache chunk(s) still being written after %g s (queue_timeout_s) at "
                "close: their writes go on until the tier answers",
                left,
                timeout_s,
            )
        self._stop_completer(FLUSH_TIMEOUT_S if flushed else 0.0)
        self._executor.shutdown(wait=True)
        with self._pin_lock:  # the store's close releases what they hold
            self._pins.clear()
            self._lookup_pins.clear()
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        self.store.close()

    def _close_opened(self) -> None:
        """Closes what a failed constructor opened (the endpoint, the put completer, the store:
        its threads and its attachment to the buffer), logging what fails to close, so the
        constructor's own error is the one raised."""
        steps: list[tuple[str, Callable[[], None]]] = []
        if self._metrics_server is not None:
            steps.append(("the metrics endpoint", self._metrics_server.close))
        if self._completer.is_alive():
            steps.append(("the put completer", self._stop_completer))
        steps.append(("the executor", functools.partial(self._executor.shutdown, wait=True)))
        steps.append(("the store", self.store.close))
        for what, close in steps:
            try:
                close()
            except Exception:
                logger.exception("UCM: closing %s of a plugin that failed to start failed", what)
        self._metrics_server = None
        self._closed = True

    def _stop_completer(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Ends the put completer once it has completed the puts before (waiting
        ``timeout_s`` at most: 0 leaves it completing the puts a tier still holds)."""
        self._completions.put(None)
        self._completer.join(timeout=timeout_s)

    # ---- helpers ------------------------------------------------------------------------------

    def _check_worker(self, what: str) -> None:
        if self.is_scheduler:
            raise RoleError(
                f"{what} is not allowed on LMCache's scheduler ({CLASS_NAME} opened UCM with the "
                "scheduler role: lookups only)"
            )

    def _count(self, name: str, amount: int = 1) -> None:
        if amount:
            with self._counters_lock:
                self._counters[name] += amount

    def _skip(self, counter: str, what: str) -> None:
        self._count(counter)
        if counter not in self._warned:
            self._warned.add(counter)
            logger.warning(
                "%s does not store %s; such chunks stay in LMCache's other backends (logged once)",
                CLASS_NAME,
                what,
            )


def _finish_lmcache_use_before_close(local_cpu_backend: Any, plugin: UcmStorageBackend) -> None:
    """LMCache's ``StorageManager.close()`` closes its backends in the order it made them,
    LocalCPUBackend before the storage plugins, and LocalCPUBackend's close frees LMCache's
    CPU memory, which an unstaged put's dump may still be reading (a put submitted just
    before shutdown) and a get still reading from a tier may still write. Its ``close`` is
    wrapped, on this instance only, so that the plugin's puts and gets are done with that
    memory first (:meth:`UcmStorageBackend._before_lmcache_frees`). Should one still use it
    past that method's bounds (a tier that holds a write through), the close runs without
    freeing the memory, which then stays mapped until the process exits: a leak at shutdown
    rather than a write or read of freed memory. The wrapper holds the plugin weakly: it
    keeps no closed plugin alive."""
    close = local_cpu_backend.close
    plugin_ref = weakref.ref(plugin)

    def close_after_ucm() -> None:
        live = plugin_ref()
        if live is None or live._before_lmcache_frees():
            close()
        else:
            _close_keeping_memory(local_cpu_backend, close)

    local_cpu_backend.close = close_after_ucm


def _close_keeping_memory(local_cpu_backend: Any, close: Callable[[], None]) -> None:
    """Runs LocalCPUBackend's ``close`` with its memory allocator's ``close`` (the free)
    made a no-op on that allocator instance, for good: UCM still uses the memory."""
    allocator = getattr(local_cpu_backend, "memory_allocator", None)
    logger.error(
        "UCM: LMCache's CPU memory stays mapped until this process exits (%s): UCM still "
        "reads or writes it",
        type(allocator).__name__ if allocator is not None else "no allocator found, not closed",
    )
    if allocator is None:
        return
    allocator.close = lambda: None
    close()


def _puts_max(local_cpu_backend: Any, config: Any, shard_size: int) -> int:
    """:data:`PUT_MEMORY_SHARE` of LMCache's CPU memory, in chunks (at least one): the size of
    the worker's allocator, else ``max_local_cpu_size`` (GB, as LMCache reads it)."""
    size = getattr(getattr(local_cpu_backend, "memory_allocator", None), "size", None)
    if not isinstance(size, int) or size <= 0:
        size = int(float(getattr(config, "max_local_cpu_size", 0) or 0) * 1024**3)
    return max(1, int(size * PUT_MEMORY_SHARE) // shard_size)


__all__ = [
    "CLASS_NAME",
    "MODULE_PATH",
    "ChunkLayout",
    "UcmStorageBackend",
    "chunk_layout",
    "kv_format",
    "plugin_name",
    "save_only_first_rank",
]
