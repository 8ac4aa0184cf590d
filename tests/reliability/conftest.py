"""Shared helpers of the reliability suite: buffer stacks with unique segment names (removed
afterwards) and payloads whose bytes name their key."""

from __future__ import annotations

import ctypes
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.soak import block_id_of, encode_payload
from ucm.native import segments

SHARD = 4096
GENERATION = 7


@pytest.fixture
def unique_id() -> Iterator[str]:
    name = f"rel-{uuid.uuid4().hex[:12]}"
    yield name
    segments.unlink(name)


def buffer_stack(
    unique_id: str, nvme: Path, slots: int = 32, shards: int = 2, **buffer: Any
) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": shards,
        "tiers": [
            {"type": "buffer", "capacity": slots * SHARD, **buffer},
            {"type": "posix", "path": str(nvme)},
        ],
    }


def blocks(count: int, prefix: bytes = b"rel") -> list[bytes]:
    return [block_id_of(prefix, i) for i in range(count)]


def payload(block_id: bytes, shard: int) -> bytes:
    return encode_payload((block_id, shard), GENERATION, SHARD)


class Shards:
    """ctypes buffers for load_data/dump_data, one shard each (no torch needed)."""

    def __init__(self, count: int) -> None:
        self.memory = [ctypes.create_string_buffer(SHARD) for _ in range(count)]

    def fill(self, block_ids: list[bytes], shard: int) -> None:
        for block_id, buffer in zip(block_ids, self.memory, strict=False):
            ctypes.memmove(buffer, payload(block_id, shard), SHARD)

    def poison(self) -> None:
        for buffer in self.memory:
            ctypes.memset(buffer, 0xA5, SHARD)

    def pointers(self, count: int) -> list[list[int]]:
        return [[ctypes.addressof(buffer)] for buffer in self.memory[:count]]

    def data(self, index: int) -> bytes:
        return self.memory[index].raw
