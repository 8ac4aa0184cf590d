"""Serving soak: ``vllm serve`` with UCM under KV pressure, many clients and random faults.

One server with ``UcmConnector`` on a CacheBuffer of 16 blocks (far less than the working set,
so prefixes come back from below through asynchronous loads) over posix and over S3 (moto, reached
through a :class:`~harness.faults.FaultProxy`) serves ``clients`` client threads for
``seconds``. Every client asks, again and again, one of a fixed set of prompts that share long
prefixes, so UCM serves most prefixes from one tier or another; vLLM's KV cache is sized so that
it preempts. vLLM's own prefix cache is off: a cached token can only come from UCM. Meanwhile a
fault thread cycles through:

- **blackhole**: the S3 endpoint accepts connections and never answers, then heals;
- **s3_down**: the S3 server stops (connections refused), then restarts empty on its port;
- **corrupt**: a third of posix's files get flipped bytes (each is a checksum miss, then
  recomputed or served from another tier).

Afterwards a server without a connector answers each distinct prompt once, one request at a
time: the reference. The soak passes when every request completed, every greedy output equals
the reference's for its prompt, and no request took longer than ``max_request_s``. ``python -m
harness.serve_soak --seconds 600`` (from the repository root) runs the long form; the test suite
runs a short one. A repository tool, not part of the wheel.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from harness.faults import FaultProxy
from harness.s3 import S3Server
from harness.vllm import prompt_tokens, write_tiny_llama
from harness.vllm_server import VllmServer, cpu_bind, write_word_tokenizer

BLOCK = 128
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4
"""One vLLM block of write_tiny_llama's default model (2 layers, 2 KV heads x 32, float32)."""
KV_BLOCKS = 40
"""vLLM's KV cache in blocks: 32 clients need ~4 blocks each, so vLLM preempts."""
MAX_TOKENS = 16
FAULTS = ("blackhole", "s3_down", "corrupt")


def _prompts(count: int) -> list[list[int]]:
    """``count`` prompts over 4 shared 256-token prefixes, each with its own 100-200-token
    suffix: 3-4 blocks each, the first two shared."""
    prefixes = [prompt_tokens(500 + index, 2 * BLOCK) for index in range(4)]
    rng = random.Random(7)
    return [
        prefixes[index % 4] + prompt_tokens(600 + index, rng.randrange(100, 200))
        for index in range(count)
    ]


class _Faults:
    """Cycles through the faults, each for ``period_s``, with a healthy period after each."""

    def __init__(self, s3: S3Server, proxy: FaultProxy, posix: Path, period_s: float) -> None:
        self.s3 = s3
        self.proxy = proxy
        self.posix = posix
        self.period_s = period_s
        self.applied: dict[str, int] = dict.fromkeys(FAULTS, 0)
        self.corrupted_files = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)

    def _run(self) -> None:
        try:
            rng = random.Random(11)
            turn = 0
            while not self.stop.wait(self.period_s):
                fault = FAULTS[turn % len(FAULTS)]
                turn += 1
                self.applied[fault] += 1
                if fault == "blackhole":
                    self.proxy.set_mode("blackhole")
                    self.stop.wait(self.period_s)
                    self.proxy.set_mode("forward")
                elif fault == "s3_down":
                    port = self.s3.port
                    self.s3.stop()
                    self.stop.wait(self.period_s)
                    self.s3 = S3Server(bucket=self.s3.bucket, port=port).start()
                else:
                    files = sorted(path for path in self.posix.rglob("*") if path.is_file())
                    for path in rng.sample(files, len(files) // 3):
                        data = bytearray(path.read_bytes())
                        if not data:
                            continue
                        for _ in range(8):
                            data[rng.randrange(len(data))] ^= 0xFF
                        path.write_bytes(bytes(data))
                        self.corrupted_files += 1
        except BaseException as exc:  # reported by run(); the soak must not hang on it
            self.error = exc


def run(
    seconds: float,
    clients: int,
    workdir: Path,
    *,
    max_request_s: float,
    fault_period_s: float,
    extra_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Runs the soak; returns its report (see the module docstring)."""
    model = write_tiny_llama(workdir / "model", seed=0)
    write_word_tokenizer(model)
    prompts = _prompts(48)
    posix = workdir / "posix"
    env: dict[str, str | None] = {
        "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(),
        "VLLM_CPU_KVCACHE_SPACE": None,
    }
    common = [
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--seed",
        "0",
        "--no-enable-prefix-caching",
        "--kv-cache-memory-bytes",
        str(KV_BLOCKS * BLOCK_BYTES),
    ]
    s3 = S3Server().start()
    proxy = FaultProxy(("127.0.0.1", s3.port)).start()
    faults = _Faults(s3, proxy, posix, fault_period_s)
    stack = {
        "unique_id": f"serve-soak-{uuid.uuid4().hex[:10]}",
        "buffer": {"capacity": 16 * BLOCK_BYTES},
        "tiers": [
            {"type": "posix", "path": str(posix)},
            {
                "type": "fsspec",
                "url": s3.url("soak"),
                "storage_options": {**s3.storage_options, "endpoint_url": proxy.endpoint},
            },
        ],
    }
    transfer = {
        "kv_connector": "UcmConnector",
        "kv_connector_module_path": "ucm.integration.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"ucm_stack": stack, **(extra_config or {})},
    }
    answers: list[tuple[int, list[int], float]] = []
    errors: list[str] = []
    lock = threading.Lock()
    report: dict[str, Any] = {"seconds": seconds, "clients": clients}
    try:
        args = [*common, "--kv-transfer-config", json.dumps(transfer)]
        with VllmServer(model, workdir / "ucm-server.log", args, env=env) as server:
            end = time.monotonic() + seconds

            def client(index: int) -> None:
                rng = random.Random(index)
                while time.monotonic() < end:
                    which = rng.randrange(len(prompts))
                    started = time.monotonic()
                    try:
                        reply = server.complete(
                            prompts[which], max_tokens=MAX_TOKENS, timeout_s=max_request_s + 60
                        )
                    except Exception as exc:
                        with lock:
                            errors.append(f"client {index}, prompt {which}: {exc}")
                        return
                    with lock:
                        answers.append((which, reply["token_ids"], time.monotonic() - started))

            faults.thread.start()
            threads = [
                threading.Thread(target=client, args=(index,), name=f"soak-client-{index}")
                for index in range(clients)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=seconds + max_request_s + 120)
            hung = sum(thread.is_alive() for thread in threads)
            faults.stop.set()
            faults.thread.join(timeout=2 * fault_period_s + 30)
            proxy.set_mode("forward")
            report["ucm_metrics"] = {
                name: value
                for name, value in server.metrics().items()
                if name.startswith("vllm:ucm_") or name == "vllm:num_preemptions"
            }
        asked = sorted({which for which, _, _ in answers})
        with VllmServer(model, workdir / "reference-server.log", common, env=env) as reference:
            expected = {
                which: reference.complete(prompts[which], max_tokens=MAX_TOKENS)["token_ids"]
                for which in asked
            }
    finally:
        faults.stop.set()
        proxy.stop()
        faults.s3.stop()
    latencies = sorted(latency for _, _, latency in answers)
    mismatches = [which for which, tokens, _ in answers if tokens != expected[which]]
    report.update(
        requests=len(answers),
        errors=errors,
        hung_clients=hung,
        fault_error=repr(faults.error) if faults.error else None,
        mismatches=len(mismatches),
        mismatched_prompts=sorted(set(mismatches))[:20],
        distinct_prompts=len(asked),
        max_request_s=latencies[-1] if latencies else None,
        p50_request_s=latencies[len(latencies) // 2] if latencies else None,
        request_bound_s=max_request_s,
        faults=dict(faults.applied),
        corrupted_files=faults.corrupted_files,
    )
    report["passed"] = bool(
        answers
        and not errors
        and not hung
        and faults.error is None
        and not mismatches
        and latencies[-1] <= max_request_s
    )
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="how long the clients run")
    parser.add_argument("--clients", type=int, default=32, help="concurrent client threads")
    parser.add_argument(
        "--max-request-s", type=float, default=180.0, help="bound on any one request's time"
    )
    parser.add_argument(
        "--fault-period-s", type=float, default=15.0, help="how long each fault lasts"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="kept when given")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument(
        "--extra-config",
        type=json.loads,
        default=None,
        help="more kv_connector_extra_config, as JSON",
    )
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.clients <= 0:
        parser.error(f"--seconds and --clients must be > 0, got {args.seconds}, {args.clients}")
    with tempfile.TemporaryDirectory(prefix="ucm-serve-soak-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        report = run(
            args.seconds,
            args.clients,
            workdir,
            max_request_s=args.max_request_s,
            fault_period_s=args.fault_period_s,
            extra_config=args.extra_config,
        )
    text = json.dumps(report, indent=2, sort_keys=True)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
