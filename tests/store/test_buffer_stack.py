"""Stacks with the shared CacheBuffer on top, with real rank processes sharing it."""

from __future__ import annotations

import itertools
import time
import uuid
from array import array
from pathlib import Path
from typing import Any

import pytest
import torch

import ucm
from ucm.arguments import ShardMemory
from ucm.errors import ConfigError, RoleError
from ucm.ranks import RankGroup

from .conftest import block, payload

SHARD = 4096


def buffer_stack(tmp_path: Path, slots: int = 64, shards: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "unique_id": f"t-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": shards,
        "tiers": [
            {"type": "buffer", "capacity": slots * SHARD, **extra},
            {"type": "posix", "path": str(tmp_path / "nvme")},
        ],
    }


def shard_tensor(block_id: bytes, shard: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload(block_id, shard, SHARD)), dtype=torch.uint8)


def test_dump_then_load_hits_the_buffer_and_writes_through(tmp_path: Path) -> None:
    config = buffer_stack(tmp_path)
    with ucm.open(config) as store:
        blocks = [block(i) for i in range(8)]
        store.wait(store.dump(blocks, 2, [[shard_tensor(b, 2)] for b in blocks]))
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
        store.wait(store.load(blocks, 2, dst))
        assert [d[0].numpy().tobytes() for d in dst] == [payload(b, 2, SHARD) for b in blocks]
        stats = store.stats()
        assert (stats["hits"], stats["misses"]) == (8, 0)
        assert stats["tiers"][0]["type"] == "buffer"
    # close() finished the write-through: a fresh store (new buffer) loads from posix.
    with ucm.open(buffer_stack(tmp_path)) as store:
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
        store.wait(store.load(blocks, 2, dst))
        assert [d[0].numpy().tobytes() for d in dst] == [payload(b, 2, SHARD) for b in blocks]
        stats = store.stats()
        assert (stats["hits"], stats["misses"]) == (0, 8)
        assert stats["tiers"][0]["owned"] == 8
        store.wait(store.load(blocks, 2, dst))  # promoted: now hits
        assert store.stats()["hits"] == 8


def test_prefetch_moves_blocks_into_the_buffer(tmp_path: Path) -> None:
    config = buffer_stack(tmp_path, shards=2)
    blocks = [block(i) for i in range(3)]
    with ucm.open(config) as first:
        for shard in (0, 1):
            first.wait(first.dump(blocks, shard, [[shard_tensor(b, shard)] for b in blocks]))
    with ucm.open(buffer_stack(tmp_path, shards=2)) as store:
        assert store.tiers[0].lookup_blocks(blocks) == [False] * 3
        store.prefetch(blocks)
        store.wait_prefetches()
        assert store.tiers[0].lookup_blocks(blocks) == [True] * 3
        assert store.stats()["prefetched_shards"] == 6


def test_prefetch_and_pin_of_one_shard_touch_that_shard_only(tmp_path: Path) -> None:
    """``shard_index`` (a TP rank's own shard, the vLLM connector's asynchronous loads):
    the prefetch moves up that shard of each block and no other, the pin holds it alone,
    and a bad index is refused naming the argument and what is valid."""
    blocks = [block(i) for i in range(3)]
    with ucm.open(buffer_stack(tmp_path, shards=2)) as first:
        for shard in (0, 1):
            first.wait(first.dump(blocks, shard, [[shard_tensor(b, shard)] for b in blocks]))
    with ucm.open(buffer_stack(tmp_path, shards=2)) as store:
        buffer = store.tiers[0]
        task = store.prefetch(blocks, shard_index=1)
        assert task is not None
        store.wait(task)
        assert buffer.lookup([(b, 1) for b in blocks]) == [True] * 3
        assert buffer.lookup([(b, 0) for b in blocks]) == [False] * 3
        assert store.stats()["prefetched_shards"] == 3
        assert store.prefetch(blocks, shard_index=1) is None  # its shard is all up already
        pins = store.pin(blocks, shard_index=1)
        assert [pin.held for pin in pins] == [1, 1, 1]
        assert [pin.held for pin in store.pin(blocks, shard_index=0)] == [0, 0, 0]
        assert [pin.held for pin in store.pin(blocks)] == [1, 1, 1]  # every shard: one is up
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
        store.wait(store.load(blocks, 1, dst, fill=False))
        assert [d[0].numpy().tobytes() for d in dst] == [payload(b, 1, SHARD) for b in blocks]
        store.unpin(pins)
        for bad, message in (
            (2, "shard_index=2 is out of range: expected None or an int in [0, 2)"),
            (True, "shard_index=True is not valid: expected None or an int in [0, 2)"),
            ("0", "shard_index='0' is not valid: expected None or an int in [0, 2)"),
        ):
            with pytest.raises(ucm.InvalidArgumentError) as raised:
                store.prefetch(blocks, shard_index=bad)  # type: ignore[arg-type]
            assert message in str(raised.value)
            with pytest.raises(ucm.InvalidArgumentError) as raised:
                store.pin(blocks, shard_index=bad)  # type: ignore[arg-type]
            assert message in str(raised.value)


def test_prefetch_returns_a_task_to_wait_on(tmp_path: Path) -> None:
    """The vLLM connector's asynchronous loads check a prefetch's task without blocking."""
    config = buffer_stack(tmp_path, shards=1)
    blocks = [block(i) for i in range(3)]
    with ucm.open(config) as first:
        first.wait(first.dump(blocks, 0, [[shard_tensor(b, 0)] for b in blocks]))
    with ucm.open(buffer_stack(tmp_path, shards=1)) as store:
        task = store.prefetch(blocks)
        assert task is not None
        store.wait(task)
        assert store.check(task)
        assert store.tiers[0].lookup_blocks(blocks) == [True] * 3
        assert store.prefetch(blocks) is None  # nothing left to move up
        absent = store.prefetch([block(99)])
        assert absent is not None
        with pytest.raises(ucm.TaskError) as raised:
            store.wait(absent)
        assert [key[0] for key in raised.value.failures] == [block(99)]


def test_eviction_from_a_small_buffer_falls_back_to_posix(tmp_path: Path) -> None:
    with ucm.open(buffer_stack(tmp_path, slots=4, shards=1)) as store:
        blocks = [block(i) for i in range(12)]
        store.wait(store.dump(blocks, 0, [[shard_tensor(b, 0)] for b in blocks]))
        store.drain()
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
        store.wait(store.load(blocks, 0, dst))
        assert [d[0].numpy().tobytes() for d in dst] == [payload(b, 0, SHARD) for b in blocks]
        assert store.stats()["tiers"][0]["evictions"] > 0
        assert store.lookup(blocks) == [True] * 12
        assert store.remove(blocks) == 12
        assert store.lookup(blocks) == [False] * 12


def test_scheduler_sees_blocks_without_a_data_plane(tmp_path: Path) -> None:
    config = buffer_stack(tmp_path, shards=1)
    with ucm.open(config, device_id=0, local_rank_size=2) as worker:
        worker.wait(worker.dump([block(1)], 0, [[shard_tensor(block(1), 0)]]))
        with ucm.open(config, device_id=-1, local_rank_size=2) as scheduler:
            assert scheduler.lookup([block(1), block(2)]) == [True, False]
            assert scheduler.lookup_on_prefix([block(1), block(2)]) == 0
            with pytest.raises(RoleError, match="not allowed on a scheduler"):
                scheduler.load([block(1)], 0, [[torch.zeros(SHARD, dtype=torch.uint8)]])


def test_buffer_must_be_the_first_tier(tmp_path: Path) -> None:
    config = buffer_stack(tmp_path)
    config["tiers"].reverse()
    with pytest.raises(ConfigError, match=r"tiers\[1\].type: the buffer tier must be the first"):
        ucm.open(config)


def test_capacity_below_one_slot_names_the_tier(tmp_path: Path) -> None:
    config = buffer_stack(tmp_path)
    config["tiers"][0]["capacity"] = SHARD - 1
    with pytest.raises(ConfigError, match=r"tiers\[0\] \(buffer\): capacity_bytes=4095 is below"):
        ucm.open(config)


def _rank(rank: int, config: dict[str, Any], blocks: list[bytes], barrier: Any, out: Any) -> None:
    try:
        with ucm.open(config, device_id=rank, local_rank_size=4) as store:
            dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
            barrier.wait(timeout=60)
            store.wait(store.load(blocks, 1, dst))
            exact = all(
                d[0].numpy().tobytes() == payload(b, 1, SHARD)
                for b, d in zip(blocks, dst, strict=True)
            )
            stats = store.stats()
            barrier.wait(timeout=60)  # keep the buffer mapped until every rank has loaded
            out.put((rank, exact, stats["tiers"][1]["hits"], stats["tiers"][0]["owned"]))
    except Exception as exc:  # reported to the test
        out.put((rank, repr(exc), -1, -1))


@pytest.mark.timeout(180)
def test_four_ranks_cold_load_reads_each_shard_from_below_exactly_once(tmp_path: Path) -> None:
    config = buffer_stack(tmp_path, slots=256)
    blocks = [block(i) for i in range(48)]
    lower = {
        "unique_id": "seed",
        "shard_size": SHARD,
        "shards_per_block": 4,
        "tiers": [{"type": "posix", "path": str(tmp_path / "nvme")}],
    }
    with ucm.open(lower) as seeding:
        seeding.wait(seeding.dump(blocks, 1, [[shard_tensor(b, 1)] for b in blocks]))
    with RankGroup(parties=4) as group:
        for r in range(4):
            group.spawn(_rank, r, config, blocks, group.barrier, group.results)
        results = sorted(group.reports(timeout=150))
    assert [r[1] for r in results] == [True] * 4, results
    # Node-wide, every shard came from posix exactly once; the other ranks waited on its slot.
    assert sum(r[2] for r in results) == 48
    assert sum(r[3] for r in results) == 48


def test_hits_copy_large_and_small_tensors_of_one_shard_byte_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The copier moves every tensor of a task in one batched native call: large and tiny
    # tensors of one shard land byte-exact, in order. The shard's size (135,276 bytes) is no
    # page multiple either: the buffer pads its segments (this stack failed to open before).
    # Dumps go the same way, from the tensors' addresses: no memoryview per tensor is made.
    def no_views(self: ShardMemory) -> None:
        raise AssertionError("a dump into the buffer made a memoryview per tensor")

    monkeypatch.setattr(ShardMemory, "views", property(no_views))
    sizes = [100, 65_536, 7, 69_632, 1]
    config = {
        "unique_id": f"t-{uuid.uuid4().hex[:12]}",
        "tensor_size_list": sizes,
        "shards_per_block": 1,
        "tiers": [{"type": "buffer", "capacity": 8 * sum(sizes)}],
    }
    blocks = [block(i) for i in range(4)]
    with ucm.open(config) as store:
        whole = [payload(b, 0, sum(sizes)) for b in blocks]

        def split(data: bytes) -> list[torch.Tensor]:
            cuts = [sum(sizes[:j]) for j in range(len(sizes) + 1)]
            return [
                torch.frombuffer(bytearray(data[a:b]), dtype=torch.uint8)
                for a, b in itertools.pairwise(cuts)
            ]

        store.wait(store.dump(blocks, 0, [split(data) for data in whole]))
        dst = [[torch.zeros(n, dtype=torch.uint8) for n in sizes] for _ in blocks]
        store.wait(store.load(blocks, 0, dst))
        assert store.stats()["hits"] == len(blocks)
        assert [b"".join(t.numpy().tobytes() for t in shard) for shard in dst] == whole
        # A second dump of Ready keys replaces their bytes (nobody is reading them).
        again = [payload(b, 1, sum(sizes)) for b in blocks]
        store.wait(store.dump(blocks, 0, [split(data) for data in again]))
        store.wait(store.load(blocks, 0, dst))
        assert [b"".join(t.numpy().tobytes() for t in shard) for shard in dst] == again


def test_buffer_opens_lazily_and_reports_what_is_resident(tmp_path: Path) -> None:
    lazy = buffer_stack(tmp_path, slots=64, populate_threads=0)
    with ucm.open(lazy) as store:
        stats = store.stats()["tiers"][0]
        assert (stats["resident_bytes"], stats["populated_bytes"]) == (0, 0)
        assert stats["data_bytes"] == 64 * SHARD
        blocks = [block(i) for i in range(4)]
        store.wait(store.dump(blocks, 0, [[shard_tensor(b, 0)] for b in blocks]))
        assert store.stats()["tiers"][0]["resident_bytes"] == 4 * SHARD
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
        store.wait(store.load(blocks, 0, dst))
        assert [d[0].numpy().tobytes() for d in dst] == [payload(b, 0, SHARD) for b in blocks]
    with ucm.open(buffer_stack(tmp_path, slots=64, populate_threads=2)) as store:
        deadline = time.monotonic() + 60
        while store.stats()["tiers"][0]["populated_bytes"] < 64 * SHARD:
            assert time.monotonic() < deadline, store.stats()["tiers"][0]
            time.sleep(0.01)
        stats = store.stats()["tiers"][0]
        assert stats["resident_bytes"] == stats["data_bytes"] == 64 * SHARD
        assert stats["populate_failed"] == 0


# ---- pins: what is Ready in the buffer stays there until unpinned ---------------------------


def _dump_all_shards(store: ucm.Store, blocks: list[bytes], shards: int) -> None:
    for shard in range(shards):
        store.wait(store.dump(blocks, shard, [[shard_tensor(b, shard)] for b in blocks]))


def _buffer_only(slots: int, shards: int) -> dict[str, Any]:
    return {
        "unique_id": f"t-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": shards,
        "tiers": [{"type": "buffer", "capacity": slots * SHARD}],
    }


def test_a_pinned_block_survives_buffer_pressure_until_unpinned() -> None:
    """Store.pin holds every Ready shard of a block in the buffer: dumps of many more blocks
    than the buffer holds evict everything else, never the pinned shards; unpinned, they go
    like the rest. Absent blocks are pinned with nothing held, and take no slot."""
    with ucm.open(_buffer_only(slots=8, shards=2)) as store:
        kept = [block(1), block(2)]
        _dump_all_shards(store, kept, 2)
        pins = store.pin([*kept, block(3)])
        assert [pin.held for pin in pins] == [2, 2, 0]
        assert store.lookup([block(3)]) == [False]
        assert store.stats()["tiers"][0]["held_slots"] == 4  # the pins' references
        pressure = [block(i) for i in range(10, 30)]
        for start in range(0, len(pressure), 2):  # 20 blocks (40 shards) through 4 free slots
            _dump_all_shards(store, pressure[start : start + 2], 2)
        assert store.stats()["tiers"][0]["evictions"] >= 36
        assert store.lookup(kept) == [True, True]
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in kept]
        store.wait(store.load(kept, 1, dst))
        assert [d[0].numpy().tobytes() for d in dst] == [payload(b, 1, SHARD) for b in kept]
        store.unpin(pins)
        store.unpin(pins)  # a second release is a no-op
        assert store.stats()["tiers"][0]["held_slots"] == 0
        for start in range(0, len(pressure), 2):  # two clock sweeps and more
            _dump_all_shards(store, pressure[start : start + 2], 2)
        assert store.lookup(kept) == [False, False]
        stats = store.stats()
        assert stats["pinned_shards"] == stats["unpinned_shards"] == 4
        with pytest.raises(ucm.InvalidArgumentError, match="pins must be a list of the Pin"):
            store.unpin(pins[0])  # type: ignore[arg-type]
        # The binding refuses what the native side would misread, and pins nothing for it.
        queue = store.tiers[0].queue
        with pytest.raises(ucm.InvalidArgumentError, match="ids has 15 bytes: expected 16"):
            queue.pin(b"x" * 15, array("I", [0]))
        slot = queue.pin(block(29), array("I", [0]))[0]  # Ready: the last pressure block
        with pytest.raises(ucm.InvalidArgumentError, match="unpin: the native load queue refused"):
            queue.unpin(array("I", [slot, slot]))  # more pins than taken
        queue.unpin(array("I", [slot]))
        assert store.stats()["tiers"][0]["held_slots"] == 0


def test_pins_hold_nothing_without_a_buffer_and_are_released_at_close(tmp_path: Path) -> None:
    posix_only = {
        "unique_id": f"t-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [{"type": "posix", "path": str(tmp_path / "nvme")}],
    }
    with ucm.open(posix_only) as store:
        _dump_all_shards(store, [block(1)], 1)
        assert [pin.held for pin in store.pin([block(1)])] == [0]
    config = _buffer_only(slots=4, shards=1)
    store = ucm.open(config)
    _dump_all_shards(store, [block(1)], 1)
    assert [pin.held for pin in store.pin([block(1)])] == [1]
    store.close()  # releases the pin: another process's store can evict the block
    with ucm.open(config) as again:
        _dump_all_shards(again, [block(i) for i in range(10, 18)], 1)
        assert again.lookup([block(1)]) == [False]


def _pinning_rank(config: dict[str, Any], barrier: Any, out: Any) -> None:
    try:
        with ucm.open(config, device_id=1, local_rank_size=2) as store:
            barrier.wait(timeout=60)  # rank 0 has dumped the blocks
            pins = store.pin([block(1), block(2)])
            out.put([pin.held for pin in pins])
            barrier.wait(timeout=120)  # rank 0 applied pressure and looked
            store.unpin(pins)
            barrier.wait(timeout=60)  # unpinned
            barrier.wait(timeout=120)  # rank 0 applied pressure again and looked
    except Exception as exc:  # reported to the test
        out.put(repr(exc))
        barrier.abort()


@pytest.mark.timeout(180)
def test_a_pin_in_one_rank_holds_against_another_ranks_evictions() -> None:
    """The pins of one process hold node-wide: rank 1 pins two blocks, and rank 0's dumps
    (its own process, the same buffer) evict everything else until rank 1 unpins."""
    config = _buffer_only(slots=8, shards=2)
    with RankGroup(parties=2, join_timeout=60) as group:
        barrier, out = group.barrier, group.results
        other = group.spawn(_pinning_rank, config, barrier, out)
        with ucm.open(config, device_id=0, local_rank_size=2) as store:
            kept = [block(1), block(2)]
            _dump_all_shards(store, kept, 2)
            barrier.wait(timeout=120)
            assert out.get(timeout=120) == [2, 2]
            pressure = [block(i) for i in range(10, 30)]
            for start in range(0, len(pressure), 2):
                _dump_all_shards(store, pressure[start : start + 2], 2)
            assert store.lookup(kept) == [True, True]
            barrier.wait(timeout=60)
            barrier.wait(timeout=60)  # rank 1 has unpinned
            for start in range(0, len(pressure), 2):  # two clock sweeps and more
                _dump_all_shards(store, pressure[start : start + 2], 2)
            assert store.lookup(kept) == [False, False]
            barrier.wait(timeout=60)
        other.join(timeout=60)
    assert other.exitcode == 0


# ---- fill=False: a memcpy at most, never a slot ----------------------------------------------


@pytest.mark.parametrize("call", ["load", "load_data"])
def test_a_no_fill_load_of_an_absent_key_takes_no_slot_and_evicts_nothing(call: str) -> None:
    """``fill=False`` (the vLLM connector's loads that cost a memcpy at most) of a key the
    buffer lacks is missing without claiming a slot for it: a claim in a full buffer would
    evict a Ready block (CLOCK) only to mark the absent key missing. Every block stays, the
    eviction counters and the occupancy do not move, and the block held stays loadable."""
    slots = 8
    with ucm.open(_buffer_only(slots=slots, shards=1)) as store:
        kept = [block(i) for i in range(slots)]
        _dump_all_shards(store, kept, 1)
        core = store.tiers[0].core
        assert store.lookup(kept) == [True] * slots
        before = store.stats()["tiers"][0]
        occupancy = core.occupancy()
        assert occupancy["resident"] == slots and occupancy["free"] == 0  # full, every slot Ready
        absent = [block(100), block(101)]
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in absent]
        if call == "load":
            task = store.load(absent, 0, dst, fill=False)
        else:
            ptrs = [[tensors[0].data_ptr()] for tensors in dst]
            task = store.load_data(absent, 0, ptrs, fill=False)
        with pytest.raises(ucm.TaskError) as raised:
            store.wait(task)
        assert set(raised.value.failures) == {(b, 0) for b in absent}
        assert all(isinstance(c, ucm.KeyMissingError) for c in raised.value.failures.values())
        after = store.stats()["tiers"][0]
        assert store.lookup(kept) == [True] * slots  # nothing evicted for the misses
        assert (after["evictions"], after["no_slot"]) == (before["evictions"], before["no_slot"])
        assert core.occupancy() == occupancy
        assert [row["evictions"] for row in store.tiers[0].namespace_stats().values()] == [0]
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in kept]
        store.wait(store.load(kept, 0, dst, fill=False))
        assert [d[0].numpy().tobytes() for d in dst] == [payload(b, 0, SHARD) for b in kept]
