"""Prometheus metrics: the collector's exposition (no network), the loopback endpoint scraped
over HTTP, and `ucm stats --serve` scraped while it attaches to a worker's live buffer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _live_buffer import DUMPED, LOADED, PREALLOCATED, SLOTS, live_buffer
from prometheus_client.parser import text_string_to_metric_families

import ucm
from ucm import metrics
from ucm.errors import InvalidArgumentError
from ucm.native.buffer import GetResult, State

SHARD = 4096


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition keyed by (name, sorted labels without unique_id)."""
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "unique_id"))
            found[(sample.name, labels)] = sample.value
    return found


def stack_config(tmp_path: Path, **buffer: Any) -> dict[str, Any]:
    """A buffer of 16 shards (``buffer``: more of its keys) over a posix tier; a fresh id."""
    return {
        "unique_id": f"metrics-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [
            {"type": "buffer", "capacity": 16 * SHARD, **buffer},
            {"type": "posix", "path": str(tmp_path / "nvme")},
        ],
    }


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ucm.Store]:
    config = stack_config(tmp_path, reserved_slots=2)
    with ucm.open(config) as opened:
        yield opened
    from ucm.native.segments import unlink

    unlink(config["unique_id"])


def blocks(count: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(16, "big") for i in range(start, start + count)]


def fill(store: ucm.Store, count: int, start: int = 0) -> None:
    """Dumps `count` new blocks (Get misses) and loads them back (Get hits)."""
    ids = blocks(count, start)
    src = [[torch.full((SHARD,), 7, dtype=torch.uint8)] for _ in ids]
    store.wait(store.dump(ids, [0] * count, src))
    dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in ids]
    store.wait(store.load(ids, [0] * count, dst))


WAITER = r"""
import json, sys
import ucm
from ucm.native.buffer import GetResult

config, key_hex = json.loads(sys.argv[1]), sys.argv[2]
with ucm.open(config, device_id=1, local_rank_size=2) as store:
    got = store.tiers[0].core.get([(bytes.fromhex(key_hex), 0)])
    print(GetResult(got.results[0]).name, flush=True)
    sys.stdin.read()  # hold the reference until the test closes our stdin
"""


def test_occupancy_counts_every_slot_state(store: ucm.Store) -> None:
    fill(store, 3)
    core: Any = store.tiers[0].core  # type: ignore[attr-defined]
    key = (blocks(1, start=100)[0], 0)
    owner = core.get([key])
    assert GetResult(owner.results[0]) is GetResult.OWNER
    # Another rank (a real process) asks for the key being filled: it becomes a waiter.
    waiter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            WAITER,
            json.dumps(store.config.model_dump(mode="json")),
            key[0].hex(),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert waiter.stdout is not None and waiter.stdin is not None
        assert waiter.stdout.readline() == "WAITER\n"
        shot = metrics.snapshot(store)
        assert shot.occupancy == metrics.Occupancy(
            capacity_slots=16,
            reserved_slots=2,
            resident=3,
            filling=1,
            preallocated=0,
            in_use=1,
            waiters=1,
            free=14,
            detached=0,
            resident_reserved=0,
        )
        if hasattr(core, "holders"):
            assert shot.attached_pids is not None
            assert {os.getpid(), waiter.pid} <= set(shot.attached_pids)
        core.commit(list(owner.slots), [State.READY])
        core.release(list(owner.slots))
    finally:
        if waiter.stdin is not None:
            waiter.stdin.close()
        waiter.wait(timeout=30)
    assert core.remove([(blocks(1)[0], 0)]) == 1
    shot = metrics.snapshot(store)
    assert shot.occupancy is not None
    assert (shot.occupancy.resident, shot.occupancy.filling) == (3, 0)
    assert shot.occupancy.free == 15
    assert shot.buffer is not None and shot.buffer["removed"] == 1
    assert shot.process["hits"] == 3  # this process's Store counted its own load


def test_render_exposes_node_wide_and_process_metrics(store: ucm.Store) -> None:
    fill(store, 4)
    found = samples(metrics.render(store).decode())
    native = store.tiers[0].core.stats()  # type: ignore[attr-defined]
    for name, value in native.items():
        suffix = "" if name in metrics.NODE_WIDE_GAUGES else "_total"
        assert found[(f"ucm_buffer_{name}{suffix}", ())] == value, name
    assert metrics.NODE_WIDE_GAUGES == ("dirty_slots",)
    assert found[("ucm_buffer_hits_total", ())] == 4
    assert found[("ucm_buffer_misses_total", ())] == 4
    assert found[("ucm_buffer_hit_ratio", ())] == 0.5
    assert found[("ucm_buffer_slots", (("state", "resident"),))] == 4
    assert found[("ucm_buffer_slots", (("state", "free"),))] == 14
    assert found[("ucm_buffer_capacity_slots", ())] == 16
    assert found[("ucm_buffer_reserved_slots", ())] == 2
    assert found[("ucm_buffer_waiters", ())] == 0
    rank = (("device_id", "0"),)
    assert found[("ucm_store_hits_total", rank)] == 4
    assert found[("ucm_store_dumped_shards_total", rank)] == 4
    assert found[("ucm_store_hit_rate", rank)] == 1.0
    posix = (("device_id", "0"), ("tier", "1"), ("type", "posix"))
    assert ("ucm_tier_bytes_written", posix) in found
    buffer_tier = (("device_id", "0"), ("tier", "0"), ("type", "buffer"))
    assert found[("ucm_tier_capacity_slots", buffer_tier)] == 16
    assert ("ucm_tier_hits", buffer_tier) not in found  # native counters only once, node-wide


def test_serve_answers_a_scrape_on_loopback_and_stops(store: ucm.Store) -> None:
    fill(store, 2)
    with metrics.serve(store, port=0) as server:
        assert server.port > 0
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(server.url, timeout=10) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            first = samples(response.read().decode())
        assert first[("ucm_buffer_hits_total", ())] == 2
        fill(store, 2, start=10)  # read on every scrape: the next one sees the new hits
        with urllib.request.urlopen(server.url, timeout=10) as response:
            second = samples(response.read().decode())
        assert second[("ucm_buffer_hits_total", ())] == 4
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=5)


SCRAPE_AFTER_CLOSE = r"""
import ctypes, json, sys
import ucm
from prometheus_client import generate_latest
from ucm import metrics

store = ucm.open(json.loads(sys.argv[1]))
registry = metrics.registry_for(store)
page = ctypes.create_string_buffer(4096)
store.wait(store.dump_data([bytes(16)], [0], [[ctypes.addressof(page)]]))
store.close()
snap = metrics.snapshot(store)  # the buffer's shared memory is unmapped now
text = generate_latest(registry).decode()
print(snap.buffer, snap.process["dump_tasks"], "ucm_store_dump_tasks_total{" in text)
"""


def test_a_snapshot_or_scrape_of_a_closed_store_reads_nothing_it_unmapped(tmp_path: Path) -> None:
    """A scrape that comes as (or after) the engine closes its store: the node-wide figures
    are left out, the process's counters are what it had at close. Before, the snapshot read
    the unmapped buffer and the process died of SIGSEGV."""
    config = stack_config(tmp_path)
    unique_id = config["unique_id"]
    from ucm.native.segments import unlink

    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRAPE_AFTER_CLOSE, json.dumps(config)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        unlink(unique_id)  # the node-wide segments outlive the store by design
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["None", "1", "True"]


def test_close_waits_for_a_reader_of_the_stores_native_memory(store: ucm.Store) -> None:
    """Store.reading() holds off close()'s unmapping while a scrape reads the buffer."""
    import threading

    closed = threading.Event()
    closer = threading.Thread(target=lambda: (store.close(), closed.set()))
    with store.reading() as live:
        assert live
        closer.start()
        # close() finishes its tasks and flushes, then waits here for the reader.
        assert not closed.wait(1.0)
        assert store.buffer is not None
        assert store.buffer.core.stats()["hits"] >= 0  # still mapped: readable
    closer.join(60)
    assert closed.is_set()
    with store.reading() as live:
        assert not live


def test_serve_refuses_other_addresses_and_bad_ports(store: ucm.Store) -> None:
    with pytest.raises(InvalidArgumentError, match=r"host='0\.0\.0\.0' is not valid: the metrics"):
        metrics.serve(store, host="0.0.0.0")
    with pytest.raises(InvalidArgumentError, match=r"port=70000 is not valid: expected an integer"):
        metrics.serve(store, port=70000)
    with (
        metrics.serve(store) as taken,
        pytest.raises(
            InvalidArgumentError, match=rf"port={taken.port} is not valid: cannot listen on it"
        ),
    ):
        metrics.serve(store, port=taken.port)


def test_stats_serve_exposes_a_live_buffer(tmp_path: Path) -> None:
    with live_buffer(tmp_path) as live:
        command = [sys.executable, "-m", "ucm.cli", "stats", str(live.stack_path)]
        served = subprocess.Popen(
            [*command, "--serve", "0", "--count", "240", "--interval", "0.25"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert served.stderr is not None
            line = served.stderr.readline()
            match = re.fullmatch(
                r"serving Prometheus metrics on (http://127\.0\.0\.1:\d+/metrics)\n", line
            )
            assert match, line
            with urllib.request.urlopen(match.group(1), timeout=10) as response:
                found = samples(response.read().decode())
        finally:
            served.terminate()
            served.wait(timeout=30)
    assert found[("ucm_buffer_hits_total", ())] == LOADED
    assert found[("ucm_buffer_misses_total", ())] == DUMPED
    assert found[("ucm_buffer_evictions_total", ())] == DUMPED - SLOTS
    assert found[("ucm_buffer_preallocs_total", ())] == PREALLOCATED
    assert found[("ucm_buffer_slots", (("state", "resident"),))] == SLOTS
    assert found[("ucm_buffer_slots", (("state", "preallocated"),))] == PREALLOCATED
    # The scheduler's own Store did nothing: per-process counters are its own.
    assert found[("ucm_store_hits_total", (("device_id", "-1"),))] == 0
