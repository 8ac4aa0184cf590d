"""Stacks, payloads and rank-process entry points for the cascade tests (spawned processes
import this module, so it must stay importable and cheap: no torch, raw addresses instead)."""

from __future__ import annotations

import ctypes
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import ucm
from ucm.layout import Layout
from ucm.testing.conformance import shard_bytes

SHARD = 4096
SHARDS = 4
LAYOUT = Layout(shard_size=SHARD, shards_per_block=SHARDS, tensor_sizes=(SHARD,))
BLOCK_FILE_BYTES = SHARD * SHARDS + 4096
"""A full posix block file on disk: the shards plus the 4 KiB footer region."""
QUEUE_TIMEOUT_S = 120.0


def stack(
    unique_id: str,
    posix_dir: str,
    s3_url: str,
    s3_options: dict[str, Any],
    *,
    buffer_slots: int = 64,
    posix: dict[str, Any] | None = None,
    s3: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``buffer → posix → fsspec s3://``: write-through to both lower tiers unless overridden."""
    return {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": SHARDS,
        "tiers": [
            {"type": "buffer", "capacity": buffer_slots * SHARD},
            {"type": "posix", "path": posix_dir, "io_threads": 2, **(posix or {})},
            {
                "type": "fsspec",
                "url": s3_url,
                "storage_options": s3_options,
                "io_threads": 4,
                **(s3 or {}),
            },
        ],
    }


def payload(block_id: bytes, shard: int) -> bytes:
    return shard_bytes((block_id, shard), LAYOUT)


def _address(buffer: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))


def dump(store: Any, blocks: Sequence[bytes], shards: Sequence[int] = range(SHARDS)) -> None:
    """Dumps the given shards of every block (one task per shard index) and waits."""
    for shard in shards:
        sources = [bytearray(payload(b, shard)) for b in blocks]
        store.wait(
            store.dump_data(list(blocks), [shard] * len(blocks), [[_address(s)] for s in sources])
        )


def load(
    store: Any, blocks: Sequence[bytes], shards: Sequence[int] = range(SHARDS)
) -> dict[tuple[bytes, int], bytes]:
    """Loads the given shards of every block; returns the bytes of each key."""
    got: dict[tuple[bytes, int], bytes] = {}
    for shard in shards:
        targets = [bytearray(SHARD) for _ in blocks]
        store.wait(
            store.load_data(list(blocks), [shard] * len(blocks), [[_address(t)] for t in targets])
        )
        for block_id, target in zip(blocks, targets, strict=True):
            got[(block_id, shard)] = bytes(target)
    return got


def wrong_keys(got: dict[tuple[bytes, int], bytes]) -> list[str]:
    """Keys whose bytes differ from their payload (empty when everything is byte-exact)."""
    return [f"{b.hex()}/{s}" for (b, s), data in got.items() if data != payload(b, s)]


def drain(store: Any, timeout_s: float = 60.0) -> None:
    """Waits until the store's write-through queue is empty (bounded)."""
    deadline = time.monotonic() + timeout_s
    while store.stats()["write_queue_bytes"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"write-through still pending after {timeout_s}s")
        time.sleep(0.01)


def tier_stats(store: Any, position: int) -> dict[str, Any]:
    stats: dict[str, Any] = store.stats()["tiers"][position]
    return stats


@contextmanager
def reporting(out: Any, device_id: int) -> Iterator[dict[str, Any]]:
    """Puts ``(device_id, report)`` on ``out``; a failure is reported, not lost in stderr."""
    report: dict[str, Any] = {}
    try:
        yield report
    except BaseException:
        report["error"] = traceback.format_exc()
        raise
    finally:
        out.put((device_id, report), timeout=QUEUE_TIMEOUT_S)


# ---- rank-process entry points -----------------------------------------------------------


def rank_dump(
    config: dict[str, Any],
    device_id: int,
    local_rank_size: int,
    blocks: list[bytes],
    barrier: Any,
    out: Any,
) -> None:
    """One rank of a node: dumps its share of the shards (index % ranks == device_id), waits for
    the other ranks, then closes (which finishes write-through)."""
    with reporting(out, device_id) as report:
        store = ucm.open(config, device_id=device_id, local_rank_size=local_rank_size)
        try:
            dump(store, blocks, range(device_id, SHARDS, local_rank_size))
            barrier.wait(timeout=QUEUE_TIMEOUT_S)
            report["dumped"] = store.stats()["dumped_shards"]
        finally:
            store.close()


def rank_load(
    config: dict[str, Any],
    device_id: int,
    local_rank_size: int,
    blocks: list[bytes],
    barrier: Any,
    out: Any,
) -> None:
    """One rank of a node: loads every shard of the blocks and checks the bytes."""
    with reporting(out, device_id) as report:
        store = ucm.open(config, device_id=device_id, local_rank_size=local_rank_size)
        try:
            barrier.wait(timeout=QUEUE_TIMEOUT_S)  # both ranks attached: they race for owners
            report["wrong"] = wrong_keys(load(store, blocks))
            report["loaded"] = store.stats()["loaded_shards"]
            report["s3_hits"] = tier_stats(store, 2)["hits"]
            report["posix_hits"] = tier_stats(store, 1)["hits"]
        finally:
            store.close()


def node_dump_and_close(
    config: dict[str, Any], blocks: list[bytes], barrier: Any, out: Any
) -> None:
    """A one-rank node: dumps every shard, records what write-through still had pending when
    the dumps were acknowledged, then closes and exits."""
    with reporting(out, 0) as report:
        store = ucm.open(config)
        try:
            dump(store, blocks)
            report["pending_bytes_at_close"] = store.stats()["write_queue_bytes"]
        finally:
            store.close()
        report["closed"] = True
