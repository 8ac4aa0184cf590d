"""Admission: which shards a lower tier accepts (``admit:`` of a tier below the CacheBuffer).

A tier with ``admit: always`` (the default) gets every shard as its ``write:`` policy says. A
gated tier (``{after_reuse: N}``, ``{min_residency_ms: T}``, or both) gets a shard only once it
is *admitted*, and then at once, by whichever process of the node admits it:

- **Use counts** are the CacheBuffer's (``Slot.reuses``, native, node-wide): every Get that
  finds the shard resident counts one use (a hit, a wait on another rank's load, a pin), in
  any rank or engine of the node; look-ups, touches and prefetch do not. A slot that is
  evicted or removed takes its count with it.
- **After every load and dump** of this process its keys are checked: a key whose count
  reached N is admitted (with a minimum residency too, only once it survived it).
- **Residency**: T milliseconds after a dump of this process, its keys still in the CacheBuffer
  are marked as having survived T, and admitted when their count allows.
- **Exactly once**: admission sets a per-tier bit in the slot under its bucket lock
  (``Buffer.admit``), so one process writes the shard, from the slot (held meanwhile).
- **A removal meanwhile is final**: a purge or a forced remove that ran while a shard was
  written here (:mod:`ucm.finality`) removes it here again once the write has landed.
- **A failed write is retried**: when the gated tier fails the write of an admitted shard
  (an error or a raising tier), its bit is cleared (``Buffer.unadmit``)
  before the slot is released, so the shard's next use admits it again
  (``admission_failures`` counts the failed writes).

What the write policies mean for a gated tier:

- ``write: through``: a dump does not write the shard; it is written at admission.
- ``write: back``: the flushers never write it; a dirty shard that was not admitted when its
  debt is paid is dropped with it (not written), and leaves the buffer on eviction.
- ``close()``: pending use checks run; residency checks that are not due yet are dropped, so a
  shard that was not admitted by then is not written (counted declined).

Counters (the Store's, per process, and each tier's in ``stats()['tiers']``):
``admitted_shards``/``admitted_bytes``: written at admission; ``declined_shards``/
``declined_bytes``: writes a dump or a flush did not make because the shard was not admitted
(a later admission may still write it: the bytes saved are declined minus admitted bytes,
summed over the node's processes).
"""

from __future__ import annotations

import ctypes
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .buffer import BufferTier
from .config import AdmitConfig
from .finality import Finality, forced_remove
from .layout import Key
from .threadname import enter_thread
from .tier import Outcome, ShardViews, Tier

CHECK_INTERVAL_S = 0.005
"""How often the admission thread looks for finished loads while some are pending."""
IDLE_WAIT_S = 1.0
"""Longest the admission thread sleeps when nothing is pending (a registration wakes it)."""
CHECK_KEYS_MAX = 4096
"""Keys one admission check takes at a time (one batched claim per gated tier)."""


@dataclass
class GatedTier:
    """A lower tier with an ``admit:`` condition: its stack position, its admission index (its
    bit in the slot's flags) and its rule."""

    position: int
    index: int
    tier: Tier
    rule: AdmitConfig
    through: bool
    """``write: through`` (a dump declines it), else ``write: back`` (a flush declines it)."""
    admitted_shards: int = 0
    declined_shards: int = 0


Count = Callable[[str, int], None]


class Admission:
    """Runs the gated tiers' admission for one process: a thread that checks the keys of this
    process's finished loads and its dumps' residency deadlines."""

    def __init__(
        self, buffer: BufferTier, gated: list[GatedTier], count: Count, finality: Finality
    ) -> None:
        assert gated
        self._buffer = buffer
        self._finality = finality
        self.gated = gated
        self._count = count
        self._shard_bytes = buffer.layout.shard_size
        self._lock = threading.Condition()
        self._stats_lock = threading.Lock()
        self._loads: deque[tuple[Callable[[], bool], list[Key]]] = deque()
        self._residency: deque[tuple[float, int, list[Key]]] = deque()
        """(due time, gated tier's list position, keys): per tier in due order."""
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ucm-admission", daemon=True)
        self._thread.start()

    @property
    def positions(self) -> set[int]:
        return {gate.position for gate in self.gated}

    def declined(self, position: int, shards: int) -> None:
        """A dump or a flush left ``shards`` shards out of the gated tier at ``position``."""
        for gate in self.gated:
            if gate.position == position:
                self._count_gate(gate, declined=shards)

    def on_dump(self, keys: Sequence[Key]) -> None:
        """A dump of ``keys`` was submitted: the dump does not write them to the gated tiers
        (declined for now); schedule the residency checks."""
        if not keys:
            return
        now = time.monotonic()
        with self._lock:
            for list_position, gate in enumerate(self.gated):
                if gate.through:
                    self._count_gate(gate, declined=len(keys))
                if gate.rule.min_residency_ms is not None:
                    due = now + gate.rule.min_residency_ms / 1000.0
                    self._residency.append((due, list_position, list(keys)))
            self._lock.notify_all()

    def on_load(self, done: Callable[[], bool], keys: Sequence[Key]) -> None:
        """A load (or dump) of ``keys`` was submitted; once ``done()`` they are checked."""
        if keys:
            with self._lock:
                self._loads.append((done, list(keys)))
                self._lock.notify_all()

    def check(self, keys: Sequence[Key], mature: GatedTier | None = None) -> int:
        """Admits the keys that meet their gated tiers' rules now (``mature``: that tier's
        residency check), writes them there from the buffer, returns the shard writes made."""
        written = 0
        for start in range(0, len(keys), CHECK_KEYS_MAX):
            part = list(keys[start : start + CHECK_KEYS_MAX])
            for gate in self.gated:
                if mature is not None and gate is not mature:
                    continue
                written += self._admit(gate, part, mature is gate)
        return written

    def settle(self) -> None:
        """Runs now the checks of this process's finished loads and its due residency checks
        (what ``Store.drain`` waits for)."""
        self._check_loads()
        self._check_residency(time.monotonic())

    def close(self) -> None:
        """Runs the checks of finished loads (waiting for none) and drops the residency checks
        that are not due: their keys stay declined."""
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._thread.join()
        self._check_loads(final=True)
        self._check_residency(time.monotonic())
        self._residency.clear()

    def stats_of(self, position: int) -> dict[str, int | str]:
        for gate in self.gated:
            if gate.position == position:
                with self._stats_lock:
                    return {
                        "admit": gate.rule.describe(),
                        "admitted_shards": gate.admitted_shards,
                        "admitted_bytes": gate.admitted_shards * self._shard_bytes,
                        "declined_shards": gate.declined_shards,
                        "declined_bytes": gate.declined_shards * self._shard_bytes,
                    }
        return {}

    # ---- internals --------------------------------------------------------------------------

    def _count_gate(self, gate: GatedTier, *, admitted: int = 0, declined: int = 0) -> None:
        with self._stats_lock:
            gate.admitted_shards += admitted
            gate.declined_shards += declined
        if admitted:
            self._count("admitted_shards", admitted)
            self._count("admitted_bytes", admitted * self._shard_bytes)
        if declined:
            self._count("declined_shards", declined)
            self._count("declined_bytes", declined * self._shard_bytes)

    def _admit(self, gate: GatedTier, keys: list[Key], mature: bool) -> int:
        rule = gate.rule
        since = self._finality.start()  # before the slots (the bytes written) are taken
        batch = self._buffer.queue.take_admitted(
            keys,
            reuses_min=rule.after_reuse or 0,
            tier=gate.index,
            mature=mature,
            needs_mature=rule.min_residency_ms is not None,
        )
        if not batch.keys:
            return 0
        try:
            try:
                size = self._shard_bytes
                views: list[ShardViews] = [
                    [memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")]
                    for address in self._buffer.core.slot_addresses(batch.slots, self._buffer.bases)
                ]
                outcomes: Sequence[Outcome] = gate.tier.dump(batch.keys, views)
            except Exception as exc:  # a raising tier fails the batch
                outcomes = [exc] * len(batch.keys)
            failed = array(
                "I",
                [
                    slot
                    for slot, outcome in zip(batch.slots, outcomes, strict=True)
                    if outcome is not None
                ],
            )
            if failed:
                # Admitted (the bit is set node-wide) but not written: the tier failed it.
                # The bit is cleared while the slot is still held, so a later use admits the
                # shard again; left set, no process would ever write it there.
                self._buffer.queue.unadmit(failed, gate.index)
            # A purge or a forced remove that ran meanwhile: what it covers goes again (every
            # key of the batch: a raising tier may have written some).
            self._finality.settle(since, batch.keys, forced_remove([gate.tier]))
        finally:
            self._buffer.queue.release(batch.slots)
        written = len(batch.keys) - len(failed)
        self._count_gate(gate, admitted=written)
        if failed:
            self._count("admission_failures", len(failed))
        return written

    def _check_loads(self, final: bool = False) -> None:
        ready: list[Key] = []
        with self._lock:
            waiting: deque[tuple[Callable[[], bool], list[Key]]] = deque()
            while self._loads:
                done, keys = self._loads.popleft()
                if done():
                    ready.extend(keys)
                elif not final:
                    waiting.append((done, keys))
            self._loads = waiting
        if ready:
            self.check(list(dict.fromkeys(ready)))

    def _check_residency(self, now: float) -> None:
        due: list[tuple[int, list[Key]]] = []
        with self._lock:
            later: deque[tuple[float, int, list[Key]]] = deque()
            while self._residency:
                entry = self._residency.popleft()
                if entry[0] <= now:
                    due.append((entry[1], entry[2]))
                else:
                    later.append(entry)
            self._residency = later
        for list_position, keys in due:
            self.check(keys, mature=self.gated[list_position])

    def _run(self) -> None:
        enter_thread()
        while True:
            with self._lock:
                if self._stop:
                    return
                # Idle (nothing pending): sleep until a load or dump is registered.
                if self._loads:
                    timeout: float | None = CHECK_INTERVAL_S
                elif self._residency:
                    due = min(entry[0] for entry in self._residency)
                    timeout = max(0.0, min(due - time.monotonic(), IDLE_WAIT_S))
                else:
                    timeout = IDLE_WAIT_S
                self._lock.wait(timeout)
                if self._stop:
                    return
            try:
                self._check_loads()
                self._check_residency(time.monotonic())
            except Exception:  # never let the thread die silently; retried next round
                self._count("admission_failures", 1)
