"""Loads without a CacheBuffer under vLLM 0.32's own ``AsyncScheduler`` (``_vllm_sched.py``,
with the configuration's ``async_scheduling`` on, as CUDA vLLM's is) and its ``Scheduler``:
every load is asynchronous, read into the worker's staging memory and copied into vLLM's
blocks, off the step
(``UcmConnector._direct_loads``): each reads a lower tier, which must not hold the forward pass.

Under asynchronous scheduling step K+1 is scheduled before step K's output is processed. A
synchronous load that failed in step K cost its request a token: vLLM discarded step K's
token but kept the one step K+1 decoded over the failed block. An asynchronous load's failure
is known before the request is scheduled at all, so vLLM recomputes the failed blocks first.

The tier is a real posix tier with a per-shard read latency (``slowposix`` of the load-path
tests). Tests assert outcomes (tokens, states, counts), never timings."""

from __future__ import annotations

import importlib.util
import os
import random
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        raise RuntimeError("vllm is not installed, and CI must run the vLLM tests")
    pytest.skip("vllm is not installed", allow_module_level=True)

from loadpath import _tiers

from ucm.errors import ConfigError

from ._vllm_sched import BLOCK, LOOKUP_TIMEOUT_MS, Harness

pytestmark = pytest.mark.timeout(600)

STEPS_MAX = 300_000
"""Bound on the steps of one wait: a step with nothing to compute takes well under a
millisecond, and a slow tier's load takes its per-shard latency times the shards."""


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(count)]


A = tokens(1, 8 * BLOCK + 5)
"""8 full blocks and 5 tokens."""
B = A[: 5 * BLOCK] + tokens(2, 3 * BLOCK + 5)
"""Shares A's first 5 blocks, then 3 blocks of its own and 5 tokens."""
D = tokens(9, 2 * BLOCK + 3)
"""A decoder's prompt: nothing of it is in UCM."""

Make = Callable[..., Harness]


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Make]:
    """Harnesses over one posix tier (no CacheBuffer) in ``tmp_path``."""
    _tiers.register()
    made: list[Harness] = []

    def factory(delay_s: float = 0.0, **kwargs: Any) -> Harness:
        tier = {
            "type": "slowposix",
            "path": str(tmp_path / "posix"),
            "delay_s": delay_s,
            "lookup_timeout_ms": LOOKUP_TIMEOUT_MS,
        }
        harness = Harness(
            tmp_path / f"h{len(made)}",
            tiers=[tier],
            unique_id=f"vllm-direct-{uuid.uuid4().hex[:10]}",
            **kwargs,
        )
        made.append(harness)
        return harness

    yield factory
    for harness in made:
        harness.close()


def _store(make: Make, prompts: dict[str, list[int]]) -> None:
    """The prompts' full blocks in the posix tier, saved by an engine of their own."""
    h = make(async_scheduling=True)
    for name, prompt in prompts.items():
        h.add(name, prompt, 1)
    h.run()


def _step_until(h: Harness, done: Callable[[], bool]) -> None:
    for _ in range(STEPS_MAX):
        if done():
            return
        h.step()
        h.settle_dumps()
    raise AssertionError("the condition did not hold within the step bound")


@pytest.mark.parametrize("bad", [0, 2, 4], ids=["first", "middle", "last"])
def test_a_load_that_fails_under_the_async_scheduler_costs_no_token(make: Make, bad: int) -> None:
    """B's 5 blocks are found by the look-up; block ``bad`` is gone before the load runs. The
    load is asynchronous: vLLM learns of the failure before B is scheduled, recomputes from
    the failed block, and B's tokens are right (with the load synchronous they were not, and
    the connector now refuses synchronous loads under the ``AsyncScheduler``)."""
    h = make(async_scheduling=True)
    h.add("a", A, 2)
    h.run()
    assert h.stored_count("a") == 8
    first_step = h._step + 1
    h.evict[first_step] = [h.block_ids_of("a", len(A))[bad]]
    start = len(h.records)
    h.add("b", B, 3)
    h.run()
    assert h.outputs["b"] == Harness.expected_outputs(B, 3)
    records = h.records[start:]
    assert not any(r.loads for r in records)  # nothing loads inside a step
    (table,) = [r.async_loads["b"] for r in records if "b" in r.async_loads]
    (done,) = [r for r in records if "b" in r.finished_recving]
    assert done.invalid == {table[bad]}
    assert h.worker._worker.stats.data["load_failed_blocks"] == 1
    assert h.stored_count("b") == 8
    h.assert_clean()
    # The recomputed blocks were saved right: a later request is served all 8.
    h.add("c", B, 3)
    h.run()
    assert h.cached_tokens["c"] == 8 * BLOCK
    assert h.outputs["c"] == Harness.expected_outputs(B, 3)
    h.assert_clean()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_decoder_runs_while_a_load_from_a_slow_tier_goes_straight_into_vllms_blocks(
    make: Make, async_scheduling: bool
) -> None:
    """D decodes while B's 8 blocks come from a tier that takes 0.1 s a shard: B waits in
    WAITING_FOR_REMOTE_KVS, D's steps go on, and both are right, under either scheduler."""
    _store(make, {"a": A})
    h = make(delay_s=0.1, async_scheduling=async_scheduling)
    h.add("d", D, 40)
    _step_until(h, lambda: len(h.outputs.get("d", [])) >= 2)
    h.add("b", A, 3)
    _step_until(h, lambda: h.status("b") == "WAITING_FOR_REMOTE_KVS")
    decoded = len(h.outputs["d"])
    _step_until(h, lambda: "b" in h.finished_recving)
    assert len(h.outputs["d"]) > decoded  # D decoded during B's load
    h.run(STEPS_MAX)
    assert h.finished_recving == {"b": 1}
    assert h.cached_tokens["b"] == 8 * BLOCK
    assert h.outputs["b"] == Harness.expected_outputs(A, 3)
    assert h.outputs["d"] == Harness.expected_outputs(D, 40)
    h.assert_clean()


def test_an_abort_during_a_direct_load_frees_its_blocks_only_once_the_load_is_over(
    make: Make,
) -> None:
    """B is aborted while its load from the slow tier runs: vLLM keeps B's blocks until the
    worker reports the load over (the harness checks that no load writes into a block vLLM
    freed), then frees every one of them."""
    _store(make, {"a": A})
    h = make(delay_s=0.1, async_scheduling=True)
    h.add("b", A, 3)
    _step_until(h, lambda: h.status("b") == "WAITING_FOR_REMOTE_KVS")
    (load,) = h.worker._worker._async
    assert load.copy is not None and not h.worker._store.check(load.copy)
    h.abort("b")
    h.run(STEPS_MAX)
    assert h.finished_recving == {"b": 1}
    assert "b" not in h.outputs
    h.assert_clean()


@pytest.mark.parametrize("bad", [None, 2], ids=["whole", "middle-removed"])
def test_under_the_synchronous_scheduler_a_load_without_a_buffer_is_direct_too(
    make: Make, bad: int | None
) -> None:
    """Without a CacheBuffer every hit reads a lower tier: never inside a step, under the
    synchronous scheduler either. B's load is asynchronous; with its middle block gone
    before the load runs, vLLM recomputes from there, and B's tokens are right."""
    h = make(async_scheduling=False)
    h.add("a", A, 2)
    h.run()
    start = len(h.records)
    if bad is not None:
        h.evict[h._step + 1] = [h.block_ids_of("a", len(A))[bad]]
    h.add("b", B, 3)
    h.run(STEPS_MAX)
    assert not any(r.loads for r in h.records[start:])
    assert [list(r.async_loads) for r in h.records[start:] if r.async_loads] == [["b"]]
    assert h.finished_recving == {"b": 1}
    assert h.outputs["b"] == Harness.expected_outputs(B, 3)
    stats = h.worker._worker.stats.data
    assert stats["load_failed_blocks"] == (0 if bad is None else 1)
    h.assert_clean()


def test_ucm_async_load_false_is_refused_under_the_async_scheduler(make: Make) -> None:
    """A synchronous load that fails under vLLM's asynchronous scheduling costs its request a
    wrong token (vLLM scheduled the next step over the failed block before it knew). The
    connector refuses the configuration at start, naming the key, the value and what is
    valid; on the code before it only warned, and loaded synchronously."""
    with pytest.raises(ConfigError) as raised:
        make(async_scheduling=True, extra_config={"ucm_async_load": False})
    assert str(raised.value) == (
        "kv_connector_extra_config['ucm_async_load']: False is not valid under vLLM's "
        "asynchronous scheduling (CUDA vLLM's default): vLLM schedules each step before it "
        "learns that the last one's load failed, so a synchronous load that fails (a block "
        "missing, corrupt, or on a dead tier) would cost its request a wrong token. Leave "
        "ucm_async_load true (the default), or turn asynchronous scheduling off "
        "(--no-async-scheduling)"
    )
    # Under synchronous scheduling it stands: every load before the forward pass.
    h = make(async_scheduling=False, extra_config={"ucm_async_load": False})
    h.add("a", A, 2)
    h.run()
    start = len(h.records)
    h.add("b", B, 3)
    h.run()
    assert [list(r.loads) for r in h.records[start:] if r.loads] == [["b"]]
    assert not any(r.async_loads for r in h.records[start:])
    assert h.outputs["b"] == Harness.expected_outputs(B, 3)
    h.assert_clean()


def test_a_direct_load_the_full_load_queue_refuses_is_recomputed(
    make: Make,
) -> None:
    """With a load queue one task deep and a slow tier, three requests whose prompts are all
    stored start their loads in one step: a load the queue does not take at once is
    reported failed, and vLLM recomputes its blocks; every request's tokens are right and
    each load is reported once."""
    prompts = {name: tokens(20 + i, 4 * BLOCK + 3) for i, name in enumerate("xyz")}
    _store(make, prompts)
    h = make(delay_s=0.2, async_scheduling=True, load={"load_queue_depth": 1})
    for name, prompt in prompts.items():
        h.add(name, prompt, 3)
    h.step()
    (record,) = h.records
    assert sorted(record.async_loads) == ["x", "y", "z"]
    h.run(STEPS_MAX)
    assert h.finished_recving == {"x": 1, "y": 1, "z": 1}
    stats = h.worker._worker.stats.data
    assert stats["load_failed_blocks"] >= 4  # at least one request's 4 blocks refused
    assert stats["loaded_blocks"] + stats["load_failed_blocks"] == 12
    for name, prompt in prompts.items():
        assert h.outputs[name] == Harness.expected_outputs(prompt, 3), name
    h.assert_clean()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("buffer", [True, False], ids=["buffer", "no-buffer"])
def test_how_a_tp2_engine_loads(tmp_path: Path, async_scheduling: bool, buffer: bool) -> None:
    """Two TP ranks (two shards per block) load as one rank does: through the CacheBuffer's
    prefetch when there is one (each rank its own shard), direct without one (a
    scheduler-role connector of a TP=2 configuration beside the
    harness's one-rank connector, on the harness's stack)."""
    import copy

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from ucm.integration.vllm import UcmConnector

    tiers = [{"type": "posix", "path": str(tmp_path / "posix")}]
    if buffer:
        tiers.insert(0, {"type": "buffer", "capacity": "4MiB"})
    h = Harness(tmp_path / "h", async_scheduling=async_scheduling, tiers=tiers)
    try:
        config = copy.copy(h.config)
        config.parallel_config = copy.copy(h.config.parallel_config)
        config.parallel_config.tensor_parallel_size = 2
        connector = UcmConnector(config, KVConnectorRole.SCHEDULER, h.kv_config)
        try:
            assert connector._geometry.shards_per_block == 2
            for one in (connector, h.connector):
                assert one._async_loads() == buffer
                assert one._direct_loads() == (not buffer)
                assert one._sched._every_load_async == (async_scheduling or not buffer)
            # Held hits under synchronous scheduling, with a CacheBuffer.
            assert (connector._sched._hold is not None) == (buffer and not async_scheduling)
            assert (h.connector._sched._hold is not None) == (buffer and not async_scheduling)
        finally:
            connector.shutdown()
    finally:
        h.close()
