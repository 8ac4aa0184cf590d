"""The two dump gaps docs/reliability.md listed as open (issue 21), each made to happen
deterministically with a real second process on the same buffer:

- a dump that meets another rank's fill of the same key, when that fill then ends Missing or
  Failed: the dump waits for the fill's outcome and then writes its own bytes;
- a dump whose bucket lock is held by a live process past the lock timeout: written straight
  to the ``write: back`` tier below, as a dump that found no free slot.

Both over ``buffer -> posix (write: back)``: before the fixes, the first dump's bytes ended in no
tier although ``wait`` returned, and the second failed with a TierError."""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

import ucm
from ucm.native.buffer import GetResult, State

from .conftest import SHARD, Shards, blocks, payload

CTX = multiprocessing.get_context("spawn")
REPLY_S = 120.0
"""Bound on one reply of the other process (a spawned interpreter on a busy machine)."""
LOCK_TIMEOUT_S = 10.0
"""The native bucket-lock timeout (constants.zig ``buffer_lock_timeout_ns``)."""


def write_back_stack(unique_id: str, nvme: Path, **buffer: Any) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [
            # No idle flush: the debt is written down by the last close, checked on posix.
            {"type": "buffer", "capacity": 32 * SHARD, "flush_interval_s": 3600, **buffer},
            {"type": "posix", "path": str(nvme), "write": "back"},
        ],
    }


def _other_rank(config: dict[str, Any], block_id: bytes, role: str, conn: Connection) -> None:
    """Rank 1: owns ``block_id``'s slot (``fill``) or holds its bucket lock (``lock``), says
    so, and ends it when told: commits the state it is sent, or drops the lock."""
    with ucm.open(config, device_id=1, local_rank_size=2) as store:
        assert store.buffer is not None
        core = store.buffer.core
        if role == "fill":
            got = core.get([(block_id, 0)])
            conn.send(("owning", int(got.results[0])))
            state = conn.recv()
            core.commit(got.slots, [State(state)])
            core.release(got.slots)
        else:
            bucket = core.bucket_of(block_id)
            core.debug_hold_lock(bucket)
            conn.send(("holding", bucket))
            conn.recv()
            core.debug_drop_lock(bucket)
        conn.send("done")
        conn.recv()  # close after the test's rank opened (the buffer stays alive)


def start_other(config: dict[str, Any], block_id: bytes, role: str) -> tuple[Any, Connection]:
    parent, child = CTX.Pipe()
    process = CTX.Process(target=_other_rank, args=(config, block_id, role, child), daemon=True)
    process.start()
    assert parent.poll(REPLY_S), "the other rank did not start"
    return process, parent


def on_posix(nvme: Path, ids: list[bytes]) -> list[bytes | None]:
    """Shard 0 of each block as the posix directory holds it, opened alone."""
    config = {
        "unique_id": "posix-only",
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [{"type": "posix", "path": str(nvme)}],
    }
    with ucm.open(config) as store:
        present = store.tiers[0].lookup([(b, 0) for b in ids])
        found = [b for b, hit in zip(ids, present, strict=True) if hit]
        shards = Shards(len(found))
        if found:
            store.wait(store.load_data(found, 0, shards.pointers(len(found))))
        data = dict(zip(found, (shards.data(i) for i in range(len(found))), strict=True))
    return [data.get(b) for b in ids]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ending", [State.MISSING, State.FAILED], ids=["missing", "failed"])
def test_a_dump_that_meets_a_fill_which_then_fails_writes_its_own_bytes(
    unique_id: str, tmp_path: Path, ending: State
) -> None:
    nvme = tmp_path / "nvme"
    config = write_back_stack(unique_id, nvme)
    (x,) = blocks(1, b"gap1")
    other, conn = start_other(config, x, "fill")
    try:
        assert conn.recv() == ("owning", GetResult.OWNER)  # rank 1 is filling x (Idle slot)
        with ucm.open(config, device_id=0, local_rank_size=2) as store:
            assert store.buffer is not None
            shards = Shards(1)
            shards.fill([x], 0)
            task = store.dump_data([x], 0, shards.pointers(1))
            # The dump met rank 1's fill: it waits for the fill's outcome (before the fix it
            # was reported done at once, its bytes dropped).
            deadline = time.monotonic() + REPLY_S
            while store.buffer.stats()["waited"] == 0 and not store.check(task):
                assert time.monotonic() < deadline, "the dump never reached the slot"
                time.sleep(0.01)
            conn.send(int(ending))  # the fill ends: x is in no tier
            assert conn.poll(REPLY_S) and conn.recv() == "done"
            store.wait(task)
            # In the buffer, byte-exact: the dump wrote its own bytes after the failed fill.
            shards.poison()
            store.wait(store.load_data([x], 0, shards.pointers(1)))
            assert shards.data(0) == payload(x, 0)
            assert store.stats()["hits"] == 1
            stats = store.buffer.stats()
            assert (stats["waited"], stats["dump_refills"]) == (1, 1)
            conn.send("close")
            other.join(REPLY_S)
            assert other.exitcode == 0
        # The last close wrote the dump's debt down: on posix, byte-exact.
        assert on_posix(nvme, [x]) == [payload(x, 0)]
    finally:
        if other.is_alive():
            other.kill()
            other.join(REPLY_S)


@pytest.mark.timeout(300)
def test_a_dump_whose_bucket_lock_times_out_is_written_straight_down(
    unique_id: str, tmp_path: Path
) -> None:
    nvme = tmp_path / "nvme"
    config = write_back_stack(unique_id, nvme)
    candidates = blocks(16, b"gap2")
    x = candidates[0]
    other, conn = start_other(config, x, "lock")
    try:
        kind, bucket = conn.recv()
        assert kind == "holding"  # a live process holds x's bucket lock
        with ucm.open(config, device_id=0, local_rank_size=2) as store:
            assert store.buffer is not None
            core = store.buffer.core
            y = next(b for b in candidates[1:] if core.bucket_of(b) != bucket)
            shards = Shards(2)
            shards.fill([x, y], 0)
            started = time.monotonic()
            store.wait(store.dump_data([x, y], 0, shards.pointers(2)))  # no TierError
            assert time.monotonic() - started >= LOCK_TIMEOUT_S  # x's Get did time out
            stats = store.buffer.stats()
            assert (stats["written_down_unbuffered"], stats["written_down_lock_timeouts"]) == (
                1,
                1,
            )
            assert stats["dirty_slots"] == 1  # y, in the buffer as write-back debt
            # x went straight to posix (the lock is still held), byte-exact; y did not.
            assert on_posix(nvme, [x, y]) == [payload(x, 0), None]
            conn.send("drop")
            assert conn.poll(REPLY_S) and conn.recv() == "done"
            # x is served from posix, y from the buffer: both byte-exact.
            shards.poison()
            store.wait(store.load_data([x, y], 0, shards.pointers(2)))
            assert [shards.data(0), shards.data(1)] == [payload(x, 0), payload(y, 0)]
            conn.send("close")
            other.join(REPLY_S)
            assert other.exitcode == 0
        assert on_posix(nvme, [x, y]) == [payload(x, 0), payload(y, 0)]
    finally:
        if other.is_alive():
            other.kill()
            other.join(REPLY_S)
