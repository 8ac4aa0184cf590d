"""The ``mooncake`` tier: a Mooncake Store pool, the DRAM pool many nodes share through one
``mooncake_master`` (``mooncake.store.MooncakeDistributedStore``; install ``ucm[mooncake]``).

Every process that opens this tier is a Mooncake client: it mounts ``global_segment_size`` bytes
of its own memory into the pool (its contribution; objects of any node may land there) and moves
shards with the transfer engine (``protocol: tcp`` or ``rdma``). The pool's data lives in the
segments its clients mount: when a node leaves (closes, or dies and the master's client TTL
runs out) the master drops every object held in its segment, and those blocks are plain misses
from then on, served from the tiers below.

Keys. One Mooncake object per shard, named ``<key_prefix>/<block id hex>/<shard index>``: keyed
by (block id, shard index) only, never ``unique_id``, so every node sees the same blocks.

Zero copy. Shards move between Mooncake and caller memory at their addresses
(``batch_get_into_multi_buffers`` / ``batch_put_from_multi_buffers``), no Python ``bytes`` in
between. The transfer engine wants that memory registered (``register_buffer``; with RDMA it
pins pages, so registering costs time) and refuses overlapping registrations. So: the
CacheBuffer's data plane, which the store announces through ``TierContext.options``
(``ucm.tier.HOST_MEMORY_OPTION``) and which stays mapped as long as the store is open, is
registered once at open; so are this tier's small per-thread header arenas. Memory outside
them (write-through snapshots, a caller's tensors in a stack without a buffer) is registered
for the duration of one call and released after it, reference-counted across concurrent calls.

Integrity. Each object is the shard envelope (``ucm.envelope``, 48 bytes: codec, shard size,
XXH3-64 of the shard, XXH3-64 of its key) followed by the shard; the header lands in the arena,
the shard straight in the destination. A load checks the envelope and the shard's checksum: an
object of another size or key, or whose bytes do not match (say a read racing a forced remove on
another node), is removed and fails with a TierError (not a miss), so the stack serves the
shard from below and repairs the pool. An object of the format before the envelope (``UCMK``)
is removed too and reads as a miss. An object of a later envelope version (``envelope.Newer``,
a newer UCM's, say during a rolling upgrade; whatever its size) is a miss that is never
removed, replaced by a dump or counted corrupt (``newer_kept`` counts them); the master's
eviction, not this node, ages it out. Mooncake's own protocol covers the rest: a read holds a
lease on the object (the master neither evicts nor removes it without ``force`` meanwhile) and
fails with ``LEASE_EXPIRED`` (retried here) if the lease ran out before the transfer ended.

Replacement. Mooncake's put keeps an existing object. A dump therefore reads the headers of the
keys first (one ranged read): an absent key is put, an identical one (same checksum) is left
alone, a newer UCM's (a later envelope version) is left alone too, and any other is removed
(``force``) and put again.

Leases. The master leases an object to every reader for ``default_kv_lease_ttl`` (10 s by
default): lookups, touches and loads. ``batched_remove`` without ``force`` keeps a leased key
(counted in ``leased_kept``); ``force`` removes it. Touch is a lookup: a fresh lease is what the
master's eviction ranks by, so a touched block is evicted last.

Master failure. A call that finds the master gone (``RPC_FAIL``) fails its keys with a
TierError (lookups answer "absent"), and so does every later call, at once, without asking
Mooncake (whose client would spend seconds reconnecting on each), until a TCP probe every
``master_retry_interval`` finds a master listening again; the client then re-mounts its segment
by itself and the tier serves again. A master without HA restarts empty: the pool's blocks are
misses, served from below.

Control records (reset epochs, ``Tier.read_control``): one object per record,
``<key_prefix>/control/<name hex>`` (``ucm.control``'s checksummed format), outside every block
and namespace key and every pattern a purge removes by, put with ``with_hard_pin`` so the
master's eviction never takes it. What Mooncake 0.3.13 cannot promise: an object lives in the
segments of the clients holding its replicas, and the master drops it when all of them leave
the pool (closed, or dead past the client TTL), pinned or not. A record lost that way reads as
"never raised" (Mooncake keeps nothing that would tell it apart from a fresh pool), so a stack
whose only tier below the buffer is mooncake keeps its epoch while the buffer or one of those
segments lives; give the stack a posix or fsspec tier too (their records are files) for an
epoch that survives every node leaving. A raise reads the record and upserts it when higher:
two processes raising one record at once may leave the lower value (one writer per record,
as vLLM's scheduler and each SGLang rank are, never does).

Eviction is the master's: when the pool fills it drops unleased objects, and a shard it dropped
is a plain miss, and nothing is written down on the way. The store feeds a ``write: back``
tier from the evictions of the tiers above it down to the first ``write: through`` one, so a
``write: back`` tier right below this one (no ``write: through`` tier between) would lose what
the pool evicts: that stack is refused.
"""

from __future__ import annotations

import bisect
import mmap
import os
import re
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

import ucm
from ucm import control, envelope, namespaces
from ucm.config import LowerTierConfig, Size
from ucm.errors import ConfigError, KeyMissingError, TierError
from ucm.fieldtypes import Int, Seconds
from ucm.layout import Key
from ucm.native.pybuffer import buffer_address
from ucm.tier import (
    HOST_MEMORY_OPTION,
    NAMESPACE_BYTES_OPTION,
    REMOVE_CHUNK_KEYS,
    Outcome,
    ShardViews,
    Tier,
    TierContext,
    chunks,
    scatter,
)

MOONCAKE_EXTRA = "mooncake"
MOONCAKE_DISTRIBUTION = "mooncake-transfer-engine-non-cuda"
INSTALL_HINT = f"pip install 'ucm[{MOONCAKE_EXTRA}]' (it brings {MOONCAKE_DISTRIBUTION})"

HEADER_BYTES = envelope.HEADER_BYTES
"""Bytes before the shard in every object."""
_SLOT_BYTES = 64
"""Stride of the header slots in an arena (cache-line sized)."""
BATCH_KEYS_MAX = 512
"""Keys per Mooncake call; a tier call with more is split (bounds the header arenas)."""
ARENA_BYTES = 2 * BATCH_KEYS_MAX * _SLOT_BYTES
"""One thread's header arena: BATCH_KEYS_MAX headers read and as many written, registered once."""
LEASE_RETRIES = 2
"""Extra attempts for keys whose read lease expired before their transfer completed."""
REGISTRATION_WAIT_S = 30.0
"""Longest a call waits for another call's registration of overlapping memory to end."""
LOOKUP_CHUNK_KEYS = 4096
SEGMENT_MIN_BYTES = 16 * 1024 * 1024
"""The smallest segment Mooncake mounts (its client buffer allocator's minimum)."""

# Mooncake ErrorCode values (mooncake-store/include/types.h) the tier acts on.
OBJECT_NOT_FOUND = -704
REPLICA_IS_NOT_READY = -703
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
INVALID_PARAMS = -600
TRANSFER_FAIL = -800
MASTER_UNREACHABLE = (-900, -901)  # RPC_FAIL, RPC_TIMEOUT
ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE (the pool is full)",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK",
    -710: "REPLICA_NOT_FOUND",
    -712: "REPLICA_IS_GONE",
    -714: "OBJECT_REPLICA_BUSY",
    -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH",
    -900: "RPC_FAIL (master unreachable?)",
    -901: "RPC_TIMEOUT",
}

_setup_lock = threading.Lock()
"""Mooncake reads its RPC timeouts from the environment when a client is set up."""


def error_name(code: int) -> str:
    return f"{ERROR_NAMES.get(code, 'error')} ({code})"


def _split_address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{value!r} is not a master address: expected host:port, e.g. 127.0.0.1:50051"
        )
    return host, int(port)


class MooncakeConfig(LowerTierConfig):
    """A Mooncake Store pool. Field names are Mooncake's own (its ``setup()`` and
    ``MooncakeConfig``); sizes take UCM's size strings."""

    type: Literal["mooncake"] = "mooncake"
    master_server_address: str = Field(
        description="host:port of the mooncake_master RPC service, e.g. 127.0.0.1:50051."
    )
    local_hostname: str = Field(
        min_length=1,
        description="This node's address as the other nodes reach it (transfers connect to it).",
    )
    metadata_server: str = Field(
        default="P2PHANDSHAKE",
        min_length=1,
        description="Transfer-engine metadata: P2PHANDSHAKE (no server), or e.g. "
        "http://host:8080/metadata, etcd://host:2379.",
    )
    protocol: Literal["tcp", "rdma"] = Field(default="tcp", description="Transport.")
    device_name: str = Field(
        default="",
        validate_default=True,
        description="RDMA device(s), e.g. mlx5_0 or auto-discovery (protocol rdma only).",
    )
    global_segment_size: Size = Field(
        default=16 * 1024 * 1024,
        description="Memory this process contributes to the pool (0: none, a pure client).",
    )
    local_buffer_size: Size = Field(
        default=16 * 1024 * 1024,
        description="Mooncake's client-side staging buffer (UCM's zero-copy path bypasses it).",
    )
    replica_num: Int = Field(
        default=1,
        ge=1,
        le=16,
        description="Copies of each shard, each in a different segment (node).",
    )
    key_prefix: str = Field(
        default="ucm",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="Namespace of this stack's objects in the pool: <key_prefix>/<block>/<shard>.",
    )
    connect_timeout: Seconds = Field(
        default=10.0,
        description="Seconds to reach the master when the tier opens (and Mooncake's RPC "
        "connect timeout).",
    )
    rpc_timeout: Seconds | None = Field(
        default=None,
        description="Seconds per master RPC (Mooncake's MC_RPC_TIMEOUT_MS; its default is 30).",
    )
    master_retry_interval: Seconds = Field(
        default=2.0,
        description="After a call finds the master unreachable, calls fail at once (lookups "
        "answer absent) and the master is probed again at most this often.",
    )

    namespace_bytes_refused: ClassVar[str | None] = (
        "Mooncake Store lists no keys and records no ages (its client API has no listing; the "
        "master keeps no write time), so the tier could neither measure a namespace's bytes nor "
        "drop its oldest blocks first; give the quota to a posix or fsspec tier, or none"
    )

    @field_validator("master_server_address")
    @classmethod
    def _check_master(cls, value: str) -> str:
        _split_address(value)
        return value

    @field_validator("global_segment_size")
    @classmethod
    def _check_segment(cls, value: int) -> int:
        if 0 < value < SEGMENT_MIN_BYTES:
            raise ValueError(
                f"{value} bytes is not a valid segment: Mooncake mounts 0 (contribute nothing) "
                f"or at least {SEGMENT_MIN_BYTES} bytes (16MiB)"
            )
        return value

    @field_validator("device_name")
    @classmethod
    def _check_device(cls, value: str, info: ValidationInfo) -> str:
        if info.data.get("protocol") == "rdma" and not value:
            raise ValueError(
                "protocol rdma needs device_name: an RDMA device such as mlx5_0, or auto-discovery"
            )
        return value


def import_store_class() -> Any:
    """``mooncake.store.MooncakeDistributedStore``, or a ConfigError saying what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        text = str(exc)
        if "libibverbs" in text:
            hint = (
                "Mooncake's store.so needs the system library libibverbs.so.1 even for tcp: "
                "install it (Debian/Ubuntu: apt-get install libibverbs1)"
            )
        else:
            hint = f"install it with {INSTALL_HINT}"
        raise ConfigError(
            f"the mooncake tier needs mooncake.store, which failed to import ({text}); {hint}"
        ) from None
    return MooncakeDistributedStore


def _probe(host: str, port: int, timeout_s: float) -> None:
    """Raises OSError unless something accepts TCP connections at host:port."""
    with socket.create_connection((host, port), timeout=timeout_s):
        pass


class _Master:
    """Whether the master answers. Once a call gets RPC_FAIL/RPC_TIMEOUT, every Mooncake call
    against the dead master would take seconds (its client reconnects on each), so calls fail
    at once instead, and a TCP probe every ``retry_s`` finds out when the master is back."""

    def __init__(self, address: str, retry_s: float) -> None:
        self.address = address
        self._host, self._port = _split_address(address)
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._next_probe = 0.0

    def reachable(self) -> bool:
        with self._lock:
            if self._down_since is None:
                return True
            now = time.monotonic()
            if now < self._next_probe:
                return False
            self._next_probe = now + self._retry_s
        try:
            _probe(self._host, self._port, min(self._retry_s, 1.0))
        except OSError:
            return False
        with self._lock:
            self._down_since = None
        return True

    def saw(self, codes: Sequence[int]) -> None:
        """Marks the master down when a call's answers say it did not respond."""
        if any(code in MASTER_UNREACHABLE for code in codes):
            with self._lock:
                now = time.monotonic()
                if self._down_since is None:
                    self._down_since = now
                self._next_probe = now + self._retry_s

    def down_for(self) -> str:
        with self._lock:
            since = self._down_since
        ago = time.monotonic() - since if since is not None else 0.0
        return (
            f"the master at {self.address} did not answer {ago:.1f}s ago; calls fail at once "
            f"until a probe (every {self._retry_s:g}s) reaches it"
        )


class _Registrations:
    """Memory registered with one Mooncake client.

    Persistent regions (the buffer's data plane, header arenas) stay registered until close.
    Other memory is registered per call: :meth:`covering` registers what a call needs and is
    not yet covered, and releases it when the last call using it ends. The transfer engine
    refuses overlapping regions, so a range that overlaps a region only partly waits until that
    (per-call) region is gone; one straddling a persistent region is an error.
    """

    def __init__(self, client: Any, label: str) -> None:
        self._client = client
        self._label = label
        self._cond = threading.Condition()
        self._starts: list[int] = []
        self._ends: dict[int, int] = {}
        self._refs: dict[int, int] = {}
        """Per-call regions' users; persistent regions are absent here."""
        self.persistent_bytes = 0
        self.temporary = 0
        """Per-call registrations made so far."""

    def add_persistent(self, address: int, nbytes: int) -> None:
        with self._cond:
            found = self._find(address, address + nbytes)
            if found is not None and found[1]:
                return  # inside a persistent region already
            if found is not None or self._overlaps(address, address + nbytes):
                raise TierError(
                    f"mooncake tier {self._label!r}: memory {address:#x}+{nbytes} overlaps a "
                    "region registered for another call"
                )
            self._register(address, nbytes)
            self._insert(address, address + nbytes)
            self.persistent_bytes += nbytes

    @contextmanager
    def covering(self, ranges: Sequence[tuple[int, int]]) -> Iterator[None]:
        """Every (address, nbytes) range is registered for the duration of the block."""
        used = self._acquire([(a, a + n) for a, n in ranges if n > 0])
        try:
            yield
        finally:
            self._release(used)

    def close(self) -> None:
        with self._cond:
            for start in list(self._starts):
                self._client.unregister_buffer(start)
            self._starts.clear()
            self._ends.clear()
            self._refs.clear()

    # ---- internals --------------------------------------------------------------------------

    def _find(self, start: int, end: int) -> tuple[int, bool] | None:
        """(region start, persistent?) of the region holding [start, end) whole, if any."""
        index = bisect.bisect_right(self._starts, start) - 1
        if index >= 0:
            region = self._starts[index]
            if self._ends[region] >= end:
                return region, region not in self._refs
        return None

    def _overlaps(self, start: int, end: int) -> list[int]:
        index = bisect.bisect_right(self._starts, start) - 1
        found = []
        for region in self._starts[max(index, 0) :]:
            if region >= end:
                break
            if self._ends[region] > start:
                found.append(region)
        return found

    def _insert(self, start: int, end: int) -> None:
        bisect.insort(self._starts, start)
        self._ends[start] = end

    def _register(self, address: int, nbytes: int) -> None:
        status = self._client.register_buffer(address, nbytes)
        if status != 0:
            raise TierError(
                f"mooncake tier {self._label!r}: register_buffer({address:#x}, {nbytes}) "
                f"failed: {error_name(status)}"
            )

    def _acquire(self, wanted: list[tuple[int, int]]) -> list[int]:
        deadline = time.monotonic() + REGISTRATION_WAIT_S
        with self._cond:
            while True:
                used: list[int] = []
                new: list[tuple[int, int]] = []
                blocked = False
                for start, end in sorted(wanted):
                    found = self._find(start, end)
                    if found is not None:
                        if not found[1]:
                            used.append(found[0])
                        continue
                    overlapping = self._overlaps(start, end)
                    if any(region not in self._refs for region in overlapping):
                        raise TierError(
                            f"mooncake tier {self._label!r}: memory {start:#x}+{end - start} "
                            "straddles the edge of a registered region"
                        )
                    if overlapping:
                        blocked = True
                        break
                    if new and start <= new[-1][1]:
                        new[-1] = (new[-1][0], max(new[-1][1], end))
                    else:
                        new.append((start, end))
                if not blocked:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TierError(
                        f"mooncake tier {self._label!r}: waited {REGISTRATION_WAIT_S:g}s for "
                        "another call's registration of overlapping memory to end"
                    )
                self._cond.wait(remaining)
            registered: list[int] = []
            try:
                for start, end in new:
                    self._register(start, end - start)
                    registered.append(start)
                    self._insert(start, end)
                    self._refs[start] = 0
            except BaseException:
                for start in registered:
                    self._forget(start)
                raise
            self.temporary += len(new)
            used += registered
            for region in used:
                self._refs[region] += 1
            return used

    def _release(self, used: list[int]) -> None:
        with self._cond:
            for region in used:
                self._refs[region] -= 1
                if self._refs[region] == 0:
                    self._forget(region)
            self._cond.notify_all()

    def _forget(self, region: int) -> None:
        self._client.unregister_buffer(region)
        self._starts.remove(region)
        del self._ends[region]
        self._refs.pop(region, None)


class _Arena:
    """One thread's registered header slots: headers read (loads, dump checks) and written."""

    def __init__(self) -> None:
        self.memory = mmap.mmap(-1, ARENA_BYTES)
        self.view = memoryview(self.memory)
        self.address = buffer_address(self.view)
        self.read_offset = 0
        self.write_offset = BATCH_KEYS_MAX * _SLOT_BYTES

    def read_address(self, index: int) -> int:
        return self.address + self.read_offset + index * _SLOT_BYTES

    def write_address(self, index: int) -> int:
        return self.address + self.write_offset + index * _SLOT_BYTES

    def read_header(self, index: int) -> memoryview:
        start = self.read_offset + index * _SLOT_BYTES
        return self.view[start : start + HEADER_BYTES]

    def write_header(self, index: int, header: bytes) -> None:
        start = self.write_offset + index * _SLOT_BYTES
        self.view[start : start + HEADER_BYTES] = header


class MooncakeTier(Tier):
    type_name = "mooncake"
    config_model = MooncakeConfig
    remove_chunk_keys = REMOVE_CHUNK_KEYS

    def __init__(self, config: ucm.TierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        assert isinstance(config, MooncakeConfig)
        self.cfg: MooncakeConfig = config
        if NAMESPACE_BYTES_OPTION in context.options:
            # The stack refuses such a quota at parse time (StackConfig); a tier opened with
            # one some other way must not ignore it either.
            raise ConfigError(
                f"tiers[{context.position}] (mooncake): takes no per-namespace byte quota: "
                f"{MooncakeConfig.namespace_bytes_refused}"
            )
        if context.evict_sink is not None:
            # The store feeds a write: back tier from the evictions of the tiers above it, down
            # to the first write: through one; the master evicts without handing anything down.
            raise ConfigError(
                f"tiers[{context.position}] (mooncake): a write: back tier below it would get "
                "shards only from this tier's evictions, and the Mooncake master evicts on its "
                "own without handing them down; make a tier between them write: through, or "
                "the tiers below write: through"
            )
        store_class = import_store_class()
        self.shard_size = self.layout.shard_size
        self.object_bytes = envelope.object_bytes_max(self.shard_size)
        host, port = _split_address(config.master_server_address)
        try:
            _probe(host, port, config.connect_timeout)
        except OSError as exc:
            raise TierError(
                f"mooncake tier {self.label!r}: cannot reach the master at "
                f"{config.master_server_address} within {config.connect_timeout:g}s: {exc}"
            ) from None
        # A scheduler only answers lookups: it contributes no memory to the pool.
        segment = 0 if context.is_scheduler else config.global_segment_size
        self.client = store_class()
        with _setup_lock:
            os.environ["MC_RPC_CONNECT_TIMEOUT_MS"] = str(int(config.connect_timeout * 1000))
            if config.rpc_timeout is not None:
                os.environ["MC_RPC_TIMEOUT_MS"] = str(int(config.rpc_timeout * 1000))
            status = self.client.setup(
                config.local_hostname,
                config.metadata_server,
                segment,
                config.local_buffer_size,
                config.protocol,
                config.device_name,
                config.master_server_address,
            )
        if status != 0:
            self.client.close()
            raise TierError(
                f"mooncake tier {self.label!r}: setup with master {config.master_server_address}"
                f", metadata_server {config.metadata_server!r}, protocol {config.protocol} "
                f"failed ({status}); see Mooncake's log above"
            )
        self._replicate = self._replicate_config(config.replica_num)
        # Control records are hard-pinned: the master's eviction never drops them.
        self._control_pin = self._replicate_config(config.replica_num)
        self._control_pin.with_hard_pin = True
        self.master = _Master(config.master_server_address, config.master_retry_interval)
        self.registrations = _Registrations(self.client, self.label)
        self._arenas: list[_Arena] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._closed = False
        self._stat: dict[str, int] = dict.fromkeys(
            (
                "hits",
                "misses",
                "errors",
                "corrupt",
                "lease_retries",
                "bytes_read",
                "bytes_written",
                "bytes_stored",
                "unchanged",
                "replaced",
                "newer_kept",
                "lookups",
                "touches",
                "lock_acquisitions",
                "remove_lock_acquisitions",
                "leased_kept",
                "master_down_skips",
            ),
            0,
        )
        try:
            for address, nbytes in context.options.get(HOST_MEMORY_OPTION, ()):
                self.registrations.add_persistent(address, nbytes)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _replicate_config(replica_num: int) -> Any:
        from mooncake.store import ReplicateConfig

        replicate = ReplicateConfig()
        replicate.replica_num = replica_num
        return replicate

    # ---- control records (reset epochs) --------------------------------------------------

    def control_object(self, name: bytes) -> str:
        """``<key_prefix>/control/<name hex>``: outside every block and namespace key (and every
        pattern a purge removes by)."""
        return f"{self.cfg.key_prefix}/{control.record_dir(name)}"

    def read_control(self, names: Sequence[bytes]) -> list[int | None]:
        """Each record's value: one small object per record (``ucm.control``'s format).
        Unanswerable (a TierError) when the master is down or an object is damaged."""
        values: list[int | None] = []
        for name in names:
            control.check_name(name)
            if not self.master.reachable():
                raise TierError(
                    f"mooncake tier {self.label!r}: control record read: {self.master.down_for()}"
                )
            values.append(self._read_record(name))
        return values

    def _read_record(self, name: bytes) -> int | None:
        key = self.control_object(name)
        exists = int(self.client.is_exist(key))
        self.master.saw([exists])
        if exists == 0:
            return None
        if exists < 0:
            raise TierError(
                f"mooncake tier {self.label!r}: control record {name.hex()}: is_exist "
                f"answered {error_name(exists)}"
            )
        data = bytes(self.client.get(key))
        # Removed since (an upsert replacing it): ask once more.
        if len(data) < control.RECORD_BYTES and int(self.client.is_exist(key)) == 1:
            data = bytes(self.client.get(key))
        value = int.from_bytes(data[8:16], "little") if len(data) == control.RECORD_BYTES else -1
        if value < 0 or not control.valid(name, value, data):
            raise TierError(
                f"mooncake tier {self.label!r}: control record {name.hex()}: its object is "
                f"torn or corrupt ({len(data)} bytes); the record cannot be read exactly"
            )
        return value

    def raise_control(self, name: bytes, value: int) -> None:
        """Upserts the record's object, hard-pinned (the master's eviction never takes it),
        when ``value`` is above the one it holds. Not atomic across processes: two raising
        one record at once may leave the lower value (one writer per record never does)."""
        control.check_name(name)
        control.check_value(value)
        if not self.master.reachable():
            raise TierError(
                f"mooncake tier {self.label!r}: control record raise: {self.master.down_for()}"
            )
        with self._lock:
            current = self._read_record(name)
            if current is not None and current >= value:
                return
            status = int(
                self.client.upsert(
                    self.control_object(name), control.encode(name, value), self._control_pin
                )
            )
        self.master.saw([status])
        if status != 0:
            raise TierError(
                f"mooncake tier {self.label!r}: control record {name.hex()}: upsert of {value} "
                f"failed: {error_name(status)}"
            )

    # ---- names, headers, arenas -------------------------------------------------------------

    def object_name(self, key: Key) -> str:
        # A namespace other than the default is its own key prefix: <key_prefix>/ns/<name>/.
        return f"{self.cfg.key_prefix}/{self.namespace_prefix(key[0])}{key[0].hex()}/{key[1]}"

    # ---- namespaces: Mooncake Store lists no keys, but removes by pattern --------------------

    def namespace_usage(self) -> dict[str, int] | None:
        return None

    def purge(self, namespace: str) -> int:
        """Removes every object under the namespace's key prefix (``remove_by_regex``, leases
        and replication tasks included): the objects of its shards, counted by the master."""
        prefix = re.escape(self.cfg.key_prefix)
        if namespace == namespaces.DEFAULT_NAMESPACE:
            pattern = f"^{prefix}/[0-9a-f]{{32}}/[0-9]+$"
        else:
            pattern = f"^{prefix}/ns/{re.escape(namespace)}/[0-9a-f]{{32}}/[0-9]+$"
        if not self.master.reachable():
            raise TierError(f"mooncake tier {self.label!r}: purge: {self.master.down_for()}")
        with self._lock:
            self._bump(lock_acquisitions=1, remove_lock_acquisitions=1)
            removed = int(self.client.remove_by_regex(pattern, True))
        if removed < 0:
            self._bump(errors=1)
            raise TierError(
                f"mooncake tier {self.label!r}: purge of namespace {namespace!r} failed: "
                f"{error_name(removed)}"
            )
        return removed

    @staticmethod
    def header(key: Key, views: ShardViews) -> bytes:
        """The envelope stored before ``key``'s shard held in ``views``."""
        return envelope.seal(key, views)

    def _arena(self) -> _Arena:
        arena: _Arena | None = getattr(self._local, "arena", None)
        if arena is None:
            arena = _Arena()
            self.registrations.add_persistent(arena.address, len(arena.memory))
            with self._stats_lock:
                self._arenas.append(arena)
            self._local.arena = arena
        return arena

    def _bump(self, **amounts: int) -> None:
        with self._stats_lock:
            for name, amount in amounts.items():
                self._stat[name] += amount

    def _describe(self, key: Key) -> str:
        return f"mooncake tier {self.label!r}: block {key[0].hex()} shard {key[1]}"

    @staticmethod
    def _ranges(views: ShardViews) -> list[tuple[int, int]]:
        return [(buffer_address(view), view.nbytes) for view in views]

    # ---- lookup, touch ----------------------------------------------------------------------

    def lookup(self, keys: Sequence[Key]) -> list[bool]:
        present: list[bool] = []
        for part in chunks(list(keys), LOOKUP_CHUNK_KEYS):
            if not self.master.reachable():
                self._bump(lookups=len(part), errors=len(part), master_down_skips=len(part))
                present += [False] * len(part)
                continue
            answers = [
                int(a) for a in self.client.batch_is_exist([self.object_name(k) for k in part])
            ]
            if len(answers) != len(part):  # a client that is not set up answers nothing
                answers = [-1] * len(part)
            self.master.saw(answers)
            errors = sum(1 for answer in answers if answer < 0)
            self._bump(lookups=len(part), errors=errors)
            # lookup has no per-key outcome: an unreachable master answers "absent" (counted).
            present += [answer == 1 for answer in answers]
        return present

    def touch(self, block_ids: Sequence[bytes]) -> None:
        # Mooncake has no touch; a lookup leases the object, and the master's eviction takes
        # the objects whose lease ran out longest ago first.
        if block_ids:
            self.lookup(self.layout.keys_of_blocks(list(block_ids)))
            self._bump(touches=len(block_ids))

    # ---- load -------------------------------------------------------------------------------

    def load(self, keys: Sequence[Key], destinations: Sequence[ShardViews]) -> list[Outcome]:
        assert len(keys) == len(destinations), "one destination per key"
        outcomes: list[Outcome] = [None] * len(keys)
        arena = self._arena()
        for start in range(0, len(keys), BATCH_KEYS_MAX):
            end = min(start + BATCH_KEYS_MAX, len(keys))
            outcomes[start:end] = self._load_batch(arena, keys[start:end], destinations[start:end])
        return outcomes

    def _load_batch(
        self, arena: _Arena, keys: Sequence[Key], destinations: Sequence[ShardViews]
    ) -> list[Outcome]:
        names = [self.object_name(key) for key in keys]
        ranges = [self._ranges(views) for views in destinations]
        for key, views in zip(keys, destinations, strict=True):
            assert sum(view.nbytes for view in views) == self.shard_size, key
        buffers = [[arena.read_address(i)] + [a for a, _ in r] for i, r in enumerate(ranges)]
        sizes = [[HEADER_BYTES] + [n for _, n in r] for r in ranges]
        if not self.master.reachable():
            self._bump(errors=len(keys), master_down_skips=len(keys))
            return [TierError(f"{self._describe(k)}: {self.master.down_for()}") for k in keys]
        codes = [0] * len(keys)
        with self.registrations.covering([item for r in ranges for item in r]):
            pending = list(range(len(keys)))
            for attempt in range(LEASE_RETRIES + 1):
                results = self.client.batch_get_into_multi_buffers(
                    [names[i] for i in pending],
                    [buffers[i] for i in pending],
                    [sizes[i] for i in pending],
                )
                if len(results) != len(pending):
                    results = [INVALID_PARAMS] * len(pending)
                for i, result in zip(pending, results, strict=True):
                    codes[i] = int(result)
                self.master.saw([codes[i] for i in pending])
                pending = [i for i in pending if codes[i] == LEASE_EXPIRED]
                if not pending or attempt == LEASE_RETRIES:
                    break
                self._bump(lease_retries=len(pending))
            return [
                self._check_loaded(arena, i, keys[i], names[i], codes[i], destinations[i])
                for i in range(len(keys))
            ]

    def _check_loaded(
        self, arena: _Arena, index: int, key: Key, name: str, code: int, views: ShardViews
    ) -> Outcome:
        if code == self.object_bytes:
            try:
                envelope.verify(
                    envelope.parse(arena.read_header(index), key, self.shard_size), views
                )
            except envelope.Newer as exc:
                return self._newer(key, str(exc))
            except envelope.Foreign as exc:
                return self._foreign(key, name, str(exc))
            except envelope.Corrupt as exc:
                return self._corrupt(key, name, str(exc))
            self._bump(hits=1, bytes_read=self.shard_size)
            return None
        if code in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
            self._bump(misses=1)
            return KeyMissingError(f"{self._describe(key)} is not in the pool")
        if code >= 0:
            return self._wrong_size(arena, index, key, name, code, views)
        if code in (INVALID_PARAMS, TRANSFER_FAIL):
            # What Mooncake answers when the object's size differs from the buffers'.
            size = int(self.client.get_size(name))
            if size >= 0 and size != self.object_bytes:
                return self._wrong_size(arena, index, key, name, size, views)
        self._bump(errors=1)
        return TierError(f"{self._describe(key)}: loading failed: {error_name(code)}")

    def _wrong_size(
        self, arena: _Arena, index: int, key: Key, name: str, size: int, views: ShardViews
    ) -> Outcome:
        """An object of another size: a shard stored under a codec (smaller), one of an older
        format (a miss), else corrupt."""
        if HEADER_BYTES < size < self.object_bytes:
            return self._load_encoded(key, name, size, views)
        head = min(size, envelope.LEGACY_PREFIX_BYTES)
        found = self.client.get_into_ranges(
            [arena.address],
            [[name]],
            [[[arena.read_offset + index * _SLOT_BYTES]]],
            [[[0]]],
            [[[head]]],
        )
        if found and int(found[0][0][0]) == head:
            legacy = envelope.legacy_format(arena.read_header(index)[:head])
            if legacy is not None:
                return self._foreign(key, name, f"written in an older format, a {legacy}")
            newer = envelope.newer_version(arena.read_header(index)[:head])
            if newer is not None:  # a newer UCM's object may have any size
                return self._newer(key, f"envelope version {newer}, {size} bytes")
        return self._corrupt(key, name, f"{size} bytes, expected {self.object_bytes}")

    def _load_encoded(self, key: Key, name: str, size: int, views: ShardViews) -> Outcome:
        """Reads a whole object smaller than a plain shard's (a codec's payload) into scratch
        memory registered for this read, decodes it into ``views`` on this thread (a loader
        or writer thread, never the engine's) and checks it."""
        scratch = bytearray(size)
        address = buffer_address(scratch)
        with self.registrations.covering([(address, size)]):
            found = self.client.get_into_ranges([address], [[name]], [[[0]]], [[[0]]], [[[size]]])
        got = int(found[0][0][0]) if found and found[0] and found[0][0] else INVALID_PARAMS
        if got in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
            self._bump(misses=1)
            return KeyMissingError(f"{self._describe(key)} is not in the pool")
        if got != size:
            self._bump(errors=1)
            return TierError(f"{self._describe(key)}: loading failed: {error_name(got)}")
        try:
            shard = envelope.open_object(scratch, key, self.shard_size)
        except envelope.Newer as exc:
            return self._newer(key, str(exc))
        except envelope.Foreign as exc:
            return self._foreign(key, name, str(exc))
        except envelope.Corrupt as exc:
            return self._corrupt(key, name, str(exc))
        scatter(shard, views)
        self._bump(hits=1, bytes_read=self.shard_size)
        return None

    def _remove_unusable(self, name: str) -> str:
        # Removed (force: our own read just leased it), so the stack's repair puts a good copy.
        removed = self.client.batch_remove([name], True)
        return "it was removed" if list(removed) == [0] else "removing it failed"

    def _corrupt(self, key: Key, name: str, problem: str) -> TierError:
        self._bump(corrupt=1)
        note = self._remove_unusable(name)
        return TierError(f"{self._describe(key)} is corrupt ({problem}); {note}")

    def _newer(self, key: Key, problem: str) -> KeyMissingError:
        """A newer UCM's object (a later envelope version): a miss that is never removed nor
        counted corrupt, so the newer nodes of a rolling upgrade keep their shards."""
        self._bump(misses=1, newer_kept=1)
        return KeyMissingError(
            f"{self._describe(key)} is not readable here ({problem}); it was kept for the UCM "
            "that wrote it"
        )

    def _foreign(self, key: Key, name: str, problem: str) -> KeyMissingError:
        self._bump(misses=1)
        note = self._remove_unusable(name)
        return KeyMissingError(f"{self._describe(key)} is not readable here ({problem}); {note}")

    # ---- dump -------------------------------------------------------------------------------

    def dump(self, keys: Sequence[Key], sources: Sequence[ShardViews]) -> list[Outcome]:
        assert len(keys) == len(sources), "one source per key"
        outcomes: list[Outcome] = [None] * len(keys)
        arena = self._arena()
        for start in range(0, len(keys), BATCH_KEYS_MAX):
            end = min(start + BATCH_KEYS_MAX, len(keys))
            outcomes[start:end] = self._dump_batch(arena, keys[start:end], sources[start:end])
        return outcomes

    def _dump_batch(
        self, arena: _Arena, keys: Sequence[Key], sources: Sequence[ShardViews]
    ) -> list[Outcome]:
        n = len(keys)
        names = [self.object_name(key) for key in keys]
        payloads: list[Sequence[Any]] = []
        headers = []
        ranges = []
        for i, views in enumerate(sources):
            assert sum(view.nbytes for view in views) == self.shard_size, keys[i]
            # The codec runs here, on the writer's thread (a shard it does not shrink is put
            # from the caller's memory as it is, zero copy).
            sealed = envelope.encode(keys[i], views, self.cfg.codec)
            headers.append(sealed.header)
            arena.write_header(i, headers[i])
            ranges.append(
                self._ranges(views)
                if sealed.payload is views
                else [(buffer_address(part), memoryview(part).nbytes) for part in sealed.payload]
            )
            payloads.append(sealed.payload)  # alive until the put is done
        if not self.master.reachable():
            self._bump(errors=n, master_down_skips=n)
            return [TierError(f"{self._describe(k)}: {self.master.down_for()}") for k in keys]
        outcomes: list[Outcome] = [None] * n
        with self.registrations.covering([item for r in ranges for item in r]):
            # Mooncake's put keeps an existing object: read the stored headers first.
            found = self.client.get_into_ranges(
                [arena.address],
                [names],
                [[[arena.read_offset + i * _SLOT_BYTES] for i in range(n)]],
                [[[0] for _ in range(n)]],
                [[[HEADER_BYTES] for _ in range(n)]],
            )
            codes = [int(parts[0]) for parts in found[0]] if found else [INVALID_PARAMS] * n
            self.master.saw(codes)
            put: list[int] = []
            replace: list[int] = []
            for i, code in enumerate(codes):
                if code == OBJECT_NOT_FOUND:
                    put.append(i)
                elif code == HEADER_BYTES:
                    if bytes(arena.read_header(i)) == headers[i]:
                        self._bump(unchanged=1)  # the pool holds these very bytes already
                    elif envelope.newer_version(arena.read_header(i)) is not None:
                        # A newer UCM's object: not ours to replace; acknowledged, not put.
                        self._bump(newer_kept=1)
                    else:
                        replace.append(i)
                elif code == INVALID_PARAMS and 0 <= self.client.get_size(names[i]) < HEADER_BYTES:
                    replace.append(i)  # shorter than a header: not one of ours
                else:
                    self._bump(errors=1)
                    outcomes[i] = TierError(
                        f"{self._describe(keys[i])}: writing failed: {error_name(code)}"
                    )
            if replace:
                with self._lock:
                    removed = self.client.batch_remove([names[i] for i in replace], True)
                for i, code in zip(replace, removed, strict=True):
                    if code in (0, OBJECT_NOT_FOUND):
                        put.append(i)
                        self._bump(replaced=1)
                    else:
                        self._bump(errors=1)
                        outcomes[i] = TierError(
                            f"{self._describe(keys[i])}: replacing it failed: {error_name(code)}"
                        )
            if put:
                put.sort()
                results = self.client.batch_put_from_multi_buffers(
                    [names[i] for i in put],
                    [[arena.write_address(i)] + [a for a, _ in ranges[i]] for i in put],
                    [[HEADER_BYTES] + [size for _, size in ranges[i]] for i in put],
                    self._replicate,
                )
                if len(results) != len(put):
                    results = [INVALID_PARAMS] * len(put)
                self.master.saw([int(code) for code in results])
                for i, code in zip(put, results, strict=True):
                    if code == 0:
                        stored = sum(size for _, size in ranges[i])
                        self._bump(bytes_written=self.shard_size, bytes_stored=stored)
                    else:
                        self._bump(errors=1)
                        outcomes[i] = TierError(
                            f"{self._describe(keys[i])}: writing failed: {error_name(int(code))}"
                        )
        return outcomes

    # ---- remove -----------------------------------------------------------------------------

    def batched_remove(self, keys: Sequence[Key], force: bool = False) -> int:
        distinct = list(dict.fromkeys(keys))
        removed = 0
        failed: list[str] = []
        if distinct and not self.master.reachable():
            self._bump(errors=len(distinct), master_down_skips=len(distinct))
            raise TierError(
                f"mooncake tier {self.label!r}: batched_remove: {self.master.down_for()}"
            )
        for chunk in chunks(distinct, self.remove_chunk_keys):
            with self._lock:
                self._bump(lock_acquisitions=1, remove_lock_acquisitions=1)
                wanted = [key for key in chunk if force or not self.pins.is_pinned(key)]
                if not wanted:
                    continue
                if self.master.reachable():
                    codes = self.client.batch_remove([self.object_name(k) for k in wanted], force)
                else:  # it went away during this removal
                    codes = [MASTER_UNREACHABLE[0]] * len(wanted)
            if len(codes) != len(wanted):
                codes = [INVALID_PARAMS] * len(wanted)
            self.master.saw(codes)
            for key, code in zip(wanted, codes, strict=True):
                if code == 0:
                    removed += 1
                elif code == OBJECT_HAS_LEASE:
                    self._bump(leased_kept=1)  # read lately by some node: in use
                elif code not in (OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY):
                    failed.append(f"block {key[0].hex()} shard {key[1]}: {error_name(code)}")
        if failed:
            self._bump(errors=len(failed))
            raise TierError(
                f"mooncake tier {self.label!r}: batched_remove failed for {len(failed)} key(s) "
                f"({removed} removed): {'; '.join(failed[:4])}"
            )
        return removed

    # ---- stats, close -----------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        with self._stats_lock:
            result: dict[str, int | float] = dict(self._stat)
        result["registered_bytes"] = self.registrations.persistent_bytes
        result["call_registrations"] = self.registrations.temporary
        result["global_segment_bytes"] = (
            0 if self.context.is_scheduler else (self.cfg.global_segment_size)
        )
        return result

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        registrations = getattr(self, "registrations", None)
        if registrations is not None:
            registrations.close()
        # Unmounts this process's segment: the master drops the objects held in it.
        self.client.close()
        for arena in getattr(self, "_arenas", []):
            try:
                arena.view.release()
                arena.memory.close()
            except BufferError:  # a header view still referenced: the mapping goes with it
                pass


@ucm.hookimpl
def register_tiers(register: Any) -> None:
    register(MooncakeTier)
