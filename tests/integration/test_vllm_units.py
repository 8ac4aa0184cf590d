"""Pieces of UcmConnector that need no engine: the extra-config check, the stats and worker
metadata vLLM aggregates over TP ranks, and how a step's loads are split into tasks. The
behaviour with real engines is tests/integration/test_vllm.py."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        raise RuntimeError("vllm is not installed, and CI must run the vLLM tests")
    pytest.skip("vllm is not installed", allow_module_level=True)

from ucm import ConfigError
from ucm.integration import vllm as connector
from ucm.integration.vllm.config import check_extra_config
from ucm.integration.vllm.worker import unique_key_groups


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"ucm_stack": "s.yaml", "ucm_stak": "s.yaml"},
            "kv_connector_extra_config['ucm_stak']: unknown UCM key (misspelled?); the UCM keys "
            "are: ucm_stack: ",
        ),
        (
            {"ucm_stack": "s.yaml", "ucm_metrics_port": "9000"},
            "kv_connector_extra_config['ucm_metrics_port']: '9000' is not valid: expected an "
            "integer port in [0, 65535]",
        ),
        (
            {"ucm_stack": "s.yaml", "ucm_report_block_ids": "yes"},
            "kv_connector_extra_config['ucm_report_block_ids']: 'yes' is not valid: expected "
            "true or false",
        ),
        (
            {"ucm_stack": "s.yaml", "ucm_async_load": "no"},
            "kv_connector_extra_config['ucm_async_load']: 'no' is not valid: expected true or "
            "false",
        ),
        *(
            (
                {"ucm_stack": "s.yaml", "ucm_load_deadline_s": bad},
                f"kv_connector_extra_config['ucm_load_deadline_s']: {bad!r} is not valid: "
                "expected a number of seconds in (0, 3600] (default 10)",
            )
            for bad in (0, -1.5, "5", True, float("nan"), float("inf"), 3601)
        ),
        *(
            (
                {"ucm_stack": "s.yaml", "ucm_lookup_wait_ms": bad},
                f"kv_connector_extra_config['ucm_lookup_wait_ms']: {bad!r} is not valid: "
                "expected a number of milliseconds in [0, 10000] (default 20)",
            )
            for bad in (-1, "20", False, float("nan"), 10001)
        ),
        *(
            (
                {"ucm_stack": "s.yaml", "ucm_compute_wait_ms": bad},
                f"kv_connector_extra_config['ucm_compute_wait_ms']: {bad!r} is not valid: "
                "expected a number of milliseconds in [0, 600000] (default 20000)",
            )
            for bad in (-1, "20", True, float("nan"), 600001)
        ),
    ],
)
def test_extra_config_errors_name_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_extra_config(extra)
    assert str(raised.value).startswith(message)


def test_the_load_deadline_defaults_to_10_s_and_takes_any_positive_number() -> None:
    from ucm.integration.vllm.config import load_deadline_s

    assert load_deadline_s({}) == 10.0
    assert load_deadline_s({"ucm_load_deadline_s": 0.05}) == 0.05
    assert load_deadline_s({"ucm_load_deadline_s": 3600}) == 3600.0
    check_extra_config({"ucm_stack": "s.yaml", "ucm_async_load": False, "ucm_load_deadline_s": 2})


def test_the_lookup_wait_defaults_to_20_ms_and_takes_0() -> None:
    from ucm.integration.vllm.config import lookup_wait_s

    assert lookup_wait_s({}) == 0.02
    assert lookup_wait_s({"ucm_lookup_wait_ms": 0}) == 0.0
    assert lookup_wait_s({"ucm_lookup_wait_ms": 10000}) == 10.0


def test_other_connectors_keys_are_left_alone() -> None:
    check_extra_config({"ucm_stack": {}, "shared_storage_path": "/x"})


def test_stats_sum_over_ranks_and_reduce() -> None:
    rank0 = connector.UcmConnectorStats()
    rank1 = connector.UcmConnectorStats()
    assert rank0.is_empty() and set(rank0.data) == set(connector.STAT_NAMES)
    rank0.data.update(loaded_blocks=3, loaded_bytes=3 << 20, load_seconds=0.5)
    rank1.data.update(loaded_blocks=3, loaded_bytes=3 << 20, load_seconds=0.5, hit_tokens=384)
    # vLLM rebuilds stats from their dict in the logging process (build_kv_connector_stats).
    rebuilt = connector.UcmConnector.build_kv_connector_stats(rank1.to_dict())
    assert rebuilt is not None
    total = rank0.aggregate(rebuilt)
    assert total.data["loaded_blocks"] == 6 and total.data["hit_tokens"] == 384
    reduced = total.reduce()
    assert reduced["loaded_bytes"] == 6 << 20
    assert reduced["load_GBps"] == round((6 << 20) / 1.0 / 1e9, 3)
    assert not total.is_empty()
    total.reset()
    assert total.is_empty()


def test_worker_metadata_counts_ranks_per_block() -> None:
    a, b = bytes(16), b"\x01" * 16
    rank0 = connector.UcmWorkerMetadata(dumped={a: 1, b: 1})
    rank1 = connector.UcmWorkerMetadata(dumped={a: 1}, failed={b})
    merged = rank0.aggregate(rank1)
    assert merged.dumped == {a: 2, b: 1} and merged.failed == {b}


def test_a_step_loading_one_block_twice_splits_it_into_two_tasks() -> None:
    a, b = bytes(16), b"\x01" * 16
    loads = [
        connector.BlockTransfer("r1", [5, 6], [a, b]),
        connector.BlockTransfer("r2", [9], [a]),  # the same block, into another vLLM block
    ]
    assert unique_key_groups(loads) == [[(a, 5), (b, 6)], [(a, 9)]]


def test_the_scheduler_side_runs_without_an_engine() -> None:
    """SchedulerSide needs a lookup function and a key space: a load planned into vLLM blocks,
    the blocks computed over it held until the workers' output says the load held."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.request import Request

    from ucm.integration.keys import KeySpace, chain_block_ids
    from ucm.integration.vllm.scheduler import SchedulerSide

    space = KeySpace(
        engine="vllm", model="m", dtype="float32", block_tokens=16, kv_layout="x", tp_size=1
    )
    present: set[bytes] = set()
    side = SchedulerSide(
        lookup=lambda ids: [block_id in present for block_id in ids],
        key_space=space,
        block_tokens=16,
        shards_per_block=1,
        block_table=lambda _state, _req_id: [7, 8, 9, 10],
    )
    request = Request("r", list(range(3, 3 + 60)), SamplingParams(max_tokens=1), None)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    ids = chain_block_ids(space.salt(None), list(request.all_token_ids[:48]), 16)
    present.update(ids[:2])
    assert side.get_num_new_matched_tokens(request, 0) == (32, False)
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 10],))
    side.update_state_after_alloc(request, blocks, 32)  # type: ignore[arg-type]

    def step(computed_before: int, scheduled: int) -> connector.UcmConnectorMetadata:
        new = SimpleNamespace(req_id="r", num_computed_tokens=computed_before)
        output = SimpleNamespace(
            preempted_req_ids=set(),
            scheduled_new_reqs=[new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
            num_scheduled_tokens={"r": scheduled},
        )
        return side.build_connector_meta(output)  # type: ignore[arg-type]

    first = step(32, 28)  # loads blocks 0-1, computes block 2 (and 12 tokens)
    assert [(t.vllm_blocks, t.ucm_ids) for t in first.loads] == [([7, 8], ids[:2])]
    assert first.saves == []  # block 2 attended to the loads: held
    assert step(60, 0).saves == []  # the load's outcome is not known yet
    side.update_connector_output(
        SimpleNamespace(
            kv_connector_worker_meta=connector.UcmWorkerMetadata(loaded_steps={first.step}),
            invalid_block_ids=set(),
        )
    )
    third = step(60, 0)
    assert [(t.vllm_blocks, t.ucm_ids) for t in third.saves] == [([9], [ids[2]])]


def test_the_worker_side_runs_without_an_engine(tmp_path: object) -> None:
    """WorkerSide needs a store and one tensor view per layer: a released request is reported
    once, after its dump completed."""
    import time
    import uuid
    from pathlib import Path

    import torch

    import ucm
    from ucm.integration.vllm.worker import WorkerSide

    root = Path(str(tmp_path))
    stack = {
        "unique_id": f"vllm-unit-{uuid.uuid4().hex[:10]}",
        "tensor_size_list": [64],
        "shards_per_block": 1,
        "tiers": [{"type": "posix", "path": str(root / "p")}],
    }
    store = ucm.open(stack, device_id=0)
    try:
        worker = WorkerSide(store, rank=0, shard_size=64)
        kv = torch.arange(4 * 16, dtype=torch.float32).view(4, 16)
        worker.set_block_views([kv])
        block_id = b"\x05" * 16
        meta = connector.UcmConnectorMetadata(
            saves=[connector.BlockTransfer("r", [2], [block_id])], released={"r"}
        )
        worker.bind(meta)
        assert worker.get_finished() == set()  # its save is not submitted yet
        worker.submit_saves()
        deadline = time.monotonic() + 60
        done: set[str] = set()
        while not done:
            assert time.monotonic() < deadline
            done = worker.get_finished()
        assert done == {"r"} and store.lookup([block_id]) == [True]
        assert worker.get_finished() == set()
        back = torch.zeros(16, dtype=torch.float32)
        store.wait(store.load([block_id], [0], [[back]]))
        assert torch.equal(back, kv[2])
    finally:
        store.close()
