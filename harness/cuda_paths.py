"""UCM's CUDA paths on a real GPU (issue 21; a documented script, not a test: it reports
figures and checks bytes, and exits non-zero when a byte differs). Results are in
docs/benchmarks.md. Needs torch with CUDA and a GPU; nothing else of an engine.

A stack of one CacheBuffer; each block is one shard of ``--layers`` tensors of
``--tensor-kib`` KiB (a vLLM block of a real model: 32 layers of 64 KiB is 16 tokens of an
8-KV-head, 128-dim bf16 model, K and V). ``--blocks`` blocks of random bytes on the GPU, in
tasks of ``--task-blocks``:

- **dump**: ``store.dump`` from the GPU tensors (the pinned staging ring: device-to-host copies
  on a side stream, one CUDA event per task, never a device-wide synchronize) into the buffer,
  each task waited for; beside it, the baseline: the same tensors copied one by one into a
  pinned host tensor (``non_blocking``), one ``torch.cuda.synchronize()`` per task.
- **load**: ``store.load`` into zeroed GPU tensors, every shard a buffer hit (host-to-device
  copies straight from the buffer's memory, registered with ``cudaHostRegister`` chunk by
  chunk as the loaders first touch it): a cold pass (registering as it goes), then a warm one
  (the time its ``store.load`` calls take to return is reported too); beside it, the baseline:
  the same tensors copied one by one from a pinned host tensor, one synchronize per task.
- **the copy mechanism alone**: the staging ring's copies of one task's shards, both ways,
  batched (``cudaMemcpyBatchAsync``, ``ucm.cudart``) against one torch copy per tensor, in
  the same process on the same tensors.
- **first load**: on a new store, the time ``store.load`` of one block takes to return to the
  caller and to complete, and how many bytes of the buffer are registered after it (the
  registration must never pin the whole buffer on the caller's thread).

Every loaded tensor is compared with its source on the GPU (``torch.equal``). Figures are per
pass, and their median over ``--repeats`` passes; each ratio is UCM's throughput over its
baseline's in the same pass. One JSON object is printed and, with ``--out``, written there.

    PYTHONPATH=$PWD:$PWD/backends python -m harness.cuda_paths [--out cuda.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from typing import Any


def _stack(unique_id: str, layers: int, tensor_bytes: int, capacity: int) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "tensor_size_list": [tensor_bytes] * layers,
        "shards_per_block": 1,
        "tiers": [{"type": "buffer", "capacity": capacity}],
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tensor-kib", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--task-blocks", type=int, default=64)
    parser.add_argument("--capacity", default="4GiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print where the caller's thread spends its store.load/store.dump calls "
        "(cProfile of one more warm pass, top 15 by own time)",
    )
    args = parser.parse_args()

    import torch

    import ucm
    from ucm.native import segments
    from ucm.sizes import parse_size

    if not torch.cuda.is_available():
        print("harness.cuda_paths needs a CUDA GPU: torch.cuda.is_available() is False")
        return 2
    tensor_bytes = args.tensor_kib * 1024
    shard_bytes = tensor_bytes * args.layers
    capacity = parse_size(args.capacity)
    device = torch.device("cuda", 0)
    generator = torch.Generator(device=device).manual_seed(0)
    source = [
        [
            torch.randint(
                0, 256, (tensor_bytes,), dtype=torch.uint8, device=device, generator=generator
            )
            for _ in range(args.layers)
        ]
        for _ in range(args.blocks)
    ]
    ids = [uuid.uuid4().bytes for _ in range(args.blocks)]
    tasks = [
        range(start, min(start + args.task_blocks, args.blocks))
        for start in range(0, args.blocks, args.task_blocks)
    ]
    total_bytes = shard_bytes * args.blocks
    pinned = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=True)

    def baseline(to_host: bool) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        offset = 0
        for task in tasks:
            for i in task:
                for tensor in source[i]:
                    host = pinned[offset : offset + tensor_bytes]
                    if to_host:
                        host.copy_(tensor, non_blocking=True)
                    else:
                        tensor.copy_(host, non_blocking=True)
                    offset += tensor_bytes
            torch.cuda.synchronize()
        return time.perf_counter() - started

    def timed_tasks(store: Any, call: Any, memory: list[list[Any]]) -> tuple[float, float]:
        """``call`` (``store.dump`` or ``store.load``) of every task, each waited for: the
        seconds in all, and the seconds the calls took to return to the caller."""
        torch.cuda.synchronize()
        submit = 0.0
        started = time.perf_counter()
        for task in tasks:
            submitted = time.perf_counter()
            pending = call([ids[i] for i in task], 0, [memory[i] for i in task])
            submit += time.perf_counter() - submitted
            store.wait(pending)
        return time.perf_counter() - started, submit

    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "layers": args.layers,
        "tensor_bytes": tensor_bytes,
        "blocks": args.blocks,
        "task_blocks": args.task_blocks,
        "capacity_bytes": capacity,
        "passes": [],
    }
    mismatches = 0
    for _ in range(args.repeats):
        unique_id = f"cuda-paths-{uuid.uuid4().hex[:10]}"
        try:
            with ucm.open(
                _stack(unique_id, args.layers, tensor_bytes, capacity), device_id=0
            ) as store:
                base_dump = baseline(to_host=True)
                ucm_dump, dump_submit = timed_tasks(store, store.dump, source)
                targets = [
                    [
                        torch.zeros(tensor_bytes, dtype=torch.uint8, device=device)
                        for _ in range(args.layers)
                    ]
                    for _ in range(args.blocks)
                ]
                cold_load, _ = timed_tasks(store, store.load, targets)
                for tensors in targets:
                    for tensor in tensors:
                        tensor.zero_()
                ucm_load, submit = timed_tasks(store, store.load, targets)
                # The baseline overwrites the sources with the pinned bytes (the same bytes:
                # the dump baseline copied them there).
                base_load = baseline(to_host=False)
                for got, want in zip(targets, source, strict=True):
                    mismatches += sum(not torch.equal(g, w) for g, w in zip(got, want, strict=True))
                stats = store.stats()
                native = store._native  # the load path: its CUDA copier, once enabled
                cuda = native._cuda if native is not None else None
                result["passes"].append(
                    {
                        "dump_gbps": total_bytes / ucm_dump / 1e9,
                        "dump_baseline_gbps": total_bytes / base_dump / 1e9,
                        "dump_ratio": base_dump / ucm_dump,
                        "dump_submit_s": dump_submit,
                        "load_gbps": total_bytes / ucm_load / 1e9,
                        "load_baseline_gbps": total_bytes / base_load / 1e9,
                        "load_ratio": base_load / ucm_load,
                        "load_submit_s": submit,
                        "cold_load_gbps": total_bytes / cold_load / 1e9,
                        "cold_load_ratio": base_load / cold_load,
                        "hits": stats["hits"],
                        "registered_bytes": len(cuda._registered) * cuda._chunk_bytes
                        if cuda is not None
                        else 0,
                        "cuda_register_failures": stats.get("cuda_register_failures", 0),
                    }
                )
        finally:
            segments.unlink(unique_id)
    # The first load of a new store: one block, its buffer memory registered on first use.
    unique_id = f"cuda-paths-{uuid.uuid4().hex[:10]}"
    try:
        with ucm.open(_stack(unique_id, args.layers, tensor_bytes, capacity), device_id=0) as store:
            store.wait(store.dump([ids[0]], 0, [source[0]]))
            target = [
                torch.zeros(tensor_bytes, dtype=torch.uint8, device=device)
                for _ in range(args.layers)
            ]
            torch.cuda.synchronize()
            started = time.perf_counter()
            pending = store.load([ids[0]], 0, [target])
            returned = time.perf_counter() - started
            store.wait(pending)
            completed = time.perf_counter() - started
            mismatches += sum(not torch.equal(g, w) for g, w in zip(target, source[0], strict=True))
            native = store._native
            cuda = native._cuda if native is not None else None
            result["first_load"] = {
                "returned_s": returned,
                "completed_s": completed,
                "registered_bytes": len(cuda._registered) * cuda._chunk_bytes
                if cuda is not None
                else 0,
                "direct": cuda is not None,
            }
    finally:
        segments.unlink(unique_id)
    # The copy mechanism alone, same pass, same tensors: the staging ring's device-to-host and
    # host-to-device copies of one task (its shards' slots), batched (cudaMemcpyBatchAsync,
    # where the runtime has it) against one torch copy per tensor.
    from ucm.staging import cuda_staging

    staging = cuda_staging(shard_bytes)
    task_blocks = list(tasks[0])
    held = staging.ring.acquire(len(task_blocks))
    try:
        pairs: list[tuple[Any, Any]] = []
        for i, slot in zip(task_blocks, held, strict=True):
            host = staging.slot(slot)
            pairs.extend(
                (tensor, host[j * tensor_bytes : (j + 1) * tensor_bytes])
                for j, tensor in enumerate(source[i])
            )
        task_bytes = shard_bytes * len(task_blocks)
        batch = staging.batch
        mechanism: dict[str, Any] = {"batched": batch is not None, "copies": len(pairs)}
        for direction in ("to_host", "to_device"):
            for label, copier in (("batched", batch), ("per_tensor", None)):
                staging.batch = copier
                if label == "batched" and copier is None:
                    continue
                copy = getattr(staging, direction)
                copy(pairs)  # warm
                started = time.perf_counter()
                for _ in range(8):
                    copy(pairs)
                mechanism[f"{direction}_{label}_gbps"] = (
                    8 * task_bytes / (time.perf_counter() - started) / 1e9
                )
            staging.batch = batch
            if batch is not None:
                mechanism[f"{direction}_ratio"] = (
                    mechanism[f"{direction}_batched_gbps"]
                    / mechanism[f"{direction}_per_tensor_gbps"]
                )
        for tensor, host in pairs:  # the round trips kept every byte
            mismatches += int(not torch.equal(tensor.cpu().view(-1), host))
        result["mechanism"] = mechanism
    finally:
        staging.batch = batch
        staging.ring.release(held)
    if args.profile:
        import cProfile
        import pstats

        unique_id = f"cuda-paths-{uuid.uuid4().hex[:10]}"
        try:
            with ucm.open(
                _stack(unique_id, args.layers, tensor_bytes, capacity), device_id=0
            ) as store:
                for task in tasks:
                    store.wait(store.dump([ids[i] for i in task], 0, [source[i] for i in task]))
                targets = [
                    [
                        torch.zeros(tensor_bytes, dtype=torch.uint8, device=device)
                        for _ in range(args.layers)
                    ]
                    for _ in range(args.blocks)
                ]
                for task in tasks:  # registers the memory
                    store.wait(store.load([ids[i] for i in task], 0, [targets[i] for i in task]))
                for kind in ("load", "dump"):
                    profile = cProfile.Profile()
                    for task in tasks:
                        blocks = [ids[i] for i in task]
                        memory = [(targets if kind == "load" else source)[i] for i in task]
                        profile.enable()
                        call = store.load if kind == "load" else store.dump
                        pending = call(blocks, 0, memory)
                        profile.disable()
                        store.wait(pending)
                    print(f"--- the caller's thread in store.{kind}", file=sys.stderr)
                    pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(15)
        finally:
            segments.unlink(unique_id)
    passes = result["passes"]
    result["median"] = {
        key: statistics.median(p[key] for p in passes)
        for key in (
            "dump_gbps",
            "dump_baseline_gbps",
            "dump_ratio",
            "dump_submit_s",
            "load_gbps",
            "load_baseline_gbps",
            "load_ratio",
            "load_submit_s",
            "cold_load_gbps",
            "cold_load_ratio",
        )
    }
    result["mismatched_tensors"] = mismatches
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
