"""The connector's counters: vLLM's stats objects (summed over TP ranks and the scheduler) and
its Prometheus counters ``vllm:ucm_*``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

STAT_NAMES: dict[str, str] = {
    "lookups": "requests looked up in UCM (scheduler)",
    "lookup_errors": "lookups that failed (answered as misses)",
    "lookups_deferred": "lookups still running after ucm_lookup_wait_ms: the request waited "
    "for a later step while the others ran",
    "save_lookups_skipped": "save filters still asking the store after ucm_lookup_wait_ms: the "
    "step dumped every block",
    "requests_epoch_unknown": "requests keyed while the reset epoch could not be read (a tier "
    "did not answer): their ids carry a nonce of this engine, which is served only what it "
    "saved itself",
    "compute_waits": "requests that waited for another engine on the node computing their "
    "first missing block (ucm_compute_wait_ms), instead of computing it a second time",
    "hit_tokens": "prompt tokens served from UCM",
    "hit_blocks": "blocks planned for loading from UCM",
    "loaded_blocks": "blocks loaded into vLLM's KV cache (summed over TP ranks)",
    "loaded_bytes": "bytes loaded into vLLM's KV cache",
    "load_failed_blocks": "blocks whose load failed and that vLLM recomputes",
    "load_seconds": "seconds spent loading, summed over TP ranks (a synchronous load: its "
    "wait before the forward pass; an asynchronous one: from its prefetch to its copy's end)",
    "async_loads": "asynchronous loads started (requests in WAITING_FOR_REMOTE_KVS, per TP rank)",
    "load_late_blocks": "blocks past the load deadline, reported failed and recomputed",
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
