"""Typed binding to the native CacheBuffer control plane (``core-native/src/buffer.zig``).

The control region is caller-provided shared memory (a mapping of the node-wide control segment);
:class:`BufferCore` lays it out (``create``) or validates it (``attach``) and then exposes the
batched operations of seed §3.2–3.4. Every operation is one native call per batch: keys are packed
into a :class:`KeyBatch` (16-byte ids concatenated + an ``array('I')`` of shard indices) and
per-key outcomes come back in ``array`` objects, so the Python cost is paid per batch.

Protocol for a load task (one rank)::

    got = core.get(keys)                  # per key: HIT, OWNER, WAITER or NO_SLOT + slot
    # OWNER: fill the slot's bytes from a lower tier, then core.commit([slot], [State.READY])
    # WAITER: core.wait([slot], timeout_s) -> READY | FAILED | TAKEOVER (now owner) | IDLE (timeout)
    core.release(slots)                   # after copying out; every slot returned by get

References are recorded per process (a *holder*: registered on first use with its pid and start
time, index 0..63): a process holds at most one reference per slot, so a key it already holds
answers ``HELD`` (nothing taken, release it once). The references of a process that died
(SIGKILL included, pid reuse detected by the start time) are dropped when a Get, an eviction scan,
a remove or a waiter meets them, and all at once by :meth:`BufferCore.reclaim_dead`.
"""

from __future__ import annotations

import ctypes
import enum
import os
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError, UcmError
from ..layout import BLOCK_ID_BYTES, Key
from . import _abi, lib

SLOT_NONE = _abi.SLOT_NONE
"""Slot index reported for a key that got no slot (NO_SLOT / LOCK_TIMEOUT)."""

OCCUPANCY_NAMES = tuple(name for name, _ in _abi.Occupancy._fields_)
"""Field order of ``ucm_buffer_occupancy`` (``Occupancy`` in buffer.zig)."""

COUNTER_NAMES = _abi.BUFFER_COUNTER_NAMES
"""Counter order of ``ucm_buffer_stats`` (``buffer.counter_names`` in buffer.zig)."""
GAUGE_NAMES = ("dirty_slots",)
"""The entries of COUNTER_NAMES that are gauges (go up and down), not monotonic counts."""

CTRL_LAYOUT_VERSION = _abi.BUFFER_LAYOUT_VERSION
"""``buffer_layout_version`` of core-native/src/constants.zig (a test checks that they agree,
against the header ``BufferCore.create`` writes): pass it to
``SharedRegion.open(ctrl_layout_version=...)`` so that an old segment is refused up front."""
HOLDERS_MAX = _abi.BUFFER_HOLDERS_MAX
CTRL_ALIGNMENT_BYTES = _abi.BUFFER_CACHE_LINE_BYTES
SLOT_COUNT_MAX = _abi.BUFFER_SLOT_COUNT_MAX
BUCKET_COUNT_MAX = _abi.BUFFER_BUCKET_COUNT_MAX
SEGMENT_COUNT_MAX = _abi.BUFFER_SEGMENT_COUNT_MAX
_U32_MAX = 0xFFFF_FFFF


State = _abi.State
"""A slot's state word; ``MISSING`` is final like ``FAILED``: the owner found the key in no
tier (waiters report a miss)."""


GetResult = _abi.GetResult
"""``HIT``: Ready, a reference is held; ``OWNER``: the caller claimed the slot (reference held,
Idle): load it and commit; ``WAITER``: someone else is filling it (reference held): wait on
it; ``NO_SLOT``/``LOCK_TIMEOUT``: nothing is held; ``HELD``: this process already holds the
key's slot (one reference per process): nothing new is taken."""
WaitResult = _abi.WaitResult
"""``IDLE``: timed out, the owner is alive (reference still held); ``TAKEOVER``: the owner died,
the caller owns the slot now; ``MISSING``: the owner found the key in no tier."""
CommitResult = _abi.CommitResult
PreallocResult = _abi.PreallocResult
HolderState = _abi.HolderState
_Status = _abi.BufferStatus


class Pool(enum.IntEnum):
    REGULAR = 0
    RESERVED = 1


_COMMIT_DIRTY_BIT = _abi.COMMIT_DIRTY_BIT
"""``commit_dirty_bit`` of buffer.zig: OR'ed into State.READY to commit with write-back debt."""
_REAL_NUMBER = (int, float)
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_FINAL_STATES = (State.READY, State.FAILED, State.MISSING)
_SLOT_SEQUENCES = (list, tuple, array)
_COMMIT_RESULTS = tuple(CommitResult)
_WAIT_RESULTS = tuple(WaitResult)
assert all(result.value == index for index, result in enumerate(_COMMIT_RESULTS))
assert all(result.value == index for index, result in enumerate(_WAIT_RESULTS))


_GeometryStruct = _abi.Geometry
_HeaderStruct = _abi.Header
_SlotStruct = _abi.Slot
_HolderStruct = _abi.HolderEntry


_EMPTY = (ctypes.c_uint64 * 1)()
"""Passed for empty arrays: the native side never reads it, but its pointers are non-null."""


def _address(values: array[int]) -> int:
    return values.buffer_info()[0] if len(values) else ctypes.addressof(_EMPTY)


def _format_bytes(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


@dataclass(frozen=True)
class Geometry:
    """Shape of a CacheBuffer. ``slot_count_reserved`` slots back Prealloc (and misses) when the
    regular pool is full; data slot ``i`` is in segment ``i // slots_per_segment``."""

    shard_size_bytes: int
    slot_count_regular: int
    slot_count_reserved: int = 0
    bucket_count: int = 0
    """0 picks one bucket per slot (rounded up to a power of two)."""
    slots_per_segment: int = 0
    """0 puts every slot in one segment."""

    def __post_init__(self) -> None:
        total = self.slot_count_regular + self.slot_count_reserved
        if self.bucket_count == 0:
            object.__setattr__(self, "bucket_count", 1 << max(0, (max(total, 1) - 1).bit_length()))
        if self.slots_per_segment == 0:
            object.__setattr__(self, "slots_per_segment", max(total, 1))
        self._validate()

    def _validate(self) -> None:
        _check_int("shard_size_bytes", self.shard_size_bytes, 1, 2**63 - 1, "set the shard size")
        too_many = isinstance(self.slot_count_regular, int) and (
            self.slot_count_regular > SLOT_COUNT_MAX
        )
        _check_int(
            "slot_count_regular",
            self.slot_count_regular,
            1,
            SLOT_COUNT_MAX,
            "use larger shards or a smaller capacity"
            if too_many
            else "give the buffer a capacity of at least one shard",
        )
        _check_int("slot_count_reserved", self.slot_count_reserved, 0, SLOT_COUNT_MAX, "")
        total = self.slot_count_regular + self.slot_count_reserved
        if total > SLOT_COUNT_MAX:
            raise InvalidArgumentError(
                f"slot_count_regular + slot_count_reserved={total} is not valid: at most "
                f"{SLOT_COUNT_MAX} slots; use larger shards or a smaller capacity"
            )
        _check_int("bucket_count", self.bucket_count, 1, BUCKET_COUNT_MAX, "")
        _check_int("slots_per_segment", self.slots_per_segment, 1, _U32_MAX, "")
        if self.segment_count > SEGMENT_COUNT_MAX:
            raise InvalidArgumentError(
                f"slots_per_segment={self.slots_per_segment} is not valid: {total} slots would "
                f"need {self.segment_count} segments, at most {SEGMENT_COUNT_MAX}; raise "
                "slots_per_segment"
            )

    @classmethod
    def from_capacity(
        cls,
        capacity_bytes: int,
        shard_size_bytes: int,
        reserved_slots: int = 0,
        slots_per_segment: int = 0,
        bucket_count: int = 0,
    ) -> Geometry:
        """The geometry of a buffer holding ``capacity_bytes`` of regular slots."""
        _check_int("shard_size_bytes", shard_size_bytes, 1, 2**63 - 1, "set the shard size")
        _check_int("capacity_bytes", capacity_bytes, 0, 2**63 - 1, "")
        if capacity_bytes < shard_size_bytes:
            raise InvalidArgumentError(
                f"capacity_bytes={capacity_bytes} is below one slot: a slot holds one shard of "
                f"shard_size_bytes={shard_size_bytes}; set the capacity to at least "
                f"{shard_size_bytes} bytes ({_format_bytes(shard_size_bytes)}) or use smaller "
                "shards"
            )
        return cls(
            shard_size_bytes=shard_size_bytes,
            slot_count_regular=capacity_bytes // shard_size_bytes,
            slot_count_reserved=reserved_slots,
            bucket_count=bucket_count,
            slots_per_segment=slots_per_segment,
        )

    @property
    def slot_count_total(self) -> int:
        return self.slot_count_regular + self.slot_count_reserved

    @property
    def segment_count(self) -> int:
        return -(-self.slot_count_total // self.slots_per_segment)

    @property
    def segment_size_bytes(self) -> int:
        """Bytes of one data segment: its slots, padded to a whole page (segments are mapped
        page by page; a shard size like 100 bytes, from an odd ``tensor_size_list``, would
        otherwise leave a segment's end mid-page). Slot addresses ignore the padding."""
        slots_bytes = self.slots_per_segment * self.shard_size_bytes
        return -(-slots_bytes // _PAGE_BYTES) * _PAGE_BYTES

    @property
    def ctrl_size_bytes(self) -> int:
        """Bytes the control region needs."""
        size = int(lib().ucm_buffer_ctrl_size_bytes(ctypes.byref(self._struct())))
        assert size > 0, size
        return size

    def _struct(self) -> _GeometryStruct:
        return _GeometryStruct(
            self.shard_size_bytes,
            self.slot_count_regular,
            self.slot_count_reserved,
            self.bucket_count,
            self.slots_per_segment,
        )

    @classmethod
    def _from_struct(cls, struct: _GeometryStruct) -> Geometry:
        return cls(
            shard_size_bytes=struct.shard_size_bytes,
            slot_count_regular=struct.slot_count_regular,
            slot_count_reserved=struct.slot_count_reserved,
            bucket_count=struct.bucket_count,
            slots_per_segment=struct.slots_per_segment,
        )


SEGMENT_HEADER_BYTES = 4096
"""The control segment file's own header page (``seg_header_bytes`` of core-native/src/
constants.zig); the CacheBuffer's control region, which starts with its header, follows it."""


def live_geometry(unique_id: str) -> Geometry:
    """The geometry recorded in the header of the published CacheBuffer of ``unique_id``: read
    from its control segment file (``/dev/shm/ucm-<unique_id>.ctrl``) without attaching to it,
    so a process that only looks (``ucm stats``) needs not know the shard size or capacity the
    ranks opened it with. Raises FileNotFoundError when no buffer of that id is published, and
    InvalidArgumentError when the file is not a CacheBuffer this library reads."""
    from .segments import ctrl_path

    path = ctrl_path(unique_id)
    size = ctypes.sizeof(_HeaderStruct)
    with path.open("rb") as handle:
        image = handle.read(SEGMENT_HEADER_BYTES + size)[SEGMENT_HEADER_BYTES:]
    if len(image) < size:
        raise InvalidArgumentError(
            f"{path} is too short to hold a CacheBuffer header; remove it if no UCM process uses it"
        )
    # ucm_buffer_header reads the header through the native view: a cache-line-aligned copy.
    raw = (ctypes.c_uint8 * (size + CTRL_ALIGNMENT_BYTES))()
    address = -(-ctypes.addressof(raw) // CTRL_ALIGNMENT_BYTES) * CTRL_ALIGNMENT_BYTES
    ctypes.memmove(address, image, size)
    header = _HeaderStruct()
    if lib().ucm_buffer_header(address, ctypes.byref(header)) != 0:
        found = _HeaderStruct.from_buffer_copy(image)
        raise InvalidArgumentError(
            f"{path} holds no CacheBuffer this library reads (magic {found.magic:#018x}, layout "
            f"version {found.layout_version}; this library reads layout version "
            f"{CTRL_LAYOUT_VERSION}): it is not a UCM CacheBuffer, or one of another UCM version "
            "(every process of a node must run the same UCM version)"
        )
    return Geometry._from_struct(header.geometry)


def _check_control_name(name: object) -> None:
    if not isinstance(name, bytes) or len(name) != CONTROL_NAME_BYTES:
        raise InvalidArgumentError(
            f"name={name!r} is not valid: a control record's name is {CONTROL_NAME_BYTES} bytes"
        )


def _check_int(name: str, value: object, low: int, high: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        advice = f"; {hint}" if hint else ""
        raise InvalidArgumentError(
            f"{name}={value!r} is not valid: expected an integer in [{low}, {high}]{advice}"
        )


class KeyBatch:
    """Keys packed for the native calls: ``ids`` is the concatenation of the 16-byte block ids,
    ``shards`` the shard indices. Build once, reuse for get/lookup/remove of the same keys."""

    __slots__ = ("ids", "shards")

    def __init__(self, ids: bytes, shards: array[int]) -> None:
        assert shards.typecode == "I" and len(ids) == BLOCK_ID_BYTES * len(shards)
        self.ids = ids
        self.shards = shards

    def __len__(self) -> int:
        return len(self.shards)

    @classmethod
    def of(cls, keys: Sequence[Key] | KeyBatch, argument: str = "keys") -> KeyBatch:
        if isinstance(keys, KeyBatch):
            return keys
        block_ids = [key[0] for key in keys]
        try:
            shards = array("I", [key[1] for key in keys])
            ids = b"".join(block_ids)
        except (TypeError, OverflowError):
            raise _bad_key(keys, argument) from None
        if len(ids) != BLOCK_ID_BYTES * len(block_ids) or any(
            len(block_id) != BLOCK_ID_BYTES for block_id in block_ids
        ):
            raise _bad_key(keys, argument)
        return cls(ids, shards)


def _bad_key(keys: Sequence[Key], argument: str) -> InvalidArgumentError:
    for index, key in enumerate(keys):
        block_id, shard = key
        if not isinstance(block_id, bytes | bytearray) or len(block_id) != BLOCK_ID_BYTES:
            return InvalidArgumentError(
                f"{argument}[{index}] block id {block_id!r} is not valid: expected "
                f"{BLOCK_ID_BYTES} bytes"
            )
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard <= _U32_MAX:
            return InvalidArgumentError(
                f"{argument}[{index}] shard index {shard!r} is not valid: expected an integer "
                f"in [0, {_U32_MAX}]"
            )
    return InvalidArgumentError(f"{argument} is not a sequence of (16-byte id, shard index)")


def _pack_block_ids(block_ids: Sequence[bytes], argument: str = "block_ids") -> bytes:
    try:
        ids = b"".join(block_ids)
    except TypeError:
        ids = b""
    if len(ids) != BLOCK_ID_BYTES * len(block_ids) or any(
        len(block_id) != BLOCK_ID_BYTES for block_id in block_ids
    ):
        for index, block_id in enumerate(block_ids):
            if not isinstance(block_id, bytes | bytearray) or len(block_id) != BLOCK_ID_BYTES:
                raise InvalidArgumentError(
                    f"{argument}[{index}]={block_id!r} is not valid: expected {BLOCK_ID_BYTES} "
                    "bytes"
                )
    return ids


def _as_u32_array(values: Sequence[int] | array[int], argument: str) -> array[int]:
    if isinstance(values, array) and values.typecode == "I":
        return values
    try:
        return array("I", values)
    except (TypeError, OverflowError):
        raise InvalidArgumentError(
            f"{argument}={list(values)!r} is not valid: expected slot indices in [0, {_U32_MAX}]"
        ) from None


@dataclass(frozen=True)
class GetBatch:
    """Per-key outcome of :meth:`BufferCore.get`: ``results[i]`` is a :class:`GetResult` code,
    ``slots[i]`` the slot (``SLOT_NONE`` for NO_SLOT). Eviction never drops write-back debt
    (a dirty slot is never a victim), so a Get has nothing to write below."""

    results: array[int]
    slots: array[int]

    def held_slots(self) -> array[int]:
        """Slots holding a reference (everything but NO_SLOT / LOCK_TIMEOUT): release these."""
        return array(
            "I", [slot for result, slot in zip(self.results, self.slots, strict=True) if result < 3]
        )


@dataclass(frozen=True)
class SlotInfo:
    block_id: bytes
    shard_index: int
    refcount: int
    """Processes holding a reference (the popcount of ``holders``)."""
    state: State
    version: int
    accessed: bool
    owner_pid: int
    """Pid of the owner's holder entry while the slot is being loaded; 0 when nobody owns it."""
    bucket: int | None
    """None when free; ``DETACHED`` when unlinked while referenced."""
    reserved: bool
    preallocated: bool
    holders: int = 0
    """Bitmap of the holder indices referencing the slot."""
    owner_holder: int | None = None
    dirty: bool = False
    """Write-back debt: the Ready shard is not yet in the ``write: back`` tiers below."""
    flusher_holder: int | None = None
    """Holder index of the process writing the dirty shard down, if any."""
    namespace: int | None = None
    """Index in the namespace table the slot counts in (while linked), else None."""


@dataclass(frozen=True)
class DirtyBatch:
    """Dirty slots claimed by :meth:`BufferCore.take_dirty`: this process holds a reference on
    each; write ``keys[i]`` from ``slots[i]`` below, then :meth:`BufferCore.clean` them."""

    slots: array[int]
    keys: list[Key]


@dataclass(frozen=True)
class HolderInfo:
    """One row of the holder table."""

    index: int
    state: HolderState
    pid: int
    start_time: int
    """Clock ticks after boot (/proc/<pid>/stat field 22) of the registered process."""
    reclaimer: int
    closing: bool = False
    """The process started closing the buffer (:meth:`BufferCore.mark_closing`)."""


@dataclass(frozen=True)
class NamespaceUsage:
    """One live entry of the native namespace table (``ucm_buffer_namespace_info``)."""

    index: int
    tag: bytes
    """The namespace's tag (first 8 bytes of its keys); ``b"\\0" * 8`` for entry 0, the
    default namespace and every key whose tag is not registered."""
    guarantee_slots: int
    cap_slots: int
    occupancy_slots: int
    """Slots linked into a chain that count for this namespace (exact; see buffer.zig)."""
    hits: int = 0
    """Gets of the namespace's keys that found them Ready (node-wide, every rank)."""
    misses: int = 0
    evictions: int = 0
    """Ready slots of the namespace evicted (by any namespace's insert)."""


NAMESPACES_MAX = _abi.BUFFER_NAMESPACES_MAX
CONTROLS_MAX = _abi.BUFFER_CONTROLS_MAX
CONTROL_NAME_BYTES = _abi.BUFFER_CONTROL_NAME_SIZE_BYTES


class NamespaceTableFullError(InvalidArgumentError):
    """Every entry of the buffer's namespace table is taken: a namespace registered now counts
    in the default namespace's entry (and takes its quota)."""


class ControlTableFullError(InvalidArgumentError):
    """Every entry of the buffer's control record table is taken: a new record (a key space
    resetting for the first time on this node) cannot be held by the buffer."""


NAMESPACE_NAMES_MAX = _abi.BUFFER_NAMESPACE_NAMES_MAX
"""Namespaces one CacheBuffer (one ``unique_id``) can ever tell apart by name."""


class NamespaceNamesFullError(UcmError):
    """Every entry of the buffer's namespace identity table is taken: a new namespace cannot be
    used with this buffer (its keys would be counted as the default namespace's)."""


class NamespaceNameConflictError(UcmError):
    """Two namespace names share a tag (probability 2^-64 per pair): the second is refused."""


@dataclass(frozen=True)
class ReclaimReport:
    holders: int
    """Dead holders whose entries were freed."""
    refs: int
    """References they held that were dropped."""


DETACHED = -1


def _name_of(raw: Any) -> str:
    """The name of a complete ``NamespaceName`` entry."""
    data = b"".join(int(word).to_bytes(8, "little") for word in raw.name)
    return data[: int(raw.name_len_bytes)].decode()


_PROCESS_ID = [os.getpid()]
"""This process's pid, refreshed in a forked child: ``holder`` compares against it on every
call, where ``os.getpid()`` would be a system call each time."""
os.register_at_fork(after_in_child=lambda: _PROCESS_ID.__setitem__(0, os.getpid()))


class BufferCore:
    """A CacheBuffer control region at ``ctrl_address`` (a shared mapping kept alive by the
    caller for this object's life)."""

    def __init__(self, ctrl_address: int, ctrl_bytes: int, geometry: Geometry) -> None:
        self._ctrl = ctrl_address
        self._ctrl_bytes = ctrl_bytes
        self.geometry = geometry
        self._native = lib()
        # Bound once: the single-slot commit and wait run cold on every waiter's wake-up path.
        self._commit_one = self._native.ucm_buffer_commit_one
        self._wait_one = self._native.ucm_buffer_wait_one
        self._holder = -1
        self._holder_pid = 0
        self._dirty_cursor = ctypes.c_uint32(0)

    @property
    def ctrl_address(self) -> int:
        """Address of the control region this object acts on."""
        return self._ctrl

    # -- holders -----------------------------------------------------------------------------

    @property
    def holder(self) -> int:
        """This process's holder index (registered on first use; again after a fork)."""
        if self._holder_pid != _PROCESS_ID[0]:
            index = int(self._native.ucm_buffer_register(self._ctrl))
            if index == _Status.HOLDERS_FULL:
                raise InvalidArgumentError(
                    f"cannot use the buffer: all {HOLDERS_MAX} holder entries belong to live "
                    "processes; close processes attached to this unique_id (or use another)"
                )
            self._check(min(index, 0), "register")
            self._holder, self._holder_pid = index, _PROCESS_ID[0]
        return self._holder

    def _unregistered(self, operation: str) -> InvalidArgumentError:
        self._holder_pid = 0
        return InvalidArgumentError(
            f"{operation}: holder {self._holder} is no longer registered to this process "
            f"(pid {os.getpid()}): it was judged dead and its references were reclaimed"
        )

    def reclaim_dead(self) -> ReclaimReport:
        """Finds processes that died holding references (pid + start time), drops those
        references and frees their holder entries. Bounded: one pass over slots and buckets,
        one bucket lock at a time."""
        holders = ctypes.c_uint32(0)
        refs = int(self._native.ucm_buffer_reclaim_dead(self._ctrl, ctypes.byref(holders)))
        self._check(min(refs, 0), "reclaim_dead")
        return ReclaimReport(holders=int(holders.value), refs=refs)

    # -- namespaces ----------------------------------------------------------------------------

    def register_namespace(self, tag: bytes, guarantee_slots: int, cap_slots: int) -> int:
        """Registers namespace ``tag`` (8 bytes; all zero: the default namespace) with its
        guarantee and cap in slots, or updates them; returns its index in the native table.
        Keys whose first 8 bytes are ``tag`` count in it from then on."""
        if not isinstance(tag, bytes) or len(tag) != 8:
            raise InvalidArgumentError(f"tag={tag!r} is not valid: expected 8 bytes")
        total = self.geometry.slot_count_total
        _check_int("cap_slots", cap_slots, 0, total, "at most every slot of the buffer")
        _check_int("guarantee_slots", guarantee_slots, 0, cap_slots, "at most cap_slots")
        index = int(
            self._native.ucm_buffer_register_namespace(
                self._ctrl, int.from_bytes(tag, "little"), guarantee_slots, cap_slots
            )
        )
        if index == _Status.NAMESPACES_FULL:
            raise NamespaceTableFullError(
                f"cannot register namespace tag {tag.hex()}: all {NAMESPACES_MAX} entries of "
                "the buffer's namespace table are taken (namespaces with quotas per unique_id)"
            )
        if index == _Status.GUARANTEES_OVER:
            raise InvalidArgumentError(
                f"cannot register namespace tag {tag.hex()} with guarantee_slots="
                f"{guarantee_slots}: the registered guarantees would exceed the "
                f"{self.geometry.slot_count_regular} regular slots"
            )
        if index == _Status.LOCK_TIMEOUT:
            raise TimeoutError(
                "register_namespace: the namespace registration lock stayed held by a live process "
                "past the lock timeout"
            )
        self._check(min(index, 0), "register_namespace")
        return index

    # -- control records (reset epochs) -----------------------------------------------------

    def control_read(self, names: Sequence[bytes]) -> list[int | None]:
        """Each record's value (the largest ever raised under the name, node-wide), None where
        the buffer holds no record of that name. Works on a scheduler (control plane only)."""
        for name in names:
            _check_control_name(name)
        if not names:
            return []
        if len(names) > _abi.BUFFER_CONTROL_READ_NAMES_MAX:
            raise InvalidArgumentError(
                f"names: {len(names)} records in one read is not valid: at most "
                f"{_abi.BUFFER_CONTROL_READ_NAMES_MAX}"
            )
        packed = bytes(b"".join(names))
        values = (ctypes.c_uint64 * len(names))()
        found = (ctypes.c_uint8 * len(names))()
        self._check(
            self._native.ucm_buffer_control_read(
                self._ctrl, packed, len(names), ctypes.addressof(values), ctypes.addressof(found)
            ),
            "control_read",
        )
        return [int(v) if f else None for v, f in zip(values, found, strict=True)]

    def control_raise(self, name: bytes, value: int) -> int:
        """Raises record ``name`` to at least ``value`` (never lowers it); returns its value
        after the raise."""
        _check_control_name(name)
        _check_int("value", value, 0, 2**64 - 1, "a record's value is a u64")
        out = ctypes.c_uint64()
        status = int(
            self._native.ucm_buffer_control_raise(self._ctrl, name, value, ctypes.byref(out))
        )
        if status == _Status.CONTROLS_FULL:
            raise ControlTableFullError(
                f"cannot hold control record {name.hex()}: all {CONTROLS_MAX} entries of the "
                "buffer's control record table are taken (one per key space and writer that "
                "reset on this node since the buffer was created; every rank closing frees them)"
            )
        self._check(status, "control_raise")
        return int(out.value)

    def register_namespace_name(self, tag: bytes, name: str) -> None:
        """Enters namespace ``name`` (its 8-byte ``tag``, not all zero) in the control plane's
        identity table, the only authority on which tag is whose: every process resolves the
        tag to ``name`` from then on (:meth:`namespace_name`), and a key whose tag is not
        entered is the default namespace's. Idempotent; one entry per tag across processes.
        :class:`NamespaceNamesFullError` when every entry is taken."""
        if not isinstance(tag, bytes) or len(tag) != 8 or tag == bytes(8):
            raise InvalidArgumentError(f"tag={tag!r} is not valid: expected 8 bytes, not all zero")
        raw = name.encode()
        if not 1 <= len(raw) <= _abi.BUFFER_NAMESPACE_NAME_MAX_BYTES:
            raise InvalidArgumentError(
                f"name={name!r} is not valid: expected 1 to "
                f"{_abi.BUFFER_NAMESPACE_NAME_MAX_BYTES} bytes"
            )
        status = int(
            self._native.ucm_buffer_register_namespace_name(
                self._ctrl, int.from_bytes(tag, "little"), raw, len(raw)
            )
        )
        if status == _Status.NAMES_FULL:
            raise NamespaceNamesFullError(
                f"cannot use namespace {name!r} with this CacheBuffer: all "
                f"{NAMESPACE_NAMES_MAX} entries of its namespace identity table are taken "
                "(namespaces ever used on this node's buffer of this unique_id; entries are "
                "never freed while the buffer lives): use a namespace already in use, or "
                "restart the node's ranks on a fresh unique_id"
            )
        if status == _Status.NAME_CONFLICT:
            raise NamespaceNameConflictError(
                f"cannot use namespace {name!r}: its tag {tag.hex()} is already another "
                f"namespace's ({self.namespace_name(tag)!r}); choose another name"
            )
        if status == _Status.LOCK_TIMEOUT:
            raise TimeoutError(
                "register_namespace_name: the namespace registration lock stayed held by a "
                "live process past the lock timeout"
            )
        self._check(min(status, 0), "register_namespace_name")

    def namespace_name(self, tag: bytes) -> str | None:
        """The name entered for ``tag`` (8 bytes) in the identity table, else None: then the
        tag's keys are the default namespace's."""
        raw = _abi.NamespaceName()
        found = int(
            self._native.ucm_buffer_namespace_name(
                self._ctrl, int.from_bytes(tag[:8], "little"), ctypes.byref(raw)
            )
        )
        self._check(min(found, 0), "namespace_name")
        return _name_of(raw) if found else None

    def namespace_names(self) -> dict[bytes, str]:
        """Every entry of the identity table: ``{tag: name}``."""
        out = (_abi.NamespaceName * NAMESPACE_NAMES_MAX)()
        count = int(self._native.ucm_buffer_namespace_names(self._ctrl, out, NAMESPACE_NAMES_MAX))
        self._check(min(count, 0), "namespace_names")
        return {int(raw.tag).to_bytes(8, "little"): _name_of(raw) for raw in out[:count]}

    def namespaces(self) -> list[NamespaceUsage]:
        """Every live entry of the namespace table (entry 0 first)."""
        rows = []
        for index in range(NAMESPACES_MAX):
            raw = _abi.NamespaceEntry()
            self._check(
                self._native.ucm_buffer_namespace_info(self._ctrl, index, ctypes.byref(raw)),
                "namespaces",
            )
            if raw.state != 2:  # NamespaceState.live
                continue
            rows.append(
                NamespaceUsage(
                    index=index,
                    tag=int(raw.tag).to_bytes(8, "little"),
                    guarantee_slots=int(raw.guarantee_slots),
                    cap_slots=int(raw.cap_slots),
                    occupancy_slots=int(raw.occupancy_slots),
                    hits=int(raw.hits),
                    misses=int(raw.misses),
                    evictions=int(raw.evictions),
                )
            )
        return rows

    def scan_holders(self) -> int:
        """Checks every live holder and marks the dead ones; returns the dead-holder bitmap."""
        mask = ctypes.c_uint64(0)
        self._check(self._native.ucm_buffer_scan_holders(self._ctrl, ctypes.byref(mask)), "scan")
        return int(mask.value)

    def holders(self) -> list[HolderInfo]:
        """The holder table (every entry, free ones included)."""
        rows = []
        for index in range(HOLDERS_MAX):
            raw = _HolderStruct()
            self._check(
                self._native.ucm_buffer_holder_info(self._ctrl, index, ctypes.byref(raw)), "holders"
            )
            rows.append(
                HolderInfo(
                    index=index,
                    state=HolderState(raw.tag >> 32),
                    pid=raw.tag & 0xFFFF_FFFF,
                    start_time=raw.start_time,
                    reclaimer=raw.reclaimer,
                    closing=bool(raw.closing),
                )
            )
        return rows

    def debug_set_holder_start_time(self, holder: int, start_time: int) -> None:
        """Test hook: records another start time for ``holder``, as if its pid had been reused
        by a new process (the recorded one is then dead)."""
        _check_int("holder", holder, 0, HOLDERS_MAX - 1, "")
        _check_int("start_time", start_time, 0, 2**64 - 1, "")
        self._check(
            self._native.ucm_buffer_debug_set_holder_start_time(self._ctrl, holder, start_time),
            "debug_set_holder_start_time",
        )

    @classmethod
    def create(
        cls, ctrl_address: int, ctrl_bytes: int, geometry: Geometry, creator_start_time: int = 0
    ) -> BufferCore:
        """Lays out a fresh control region (every slot free)."""
        _check_region(ctrl_address, ctrl_bytes)
        needed = geometry.ctrl_size_bytes
        if ctrl_bytes < needed:
            raise InvalidArgumentError(
                f"ctrl_bytes={ctrl_bytes} is too small for {geometry}: the control region "
                f"needs {needed} bytes"
            )
        status = lib().ucm_buffer_init(
            ctrl_address, ctrl_bytes, ctypes.byref(geometry._struct()), creator_start_time
        )
        if status != 0:
            raise InvalidArgumentError(f"cannot create the buffer: {_Status(status).name}")
        return cls(ctrl_address, ctrl_bytes, geometry)

    @classmethod
    def attach(
        cls, ctrl_address: int, ctrl_bytes: int, geometry: Geometry | None = None
    ) -> BufferCore:
        """Validates an existing control region; refuses a bad magic, another layout version or
        a geometry other than ``geometry`` (when given)."""
        _check_region(ctrl_address, ctrl_bytes)
        native = lib()
        expected = ctypes.byref(geometry._struct()) if geometry is not None else None
        status = native.ucm_buffer_attach(ctrl_address, ctrl_bytes, expected)
        if status == _Status.OK:
            header = _HeaderStruct()
            assert native.ucm_buffer_header(ctrl_address, ctypes.byref(header)) == 0
            return cls(ctrl_address, ctrl_bytes, Geometry._from_struct(header.geometry))
        if status == _Status.BAD_MAGIC:
            raise InvalidArgumentError(
                f"the control region at {ctrl_address:#x} is not an initialised UCM CacheBuffer "
                "(bad magic): it was never created, or belongs to something else; remove the "
                "stale segment so that it is created afresh"
            )
        header = _HeaderStruct.from_address(ctrl_address)
        if status == _Status.BAD_LAYOUT_VERSION:
            raise InvalidArgumentError(
                f"the control region has layout version {header.layout_version}, this library "
                "reads another; every rank of a node must run the same UCM version (remove the "
                "stale segment or restart all ranks)"
            )
        if status == _Status.GEOMETRY_MISMATCH:
            found = Geometry._from_struct(header.geometry)
            raise InvalidArgumentError(
                f"the existing buffer has {found}, this rank expects {geometry}; every rank "
                "sharing a unique_id must use the same shard size and capacity (or choose "
                "another unique_id)"
            )
        if status == _Status.CTRL_TOO_SMALL:
            raise InvalidArgumentError(
                f"ctrl_bytes={ctrl_bytes} is smaller than the control region "
                f"({header.ctrl_size_bytes} bytes) described by its header"
            )
        raise InvalidArgumentError(f"cannot attach to the buffer: {_Status(status).name}")

    # -- operations ------------------------------------------------------------------------

    def get(self, keys: Sequence[Key] | KeyBatch) -> GetBatch:
        batch = KeyBatch.of(keys)
        n = len(batch)
        if n == 0:
            return GetBatch(array("B"), array("I"))
        results = array("B", bytes(n))
        slots = array("I", bytes(4 * n))
        status = self._native.ucm_buffer_get(
            self._ctrl,
            self.holder,
            n,
            batch.ids,
            _address(batch.shards),
            _address(results),
            _address(slots),
        )
        if status == _Status.NOT_REGISTERED:
            raise self._unregistered("get")
        self._check(status, "get")
        return GetBatch(results, slots)

    def commit(
        self, slots: Sequence[int] | array[int], states: Sequence[State], *, dirty: bool = False
    ) -> list[CommitResult]:
        """Publishes owned slots (READY, FAILED or MISSING), waking their waiters. ``dirty``
        publishes the READY ones with write-back debt (a dump into a buffer with ``write: back``
        tiers below): they stay until :meth:`take_dirty` / :meth:`clean` wrote them down."""
        # The commit sits on every waiter's wake-up latency, and an owner that has just slept
        # on I/O runs it with cold caches, where each Python step costs microseconds: the
        # happy path is one conversion and one native call, and a single slot needs no array
        # at all. The native side validates every state; only a refused call walks the
        # arguments to name the bad one.
        if (
            type(states) is list
            and len(states) == 1
            and type(slots) in _SLOT_SEQUENCES
            and len(slots) == 1
        ):
            slot, state = slots[0], states[0]
            # Exact types only: ctypes would silently mask a wider int into the u32 slot.
            if type(slot) is int and 0 <= slot <= _U32_MAX and type(state) is State:
                holder = self._holder if self._holder_pid == _PROCESS_ID[0] else self.holder
                code = self._commit_one(
                    self._ctrl,
                    holder,
                    slot,
                    state | _COMMIT_DIRTY_BIT if dirty and state is State.READY else state,
                )
                if code >= 0:
                    return [_COMMIT_RESULTS[code]]
                # Refused before anything changed: the general path names the reason.
        slot_array = _as_u32_array(slots, "slots")
        count = len(slot_array)
        try:
            state_array = array("B", states)
        except (TypeError, OverflowError):
            self._reject_states(states, count)
            raise  # _reject_states always raises here
        if len(state_array) != count:
            self._reject_states(states, count)
        if not count:
            return []
        if dirty:
            ready = int(State.READY)
            for index, code in enumerate(state_array):
                if code == ready:
                    state_array[index] = ready | _COMMIT_DIRTY_BIT
        out = array("B", bytes(count))
        status = self._native.ucm_buffer_commit(
            self._ctrl,
            self.holder,
            count,
            _address(slot_array),
            _address(state_array),
            _address(out),
        )
        if status:
            self._reject_states(states, count)
            self._check_slots(status, slot_array, "commit")
        return [_COMMIT_RESULTS[code] for code in out]

    @staticmethod
    def _reject_states(states: Sequence[State], count: int) -> None:
        """Raises naming the first invalid entry of ``states`` (or its length), if any."""
        if len(states) != count:
            raise InvalidArgumentError(
                f"states has {len(states)} entries, slots has {count}: one state per slot"
            )
        for index, state in enumerate(states):
            if not isinstance(state, int) or state not in _FINAL_STATES:
                raise InvalidArgumentError(
                    f"states[{index}]={state!r} is not valid: expected State.READY, "
                    "State.FAILED or State.MISSING"
                )

    def wait(self, slots: Sequence[int] | array[int], timeout_s: float) -> list[WaitResult]:
        """Blocks (futex, zero CPU) until each slot is final, all within ``timeout_s``."""
        slot_array = _as_u32_array(slots, "slots")
        if not (isinstance(timeout_s, _REAL_NUMBER) and 0 <= timeout_s < 1e9):
            raise InvalidArgumentError(
                f"timeout_s={timeout_s!r} is not valid: expected seconds in [0, 1e9)"
            )
        count = len(slot_array)
        if not count:
            return []
        if count == 1:  # no result array: the waiter has just woken, cold
            code = self._wait_one(self._ctrl, self.holder, slot_array[0], int(timeout_s * 1e9))
            if code >= 0:
                return [_WAIT_RESULTS[code]]
            self._check_slots(code, slot_array, "wait", referenced=True)
        out = array("B", bytes(count))
        status = self._native.ucm_buffer_wait(
            self._ctrl,
            self.holder,
            count,
            _address(slot_array),
            int(timeout_s * 1e9),
            _address(out),
        )
        # The waiter has just woken, cold: nothing but the result list on the way back.
        if status:
            self._check_slots(status, slot_array, "wait", referenced=True)
        return list(map(_WAIT_RESULTS.__getitem__, out))

    def release(self, slots: Sequence[int] | array[int]) -> None:
        slot_array = _as_u32_array(slots, "slots")
        if not slot_array:
            return
        released = self._native.ucm_buffer_release(
            self._ctrl, self.holder, len(slot_array), _address(slot_array)
        )
        self._check_slots(released if released < 0 else 0, slot_array, "release", referenced=True)
        if released != len(slot_array):
            seen: set[int] = set()
            for index, slot in enumerate(slot_array):
                if slot in seen:
                    raise InvalidArgumentError(
                        f"slots[{index}]={slot} is not valid for release: listed twice (a "
                        "process holds one reference per slot); the first was released"
                    )
                seen.add(slot)
            raise TimeoutError(
                f"release dropped {released} of {len(slot_array)} references: a bucket lock "
                "stayed held past the lock timeout"
            )

    def take_dirty(self, capacity: int) -> DirtyBatch:
        """Claims up to ``capacity`` dirty slots for writing down (this process's reference and
        its holder as their flusher), scanning the buffer once at most from where the last call
        stopped. Slots a live flusher in another process (or thread) writes are skipped."""
        _check_int("capacity", capacity, 1, _U32_MAX, "")
        slots = array("I", bytes(4 * capacity))
        shards = array("I", bytes(4 * capacity))
        ids = ctypes.create_string_buffer(BLOCK_ID_BYTES * capacity)
        taken = int(
            self._native.ucm_buffer_take_dirty(
                self._ctrl,
                self.holder,
                ctypes.byref(self._dirty_cursor),
                capacity,
                _address(slots),
                ctypes.addressof(ids),
                _address(shards),
            )
        )
        self._check(min(taken, 0), "take_dirty")
        raw = ids.raw
        keys = [
            (raw[i * BLOCK_ID_BYTES : (i + 1) * BLOCK_ID_BYTES], shards[i]) for i in range(taken)
        ]
        return DirtyBatch(slots[:taken], keys)

    def clean(self, slots: Sequence[int] | array[int], written: Sequence[bool]) -> int:
        """Ends the flush of slots from :meth:`take_dirty`: ``written[i]`` pays slot i's debt,
        otherwise it stays dirty for a later flush. The references stay: :meth:`release` them
        after. Returns slots cleaned."""
        slot_array = _as_u32_array(slots, "slots")
        if len(written) != len(slot_array):
            raise InvalidArgumentError(
                f"written has {len(written)} entries, slots has {len(slot_array)}: one per slot"
            )
        if not slot_array:
            return 0
        flags = array("B", [1 if ok else 0 for ok in written])
        cleaned = int(
            self._native.ucm_buffer_clean(
                self._ctrl, self.holder, len(slot_array), _address(slot_array), _address(flags)
            )
        )
        self._check_slots(min(cleaned, 0), slot_array, "clean", referenced=True)
        return cleaned

    def mark_closing(self, closing: bool = True) -> bool:
        """Marks this process closing the buffer (or open again, ``closing=False``). Returns
        True when no other live process is attached without closing: this one is the last,
        and must write every dirty slot down before it leaves."""
        last = int(self._native.ucm_buffer_mark_closing(self._ctrl, self.holder, int(closing)))
        self._check(min(last, 0), "mark_closing")
        return bool(last)

    def prealloc(self, keys: Sequence[Key] | KeyBatch) -> list[PreallocResult]:
        batch = KeyBatch.of(keys)
        out = array("B", bytes(len(batch)))
        status = self._native.ucm_buffer_prealloc(
            self._ctrl, len(batch), batch.ids, _address(batch.shards), _address(out)
        )
        self._check(status, "prealloc")
        return [PreallocResult(code) for code in out]

    def touch(self, block_ids: Sequence[bytes]) -> int:
        """Sets the accessed bit of every resident shard of each block; returns shards touched."""
        ids = _pack_block_ids(block_ids)
        touched = int(self._native.ucm_buffer_touch(self._ctrl, len(block_ids), ids))
        self._check(min(touched, 0), "touch")
        return touched

    def lookup(self, keys: Sequence[Key] | KeyBatch) -> list[bool]:
        batch = KeyBatch.of(keys)
        out = array("B", bytes(len(batch)))
        status = self._native.ucm_buffer_lookup(
            self._ctrl, len(batch), batch.ids, _address(batch.shards), _address(out)
        )
        self._check(status, "lookup")
        return [bool(present) for present in out]

    def reuses(self, keys: Sequence[Key] | KeyBatch) -> list[int]:
        """Per key, the uses counted on its resident slot (``Slot.reuses``: Gets that found it
        resident, hits and waiters, node-wide; saturating at 65535), 0 when absent."""
        batch = KeyBatch.of(keys)
        out = array("H", bytes(2 * len(batch)))
        status = self._native.ucm_buffer_reuses(
            self._ctrl, len(batch), batch.ids, _address(batch.shards), _address(out)
        )
        self._check(status, "reuses")
        return list(out)

    def lookup_blocks(self, block_ids: Sequence[bytes], shards_per_block: int) -> list[bool]:
        ids = _pack_block_ids(block_ids)
        _check_int("shards_per_block", shards_per_block, 1, _U32_MAX, "")
        out = array("B", bytes(len(block_ids)))
        status = self._native.ucm_buffer_lookup_blocks(
            self._ctrl, len(block_ids), ids, shards_per_block, _address(out)
        )
        self._check(status, "lookup_blocks")
        return [bool(present) for present in out]

    def list_ready(self, batch_keys: int = 4096) -> list[Key]:
        """Every key whose slot is Ready now, node-wide (a read-only scan of the slots, each
        read under its bucket lock, ``batch_keys`` per native call). Keys added or removed
        during the scan may or may not be listed."""
        _check_int("batch_keys", batch_keys, 1, _U32_MAX, "")
        ids = ctypes.create_string_buffer(batch_keys * BLOCK_ID_BYTES)
        shards = array("I", bytes(4 * batch_keys))
        cursor = ctypes.c_uint32(0)
        keys: list[Key] = []
        while True:
            listed = int(
                self._native.ucm_buffer_list_ready(
                    self._ctrl, ctypes.byref(cursor), batch_keys, ids, _address(shards)
                )
            )
            self._check(listed, "list_ready")
            raw = ids.raw
            keys.extend(
                (raw[i * BLOCK_ID_BYTES : (i + 1) * BLOCK_ID_BYTES], shards[i])
                for i in range(listed)
            )
            if cursor.value == 0:
                return keys

    def remove(self, keys: Sequence[Key] | KeyBatch, *, force: bool = False) -> int:
        """Removes keys (one lock pass per chunk of 1024); returns Ready shards removed. Slots in
        use are kept unless ``force`` (then freed when their last holder releases)."""
        batch = KeyBatch.of(keys)
        removed = int(
            self._native.ucm_buffer_remove(
                self._ctrl, len(batch), batch.ids, _address(batch.shards), bool(force)
            )
        )
        self._check(min(removed, 0), "remove")
        return removed

    def remove_blocks(self, block_ids: Sequence[bytes], *, force: bool = False) -> int:
        ids = _pack_block_ids(block_ids)
        removed = int(
            self._native.ucm_buffer_remove_blocks(self._ctrl, len(block_ids), ids, bool(force))
        )
        self._check(min(removed, 0), "remove_blocks")
        return removed

    def stats(self) -> dict[str, int]:
        out = array("Q", bytes(8 * len(COUNTER_NAMES)))
        count = self._native.ucm_buffer_stats(self._ctrl, _address(out), len(COUNTER_NAMES))
        self._check(min(count, 0), "stats")
        assert count == len(COUNTER_NAMES), count
        return dict(zip(COUNTER_NAMES, out, strict=True))

    def count_write_through_skipped(self, amount: int) -> None:
        """Adds shard writes this rank's dumps skipped in its ``write: through`` tiers to the
        node-wide ``write_through_skipped`` counter (every rank's, as ``ucm stats`` shows)."""
        self._check(
            self._native.ucm_buffer_count_write_through_skipped(self._ctrl, amount),
            "count_write_through_skipped",
        )

    def occupancy(self) -> dict[str, int]:
        """Slot counts by where the slots are (``OCCUPANCY_NAMES``), counted natively from the
        shared slot table without locks (``Buffer.occupancy`` in buffer.zig): a gauge."""
        out = _abi.Occupancy()
        self._check(self._native.ucm_buffer_occupancy(self._ctrl, ctypes.byref(out)), "occupancy")
        return {name: int(getattr(out, name)) for name in OCCUPANCY_NAMES}

    def slot_locations(self, slots: Sequence[int] | array[int]) -> list[tuple[int, int]]:
        """``(segment, offset_bytes)`` of each slot's bytes."""
        slot_array = _as_u32_array(slots, "slots")
        segments = array("I", bytes(4 * len(slot_array)))
        offsets = array("Q", bytes(8 * len(slot_array)))
        status = self._native.ucm_buffer_slot_locations(
            self._ctrl,
            len(slot_array),
            _address(slot_array),
            _address(segments),
            _address(offsets),
        )
        self._check_slots(status, slot_array, "slot_locations")
        return list(zip(segments, offsets, strict=True))

    def slot_addresses(
        self, slots: Sequence[int] | array[int], segment_bases: Sequence[int]
    ) -> array[int]:
        """``segment_bases[segment] + offset`` per slot; 0 where the base is 0 (no data plane)."""
        slot_array = _as_u32_array(slots, "slots")
        if len(segment_bases) != self.geometry.segment_count:
            raise InvalidArgumentError(
                f"segment_bases has {len(segment_bases)} entries: expected one per segment "
                f"({self.geometry.segment_count})"
            )
        bases = array("Q", segment_bases)
        out = array("Q", bytes(8 * len(slot_array)))
        status = self._native.ucm_buffer_slot_addresses(
            self._ctrl,
            len(slot_array),
            _address(slot_array),
            _address(bases),
            len(bases),
            _address(out),
        )
        self._check_slots(status, slot_array, "slot_addresses")
        return out

    # -- introspection (tests, tools) --------------------------------------------------------

    def slot_info(self, slot: int) -> SlotInfo:
        _check_int("slot", slot, 0, self.geometry.slot_count_total - 1, "")
        raw = _SlotStruct()
        self._check(self._native.ucm_buffer_debug_slot(self._ctrl, slot, ctypes.byref(raw)), "")
        bucket: int | None = raw.bucket
        if raw.bucket == SLOT_NONE:
            bucket = None
        elif raw.bucket == SLOT_NONE - 1:
            bucket = DETACHED
        owner_holder = raw.owner - 1 if raw.owner else None
        owner_pid = 0
        if owner_holder is not None:
            entry = _HolderStruct()
            self._native.ucm_buffer_holder_info(self._ctrl, owner_holder, ctypes.byref(entry))
            owner_pid = entry.tag & 0xFFFF_FFFF
        return SlotInfo(
            block_id=bytes(raw.block_id),
            shard_index=raw.shard_index,
            refcount=int(raw.holders).bit_count(),
            state=State(raw.state),
            version=raw.version,
            accessed=bool(raw.accessed),
            owner_pid=owner_pid,
            bucket=bucket,
            reserved=bool(raw.flags & 1),
            preallocated=bool(raw.flags & 2),
            holders=int(raw.holders),
            owner_holder=owner_holder,
            dirty=bool(raw.flags & 4),
            flusher_holder=raw.flusher - 1 if raw.flusher else None,
            namespace=raw.namespace - 1 if raw.namespace else None,
        )

    def ready_slots(self, keys: Sequence[Key]) -> list[int]:
        """The slots where keys that are Ready in the buffer live, with the release library's
        calls (benchmarks copy from them directly): a lookup, then a Get of those keys (all
        hits: nothing is allocated or claimed as owner) whose references are dropped at once;
        a slot stays where it is while nothing evicts it. Raises InvalidArgumentError naming
        the keys that are not Ready."""
        absent = [key for key, present in zip(keys, self.lookup(keys), strict=True) if not present]
        if absent:
            raise InvalidArgumentError(
                f"keys not Ready in the buffer: {absent[:4]!r}"
                f"{f' and {len(absent) - 4} more' if len(absent) > 4 else ''}"
            )
        batch = self.get(keys)
        try:
            evicted = [
                key
                for key, result in zip(keys, batch.results, strict=True)
                if result != GetResult.HIT
            ]
            if evicted:
                raise InvalidArgumentError(
                    f"keys evicted between the lookup and the Get: {evicted[:4]!r}"
                )
            return list(batch.slots)
        finally:
            self.release(batch.held_slots())

    def slot_of(self, key: Key) -> int | None:
        """The slot holding ``key`` on its chain (any state), or None."""
        batch = KeyBatch.of([key], "key")
        found = int(self._native.ucm_buffer_debug_find(self._ctrl, batch.ids, batch.shards[0]))
        self._check(min(found, -2) if found < -1 else 0, "slot_of")
        return None if found == -1 else found

    def cursor(self, pool: Pool = Pool.REGULAR) -> int:
        position = int(self._native.ucm_buffer_debug_cursor(self._ctrl, int(pool)))
        self._check(min(position, 0), "cursor")
        return position

    def bucket_of(self, block_id: bytes) -> int:
        bucket = int(
            self._native.ucm_buffer_debug_bucket_of(self._ctrl, _pack_block_ids([block_id]))
        )
        self._check(min(bucket, 0), "bucket_of")
        return bucket

    def debug_hold_lock(self, bucket: int) -> None:
        """Test hook: takes a bucket lock and keeps it (kill this process to test recovery)."""
        _check_int("bucket", bucket, 0, self.geometry.bucket_count - 1, "")
        self._check(self._native.ucm_buffer_debug_hold_lock(self._ctrl, bucket), "hold_lock")

    def debug_drop_lock(self, bucket: int) -> None:
        _check_int("bucket", bucket, 0, self.geometry.bucket_count - 1, "")
        self._check(self._native.ucm_buffer_debug_drop_lock(self._ctrl, bucket), "drop_lock")

    def debug_hold_registration_lock(self) -> None:
        """Test hook: takes the namespace registration lock and keeps it (kill this process to
        test recovery)."""
        self._check(
            self._native.ucm_buffer_debug_hold_registration_lock(self._ctrl),
            "hold_registration_lock",
        )

    # -- errors --------------------------------------------------------------------------------

    def _check(self, status: int, operation: str) -> None:
        if status >= 0:
            return
        if status == _Status.LOCK_TIMEOUT:
            raise TimeoutError(
                f"{operation}: a bucket lock stayed held by a live process past the lock timeout"
            )
        if status == _Status.BAD_MAGIC:
            raise InvalidArgumentError(
                f"{operation}: the control region at {self._ctrl:#x} is no longer a CacheBuffer"
            )
        if status == _Status.NOT_REGISTERED:
            raise self._unregistered(operation)
        raise InvalidArgumentError(f"{operation}: invalid argument ({_Status(status).name})")

    def _check_slots(
        self, status: int, slots: array[int], operation: str, referenced: bool = False
    ) -> None:
        if status == _Status.NOT_REGISTERED:
            raise self._unregistered(operation)
        if status != _Status.INVALID_ARGUMENT:
            self._check(status, operation)
            return
        total = self.geometry.slot_count_total
        for index, slot in enumerate(slots):
            if slot >= total:
                raise InvalidArgumentError(
                    f"slots[{index}]={slot} is not valid: expected a slot index in [0, {total})"
                )
            if referenced and not self.slot_info(slot).holders >> self._holder & 1:
                raise InvalidArgumentError(
                    f"slots[{index}]={slot} is not valid for {operation}: this process holds no "
                    "reference on it (release each slot returned by get exactly once)"
                )
        self._check(status, operation)


def set_wait_pause_ns(pause_ns: int) -> None:
    """Test hook (this process only): ``wait`` pauses this long between reading the version and
    state and blocking on the futex, so a test can land a completion inside that window."""
    _check_int("pause_ns", pause_ns, 0, 2**64 - 1, "")
    lib().ucm_buffer_debug_set_wait_pause_ns(pause_ns)


def _check_region(ctrl_address: int, ctrl_bytes: int) -> None:
    if (
        isinstance(ctrl_address, bool)
        or not isinstance(ctrl_address, int)
        or ctrl_address <= 0
        or ctrl_address % CTRL_ALIGNMENT_BYTES
    ):
        raise InvalidArgumentError(
            f"ctrl_address={ctrl_address!r} is not valid: expected the non-zero, "
            f"{CTRL_ALIGNMENT_BYTES}-byte aligned address of a shared mapping"
        )
    _check_int("ctrl_bytes", ctrl_bytes, 256, 2**63 - 1, "map the whole control segment")


def iter_keys(block_ids: Iterable[bytes], shard_index: int) -> list[Key]:
    """One key per block at ``shard_index`` (the shape of a load task)."""
    return [(block_id, shard_index) for block_id in block_ids]


class AnonymousBuffer:
    """A CacheBuffer (control and data plane) in anonymous shared mappings of this process:
    processes forked while it is open share it at the same addresses. For benchmarks and tools;
    the product maps named segments (:class:`ucm.native.segments.SharedRegion`)."""

    def __init__(self, geometry: Geometry) -> None:
        import mmap

        self.geometry = geometry
        ctrl_bytes = -(-geometry.ctrl_size_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        data_bytes = geometry.slot_count_total * geometry.shard_size_bytes
        # mmap(-1) is MAP_SHARED | MAP_ANONYMOUS: a forked child sees the same pages.
        self._ctrl_map: mmap.mmap | None = mmap.mmap(-1, ctrl_bytes)
        self._data_map: mmap.mmap | None = mmap.mmap(-1, data_bytes)
        self._anchors: list[ctypes.c_char] = [
            ctypes.c_char.from_buffer(self._ctrl_map),
            ctypes.c_char.from_buffer(self._data_map),
        ]
        self.ctrl_address = ctypes.addressof(self._anchors[0])
        self.data_address = ctypes.addressof(self._anchors[1])
        self.core = BufferCore.create(self.ctrl_address, ctrl_bytes, geometry)

    def slot_view(self, slot: int) -> memoryview:
        """The bytes of ``slot`` (one segment holds every slot here)."""
        assert self._data_map is not None, "closed"
        size = self.geometry.shard_size_bytes
        ((segment, offset),) = self.core.slot_locations([slot])
        offset += segment * self.geometry.slots_per_segment * size
        return memoryview(self._data_map)[offset : offset + size]

    def close(self) -> None:
        self._anchors.clear()
        for mapping in (self._ctrl_map, self._data_map):
            if mapping is not None:
                mapping.close()
        self._ctrl_map = self._data_map = None

    def __enter__(self) -> AnonymousBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
