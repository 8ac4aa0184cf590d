"""Write-back debt (DESIGN.md "Cascade semantics"): a dump into a buffer with a ``write: back``
tier below lands in the buffer only, dirty; nothing acknowledged is lost on a clean close, and a
kill -9 of the last rank loses at most ``dirty_max``. Ranks are real processes."""

from __future__ import annotations

import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import ucm
from ucm.errors import TaskError, TierError
from ucm.native.segments import unlink
from ucm.ranks import RankGroup

from ._writeback_ranks import rank_main
from .conftest import block, payload

SHARD = 4096
REPLY_TIMEOUT_S = 120
"""Bound on one command's reply: generous for a busy machine, still catches a hang."""


def write_back_stack(
    tmp_path: Path, *, slots: int = 16, shards: int = 4, dirty_max: int = 256 << 20
) -> dict[str, Any]:
    return {
        "unique_id": f"wb-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": shards,
        "tiers": [
            # No idle flush during a test: the debt at close is the close's to pay.
            {
                "type": "buffer",
                "capacity": slots * SHARD,
                "dirty_max": dirty_max,
                "flush_interval_s": 3600,
            },
            {"type": "posix", "path": str(tmp_path / "nvme"), "write": "back"},
        ],
    }


def posix_alone(tmp_path: Path, shards: int) -> dict[str, Any]:
    return {
        "unique_id": f"po-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": shards,
        "tiers": [{"type": "posix", "path": str(tmp_path / "nvme")}],
    }


def on_posix(tmp_path: Path, shards: int, numbers: list[int], shard: int) -> list[bool]:
    """Which blocks' shard ``shard`` the posix directory holds byte-exact, opened alone."""
    with ucm.open(posix_alone(tmp_path, shards)) as store:
        present = store.tiers[0].lookup([(block(n), shard) for n in numbers])
        found = [n for n, hit in zip(numbers, present, strict=True) if hit]
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in found]
        if found:
            store.wait(store.load([block(n) for n in found], shard, dst))
        exact = {
            n: d[0].numpy().tobytes() == payload(block(n), shard, SHARD)
            for n, d in zip(found, dst, strict=True)
        }
        assert all(exact.values()), "a shard on posix differs from what was dumped"
        return [n in exact for n in numbers]


class Rank:
    """One rank process (``_writeback_ranks.rank_main``) and its command pipe."""

    def __init__(
        self, group: RankGroup, config: dict[str, Any], device_id: int = 0, ranks: int = 1
    ) -> None:
        self.conn, child = group.context.Pipe()
        self.process = group.spawn(rank_main, config, device_id, ranks, child)
        child.close()
        self.expect("ready")

    def expect(self, kind: str) -> Any:
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise AssertionError(f"no {kind!r} reply from rank {self.process.pid} in time")
        reply_kind, value = self.conn.recv()
        assert reply_kind == kind, (reply_kind, value)
        return value

    def dump(self, numbers: list[int], shard: int) -> None:
        self.conn.send(("dump", numbers, shard))
        assert self.expect("acked") == numbers

    def load(self, numbers: list[int], shard: int) -> bool:
        self.conn.send(("load", numbers, shard))
        return bool(self.expect("loaded"))

    def stats(self) -> dict[str, Any]:
        self.conn.send(("stats",))
        return dict(self.expect("stats"))

    def close(self) -> None:
        self.conn.send(("close",))
        assert self.expect("closed") is None
        self.process.join(REPLY_TIMEOUT_S)
        assert self.process.exitcode == 0

    def kill(self) -> None:
        assert self.process.pid is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(REPLY_TIMEOUT_S)


@contextmanager
def ranks(config: dict[str, Any], count: int) -> Iterator[list[Rank]]:
    try:
        # Ranks still running at the end (never closed) are killed at once.
        with RankGroup(parties=count, join_timeout=0) as group:
            yield [Rank(group, config, device_id, count) for device_id in range(count)]
    finally:
        unlink(config["unique_id"])


@pytest.mark.timeout(300)
def test_a_single_rank_that_closes_writes_its_debt_down(tmp_path: Path) -> None:
    """The bug report: buffer (16 slots) -> posix (write: back), 64 blocks of 4 shards dumped
    by one rank, the first 2 loaded again, close(): every block is on posix."""
    config = write_back_stack(tmp_path)
    numbers = list(range(64))
    with ranks(config, 1) as (rank,):
        for shard in range(4):
            rank.dump(numbers, shard)
        for shard in range(4):
            assert rank.load(numbers[:2], shard)
        stats = rank.stats()
        # Debt was left for the close to pay (never more than the bound: 8 of 16 slots).
        assert 0 < stats["buffer"]["dirty_slots"] <= 8
        assert stats["buffer"]["dirty_limit_bytes"] == 8 * SHARD
        assert stats["buffer"]["evictions"] > 0  # clean slots made room, dirty ones never did
        rank.close()
    for shard in range(4):
        assert on_posix(tmp_path, 4, numbers, shard) == [True] * 64


@pytest.mark.timeout(300)
def test_the_last_of_four_ranks_to_close_writes_everyones_debt_down(tmp_path: Path) -> None:
    config = write_back_stack(tmp_path, slots=64, dirty_max=32 * SHARD)
    numbers = list(range(48))
    with ranks(config, 4) as group:
        for rank_index, rank in enumerate(group):
            rank.dump(numbers, rank_index)  # each rank its own shard of every block
        debt = group[3].stats()["buffer"]["dirty_slots"]
        assert 0 < debt <= 32
        for rank in group[:3]:
            rank.close()  # not the last: the debt stays in the shared buffer
        assert group[3].stats()["buffer"]["dirty_slots"] == debt
        missing = sum(not hit for s in range(4) for hit in on_posix(tmp_path, 4, numbers, s))
        assert missing == debt
        group[3].close()
    for shard in range(4):
        assert on_posix(tmp_path, 4, numbers, shard) == [True] * 48


@pytest.mark.timeout(300)
def test_a_rank_closing_early_leaves_its_debt_to_the_ranks_that_remain(tmp_path: Path) -> None:
    config = write_back_stack(tmp_path, slots=32, shards=2)
    numbers = list(range(24))
    with ranks(config, 2) as (first, second):
        first.dump(numbers, 0)
        first.close()
        left = second.stats()["buffer"]["dirty_slots"]
        assert left > 0
        assert sum(not hit for hit in on_posix(tmp_path, 2, numbers, 0)) == left
        # The others' work goes on: the debt is served from the buffer, more is added.
        assert second.load(numbers[-4:], 0)
        second.dump(numbers, 1)
        assert second.load(numbers, 1)
        second.close()  # the last: pays the first rank's debt and its own
    assert on_posix(tmp_path, 2, numbers, 0) == [True] * 24
    assert on_posix(tmp_path, 2, numbers, 1) == [True] * 24


@pytest.mark.timeout(300)
def test_kill_9_of_the_last_rank_loses_at_most_dirty_max(tmp_path: Path) -> None:
    bound_slots = 6
    config = write_back_stack(tmp_path, slots=32, shards=1, dirty_max=bound_slots * SHARD)
    acked: list[int] = []
    with ranks(config, 1) as (rank,):
        for start in range(0, 60, 4):
            numbers = list(range(start, start + 4))
            rank.dump(numbers, 0)
            acked.extend(numbers)
        assert rank.stats()["buffer"]["dirty_slots"] == bound_slots
        rank.kill()  # the last process of the buffer: its data plane is gone with it
    lost = sum(not hit for hit in on_posix(tmp_path, 1, acked, 0))
    assert 0 < lost <= bound_slots


def test_a_failing_write_back_tier_fails_the_dump_and_the_close(tmp_path: Path) -> None:
    config = write_back_stack(tmp_path, slots=16, shards=1, dirty_max=2 * SHARD)
    store = ucm.open(config)
    try:
        blocks = [block(n) for n in range(8)]
        src = [
            [torch.frombuffer(bytearray(payload(b, 0, SHARD)), dtype=torch.uint8)] for b in blocks
        ]
        store.wait(store.dump(blocks[:2], 0, src[:2]))  # within the bound: no write-down yet
        nvme = tmp_path / "nvme"
        shutil.rmtree(nvme)
        nvme.write_text("the directory is gone: every write-down fails")
        with pytest.raises(TaskError) as info:
            store.wait(store.dump(blocks[2:], 0, src[2:]))
        message = str(info.value)
        assert message.startswith("6 key(s) failed: ")
        assert "write-back failed: 2 dirty shard(s) cannot be written" in message
        # Not acknowledged and not taken: no debt piles up that nothing can pay. What was
        # acknowledged stays in the buffer and loads byte-exact.
        assert store.tiers[0].lookup([(b, 0) for b in blocks]) == [True] * 2 + [False] * 6
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks[:2]]
        store.wait(store.load(blocks[:2], 0, dst))
        assert [d[0].numpy().tobytes() for d in dst] == [payload(b, 0, SHARD) for b in blocks[:2]]
        assert store.stats()["tiers"][0]["dirty_slots"] == 2
    finally:
        with pytest.raises(TierError, match=r"close: 2 dirty shard\(s\) could not be written"):
            store.close()
        unlink(config["unique_id"])


def test_dirty_slots_are_flushed_not_evicted_in_a_buffer_that_fills(tmp_path: Path) -> None:
    """Eviction from a full buffer never drops write-back debt: the dump path flushes it down
    first, so every block survives in posix, and loads after the evictions are byte-exact."""
    config = write_back_stack(tmp_path, slots=8, shards=1, dirty_max=4 * SHARD)
    with ucm.open(config) as store:
        blocks = [block(n) for n in range(40)]
        for start in range(0, 40, 5):
            part = blocks[start : start + 5]
            src = [
                [torch.frombuffer(bytearray(payload(b, 0, SHARD)), dtype=torch.uint8)] for b in part
            ]
            store.wait(store.dump(part, 0, src))
            assert store.stats()["tiers"][0]["dirty_slots"] <= 4
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
        store.wait(store.load(blocks, 0, dst))
        assert [d[0].numpy().tobytes() for d in dst] == [payload(b, 0, SHARD) for b in blocks]
        buffer_stats = store.stats()["tiers"][0]
        assert buffer_stats["evictions"] > 0
        assert buffer_stats["written_back_shards"] == buffer_stats["flushed"] >= 36
        assert buffer_stats["write_back_failures"] == 0
    assert on_posix(tmp_path, 1, list(range(40)), 0) == [True] * 40


def test_a_slot_removed_while_it_is_written_down_is_not_a_write_back_failure(
    tmp_path: Path,
) -> None:
    """Seen in the 600 s soak: a rank force-removed keys while another's flusher wrote them;
    the removal paid the debt, and the dump that was flushing failed with "write-back failed"
    although every write had succeeded. The flush then removes from posix what it wrote: a
    remove racing a flush is final (tests/loadpath/test_remove_vs_write_back.py)."""
    config = write_back_stack(tmp_path, slots=16, shards=1, dirty_max=8 * SHARD)
    with ucm.open(config) as store:
        buffer: Any = store.tiers[0]
        blocks = [block(n) for n in range(6)]
        src = [
            [torch.frombuffer(bytearray(payload(b, 0, SHARD)), dtype=torch.uint8)] for b in blocks
        ]
        store.wait(store.dump(blocks, 0, src))
        assert buffer.dirty_slots() == 6
        sink = buffer._sink

        def removing_sink(keys: Any, views: Any) -> Any:
            outcomes = sink(keys, views)
            assert buffer.core.remove(list(keys), force=True) == len(keys)
            # What a forced remove records next, in any process (Store.remove, ucm.finality).
            buffer.finality.record_removes([key[0] for key in keys])
            return outcomes

        buffer._sink = removing_sink
        assert buffer.flush_some() == (6, 6)  # all written; none left to clean
        buffer._sink = sink
        assert buffer.dirty_slots() == 0
        stats = buffer.stats()
        assert (stats["flushed"], stats["write_back_failures"]) == (0, 0)
        assert stats["writes_retracted"] == 6
        buffer.settle(0)  # nothing to pay, nothing raised
    assert on_posix(tmp_path, 1, list(range(6)), 0) == [False] * 6
