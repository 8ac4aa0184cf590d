"""A purge or a forced remove is final: no write to a lower tier that was under way brings a
removed block back once the removal has returned.

**The remover** (``Store.purge``, ``Store.remove(force=True)``, any process: ``ucm purge``
included) clears the CacheBuffer first, then records the removal in the removal log
(:mod:`ucm.native.removals`: a generation and a ring of recent removals, in the buffer's
shared control plane, or this process's own without a buffer), then clears the tiers below.

**Every writer to a lower tier** (admission, the write-through backlog, the write-back
flushers and eviction, the no-buffer dumps into the top tier, the straight writes of keys the
buffer refused) goes through :class:`Finality`:

1. :meth:`Finality.start` reads the generation *before* it captures the bytes it will write
   (takes the slot, or dumps into the buffer);
2. just before the bytes land, :meth:`Finality.unremoved` drops the keys removed since;
3. once they have landed, :meth:`Finality.settle` removes again, from the tiers it wrote,
   every key a removal since ``start`` covers (a purge of the key's namespace, a forced remove
   of its block), unless the buffer holds the key again (a later dump: the block is wanted).
   When the ring no longer holds the whole window (more than ``REMOVAL_LOG_ENTRIES`` removals
   since), it fails closed: every key it wrote that the buffer does not hold is removed.

Why that suffices: a write that lands in a tier after the removal cleared it carries bytes
captured before the removal cleared the buffer (else they are a later dump's), so its start
generation is below the removal's, and its check after landing comes after the removal was
recorded: it finds it. A write that landed before the tier was cleared is removed by the
removal itself.

Counters (one set, every path): ``writes_retracted`` (keys removed again, or not written,
because a removal covered them) and ``retract_failures`` (such removals that failed: logged,
never raised).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from . import namespaces
from .layout import Key
from .native.removals import RemovalKind, RemovalLog

if TYPE_CHECKING:
    from .tier import Tier

logger = logging.getLogger(__name__)

Held = Callable[[Sequence[Key]], list[bool]]
"""Per key, whether the CacheBuffer holds it now."""
Retract = Callable[[Sequence[Key]], None]
"""Removes keys (forced) from the tiers a writer wrote them to."""


class Finality:
    """The writers' side of the removal log, and the removers' record of what they remove."""

    def __init__(self, log: RemovalLog, held: Held | None = None) -> None:
        self.log = log
        self._held = held
        self._held_lock = threading.Lock()
        """Held while ``held`` runs: :meth:`detach` returns only once no call is in it."""
        self._lock = threading.Lock()
        self._counts = {"writes_retracted": 0, "retract_failures": 0}

    # ---- removers -----------------------------------------------------------------------------

    def record_purge(self, namespace: str) -> None:
        """A purge of ``namespace`` clears the tiers below next."""
        self.log.append_purge(namespaces.tag(namespace))

    def record_removes(self, block_ids: Sequence[bytes]) -> None:
        """A forced remove of the blocks (scoped ids) clears the tiers below next."""
        self.log.append_removes(block_ids)

    # ---- writers ------------------------------------------------------------------------------

    def start(self) -> int:
        """The generation a write starts from: read before its bytes are captured."""
        return self.log.generation()

    def removed(self, start: int, keys: Sequence[Key]) -> list[bool]:
        """Per key, whether a removal recorded after ``start`` covers it (every key when the
        ring no longer holds the whole window)."""
        removals = self.log.since(start)
        if removals is None:
            return [True] * len(keys)
        if not removals:
            return [False] * len(keys)
        blocks = {r.id for r in removals if r.kind == RemovalKind.REMOVE}
        tags = {r.id[: namespaces.TAG_BYTES] for r in removals if r.kind == RemovalKind.PURGE}
        return [
            key[0] in blocks or any(namespaces.purge_covers(t, key[0]) for t in tags)
            for key in keys
        ]

    def unremoved(self, start: int, keys: Sequence[Key]) -> list[int]:
        """Just before a write lands: the positions of the keys no removal since ``start``
        covers (the others are not written; counted in ``writes_retracted``)."""
        removed = self.removed(start, keys)
        dropped = sum(removed)
        if dropped:
            self._count("writes_retracted", dropped)
        return [i for i, gone in enumerate(removed) if not gone]

    def settle(self, start: int, keys: Sequence[Key], retract: Retract) -> int:
        """Once a write of ``keys`` has landed: removes again, through ``retract``, each key a
        removal since ``start`` covers and that the buffer does not hold again. Returns how
        many; a failure is logged and counted, never raised (the writer must go on)."""
        if not keys:
            return 0
        gone: list[Key] = []
        try:
            removed = self.removed(start, keys)
            gone = [key for key, away in zip(keys, removed, strict=True) if away]
            if gone:
                with self._held_lock:
                    again = self._held(gone) if self._held is not None else [False] * len(gone)
                gone = [key for key, back in zip(gone, again, strict=True) if not back]
            if gone:
                retract(gone)
        except Exception as exc:
            self._count("retract_failures", max(1, len(gone)))
            logger.warning(
                "UCM: %d shard(s) removed while they were being written to a lower tier could "
                "not be removed from it again: %r",
                len(gone),
                exc,
            )
            return 0
        self._count("writes_retracted", len(gone))
        return len(gone)

    def detach(self) -> None:
        """The buffer is closing: writes that outlive it (a write-through write that close
        left running) settle on a private copy of the log, and without asking the buffer
        whether it holds a key again (every covered key is removed again: a miss at worst)."""
        self.log.detach()
        with self._held_lock:
            self._held = None

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def _count(self, name: str, amount: int) -> None:
        if amount:
            with self._lock:
                self._counts[name] += amount


def forced_remove(tiers: Sequence[Tier]) -> Retract:
    """A :data:`Retract` that force-removes keys from each of ``tiers``."""

    def retract(keys: Sequence[Key]) -> None:
        for tier in tiers:
            tier.batched_remove(keys, force=True)

    return retract


__all__ = ["Finality", "Held", "Retract", "forced_remove"]
