"""One launcher for multi-rank runs: rank processes started fresh (``spawn``), a Barrier they
meet at, and a queue each rank puts its report on.

Used by ``ucm demo``, the multi-rank benchmarks and the multi-process tests, so that starting,
collecting and cleaning up rank processes is written once::

    with RankGroup(parties=4) as group:
        for rank in range(4):
            group.spawn(worker, rank, config, group.barrier, group.results)
        reports = group.reports(timeout=300)

``spawn``, not ``fork``: a rank is a fresh interpreter like an engine's worker process, and a
forked child would inherit the parent's threads and mappings (the native queue's threads, an
open buffer) in whatever state they were. Leaving the ``with`` block joins every process (each
one bounded) and kills any still alive, so a failing caller never leaves ranks behind.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections.abc import Callable
from multiprocessing.context import SpawnContext, SpawnProcess
from types import TracebackType
from typing import Any

from .errors import UcmError

POLL_S = 0.2
"""How often ``reports`` looks at the processes while it waits."""
KILL_WAIT_S = 10.0
"""How long a killed process gets to be reaped."""


class RankError(UcmError):
    """Rank processes ended, or the wait ran out, without every report."""


class RankGroup:
    """Spawned rank processes sharing ``barrier`` (of ``parties``) and ``results``."""

    def __init__(self, parties: int, join_timeout: float = 30.0) -> None:
        """``join_timeout``: how long leaving the group waits for each process to exit by
        itself before killing it (0: kill whatever is still running at once)."""
        if not (isinstance(parties, int) and parties >= 1):
            raise ValueError(f"parties={parties!r} is not valid: expected an int >= 1")
        self.context: SpawnContext = multiprocessing.get_context("spawn")
        self.barrier = self.context.Barrier(parties)
        self.results: multiprocessing.Queue[Any] = self.context.Queue()
        self.processes: list[SpawnProcess] = []
        self.join_timeout = join_timeout

    def queue(self) -> multiprocessing.Queue[Any]:
        """Another queue shared with the ranks (say for progress)."""
        return self.context.Queue()

    def spawn(
        self, target: Callable[..., Any], *args: Any, name: str | None = None
    ) -> SpawnProcess:
        """Starts ``target(*args)`` in a new process (pass ``self.barrier``/``self.results``
        among ``args`` where the target takes them)."""
        process = self.context.Process(target=target, args=args, name=name)
        process.start()
        self.processes.append(process)
        return process

    def reports(
        self,
        timeout: float,
        expected: int | None = None,
        partial: bool = False,
        tick: Callable[[], None] | None = None,
    ) -> list[Any]:
        """``expected`` reports (one per process by default) from ``results``, in the order they
        arrive. ``timeout`` bounds the wait for each next report (as a ``get(timeout=...)``
        per report would). Stops early when every process has exited and the queue is
        drained: then, and when the timeout passes, it raises RankError naming the exit codes,
        unless ``partial`` (then it returns what arrived). A process that died (a non-zero exit
        code) breaks the barrier, so the ranks waiting at it for the dead one fail at once
        instead of at their own timeout. ``tick`` runs between polls."""
        wanted = len(self.processes) if expected is None else expected
        got: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(got) < wanted:
            try:
                got.append(self.results.get(timeout=POLL_S))
                deadline = time.monotonic() + timeout
                continue
            except queue.Empty:
                pass
            if tick is not None:
                tick()
            if any(process.exitcode for process in self.processes):
                self.barrier.abort()
            exited = not any(process.is_alive() for process in self.processes)
            if exited:
                got += self._drain(wanted - len(got))
            if len(got) >= wanted:
                break
            if exited or time.monotonic() >= deadline:
                if partial:
                    return got
                codes = [process.exitcode for process in self.processes]
                why = "every rank process exited" if exited else f"{timeout:g}s passed"
                raise RankError(
                    f"{len(got)} of {wanted} rank report(s) arrived before {why}; exit codes "
                    f"{codes}"
                )
        return got

    def _drain(self, most: int) -> list[Any]:
        # A report put just before its process exited may still be in the queue's feeder pipe.
        got: list[Any] = []
        while len(got) < most:
            try:
                got.append(self.results.get(timeout=POLL_S))
            except queue.Empty:
                break
        return got

    def join(self) -> list[int | None]:
        """Joins every process (each bounded by ``join_timeout``), kills the ones still alive,
        and returns their exit codes."""
        for process in self.processes:
            process.join(timeout=self.join_timeout)
            if process.is_alive():
                process.kill()
                process.join(timeout=KILL_WAIT_S)
        return [process.exitcode for process in self.processes]

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.barrier.abort()  # ranks waiting on it fail at once instead of at their timeout
        self.join()
