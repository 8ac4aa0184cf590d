"""A rank process for the quota tests (spawned: importable): opens the stack and dumps random
blocks of two namespaces forever, until it is killed."""

from __future__ import annotations

import ctypes
import random
import traceback
from multiprocessing.connection import Connection
from typing import Any

import ucm


def insert_forever(
    config: dict[str, Any], device_id: int, ranks: int, seed: int, conn: Connection
) -> None:
    try:
        store = ucm.open(config, device_id=device_id, local_rank_size=ranks)
        source = (ctypes.c_ubyte * store.layout.shard_size)()
        address = ctypes.addressof(source)
        rng = random.Random(seed)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("inserting", None))
    while True:
        namespace = "tenant-a" if rng.random() < 0.5 else "tenant-b"
        blocks = list(
            dict.fromkeys(
                rng.randrange(300).to_bytes(16, "big") for _ in range(rng.randrange(1, 9))
            )
        )
        shard = rng.randrange(store.layout.shards_per_block)
        try:
            task = store.dump_data(blocks, shard, [[address]] * len(blocks), namespace=namespace)
            store.wait(task)
        except ucm.TaskError:  # no slot: every one in flight
            pass
