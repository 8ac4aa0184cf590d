"""Bounded look-ups (issue 21): a lower tier that hangs never holds a look-up past the tier's
deadline (``lookup_timeout_ms``), a circuit breaker skips it after consecutive failures and a
half-open probe brings it back once it is healthy.

The hung tier is real: an fsspec tier whose S3 endpoint is a TCP server on 127.0.0.1 that
accepts connections and never answers (``harness.faults.BlackHole``); the healthy one is moto
(``harness.s3``). Time bounds here are generous outcome checks (the answer came back instead
of waiting for s3fs's own ~106 s time-out), not speed measurements."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

import ucm
from harness.faults import BlackHole
from harness.s3 import S3Server
from ucm.cli_ops import stats_view
from ucm.errors import ConfigError
from ucm.metrics import render, snapshot

from .conftest import SHARD, Shards, blocks

T = TypeVar("T")

SLACK_S = 10.0
"""Margin over a deadline for a loaded 2-core machine: far below the ~106 s that s3fs (with
UCM's default client time-outs) waits on an endpoint that never answers."""


@pytest.fixture
def hole() -> Iterator[BlackHole]:
    with BlackHole() as server:
        yield server


def stack(
    unique_id: str, url: str, options: dict[str, Any], shards: int = 1, **fsspec: Any
) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": shards,
        "tiers": [
            {"type": "buffer", "capacity": 16 * SHARD},
            {"type": "fsspec", "url": url, "storage_options": options, **fsspec},
        ],
    }


def bounded(call: Callable[[], T], bound_s: float) -> tuple[T, float]:
    """``call()``'s answer and seconds, run on a thread: fails (instead of hanging the test)
    when it has not answered within ``bound_s``."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:
            failure.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound_s)
    seconds = time.monotonic() - started
    assert not thread.is_alive(), f"still waiting on the hung tier after {seconds:.1f}s"
    if failure:
        raise failure[0]
    return result[0], seconds


def fsspec_stats(store: ucm.Store) -> dict[str, Any]:
    (tier,) = [t for t in store.stats()["tiers"] if t["type"] == "fsspec"]
    return tier


@pytest.mark.timeout(120)
def test_a_black_holed_tier_answers_miss_within_its_default_deadline(
    unique_id: str, hole: BlackHole
) -> None:
    # The stack as a user writes it (no new keys): the default deadline bounds the look-ups.
    config = stack(unique_id, f"s3://ucm-test/{uuid.uuid4().hex}", hole.storage_options)
    ids = blocks(4, b"hole")
    with ucm.open(config) as store, hole:  # the hole closes first: nothing left hanging
        deadline_s = 1.0  # lookup_timeout_ms's default
        answer, _ = bounded(lambda: store.lookup_on_prefix(ids), deadline_s + SLACK_S)
        assert answer == -1
        answer, _ = bounded(lambda: store.lookup(ids), deadline_s + SLACK_S)
        assert answer == [False] * 4
        assert hole.accepted >= 1  # the tier was asked, and the endpoint never answered
        assert store.config.tiers[1].lookup_timeout_ms == 1000  # type: ignore[attr-defined]
        stats = fsspec_stats(store)
        assert stats["lookup_timeouts"] == 2
        assert stats["breaker_state"] == "closed"  # 2 of the default 3 failures


@pytest.mark.timeout(120)
def test_the_breaker_opens_after_exactly_n_failures_and_skips_the_tier(
    unique_id: str, hole: BlackHole
) -> None:
    config = stack(
        unique_id,
        f"s3://ucm-test/{uuid.uuid4().hex}",
        hole.storage_options,
        lookup_timeout_ms=200,
        breaker={"failures": 3, "probe_interval_ms": 3_600_000},
    )
    ids = blocks(2, b"open")
    with ucm.open(config) as store, hole:  # the hole closes first: nothing left hanging
        for _ in range(3):
            assert bounded(lambda: store.lookup_on_prefix(ids), 0.2 + SLACK_S)[0] == -1
        stats = fsspec_stats(store)
        assert stats["breaker_state"] == "open"
        assert (stats["lookup_timeouts"], stats["breaker_failures"]) == (3, 3)
        assert (stats["breaker_opens"], stats["breaker_skips"]) == (1, 0)
        # Open: answered "miss" without asking the tier (no wait).
        for _ in range(5):
            assert bounded(lambda: store.lookup(ids), SLACK_S)[0] == [False, False]
        # A load from the open tier is a miss there, not a wait on it.
        shards = Shards(1)
        with pytest.raises(ucm.TaskError) as failed:
            bounded(lambda: store.wait(store.load_data(ids[:1], 0, shards.pointers(1))), SLACK_S)
        assert "not found in any of the 2 tier(s)" in str(failed.value)
        stats = fsspec_stats(store)
        assert (stats["breaker_skips"], stats["load_skips"], stats["breaker_opens"]) == (5, 1, 1)
        assert (stats["lookup_timeouts"], stats["lookup_busy"]) == (3, 0)
        # The state and counts reach `ucm stats` (text and JSON) and Prometheus.
        shot = snapshot(store)
        assert shot.to_json()["tiers"][1]["breaker_state"] == "open"
        assert shot.to_json()["tiers"][1]["breaker_opens"] == 1
        from rich.console import Console

        console = Console(width=400, record=True)
        console.print(stats_view(shot))
        text = console.export_text()
        assert "breaker_state=open" in text and "breaker_opens=1" in text
        metrics = render(store).decode()
        pattern = r'ucm_tier_breaker_state\{[^}]*state="(\w+)",tier="1"[^}]*\} (\S+)'
        states = re.findall(pattern, metrics)
        assert sorted(states) == [("closed", "0.0"), ("half_open", "0.0"), ("open", "1.0")]
        assert "ucm_tier_breaker_opens{" in metrics


@pytest.mark.timeout(120)
def test_a_stuck_tier_never_piles_up_threads(unique_id: str, hole: BlackHole) -> None:
    config = stack(
        unique_id,
        f"s3://ucm-test/{uuid.uuid4().hex}",
        hole.storage_options,
        lookup_timeout_ms=200,
        breaker={"failures": 100},
    )
    ids = blocks(1, b"busy")
    with ucm.open(config) as store, hole:  # the hole closes first: nothing left hanging
        before = set(threading.enumerate())
        for _ in range(4):  # each leaves one of the tier's 4 look-up threads stuck
            assert bounded(lambda: store.lookup(ids), 0.2 + SLACK_S)[0] == [False]
        for _ in range(3):  # every thread is held: "miss" at once, no new thread
            assert bounded(lambda: store.lookup(ids), SLACK_S)[0] == [False]
        stats = fsspec_stats(store)
        assert (stats["lookup_timeouts"], stats["lookup_busy"]) == (4, 3)
        assert stats["breaker_state"] == "closed"
        # UCM's new threads: the tier's 4 look-up threads, however many look-ups were
        # refused, and at most one background namespace scan that reading stats may start
        # (stuck in the hole too). fsspec's and asyncio's own threads are theirs to bound.
        new = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
        ours = sorted(name for name in new if name.startswith("ucm-"))
        assert ours in (
            [f"ucm-lookup-fsspec-{i}" for i in range(4)],
            [f"ucm-lookup-fsspec-{i}" for i in range(4)] + ["ucm-namespace-scan"],
        ), new


@pytest.mark.timeout(180)
def test_a_half_open_probe_closes_the_breaker_once_the_endpoint_is_healthy(
    unique_id: str, hole: BlackHole
) -> None:
    url = f"s3://ucm-test/{uuid.uuid4().hex}"
    config = stack(
        unique_id,
        url,
        hole.storage_options,
        lookup_timeout_ms=3000,
        breaker={"failures": 2, "probe_interval_ms": 500},
    )
    ids = blocks(3, b"probe")
    with ucm.open(config) as store, hole:  # the hole closes first: nothing left hanging
        for _ in range(2):
            assert bounded(lambda: store.lookup_on_prefix(ids), 3 + SLACK_S)[0] == -1
        assert fsspec_stats(store)["breaker_state"] == "open"
        # The endpoint comes back healthy (moto on the same port) and another node writes
        # the first two blocks there.
        hole.close()
        server = S3Server(port=hole.port).start()
        try:
            writer_config = {
                "unique_id": f"{unique_id}-w",
                "shard_size": SHARD,
                "shards_per_block": 1,
                "tiers": [{"type": "fsspec", "url": url, "storage_options": hole.storage_options}],
            }
            with ucm.open(writer_config) as writer:
                shards = Shards(2)
                shards.fill(ids[:2], 0)
                writer.wait(writer.dump_data(ids[:2], 0, shards.pointers(2)))
            answer = -1
            give_up = time.monotonic() + 60
            while answer != 1 and time.monotonic() < give_up:
                time.sleep(0.2)
                answer = bounded(lambda: store.lookup_on_prefix(ids), 3 + SLACK_S)[0]
            assert answer == 1
            stats = fsspec_stats(store)
            assert stats["breaker_state"] == "closed"
            assert stats["breaker_closes"] == 1
            # Every probe but the last failed and opened it again.
            assert stats["breaker_probes"] >= 1
            assert stats["breaker_opens"] == stats["breaker_probes"]
            assert bounded(lambda: store.lookup(ids), 3 + SLACK_S)[0] == [True, True, False]
        finally:
            server.stop()


@pytest.mark.timeout(120)
def test_a_healthy_tier_answers_as_before(unique_id: str) -> None:
    server = S3Server().start()
    try:
        url = server.url()
        writer_config = {
            "unique_id": f"{unique_id}-w",
            "shard_size": SHARD,
            "shards_per_block": 2,
            "tiers": [{"type": "fsspec", "url": url, "storage_options": server.storage_options}],
        }
        ids = blocks(8, b"healthy")
        with ucm.open(writer_config) as writer:
            shards = Shards(8)
            whole = ids[:3] + ids[4:]  # block 3 is missing
            for shard in (0, 1):
                shards.fill(whole, shard)
                writer.wait(writer.dump_data(whole, [shard] * 7, shards.pointers(7)))
            shards.fill(ids[3:4], 0)  # block 3 has shard 0 only
            writer.wait(writer.dump_data(ids[3:4], 0, shards.pointers(1)))
            tier = writer.tiers[0]
            keys = writer.layout.keys_of_blocks(ids)
            assert tier.lookup(keys) == [True] * 7 + [False] + [True] * 8
            # The tier's prefix answers stop after the round (io_threads = 8 blocks) holding
            # the first absent key; the store's answer is the same as a full look-up's.
            assert tier.lookup_prefix(keys) == tier.lookup(keys)
        config = stack(unique_id, url, server.storage_options, shards=2, io_threads=2)
        with ucm.open(config) as store:
            assert store.lookup(ids) == [True, True, True, False, True, True, True, True]
            assert store.lookup_on_prefix(ids) == 2
            assert store.lookup_on_prefix(ids[4:]) == 3
            assert store.lookup_on_prefix(ids[3:]) == -1
            assert store.lookup_on_prefix([]) == -1
            fsspec_tier = store.tiers[1]
            keys = store.layout.keys_of_blocks(ids)
            # Two blocks a round: rounds {0, 1}, {2, 3}: stops there (block 3 lacks shard 1).
            assert fsspec_tier.lookup_prefix(keys) == [True] * 7 + [False]
            stats = fsspec_stats(store)
            assert stats["breaker_state"] == "closed"
            assert stats["lookup_timeouts"] == stats["lookup_errors"] == 0
            assert stats["breaker_failures"] == 0
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("fsspec", "location"),
    [
        ({"lookup_timeout_ms": 0}, "tiers[1].lookup_timeout_ms"),
        ({"lookup_timeout_ms": "fast"}, "tiers[1].lookup_timeout_ms"),
        ({"breaker": {"failures": 0}}, "tiers[1].breaker.failures"),
        ({"breaker": {"probe_interval_ms": -5}}, "tiers[1].breaker.probe_interval_ms"),
        ({"breaker": {"probe": 5}}, "tiers[1].breaker.probe"),
    ],
)
def test_bad_deadline_or_breaker_values_name_their_yaml_path(
    fsspec: dict[str, Any], location: str
) -> None:
    config = stack("bad-breaker", "memory://bad", {}, **fsspec)
    with pytest.raises(ConfigError) as error:
        ucm.open(config)
    assert f"{location}: " in str(error.value), str(error.value)
    (value,) = [v for v in fsspec.values()]
    shown = value if not isinstance(value, dict) else next(iter(value.values()))
    assert repr(shown) in str(error.value)
