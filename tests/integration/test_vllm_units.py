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
from ucm.integration.vllm.config import _check_extra_config
from ucm.integration.vllm.worker import _unique_key_groups


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
    ],
)
def test_extra_config_errors_name_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        _check_extra_config(extra)
    assert str(raised.value).startswith(message)


def test_other_connectors_keys_are_left_alone() -> None:
    _check_extra_config({"ucm_stack": {}, "shared_storage_path": "/x"})


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
    assert _unique_key_groups(loads) == [[(a, 5), (b, 6)], [(a, 9)]]
