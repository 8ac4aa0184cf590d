"""``BufferTier.hold``: the scheduler role's hold on CacheBuffer blocks (vLLM's scheduler holds
a synchronous load's blocks from its look-up until the load ran). In a process of its own it
holds through the buffer core; in a process that also runs a worker of the buffer (vLLM's
in-process executor), through that worker's queue. Real processes, killed ones included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import ucm
from ucm.native.buffer import SLOT_NONE

from .conftest import block, payload
from .test_buffer_stack import SHARD, buffer_stack

WAIT_S = 120.0

CHILD = r"""
import json, sys
import ucm
stack = json.loads(sys.argv[1])
with ucm.open(stack, device_id=-1) as store:
    keys = [(bytes.fromhex(h), 0) for h in sys.argv[2:]]
    slots = store.buffer.hold(keys)
    print(json.dumps(slots), flush=True)
    if sys.stdin.readline().strip() == "release":
        store.buffer.unhold(slots)
        print("released", flush=True)
        sys.stdin.readline()
"""


def stack(tmp_path: Path) -> dict[str, Any]:
    """A 64-slot buffer over posix, one shard per block."""
    return buffer_stack(tmp_path, slots=64, shards=1)


def dump(store: ucm.Store, blocks: list[bytes]) -> None:
    sources = [
        [torch.frombuffer(bytearray(payload(b, 0, SHARD)), dtype=torch.uint8)] for b in blocks
    ]
    store.wait(store.dump(blocks, 0, sources))


def remove(store: ucm.Store, block_id: bytes) -> int:
    """Removes the block from the CacheBuffer as an eviction would: a held block stays."""
    return store.tiers[0].batched_remove([(block_id, 0)], force=False)


def holder(config: dict[str, Any], *blocks: bytes) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(config), *(b.hex() for b in blocks)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def read_line(child: subprocess.Popen[str]) -> str:
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, f"the holding process exited (rc {child.wait(WAIT_S)})"
    return line


def test_a_scheduler_process_holds_a_block_against_eviction_until_it_releases_it(
    tmp_path: Path,
) -> None:
    config = stack(tmp_path)
    with ucm.open(config) as store:
        present, absent = block(1), block(2)
        dump(store, [present])
        child = holder(config, present, absent)
        try:
            slots = json.loads(read_line(child))
            assert slots[0] != SLOT_NONE and slots[1] == SLOT_NONE  # absent: nothing allocated
            assert remove(store, present) == 0  # held by the scheduler process
            assert store.lookup([present, absent]) == [True, False]
            assert child.stdin is not None
            child.stdin.write("release\n")
            child.stdin.flush()
            assert read_line(child).strip() == "released"
            assert remove(store, present) == 1
        finally:
            if child.stdin is not None:
                child.stdin.close()
            assert child.wait(WAIT_S) == 0


def test_the_holds_of_a_killed_scheduler_process_are_reclaimed(tmp_path: Path) -> None:
    config = stack(tmp_path)
    with ucm.open(config) as store:
        held = block(3)
        dump(store, [held])
        child = holder(config, held)
        try:
            assert json.loads(read_line(child))[0] != SLOT_NONE
            assert remove(store, held) == 0
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(WAIT_S)
        assert store.buffer is not None
        store.buffer.core.reclaim_dead()
        assert remove(store, held) == 1


def test_a_scheduler_beside_a_worker_in_one_process_holds_through_the_workers_queue(
    tmp_path: Path,
) -> None:
    """vLLM's in-process executor: one holder for both. The worker's load of a block the
    scheduler holds is a plain hit (its queue counts both uses), and the release lets an
    eviction take it."""
    config = stack(tmp_path)
    with ucm.open(config) as worker, ucm.open(config, device_id=-1) as scheduler:
        blocks = [block(4), block(5)]
        dump(worker, blocks)
        assert scheduler.buffer is not None
        slots = scheduler.buffer.hold([(b, 0) for b in blocks])
        assert SLOT_NONE not in slots
        assert remove(worker, blocks[0]) == 0
        for _ in range(2):  # the worker's own uses come and go beside the hold
            out = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
            worker.wait(worker.load(blocks, 0, out))
            assert [o[0].numpy().tobytes() for o in out] == [payload(b, 0, SHARD) for b in blocks]
        assert remove(worker, blocks[0]) == 0
        scheduler.buffer.unhold(slots)
        assert [remove(worker, b) for b in blocks] == [1, 1]


WRITER = r"""
import json, sys, torch
import ucm
sys.path.insert(0, sys.argv[2])
from store.conftest import block, payload
stack = json.loads(sys.argv[1])
with ucm.open(stack) as store:
    b = block(6)
    source = torch.frombuffer(bytearray(payload(b, 0, stack["shard_size"])), dtype=torch.uint8)
    store.wait(store.dump([b], 0, [[source]]))
    print("dumped", flush=True)
    sys.stdin.readline()
"""


def test_holds_taken_before_a_worker_opens_in_the_process_are_given_up_not_shared(
    tmp_path: Path,
) -> None:
    """A scheduler held a block through the buffer core, then a worker of the buffer opened
    in its process: the worker's queue would find the process's reference without a use of
    its own, so the hold is given up when the worker opens, and its loads are plain hits."""
    config = stack(tmp_path)
    tests_dir = str(Path(__file__).resolve().parents[1])
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, json.dumps(config), tests_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert read_line(writer).strip() == "dumped"
        held = block(6)
        with ucm.open(config, device_id=-1) as scheduler:
            assert scheduler.buffer is not None
            slots = scheduler.buffer.hold([(held, 0)])
            assert slots[0] != SLOT_NONE
            with ucm.open(config) as worker:
                out = [[torch.zeros(SHARD, dtype=torch.uint8)]]
                for _ in range(2):
                    worker.wait(worker.load([held], 0, out))
                    assert out[0][0].numpy().tobytes() == payload(held, 0, SHARD)
                assert remove(worker, held) == 1  # the hold was given up
                scheduler.buffer.unhold(slots)  # skipped: nothing held any more
    finally:
        if writer.stdin is not None:
            writer.stdin.close()
        assert writer.wait(WAIT_S) == 0


def test_with_two_workers_of_the_buffer_in_one_process_nothing_is_held(tmp_path: Path) -> None:
    """Neither worker's queue could count the other's uses of the process's one reference:
    a hold taken through the first is given up when the second opens, and none is taken while
    both are open. (Two engines in one test process; vLLM runs one worker per process.)"""
    config = stack(tmp_path)
    with ucm.open(config) as first, ucm.open(config, device_id=-1) as scheduler:
        held = block(7)
        dump(first, [held])
        assert scheduler.buffer is not None
        assert scheduler.buffer.holdable()
        slots = scheduler.buffer.hold([(held, 0)])
        assert slots[0] != SLOT_NONE
        with ucm.open(config) as second:
            assert not scheduler.buffer.holdable()
            assert scheduler.buffer.hold([(held, 0)]) == [SLOT_NONE]
            out = [[torch.zeros(SHARD, dtype=torch.uint8)]]
            second.wait(second.load([held], 0, out))  # no reference left to trip over
            assert out[0][0].numpy().tobytes() == payload(held, 0, SHARD)
            assert remove(first, held) == 1  # the first hold was given up
        scheduler.buffer.unhold(slots)  # skipped: given up
        assert scheduler.buffer.holdable()


def test_closing_a_scheduler_store_releases_its_holds_and_later_calls_are_no_ops(
    tmp_path: Path,
) -> None:
    """A scheduler's holds end with its store (not only with its process), and a release
    that comes after the close (a late hook) touches no unmapped memory."""
    config = stack(tmp_path)
    with ucm.open(config) as worker:
        held = block(8)
        dump(worker, [held])
        child = holder(config, held)  # the worker's holder is this process: hold from another
        try:
            assert json.loads(read_line(child))[0] != SLOT_NONE
        finally:
            if child.stdin is not None:
                child.stdin.close()  # no "release": the child closes its store holding it
            assert child.wait(WAIT_S) == 0
        assert remove(worker, held) == 1
    config = stack(tmp_path)
    scheduler = ucm.open(config, device_id=-1)
    buffer = scheduler.buffer
    assert buffer is not None
    slots = buffer.hold([(block(9), 0)])
    scheduler.close()
    buffer.unhold(slots)
    assert buffer.hold([(block(9), 0)]) == [SLOT_NONE]
