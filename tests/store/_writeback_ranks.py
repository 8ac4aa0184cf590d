"""A rank process driven over a pipe, for the write-back tests (spawned: importable).

The parent sends commands; the rank answers each one on the same pipe:

- ``("dump", blocks, shard)``: dumps ``payload(block(b), shard)`` for each b, waits for the
  task, answers ``("acked", blocks)`` (the task succeeded: the dump is acknowledged);
- ``("load", blocks, shard)``: loads them, answers ``("loaded", byte_exact)``;
- ``("hold", blocks, shard)``: takes this process's reference on each key's slot straight
  from the buffer core (as a rank reading it would) and keeps it, answers ``("held", results)``
  (the :class:`~ucm.native.buffer.GetResult` codes);
- ``("release",)``: gives back every reference ``hold`` took, answers ``("released", None)``;
- ``("stats",)``: answers ``("stats", {"store": store counters, "buffer": the buffer tier's})``;
- ``("close",)``: closes the store, answers ``("closed", error or None)`` and exits.

Any exception is answered as ``("error", repr)``.
"""

from __future__ import annotations

import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

import ucm

from .conftest import block, payload


def rank_main(config: dict[str, Any], device_id: int, ranks: int, conn: Connection) -> None:
    try:
        store = ucm.open(config, device_id=device_id, local_rank_size=ranks)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    shard_size = store.layout.shard_size
    conn.send(("ready", None))
    held: list[int] = []
    while True:
        command = conn.recv()
        try:
            if command[0] == "dump":
                _, numbers, shard = command
                blocks = [block(n) for n in numbers]
                src = [
                    [torch.frombuffer(bytearray(payload(b, shard, shard_size)), dtype=torch.uint8)]
                    for b in blocks
                ]
                store.wait(store.dump(blocks, shard, src))
                conn.send(("acked", numbers))
            elif command[0] == "load":
                _, numbers, shard = command
                blocks = [block(n) for n in numbers]
                dst = [[torch.zeros(shard_size, dtype=torch.uint8)] for _ in blocks]
                store.wait(store.load(blocks, shard, dst))
                exact = all(
                    d[0].numpy().tobytes() == payload(b, shard, shard_size)
                    for b, d in zip(blocks, dst, strict=True)
                )
                conn.send(("loaded", exact))
            elif command[0] == "hold":
                _, numbers, shard = command
                assert store.buffer is not None
                got = store.buffer.core.get([(block(n), shard) for n in numbers])
                held.extend(got.held_slots())
                conn.send(("held", list(got.results)))
            elif command[0] == "release":
                assert store.buffer is not None
                store.buffer.core.release(held)
                held.clear()
                conn.send(("released", None))
            elif command[0] == "stats":
                stats = store.stats()
                counters = {k: v for k, v in stats.items() if k != "tiers"}
                conn.send(("stats", {"store": counters, "buffer": stats["tiers"][0]}))
            elif command[0] == "close":
                try:
                    store.close()
                except Exception as exc:
                    conn.send(("closed", repr(exc)))
                else:
                    conn.send(("closed", None))
                return
            else:
                conn.send(("error", f"unknown command {command!r}"))
        except Exception:
            conn.send(("error", traceback.format_exc()))
