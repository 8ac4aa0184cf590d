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
import struct
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
from ucm.native import lib
plugins.load_plugins()
lib()  # the native library loads on first use: load it while its folder is still readable
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
    # Nothing was created, and the refused open removed the creation lock file it made.
    assert [path.exists() for path in segments.segment_paths(unique_id)] == [False] * 3


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


# --- Nothing left behind: a dead run's names are reclaimed at the next start or by `ucm gc` ---

HOLDER = r"""
import json, sys
import ucm
config = json.loads(sys.argv[1])
with_scheduler = sys.argv[2] == "1"
worker = ucm.open(config, device_id=1, local_rank_size=2)
scheduler = ucm.open(config, device_id=-1) if with_scheduler else None
print(json.dumps({"pid": worker.tiers[0].region.creator_pid}), flush=True)
sys.stdin.read()
# A clean exit the way an engine closes: its worker first, then its scheduler.
worker.close()
if scheduler is not None:
    scheduler.close()
"""


def _start_holder(config: dict[str, object], with_scheduler: bool) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, json.dumps(config), str(int(with_scheduler))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    assert select.select([holder.stdout], [], [], 120)[0], "the holder did not open in time"
    json.loads(holder.stdout.readline())
    return holder


def _names(unique_id: str) -> list[str]:
    return sorted(p.name for p in segments.segment_paths(unique_id) if os.path.lexists(p))


@pytest.mark.parametrize("ending", ["clean", "sigterm", "sigkill"])
def test_a_dead_runs_names_are_gone_after_the_next_open_of_another_buffer(
    unique_id: str, tmp_path: Path, ending: str
) -> None:
    from ucm import shm_gc

    shm_gc.collect()  # the shared /dev/shm's backlog, so the bounded sweep below sees it all
    config = buffer_stack(unique_id, tmp_path / "nvme")
    holder = _start_holder(config, with_scheduler=ending == "clean")
    assert _names(unique_id) == [f"ucm-{unique_id}.ctrl", f"ucm-{unique_id}.lock"]
    assert holder.stdin is not None
    if ending == "clean":
        holder.stdin.close()
    else:
        holder.send_signal(signal.SIGTERM if ending == "sigterm" else signal.SIGKILL)
    assert holder.wait(60) == (0 if ending == "clean" else -getattr(signal, ending.upper()))
    if ending == "clean":
        assert _names(unique_id) == []  # the last closer removed its own lock file
    other = f"{unique_id}-next"
    try:
        with ucm.open(buffer_stack(other, tmp_path / "nvme2")):
            assert _names(unique_id) == []
    finally:
        segments.unlink(other)
    assert _names(other) == []


def test_gc_never_touches_a_live_buffer_under_a_concurrent_gc_loop(
    unique_id: str, tmp_path: Path
) -> None:
    import threading

    from ucm import shm_gc

    live_config = buffer_stack(unique_id, tmp_path / "nvme")
    churn = f"{unique_id}-churn"
    churn_config = buffer_stack(churn, tmp_path / "churn")
    holder = _start_holder(live_config, with_scheduler=False)
    ctrl = segments.ctrl_path(unique_id)
    inode = ctrl.stat().st_ino
    stop = threading.Event()
    verdicts: list[shm_gc.Verdict] = []
    passes = [0]

    def gc_loop() -> None:
        for _ in range(100_000):  # bounded; stopped by the event long before
            if stop.is_set():
                return
            verdicts.extend(shm_gc.collect_one(unique_id).verdicts)
            shm_gc.collect_one(churn)
            passes[0] += 1

    thread = threading.Thread(target=gc_loop, daemon=True)
    thread.start()
    try:
        for round_index in range(6):
            # A rank joins the live buffer, shares bytes with it, and leaves ...
            with ucm.open(live_config, device_id=0, local_rank_size=2) as rank:
                assert rank.tiers[0].region.created is False
                ids = blocks(2, b"live%d" % round_index)
                shards = Shards(2)
                shards.fill(ids, 0)
                rank.wait(rank.dump_data(ids, 0, shards.pointers(2)))
                shards.poison()
                rank.wait(rank.load_data(ids, 0, shards.pointers(2)))
                assert [shards.data(i) for i in range(2)] == [payload(b, 0) for b in ids]
            # ... and a buffer gc races with is created, used and closed.
            with ucm.open(churn_config) as fresh:
                assert fresh.tiers[0].region.created is True
                (block_id,) = blocks(1, b"churn%d" % round_index)
                one = Shards(1)
                one.fill([block_id], 1)
                fresh.wait(fresh.dump_data([block_id], 1, one.pointers(1)))
                one.poison()
                fresh.wait(fresh.load_data([block_id], 1, one.pointers(1)))
                assert one.data(0) == payload(block_id, 1)
            assert ctrl.stat().st_ino == inode
    finally:
        stop.set()
        thread.join(60)
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(60) == 0
        segments.unlink(churn)
    assert passes[0] > 0
    assert verdicts and all(v.action == "kept" for v in verdicts), verdicts
    assert _names(unique_id) == [] and _names(churn) == []


def test_ucm_gc_dry_run_removes_nothing_and_reports_exactly(unique_id: str, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ucm.cli import app

    live_id = f"{unique_id}-live"
    stale = [f"ucm-{unique_id}.ctrl", f"ucm-{unique_id}.lock"]
    try:
        with ucm.open(buffer_stack(live_id, tmp_path / "live")) as live:
            # Killed after the open above, so that open's sweep could not reclaim it.
            holder = _start_holder(buffer_stack(unique_id, tmp_path / "nvme"), False)
            holder.send_signal(signal.SIGKILL)
            holder.wait(60)
            assert _names(unique_id) == stale
            runner = CliRunner()
            for dry_run in (True, False):
                result = runner.invoke(app, ["gc", "--dry-run"] if dry_run else ["gc"])
                assert result.exit_code == 0, result.output
                lines = result.output.splitlines()
                verb = "would remove" if dry_run else "removed"
                assert sorted(line for line in lines if f"/ucm-{unique_id}." in line) == [
                    f"{verb} /dev/shm/{name} (dead: no live process in the attach table "
                    f"(creator pid {holder.pid}))"
                    for name in stale
                ]
                assert sorted(line for line in lines if f"/ucm-{live_id}." in line) == [
                    f"kept /dev/shm/ucm-{live_id}.{suffix} (live: used by pid {os.getpid()})"
                    for suffix in ("ctrl", "lock")
                ]
                listed = [line for line in lines if line.startswith(f"{verb} /dev/shm/")]
                kept = [line for line in lines if line.startswith("kept /dev/shm/")]
                match = re.fullmatch(
                    rf"{verb} (\d+) file\(s\) of \d+ buffer\(s\); kept (\d+) file\(s\) of \d+ "
                    r"buffer\(s\); 0 error\(s\)",
                    lines[-1],
                )
                assert match is not None, lines[-1]
                assert (int(match.group(1)), int(match.group(2))) == (len(listed), len(kept))
                assert _names(unique_id) == (stale if dry_run else [])
                assert _names(live_id) == [f"ucm-{live_id}.ctrl", f"ucm-{live_id}.lock"]
            # The live buffer still serves its owner.
            (block_id,) = blocks(1)
            shards = Shards(1)
            shards.fill([block_id], 0)
            live.wait(live.dump_data([block_id], 0, shards.pointers(1)))
            shards.poison()
            live.wait(live.load_data([block_id], 0, shards.pointers(1)))
            assert shards.data(0) == payload(block_id, 0)
    finally:
        segments.unlink(live_id)


def _fake_ctrl(path: Path, entries: list[tuple[int, int]], magic: int | None = None) -> None:
    """A control segment header as shm.zig writes it: magic, layout version, creator pid at 48,
    the attach table (pid, flags, start time) at 128."""
    from ucm.native import _abi

    header = bytearray(2 * _abi.SEG_HEADER_BYTES)
    struct.pack_into("<QI", header, 0, _abi.SEG_MAGIC if magic is None else magic, 1)
    struct.pack_into("<I", header, 48, entries[0][0] if entries else 4242)
    for index, (pid, start) in enumerate(entries):
        struct.pack_into("<IIQ", header, 128 + 16 * index, pid, 1, start)
    path.write_bytes(bytes(header))


def test_gc_judges_liveness_by_pid_and_start_time_and_never_touches_unknown_files(
    tmp_path: Path,
) -> None:
    from ucm import shm_gc

    me = os.getpid()
    start = shm_gc.process_start_time(me)
    assert start is not None
    _fake_ctrl(tmp_path / "ucm-live.ctrl", [(0, 0), (me, start)])
    _fake_ctrl(tmp_path / "ucm-reused.ctrl", [(me, start + 1)])  # our pid, another process
    _fake_ctrl(tmp_path / "ucm-alien.ctrl", [], magic=0x1234)
    (tmp_path / "ucm-orphan.lock").write_bytes(b"")
    (tmp_path / "ucm-creating.ctrl.init").write_bytes(b"")
    (tmp_path / "other.ctrl").write_bytes(b"")
    (tmp_path / "ucm-.bad.lock").write_bytes(b"")  # no valid unique id: not UCM's
    held = os.open(tmp_path / "ucm-creating.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        import fcntl

        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a creator mid-creation
        dry = shm_gc.collect(dry_run=True, shm_dir=tmp_path)
        assert sorted(os.listdir(tmp_path)) == [
            "other.ctrl",
            "ucm-.bad.lock",
            "ucm-alien.ctrl",
            "ucm-creating.ctrl.init",
            "ucm-creating.lock",
            "ucm-live.ctrl",
            "ucm-orphan.lock",
            "ucm-reused.ctrl",
        ]
        report = shm_gc.collect(shm_dir=tmp_path)
        expected = {
            "alien": ("kept", "unknown: not a UCM segment of layout version 1"),
            "creating": ("kept", "busy: the creation lock is held"),
            "live": ("kept", f"live: used by pid {me}"),
            "orphan": ("removed", "dead: a lock file without a segment"),
            "reused": ("removed", f"dead: no live process in the attach table (creator pid {me})"),
        }
        for result in (dry, report):
            assert {v.unique_id: (v.action, v.reason) for v in result.verdicts} == expected
            assert result.errors == [] and result.not_visited == 0
        assert sorted(p.name for p in dry.removed) == ["ucm-orphan.lock", "ucm-reused.ctrl"]
        # The real pass took and removed the lock files it created for the dead ones.
        assert sorted(p.name for p in report.removed) == [
            "ucm-orphan.lock",
            "ucm-reused.ctrl",
            "ucm-reused.lock",
        ]
        # Kept names stay as they were: gc leaves no lock file of its own beside them.
        assert sorted(os.listdir(tmp_path)) == [
            "other.ctrl",
            "ucm-.bad.lock",
            "ucm-alien.ctrl",
            "ucm-creating.ctrl.init",
            "ucm-creating.lock",
            "ucm-live.ctrl",
        ]
    finally:
        os.close(held)
    # The creator died mid-creation (its lock dropped with it): its names go too.
    report = shm_gc.collect(shm_dir=tmp_path)
    assert sorted(p.name for p in report.removed) == [
        "ucm-creating.ctrl.init",
        "ucm-creating.lock",
    ]


def test_the_sweep_at_open_is_bounded(tmp_path: Path) -> None:
    from ucm import shm_gc

    for index in range(50):
        (tmp_path / f"ucm-orphan{index}.lock").write_bytes(b"")
    report = shm_gc.collect(max_ids=shm_gc.SWEEP_MAX_IDS, budget_s=60.0, shm_dir=tmp_path)
    assert len(report.removed) == shm_gc.SWEEP_MAX_IDS
    assert report.not_visited == 50 - shm_gc.SWEEP_MAX_IDS
    assert len(os.listdir(tmp_path)) == 50 - shm_gc.SWEEP_MAX_IDS


def test_a_ucm_command_sweeps_a_dead_runs_names(unique_id: str) -> None:
    from ucm import shm_gc

    shm_gc.collect()  # the shared /dev/shm's backlog, so the bounded sweep below sees it all
    lock = segments.segment_paths(unique_id)[2]
    lock.touch(mode=0o600)  # what a refused open of an older UCM left
    completed = subprocess.run(
        [sys.executable, "-c", "import sys; from ucm.cli import main; main()", "schema"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["title"]
    assert not os.path.lexists(lock)


def test_an_open_racing_gc_on_the_same_buffer_waits_then_creates_a_fresh_one(
    unique_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    from ucm import shm_gc

    config = buffer_stack(unique_id, tmp_path / "nvme")
    holder = _start_holder(config, with_scheduler=False)
    holder.send_signal(signal.SIGKILL)
    holder.wait(60)
    ctrl = segments.ctrl_path(unique_id)
    stale_inode = ctrl.stat().st_ino
    opened: dict[str, object] = {}

    def opener() -> None:
        with ucm.open(config) as store:
            region = store.tiers[0].region
            opened.update(created=region.created, replaced=region.replaced_stale)
            opened["inode"] = ctrl.stat().st_ino
            (block_id,) = blocks(1, b"race")
            shards = Shards(1)
            shards.fill([block_id], 0)
            store.wait(store.dump_data([block_id], 0, shards.pointers(1)))
            shards.poison()
            store.wait(store.load_data([block_id], 0, shards.pointers(1)))
            opened["bytes"] = shards.data(0) == payload(block_id, 0)

    thread = threading.Thread(target=opener, daemon=True)
    real = shm_gc._ctrl_liveness

    def judged_then_paused(path: Path) -> tuple[bool, str, os.stat_result | None]:
        result = real(path)
        if path == ctrl and not thread.is_alive() and not opened:
            # gc holds the creation lock and has judged the buffer dead: an open starts now.
            thread.start()
            time.sleep(1.0)
            assert opened == {}, "the open did not wait for the creation lock gc holds"
        return result

    monkeypatch.setattr(shm_gc, "_ctrl_liveness", judged_then_paused)
    report = shm_gc.collect_one(unique_id)
    assert [(v.action, sorted(p.name for p in v.paths)) for v in report.verdicts] == [
        ("removed", [f"ucm-{unique_id}.ctrl", f"ucm-{unique_id}.lock"])
    ]
    thread.join(120)
    assert not thread.is_alive()
    # The open retried on a fresh lock and built a fresh buffer: nothing of the dead one.
    assert opened["created"] is True and opened["replaced"] is False
    assert opened["inode"] != stale_inode and opened["bytes"] is True
    assert _names(unique_id) == []
