"""A "node" for the Mooncake tests: a spawned process with its own store (own unique_id, own
CacheBuffer, own Mooncake client) that runs commands sent over a pipe, so a test can drive
several nodes against one master. Spawned processes import this module: keep it cheap (no
torch; shards move through raw addresses)."""

from __future__ import annotations

import ctypes
import traceback
from collections.abc import Sequence
from typing import Any

import ucm
from ucm.layout import Layout
from ucm.testing.conformance import shard_bytes

SHARD = 64 * 1024
SHARDS = 2
LAYOUT = Layout(shard_size=SHARD, shards_per_block=SHARDS, tensor_sizes=(SHARD,))


def stack(unique_id: str, tiers: list[dict[str, Any]], layout: Layout = LAYOUT) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "shard_size": layout.shard_size,
        "shards_per_block": layout.shards_per_block,
        "tiers": tiers,
    }


def payload(block_id: bytes, shard: int, layout: Layout = LAYOUT) -> bytes:
    return shard_bytes((block_id, shard), layout)


def _address(buffer: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))


def dump(store: Any, blocks: Sequence[bytes], layout: Layout = LAYOUT) -> None:
    """Every shard of the blocks (one task per shard index), then the write-through backlog."""
    for shard in range(layout.shards_per_block):
        sources = [bytearray(payload(b, shard, layout)) for b in blocks]
        task = store.dump_data(
            list(blocks), [shard] * len(blocks), [[_address(s)] for s in sources]
        )
        store.wait(task)
    store.drain()


def load(store: Any, blocks: Sequence[bytes], layout: Layout = LAYOUT) -> list[str]:
    """Loads every shard of the blocks; returns the keys whose bytes are wrong."""
    wrong = []
    for shard in range(layout.shards_per_block):
        targets = [bytearray(layout.shard_size) for _ in blocks]
        task = store.load_data(
            list(blocks), [shard] * len(blocks), [[_address(t)] for t in targets]
        )
        store.wait(task)
        wrong += [
            f"{b.hex()}/{shard}"
            for b, t in zip(blocks, targets, strict=True)
            if bytes(t) != payload(b, shard, layout)
        ]
    return wrong


def node_main(config: dict[str, Any], conn: Any) -> None:
    """Opens the store, then answers ``(command, args)`` with ``("ok", value)`` or
    ``("error", traceback)`` until ``exit`` (or until the parent goes away)."""
    store = ucm.open(config)
    conn.send(("ok", "ready"))
    while True:
        try:
            command, args = conn.recv()
        except EOFError:
            store.close()
            return
        try:
            if command == "exit":
                store.close()
                conn.send(("ok", None))
                return
            conn.send(("ok", _run(store, command, args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def _run(store: Any, command: str, args: tuple[Any, ...]) -> Any:
    if command == "dump":
        dump(store, args[0])
        return store.stats()
    if command == "load":
        return {"wrong": load(store, args[0]), "stats": store.stats()}
    if command == "lookup":
        return store.lookup(args[0])
    if command == "tier_lookup":  # (position, blocks): one tier's own answer
        return store.tiers[args[0]].lookup_blocks(args[1])
    if command == "stats":
        return store.stats()
    raise ValueError(f"unknown command {command!r}")
