"""A rank process for the purge-finality tests (spawned: importable). It dumps blocks of two
namespaces into a stack whose write-through tier holds its writes at a gate file, reports,
then, once told, waits for its write-through backlog and reports its counters."""

from __future__ import annotations

import traceback
from typing import Any

import torch

import ucm

from . import _tiers

SHARD = 4096
REPLY_TIMEOUT_S = 120.0


def rank(config: dict[str, Any], plan: dict[str, Any], conn: Any) -> None:
    _tiers.register()  # the test tiers exist in this process too
    try:
        with ucm.open(config, device_id=0, local_rank_size=1) as store:
            for namespace, hexes in plan["dumps"]:
                blocks = [bytes.fromhex(h) for h in hexes]
                for shard in range(config["shards_per_block"]):
                    src = [
                        [
                            torch.frombuffer(
                                bytearray(_tiers.payload(b, shard, SHARD)), dtype=torch.uint8
                            )
                        ]
                        for b in blocks
                    ]
                    store.wait(store.dump(blocks, shard, src, namespace=namespace))
            conn.send(("dumped", None))
            assert conn.poll(REPLY_TIMEOUT_S), "the test never said go"
            assert conn.recv() == "go"
            store.drain()  # the write-through backlog has landed (the gate is open)
            stats = store.stats()
            conn.send(
                (
                    "drained",
                    {
                        name: stats.get(name)
                        for name in (
                            "write_through_shards",
                            "write_through_failures",
                            "writes_retracted",
                            "retract_failures",
                        )
                    },
                )
            )
    except BaseException:
        conn.send(("error", traceback.format_exc()))
