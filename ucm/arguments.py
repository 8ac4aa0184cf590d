"""Validation of public-call arguments, done before anything is touched.

Every error names the argument, the offending value and what would be valid. Shard memory is
turned into lists of memoryviews (one per tensor) that tiers read into or write from directly.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidArgumentError
from .layout import BLOCK_ID_BYTES, Key, Layout


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_block_ids(block_ids: Any, name: str = "block_ids") -> list[bytes]:
    if isinstance(block_ids, bytes | bytearray | str) or not isinstance(block_ids, Sequence):
        raise InvalidArgumentError(
            f"{name} must be a list of {BLOCK_ID_BYTES}-byte block ids, got "
            f"{type(block_ids).__name__} {_short(block_ids)}"
        )
    checked = []
    for i, block_id in enumerate(block_ids):
        if not isinstance(block_id, bytes | bytearray | memoryview):
            raise InvalidArgumentError(
                f"{name}[{i}] must be bytes of length {BLOCK_ID_BYTES}, got "
                f"{type(block_id).__name__} {_short(block_id)}"
            )
        raw = bytes(block_id)
        if len(raw) != BLOCK_ID_BYTES:
            raise InvalidArgumentError(
                f"{name}[{i}] must be exactly {BLOCK_ID_BYTES} bytes, got {len(raw)} bytes "
                f"({_short(raw)})"
            )
        checked.append(raw)
    return checked


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
            f"{_short(shard_index)}"
        )
    for i, index in enumerate(indexes):
        if not isinstance(index, int) or isinstance(index, bool):
            raise InvalidArgumentError(
                f"shard_index[{i}]={_short(index)} is not valid: expected {valid}"
            )
        if not 0 <= index < layout.shards_per_block:
            raise InvalidArgumentError(
                f"shard_index[{i}]={index} is out of range: expected {valid}"
            )
    return indexes


@dataclass
class ShardMemory:
    """Caller memory of one task: per key, the views a tier reads into or writes from.

    ``cuda_pairs`` lists (device tensor, host staging tensor) pairs: loads land in the staging
    tensor and are copied to the device after the task's I/O; dumps copy to staging first.
    """

    views: list[list[memoryview]]
    keepalive: list[Any] = field(default_factory=list)
    cuda_pairs: list[tuple[Any, Any]] = field(default_factory=list)


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
    sizes = layout.tensor_sizes
    memory = ShardMemory(views=[])
    for i, entry in enumerate(tensors):
        items = [entry] if torch is not None and isinstance(entry, torch.Tensor) else entry
        if not isinstance(items, Sequence) or isinstance(items, str | bytes):
            raise InvalidArgumentError(
                f"{name}[{i}] must be a list of {len(sizes)} torch tensor(s), got "
                f"{type(entry).__name__}"
            )
        if len(items) != len(sizes):
            raise InvalidArgumentError(
                f"{name}[{i}] has {len(items)} tensor(s) but the shard layout has {len(sizes)} "
                f"(tensor_size_list={list(sizes)})"
            )
        views = []
        for j, tensor in enumerate(items):
            where = f"{name}[{i}][{j}]"
            if torch is None or not isinstance(tensor, torch.Tensor):
                raise InvalidArgumentError(
                    f"{where} must be a torch.Tensor, got {type(tensor).__name__}"
                )
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes != sizes[j]:
                raise InvalidArgumentError(
                    f"{where} has {nbytes} bytes ({tuple(tensor.shape)} {tensor.dtype}) but the "
                    f"layout expects {sizes[j]} bytes (tensor_size_list[{j}])"
                )
            if not tensor.is_contiguous():
                raise InvalidArgumentError(
                    f"{where} is not contiguous (strides {tensor.stride()}); pass "
                    "tensor.contiguous() or a contiguous view"
                )
            if for_load and tensor.requires_grad and tensor.is_leaf:
                raise InvalidArgumentError(
                    f"{where} requires grad; load into a tensor with requires_grad=False"
                )
            if tensor.device.type == "cpu":
                views.append(_view_at(tensor.data_ptr(), nbytes))
                memory.keepalive.append(tensor)
            elif tensor.device.type == "cuda":
                staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                if not for_load:
                    staging.copy_(tensor.reshape(-1).view(torch.uint8))
                memory.cuda_pairs.append((tensor, staging))
                views.append(_view_at(staging.data_ptr(), nbytes))
                memory.keepalive.append(staging)
            else:
                raise InvalidArgumentError(
                    f"{where} is on device {tensor.device}; UCM copies to CPU and CUDA tensors"
                )
        memory.views.append(views)
    return memory


def finish_cuda_loads(memory: ShardMemory) -> None:
    """Copies staged bytes into the CUDA destination tensors and waits for the copies."""
    if not memory.cuda_pairs:
        return
    import torch

    for device_tensor, staging in memory.cuda_pairs:
        device_tensor.reshape(-1).view(torch.uint8).copy_(staging, non_blocking=True)
    torch.cuda.synchronize()


def check_pointers(pointers: Any, count: int, layout: Layout, name: str) -> ShardMemory:
    """``pointers[i][j]``: the address of tensor j of block i's shard (sizes from the layout)."""
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
    memory = ShardMemory(views=[])
    for i, entry in enumerate(pointers):
        items = [entry] if isinstance(entry, int) else entry
        if not isinstance(items, Sequence) or len(items) != len(sizes):
            raise InvalidArgumentError(
                f"{name}[{i}] must list {len(sizes)} address(es) (tensor_size_list="
                f"{list(sizes)}), got {_short(entry)}"
            )
        views = []
        for j, address in enumerate(items):
            if not isinstance(address, int) or isinstance(address, bool) or address <= 0:
                raise InvalidArgumentError(
                    f"{name}[{i}][{j}]={_short(address)} is not valid: expected a non-zero "
                    "integer address"
                )
            views.append(_view_at(address, sizes[j]))
        memory.views.append(views)
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
