"""Hit path (issue 4): buffer -> CPU torch tensors through ``store.load``, batches of 256 shards
of 256 KiB and of 2 MiB, against plain memcpy of the same bytes (target >= 85%); and 256 KiB
shards made of 32 tensors of 8 KiB, where the baseline pays one call per tensor.

Measured: four load tasks of 256 Ready shards each in flight (the way a runtime streams layers:
two disjoint key sets, two sets of resident destination tensors, alternating), from the first
submission to the last ``wait`` returning: argument checks, the dispatcher's batched Get, the
copier's memmoves and the releases. Baseline, same run:
``ctypes.memmove`` of every shard from its slot to the same destinations, in a Python loop (the
same bytes, the same source and destination pages, nothing else).

Dumps, same run and stack: ``store.dump`` of one task of 256 fresh keys per round (the buffer is
full by then, so each dump also evicts), from the first submission to ``wait`` returning,
against ``ctypes.memmove`` of the same bytes from the same tensors into buffer slots.
"""

from __future__ import annotations

import ctypes
import statistics
import time
import uuid
from typing import Any

from . import BenchOptions, BenchResult, Figure, Plot

BATCH = 256
CASES = ((256 * 1024, 1), (2 * 1024 * 1024, 1), (256 * 1024, 32))
"""(shard bytes, tensors per shard). The issue's target is on the one-tensor shards; a shard
split into many small tensors (K and V of several layers) shows the per-tensor cost."""
TARGET_RATIO = 0.85
IN_FLIGHT = 4


def _label(size: int) -> str:
    return f"{size // 1024} KiB" if size < (1 << 20) else f"{size >> 20} MiB"


def _case(size: int, tensors: int) -> str:
    if tensors == 1:
        return _label(size)
    return f"{_label(size)} as {tensors} x {_label(size // tensors)}"


class HitPath:
    name = "hit_path"
    title = "Hit path: CacheBuffer -> CPU torch tensors vs plain memcpy"

    def run(self, options: BenchOptions) -> BenchResult:
        rounds = 3 if options.quick else 15
        figures, notes = [], []
        ucm_series: tuple[list[float], list[float]] = ([], [])
        memcpy_series: tuple[list[float], list[float]] = ([], [])
        for size, tensors in CASES:
            options.progress(f"{BATCH} x {_case(size, tensors)}")
            ours, plain, dumped, dump_plain = self._measure(size, tensors, rounds)
            single = tensors == 1
            figures.append(
                Figure(
                    name=f"load {BATCH} hits x {_case(size, tensors)} "
                    f"({IN_FLIGHT} tasks in flight)",
                    value=ours,
                    unit="GB/s",
                    baseline="ctypes.memmove of the same bytes, slot -> same tensors"
                    + ("" if single else " (one call per tensor)"),
                    baseline_value=plain,
                    target=f">= {TARGET_RATIO:.0%} of memcpy" if single else None,
                    target_ratio=TARGET_RATIO if single else None,
                )
            )
            figures.append(
                Figure(
                    name=f"dump {BATCH} fresh shards x {_case(size, tensors)} into the buffer",
                    value=dumped,
                    unit="GB/s",
                    baseline="ctypes.memmove of the same bytes, tensors -> slots"
                    + ("" if single else " (one call per tensor)"),
                    baseline_value=dump_plain,
                )
            )
            if single:
                for series, value in ((ucm_series, ours), (memcpy_series, plain)):
                    series[0].append(size / 1024)
                    series[1].append(value)
        notes.append(f"median of {rounds} rounds; {IN_FLIGHT} x {BATCH} shards per round")
        plot = Plot(
            filename="hit_path.png",
            title="Hit path bandwidth",
            xlabel="shard size (KiB)",
            ylabel="GB/s",
            series={"store.load": ucm_series, "memcpy": memcpy_series},
            kind="bar",
        )
        return BenchResult(name=self.name, figures=figures, plots=[plot], notes=notes)

    def _measure(self, size: int, tensors: int, rounds: int) -> tuple[float, float, float, float]:
        import torch

        import ucm
        from ucm.native import segments

        unique_id = f"bench-hit-{uuid.uuid4().hex[:10]}"
        part = size // tensors
        config: dict[str, Any] = {
            "unique_id": unique_id,
            "shards_per_block": 1,
            "tiers": [{"type": "buffer", "capacity": (2 * BATCH + 1) * size}],
        }
        if tensors == 1:
            config["shard_size"] = size
        else:
            config["tensor_size_list"] = [part] * tensors
        try:
            with ucm.open(config) as store:
                sets = [[(k * BATCH + i).to_bytes(16, "big") for i in range(BATCH)] for k in (0, 1)]
                pattern = torch.arange(size, dtype=torch.int64).to(torch.uint8)
                pieces = [pattern[i * part : (i + 1) * part] for i in range(tensors)]
                for ids in sets:
                    store.wait(store.dump(ids, 0, [pieces for _ in ids]))
                dsts = [
                    [[torch.ones(part, dtype=torch.uint8) for _ in range(tensors)] for _ in ids]
                    for ids in sets
                ]
                buffer: Any = store.tiers[0]
                addresses = []
                for ids in sets:
                    addresses.append(slot_addresses(buffer, [(b, 0) for b in ids]))
                targets = [[[t.data_ptr() for t in shard] for shard in dst] for dst in dsts]
                ours, plain = [], []
                for round_index in range(rounds + 1):
                    for dst in dsts:
                        for shard in dst:
                            for tensor in shard:
                                tensor.zero_()
                    started = time.perf_counter()
                    tasks = [
                        store.load(ids, 0, dst)
                        for _ in range(IN_FLIGHT // 2)
                        for ids, dst in zip(sets, dsts, strict=True)
                    ]
                    for task in tasks:
                        store.wait(task)
                    elapsed = time.perf_counter() - started
                    if round_index == 0:
                        assert all(
                            torch.equal(torch.cat(shard), pattern) for dst in dsts for shard in dst
                        )
                        continue  # warm-up
                    ours.append(elapsed)
                    for dst in dsts:
                        for shard in dst:
                            for tensor in shard:
                                tensor.zero_()
                    memmove = ctypes.memmove
                    started = time.perf_counter()
                    for _ in range(IN_FLIGHT // 2):
                        for set_targets, slots in zip(targets, addresses, strict=True):
                            for shard_targets, address in zip(set_targets, slots, strict=True):
                                for target in shard_targets:
                                    memmove(target, address, part)
                                    address += part
                    plain.append(time.perf_counter() - started)
                dumps, dump_plain = self._measure_dumps(store, pieces, addresses[0], rounds)
        finally:
            segments.unlink(unique_id)
        moved = IN_FLIGHT * BATCH * size / 1e9
        dump_moved = BATCH * size / 1e9
        return (
            moved / statistics.median(ours),
            moved / statistics.median(plain),
            dump_moved / statistics.median(dumps),
            dump_moved / statistics.median(dump_plain),
        )

    @staticmethod
    def _measure_dumps(
        store: Any, pieces: list[Any], slots: list[int], rounds: int
    ) -> tuple[list[float], list[float]]:
        """Seconds per dump of BATCH fresh keys, and per memmove of the same bytes into slots."""
        sources = [[piece.clone() for piece in pieces] for _ in range(BATCH)]
        pointers = [[(t.data_ptr(), t.nbytes) for t in shard] for shard in sources]
        ours: list[float] = []
        plain: list[float] = []
        for round_index in range(rounds + 1):
            first = (round_index + 2) * BATCH  # after the two load sets: never dumped before
            ids = [(first + i).to_bytes(16, "big") for i in range(BATCH)]
            started = time.perf_counter()
            store.wait(store.dump(ids, 0, sources))
            elapsed = time.perf_counter() - started
            memmove = ctypes.memmove
            started = time.perf_counter()
            # Into slots that now hold some dumped key: every key here has the same bytes, so
            # the baseline rewrites what is already there.
            for shard, address in zip(pointers, slots, strict=True):
                for pointer, nbytes in shard:
                    memmove(address, pointer, nbytes)
                    address += nbytes
            if round_index:  # the first is a warm-up
                plain.append(time.perf_counter() - started)
                ours.append(elapsed)
        return ours, plain


def slot_addresses(buffer: Any, keys: list[tuple[bytes, int]]) -> list[int]:
    """Where Ready keys' bytes live in this process (for baselines that copy them directly)."""
    slots = [buffer.core.slot_of(key) for key in keys]
    assert all(slot is not None for slot in slots), "a key is not in the buffer"
    return [
        buffer.bases[segment] + offset
        for segment, offset in buffer.core.slot_locations([s for s in slots if s is not None])
    ]


BENCHMARK = HitPath()
