"""Several nodes on one Mooncake pool, real processes against a real mooncake_master: blocks
shared between nodes, a node leaving (cleanly or killed), the master killed and back, and the
pool's own eviction. Each node is a spawned process with its own unique_id and CacheBuffer
(``_mooncake_nodes.node_main``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import ucm
from harness.mooncake import MooncakeMaster
from ucm.layout import Layout
from ucm.ranks import RankGroup
from ucm.testing.conformance import block_ids

from . import _mooncake_nodes as nodes

BOUND_S = 60.0
"""Generous bound on any one step (they take well under a few seconds here)."""


class Node:
    """Test-side handle of one node process."""

    def __init__(self, group: RankGroup, config: dict[str, Any]) -> None:
        self.conn, child = group.context.Pipe()
        self.process = group.spawn(nodes.node_main, config, child)
        child.close()
        assert self._reply(BOUND_S) == "ready"

    def call(self, command: str, *args: Any, timeout_s: float = BOUND_S) -> Any:
        self.conn.send((command, args))
        return self._reply(timeout_s)

    def _reply(self, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"node {self.process.pid} did not answer within {timeout_s}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"node {self.process.pid} failed:\n{value}")
        return value

    def exit(self) -> None:
        """A clean leave: the store closes (its Mooncake client unmounts its segment)."""
        self.call("exit")
        self.process.join(timeout=BOUND_S)
        assert self.process.exitcode == 0

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=BOUND_S)


@pytest.fixture
def start_node() -> Iterator[Callable[[dict[str, Any]], Node]]:
    started: list[Node] = []
    with RankGroup(parties=1, join_timeout=BOUND_S) as group:

        def start(config: dict[str, Any]) -> Node:
            node = Node(group, config)
            started.append(node)
            return node

        yield start
        # A clean leave: a killed node's segment would stay mounted in the master (and receive
        # other tests' writes, which then fail) until the master's client TTL runs out.
        for node in started:
            if node.process.is_alive():
                try:
                    node.exit()
                except BaseException:
                    node.kill()


def run_id() -> str:
    return uuid.uuid4().hex[:10]


def mooncake(master: MooncakeMaster, namespace: str, **options: Any) -> dict[str, Any]:
    return {
        "type": "mooncake",
        "master_server_address": master.address,
        "local_hostname": "127.0.0.1",
        "key_prefix": namespace,
        **options,
    }


def buffer(slots: int = 64) -> dict[str, Any]:
    return {"type": "buffer", "capacity": slots * nodes.SHARD}


def shards_of(blocks: list[bytes]) -> int:
    return len(blocks) * nodes.SHARDS


def test_a_block_dumped_on_one_node_is_loaded_byte_exact_on_another_and_promoted(
    mooncake_master: MooncakeMaster, start_node: Callable[[dict[str, Any]], Node]
) -> None:
    run = run_id()
    # Node B contributes no memory, so every object lives in node A's segment.
    node_a = start_node(nodes.stack(f"mc-{run}-a", [buffer(), mooncake(mooncake_master, run)]))
    node_b = start_node(
        nodes.stack(
            f"mc-{run}-b", [buffer(), mooncake(mooncake_master, run, global_segment_size=0)]
        )
    )
    blocks = block_ids(6, seed=21)
    stats_a = node_a.call("dump", blocks)
    assert stats_a["tiers"][1]["bytes_written"] == shards_of(blocks) * nodes.SHARD
    assert node_b.call("tier_lookup", 0, blocks) == [False] * len(blocks)  # B's own buffer
    assert node_b.call("lookup", blocks) == [True] * len(blocks)  # found in the pool
    first = node_b.call("load", blocks)
    assert first["wrong"] == []
    pool = first["stats"]["tiers"][1]
    assert (pool["hits"], pool["misses"], pool["corrupt"]) == (shards_of(blocks), 0, 0)
    # Zero copy into B's slots: the store handed the buffer's data plane to the pool tier,
    # registered once at open, so these loads registered nothing per call.
    assert pool["registered_bytes"] >= 64 * nodes.SHARD
    assert pool["call_registrations"] == 0
    assert node_b.call("tier_lookup", 0, blocks) == [True] * len(blocks)  # promoted
    # Node A leaves: its segment, and every block in it, leaves the pool with it.
    node_a.exit()
    assert node_b.call("tier_lookup", 1, blocks) == [False] * len(blocks)
    again = node_b.call("load", blocks)  # from B's own buffer, the pool untouched
    assert again["wrong"] == []
    assert again["stats"]["tiers"][1]["hits"] == pool["hits"]
    assert again["stats"]["tiers"][0]["hits"] - first["stats"]["tiers"][0]["hits"] == shards_of(
        blocks
    )


def test_a_killed_node_takes_its_blocks_with_it_and_the_tier_below_serves_them(
    new_master: Callable[..., MooncakeMaster],
    start_node: Callable[[dict[str, Any]], Node],
    tmp_path: Path,
) -> None:
    master = new_master(client_ttl_s=3)  # a silent client's segment goes after 3 s
    run = run_id()
    shared = {"type": "posix", "path": str(tmp_path / "shared"), "io_threads": 2}
    node_a = start_node(nodes.stack(f"mc-{run}-a", [buffer(), mooncake(master, run), shared]))
    node_b = start_node(
        nodes.stack(f"mc-{run}-b", [buffer(), mooncake(master, run, global_segment_size=0), shared])
    )
    blocks = block_ids(4, seed=22)
    node_a.call("dump", blocks)
    assert node_b.call("tier_lookup", 1, blocks) == [True] * len(blocks)
    node_a.kill()  # kill -9: no unmount; the master still lists A's objects for a while
    started = time.monotonic()
    result = node_b.call("load", blocks)
    elapsed = time.monotonic() - started
    assert elapsed < BOUND_S, f"loading past a dead node took {elapsed:.1f}s"
    assert result["wrong"] == []
    pool, shared_tier = result["stats"]["tiers"][1], result["stats"]["tiers"][2]
    assert pool["hits"] == 0 and pool["corrupt"] == 0
    # Each shard was a failed transfer (A's segment still listed) or a miss (already gone).
    assert pool["errors"] + pool["misses"] >= shards_of(blocks)
    assert shared_tier["hits"] == shards_of(blocks)
    deadline = time.monotonic() + BOUND_S
    while node_b.call("tier_lookup", 1, blocks) != [False] * len(blocks):
        assert time.monotonic() < deadline, "the master never dropped the dead node's segment"
        time.sleep(0.5)


def _evict_from_buffer(store: Any, blocks: list[bytes], layout: Layout = nodes.LAYOUT) -> None:
    keys = layout.keys_of_blocks(blocks)
    assert store.tiers[0].batched_remove(keys, force=True) == len(keys)


def test_master_killed_mid_run_fails_fast_and_the_running_store_serves_again(
    new_master: Callable[..., MooncakeMaster], tmp_path: Path
) -> None:
    master = new_master()
    run = run_id()
    config = nodes.stack(
        f"mc-{run}",
        [buffer(), mooncake(master, run), {"type": "posix", "path": str(tmp_path / "nvme")}],
    )
    before, during, after = block_ids(3, seed=23), block_ids(3, seed=24), block_ids(3, seed=25)
    with ucm.open(config) as store:
        nodes.dump(store, before)
        pool: Any = store.tiers[1]
        assert pool.lookup_blocks(before) == [True] * 3
        _evict_from_buffer(store, before)  # so loads must go below the buffer
        master.kill()
        started = time.monotonic()
        assert nodes.load(store, before) == []  # the pool fails fast; posix serves
        assert store.lookup(before) == [True] * 3  # posix answers
        assert pool.lookup_blocks(before) == [False] * 3  # an unreachable pool: "absent"
        nodes.dump(store, during)  # acknowledged by the buffer and posix; the pool fails
        elapsed = time.monotonic() - started
        assert elapsed < BOUND_S, f"the store took {elapsed:.1f}s against a dead master"
        stats = store.stats()
        assert stats["tiers"][1]["errors"] >= 2 * shards_of(before)
        assert stats["write_through_failures"] >= shards_of(during)
        assert stats["tiers"][2]["hits"] >= shards_of(before)
        # A master comes back at the same address (empty: without HA it kept nothing).
        master.start()
        deadline = time.monotonic() + BOUND_S
        while True:
            nodes.dump(store, after)
            if pool.lookup_blocks(after) == [True] * 3:
                break
            assert time.monotonic() < deadline, "the store never reached the new master"
            time.sleep(0.5)
        _evict_from_buffer(store, after)
        hits = store.stats()["tiers"][1]["hits"]
        assert nodes.load(store, after) == []
        assert store.stats()["tiers"][1]["hits"] - hits == shards_of(after)


EVICTION_LAYOUT = Layout(shard_size=512 * 1024, shards_per_block=2, tensor_sizes=(512 * 1024,))


def test_a_shard_the_pool_evicted_is_reloaded_from_the_tier_below(
    new_master: Callable[..., MooncakeMaster], tmp_path: Path
) -> None:
    master = new_master(lease_ttl_ms=200)
    run = run_id()
    layout = EVICTION_LAYOUT
    # The smallest pool Mooncake mounts, 16 MiB, is this process's segment and the only one:
    # about 28 shards of 512 KiB fit before the master starts evicting (at 90% full).
    config = nodes.stack(
        f"mc-{run}",
        [
            {"type": "buffer", "capacity": 8 * layout.shard_size},
            mooncake(master, run, global_segment_size="16MiB"),
            {"type": "posix", "path": str(tmp_path / "nvme")},
        ],
        layout,
    )
    rounds = [block_ids(4, seed=100 + r) for r in range(12)]  # 96 shards: over 3x the pool
    were_in_pool: list[bytes] = []
    with ucm.open(config) as store:
        pool: Any = store.tiers[1]
        for blocks in rounds:
            nodes.dump(store, blocks, layout)
            hits = pool.lookup_blocks(blocks)
            were_in_pool += [b for b, hit in zip(blocks, hits, strict=True) if hit]
            time.sleep(0.3)  # the master evicts in the background when the pool fills up
        everything = [block for blocks in rounds for block in blocks]
        now_in_pool = dict(zip(everything, pool.lookup_blocks(everything), strict=True))
        evicted = [b for b in were_in_pool if not now_in_pool[b]]
        assert len(were_in_pool) > 10 and evicted, (len(were_in_pool), len(evicted))
        in_buffer = [
            b
            for b, hit in zip(everything, store.tiers[0].lookup_blocks(everything), strict=True)
            if hit
        ]
        if in_buffer:
            _evict_from_buffer(store, in_buffer, layout)
        time.sleep(0.3)  # let the lookups' leases (200 ms) lapse: eviction may go on
        before = store.stats()["tiers"]
        assert nodes.load(store, everything, layout) == []  # byte-exact: pool or posix
        after = store.stats()["tiers"]
        shards = layout.shards_per_block
        assert after[1]["corrupt"] == 0
        assert after[1]["misses"] - before[1]["misses"] >= shards * len(evicted)
        assert after[2]["hits"] - before[2]["hits"] >= shards * len(evicted)
        served = (after[1]["hits"] - before[1]["hits"]) + (after[2]["hits"] - before[2]["hits"])
        assert served == shards * len(everything)


def test_with_two_replicas_blocks_outlive_the_node_that_held_them(
    mooncake_master: MooncakeMaster, start_node: Callable[[dict[str, Any]], Node]
) -> None:
    run = run_id()
    pool = mooncake(mooncake_master, run, replica_num=2)  # each shard in two segments
    node_a = start_node(nodes.stack(f"mc-{run}-a", [buffer(), pool]))
    node_c = start_node(nodes.stack(f"mc-{run}-c", [buffer(), pool]))
    blocks = block_ids(4, seed=26)
    node_a.call("dump", blocks)
    node_a.exit()  # one copy of each shard leaves with A's segment; the other is in C's
    assert node_c.call("tier_lookup", 1, blocks) == [True] * len(blocks)
    result = node_c.call("load", blocks)
    assert result["wrong"] == []
    assert result["stats"]["tiers"][1]["hits"] == shards_of(blocks)
