"""The shared-memory segment layer (core-native/src/shm.zig, memfd.zig, fdpass.zig) with real
rank processes: atomic creation and attach, shared bytes, stale replacement, validation, the
huge-page fallback, the scheduler role, the SO_PEERCRED refusal and bounded close."""

from __future__ import annotations

import ctypes
import json
import os
import re
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ucm.errors import InvalidArgumentError
from ucm.native import segments
from ucm.native.segments import (
    SegmentMismatchError,
    SharedMemoryCapacityError,
    SharedRegion,
)

RANK_SCRIPT = Path(__file__).with_name("seg_rank.py")
CTRL_BYTES = 8192
SEGMENT_BYTES = 1 << 20
DATA_BYTES = 2 * SEGMENT_BYTES
READ_TIMEOUT_S = 20.0


class Rank:
    """A seg_rank.py process driven line by line."""

    def __init__(self, unique_id: str, role: str = "worker", delay_s: float = 0.0) -> None:
        args = [unique_id, str(CTRL_BYTES), str(DATA_BYTES), str(SEGMENT_BYTES), role]
        self.process = subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), *args, str(delay_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._opened: dict[str, object] | None = None

    def _read(self) -> dict[str, object]:
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            assert selector.select(READ_TIMEOUT_S), "rank process did not answer in time"
        line = self.process.stdout.readline()
        assert line, f"rank process exited with {self.process.poll()}"
        result: dict[str, object] = json.loads(line)
        return result

    @property
    def opened(self) -> dict[str, object]:
        if self._opened is None:
            self._opened = self._read()
        return self._opened

    def cmd(self, line: str) -> dict[str, object]:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self._read()

    def finish(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


@pytest.fixture
def unique_id() -> Iterator[str]:
    name = f"segtest-{uuid.uuid4().hex[:12]}"
    yield name
    segments.unlink(name)


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    started: list[Rank] = []
    yield started
    for rank in started:
        rank.finish()


def test_racing_ranks_have_exactly_one_creator_and_share_every_byte(
    unique_id: str, ranks: list[Rank]
) -> None:
    ranks.extend(Rank(unique_id) for _ in range(6))
    opened = [rank.opened for rank in ranks]
    assert [o["event"] for o in opened] == ["open"] * 6
    creators = [o for o in opened if o["created"]]
    assert len(creators) == 1
    creator_pid = creators[0]["pid"]
    # Everyone sees the creator's init: the segment was never visible before it ran.
    assert {o["init_pid"] for o in opened} == {creator_pid}
    assert {o["creator_pid"] for o in opened} == {creator_pid}
    for index, rank in enumerate(ranks):
        rank.cmd(f"wctrl {64 + index} {index + 1:02x}")
        rank.cmd(f"wdata {SEGMENT_BYTES + 4096 * index} {bytes([0xA0 + index] * 4).hex()}")
    expected_ctrl = bytes(range(1, 7)).hex()
    for rank in ranks:
        assert rank.cmd("rctrl 64 6")["hex"] == expected_ctrl
        for index in range(6):
            got = rank.cmd(f"rdata {SEGMENT_BYTES + 4096 * index} 4")["hex"]
            assert got == bytes([0xA0 + index] * 4).hex()
        assert rank.cmd("rdata 0 4")["hex"] == b"DATA".hex()
    for path in (segments.ctrl_path(unique_id), segments.segment_paths(unique_id)[2]):
        assert path.stat().st_mode & 0o777 == 0o600
    for rank in ranks:  # bounded: never a hang (the socket timeout is 2 s per peer)
        assert float(rank.cmd("close")["seconds"]) < 30.0  # type: ignore[arg-type]
    assert not segments.ctrl_path(unique_id).exists()


def test_start_order_is_irrelevant_and_the_buffer_outlives_its_creator(
    unique_id: str, ranks: list[Rank]
) -> None:
    # Staggered, in another order than they are started; which one wins depends on the
    # scheduler of a loaded machine, so only "exactly one, and everyone sees its init" holds.
    ranks.extend(Rank(unique_id, delay_s=delay) for delay in (0.4, 0.0, 0.2))
    opened = [rank.opened for rank in ranks]
    creators = [index for index, o in enumerate(opened) if o["created"]]
    assert len(creators) == 1
    creator = ranks[creators[0]]
    assert {o["init_pid"] for o in opened} == {creator.opened["pid"]}
    creator.cmd(f"wdata {SEGMENT_BYTES + 8} {b'kept'.hex()}")
    creator.cmd("close")
    # A late rank gets the data descriptors from a surviving worker, not from the creator.
    late = Rank(unique_id)
    ranks.append(late)
    assert late.opened["created"] is False
    assert late.cmd(f"rdata {SEGMENT_BYTES + 8} 4")["hex"] == b"kept".hex()
    assert late.opened["init_pid"] == creator.opened["pid"]


def test_stale_segment_of_a_killed_creator_is_replaced(unique_id: str, ranks: list[Rank]) -> None:
    first = Rank(unique_id)
    ranks.append(first)
    assert first.opened["created"] is True
    first.cmd(f"wdata 100 {b'old!'.hex()}")
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(10)
    assert segments.ctrl_path(unique_id).exists()
    second = Rank(unique_id)
    ranks.append(second)
    assert second.opened["created"] is True
    assert second.opened["replaced_stale"] is True
    assert second.opened["stale_creator_pid"] == first.opened["pid"]
    assert second.opened["init_pid"] == second.opened["pid"]
    assert second.cmd("rdata 100 4")["hex"] == "00000000"


def test_killed_creator_with_a_live_rank_is_not_stale(unique_id: str, ranks: list[Rank]) -> None:
    creator = Rank(unique_id)
    ranks.append(creator)
    assert creator.opened["created"] is True
    survivor = Rank(unique_id)
    ranks.append(survivor)
    assert survivor.opened["created"] is False
    survivor.cmd(f"wdata 200 {b'live'.hex()}")
    creator.process.send_signal(signal.SIGKILL)
    creator.process.wait(10)
    late = Rank(unique_id)
    ranks.append(late)
    assert late.opened["created"] is False
    assert late.opened["replaced_stale"] is False
    assert late.cmd("rdata 200 4")["hex"] == b"live".hex()


def test_mismatched_layout_version_magic_and_geometry_are_refused(unique_id: str) -> None:
    with SharedRegion.open(unique_id, CTRL_BYTES, DATA_BYTES, SEGMENT_BYTES) as region:
        version = ctypes.c_uint32.from_address(region.header_address + 8)
        version.value = 99
        path = segments.ctrl_path(unique_id)
        with pytest.raises(SegmentMismatchError) as refused:
            SharedRegion.open(unique_id, CTRL_BYTES, DATA_BYTES, SEGMENT_BYTES)
        assert str(refused.value).startswith(
            f"the control segment {path} has layout version 99, this library expects 1: "
        )
        version.value = 1
        magic = ctypes.c_uint64.from_address(region.header_address)
        good_magic = magic.value
        magic.value = 0x1234
        with pytest.raises(SegmentMismatchError) as bad_magic:
            SharedRegion.open(unique_id, CTRL_BYTES, DATA_BYTES, SEGMENT_BYTES)
        assert str(bad_magic.value).startswith(
            f"the control segment {path} has magic 0x0000000000001234, expected "
            f'0x{good_magic:016x} ("UCM-SEG1")'
        )
        magic.value = good_magic
        with pytest.raises(SegmentMismatchError) as geometry:
            SharedRegion.open(unique_id, CTRL_BYTES, 2 * DATA_BYTES, SEGMENT_BYTES)
        assert str(geometry.value) == (
            f"the buffer {unique_id} exists with ctrl_bytes={CTRL_BYTES} "
            f"data_bytes={DATA_BYTES} segment_bytes={SEGMENT_BYTES}, this process asked for "
            f"ctrl_bytes={CTRL_BYTES} data_bytes={2 * DATA_BYTES} segment_bytes={SEGMENT_BYTES}"
            ": all ranks must open it with the same capacity and layout"
        )
        with pytest.raises(SegmentMismatchError, match="control layout version 0, this process"):
            SharedRegion.open(
                unique_id, CTRL_BYTES, DATA_BYTES, SEGMENT_BYTES, ctrl_layout_version=5
            )


def test_capacity_larger_than_dev_shm_fails_naming_needed_and_available(unique_id: str) -> None:
    data_bytes = 1 << 40
    with pytest.raises(SharedMemoryCapacityError) as error:
        SharedRegion.open(unique_id, CTRL_BYTES, data_bytes, 1 << 32)
    assert isinstance(error.value, InvalidArgumentError)
    match = re.fullmatch(
        r"the buffer needs (\d+) bytes of shared memory \((\d+) control \+ (\d+) data\) but "
        r"/dev/shm has (\d+) bytes available and the free huge pages hold (\d+) bytes; "
        r"lower the buffer capacity \(or enlarge /dev/shm\)",
        str(error.value),
    )
    assert match is not None, str(error.value)
    needed, ctrl, data, available = (int(match.group(i)) for i in range(1, 5))
    assert (ctrl, data) == (4096 + CTRL_BYTES, data_bytes)
    assert needed == ctrl + data
    assert available < needed
    assert not any(path.exists() for path in segments.segment_paths(unique_id)[:2])


def _free_huge_pages() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("HugePages_Free:"):
            return int(line.split()[1])
    return 0


def _shmem_thp_enabled() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    text = path.read_text() if path.exists() else "[never]"
    return "[never]" not in text and "[deny]" not in text


@pytest.mark.skipif(_free_huge_pages() > 0, reason="this machine has hugetlb pages to use")
def test_hugetlb_falls_back_to_a_normal_memfd_and_reports_it(unique_id: str) -> None:
    expected_mode = "thp" if _shmem_thp_enabled() else "none"
    with SharedRegion.open(unique_id, CTRL_BYTES, 4 << 20, 2 << 20, hugetlb="try") as tried:
        assert tried.huge_pages == expected_mode
        assert tried.hugetlb_fallback == "mmap of the hugetlb memfd failed (ENOMEM)"
        ctypes.memmove(tried.data_address + (4 << 20) - 4, b"tail", 4)
        assert ctypes.string_at(tried.data_address + (4 << 20) - 4, 4) == b"tail"
    with SharedRegion.open(unique_id, CTRL_BYTES, 4 << 20, 2 << 20) as auto:
        assert auto.huge_pages == expected_mode
        assert auto.hugetlb_fallback == "not enough free hugetlb pages"
    with SharedRegion.open(unique_id, CTRL_BYTES, DATA_BYTES, SEGMENT_BYTES) as small:
        assert small.hugetlb_fallback == "segment_bytes is not a multiple of the huge page size"


def test_open_allocates_no_data_and_unpopulated_pages_serve_correct_bytes(
    unique_id: str,
) -> None:
    data_bytes = 64 << 20
    with SharedRegion.open(unique_id, CTRL_BYTES, data_bytes, 32 << 20) as region:
        lazy = region.residency()
        assert (lazy.resident_bytes, lazy.data_bytes) == (0, data_bytes)
        assert (lazy.populated_bytes, lazy.populate_threads, lazy.populate_error) == (0, 0, None)
        # A page nobody populated reads as zeros and keeps what is written to it.
        address = region.data_address + data_bytes - 4096
        assert ctypes.string_at(address, 4096) == bytes(4096)
        ctypes.memmove(address, b"x" * 4096, 4096)
        assert ctypes.string_at(address, 4096) == b"x" * 4096
        assert region.residency().resident_bytes == 4096
        with SharedRegion.open(unique_id, CTRL_BYTES, data_bytes, 32 << 20) as second:
            assert ctypes.string_at(second.data_address + data_bytes - 4096, 4096) == b"x" * 4096


def test_background_population_makes_the_whole_data_plane_resident(unique_id: str) -> None:
    data_bytes = 96 << 20
    with SharedRegion.open(unique_id, CTRL_BYTES, data_bytes, 32 << 20) as region:
        ctypes.memmove(region.data_address + 5, b"kept", 4)
        assert region.populate(2) == 2
        assert region.populate(2) == 0  # once per region
        deadline = time.monotonic() + 60
        while region.residency().populate_seconds is None and time.monotonic() < deadline:
            time.sleep(0.01)
        done = region.residency()
        assert (done.resident_bytes, done.populated_bytes) == (data_bytes, data_bytes)
        assert done.populate_threads == 2 and done.populate_error is None
        assert done.populate_seconds is not None and done.populate_seconds > 0
        assert ctypes.string_at(region.data_address + 5, 4) == b"kept"  # population writes no byte
    with (
        SharedRegion.open(unique_id, CTRL_BYTES, DATA_BYTES, SEGMENT_BYTES) as region,
        pytest.raises(InvalidArgumentError, match=r"threads=9 is not valid: expected an int"),
    ):
        region.populate(9)


def test_close_stops_background_population_promptly(unique_id: str) -> None:
    data_bytes = 2 << 30  # far more than two threads fault in before close
    with SharedRegion.open(unique_id, CTRL_BYTES, data_bytes, 1 << 30) as region:
        region.populate(2)
        started = time.monotonic()
    assert time.monotonic() - started < 5.0


def test_a_forked_child_closing_the_region_neither_hangs_nor_detaches_the_parent(
    unique_id: str,
) -> None:
    data_bytes = 2 << 30  # population is still running when the child closes
    with SharedRegion.open(unique_id, CTRL_BYTES, data_bytes, 1 << 30) as region:
        assert region.populate(2) == 2
        ctypes.memmove(region.data_address + 7, b"parent", 6)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the parent's populate threads do not exist here
            region.close()
            os.write(write, b"closed")
            os._exit(0)
        os.close(write)
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung closing its copy of the region")
        assert status == 0
        assert os.read(read, 16) == b"closed"
        os.close(read)
        # The parent still holds its attach entry: a second open shares its bytes.
        with SharedRegion.open(unique_id, CTRL_BYTES, data_bytes, 1 << 30) as second:
            assert ctypes.string_at(second.data_address + 7, 6) == b"parent"
        assert region.residency().data_bytes == data_bytes


def test_scheduler_maps_the_control_segment_only(unique_id: str, ranks: list[Rank]) -> None:
    scheduler = Rank(unique_id, role="scheduler")
    ranks.append(scheduler)
    # A scheduler that creates still creates and serves the data, without mapping it.
    assert scheduler.opened["created"] is True
    assert scheduler.opened["data_address"] == 0
    assert scheduler.opened["serves_data"] is True
    with SharedRegion.open(unique_id, CTRL_BYTES, DATA_BYTES, SEGMENT_BYTES) as worker:
        assert worker.created is False
        # Created by the scheduler, so nobody wrote the data yet: zero pages.
        assert ctypes.string_at(worker.segment_address(1), 4) == bytes(4)
        ctypes.memmove(worker.ctrl_address + 32, b"seen", 4)
        with SharedRegion.open(
            unique_id, CTRL_BYTES, DATA_BYTES, SEGMENT_BYTES, "scheduler"
        ) as attached:
            assert attached.data_address == 0
            assert attached.segment_address(1) == 0
            assert attached.serves_data is False
            assert ctypes.string_at(attached.ctrl_address + 32, 4) == b"seen"
        assert scheduler.cmd("rctrl 32 4")["hex"] == b"seen".hex()


def test_fd_server_refuses_a_peer_with_another_uid_hook(unique_id: str, ranks: list[Rank]) -> None:
    with SharedRegion.open(unique_id, CTRL_BYTES, DATA_BYTES, SEGMENT_BYTES) as region:
        region.debug_set_peer_uid(os.geteuid() + 1)
        rank = Rank(unique_id)
        ranks.append(rank)
        assert rank.opened == {
            "event": "error",
            "type": "SharedMemoryPermissionError",
            "message": (
                f"the fd server of pid {os.getpid()} refused to hand out the data segments: "
                f"peer uid {os.geteuid()} is not its uid {os.geteuid() + 1} (only processes "
                "of the same user may attach)"
            ),
        }
        assert region.refused_count == 1
        assert region.served_count == 0


OTHER_USER_SCRIPT = r"""
import json, os, socket, struct, sys
result = {"uid": os.geteuid()}
try:
    open(sys.argv[2], "rb")
    result["open"] = "opened"
except PermissionError:
    result["open"] = "permission denied"
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.settimeout(10)
sock.connect(sys.argv[1].encode().replace(b"@", b"\0", 1))
data, ancdata, flags, _ = sock.recvmsg(64, socket.CMSG_SPACE(64 * 4))
result["reply"] = list(struct.unpack("8I", data))
result["fds"] = len(ancdata)
print(json.dumps(result))
"""


# The client only needs the standard library; the venv interpreter may live under a directory
# (e.g. /root/.pyenv) the other user cannot enter, the system one does not.
SYSTEM_PYTHON = Path("/usr/bin/python3")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="no system python for the other user")
def test_fd_server_refuses_a_real_process_of_another_user(unique_id: str) -> None:
    other_uid = 65534
    with SharedRegion.open(unique_id, CTRL_BYTES, DATA_BYTES, SEGMENT_BYTES) as region:
        address = f"@ucm-{unique_id}-{os.getpid()}-{region.entry_index}"
        ctrl = segments.ctrl_path(unique_id)
        completed = subprocess.run(
            [SYSTEM_PYTHON, "-I", "-c", OTHER_USER_SCRIPT, address, str(ctrl)],
            cwd="/",
            user=other_uid,
            group=other_uid,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert completed.returncode == 0, completed.stderr
        result = json.loads(completed.stdout)
        assert result["uid"] == other_uid
        assert result["open"] == "permission denied"
        magic = struct.unpack("<I", b"FMCU")[0]
        # Reply: magic, status 1 (refused), 2 segments, first 0, chunk 0, peer uid, our uid.
        assert result["reply"] == [magic, 1, 2, 0, 0, other_uid, os.geteuid(), 0]
        assert result["fds"] == 0
        assert region.refused_count == 1


def test_close_never_hangs_even_with_a_stalled_client(unique_id: str) -> None:
    region = SharedRegion.open(unique_id, CTRL_BYTES, DATA_BYTES, SEGMENT_BYTES)
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stalled.connect(f"\0ucm-{unique_id}-{os.getpid()}-{region.entry_index}".encode())
    start = time.monotonic()
    region.close()
    assert time.monotonic() - start < 30.0  # bounded: the stalled client is not waited for
    assert region.closed
    region.close()  # idempotent
    stalled.close()
    assert not segments.ctrl_path(unique_id).exists()


def test_a_rank_that_exits_without_close_exits_promptly(unique_id: str, ranks: list[Rank]) -> None:
    rank = Rank(unique_id)
    ranks.append(rank)
    assert rank.opened["created"] is True
    rank.cmd("exit")
    assert rank.process.wait(30) == 0
    # The finalizer closed it at exit: the last holder unlinked the control segment.
    assert not segments.ctrl_path(unique_id).exists()


def test_a_failing_initialiser_publishes_nothing(unique_id: str) -> None:
    def init(region: SharedRegion) -> None:
        raise RuntimeError("init failed")

    with pytest.raises(RuntimeError, match="init failed"):
        SharedRegion.open(unique_id, CTRL_BYTES, DATA_BYTES, SEGMENT_BYTES, init=init)
    assert not any(path.exists() for path in segments.segment_paths(unique_id)[:2])
    with SharedRegion.open(unique_id, CTRL_BYTES, DATA_BYTES, SEGMENT_BYTES) as region:
        assert region.created is True


def test_segments_are_owner_only_whatever_the_umask(unique_id: str) -> None:
    previous = os.umask(0)
    try:
        with SharedRegion.open(unique_id, CTRL_BYTES, DATA_BYTES, SEGMENT_BYTES):
            for path in (segments.ctrl_path(unique_id), segments.segment_paths(unique_id)[2]):
                assert path.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(previous)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"unique_id": "../etc"},
            "unique_id='../etc' is not valid: expected 1 to 64 characters among "
            "A-Z a-z 0-9 _ - . not starting with '.' or '-'",
        ),
        ({"ctrl_bytes": 0}, "ctrl_bytes=0 is not valid: expected a positive int"),
        (
            {"segment_bytes": 1000},
            "segment_bytes=1000 is not valid: expected a positive multiple of the 4096-byte page",
        ),
        (
            {"data_bytes": SEGMENT_BYTES + 4096},
            f"data_bytes={SEGMENT_BYTES + 4096} is not valid: expected a positive multiple of "
            f"segment_bytes={SEGMENT_BYTES}, at most 17592186044416",
        ),
        ({"role": "boss"}, "role='boss' is not valid: expected 'worker' or 'scheduler'"),
        ({"hugetlb": "yes"}, "hugetlb='yes' is not valid: expected 'auto', 'off' or 'try'"),
        ({"timeout_s": -1}, "timeout_s=-1 is not valid: expected a finite number > 0"),
    ],
)
def test_bad_arguments_name_the_argument_and_value(
    unique_id: str, kwargs: dict[str, object], message: str
) -> None:
    arguments: dict[str, object] = {
        "unique_id": unique_id,
        "ctrl_bytes": CTRL_BYTES,
        "data_bytes": DATA_BYTES,
        "segment_bytes": SEGMENT_BYTES,
    }
    arguments.update(kwargs)
    with pytest.raises(InvalidArgumentError) as error:
        SharedRegion.open(**arguments)  # type: ignore[arg-type]
    assert str(error.value) == message
    assert not segments.ctrl_path(unique_id).exists()
