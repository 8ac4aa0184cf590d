"""Validation of public-call arguments, done before anything is touched.

Every error names the argument, the offending value and what would be valid. Shard memory is
turned into lists of memoryviews (one per tensor) that tiers read into or write from directly.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import operator
import sys
import threading
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import InvalidArgumentError
from .layout import BLOCK_ID_BYTES, Key, Layout

if TYPE_CHECKING:
    from .staging import StagedTask


def short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters: what error messages show of a bad value."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_block_ids(block_ids: Any, name: str = "block_ids") -> list[bytes]:
    if isinstance(block_ids, bytes | bytearray | str) or not isinstance(block_ids, Sequence):
        raise InvalidArgumentError(
            f"{name} must be a list of {BLOCK_ID_BYTES}-byte block ids, got "
            f"{type(block_ids).__name__} {short(block_ids)}"
        )
    # Fast path: every id already 16 bytes of `bytes` (what runtimes pass): no copies.
    if all(type(b) is bytes and len(b) == BLOCK_ID_BYTES for b in block_ids):
        return list(block_ids)
    checked = []
    for i, block_id in enumerate(block_ids):
        if not isinstance(block_id, bytes | bytearray | memoryview):
            raise InvalidArgumentError(
                f"{name}[{i}] must be bytes of length {BLOCK_ID_BYTES}, got "
                f"{type(block_id).__name__} {short(block_id)}"
            )
        raw = bytes(block_id)
        if len(raw) != BLOCK_ID_BYTES:
            raise InvalidArgumentError(
                f"{name}[{i}] must be exactly {BLOCK_ID_BYTES} bytes, got {len(raw)} bytes "
                f"({short(raw)})"
            )
        checked.append(raw)
    return checked


class TaskKeys:
    """A task's keys, packed for the native queue: ``ids`` (the 16-byte block ids back to back)
    and ``shards`` (``array('I')``); the ``(block id, shard index)`` list is built on first use
    (a task that succeeds needs none), from ``ids``: a copy made at submit, so a caller that
    reuses its list (or its ``bytearray`` ids) after ``load``/``dump`` changes nothing."""

    __slots__ = ("_keys", "ids", "shards")

    def __init__(self, ids: bytes, shards: array[int]) -> None:
        self.ids = ids
        self.shards = shards
        self._keys: list[Key] | None = None

    def __len__(self) -> int:
        return len(self.shards)

    @property
    def keys(self) -> list[Key]:
        if self._keys is None:
            ids = self.ids
            self._keys = [
                (ids[i * BLOCK_ID_BYTES : (i + 1) * BLOCK_ID_BYTES], shard)
                for i, shard in enumerate(self.shards)
            ]
        return self._keys

    def slice(self, start: int, end: int) -> TaskKeys:
        part = TaskKeys(
            self.ids[start * BLOCK_ID_BYTES : end * BLOCK_ID_BYTES],
            self.shards[start:end],
        )
        if self._keys is not None:
            part._keys = self._keys[start:end]
        return part

    @classmethod
    def of(cls, keys: Sequence[Key]) -> TaskKeys:
        packed = cls(b"".join(key[0] for key in keys), array("I", [key[1] for key in keys]))
        packed._keys = list(keys)
        return packed


TIMEOUT_S_MAX = threading.TIMEOUT_MAX
"""The longest bound a wait takes (about 292 years: what ``threading`` waits accept); a longer
one waits this long."""


def check_timeout_s(timeout_s: Any, name: str = "timeout_s") -> float | None:
    """A wait's bound: None (no bound) or a finite number of seconds, 0 or more (one above
    ``TIMEOUT_S_MAX`` is taken as ``TIMEOUT_S_MAX``, which is no bound in practice)."""
    if timeout_s is None:
        return None
    return _seconds(timeout_s, name, "None (no bound) or a finite number of seconds, 0 or more")


def check_seconds(seconds: Any, name: str) -> float:
    """A finite number of seconds, 0 or more (capped at ``TIMEOUT_S_MAX``), where None (no
    bound) is not an option."""
    return _seconds(seconds, name, "a finite number of seconds, 0 or more")


def _seconds(seconds: Any, name: str, valid: str) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise InvalidArgumentError(
            f"{name} must be {valid}, got {type(seconds).__name__} {short(seconds)}"
        )
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgumentError(f"{name}={seconds!r} is not valid: expected {valid}")
    return min(float(seconds), TIMEOUT_S_MAX)


def check_flag(flag: Any, name: str) -> bool:
    """A bool argument: True or False, nothing that merely converts to one (``"no"`` is
    true)."""
    if flag is not True and flag is not False:
        raise InvalidArgumentError(f"{name} must be a bool, got {short(flag)}")
    return flag


def check_task_keys(block_ids: Any, shard_index: Any, layout: Layout) -> TaskKeys:
    """The keys of a load or dump, checked (ids, indexes, no key twice) and packed. The common
    shapes (a list of 16-byte ids, an int or a list of ints) take a few C-level passes; anything
    else, or anything wrong, goes through the per-entry checks that name the bad value."""
    fast = _fast_task_keys(block_ids, shard_index, layout)
    if fast is not None:
        return fast
    blocks = check_block_ids(block_ids)
    indexes = check_shard_indexes(shard_index, len(blocks), layout)
    keys = keys_for(blocks, indexes)
    check_unique_keys(keys)
    return TaskKeys.of(keys)


def _fast_task_keys(block_ids: Any, shard_index: Any, layout: Layout) -> TaskKeys | None:
    if type(block_ids) is not list and type(block_ids) is not tuple:
        return None
    count = len(block_ids)
    try:
        ids = b"".join(block_ids)
        # Every id is 16 bytes: the lengths sum to 16 * count and none is longer.
        if len(ids) != BLOCK_ID_BYTES * count or (count and max(map(len, block_ids)) != 16):
            return None
        if type(shard_index) is int:
            if not 0 <= shard_index < layout.shards_per_block:
                return None
            shards = array("I", [shard_index]) * count
            unique = len(set(block_ids)) == count
        else:
            if type(shard_index) is not list and type(shard_index) is not tuple:
                return None
            if len(shard_index) != count or bool in set(map(type, shard_index)):
                return None
            shards = array("I", shard_index)
            if count and max(shards) >= layout.shards_per_block:
                return None
            unique = len(set(zip(block_ids, shard_index, strict=True))) == count
    except (TypeError, OverflowError, ValueError):
        return None
    return TaskKeys(ids, shards) if unique else None


def check_one_shard(shard_index: Any, layout: Layout) -> int | None:
    """An optional single shard index (``prefetch``/``pin``: only that shard of each block,
    a rank's own): None, or an int in [0, shards_per_block)."""
    if shard_index is None:
        return None
    per_block = layout.shards_per_block
    valid = f"None or an int in [0, {per_block}) (shards_per_block={per_block})"
    if not isinstance(shard_index, int) or isinstance(shard_index, bool):
        raise InvalidArgumentError(
            f"shard_index={short(shard_index)} is not valid: expected {valid}"
        )
    if not 0 <= shard_index < layout.shards_per_block:
        raise InvalidArgumentError(f"shard_index={shard_index} is out of range: expected {valid}")
    return shard_index


def check_shard_indexes(shard_index: Any, count: int, layout: Layout) -> list[int]:
    """One shard index per block (an int is applied to every block)."""
    valid = f"an int in [0, {layout.shards_per_block}) (shards_per_block={layout.shards_per_block})"
    if isinstance(shard_index, int) and not isinstance(shard_index, bool):
        indexes = [shard_index] * count
    elif isinstance(shard_index, Sequence) and not isinstance(shard_index, str | bytes):
        indexes = list(shard_index)
        if len(indexes) != count:
            raise InvalidArgumentError(
                f"shard_index has {len(indexes)} entries but block_ids has {count}: give one "
                "shard index per block (or a single int for all)"
            )
    else:
        raise InvalidArgumentError(
            f"shard_index must be an int or a list of ints, got {type(shard_index).__name__} "
            f"{short(shard_index)}"
        )
    for i, index in enumerate(indexes):
        if not isinstance(index, int) or isinstance(index, bool):
            raise InvalidArgumentError(
                f"shard_index[{i}]={short(index)} is not valid: expected {valid}"
            )
        if not 0 <= index < layout.shards_per_block:
            raise InvalidArgumentError(
                f"shard_index[{i}]={index} is out of range: expected {valid}"
            )
    return indexes


class ShardMemory:
    """Caller memory of one task: per key, where a tier reads into or writes from.

    ``flat`` holds the host address of every tensor of every key, key-major (``len(sizes)``
    per key): what the native queue copies to or from, in one array. ``views[i]`` are
    memoryviews of key i's tensors, built on first use (only the tiers below read them).
    ``cuda_pairs`` lists (device tensor, host staging view) pairs: each CUDA shard holds one
    slot of the pinned staging ring (``ucm.staging``, ``staged``) — loads land in the slot and
    are copied to the device after the task's I/O; dumps copy to the slot first. ``cuda[i]``
    (an empty list: no CUDA tensor anywhere), when set, holds key i's (device tensor, staging
    view) pairs, so a loader with registered buffer memory can copy slot bytes straight to the
    device instead of through the staging slot.
    """

    def __init__(
        self,
        sizes: Sequence[int] = (),
        views: list[list[memoryview]] | None = None,
    ) -> None:
        self.sizes = tuple(sizes)
        self._views = views
        self.flat: array[int] = array("Q")
        self.keepalive: list[Any] = []
        self.cuda_pairs: list[tuple[Any, Any]] = []
        self.cuda: list[list[tuple[Any, Any]] | None] = []
        self.staged: StagedTask | None = None
        """The staging slots of the CUDA shards (``ucm.staging``), until the task completes."""

    def __len__(self) -> int:
        if self._views is not None:
            return len(self._views)
        return len(self.flat) // len(self.sizes) if self.sizes else 0

    def addresses_of(self, index: int) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of key ``index``'s tensors."""
        count = len(self.sizes)
        start = index * count
        return list(zip(self.flat[start : start + count], self.sizes, strict=True))

    def slice(self, start: int, end: int) -> ShardMemory:
        """Keys [start, end) of this memory (the same caller memory, kept alive the same)."""
        if start == 0 and end == len(self):
            return self
        count = len(self.sizes)
        part = ShardMemory(self.sizes)
        part.flat = self.flat[start * count : end * count]
        part.keepalive = self.keepalive
        if self.cuda:
            part.cuda = self.cuda[start:end]
            part.cuda_pairs = [pair for pairs in part.cuda if pairs for pair in pairs]
        return part

    @property
    def views(self) -> list[list[memoryview]]:
        if self._views is None:
            self._views = [
                [_view_at(address, nbytes) for address, nbytes in self.addresses_of(i)]
                for i in range(len(self))
            ]
        return self._views


def _view_at(address: int, nbytes: int) -> memoryview:
    buffer = (ctypes.c_ubyte * nbytes).from_address(address)
    return memoryview(buffer).cast("B")


def check_tensors(
    tensors: Any, count: int, layout: Layout, name: str, for_load: bool
) -> ShardMemory:
    """``tensors[i]`` is the list of torch tensors of block i's shard (a bare tensor is taken as
    a one-element list)."""
    if not isinstance(tensors, Sequence) or isinstance(tensors, str | bytes):
        raise InvalidArgumentError(
            f"{name} must be a list with one list of tensors per block, got "
            f"{type(tensors).__name__}"
        )
    if len(tensors) != count:
        raise InvalidArgumentError(
            f"{name} has {len(tensors)} entries but block_ids has {count}: give one list of "
            "tensors per block"
        )
    torch = sys.modules.get("torch")
    fast = _fast_tensors(tensors, layout, for_load, torch)
    if fast is not None:
        return fast
    tensor_type = torch.Tensor if torch is not None else ()
    strided = torch.strided if torch is not None else None
    sizes = layout.tensor_sizes
    memory = ShardMemory(sizes)
    keepalive = memory.keepalive
    flat = memory.flat
    for i, entry in enumerate(tensors):
        # A list first: isinstance(list, torch.Tensor) goes through torch's metaclass and costs
        # ~0.25 us, a third of the whole check of a one-tensor shard.
        items = (
            entry if type(entry) is list else (entry,) if isinstance(entry, tensor_type) else entry
        )
        # Exact list/tuple first: the common case, without the (slow) ABC isinstance check.
        if (
            type(items) is not list
            and type(items) is not tuple
            and (not isinstance(items, Sequence) or isinstance(items, str | bytes))
        ):
            raise InvalidArgumentError(
                f"{name}[{i}] must be a list of {len(sizes)} torch tensor(s), got "
                f"{type(entry).__name__}"
            )
        if len(items) != len(sizes):
            raise InvalidArgumentError(
                f"{name}[{i}] has {len(items)} tensor(s) but the shard layout has {len(sizes)} "
                f"(tensor_size_list={list(sizes)})"
            )
        devices: list[tuple[Any, Any]] = []
        for j, tensor in enumerate(items):
            # The happy path is a handful of attribute reads per tensor: this runs per shard.
            if not isinstance(tensor, tensor_type):
                raise InvalidArgumentError(
                    f"{name}[{i}][{j}] must be a torch.Tensor, got {type(tensor).__name__}"
                )
            if tensor.layout is not strided:
                raise InvalidArgumentError(
                    f"{name}[{i}][{j}] is a {tensor.layout} tensor; UCM copies a tensor's bytes "
                    "and needs a dense (torch.strided) contiguous tensor: pass tensor.to_dense()"
                )
            try:
                nbytes = tensor.nbytes
                contiguous = tensor.is_contiguous()
                address = tensor.data_ptr() if tensor.is_cpu else 0
            except RuntimeError as exc:  # a tensor without plain storage torch lets us read
                raise InvalidArgumentError(
                    f"{name}[{i}][{j}] has no memory UCM can copy ({_first_line(exc)}); pass a "
                    "dense contiguous CPU or CUDA tensor"
                ) from None
            if nbytes != sizes[j]:
                raise InvalidArgumentError(
                    f"{name}[{i}][{j}] has {nbytes} bytes ({tuple(tensor.shape)} {tensor.dtype}) "
                    f"but the layout expects {sizes[j]} bytes (tensor_size_list[{j}])"
                )
            if not contiguous:
                raise InvalidArgumentError(
                    f"{name}[{i}][{j}] is not contiguous (strides {tensor.stride()}); pass "
                    "tensor.contiguous() or a contiguous view"
                )
            if for_load and tensor.requires_grad and tensor.is_leaf:
                raise InvalidArgumentError(
                    f"{name}[{i}][{j}] requires grad; load into a tensor with requires_grad=False"
                )
            if tensor.is_cpu:
                flat.append(address)
                keepalive.append(tensor)
            elif tensor.is_cuda:
                flat.append(0)  # the staging slot's address, once the task's slots are taken
                devices.append((tensor, None))
            else:
                raise InvalidArgumentError(
                    f"{name}[{i}][{j}] is on device {tensor.device}; UCM copies to CPU and CUDA "
                    "tensors"
                )
        if devices and len(devices) != len(items):
            raise InvalidArgumentError(
                f"{name}[{i}] mixes CPU and CUDA tensors; keep one shard's tensors on one device"
            )
        memory.cuda.append(devices or None)
    if for_load:
        _check_distinct(memory, name)
    if any(memory.cuda):
        _stage_cuda(memory, layout, for_load)
    return memory


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _overlaps(starts: Sequence[int], sizes: tuple[int, ...]) -> bool:
    """Whether any two of the ranges ``[starts[k], starts[k] + sizes[k % len(sizes)])``
    overlap, in C-level passes (~100 ns per range, a quarter of the tensor checks' own cost).
    Sorted starts at least the largest size apart: disjoint (exact for equal sizes). Else
    disjoint ranges sorted by start are sorted by end too, so they are disjoint exactly when
    each sorted start is at or past the sorted end before it."""
    if len(starts) < 2:
        return False
    ordered = sorted(starts)
    widest = max(sizes)
    if min(map(operator.sub, itertools.islice(ordered, 1, None), ordered)) >= widest:
        return False
    if min(sizes) == widest:
        return True
    ends = sorted(map(operator.add, starts, sizes * (len(starts) // len(sizes))))
    return not all(map(operator.ge, itertools.islice(ordered, 1, None), ends))


def _check_distinct(memory: ShardMemory, name: str) -> None:
    """A load's destinations must not share memory: two keys' bytes into one place would leave
    one of them silently lost. CPU tensors, by address, in C-level passes; CUDA destinations
    are not checked (a per-tensor Python pass would add about a fifth to what a CUDA load
    already pays per tensor in Python, the path's known bottleneck: docs/benchmarks.md)."""
    sizes = memory.sizes
    per_key = len(sizes)
    ranges: dict[Any, list[tuple[int, int, int]]] = {}  # device: (start, end, flat index)
    host = [address for address in memory.flat if address]
    if len(host) == len(memory.flat) and not _overlaps(memory.flat, sizes):
        return  # the common case: CPU tensors only, disjoint
    for k, address in enumerate(memory.flat):
        if address:
            ranges.setdefault("cpu", []).append((address, address + sizes[k % per_key], k))
    for spans in ranges.values():
        spans.sort()
        widest = spans[0]
        for span in spans[1:]:
            if span[0] < widest[1]:
                first, second = sorted((widest[2], span[2]))
                raise InvalidArgumentError(
                    f"{name}[{second // per_key}][{second % per_key}] shares memory with "
                    f"{name}[{first // per_key}][{first % per_key}]: a load writes each key's "
                    "bytes to its own destination, so give every tensor distinct memory"
                )
            if span[1] > widest[1]:
                widest = span


def _stage_cuda(memory: ShardMemory, layout: Layout, for_load: bool) -> None:
    """Gives each CUDA shard a slot of the process's pinned staging ring (``ucm.staging``):
    its host addresses become the slot's, and a dump's device bytes are copied there (side
    stream, one event wait for the task)."""
    from .staging import StagedTask, cuda_staging

    staging = cuda_staging(layout.shard_size)
    keys = [i for i, pairs in enumerate(memory.cuda) if pairs is not None]
    # A dump never waits for slots (saves must not hold the forward pass back): it fails at
    # once and the caller counts it; a load waits (bounded) for earlier tasks' slots.
    wait_s = None if for_load else 0.0
    task = StagedTask(staging.ring, staging.ring.acquire(len(keys), wait_s))
    try:
        count = len(memory.sizes)
        for i, slot in zip(keys, task.slots, strict=True):
            host = staging.slot(slot)
            offset = 0
            pairs = []
            for j, (tensor, _none) in enumerate(memory.cuda[i] or ()):
                nbytes = memory.sizes[j]
                view = host[offset : offset + nbytes]
                memory.flat[i * count + j] = view.data_ptr()
                pairs.append((tensor, view))
                offset += nbytes
            memory.cuda[i] = pairs
            memory.cuda_pairs.extend(pairs)
        if not for_load:
            staging.to_host(memory.cuda_pairs)
    except BaseException:
        task.release()
        raise
    memory.staged = task


def _fast_tensors(tensors: Any, layout: Layout, for_load: bool, torch: Any) -> ShardMemory | None:
    """The common case of ``check_tensors`` (lists of contiguous CPU ``torch.Tensor`` objects of
    the layout's sizes) in C-level passes over all tensors at once: ~0.3 us per tensor instead
    of ~0.6. None sends anything else (a CUDA tensor, a subclass, a bad size, a tensor that
    needs grad) to the per-tensor checks, which name the problem or handle it."""
    if torch is None or type(tensors) is not list or not tensors:
        return None
    sizes = layout.tensor_sizes
    tensor_type = torch.Tensor
    if type(tensors[0]) is list:
        if set(map(len, tensors)) != {len(sizes)} or set(map(type, tensors)) != {list}:
            return None
        every = list(itertools.chain.from_iterable(tensors))
    elif len(sizes) == 1:
        every = tensors  # one bare tensor per shard
    else:
        return None
    if set(map(type, every)) != {tensor_type}:
        return None
    try:
        nbytes = list(map(_NBYTES, every))
        if len(sizes) == 1:
            if set(nbytes) != {sizes[0]}:
                return None
        elif nbytes != list(sizes) * len(tensors):
            return None
        if not all(map(_IS_CPU, every)) or not all(map(tensor_type.is_contiguous, every)):
            return None
        if for_load and any(map(_REQUIRES_GRAD, every)):
            return None
        flat = array("Q", map(tensor_type.data_ptr, every))
    except RuntimeError:
        # A sparse or mkldnn tensor (torch has no nbytes, contiguity or address for it): the
        # per-tensor checks name it.
        return None
    if for_load and _overlaps(flat, sizes):
        return None  # two destinations share memory: the per-tensor checks name them
    memory = ShardMemory(sizes)
    memory.flat = flat
    memory.keepalive.append(every)
    return memory


_NBYTES = operator.attrgetter("nbytes")
_IS_CPU = operator.attrgetter("is_cpu")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def finish_cuda_loads(memory: ShardMemory, direct: frozenset[int] | set[int] = frozenset()) -> None:
    """Copies staged bytes into the CUDA destination tensors (the staging ring's side stream,
    waiting on that copy's event, not the device), then returns the task's staging slots.
    Keys in ``direct`` were copied to the device straight from registered buffer memory."""
    try:
        pairs = [
            pair
            for i, key_pairs in enumerate(memory.cuda)
            if key_pairs is not None and i not in direct
            for pair in key_pairs
        ]
        if pairs:
            from .staging import cuda_staging

            cuda_staging(sum(memory.sizes)).to_device(pairs)
    finally:
        release_staging(memory)


def release_staging(memory: ShardMemory) -> None:
    """Returns the staging slots a task's CUDA shards held (once; none: nothing)."""
    staged = memory.staged
    if staged is not None:
        staged.release()


ADDRESS_MIN = 4096
"""Caller addresses below this are never valid: the null page."""


def check_pointers(pointers: Any, count: int, layout: Layout, name: str) -> ShardMemory:
    """``pointers[i][j]``: the address of tensor j of block i's shard (sizes from the layout)."""
    fast = _fast_pointers(pointers, count, layout)
    if fast is not None:
        return fast
    if isinstance(pointers, array):
        return _check_packed_pointers(pointers, count, layout, name)
    if not isinstance(pointers, Sequence) or isinstance(pointers, str | bytes):
        raise InvalidArgumentError(
            f"{name} must be a list with one list of addresses per block, got "
            f"{type(pointers).__name__}"
        )
    if len(pointers) != count:
        raise InvalidArgumentError(
            f"{name} has {len(pointers)} entries but block_ids has {count}: give one list of "
            "addresses per block"
        )
    sizes = layout.tensor_sizes
    memory = ShardMemory(sizes)
    flat = memory.flat
    for i, entry in enumerate(pointers):
        items = [entry] if isinstance(entry, int) else entry
        if not isinstance(items, Sequence) or len(items) != len(sizes):
            raise InvalidArgumentError(
                f"{name}[{i}] must list {len(sizes)} address(es) (tensor_size_list="
                f"{list(sizes)}), got {short(entry)}"
            )
        for j, address in enumerate(items):
            if (
                not isinstance(address, int)
                or isinstance(address, bool)
                or not ADDRESS_MIN <= address < 1 << 64
            ):
                raise InvalidArgumentError(
                    f"{name}[{i}][{j}]={short(address)} is not valid: expected an integer "
                    f"address (at least {ADDRESS_MIN}: below is the null page)"
                )
        flat.extend(items)
    return memory


def _check_packed_pointers(
    pointers: array[Any], count: int, layout: Layout, name: str
) -> ShardMemory:
    """The errors of a packed ``array`` of addresses (the fast path took every valid one)."""
    per_key = len(layout.tensor_sizes)
    packed = f"an array('Q'): one unsigned 64-bit address per tensor, key-major ({per_key} per key)"
    if pointers.typecode != "Q":
        raise InvalidArgumentError(
            f"{name} is an array('{pointers.typecode}'); packed addresses must be {packed}"
        )
    if len(pointers) != count * per_key:
        raise InvalidArgumentError(
            f"{name} holds {len(pointers)} addresses but {count} block(s) of {per_key} tensor(s) "
            f"need {count * per_key}: packed addresses must be {packed}"
        )
    for k, address in enumerate(pointers):
        if address < ADDRESS_MIN:
            raise InvalidArgumentError(
                f"{name}[{k}] (block {k // per_key}, tensor {k % per_key})={address} is not "
                f"valid: expected an integer address (at least {ADDRESS_MIN}: below is the null "
                "page)"
            )
    raise AssertionError("unreachable: the fast path takes a valid array")


def _fast_pointers(pointers: Any, count: int, layout: Layout) -> ShardMemory | None:
    """The common shapes of ``check_pointers`` in a few C-level passes: a list of ints (one
    tensor per shard) or a list of lists; None sends anything else to the checks that name it.
    ``array('Q')`` refuses non-integers and negative or too large ones; bools become 0 or 1,
    which the null-page bound refuses."""
    sizes = layout.tensor_sizes
    if type(pointers) is array:
        # Packed: every address of the task, key-major, in one array('Q') (the fastest form).
        if pointers.typecode != "Q" or len(pointers) != count * len(sizes):
            return None
        # A copy: native threads read these addresses after load()/dump() returns, and the
        # caller may reuse or resize its array by then.
        flat = array("Q", pointers)
        if count and min(flat) < ADDRESS_MIN:
            return None
        memory = ShardMemory(sizes)
        memory.flat = flat
        return memory
    if (type(pointers) is not list and type(pointers) is not tuple) or len(pointers) != count:
        return None
    try:
        if count and type(pointers[0]) is int:
            if len(sizes) != 1:
                return None
            flat = array("Q", pointers)
        elif len(sizes) == 1:
            # One tensor per shard: unpacking checks that each entry holds exactly one.
            flat = array("Q", [address for (address,) in pointers])
        else:
            if count and set(map(len, pointers)) != {len(sizes)}:
                return None
            flat = array("Q", list(itertools.chain.from_iterable(pointers)))
    except (TypeError, OverflowError, ValueError):
        return None
    if count and min(flat) < ADDRESS_MIN:
        return None
    memory = ShardMemory(sizes)
    memory.flat = flat
    return memory


def keys_for(block_ids: list[bytes], indexes: list[int]) -> list[Key]:
    return list(zip(block_ids, indexes, strict=True))


def check_unique_keys(keys: list[Key]) -> None:
    seen: dict[Key, int] = {}
    for i, key in enumerate(keys):
        if key in seen:
            raise InvalidArgumentError(
                f"block_ids[{i}] with shard_index {key[1]} repeats block_ids[{seen[key]}]: each "
                "(block id, shard index) may appear once per task"
            )
        seen[key] = i
