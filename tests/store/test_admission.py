"""Admission (``admit:`` of a lower tier, ucm/admission.py): the CacheBuffer counts each shard's
uses node-wide (``Slot.reuses``), and a gated tier gets a shard only once it is admitted. Ranks
are real processes; what a tier holds is read back byte for byte through a posix-only store."""

from __future__ import annotations

import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

import ucm
from ucm import metrics
from ucm.errors import ConfigError
from ucm.native.buffer import GetResult
from ucm.ranks import RankGroup

from ._writeback_ranks import rank_main
from .conftest import block, payload

SHARD = 4096
REPLY_TIMEOUT_S = 120
"""Bound on one command's reply: generous for a busy machine, still catches a hang."""


def gated_stack(
    tmp_path: Path, admit: Any, *, write: str = "through", slots: int = 64, **buffer: Any
) -> dict[str, Any]:
    return {
        "unique_id": f"adm-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [
            {"type": "buffer", "capacity": slots * SHARD, "flush_interval_s": 3600, **buffer},
            {"type": "posix", "path": str(tmp_path / "nvme"), "write": write, "admit": admit},
        ],
    }


def posix_holds(tmp_path: Path, numbers: range | list[int]) -> dict[int, bool]:
    """Per block: whether the posix tier holds it with exactly its payload (read back through
    a posix-only store)."""
    config = {
        "unique_id": f"po-{uuid.uuid4().hex[:12]}",
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [{"type": "posix", "path": str(tmp_path / "nvme")}],
    }
    held = {}
    with ucm.open(config) as store:
        present = store.lookup([block(n) for n in numbers])
        for n, there in zip(numbers, present, strict=True):
            if not there:
                held[n] = False
                continue
            dst = [[torch.zeros(SHARD, dtype=torch.uint8)]]
            store.wait(store.load([block(n)], 0, dst))
            assert dst[0][0].numpy().tobytes() == payload(block(n), 0, SHARD), f"block {n} torn"
            held[n] = True
    return held


def dump(store: ucm.Store, numbers: range | list[int]) -> None:
    blocks = [block(n) for n in numbers]
    src = [[torch.frombuffer(bytearray(payload(b, 0, SHARD)), dtype=torch.uint8)] for b in blocks]
    store.wait(store.dump(blocks, 0, src))


def load(store: ucm.Store, numbers: range | list[int]) -> None:
    blocks = [block(n) for n in numbers]
    dst = [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in blocks]
    store.wait(store.load(blocks, 0, dst))
    for b, d in zip(blocks, dst, strict=True):
        assert d[0].numpy().tobytes() == payload(b, 0, SHARD)


def reuses(store: ucm.Store, numbers: range | list[int]) -> list[int]:
    assert store.buffer is not None
    return store.buffer.core.reuses([(block(n), 0) for n in numbers])


def admission_stats(store: ucm.Store) -> dict[str, Any]:
    stats = store.stats()
    return {name: stats[name] for name in ("admitted_shards", "declined_shards")} | {
        "tier": {
            name: stats["tiers"][1][name]
            for name in ("admit", "admitted_shards", "declined_shards", "declined_bytes")
        }
    }


def _call(conn: Connection, command: tuple[Any, ...]) -> Any:
    conn.send(command)
    assert conn.poll(REPLY_TIMEOUT_S), f"no reply to {command[0]!r}"
    kind, value = conn.recv()
    assert kind != "error", value
    return value


def test_reuse_counts_are_exact_with_four_ranks_in_real_processes(tmp_path: Path) -> None:
    """Every Get that finds a shard resident counts one use, whichever rank makes it, hits
    and waits on another rank's load alike; look-ups do not count. Admission writes each
    block once node-wide."""
    config = gated_stack(tmp_path, {"after_reuse": 1})
    blocks = range(8)
    with ucm.open(config) as parent:
        dump(parent, blocks)
        assert reuses(parent, blocks) == [0] * 8  # a dump installs the slot: no use yet
        with RankGroup(parties=4) as group:
            pipes = [group.context.Pipe() for _ in range(4)]
            for rank, (mine, theirs) in enumerate(pipes):
                group.spawn(rank_main, config, rank, 4, theirs)
                assert mine.poll(REPLY_TIMEOUT_S)
                assert mine.recv() == ("ready", None)
            # Rank r loads blocks 0..2r+1, twice (two tasks): all four ranks at once.
            for _round in range(2):
                for rank, (mine, _) in enumerate(pipes):
                    mine.send(("load", list(range(2 * rank + 2)), 0))
                for mine, _ in pipes:
                    assert mine.poll(REPLY_TIMEOUT_S)
                    assert mine.recv() == ("loaded", True)
            parent.lookup([block(n) for n in blocks])  # not a use
            expected = [2 * sum(1 for r in range(4) if n <= 2 * r + 1) for n in blocks]
            assert expected == [8, 8, 6, 6, 4, 4, 2, 2]
            assert reuses(parent, blocks) == expected
            # Each block was admitted (after_reuse: 1) by exactly one rank of the four, which
            # wrote it to posix once: the admission bit is node-wide.
            deadline = time.monotonic() + REPLY_TIMEOUT_S
            while True:
                admitted = [
                    _call(mine, ("stats",))["store"]["admitted_shards"] for mine, _ in pipes
                ]
                if sum(admitted) >= 8 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert sum(admitted) == 8, admitted
            assert posix_holds(tmp_path, blocks) == dict.fromkeys(blocks, True)
            for mine, _ in pipes:
                assert _call(mine, ("close",)) is None
            group.join()


def test_after_reuse_through_writes_a_block_at_its_nth_use_and_never_before(
    tmp_path: Path,
) -> None:
    config = gated_stack(tmp_path, {"after_reuse": 2})
    with ucm.open(config) as store:
        dump(store, range(6))
        store.drain()
        assert posix_holds(tmp_path, range(6)) == dict.fromkeys(range(6), False)
        load(store, range(3))  # one use each: not yet
        store.drain()
        assert reuses(store, range(6)) == [1, 1, 1, 0, 0, 0]
        assert not any(posix_holds(tmp_path, range(6)).values())
        load(store, range(2))  # the second use of blocks 0 and 1: admitted, written now
        store.drain()
        assert posix_holds(tmp_path, range(6)) == {
            0: True,
            1: True,
            2: False,
            3: False,
            4: False,
            5: False,
        }
        written = store.stats()["tiers"][1]["bytes_written"]
        assert written >= 2 * SHARD
        load(store, range(2))  # admitted once: not written again
        store.drain()
        assert store.stats()["tiers"][1]["bytes_written"] == written
        exposition = metrics.render(store).decode()
        assert 'ucm_store_admitted_shards_total{device_id="0",unique_id="' in exposition
        assert "ucm_store_declined_bytes_total{" in exposition
        assert (
            'ucm_tier_admitted_shards{device_id="0",tier="1",type="posix",unique_id="' in exposition
        )
        assert admission_stats(store) == {
            "admitted_shards": 2,
            "declined_shards": 6,
            "tier": {
                "admit": "{after_reuse: 2}",
                "admitted_shards": 2,
                "declined_shards": 6,
                "declined_bytes": 6 * SHARD,
            },
        }
    assert posix_holds(tmp_path, range(6)) == {
        0: True,
        1: True,
        2: False,
        3: False,
        4: False,
        5: False,
    }


def test_always_writes_every_dump_through(tmp_path: Path) -> None:
    with ucm.open(gated_stack(tmp_path, "always")) as store:
        dump(store, range(4))
        store.drain()
        assert posix_holds(tmp_path, range(4)) == dict.fromkeys(range(4), True)
        assert store.stats()["declined_shards"] == 0


def test_min_residency_writes_what_survived_it_and_close_drops_what_did_not(
    tmp_path: Path,
) -> None:
    config = gated_stack(tmp_path, {"min_residency_ms": 2000})
    store = ucm.open(config)
    try:
        dumped_at = time.monotonic()
        dump(store, range(4))
        store.remove([block(3)])  # gone before its residency: never written
        store.drain()
        holds = posix_holds(tmp_path, range(4))
        if time.monotonic() - dumped_at < 1.9:  # a busy machine may take longer to get here
            assert not any(holds.values()), holds
        deadline = time.monotonic() + 30
        while store.stats()["admitted_shards"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert posix_holds(tmp_path, range(4)) == {0: True, 1: True, 2: True, 3: False}
        closing_at = time.monotonic()
        dump(store, range(10, 12))  # closed before their residency: dropped
    finally:
        store.close()
    if time.monotonic() - closing_at < 1.9:
        assert posix_holds(tmp_path, [10, 11]) == {10: False, 11: False}
        assert store.stats()["admitted_shards"] == 3


def test_after_reuse_with_min_residency_needs_both(tmp_path: Path) -> None:
    config = gated_stack(tmp_path, {"after_reuse": 1, "min_residency_ms": 2000})
    with ucm.open(config) as store:
        dumped_at = time.monotonic()
        dump(store, range(3))
        load(store, [0])  # used, not yet resident for 2 s
        store.drain()
        holds = posix_holds(tmp_path, range(3))
        if time.monotonic() - dumped_at < 1.9:  # a busy machine may take longer to get here
            assert not any(holds.values()), holds
        time.sleep(max(0.0, 2.2 - (time.monotonic() - dumped_at)))
        store.drain()  # the residency check: block 0 used once and survived 2 s
        assert posix_holds(tmp_path, range(3)) == {0: True, 1: False, 2: False}
        load(store, [1])  # used after its residency: admitted at this use
        store.drain()
        assert posix_holds(tmp_path, range(3)) == {0: True, 1: True, 2: False}


def test_write_back_drops_an_evicted_or_closed_dirty_block_never_admitted(tmp_path: Path) -> None:
    """A gated `write: back` tier gets a shard at its admission only: the flushers pay the
    debt of a non-admitted one without writing it, so it is dropped on eviction and at close."""
    config = gated_stack(tmp_path, {"after_reuse": 1}, write="back", slots=16, dirty_max=4 * SHARD)
    with ucm.open(config) as store:
        dump(store, range(4))
        load(store, [0, 1])
        store.drain()
        assert posix_holds(tmp_path, range(4)) == {0: True, 1: True, 2: False, 3: False}
        written = store.stats()["tiers"][1]["bytes_written"]
        dump(store, range(4, 40))  # evicts blocks 2 and 3 (and more), never admitted
        assert store.lookup([block(2), block(3)]) == [False, False]
        stats = store.stats()
        assert stats["tiers"][1]["bytes_written"] == written
        # Every debt paid so far was paid by declining (blocks 0 and 1 were paid before
        # their use, declined too): the tier was written at admission only.
        assert stats["tiers"][1]["declined_shards"] == stats["tiers"][0]["written_back_shards"]
        assert stats["tiers"][1]["declined_shards"] >= 36 - 4
        assert stats["tiers"][1]["admitted_shards"] == 2
    held = posix_holds(tmp_path, range(40))
    assert [n for n, there in held.items() if there] == [0, 1]


def test_a_corrupt_admit_value_names_its_yaml_path(tmp_path: Path) -> None:
    cases = [
        ("sometimes", "tiers[1].admit: unknown admission policy 'sometimes'; valid: 'always', or"),
        (
            {"after_reuse": 0},
            "tiers[1].admit.after_reuse: Input should be greater than or equal to 1 (got 0)",
        ),
        (
            {"after_reuse": 70000},
            "tiers[1].admit.after_reuse: Input should be less than or equal to 65535 (got 70000)",
        ),
        (
            {"min_residency_ms": "soon"},
            "tiers[1].admit.min_residency_ms: Input should be a valid integer",
        ),
        (
            {"after_rese": 2},
            "tiers[1].admit.after_rese: unknown key (misspelled?); not allowed here (got 2)",
        ),
        (
            {},
            "tiers[1].admit: not an admission policy; valid: 'always', or a mapping with "
            "after_reuse: N (1..65535 uses) and/or min_residency_ms: T (1..86400000 ms) (got {})",
        ),
    ]
    for value, message in cases:
        with pytest.raises(ConfigError) as info:
            ucm.open(gated_stack(tmp_path, value))
        assert message in str(info.value), str(info.value)
    no_buffer = {
        "unique_id": "adm-nobuf",
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [{"type": "posix", "path": str(tmp_path), "admit": {"after_reuse": 1}}],
    }
    with pytest.raises(ConfigError) as info:
        ucm.open(no_buffer)
    assert (
        "tiers[0].admit: admission counts uses in the CacheBuffer: give the stack a buffer tier "
        "(the buffer section or tiers[0]), or use admit: always (got '{after_reuse: 1}')"
    ) in str(info.value)
    with pytest.raises(ConfigError) as info:
        ucm.open(gated_stack(tmp_path, {"after_reuse": 1}, write="none"))
    assert "tiers[1].admit: a `write: none` tier is never written by the cascade" in str(info.value)


def test_a_dump_that_replaces_a_resident_block_starts_its_count_over(tmp_path: Path) -> None:
    """The dump path replaces a Ready copy (remove, then claim afresh): the new slot's count
    starts at 0, so a re-dump neither admits the block nor keeps the uses it had."""
    with ucm.open(gated_stack(tmp_path, {"after_reuse": 2})) as store:
        dump(store, range(3))
        load(store, [0])
        store.drain()
        assert reuses(store, range(3)) == [1, 0, 0]
        dump(store, [0])
        store.drain()
        assert reuses(store, range(3)) == [0, 0, 0]
        assert not any(posix_holds(tmp_path, range(3)).values())


def test_a_dump_of_a_block_another_rank_reads_counts_no_use(tmp_path: Path) -> None:
    """A dump that meets a Ready copy another rank holds keeps that copy (its bytes are the
    same) and is no use of it: writing a block is not reading it. Before the dump's claims
    were uses, this re-dump took block 0 from one use to three, and admitted it."""
    config = gated_stack(tmp_path, {"after_reuse": 2})
    with ucm.open(config) as store:
        dump(store, range(3))
        with RankGroup(parties=1) as group:
            mine, theirs = group.context.Pipe()
            group.spawn(rank_main, config, 1, 2, theirs)
            assert mine.poll(REPLY_TIMEOUT_S)
            assert mine.recv() == ("ready", None)
            assert _call(mine, ("hold", [0], 0)) == [GetResult.HIT]  # the reader's one use
            dump(store, [0])  # replaces nothing: the reader holds the slot
            assert reuses(store, range(3)) == [1, 0, 0]
            assert _call(mine, ("release",)) is None
            store.drain()
            assert reuses(store, range(3)) == [1, 0, 0]
            assert admission_stats(store)["admitted_shards"] == 0
            assert _call(mine, ("close",)) is None
            group.join()
        assert not any(posix_holds(tmp_path, range(3)).values())


@pytest.mark.parametrize(
    "admit", ["always", {"after_reuse": 2}, {"after_reuse": 1, "min_residency_ms": 5}]
)
def test_a_stack_dumped_without_nones_validates_again(tmp_path: Path, admit: Any) -> None:
    """Engines re-validate a StackConfig's ``model_dump(exclude_none=True)`` (ucm.integration
    keys.engine_stack): ``always`` once dumped as ``{}``, which ``admit:`` refuses."""
    from ucm.stack import parse_stack

    config = parse_stack(gated_stack(tmp_path, admit))
    dumped = config.model_dump(exclude_none=True)
    assert dumped["tiers"][1]["admit"] == admit
    assert parse_stack(dumped) == config
