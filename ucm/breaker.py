"""Bounded calls into a lower tier: a per-tier deadline and a circuit breaker.

Look-ups run on the engine's scheduler thread (vLLM's ``get_num_new_matched_tokens``, SGLang's
and LMCache's prefix checks), so a tier that hangs (an S3 endpoint that accepts connections and
never answers) must not hold that thread: every look-up into a lower tier goes through its
:class:`TierGuard`.

- **Deadline** (``lookup_timeout_ms``): the tier's call runs on one of the guard's own daemon
  threads and the caller waits at most the deadline; past it the answer is "miss" and the call
  is left to finish (or time out in the tier's own client) on its thread. While every one of
  the guard's threads is still held by earlier calls, a new call answers "miss" at once: a
  black-holed tier never piles up threads.
- **Circuit breaker** (``breaker.failures``, ``breaker.probe_interval_ms``): ``closed`` counts
  consecutive failures (a time-out or an error); at ``failures`` of them it opens and every
  call answers "miss" without touching the tier. After ``probe_interval_ms`` the next call is
  let through as the one half-open probe (others still answer "miss" meanwhile): a success
  closes the breaker, a failure opens it for another interval.

Loads read the same breaker: while it is open, a load skips the tier (a miss there: the next
tier, or a recompute, serves the key) instead of waiting on it. Only look-ups move it (a
load's failure is already reported per key, and bounded by the load path's own deadlines), so
a half-open probe is always a look-up. Dumps ignore it: they run off the engine's critical
path, and a dump skipped by an open breaker would drop data a ``write: back`` tier must
receive.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, TypeVar

from .config import BreakerConfig
from .threadname import enter_thread

T = TypeVar("T")
M = TypeVar("M")

BreakerState = Literal["closed", "open", "half_open"]
BREAKER_STATES: tuple[BreakerState, ...] = ("closed", "open", "half_open")

LOOKUP_THREADS = 4
"""Look-ups in flight at once per tier (concurrent callers: the scheduler, several ranks'
threads); a fifth caller while all four are stuck answers "miss" at once."""

EXACT_LOOKUP_THREADS = 1
"""Exact look-ups in flight at once per tier (an engine's reset-epoch reads, retried every few
seconds in the background while a tier does not answer). Their own threads: a retry stuck in a
black-holed tier's client never takes a thread a request's look-up needs."""


class CircuitBreaker:
    """closed → (``failures`` consecutive failures) → open → (``probe_interval_s``) → one
    half-open probe → closed on success, open again on failure. Thread-safe."""

    def __init__(self, failures: int, probe_interval_s: float) -> None:
        assert failures >= 1 and probe_interval_s > 0
        self.failures_to_open = failures
        self.probe_interval_s = probe_interval_s
        self._lock = threading.Lock()
        self._state: BreakerState = "closed"
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False
        self.counts = {
            "breaker_opens": 0,
            "breaker_closes": 0,
            "breaker_probes": 0,
            "breaker_skips": 0,
            "breaker_failures": 0,
        }

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def is_open(self) -> bool:
        """Open (not half-open): callers other than look-ups skip the tier. Moves nothing."""
        with self._lock:
            return self._state == "open"

    def allow(self) -> bool:
        """Whether a call may go to the tier now (False: answer "miss" without asking)."""
        with self._lock:
            if self._state == "closed":
                return True
            if (
                self._state == "open"
                and time.monotonic() - self._opened_at >= self.probe_interval_s
            ):
                self._state = "half_open"
            if self._state == "half_open" and not self._probing:
                self._probing = True
                self.counts["breaker_probes"] += 1
                return True
            self.counts["breaker_skips"] += 1
            return False

    def success(self) -> None:
        with self._lock:
            self._consecutive = 0
            self._probing = False
            if self._state != "closed":
                self._state = "closed"
                self.counts["breaker_closes"] += 1

    def failure(self) -> None:
        with self._lock:
            self.counts["breaker_failures"] += 1
            self._consecutive += 1
            probe = self._state == "half_open"
            self._probing = False
            if probe or (self._state == "closed" and self._consecutive >= self.failures_to_open):
                self._state = "open"
                self._opened_at = time.monotonic()
                self.counts["breaker_opens"] += 1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "breaker_state": self._state,
                "breaker_consecutive_failures": self._consecutive,
                **self.counts,
            }


class _Timeout(Exception):
    pass


class _Busy(Exception):
    pass


class DaemonPool:
    """At most ``threads`` daemon threads, started on demand. :meth:`try_submit` never queues
    behind a stuck call: it answers None when every thread is taken. Daemon threads, so a call
    stuck in a tier's client never holds up the interpreter's exit."""

    def __init__(self, name: str, threads: int) -> None:
        assert threads >= 1
        self._name = name
        self._free = threading.Semaphore(threads)
        self._work: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._closed = False

    def try_submit(self, fn: Callable[[], T]) -> Future[T] | None:
        if not self._free.acquire(blocking=False):
            return None
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                self._free.release()
                return None
            if self._idle == 0:
                thread = threading.Thread(
                    target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                self._idle += 1
                thread.start()
            self._idle -= 1
        self._work.put((future, fn))
        return future

    def _run(self) -> None:
        enter_thread()
        while True:
            item = self._work.get()
            if item is None:
                return
            future, fn = item
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
            finally:
                with self._lock:
                    self._idle += 1
                self._free.release()

    def close(self) -> None:
        """Stops the idle threads; a thread still in a stuck call ends when the call does."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = len(self._threads)
        for _ in range(threads):
            self._work.put(None)


class TierGuard:
    """One lower tier's deadline and breaker. :meth:`call` runs a look-up; :meth:`skips` says
    whether a load should skip the tier."""

    def __init__(self, label: str, timeout_ms: int, breaker: BreakerConfig | None = None) -> None:
        breaker = breaker or BreakerConfig()
        self.label = label
        self.timeout_ms = timeout_ms
        self.timeout_s = timeout_ms / 1000.0
        self.last_miss = ""
        """Why the last call answered ``miss`` (for error messages)."""
        self.breaker = CircuitBreaker(breaker.failures, breaker.probe_interval_ms / 1000.0)
        self._pool = DaemonPool(f"ucm-lookup-{label}", LOOKUP_THREADS)
        self._exact_pool = DaemonPool(f"ucm-lookup-exact-{label}", EXACT_LOOKUP_THREADS)
        self._lock = threading.Lock()
        self.counts = {"lookup_timeouts": 0, "lookup_errors": 0, "lookup_busy": 0, "load_skips": 0}

    def call(self, fn: Callable[[], T], miss: M, *, exact: bool = False) -> T | M:
        """``fn()``'s answer, or ``miss`` when the breaker is open, every guard thread is still
        held by an earlier call, the call raised, or it did not answer within the deadline
        (:attr:`last_miss` then says which). ``exact`` calls (a caller that cannot take "miss"
        for "absent") run on their own threads, apart from the requests' look-ups."""
        if not self.breaker.allow():
            self.last_miss = "its circuit breaker is open"
            return miss
        pool, threads = (
            (self._exact_pool, EXACT_LOOKUP_THREADS) if exact else (self._pool, LOOKUP_THREADS)
        )
        try:
            answer = self._bounded(pool, fn)
        except _Busy:
            self._bump("lookup_busy")
            self.breaker.failure()
            kind = "exact look-up" if exact else "look-up"
            self.last_miss = f"all {threads} of its {kind} threads are held by earlier calls"
            return miss
        except _Timeout:
            self._bump("lookup_timeouts")
            self.breaker.failure()
            self.last_miss = f"it did not answer within lookup_timeout_ms={self.timeout_ms}"
            return miss
        except Exception as exc:
            self._bump("lookup_errors")
            self.breaker.failure()
            self.last_miss = f"it failed: {type(exc).__name__}: {exc}"
            return miss
        self.breaker.success()
        return answer

    def _bounded(self, pool: DaemonPool, fn: Callable[[], T]) -> T:
        future = pool.try_submit(fn)
        if future is None:
            raise _Busy
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError:
            if future.done():  # it raised TimeoutError itself
                raise
            raise _Timeout from None

    def skips(self) -> bool:
        """Whether the breaker is open (a load answers "miss" here without asking)."""
        if self.breaker.is_open():
            self._bump("load_skips")
            return True
        return False

    def _bump(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self.counts)
        return {**self.breaker.stats(), **counts}

    def close(self) -> None:
        self._pool.close()
        self._exact_pool.close()
