"""vLLM's OpenAI server with UCM, driven by vLLM's own client (``vllm bench serve``): shared
documents asked again and again, with and without UCM, one replica and two.

The workload is the one a document-QA service sees: ``docs`` documents of ``doc_tokens`` tokens,
each asked ``asks`` times with a new ``suffix_tokens``-token question, interleaved (every
document once, then every document again, ...). A request's first ask can be served by nothing;
its repeats by vLLM's prefix cache while the document is still in vLLM's KV space, and by UCM
after that. vLLM's KV space (``VLLM_CPU_KVCACHE_SPACE``) holds about half the documents, so
vLLM's own prefix cache evicts them between asks.

Systems, each a fresh ``vllm serve`` (every worker on the same OpenMP threads):

- **no connector** (the baseline): vLLM with its prefix cache;
- **UCM sync** and **UCM async**: vLLM with its prefix cache and ``UcmConnector`` (a CacheBuffer
  over posix with ``o_direct``), with ``ucm_async_load`` false (and ``--no-async-scheduling``:
  the connector refuses synchronous loads under asynchronous scheduling) and true (the default);
- **2 burners**: no connector and UCM async again, each beside two CPU-bound processes (a busy
  node: a first ask must still cost next to nothing). Both servers stay up and take turns in
  ``busy_rounds`` rounds (3; ``busy_asks`` = 2 asks per document), each round with documents of
  its own and the order alternating, so the two systems meet the same moments of a noisy
  machine: the first-ask figures pool every round (27 first asks a system), and each round's
  ratio is kept beside them;
- **floor**: vLLM with its prefix cache and a KV space that holds every document: the best a
  repeat ask can do (the target for UCM's repeat asks is within 1.3x of it);
- **two replicas** (full run only), one CPU each, the requests dealt round robin (two
  ``vllm bench serve`` clients at once), without a connector and with UCM on one shared buffer:
  consecutive asks of a document land on different replicas, so with UCM every repeat is a
  cross-replica hit and every document is computed once on the node.

Each server first answers ``warmup`` prompts (4; 1 in the quick run) shaped like first asks
that share no block with the workload, as many at a time as the measured run sends: the first
requests after a server starts pay for first touches of its memory (vLLM's KV space; UCM's
CacheBuffer, populated behind the open, and its first posix files), which a server that has
been up a while no longer does. Their TTFTs are reported as the cold start, beside the
no-connector server's.

Figures: TTFT p50/p90 of first asks and of repeat asks, the cold start, decode time per output
token, wall time, and the prompt tokens computed, served by vLLM's prefix cache and served by
UCM in the measured run (vLLM's ``vllm:prompt_tokens_by_source``). Every system's greedy
outputs must equal the no-connector server's, request by request, or the benchmark fails.

``--quick``: a tiny model, 3 short documents asked twice, one UCM server with vLLM's prefix cache
off (its KV space would hold them all: every repeat is UCM's), repeat asks against first asks:
it proves the machinery runs; its ratios say nothing about the targets.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import BenchOptions, BenchResult, Figure, Plot, need_harness, not_installed

FULL: dict[str, Any] = {
    "model": {
        "layers": 8,
        "hidden": 512,
        "heads": 16,
        "kv_heads": 16,
        "head_dim": 128,
        "intermediate": 1024,
        "vocab": 512,
    },
    "docs": 9,
    "doc_tokens": 1800,
    "suffix_tokens": 64,
    "asks": 5,
    "output_tokens": 16,
    "concurrency": 4,
    "kv_gib": 1,
    "floor_kv_gib": 3,
    "buffer": "4GiB",
    "replicas": True,
    "prefix_caching": True,
    "warmup": 4,
    "busy_rounds": 3,
    "busy_asks": 2,
}
QUICK: dict[str, Any] = {
    "model": {
        "layers": 2,
        "hidden": 128,
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 32,
        "intermediate": 256,
        "vocab": 512,
    },
    "docs": 3,
    "doc_tokens": 300,
    "suffix_tokens": 16,
    "asks": 2,
    "output_tokens": 8,
    "concurrency": 2,
    "kv_gib": 1,
    "floor_kv_gib": 1,
    "buffer": "64MiB",
    "replicas": False,
    "prefix_caching": False,
    "warmup": 1,
}
BLOCK_TOKENS = 128
BENCH_TIMEOUT_S = 1800.0
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
"""vLLM's ``vllm:prompt_tokens_by_source`` labels: computed, its prefix cache, a connector."""


def _kv_bytes_per_token(model: dict[str, int]) -> int:
    return model["layers"] * 2 * model["kv_heads"] * model["head_dim"] * 4


def _tokens(config: dict[str, Any], seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, int(config["model"]["vocab"])) for _ in range(length)]


def workload(config: dict[str, Any], round_: int = 0, asks: int | None = None) -> list[list[int]]:
    """The prompts in the order they are sent: ask ``a`` of document ``d`` is request
    ``a * docs + d``; every ask has its own question (suffix). Each ``round_`` has documents
    and questions of its own (round 0 is the workload of every one-round system); ``asks``
    defaults to the config's."""
    base = ROUND_SEED_STRIDE * round_
    docs = [
        _tokens(config, base + 1000 + d, int(config["doc_tokens"]))
        for d in range(int(config["docs"]))
    ]
    return [
        docs[d] + _tokens(config, base + 2000 + ask * 100 + d, int(config["suffix_tokens"]))
        for ask in range(int(config["asks"]) if asks is None else asks)
        for d in range(len(docs))
    ]


ROUND_SEED_STRIDE = 100_000
"""Seed distance between two rounds' prompts: a round's seeds are its base plus 1000 + d (its
documents) and 2000 + 100 * ask + d (its questions); the warm-up's are 9000 + i."""


def warmup_prompts(config: dict[str, Any]) -> list[list[int]]:
    """``warmup`` prompts shaped like a first ask (a document and a question) that share no
    block with the workload: each server answers them before the measured run, so a first ask
    measures a miss on a running server, not the first touches of its memory (vLLM's KV space,
    UCM's CacheBuffer and posix files). Their TTFTs are reported as the cold start."""
    length = int(config["doc_tokens"]) + int(config["suffix_tokens"])
    return [_tokens(config, 9000 + index, length) for index in range(int(config["warmup"]))]


@dataclass
class Served:
    """One system's run: per request (in workload order) its TTFT and generated text, the
    decode time per output token, wall time, and vLLM's prompt-token counters by source (the
    measured run's: the warm-up's are subtracted); the warm-up asks' TTFTs."""

    ttfts: list[float]
    texts: list[str]
    tpot_ms: float
    wall_s: float
    tokens: dict[str, float]
    warmup_ttfts: list[float]
    rounds: int = 1
    """Rounds of the workload run one after another on this server, each with documents of
    its own: ``ttfts`` and ``texts`` hold them round after round, in equal parts."""

    def split(self, docs: int) -> tuple[list[float], list[float]]:
        """TTFTs of the first asks (every round's first ``docs`` requests) and of the repeats."""
        size = len(self.ttfts) // self.rounds
        chunks = [self.ttfts[start : start + size] for start in range(0, len(self.ttfts), size)]
        return (
            [ttft for chunk in chunks for ttft in chunk[:docs]],
            [ttft for chunk in chunks for ttft in chunk[docs:]],
        )


def _by_source(server: Any) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source`` of one server, per source label."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as response:
        text = response.read().decode()
    counts = dict.fromkeys((*SOURCES, "compute_waits"), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_by_source_total":
                source = sample.labels.get("source", "")
                if source in counts:
                    counts[source] += float(sample.value)
            elif sample.name == "vllm:ucm_compute_waits_total":
                # Requests that waited for the other replica's save (compute claims).
                counts["compute_waits"] += float(sample.value)
    return counts


class VllmServingBenchmark:
    name = "vllm_serving"
    title = (
        "vLLM's OpenAI server + UCM under `vllm bench serve`: shared documents asked again, "
        "TTFT of first and repeat asks, decode, wall time, tokens computed; two replicas"
    )

    def run(self, options: BenchOptions) -> BenchResult:
        absent = not_installed(self.name, ("vllm", "pandas"), "s")
        if absent is not None:
            return absent
        need_harness(self.name)
        from harness.vllm import write_tiny_llama
        from harness.vllm_server import cpu_bind, write_word_tokenizer

        config = QUICK if options.quick else FULL
        workdir = Path(options.workdir or ".") / f"vllm-serving-{uuid.uuid4().hex[:8]}"
        workdir.mkdir(parents=True)
        options.progress("vllm_serving: writing the random-weight model and its tokenizer")
        model = write_tiny_llama(workdir / "model", seed=0, max_positions=4096, **config["model"])
        write_word_tokenizer(model, vocab=int(config["model"]["vocab"]))
        prompts = workload(config)
        dataset = self._dataset(model, prompts, workdir / "requests.jsonl")
        cpus = sorted(os.sched_getaffinity(0))
        runs: dict[str, Served] = {}
        plain_env = {"VLLM_CPU_KVCACHE_SPACE": str(config["kv_gib"])}
        stack = self._stack(workdir, config, "one")
        ucm_args = self._ucm_args(stack)
        if options.quick:
            # One server: a server start costs 30-100 s on a busy two-core machine.
            served = self._system(
                options, model, dataset, config, "ucm", ucm_args, plain_env, cpu_bind()
            )
            return self._quick(served, config)
        runs["no connector"] = self._system(
            options, model, dataset, config, "plain", [], plain_env, cpu_bind()
        )
        # Loads before the forward pass exist under synchronous scheduling only (the connector
        # refuses them under vLLM's asynchronous scheduling, CUDA vLLM's default).
        sync_args = [
            *self._ucm_args(self._stack(workdir, config, "sync"), {"ucm_async_load": False}),
            "--no-async-scheduling",
        ]
        runs["UCM sync"] = self._system(
            options, model, dataset, config, "ucm-sync", sync_args, plain_env, cpu_bind()
        )
        runs["UCM async"] = self._system(
            options, model, dataset, config, "ucm", ucm_args, plain_env, cpu_bind()
        )
        floor_env = {"VLLM_CPU_KVCACHE_SPACE": str(config["floor_kv_gib"])}
        runs["floor"] = self._system(
            options, model, dataset, config, "floor", [], floor_env, cpu_bind()
        )
        # A busy node: two CPU-bound processes beside each system (first asks must still cost
        # next to nothing), in interleaved rounds.
        busy_args = self._ucm_args(self._stack(workdir, config, "busy"))
        plain_busy, ucm_busy = self._busy(options, model, workdir, config, busy_args, plain_env)
        runs["no connector, 2 burners"] = plain_busy
        runs["UCM async, 2 burners"] = ucm_busy
        if len(cpus) >= 2 and config["replicas"]:
            runs["2 replicas, no connector"] = self._replicas(
                options, model, prompts, config, workdir, "plain2", [], cpus
            )
            shared = self._stack(workdir, config, "two")
            runs["2 replicas, UCM"] = self._replicas(
                options, model, prompts, config, workdir, "ucm2", self._ucm_args(shared), cpus
            )
        reference = runs["no connector"].texts
        for system, served in runs.items():
            if system == "UCM async, 2 burners":
                # Every round's, against the no-connector server's beside the same burners.
                _same_outputs(system, served.texts, plain_busy.texts)
            elif system == "no connector, 2 burners":
                # Its first round asks the first of round 0's prompts, as every system does.
                first = len(served.texts) // served.rounds
                _same_outputs(system, served.texts[:first], reference[:first])
            else:
                _same_outputs(system, served.texts, reference)
        return self._result(runs, config, len(cpus))

    # ---- systems -------------------------------------------------------------------------

    def _dataset(self, model: Path, prompts: list[list[int]], path: Path) -> Path:
        """The prompts as a ``custom`` dataset of ``vllm bench serve`` (JSONL of texts): the
        word tokenizer maps each text back to exactly these token ids."""
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        with path.open("w") as out:
            for prompt in prompts:
                text = " ".join(str(tokenizer.id_to_token(token)) for token in prompt)
                if tokenizer.encode(text, add_special_tokens=False).ids != prompt:
                    raise AssertionError("the word tokenizer does not round-trip the prompt")
                out.write(json.dumps({"prompt": text}) + "\n")
        return path

    def _stack(self, workdir: Path, config: dict[str, Any], name: str) -> Path:
        stack = {
            "unique_id": f"bench-serving-{name}-{uuid.uuid4().hex[:8]}",
            "tiers": [
                {"type": "buffer", "capacity": config["buffer"]},
                # O_DIRECT, as under any CacheBuffer (docs/configuration.md): buffered writes
                # cost the node's CPUs 10x more for each new page-cache page.
                {"type": "posix", "path": str(workdir / f"posix-{name}"), "o_direct": True},
            ],
        }
        path = workdir / f"stack-{name}.json"
        path.write_text(json.dumps(stack))
        return path

    def _ucm_args(self, stack: Path, extra: dict[str, Any] | None = None) -> list[str]:
        transfer = {
            "kv_connector": "UcmConnector",
            "kv_connector_module_path": "ucm.integration.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"ucm_stack": str(stack), **(extra or {})},
        }
        return ["--kv-transfer-config", json.dumps(transfer)]

    def _server_args(self, config: dict[str, Any], extra: list[str]) -> list[str]:
        return [
            "--dtype",
            "float32",
            "--max-model-len",
            "4096",
            "--enforce-eager",
            "--seed",
            "0",
            "--enable-prefix-caching" if config["prefix_caching"] else "--no-enable-prefix-caching",
            *extra,
        ]

    def _bench_args(
        self, dataset: Path, count: int, config: dict[str, Any], concurrency: int
    ) -> list[str]:
        return [
            "--dataset-name",
            "custom",
            "--dataset-path",
            str(dataset),
            "--disable-shuffle",
            "--skip-chat-template",
            "--custom-output-len",
            str(config["output_tokens"]),
            "--num-prompts",
            str(count),
            "--temperature",
            "0",
            "--ignore-eos",
            "--request-rate",
            "inf",
            "--max-concurrency",
            str(concurrency),
        ]

    def _system(
        self,
        options: BenchOptions,
        model: Path,
        dataset: Path,
        config: dict[str, Any],
        label: str,
        extra: list[str],
        env: dict[str, str],
        bind: str,
    ) -> Served:
        count = int(config["docs"]) * int(config["asks"])
        workdir = dataset.parent
        with self._server(options, model, workdir, config, label, extra, env, bind) as server:
            warmup = self._warm_up(options, server, model, workdir, label, config, 0, 1)
            return self._measure(options, server, dataset, count, config, label, warmup)

    def _server(
        self,
        options: BenchOptions,
        model: Path,
        workdir: Path,
        config: dict[str, Any],
        label: str,
        extra: list[str],
        env: dict[str, str],
        bind: str,
    ) -> Any:
        """A started ``vllm serve`` (a context manager: stopped when the block ends)."""
        from harness.vllm_server import VllmServer

        options.progress(f"vllm_serving: {label}: starting vllm serve")
        server_env: dict[str, str | None] = {**env, "VLLM_CPU_OMP_THREADS_BIND": bind}
        return VllmServer(
            model, workdir / f"{label}.log", self._server_args(config, extra), env=server_env
        )

    def _measure(
        self,
        options: BenchOptions,
        server: Any,
        dataset: Path,
        count: int,
        config: dict[str, Any],
        label: str,
        warmup: list[float],
    ) -> Served:
        """One measured run of ``dataset``'s ``count`` prompts on a running server."""
        from harness.vllm_server import bench_serve

        before = _by_source(server)
        options.progress(f"vllm_serving: {label}: vllm bench serve, {count} requests")
        result = bench_serve(
            server,
            dataset.parent / f"{label}.json",
            self._bench_args(dataset, count, config, int(config["concurrency"])),
            timeout_s=BENCH_TIMEOUT_S,
        )
        return self._served(result, _minus(_by_source(server), before), warmup)

    def _busy(
        self,
        options: BenchOptions,
        model: Path,
        workdir: Path,
        config: dict[str, Any],
        ucm_args: list[str],
        env: dict[str, str],
    ) -> tuple[Served, Served]:
        """The busy node: no connector and UCM async, each beside two CPU-bound processes, in
        ``busy_rounds`` rounds of ``busy_asks`` asks per document, each round with documents
        of its own. Both servers stay up (an idle one takes no CPU) and take turns, the order
        alternating from round to round, so the two systems meet the same moments of a noisy
        machine: nine first asks of one run each were too few to tell them apart here.
        Returns the no-connector server's rounds and UCM's, each as one :class:`Served`."""
        from contextlib import ExitStack

        from harness.vllm_server import cpu_bind

        rounds, asks = int(config["busy_rounds"]), int(config["busy_asks"])
        count = int(config["docs"]) * asks
        labels = ("plain-burners", "ucm-burners")
        measured: dict[str, list[Served]] = {label: [] for label in labels}
        with ExitStack() as stack:
            # Started before the burners: a start beside them costs minutes and measures
            # nothing; the warm-up (the cold start) runs beside them.
            servers = {
                label: stack.enter_context(
                    self._server(options, model, workdir, config, label, args, env, cpu_bind())
                )
                for label, args in zip(labels, ([], ucm_args), strict=True)
            }
            stack.enter_context(_burners(2))
            warmups = {
                label: self._warm_up(options, server, model, workdir, label, config, 0, 1)
                for label, server in servers.items()
            }
            for round_ in range(rounds):
                dataset = self._dataset(
                    model, workload(config, round_, asks), workdir / f"busy-{round_}.jsonl"
                )
                order = labels if round_ % 2 == 0 else labels[::-1]
                for label in order:
                    measured[label].append(
                        self._measure(
                            options,
                            servers[label],
                            dataset,
                            count,
                            config,
                            f"{label}-{round_}",
                            warmups[label],
                        )
                    )
        plain, ucm = (_rounds(measured[label]) for label in labels)
        return plain, ucm

    def _warm_up(
        self,
        options: BenchOptions,
        server: Any,
        model: Path,
        workdir: Path,
        label: str,
        config: dict[str, Any],
        index: int,
        servers: int,
    ) -> list[float]:
        """Sends this server its share of the warm-up prompts (every ``servers``-th, from
        ``index``), as many at a time as the measured run will; returns their TTFTs."""
        from harness.vllm_server import bench_serve

        mine = warmup_prompts(config)[index::servers]
        if not mine:
            return []
        dataset = self._dataset(model, mine, workdir / f"{label}-warmup.jsonl")
        concurrency = max(1, int(config["concurrency"]) // servers)
        options.progress(f"vllm_serving: {label}: {len(mine)} warm-up asks")
        result = bench_serve(
            server,
            workdir / f"{label}-warmup.json",
            self._bench_args(dataset, len(mine), config, concurrency),
            timeout_s=BENCH_TIMEOUT_S,
        )
        return self._served(result, dict.fromkeys(SOURCES, 0.0), []).ttfts

    def _replicas(
        self,
        options: BenchOptions,
        model: Path,
        prompts: list[list[int]],
        config: dict[str, Any],
        workdir: Path,
        label: str,
        extra: list[str],
        cpus: list[int],
    ) -> Served:
        """Two servers, one CPU each; request ``i`` goes to replica ``i % 2`` (two clients, at
        once, each with half the concurrency)."""
        from contextlib import ExitStack

        from harness.vllm_server import VllmServer, bench_serve

        halves = [prompts[0::2], prompts[1::2]]
        datasets = [
            self._dataset(model, half, workdir / f"{label}-{index}.jsonl")
            for index, half in enumerate(halves)
        ]
        env = {"VLLM_CPU_KVCACHE_SPACE": str(config["kv_gib"])}
        options.progress(f"vllm_serving: {label}: starting two vllm serve replicas")
        with ExitStack() as stack:
            servers = [
                stack.enter_context(
                    VllmServer(
                        model,
                        workdir / f"{label}-{index}.log",
                        self._server_args(config, extra),
                        env={**env, "VLLM_CPU_OMP_THREADS_BIND": str(cpus[index])},
                    )
                )
                for index in range(2)
            ]
            concurrency = max(1, int(config["concurrency"]) // 2)
            with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
                warmups = [
                    pool.submit(
                        self._warm_up,
                        options,
                        servers[index],
                        model,
                        workdir,
                        f"{label}-{index}",
                        config,
                        index,
                        2,
                    )
                    for index in range(2)
                ]
                warmed = [future.result(timeout=BENCH_TIMEOUT_S + 60) for future in warmups]
                before = [_by_source(server) for server in servers]
                options.progress(f"vllm_serving: {label}: two clients, round robin")
                futures = [
                    pool.submit(
                        bench_serve,
                        servers[index],
                        workdir / f"{label}-{index}.json",
                        self._bench_args(datasets[index], len(halves[index]), config, concurrency),
                        timeout_s=BENCH_TIMEOUT_S,
                    )
                    for index in range(2)
                ]
                results = [future.result(timeout=BENCH_TIMEOUT_S + 60) for future in futures]
            counts = [
                _minus(_by_source(server), start)
                for server, start in zip(servers, before, strict=True)
            ]
        parts = [
            self._served(result, count, warm)
            for result, count, warm in zip(results, counts, warmed, strict=True)
        ]
        ttfts: list[float] = []
        texts: list[str] = []
        for index in range(len(prompts)):
            part = parts[index % 2]
            ttfts.append(part.ttfts[index // 2])
            texts.append(part.texts[index // 2])
        return Served(
            ttfts=ttfts,
            texts=texts,
            tpot_ms=statistics.mean(part.tpot_ms for part in parts),
            wall_s=max(part.wall_s for part in parts),
            tokens={name: sum(part.tokens[name] for part in parts) for name in parts[0].tokens},
            warmup_ttfts=[ttft for part in parts for ttft in part.warmup_ttfts],
        )

    def _served(
        self, result: dict[str, Any], tokens: dict[str, float], warmup: list[float]
    ) -> Served:
        errors = [error for error in result.get("errors", []) if error]
        if errors or result.get("failed", 0):
            raise RuntimeError(f"vllm bench serve: {result.get('failed')} failed: {errors[:3]}")
        return Served(
            ttfts=[float(value) for value in result["ttfts"]],
            texts=[str(text) for text in result["generated_texts"]],
            tpot_ms=float(result["median_tpot_ms"]),
            wall_s=float(result["duration"]),
            tokens=tokens,
            warmup_ttfts=warmup,
        )

    # ---- figures -------------------------------------------------------------------------

    def _quick(self, served: Served, config: dict[str, Any]) -> BenchResult:
        docs = int(config["docs"])
        first, repeat = served.ttfts[:docs], served.ttfts[docs:]
        figure = Figure(
            name="TTFT p50, repeat asks, UCM (quick: tiny model)",
            value=statistics.median(repeat),
            unit="s",
            baseline="first asks on the same server",
            baseline_value=statistics.median(first),
            higher_is_better=False,
            extra={f"tokens_{source}": served.tokens[source] for source in SOURCES},
        )
        if served.tokens["external_kv_transfer"] <= 0:
            raise RuntimeError(f"UCM served no prompt token: {served.tokens}")
        notes = [
            "quick: one UCM server and a tiny model, to prove the machinery runs; the full "
            "run adds the no-connector baseline (every output compared), the floor and two "
            "replicas"
        ]
        return BenchResult(name=self.name, figures=[figure], notes=notes)

    def _result(self, runs: dict[str, Served], config: dict[str, Any], cpus: int) -> BenchResult:
        docs = int(config["docs"])
        baseline = runs["no connector"]

        def split(served: Served) -> tuple[list[float], list[float]]:
            return served.split(docs)

        def quantile(values: list[float], q: float) -> float:
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        figures: list[Figure] = []
        baselines = ("no connector", "2 replicas, no connector", "no connector, 2 burners")
        for system, served in runs.items():
            if system in baselines:
                continue
            base = baseline
            if system.startswith("2 "):
                base = runs["2 replicas, no connector"]
            elif system.endswith("2 burners"):
                base = runs["no connector, 2 burners"]
            base_name = next(name for name in baselines if runs.get(name) is base)
            first, repeat = split(served)
            first_b, repeat_b = split(base)
            for kind, values, values_b in (
                ("first asks", first, first_b),
                ("repeat asks", repeat, repeat_b),
            ):
                target = None
                target_ratio = None
                if system.startswith("UCM") and kind == "first asks":
                    target, target_ratio = ">= 0.95x no connector", 0.95
                figures.append(
                    Figure(
                        name=f"TTFT p50, {kind}, {system}",
                        value=statistics.median(values),
                        unit="s",
                        baseline=f"{kind}, {base_name}",
                        baseline_value=statistics.median(values_b),
                        higher_is_better=False,
                        target=target,
                        target_ratio=target_ratio,
                        extra={
                            "p90_s": quantile(values, 0.9),
                            "baseline_p90_s": quantile(values_b, 0.9),
                            "samples": float(len(values)),
                            **_round_ratios(values, values_b, served.rounds),
                        },
                    )
                )
            if served.warmup_ttfts and base.warmup_ttfts:
                figures.append(
                    Figure(
                        name=f"TTFT p50, cold start (warm-up asks), {system}",
                        value=statistics.median(served.warmup_ttfts),
                        unit="s",
                        baseline=f"warm-up asks, {base_name}",
                        baseline_value=statistics.median(base.warmup_ttfts),
                        higher_is_better=False,
                        extra={
                            "max_s": max(served.warmup_ttfts),
                            "baseline_max_s": max(base.warmup_ttfts),
                        },
                    )
                )
            figures.append(
                Figure(
                    name=f"wall time, {system}",
                    value=served.wall_s,
                    unit="s",
                    baseline=base_name,
                    baseline_value=base.wall_s,
                    higher_is_better=False,
                    extra={
                        "decode_ms_per_token": served.tpot_ms,
                        "baseline_decode_ms_per_token": base.tpot_ms,
                        **{f"tokens_{source}": served.tokens[source] for source in SOURCES},
                        **{f"baseline_tokens_{source}": base.tokens[source] for source in SOURCES},
                    },
                )
            )
        if "floor" in runs:
            _, repeat = split(runs["UCM async"])
            _, floor = split(runs["floor"])
            figures.append(
                Figure(
                    name="TTFT p50, repeat asks, UCM async",
                    value=statistics.median(repeat),
                    unit="s",
                    baseline="vLLM's prefix-cache hit (floor: KV space holds every document)",
                    baseline_value=statistics.median(floor),
                    higher_is_better=False,
                    target="within 1.3x of the floor",
                    target_ratio=1 / 1.3,
                )
            )
        if "2 replicas, UCM" in runs:
            once = docs * int(config["doc_tokens"])
            computed = runs["2 replicas, UCM"].tokens["local_compute"]
            suffixes = len(baseline.ttfts) * int(config["suffix_tokens"])
            figures.append(
                Figure(
                    name="prompt tokens computed on the node, 2 replicas, UCM",
                    value=computed,
                    unit="tokens",
                    baseline="2 replicas, no connector",
                    baseline_value=runs["2 replicas, no connector"].tokens["local_compute"],
                    higher_is_better=False,
                    extra={
                        "documents_once_plus_questions": float(once + suffixes),
                        "served_by_ucm": runs["2 replicas, UCM"].tokens["external_kv_transfer"],
                        "compute_waits": runs["2 replicas, UCM"].tokens.get("compute_waits", 0.0),
                    },
                )
            )
        kv_mib = int(config["doc_tokens"]) * _kv_bytes_per_token(config["model"]) / 2**20
        notes = [
            f"model: random Llama, {config['model']['layers']} layers, "
            f"{config['model']['kv_heads']} KV heads x {config['model']['head_dim']}, float32: "
            f"{_kv_bytes_per_token(config['model']) // 1024} KiB of KV per token; "
            f"{docs} documents of {config['doc_tokens']} tokens ({kv_mib:.0f} MiB of KV each), "
            f"{config['asks']} asks each with a {config['suffix_tokens']}-token question, "
            f"interleaved; {config['output_tokens']} output tokens; "
            f"{config['concurrency']} requests at a time; "
            f"VLLM_CPU_KVCACHE_SPACE={config['kv_gib']} GiB",
            f"every greedy output of every system equals the no-connector server's "
            f"({len(baseline.texts)} requests each)",
            f"{cpus} CPUs; every server's worker is bound with VLLM_CPU_OMP_THREADS_BIND "
            "(two replicas: one CPU each)",
            f"2 burners: {config['busy_rounds']} rounds of {config['busy_asks']} asks per "
            "document, each round with documents of its own, the two servers taking turns "
            "(order alternating); figures pool the rounds, round_<i>_ratio gives each round's",
        ]
        series = {
            system: ([0.0, 1.0], [statistics.median(split(s)[0]), statistics.median(split(s)[1])])
            for system, s in runs.items()
        }
        plots = [
            Plot(
                filename="vllm_serving_ttft.png",
                title="TTFT p50: first asks (0) and repeat asks (1)",
                xlabel="0 = first asks, 1 = repeat asks",
                ylabel="seconds (log)",
                series=series,
                kind="bar",
                logy=True,
            )
        ]
        return BenchResult(name=self.name, figures=figures, plots=plots, notes=notes)


def _round_ratios(values: list[float], baseline: list[float], rounds: int) -> dict[str, float]:
    """Per round past one: the baseline's TTFT p50 over the system's, in that round (the
    rounds' spread shows how far one round's ratio can be trusted)."""
    if rounds < 2 or len(values) != len(baseline):
        return {}
    size = len(values) // rounds
    return {
        f"round_{index}_ratio": statistics.median(baseline[start : start + size])
        / statistics.median(values[start : start + size])
        for index, start in enumerate(range(0, len(values), size))
    }


def _rounds(parts: list[Served]) -> Served:
    """One server's rounds as one :class:`Served`: its requests round after round, the tokens
    and wall time summed, decode time per token the mean of the rounds' medians."""
    return Served(
        ttfts=[ttft for part in parts for ttft in part.ttfts],
        texts=[text for part in parts for text in part.texts],
        tpot_ms=statistics.mean(part.tpot_ms for part in parts),
        wall_s=sum(part.wall_s for part in parts),
        tokens={name: sum(part.tokens[name] for part in parts) for name in parts[0].tokens},
        warmup_ttfts=parts[0].warmup_ttfts,
        rounds=len(parts),
    )


def _same_outputs(system: str, texts: list[str], reference: list[str]) -> None:
    """Raises unless ``system``'s greedy outputs equal the reference server's, request by
    request."""
    differ = [i for i, (a, b) in enumerate(zip(texts, reference, strict=False)) if a != b]
    if differ or len(texts) != len(reference):
        raise RuntimeError(
            f"{system}: greedy outputs differ from the no-connector server's at requests "
            f"{differ[:10]} (of {len(reference)}; {len(texts)} answered)"
        )


def _minus(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}


@contextlib.contextmanager
def _burners(count: int) -> Iterator[None]:
    """``count`` CPU-bound processes (``while True: pass``) for the length of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)


BENCHMARK = VllmServingBenchmark()
