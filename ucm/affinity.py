"""Keeping UCM's background threads off an engine's compute CPUs.

An engine that binds its compute threads to CPUs (vLLM's CPU backend:
``VLLM_CPU_OMP_THREADS_BIND="0-31|32-63"``, one list per local rank) starts UCM from a thread
already bound to those CPUs, and every thread UCM starts (the native queue's dispatcher, copy
and populate threads, the loaders, tier pools) would inherit that binding and take time from
the forward pass. :func:`background_cpus` names the CPUs the engine left free, and
:class:`NewThreads` moves the threads a call started (``ucm.open``) onto them: a thread any of
those threads starts later inherits their binding.

Work nobody waits for (writing through to lower tiers) runs on threads that call
:func:`become_background`: the lowest CPU priority, and tiers do its I/O on that thread rather
than on their shared pools (whose threads also serve loads an engine waits for). The fill of
an engine's asynchronous load runs inside :func:`background_work`: its I/O on the loader's own
thread too, at the loader's priority.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from types import TracebackType
from typing import TYPE_CHECKING

from .errors import ConfigError
from .threadname import enter_thread

if TYPE_CHECKING:
    from .stack import StackConfig


def parse_cpu_list(text: str, name: str) -> set[int]:
    """``"5,2-4"`` -> ``{2, 3, 4, 5}``; errors name ``name`` and the bad part."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        try:
            first = int(low)
            last = int(high) if dash else first
        except ValueError:
            raise ConfigError(
                f"{name}={text!r}: {part!r} is not a CPU id or a range like 2-4"
            ) from None
        if first < 0 or last < first:
            raise ConfigError(f"{name}={text!r}: {part!r} is not a valid CPU range")
        cpus.update(range(first, last + 1))
    return cpus


def engine_cpus(bind: str | None, name: str = "VLLM_CPU_OMP_THREADS_BIND") -> set[int] | None:
    """The CPUs an explicit binding gives the engine's compute threads (every rank's list:
    ``|``-separated); None when it names none (unset, ``auto``, ``nobind``)."""
    if bind is None or bind.strip() in ("", "auto", "nobind"):
        return None
    cpus: set[int] = set()
    for rank_list in bind.split("|"):
        cpus |= parse_cpu_list(rank_list, name)
    return cpus


OMP_BINDING_VARIABLES = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES")
"""Where vLLM's ``auto`` binding writes a worker's CPU list (GNU, Intel, other OpenMP)."""


def omp_cpus(environ: Mapping[str, str] | None = None) -> set[int] | None:
    """The CPUs an OpenMP binding in the environment names: ``GOMP_CPU_AFFINITY="0 1 4-6"``,
    ``KMP_AFFINITY="...,proclist=[0,1]"`` or ``OMP_PLACES="{0,1}"`` (the forms vLLM writes);
    None when none is set or one cannot be read."""
    env = os.environ if environ is None else environ
    cpus: set[int] = set()
    try:
        for name in OMP_BINDING_VARIABLES:
            value = env.get(name, "").strip()
            if not value:
                continue
            if name == "GOMP_CPU_AFFINITY":
                lists = [",".join(value.replace(",", " ").split())]
            elif name == "KMP_AFFINITY":
                lists = re.findall(r"proclist=\[([^\]]*)\]", value)
            else:
                lists = re.findall(r"\{([^}]*)\}", value)
            for text in lists:
                cpus |= parse_cpu_list(text, name)
    except ConfigError:
        return None
    return cpus or None


def engine_binding(bind: str | None, environ: Mapping[str, str] | None = None) -> set[int] | None:
    """The CPUs the engine's compute threads run on: an explicit binding's lists
    (:func:`engine_cpus`); under ``auto`` (vLLM's default, also when unset) vLLM picks each
    rank's CPUs itself and hands them to OpenMP in the worker's environment
    (:func:`omp_cpus`). None: ``nobind``, or no binding UCM can read."""
    engine = engine_cpus(bind)
    if engine is not None or (bind is not None and bind.strip() == "nobind"):
        return engine
    return omp_cpus(environ)


def background_cpus(bind: str | None, allowed: set[int] | None = None) -> set[int] | None:
    """The CPUs this process may use (``allowed``, by default :func:`process_cpus`) that the
    engine's binding (:func:`engine_binding`) leaves to others (None: no binding, or it takes
    every CPU this process may use, so there is nowhere else to go)."""
    engine = engine_binding(bind)
    if engine is None:
        return None
    free = (process_cpus() if allowed is None else allowed) - engine
    return free or None


CPUSET = "/sys/fs/cgroup/cpuset.cpus.effective"


def process_cpus() -> set[int]:
    """The CPUs this process's cgroup may use (not the calling thread's binding: an engine's
    thread is bound to its compute CPUs already)."""
    try:
        with open(CPUSET) as cpuset:
            text = cpuset.read().strip()
        if text:
            return parse_cpu_list(text, CPUSET)
    except (OSError, ConfigError):
        pass
    return set(range(os.cpu_count() or 1))


BACKGROUND_NICE = 19
"""The nice value of a thread doing work nobody waits for (:func:`become_background`)."""

_role = threading.local()


def become_background() -> None:
    """Marks the calling thread as background work: nice :data:`BACKGROUND_NICE` (Linux nice
    is per thread; lowering priority needs no privilege, and a refusal leaves it as it was),
    and :func:`in_background` true, so a tier does this thread's I/O on it instead of handing
    it to a pool shared with loads."""
    _role.background = True
    enter_thread()
    with suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


def in_background() -> bool:
    """Whether the calling thread does background work now: it did :func:`become_background`,
    or it is inside :func:`background_work`."""
    return bool(getattr(_role, "background", False))


@contextmanager
def background_work() -> Iterator[None]:
    """Marks the calling thread's work inside the block as work nobody waits on (the fill of
    an engine's asynchronous load): :func:`in_background` is true there, so a tier does its
    I/O on this thread instead of handing it to its pool. The priority stays: a Python thread
    of an engine's process at a low priority, descheduled while it holds the GIL, holds up the
    engine's own thread (every UCM thread at SCHED_IDLE made vLLM's decoding steps 1.7-2.2x
    slower during a load from posix; issue 21)."""
    previous = in_background()
    _role.background = True
    try:
        yield
    finally:
        _role.background = previous


def _threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


class NewThreads:
    """``with NewThreads() as new: ...`` then ``new.pin(cpus)``: binds every thread of this
    process started inside the block (and still alive) to ``cpus``. Threads other code of the
    process starts at the same moment are caught too: use it around calls that own the
    moment (an engine worker's start-up)."""

    def __init__(self) -> None:
        self._before: set[int] = set()
        self.started: set[int] = set()

    def __enter__(self) -> NewThreads:
        self._before = _threads()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.started = _threads() - self._before

    def pin(self, cpus: set[int]) -> int:
        """Binds the started threads to ``cpus``; returns how many were bound (a thread that
        ended meanwhile is skipped)."""
        pinned = 0
        for tid in sorted(self.started):
            try:
                os.sched_setaffinity(tid, cpus)
            except (ProcessLookupError, FileNotFoundError):
                continue
            pinned += 1
        return pinned


BINDING_SIZED_KEYS = ("copy_threads", "populate_threads")
"""The buffer's thread counts :func:`follow_binding` sizes to the CPUs an engine leaves free."""


def follow_binding(stack: StackConfig, bind: str | None) -> tuple[StackConfig, dict[str, int]]:
    """``stack`` with the buffer's thread counts (:data:`BINDING_SIZED_KEYS`) the stack does
    not state cut to the CPUs the engine's binding (:func:`engine_binding`) leaves free (at
    least 1: a binding that takes every CPU leaves one thread of each kind to share them), and
    what was changed.
    More copy or populate threads than free CPUs only take turns with each other and with the
    engine's compute threads. Unchanged without a binding, without a buffer, or
    where the free CPUs are enough."""
    from .stack import parse_stack

    if stack.buffer is None:
        return stack, {}
    engine = engine_binding(bind)
    if engine is None:
        return stack, {}
    cpus = len(process_cpus() - engine) or 1
    buffer = stack.buffer
    sized = {
        key: cpus
        for key in BINDING_SIZED_KEYS
        if key not in buffer.model_fields_set and getattr(buffer, key) > cpus
    }
    if not sized:
        return stack, {}
    data = stack.model_dump(exclude_none=True)
    data["tiers"][0].update(sized)
    return parse_stack(data, source="stack (thread counts sized to the engine's binding)"), sized
