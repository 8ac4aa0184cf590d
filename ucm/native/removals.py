"""The removal log (``core-native/src/removal_log.zig``): purges and forced removes, recorded
for the writers to lower tiers (:mod:`ucm.finality`).

A log is the CacheBuffer's, in its shared control plane (:meth:`RemovalLog.of_buffer`: every
process of the node records into it and reads it), or, for a stack without a buffer, this
process's own (:func:`process_log`). Both have the same calls: the latest generation, an
append per removal, and the removals after a generation (None when the ring no longer holds
that whole window: the reader then fails closed).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidArgumentError, UcmError
from ..layout import BLOCK_ID_BYTES
from . import _abi, lib
from .buffer import BufferCore

RemovalKind = _abi.RemovalKind


@dataclass(frozen=True)
class Removal:
    """One recorded removal: a purge (``id`` starts with the namespace's tag, 8 zero bytes
    follow) or a forced remove of one block (``id`` is its scoped id)."""

    generation: int
    kind: RemovalKind
    id: bytes


class RemovalLog:
    """The calls of one removal log at ``address`` (kept valid by ``keepalive``)."""

    def __init__(self, address: int, keepalive: object) -> None:
        if not address or address % 64:
            raise UcmError(f"removal log: bad address {address:#x} (64-byte aligned, not null)")
        self._address = address
        self._keepalive = keepalive
        self._native = lib()
        self._lock = threading.Lock()
        """Held by every call on the log: :meth:`detach` never moves it under a reader."""

    @classmethod
    def of_buffer(cls, core: BufferCore) -> RemovalLog:
        """The log in the control plane of ``core``'s buffer (node-wide)."""
        address = int(lib().ucm_buffer_removal_log(core.ctrl_address))
        return cls(address, core)

    @classmethod
    def private(cls) -> RemovalLog:
        """A fresh log in this process's memory."""
        size = _abi.REMOVAL_LOG_SIZE_BYTES
        memory = (ctypes.c_ubyte * (size + 64))()
        address = ctypes.addressof(memory)
        address += -address % 64
        log = cls(address, memory)
        log._check(log._native.ucm_removal_log_init(address), "init")
        return log

    def detach(self) -> None:
        """From now on, reads and appends use a private copy of the log as it is now: the
        memory it was in (a buffer's control plane) is about to be unmapped. Removals that
        other processes record later are not seen through this object."""
        size = _abi.REMOVAL_LOG_SIZE_BYTES
        memory = (ctypes.c_ubyte * (size + 64))()
        address = ctypes.addressof(memory)
        address += -address % 64
        with self._lock:
            ctypes.memmove(address, self._address, size)
            self._address, self._keepalive = address, memory

    def generation(self) -> int:
        """The latest removal's generation (0: none yet)."""
        with self._lock:
            value = int(self._native.ucm_removal_log_generation(self._address))
        self._check(value, "generation")
        return value

    def append_purge(self, tag: bytes) -> int:
        """Records a purge of the namespace whose tag (8 bytes) is ``tag``."""
        return self._append(RemovalKind.PURGE, bytes(tag) + bytes(BLOCK_ID_BYTES - len(tag)))

    def append_removes(self, block_ids: Sequence[bytes]) -> int:
        """Records a forced remove of each block (scoped ids); returns the last generation."""
        generation = self.generation()
        for block_id in dict.fromkeys(block_ids):
            generation = self._append(RemovalKind.REMOVE, block_id)
        return generation

    def since(self, generation: int) -> list[Removal] | None:
        """The removals after ``generation``, oldest first; None when the ring no longer holds
        every one of them (or one is still being written): the caller fails closed."""
        if self.generation() == generation:
            return []  # the common case: one call, nothing to copy
        capacity = _abi.REMOVAL_LOG_READ_MAX
        out = (_abi.RemovalRecord * capacity)()
        latest = ctypes.c_uint64(0)
        with self._lock:
            count = int(
                self._native.ucm_removal_log_read(
                    self._address, generation, out, capacity, ctypes.byref(latest)
                )
            )
        if count == _abi.REMOVAL_LOG_INCOMPLETE:
            return None
        self._check(count, "read")
        return [
            Removal(int(record.generation), RemovalKind(record.kind), bytes(record.id))
            for record in out[:count]
        ]

    def _append(self, kind: RemovalKind, block_id: bytes) -> int:
        if len(block_id) != BLOCK_ID_BYTES:
            raise InvalidArgumentError(
                f"removal log: id must be {BLOCK_ID_BYTES} bytes, got {len(block_id)}"
            )
        raw = (ctypes.c_ubyte * BLOCK_ID_BYTES).from_buffer_copy(block_id)
        with self._lock:
            value = int(self._native.ucm_removal_log_append(self._address, int(kind), raw))
        self._check(value, "append")
        return value

    def _check(self, status: int, operation: str) -> None:
        if status < 0:
            raise UcmError(f"removal log {operation}: native error {status}")


_process_log: RemovalLog | None = None
_process_log_lock = threading.Lock()


def process_log() -> RemovalLog:
    """This process's own log: the one of every stack without a buffer in this process."""
    global _process_log
    with _process_log_lock:
        if _process_log is None:
            _process_log = RemovalLog.private()
        return _process_log


__all__ = ["Removal", "RemovalKind", "RemovalLog", "process_log"]
