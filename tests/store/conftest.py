"""Fixtures for Store tests: an in-process dict tier with fault injection, registered through
the same plugin hook third parties use."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Literal

import pytest

import ucm
from ucm.config import LowerTierConfig
from ucm.errors import KeyMissingError, TierError
from ucm.layout import Key
from ucm.plugins import pm
from ucm.tier import Outcome, ShardViews, Tier, chunks, scatter

SHARED: dict[str, dict[Key, bytes]] = {}
"""Contents of every DictTier by its `space`, so tests can inspect what each tier holds."""


class DictTierConfig(LowerTierConfig):
    type: Literal["dict"] = "dict"
    space: str
    capacity_shards: int | None = None
    fail_blocks: tuple[str, ...] = ()
    """Hex block ids whose load and dump fail with TierError (fault injection)."""


class DictTier(Tier):
    type_name = "dict"
    config_model = DictTierConfig

    def __init__(self, config: DictTierConfig, context: ucm.TierContext) -> None:  # type: ignore[override]
        super().__init__(config, context)
        self.cfg = config
        self.data = SHARED.setdefault(config.space, {})
        self.lock = threading.Lock()
        self.calls: dict[str, int] = {"load": 0, "dump": 0, "lock_acquisitions": 0}
        self.order: list[Key] = []

    def _fails(self, key: Key) -> bool:
        return key[0].hex() in self.cfg.fail_blocks

    def lookup(self, keys: Sequence[Key]) -> list[bool]:
        with self.lock:
            return [key in self.data for key in keys]

    def load(self, keys: Sequence[Key], destinations: Sequence[ShardViews]) -> list[Outcome]:
        self.calls["load"] += 1
        outcomes: list[Outcome] = []
        for key, views in zip(keys, destinations, strict=True):
            if self._fails(key):
                outcomes.append(TierError(f"injected failure in {self.cfg.space}"))
                continue
            with self.lock:
                data = self.data.get(key)
            if data is None:
                outcomes.append(KeyMissingError("absent"))
                continue
            scatter(data, views)
            outcomes.append(None)
        return outcomes

    def dump(self, keys: Sequence[Key], sources: Sequence[ShardViews]) -> list[Outcome]:
        self.calls["dump"] += 1
        outcomes: list[Outcome] = []
        for key, views in zip(keys, sources, strict=True):
            if self._fails(key):
                outcomes.append(TierError(f"injected failure in {self.cfg.space}"))
                continue
            data = b"".join(bytes(v) for v in views)
            with self.lock:
                self.data[key] = data
                self.order.append(key)
                self._evict_over_capacity()
            outcomes.append(None)
        return outcomes

    def _evict_over_capacity(self) -> None:
        limit = self.cfg.capacity_shards
        while limit is not None and len(self.data) > limit:
            victim = next(k for k in self.order if k in self.data)
            sink = self.context.evict_sink
            if sink is not None:
                outcome = sink([victim], [[memoryview(self.data[victim])]])[0]
                if outcome is not None:
                    return  # keep the only copy
            self.order.remove(victim)
            del self.data[victim]

    def touch(self, block_ids: Sequence[bytes]) -> None:
        pass

    def batched_remove(self, keys: Sequence[Key], force: bool = False) -> int:
        removed = 0
        for chunk in chunks(list(dict.fromkeys(keys))):
            with self.lock:
                self.calls["lock_acquisitions"] += 1
                for key in chunk:
                    if key in self.data and (force or not self.pins.is_pinned(key)):
                        del self.data[key]
                        removed += 1
        return removed

    def stats(self) -> dict[str, int | float]:
        return {"shards": len(self.data), **self.calls}


class DictTierPlugin:
    @ucm.hookimpl
    def register_tiers(self, register):  # type: ignore[no-untyped-def]
        register(DictTier)


@pytest.fixture
def dict_tier() -> Iterator[type[DictTier]]:
    plugin = DictTierPlugin()
    pm.register(plugin, name="test-dict-tier")
    SHARED.clear()
    try:
        yield DictTier
    finally:
        pm.unregister(name="test-dict-tier")
        SHARED.clear()


def block(n: int) -> bytes:
    return n.to_bytes(16, "big")


def payload(block_id: bytes, shard: int, size: int) -> bytes:
    unit = block_id + shard.to_bytes(4, "big") + b"ucm!"
    return (unit * (size // len(unit) + 1))[:size]
