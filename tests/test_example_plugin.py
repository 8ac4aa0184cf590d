"""The example third-party tier (examples/ucm-tier-sqlite): conformance suite, its own behaviour
(capacity, eviction to a write-back sink, several threads and processes on one file), and a
stack that uses it end to end through ``ucm.open``."""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import math
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

import ucm
from ucm.errors import ConfigError, KeyMissingError, TierError
from ucm.layout import Key, Layout
from ucm.testing import TierConformance, make_context, shard_bytes
from ucm.tier import REMOVE_CHUNK_KEYS, Outcome, ShardViews

try:
    importlib.metadata.distribution("ucm-tier-sqlite")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "example plugin not installed: pip install -e examples/ucm-tier-sqlite",
        allow_module_level=True,
    )

from ucm_tier_sqlite import SqliteTier, SqliteTierConfig

LAYOUT = Layout(shard_size=256, shards_per_block=2, tensor_sizes=(100, 156))
TierMaker = Callable[..., SqliteTier]


class TestSqliteTierConformance(TierConformance):
    @pytest.fixture
    def tier_factory(self, tmp_path: Path) -> Callable[[Layout], SqliteTier]:
        counter = iter(range(1000))

        def make(layout: Layout) -> SqliteTier:
            path = tmp_path / f"conformance-{next(counter)}.sqlite3"
            return SqliteTier(SqliteTierConfig(path=path), make_context(layout))

        return make


@pytest.fixture
def make_tier(tmp_path: Path) -> Any:
    made: list[SqliteTier] = []

    def make(layout: Layout = LAYOUT, evict_sink: Any = None, **config: Any) -> SqliteTier:
        config.setdefault("path", tmp_path / "kv.sqlite3")
        tier = SqliteTier(SqliteTierConfig(**config), make_context(layout, evict_sink=evict_sink))
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def keys_of(count: int, shard: int = 0, seed: int = 0) -> list[Key]:
    return [(seed.to_bytes(8, "big") + i.to_bytes(8, "big"), shard) for i in range(count)]


def dump(tier: SqliteTier, keys: Sequence[Key], salt: int = 0) -> list[Outcome]:
    sources = [[memoryview(shard_bytes(key, tier.layout, salt))] for key in keys]
    return tier.dump(keys, sources)


def load(tier: SqliteTier, keys: Sequence[Key]) -> tuple[list[Outcome], list[bytes]]:
    buffers = [bytearray(tier.layout.shard_size) for _ in keys]
    outcomes = tier.load(keys, [[memoryview(b)] for b in buffers])
    return outcomes, [bytes(b) for b in buffers]


def pause() -> None:
    time.sleep(0.002)  # orders last-touch timestamps


# -- configuration -----------------------------------------------------------------------------


def test_config_defaults_and_sizes(tmp_path: Path) -> None:
    config = SqliteTierConfig.model_validate({"type": "sqlite", "path": str(tmp_path / "a.db")})
    assert config.model_dump() == {
        "type": "sqlite",
        "name": None,
        "write": "through",
        "promote": False,
        "codec": {"type": "none"},
        "lookup_timeout_ms": 1000,
        "breaker": {"failures": 3, "probe_interval_ms": 10000},
        "admit": "always",
        "path": tmp_path / "a.db",
        "capacity": None,
        "timeout": 30.0,
    }
    assert SqliteTierConfig(path=tmp_path, capacity="1MiB").capacity == 1024**2


def test_capacity_below_one_shard_is_a_config_error(make_tier: TierMaker) -> None:
    with pytest.raises(ConfigError) as excinfo:
        make_tier(capacity=255)
    assert str(excinfo.value) == (
        "tiers[1].capacity: 255 bytes cannot hold one shard (256 bytes); give at least 256"
    )


def test_database_and_its_directory_are_created(tmp_path: Path, make_tier: TierMaker) -> None:
    path = tmp_path / "deep" / "er" / "kv.sqlite3"
    tier = make_tier(path=path)
    assert path.is_file()
    assert dump(tier, keys_of(1)) == [None]


def test_unusable_path_is_a_config_error(tmp_path: Path, make_tier: TierMaker) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError) as excinfo:
        make_tier(path=tmp_path / "file" / "kv.sqlite3")
    assert str(excinfo.value).startswith(
        f"tiers[1].path: cannot create the directory of '{tmp_path / 'file' / 'kv.sqlite3'}': "
    )


# -- data, outcomes, stats -----------------------------------------------------------------------


def test_scatter_gather_across_views_of_any_split(make_tier: TierMaker) -> None:
    tier = make_tier()
    keys = keys_of(3)
    data = [shard_bytes(key, LAYOUT) for key in keys]
    splits = [(0, 256), (0, 1, 100, 255, 256), (0, 0, 128, 256)]  # empty views are fine
    sources = [
        [memoryview(d)[a:b] for a, b in itertools.pairwise(cuts)]
        for d, cuts in zip(data, splits, strict=True)
    ]
    assert tier.dump(keys, sources) == [None] * 3
    buffers = [bytearray(256) for _ in keys]
    destinations = [
        [memoryview(b)[a:c] for a, c in itertools.pairwise(cuts)]
        for b, cuts in zip(buffers, reversed(splits), strict=True)
    ]
    assert tier.load(keys, destinations) == [None] * 3
    assert [bytes(b) for b in buffers] == data


def test_bad_entries_get_their_own_outcomes(make_tier: TierMaker) -> None:
    tier = make_tier()
    good = keys_of(1)[0]
    short = memoryview(bytearray(255))
    outcomes = tier.dump(
        [(b"short", 0), (good[0], 2), good, good],
        [[memoryview(bytearray(256))]] * 2 + [[short], [memoryview(shard_bytes(good, LAYOUT))]],
    )
    assert [str(o) for o in outcomes[:2]] == [
        "block id b'short' must be 16 bytes",
        "shard index 2 out of range 0..1",
    ]
    # A key given twice: the last source wins and both entries share its outcome.
    assert outcomes[2:] == [None, None]
    assert load(tier, [good])[1] == [shard_bytes(good, LAYOUT)]
    readonly = [memoryview(bytes(256))]
    (problem,) = tier.load([good], [readonly])
    assert str(problem) == "destination view is read-only"
    with pytest.raises(ucm.InvalidArgumentError, match="got 2 entries for 1 keys"):
        tier.dump([good], [[short], [short]])


def test_stats_count_hits_misses_bytes_and_usage(make_tier: TierMaker) -> None:
    tier = make_tier(capacity=10 * 256)
    keys = keys_of(4)
    dump(tier, keys)
    outcomes, _ = load(tier, [*keys[:3], *keys_of(2, seed=9)])
    assert [type(o) for o in outcomes] == [type(None)] * 3 + [KeyMissingError] * 2
    stats = tier.stats()
    assert {k: stats[k] for k in ("hits", "misses", "bytes_read", "bytes_written")} == {
        "hits": 3,
        "misses": 2,
        "bytes_read": 3 * 256,
        "bytes_written": 4 * 256,
    }
    assert (stats["shards"], stats["used_bytes"], stats["capacity"]) == (4, 1024, 2560)
    dump(tier, keys[:2], salt=1)  # overwrites do not grow usage
    assert (tier.stats()["shards"], tier.stats()["used_bytes"]) == (4, 1024)
    assert tier.batched_remove(keys[1:]) == 3
    assert (tier.stats()["shards"], tier.stats()["used_bytes"], tier.stats()["removed"]) == (
        1,
        256,
        3,
    )


def test_shard_written_with_another_shard_size_is_a_tier_error(
    tmp_path: Path, make_tier: TierMaker
) -> None:
    small = Layout(shard_size=128, shards_per_block=2, tensor_sizes=(128,))
    key = keys_of(1)[0]
    assert dump(make_tier(small), [key]) == [None]
    (outcome,), _ = load(make_tier(LAYOUT), [key])
    assert isinstance(outcome, TierError) and not isinstance(outcome, KeyMissingError)
    assert str(outcome) == (
        f"sqlite tier 'sqlite': block {key[0].hex()} shard 0 holds 128 bytes, expected 256 "
        "(written with another shard_size?)"
    )


def test_closed_tier_fails_clearly(make_tier: TierMaker) -> None:
    tier = make_tier(name="cold")
    tier.close()
    with pytest.raises(TierError, match=r"^sqlite tier 'cold' is closed$"):
        tier.lookup(keys_of(1))
    assert [str(o) for o in dump(tier, keys_of(1))] == ["sqlite tier 'cold' is closed"]


# -- capacity and eviction -----------------------------------------------------------------------


def test_capacity_evicts_least_recently_touched_first(make_tier: TierMaker) -> None:
    tier = make_tier(capacity=4 * 256)
    old, renewed = keys_of(2, seed=1), keys_of(2, seed=2)
    dump(tier, old + renewed)
    pause()
    tier.touch([key[0] for key in renewed])
    pause()
    newcomers = keys_of(2, seed=3)
    assert dump(tier, newcomers) == [None, None]
    assert tier.lookup(old + renewed + newcomers) == [False] * 2 + [True] * 4
    assert tier.stats()["evictions"] == 2
    assert load(tier, renewed + newcomers)[1] == [
        shard_bytes(k, LAYOUT) for k in renewed + newcomers
    ]


def test_a_load_hit_counts_as_a_use(make_tier: TierMaker) -> None:
    tier = make_tier(capacity=2 * 256)
    first, second = keys_of(2)
    dump(tier, [first])
    pause()
    dump(tier, [second])
    pause()
    assert load(tier, [first])[0] == [None]
    pause()
    dump(tier, keys_of(1, seed=5))
    assert tier.lookup([first, second]) == [True, False]


def test_pinned_shards_are_never_evicted_and_a_full_tier_rejects_per_key(
    make_tier: TierMaker,
) -> None:
    tier = make_tier(capacity=2 * 256)
    stored = keys_of(2)
    dump(tier, stored)
    tier.pins.pin(stored)
    outcomes = dump(tier, keys_of(1, seed=7))
    tier.pins.unpin(stored)
    assert [str(o) for o in outcomes] == [
        "sqlite tier 'sqlite' is full: capacity 512 bytes, every other shard is in use or "
        "could not be written back below"
    ]
    assert tier.lookup(stored + keys_of(1, seed=7)) == [True, True, False]
    assert tier.stats()["rejected_full"] == 1


def test_evicted_shards_go_to_the_sink_first_and_a_failed_one_is_kept(
    make_tier: TierMaker,
) -> None:
    received: list[tuple[Key, bytes]] = []
    refuse: set[Key] = set()

    def sink(keys: Sequence[Key], views: Sequence[ShardViews]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for key, shard in zip(keys, views, strict=True):
            if key in refuse:
                outcomes.append(TierError("lower tier down"))
            else:
                received.append((key, b"".join(shard)))
                outcomes.append(None)
        return outcomes

    tier = make_tier(capacity=2 * 256, evict_sink=sink)
    first, second = keys_of(2)
    dump(tier, [first])
    pause()
    dump(tier, [second])
    pause()
    refuse.add(first)  # the oldest cannot be written back: it must stay
    (outcome,) = dump(tier, keys_of(1, seed=3))
    assert isinstance(outcome, TierError) and "is full" in str(outcome)
    assert tier.lookup([first, second]) == [True, True]
    refuse.clear()
    assert dump(tier, keys_of(1, seed=3)) == [None]
    assert received == [(first, shard_bytes(first, LAYOUT))]
    assert tier.lookup([first, second, *keys_of(1, seed=3)]) == [False, True, True]


# -- batched_remove: one lock per chunk ----------------------------------------------------------


def test_remove_lock_acquisitions_per_chunk(make_tier: TierMaker) -> None:
    layout = Layout(shard_size=16, shards_per_block=1, tensor_sizes=(16,))
    tier = make_tier(layout)
    for n in (0, 1, REMOVE_CHUNK_KEYS, REMOVE_CHUNK_KEYS + 1, 2500):
        keys = keys_of(n, seed=n)
        assert dump(tier, keys) == [None] * n
        before = tier.stats()["remove_lock_acquisitions"]
        assert tier.batched_remove(keys + keys) == n  # duplicates are removed (and counted) once
        assert tier.stats()["remove_lock_acquisitions"] - before == math.ceil(n / REMOVE_CHUNK_KEYS)
        assert tier.stats()["shards"] == 0


# -- several threads and processes on one file ---------------------------------------------------


def test_threads_share_one_tier(make_tier: TierMaker) -> None:
    tier = make_tier()
    errors: list[str] = []

    def work(seed: int) -> None:
        keys = keys_of(20, seed=seed)
        for _ in range(3):
            if dump(tier, keys, salt=seed) != [None] * 20:
                errors.append(f"dump {seed}")
            outcomes, data = load(tier, keys)
            if outcomes != [None] * 20 or data != [shard_bytes(k, LAYOUT, seed) for k in keys]:
                errors.append(f"load {seed}")
            tier.touch([key[0] for key in keys])

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert tier.stats()["shards"] == 80
    assert tier.batched_remove([k for s in range(4) for k in keys_of(20, seed=s)]) == 80


WORKER = textwrap.dedent(
    """
    import json, sys, time
    from ucm.layout import Layout
    from ucm.testing import make_context, shard_bytes
    from ucm_tier_sqlite import SqliteTier, SqliteTierConfig

    path, rank, ranks, per_rank, phase = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    layout = Layout(shard_size=256, shards_per_block=2, tensor_sizes=(100, 156))
    keys_of = lambda r: [(r.to_bytes(8, "big") + i.to_bytes(8, "big"), i % 2)
                         for i in range(per_rank)]
    every_key = [k for r in range(ranks) for k in keys_of(r)]
    tier = SqliteTier(SqliteTierConfig(path=path), make_context(layout, device_id=rank))
    if phase == "dump":
        mine = keys_of(rank)
        data = [shard_bytes(k, layout) for k in mine]
        outcomes = tier.dump(mine, [[memoryview(d)[:100], memoryview(d)[100:]] for d in data])
        assert outcomes == [None] * per_rank, outcomes
        deadline = time.monotonic() + 60
        while not all(tier.lookup(every_key)):  # until every peer has written its keys
            assert time.monotonic() < deadline, "peers did not write their keys"
            time.sleep(0.01)
        buffers = [bytearray(256) for _ in every_key]
        outcomes = tier.load(every_key, [[memoryview(b)] for b in buffers])
        exact = all(bytes(b) == shard_bytes(k, layout) for k, b in zip(every_key, buffers))
        print(json.dumps({"ok": outcomes == [None] * len(every_key), "exact": exact}))
    else:
        print(json.dumps({"removed": tier.batched_remove(every_key)}))
    tier.close()
    """
)


def run_ranks(path: Path, ranks: int, per_rank: int, phase: str) -> list[dict[str, Any]]:
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(path), str(rank), str(ranks), str(per_rank), phase],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(ranks)
    ]
    results = []
    for process in processes:
        try:
            out, err = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
        assert process.returncode == 0, err
        results.append(json.loads(out))
    return results


def test_processes_share_one_database_file(tmp_path: Path) -> None:
    path = tmp_path / "shared.sqlite3"
    assert run_ranks(path, ranks=3, per_rank=40, phase="dump") == [{"ok": True, "exact": True}] * 3
    # Concurrent removal of the same keys: each is removed exactly once overall.
    removed = run_ranks(path, ranks=3, per_rank=40, phase="remove")
    assert sum(result["removed"] for result in removed) == 3 * 40


# -- a stack that uses the plugin, end to end ------------------------------------------------------


def test_stack_with_the_sqlite_tier_dumps_and_loads_byte_exact(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    stack = {
        "unique_id": "sqlite-example",
        "tensor_size_list": [1024, 3072],
        "shards_per_block": 1,
        "tiers": [{"type": "sqlite", "path": str(tmp_path / "kv.sqlite3"), "capacity": "1MiB"}],
    }
    store = ucm.open(stack, device_id=0, local_rank_size=1)
    try:
        assert isinstance(store.tiers[0], SqliteTier)
        ids = [bytes([i]) * 16 for i in range(4)]
        generator = torch.Generator().manual_seed(0)
        src = [
            [
                torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
                for size in (1024, 3072)
            ]
            for _ in ids
        ]
        store.wait(store.dump(ids, [0] * 4, src))
        assert store.lookup(ids) == [True] * 4
        dst = [[torch.zeros(size, dtype=torch.uint8) for size in (1024, 3072)] for _ in ids]
        store.wait(store.load(ids, [0] * 4, dst))
        for got, want in zip(dst, src, strict=True):
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        assert store.remove(ids) == 4
        assert store.lookup(ids) == [False] * 4
    finally:
        store.close()
