"""A CPU implementation of LMCache's ``GPUConnectorInterface``, for tests and benchmarks of the
LMCache integration (``ucm.integration.lmcache``) on machines without a GPU.

LMCacheEngine moves KV between the serving engine's paged KV cache and its MemoryObjs through a
GPU connector; LMCache's own connectors need CUDA (or another accelerator) kernels. This one does
the same copies with torch on host tensors, over a vLLM-style paged cache: ``kvcaches`` is a
list with one tensor ``[2, num_slots, hidden_dim]`` per layer (K and V), and ``slot_mapping`` maps
token ``t`` of the sequence to its slot. MemoryObjs are in LMCache's ``KV_2LTD`` format,
``[2, num_layers, tokens, hidden_dim]``. Both arrive as keyword arguments of
``LMCacheEngine.store`` / ``retrieve``, as LMCache's own connectors get them.
"""

from __future__ import annotations

from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj


class CpuKVConnector(GPUConnectorInterface):  # type: ignore[misc]
    """Copies KV between a paged host KV cache and LMCache MemoryObjs (``KV_2LTD``)."""

    def __init__(self, num_layers: int, hidden_dim: int) -> None:
        if num_layers < 1 or hidden_dim < 1:
            raise ValueError(
                f"num_layers and hidden_dim must be >= 1, got {num_layers} and {hidden_dim}"
            )
        self.num_layers = num_layers
        self.hidden_dim = hidden_dim

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim])

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        chunk, caches, slots = self._operands(memory_obj, start, end, kwargs)
        for layer, cache in enumerate(caches):
            chunk[:, layer].copy_(cache.index_select(1, slots))

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        chunk, caches, slots = self._operands(memory_obj, start, end, kwargs)
        for layer, cache in enumerate(caches):
            cache.index_copy_(1, slots, chunk[:, layer])

    def batched_from_gpu(
        self,
        memory_objs: list[MemoryObj],
        starts: list[int],
        ends: list[int],
        **kwargs: Any,
    ) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(
        self,
        memory_objs: list[MemoryObj] | None = None,
        starts: list[int] | None = None,
        ends: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        if memory_objs is None or starts is None or ends is None:
            raise ValueError("batched_to_gpu needs memory_objs, starts and ends")
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)

    def _operands(
        self, memory_obj: MemoryObj, start: int, end: int, kwargs: dict[str, Any]
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        try:
            caches: list[torch.Tensor] = list(kwargs["kvcaches"])
            slot_mapping: torch.Tensor = kwargs["slot_mapping"]
        except KeyError as exc:
            raise ValueError(
                f"CpuKVConnector needs kvcaches= and slot_mapping= keyword arguments, "
                f"missing {exc.args[0]!r}"
            ) from None
        if len(caches) != self.num_layers:
            raise ValueError(f"kvcaches has {len(caches)} layers, expected {self.num_layers}")
        if memory_obj.meta.fmt != MemoryFormat.KV_2LTD:
            fmt = memory_obj.meta.fmt
            raise ValueError(f"CpuKVConnector handles KV_2LTD MemoryObjs, not {fmt}")
        chunk = memory_obj.tensor
        expected = self.get_shape(end - start)
        if chunk is None or chunk.shape != expected:
            shape = None if chunk is None else list(chunk.shape)
            raise ValueError(f"MemoryObj shape {shape} does not match {list(expected)}")
        slots = slot_mapping[start:end].to(dtype=torch.long)
        return chunk, caches, slots


__all__ = ["CpuKVConnector"]
