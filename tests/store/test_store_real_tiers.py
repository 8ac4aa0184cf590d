"""The Store over the built-in lower tiers (no buffer): byte-exact round trips for each shard
layout, and a block dumped by one process loaded by another through a shared tier."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import ucm

from .conftest import block, payload

LAYOUTS = {
    "one tensor": {"shard_size": 8192},
    "K and V": {"tensor_size_list": [4096, 4096]},
    "layer plus chunk": {"tensor_size_list": [1024] * 8},
    "different sizes": {"tensor_size_list": [4000, 4096, 96]},
}


def tier_for(kind: str, tmp_path: Path) -> dict[str, Any]:
    if kind == "posix":
        return {"type": "posix", "path": str(tmp_path / "nvme")}
    if kind == "fsspec-file":
        return {"type": "fsspec", "url": f"file://{tmp_path / 'fs'}"}
    return {"type": "fsspec", "url": f"memory://ucm-test-{uuid.uuid4().hex}"}


def split(data: bytes, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    out, offset = [], 0
    for n in sizes:
        out.append(torch.frombuffer(bytearray(data[offset : offset + n]), dtype=torch.uint8))
        offset += n
    return out


@pytest.mark.parametrize("kind", ["posix", "fsspec-file", "fsspec-memory"])
@pytest.mark.parametrize("geometry", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_dump_load_byte_exact(tmp_path: Path, kind: str, geometry: dict[str, Any]) -> None:
    config = {
        "unique_id": "rt",
        "shards_per_block": 4,
        **geometry,
        "tiers": [tier_for(kind, tmp_path)],
    }
    with ucm.open(config) as store:
        sizes, size = store.layout.tensor_sizes, store.layout.shard_size
        blocks = [block(i) for i in range(5)]
        shards = [0, 1, 2, 3, 1]
        src = [split(payload(b, s, size), sizes) for b, s in zip(blocks, shards, strict=True)]
        store.wait(store.dump(blocks, shards, src))
        dst = [[torch.zeros(n, dtype=torch.uint8) for n in sizes] for _ in blocks]
        store.wait(store.load(blocks, shards, dst))
        for b, s, tensors in zip(blocks, shards, dst, strict=True):
            assert b"".join(t.numpy().tobytes() for t in tensors) == payload(b, s, size)
        assert store.lookup(blocks) == [False] * 5  # only one shard of each block
        assert store.remove(blocks) == 5


CHILD = """
import sys, torch, ucm
config = {"unique_id": "other-node", "shard_size": 64, "shards_per_block": 2,
          "tiers": [{"type": "posix", "path": sys.argv[1]}]}
with ucm.open(config) as store:
    ids = [bytes([i]) * 16 for i in range(3)]
    for shard in (0, 1):
        src = [[torch.full((64,), i * 2 + shard, dtype=torch.uint8)] for i in range(3)]
        store.wait(store.dump(ids, shard, src))
"""


def test_a_block_dumped_by_another_process_is_loaded_here(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "nvme")], check=True, timeout=60)
    config = {
        "unique_id": "this-node",
        "shard_size": 64,
        "shards_per_block": 2,
        "tiers": [{"type": "posix", "path": str(tmp_path / "nvme")}],
    }
    with ucm.open(config) as store:
        ids = [bytes([i]) * 16 for i in range(3)]
        assert store.lookup(ids) == [True] * 3
        assert store.lookup_on_prefix([*ids, block(99)]) == 2
        dst = [[torch.zeros(64, dtype=torch.uint8)] for _ in ids]
        store.wait(store.load(ids, 1, dst))
        assert [int(d[0][0]) for d in dst] == [1, 3, 5]


def test_posix_eviction_keeps_a_block_its_failing_write_back_tier_could_not_take(
    tmp_path: Path,
) -> None:
    """Eviction never drops the only copy, on the real tiers: posix over capacity hands its
    victims to a `write: back` fsspec tier that fails every write (its root is a file), keeps
    them all, and every block still loads byte-exact; once the tier below works, an eviction
    pass writes them down and drops them."""
    below = tmp_path / "below"
    below.write_text("a file where the tier expects a directory: every write fails")
    config = {
        "unique_id": f"rt-{uuid.uuid4().hex[:8]}",
        "shard_size": 4096,
        "shards_per_block": 1,
        "tiers": [
            {"type": "posix", "path": str(tmp_path / "nvme"), "capacity": 3 * 4096},
            {"type": "fsspec", "url": f"file://{below}", "write": "back"},
        ],
    }
    blocks = [block(i) for i in range(8)]
    src = [[torch.frombuffer(bytearray(payload(b, 0, 4096)), dtype=torch.uint8)] for b in blocks]
    with ucm.open(config) as store:
        store.wait(store.dump(blocks, 0, src))
        posix = store.tiers[0]
        posix.evict_to_capacity()  # type: ignore[attr-defined]
        assert posix.lookup([(b, 0) for b in blocks]) == [True] * 8  # nothing dropped
        assert posix.stats()["evict_sink_failures"] > 0
        assert posix.stats()["evictions"] == 0
        dst = [[torch.zeros(4096, dtype=torch.uint8)] for _ in blocks]
        store.wait(store.load(blocks, 0, dst))
        assert [d[0].numpy().tobytes() for d in dst] == [payload(b, 0, 4096) for b in blocks]
        below.unlink()  # the tier below works again
        assert posix.evict_to_capacity() > 0  # type: ignore[attr-defined]
        gone = [
            b
            for b, here in zip(blocks, posix.lookup([(b, 0) for b in blocks]), strict=True)
            if not here
        ]
        assert gone
        assert store.tiers[1].lookup([(b, 0) for b in gone]) == [True] * len(gone)


def _nice_of_calling_thread() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_write_through_to_posix_runs_on_one_low_priority_thread(tmp_path: Path) -> None:
    """Writing through is work nobody waits for: the posix tier writes it on the write-through
    thread itself, at nice 19, never on its I/O pool (whose threads also serve the loads an
    engine waits for), and every byte lands."""
    posix = {"type": "posix", "path": str(tmp_path / "nvme"), "io_threads": 4}
    config = {
        "unique_id": f"rt-wt-{uuid.uuid4().hex[:8]}",
        "shard_size": 4096,
        "shards_per_block": 2,
        "tiers": [{"type": "buffer", "capacity": 64 * 4096}, {**posix, "write": "through"}],
    }
    blocks = [block(i) for i in range(8)]  # eight files: eight groups the pool would share
    src = [[torch.frombuffer(bytearray(payload(b, 1, 4096)), dtype=torch.uint8)] for b in blocks]
    writers: list[tuple[str, int]] = []
    with ucm.open(config) as store:
        tier = store.tiers[1]
        dump_block = tier._dump_block  # type: ignore[attr-defined]

        def recorded(*args: Any) -> int:
            writers.append((threading.current_thread().name, _nice_of_calling_thread()))
            return dump_block(*args)

        tier._dump_block = recorded  # type: ignore[attr-defined]
        store.wait(store.dump(blocks, 1, src))
    assert store.stats()["write_through_shards"] == 8  # close waited for the backlog
    assert writers == [("ucm-write-through", 19)] * 8
    with ucm.open({**config, "unique_id": f"{config['unique_id']}-r", "tiers": [posix]}) as store:
        dst = [[torch.zeros(4096, dtype=torch.uint8)] for _ in blocks]
        store.wait(store.load(blocks, 1, dst))
        assert [d[0].numpy().tobytes() for d in dst] == [payload(b, 1, 4096) for b in blocks]
