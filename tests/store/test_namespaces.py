"""Namespaces (issue 22): the same block ids in two namespaces never meet (no hit, load, remove
or presence answer crosses), in the CacheBuffer and in every lower tier; a purge removes
exactly one namespace's shards from every tier and leaves the others byte-exact; a second node
(another buffer) serving the same namespace sees the same blocks; the admin commands print
exact counts. Real tiers (buffer, posix, fsspec over files), real processes where it matters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import ucm

SHARD = 4096
SPB = 2


def stack(tmp_path: Path, *, write: str = "through", buffer: bool = True) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = []
    if buffer:
        tiers.append({"type": "buffer", "capacity": 64 * SHARD})
    tiers += [
        {"type": "posix", "path": str(tmp_path / "nvme"), "write": write},
        {"type": "fsspec", "url": f"file://{tmp_path / 'objects'}", "write": write},
    ]
    return {
        "unique_id": f"ns-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": SPB,
        "tiers": tiers,
    }


def ids(count: int, seed: int = 0) -> list[bytes]:
    return [bytes([seed, i]) * 8 for i in range(count)]


def content(value: int) -> torch.Tensor:
    return torch.arange(SHARD, dtype=torch.int64).to(torch.uint8) ^ value


def dump_all(store: ucm.Store, blocks: list[bytes], value: int, **kw: Any) -> None:
    for shard in range(SPB):
        src = [[content(value + shard)] for _ in blocks]
        store.wait(store.dump(blocks, shard, src, **kw))
    store.drain()


def assert_loads(store: ucm.Store, blocks: list[bytes], value: int, **kw: Any) -> None:
    for shard in range(SPB):
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
        store.wait(store.load(blocks, shard, dst, **kw))
        for got in dst:
            assert torch.equal(got[0], content(value + shard)), "not byte-exact"


def test_same_blocks_in_two_namespaces_never_cross(tmp_path: Path) -> None:
    blocks = ids(4)
    with ucm.open(stack(tmp_path), device_id=0) as store:
        dump_all(store, blocks, 10, namespace="tenant-a")
        assert store.lookup(blocks, namespace="tenant-a") == [True] * 4
        # No presence answer in another namespace, the default included.
        assert store.lookup(blocks, namespace="tenant-b") == [False] * 4
        assert store.lookup(blocks) == [False] * 4
        assert store.lookup_on_prefix(blocks, namespace="tenant-b") == -1
        assert store.lookup_on_prefix(blocks, namespace="tenant-a") == 3
        # No load: every key of B is missing, in every tier.
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
        with pytest.raises(ucm.TaskError) as failed:
            store.wait(store.load(blocks, 0, dst, namespace="tenant-b"))
        assert len(failed.value.failures) == 4
        assert all(torch.count_nonzero(d[0]) == 0 for d in dst)
        # No pin, touch or remove of A's shards through B.
        assert [pin.held for pin in store.pin(blocks, namespace="tenant-b")] == [0] * 4
        store.touch(blocks, namespace="tenant-b")
        assert store.remove(blocks, force=True, namespace="tenant-b") == 0
        assert store.remove(blocks, force=True) == 0
        assert_loads(store, blocks, 10, namespace="tenant-a")
        # B's own copy of the same ids is separate data.
        dump_all(store, blocks, 50, namespace="tenant-b")
        assert_loads(store, blocks, 10, namespace="tenant-a")
        assert_loads(store, blocks, 50, namespace="tenant-b")
        assert store.remove(blocks[:1], namespace="tenant-b") == SPB
        assert store.lookup(blocks, namespace="tenant-a") == [True] * 4
        assert store.lookup(blocks, namespace="tenant-b") == [False, True, True, True]


def test_namespace_given_at_open_is_the_default_of_every_call(tmp_path: Path) -> None:
    config = stack(tmp_path)
    blocks = ids(3)
    with ucm.open(config, device_id=0, namespace="tenant-a") as store:
        assert store.namespace == "tenant-a"
        dump_all(store, blocks, 7)
        assert store.lookup(blocks) == [True] * 3
        assert store.lookup(blocks, namespace=ucm.DEFAULT_NAMESPACE) == [False] * 3
        assert_loads(store, blocks, 7, namespace="tenant-a")
    # Another process of the node (same buffer) opens the default namespace: per call it
    # reaches tenant-a's blocks, and only there.
    with ucm.open(config, device_id=0) as store:
        assert store.namespace == ucm.DEFAULT_NAMESPACE
        assert store.lookup(blocks) == [False] * 3
        assert_loads(store, blocks, 7, namespace="tenant-a")


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("", "''"),
        ("a b", "'a b'"),
        ("-leading", "'-leading'"),
        ("x" * 65, "'" + "x" * 65 + "'"),
        ("é", "'é'"),
        (5, "5"),
        (None, "None"),
    ],
)
def test_bad_namespace_names_are_refused_naming_argument_value_and_rule(
    tmp_path: Path, value: Any, shown: str
) -> None:
    rule = "1 to 64 characters of A-Z a-z 0-9 '.' '_' '-', starting with a letter or a digit"
    config = stack(tmp_path, buffer=False)
    if value is not None:  # None at open means nothing wrong; it is refused per call only
        with pytest.raises(ucm.InvalidArgumentError) as at_open:
            ucm.open(config, device_id=0, namespace=value)
        assert f"namespace={shown} is not a valid namespace name" in str(at_open.value)
        assert rule in str(at_open.value)
    with ucm.open(config, device_id=0) as store:
        if value is None:
            assert store.lookup(ids(1), namespace=None) == [False]  # None: the store's own
            return
        with pytest.raises(ucm.InvalidArgumentError) as per_call:
            store.lookup(ids(1), namespace=value)
        assert f"namespace={shown} is not a valid namespace name" in str(per_call.value)
        assert rule in str(per_call.value)


def _tier_store(config: dict[str, Any], position: int, **kw: Any) -> ucm.Store:
    """A store over one lower tier of ``config`` (another node reading it)."""
    lone = {
        **config,
        "unique_id": f"ns-{uuid.uuid4().hex[:12]}",
        "tiers": [config["tiers"][position]],
    }
    return ucm.open(lone, device_id=0, **kw)


def test_purge_removes_exactly_one_namespace_from_every_tier(tmp_path: Path) -> None:
    config = stack(tmp_path)
    blocks = ids(5)
    with ucm.open(config, device_id=0) as store:
        dump_all(store, blocks, 1, namespace="tenant-a")
        dump_all(store, blocks, 2, namespace="tenant-b")
        dump_all(store, blocks, 3)  # the default namespace
        shards = len(blocks) * SPB
        assert store.namespaces() == {
            "default": [shards] * 3,
            "tenant-a": [shards] * 3,
            "tenant-b": [shards] * 3,
        }
        assert store.purge("tenant-a") == [shards, shards, shards]
        assert store.purge("tenant-a") == [0, 0, 0]
        assert store.namespaces() == {"default": [shards] * 3, "tenant-b": [shards] * 3}
        assert store.lookup(blocks, namespace="tenant-a") == [False] * 5
        assert_loads(store, blocks, 2, namespace="tenant-b")
        assert_loads(store, blocks, 3)
        assert store.stats()["purged_shards"] == 3 * shards
    # Each lower tier on its own still holds B and the default byte-exact, and nothing of A.
    for position in (1, 2):
        with _tier_store(config, position) as lone:
            assert lone.lookup(blocks, namespace="tenant-a") == [False] * 5
            assert_loads(lone, blocks, 2, namespace="tenant-b")
            assert_loads(lone, blocks, 3)
    assert not list((tmp_path / "nvme" / "ns" / "tenant-a").rglob("*.blk"))
    assert len(list((tmp_path / "nvme" / "ns" / "tenant-b").rglob("*.blk"))) == 5
    assert not list((tmp_path / "objects" / "ns" / "tenant-a").rglob("[0-9]"))
    assert len(list((tmp_path / "objects" / "ns" / "tenant-b").rglob("[0-9]"))) == shards


def test_a_second_node_serving_the_namespace_sees_its_blocks(tmp_path: Path) -> None:
    config = stack(tmp_path)
    blocks = ids(3)
    with ucm.open(config, device_id=0) as node1:
        dump_all(node1, blocks, 9, namespace="tenant-a")
    # Another node: its own buffer (another unique_id) over the same posix/fsspec storage.
    node2 = {**config, "unique_id": f"ns-{uuid.uuid4().hex[:12]}"}
    with ucm.open(node2, device_id=0) as store:
        assert store.lookup(blocks, namespace="tenant-a") == [True] * 3
        assert store.lookup(blocks, namespace="tenant-b") == [False] * 3
        assert store.lookup(blocks) == [False] * 3
        assert_loads(store, blocks, 9, namespace="tenant-a")


def test_write_back_debt_lands_in_the_namespace_key_space(tmp_path: Path) -> None:
    config = stack(tmp_path, write="back")
    blocks = ids(4)
    with ucm.open(config, device_id=0) as store:
        dump_all(store, blocks, 4, namespace="tenant-a")
        dump_all(store, blocks, 8)
    # The last closer wrote the dirty slots down: into tenant-a's prefix, and the default's.
    assert len(list((tmp_path / "nvme" / "ns" / "tenant-a").rglob("*.blk"))) == 4
    with _tier_store(config, 1) as lone:
        assert_loads(lone, blocks, 4, namespace="tenant-a")
        assert_loads(lone, blocks, 8)


_CHILD = textwrap.dedent(
    """
    import json, sys, torch, ucm
    config = json.loads(sys.argv[1])
    with ucm.open(config, device_id=1, local_rank_size=2, namespace="tenant-b") as store:
        blocks = [bytes([0, i]) * 8 for i in range(4)]
        out = {"own": store.lookup(blocks), "a": store.lookup(blocks, namespace="tenant-a")}
        dst = [[torch.zeros(4096, dtype=torch.uint8)] for _ in blocks]
        store.wait(store.load(blocks, 1, dst, namespace="tenant-a"))
        out["a_bytes"] = [bytes(d[0].numpy()).hex() for d in dst]
        out["removed_as_b"] = store.remove(blocks, force=True)
        out["purged_c"] = store.purge("tenant-c")
    print(json.dumps(out))
    """
)


def test_isolation_holds_across_processes_sharing_one_buffer(tmp_path: Path) -> None:
    config = stack(tmp_path)
    blocks = ids(4)
    with ucm.open(config, device_id=0, local_rank_size=2) as store:
        dump_all(store, blocks, 20, namespace="tenant-a")
        result = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(config)],
            capture_output=True,
            text=True,
            timeout=120,
            env=os.environ.copy(),
        )
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout.strip().splitlines()[-1])
        assert out["own"] == [False] * 4
        assert out["a"] == [True] * 4
        expected = bytes(content(21).numpy()).hex()
        assert out["a_bytes"] == [expected] * 4
        assert out["removed_as_b"] == 0
        assert out["purged_c"] == [0, 0, 0]
        assert_loads(store, blocks, 20, namespace="tenant-a")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ucm.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )


def test_cli_lists_usage_and_purges_with_exact_counts(tmp_path: Path) -> None:
    config = stack(tmp_path)
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    blocks = ids(3)
    shards = len(blocks) * SPB
    with ucm.open(config, device_id=0) as store:  # a live rank: the CLI attaches its buffer
        dump_all(store, blocks, 1, namespace="tenant-a")
        dump_all(store, blocks, 2, namespace="tenant-b")
        listed = _cli("namespaces", str(path), "--json")
        assert listed.returncode == 0, listed.stderr
        usage = json.loads(listed.stdout)
        assert usage["tiers"] == ["buffer (buffer)", "posix (posix)", "fsspec (fsspec)"]
        cell = {"shards": shards, "bytes": shards * SHARD}
        assert usage["namespaces"] == {"tenant-a": [cell] * 3, "tenant-b": [cell] * 3}
        table = _cli("namespaces", str(path))
        assert table.returncode == 0, table.stderr
        assert "tenant-a" in table.stdout and "tenant-b" in table.stdout
        purged = _cli("purge", str(path), "tenant-a")
        assert purged.returncode == 0, purged.stderr
        assert f"buffer (buffer): removed {shards} shard(s)" in purged.stdout
        assert f"posix (posix): removed {shards} shard(s)" in purged.stdout
        assert f"fsspec (fsspec): removed {shards} shard(s)" in purged.stdout
        assert f"purged namespace 'tenant-a': {3 * shards} shard(s) removed" in purged.stdout
        # The live rank sees the purge in the shared buffer and below; B is untouched.
        assert store.lookup(blocks, namespace="tenant-a") == [False] * 3
        assert_loads(store, blocks, 2, namespace="tenant-b")
        again = _cli("purge", str(path), "tenant-a", "--json")
        assert json.loads(again.stdout)["removed"] == {
            "buffer (buffer)": 0,
            "posix (posix)": 0,
            "fsspec (fsspec)": 0,
        }
    bad = _cli("purge", str(path), "no/slash")
    assert bad.returncode == 2
    assert "NAMESPACE='no/slash' is not a valid namespace name" in bad.stderr
    # No live buffer any more: the CLI reads the lower tiers alone.
    after = _cli("namespaces", str(path), "--json")
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["tiers"] == ["posix (posix)", "fsspec (fsspec)"]
    assert json.loads(after.stdout)["namespaces"] == {
        "tenant-b": [{"shards": shards, "bytes": shards * SHARD}] * 2
    }


def test_a_fresh_cli_purges_exactly_default_from_a_buffer_only_stack(tmp_path: Path) -> None:
    # A buffer-only stack: no lower tier's ns/<name>/ layout names anything to the CLI, which
    # knows no namespace by itself. The buffer's own table must tell every tenant apart.
    config = stack(tmp_path)
    config["tiers"] = config["tiers"][:1]
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump(config))
    blocks = ids(4)
    shards = len(blocks) * SPB
    with ucm.open(config, device_id=0) as store:  # a live rank: the CLI attaches its buffer
        dump_all(store, blocks, 1, namespace="tenant-a")
        dump_all(store, blocks, 2, namespace="tenant-b")
        dump_all(store, blocks[:3], 3)  # the default namespace: 3 blocks
        listed = _cli("namespaces", str(path), "--json")
        assert listed.returncode == 0, listed.stderr
        usage = json.loads(listed.stdout)
        assert usage["tiers"] == ["buffer (buffer)"]
        assert usage["namespaces"] == {
            "default": [{"shards": 3 * SPB, "bytes": 3 * SPB * SHARD}],
            "tenant-a": [{"shards": shards, "bytes": shards * SHARD}],
            "tenant-b": [{"shards": shards, "bytes": shards * SHARD}],
        }
        purged = _cli("purge", str(path), "default", "--json")
        assert purged.returncode == 0, purged.stderr
        assert json.loads(purged.stdout) == {
            "namespace": "default",
            "removed": {"buffer (buffer)": 3 * SPB},
        }
        assert store.lookup(blocks[:3]) == [False] * 3
        assert_loads(store, blocks, 1, namespace="tenant-a")  # every shard kept, byte-exact
        assert_loads(store, blocks, 2, namespace="tenant-b")
        assert store.namespaces() == {"tenant-a": [shards], "tenant-b": [shards]}


def test_a_full_identity_table_fails_the_namespaced_call_closed(tmp_path: Path) -> None:
    from ucm.native.buffer import NAMESPACE_NAMES_MAX, NamespaceNamesFullError

    config = stack(tmp_path)
    config["tiers"] = config["tiers"][:1]
    blocks = ids(2)
    with ucm.open(config, device_id=0) as store:
        assert store.buffer is not None
        core = store.buffer.core
        for number in range(NAMESPACE_NAMES_MAX):  # every entry taken by other namespaces
            core.register_namespace_name((number + 1).to_bytes(8, "little"), f"other-{number}")
        src = [[content(5)] for _ in blocks]
        for _ in range(2):  # refused every time, never let in as the default namespace's
            with pytest.raises(NamespaceNamesFullError) as raised:
                store.dump(blocks, 0, src, namespace="late")
            assert str(raised.value) == (
                "cannot use namespace 'late' with this CacheBuffer: all 4096 entries of its "
                "namespace identity table are taken (namespaces ever used on this node's buffer "
                "of this unique_id; entries are never freed while the buffer lives): use a "
                "namespace already in use, or restart the node's ranks on a fresh unique_id"
            )
        assert store.namespaces() == {}
        dump_all(store, blocks, 6)  # the default namespace needs no entry
        assert store.namespaces() == {"default": [len(blocks) * SPB]}


def test_a_failed_key_is_named_by_the_callers_block_id(tmp_path: Path) -> None:
    """TaskError and Task.keys name the ids the caller gave, not the scoped ids the tiers
    store: a caller matching failures against its own keys (LMCache's plugin does) must find
    them. Failed before the fix: the failures named scoped ids."""
    blocks = ids(3)
    with ucm.open(stack(tmp_path), device_id=0, namespace="tenant-a") as store:
        dump_all(store, blocks[:2], 5)
        dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
        task = store.load(blocks, 0, dst)
        assert task.keys == [(block, 0) for block in blocks]
        with pytest.raises(ucm.TaskError) as failed:
            store.wait(task)
        assert set(failed.value.failures) == {(blocks[2], 0)}
        assert torch.equal(dst[0][0], content(5)) and torch.equal(dst[1][0], content(5))
