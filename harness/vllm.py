"""Real vLLM engines for UCM's tests and benchmarks, driven from a subprocess.

vLLM's CPU build spawns an engine-core process and a worker process per TP rank, and an engine
start costs tens of seconds on two cores, so tests and benchmarks run a *plan* — several engines
one after the other, each with a list of steps — in one driver subprocess
(``python -m harness.vllm PLAN.json OUT.json``) and read its JSON result::

    model = write_tiny_llama(tmp / "model", seed=0)
    run = run_plan({"engines": [{"llm": engine_args(model, stack=stack), "steps": [
        {"op": "generate", "label": "first", "prompts": [prompt], "max_tokens": 8},
        {"op": "generate", "label": "again", "prompts": [prompt], "max_tokens": 8},
    ]}]}, timeout_s=600)
    first, again = run.result("first"), run.result("again")
    assert again["tokens"] == first["tokens"] and again["cached"] == [384]

Every engine is a new vLLM engine (new engine-core and worker processes); each is shut down
before the next starts. Prompts are token ids (``skip_tokenizer_init``), generation is greedy.

Steps (``op``): ``generate`` (``prompts``, ``max_tokens``, ``cache_salt``;
``prompt_logprobs`` N: the result lists each prompt token's logprob; ``continue_from`` a
label with ``take`` N: that step's prompts, each extended by its first N outputs; one
``LLM.generate`` call per prompt unless ``batch`` is true: the batch a request runs in changes
its floating-point sums, so single-request calls keep outputs comparable across engines),
``reset_prefix_cache`` (``reset_connector``: true resets the connector too),
``metrics`` (vLLM's ``vllm:ucm_*`` and prefix-cache counters), ``http_get`` (``url``), and
``s3`` (``action``: ``stop``, ``start``, ``fail_reads``, ``heal``) for the S3 server the driver
runs itself when the plan has ``"s3": {"port": P}``.

A model for the tests is written locally with transformers (:func:`write_tiny_llama`): no
weights are downloaded, and its random weights give context-dependent greedy tokens (unlike
``load_format="dummy"``, whose flat logits prove nothing).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[1]
"""The checkout holding ``harness/``: the driver subprocess imports ``harness.vllm`` from it."""

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: plenty for the tests' prompts
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Environment every driver gets (the caller's values win)."""

MARKER = "=== ucm-vllm-driver engine"
"""Printed to stdout and stderr before each engine starts, so output can be split per engine."""


def write_tiny_llama(
    directory: str | os.PathLike[str],
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    intermediate: int = 256,
    vocab: int = 512,
    max_positions: int = 4096,
    init_range: float = 0.1,
) -> Path:
    """A random-weight Llama saved in ``directory`` (safetensors, float32): a few MB for the
    defaults. ``seed`` fixes the weights: two seeds are two different models. A larger
    ``init_range`` than Llama's 0.02 keeps the top logits apart, so greedy tokens do not flip on
    the last bits of a sum that a different batch shape computes differently."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(directory)
    if (path / "config.json").exists():
        return path
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        initializer_range=init_range,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        model.save_pretrained(str(path), safe_serialization=True)
    finally:
        torch.random.set_rng_state(generator_state)
    return path


def engine_args(
    model: str | os.PathLike[str],
    *,
    stack: Any = None,
    connector: str | None = None,
    extra_config: Mapping[str, Any] | None = None,
    tp: int = 1,
    prefix_caching: bool = False,
    max_model_len: int = 4096,
    **overrides: Any,
) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments for a test engine, as JSON. ``stack`` attaches
    ``UcmConnector`` (``ucm_stack`` = the path or dict given); ``connector`` names another
    connector of vLLM's registry (e.g. ``ExampleConnector``) with ``extra_config``."""
    args: dict[str, Any] = {
        "model": str(model),
        "skip_tokenizer_init": True,
        "enable_prefix_caching": prefix_caching,
        "dtype": "float32",
        "max_model_len": max_model_len,
        "enforce_eager": True,  # no torch.compile: engines start in seconds, not a minute
        "tensor_parallel_size": tp,
        "seed": 0,
        "disable_log_stats": False,  # get_metrics() reads vLLM's Prometheus registry
    }
    if stack is not None:
        extra = {"ucm_stack": str(stack) if isinstance(stack, os.PathLike) else stack}
        extra.update(extra_config or {})
        args["kv_transfer_config"] = {
            "kv_connector": "UcmConnector",
            "kv_connector_module_path": "ucm.integration.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    elif connector is not None:
        args["kv_transfer_config"] = {
            "kv_connector": connector,
            "kv_role": "kv_both",
            "kv_connector_extra_config": dict(extra_config or {}),
        }
    args.update(overrides)
    return args


@dataclass
class PlanRun:
    """What a driver run returned: per-step results (JSON), its exit status and output."""

    data: dict[str, Any]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def result(self, label: str) -> dict[str, Any]:
        """The result of the step labelled ``label`` (KeyError naming the labels there are)."""
        for engine in self.data.get("engines", []):
            for step in engine.get("steps", []):
                if step.get("label") == label:
                    return dict(step)
        labels = [
            step.get("label")
            for engine in self.data.get("engines", [])
            for step in engine.get("steps", [])
        ]
        raise KeyError(f"no step labelled {label!r} in the run (labels: {labels})")

    def engine(self, index: int) -> dict[str, Any]:
        engines: list[dict[str, Any]] = self.data.get("engines", [])
        return engines[index]

    def output_of_engine(self, index: int) -> str:
        """stdout + stderr printed while engine ``index`` ran (children's lines included)."""
        text = self.stdout + "\n" + self.stderr
        parts = text.split(MARKER)
        chunks: dict[int, list[str]] = {}
        for part in parts[1:]:
            number, _, rest = part.partition("\n")
            chunks.setdefault(int(number.strip().split()[0]), []).append(rest)
        return "\n".join(chunks.get(index, []))


def run_plan(
    plan: Mapping[str, Any],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
) -> PlanRun:
    """Runs ``plan`` in a driver subprocess; raises subprocess.TimeoutExpired (after killing
    the driver's whole process group) when it runs past ``timeout_s``."""
    with tempfile.TemporaryDirectory(prefix="ucm-vllm-", dir=workdir) as scratch:
        plan_path = Path(scratch) / "plan.json"
        out_path = Path(scratch) / "out.json"
        plan_path.write_text(json.dumps(plan))
        full_env = {**os.environ, **ENGINE_ENV, **(env or {})}
        # The driver imports this module by name: the repository root on its path.
        path = full_env.get("PYTHONPATH", "")
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPOSITORY), path) if p)
        started = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, "-m", "harness.vllm", str(plan_path), str(out_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
            start_new_session=True,  # one process group: a timeout kills the engines too
        )
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            stdout, stderr = process.communicate()
            raise subprocess.TimeoutExpired(
                process.args, timeout_s, output=stdout, stderr=stderr
            ) from None
        finally:
            _kill_group(process.pid)  # leftovers of a driver that died
        data = json.loads(out_path.read_text()) if out_path.exists() else {}
        return PlanRun(
            data=data,
            returncode=process.returncode,
            stdout=stdout,
            stderr=stderr,
            seconds=time.monotonic() - started,
        )


def _kill_group(pid: int) -> None:
    import signal

    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


# ---- the driver (runs in the subprocess) -------------------------------------------------------


class _Driver:
    def __init__(self, plan: Mapping[str, Any]) -> None:
        self.plan = plan
        self.results: dict[str, dict[str, Any]] = {}
        """This engine's step results by label (``continue_from`` reads them)."""
        self.s3: Any = None
        s3_plan = plan.get("s3")
        if s3_plan:
            from .s3 import S3Server

            self.s3 = S3Server(port=int(s3_plan["port"])).start()

    def run(self) -> dict[str, Any]:
        engines_out: list[dict[str, Any]] = []
        output: dict[str, Any] = {"engines": engines_out}
        for index, engine in enumerate(self.plan.get("engines", [])):
            for stream in (sys.stdout, sys.stderr):
                print(f"{MARKER} {index} ===", file=stream, flush=True)
            engines_out.append(self.run_engine(engine))
        if self.s3 is not None:
            self.s3.stop()
        return output

    def run_engine(self, engine: Mapping[str, Any]) -> dict[str, Any]:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        args = dict(engine["llm"])
        if "kv_transfer_config" in args:
            args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
        started = time.perf_counter()
        steps: list[dict[str, Any]] = []
        out: dict[str, Any] = {"steps": steps}
        self.results = {}
        try:
            llm = LLM(**args)
        except Exception as exc:
            out["start_error"] = f"{type(exc).__name__}: {exc}"
            out["start_seconds"] = time.perf_counter() - started
            traceback.print_exc()
            gc.collect()
            return out
        out["start_seconds"] = time.perf_counter() - started
        try:
            for step in engine.get("steps", []):
                try:
                    steps.append(self.run_step(llm, step))
                except Exception as exc:  # recorded; the engine's later steps are skipped
                    traceback.print_exc()
                    steps.append({"label": step.get("label", step.get("op")), "error": f"{exc!r}"})
                    break
        finally:
            shutdown_started = time.perf_counter()
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
            out["shutdown_seconds"] = time.perf_counter() - shutdown_started
        return out

    def run_step(self, llm: Any, step: Mapping[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams

        op = step["op"]
        label = step.get("label", op)
        started = time.perf_counter()
        result: dict[str, Any] = {"label": label, "op": op}
        if op == "generate":
            params = SamplingParams(
                temperature=0.0,
                max_tokens=int(step.get("max_tokens", 8)),
                ignore_eos=True,
                prompt_logprobs=step.get("prompt_logprobs"),
            )
            prompts = [list(map(int, prompt)) for prompt in step.get("prompts", [])]
            if "continue_from" in step:  # the prompt of an earlier step plus its first outputs
                earlier = self.results[str(step["continue_from"])]
                take = int(step.get("take", 0))
                prompts.extend(
                    prompt + tokens[:take]
                    for prompt, tokens in zip(earlier["prompts"], earlier["tokens"], strict=True)
                )
            result["prompts"] = prompts
            inputs: list[dict[str, Any]] = []
            for prompt in prompts:
                item: dict[str, Any] = {"prompt_token_ids": prompt}
                if step.get("cache_salt"):
                    item["cache_salt"] = step["cache_salt"]
                inputs.append(item)
            outputs: list[Any] = []
            seconds: list[float] = []
            if step.get("batch"):
                outputs = llm.generate(inputs, params, use_tqdm=False)
                seconds = [time.perf_counter() - started]
            else:
                for item in inputs:
                    one = time.perf_counter()
                    outputs.extend(llm.generate([item], params, use_tqdm=False))
                    seconds.append(time.perf_counter() - one)
            result["tokens"] = [list(output.outputs[0].token_ids) for output in outputs]
            result["cached"] = [int(output.num_cached_tokens or 0) for output in outputs]
            result["kv_transfer_params"] = [output.kv_transfer_params for output in outputs]
            if step.get("prompt_logprobs") is not None:  # each prompt token's logprob
                result["prompt_logprobs"] = [
                    [
                        None if ranked is None else float(ranked[token].logprob)
                        for token, ranked in zip(prompt, output.prompt_logprobs, strict=True)
                    ]
                    for prompt, output in zip(prompts, outputs, strict=True)
                ]
            result["request_seconds"] = seconds
            result["generated_tokens"] = sum(len(tokens) for tokens in result["tokens"])
            result["prompt_tokens"] = sum(len(prompt) for prompt in prompts)
        elif op == "reset_prefix_cache":
            result["ok"] = bool(
                llm.reset_prefix_cache(reset_connector=bool(step.get("reset_connector", False)))
            )
        elif op == "metrics":
            result["metrics"] = _metrics(llm)
        elif op == "http_get":
            with urllib.request.urlopen(str(step["url"]), timeout=30) as response:
                result["text"] = response.read().decode()
        elif op == "s3":
            self.s3_action(str(step["action"]), float(step.get("seconds", 0.0)))
        elif op == "sleep":
            time.sleep(float(step["seconds"]))
        else:
            raise ValueError(f"unknown step op {op!r}")
        result["seconds"] = time.perf_counter() - started
        self.results[label] = result
        return result

    def s3_action(self, action: str, seconds: float = 0.0) -> None:
        if self.s3 is None:
            raise ValueError("an s3 step needs 's3': {'port': P} in the plan")
        if action == "stop":
            self.s3.stop()
        elif action == "start":
            self.s3.start()
        elif action == "fail_reads":
            self.s3.set_failure("GET object", 503)
        elif action == "heal":
            self.s3.set_failure("GET object", 0)
        elif action == "delay_reads":  # a slow tier: every read of object data answers
            # ``seconds`` late (listings, which look-ups use, are not delayed)
            self.s3.set_delay("GET object", seconds)
        else:
            raise ValueError(f"unknown s3 action {action!r}")


def _metrics(llm: Any) -> dict[str, float]:
    """Counters of vLLM's Prometheus registry worth asserting on: ``vllm:ucm_*`` and the prefix
    cache's, summed over their labels (read from the registry itself: ``LLM.get_metrics``
    truncates counters to integers)."""
    from prometheus_client import REGISTRY

    llm.get_metrics()  # vLLM's loggers have recorded every finished step
    values: dict[str, float] = {}
    for family in REGISTRY.collect():
        if not (family.name.startswith("vllm:ucm_") or "prefix_cache" in family.name):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name = sample.name.removesuffix("_total")
            values[name] = values.get(name, 0.0) + float(sample.value)
    return values


def prompt_tokens(seed: int, length: int, vocab: int = 512) -> list[int]:
    """A reproducible prompt of ``length`` token ids in [3, vocab) (0-2 are special ids)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m harness.vllm PLAN.json OUT.json", file=sys.stderr)
        return 2
    plan = json.loads(Path(args[0]).read_text())
    driver = _Driver(plan)
    output = driver.run()
    Path(args[1]).write_text(json.dumps(output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
