"""Tasks: handles of submitted load/dump batches."""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field

from .errors import TaskError
from .layout import Key

_ids = itertools.count(1)


@dataclass(eq=False)
class Task:
    """A submitted batch. Pass it to ``store.wait`` or ``store.check``."""

    kind: str
    keys: list[Key]
    future: Future[dict[Key, BaseException]] = field(repr=False)
    task_id: int = field(default_factory=lambda: next(_ids))

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> None:
        """Blocks until finished; raises TaskError naming every failed key."""
        failures = self.future.result(timeout=timeout)
        if failures:
            raise TaskError(failures)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<Task {self.task_id} {self.kind} {len(self.keys)} keys {state}>"
