"""Tasks: handles of submitted load/dump batches, and what completes them.

A task completes one of two ways. Tasks the native queue runs (loads, prefetches and dumps
through the buffer tier) complete natively: :class:`~ucm.loadqueue.NativeJob` waits on the
task's futex word with the GIL released. Tasks run by Python threads (stacks without a buffer
tier, and dumps that also feed ``write: through`` tiers) complete through :class:`Progress`.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Protocol

from .errors import TaskError
from .layout import Key

_ids = itertools.count(1)


class Completion(Protocol):
    """What a Task waits on."""

    def done(self) -> bool:
        """Non-blocking: whether the task finished (successfully or not)."""
        ...

    def failures(self, timeout: float | None) -> dict[Key, BaseException]:
        """Blocks until finished; the failed keys and why. TimeoutError if still running."""
        ...


class KeyList(Protocol):
    """Keys built on demand (``ucm.arguments.TaskKeys``): a task that succeeds needs none."""

    @property
    def keys(self) -> list[Key]: ...

    def __len__(self) -> int: ...


class Task:
    """A submitted batch. Pass it to ``store.wait`` or ``store.check``."""

    __slots__ = ("_keys", "completion", "kind", "task_id")

    def __init__(self, kind: str, keys: list[Key] | KeyList, completion: Completion) -> None:
        self.kind = kind
        self._keys = keys
        self.completion = completion
        self.task_id = next(_ids)

    @property
    def keys(self) -> list[Key]:
        """The task's (block id, shard index) keys, in submission order."""
        keys = self._keys
        return keys if isinstance(keys, list) else keys.keys

    def done(self) -> bool:
        return self.completion.done()

    def result(self, timeout: float | None = None) -> None:
        """Blocks until finished; raises TaskError naming every failed key, or TimeoutError
        (the task still running) once ``timeout`` seconds have passed."""
        try:
            failures = self.completion.failures(timeout)
        except TimeoutError:
            if timeout is None or self.completion.done():
                raise  # the task's own failure (a completion that raised), not the bound
            raise TimeoutError(
                f"task {self.task_id} ({self.kind} of {len(self._keys)} keys) did not finish "
                f"within {timeout:g} s; it is still running: keep its memory until "
                "store.check(task) is True"
            ) from None
        if failures:
            raise TaskError(failures)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<Task {self.task_id} {self.kind} {len(self._keys)} keys {state}>"


class Progress:
    """Counts a task's entries down as Python threads finish them (in any order, from any
    thread); the last one completes the task with every failure, after ``on_complete``."""

    def __init__(
        self,
        keys: list[Key],
        on_complete: Callable[[Progress], None] | None = None,
    ) -> None:
        self.keys = keys
        self.future: Future[dict[Key, BaseException]] = Future()
        self.failures_seen: dict[Key, BaseException] = {}
        self._remaining = len(keys)
        self._finished = [False] * len(keys)
        self._lock = threading.Lock()
        self._on_complete = on_complete
        if not keys:
            self._complete()

    def done(self) -> bool:
        return self.future.done()

    def failures(self, timeout: float | None) -> dict[Key, BaseException]:
        return self.future.result(timeout=timeout)

    def finish(self, indices: Iterable[int], failure: BaseException | None = None) -> None:
        """Marks entries done (failed with ``failure`` when given). Idempotent per entry."""
        with self._lock:
            newly = 0
            for i in indices:
                if self._finished[i]:
                    continue
                self._finished[i] = True
                newly += 1
                if failure is not None:
                    self.failures_seen[self.keys[i]] = failure
            self._remaining -= newly
            complete = newly > 0 and self._remaining == 0
        if complete:
            self._complete()

    def fail(self, failures: dict[int, BaseException]) -> None:
        for i, failure in failures.items():
            self.finish([i], failure)

    def unfinished(self) -> list[int]:
        with self._lock:
            return [i for i, done in enumerate(self._finished) if not done]

    def _complete(self) -> None:
        try:
            if self._on_complete is not None:
                self._on_complete(self)
        except BaseException as exc:  # completing must never leave the task hanging
            self.future.set_exception(exc)
            return
        self.future.set_result(dict(self.failures_seen))
