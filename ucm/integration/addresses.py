"""Engine KV blocks as raw addresses: one base address and one block stride per layer, checked
once at registration, so that a step's shard addresses are array arithmetic and the transfer
goes through ``store.load_data`` / ``store.dump_data`` (no tensor per layer per block, no
per-tensor check in Python).

A runtime registers one *block view* per stored layer: a CPU tensor whose ``view[b]`` is block
``b`` of the layer, contiguous, ``size`` bytes. Then block ``b``'s bytes of layer ``l`` start at
``base[l] + b * stride[l]``, exactly ``view[b].data_ptr()``. Registration checks what makes
every such address safe for every block in ``[0, blocks)``: each block contiguous and of the
layout's size, blocks that do not overlap, and the last block inside the tensor's storage. A
step then checks only that its block numbers are in range (one min/max over the array).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..arguments import ADDRESS_MIN
from ..errors import ConfigError, InvalidArgumentError

if TYPE_CHECKING:
    import numpy as np
    import torch


class BlockAddresses:
    """Per layer: ``base`` (address of block 0), ``stride`` (bytes from one block to the next)
    and ``size`` (bytes of one block), for ``blocks`` blocks; :meth:`of` turns a step's block
    numbers into the key-major ``array('Q')`` that ``load_data``/``dump_data`` take."""

    __slots__ = ("_bases", "_keepalive", "_np", "_strides", "blocks", "names", "sizes")

    def __init__(
        self,
        views: Sequence[torch.Tensor],
        sizes: Sequence[int],
        names: Sequence[str],
        blocks: int,
        what: str = "the KV cache",
    ) -> None:
        """``views[l]``: layer ``names[l]``'s block view (see :func:`block_view`), whose
        blocks hold ``sizes[l]`` bytes; ``what`` starts every error message."""
        import numpy

        if not len(views) == len(sizes) == len(names) or not views:
            raise ConfigError(
                f"{what}: {len(views)} layer view(s), {len(sizes)} size(s) and {len(names)} "
                "name(s): give one of each per stored layer, at least one layer"
            )
        if blocks < 1:
            raise ConfigError(f"{what}: blocks={blocks}; a KV cache has at least one block")
        bases: list[int] = []
        strides: list[int] = []
        for view, size, name in zip(views, sizes, names, strict=True):
            base, stride = _layer_geometry(view, size, name, blocks, what)
            bases.append(base)
            strides.append(stride)
        self._np = numpy
        self._bases = numpy.array(bases, dtype=numpy.uint64)
        self._strides = numpy.array(strides, dtype=numpy.uint64)
        self.sizes = tuple(sizes)
        self.names = tuple(names)
        self.blocks = blocks
        self._keepalive = list(views)
        """The tensors whose memory the addresses point into: alive as long as this object."""

    @property
    def bases(self) -> list[int]:
        return [int(b) for b in self._bases]

    @property
    def strides(self) -> list[int]:
        return [int(s) for s in self._strides]

    def of(self, blocks: Sequence[int] | np.ndarray[Any, Any]) -> array[int]:
        """The addresses of ``blocks``' shards, key-major: ``len(blocks) * layers`` entries,
        entry ``i * layers + l`` = layer ``l`` of ``blocks[i]``. Raises
        :class:`~ucm.errors.InvalidArgumentError` naming the first block out of range."""
        np = self._np
        numbers = np.asarray(blocks)
        out: array[int] = array("Q")
        if numbers.size == 0:
            return out
        if numbers.ndim != 1 or numbers.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"blocks must be a flat list of block numbers, got {numbers.dtype} of shape "
                f"{numbers.shape}"
            )
        low, high = int(numbers.min()), int(numbers.max())
        if low < 0 or high >= self.blocks:
            bad = low if low < 0 else high
            at = int(np.flatnonzero(numbers == bad)[0])
            raise InvalidArgumentError(
                f"blocks[{at}]={bad} is out of range: the registered KV cache has blocks "
                f"[0, {self.blocks})"
            )
        flat = self._bases[None, :] + numbers.astype(np.uint64)[:, None] * self._strides[None, :]
        out.frombytes(np.ascontiguousarray(flat, dtype=np.uint64).tobytes())
        return out


def _layer_geometry(view: Any, size: int, name: str, blocks: int, what: str) -> tuple[int, int]:
    """``(base, stride)`` of one layer's block view, after every check that makes
    ``base + b * stride`` (``size`` bytes) safe for each block ``b < blocks``."""
    import torch

    where = f"{what} of layer {name!r}"
    if not isinstance(view, torch.Tensor):
        raise ConfigError(f"{where} must be a torch.Tensor, got {type(view).__name__}")
    if view.device.type != "cpu":
        raise ConfigError(
            f"{where} is on {view.device}; addresses are for CPU KV caches (a CUDA cache "
            "goes through tensor views)"
        )
    if view.dim() < 1 or view.shape[0] != blocks:
        raise ConfigError(
            f"{where} has shape {tuple(view.shape)}; expected {blocks} blocks in dimension 0"
        )
    first = view[0]
    if not first.is_contiguous() or first.nbytes != size:
        raise ConfigError(
            f"{where} (shape {tuple(view.shape)}, strides {view.stride()}, {view.dtype}) does "
            f"not keep one block in {size} contiguous bytes"
        )
    stride = view.stride(0) * view.element_size()
    if blocks > 1 and stride < size:
        raise ConfigError(
            f"{where}: blocks are {stride} bytes apart but each holds {size} bytes, so they "
            "overlap; UCM needs one block's bytes apart from every other's"
        )
    base = view.data_ptr()
    storage = view.untyped_storage()
    start = storage.data_ptr()
    end = start + storage.nbytes()
    last = base + (blocks - 1) * stride + size
    if base < max(start, ADDRESS_MIN) or last > end:
        raise ConfigError(
            f"{where}: blocks span [{base:#x}, {last:#x}) but the tensor's memory is "
            f"[{start:#x}, {end:#x})"
        )
    return base, stride


def block_view(kv: torch.Tensor, blocks: int, nbytes: int, where: str) -> torch.Tensor:
    """``kv`` ([blocks, ...]) with its per-block dimensions in memory order, so that
    ``view[b]`` is block b of the layer as one contiguous tensor of ``nbytes`` bytes (``where``
    names the tensor in errors)."""
    if kv.dim() < 2 or kv.shape[0] != blocks:
        raise ConfigError(
            f"{where} has shape {tuple(kv.shape)}; UCM expects {blocks} blocks in dimension 0"
        )
    inner = sorted(range(1, kv.dim()), key=lambda d: kv.stride(d), reverse=True)
    view = kv.permute(0, *inner)
    block = view[0]
    if not block.is_contiguous() or block.nbytes != nbytes:
        raise ConfigError(
            f"{where} (shape {tuple(kv.shape)}, strides {kv.stride()}, {kv.dtype}) does not "
            f"keep one block in {nbytes} contiguous bytes, which UCM's shard layout needs; use "
            "a block-contiguous KV cache layout (VLLM_KV_CACHE_LAYOUT, e.g. LBHNC)"
        )
    return view
