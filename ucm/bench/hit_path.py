"""Hit path (issue 13): ``store.load`` of 128 MiB of Ready shards into CPU tensors, against one
torch ``copy_`` of the same 128 MiB, same source slots, same destination pages, same run.

Cases: 256 KiB and 2 MiB shards (one tensor each), and 256 KiB shards made of 32 tensors of
8 KiB. For each:

- **caller idle**: the caller submits the task and waits (targets: at least 1.2x one torch copy
  for one-tensor shards, 0.85x for 32 x 8 KiB);
- **with a pure-Python spinner thread** in the caller's process (a runtime's thread holding the
  GIL): the native queue, one torch copy under the same spinner (target 1.1x), and UCM's Python
  queue of before issue 13 (``_python_queue``: dispatcher and copier threads) beside them;
- **copy threads**: the default 4, then 1 and 2 (full mode; this machine has 2 cores);
- **dumps**: ``store.dump`` of the same bytes into resident slots, against one torch copy into
  the slots.

Also measured: the caller's cost to submit a 256-shard task (``load_data``, the call alone, as the
calling thread's CPU time; the
copies run after it returns), with the addresses as a list of lists and as one ``array('Q')``,
against the issue's 20 us bound, and the native submit alone (prepared arrays: the floor, most
of it the futex wake of the dispatcher, ~10 us on this VM).

And a vLLM worker's step: a load of Ready blocks into 32 per-layer KV tensors (8 KiB per layer
per block), through addresses (``BlockAddresses.of`` + ``load_data``, what the connector does
for a CPU KV cache) against one tensor view per layer per block (``store.load``, what it did
before): wall time of the step's load and the caller's thread CPU time, same run.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
import uuid
from array import array
from collections.abc import Callable
from functools import partial
from typing import Any

from . import BenchOptions, BenchResult, Figure, Plot

DEFAULT_COPY_THREADS = 4
"""The buffer tier's default ``copy_threads`` (the C++ UCM's default too)."""


TASK_BYTES = 128 << 20
QUICK_TASK_BYTES = 16 << 20
CASES = ((256 * 1024, 1), (2 * 1024 * 1024, 1), (256 * 1024, 32))
"""(shard bytes, tensors per shard)."""
IDLE_TARGET, MANY_TENSORS_TARGET, SPINNER_TARGET = 1.2, 0.85, 1.1
SUBMIT_SHARDS = 256
VLLM_LAYERS, VLLM_LAYER_BYTES = 32, 8 * 1024
"""The vLLM-style step: one KV tensor per layer, a block of a layer 8 KiB."""
SUBMIT_BOUND_US = 20.0


def _label(size: int) -> str:
    return f"{size // 1024} KiB" if size < (1 << 20) else f"{size >> 20} MiB"


def _case(size: int, tensors: int) -> str:
    if tensors == 1:
        return _label(size)
    return f"{_label(size)} as {tensors} x {_label(size // tensors)}"


class _Spinner:
    """A pure-Python thread that holds the GIL whenever the interpreter lets it run."""

    def __init__(self) -> None:
        self._stop = False
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        count = 0
        while not self._stop:
            count += 1

    def __enter__(self) -> _Spinner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()


def _median_s(run: Callable[[], object], rounds: int) -> float:
    run()  # warm-up
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


class HitPath:
    name = "hit_path"
    title = "Hit path: native load queue -> CPU tensors vs one torch copy_"

    def run(self, options: BenchOptions) -> BenchResult:
        quick = options.quick
        total = QUICK_TASK_BYTES if quick else TASK_BYTES
        rounds = 3 if quick else 11
        figures: list[Figure] = []
        series: dict[str, tuple[list[float], list[float]]] = {
            "native queue": ([], []),
            "native queue, spinner": ([], []),
            "Python queue (before), spinner": ([], []),
            "torch copy_": ([], []),
        }
        for size, tensors in CASES:
            options.progress(f"{_case(size, tensors)} shards, {total >> 20} MiB per task")
            m = self._measure(size, tensors, total, rounds, copy_threads=None, quick=quick)
            gb = total / 1e9
            single = tensors == 1
            target = IDLE_TARGET if single else MANY_TENSORS_TARGET
            figures.append(
                Figure(
                    name=f"load {_case(size, tensors)} hits, caller idle ({DEFAULT_COPY_THREADS} "
                    "copy threads, the default)",
                    value=gb / m["ours"],
                    unit="GB/s",
                    baseline=f"one torch copy_ of the same {total >> 20} MiB, slots -> same "
                    "destination",
                    baseline_value=gb / m["torch"],
                    target=f">= {target}x one torch copy",
                    target_ratio=target,
                    extra={"python_queue_gbps": gb / m["python"]},
                )
            )
            figures.append(
                Figure(
                    name=f"load_data {_case(size, tensors)} hits (raw addresses, one "
                    "array('Q')), caller idle",
                    value=gb / m["ours_data"],
                    unit="GB/s",
                    baseline="one torch copy_ of the same bytes",
                    baseline_value=gb / m["torch"],
                )
            )
            figures.append(
                Figure(
                    name=f"load {_case(size, tensors)} hits, pure-Python spinner thread in the "
                    "caller's process",
                    value=gb / m["ours_spin"],
                    unit="GB/s",
                    baseline="one torch copy_ of the same bytes under the same spinner",
                    baseline_value=gb / m["torch_spin"],
                    target=f">= {SPINNER_TARGET}x one torch copy" if single else None,
                    target_ratio=SPINNER_TARGET if single else None,
                )
            )
            figures.append(
                Figure(
                    name=f"load {_case(size, tensors)} hits, spinner: UCM's Python queue "
                    "(before issue 13)",
                    value=gb / m["python_spin"],
                    unit="GB/s",
                    baseline="one torch copy_ of the same bytes under the same spinner",
                    baseline_value=gb / m["torch_spin"],
                )
            )
            figures.append(
                Figure(
                    name=f"dump {_case(size, tensors)} shards into resident slots",
                    value=gb / m["dump"],
                    unit="GB/s",
                    baseline="one torch copy_ of the same bytes into the slots",
                    baseline_value=gb / m["torch_dump"],
                )
            )
            if not quick and single:
                for threads in (1, 2):
                    variant = self._measure(
                        size, tensors, total, rounds, copy_threads=threads, quick=True
                    )
                    figures.append(
                        Figure(
                            name=f"load {_case(size, tensors)} hits, caller idle, {threads} "
                            f"copy thread{'s' if threads > 1 else ''}",
                            value=gb / variant["ours"],
                            unit="GB/s",
                            baseline="one torch copy_ of the same bytes",
                            baseline_value=gb / variant["torch"],
                        )
                    )
            if "submit_lists" in m:
                forms = (
                    ("load_data task (addresses as lists)", "submit_lists"),
                    ("load_data task (addresses as one array('Q'))", "submit_array"),
                    ("task, prepared arrays: the native submit alone", "submit_native"),
                )
                for form, key in forms:
                    figures.append(
                        Figure(
                            name=f"caller's cost (thread CPU time) to submit a {SUBMIT_SHARDS}"
                            f"-shard {form}",
                            value=m[key] * 1e6,
                            unit="us",
                            baseline="the issue's bound",
                            baseline_value=SUBMIT_BOUND_US,
                            higher_is_better=False,
                            target=f"<= {SUBMIT_BOUND_US:g} us",
                            target_ratio=1.0,
                        )
                    )
            x = float(size // 1024 if single else size // 1024 + 1)
            for label, key in (
                ("native queue", "ours"),
                ("native queue, spinner", "ours_spin"),
                ("Python queue (before), spinner", "python_spin"),
                ("torch copy_", "torch"),
            ):
                series[label][0].append(x)
                series[label][1].append(gb / m[key])
        options.progress("vLLM-style step: 32 layers x 8 KiB, addresses vs tensor views")
        step = self._vllm_step(total, rounds)
        for what, key, unit, scale in (
            ("wall time of a step's load (submit + wait)", "wall", "ms", 1e3),
            ("caller's thread CPU time to build and submit a step's load", "submit", "ms", 1e3),
        ):
            figures.append(
                Figure(
                    name=f"vLLM-style step, {step['blocks']:.0f} blocks x {VLLM_LAYERS} layers "
                    f"x {_label(VLLM_LAYER_BYTES)}: {what}, through addresses (BlockAddresses + "
                    "load_data)",
                    value=step[f"addresses_{key}"] * scale,
                    unit=unit,
                    baseline="through one tensor view per layer per block (store.load)",
                    baseline_value=step[f"views_{key}"] * scale,
                    higher_is_better=False,
                )
            )
        plot = Plot(
            filename="hit_path.png",
            title=f"Hit path, {total >> 20} MiB per task",
            xlabel="shard KiB (257 = 256 KiB as 32 tensors)",
            ylabel="GB/s",
            series=series,
            kind="bar",
        )
        notes = [
            f"median of {rounds} rounds; one task of {total >> 20} MiB per round; the torch copy "
            "reads the same slot pages and writes the same destination pages",
            "the Python queue is UCM's hit path of before issue 13 (a dispatcher and a copier "
            "thread; the copier moves each run of adjacent ranges with one ctypes.memmove), "
            "rebuilt in ucm/bench/_python_queue.py from the same native Get and release",
        ]
        return BenchResult(name=self.name, figures=figures, plots=[plot], notes=notes)

    def _measure(
        self,
        size: int,
        tensors: int,
        total: int,
        rounds: int,
        *,
        copy_threads: int | None,
        quick: bool,
    ) -> dict[str, float]:
        import torch

        import ucm
        from ucm.native import segments
        from ucm.native.buffer import KeyBatch

        from ._python_queue import PythonHitQueue

        unique_id = f"bench-hit-{uuid.uuid4().hex[:10]}"
        part = size // tensors
        n = total // size
        config: dict[str, Any] = {
            "unique_id": unique_id,
            "shards_per_block": 1,
            "tiers": [
                {"type": "buffer", "capacity": n * size}
                | ({"copy_threads": copy_threads} if copy_threads else {})
            ],
        }
        if tensors == 1:
            config["shard_size"] = size
        else:
            config["tensor_size_list"] = [part] * tensors
        out: dict[str, float] = {}
        try:
            with ucm.open(config) as store:
                ids = [i.to_bytes(16, "big") for i in range(n)]
                pattern = torch.arange(total, dtype=torch.int64).to(torch.uint8)
                pieces = [
                    [
                        pattern[i * size + j * part : i * size + (j + 1) * part]
                        for j in range(tensors)
                    ]
                    for i in range(n)
                ]
                store.wait(store.dump(ids, 0, pieces))
                buffer: Any = store.tiers[0]
                addresses = slot_addresses(buffer, [(b, 0) for b in ids])
                # The dumps claimed fresh slots in order: one contiguous run of slot memory.
                assert addresses == [addresses[0] + i * size for i in range(n)]
                slots = torch.frombuffer(
                    (ctypes.c_ubyte * total).from_address(addresses[0]), dtype=torch.uint8
                )
                dst = torch.ones(total, dtype=torch.uint8)
                views = [
                    [dst[i * size + j * part : i * size + (j + 1) * part] for j in range(tensors)]
                    for i in range(n)
                ]
                targets = [[t.data_ptr() for t in shard] for shard in views]

                def ours() -> None:
                    store.wait(store.load(ids, 0, views))

                packed = array("Q", [address for shard in targets for address in shard])

                def ours_data() -> None:
                    store.wait(store.load_data(ids, 0, packed))

                def plain() -> None:
                    dst.copy_(slots)

                python = PythonHitQueue(buffer.core, buffer.bases, [part] * tensors)
                keys = KeyBatch.of([(b, 0) for b in ids])

                def before() -> None:
                    python.load(keys, targets).wait(60)

                try:
                    out["ours"] = _median_s(ours, rounds)
                    out["torch"] = _median_s(plain, rounds)
                    out["ours_data"] = _median_s(ours_data, rounds)
                    dst.zero_()
                    ours()
                    assert torch.equal(dst, pattern), "the hit path copied wrong bytes"
                    if quick and copy_threads is not None:
                        return out
                    out["python"] = _median_s(before, rounds)
                    dst.zero_()
                    before()
                    assert torch.equal(dst, pattern), "the Python baseline copied wrong bytes"
                    with _Spinner():
                        out["ours_spin"] = _median_s(ours, rounds)
                        out["torch_spin"] = _median_s(plain, rounds)
                        out["python_spin"] = _median_s(before, rounds)
                finally:
                    python.close()
                # Dumps of the same keys: Ready already, so each replaces its slot's bytes.
                out["dump"] = _median_s(lambda: store.wait(store.dump(ids, 0, pieces)), rounds)
                out["torch_dump"] = _median_s(lambda: slots.copy_(pattern), rounds)
                if size == CASES[0][0] and tensors == 1 and n >= SUBMIT_SHARDS:
                    out.update(_submit_costs(store, ids[:SUBMIT_SHARDS], targets, rounds))
        finally:
            segments.unlink(unique_id)
        return out

    def _vllm_step(self, total: int, rounds: int) -> dict[str, float]:
        """A vLLM worker's per-step load of Ready blocks into one KV tensor per layer: through
        :class:`~ucm.integration.addresses.BlockAddresses` (array arithmetic, one
        ``load_data``) against one tensor view per layer per block (``store.load``, what the
        connector passed before), same store, same blocks, same destination."""
        import torch

        import ucm
        from ucm.integration.addresses import BlockAddresses
        from ucm.native import segments

        part = VLLM_LAYER_BYTES
        n = total // (part * VLLM_LAYERS)
        kv_blocks = n + 8  # the step loads n of them, out of order
        unique_id = f"bench-vstep-{uuid.uuid4().hex[:10]}"
        config: dict[str, Any] = {
            "unique_id": unique_id,
            "tensor_size_list": [part] * VLLM_LAYERS,
            "shards_per_block": 1,
            "tiers": [{"type": "buffer", "capacity": n * part * VLLM_LAYERS}],
        }
        out: dict[str, float] = {"blocks": float(n)}
        try:
            with ucm.open(config) as store:
                ids = [i.to_bytes(16, "big") for i in range(n)]
                layers = [
                    torch.randint(0, 255, (kv_blocks, part), dtype=torch.uint8)
                    for _ in range(VLLM_LAYERS)
                ]
                blocks = [(7 * i + 3) % kv_blocks for i in range(n)]
                names = [f"layer{i}" for i in range(VLLM_LAYERS)]
                addresses = BlockAddresses(layers, [part] * VLLM_LAYERS, names, kv_blocks)
                store.wait(store.dump_data(ids, 0, addresses.of(blocks)))
                expected = [layer[blocks].clone() for layer in layers]

                def through_views() -> Any:
                    views = [[layer[b] for layer in layers] for b in blocks]
                    return store.load(ids, 0, views)

                def through_addresses() -> Any:
                    return store.load_data(ids, 0, addresses.of(blocks))

                for name, submit in (("views", through_views), ("addresses", through_addresses)):
                    for layer in layers:
                        layer.zero_()
                    out[f"{name}_wall"] = _median_s(partial(_run_step, store, submit), rounds)
                    for layer, want in zip(layers, expected, strict=True):
                        assert torch.equal(layer[blocks], want), f"{name} loaded wrong bytes"
                    samples = []
                    for _ in range(max(10, rounds)):
                        started = time.thread_time()
                        task = submit()
                        samples.append(time.thread_time() - started)
                        store.wait(task)
                    out[f"{name}_submit"] = statistics.median(samples)
        finally:
            segments.unlink(unique_id)
        return out


def _run_step(store: Any, submit: Callable[[], Any]) -> None:
    store.wait(submit())


def _submit_costs(
    store: Any, ids: list[bytes], targets: list[list[int]], rounds: int
) -> dict[str, float]:
    """CPU seconds the caller's thread spends in ``load_data`` for a task of ``len(ids)`` hits
    (median). CPU time, not wall time: on 2 cores the copy threads the call wakes take both
    CPUs at once, and the caller's thread may then wait a time slice to run its last
    microseconds, which is no cost of the call."""
    lists = targets[: len(ids)]
    packed = array("Q", [t[0] for t in lists])
    costs: dict[str, float] = {}
    for key, form in (("submit_lists", lists), ("submit_array", packed)):
        samples = []
        for _ in range(max(20, rounds * 5)):
            started = time.thread_time()
            task = store.load_data(ids, 0, form)
            samples.append(time.thread_time() - started)
            store.wait(task)
        costs[key] = statistics.median(samples)
    from ucm.native.queue import TaskKind

    queue = store.tiers[0].queue
    keys = b"".join(ids)
    shards = array("I", [0]) * len(ids)
    samples = []
    for _ in range(max(20, rounds * 5)):
        results = bytearray(len(ids))
        started = time.thread_time()
        token = queue.submit(TaskKind.LOAD, keys, shards, packed, results)
        samples.append(time.thread_time() - started)
        queue.wait(token, None)  # (keys, shards, packed and results outlive the task)
    costs["submit_native"] = statistics.median(samples)
    return costs


def slot_addresses(buffer: Any, keys: list[tuple[bytes, int]]) -> list[int]:
    """Where Ready keys' bytes live in this process (for baselines that copy them directly)."""
    slots = buffer.core.ready_slots(keys)
    return [buffer.bases[segment] + offset for segment, offset in buffer.core.slot_locations(slots)]


BENCHMARK = HitPath()
