"""The shared-memory segments of a buffer: one control segment and the data segments.

Binding to ``core-native/src/seg_region.zig``. All ranks of a node open the same ``unique_id``;
exactly one creates, the others attach, whatever the start order:

- the control segment is ``/dev/shm/ucm-<unique_id>.ctrl`` (mode 0600). Its first page is the
  segment header (magic, layout version, geometry, creator pid and start time, attach table);
  the caller's control region starts at :attr:`SharedRegion.ctrl_address`, page-aligned and
  zeroed when created. A creator initialises it in ``init`` *before* the segment is published,
  so no rank ever sees it half-built.
- the data segments are memfds (hugetlb when the kernel has free huge pages, else a normal
  memfd with ``MADV_HUGEPAGE``), sized but not faulted in at open (:meth:`SharedRegion.populate`
  starts native threads that fault them in behind it), mapped back to back at
  :attr:`data_address`, and
  handed to later ranks over a Unix socket after a same-uid check (SO_PEERCRED). Every worker
  serves them on a daemon thread, so the buffer outlives its creator.
- a scheduler (``role="scheduler"``, device_id < 0) maps the control segment only; its
  :attr:`data_address` is 0.
- a segment whose creator and ranks are all dead is stale and replaced at the next open.
"""

from __future__ import annotations

import ctypes
import errno as errno_module
import math
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import InvalidArgumentError, UcmError
from ..threadname import enter_thread
from . import _abi, lib

Role = Literal["worker", "scheduler"]
HugetlbPolicy = Literal["auto", "off", "try"]
HugePagesMode = Literal["hugetlb", "thp", "none"]

SHM_DIR = Path("/dev/shm")
UNIQUE_ID_MAX_CHARS = _abi.SEG_UNIQUE_ID_MAX_BYTES
_ROLES: dict[str, int] = {"worker": 0, "scheduler": 1}
_POLICIES: dict[str, int] = {"auto": 0, "off": 1, "try": 2}
_HUGE_PAGES: dict[int, HugePagesMode] = {0: "none", 1: "thp", 2: "hugetlb"}
_FALLBACKS: dict[int, str] = {
    0: "hugetlb in use",
    1: "hugetlb disabled by the caller",
    2: "not enough free hugetlb pages",
    3: "segment_bytes is not a multiple of the huge page size",
    4: "memfd_create(MFD_HUGETLB) failed",
    5: "ftruncate of the hugetlb memfd failed",
    6: "mmap of the hugetlb memfd failed",
}
_ERROR_BUFFER_BYTES = 1024
_SERVE_JOIN_TIMEOUT_S = 5.0


class SharedMemoryError(UcmError):
    """The shared-memory segments of a buffer could not be created or attached."""


class SegmentMismatchError(SharedMemoryError):
    """An existing segment has another magic, layout version or geometry: it is refused."""


class SharedMemoryCapacityError(SharedMemoryError, InvalidArgumentError):
    """The requested capacity does not fit in /dev/shm (or the free huge pages)."""


class SharedMemoryPermissionError(SharedMemoryError):
    """The segment belongs to another user, or a peer refused to hand out the data."""


class SharedMemoryTimeoutError(SharedMemoryError):
    """A bounded wait (creation lock, data hand-over) ran out."""


_ERRORS: dict[int, type[UcmError]] = {
    -1: InvalidArgumentError,
    -20: SegmentMismatchError,
    -21: SharedMemoryCapacityError,
    -22: SharedMemoryTimeoutError,
    -23: SharedMemoryPermissionError,
    -24: SharedMemoryError,
}


POPULATE_THREADS_MAX = _abi.POPULATE_THREADS_MAX
"""``constants.populate_threads_max``: background threads one process may fault its data in on."""


@dataclass(frozen=True)
class Residency:
    """How much of a buffer's data plane is backed by memory."""

    resident_bytes: int
    """Bytes of the data segments allocated, node-wide (every rank's writes and populating)."""
    data_bytes: int
    populated_bytes: int
    """Bytes of this process's mapping its background threads have faulted in."""
    populate_threads: int
    populate_error: str | None
    """Why this process's background population stopped early (e.g. ``ENOMEM``), or None."""
    populate_seconds: float | None
    """Seconds from the start of population to its end (None while it runs, or when lazy)."""


def ctrl_path(unique_id: str) -> Path:
    """The published control segment of ``unique_id``."""
    _check_unique_id(unique_id)
    return SHM_DIR / f"ucm-{unique_id}.ctrl"


def segment_paths(unique_id: str) -> list[Path]:
    """Every name the segment layer may create for ``unique_id`` (control, its temporary name
    while being created, the creation lock)."""
    _check_unique_id(unique_id)
    return [SHM_DIR / f"ucm-{unique_id}{suffix}" for suffix in (".ctrl", ".ctrl.init", ".lock")]


def unlink(unique_id: str) -> int:
    """Removes the names of ``unique_id`` under /dev/shm; returns how many existed. Processes
    that still map the segments keep them (tests and admin cleanup)."""
    _check_unique_id(unique_id)
    raw = unique_id.encode()
    result = int(lib().ucm_seg_unlink(raw, len(raw)))
    assert result >= 0, result
    return result


def _check_unique_id(unique_id: object) -> None:
    valid = (
        isinstance(unique_id, str)
        and 0 < len(unique_id) <= UNIQUE_ID_MAX_CHARS
        and unique_id.isascii()
        and all(c.isalnum() or c in "_-." for c in unique_id)
        and unique_id[0] not in ".-"
    )
    if not valid:
        raise InvalidArgumentError(
            f"unique_id={unique_id!r} is not valid: expected 1 to {UNIQUE_ID_MAX_CHARS} "
            "characters among A-Z a-z 0-9 _ - . not starting with '.' or '-'"
        )


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**64:
        raise InvalidArgumentError(f"{name}={value!r} is not valid: expected a positive int")
    return value


def _raise(code: int, error_buffer: ctypes.Array[ctypes.c_char]) -> None:
    message = error_buffer.value.decode(errors="replace") or f"native error {code}"
    raise _ERRORS.get(code, SharedMemoryError)(message)


class _Handle:
    """Owns the native handle and the serve thread; shared by close() and the finalizer."""

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.pid = os.getpid()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def start_serving(self, name: str) -> None:
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        enter_thread()
        lib().ucm_seg_serve(self.handle)

    def close(self) -> None:
        with self.lock:
            if not self.handle:
                return
            handle, self.handle = self.handle, 0
            if os.getpid() != self.pid:
                # A fork() child (closing, or exiting through the finalizer): the region's
                # attach entry, serve loop and populate threads are the parent's; touching
                # them would deregister the parent or join threads that do not exist here (a
                # hang). The child's copy of the mappings goes with its exit.
                return
            lib().ucm_seg_stop(handle)
            if self.thread is not None:
                self.thread.join(_SERVE_JOIN_TIMEOUT_S)
                if self.thread.is_alive():
                    # Freeing the region under a running serve loop would be a use-after-free;
                    # leak it instead (the loop wakes every few hundred ms, so this is unreachable
                    # short of a kernel stall).
                    return
            lib().ucm_seg_close(handle)


class SharedRegion:
    """One process's view of a buffer's shared memory. Use :meth:`open`."""

    def __init__(self, owner: _Handle, unique_id: str, role: Role) -> None:
        self._owner = owner
        self.unique_id = unique_id
        self.role: Role = role
        self._finalizer = weakref.finalize(self, owner.close)

    @classmethod
    def open(
        cls,
        unique_id: str,
        ctrl_bytes: int,
        data_bytes: int,
        segment_bytes: int,
        role: Role = "worker",
        *,
        init: Callable[[SharedRegion], None] | None = None,
        ctrl_layout_version: int = 0,
        hugetlb: HugetlbPolicy = "auto",
        timeout_s: float = 60.0,
    ) -> SharedRegion:
        """Creates or attaches the region of ``unique_id``.

        ``init(region)`` runs only in the process that creates it, before any other process can
        see it; the control region is zeroed. If ``init`` raises, nothing is published and the
        error propagates. Every rank must pass the same sizes and ``ctrl_layout_version``.
        ``hugetlb="try"`` attempts MFD_HUGETLB even without free huge pages (tests the fallback).
        """
        _check_unique_id(unique_id)
        _check_size("ctrl_bytes", ctrl_bytes)
        _check_size("data_bytes", data_bytes)
        _check_size("segment_bytes", segment_bytes)
        if role not in _ROLES:
            raise InvalidArgumentError(
                f"role={role!r} is not valid: expected 'worker' or 'scheduler'"
            )
        if hugetlb not in _POLICIES:
            raise InvalidArgumentError(
                f"hugetlb={hugetlb!r} is not valid: expected 'auto', 'off' or 'try'"
            )
        if (
            isinstance(ctrl_layout_version, bool)
            or not isinstance(ctrl_layout_version, int)
            or not 0 <= ctrl_layout_version < 2**32
        ):
            raise InvalidArgumentError(
                f"ctrl_layout_version={ctrl_layout_version!r} is not valid: expected a 32-bit "
                "unsigned int"
            )
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not (math.isfinite(timeout_s) and timeout_s > 0)
        ):
            raise InvalidArgumentError(
                f"timeout_s={timeout_s!r} is not valid: expected a finite number > 0"
            )
        if init is not None and not callable(init):
            raise InvalidArgumentError(f"init={init!r} is not valid: expected a callable")
        raw = unique_id.encode()
        error_buffer = ctypes.create_string_buffer(_ERROR_BUFFER_BYTES)
        handle = ctypes.c_size_t(0)
        code = lib().ucm_seg_open(
            raw,
            len(raw),
            ctrl_bytes,
            data_bytes,
            segment_bytes,
            ctrl_layout_version,
            _ROLES[role],
            _POLICIES[hugetlb],
            int(timeout_s * 1e9),
            ctypes.byref(handle),
            error_buffer,
            len(error_buffer),
        )
        if code < 0:
            _raise(code, error_buffer)
        owner = _Handle(int(handle.value))
        region = cls(owner, unique_id, role)
        if code == 1:
            try:
                if init is not None:
                    init(region)
                code = lib().ucm_seg_publish(owner.handle, error_buffer, len(error_buffer))
                if code < 0:
                    _raise(code, error_buffer)
            except BaseException:
                region.close()
                raise
        if region._info().serves_data:
            owner.start_serving(f"ucm-segments-{unique_id}")
        return region

    def _info(self) -> _abi.SegInfo:
        if not self._owner.handle:
            raise UcmError(f"the shared region {self.unique_id!r} is closed")
        info = _abi.SegInfo()
        code = lib().ucm_seg_info(self._owner.handle, ctypes.byref(info), ctypes.sizeof(info))
        assert code == 0, code
        return info

    @property
    def header_address(self) -> int:
        """Address of the segment header (the first page of the control segment)."""
        return int(self._info().header_address)

    @property
    def ctrl_address(self) -> int:
        """Address of the caller's control region (``ctrl_bytes`` long, page-aligned)."""
        return int(self._info().ctrl_address)

    @property
    def ctrl_bytes(self) -> int:
        return int(self._info().ctrl_bytes)

    @property
    def data_address(self) -> int:
        """Base of the data segments (segment i at ``data_address + i * segment_bytes``);
        0 for a scheduler."""
        return int(self._info().data_address)

    @property
    def data_bytes(self) -> int:
        return int(self._info().data_bytes)

    @property
    def segment_bytes(self) -> int:
        return int(self._info().segment_bytes)

    @property
    def segment_count(self) -> int:
        return int(self._info().segment_count)

    def segment_address(self, index: int) -> int:
        """Base address of data segment ``index`` (0 for a scheduler)."""
        info = self._info()
        if isinstance(index, bool) or not isinstance(index, int):
            raise InvalidArgumentError(f"index={index!r} is not valid: expected an int")
        if not 0 <= index < info.segment_count:
            raise InvalidArgumentError(
                f"index={index} is not valid: expected 0 to {info.segment_count - 1}"
            )
        if not info.data_address:
            return 0
        return int(info.data_address + index * info.segment_bytes)

    @property
    def created(self) -> bool:
        """True in the process that created (and published) the segments."""
        return bool(self._info().created)

    @property
    def replaced_stale(self) -> bool:
        """True when this open found a stale segment of a dead run and replaced it."""
        return bool(self._info().replaced_stale)

    @property
    def stale_creator_pid(self) -> int:
        return int(self._info().stale_creator_pid)

    @property
    def creator_pid(self) -> int:
        return int(self._info().creator_pid)

    @property
    def huge_pages(self) -> HugePagesMode:
        """What backs the data: ``hugetlb``, ``thp`` (MADV_HUGEPAGE accepted and shmem THP
        enabled) or ``none`` (4 KiB pages)."""
        return _HUGE_PAGES[int(self._info().huge_pages)]

    @property
    def hugetlb_fallback(self) -> str:
        """Why hugetlb is not in use (``"hugetlb in use"`` when it is), with the errno."""
        info = self._info()
        reason = _FALLBACKS.get(int(info.hugetlb_fallback), f"reason {info.hugetlb_fallback}")
        if info.hugetlb_errno:
            name = errno_module.errorcode.get(int(info.hugetlb_errno), str(info.hugetlb_errno))
            return f"{reason} ({name})"
        return reason

    @property
    def entry_index(self) -> int:
        """This process's row in the attach table; its data server listens on the abstract
        socket ``@ucm-<unique_id>-<pid>-<entry_index>``."""
        return int(self._info().entry_index)

    @property
    def serves_data(self) -> bool:
        return bool(self._info().serves_data)

    @property
    def served_count(self) -> int:
        """Peers this process handed the data descriptors to."""
        return int(self._info().served_count)

    @property
    def refused_count(self) -> int:
        """Peers this process refused (uid mismatch)."""
        return int(self._info().refused_count)

    @property
    def closed(self) -> bool:
        return not self._owner.handle

    def populate(self, threads: int) -> int:
        """Starts ``threads`` (0 to :data:`POPULATE_THREADS_MAX`) native threads that fault this
        process's data mapping in, chunk by chunk, behind open; 0 leaves every page to fault in
        on first touch. Returns how many started (0 for a scheduler, or when already started)."""
        if (
            isinstance(threads, bool)
            or not isinstance(threads, int)
            or not 0 <= threads <= POPULATE_THREADS_MAX
        ):
            raise InvalidArgumentError(
                f"threads={threads!r} is not valid: expected an int in [0, {POPULATE_THREADS_MAX}]"
            )
        if not self._owner.handle:
            raise UcmError(f"the shared region {self.unique_id!r} is closed")
        started = int(lib().ucm_seg_populate(self._owner.handle, threads))
        assert started >= 0, started
        return started

    def residency(self) -> Residency:
        """Resident bytes of the data plane (node-wide) and this process's population."""
        if not self._owner.handle:
            raise UcmError(f"the shared region {self.unique_id!r} is closed")
        raw = _abi.SegResidency()
        code = lib().ucm_seg_residency(self._owner.handle, ctypes.byref(raw), ctypes.sizeof(raw))
        assert code == 0, code
        error = None
        if raw.populate.error_code:
            code_name = errno_module.errorcode.get(raw.populate.error_code)
            error = code_name or str(raw.populate.error_code)
        elapsed = raw.populate.elapsed_ns
        return Residency(
            resident_bytes=int(raw.resident_bytes),
            data_bytes=int(raw.data_bytes),
            populated_bytes=int(raw.populate.populated_bytes),
            populate_threads=int(raw.populate.threads),
            populate_error=error,
            populate_seconds=elapsed / 1e9 if elapsed else None,
        )

    @property
    def handle(self) -> int:
        """The native region handle (the native load queue checks slot pages through it)."""
        if not self._owner.handle:
            raise UcmError(f"the shared region {self.unique_id!r} is closed")
        return self._owner.handle

    def debug_set_peer_uid(self, uid: int) -> None:
        """Test hook: the data server then only accepts peers of ``uid``."""
        if not self.serves_data:
            raise InvalidArgumentError("this process does not serve the data segments")
        if isinstance(uid, bool) or not isinstance(uid, int) or not 0 <= uid < 2**32:
            raise InvalidArgumentError(f"uid={uid!r} is not valid: expected a 32-bit uid")
        assert lib().ucm_seg_debug_set_peer_uid(self._owner.handle, uid) == 0

    def close(self) -> None:
        """Stops serving, unmaps, leaves the attach table; the last data holder unlinks the
        control segment. Idempotent, never blocks more than a few seconds."""
        self._finalizer()

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
