"""Shard geometry and keys.

A key is ``(block_id, shard_index)``: a 16-byte block id and 0 <= shard_index < shards_per_block.
A shard is ``shard_size`` bytes, the concatenation of ``tensor_sizes`` when it spans tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_ID_BYTES = 16

Key = tuple[bytes, int]


@dataclass(frozen=True)
class Layout:
    shard_size: int
    shards_per_block: int
    tensor_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.shard_size > 0
        assert self.shards_per_block > 0
        assert sum(self.tensor_sizes) == self.shard_size

    @property
    def block_size(self) -> int:
        return self.shard_size * self.shards_per_block

    def shard_offset(self, shard_index: int) -> int:
        """Byte offset of a shard inside a block-sized file or object."""
        assert 0 <= shard_index < self.shards_per_block
        return shard_index * self.shard_size

    def keys_of_blocks(self, block_ids: list[bytes]) -> list[Key]:
        """Every key of every block, block-major."""
        return [(b, s) for b in block_ids for s in range(self.shards_per_block)]
