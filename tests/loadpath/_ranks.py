"""Rank processes for the multi-rank tests (spawned: everything here is importable)."""

from __future__ import annotations

import traceback
from typing import Any

import torch

import ucm
from ucm.errors import TaskError

from . import _tiers

SHARD = 4096
TIMEOUT_S = 90


def _dst(n: int) -> list[list[torch.Tensor]]:
    return [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in range(n)]


def _exact(blocks: list[bytes], shard: int, dst: list[list[torch.Tensor]]) -> bool:
    return all(
        d[0].numpy().tobytes() == _tiers.payload(b, shard, SHARD)
        for b, d in zip(blocks, dst, strict=True)
    )


def worker(
    rank: int, ranks: int, config: dict[str, Any], plan: dict[str, Any], barrier: Any, out: Any
) -> None:
    """One worker rank: (1) cold load of the shared blocks, (2) one rank dumps new blocks,
    everyone looks them up, (3) a load where one key fails below."""
    _tiers.register()  # the test tiers exist in this process too
    report: dict[str, Any] = {"rank": rank}
    try:
        with ucm.open(config, device_id=rank, local_rank_size=ranks) as store:
            cold = [bytes.fromhex(h) for h in plan["cold"]]
            dst = _dst(len(cold))
            barrier.wait(timeout=TIMEOUT_S)
            store.wait(store.load(cold, 1, dst))
            report["cold_exact"] = _exact(cold, 1, dst)
            stats = store.stats()
            report["cold_owned"] = stats["tiers"][0]["owned"]
            report["cold_reads"] = stats["tiers"][1]["hits"]
            report["cold_hits"] = stats["hits"]
            barrier.wait(timeout=TIMEOUT_S)

            fresh = [bytes.fromhex(h) for h in plan["fresh"]]
            if rank == plan["dumper"]:
                for shard in range(config["shards_per_block"]):
                    src = [
                        [
                            torch.frombuffer(
                                bytearray(_tiers.payload(b, shard, SHARD)), dtype=torch.uint8
                            )
                        ]
                        for b in fresh
                    ]
                    store.wait(store.dump(fresh, shard, src))
            barrier.wait(timeout=TIMEOUT_S)
            report["fresh_lookup"] = store.lookup(fresh)
            holed = [bytes.fromhex(h) for h in plan["holed"]]
            report["prefix"] = store.lookup_on_prefix(holed)
            dst = _dst(len(fresh))
            store.wait(store.load(fresh, 0, dst))
            report["fresh_exact"] = _exact(fresh, 0, dst)
            barrier.wait(timeout=TIMEOUT_S)

            faulty = [bytes.fromhex(h) for h in plan["faulty"]]
            dst = _dst(len(faulty))
            task = store.load(faulty, 1, dst)
            try:
                store.wait(task)
                report["failed"] = {}
            except TaskError as exc:
                report["failed"] = {f"{b.hex()}:{s}": repr(c) for (b, s), c in exc.failures.items()}
            bad = {h.split(":")[0] for h in report["failed"]}
            good = [b for b in faulty if b.hex() not in bad]
            good_dst = [d for b, d in zip(faulty, dst, strict=True) if b.hex() not in bad]
            report["faulty_others_exact"] = _exact(good, 1, good_dst)
            report["injected"] = store.stats()["tiers"][1]["injected"]
            barrier.wait(timeout=TIMEOUT_S)  # keep the buffer mapped until everyone is done
    except Exception:
        report["error"] = traceback.format_exc()
        barrier.abort()
    out.put(report)


def scheduler(
    ranks: int, config: dict[str, Any], plan: dict[str, Any], barrier: Any, out: Any
) -> None:
    """The scheduler role: control plane only, answers lookups."""
    _tiers.register()
    report: dict[str, Any] = {"rank": -1}
    try:
        with ucm.open(config, device_id=-1, local_rank_size=ranks) as store:
            barrier.wait(timeout=TIMEOUT_S)  # cold load starts
            barrier.wait(timeout=TIMEOUT_S)  # cold load done
            barrier.wait(timeout=TIMEOUT_S)  # dump done
            fresh = [bytes.fromhex(h) for h in plan["fresh"]]
            report["fresh_lookup"] = store.lookup(fresh)
            report["prefix"] = store.lookup_on_prefix([bytes.fromhex(h) for h in plan["holed"]])
            report["fresh_in_buffer"] = store.tiers[0].lookup_blocks(fresh)
            barrier.wait(timeout=TIMEOUT_S)
            barrier.wait(timeout=TIMEOUT_S)
    except Exception:
        report["error"] = traceback.format_exc()
        barrier.abort()
    out.put(report)


def failing_owner(config: dict[str, Any], key_hex: str, out: Any) -> None:
    """Claims one key and fails to load it (the tier below is slow, then fails)."""
    _tiers.register()
    try:
        with ucm.open(config, device_id=0, local_rank_size=2) as store:
            try:
                store.wait(store.load([bytes.fromhex(key_hex)], 0, _dst(1)))
                out.put(("loaded", 0))
            except TaskError as exc:
                out.put(
                    (repr(next(iter(exc.failures.values()))), store.stats()["tiers"][1]["injected"])
                )
    except Exception:
        out.put((traceback.format_exc(), -1))


def stuck_owner(config: dict[str, Any], key_hex: str, ready: Any) -> None:
    """Claims one key through the native queue and is SIGKILLed while its loader is still
    reading it from below (the tier takes far longer than the test waits)."""
    _tiers.register()
    with ucm.open(config, device_id=0, local_rank_size=2) as store:
        task = store.load([bytes.fromhex(key_hex)], 0, _dst(1))
        ready.put("loading")
        store.wait(task)  # never returns: the test kills this process first
