"""`ucm stats` attached (as the scheduler role, in its own process) to a CacheBuffer that a real
worker process holds: the node-wide numbers it shows are exactly the worker's own."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from _live_buffer import (
    DUMPED,
    LOADED,
    PREALLOCATED,
    RESERVED,
    SHARD,
    SLOTS,
    LiveBuffer,
    live_buffer,
)

from ucm.native.buffer import CTRL_LAYOUT_VERSION, BufferCore
from ucm.native.segments import ctrl_path


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveBuffer]:
    """One worker holding the buffer for every test here: `ucm stats` only reads it."""
    with live_buffer(tmp_path_factory.mktemp("live")) as running:
        yield running


def ucm_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ucm.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_stats_json_is_the_live_buffers_node_wide_state(live: LiveBuffer) -> None:
    shown = ucm_cli("stats", str(live.stack_path), "--json")
    assert shown.returncode == 0, shown.stderr
    data: dict[str, Any] = json.loads(shown.stdout)
    worker = live.worker_view
    assert data["unique_id"] == live.unique_id
    assert data["device_id"] == -1
    # Node-wide: the shared counters, identical to what the worker reads itself.
    assert data["buffer"] == worker["native"]
    assert data["buffer"]["hits"] == LOADED
    assert data["buffer"]["misses"] == DUMPED
    assert data["buffer"]["evictions"] == DUMPED - SLOTS
    assert data["buffer"]["preallocs"] == PREALLOCATED
    assert data["buffer"]["commits_ready"] == DUMPED
    assert data["hit_rate"] == LOADED / (LOADED + DUMPED)
    assert data["occupancy"] == {
        "capacity_slots": SLOTS,
        "reserved_slots": RESERVED,
        "resident": worker["resident"],
        "filling": 0,
        "preallocated": PREALLOCATED,
        "in_use": 0,
        "waiters": 0,
        "free": RESERVED - PREALLOCATED,
        "detached": 0,
        "resident_reserved": 0,
        "resident_fraction": 1.0,
    }
    assert worker["resident"] == SLOTS
    assert data["node_wide"] == [
        "buffer",
        "occupancy",
        "hit_rate",
        "attached_pids",
        "namespaces",
    ]
    # Every key here is the default namespace's: its figures are the buffer's own.
    assert data["namespaces"] == {
        "default": {
            "occupancy_slots": SLOTS + PREALLOCATED,  # linked: Ready and prewarmed
            "occupancy_bytes": (SLOTS + PREALLOCATED) * SHARD,
            "guarantee_slots": 0,
            "cap_slots": SLOTS + RESERVED,
            "hits": data["buffer"]["hits"],
            "misses": data["buffer"]["misses"],
            "evictions": data["buffer"]["evictions"],
        }
    }
    if hasattr(BufferCore, "holders"):  # the holder table: processes registered on the buffer
        assert data["attached_pids"] == [live.pid]
    # This process (the scheduler) did nothing itself; the worker's own Store counters differ.
    assert (data["process"]["hits"], data["process"]["misses"]) == (0, 0)
    assert worker["store"]["hits"] == LOADED
    assert [tier["type"] for tier in data["tiers"]] == ["buffer", "posix"]
    assert "hits" not in data["tiers"][0]  # native counters are reported once, node-wide
    assert data["tiers"][0]["capacity_slots"] == SLOTS


def test_stats_table_shows_occupancy_hit_rate_and_counters(live: LiveBuffer) -> None:
    shown = ucm_cli("stats", str(live.stack_path))
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert f"CacheBuffer '{live.unique_id}'" in out and "node-wide, shared by every rank" in out
    rows = {
        "occupancy": f"{SLOTS} / {SLOTS} slots (100.0%)",
        "reserved pool": f"0 / {RESERVED} resident",
        "hit rate": f"{100 * LOADED / (LOADED + DUMPED):.1f}%",
        "waiters now": "0",
        "preallocated (unclaimed)": str(PREALLOCATED),
        "free": str(RESERVED - PREALLOCATED),
        "evictions": str(DUMPED - SLOTS),
        "prealloc_hits": "0",
        "hits": str(LOADED),
        "misses": str(DUMPED),
    }
    for label, value in rows.items():
        assert re.search(rf"│ {re.escape(label)}\s+│\s+{re.escape(value)} │", out), (label, out)
    assert "tiers as seen by this process" in out and "posix" in out


def test_stats_watch_takes_bounded_readings(live: LiveBuffer) -> None:
    as_json = ucm_cli(
        "stats", str(live.stack_path), "--watch", "--json", "--count", "3", "--interval", "0.2"
    )
    live_view = ucm_cli(
        "stats", str(live.stack_path), "--watch", "--count", "2", "--interval", "0.2"
    )
    assert as_json.returncode == 0, as_json.stderr
    lines = as_json.stdout.splitlines()
    assert len(lines) == 3
    readings = [json.loads(line) for line in lines]
    assert all(reading["buffer"]["hits"] == LOADED for reading in readings)
    stamps = [reading["taken_at"] for reading in readings]
    assert all(later - earlier >= 0.2 for earlier, later in itertools.pairwise(stamps))
    assert live_view.returncode == 0, live_view.stderr
    assert "per s" in live_view.stdout  # the second reading shows rates against the first


def _engine_stack(
    tmp_path: Path, unique_id: str, capacity: int | str, section: bool = False
) -> Path:
    """A stack as an engine (vLLM, SGLang) is given: unique_id and tiers, no geometry; the
    buffer as the first tier, or as its own section (``section``)."""
    stack = tmp_path / f"engine-{uuid.uuid4().hex[:8]}.yaml"
    lower = {"type": "posix", "path": str(tmp_path / "nvme")}
    if section:
        data = {"unique_id": unique_id, "buffer": {"capacity": capacity}, "tiers": [lower]}
    else:
        data = {"unique_id": unique_id, "tiers": [{"type": "buffer", "capacity": capacity}, lower]}
    stack.write_text(yaml.safe_dump(data))
    return stack


def test_stats_takes_the_geometry_from_the_live_buffers_header(
    live: LiveBuffer, tmp_path: Path
) -> None:
    # The engine's stack states no shard_size, tensor_size_list or shards_per_block (the
    # engine derives them), and here not even the capacity the worker opened it with: the live
    # buffer's header says what it is.
    for capacity, section in itertools.product((SLOTS * SHARD, "1GiB"), (False, True)):
        stack = _engine_stack(tmp_path, live.unique_id, capacity, section)
        shown = ucm_cli("stats", str(stack), "--json")
        assert shown.returncode == 0, shown.stderr
        data: dict[str, Any] = json.loads(shown.stdout)
        assert data["unique_id"] == live.unique_id
        assert data["buffer"] == live.worker_view["native"]
        assert (data["occupancy"]["capacity_slots"], data["occupancy"]["reserved_slots"]) == (
            SLOTS,
            RESERVED,
        )
        assert data["occupancy"]["resident"] == SLOTS
        table = ucm_cli("stats", str(stack))
        assert table.returncode == 0, table.stderr
        assert f"{SLOTS} / {SLOTS} slots (100.0%)" in table.stdout


def test_stats_refuses_a_stack_whose_shard_size_is_not_the_live_buffers(
    live: LiveBuffer, tmp_path: Path
) -> None:
    stack = tmp_path / "wrong.yaml"
    config = yaml.safe_load(live.stack_path.read_text())
    config["shard_size"] = 2 * SHARD
    stack.write_text(yaml.safe_dump(config))
    shown = ucm_cli("stats", str(stack))
    assert shown.returncode == 1
    assert " ".join(shown.stderr.split()) == (
        f"invalid: {stack}: the stack states a shard size of {2 * SHARD} bytes, but the live "
        f"CacheBuffer '{live.unique_id}' holds shards of {SHARD} bytes (from its header); leave "
        "shard_size and tensor_size_list out of the stack: `ucm stats` reads them from the live "
        "buffer"
    )


@pytest.mark.parametrize("engine_stack", [False, True], ids=["full-stack", "engine-stack"])
def test_stats_refuses_a_buffer_that_is_not_running(tmp_path: Path, engine_stack: bool) -> None:
    unique_id = f"absent-{uuid.uuid4().hex[:12]}"
    stack = tmp_path / "stack.yaml"
    if engine_stack:
        stack = _engine_stack(tmp_path, unique_id, "64MiB")
    else:
        stack.write_text(
            yaml.safe_dump(
                {
                    "unique_id": unique_id,
                    "shard_size": 4096,
                    "shards_per_block": 1,
                    "tiers": [{"type": "buffer", "capacity": 4096 * 4}],
                }
            )
        )
    shown = ucm_cli("stats", str(stack))
    assert shown.returncode == 1
    assert " ".join(shown.stderr.split()) == (
        f"error: no live CacheBuffer for unique_id '{unique_id}': {ctrl_path(unique_id)} does "
        "not exist; start a rank that opens this stack first (an engine with UCM attached, or "
        "ucm.open with device_id >= 0): `ucm stats` attaches to a running buffer and never "
        "creates one"
    )
    assert not ctrl_path(unique_id).exists()  # looking did not create one


def _posix_only_stack(tmp_path: Path) -> Path:
    """A stack file without a buffer: one posix tier under ``tmp_path``."""
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        yaml.safe_dump(
            {
                "unique_id": "posix-only",
                "shard_size": 4096,
                "shards_per_block": 1,
                "tiers": [{"type": "posix", "path": str(tmp_path / "nvme")}],
            }
        )
    )
    return stack


def test_stats_on_a_stack_without_buffer_and_on_a_bad_stack(tmp_path: Path) -> None:
    stack = _posix_only_stack(tmp_path)
    shown = ucm_cli("stats", str(stack), "--json")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert (data["buffer"], data["occupancy"], data["hit_rate"]) == (None, None, None)
    assert data["tiers"][0]["type"] == "posix"
    stack.write_text("unique_id: x\nshard_size: 0\ntiers: []\n")
    bad = ucm_cli("stats", str(stack))
    assert bad.returncode == 1
    assert bad.stderr.startswith("invalid:")


@pytest.mark.parametrize("size", [100, 4096 + 256], ids=["too-short", "not-a-buffer"])
def test_stats_refuses_a_control_segment_that_is_not_a_cachebuffer(
    tmp_path: Path, size: int
) -> None:
    from ucm.native.segments import unlink

    unique_id = f"foreign-{uuid.uuid4().hex[:12]}"
    stack = _engine_stack(tmp_path, unique_id, "64MiB")
    ctrl_path(unique_id).write_bytes(b"\x01" * size)
    try:
        shown = ucm_cli("stats", str(stack))
    finally:
        unlink(unique_id)
    assert shown.returncode == 1
    message = " ".join(shown.stderr.split())
    if size == 100:
        assert message == (
            f"invalid: {stack}: unique_id '{unique_id}': {ctrl_path(unique_id)} is too short to "
            "hold a CacheBuffer header; remove it if no UCM process uses it"
        )
    else:
        assert message == (
            f"invalid: {stack}: unique_id '{unique_id}': {ctrl_path(unique_id)} holds no "
            "CacheBuffer this library reads (magic 0x0101010101010101, layout version 16843009; "
            f"this library reads layout version {CTRL_LAYOUT_VERSION}): it is not a UCM "
            "CacheBuffer, or one of another UCM version (every process of a node must run the "
            "same UCM version)"
        )


def test_stats_serve_on_a_port_in_use_is_a_clean_error(tmp_path: Path) -> None:
    # It printed a traceback ending in the InvalidArgumentError.
    import socket

    stack = _posix_only_stack(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = ucm_cli("stats", str(stack), "--serve", str(port))
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"error: --serve {port}: port={port} is not valid: cannot listen on it ([Errno 98] "
        "Address already in use)\n"
    )


def test_stats_of_an_invalid_stack_names_its_problem_before_looking_for_a_buffer(
    tmp_path: Path,
) -> None:
    # It said "no live CacheBuffer ... start a rank", hiding the stack's own error.
    stack = tmp_path / "badsize.yaml"
    stack.write_text(
        f"unique_id: bad-{uuid.uuid4().hex[:8]}\nshard_size: 12XB\nshards_per_block: 1\n"
        "buffer: {capacity: 1MiB}\n"
    )
    result = ucm_cli("stats", str(stack))
    assert result.returncode == 1
    assert result.stderr == (
        f"invalid: {stack}: invalid stack:\n  shard_size: Value error, invalid size '12XB': "
        "expected an integer byte count or a string like '64GiB', '512MiB', '4096', '1.5GB' "
        "(got '12XB')\n"
    )
    # An engine's stack (no geometry: the live buffer gives it) is checked as well.
    stack.write_text(
        f"unique_id: bad-{uuid.uuid4().hex[:8]}\ntiers:\n  - {{type: buffer, capacity: 1MiB, "
        "load_workers: 0}\n"
    )
    result = ucm_cli("stats", str(stack))
    assert result.returncode == 1
    assert result.stderr == (
        f"invalid: {stack}: invalid stack:\n  tiers[0].load_workers: Input should be greater "
        "than or equal to 1 (got 0)\n"
    )
