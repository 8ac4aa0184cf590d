"""Namespace quotas through ``ucm.open`` (issue 22): the stack's ``quotas:`` reach the node-wide
CacheBuffer's namespace table at open (named namespaces) or at a namespace's first call
(``others``); a guaranteed namespace keeps its blocks byte-exact through another namespace's
flood, which without quotas evicts them all; a namespace at its cap evicts its own blocks."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import torch

import ucm
from ucm import namespaces
from ucm.buffer import BufferTier

SHARD = 4096
SPB = 2
SLOTS = 64


def stack(quotas: dict[str, Any] | None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "unique_id": f"quota-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": SPB,
        "buffer": {"capacity": SLOTS * SHARD},
    }
    if quotas is not None:
        data["quotas"] = quotas
    return data


def ids(count: int, seed: int) -> list[bytes]:
    return [bytes([seed, i % 256, i // 256]) + bytes(13) for i in range(count)]


def content(value: int) -> torch.Tensor:
    return torch.arange(SHARD, dtype=torch.int64).to(torch.uint8) ^ value


def dump_all(store: ucm.Store, blocks: list[bytes], value: int, namespace: str) -> None:
    for shard in range(SPB):
        src = [[content(value + shard)] for _ in blocks]
        store.wait(store.dump(blocks, shard, src, namespace=namespace))
    store.drain()


def usage(store: ucm.Store) -> Counter[str]:
    """Occupancy in slots per namespace name, from the native table."""
    buffer = store.tiers[0]
    assert isinstance(buffer, BufferTier)
    names = {namespaces.tag(name): name for name in ("tenant-a", "tenant-b", "tenant-c")}
    names[bytes(8)] = namespaces.DEFAULT_NAMESPACE
    return Counter({names[row.tag]: row.occupancy_slots for row in buffer.core.namespaces()})


def quotas_of(store: ucm.Store) -> dict[bytes, tuple[int, int]]:
    buffer = store.tiers[0]
    assert isinstance(buffer, BufferTier)
    return {row.tag: (row.guarantee_slots, row.cap_slots) for row in buffer.core.namespaces()}


def flood_then_replay(quotas: dict[str, Any] | None) -> tuple[list[bool], Counter[str]]:
    working_set = ids(8, seed=1)  # 16 shards: tenant-a's guarantee
    with ucm.open(stack(quotas), device_id=0, namespace="tenant-a") as store:
        dump_all(store, working_set, 10, "tenant-a")
        for round_index in range(10):  # tenant-b: 10 x 32 blocks, five times the buffer
            dump_all(store, ids(32, seed=100 + round_index), 20, "tenant-b")
        present = store.lookup(working_set)
        if all(present):
            for shard in range(SPB):
                dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in working_set]
                store.wait(store.load(working_set, shard, dst))
                assert all(torch.equal(d[0], content(10 + shard)) for d in dst)
        return present, usage(store)


def test_quotas_reach_the_native_table_at_open_and_at_first_use() -> None:
    quotas = {
        "namespaces": {
            "tenant-a": {"buffer": {"guarantee": "25%", "cap": "50%"}},
            "tenant-c": {"buffer": {"cap": f"{8 * SHARD}"}},
        },
        "others": {"buffer": {"cap": "75%"}},
    }
    with ucm.open(stack(quotas), device_id=0) as store:
        assert quotas_of(store) == {
            bytes(8): (0, 48),  # the default namespace: others
            namespaces.tag("tenant-a"): (16, 32),
            namespaces.tag("tenant-c"): (0, 8),
        }
        store.lookup(ids(1, seed=0), namespace="tenant-b")  # first use: others' cap
        assert quotas_of(store)[namespaces.tag("tenant-b")] == (0, 48)


def test_a_guarantee_keeps_a_working_set_through_a_flood_that_evicts_it_without_quotas() -> None:
    guaranteed = {"namespaces": {"tenant-a": {"buffer": {"guarantee": "25%"}}}}
    present, used = flood_then_replay(guaranteed)
    assert present == [True] * 8
    assert used == Counter({"tenant-a": 16, "tenant-b": 48, "default": 0})
    present, _ = flood_then_replay(None)
    assert present == [False] * 8


def test_a_namespace_at_its_cap_evicts_its_own_blocks() -> None:
    quotas = {"namespaces": {"tenant-c": {"buffer": {"cap": f"{8 * SHARD}"}}}}
    with ucm.open(stack(quotas), device_id=0) as store:
        dump_all(store, ids(4, seed=7), 30, "tenant-a")  # 8 shards, unnamed: no cap
        for block in ids(10, seed=8):  # 20 shards into a cap of 8, a block at a time
            dump_all(store, [block], 40, "tenant-c")
        assert usage(store) == Counter({"tenant-a": 8, "tenant-c": 8, "default": 0})
        assert store.lookup(ids(4, seed=7), namespace="tenant-a") == [True] * 4
        assert store.lookup(ids(10, seed=8), namespace="tenant-c") == [False] * 6 + [True] * 4
        # One task holds every slot it takes until it finishes: beyond the cap, its keys find
        # no slot (as in a full buffer), never another namespace's.
        src = [[content(50)] for _ in range(10)]
        task = store.dump(ids(10, seed=9), 0, src, namespace="tenant-c")
        try:
            store.wait(task)
        except ucm.TaskError as failed:
            assert len(failed.failures) == 2
            assert all("NO_SLOT" in str(error) for error in failed.failures.values())
        else:
            raise AssertionError("a 10-key task into a cap of 8 slots")
        assert usage(store)["tenant-a"] == 8


def test_per_namespace_figures_in_stats_prometheus_and_the_stats_view() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from rich.console import Console

    from ucm import cli_ops, metrics

    guaranteed = {"namespaces": {"tenant-a": {"buffer": {"guarantee": "25%"}}}}
    working_set = ids(8, seed=1)
    with ucm.open(stack(guaranteed), device_id=0, namespace="tenant-a") as store:
        dump_all(store, working_set, 10, "tenant-a")  # 16 misses (new shards)
        for round_index in range(10):  # 640 misses; B keeps 48 slots, evicts its own 592
            dump_all(store, ids(32, seed=100 + round_index), 20, "tenant-b")
        for shard in range(SPB):  # 16 hits
            dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in working_set]
            store.wait(store.load(working_set, shard, dst))
        figures = store.stats()["namespaces"]
        assert figures == {
            "default": {
                "occupancy_slots": 0,
                "occupancy_bytes": 0,
                "guarantee_slots": 0,
                "cap_slots": SLOTS,
                "hits": 0,
                "misses": 0,
                "evictions": 0,
            },
            "tenant-a": {
                "occupancy_slots": 16,
                "occupancy_bytes": 16 * SHARD,
                "guarantee_slots": 16,
                "cap_slots": SLOTS,
                "hits": 16,
                "misses": 16,
                "evictions": 0,
            },
            "tenant-b": {
                "occupancy_slots": 48,
                "occupancy_bytes": 48 * SHARD,
                "guarantee_slots": 0,
                "cap_slots": SLOTS,
                "hits": 0,
                "misses": 640,
                "evictions": 592,
            },
        }
        registry = CollectorRegistry()
        registry.register(metrics.StoreCollector(store))
        text = generate_latest(registry).decode()
        uid = store.config.unique_id
        assert (
            f'ucm_buffer_namespace_occupancy_slots{{namespace="tenant-a",unique_id="{uid}"}} 16.0'
            in text
        )
        assert (
            f'ucm_buffer_namespace_evictions_total{{namespace="tenant-b",unique_id="{uid}"}} 592.0'
            in text
        )
        console = Console(width=200, record=True)
        console.print(cli_ops.namespace_view(metrics.snapshot(store)))
        rows = [line.split("│") for line in console.export_text().splitlines()]
        cells = [[cell.strip() for cell in row[1:-1]] for row in rows if len(row) > 2]
        assert ["tenant-b", "48", str(48 * SHARD), "0", "64", "0", "640", "592"] in cells
        assert cells.index(["tenant-b", "48", str(48 * SHARD), "0", "64", "0", "640", "592"]) < (
            cells.index(["tenant-a", "16", str(16 * SHARD), "16", "64", "16", "16", "0"])
        )


def test_the_namespace_label_keeps_16_values_and_groups_the_rest() -> None:
    from ucm import metrics

    def figures(slots: int) -> dict[str, int]:
        return {name: slots for name, _, _ in metrics._NAMESPACE_FIGURES}

    many = {f"t{index:02d}": figures(index) for index in range(20)}
    grouped = metrics.namespace_labels(many)
    assert len(grouped) == metrics.NAMESPACE_LABELS_MAX + 1 == 17
    assert sorted(grouped) == sorted([*(f"t{index:02d}" for index in range(4, 20)), "_other"])
    assert grouped["_other"] == figures(0 + 1 + 2 + 3)
    assert metrics.namespace_labels(dict(list(many.items())[:16])) == {
        name: figures(int(name[1:])) for name in list(many)[:16]
    }


def test_without_quotas_namespaces_still_have_figures_and_a_full_table_is_no_error() -> None:
    with ucm.open(stack(None), device_id=0) as store:
        dump_all(store, ids(2, seed=3), 60, "tenant-a")
        figures = store.stats()["namespaces"]
        assert figures["tenant-a"]["occupancy_slots"] == 4
        assert figures["tenant-a"]["misses"] == 4
        assert (figures["tenant-a"]["guarantee_slots"], figures["tenant-a"]["cap_slots"]) == (
            0,
            SLOTS,
        )
        # 40 more namespaces: the table keeps 32 (default, tenant-a, 30 of them); the others
        # count in the default namespace's entry, and nothing fails.
        for index in range(40):
            assert store.lookup(ids(1, seed=4), namespace=f"extra-{index}") == [False]
        dump_all(store, ids(1, seed=5), 70, "extra-39")
        figures = store.stats()["namespaces"]
        assert len(figures) == 32
        assert "extra-39" not in figures
        assert figures["default"]["occupancy_slots"] == 2


def _tier_usage(path: Path, namespace: str) -> int:
    """Bytes of ``namespace``'s files under a posix root or a file:// fsspec root, as the tiers
    count them (disk blocks for posix, object sizes for fsspec)."""
    root = path / "ns" / namespace
    return sum(
        (file.stat().st_blocks * 512 if "nvme" in str(path) else file.stat().st_size)
        for file in root.rglob("*")
        if file.is_file()
    )


def test_lower_tiers_keep_each_namespace_within_its_bytes_oldest_blocks_first(
    tmp_path: Path,
) -> None:
    import time

    nvme, objects = tmp_path / "nvme", tmp_path / "objects"
    lower = [
        {"type": "posix", "path": str(nvme)},
        {"type": "fsspec", "url": f"file://{objects}"},
    ]
    # One block (2 shards) per tier, measured first: the quotas are 4 blocks' worth.
    probe = stack(None) | {"tiers": lower}
    probe["buffer"] = {"capacity": SLOTS * SHARD}
    with ucm.open(probe, device_id=0) as store:
        dump_all(store, ids(1, seed=9), 5, "probe")
    block_bytes = {"posix": _tier_usage(nvme, "probe"), "fsspec": _tier_usage(objects, "probe")}
    assert block_bytes["posix"] >= 2 * SHARD and block_bytes["fsspec"] >= 2 * SHARD
    quotas = {
        "namespaces": {
            "tenant-a": {
                "tiers": {"posix": 4 * block_bytes["posix"], "fsspec": 4 * block_bytes["fsspec"]}
            }
        },
        "others": {"tiers": {"posix": 2 * block_bytes["posix"]}},
    }
    config = probe | {"quotas": quotas, "unique_id": f"quota-{uuid.uuid4().hex[:12]}"}
    blocks = ids(10, seed=10)
    with ucm.open(config, device_id=0) as store:
        for block in blocks:  # one at a time, oldest first (mtimes 10 ms apart)
            dump_all(store, [block], 7, "tenant-a")
            dump_all(store, [block], 8, "tenant-b")  # unnamed: others' posix bytes only
            for tier in ("posix", "fsspec"):
                root = nvme if tier == "posix" else objects
                assert _tier_usage(root, "tenant-a") <= 4 * block_bytes[tier]
            assert _tier_usage(nvme, "tenant-b") <= 2 * block_bytes["posix"]
            time.sleep(0.01)
        # The newest blocks stayed, on each tier; the oldest went first.
        posix, fsspec = store.tiers[1], store.tiers[2]
        for tier, keep in ((posix, 4), (fsspec, 4)):
            present = tier.lookup([(block, 0) for block in namespaces.scope("tenant-a", blocks)])
            assert present == [False] * (10 - keep) + [True] * keep, tier.label
        present = posix.lookup([(block, 0) for block in namespaces.scope("tenant-b", blocks)])
        assert present == [False] * 8 + [True] * 2
        # fsspec has no quota for tenant-b: all ten blocks are there.
        assert (
            fsspec.lookup([(block, 0) for block in namespaces.scope("tenant-b", blocks)])
            == [True] * 10
        )
        assert posix.stats()["namespace_eviction_passes"] > 0


def test_counters_are_exact_after_ranks_are_killed_mid_dump() -> None:
    """Real rank processes (ucm.open, dumps in two namespaces) SIGKILLed in the middle of their
    dumps, three times, while this process keeps the buffer open as rank 0; after
    ``reclaim_dead`` (which a rank's open also runs) every namespace's counter equals the slots
    its keys hold, counted slot by slot."""
    import os
    import signal
    import time

    from ucm.native.buffer import DETACHED
    from ucm.ranks import RankGroup

    from ._quota_ranks import insert_forever

    config = stack({"namespaces": {"tenant-a": {"buffer": {"guarantee": "25%", "cap": "75%"}}}})
    with ucm.open(config, device_id=0, local_rank_size=3) as store:
        buffer = store.tiers[0]
        assert isinstance(buffer, BufferTier)
        for round_index in range(3):
            with RankGroup(parties=1, join_timeout=0) as group:
                pipes = []
                for rank in (1, 2):
                    parent, child = group.context.Pipe()
                    group.spawn(insert_forever, config, rank, 3, round_index * 2 + rank, child)
                    pipes.append(parent)
                for parent in pipes:
                    assert parent.poll(120)
                    message, detail = parent.recv()
                    assert message == "inserting", detail
                time.sleep(0.2 + 0.1 * round_index)
                for process in group.processes:
                    os.kill(process.pid, signal.SIGKILL)  # mid-dump: locks, owners, references
                for process in group.processes:
                    process.join(10)
            assert buffer.core.reclaim_dead().holders == 2
            indices = {row.tag: row.index for row in buffer.core.namespaces()}
            exact: Counter[int] = Counter()
            for slot in range(buffer.geometry.slot_count_total):
                info = buffer.core.slot_info(slot)
                if info.bucket is None or info.bucket == DETACHED:
                    continue
                exact[indices.get(info.block_id[:8], 0)] += 1
            counted = Counter({row.index: row.occupancy_slots for row in buffer.core.namespaces()})
            assert +counted == +exact, round_index
            a, b = indices[namespaces.tag("tenant-a")], indices[namespaces.tag("tenant-b")]
            assert exact[a] > 0 and exact[b] > 0  # the ranks did fill the buffer
            assert counted[a] <= 48  # tenant-a's cap, 75% of 64 slots
