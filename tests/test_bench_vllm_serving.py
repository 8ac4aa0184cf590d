"""The serving benchmark's bookkeeping of interleaved rounds (the busy node's): which TTFTs are
first asks, how rounds pool, and that outputs are compared request by request. The servers
themselves run in tests/test_bench.py (the quick run) and the full ``ucm bench``."""

from __future__ import annotations

import pytest

from ucm.bench.vllm_serving import (
    FULL,
    Served,
    _round_ratios,
    _rounds,
    _same_outputs,
    workload,
)


def _served(ttfts: list[float], texts: list[str], rounds: int = 1) -> Served:
    tokens = {"local_compute": float(len(ttfts)), "external_kv_transfer": 1.0}
    return Served(ttfts, texts, 10.0, 5.0, tokens, [1.5], rounds)


def test_a_round_has_documents_and_questions_of_its_own_and_round_0_is_the_workload() -> None:
    config = {**FULL, "docs": 3, "doc_tokens": 256, "suffix_tokens": 8, "asks": 4}
    assert workload(config, 0) == workload(config)
    assert workload(config, 0, asks=2) == workload(config)[:6]
    first, second = workload(config, 0, asks=2), workload(config, 1, asks=2)
    assert len(second) == 6 and all(len(prompt) == 264 for prompt in second)
    assert second[:3] != first[:3]
    # Within a round each document is asked again with a new question.
    assert second[0][:256] == second[3][:256] and second[0][256:] != second[3][256:]
    # No block of one round's documents is another round's.
    blocks = {tuple(p[i : i + 128]) for p in first for i in range(0, 256, 128)}
    assert not blocks & {tuple(p[i : i + 128]) for p in second for i in range(0, 256, 128)}


def test_rounds_pool_in_order_and_split_into_every_rounds_first_asks() -> None:
    # 2 documents, 2 asks: per round, requests 0-1 are first asks and 2-3 repeats.
    parts = [
        _served([1.0, 2.0, 0.1, 0.2], ["a", "b", "c", "d"]),
        _served([3.0, 4.0, 0.3, 0.4], ["e", "f", "g", "h"]),
        _served([5.0, 6.0, 0.5, 0.6], ["i", "j", "k", "l"]),
    ]
    pooled = _rounds(parts)
    assert pooled.rounds == 3
    assert pooled.texts == list("abcdefghijkl")
    assert pooled.split(2) == ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert pooled.wall_s == 15.0 and pooled.tpot_ms == 10.0
    assert pooled.tokens == {"local_compute": 12.0, "external_kv_transfer": 3.0}
    assert pooled.warmup_ttfts == [1.5]
    one = parts[0]
    assert one.split(2) == ([1.0, 2.0], [0.1, 0.2])


def test_each_rounds_ratio_is_the_baselines_p50_over_the_systems() -> None:
    ucm = [2.0, 4.0, 10.0, 10.0]  # round 0 p50 3.0, round 1 p50 10.0
    plain = [3.0, 3.0, 8.0, 12.0]  # round 0 p50 3.0, round 1 p50 10.0
    assert _round_ratios(ucm, plain, 2) == {"round_0_ratio": 1.0, "round_1_ratio": 1.0}
    assert _round_ratios([4.0, 4.0], [2.0, 2.0], 2) == {
        "round_0_ratio": 0.5,
        "round_1_ratio": 0.5,
    }
    assert _round_ratios(ucm, plain, 1) == {}


def test_outputs_must_match_request_by_request_and_in_number() -> None:
    _same_outputs("UCM", ["x", "y"], ["x", "y"])
    with pytest.raises(RuntimeError, match=r"^UCM: greedy outputs differ .* at requests \[1\] "):
        _same_outputs("UCM", ["x", "z"], ["x", "y"])
    with pytest.raises(RuntimeError, match=r"at requests \[\] \(of 2; 1 answered\)"):
        _same_outputs("UCM", ["x"], ["x", "y"])
