"""vLLM with UCM: time to first token of a long prompt served by UCM, beside recompute, beside
vLLM's own prefix-cache hit and beside vLLM's ExampleConnector; and the throughput of a
repeated-prefix workload with and without UCM.

The model is a random-weight MHA Llama written locally (no download) whose KV is a visible
part of TTFT: 8 layers x 16 KV heads x 128 head_dim in float32 = 128 KiB of KV per token, a
2,065-token prompt (16 full 128-token blocks + 17 tokens) = 256 MiB of KV to serve. Each engine
is its own processes (``harness.vllm`` drives them from one subprocess), and every TTFT is
the wall time of ``LLM.generate`` for one request with ``max_tokens=1``:

- **recompute**: an engine without a connector, prefix caching off, a fresh prompt;
- **vLLM prefix-cache hit** (the floor): an engine without a connector, prefix caching on, the
  same prompt again (its KV already in vLLM's cache);
- **UCM from the CacheBuffer**: ``UcmConnector`` on buffer + posix, prefix caching off, the
  prompt again after its first request stored it;
- **UCM from posix**: a new engine on the same stack (a new CacheBuffer: empty), the posix tier
  reading with O_DIRECT (never from the page cache);
- **ExampleConnector**: vLLM's reference connector (safetensors files per layer), prefix
  caching off, the prompt again (it reads files it has just written: from the page cache).

Throughput: 32 requests (16 share one of two long prefixes, 16 are unique, shuffled), one
``generate`` call, prompt + generated tokens per second, on an engine without a connector and on
the UCM engine (prefix caching off in both).

``--quick``: a tiny model and prompt, one UCM engine whose engine core and worker share the
driver's process (recompute vs CacheBuffer hit): it proves the machinery runs; its ratios say
nothing about the targets.

Every engine's worker computes on the same OpenMP threads: the run pins
``VLLM_CPU_OMP_THREADS_BIND`` to the CPUs this process may use (unless the caller set it).
Left to itself, vLLM reserves one more CPU for the scheduler when any KV connector is
configured, and on 2 CPUs that gives an engine without a connector one thread and an engine
with one two: the recompute and prefix-cache baselines would then compute at half speed.
"""

from __future__ import annotations

import os
import random
import statistics
import uuid
from pathlib import Path
from typing import Any

from . import BenchOptions, BenchResult, Figure, Plot, need_harness, not_installed

BLOCK_TOKENS = 128
FULL = {
    "model": {
        "layers": 8,
        "hidden": 2048,
        "heads": 16,
        "kv_heads": 16,
        "head_dim": 128,
        "intermediate": 1024,
        "vocab": 1024,
    },
    "prompt_tokens": 2065,
    "prompts": 5,
    "again": 3,
    "throughput": {"shared_prefix": 768, "suffix": 32, "unique": 800, "requests": 32},
}
QUICK = {
    "model": {
        "layers": 2,
        "hidden": 128,
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 32,
        "intermediate": 256,
        "vocab": 512,
    },
    "prompt_tokens": 600,
    "prompts": 2,
    "again": 1,
}
TIMEOUT_S = 3600.0
PAUSE_S = 3.0
"""Between a prompt's first request and its repeats (every variant, so all are alike)."""


def _kv_bytes_per_token(model: dict[str, int]) -> int:
    return model["layers"] * 2 * model["kv_heads"] * model["head_dim"] * 4


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def _omp_bind() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for one TP=1 worker: the caller's, or every CPU this
    process may run on (the same threads for every engine, connector or not)."""
    given = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if given:
        return given
    return ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))


def _ttft_steps(prefix: str, prompts: list[list[int]], first: bool, again: int) -> list[Any]:
    """Per prompt: its first request (when ``first``), then ``again`` repeats of it."""
    steps: list[Any] = []
    for index, prompt in enumerate(prompts):
        if first:
            steps.append(_gen(f"{prefix}_first_{index}", [prompt], 1))
            # The dump of a miss, and its write-through to posix (256 MiB, O_DIRECT), run
            # behind the request in the worker; a repeat arrives after they have settled.
            steps.append({"op": "sleep", "label": f"{prefix}_pause_{index}", "seconds": PAUSE_S})
        steps.extend(_gen(f"{prefix}_again_{index}_{j}", [prompt], 1) for j in range(again))
    return steps


def _labels(prefix: str, prompts: int, again: int) -> list[str]:
    return [f"{prefix}_again_{i}_{j}" for i in range(prompts) for j in range(again)]


def _gen(label: str, prompts: list[list[int]], max_tokens: int, batch: bool = False) -> Any:
    return {
        "op": "generate",
        "label": label,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "batch": batch,
    }


def _workload(config: dict[str, int], vocab: int, seed: int) -> list[list[int]]:
    """Half the requests share one of two long prefixes (unique suffixes), half are unique;
    shuffled, so requests sharing a prefix arrive spread over the batch."""
    rng = random.Random(seed)
    prefixes = [_prompt(seed * 100 + p, config["shared_prefix"], vocab) for p in range(2)]
    half = config["requests"] // 2
    sharing = [
        prefixes[i % 2] + _prompt(seed * 1000 + i, config["suffix"], vocab) for i in range(half)
    ]
    unique = [_prompt(seed * 10000 + i, config["unique"], vocab) for i in range(half)]
    requests = sharing + unique
    rng.shuffle(requests)
    return requests


class VllmTtftBenchmark:
    name = "vllm_ttft"
    title = (
        "vLLM + UCM: TTFT of a 2k-token prompt from the buffer and posix vs recompute, "
        "vLLM's prefix cache and ExampleConnector; repeated-prefix throughput"
    )

    def run(self, options: BenchOptions) -> BenchResult:
        absent = not_installed(self.name, ("vllm",), "s")
        if absent is not None:
            return absent
        need_harness("vllm_ttft")
        from harness.vllm import engine_args, run_plan, write_tiny_llama

        config: dict[str, Any] = QUICK if options.quick else FULL
        workdir = Path(options.workdir or ".")
        options.progress("vllm_ttft: writing the random-weight model")
        model = write_tiny_llama(workdir / "model", seed=0, max_positions=4096, **config["model"])
        vocab = int(config["model"]["vocab"])
        count, again = int(config["prompts"]), int(config["again"])
        prompts = [_prompt(seed, int(config["prompt_tokens"]), vocab) for seed in range(count)]
        few = prompts[:3]  # variants whose every sample needs a recompute first
        stack = {
            "unique_id": f"bench-vllm-{uuid.uuid4().hex[:10]}",
            "tiers": [
                {"type": "buffer", "capacity": "2GiB" if not options.quick else "256MiB"},
                {"type": "posix", "path": str(workdir / "posix"), "o_direct": True},
            ],
        }
        max_len = 4096
        ucm = engine_args(model, stack=stack, max_model_len=max_len)
        env = {
            "VLLM_CPU_KVCACHE_SPACE": "1" if options.quick else "2",
            "VLLM_CPU_OMP_THREADS_BIND": _omp_bind(),
        }
        if options.quick:
            # One process for the engine core and the worker: `import vllm` alone costs 8-15 s
            # here, and a multiprocess engine imports it three times.
            ucm["distributed_executor_backend"] = "uni"
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        notes = [
            f"model: random Llama, {config['model']['layers']} layers, hidden "
            f"{config['model']['hidden']}, {config['model']['kv_heads']} KV heads x "
            f"{config['model']['head_dim']} head_dim, float32: "
            f"{_kv_bytes_per_token(config['model']) // 1024} KiB of KV per token; prompt "
            f"{config['prompt_tokens']} tokens ({config['prompt_tokens'] // BLOCK_TOKENS} full "
            "blocks served, the rest computed); TTFT = wall time of LLM.generate, max_tokens=1; "
            "medians (p25-p75 in the JSON extras)",
            "each engine is its own processes (quick: one process) and the machine is shared: "
            "compare ratios",
            f"every engine's worker computes on the same OpenMP threads "
            f"(VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']})",
        ]
        ucm_steps = [*_ttft_steps("ucm", prompts, True, again), {"op": "metrics", "label": "m"}]
        if options.quick:
            plan: dict[str, Any] = {"engines": [{"llm": ucm, "steps": ucm_steps}]}
        else:
            throughput = _workload(config["throughput"], vocab, seed=7)
            example_dir = workdir / "example-connector"
            example_dir.mkdir(parents=True, exist_ok=True)
            plan = {
                "engines": [
                    {
                        "llm": engine_args(model, max_model_len=max_len),
                        "steps": [
                            *_ttft_steps("recompute", few, True, 0),
                            _gen("tput_plain", throughput, 16, batch=True),
                        ],
                    },
                    {
                        "llm": engine_args(model, prefix_caching=True, max_model_len=max_len),
                        "steps": _ttft_steps("floor", few, True, again),
                    },
                    {
                        "llm": ucm,
                        "steps": [*ucm_steps, _gen("tput_ucm", throughput, 16, batch=True)],
                    },
                    {
                        "llm": ucm,
                        "steps": [
                            *_ttft_steps("posix", prompts, False, 1),
                            {"op": "metrics", "label": "posix_metrics"},
                        ],
                    },
                    {
                        "llm": engine_args(
                            model,
                            connector="ExampleConnector",
                            extra_config={"shared_storage_path": str(example_dir)},
                            max_model_len=max_len,
                        ),
                        "steps": _ttft_steps("example", few, True, again),
                    },
                ]
            }
        options.progress("vllm_ttft: running the engines (one subprocess, engine after engine)")
        run = run_plan(plan, timeout_s=TIMEOUT_S, env=env, workdir=workdir)
        engines = run.data.get("engines", [])
        problems = [e.get("start_error") for e in engines if e.get("start_error")]
        problems += [s["error"] for e in engines for s in e.get("steps", []) if "error" in s]
        if run.returncode != 0 or problems or len(engines) != len(plan["engines"]):
            raise RuntimeError(
                f"the vLLM driver failed (rc={run.returncode}, {problems}): "
                f"{(run.stdout + run.stderr)[-3000:]}"
            )
        expected = (int(config["prompt_tokens"]) // BLOCK_TOKENS) * BLOCK_TOKENS
        variants = {"ucm": (count, again)}
        if not options.quick:
            variants.update(floor=(3, again), posix=(count, 1), example=(3, again))
        samples: dict[str, list[float]] = {}
        for variant, (prompts_used, repeats) in variants.items():
            labels = _labels(variant, prompts_used, repeats)
            served = [int(run.result(label)["cached"][0]) for label in labels]
            if min(served) < expected:
                raise RuntimeError(f"{variant} served {served} tokens, expected {expected} each")
            samples[variant] = [float(run.result(label)["seconds"]) for label in labels]
        metrics = run.result("m")["metrics"]
        load_ms = 1000 * metrics.get("vllm:ucm_load_seconds", 0.0) / (count * again)
        first = [float(run.result(f"ucm_first_{i}")["seconds"]) for i in range(count)]
        ucm_hit = statistics.median(samples["ucm"])
        if options.quick:
            figures = [
                Figure(
                    name="TTFT, UCM from the CacheBuffer (quick: tiny model)",
                    value=ucm_hit,
                    unit="s",
                    baseline="the same prompt's first request (recompute + save)",
                    baseline_value=statistics.median(first),
                    higher_is_better=False,
                    extra={"served_tokens": float(expected), "load_ms_per_request": load_ms},
                )
            ]
            notes.append(
                "quick: one UCM engine, tiny model; the full run adds posix, vLLM's prefix "
                "cache, ExampleConnector and the throughput workload"
            )
            return BenchResult(name=self.name, figures=figures, notes=notes)
        samples["recompute"] = [
            float(run.result(f"recompute_first_{i}")["seconds"]) for i in range(len(few))
        ]
        samples["miss"] = first
        posix_metrics = run.result("posix_metrics")["metrics"]
        if posix_metrics.get("vllm:ucm_loaded_blocks", 0) < count * (expected // BLOCK_TOKENS):
            raise RuntimeError(f"the posix engine did not load from UCM: {posix_metrics}")
        posix_load_ms = 1000 * posix_metrics.get("vllm:ucm_load_seconds", 0.0) / count
        return self._full(
            run, samples, expected, config, notes, {"buffer": load_ms, "posix": posix_load_ms}
        )

    def _full(
        self,
        run: Any,
        samples: dict[str, list[float]],
        expected: int,
        config: dict[str, Any],
        notes: list[str],
        load_ms: dict[str, float],
    ) -> BenchResult:
        median = {variant: statistics.median(values) for variant, values in samples.items()}

        def spread(variant: str) -> dict[str, float]:
            values = sorted(samples[variant])
            quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
            return {"p25_s": quartiles[0], "p75_s": quartiles[2], "samples": float(len(values))}

        plain = run.result("tput_plain")
        with_ucm = run.result("tput_ucm")

        def rate(result: dict[str, Any]) -> float:
            tokens = result["prompt_tokens"] + result["generated_tokens"]
            return float(tokens) / float(result["seconds"])

        kv_mib = expected * _kv_bytes_per_token(config["model"]) / 2**20
        names = {
            "ucm": "TTFT, UCM from the CacheBuffer",
            "posix": "TTFT, UCM from posix (O_DIRECT)",
        }
        baselines = {
            "recompute": "recompute",
            "floor": "vLLM prefix-cache hit (floor)",
            "example": "ExampleConnector hit",
        }
        targets = {
            ("ucm", "recompute"): (">= 20x lower than recompute", 20.0),
            ("ucm", "floor"): ("within 1.3x of the floor", 1 / 1.3),
            ("ucm", "example"): (">= 2x lower than ExampleConnector", 2.0),
        }
        figures: list[Figure] = []
        for variant, name in names.items():
            for baseline, baseline_name in baselines.items():
                target, target_ratio = targets.get((variant, baseline), (None, None))
                extra = spread(variant) if baseline == "recompute" else {}
                if baseline == "recompute":
                    extra["load_ms_per_request"] = load_ms[
                        "buffer" if variant == "ucm" else "posix"
                    ]
                    extra["kv_MiB"] = kv_mib
                figures.append(
                    Figure(
                        name=name,
                        value=median[variant],
                        unit="s",
                        baseline=baseline_name,
                        baseline_value=median[baseline],
                        higher_is_better=False,
                        target=target,
                        target_ratio=target_ratio,
                        extra=extra,
                    )
                )
        for variant, name in (
            ("floor", "TTFT, vLLM prefix-cache hit (floor)"),
            ("example", "TTFT, ExampleConnector hit"),
        ):
            figures.append(
                Figure(
                    name=name,
                    value=median[variant],
                    unit="s",
                    baseline="recompute",
                    baseline_value=median["recompute"],
                    higher_is_better=False,
                    extra=spread(variant),
                )
            )
        figures.append(
            Figure(
                name="TTFT of a miss with UCM (recompute + save)",
                value=median["miss"],
                unit="s",
                baseline="recompute without a connector",
                baseline_value=median["recompute"],
                higher_is_better=False,
                extra=spread("miss"),
            )
        )
        served_tput = sum(with_ucm["cached"])
        figures.append(
            Figure(
                name="throughput, 32 requests, half sharing 2 long prefixes, with UCM",
                value=rate(with_ucm),
                unit="tok/s",
                baseline="the same workload without UCM",
                baseline_value=rate(plain),
                extra={
                    "seconds_with": float(with_ucm["seconds"]),
                    "seconds_without": float(plain["seconds"]),
                    "prompt_tokens_served_by_ucm": float(served_tput),
                    "prompt_tokens": float(with_ucm["prompt_tokens"]),
                },
            )
        )
        notes += [
            "posix: a new engine on the same stack (a fresh, empty CacheBuffer), O_DIRECT reads",
            f"UCM's own load time per hit (vllm:ucm_load_seconds): CacheBuffer "
            f"{load_ms['buffer']:.1f} ms, posix {load_ms['posix']:.1f} ms for {kv_mib:.0f} MiB",
            "ExampleConnector reads the safetensors files it has just written (page cache)",
            f"throughput: {served_tput} of {with_ucm['prompt_tokens']} prompt tokens served "
            "by UCM (the first requests of each shared prefix compute it)",
        ]
        shown = {
            "recompute": "recompute",
            "floor": "vLLM prefix-cache hit",
            "ucm": "UCM CacheBuffer",
            "posix": "UCM posix",
            "example": "ExampleConnector",
        }
        plots = [
            Plot(
                filename="vllm_ttft.png",
                title=f"TTFT of a {config['prompt_tokens']}-token prompt ({kv_mib:.0f} MiB of KV)",
                xlabel="",
                ylabel="seconds (log)",
                series={label: ([0.0], [median[key]]) for key, label in shown.items()},
                kind="bar",
                logy=True,
            ),
            Plot(
                filename="vllm_throughput.png",
                title="repeated-prefix workload throughput",
                xlabel="",
                ylabel="tokens/s",
                series={
                    "without UCM": ([0.0], [rate(plain)]),
                    "with UCM": ([0.0], [rate(with_ucm)]),
                },
                kind="bar",
            ),
        ]
        return BenchResult(name=self.name, figures=figures, plots=plots, notes=notes)


BENCHMARK = VllmTtftBenchmark()
