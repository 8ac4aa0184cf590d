"""The three-tier stack ``buffer → posix → fsspec s3://`` (a real S3 server on 127.0.0.1) with
real rank processes: sharing between nodes through S3, each tier serving what the one above
lost, Touch reaching posix, repair of a torn posix file, write-back on posix eviction, close()
finishing write-through, and a long-running store seeing blocks other nodes add."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ucm_backends.fsspec_tier import FsspecConfig, FsspecTier
from ucm_backends.posix import PosixConfig, PosixTier

import ucm
from harness.s3 import S3Server
from ucm.errors import TaskError
from ucm.testing import make_context
from ucm.testing.conformance import block_ids

from . import _nodes
from ._nodes import BLOCK_FILE_BYTES, LAYOUT, SHARDS, drain, dump, load, stack, tier_stats
from .conftest import RunRanks

Ids = Callable[[str], str]


def s3_view(s3: S3Server, url: str) -> FsspecTier:
    """A plain tier over the S3 prefix, to check what it holds independently of any stack."""
    return FsspecTier(
        FsspecConfig(url=url, storage_options=s3.storage_options), make_context(LAYOUT)
    )


def posix_view(path: str) -> PosixTier:
    return PosixTier(PosixConfig(path=path), make_context(LAYOUT))


def held_exact(tier: Any, blocks: list[bytes]) -> list[bool]:
    """Per block: whether the tier holds every shard of it, byte-exact (closes the tier)."""
    try:
        keys = LAYOUT.keys_of_blocks(blocks)
        buffers = [bytearray(LAYOUT.shard_size) for _ in keys]
        outcomes = tier.load(keys, [[memoryview(b)] for b in buffers])
        exact = [
            outcome is None and bytes(data) == _nodes.payload(*key)
            for key, outcome, data in zip(keys, outcomes, buffers, strict=True)
        ]
        return [all(exact[i * SHARDS : (i + 1) * SHARDS]) for i in range(len(blocks))]
    finally:
        tier.close()


def test_block_dumped_by_node_a_ranks_is_loaded_byte_exact_by_node_b_through_s3(
    s3: S3Server, s3_url: str, unique: Ids, nvme: Ids, run_ranks: RunRanks
) -> None:
    blocks = block_ids(3, seed=1)
    node_a = stack(unique("A"), nvme("A"), s3_url, s3.storage_options)
    reports = run_ranks(_nodes.rank_dump, [(node_a, rank, 2, blocks) for rank in (0, 1)])
    assert [reports[rank]["dumped"] for rank in (0, 1)] == [6, 6]  # shards {0, 2} and {1, 3}
    assert held_exact(s3_view(s3, s3_url), blocks) == [True] * 3

    # Node B: its own buffer (unique_id) and its own, empty posix directory; only S3 is shared.
    node_b = stack(unique("B"), nvme("B"), s3_url, s3.storage_options, posix={"promote": True})
    before = s3.requests()
    reports = run_ranks(_nodes.rank_load, [(node_b, rank, 2, blocks) for rank in (0, 1)])
    for rank in (0, 1):
        assert reports[rank]["wrong"] == [], f"rank {rank} got wrong bytes"
        assert reports[rank]["loaded"] == 3 * SHARDS
        assert reports[rank]["posix_hits"] == 0
    # Every shard came from S3 exactly once for the whole node: the two ranks share node B's
    # buffer (one owner loads a shard, the other waits for it), and the server saw exactly
    # those object reads.
    assert reports[0]["s3_hits"] + reports[1]["s3_hits"] == 3 * SHARDS
    assert (s3.requests() - before)["GET object"] == 3 * SHARDS
    # posix (promote: true) received a copy on the way up; node A's directory was never read.
    assert held_exact(posix_view(nvme("B")), blocks) == [True] * 3


def test_block_evicted_from_the_buffer_is_served_from_posix_without_touching_s3(
    s3: S3Server, s3_url: str, unique: Ids, nvme: Ids
) -> None:
    blocks = block_ids(6, seed=2)
    config = stack(unique("A"), nvme("A"), s3_url, s3.storage_options, buffer_slots=8)
    with ucm.open(config) as store:
        for block in blocks:  # 24 shards through an 8-slot buffer
            dump(store, [block])
        drain(store)
        evicted = [b for b in blocks if not any(store.tiers[0].lookup(LAYOUT.keys_of_blocks([b])))]
        assert evicted, "the 8-slot buffer kept a shard of every block"
        first = evicted[0]
        assert store.tiers[1].lookup(LAYOUT.keys_of_blocks([first])) == [True] * SHARDS
        s3_before, requests_before = tier_stats(store, 2), s3.requests()
        posix_hits = tier_stats(store, 1)["hits"]
        got = load(store, [first])
        assert _nodes.wrong_keys(got) == [] and len(got) == SHARDS
        assert tier_stats(store, 1)["hits"] - posix_hits == SHARDS
        s3_after = tier_stats(store, 2)
        assert (s3_after["hits"], s3_after["misses"]) == (s3_before["hits"], s3_before["misses"])
        assert s3.requests() - requests_before == Counter()  # not one request reached S3


def test_stack_touch_keeps_a_block_in_posix_through_an_eviction_pass(
    s3: S3Server, s3_url: str, unique: Ids, nvme: Ids
) -> None:
    b0, b1, b2, b3 = block_ids(4, seed=3)
    capacity = 3 * BLOCK_FILE_BYTES + BLOCK_FILE_BYTES // 2  # room for three block files
    config = stack(unique("A"), nvme("A"), s3_url, s3.storage_options, posix={"capacity": capacity})
    with ucm.open(config) as store:
        posix = store.tiers[1]
        for block in (b0, b1, b2):
            dump(store, [block])
            drain(store)
        path = Path(posix.block_path(b0))
        assert path.stat().st_size == BLOCK_FILE_BYTES
        written = path.stat().st_mtime_ns
        store.touch([b0])  # the stack-level call reaches the posix file's timestamp
        assert path.stat().st_mtime_ns > Path(posix.block_path(b2)).stat().st_mtime_ns > written
        passes = tier_stats(store, 1)["eviction_passes"]
        dump(store, [b3])  # a fourth block: over capacity, the oldest-touched block goes
        drain(store)
        assert tier_stats(store, 1)["eviction_passes"] == passes + 1
        assert tier_stats(store, 1)["evictions"] == SHARDS
        assert posix.lookup_blocks([b0, b1, b2, b3]) == [True, False, True, True]
        assert store.lookup([b0, b1, b2, b3]) == [True] * 4  # b1 is still in S3
    assert held_exact(posix_view(nvme("A")), [b0, b2, b3]) == [True] * 3


@pytest.mark.parametrize("promote", [True, False], ids=["promote", "repair-only"])
def test_torn_posix_file_falls_through_to_s3_and_is_repaired(
    s3: S3Server, s3_url: str, unique: Ids, nvme: Ids, promote: bool
) -> None:
    blocks = block_ids(2, seed=4)
    posix = {"promote": promote}
    with ucm.open(stack(unique("A"), nvme("A"), s3_url, s3.storage_options, posix=posix)) as a:
        dump(a, blocks)
    torn = posix_view(nvme("A")).block_path(blocks[0])
    os.truncate(torn, LAYOUT.block_size // 2)  # a crash mid-write: shards and footer cut off
    # A fresh buffer (another unique_id), the same posix directory and S3 prefix. The load
    # asks for one shard index per task, as ranks do: the first task finds the file torn, the
    # later ones find its other shards marked lost, so every shard is repaired, not just one.
    with ucm.open(stack(unique("B"), nvme("A"), s3_url, s3.storage_options, posix=posix)) as b:
        got = load(b, blocks)
        assert _nodes.wrong_keys(got) == [] and len(got) == 2 * SHARDS
        assert (tier_stats(b, 1)["corrupt"], tier_stats(b, 1)["hits"]) == (1, SHARDS)
        assert tier_stats(b, 2)["hits"] == SHARDS  # the torn block came from S3
        assert b.stats()["repaired_shards"] == SHARDS
    # posix holds a valid copy again: read back by a tier of its own.
    assert held_exact(posix_view(nvme("A")), blocks) == [True, True]


def test_write_back_below_posix_receives_blocks_evicted_from_posix(
    s3: S3Server, s3_url: str, unique: Ids, nvme: Ids
) -> None:
    blocks = block_ids(5, seed=5)
    capacity = 2 * BLOCK_FILE_BYTES + BLOCK_FILE_BYTES // 2  # room for two block files
    config = stack(
        unique("A"),
        nvme("A"),
        s3_url,
        s3.storage_options,
        posix={"capacity": capacity},
        s3={"write": "back"},
    )
    with ucm.open(config) as store:
        for block in blocks:  # one at a time: the posix timestamps order the evictions
            dump(store, [block])
            drain(store)
        in_posix = store.tiers[1].lookup_blocks(blocks)
        assert in_posix == [False, False, False, True, True]
        assert tier_stats(store, 1)["evictions"] == 3 * SHARDS
        assert tier_stats(store, 1)["evict_sink_failures"] == 0
        assert store.stats()["written_back_shards"] == 3 * SHARDS
        assert store.lookup(blocks) == [True] * 5  # eviction never dropped the only copy
    # S3 got exactly the evicted blocks (write: back, not through), byte-exact.
    assert held_exact(s3_view(s3, s3_url), blocks) == [True, True, True, False, False]


def test_close_finishes_write_through_so_nothing_acknowledged_is_lost(
    s3: S3Server, s3_url: str, unique: Ids, nvme: Ids, run_ranks: RunRanks
) -> None:
    blocks = block_ids(6, seed=6)
    config = stack(unique("A"), nvme("A"), s3_url, s3.storage_options)
    s3.set_delay("PUT", 0.05)  # a slow object store: write-through lags well behind the dumps
    try:
        (report,) = run_ranks(_nodes.node_dump_and_close, [(config, blocks)]).values()
    finally:
        s3.set_delay("PUT", 0)
    assert report["pending_bytes_at_close"] > 0  # close() really had work to finish
    assert report["closed"]
    assert held_exact(s3_view(s3, s3_url), blocks) == [True] * 6
    assert held_exact(posix_view(nvme("A")), blocks) == [True] * 6


def test_long_running_store_sees_blocks_another_node_adds_to_s3_later(
    s3: S3Server, s3_url: str, unique: Ids, nvme: Ids, run_ranks: RunRanks
) -> None:
    (block,) = block_ids(1, seed=7)
    with ucm.open(stack(unique("B"), nvme("B"), s3_url, s3.storage_options)) as store:
        assert store.lookup([block]) == [False]
        with pytest.raises(TaskError, match=f"block {block.hex()} shard 0: KeyMissingError"):
            load(store, [block], [0])
        # Node A, another process with its own buffer and posix directory, adds the block.
        node_a = stack(unique("A"), nvme("A"), s3_url, s3.storage_options)
        run_ranks(_nodes.node_dump_and_close, [(node_a, [block])])
        assert store.lookup([block]) == [True]  # no stale listing, no remembered miss
        assert store.lookup_on_prefix([block]) == 0
        got = load(store, [block])
        assert _nodes.wrong_keys(got) == [] and len(got) == SHARDS
        assert tier_stats(store, 2)["hits"] == SHARDS
