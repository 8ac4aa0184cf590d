"""Functions run in child processes (spawned, so they must be importable)."""

from __future__ import annotations

from typing import Any

from ucm.layout import Layout
from ucm.testing import make_context
from ucm.testing.conformance import shard_bytes, split


def write_shard_rounds(
    path: str, layout: Layout, blocks: list[bytes], shard: int, rounds: int, barrier: Any
) -> None:
    """Dumps ``shard`` of every block ``rounds`` times (salt = round), all rounds in step with
    the other writer through ``barrier``."""
    from ucm_backends.posix import PosixConfig, PosixTier

    tier = PosixTier(
        PosixConfig(path=path, io_threads=2), make_context(layout, unique_id=f"node{shard}")
    )
    try:
        for salt in range(rounds):
            barrier.wait(timeout=60)
            keys = [(block, shard) for block in blocks]
            sources = [split(shard_bytes(k, layout, salt), layout) for k in keys]
            outcomes = tier.dump(keys, sources)
            assert outcomes == [None] * len(keys), outcomes
    finally:
        tier.close()


def dump_to_fsspec(url: str, options: dict[str, Any], layout: Layout, blocks: list[bytes]) -> None:
    """Another "node" (its own unique_id, its own process) dumps every shard of ``blocks``."""
    from ucm_backends.fsspec_tier import FsspecConfig, FsspecTier

    tier = FsspecTier(
        FsspecConfig(url=url, storage_options=options),
        make_context(layout, unique_id="other-node"),
    )
    try:
        keys = layout.keys_of_blocks(blocks)
        outcomes = tier.dump(keys, [split(shard_bytes(k, layout), layout) for k in keys])
        assert outcomes == [None] * len(keys), outcomes
    finally:
        tier.close()
