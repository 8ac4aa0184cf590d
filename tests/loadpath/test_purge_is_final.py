"""A purge or a forced remove is final (docs/reliability.md, "A purge or a forced remove is
final"): a write to a lower tier already in flight when ``Store.purge`` or
``Store.remove(force=True)`` returns must not bring the removed blocks back once it lands,
whichever path writes (admission, write-through) and whichever process purges (``ucm
purge`` included). Writes are held at gates (an event in-process, a file across processes),
so the order of events is what the test says, never a matter of timing. A write of a key
that no removal covered is never taken back."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import ucm
from ucm import namespaces

from . import _purge_rank
from ._tiers import ENTERED, GATES, block, payload, wait_for_file
from .test_loadqueue import BOUND_S, SHARD

SHARDS = 1
BLOCKS = 4
NS = "tenant-a"
OTHER = "tenant-b"


def _below(tmp_path: Path, namespace: str, blocks: list[bytes]) -> dict[int, bytes | None]:
    """Per (block number, shard) flattened index: the bytes the posix directory holds, read
    back through a posix-only store (None: absent)."""
    config = {
        "unique_id": f"po-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": SHARDS,
        "tiers": [{"type": "posix", "path": str(tmp_path / "nvme")}],
    }
    held: dict[int, bytes | None] = {}
    with ucm.open(config, namespace=namespace) as store:
        tier = store.tiers[0]
        for i, b in enumerate(blocks):
            for shard in range(SHARDS):
                index = i * SHARDS + shard
                if not tier.lookup([(namespaces.scope(namespace, [b])[0], shard)])[0]:
                    held[index] = None
                    continue
                dst = [[torch.zeros(SHARD, dtype=torch.uint8)]]
                store.wait(store.load([b], shard, dst), timeout_s=BOUND_S)
                held[index] = dst[0][0].numpy().tobytes()
    return held


def _exact(blocks: list[bytes]) -> dict[int, bytes | None]:
    return {
        i * SHARDS + shard: payload(b, shard, SHARD)
        for i, b in enumerate(blocks)
        for shard in range(SHARDS)
    }


def _absent(blocks: list[bytes]) -> dict[int, bytes | None]:
    return {i * SHARDS + shard: None for i in range(len(blocks)) for shard in range(SHARDS)}


def _admission_stack(unique_id: str, tmp_path: Path) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": SHARDS,
        "tiers": [
            {"type": "buffer", "capacity": 64 * SHARD, "flush_interval_s": 3600},
            {
                "type": "slowposix",
                "path": str(tmp_path / "nvme"),
                "write": "through",
                "admit": {"after_reuse": 1},
                "dump_gate": "nvme",
            },
        ],
    }


def _dump_and_reuse(store: ucm.Store, blocks: list[bytes], namespace: str) -> None:
    """Dumps every shard of the blocks, then loads them once (a hit each: one reuse), so that
    the admission thread writes them to the gated tier."""
    for shard in range(SHARDS):
        src = [
            [torch.frombuffer(bytearray(payload(b, shard, SHARD)), dtype=torch.uint8)]
            for b in blocks
        ]
        store.wait(store.dump(blocks, shard, src, namespace=namespace), timeout_s=BOUND_S)
    for shard in range(SHARDS):
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
        store.wait(store.load(blocks, shard, dst, namespace=namespace), timeout_s=BOUND_S)


def _wait_admitted(store: ucm.Store, shards: int) -> None:
    """Bounded wait until the admission thread has written ``shards`` shards (its counter)."""
    deadline = time.monotonic() + BOUND_S
    while store.stats()["admitted_shards"] < shards:
        assert time.monotonic() < deadline, f"admission wrote {store.stats()['admitted_shards']}"
        time.sleep(0.01)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["purge", "remove"])
def test_an_admission_write_in_flight_never_brings_purged_blocks_back(
    test_tiers: None, unique_id: str, tmp_path: Path, how: str
) -> None:
    """The admission thread's write of the blocks is held at the tier's gate while
    ``purge(ns)`` (or ``remove(ids, force=True)``) runs and returns; the write then lands. No
    purged block may be readable from any tier afterwards (before the fix, every one came
    back on the gated tier). Blocks of another namespace admitted behind the held write keep
    their bytes, exactly."""
    gate = GATES.setdefault("nvme", threading.Event())
    gate.clear()
    purged = [block(100 + n) for n in range(BLOCKS)]
    kept = [block(200 + n) for n in range(BLOCKS)]
    with ucm.open(_admission_stack(unique_id, tmp_path), namespace=NS) as store:
        try:
            _dump_and_reuse(store, purged, NS)
            assert ENTERED.setdefault("nvme", threading.Event()).wait(BOUND_S), "no admission"
            if how == "purge":
                removed = store.purge(NS)
                assert removed[0] == BLOCKS * SHARDS  # the buffer's copies
            else:
                assert store.remove(purged, force=True) == BLOCKS * SHARDS
            assert store.lookup(purged) == [False] * BLOCKS
            _dump_and_reuse(store, kept, OTHER)  # admitted behind the held write
            gate.set()  # the admission write lands now, after the purge returned
            _wait_admitted(store, 2 * BLOCKS * SHARDS)
            store.drain()
            assert store.lookup(purged) == [False] * BLOCKS
            assert store.lookup(kept, namespace=OTHER) == [True] * BLOCKS
            counters = {
                name: store.stats().get(name) for name in ("writes_retracted", "retract_failures")
            }
        finally:
            gate.set()
    assert _below(tmp_path, NS, purged) == _absent(purged)
    assert _below(tmp_path, OTHER, kept) == _exact(kept)
    assert counters == {"writes_retracted": BLOCKS * SHARDS, "retract_failures": 0}


def _rank_stack(unique_id: str, tmp_path: Path) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": SHARDS,
        "tiers": [
            {"type": "buffer", "capacity": 64 * SHARD, "flush_interval_s": 3600},
            {
                "type": "slowposix",
                "path": str(tmp_path / "nvme"),
                "write": "through",
                "dump_gate_file": str(tmp_path / "gate"),
            },
        ],
    }


@pytest.mark.timeout(300)
def test_ucm_purge_reaches_another_processs_write_through_backlog(
    test_tiers: None, unique_id: str, tmp_path: Path
) -> None:
    """A rank process's write-through backlog (namespace ``tenant-a``, then ``tenant-b``)
    is held at a gate file; the real ``ucm purge STACK tenant-a`` runs in a process of its own
    and returns; the gate opens and the rank's writes land. Then no tenant-a block is on the
    lower tier (before the fix, every one was), and every tenant-b block is, byte-exact: its
    write spanned the purge and no removal covered it."""
    purged = [block(300 + n) for n in range(BLOCKS)]
    kept = [block(400 + n) for n in range(BLOCKS)]
    plan = {"dumps": [(NS, [b.hex() for b in purged]), (OTHER, [b.hex() for b in kept])]}
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(
        target=_purge_rank.rank, args=(_rank_stack(unique_id, tmp_path), plan, child)
    )
    process.start()
    try:
        assert parent.poll(BOUND_S), "the rank never dumped"
        kind, value = parent.recv()
        assert kind == "dumped", value
        wait_for_file(str(tmp_path / "gate.entered"))  # its first write is held
        # The CLI's stack: the same buffer (attached live) and the same directory, as posix.
        cli_stack = {
            "unique_id": unique_id,
            "tiers": [
                {"type": "buffer", "capacity": 64 * SHARD},
                {"type": "posix", "path": str(tmp_path / "nvme"), "write": "through"},
            ],
        }
        path = tmp_path / "stack.yaml"
        path.write_text(yaml.safe_dump(cli_stack))
        purge = subprocess.run(
            [sys.executable, "-m", "ucm.cli", "purge", str(path), NS],
            capture_output=True,
            text=True,
            timeout=BOUND_S,
            env=os.environ.copy(),
        )
        assert purge.returncode == 0, purge.stderr
        assert f"purged namespace {NS!r}" in purge.stdout
        (tmp_path / "gate").touch()  # the rank's writes land now, after the purge returned
        parent.send("go")
        assert parent.poll(BOUND_S), "the rank never drained its backlog"
        kind, counters = parent.recv()
        assert kind == "drained", counters
        process.join(BOUND_S)
        assert process.exitcode == 0
    finally:
        (tmp_path / "gate").touch()
        if process.is_alive():
            process.kill()
            process.join(BOUND_S)
    assert _below(tmp_path, NS, purged) == _absent(purged)
    assert _below(tmp_path, OTHER, kept) == _exact(kept)
    assert counters == {
        "write_through_shards": 2 * BLOCKS * SHARDS,
        "write_through_failures": 0,
        "writes_retracted": BLOCKS * SHARDS,
        "retract_failures": 0,
    }


def _no_buffer_stack(unique_id: str, tmp_path: Path) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": SHARDS,
        "tiers": [{"type": "slowposix", "path": str(tmp_path / "nvme"), "dump_gate": "nvme"}],
    }


@pytest.mark.timeout(300)
def test_a_dump_into_a_top_tier_without_a_buffer_is_taken_back_by_a_purge_in_the_process(
    test_tiers: None, unique_id: str, tmp_path: Path
) -> None:
    """Without a buffer the log is the process's own: a dump into the posix top tier, held at
    its gate, lands after another store of the process purged the namespace, and is removed
    again once it has landed (before the fix, every block stayed)."""
    gate = GATES.setdefault("nvme", threading.Event())
    gate.clear()
    purged = [block(500 + n) for n in range(BLOCKS)]
    config = _no_buffer_stack(unique_id, tmp_path)
    with ucm.open(config, namespace=NS) as writer, ucm.open(config, namespace=NS) as purger:
        try:
            src = [
                [torch.frombuffer(bytearray(payload(b, 0, SHARD)), dtype=torch.uint8)]
                for b in purged
            ]
            task = writer.dump(purged, 0, src)
            assert ENTERED.setdefault("nvme", threading.Event()).wait(BOUND_S), "no dump"
            assert purger.purge(NS) == [0]  # nothing landed yet
            gate.set()  # the dump lands now, after the purge returned
            writer.wait(task, timeout_s=BOUND_S)
            assert writer.lookup(purged) == [False] * BLOCKS
            counters = {
                name: writer.stats().get(name) for name in ("writes_retracted", "retract_failures")
            }
        finally:
            gate.set()
    assert _below(tmp_path, NS, purged) == _absent(purged)
    assert counters == {"writes_retracted": BLOCKS * SHARDS, "retract_failures": 0}
