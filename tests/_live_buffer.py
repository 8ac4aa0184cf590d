"""A live CacheBuffer held by a real worker process, for `ucm stats` and metrics tests.

The worker opens a buffer-over-posix stack as rank 0, dumps more shards than the buffer holds
(evictions), loads some back (hits), preallocates a few keys, prints its own view of the native
counters as one JSON line, then keeps the buffer alive until its stdin closes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SHARD = 4096
SLOTS = 8
RESERVED = 4
DUMPED = 12
LOADED = 5
PREALLOCATED = 2

WORKER = r"""
import json, sys
import torch
import ucm

stack, shard, dumped, loaded, preallocated = sys.argv[1], *map(int, sys.argv[2:6])
with ucm.open(stack, device_id=0, local_rank_size=1) as store:
    blocks = [i.to_bytes(16, "big") for i in range(dumped)]
    src = [[torch.full((shard,), i % 251, dtype=torch.uint8)] for i in range(dumped)]
    store.wait(store.dump(blocks, [0] * dumped, src))
    # The last shards dumped are resident; load the last `loaded` of them back (hits).
    tail = blocks[-loaded:]
    dst = [[torch.zeros(shard, dtype=torch.uint8)] for _ in tail]
    store.wait(store.load(tail, [0] * loaded, dst))
    assert all(d[0][0].item() == (dumped - loaded + i) % 251 for i, d in enumerate(dst))
    buffer = store.tiers[0]
    extra = [(i.to_bytes(16, "big"), 0) for i in range(1000, 1000 + preallocated)]
    assert [int(r) for r in buffer.core.prealloc(extra)] == [0] * preallocated
    resident = sum(buffer.lookup([(b, 0) for b in blocks]))
    print(json.dumps({"native": buffer.core.stats(), "resident": resident,
                      "store": {k: v for k, v in store.stats().items() if k != "tiers"}}),
          flush=True)
    sys.stdin.read()  # keep the buffer alive until the test closes our stdin
"""


@dataclass
class LiveBuffer:
    stack_path: Path
    unique_id: str
    pid: int
    """The worker's pid."""
    worker_view: dict[str, Any]
    """What the worker itself read: native counters, resident shard count, its Store counters."""


def stack_config(tmp_path: Path) -> dict[str, Any]:
    return {
        "unique_id": f"stats-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [
            {"type": "buffer", "capacity": SLOTS * SHARD, "reserved_slots": RESERVED},
            {"type": "posix", "path": str(tmp_path / "nvme")},
        ],
    }


@contextmanager
def live_buffer(tmp_path: Path) -> Iterator[LiveBuffer]:
    config = stack_config(tmp_path)
    stack_path = tmp_path / "stack.yaml"
    stack_path.write_text(yaml.safe_dump(config))
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            WORKER,
            str(stack_path),
            str(SHARD),
            str(DUMPED),
            str(LOADED),
            str(PREALLOCATED),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        line = worker.stdout.readline()  # bounded: the worker exits (EOF) if anything fails
        if not line:
            worker.wait(timeout=30)
            raise AssertionError(f"worker failed: {worker.stderr.read() if worker.stderr else ''}")
        yield LiveBuffer(stack_path, config["unique_id"], worker.pid, json.loads(line))
    finally:
        assert worker.stdin is not None
        worker.stdin.close()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(timeout=30)
        from ucm.native.segments import unlink

        unlink(config["unique_id"])
