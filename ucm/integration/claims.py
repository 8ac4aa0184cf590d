"""Compute claims: which blocks an engine on this node is computing right now, so that another
engine that asks for the same prefix meanwhile waits for those blocks to be saved instead of
computing them a second time (two replicas behind one load balancer, one shared CacheBuffer).

A claim on a block is an exclusive *open file description* lock (``fcntl`` ``F_OFD_SETLK``) on
one byte of the stack's CacheBuffer lock file, ``/dev/shm/ucm-<unique_id>.lock``, at an offset
derived from the block id. The kernel keeps the table:

- a claim dies with its engine (exit, SIGTERM, kill -9: the file description is closed), so a
  dead engine never holds another one up, and nothing is left behind (no file of its own: the
  lock file is the buffer's, reclaimed with it);
- an engine's own claims never stand in its way (locks of one file description never conflict);
- a check (``F_OFD_GETLK``) takes nothing and never waits.

A claim only ever makes another engine *wait*, bounded by its ``ucm_compute_wait_ms``; it never
changes which bytes are served (a block is served only once it is in the store). Two block ids
that share an offset (a 62-bit hash) make one engine wait for the other's block: still bounded,
never wrong. Without a CacheBuffer (no lock file: nothing shared on the node) there are no
claims.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
from collections.abc import Iterable
from pathlib import Path

from ..native import segments

logger = logging.getLogger(__name__)

_OFFSET_MASK = (1 << 62) - 1
_FLOCK = "hhxxxxqqixxxx"
"""``struct flock`` on Linux x86-64 and aarch64: l_type, l_whence, l_start, l_len, l_pid."""


def _offset(block_id: bytes) -> int:
    return int.from_bytes(block_id[:8], "little") & _OFFSET_MASK


class ComputeClaims:
    """This engine's claims on the node (one open file description of the lock file)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self._held: set[bytes] = set()

    @classmethod
    def open(cls, unique_id: str) -> ComputeClaims | None:
        """The claims of the stack's CacheBuffer, or None without one on this node."""
        path = segments.SHM_DIR / f"ucm-{unique_id}.lock"
        try:
            return cls(path)
        except OSError as exc:
            logger.info("UCM: no compute claims (%s: %s)", path, exc)
            return None

    def _lock(self, command: int, kind: int, block_id: bytes) -> bytes:
        request = struct.pack(_FLOCK, kind, os.SEEK_SET, _offset(block_id), 1, 0)
        return fcntl.fcntl(self._fd, command, request)

    def claimed_elsewhere(self, block_id: bytes) -> bool:
        """Whether another engine claims ``block_id`` now (never waits, takes nothing)."""
        if self._fd < 0:
            return False
        try:
            answer = self._lock(fcntl.F_OFD_GETLK, fcntl.F_WRLCK, block_id)
        except OSError as exc:
            logger.debug("UCM: compute claim check failed: %s", exc)
            return False
        kind: int = struct.unpack(_FLOCK, answer)[0]
        return kind != fcntl.F_UNLCK

    def claim(self, block_ids: Iterable[bytes]) -> list[bytes]:
        """Claims each block not claimed yet; returns those this call claimed (a block another
        engine claims is left to it)."""
        claimed: list[bytes] = []
        if self._fd < 0:
            return claimed
        for block_id in block_ids:
            if block_id in self._held:
                continue
            try:
                self._lock(fcntl.F_OFD_SETLK, fcntl.F_WRLCK, block_id)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    logger.debug("UCM: compute claim failed: %s", exc)
                continue
            self._held.add(block_id)
            claimed.append(block_id)
        return claimed

    def release(self, block_ids: Iterable[bytes]) -> None:
        for block_id in block_ids:
            if block_id not in self._held:
                continue
            self._held.discard(block_id)
            try:
                self._lock(fcntl.F_OFD_SETLK, fcntl.F_UNLCK, block_id)
            except OSError as exc:
                logger.debug("UCM: compute claim release failed: %s", exc)

    @property
    def held(self) -> frozenset[bytes]:
        return frozenset(self._held)

    def close(self) -> None:
        """Drops every claim (closing the file description releases its locks)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._held.clear()
