"""Observability: one snapshot of a live store's counters, and Prometheus metrics made from it.

Two kinds of numbers, kept apart because they mean different things:

- **node-wide**: the shared CacheBuffer's native counters (``ucm.native.buffer.COUNTER_NAMES``)
  and its slot occupancy live in the shared control segment; every process attached to the same
  ``unique_id`` (any rank, or the scheduler role that ``ucm stats`` uses) reads the same values.
- **this process**: the Store's own counters (load hits and misses, shards loaded and dumped...)
  and each lower tier's ``stats()`` count what *this* process did. A scheduler that only attaches
  to look sees zeros there; a rank that serves its own metrics endpoint sees its own work.

:func:`snapshot` reads both; :class:`StoreCollector` turns a snapshot into Prometheus metric
families on every scrape; :func:`serve` exposes them over HTTP on the loopback interface only.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .breaker import BREAKER_STATES
from .errors import InvalidArgumentError
from .native.buffer import COUNTER_NAMES, GAUGE_NAMES, BufferCore

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

    from .store import Store

NODE_WIDE_COUNTERS: tuple[str, ...] = COUNTER_NAMES
"""Counters of the shared CacheBuffer: the same for every process of the node."""
NODE_WIDE_GAUGES: tuple[str, ...] = GAUGE_NAMES
"""Of those, the gauges (exported as Prometheus gauges, without ``_total``)."""


@dataclass(frozen=True)
class Occupancy:
    """Where the buffer's slots are, counted by the native core from the shared slot table
    (node-wide).

    Read without locks while ranks work: each slot is read once, so the counts are a consistent
    picture of each slot but the sum may mix instants; it is a gauge, not an audit.
    """

    capacity_slots: int
    """Regular slots (the buffer's capacity)."""
    reserved_slots: int
    """Extra slots of the reserved pool (Prealloc, and misses when the regular pool is full)."""
    resident: int
    """Slots holding a Ready shard that lookups find."""
    filling: int
    """Slots claimed by an owner that is loading them (Idle, referenced)."""
    preallocated: int
    """Slots hung by Prealloc, waiting for their Get (Idle, unreferenced)."""
    in_use: int
    """Slots some process holds a reference on (copying out, filling, waiting)."""
    waiters: int
    """References held on slots being filled, beyond their owner's: ranks waiting right now."""
    free: int
    """Slots on no hash chain: never used, removed or failed."""
    detached: int
    """Slots removed (or failed) while still referenced: freed at their last release."""
    resident_reserved: int
    """Of ``resident``, slots in the reserved pool."""

    @property
    def total_slots(self) -> int:
        return self.capacity_slots + self.reserved_slots

    @property
    def resident_fraction(self) -> float:
        """Resident shards over the regular capacity (can exceed 1 when reserved slots hold
        shards too)."""
        return self.resident / self.capacity_slots if self.capacity_slots else 0.0


def buffer_occupancy(core: BufferCore) -> Occupancy:
    """Counts the slots of the buffer (``BufferCore.occupancy``: the native core reads the
    shared slot table, whose layout it owns)."""
    geometry = core.geometry
    return Occupancy(
        capacity_slots=geometry.slot_count_regular,
        reserved_slots=geometry.slot_count_reserved,
        **core.occupancy(),
    )


@dataclass(frozen=True)
class Snapshot:
    """Every counter of a store at one instant (see the module docstring for node-wide versus
    this process)."""

    unique_id: str
    taken_at: float
    """``time.time()`` of the reading."""
    pid: int
    device_id: int
    buffer: dict[str, int] | None
    """Node-wide native counters of the shared CacheBuffer; None without a buffer tier."""
    occupancy: Occupancy | None
    """Node-wide slot occupancy; None without a buffer tier."""
    attached_pids: list[int] | None = None
    """Node-wide: pids of the processes registered as holders of the buffer (ranks that have
    used it and are alive); None without a buffer tier."""
    process: dict[str, int | float] = field(default_factory=dict)
    """This process's Store counters (``Store.stats()`` without ``tiers``)."""
    tiers: list[dict[str, Any]] = field(default_factory=list)
    """Each tier's ``stats()`` as seen by this process (for the buffer tier: only its
    per-process counters; the native ones are in ``buffer``)."""
    namespaces: dict[str, dict[str, int]] = field(default_factory=dict)
    """Node-wide, per namespace: CacheBuffer slots and bytes held, guarantee and cap, Get
    hits, misses and evictions (``Store.stats()["namespaces"]``); empty without a buffer."""
    namespace_tiers: dict[str, dict[str, dict[str, int]] | None] = field(default_factory=dict)
    """Per lower tier (by label), each namespace's bytes there and this process's evictions
    of its shards there (``Store.stats()["namespace_tiers"]``); None where the tier cannot tell
    (Mooncake) or has not finished its first scan. The bytes are the tier's whole content as
    of its last scan (every process's), moved by this process's writes since."""

    @property
    def hit_rate(self) -> float | None:
        """Node-wide: buffer Get hits over hits + misses (loads and dumps both claim slots, so a
        dump of a new shard counts as a miss). None without a buffer or before any Get."""
        if self.buffer is None:
            return None
        lookups = self.buffer["hits"] + self.buffer["misses"]
        return self.buffer["hits"] / lookups if lookups else None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["hit_rate"] = self.hit_rate
        if self.occupancy is not None:
            data["occupancy"]["resident_fraction"] = self.occupancy.resident_fraction
        data["node_wide"] = ["buffer", "occupancy", "hit_rate", "attached_pids", "namespaces"]
        return data


def snapshot(store: Store, scan_wait_s: float = 0.0) -> Snapshot:
    """Reads every counter of ``store`` now (works on a scheduler: nothing reads shard data).
    ``scan_wait_s``: how long to wait for the lower tiers' per-namespace scans under way (a
    one-shot ``ucm stats``); 0 reads what they know now (a scrape never waits)."""
    if scan_wait_s > 0:
        store.namespace_tier_stats(scan_wait_s)
    buffer_counters: dict[str, int] | None = None
    occupancy: Occupancy | None = None
    attached_pids: list[int] | None = None
    buffer = store.buffer
    # A scrape may run while the engine closes the store: the node-wide figures are read from
    # the buffer's shared memory, which close() unmaps (after it, they are left out).
    with store.reading() as live:
        stats = store.stats()
        if buffer is not None and live:
            core = buffer.core
            buffer_counters = core.stats()
            occupancy = buffer_occupancy(core)
            attached_pids = _attached_pids(core)
    tier_stats: list[dict[str, Any]] = stats.pop("tiers")
    namespace_stats: dict[str, dict[str, int]] = stats.pop("namespaces")
    namespace_tiers: dict[str, dict[str, dict[str, int]] | None] = stats.pop("namespace_tiers")
    if buffer is not None:
        tier_stats[0] = {
            name: value for name, value in tier_stats[0].items() if name not in NODE_WIDE_COUNTERS
        }
    return Snapshot(
        unique_id=store.config.unique_id,
        taken_at=time.time(),
        pid=os.getpid(),
        device_id=store.device_id,
        buffer=buffer_counters,
        occupancy=occupancy,
        attached_pids=attached_pids,
        process=stats,
        tiers=tier_stats,
        namespaces=namespace_stats,
        namespace_tiers=namespace_tiers,
    )


def _attached_pids(core: BufferCore) -> list[int]:
    """Pids of the processes registered as live holders of the buffer."""
    return sorted(row.pid for row in core.holders() if row.state.name == "LIVE")


# ---- Prometheus ---------------------------------------------------------------------------------

NAMESPACE_LABELS_MAX = 16
"""Most namespaces with a ``namespace`` label value of their own in Prometheus: those holding
the most CacheBuffer slots, then the most bytes on the lower tiers (ties by name), the same
ones in the buffer's and the tiers' metrics; every other namespace is summed under
:data:`OTHER_NAMESPACES`, so the label's cardinality stays at most 17 per ``unique_id``."""
OTHER_NAMESPACES = "_other"
"""The ``namespace`` label value of the namespaces beyond :data:`NAMESPACE_LABELS_MAX` (not a
valid namespace name, so it never collides with one)."""
_NAMESPACE_FIGURES = (
    ("occupancy_slots", "gauge", "CacheBuffer slots the namespace holds"),
    ("occupancy_bytes", "gauge", "CacheBuffer bytes the namespace holds"),
    ("guarantee_slots", "gauge", "CacheBuffer slots guaranteed to the namespace"),
    ("cap_slots", "gauge", "Most CacheBuffer slots the namespace may hold"),
    ("hits", "counter", "CacheBuffer Get hits of the namespace's keys"),
    ("misses", "counter", "CacheBuffer Get misses of the namespace's keys"),
    ("evictions", "counter", "The namespace's Ready CacheBuffer slots evicted"),
)


_TIER_NAMESPACE_FIGURES = (
    ("bytes", "gauge", "Bytes the namespace holds on the tier"),
    ("evictions", "counter", "The namespace's shards this process evicted from the tier"),
)


def labelled_namespaces(
    namespaces: dict[str, dict[str, int]],
    namespace_tiers: dict[str, dict[str, dict[str, int]] | None] | None = None,
) -> set[str]:
    """The namespaces that keep a ``namespace`` label value of their own: at most
    :data:`NAMESPACE_LABELS_MAX`, those holding the most CacheBuffer slots, then the most
    bytes on the lower tiers, ties by name."""
    slots = {name: figures["occupancy_slots"] for name, figures in namespaces.items()}
    tier_bytes: dict[str, int] = {}
    for per_namespace in (namespace_tiers or {}).values():
        for name, figures in (per_namespace or {}).items():
            tier_bytes[name] = tier_bytes.get(name, 0) + figures["bytes"]
    ranked = sorted(
        set(slots) | set(tier_bytes),
        key=lambda name: (-slots.get(name, 0), -tier_bytes.get(name, 0), name),
    )
    return set(ranked[:NAMESPACE_LABELS_MAX])


def namespace_labels(
    namespaces: dict[str, dict[str, int]], kept: set[str] | None = None
) -> dict[str, dict[str, int]]:
    """``namespaces`` (a namespace's figures by name) with the ``kept`` ones on their own
    (default: :func:`labelled_namespaces` of these alone) and the rest summed under
    :data:`OTHER_NAMESPACES` (absent when nothing is left over)."""
    if kept is None:
        kept = labelled_namespaces(namespaces)
    grouped = {name: dict(figures) for name, figures in namespaces.items() if name in kept}
    rest = [figures for name, figures in namespaces.items() if name not in kept]
    if rest:
        grouped[OTHER_NAMESPACES] = {
            figure: sum(figures[figure] for figures in rest) for figure in rest[0]
        }
    return grouped


_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")
_OCCUPANCY_STATES = ("resident", "filling", "preallocated", "free", "detached")


def _metric_name(raw: str) -> str:
    name = _NAME_RE.sub("_", raw).strip("_").lower()
    return name if name and not name[0].isdigit() else f"x_{name}"


def _is_number(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


class StoreCollector:
    """A Prometheus collector reading a store on every scrape (``registry.register(...)``).

    Metric names: ``ucm_buffer_*`` node-wide (native counters as ``*_total`` counters, slots by
    state, hit ratio), ``ucm_store_*`` this process's Store counters, ``ucm_tier_*`` each tier's
    own counters as gauges labelled by ``tier`` (position) and ``type``. Every metric carries a
    ``unique_id`` label.
    """

    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        shot = snapshot(self.store)
        uid = ["unique_id"]
        uid_value = [shot.unique_id]
        if shot.buffer is not None:
            for name in NODE_WIDE_COUNTERS:
                kind = GaugeMetricFamily if name in NODE_WIDE_GAUGES else CounterMetricFamily
                family = kind(
                    f"ucm_buffer_{name}",
                    f"CacheBuffer {name.replace('_', ' ')} (node-wide, shared by every rank).",
                    labels=uid,
                )
                family.add_metric(uid_value, shot.buffer[name])
                yield family
        if shot.occupancy is not None:
            occupancy = shot.occupancy
            slots = GaugeMetricFamily(
                "ucm_buffer_slots",
                "CacheBuffer slots by state (node-wide).",
                labels=[*uid, "state"],
            )
            counts = asdict(occupancy)
            for state in _OCCUPANCY_STATES:
                slots.add_metric([*uid_value, state], counts[state])
            yield slots
            for name, help_text, number in (
                ("capacity_slots", "Regular slots of the CacheBuffer", occupancy.capacity_slots),
                (
                    "reserved_slots",
                    "Reserved-pool slots of the CacheBuffer",
                    occupancy.reserved_slots,
                ),
                ("in_use_slots", "Slots some process holds a reference on", occupancy.in_use),
                ("waiters", "Ranks waiting right now for another rank's load", occupancy.waiters),
            ):
                gauge = GaugeMetricFamily(
                    f"ucm_buffer_{name}", f"{help_text} (node-wide).", labels=uid
                )
                gauge.add_metric(uid_value, number)
                yield gauge
        if shot.attached_pids is not None:
            attached = GaugeMetricFamily(
                "ucm_buffer_attached_processes",
                "Live processes registered on the CacheBuffer (node-wide).",
                labels=uid,
            )
            attached.add_metric(uid_value, len(shot.attached_pids))
            yield attached
        if shot.hit_rate is not None:
            ratio = GaugeMetricFamily(
                "ucm_buffer_hit_ratio",
                "CacheBuffer Get hits / (hits + misses) since creation (node-wide).",
                labels=uid,
            )
            ratio.add_metric(uid_value, shot.hit_rate)
            yield ratio
        kept = labelled_namespaces(shot.namespaces, shot.namespace_tiers)
        if shot.namespaces:
            grouped = namespace_labels(shot.namespaces, kept)
            for figure, figure_kind, help_text in _NAMESPACE_FIGURES:
                family_type = GaugeMetricFamily if figure_kind == "gauge" else CounterMetricFamily
                by_namespace = family_type(
                    f"ucm_buffer_namespace_{figure}",
                    f"{help_text} (node-wide).",
                    labels=[*uid, "namespace"],
                )
                for name, figures in grouped.items():
                    by_namespace.add_metric([*uid_value, name], figures[figure])
                yield by_namespace
        labels = [*uid, "device_id"]
        label_values = [*uid_value, str(shot.device_id)]
        for name, value in sorted(shot.process.items()):
            if not _is_number(value):
                continue
            metric = _metric_name(name)
            if name in ("hit_rate", "write_queue_bytes", "write_snapshot_bytes"):
                gauge = GaugeMetricFamily(
                    f"ucm_store_{metric}", f"Store {name} (this process).", labels=labels
                )
                gauge.add_metric(label_values, float(value))
                yield gauge
            else:
                counter = CounterMetricFamily(
                    f"ucm_store_{metric}", f"Store {name} (this process).", labels=labels
                )
                counter.add_metric(label_values, float(value))
                yield counter
        families: dict[str, GaugeMetricFamily] = {}
        for position, tier in enumerate(shot.tiers):
            tier_labels = [*label_values, str(position), str(tier.get("type", ""))]
            for name, value in tier.items():
                if not _is_number(value):
                    continue
                metric = f"ucm_tier_{_metric_name(name)}"
                if metric not in families:
                    families[metric] = GaugeMetricFamily(
                        metric,
                        f"Tier counter {name} (this process's view).",
                        labels=[*labels, "tier", "type"],
                    )
                families[metric].add_metric(tier_labels, float(value))
        yield from families.values()
        yield from self._tier_namespaces(shot, labels, label_values, kept)
        states = GaugeMetricFamily(
            "ucm_tier_breaker_state",
            "A lower tier's circuit breaker: 1 for its current state (closed, open, half_open).",
            labels=[*labels, "tier", "type", "state"],
        )
        for position, tier in enumerate(shot.tiers):
            current = tier.get("breaker_state")
            if not isinstance(current, str):
                continue  # the buffer: no breaker
            tier_labels = [*label_values, str(position), str(tier.get("type", ""))]
            for state in BREAKER_STATES:
                states.add_metric([*tier_labels, state], 1.0 if state == current else 0.0)
        yield states

    @staticmethod
    def _tier_namespaces(
        shot: Snapshot, labels: list[str], label_values: list[str], kept: set[str]
    ) -> Iterator[Metric]:
        """``ucm_tier_namespace_*``: each lower tier's bytes and evictions per namespace,
        grouped like the buffer's; a tier that cannot tell (None) has no series (unknown, not
        zero)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        positions = {str(tier.get("name")): position for position, tier in enumerate(shot.tiers)}
        for figure, figure_kind, help_text in _TIER_NAMESPACE_FIGURES:
            family_type = GaugeMetricFamily if figure_kind == "gauge" else CounterMetricFamily
            family = family_type(
                f"ucm_tier_namespace_{figure}",
                f"{help_text} (bytes: the tier's content as of its last scan, moved by this "
                "process's writes since; evictions: this process's).",
                labels=[*labels, "tier", "type", "namespace"],
            )
            for label, per_namespace in shot.namespace_tiers.items():
                position = positions.get(label)
                if per_namespace is None or position is None:
                    continue
                tier_values = [
                    *label_values,
                    str(position),
                    str(shot.tiers[position].get("type", "")),
                ]
                for name, figures in namespace_labels(per_namespace, kept).items():
                    family.add_metric([*tier_values, name], figures[figure])
            yield family


class CountersCollector:
    """An engine integration's own counters, read on every scrape: ``read()`` gives each
    counter's value now; names in ``gauges`` are levels (exported as ``ucm_<engine>_<name>``),
    the others only grow (``ucm_<engine>_<name>_total``). Every metric carries the
    ``unique_id`` label, as the store's."""

    def __init__(
        self,
        engine: str,
        unique_id: str,
        read: Callable[[], Mapping[str, int]],
        gauges: frozenset[str] = frozenset(),
    ) -> None:
        self.engine = engine
        self.unique_id = unique_id
        self.read = read
        self.gauges = gauges

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, value in sorted(self.read().items()):
            words = name.replace("_", " ")
            kind = GaugeMetricFamily if name in self.gauges else CounterMetricFamily
            family = kind(
                _metric_name(f"ucm_{self.engine}_{name}"),
                f"The {self.engine} integration's {words} (this process).",
                labels=["unique_id"],
            )
            family.add_metric([self.unique_id], value)
            yield family


def registry_for(store: Store, *extra: CountersCollector) -> CollectorRegistry:
    """A fresh registry holding this store's collector and ``extra`` (an integration's)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    for collector in extra:
        registry.register(collector)
    return registry


def render(store: Store) -> bytes:
    """The Prometheus text exposition of the store's metrics (no network)."""
    from prometheus_client import generate_latest

    return generate_latest(registry_for(store))


class MetricsServer:
    """A running metrics endpoint; :attr:`port` is the bound port. Close it (or use ``with``)."""

    def __init__(self, host: str, port: int, server: Any, thread: threading.Thread) -> None:
        self.host = host
        self.port = port
        self._server = server
        self._thread = thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def serve(
    store: Store, port: int = 0, host: str = "127.0.0.1", *extra: CountersCollector
) -> MetricsServer:
    """Serves ``/metrics`` for ``store`` (and ``extra``, an integration's counters) on a
    loopback address in a daemon thread.

    ``port=0`` picks a free port (read it from the result). Only loopback addresses are allowed:
    the endpoint has no authentication, so expose it beyond the host through something that has
    (a reverse proxy, an agent scraping locally).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgumentError(f"port={port!r} is not valid: expected an integer in [0, 65535]")
    if not _is_loopback(host):
        raise InvalidArgumentError(
            f"host={host!r} is not valid: the metrics endpoint listens on a loopback address "
            "only (127.0.0.1, ::1 or localhost); it has no authentication"
        )
    from prometheus_client import start_http_server

    try:
        server, thread = start_http_server(port, addr=host, registry=registry_for(store, *extra))
    except OSError as exc:
        raise InvalidArgumentError(
            f"port={port} is not valid: cannot listen on it ({exc})"
        ) from exc
    return MetricsServer(host, int(server.server_port), server, thread)


def _is_loopback(host: object) -> bool:
    if not isinstance(host, str):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
