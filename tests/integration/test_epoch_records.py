"""A reset's epoch outlives the buffer, whatever the lower tiers' admission and quotas do.

A reset (vLLM's ``reset_cache``, SGLang's ``clear``: an RL weight sync) moves a key space to a
new epoch through :class:`~ucm.integration.keys.EpochState`, as the integrations do. The epoch
must then be read by every engine started later, after every rank of the node closed (the
buffer gone): else the blocks saved before the reset, still in a lower tier, are served again
(wrong tokens after a weight update). Each scenario restarts in a fresh store (or process) and
checks both the epoch read and that none of the pre-reset blocks is served under the ids the
engine then computes.
"""

from __future__ import annotations

import multiprocessing
import time
import uuid
from pathlib import Path
from typing import Any

import ucm
from ucm.integration.keys import Epochs, EpochState, KeySpace, chain_block_ids

SPACE = KeySpace(
    engine="vllm",
    model="/models/llama-tiny",
    dtype="torch.float32",
    block_tokens=4,
    kv_layout="[num_blocks, kv_heads, block_size, 2*head_size] x 2 layers",
    tp_size=1,
)
SHARD = 4096
BLOCKS = 10
TOKENS = list(range(1000, 1000 + BLOCKS * SPACE.block_tokens))
WAIT_S = 120.0
"""Bound on every wait for an event (a busy 2-core machine): catches a hang, never a race."""


def stack(tmp_path: Path, **posix: Any) -> dict[str, Any]:
    return {
        "unique_id": f"rec-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [
            {"type": "buffer", "capacity": 64 * SHARD, "flush_interval_s": 3600},
            # The epoch's read, not look-up deadlines, is under test: a generous one.
            {"type": "posix", "path": str(tmp_path / "nvme"), "lookup_timeout_ms": 60_000} | posix,
        ],
    }


def ids(epoch: int) -> list[bytes]:
    """The ids an engine in ``epoch`` computes for the test's prompt."""
    return chain_block_ids(SPACE.salt(epoch=epoch), TOKENS, SPACE.block_tokens)


def payload(block_id: bytes) -> bytes:
    return (block_id * (SHARD // len(block_id)))[:SHARD]


def dump(store: ucm.Store, blocks: list[bytes], namespace: str | None = None) -> None:
    buffers = [bytearray(payload(b)) for b in blocks]
    import torch

    src = [[torch.frombuffer(buf, dtype=torch.uint8)] for buf in buffers]
    store.wait(store.dump(blocks, [0] * len(blocks), src, namespace=namespace))


def load(store: ucm.Store, blocks: list[bytes]) -> None:
    import torch

    dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
    store.wait(store.load(blocks, [0] * len(blocks), dst))
    for block, d in zip(blocks, dst, strict=True):
        assert d[0].numpy().tobytes() == payload(block)


def engine_reset(state: EpochState) -> int | None:
    """A reset as the integrations make it (vLLM's scheduler, SGLang's clear): the new epoch,
    recorded in every tier before it returns."""
    epoch = state.reset()
    assert state.unrecorded is None, "the reset's epoch was not recorded in every tier"
    return epoch


def posix_holds(tmp_path: Path, blocks: list[bytes], namespace: str | None = None) -> list[bool]:
    """What the posix tier holds, read through a posix-only store (no buffer)."""
    config = {
        "unique_id": f"po-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [{"type": "posix", "path": str(tmp_path / "nvme"), "lookup_timeout_ms": 60_000}],
    }
    with ucm.open(config) as store:
        return store.lookup(blocks, namespace=namespace)


def restarted_epoch_and_hits(
    config: dict[str, Any], namespace: str | None = None
) -> tuple[int | None, list[bool]]:
    """A later engine (the buffer gone): the epoch it reads and which of the prompt's blocks,
    under the ids it computes in that epoch, the stack serves."""
    with ucm.open(config, device_id=0) as store:
        state = EpochState(Epochs(SPACE.salt()), store)
        try:
            epoch = state.start()
        finally:
            state.close()
        assert epoch is not None
        return epoch, store.lookup(ids(epoch), namespace=namespace)


def test_a_reset_survives_a_lower_tier_that_admits_after_reuse(tmp_path: Path) -> None:
    config = stack(tmp_path, admit={"after_reuse": 1})
    before = ids(0)
    with ucm.open(config, device_id=0) as store:
        state = EpochState(Epochs(SPACE.salt()), store)
        assert state.start() == 0
        dump(store, before)
        load(store, before)  # reused once: admitted to posix
        store.drain()
        assert engine_reset(state) == 1
        state.close()
    # Every rank closed: the buffer is gone, the pre-reset blocks are on posix.
    assert posix_holds(tmp_path, before) == [True] * BLOCKS
    epoch, hits = restarted_epoch_and_hits(config)
    assert epoch == 1
    assert hits == [False] * BLOCKS


def _reset_then_close_early(config: dict[str, Any], done: Any) -> None:
    """A rank process: saves the prompt, waits until posix admitted it, resets, closes at once
    (long before a block written now would be resident for ``min_residency_ms``)."""
    before = ids(0)
    with ucm.open(config, device_id=0) as store:
        state = EpochState(Epochs(SPACE.salt()), store)
        assert state.start() == 0
        dump(store, before)
        deadline = time.monotonic() + WAIT_S
        posix = store.tiers[1]
        while not all(posix.lookup([(b, 0) for b in before])):
            assert time.monotonic() < deadline, "the pre-reset blocks were never admitted"
            time.sleep(0.05)
            store.drain()  # runs the residency checks that are due
        assert engine_reset(state) == 1
        state.close()
    done.put("closed")


def test_a_reset_survives_a_process_that_closes_before_min_residency(tmp_path: Path) -> None:
    config = stack(tmp_path, admit={"min_residency_ms": 1500})
    context = multiprocessing.get_context("spawn")
    done = context.Queue()
    child = context.Process(target=_reset_then_close_early, args=(config, done))
    child.start()
    child.join(WAIT_S)
    assert child.exitcode == 0, f"the rank process failed: exit code {child.exitcode}"
    assert done.get(timeout=WAIT_S) == "closed"
    assert posix_holds(tmp_path, ids(0)) == [True] * BLOCKS
    epoch, hits = restarted_epoch_and_hits(config)
    assert epoch == 1
    assert hits == [False] * BLOCKS


def test_a_reset_survives_a_byte_quota_on_the_default_namespace(tmp_path: Path) -> None:
    # Default's posix bytes (quotas.others) hold about two blocks; tenant-a's are unbounded.
    config = stack(tmp_path) | {
        "quotas": {
            "namespaces": {"tenant-a": {"tiers": {"posix": "1GiB"}}},
            "others": {"tiers": {"posix": 3 * SHARD}},
        }
    }
    before = ids(0)
    with ucm.open(config, device_id=0) as store:
        state = EpochState(Epochs(SPACE.salt()), store)
        assert state.start() == 0
        dump(store, before, namespace="tenant-a")
        store.drain()
        time.sleep(0.02)  # the reset's writes are younger than tenant-a's blocks on any clock
        assert engine_reset(state) == 1
        # Later blocks of the default namespace (another key space): over its quota, so its
        # oldest blocks are evicted.
        for n in range(4):
            time.sleep(0.02)
            dump(store, [bytes([0xEE, n]) + bytes(14)])
            store.drain()
        assert store.tiers[1].stats()["namespace_eviction_passes"] > 0
        state.close()
    assert posix_holds(tmp_path, before, namespace="tenant-a") == [True] * BLOCKS
    epoch, hits = restarted_epoch_and_hits(config, namespace="tenant-a")
    assert epoch == 1
    assert hits == [False] * BLOCKS


_READ_EPOCH = """
import sys
import ucm
from ucm.integration.keys import Epochs, KeySpace
space = KeySpace(engine="vllm", model="/models/llama-tiny", dtype="torch.float32",
    block_tokens=4, kv_layout="[num_blocks, kv_heads, block_size, 2*head_size] x 2 layers",
    tp_size=1)
config = {"unique_id": sys.argv[1], "shard_size": 4096, "shards_per_block": 1,
    "tiers": [{"type": "buffer", "capacity": 64 * 4096}]}
with ucm.open(config, device_id=-1) as scheduler:
    print(Epochs(space.salt()).current(scheduler))
"""


def test_a_buffer_only_stack_keeps_its_epoch_while_a_process_of_the_node_holds_it() -> None:
    """The buffer's control plane holds the record for every process of the node: a
    scheduler process (control plane only) started after a worker's reset reads it."""
    import subprocess
    import sys

    config = {
        "unique_id": f"rec-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [{"type": "buffer", "capacity": 64 * SHARD}],
    }
    with ucm.open(config, device_id=0) as worker:
        state = EpochState(Epochs(SPACE.salt()), worker)
        try:
            assert state.start() == 0
            assert engine_reset(state) == 1
            assert engine_reset(state) == 2
        finally:
            state.close()
        read = subprocess.run(
            [sys.executable, "-c", _READ_EPOCH, config["unique_id"]],
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
        assert read.returncode == 0, read.stderr
        assert read.stdout.strip() == "2"
