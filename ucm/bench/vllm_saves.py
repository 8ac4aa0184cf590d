"""vLLM's saves without a CacheBuffer (issue 21): *staged* saves (the worker's saving thread
copies the step's blocks into private staging memory, one native call, then dumps that memory)
against the dumps straight from vLLM's blocks that they replaced (``WorkerSide(stage_saves=
False)``), on one posix tier, in the same run.

No engine: the connector's worker side (``ucm.integration.vllm.worker.WorkerSide``) over a CPU
KV cache registered through addresses, as the connector registers vLLM's (full run: 8 layers of
256 KiB per block, 16 tokens of the model of ``vllm_serving``; 8 new blocks saved per step, the
step's request released the same step). Two passes per system, each on a fresh stack:

- **saves**: 24 steps of saves. Figures: the save hook's return time (``wait_for_save``, p50
  and max over the steps) and the time until every save is stored (from the first hook to the
  last dump done: what the staging copy costs the throughput).
- **preemptions**: each step's request is preempted right after its save was submitted, and
  ``handle_preemptions`` (what runs before the forward pass that may overwrite its blocks) is
  timed: a staged save waits for its copy into staging memory, a direct one for the tier's
  write. The benchmark then overwrites the blocks, as vLLM would.

Every stored block is loaded back and compared with the bytes the step saved (after the
preemption pass, with bytes the blocks no longer hold). No target: the issue asks that saves
never block the forward pass; these figures are what that costs and saves.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid
from typing import Any

from . import BenchOptions, BenchResult, Figure, Plot, not_installed

FULL = {"layers": 8, "layer_bytes": 256 * 1024, "per_step": 8, "steps": 24}
QUICK = {"layers": 4, "layer_bytes": 32 * 1024, "per_step": 4, "steps": 6}
DONE_BOUND_S = 300.0
"""Longest a pass waits for its saves to be stored: a hang fails the benchmark."""


def _pass(
    root: str,
    staged: bool,
    preempt: bool,
    geometry: dict[str, int],
    original: Any,
) -> dict[str, Any]:
    """One pass on a fresh stack over ``root``: per-step hook (and preemption) times in
    seconds, the time until every save was stored, and the bytes checked."""
    import torch

    import ucm
    from ucm.integration.addresses import BlockAddresses
    from ucm.integration.vllm.metadata import BlockTransfer, UcmConnectorMetadata
    from ucm.integration.vllm.worker import WorkerSide

    layers, layer_bytes = geometry["layers"], geometry["layer_bytes"]
    per_step, steps = geometry["per_step"], geometry["steps"]
    blocks = per_step * steps
    stack = {
        "unique_id": f"bench-saves-{uuid.uuid4().hex[:10]}",
        "tensor_size_list": [layer_bytes] * layers,
        "shards_per_block": 1,
        "tiers": [{"type": "posix", "path": root}],
    }
    kv = original.clone()  # [layer][block] bytes: vLLM's KV cache of this pass
    views = [kv[layer] for layer in range(layers)]
    addresses = BlockAddresses(
        views, [layer_bytes] * layers, [f"layer.{n}" for n in range(layers)], blocks
    )
    ids = [uuid.uuid4().bytes for _ in range(blocks)]
    hooks: list[float] = []
    waits: list[float] = []
    with ucm.open(stack, device_id=0) as store:
        worker = WorkerSide(store, rank=0, shard_size=layers * layer_bytes, stage_saves=staged)
        worker.set_block_views(views, addresses)
        started = time.perf_counter()
        for step in range(steps):
            part = list(range(step * per_step, (step + 1) * per_step))
            request = f"r{step}"
            saves = [BlockTransfer(request, part, [ids[b] for b in part])]
            worker.bind(UcmConnectorMetadata(saves=saves, released={request}))
            began = time.perf_counter()
            worker.submit_saves()
            hooks.append(time.perf_counter() - began)
            if preempt:
                meta = UcmConnectorMetadata(preempted={request})
                began = time.perf_counter()
                worker.handle_preemptions(meta)
                waits.append(time.perf_counter() - began)
                kv[:, part[0] : part[-1] + 1].fill_(0xA5)  # vLLM reuses the freed blocks
        finished: set[str] = set()
        deadline = time.monotonic() + DONE_BOUND_S
        while worker.stats.data["saved_blocks"] + worker.stats.data["save_failed_blocks"] < blocks:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{'staged' if staged else 'direct'} saves not stored within "
                    f"{DONE_BOUND_S:.0f} s: {dict(worker.stats.data)}"
                )
            finished |= worker.get_finished()
            time.sleep(0.001)
        stored_s = time.perf_counter() - started
        finished |= worker.get_finished()
        failed = worker.stats.data["save_failed_blocks"]
        if failed or finished != {f"r{step}" for step in range(steps)}:
            raise RuntimeError(
                f"{'staged' if staged else 'direct'} saves on a healthy posix tier: {failed} "
                f"blocks failed, requests reported {sorted(finished)}"
            )
        back = torch.zeros_like(original)
        store.wait(
            store.load_data(
                ids,
                0,
                BlockAddresses(
                    [back[layer] for layer in range(layers)],
                    [layer_bytes] * layers,
                    [f"layer.{n}" for n in range(layers)],
                    blocks,
                ).of(list(range(blocks))),
            ),
            timeout_s=DONE_BOUND_S,
        )
        if not torch.equal(back, original):
            raise AssertionError(
                f"{'staged' if staged else 'direct'} saves stored bytes the steps did not save"
            )
        worker.close()
    return {"hooks": hooks, "waits": waits, "stored_s": stored_s, "bytes": original.numel()}


def _per_step(
    what: str, staged: list[float], direct: list[float], baseline: str, step_mib: float
) -> list[Figure]:
    """The p50 and the max over the steps of ``what`` (seconds per step), staged against
    ``baseline``, in ms."""
    return [
        Figure(
            name=f"{what}, {quantile} of the steps",
            value=pick(staged) * 1000,
            unit="ms",
            baseline=baseline,
            baseline_value=pick(direct) * 1000,
            higher_is_better=False,
            extra={"step_mib": step_mib, "steps": float(len(staged))},
        )
        for quantile, pick in (("p50", statistics.median), ("max", max))
    ]


class VllmSaves:
    name = "vllm_saves"
    title = (
        "vLLM saves without a CacheBuffer: staged through a copy vs straight from vLLM's "
        "blocks (posix)"
    )

    def run(self, options: BenchOptions) -> BenchResult:
        absent = not_installed(self.name, ("vllm", "torch"), "ms")
        if absent is not None:
            return absent
        import torch

        geometry = QUICK if options.quick else FULL
        blocks = geometry["per_step"] * geometry["steps"]
        original = torch.randint(
            0, 256, (geometry["layers"], blocks, geometry["layer_bytes"]), dtype=torch.uint8
        )
        results: dict[tuple[str, str], dict[str, Any]] = {}
        with tempfile.TemporaryDirectory(prefix="ucm-saves-", dir=options.workdir) as root:
            for pass_name in ("saves", "preemptions"):
                order = ("direct", "staged") * (1 if options.quick else 2)  # interleaved
                for system in order:
                    options.progress(f"{pass_name}: {system}")
                    result = _pass(
                        os.path.join(root, uuid.uuid4().hex[:8]),
                        staged=system == "staged",
                        preempt=pass_name == "preemptions",
                        geometry=geometry,
                        original=original,
                    )
                    kept = results.setdefault((pass_name, system), {"hooks": [], "waits": []})
                    kept["hooks"] += result["hooks"]
                    kept["waits"] += result["waits"]
                    kept.setdefault("stored_s", []).append(result["stored_s"])
        step_mib = geometry["per_step"] * geometry["layers"] * geometry["layer_bytes"] / 2**20
        figures: list[Figure] = []
        figures += _per_step(
            "save hook (wait_for_save) return",
            results["saves", "staged"]["hooks"],
            results["saves", "direct"]["hooks"],
            "dumps straight from vLLM's blocks",
            step_mib,
        )
        staged, direct = results["saves", "staged"], results["saves", "direct"]
        total_mib = step_mib * geometry["steps"]
        figures.append(
            Figure(
                name=f"every save stored ({blocks} blocks, {total_mib:.0f} MiB), median of runs",
                value=statistics.median(staged["stored_s"]) * 1000,
                unit="ms",
                baseline="dumps straight from vLLM's blocks",
                baseline_value=statistics.median(direct["stored_s"]) * 1000,
                higher_is_better=False,
            )
        )
        figures += _per_step(
            "preemption wait before the forward pass",
            results["preemptions", "staged"]["waits"],
            results["preemptions", "direct"]["waits"],
            "dumps straight from vLLM's blocks (the tier's write)",
            step_mib,
        )
        series: dict[str, tuple[list[float], list[float]]] = {}
        for system in ("direct", "staged"):
            xs, ys = series.setdefault(system, ([], []))
            for x, (pass_name, key) in enumerate((("saves", "hooks"), ("preemptions", "waits"))):
                xs.append(float(x))
                ys.append(statistics.median(results[pass_name, system][key]) * 1000)
        plot = Plot(
            filename="vllm_saves",
            title="vLLM saves without a CacheBuffer: 0 = save hook, 1 = preemption wait (p50)",
            xlabel="0: wait_for_save, 1: handle_preemptions",
            ylabel="ms",
            series=series,
            kind="bar",
        )
        return BenchResult(
            name=self.name,
            figures=figures,
            plots=[plot],
            notes=[
                "each system ran twice per pass, interleaved, each run on a fresh posix "
                "directory; every stored block was loaded back and compared"
            ],
        )


BENCHMARK = VllmSaves()
