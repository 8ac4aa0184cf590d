"""The ``posix`` tier: local NVMe (or any POSIX filesystem), one file per block.

File format. ``<path>/<hex[:2]>/<hex>.blk`` holds shard ``s`` at byte ``shard_size * s`` (as
the tier's ``codec:`` stored it: a compressed payload starts there and the rest of its place
stays a hole, so a block costs the bytes its codec left) and a footer at ``block_size``, padded
to 4 KiB so O_DIRECT I/O stays aligned::

    magic "UCMEBLK1" | u32 version | u32 shards_per_block | u64 shard_size
    per shard: u32 flags (bit 0 = present, bit 1 = lost) | the shard's envelope (``ucm.envelope``,
    48 bytes: codec, length, XXH3-64 of the shard, digest of its key; zeros when absent)
    u32 crc32 of everything above

The envelope is the one every lower tier stores (one header, one checksum rule, one parser).
Files of the formats before it (``UCMPOSX1``, versions 1 and 2) read as foreign ones: a miss,
replaced by the next dump of their block.

A shard whose checksum does not match (a torn or corrupted file) is removed and its load fails
with a TierError saying so (not a miss: the stack then repairs it from a tier below). The removed
shard stays marked *lost* in the footer (a file whose footer is unreadable becomes a footer-only
file with every shard lost), so a later load of it, by any rank or process, is again a failure and
gets repaired too, instead of a plain miss that nobody repairs: ranks load different shards of a
block, and only the first one to read a torn file sees it torn. A dump that meets a file whose
footer is unreadable marks every shard it does not write lost the same way. A lost shard is not
present (lookup says False); a dump, remove or eviction of it clears the mark.

Writes. A block file is never modified in place: a dump builds the new file (the shards already
present plus the new ones) under a temporary name and ``os.replace``-s it, so readers, which take
no lock, always see a complete file. The temp files of writers killed mid-dump are removed
behind each open of the tier and by every eviction scan (those of live processes are kept).
We keep one file per block (rather than one per shard) so a block is one sequential read and
one inode; the price is a read-modify-write when a shard joins an existing block, done under
an exclusive ``flock`` on the block's lock stripe, so writers of different shards of one block
in different processes never lose each other's shard.

Locks (``<path>/.locks``): ``global.lock`` is taken shared by writers/touch and exclusive by
``batched_remove`` (once per chunk of REMOVE_CHUNK_KEYS keys) and eviction, each time through
``gate.lock`` so a stream of shared holders cannot starve an exclusive one; ``NN.lock`` (256
stripes by the first block-id byte) serialise writers of the same block. flock locks belong to an
open file description, so each acquisition opens its own descriptor: threads of one process
exclude each other exactly like processes do. Every lock wait is bounded by ``lock_timeout``.

Control records (reset epochs, ``Tier.read_control``): ``<path>/control/<name hex>/<value>``,
one small checksummed file per value (``ucm.control``), outside every scan, capacity, quota,
eviction, listing and namespace of the tier.

Eviction. With ``capacity`` set, a pass runs when this process's estimate of the directory's size
exceeds it (and at least every capacity/8 bytes written, so other processes' writes are seen). It
scans the directory, drops whole blocks oldest-mtime first (dump, load and touch set the mtime),
hands them to ``context.evict_sink`` first when a ``write: back`` tier is below, and keeps every
shard whose write-down failed. A block touched or rewritten between the scan and the drop is kept.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import secrets
import struct
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field

import ucm
from ucm import control, envelope, namespaces
from ucm.affinity import in_background
from ucm.config import LowerTierConfig, Size
from ucm.errors import ConfigError, KeyMissingError, TierError
from ucm.fieldtypes import Flag, Int, Seconds
from ucm.layout import Key
from ucm.native.pybuffer import copy_into
from ucm.threadname import enter_thread
from ucm.tier import (
    NAMESPACE_BYTES_OPTION,
    REMOVE_CHUNK_KEYS,
    NamespaceBytes,
    NamespaceUsage,
    Outcome,
    ShardViews,
    Tier,
    TierContext,
    chunks,
    scatter,
)

MAGIC = b"UCMEBLK1"
VERSION = 1
ALIGN = 4096
_HEAD = struct.Struct("<8sIIQ")
_FLAGS = struct.Struct("<I")
_ENTRY_BYTES = _FLAGS.size + envelope.HEADER_BYTES
_NO_ENVELOPE = bytes(envelope.HEADER_BYTES)
_CRC = struct.Struct("<I")
_PRESENT = 1
_LOST = 2
_STRIPES = 256
_TEMP_MAX_AGE_S = 3600.0
_IOV_MAX = 1024

T = TypeVar("T")


class PosixConfig(LowerTierConfig):
    """A directory on local storage; several processes (ranks, nodes) may share it."""

    type: Literal["posix"] = "posix"
    path: str = Field(min_length=1, description="Directory holding the block files.")
    capacity: Size | None = Field(
        default=None, description="Bound on the bytes on disk; oldest-touched blocks go first."
    )
    o_direct: Flag = Field(
        default=False,
        description="Bypass the page cache (O_DIRECT) when the filesystem and geometry allow it "
        "(shard_size a multiple of 4096); falls back to buffered I/O otherwise.",
    )
    io_threads: Int = Field(
        default=8,
        ge=1,
        le=256,
        description="Parallel file I/O per batch (a deeper queue keeps the device busy).",
    )
    fsync: Flag = Field(default=False, description="fsync each block file and its directory.")
    lock_timeout: Seconds = Field(
        default=30.0, description="Seconds to wait for a file lock before failing."
    )

    def block_footprint(self, shard_size: int, shards_per_block: int) -> tuple[int, str] | None:
        size = block_file_size(shard_size, shards_per_block)
        footer = size - shard_size * shards_per_block
        return size, (
            f"one file: {shards_per_block} shard(s) of {shard_size} bytes and a {footer}-byte "
            f"footer, {ALIGN}-aligned"
        )


def footer_lengths(shards_per_block: int) -> tuple[int, int]:
    """(footer bytes, the footer's region in the file): the region also ends with a copy of the
    head, so a file of another geometry (whose footer is elsewhere) is recognised from its last
    bytes instead of looking corrupt."""
    footer_len = _HEAD.size + _ENTRY_BYTES * shards_per_block + _CRC.size
    return footer_len, _round_up(footer_len + _HEAD.size, ALIGN)


def block_file_size(shard_size: int, shards_per_block: int) -> int:
    """Bytes of one block file (every shard present, no codec)."""
    return shard_size * shards_per_block + footer_lengths(shards_per_block)[1]


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


class _Corrupt(Exception):
    """The footer is unreadable (torn or corrupted file)."""


class _Foreign(Exception):
    """A valid footer of a different geometry (another stack sharing the directory)."""


@dataclass
class _Footer:
    present: list[bool]
    headers: list[bytes]
    """The envelope header of each present shard (zeros for an absent one)."""
    lost: list[bool]
    envelopes: list[envelope.Envelope | None]
    """``headers`` parsed (None for an absent shard)."""


@dataclass
class _Counts:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


def _aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can read into the view: address and length multiples of ALIGN."""
    if len(view) % ALIGN or view.readonly:
        return False
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return False
    return address % ALIGN == 0


def _scatter(data: ShardViews, views: ShardViews) -> None:
    """Copies a shard held in ``data`` into ``views`` (both split any way)."""
    scatter(data[0] if len(data) == 1 else b"".join(data), views)


def _split_present(run: list[int], footer: _Footer) -> list[list[int]]:
    """The run's present shards, as runs of adjacent shards."""
    pieces: list[list[int]] = []
    for shard in run:
        if not footer.present[shard]:
            continue
        if pieces and pieces[-1][-1] == shard - 1:
            pieces[-1].append(shard)
        else:
            pieces.append([shard])
    return pieces


class PosixTier(Tier):
    type_name = "posix"
    config_model = PosixConfig
    remove_chunk_keys = REMOVE_CHUNK_KEYS
    """Keys per lock acquisition in batched_remove (a benchmark compares other values)."""

    def __init__(self, config: ucm.TierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        assert isinstance(config, PosixConfig)
        self.cfg: PosixConfig = config
        self.root = Path(config.path)
        layout = self.layout
        self.shard_size = layout.shard_size
        self.spb = layout.shards_per_block
        self.block_size = layout.block_size
        self.footer_len, self.footer_region = footer_lengths(self.spb)
        self.file_size = self.block_size + self.footer_region
        try:
            (self.root / ".locks").mkdir(parents=True, exist_ok=True)
            for stripe in range(_STRIPES):
                (self.root / f"{stripe:02x}").mkdir(exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"posix tier {self.label!r}: cannot create directory {str(self.root)!r}: "
                f"{exc.strerror}"
            ) from None
        self._global_lock_path = str(self.root / ".locks" / "global.lock")
        self._gate_lock_path = str(self.root / ".locks" / "gate.lock")
        self._direct = False
        self.o_direct_fallback_reason = ""
        if config.o_direct:
            if self.shard_size % ALIGN:
                self.o_direct_fallback_reason = (
                    f"shard_size {self.shard_size} is not a multiple of {ALIGN}"
                )
            else:
                self._direct = True
        self._local = threading.local()
        self._stats_lock = threading.Lock()
        self._counts = _Counts()
        self._stat: dict[str, int] = dict.fromkeys(
            (
                "lock_acquisitions",
                "remove_lock_acquisitions",
                "evictions",
                "eviction_passes",
                "namespace_eviction_passes",
                "evict_sink_failures",
                "touches",
            ),
            0,
        )
        self._pool = ThreadPoolExecutor(
            config.io_threads, thread_name_prefix="ucm-posix", initializer=enter_thread
        )
        self._sweeper = ThreadPoolExecutor(
            1, thread_name_prefix="ucm-temp-sweep", initializer=enter_thread
        )
        self._closed = False
        self._usage = 0
        self._written_since_scan = 0
        self._evict_lock = threading.Lock()
        self._made_dirs: set[str] = set()
        # Each namespace's bytes here (this process's estimate, exact after every scan): what
        # namespace byte quotas (the stack's `quotas:` for this tier) are enforced against, and
        # what stats report per namespace.
        quotas: NamespaceBytes | None = context.options.get(NAMESPACE_BYTES_OPTION)
        self._namespace_usage = NamespaceUsage(quotas)
        self.temp_sweep: Future[None] | None = None
        """The sweep of dead writers' temp files behind open (None: the scans reap them)."""
        if config.capacity is not None:
            total, entries = self._scan()
            self._usage = total
            self._namespace_usage.rescanned(_by_namespace(entries))
        else:
            # No eviction scan will ever reap what writers killed mid-dump left: sweep once,
            # behind open, on a thread of its own (never one of the I/O pool's, which
            # loads wait for); close stops it between two directories.
            self.temp_sweep = self._sweeper.submit(self._reap_temps)
            self._sweeper.shutdown(wait=False)  # its thread exits when done
        if quotas is not None:
            self.evict_namespace_quotas()

    # ----------------------------------------------------------------- paths, locks, buffers

    def block_path(self, block_id: bytes) -> str:
        hexid = block_id.hex()
        prefix = self.namespace_prefix(block_id)
        if not prefix:
            return os.path.join(self.root, hexid[:2], hexid + ".blk")
        # A namespace's own tree; striped by a byte of the id's hash (its first 8 bytes are
        # the namespace's tag, the same for all of them).
        return os.path.join(self.root, prefix, hexid[16:18], hexid + ".blk")

    def _make_parent(self, path: str) -> None:
        """Creates a namespace's stripe directory on its first write (the default namespace's
        exist from open)."""
        directory = os.path.dirname(path)
        if directory not in self._made_dirs:
            os.makedirs(directory, exist_ok=True)
            self._made_dirs.add(directory)

    def _bump(self, name: str, amount: int = 1) -> None:
        with self._stats_lock:
            self._stat[name] += amount

    def _flock(self, path: str, mode: int, counted: bool = True) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + self.cfg.lock_timeout
        delay = 0.0002
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                if counted:
                    self._bump("lock_acquisitions")
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise TierError(
                        f"posix tier {self.label!r}: timed out after {self.cfg.lock_timeout}s "
                        f"waiting for lock file {path!r}"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.01)

    @contextmanager
    def _global(self, exclusive: bool) -> Iterator[None]:
        # flock prefers readers: while writers keep the global lock shared without a gap (two
        # ranks dumping), an exclusive request (remove, eviction) would never be granted. So
        # every locker first passes a gate, held only until its global lock is granted: a
        # remover waiting in the gate stops new shared holders, the current ones finish, and
        # it gets its turn.
        gate = self._flock(self._gate_lock_path, fcntl.LOCK_EX, counted=False)
        try:
            fd = self._flock(self._global_lock_path, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            os.close(gate)
        try:
            yield
        finally:
            os.close(fd)  # closing the only descriptor releases the flock

    @contextmanager
    def _write_locks(self, block_id: bytes) -> Iterator[None]:
        with self._global(exclusive=False):
            # By the first id byte; a namespace's ids all start with its tag: by their 9th.
            spread = block_id[8] if self.namespace_prefix(block_id) else block_id[0]
            stripe = str(self.root / ".locks" / f"{spread:02x}.lock")
            fd = self._flock(stripe, fcntl.LOCK_EX)
            try:
                yield
            finally:
                os.close(fd)

    def _buffer(self, name: str, size: int) -> mmap.mmap:
        """A per-thread page-aligned scratch buffer (O_DIRECT needs aligned memory)."""
        buf: mmap.mmap | None = getattr(self._local, name, None)
        if buf is None or len(buf) != size:
            buf = mmap.mmap(-1, size)
            setattr(self._local, name, buf)
        return buf

    def _disable_direct(self, reason: str) -> None:
        if self._direct:
            self._direct = False
            self.o_direct_fallback_reason = reason

    def _open_read(self, path: str) -> tuple[int, bool]:
        """Opens for reading, with O_DIRECT when active; returns (fd, direct)."""
        if self._direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._disable_direct(f"the filesystem refused O_DIRECT: {exc.strerror}")
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC), False

    def _pread_exact(self, fd: int, direct: bool, size: int, offset: int) -> memoryview:
        """Reads ``size`` bytes (aligned scratch for O_DIRECT); raises _Corrupt when short."""
        if direct:
            buf = self._buffer("rd_" + str(size), _round_up(size, ALIGN))
            view = memoryview(buf)[: _round_up(size, ALIGN)]
            got = os.preadv(fd, [view], offset)
            if got < size:
                raise _Corrupt(f"file shorter than expected ({offset + got} bytes)")
            return view[:size]
        data = os.pread(fd, size, offset)
        if len(data) < size:
            raise _Corrupt(f"file shorter than expected ({offset + len(data)} bytes)")
        return memoryview(data)

    # ------------------------------------------------------------------------------ footer

    def _encode_footer(self, footer: _Footer) -> bytes:
        parts = [_HEAD.pack(MAGIC, VERSION, self.spb, self.shard_size)]
        for present, header, lost in zip(footer.present, footer.headers, footer.lost, strict=True):
            parts.append(_FLAGS.pack((_PRESENT if present else 0) | (_LOST if lost else 0)))
            parts.append(header if present else _NO_ENVELOPE)
        body = b"".join(parts)
        return body + _CRC.pack(zlib.crc32(body))

    def _decode_footer(self, block_id: bytes, raw: memoryview) -> _Footer:
        legacy = envelope.legacy_format(raw)
        if legacy is not None:
            raise _Foreign(f"block file of an older format, a {legacy}")
        body = raw[: self.footer_len - _CRC.size]
        magic, version, spb, shard_size = _HEAD.unpack_from(body)
        if magic != MAGIC:
            raise _Corrupt("bad magic")
        (crc,) = _CRC.unpack_from(raw, self.footer_len - _CRC.size)
        if crc != zlib.crc32(body):
            raise _Corrupt("footer checksum mismatch")
        if spb != self.spb or shard_size != self.shard_size or version != VERSION:
            raise _Foreign(
                f"block file of another geometry (version {version}, shards_per_block {spb}, "
                f"shard_size {shard_size})"
            )
        footer = _Footer([], [], [], [])
        for index in range(self.spb):
            offset = _HEAD.size + index * _ENTRY_BYTES
            (flags,) = _FLAGS.unpack_from(body, offset)
            header = bytes(body[offset + _FLAGS.size : offset + _ENTRY_BYTES])
            parsed = None
            if flags & _PRESENT:
                try:
                    parsed = envelope.parse(header, (block_id, index), self.shard_size)
                except envelope.Foreign as exc:
                    raise _Foreign(f"shard {index}: {exc}") from None
                except envelope.Corrupt as exc:
                    raise _Corrupt(f"shard {index}: {exc}") from None
            footer.present.append(bool(flags & _PRESENT))
            footer.lost.append(bool(flags & _LOST) and not flags & _PRESENT)
            footer.headers.append(header)
            footer.envelopes.append(parsed)
        return footer

    def _read_footer(self, block_id: bytes, fd: int, direct: bool) -> _Footer:
        try:
            if direct:
                raw = self._pread_exact(fd, True, self.footer_region, self.block_size)
            else:
                raw = self._pread_exact(fd, False, self.footer_len, self.block_size)
            return self._decode_footer(block_id, raw[: self.footer_len])
        except _Corrupt:
            self._check_foreign(fd, direct)
            raise

    def _check_foreign(self, fd: int, direct: bool) -> None:
        """Raises _Foreign when the file ends with a valid head of another geometry. Checked
        whatever the file's size: geometries can share one (2 shards of 8 KiB and 4 of 4 KiB),
        and a file of another stack is never ours to drop as corrupt."""
        size = os.fstat(fd).st_size
        if size < _HEAD.size:
            return
        start = (size - _HEAD.size) // ALIGN * ALIGN  # aligned, for O_DIRECT descriptors
        length = _round_up(size - start, ALIGN)
        buf = memoryview(self._buffer("tail", 2 * ALIGN))[:length]
        got = os.preadv(fd, [buf], start) if direct else os.preadv(fd, [buf[: size - start]], start)
        if got < size - start:
            return
        tail = bytes(buf[size - start - _HEAD.size : size - start])
        legacy = envelope.legacy_format(tail)
        if legacy is not None:
            raise _Foreign(f"block file of an older format, a {legacy}")
        magic, version, spb, shard_size = _HEAD.unpack(tail)
        if magic == MAGIC and (spb, shard_size, version) != (self.spb, self.shard_size, VERSION):
            raise _Foreign(
                f"block file of another geometry (version {version}, shards_per_block {spb}, "
                f"shard_size {shard_size})"
            )

    def _footer_of(self, block_id: bytes) -> _Footer | None:
        """The footer of a block's file; None when absent, unreadable or foreign."""
        try:
            fd = os.open(self.block_path(block_id), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            return self._read_footer(block_id, fd, False)
        except (_Corrupt, _Foreign):
            return None
        finally:
            os.close(fd)

    # ------------------------------------------------------------------------ batch helper

    def _run(self, fn: Any, groups: list[T]) -> list[Any]:
        # A background caller (write-through: nobody waits) does its own I/O at its own low
        # priority; the pool's threads also serve loads an engine waits for.
        if len(groups) <= 1 or self.cfg.io_threads == 1 or in_background():
            return [fn(group) for group in groups]
        return list(self._pool.map(fn, groups))

    @staticmethod
    def _group(keys: Sequence[Key]) -> dict[bytes, list[int]]:
        groups: dict[bytes, list[int]] = {}
        for position, (block_id, _shard) in enumerate(keys):
            groups.setdefault(block_id, []).append(position)
        return groups

    # ------------------------------------------------------------------------------ lookup

    def lookup(self, keys: Sequence[Key]) -> list[bool]:
        groups = self._group(keys)
        result = [False] * len(keys)

        def one(item: tuple[bytes, list[int]]) -> None:
            footer = self._footer_of(item[0])
            if footer is not None:
                for position in item[1]:
                    result[position] = footer.present[keys[position][1]]

        self._run(one, list(groups.items()))
        return result

    def lookup_blocks(self, block_ids: Sequence[bytes]) -> list[bool]:
        def one(block_id: bytes) -> bool:
            footer = self._footer_of(block_id)
            return footer is not None and all(footer.present)

        return self._run(one, list(block_ids))

    # -------------------------------------------------------------------------------- load

    def load(self, keys: Sequence[Key], destinations: Sequence[ShardViews]) -> list[Outcome]:
        assert len(keys) == len(destinations), "one destination per key"
        outcomes: list[Outcome] = [None] * len(keys)
        groups = self._group(keys)

        def one(item: tuple[bytes, list[int]]) -> _Counts:
            return self._load_block(item[0], item[1], keys, destinations, outcomes)

        items = list(groups.items())
        counts: list[_Counts] = []
        if len(items) > 1 and self.cfg.io_threads > 1:
            # A block without a file is a miss answered on this thread: a hand-off to the pool
            # per missing block costs far more than its stat (the miss path's CPU, issue 21).
            absent = {b for b, _ in items if not os.path.exists(self.block_path(b))}
            if absent:
                counts = [self._absent(b, ps, keys, outcomes) for b, ps in items if b in absent]
                items = [item for item in items if item[0] not in absent]
        counts += self._run(one, items)
        with self._stats_lock:
            for c in counts:
                self._counts.hits += c.hits
                self._counts.misses += c.misses
                self._counts.corrupt += c.corrupt
                self._counts.bytes_read += c.bytes_read
        return outcomes

    def _absent(
        self, block_id: bytes, positions: list[int], keys: Sequence[Key], outcomes: list[Outcome]
    ) -> _Counts:
        """The outcomes of a block that has no file here: a miss of each of its keys."""
        hexid = block_id.hex()
        for position in positions:
            outcomes[position] = KeyMissingError(
                f"posix tier {self.label!r}: block {hexid} shard {keys[position][1]} is not present"
            )
        counts = _Counts()
        counts.misses = len(positions)
        return counts

    def _load_block(
        self,
        block_id: bytes,
        positions: list[int],
        keys: Sequence[Key],
        destinations: Sequence[ShardViews],
        outcomes: list[Outcome],
    ) -> _Counts:
        counts = _Counts()
        path = self.block_path(block_id)
        hexid = block_id.hex()

        def miss(position: int, why: str) -> None:
            counts.misses += 1
            outcomes[position] = KeyMissingError(
                f"posix tier {self.label!r}: block {hexid} shard {keys[position][1]} {why}"
            )

        def corrupt(position: int, why: str) -> None:
            # A failure, not a miss: the stack rewrites (repairs) the shard here once a tier
            # below serves it.
            outcomes[position] = TierError(
                f"posix tier {self.label!r}: block {hexid} shard {keys[position][1]} is corrupt "
                f"({why})"
            )

        try:
            fd, direct = self._open_read(path)
        except FileNotFoundError:
            return self._absent(block_id, positions, keys, outcomes)
        except OSError as exc:
            for position in positions:
                outcomes[position] = TierError(
                    f"posix tier {self.label!r}: cannot open {path!r}: {exc.strerror}"
                )
            return counts
        try:
            by_shard: dict[int, list[int]] = {}
            for position in positions:
                by_shard.setdefault(keys[position][1], []).append(position)
            # Each requested shard is read once, into the first destination asking for it
            # (straight into it when O_DIRECT allows), in one call per run of adjacent shards.
            targets = {
                shard: self._read_target(destinations[ps[0]], direct, shard)
                for shard, ps in by_shard.items()
            }
            done: set[int] = set()
            try:
                footer = self._read_runs_and_footer(
                    block_id, fd, direct, sorted(by_shard), targets, done
                )
            except _Foreign as exc:
                for position in positions:
                    miss(position, f"is not readable here: {exc}")
                return counts
            except _Corrupt as exc:
                for position in positions:
                    corrupt(position, f"{exc}; its data was removed")
                counts.corrupt += 1
                self._drop_corrupt(block_id, fd, None, None)
                return counts
            bad: list[int] = []
            for shard, shard_positions in by_shard.items():
                if not footer.present[shard]:
                    for position in shard_positions:
                        if footer.lost[shard]:
                            corrupt(position, "it was removed earlier; a tier below may repair it")
                        else:
                            miss(position, "is not present")
                    continue
                try:
                    if shard not in done:
                        self._read_run(fd, direct, [shard], targets)
                except _Corrupt as exc:
                    bad.append(shard)
                    for position in shard_positions:
                        corrupt(position, f"{exc}; it was removed")
                    continue
                except OSError as exc:
                    for position in shard_positions:
                        outcomes[position] = TierError(
                            f"posix tier {self.label!r}: reading {path!r}: {exc.strerror}"
                        )
                    continue
                data = targets[shard]
                shard_envelope = footer.envelopes[shard]
                assert shard_envelope is not None, "a present shard has an envelope"
                try:
                    if shard_envelope.codec == envelope.Codec.NONE:
                        envelope.verify(shard_envelope, data)
                    else:
                        # The payload sits at the start of the shard's place in the file; it
                        # is decoded here, on this I/O thread, into the destination.
                        payload = b"".join(data)[: shard_envelope.stored]
                        data = [memoryview(envelope.decode(shard_envelope, payload))]
                except envelope.Corrupt as exc:
                    bad.append(shard)
                    for position in shard_positions:
                        corrupt(position, f"{exc}; it was removed")
                    continue
                for position in shard_positions:
                    views = destinations[position]
                    if views is not data:
                        _scatter(data, views)
                    counts.hits += 1
                    counts.bytes_read += self.shard_size
            if bad:
                counts.corrupt += len(bad)
                self._drop_corrupt(block_id, fd, bad, footer)
        finally:
            os.close(fd)
        if counts.hits:
            self._set_time(path)
        return counts

    def _read_target(self, views: ShardViews, direct: bool, shard: int) -> ShardViews:
        """Where a shard is read to: the destination views themselves, unless O_DIRECT needs
        aligned memory they do not offer (then this thread's scratch, copied out after)."""
        if not direct or all(_aligned(view) for view in views):
            return views
        scratch = memoryview(self._buffer("scratch", self.block_size))
        return [scratch[shard * self.shard_size : (shard + 1) * self.shard_size]]

    def _read_runs_and_footer(
        self,
        block_id: bytes,
        fd: int,
        direct: bool,
        shards: list[int],
        targets: dict[int, ShardViews],
        done: set[int],
    ) -> _Footer:
        """Reads the footer, together with the run of requested shards that ends at the last
        shard (the footer follows it in the file: one read like ``dd``'s for a whole block),
        then every other run of requested shards present in the footer; adds what it read to
        ``done``. Raises _Corrupt / _Foreign for an unusable footer."""
        runs: list[list[int]] = []
        for shard in shards:
            if runs and runs[-1][-1] == shard - 1:
                runs[-1].append(shard)
            else:
                runs.append([shard])
        footer: _Footer | None = None
        if runs and runs[-1][-1] == self.spb - 1:
            tail = runs.pop()
            scratch = memoryview(self._buffer("footer", self.footer_region))
            iov = [view for shard in tail for view in targets[shard]]
            wanted = len(tail) * self.shard_size + self.footer_region
            try:
                got = (
                    os.preadv(fd, [*iov, scratch], tail[0] * self.shard_size)
                    if len(iov) < _IOV_MAX
                    else -1
                )
            except OSError:
                got = -1  # left to the plain path below, which reports it
            if got != wanted:
                runs.append(tail)
            if got == wanted:
                try:
                    footer = self._decode_footer(block_id, scratch[: self.footer_len])
                except _Corrupt:
                    self._check_foreign(fd, direct)
                    raise
                done.update(tail)
        if footer is None:
            footer = self._read_footer(block_id, fd, direct)
        for run in runs:
            for piece in _split_present(run, footer):
                try:
                    self._read_run(fd, direct, piece, targets)
                except (OSError, _Corrupt):
                    continue  # read again one shard at a time, which reports the failure
                done.update(piece)
        return footer

    def _read_run(
        self, fd: int, direct: bool, run: list[int], targets: dict[int, ShardViews]
    ) -> None:
        """Reads adjacent shards into their targets in one call; _Corrupt when short."""
        iov = [view for shard in run for view in targets[shard]]
        if len(iov) >= _IOV_MAX and len(run) > 1:
            for shard in run:
                self._read_run(fd, direct, [shard], targets)
            return
        wanted = len(run) * self.shard_size
        got = os.preadv(fd, iov, run[0] * self.shard_size)
        if got < wanted:
            raise _Corrupt(f"short read ({got} of {wanted} bytes)")

    def _set_time(self, path: str) -> None:
        now = time.time_ns()
        with suppress(FileNotFoundError):
            os.utime(path, ns=(now, now))

    def _drop_corrupt(
        self, block_id: bytes, fd: int, shards: list[int] | None, footer: _Footer | None
    ) -> None:
        """Removes corrupt shards (or the whole file when ``shards`` is None) if the file at the
        block's path is still the one we read through ``fd`` (kept open, so its inode number
        cannot be reused meanwhile)."""
        path = self.block_path(block_id)
        inode = os.fstat(fd).st_ino
        with self._write_locks(block_id):
            try:
                if os.stat(path).st_ino != inode:
                    return  # replaced by a writer since: not ours to judge
            except FileNotFoundError:
                return
            if shards is None or footer is None:
                # Which shards the file held is unknown: mark every one lost.
                every = set(range(self.spb))
                nothing = _Footer(
                    [False] * self.spb,
                    [_NO_ENVELOPE] * self.spb,
                    [False] * self.spb,
                    [None] * self.spb,
                )
                grown = self._rewrite_locked(block_id, nothing, lose=every)
            else:
                grown = self._rewrite_locked(block_id, footer, drop=set(shards), lose=set(shards))
            with self._stats_lock:
                self._usage += grown

    # -------------------------------------------------------------------------------- dump

    def dump(self, keys: Sequence[Key], sources: Sequence[ShardViews]) -> list[Outcome]:
        assert len(keys) == len(sources), "one source per key"
        outcomes: list[Outcome] = [None] * len(keys)
        groups = self._group(keys)
        over = [False]
        """Whether a namespace went over its byte quota here (set by the I/O threads)."""

        def one(item: tuple[bytes, list[int]]) -> int:
            block_id, positions = item
            try:
                grown = self._dump_block(block_id, positions, keys, sources)
                if self._namespace_usage.add(namespaces.namespace_of(block_id), grown):
                    over[0] = True
                return grown
            except Exception as exc:
                error = (
                    exc
                    if isinstance(exc, TierError)
                    else TierError(
                        f"posix tier {self.label!r}: writing block {block_id.hex()}: "
                        f"{type(exc).__name__}: {exc}"
                    )
                )
                for position in positions:
                    outcomes[position] = error
                return 0

        grown = sum(self._run(one, list(groups.items())))
        written = self.shard_size * sum(1 for o in outcomes if o is None)
        with self._stats_lock:
            self._counts.bytes_written += written
            self._usage += grown
            self._written_since_scan += written
            over_capacity = self.cfg.capacity is not None and (
                self._usage > self.cfg.capacity
                or self._written_since_scan > max(self.cfg.capacity // 8, 1)
            )
        if over_capacity:
            self.evict_to_capacity()
        if over[0]:
            self.evict_namespace_quotas()
        return outcomes

    def _dump_block(
        self,
        block_id: bytes,
        positions: list[int],
        keys: Sequence[Key],
        sources: Sequence[ShardViews],
    ) -> int:
        """Writes the given shards into the block's file; returns the growth in disk bytes."""
        new: dict[int, ShardViews] = {}
        for position in positions:
            views = sources[position]
            assert sum(len(v) for v in views) == self.shard_size, "source size != shard_size"
            new[keys[position][1]] = views  # the last of duplicate keys wins
        # The codec runs here, on an I/O thread, before the block's lock is taken.
        sealed = {
            shard: envelope.encode((block_id, shard), views, self.cfg.codec)
            for shard, views in new.items()
        }
        with self._write_locks(block_id):
            return self._rewrite_locked(block_id, None, new=sealed)

    def _rewrite_locked(
        self,
        block_id: bytes,
        footer: _Footer | None,
        new: dict[int, envelope.Sealed] | None = None,
        drop: set[int] | None = None,
        lose: set[int] | None = None,
    ) -> int:
        """Writes the block's new file (existing shards minus ``drop`` plus ``new``; ``lose``:
        dropped shards to mark lost) via a temp name and rename, or unlinks it when nothing is
        left. Caller holds the block's write lock (or the global lock exclusively). Returns the
        change in disk bytes."""
        new = new or {}
        drop = drop or set()
        lose = lose or set()
        path = self.block_path(block_id)
        image = self._buffer("image", self.file_size)
        present = [False] * self.spb
        stored = [0] * self.spb
        headers = [_NO_ENVELOPE] * self.spb
        lost = [shard in lose and shard not in new for shard in range(self.spb)]
        old_bytes = 0
        try:
            old_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            old_fd = -1
        if old_fd >= 0:
            try:
                old_bytes = os.fstat(old_fd).st_blocks * 512
                if footer is None:
                    try:
                        footer = self._read_footer(block_id, old_fd, False)
                    except _Foreign:
                        footer = None  # replaced wholesale below
                    except _Corrupt:
                        # A torn file (replaced wholesale below): which shards it held is
                        # unknown, so every one not written now is lost, as when a reader
                        # meets it first (_drop_corrupt), and gets repaired from below.
                        footer = None
                        lost = [shard not in new and shard not in drop for shard in range(self.spb)]
                if footer is not None:
                    for shard in range(self.spb):
                        if footer.lost[shard] and shard not in new and shard not in drop:
                            lost[shard] = True
                        if not footer.present[shard] or shard in new or shard in drop:
                            continue
                        offset = shard * self.shard_size
                        got = os.preadv(
                            old_fd, [memoryview(image)[offset : offset + self.shard_size]], offset
                        )
                        kept = footer.envelopes[shard]
                        if got == self.shard_size and kept is not None:
                            present[shard] = True
                            stored[shard] = kept.stored
                            headers[shard] = footer.headers[shard]
            finally:
                os.close(old_fd)
        for shard, sealed in new.items():
            offset = shard * self.shard_size
            for view in sealed.payload:  # GIL released: the engine's threads keep running
                offset += copy_into(image, offset, view)
            present[shard] = True
            stored[shard] = sealed.stored
            headers[shard] = sealed.header
        if not any(present) and not any(lost):
            with suppress(FileNotFoundError):
                os.unlink(path)
            return -old_bytes
        footer_bytes = self._encode_footer(_Footer(present, headers, lost, []))
        image[self.block_size : self.block_size + len(footer_bytes)] = footer_bytes
        head = footer_bytes[: _HEAD.size]
        image[self.block_size + len(footer_bytes) : self.file_size - len(head)] = bytes(
            self.footer_region - len(footer_bytes) - len(head)
        )
        image[self.file_size - len(head) : self.file_size] = head
        return self._write_file(path, image, stored) - old_bytes

    def _write_file(self, path: str, image: mmap.mmap, stored: list[int]) -> int:
        """Writes ``image`` to ``path`` (via a temp name); ``stored``: the bytes of each shard's
        payload (0: absent)."""
        self._make_parent(path)
        directory, name = os.path.split(path)
        temp = os.path.join(
            directory, f".{name}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}.tmp"
        )
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = -1
        direct = self._direct
        if direct:
            try:
                fd = os.open(temp, flags | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._disable_direct(f"the filesystem refused O_DIRECT: {exc.strerror}")
                direct = False
        if fd < 0:
            fd = os.open(temp, flags, 0o644)
        try:
            view = memoryview(image)
            if direct:
                try:
                    self._pwrite_all(fd, view[: self.file_size], 0)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._disable_direct(f"O_DIRECT write refused: {exc.strerror}")
                    os.close(fd)
                    fd = os.open(temp, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
                    direct = False
            if not direct:
                # Absent shards, and what a codec saved of a present one, stay holes: a block
                # costs only what it holds.
                for shard, size in enumerate(stored):
                    if size:
                        offset = shard * self.shard_size
                        self._pwrite_all(fd, view[offset : offset + size], offset)
                self._pwrite_all(fd, view[self.block_size : self.file_size], self.block_size)
            if self.cfg.fsync:
                os.fsync(fd)
            now = time.time_ns()
            os.utime(fd, ns=(now, now))
            disk_bytes = os.fstat(fd).st_blocks * 512
        except BaseException:
            os.close(fd)
            with suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        os.close(fd)
        os.replace(temp, path)
        if self.cfg.fsync:
            dir_fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return disk_bytes

    @staticmethod
    def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
        while len(data):
            written = os.pwrite(fd, data, offset)
            data = data[written:]
            offset += written

    # ------------------------------------------------------------------------------- touch

    def touch(self, block_ids: Sequence[bytes]) -> None:
        if not block_ids:
            return
        # Shared global lock: an eviction pass (exclusive) never drops a block between its
        # re-check of the mtime and a touch that lands in between.
        with self._global(exclusive=False):
            for block_id in block_ids:
                self._set_time(self.block_path(block_id))
        self._bump("touches", len(block_ids))

    # ----------------------------------------------------------------- control records

    def read_control(self, names: Sequence[bytes]) -> list[int | None]:
        """Each record's value from ``<path>/control/<name hex>/`` (``ucm.control``)."""
        return [self._read_record(control.check_name(name)) for name in names]

    def _read_record(self, name: bytes) -> int | None:
        directory = self.root / control.record_dir(name)

        def listing() -> list[str] | None:
            try:
                return os.listdir(directory)
            except FileNotFoundError:
                return None

        def fetch(value: int) -> bytes | None:
            try:
                with open(directory / control.value_file(value), "rb") as file:
                    return file.read(control.RECORD_BYTES + 1)
            except FileNotFoundError:
                return None

        try:
            return control.read(name, listing, fetch, f"posix tier {self.label!r}")
        except OSError as exc:
            raise TierError(
                f"posix tier {self.label!r}: reading control record {name.hex()}: {exc}"
            ) from exc

    def raise_control(self, name: bytes, value: int) -> None:
        """Writes the file of ``value`` (temp, fsync, rename, fsync of the directory), then
        drops the files of lower values."""
        control.check_name(name)
        control.check_value(value)
        directory = self.root / control.record_dir(name)
        final = directory / control.value_file(value)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if not final.exists():
                temp = directory / f"{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    os.write(fd, control.encode(name, value))
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(temp, final)
                dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            values = control.values_of(os.listdir(directory))
            control.prune(values, max(values), lambda v: _unlink(directory / control.value_file(v)))
        except OSError as exc:
            raise TierError(
                f"posix tier {self.label!r}: raising control record {name.hex()} to {value}: {exc}"
            ) from exc

    # ------------------------------------------------------------------------------ remove

    def batched_remove(self, keys: Sequence[Key], force: bool = False) -> int:
        distinct = list(dict.fromkeys(keys))
        removed = 0
        for chunk in chunks(distinct, self.remove_chunk_keys):
            with self._global(exclusive=True):
                self._bump("remove_lock_acquisitions")
                by_block: dict[bytes, set[int]] = {}
                for block_id, shard in chunk:
                    if force or not self.pins.is_pinned((block_id, shard)):
                        by_block.setdefault(block_id, set()).add(shard)
                for block_id, shards in by_block.items():
                    removed += self._remove_locked(block_id, shards)
        return removed

    def _remove_locked(self, block_id: bytes, shards: set[int]) -> int:
        footer = self._footer_of(block_id)
        if footer is None:
            return 0
        gone = {s for s in shards if footer.present[s]}
        if gone or any(footer.lost[s] for s in shards):
            grown = self._rewrite_locked(block_id, footer, drop=set(shards))
            with self._stats_lock:
                self._usage += grown
            self._namespace_usage.remove(namespaces.namespace_of(block_id), -grown)
        return len(gone)

    # ---------------------------------------------------------------------------- eviction

    def _scan(self) -> tuple[int, list[tuple[int, int, int, bytes]]]:
        """(total disk bytes, [(mtime_ns, disk bytes, inode, block id)]) of every block file;
        removes temp files left by dead processes."""
        total = 0
        entries: list[tuple[int, int, int, bytes]] = []
        now = time.time()
        for directory in self._stripe_dirs():
            try:
                iterator = os.scandir(directory)
            except FileNotFoundError:
                continue
            with iterator:
                for entry in iterator:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if entry.name.endswith(".tmp"):
                        self._reap_temp(entry.path, entry.name, st.st_mtime, now)
                        continue
                    if not entry.name.endswith(".blk") or len(entry.name) != 36:
                        continue
                    try:
                        block_id = bytes.fromhex(entry.name[:32])
                    except ValueError:
                        continue
                    size = st.st_blocks * 512
                    total += size
                    entries.append((st.st_mtime_ns, size, st.st_ino, block_id))
        return total, entries

    def _stripe_dirs(self) -> Iterator[str]:
        """Every stripe directory: the default namespace's, then each namespace's (under
        ``ns/<name>/``, whose names are registered as they are found)."""
        for stripe in range(_STRIPES):
            yield os.path.join(self.root, f"{stripe:02x}")
        try:
            names = sorted(entry.name for entry in os.scandir(self.root / "ns") if entry.is_dir())
        except FileNotFoundError:
            return
        for name in names:
            namespaces.register(name)
            for stripe in range(_STRIPES):
                yield os.path.join(self.root, "ns", name, f"{stripe:02x}")

    def list_keys(self) -> list[Key]:
        keys: list[Key] = []
        for _mtime, _size, _inode, block_id in self._scan()[1]:
            footer = self._footer_of(block_id)
            if footer is not None:
                keys += [(block_id, s) for s in range(self.spb) if footer.present[s]]
        return keys

    def _reap_temps(self) -> None:
        """Removes the temp files of dead writers (killed mid-dump) from every stripe
        directory, as each scan does."""
        now = time.time()
        for directory in self._stripe_dirs():
            if self._closed:
                return  # the next open sweeps again
            try:
                iterator = os.scandir(directory)
            except FileNotFoundError:
                continue
            with iterator:
                for entry in iterator:
                    if not entry.name.endswith(".tmp"):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    self._reap_temp(entry.path, entry.name, st.st_mtime, now)

    @staticmethod
    def _reap_temp(path: str, name: str, mtime: float, now: float) -> None:
        try:
            pid = int(name.split(".")[3])
        except (IndexError, ValueError):
            return
        dead = False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            dead = True
        except PermissionError:
            pass
        if dead or now - mtime > _TEMP_MAX_AGE_S:
            with suppress(FileNotFoundError):
                os.unlink(path)

    def evict_to_capacity(self) -> int:
        """One eviction pass (a no-op without ``capacity``); returns the shards evicted."""
        capacity = self.cfg.capacity
        if capacity is None:
            return 0
        with self._evict_lock:  # one pass per process at a time
            total, entries = self._scan()
            with self._stats_lock:
                self._usage = total
                self._written_since_scan = 0
            if self._namespace_usage.quotas is None:  # else their passes rescan
                self._namespace_usage.rescanned(_by_namespace(entries))
            if total <= capacity:
                return 0
            self._bump("eviction_passes")
            return self._evict_entries(self._oldest(entries, total - capacity))

    def _oldest(
        self, entries: list[tuple[int, int, int, bytes]], excess: int
    ) -> list[tuple[int, int, int, bytes]]:
        """The oldest unpinned blocks of ``entries`` (oldest mtime first) that make up
        ``excess`` bytes."""
        victims: list[tuple[int, int, int, bytes]] = []
        for entry in sorted(entries):
            if excess <= 0:
                break
            block_id = entry[3]
            if any(self.pins.is_pinned((block_id, s)) for s in range(self.spb)):
                continue
            victims.append(entry)
            excess -= entry[1]
        return victims

    def _evict_entries(self, victims: list[tuple[int, int, int, bytes]]) -> int:
        """Writes the victims down (a `write: back` tier below) and drops them, keeping what
        could not be written down or changed since the scan; returns the shards evicted."""
        evicted = 0
        for chunk in chunks(victims):
            keep = self._write_down(chunk)
            with self._global(exclusive=True):
                for mtime_ns, size, inode, block_id in chunk:
                    evicted += self._evict_locked(block_id, mtime_ns, size, inode, keep)
        return evicted

    def evict_namespace_quotas(self) -> int:
        """One pass over the namespace byte quotas (a no-op without any): each namespace over
        its bytes here loses its oldest blocks first, down to them. Returns shards evicted."""
        estimate = self._namespace_usage
        if estimate.quotas is None:
            return 0
        with self._evict_lock:
            _total, entries = self._scan()
            by_namespace: dict[str, list[tuple[int, int, int, bytes]]] = {}
            for entry in entries:
                by_namespace.setdefault(namespaces.namespace_of(entry[3]), []).append(entry)
            excess = estimate.rescanned(_by_namespace(entries))
            victims: list[tuple[int, int, int, bytes]] = []
            for name, over in excess.items():
                victims += self._oldest(by_namespace[name], over)
            if not victims:
                return 0
            self._bump("namespace_eviction_passes")
            return self._evict_entries(victims)  # each drop comes off the estimate

    def _write_down(self, victims: Sequence[tuple[int, int, int, bytes]]) -> set[Key]:
        """Hands the victims' shards to the evict sink; returns the keys to keep (failed)."""
        sink = self.context.evict_sink
        if sink is None:
            return set()
        keys: list[Key] = []
        views: list[ShardViews] = []
        for _mtime, _size, _inode, block_id in victims:
            path = self.block_path(block_id)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                footer = self._read_footer(block_id, fd, False)
                for shard, shard_envelope in enumerate(footer.envelopes):
                    if shard_envelope is None:
                        continue
                    data = bytearray(self.shard_size)
                    got = os.preadv(fd, [data], shard * self.shard_size)
                    if got != self.shard_size:
                        continue
                    try:
                        decoded = envelope.decode(shard_envelope, data[: shard_envelope.stored])
                    except envelope.Corrupt:
                        continue
                    keys.append((block_id, shard))
                    views.append([memoryview(decoded)])
            except (_Corrupt, _Foreign):
                continue
            finally:
                os.close(fd)
        if not keys:
            return set()
        try:
            outcomes = list(sink(keys, views))
        except Exception:  # a sink that raises failed every key: keep them all
            outcomes = [TierError("evict sink raised")] * len(keys)
        keep = {key for key, outcome in zip(keys, outcomes, strict=True) if outcome is not None}
        self._bump("evict_sink_failures", len(keep))
        return keep

    def _evict_locked(
        self, block_id: bytes, mtime_ns: int, size: int, inode: int, keep: set[Key]
    ) -> int:
        path = self.block_path(block_id)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return 0
        if st.st_ino != inode or st.st_mtime_ns != mtime_ns:
            return 0  # touched, loaded or rewritten since the scan: no longer a victim
        footer = self._footer_of(block_id)
        if footer is None:
            os.unlink(path)
            return 0
        kept = {s for s in range(self.spb) if footer.present[s] and (block_id, s) in keep}
        drop = {s for s in range(self.spb) if footer.present[s]} - kept
        if not drop and not any(footer.lost):
            return 0
        # Lost marks go with the block: only a resident block is worth repairing.
        grown = self._rewrite_locked(block_id, footer, drop=set(range(self.spb)) - kept)
        with self._stats_lock:
            self._usage += grown
            self._stat["evictions"] += len(drop)
        self._namespace_usage.remove(namespaces.namespace_of(block_id), -grown, len(drop))
        return len(drop)

    # ------------------------------------------------------------------------- stats, close

    def namespace_figures(self, wait_s: float = 0.0) -> dict[str, dict[str, int]] | None:
        """Each namespace's disk bytes here and this process's evictions of its shards. The
        bytes are exact after a scan of the directory (at open with ``capacity`` or quotas,
        at every eviction pass, and in the background when stats are read and the last scan
        is older than ``NamespaceUsage.scan_interval_s``), moved by this process's writes and
        removals since; unknown (None) until the first scan."""
        if not self._closed:
            self._namespace_usage.refresh(lambda: _by_namespace(self._scan()[1]), wait_s)
        return self._namespace_usage.figures()

    def stats(self) -> dict[str, int | float]:
        with self._stats_lock:
            result: dict[str, int | float] = {
                "hits": self._counts.hits,
                "misses": self._counts.misses,
                "corrupt": self._counts.corrupt,
                "bytes_read": self._counts.bytes_read,
                "bytes_written": self._counts.bytes_written,
                "usage_bytes": self._usage,
                "capacity_bytes": self.cfg.capacity or 0,
                "o_direct_active": int(self._direct),
            }
            result.update(self._stat)
        return result

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._sweeper.shutdown(wait=True)


def _unlink(path: Path) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


def _by_namespace(entries: list[tuple[int, int, int, bytes]]) -> dict[str, int]:
    """Disk bytes per namespace of scanned block files."""
    usage: dict[str, int] = {}
    for _mtime, size, _inode, block_id in entries:
        name = namespaces.namespace_of(block_id)
        usage[name] = usage.get(name, 0) + size
    return usage


@ucm.hookimpl
def register_tiers(register: Any) -> None:
    register(PosixTier)
