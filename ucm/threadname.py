"""What every thread UCM starts does first (:func:`enter_thread`): it takes an OS name, so
``top -H``, ``perf`` and ``/proc/PID/task/TID/comm`` of an engine's process tell UCM's threads
from the engine's (docs/observability.md), and, where the process keeps UCM's threads off an
engine's compute CPUs (:func:`bind_new_threads`, set by the vLLM connector from
``ucm.affinity.background_cpus``), it binds itself to the CPUs the engine leaves free. A leaf
module: every module that starts a thread imports it."""

from __future__ import annotations

import os
import threading
from contextlib import suppress

_bound: frozenset[int] | None = None


def bind_new_threads(cpus: set[int] | None) -> None:
    """Every UCM thread that starts in this process from now on binds itself to ``cpus``
    (None: no binding, the default). A thread UCM starts lazily, long after ``ucm.open`` (a
    tier's I/O pool, a look-up pool), may be started from an engine's thread bound to its
    compute CPUs and would inherit that binding without this."""
    global _bound
    _bound = frozenset(cpus) if cpus else None


def enter_thread() -> None:
    """Names the calling thread for the OS after its Python name, cut to the kernel's 15 bytes
    (``ucm-write-through`` shows as ``ucm-write-throu``), and binds it to the CPUs of
    :func:`bind_new_threads`, if any. A refusal of either leaves the thread as it was."""
    text = threading.current_thread().name.encode()[:15]
    with suppress(OSError), open(f"/proc/self/task/{threading.get_native_id()}/comm", "wb") as comm:
        comm.write(text)
    cpus = _bound
    if cpus is not None:
        with suppress(OSError):
            os.sched_setaffinity(0, cpus)
