"""Shared-memory regions for CacheBuffer tests: a file under /dev/shm with a unique name per
test, mapped with ``mmap`` (the segment layer replaces this in the product), removed afterwards."""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ucm.native.buffer import BufferCore, Geometry


class ShmRegion:
    """One mapped /dev/shm file. ``address`` stays valid until ``close``."""

    def __init__(self, size_bytes: int, path: str | None = None) -> None:
        self.size_bytes = size_bytes
        self.created = path is None
        self.path = path or f"/dev/shm/ucm-test-{os.getpid()}-{uuid.uuid4().hex}"
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if self.created else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if self.created:
                os.ftruncate(fd, size_bytes)
            self.map = mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self.map)
        self.address = ctypes.addressof(self._anchor)

    def read(self, offset: int, size: int) -> bytes:
        return bytes(self.map[offset : offset + size])

    def write(self, offset: int, data: bytes) -> None:
        self.map[offset : offset + len(data)] = data

    def close(self) -> None:
        self._anchor = None
        self.map.close()
        if self.created:
            os.unlink(self.path)


@dataclass
class SharedBuffer:
    """A control region plus one data segment holding every slot."""

    geometry: Geometry
    ctrl: ShmRegion
    data: ShmRegion
    core: BufferCore

    def slot_offset(self, slot: int) -> int:
        ((segment, offset),) = self.core.slot_locations([slot])
        assert segment == 0
        return offset

    def read_slot(self, slot: int) -> bytes:
        return self.data.read(self.slot_offset(slot), self.geometry.shard_size_bytes)

    def write_slot(self, slot: int, payload: bytes) -> None:
        assert len(payload) == self.geometry.shard_size_bytes
        self.data.write(self.slot_offset(slot), payload)

    def attach_in_child(self) -> SharedBuffer:
        """Maps the same files again (as another rank would) and attaches with validation."""
        ctrl = ShmRegion(self.ctrl.size_bytes, self.ctrl.path)
        data = ShmRegion(self.data.size_bytes, self.data.path)
        core = BufferCore.attach(ctrl.address, ctrl.size_bytes, self.geometry)
        return SharedBuffer(self.geometry, ctrl, data, core)


@contextmanager
def shared_buffer(geometry: Geometry) -> Iterator[SharedBuffer]:
    ctrl = ShmRegion(geometry.ctrl_size_bytes)
    data = ShmRegion(geometry.slot_count_total * geometry.shard_size_bytes)
    try:
        core = BufferCore.create(ctrl.address, ctrl.size_bytes, geometry)
        yield SharedBuffer(geometry, ctrl, data, core)
    finally:
        data.close()
        ctrl.close()


def block(name: str) -> bytes:
    """A readable 16-byte block id."""
    return name.encode().ljust(16, b".")


def payload(key: tuple[bytes, int], size: int) -> bytes:
    """Deterministic shard bytes for a key, different for every key."""
    seed = key[0] + key[1].to_bytes(4, "little")
    chunks = [
        hashlib.blake2b(seed + counter.to_bytes(4, "little")).digest()
        for counter in range(-(-size // 64))
    ]
    return b"".join(chunks)[:size]


class RemoteRank:
    """Another rank of the node: a forked process attached to the same buffer that runs
    BufferCore calls on request. A process holds one reference per slot, so the owner/waiter
    interplay of two ranks needs two processes."""

    def __init__(self, shared: SharedBuffer) -> None:
        import multiprocessing

        context = multiprocessing.get_context("fork")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_serve_rank, args=(shared, child), daemon=True)
        self.process.start()
        self.pid = self.process.pid
        self.holder: int = self.call("holder")

    def call(self, method: str, *args: object, timeout_s: float = 20.0) -> Any:
        self._conn.send((method, args))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"rank {self.pid} did not answer {method} within {timeout_s} s")
        ok, value = self._conn.recv()
        if not ok:
            raise value
        return value

    def get(self, keys: list[tuple[bytes, int]]) -> tuple[list[int], list[int]]:
        return self.call("get", keys)  # type: ignore[no-any-return]

    def start(self, method: str, *args: object) -> None:
        """Sends a request without waiting for its answer (the rank may block in it)."""
        self._conn.send((method, args))

    def answer(self, timeout_s: float = 20.0) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"rank {self.pid} did not answer within {timeout_s} s")
        ok, value = self._conn.recv()
        if not ok:
            raise value
        return value

    def kill(self) -> None:
        import signal

        os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            self._conn.send(("exit", ()))
            self.process.join(10)
        if self.process.is_alive():
            self.kill()


def _serve_rank(shared: SharedBuffer, conn: Any) -> None:
    rank = shared.attach_in_child()
    core = rank.core
    while True:
        if not conn.poll(60):
            return
        method, args = conn.recv()
        try:
            if method == "exit":
                return
            if method == "holder":
                value: object = core.holder
            elif method == "get":
                got = core.get(*args)
                value = ([int(r) for r in got.results], list(got.slots))
            elif method == "sleep":
                import time

                time.sleep(*args)
                value = None
            else:
                result = getattr(core, method)(*args)
                value = [int(r) for r in result] if isinstance(result, list) else result
            conn.send((True, value))
        except Exception as exc:  # handed to the caller, which re-raises it
            conn.send((False, exc))
