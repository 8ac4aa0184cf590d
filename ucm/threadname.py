"""OS names for UCM's threads: ``top -H``, ``perf`` and ``/proc/PID/task/TID/comm`` of an
engine's process tell UCM's threads from the engine's (docs/observability.md). A leaf module:
every module that starts a thread imports it."""

from __future__ import annotations

import threading
from contextlib import suppress


def name_os_thread() -> None:
    """Gives the calling thread's OS name its Python name, cut to the kernel's 15 bytes
    (``ucm-write-through`` shows as ``ucm-write-throu``). A refusal leaves the name as it
    was."""
    text = threading.current_thread().name.encode()[:15]
    with suppress(OSError), open(f"/proc/self/task/{threading.get_native_id()}/comm", "wb") as comm:
        comm.write(text)
