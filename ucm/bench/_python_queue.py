"""The hit path of UCM before issue 13, rebuilt from the same native calls, as a baseline only.

Until issue 13 a rank's LoadQueue was two Python threads: a *dispatcher* that claimed a task's
keys with one batched native Get and handed the hits to a *copier*, which copied every tensor
of the task out of its slot in one native call (the GIL released for it), released the slots
and completed the task. Here the copier merges ranges that are adjacent in both the slots and
the destinations and moves each run with one ``ctypes.memmove`` (in the benchmark's layout,
one call per task, like the old single native call). Both threads need the GIL between native
calls, so a runtime thread that holds it (a model step) stalls them. The product no longer has
this path; the hit-path benchmark runs this reduced copy of it (hits only: no owners, waiters
or Prealloc) beside the native queue so that both are measured in the same run.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Sequence
from typing import Any

from ..native.buffer import BufferCore, GetResult, KeyBatch


class PythonHitQueue:
    """Dispatcher and copier threads over ``core`` (this process's holder)."""

    def __init__(self, core: BufferCore, bases: Sequence[int], tensor_sizes: Sequence[int]):
        self._core = core
        self._bases = list(bases)
        self._sizes = list(tensor_sizes)
        self._tasks: queue.Queue[Any] = queue.Queue()
        self._copies: queue.Queue[Any] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._dispatch, daemon=True),
            threading.Thread(target=self._copy, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def load(self, keys: KeyBatch, targets: Sequence[Sequence[int]]) -> threading.Event:
        """Queues a task of Ready keys; the event is set once every shard is copied."""
        done = threading.Event()
        self._tasks.put((keys, targets, done))
        return done

    def close(self) -> None:
        self._tasks.put(None)
        for thread in self._threads:
            thread.join()

    def _dispatch(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                self._copies.put(None)
                return
            keys, targets, done = item
            batch = self._core.get(keys)
            if any(result != GetResult.HIT for result in batch.results):
                raise RuntimeError("the Python baseline queue serves Ready keys only")
            addresses = self._core.slot_addresses(batch.slots, self._bases)
            self._copies.put((batch.slots, addresses, targets, done))

    def _copy(self) -> None:
        memmove = ctypes.memmove
        sizes = self._sizes
        while True:
            item = self._copies.get()
            if item is None:
                return
            slots, addresses, targets, done = item
            runs: list[list[int]] = []  # [target, source, length], merged when adjacent
            for source, shard_targets in zip(addresses, targets, strict=True):
                for target, size in zip(shard_targets, sizes, strict=True):
                    last = runs[-1] if runs else None
                    if last and last[0] + last[2] == target and last[1] + last[2] == source:
                        last[2] += size
                    else:
                        runs.append([target, source, size])
                    source += size
            for target, source, length in runs:
                memmove(target, source, length)
            self._core.release(slots)
            done.set()
