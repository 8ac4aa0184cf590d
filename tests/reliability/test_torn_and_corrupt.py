"""Torn writes and corrupted data under a running stack: a flipped bit, a truncated file, a
corrupted footer or a deleted file in the posix tier is never returned as data; the key is
served from the tier below and the broken copy is repaired. A writer SIGKILLed mid-dump never
leaves a readable half-written shard."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import ucm
from harness.soak import block_id_of, check_payload
from ucm.errors import TaskError
from ucm.native import segments

from .conftest import SHARD, Shards, blocks, payload

SHARDS_PER_BLOCK = 2


def three_tier_stack(unique_id: str, tmp_path: Path, lower: bool = True) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [
        {"type": "buffer", "capacity": 32 * SHARD},
        {"type": "posix", "path": str(tmp_path / "nvme")},
    ]
    if lower:
        tiers.append({"type": "fsspec", "url": f"file://{tmp_path / 'remote'}"})
    return {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": SHARDS_PER_BLOCK,
        "tiers": tiers,
    }


def _fresh_id() -> str:
    return f"rel-{uuid.uuid4().hex[:12]}"


def _dump_all(config: dict[str, Any], block_ids: list[bytes]) -> None:
    """Dumps every shard of the blocks and closes (close finishes the write-through)."""
    with ucm.open(config) as store:
        shards = Shards(len(block_ids))
        for shard in range(SHARDS_PER_BLOCK):
            shards.fill(block_ids, shard)
            store.wait(store.dump_data(block_ids, shard, shards.pointers(len(block_ids))))
    segments.unlink(config["unique_id"])


def _block_file(tmp_path: Path, block_id: bytes) -> Path:
    hexid = block_id.hex()
    return tmp_path / "nvme" / hexid[:2] / f"{hexid}.blk"


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0x10]))


def _load(
    store: ucm.Store, block_ids: list[bytes], shard: int
) -> tuple[list[bytes], dict[Any, Any]]:
    shards = Shards(len(block_ids))
    shards.poison()
    failures: dict[Any, Any] = {}
    try:
        store.wait(store.load_data(block_ids, shard, shards.pointers(len(block_ids))))
    except TaskError as error:
        failures = dict(error.failures)
    return [shards.data(i) for i in range(len(block_ids))], failures


def test_corrupt_torn_and_deleted_files_are_served_from_below_and_repaired(
    tmp_path: Path,
) -> None:
    flipped, torn, bad_footer, deleted, intact = block_ids = blocks(5, b"corrupt")
    _dump_all(three_tier_stack(_fresh_id(), tmp_path), block_ids)
    config = three_tier_stack(_fresh_id(), tmp_path)  # a fresh (empty) buffer over the same disk
    with ucm.open(config) as store:
        # Damage the files under the running stack.
        _flip(_block_file(tmp_path, flipped), 100)  # a bit of shard 0's bytes
        os.truncate(_block_file(tmp_path, torn), SHARD + SHARD // 2)  # a torn, half-written file
        _flip(_block_file(tmp_path, bad_footer), SHARDS_PER_BLOCK * SHARD + 9)  # footer version
        _block_file(tmp_path, deleted).unlink()
        for shard in range(SHARDS_PER_BLOCK):
            data, failures = _load(store, block_ids, shard)
            assert failures == {}
            assert data == [payload(b, shard) for b in block_ids]  # never the damaged bytes
        stats = store.stats()
        posix = stats["tiers"][1]
        # Shard 0 of `flipped`, both shards of `torn` and of `bad_footer`.
        assert posix["corrupt"] >= 3
        assert stats["hits"] == 0
        repaired = stats.get("repaired_shards", 0)
        assert repaired == 5, stats
        # The posix copies are whole again (read straight from the tier, bypassing the buffer).
        tier = store.tiers[1]
        keys = [(b, s) for b in (flipped, torn, bad_footer, intact) for s in range(2)]
        views = [[memoryview(bytearray(SHARD))] for _ in keys]
        assert tier.load(keys, views) == [None] * len(keys)
        assert [bytes(v[0]) for v in views] == [payload(b, s) for b, s in keys]
        # A deleted file is a plain miss: served from below, not copied back into posix (it
        # has `promote: false`, and a miss is not damage to repair).
        assert tier.lookup([(deleted, 0), (deleted, 1)]) == [False, False]


def test_corrupt_data_with_no_copy_below_fails_the_key_and_is_never_returned(
    tmp_path: Path,
) -> None:
    damaged, intact = block_ids = blocks(2, b"nocopy")
    _dump_all(three_tier_stack(_fresh_id(), tmp_path, lower=False), block_ids)
    config = three_tier_stack(_fresh_id(), tmp_path, lower=False)
    with ucm.open(config) as store:
        _flip(_block_file(tmp_path, damaged), 2000)  # shard 0
        for attempt in range(2):  # a later request sees the loss again, never stale success
            data, failures = _load(store, block_ids, 0)
            assert list(failures) == [(damaged, 0)], attempt
            assert "corrupt" in str(failures[(damaged, 0)])
            assert data[1] == payload(intact, 0)
            assert data[0] != payload(damaged, 0)
        data, failures = _load(store, [damaged], 1)  # the other shard of the block is intact
        assert failures == {}
        assert data == [payload(damaged, 1)]
        assert store.stats()["tiers"][1]["corrupt"] >= 1


WRITER = r"""
import ctypes, json, sys, time
import ucm
from harness.soak import block_id_of, encode_payload
config = json.loads(sys.argv[1])
size = config["shard_size"]
store = ucm.open(config)
ids = [block_id_of(b"torn", i) for i in range(8)]
memory = [ctypes.create_string_buffer(size) for _ in ids]
print("ready", flush=True)
while True:
    generation = time.monotonic_ns()
    shard = generation % 2
    for block_id, buffer in zip(ids, memory):
        ctypes.memmove(buffer, encode_payload((block_id, shard), generation, size), size)
    store.wait(store.dump_data(ids, shard, [[ctypes.addressof(m)] for m in memory]))
"""


WRITER_PHASE_S = 60.0
"""Bound on a writer's start (``ready``) and on its reaping after SIGKILL. Both normally take
well under a second; on a busy machine a killed process is reaped only once every one of its
threads got a CPU to exit on (up to 16 s was seen here, with several times more runnable
work than CPUs)."""


def _start_writer(script: str, config: dict[str, Any], stderr: Path) -> subprocess.Popen[str]:
    """Starts a writer process and waits for its ``ready`` line; fails naming what it printed
    to stderr."""
    with open(stderr, "w") as errors:
        writer = subprocess.Popen(
            [sys.executable, "-c", script, json.dumps(config)],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
    assert writer.stdout is not None
    readable, _, _ = select.select([writer.stdout], [], [], WRITER_PHASE_S)
    line = writer.stdout.readline() if readable else ""
    if line != "ready\n":
        writer.kill()
        writer.wait(WRITER_PHASE_S)
        pytest.fail(
            f"writer {writer.pid}: {'exited' if readable else 'silent'} after "
            f"{WRITER_PHASE_S} s, not ready ({line!r}); stderr:\n{stderr.read_text()[-4000:]}"
        )
    return writer


@pytest.mark.timeout(300)
def test_a_writer_killed_mid_dump_never_leaves_readable_torn_shards(tmp_path: Path) -> None:
    rng = random.Random(7)
    start_ns = time.monotonic_ns()
    # posix only: every dump is a synchronous file write the kill can interrupt.
    config = {
        "unique_id": _fresh_id(),
        "shard_size": SHARD,
        "shards_per_block": SHARDS_PER_BLOCK,
        "tiers": [{"type": "posix", "path": str(tmp_path / "nvme")}],
    }
    for run in range(6):
        writer = _start_writer(WRITER, config, tmp_path / f"writer-{run}.stderr")
        time.sleep(rng.uniform(0.05, 0.4))
        writer.send_signal(signal.SIGKILL)
        writer.wait(WRITER_PHASE_S)
    ids = [block_id_of(b"torn", i) for i in range(8)]
    with ucm.open(config) as store:
        verified = 0
        for shard in range(SHARDS_PER_BLOCK):
            data, failures = _load(store, ids, shard)
            for block_id, got in zip(ids, data, strict=True):
                failure = failures.get((block_id, shard))
                if failure is not None:
                    assert isinstance(failure, ucm.KeyMissingError), failure
                    continue
                assert check_payload((block_id, shard), got, start_ns, time.monotonic_ns()) == ""
                verified += 1
        assert verified >= 8  # six writer runs filled both shards of the blocks
        assert store.stats()["tiers"][0]["corrupt"] == 0  # temp file + rename: nothing torn


BIG_WRITER = r"""
import ctypes, json, sys
import ucm
from harness.soak import block_id_of
config = json.loads(sys.argv[1])
size = config["shard_size"]
store = ucm.open(config)
ids = [block_id_of(b"big", i) for i in range(4)]
memory = [ctypes.create_string_buffer(b"k" * size, size) for _ in ids]
print("ready", flush=True)
shard = 0
while True:
    store.wait(store.dump_data(ids, shard, [[ctypes.addressof(m)] for m in memory]))
    shard ^= 1
"""


def _temp_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.tmp"))


def _kill_while_writing(writer: subprocess.Popen[str], directory: Path) -> list[Path]:
    """SIGKILLs ``writer`` while one of its block files is a temp file, and returns the temp
    files it left. A temp file lives only while its bytes are written (a millisecond or two of
    each dump), so a kill at a random time mostly misses it. Here the writer is stopped as soon
    as a temp file shows, and inspected while stopped: its files stand still then. It is killed
    if one is still there, and let go on otherwise, until ``WRITER_PHASE_S`` runs out."""
    deadline = time.monotonic() + WRITER_PHASE_S
    stops = 0
    while time.monotonic() < deadline:
        if not _temp_files(directory):
            time.sleep(0.0002)
            continue
        writer.send_signal(signal.SIGSTOP)
        _, status = os.waitpid(writer.pid, os.WUNTRACED)  # returns once every thread stopped
        assert os.WIFSTOPPED(status), f"writer {writer.pid} ended: wait status {status}"
        stops += 1
        left = _temp_files(directory)
        if left:
            writer.send_signal(signal.SIGKILL)
            writer.wait(WRITER_PHASE_S)
            return left
        writer.send_signal(signal.SIGCONT)  # the file was renamed in between: try the next
    writer.kill()
    writer.wait(WRITER_PHASE_S)
    pytest.fail(f"no temp file stood still in {WRITER_PHASE_S} s ({stops} stops)")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["posix", "fsspec"])
def test_temp_files_of_writers_killed_mid_dump_are_reaped_without_a_capacity(
    tmp_path: Path, kind: str
) -> None:
    # Big shards: each dump writes its files' temp copies for a while. No capacity: no
    # eviction scan ever runs in this directory.
    tier: dict[str, Any] = (
        {"type": "posix", "path": str(tmp_path / "nvme")}
        if kind == "posix"
        else {"type": "fsspec", "url": f"file://{tmp_path / 'nvme'}"}
    )
    config = {
        "unique_id": _fresh_id(),
        "shard_size": 4 << 20,
        "shards_per_block": SHARDS_PER_BLOCK,
        "tiers": [tier],
    }
    writer = _start_writer(BIG_WRITER, config, tmp_path / "writer.stderr")
    left = _kill_while_writing(writer, tmp_path / "nvme")
    assert all(path.exists() for path in left)  # the dead writer's, nobody removes them yet
    with ucm.open(config) as store:  # a later process using the directory
        sweep = store.tiers[0].temp_sweep
        sweep.result(timeout=WRITER_PHASE_S)
        assert _temp_files(tmp_path / "nvme") == []
