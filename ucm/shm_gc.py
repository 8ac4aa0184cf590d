"""Reclaims what dead UCM processes left in ``/dev/shm`` (``ucm gc``, and a bounded sweep at
every buffer open).

A buffer ``<id>`` may leave three names (see :mod:`ucm.native.segments`): the control segment
``ucm-<id>.ctrl``, its temporary name ``ucm-<id>.ctrl.init`` while a creator builds it, and the
creation lock ``ucm-<id>.lock``. A clean close of the last data holder unlinks them, but a
process stopped by SIGTERM or SIGKILL leaves the control segment, a failed open leaves the lock,
and a process that closes after the buffer's last data holder (a scheduler) re-creates the lock.

Safety, for each ``<id>``, with the same mechanism as the open path
(``core-native/src/shm.zig``):

- take the creation lock without waiting: open ``ucm-<id>.lock`` (``O_CREAT``, 0600), ``flock``
  it exclusively and non-blocking, and check that the name still refers to the locked inode.
  A creator holds this lock from before ``.ctrl.init`` exists until the segment is published,
  an attaching rank holds it until it sits in the attach table, and the last closer holds it
  while it unlinks. If the lock is held, nothing of ``<id>`` is touched (kept, "busy").
- under the lock, read the segment header of ``.ctrl``: any attach-table entry whose pid is
  running with the recorded start time (``/proc/<pid>/stat`` field 22, so a reused pid does not
  count, a zombie is dead) means a live process uses it: nothing is touched (kept, "live"). A
  file that is not a UCM segment of this layout version is never touched either.
- otherwise unlink ``.ctrl`` (only if the name still refers to the file read), ``.ctrl.init``
  (under the lock it can only be a dead creator's) and last ``.lock``, still holding it: an
  opener that waits on the old lock inode sees the name changed and retries on a fresh one,
  exactly as after a clean close.

A concurrent open of the same ``<id>`` therefore either holds the lock (gc keeps everything) or
waits for it and then creates a fresh buffer; gc never unlinks a segment registered by a live
process, because registration happens under the same lock.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .native import _abi

SHM_DIR = Path("/dev/shm")
SUFFIXES = (".ctrl", ".ctrl.init", ".lock")
PREFIX = "ucm-"

SWEEP_MAX_IDS = 32
"""Buffers (unique ids) the sweep at open examines per call, at most 3 names each."""
SWEEP_BUDGET_S = 0.2
"""Wall-clock budget of the sweep at open; it stops between buffers once spent."""

log = logging.getLogger(__name__)

Action = Literal["removed", "kept"]


@dataclass(frozen=True)
class Verdict:
    """What gc did (or, in a dry run, would do) with one buffer's names."""

    unique_id: str
    action: Action
    paths: tuple[Path, ...]
    reason: str


@dataclass
class GcReport:
    """The outcome of one pass: every buffer examined, with exact counts."""

    dry_run: bool
    verdicts: list[Verdict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    not_visited: int = 0
    """Buffers left for a later pass (the sweep at open's bound)."""

    @property
    def removed(self) -> list[Path]:
        return [p for v in self.verdicts if v.action == "removed" for p in v.paths]

    @property
    def kept(self) -> list[Path]:
        return [p for v in self.verdicts if v.action == "kept" for p in v.paths]


_totals = {"sweeps": 0, "removed_files": 0, "kept_files": 0, "errors": 0}


def sweep_totals() -> dict[str, int]:
    """Counters of the sweeps at open in this process (errors are ignored there, but counted)."""
    return dict(_totals)


def candidates(shm_dir: Path = SHM_DIR) -> dict[str, list[Path]]:
    """The UCM names under ``shm_dir``, grouped by unique id."""
    groups: dict[str, list[Path]] = {}
    with os.scandir(shm_dir) as entries:
        for entry in entries:
            name = entry.name
            if not name.startswith(PREFIX):
                continue
            for suffix in SUFFIXES:
                if name.endswith(suffix):
                    unique_id = name[len(PREFIX) : -len(suffix)]
                    if _valid_unique_id(unique_id):  # names UCM cannot make are not UCM's
                        groups.setdefault(unique_id, []).append(shm_dir / name)
                    break
    return groups


def _valid_unique_id(unique_id: str) -> bool:
    """The rule of ``segments._check_unique_id`` (and the native ``unique_id_valid``)."""
    return (
        0 < len(unique_id) <= _abi.SEG_UNIQUE_ID_MAX_BYTES
        and unique_id.isascii()
        and all(c.isalnum() or c in "_-." for c in unique_id)
        and unique_id[0] not in ".-"
    )


def collect(
    *,
    dry_run: bool = False,
    max_ids: int | None = None,
    budget_s: float | None = None,
    exclude: str | None = None,
    shm_dir: Path = SHM_DIR,
) -> GcReport:
    """Examines the UCM names under ``shm_dir`` and removes those of dead buffers.

    ``max_ids`` and ``budget_s`` bound the pass (the buffers are taken in random order, so a
    node with many live buffers still reaches every stale one over a few passes); ``exclude``
    skips one unique id (the one the caller is opening: its own open handles it)."""
    report = GcReport(dry_run=dry_run)
    try:
        groups = candidates(shm_dir)
    except OSError as exc:
        report.errors.append(f"cannot list {shm_dir}: {exc.strerror or exc}")
        return report
    groups.pop(exclude or "", None)
    ids = list(groups)
    if max_ids is not None:
        random.shuffle(ids)
    deadline = None if budget_s is None else time.monotonic() + budget_s
    for index, unique_id in enumerate(ids):
        if (max_ids is not None and index >= max_ids) or (
            deadline is not None and time.monotonic() > deadline
        ):
            report.not_visited = len(ids) - index
            break
        collect_one(unique_id, dry_run=dry_run, report=report, shm_dir=shm_dir)
    return report


def collect_one(
    unique_id: str,
    *,
    dry_run: bool = False,
    report: GcReport | None = None,
    shm_dir: Path = SHM_DIR,
) -> GcReport:
    """Removes the names of ``unique_id`` if no live process uses them (see the module doc)."""
    report = report if report is not None else GcReport(dry_run=dry_run)
    ctrl, init, lock = (shm_dir / f"{PREFIX}{unique_id}{suffix}" for suffix in SUFFIXES)
    present = [p for p in (ctrl, init, lock) if os.path.lexists(p)]
    if not present:
        return report
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    created_lock = locked = False
    try:
        try:
            # A dry run creates nothing: without a lock file it judges without the lock.
            fd = os.open(lock, flags)
        except FileNotFoundError:
            if dry_run:
                fd = -1
            else:
                fd = os.open(lock, flags | os.O_CREAT | os.O_EXCL, 0o600)
                created_lock = True
    except OSError as exc:  # includes a racing creator's EEXIST: judged at the next pass
        report.errors.append(f"{lock}: cannot open the lock: {exc.strerror or exc}")
        report.verdicts.append(Verdict(unique_id, "kept", tuple(present), "error"))
        return report
    try:
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                report.verdicts.append(
                    Verdict(unique_id, "kept", tuple(present), "busy: the creation lock is held")
                )
                return report
            if not _same_file(fd, lock):
                # A closer removed the name between our open and flock: it is being handled.
                report.verdicts.append(
                    Verdict(unique_id, "kept", tuple(present), "busy: the lock changed")
                )
                return report
            locked = True
        present = [p for p in (ctrl, init, lock) if os.path.lexists(p)]
        reason = "dead: no live process in the attach table"
        ctrl_file: os.stat_result | None = None
        if os.path.lexists(ctrl):
            live, why, ctrl_file = _ctrl_liveness(ctrl)
            if live or (ctrl_file is None and not why.startswith("dead")):
                report.verdicts.append(Verdict(unique_id, "kept", tuple(present), why))
                return report
            reason = why
        elif not os.path.lexists(init):
            reason = "dead: a lock file without a segment"
        if dry_run:
            report.verdicts.append(Verdict(unique_id, "removed", tuple(present), reason))
            return report
        removed: list[Path] = []
        if ctrl_file is not None and _same_path(ctrl, ctrl_file) and _unlink(ctrl, report):
            removed.append(ctrl)
        if _unlink(init, report):
            removed.append(init)
        if fd >= 0 and _same_file(fd, lock) and _unlink(lock, report):
            removed.append(lock)
        if removed:
            report.verdicts.append(Verdict(unique_id, "removed", tuple(removed), reason))
        return report
    finally:
        if fd >= 0:
            if created_lock and locked and _same_file(fd, lock):
                # Kept: gc leaves no lock file of its own (still held, as a closer does).
                _unlink(lock, report)
            os.close(fd)  # drops the flock


def sweep_at_open(exclude: str | None) -> GcReport:
    """The bounded sweep every buffer open runs: at most :data:`SWEEP_MAX_IDS` buffers within
    :data:`SWEEP_BUDGET_S`; errors are ignored but counted (:func:`sweep_totals`)."""
    try:
        report = collect(max_ids=SWEEP_MAX_IDS, budget_s=SWEEP_BUDGET_S, exclude=exclude)
    except Exception as exc:  # never fail an open over hygiene
        report = GcReport(dry_run=False, errors=[f"sweep failed: {exc!r}"])
    _totals["sweeps"] += 1
    _totals["removed_files"] += len(report.removed)
    _totals["kept_files"] += len(report.kept)
    _totals["errors"] += len(report.errors)
    if report.removed:
        log.info("removed %d stale UCM names from /dev/shm", len(report.removed))
    for error in report.errors:
        log.debug("/dev/shm sweep: %s", error)
    return report


def _ctrl_liveness(ctrl: Path) -> tuple[bool, str, os.stat_result | None]:
    """(live, reason, stat of the file read). stat is None when the file must not be touched."""
    try:
        fd = os.open(ctrl, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False, "dead: the segment is gone", None
    except OSError as exc:
        return False, f"error: cannot open the segment: {exc.strerror or exc}", None
    try:
        status = os.fstat(fd)
        header = os.pread(fd, _abi.SEG_HEADER_BYTES, 0)
    finally:
        os.close(fd)
    if len(header) < ctypes.sizeof(_abi.SegHeader):
        return False, "unknown: too small to be a UCM segment", None
    parsed = _abi.SegHeader.from_buffer_copy(header)
    if parsed.magic != _abi.SEG_MAGIC or parsed.layout_version != _abi.SEG_LAYOUT_VERSION:
        return (
            False,
            f"unknown: not a UCM segment of layout version {_abi.SEG_LAYOUT_VERSION}",
            None,
        )
    live = [
        int(entry.pid)
        for entry in parsed.attach
        if entry.pid and process_start_time(entry.pid) == entry.start_time_ticks
    ]
    if live:
        return True, "live: used by pid " + ", ".join(map(str, sorted(set(live)))), status
    return (
        False,
        f"dead: no live process in the attach table (creator pid {parsed.creator_pid})",
        status,
    )


def process_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat``; None for a missing process or a zombie (as the native
    ``process_alive``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read(4096)
    except OSError:
        return None
    fields = text[text.rfind(b")") + 1 :].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def _same_file(fd: int, path: Path) -> bool:
    try:
        return _same_path(path, os.fstat(fd))
    except OSError:
        return False


def _same_path(path: Path, status: os.stat_result) -> bool:
    try:
        now = os.lstat(path)
    except OSError:
        return False
    return (now.st_ino, now.st_dev) == (status.st_ino, status.st_dev)


def _unlink(path: Path, report: GcReport) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            report.errors.append(f"{path}: cannot remove: {exc.strerror or exc}")
        return False
    return True
