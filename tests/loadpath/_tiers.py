"""Test tiers for the load path, in an importable module so that spawned rank processes can
register them too (``register()`` in each child): a posix tier with per-shard latency and
injected load and dump failures, and an in-process tier that records load order and can serve
corrupt data."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field
from ucm_backends.posix import PosixConfig, PosixTier

import ucm
from ucm.config import LowerTierConfig
from ucm.errors import KeyMissingError, TierError
from ucm.layout import Key
from ucm.plugins import pm
from ucm.tier import Outcome, ShardViews, Tier, TierContext, scatter

PLUGIN_NAME = "test-loadpath-tiers"


class SlowPosixConfig(PosixConfig):
    type: Literal["slowposix"] = "slowposix"  # type: ignore[assignment]
    delay_s: float = Field(default=0.0, ge=0)
    """Latency per shard loaded: a batch of k shards takes k * delay_s (one request at a time
    per call; concurrent calls, from threads or processes, overlap)."""
    fail_keys: tuple[str, ...] = ()
    """``"<block hex>:<shard>"`` keys whose load fails with TierError (fault injection)."""
    dump_gate: str | None = None
    """Hold every dump until GATES[dump_gate] is set (ENTERED[dump_gate] says one arrived)."""
    dump_gate_file: str | None = None
    """Hold every dump until this file exists (a gate another process opens); the tier
    creates ``<dump_gate_file>.entered`` when a dump arrives."""
    fail_dumps: int = Field(default=0, ge=0)
    """The first ``fail_dumps`` shards dumped (by this process) fail with TierError and are
    not written: a tier that is down, then back."""


class SlowPosixTier(PosixTier):
    type_name = "slowposix"
    config_model = SlowPosixConfig

    def __init__(self, config: ucm.TierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        assert isinstance(config, SlowPosixConfig)
        self.slow = config
        self.injected = 0
        self.dump_failures_left = config.fail_dumps
        self.injected_dump_failures = 0
        self.dump_lock = threading.Lock()

    def load(self, keys: Sequence[Key], destinations: Sequence[ShardViews]) -> list[Outcome]:
        time.sleep(self.slow.delay_s * len(keys))
        failing = [f"{b.hex()}:{s}" in self.slow.fail_keys for b, s in keys]
        outcomes: list[Outcome] = [None] * len(keys)
        chosen = [i for i, fails in enumerate(failing) if not fails]
        for i, fails in enumerate(failing):
            if fails:
                self.injected += 1
                outcomes[i] = TierError("injected failure in slowposix")
        loaded = super().load([keys[i] for i in chosen], [destinations[i] for i in chosen])
        for i, outcome in zip(chosen, loaded, strict=True):
            outcomes[i] = outcome
        return outcomes

    def dump(self, keys: Sequence[Key], sources: Sequence[ShardViews]) -> list[Outcome]:
        gate = self.slow.dump_gate
        if gate is not None:
            ENTERED.setdefault(gate, threading.Event()).set()
            if not GATES.setdefault(gate, threading.Event()).wait(GATE_TIMEOUT_S):
                raise TierError(f"the test never opened the gate {gate!r}")
        if self.slow.dump_gate_file is not None:
            wait_for_file(self.slow.dump_gate_file, entered=True)
        with self.dump_lock:
            failing = min(self.dump_failures_left, len(keys))
            self.dump_failures_left -= failing
            self.injected_dump_failures += failing
        outcomes: list[Outcome] = [TierError("injected dump failure in slowposix")] * failing
        return outcomes + super().dump(keys[failing:], sources[failing:])

    def stats(self) -> dict[str, int | float]:
        return {
            **super().stats(),
            "injected": self.injected,
            "injected_dump_failures": self.injected_dump_failures,
        }


GATE_FILE_POLL_S = 0.01


def wait_for_file(path: str, entered: bool = False) -> None:
    """Waits (bounded by GATE_TIMEOUT_S) until ``path`` exists: a gate between processes,
    which share no event; ``entered`` first creates ``<path>.entered``."""
    if entered:
        Path(path + ".entered").touch()
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TierError(f"the test never created the gate file {path!r}")
        time.sleep(GATE_FILE_POLL_S)


RECORDED: dict[str, list[Key]] = {}
"""Keys each RecordingTier loaded, in order, by its `space`."""
CONTENTS: dict[str, dict[Key, bytes]] = {}
CORRUPT: dict[str, set[Key]] = {}
"""Keys a RecordingTier serves as corrupt (a TierError) until they are written again."""
CONTROLS: dict[str, dict[bytes, int]] = {}
"""Control records per space (read_control/raise_control), outside the blocks."""
GATES: dict[str, threading.Event] = {}
"""A ``gated`` RecordingTier holds every load and dump until GATES[space] is set: a test orders
events by what the tier is doing, never by sleeping."""
ENTERED: dict[str, threading.Event] = {}
"""Set by a ``gated`` RecordingTier when a load or dump reaches it (and waits at the gate)."""
GATE_TIMEOUT_S = 120.0
"""Bound on a wait at a gate that a test forgot to open (it then fails, never hangs)."""


class RecordingConfig(LowerTierConfig):
    type: Literal["recording"] = "recording"
    space: str
    delay_s: float = 0.0
    gated: bool = False


class RecordingTier(Tier):
    """In-process dict tier: records load order; keys in CORRUPT[space] fail with a TierError
    (not a miss) until a dump replaces them."""

    type_name = "recording"
    config_model = RecordingConfig

    def __init__(self, config: ucm.TierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        assert isinstance(config, RecordingConfig)
        self.cfg = config
        self.data = CONTENTS.setdefault(config.space, {})
        self.order = RECORDED.setdefault(config.space, [])
        self.corrupt = CORRUPT.setdefault(config.space, set())
        self.controls = CONTROLS.setdefault(config.space, {})
        self.lock = threading.Lock()

    def _pass_gate(self) -> None:
        if not self.cfg.gated:
            return
        ENTERED.setdefault(self.cfg.space, threading.Event()).set()
        if not GATES.setdefault(self.cfg.space, threading.Event()).wait(GATE_TIMEOUT_S):
            raise TierError(f"the test never opened the gate of {self.cfg.space}")

    def lookup(self, keys: Sequence[Key]) -> list[bool]:
        with self.lock:
            return [key in self.data and key not in self.corrupt for key in keys]

    def load(self, keys: Sequence[Key], destinations: Sequence[ShardViews]) -> list[Outcome]:
        self._pass_gate()
        outcomes: list[Outcome] = []
        for key, views in zip(keys, destinations, strict=True):
            time.sleep(self.cfg.delay_s)
            with self.lock:
                self.order.append(key)
                data = self.data.get(key)
                corrupt = key in self.corrupt
            if corrupt:
                outcomes.append(TierError(f"corrupt shard in {self.cfg.space}"))
            elif data is None:
                outcomes.append(KeyMissingError("absent"))
            else:
                scatter(data, views)
                outcomes.append(None)
        return outcomes

    def dump(self, keys: Sequence[Key], sources: Sequence[ShardViews]) -> list[Outcome]:
        self._pass_gate()
        blobs = [b"".join(bytes(v) for v in views) for views in sources]
        with self.lock:
            for key, blob in zip(keys, blobs, strict=True):
                self.data[key] = blob
                self.corrupt.discard(key)
        return [None] * len(keys)

    def touch(self, block_ids: Sequence[bytes]) -> None:
        pass

    def read_control(self, names: Sequence[bytes]) -> list[int | None]:
        """Control records (a reset's epoch), kept per space beside the blocks, outside them."""
        with self.lock:
            return [self.controls.get(name) for name in names]

    def raise_control(self, name: bytes, value: int) -> None:
        with self.lock:
            self.controls[name] = max(value, self.controls.get(name, 0))

    def batched_remove(self, keys: Sequence[Key], force: bool = False) -> int:
        with self.lock:
            removed = [key for key in dict.fromkeys(keys) if self.data.pop(key, None) is not None]
        return len(removed)

    def stats(self) -> dict[str, int | float]:
        return {"hits": 0, "misses": 0, "loads": len(self.order)}


class Plugin:
    @ucm.hookimpl
    def register_tiers(self, register: Callable[[type[Tier]], None]) -> None:
        register(SlowPosixTier)
        register(RecordingTier)


def register() -> None:
    """Registers the test tiers in this process (idempotent)."""
    if pm.get_plugin(PLUGIN_NAME) is None:
        pm.register(Plugin(), name=PLUGIN_NAME)


def unregister() -> None:
    if pm.get_plugin(PLUGIN_NAME) is not None:
        pm.unregister(name=PLUGIN_NAME)


def block(n: int) -> bytes:
    return n.to_bytes(16, "big")


def payload(block_id: bytes, shard: int, size: int) -> bytes:
    unit = block_id + shard.to_bytes(4, "big") + b"load"
    return (unit * (size // len(unit) + 1))[:size]
