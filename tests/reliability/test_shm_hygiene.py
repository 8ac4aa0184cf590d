"""Shared-memory hygiene seen through ``ucm.open`` of a buffer stack: owner-only segments, a
process of another uid refused with a clear error, stale segments of a SIGKILLed run replaced,
a mismatched layout version refused, a capacity larger than /dev/shm refused at open."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ucm
from ucm.errors import ConfigError, UcmError
from ucm.native import segments
from ucm.native.segments import SegmentMismatchError, SharedMemoryPermissionError
from ucm.sizes import parse_size

from .conftest import SHARD, Shards, blocks, buffer_stack, payload


def test_buffer_segments_are_owner_only_whatever_the_umask(unique_id: str, tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        with ucm.open(buffer_stack(unique_id, tmp_path / "nvme")):
            ctrl, _, lock = segments.segment_paths(unique_id)
            for path in (ctrl, lock):
                status = path.stat()
                assert status.st_mode & 0o777 == 0o600, path
                assert status.st_uid == os.geteuid()
    finally:
        os.umask(previous)
    assert not segments.ctrl_path(unique_id).exists()


# Imports everything ucm.open needs while still root (the interpreter lives under /root, which
# another user cannot read), then drops to the other uid for good and opens the stack.
OTHER_USER_OPEN = r"""
import json, os, sys
import ucm
import ucm.native.buffer, ucm.native.segments
from ucm import plugins
plugins.load_plugins()
config = json.loads(sys.argv[1])
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
assert os.getuid() == os.geteuid() == 65534
try:
    ucm.open(config).close()
    print(json.dumps({"opened": True}))
except Exception as exc:
    print(json.dumps({"type": type(exc).__name__, "ucm": isinstance(exc, ucm.UcmError),
                      "message": str(exc)}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another uid")
def test_a_process_of_another_uid_cannot_open_the_buffer(unique_id: str, tmp_path: Path) -> None:
    config = buffer_stack(unique_id, tmp_path / "nvme")
    with ucm.open(config) as store:
        completed = subprocess.run(
            [sys.executable, "-c", OTHER_USER_OPEN, json.dumps(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert completed.returncode == 0, completed.stderr
        result = json.loads(completed.stdout)
        lock = segments.segment_paths(unique_id)[2]
        assert result == {
            "type": SharedMemoryPermissionError.__name__,
            "ucm": True,
            "message": (
                f"cannot open the lock file {lock}: permission denied (it belongs to another "
                "user; segments are owner-only, mode 0600)"
            ),
        }
        # The refused process touched nothing: the buffer still serves its owner.
        (block_id,) = blocks(1)
        shards = Shards(1)
        shards.fill([block_id], 0)
        store.wait(store.dump_data([block_id], 0, shards.pointers(1)))
        shards.poison()
        store.wait(store.load_data([block_id], 0, shards.pointers(1)))
        assert shards.data(0) == payload(block_id, 0)


RANK = r"""
import ctypes, json, sys
import ucm
from harness.soak import block_id_of, encode_payload
config = json.loads(sys.argv[1])
rank = int(sys.argv[2])
store = ucm.open(config, device_id=rank, local_rank_size=2)
size = config["shard_size"]
ids = [block_id_of(b"stale", i) for i in range(4)]
memory = [ctypes.create_string_buffer(encode_payload((b, rank), 1, size), size) for b in ids]
store.wait(store.dump_data(ids, rank, [[ctypes.addressof(m)] for m in memory]))
region = store.tiers[0].region
print(json.dumps({"pid": region.creator_pid, "created": region.created}), flush=True)
sys.stdin.read()
"""


def test_stale_segments_of_a_killed_run_are_replaced_at_open(
    unique_id: str, tmp_path: Path
) -> None:
    config = buffer_stack(unique_id, tmp_path / "nvme")
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, json.dumps(config), str(rank)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        opened = []
        for rank in ranks:
            assert rank.stdout is not None
            assert select.select([rank.stdout], [], [], 60)[0], "rank did not open in time"
            opened.append(json.loads(rank.stdout.readline()))
        assert sorted(o["created"] for o in opened) == [False, True]
        creator_pid = opened[0]["pid"]
        assert {o["pid"] for o in opened} == {creator_pid}
    finally:
        for rank in ranks:
            rank.send_signal(signal.SIGKILL)
            rank.wait(10)
    # Every rank of the run is dead; its segments are still there.
    assert segments.ctrl_path(unique_id).exists()
    with ucm.open(config) as store:
        region = store.tiers[0].region
        assert region.created is True
        assert region.replaced_stale is True
        assert region.stale_creator_pid == creator_pid
        # A fresh, empty buffer: nothing of the dead run is resident, every slot is free.
        old = [(b, s) for b in blocks(4, b"stale") for s in range(2)]
        assert store.tiers[0].lookup(old) == [False] * len(old)
        core = store.tiers[0].core
        total = core.geometry.slot_count_total
        assert all(core.slot_info(slot).bucket is None for slot in range(total))
        fresh = blocks(3, b"fresh")
        shards = Shards(3)
        shards.fill(fresh, 1)
        store.wait(store.dump_data(fresh, 1, shards.pointers(3)))
        shards.poison()
        store.wait(store.load_data(fresh, 1, shards.pointers(3)))
        assert [shards.data(i) for i in range(3)] == [payload(b, 1) for b in fresh]


def test_a_mismatched_layout_version_is_refused_at_open(unique_id: str, tmp_path: Path) -> None:
    config = buffer_stack(unique_id, tmp_path / "nvme")
    with ucm.open(config) as first:
        region = first.tiers[0].region
        ctrl = segments.ctrl_path(unique_id)
        # The segment header (layout of the shared files) ...
        segment_version = ctypes.c_uint32.from_address(region.header_address + 8)
        assert segment_version.value == 1
        segment_version.value = 99
        try:
            with pytest.raises(SegmentMismatchError) as refused:
                ucm.open(config)
        finally:
            segment_version.value = 1
        assert isinstance(refused.value, UcmError)
        assert str(refused.value).startswith(
            f"the control segment {ctrl} has layout version 99, this library expects 1: it was "
            "created by another UCM version"
        )
        # ... and the CacheBuffer header inside the control region.
        buffer_version = ctypes.c_uint32.from_address(region.ctrl_address + 8)
        good = buffer_version.value
        buffer_version.value = good + 1
        try:
            with pytest.raises(ConfigError) as wrong_buffer:
                ucm.open(config)
        finally:
            buffer_version.value = good
        assert str(wrong_buffer.value).startswith(
            f"tiers[0] (buffer): the control region has layout version {good + 1}, this "
            "library reads another; every rank of a node must run the same UCM version"
        )
        # The refused open's traceback still references the region it mapped before the
        # CacheBuffer header was refused (BufferTier.__init__ does not close it): drop it now,
        # so its close runs while the buffer exists instead of leaving a stray lock file.
        del refused, wrong_buffer
        gc.collect()
        # Restored: a second rank attaches and shares the first one's bytes.
        (block_id,) = blocks(1)
        shards = Shards(1)
        shards.fill([block_id], 0)
        first.wait(first.dump_data([block_id], 0, shards.pointers(1)))
        with ucm.open(config, device_id=1, local_rank_size=2) as second:
            assert second.tiers[0].region.created is False
            shards.poison()
            second.wait(second.load_data([block_id], 0, shards.pointers(1)))
            assert shards.data(0) == payload(block_id, 0)
            assert second.stats()["hits"] == 1


def _shm_available() -> int:
    status = os.statvfs("/dev/shm")
    return status.f_bavail * status.f_frsize


CAPACITY_ERROR = (
    r"tiers\[0\] \(buffer\): the buffer needs (\d+) bytes of shared memory \((\d+) control "
    r"\+ (\d+) data\) but /dev/shm has (\d+) bytes available and the free huge pages hold "
    r"(\d+) bytes; lower the buffer capacity \(or enlarge /dev/shm\)"
)


@pytest.mark.parametrize(
    "capacity",
    [
        pytest.param("twice", id="twice-dev-shm"),
        pytest.param("10TiB", id="10TiB"),
    ],
)
def test_a_capacity_larger_than_dev_shm_fails_at_open_with_needed_and_available(
    unique_id: str, tmp_path: Path, capacity: str
) -> None:
    config = buffer_stack(unique_id, tmp_path / "nvme")
    config["shard_size"] = 1 << 20
    if capacity == "twice":  # whatever this machine's /dev/shm holds, twice that cannot fit
        capacity = f"{2 * _shm_available() // (1 << 30) + 1}GiB"
    config["tiers"][0]["capacity"] = capacity
    assert parse_size(capacity) > _shm_available(), "the machine's /dev/shm is larger than 10 TiB"
    with pytest.raises(ConfigError) as error:
        ucm.open(config)
    match = re.fullmatch(CAPACITY_ERROR, str(error.value))
    assert match is not None, str(error.value)
    needed, ctrl, data, available = (int(match.group(i)) for i in range(1, 5))
    assert data == parse_size(capacity)
    assert needed == ctrl + data
    assert available < needed
    assert abs(available - _shm_available()) < (1 << 30)  # /dev/shm as statvfs sees it
    # Nothing was created (the creation lock file may stay: it is how ranks serialise opens).
    assert [path.exists() for path in segments.segment_paths(unique_id)[:2]] == [False, False]


def test_a_capacity_beyond_the_slot_limit_names_the_fix(unique_id: str, tmp_path: Path) -> None:
    config = buffer_stack(unique_id, tmp_path / "nvme")
    config["tiers"][0]["capacity"] = "10TiB"  # 4 KiB shards: 2.7e9 slots
    with pytest.raises(ConfigError) as error:
        ucm.open(config)
    assert not any(path.exists() for path in segments.segment_paths(unique_id))
    slots = (10 << 40) // SHARD
    message = str(error.value)
    assert message.startswith(
        f"tiers[0] (buffer): slot_count_regular={slots} is not valid: expected an integer in "
        f"[1, {1 << 30}]"
    )
    assert "smaller capacity" in message, message
