"""Each lower tier's bytes and evictions per namespace (issue 22): in ``store.stats()``, in
``ucm stats --by-namespace`` (an operator's process, attached to the live buffer) and in
Prometheus (``ucm_tier_namespace_*{namespace=...}``, parsed with prometheus_client's parser),
with exact byte counts: posix counts a block file's disk bytes (its shards and a 4 KiB footer
region), fsspec its objects' sizes (each shard behind its 48-byte envelope). A tier that cannot
tell shows unknown, never 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import ucm
from ucm import envelope, metrics

SHARD = 4096
SPB = 2
SLOTS = 64
POSIX_BLOCK = SPB * SHARD + 4096
"""A posix block file holding every shard: the shards, then the footer region (4 KiB)."""
FSSPEC_BLOCK = SPB * (envelope.HEADER_BYTES + SHARD)
"""A block on fsspec: one object per shard, its envelope header then the shard (no codec)."""
BLOCKS = {"tenant-a": 3, "tenant-b": 5}


def ids(count: int, seed: int) -> list[bytes]:
    return [bytes([seed, i]) + bytes(14) for i in range(count)]


def dump(store: ucm.Store, blocks: list[bytes], namespace: str) -> None:
    for shard in range(SPB):
        src = [[torch.full((SHARD,), 7 + shard, dtype=torch.uint8)] for _ in blocks]
        store.wait(store.dump(blocks, shard, src, namespace=namespace))
    store.drain()


def stack(root: Path, quotas: dict[str, Any] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "unique_id": f"ns-tiers-{uuid.uuid4().hex[:10]}",
        "shard_size": SHARD,
        "shards_per_block": SPB,
        "buffer": {"capacity": SLOTS * SHARD},
        "tiers": [
            {"type": "posix", "path": str(root / "nvme")},
            {"type": "fsspec", "url": f"file://{root / 'objects'}"},
        ],
    }
    if quotas is not None:
        data["quotas"] = quotas
    return data


def disk_bytes(root: Path, namespace: str) -> int:
    """What posix counts: the disk blocks of the namespace's files."""
    return sum(f.stat().st_blocks * 512 for f in (root / "ns" / namespace).rglob("*.blk"))


def object_bytes(root: Path, namespace: str) -> int:
    """What fsspec counts: the sizes of the namespace's objects."""
    return sum(f.stat().st_size for f in (root / "ns" / namespace).rglob("*") if f.is_file())


def expected(blocks: dict[str, int], evictions: int = 0) -> dict[str, dict[str, Any]]:
    return {
        "posix": {
            name: {"bytes": count * POSIX_BLOCK, "evictions": evictions}
            for name, count in blocks.items()
        },
        "fsspec": {
            name: {"bytes": count * FSSPEC_BLOCK, "evictions": evictions}
            for name, count in blocks.items()
        },
    }


def prometheus(store: ucm.Store) -> dict[tuple[str, str, str, str], float]:
    """``ucm_tier_namespace_*`` samples by (sample name, tier position, type, namespace)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[tuple[str, str, str, str], float] = {}
    for family in text_string_to_metric_families(metrics.render(store).decode()):
        if family.name not in ("ucm_tier_namespace_bytes", "ucm_tier_namespace_evictions"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = sample.labels
            assert labels["unique_id"] == store.config.unique_id
            key = (sample.name, labels["tier"], labels["type"], labels["namespace"])
            samples[key] = sample.value
    return samples


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[ucm.Store, Path, Path]]:
    """A rank holding the buffer, with 3 blocks of tenant-a and 5 of tenant-b dumped through
    to posix and fsspec, and the stack's file."""
    config = stack(tmp_path)
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    with ucm.open(config, device_id=0) as store:
        for seed, (name, count) in enumerate(BLOCKS.items()):
            dump(store, ids(count, seed), name)
        yield store, tmp_path, path


def test_stats_have_each_lower_tiers_exact_bytes_per_namespace(
    live: tuple[ucm.Store, Path, Path],
) -> None:
    store, root, _ = live
    figures = store.namespace_tier_stats(wait_s=60)  # the tiers' first scans
    assert figures == expected(BLOCKS)
    assert store.stats()["namespace_tiers"] == figures
    # The figures are what the files hold.
    for name, count in BLOCKS.items():
        assert disk_bytes(root / "nvme", name) == count * POSIX_BLOCK
        assert object_bytes(root / "objects", name) == count * FSSPEC_BLOCK
    # This process's writes and removals move them at once, exactly, without a new scan.
    dump(store, ids(2, 9), "tenant-a")
    assert store.remove(ids(1, 1), namespace="tenant-b") == SPB  # its shards, every tier
    assert store.stats()["namespace_tiers"] == expected({"tenant-a": 5, "tenant-b": 4})


def test_prometheus_has_the_namespace_label_on_each_lower_tier(
    live: tuple[ucm.Store, Path, Path],
) -> None:
    store, _, _ = live
    store.namespace_tier_stats(wait_s=60)
    samples = prometheus(store)
    want = {}
    for position, (tier, block) in enumerate((("posix", POSIX_BLOCK), ("fsspec", FSSPEC_BLOCK))):
        for name, count in BLOCKS.items():
            want[("ucm_tier_namespace_bytes", str(position + 1), tier, name)] = count * block
            want[("ucm_tier_namespace_evictions_total", str(position + 1), tier, name)] = 0.0
    assert samples == want


def test_ucm_stats_by_namespace_shows_the_lower_tiers_bytes(
    live: tuple[ucm.Store, Path, Path],
) -> None:
    """An operator's ``ucm stats`` (its own process: its own scans of the tiers)."""
    _, _, path = live
    command = [sys.executable, "-m", "ucm.cli", "stats", str(path)]
    shown = subprocess.run(
        [*command, "--json"], capture_output=True, text=True, timeout=120, check=False
    )
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["namespace_tiers"] == expected(BLOCKS)
    shown = subprocess.run(
        [*command, "--by-namespace"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert shown.returncode == 0, shown.stderr
    rows = [line.split("│") for line in shown.stdout.splitlines()]
    cells = [[cell.strip() for cell in row[1:-1]] for row in rows if len(row) > 2]
    a = ["tenant-a", str(3 * POSIX_BLOCK), "0", str(3 * FSSPEC_BLOCK), "0"]
    b = ["tenant-b", str(5 * POSIX_BLOCK), "0", str(5 * FSSPEC_BLOCK), "0"]
    assert a in cells and b in cells
    assert cells.index(b) < cells.index(a)  # the most bytes first
    assert ["default", "0", "0", "0", "0"] in cells  # the buffer's default namespace: nothing


def test_quota_evictions_count_per_namespace(tmp_path: Path) -> None:
    """tenant-a may hold 2 blocks on each lower tier: of 5 dumped one at a time, the 3 oldest
    are evicted (6 shards per tier), and tenant-b, without a quota, keeps its 2."""
    bytes_of_two = {"posix": 2 * POSIX_BLOCK, "fsspec": 2 * FSSPEC_BLOCK}
    quotas = {"namespaces": {"tenant-a": {"tiers": bytes_of_two}}}
    with ucm.open(stack(tmp_path, quotas), device_id=0) as store:
        for block in ids(5, 1):
            dump(store, [block], "tenant-a")
            time.sleep(0.01)  # mtimes apart: the oldest go first
        dump(store, ids(2, 2), "tenant-b")
        assert store.stats()["namespace_tiers"] == {
            "posix": {
                "tenant-a": {"bytes": 2 * POSIX_BLOCK, "evictions": 3 * SPB},
                "tenant-b": {"bytes": 2 * POSIX_BLOCK, "evictions": 0},
            },
            "fsspec": {
                "tenant-a": {"bytes": 2 * FSSPEC_BLOCK, "evictions": 3 * SPB},
                "tenant-b": {"bytes": 2 * FSSPEC_BLOCK, "evictions": 0},
            },
        }
        assert disk_bytes(tmp_path / "nvme", "tenant-a") == 2 * POSIX_BLOCK
        assert object_bytes(tmp_path / "objects", "tenant-a") == 2 * FSSPEC_BLOCK
        samples = prometheus(store)
        assert samples[("ucm_tier_namespace_evictions_total", "1", "posix", "tenant-a")] == 6
        assert samples[("ucm_tier_namespace_evictions_total", "2", "fsspec", "tenant-a")] == 6


def test_a_tier_that_cannot_tell_shows_unknown_not_zero(
    tmp_path: Path, scratch_tier: type[ucm.Tier]
) -> None:
    """A tier without per-namespace figures (Mooncake Store, which lists no keys; here the
    test plugin's tier): None in stats, "-" in the table, no series in Prometheus."""
    from rich.console import Console

    from ucm import cli_ops

    config = stack(tmp_path)
    config["tiers"] = [config["tiers"][0], {"type": "scratch"}]
    with ucm.open(config, device_id=0) as store:
        dump(store, ids(2, 1), "tenant-a")
        figures = store.namespace_tier_stats(wait_s=60)
        assert figures == {
            "posix": {"tenant-a": {"bytes": 2 * POSIX_BLOCK, "evictions": 0}},
            "scratch": None,
        }
        assert {key[1:] for key in prometheus(store)} == {("1", "posix", "tenant-a")}
        console = Console(width=200, record=True)
        console.print(cli_ops.namespace_view(metrics.snapshot(store)))
        rows = [line.split("│") for line in console.export_text().splitlines()]
        cells = [[cell.strip() for cell in row[1:-1]] for row in rows if len(row) > 2]
        assert ["tenant-a", str(2 * POSIX_BLOCK), "0", "-", "-"] in cells


def test_the_namespace_label_is_capped_across_the_buffer_and_the_tiers() -> None:
    """The same namespaces keep their own label in the buffer's and the tiers' metrics: the
    most buffer slots first, then the most bytes below; the rest are summed as ``_other``."""
    buffer = {
        name: {"occupancy_slots": slots}
        for name, slots in (("default", 0), ("hot", 5), ("warm", 1))
    }
    tiers: dict[str, dict[str, dict[str, int]] | None] = {
        "posix": {f"t{i:02d}": {"bytes": 100 * i, "evictions": i} for i in range(20)},
        "mooncake": None,
    }
    kept = metrics.labelled_namespaces(buffer, tiers)
    # hot and warm by their slots, then the 14 namespaces with the most bytes below.
    assert kept == {"hot", "warm", *(f"t{i:02d}" for i in range(6, 20))}
    posix = tiers["posix"]
    assert posix is not None
    grouped = metrics.namespace_labels(posix, kept)
    assert len(grouped) == 15
    assert grouped["_other"] == {
        "bytes": 100 * sum(range(6)),
        "evictions": sum(range(6)),
    }
    assert metrics.namespace_labels(buffer, kept) == {
        "hot": {"occupancy_slots": 5},
        "warm": {"occupancy_slots": 1},
        "_other": {"occupancy_slots": 0},
    }
