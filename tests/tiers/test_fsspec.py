"""fsspec tier on memory:// and file://: object layout, checksums, protocol errors,
concurrency, eviction by last touch."""

from __future__ import annotations

import dataclasses
import os
import struct
import sys
import threading
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import pytest
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.registry import register_implementation
from ucm_backends.fsspec_tier import HEADER_BYTES, FsspecConfig, FsspecTier

from ucm import envelope
from ucm.errors import ConfigError, KeyMissingError, TierError
from ucm.layout import Key, Layout
from ucm.native.checksum import checksum
from ucm.ranks import RankGroup
from ucm.stack import parse_stack
from ucm.testing import make_context
from ucm.testing.conformance import (
    assert_loads_exact,
    block_ids,
    dump_keys,
    load_keys,
    shard_bytes,
)
from ucm.tier import NAMESPACE_BYTES_OPTION, NamespaceBytes, Outcome, ShardViews

from .conftest import fsspec_tier

LAYOUT = Layout(shard_size=1024, shards_per_block=2, tensor_sizes=(1000, 24))


def test_objects_keyed_by_block_and_shard_only(memory_url: str) -> None:
    node1 = fsspec_tier(memory_url, LAYOUT)
    node2 = FsspecTier(FsspecConfig(url=memory_url), make_context(LAYOUT, unique_id="node-2"))
    (block,) = block_ids(1)
    dump_keys(node1, [(block, 1)])
    root = memory_url.removeprefix("memory://")
    expected = f"/{root}/{block.hex()[:2]}/{block.hex()}/1"
    assert node1.fs.find(f"/{root}") == [expected]
    assert node1.fs.cat_file(expected)[:4] == envelope.MAGIC
    assert_loads_exact(node2, [(block, 1)])  # another unique_id reads the same object
    node1.close()
    node2.close()


def test_file_url_layout_and_no_temp_left(tmp_path: Path) -> None:
    tier = fsspec_tier(f"file://{tmp_path}", LAYOUT)
    keys = LAYOUT.keys_of_blocks(block_ids(2))
    dump_keys(tier, keys)
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files == sorted(f"{b.hex()[:2]}/{b.hex()}/{s}" for b, s in keys)
    assert_loads_exact(tier, keys)
    tier.close()


def test_temp_files_of_dead_writers_are_reaped_at_open(tmp_path: Path) -> None:
    with RankGroup(parties=1) as group:
        dead = group.spawn(int)
    assert group.join() == [0] and dead.pid is not None
    (block,) = block_ids(1)
    directory = tmp_path / block.hex()[:2] / block.hex()
    directory.mkdir(parents=True)
    stale = directory / f"0.{dead.pid}.abcd1234.tmp"
    mine = directory / f"1.{os.getpid()}.abcd1234.tmp"
    stale.write_bytes(b"partial")
    mine.write_bytes(b"in progress")
    tier = fsspec_tier(f"file://{tmp_path}", LAYOUT)
    assert tier.temp_sweep is not None
    tier.temp_sweep.result(timeout=60)  # the sweep behind open
    assert not stale.exists()
    assert mine.exists()  # a live writer's temp file is left alone
    tier.close()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_object_fails_and_is_removed(tmp_path: Path, damage: str) -> None:
    tier = fsspec_tier(f"file://{tmp_path}", LAYOUT)
    (block,) = block_ids(1)
    keys = LAYOUT.keys_of_blocks([block])
    dump_keys(tier, keys)
    path = tmp_path / block.hex()[:2] / block.hex() / "0"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[:500])
        why = f"500 bytes, expected {HEADER_BYTES + LAYOUT.shard_size}"
    else:
        data[700] ^= 0x01
        path.write_bytes(data)
        why = "checksum mismatch"
    outcomes, _ = load_keys(tier, keys)
    # A failure (not a miss), so a stack repairs the shard here from a tier below.
    assert isinstance(outcomes[0], TierError) and not isinstance(outcomes[0], KeyMissingError)
    assert str(outcomes[0]) == (
        f"fsspec tier 'fsspec': block {block.hex()} shard 0 is corrupt ({why}); it was removed"
    )
    assert outcomes[1] is None
    assert not path.exists()
    assert tier.lookup(keys) == [False, True]
    stats = tier.stats()
    assert (stats["corrupt"], stats["hits"], stats["misses"]) == (1, 1, 0)
    tier.close()


def _old_format_object(key: Key, magic: bytes) -> bytes:
    """A whole, valid object as the fsspec tier wrote it before the shard envelope: UCF2 (XXH3
    of the shard) or UCMF (crc32), then the length, then the shard."""
    data = shard_bytes(key, LAYOUT)
    digest = checksum([data]) if magic == b"UCF2" else zlib.crc32(data)
    return struct.pack("<4sQQ", magic, digest, LAYOUT.shard_size) + data


@pytest.mark.parametrize("magic", [b"UCF2", b"UCMF"])
def test_object_of_an_older_format_is_a_miss_and_is_replaced(tmp_path: Path, magic: bytes) -> None:
    tier = fsspec_tier(f"file://{tmp_path}", LAYOUT)
    (block,) = block_ids(1)
    keys = LAYOUT.keys_of_blocks([block])
    dump_keys(tier, keys)
    path = tmp_path / block.hex()[:2] / block.hex() / "0"
    path.write_bytes(_old_format_object(keys[0], magic))
    outcomes, buffers = load_keys(tier, keys)
    assert isinstance(outcomes[0], KeyMissingError)
    name = "UCF2" if magic == b"UCF2" else "UCMF"
    assert str(outcomes[0]) == (
        f"fsspec tier 'fsspec': block {block.hex()} shard 0 is not readable here (written in an "
        f"older format, a fsspec object ({name})); it was removed"
    )
    assert buffers[0] == bytearray(LAYOUT.shard_size)  # never data
    assert outcomes[1] is None
    assert not path.exists()
    assert tier.lookup(keys) == [False, True]
    stats = tier.stats()
    assert (stats["corrupt"], stats["hits"], stats["misses"]) == (0, 1, 1)
    dump_keys(tier, keys[:1])
    assert_loads_exact(tier, keys)
    tier.close()


def _newer_version_object(key: Key) -> bytes:
    """A whole object as a newer UCM could write it: an envelope of a later version than this
    UCM reads, then a payload (here the shard itself)."""
    data = shard_bytes(key, LAYOUT)
    header = bytearray(envelope.seal(key, [data]))
    header[4] = envelope.VERSION + 1  # the version byte, after the magic
    return bytes(header) + data


@pytest.mark.parametrize("sink", [False, True], ids=["no-sink", "evict-sink"])
@pytest.mark.parametrize("where", ["memory", "file"])
def test_object_of_a_newer_envelope_version_is_a_miss_and_is_never_deleted(
    memory_url: str, tmp_path: Path, where: str, sink: bool
) -> None:
    # A bucket shared by the nodes of a rolling upgrade: the newer nodes' objects are misses
    # here, but this node must never delete them or call them corrupt, on a load, an
    # eviction pass or a scan at open (a dump of the same key replaces one with this node's
    # version, which the newer UCM reads).
    received: list[Key] = []

    def write_down(keys: Sequence[Key], views: Sequence[ShardViews]) -> list[Outcome]:
        received.extend(keys)
        return [None] * len(keys)

    url = memory_url if where == "memory" else f"file://{tmp_path}"
    object_bytes = HEADER_BYTES + LAYOUT.shard_size
    capacity = 4 * object_bytes  # two blocks
    tier = fsspec_tier(url, LAYOUT, evict_sink=write_down if sink else None, capacity=capacity)
    newer_block, a, b = block_ids(3, seed=21)
    newer_keys = LAYOUT.keys_of_blocks([newer_block])
    stored = {key: _newer_version_object(key) for key in newer_keys}
    for key, raw in stored.items():
        tier.fs.pipe_file(tier.object_path(key), raw)
    if where == "file":  # the oldest block by far: the first victim of any eviction pass
        for key in newer_keys:
            os.utime(tier.object_path(key), (1_000_000, 1_000_000))

    def assert_kept() -> None:
        for key, raw in stored.items():
            assert bytes(tier.fs.cat_file(tier.object_path(key))) == raw, key

    tier.lookup(newer_keys)  # a listing: it may answer present, and never removes anything
    tier.lookup_blocks([newer_block])
    assert_kept()
    outcomes, buffers = load_keys(tier, newer_keys)
    for key, outcome in zip(newer_keys, outcomes, strict=True):
        assert isinstance(outcome, KeyMissingError), outcome
        assert str(outcome) == (
            f"fsspec tier 'fsspec': block {newer_block.hex()} shard {key[1]} is not readable "
            f"here (envelope version {envelope.VERSION + 1}; this UCM reads up to "
            f"{envelope.VERSION}); it was kept for the UCM that wrote it"
        )
    assert buffers == [bytearray(LAYOUT.shard_size)] * len(newer_keys)  # never data
    assert_kept()
    # A dump of the same key (this node recomputed the block) replaces that shard with this
    # node's version, which the newer UCM still reads: nothing is lost, and it loads here.
    dump_keys(tier, newer_keys[:1])
    outcomes, buffers = load_keys(tier, newer_keys[:1])
    assert outcomes == [None]
    assert bytes(buffers[0]) == shard_bytes(newer_keys[0], LAYOUT)
    del stored[newer_keys[0]]
    assert_kept()
    # Two blocks of our own fill the capacity past its bound: every eviction pass picks the
    # newer block first (the oldest) and must keep it.
    time.sleep(0.01)
    dump_keys(tier, LAYOUT.keys_of_blocks([a]))
    time.sleep(0.01)
    dump_keys(tier, LAYOUT.keys_of_blocks([b]))
    tier.evict_to_capacity()
    assert_kept()
    assert not set(received) & set(stored)  # a newer object is never handed below as ours
    stats = tier.stats()
    assert stats["eviction_passes"] >= 1
    assert stats["corrupt"] == 0
    assert stats["misses"] == len(newer_keys)
    assert stats["newer_kept"] >= len(newer_keys)  # the loads, the evictions
    tier.close()
    # A fresh open scans the tree (capacity set) and evicts: the objects stay.
    tier = fsspec_tier(url, LAYOUT, capacity=capacity)
    tier.evict_to_capacity()
    tier.list_keys()
    assert_kept()
    outcomes, _ = load_keys(tier, newer_keys)
    assert all(isinstance(outcome, KeyMissingError) for outcome in outcomes)
    assert_kept()
    tier.close()


def test_object_copied_onto_another_key_is_corrupt(memory_url: str) -> None:
    tier = fsspec_tier(memory_url, LAYOUT)
    (block,) = block_ids(1)
    dump_keys(tier, [(block, 0)])
    tier.fs.pipe_file(tier.object_path((block, 1)), tier.fs.cat_file(tier.object_path((block, 0))))
    outcomes, buffers = load_keys(tier, [(block, 1)])
    assert isinstance(outcomes[0], TierError) and not isinstance(outcomes[0], KeyMissingError)
    assert "is corrupt (the envelope names another key); it was removed" in str(outcomes[0])
    assert buffers[0] == bytearray(LAYOUT.shard_size)
    tier.close()


def test_missing_protocol_package_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # absent, even where it is installed
    with pytest.raises(ConfigError) as info:
        fsspec_tier("gs://bucket/prefix", LAYOUT)
    assert str(info.value) == (
        "fsspec tier url 'gs://bucket/prefix': protocol 'gs' needs the package 'gcsfs', which is "
        "not installed; install it with `pip install gcsfs` (Please install gcsfs to access "
        "Google Storage)"
    )


def test_unknown_protocol_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        fsspec_tier("nosuchproto://x/y", LAYOUT)
    message = str(info.value)
    assert message.startswith(
        "fsspec tier url 'nosuchproto://x/y': unknown protocol 'nosuchproto'; known protocols: "
    )
    assert "memory" in message and "s3" in message


def test_config_through_the_stack_schema() -> None:
    stack = parse_stack(
        {
            "unique_id": "t",
            "shard_size": 1024,
            "shards_per_block": 2,
            "tiers": [
                {
                    "type": "fsspec",
                    "url": "memory://x",
                    "storage_options": {"a": 1},
                    "capacity": "4KiB",  # at least a block: 2 objects of 48 + 1024 bytes
                    "write": "back",
                }
            ],
        }
    )
    tier = stack.tiers[0]
    assert isinstance(tier, FsspecConfig)
    assert (tier.url, tier.storage_options, tier.capacity, tier.write) == (
        "memory://x",
        {"a": 1},
        4096,
        "back",
    )
    with pytest.raises(ConfigError) as info:
        parse_stack(
            {
                "unique_id": "t",
                "shard_size": 1024,
                "shards_per_block": 2,
                "tiers": [{"type": "fsspec", "uri": "memory://x"}],
            }
        )
    assert "tiers[0].uri: unknown key" in str(info.value)
    assert "tiers[0].url: Field required" in str(info.value)


class SlowMemoryFileSystem(MemoryFileSystem):  # type: ignore[misc]
    """memory:// where every object read or write waits until 8 of them are in flight at once
    (a barrier, bounded): requests issued one at a time, or fewer than 8 at a time, fail."""

    protocol = "slowmem"
    active = 0
    peak = 0
    lock = threading.Lock()
    barrier = threading.Barrier(8, timeout=60)

    def _delay(self) -> None:
        cls = SlowMemoryFileSystem
        with cls.lock:
            cls.active += 1
            cls.peak = max(cls.peak, cls.active)
        try:
            cls.barrier.wait()
        finally:
            with cls.lock:
                cls.active -= 1

    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        self._delay()
        data: bytes = super().cat_file(path, start, end)
        return data

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: object) -> None:
        self._delay()
        super().pipe_file(path, value, mode=mode, **kwargs)


def test_requests_of_a_batch_run_concurrently() -> None:
    register_implementation("slowmem", SlowMemoryFileSystem, clobber=True)
    tier = fsspec_tier("slowmem://ucm-concurrency", LAYOUT, io_threads=8)
    keys = LAYOUT.keys_of_blocks(block_ids(8))
    # 32 dumps and 32 loads, each passing only once 8 are in flight together.
    dump_keys(tier, keys)
    assert_loads_exact(tier, keys)
    assert SlowMemoryFileSystem.peak == 8
    assert not SlowMemoryFileSystem.barrier.broken
    tier.close()


def test_capacity_evicts_oldest_touched_block(tmp_path: Path) -> None:
    object_bytes = HEADER_BYTES + LAYOUT.shard_size
    tier = fsspec_tier(f"file://{tmp_path}", LAYOUT, capacity=6 * object_bytes + 200)
    a, b, c, d = block_ids(4)
    for block in (a, b, c):
        dump_keys(tier, LAYOUT.keys_of_blocks([block]))
        time.sleep(0.02)  # distinct modification times even on a coarse clock
    tier.touch([a, d])  # d is absent: nothing to refresh, no marker
    time.sleep(0.02)
    dump_keys(tier, LAYOUT.keys_of_blocks([d]))
    assert tier.lookup_blocks([a, b, c, d]) == [True, False, True, True]
    assert (tmp_path / a.hex()[:2] / a.hex() / "touch").exists()
    assert not (tmp_path / d.hex()[:2] / d.hex() / "touch").exists()
    stats = tier.stats()
    assert (stats["evictions"], stats["touches"]) == (2, 2)
    tier.close()


def test_touch_without_capacity_renews_the_age_a_namespace_quota_evicts_by(
    tmp_path: Path,
) -> None:
    """Quota eviction drops a namespace's oldest *touched* blocks, so a tier with a namespace
    quota and no ``capacity`` still records touches."""
    object_bytes = HEADER_BYTES + LAYOUT.shard_size
    quotas = NamespaceBytes(named={}, others=6 * object_bytes + 200)  # three blocks
    context = dataclasses.replace(make_context(LAYOUT), options={NAMESPACE_BYTES_OPTION: quotas})
    tier = FsspecTier(FsspecConfig(url=f"file://{tmp_path}"), context)
    a, b, c, d = block_ids(4)
    for block in (a, b, c):
        dump_keys(tier, LAYOUT.keys_of_blocks([block]))
        time.sleep(0.02)  # distinct modification times even on a coarse clock
    tier.touch([a])
    time.sleep(0.02)
    dump_keys(tier, LAYOUT.keys_of_blocks([d]))  # over the quota: the oldest touched goes
    assert tier.lookup_blocks([a, b, c, d]) == [True, False, True, True]
    assert (tmp_path / a.hex()[:2] / a.hex() / "touch").exists()
    assert tier.stats()["touches"] == 1
    tier.close()


def test_evict_sink_failure_keeps_the_shard(memory_url: str) -> None:
    received: list[Key] = []

    def sink(keys: Sequence[Key], views: Sequence[ShardViews]) -> list[Outcome]:
        received.extend(keys)
        return [TierError("down") if k[1] == 0 else None for k in keys]

    object_bytes = HEADER_BYTES + LAYOUT.shard_size
    tier = fsspec_tier(memory_url, LAYOUT, evict_sink=sink, capacity=4 * object_bytes)
    a, b, c = block_ids(3)
    for block in (a, b, c):
        dump_keys(tier, LAYOUT.keys_of_blocks([block]))
        time.sleep(0.01)
    assert received == [(a, 0), (a, 1)]
    assert tier.lookup([(a, 0), (a, 1)]) == [True, False]
    assert_loads_exact(tier, [(a, 0)])
    tier.close()


def test_eviction_keeps_a_shard_it_could_not_read_for_the_write_down(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An object store that fails a GET now and then (throttling, a timeout) but not the
    # DELETE that follows: the shard was never written down, so it must stay here.
    received: list[Key] = []

    def sink(keys: Sequence[Key], views: Sequence[ShardViews]) -> list[Outcome]:
        received.extend(keys)
        return [None] * len(keys)

    object_bytes = HEADER_BYTES + LAYOUT.shard_size
    tier = fsspec_tier(memory_url, LAYOUT, evict_sink=sink, capacity=4 * object_bytes)
    a, b, c = block_ids(3)
    unreadable = f"{a.hex()}/0"
    read = tier.fs.cat_file

    def throttled(path: str, *args: object, **kwargs: object) -> bytes:
        if str(path).endswith(unreadable):
            raise OSError("503 SlowDown")
        return bytes(read(path, *args, **kwargs))

    monkeypatch.setattr(tier.fs, "cat_file", throttled)
    for block in (a, b, c):
        dump_keys(tier, LAYOUT.keys_of_blocks([block]))
        time.sleep(0.01)
    assert received == [(a, 1)]  # (a, 0) could not be read: not written down ...
    assert tier.stats()["evictions"] == 1
    monkeypatch.undo()
    assert tier.lookup([(a, 0), (a, 1)]) == [True, False]  # ... so it is kept
    assert_loads_exact(tier, [(a, 0)])
    tier.close()


def test_eviction_drops_a_leftover_touch_marker(memory_url: str) -> None:
    object_bytes = HEADER_BYTES + LAYOUT.shard_size
    tier = fsspec_tier(memory_url, LAYOUT, capacity=2 * object_bytes)
    orphan, a, b = block_ids(3)
    marker = f"{tier.block_dir(orphan)}/touch"
    tier.fs.pipe_file(marker, b"1")  # shards removed elsewhere, the marker left behind
    time.sleep(0.01)
    dump_keys(tier, LAYOUT.keys_of_blocks([a]))
    time.sleep(0.01)
    dump_keys(tier, [(b, 0)])
    assert not tier.fs.exists(marker)
    assert tier.lookup([(a, 0), (a, 1), (b, 0)]) == [False, False, True]
    tier.close()


@pytest.mark.parametrize("where", ["memory", "file"])
def test_batched_remove_counts_exactly_and_drops_the_marker_of_an_emptied_block(
    memory_url: str, tmp_path: Path, where: str
) -> None:
    # Local filesystems delete path by path and count what existed, listing a block only
    # when it was partly removed; object stores list first (test_s3.py covers that path).
    url = memory_url if where == "memory" else f"file://{tmp_path}"
    tier = fsspec_tier(url, LAYOUT, capacity="1GiB")  # touch markers exist with a capacity
    a, b, absent = block_ids(3)
    dump_keys(tier, LAYOUT.keys_of_blocks([a, b]))
    tier.touch([a, b])
    marker_a = f"{tier.block_dir(a)}/touch"
    marker_b = f"{tier.block_dir(b)}/touch"
    assert tier.fs.exists(marker_a) and tier.fs.exists(marker_b)
    assert tier.batched_remove([(a, 0), (absent, 0), (absent, 1)]) == 1
    assert tier.fs.exists(marker_a)  # shard 1 is still there
    assert tier.batched_remove([(a, 0), (a, 1)]) == 1
    assert not tier.fs.exists(marker_a)  # emptied: checked by listing
    assert tier.batched_remove(LAYOUT.keys_of_blocks([b])) == 2
    assert not tier.fs.exists(marker_b)  # whole block named: no listing needed
    assert tier.lookup(LAYOUT.keys_of_blocks([a, b])) == [False] * 4
    tier.close()
