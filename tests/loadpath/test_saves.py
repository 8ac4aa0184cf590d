"""Saves never block the caller (issue 21): a dump does not wait for a slow ``write: through``
tier. What the write-through backlog has no room for skips that tier (exact counts in
``write_through_skipped``) and stays in the buffer; a full dump queue makes ``dump()`` raise
within ``dump_submit_timeout_s``. The tier is a real (in-process) tier held at a gate."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import ucm
from ucm.metrics import registry_for

from ._tiers import CONTENTS, ENTERED, GATES, block, payload
from .test_loadqueue import BOUND_S, SHARD, bounded, dst_for, exact, stack


def src_for(blocks: list[bytes], shard: int) -> list[list[torch.Tensor]]:
    return [
        [torch.frombuffer(bytearray(payload(b, shard, SHARD)), dtype=torch.uint8)] for b in blocks
    ]


def ucm_stats_json(tmp_path: Path, unique_id: str) -> dict[str, Any]:
    """``ucm stats --json`` of the live buffer ``unique_id`` (a stack naming its buffer only:
    the geometry comes from the live header)."""
    stack_path = tmp_path / "stack.yaml"
    stack_path.write_text(
        yaml.safe_dump(
            {"unique_id": unique_id, "tiers": [{"type": "buffer", "capacity": 128 * SHARD}]}
        )
    )
    shown = subprocess.run(
        [sys.executable, "-m", "ucm.cli", "stats", str(stack_path), "--json"],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    data: dict[str, Any] = json.loads(shown.stdout)
    return data


def test_close_waits_for_a_stuck_write_through_tier_at_most_queue_timeout_s(
    test_tiers: None, unique_id: str
) -> None:
    """An engine's shutdown closes its store while a write-through tier does not answer: close
    waits queue_timeout_s for the backlog, then what is still queued skips that tier (counted),
    and the write in progress goes on in the background. Before, close waited for the whole
    backlog, each write as long as the tier took."""
    slow = {"type": "recording", "space": "slow", "write": "through", "gated": True}
    gate = GATES.setdefault("slow", threading.Event())
    gate.clear()
    ENTERED.setdefault("slow", threading.Event()).clear()
    config = stack(unique_id, slow, slots=128, write_queue_bytes=16 * SHARD, queue_timeout_s=1.0)
    opener = threading.Timer(BOUND_S, gate.set)  # bounds the wait of the code before
    opener.start()
    try:
        store = ucm.open(config)
        blocks = [block(i) for i in range(4)]
        for b in blocks:  # one write-through item each
            store.wait(store.dump([b], 0, src_for([b], 0)))
        assert ENTERED["slow"].wait(BOUND_S)  # the first write is stuck at the gate
        store.close()
        assert not gate.is_set(), "close waited for the stuck write-through tier"
        stats = store.stats()
        assert stats["write_through_skipped"] == 3  # the three queued behind the stuck one
        assert stats.get("write_through_shards", 0) == 0
    finally:
        opener.cancel()
        gate.set()


def test_close_leaves_a_dump_that_a_tier_holds_running_after_queue_timeout_s(
    test_tiers: None, unique_id: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """A stack without a buffer: a dump is written into its tier, which holds it. Close waits
    queue_timeout_s for it, then leaves it running and ends the dump queued behind it with
    StoreClosedError. Before, close waited for as long as the tier held the write (a hung
    NFS: for ever, and an SGLang detach or an engine's shutdown with it). Once the tier
    answers, the dump finishes on the thread left running, with no crash, and its bytes are
    stored."""
    space = "held"
    gate = GATES.setdefault(space, threading.Event())
    gate.clear()
    ENTERED.setdefault(space, threading.Event()).clear()
    CONTENTS.pop(space, None)
    config = {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": 1,
        "load": {"queue_timeout_s": 1.0},
        "tiers": [{"type": "recording", "space": space, "gated": True}],
    }
    opener = threading.Timer(BOUND_S, gate.set)  # bounds the wait of the code before
    opener.start()
    try:
        store = ucm.open(config)
        held = [block(10)]
        source = src_for(held, 0)  # read by the held dump until it ends
        task = store.dump(held, 0, source)
        assert ENTERED[space].wait(BOUND_S)  # the tier holds it
        behind = [block(11)]
        queued = store.dump(behind, 0, src_for(behind, 0))
        store.close()
        assert not gate.is_set(), "close waited for the tier"
        assert "ucm: a dump still running after 1.0 s at close (a tier holds its write); " in (
            capfd.readouterr().err
        )
        with pytest.raises(ucm.TaskError, match="StoreClosedError"):
            store.wait(queued, timeout_s=BOUND_S)
        gate.set()  # the tier answers: the dump left running ends, no crash
        store.wait(task, timeout_s=BOUND_S)
        assert CONTENTS[space][(held[0], 0)] == payload(held[0], 0, SHARD)
        assert (behind[0], 0) not in CONTENTS[space]
    finally:
        opener.cancel()
        gate.set()


def test_a_stuck_write_through_tier_skips_what_the_backlog_cannot_hold(
    test_tiers: None, unique_id: str, tmp_path: Path
) -> None:
    slow = {"type": "recording", "space": "slow", "write": "through", "gated": True}
    gate = GATES.setdefault("slow", threading.Event())
    gate.clear()
    config = stack(unique_id, slow, slots=128, write_queue_bytes=4 * SHARD)
    with ucm.open(config) as store:
        first = [block(i) for i in range(4)]
        store.wait(store.dump(first, 0, src_for(first, 0)))  # the backlog takes all four
        assert ENTERED.setdefault("slow", threading.Event()).wait(BOUND_S)  # stuck at the gate
        later = [block(10 + i) for i in range(8)]
        started = time.monotonic()
        for b in later:  # each finds the backlog full: acknowledged without waiting for it
            task = store.dump([b], 0, src_for([b], 0))
            bounded(lambda task=task: store.wait(task), "a dump behind a stuck write-through")
        # Not a timing assertion: only that nothing waited out a bound of the old code (600 s
        # for write-through room, queue_timeout_s for a full dump queue).
        assert time.monotonic() - started < BOUND_S
        stats = store.stats()
        assert stats["write_through_skipped"] == 8
        assert stats["write_queue_bytes"] == 4 * SHARD
        assert stats.get("write_through_shards", 0) == 0
        scraped = registry_for(store).get_sample_value(
            "ucm_store_write_through_skipped_total",
            {"unique_id": unique_id, "device_id": "0"},
        )
        assert scraped == 8
        # Node-wide too, in the buffer's shared counters: what `ucm stats` shows (attached as
        # the scheduler role, in its own process).
        assert store.stats()["tiers"][0]["write_through_skipped"] == 8
        shown = ucm_stats_json(tmp_path, unique_id)
        assert shown["buffer"]["write_through_skipped"] == 8
        # The skipped shards are in the buffer, byte-exact.
        dst = dst_for(8)
        store.wait(store.load(later, 0, dst))
        assert exact(later, 0, dst)
        gate.set()
        store.drain()
        stats = store.stats()
        assert (stats["write_through_shards"], stats["write_through_skipped"]) == (4, 8)
        assert stats["write_queue_bytes"] == 0
    # The write-through tier got exactly what the backlog took.
    assert CONTENTS["slow"] == {(b, 0): payload(b, 0, SHARD) for b in first}


def test_the_skip_wait_is_configurable_and_a_freed_backlog_takes_the_dump(
    test_tiers: None, unique_id: str
) -> None:
    slow = {"type": "recording", "space": "slow", "write": "through", "gated": True}
    gate = GATES.setdefault("slow", threading.Event())
    gate.clear()
    config = stack(
        unique_id, slow, slots=128, write_queue_bytes=SHARD, write_through_wait_s=BOUND_S
    )
    with ucm.open(config) as store:
        store.wait(store.dump([block(0)], 0, src_for([block(0)], 0)))
        assert ENTERED.setdefault("slow", threading.Event()).wait(BOUND_S)
        task = store.dump([block(1)], 0, src_for([block(1)], 0))
        time.sleep(0.2)
        assert not store.check(task)  # waiting for room, within write_through_wait_s
        gate.set()
        bounded(lambda: store.wait(task), "a dump waiting for write-through room")
        store.drain()
        stats = store.stats()
        assert (stats["write_through_shards"], stats["write_through_skipped"]) == (2, 0)
    assert set(CONTENTS["slow"]) == {(block(0), 0), (block(1), 0)}


def test_a_full_dump_queue_raises_within_dump_submit_timeout(
    test_tiers: None, unique_id: str
) -> None:
    # The dump thread is held by a write-through tier that waits for room (a long skip wait),
    # so the dump queue (depth 1) fills: dump() raises after dump_submit_timeout_s, naming it.
    slow = {"type": "recording", "space": "slow", "write": "through", "gated": True}
    gate = GATES.setdefault("slow", threading.Event())
    gate.clear()
    config = stack(
        unique_id,
        slow,
        slots=128,
        write_queue_bytes=SHARD,
        write_through_wait_s=BOUND_S,
        dump_queue_depth=1,
        dump_submit_timeout_s=0.2,
    )
    with ucm.open(config) as store:
        tasks = [store.dump([block(0)], 0, src_for([block(0)], 0))]
        assert ENTERED.setdefault("slow", threading.Event()).wait(BOUND_S)
        tasks.append(store.dump([block(1)], 0, src_for([block(1)], 0)))  # the thread waits
        time.sleep(0.2)
        tasks.append(store.dump([block(2)], 0, src_for([block(2)], 0)))  # the queue's one place

        def refused() -> None:
            with pytest.raises(TimeoutError, match="dump_submit_timeout_s"):
                store.dump([block(3)], 0, src_for([block(3)], 0))

        bounded(refused, "dump() on a full dump queue")
        gate.set()
        for task in tasks:
            bounded(lambda task=task: store.wait(task), "a queued dump")


def test_vllm_wait_for_save_returns_while_a_write_through_tier_is_stuck(
    test_tiers: None, unique_id: str
) -> None:
    """The vLLM worker's save hook (``submit_saves``, what ``wait_for_save`` calls) over a stack
    whose write-through tier never answers: every step's save is submitted and acknowledged,
    what the backlog cannot hold is skipped (exact count), and the requests are released."""
    from ucm.integration.vllm.metadata import BlockTransfer, UcmConnectorMetadata
    from ucm.integration.vllm.worker import WorkerSide

    slow = {"type": "recording", "space": "slow", "write": "through", "gated": True}
    GATES.setdefault("slow", threading.Event()).clear()
    steps = 6
    with ucm.open(stack(unique_id, slow, slots=128, shards=1, write_queue_bytes=SHARD)) as store:
        worker = WorkerSide(store, rank=0, shard_size=SHARD)
        kv = torch.arange(steps * SHARD, dtype=torch.int64).remainder(251).to(torch.uint8)
        worker.set_block_views([kv.view(steps, SHARD)])
        ids = [block(40 + i) for i in range(steps)]
        for step, block_id in enumerate(ids):
            meta = UcmConnectorMetadata(
                saves=[BlockTransfer(f"r{step}", [step], [block_id])], released={f"r{step}"}
            )
            worker.bind(meta)
            bounded(worker.submit_saves, "wait_for_save behind a stuck write-through tier")
            if step == 0:  # the first save fills the backlog and sits at the tier's gate
                assert ENTERED.setdefault("slow", threading.Event()).wait(BOUND_S)
        done: set[str] = set()
        deadline = time.monotonic() + BOUND_S
        while len(done) < steps:
            assert time.monotonic() < deadline, f"released so far: {sorted(done)}"
            done |= worker.get_finished()
            time.sleep(0.01)
        assert done == {f"r{step}" for step in range(steps)}
        assert worker.stats.data["saved_blocks"] == steps
        assert worker.stats.data.get("save_failed_blocks", 0) == 0
        assert store.stats()["write_through_skipped"] == steps - 1
        dst = dst_for(steps)
        store.wait(store.load(ids, 0, dst))
        assert [d[0].numpy().tobytes() for d in dst] == [
            kv[i * SHARD : (i + 1) * SHARD].numpy().tobytes() for i in range(steps)
        ]
        GATES["slow"].set()


def test_a_dump_that_meets_this_ranks_own_failing_prefetch_writes_its_own_bytes(
    test_tiers: None, unique_id: str
) -> None:
    """docs/reliability.md's first dump gap, within one rank: a prefetch of a key no tier has
    is filling its slot (held at the tier's gate) when a dump of the same key arrives. The fill
    ends Missing; the dump then writes its own bytes (before the fix it was reported done at
    once and its bytes were in no tier)."""
    low = {"type": "recording", "space": "low", "write": "none", "gated": True}
    gate = GATES.setdefault("low", threading.Event())
    gate.clear()
    with ucm.open(stack(unique_id, low, slots=64, shards=1)) as store:
        assert store.buffer is not None
        x = block(70)
        store.prefetch([x])  # this rank owns x's slot, its loader waits at the gate
        assert ENTERED.setdefault("low", threading.Event()).wait(BOUND_S)
        task = store.dump([x], 0, src_for([x], 0))
        deadline = time.monotonic() + BOUND_S
        while store.buffer.stats()["waited"] == 0 and not store.check(task):
            assert time.monotonic() < deadline, "the dump never reached the slot"
            time.sleep(0.01)
        gate.set()  # the prefetch finds x in no tier: its fill ends Missing
        bounded(lambda: store.wait(task), "the dump behind the prefetch")
        store.wait_prefetches()
        dst = dst_for(1)
        store.wait(store.load([x], 0, dst))
        assert exact([x], 0, dst)
        stats = store.buffer.stats()
        assert (stats["waited"], stats["dump_refills"]) == (1, 1)
        assert CONTENTS.get("low", {}) == {}  # write: none: the buffer holds the only copy


@contextlib.contextmanager
def _opened_at_exit(gate: threading.Event) -> Iterator[None]:
    """Opens the gate however the block ends, before the store closes: a failed assertion
    must not leave close() draining dumps held at a gate."""
    try:
        yield
    finally:
        gate.set()


def _anon_rss_bytes() -> int:
    """This process's anonymous resident memory (``RssAnon``): snapshot buffers, not the
    CacheBuffer's shared memory nor the page cache of the files written."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_the_snapshot_memory_a_burst_leaves_is_freed_once_the_writer_is_idle(
    test_tiers: None, unique_id: str, tmp_path: Path
) -> None:
    """A burst of write-through dumps snapshots its shards (up to ``write_queue_bytes``); once
    written they are kept for the next dumps, and once the writer has been idle
    ``write_snapshot_idle_s`` they are freed and their pages go back to the system
    (anonymous RSS, measured). The posix tier keeps no copy in memory."""
    shard = 128 * 1024  # from the C heap, 64 MiB of these stayed resident once freed
    count = 512  # 64 MiB of snapshots: exactly the backlog
    snapshots = count * shard
    gate = GATES.setdefault("nvme", threading.Event())
    gate.clear()
    config = {
        "unique_id": unique_id,
        "shard_size": shard,
        "shards_per_block": 1,
        "tiers": [
            {
                "type": "buffer",
                "capacity": count * shard,
                "write_queue_bytes": snapshots,
                "write_snapshot_idle_s": 1.0,
            },
            {
                "type": "slowposix",
                "path": str(tmp_path / "nvme"),
                "write": "through",
                "dump_gate": "nvme",
            },
        ],
    }
    blocks = [block(i) for i in range(count)]
    src = [[torch.full((shard,), i % 251, dtype=torch.uint8)] for i in range(count)]
    with ucm.open(config) as store, _opened_at_exit(gate):
        before = _anon_rss_bytes()
        for start in range(0, count, 64):  # the writer holds the first part at the gate
            part = slice(start, start + 64)
            store.wait(store.dump(blocks[part], 0, src[part]), timeout_s=BOUND_S)
            if start == 0:
                assert ENTERED.setdefault("nvme", threading.Event()).wait(BOUND_S)
        stats = store.stats()
        assert (stats["write_queue_bytes"], stats["write_through_skipped"]) == (snapshots, 0)
        held = _anon_rss_bytes()
        assert held - before >= snapshots * 3 // 4, f"{held - before} bytes for the snapshots"
        scraped = registry_for(store).get_sample_value(
            "ucm_store_write_queue_bytes", {"unique_id": unique_id, "device_id": "0"}
        )
        assert scraped == snapshots

        gate.set()
        deadline = time.monotonic() + BOUND_S
        while True:  # written, kept, then freed once the writer has been idle for 1 s
            stats = store.stats()
            if stats.get("write_through_shards") == count and not stats["write_snapshot_bytes"]:
                break
            assert time.monotonic() < deadline, f"the idle writer kept its buffers: {stats}"
            time.sleep(0.05)
        freed = held - _anon_rss_bytes()
        assert freed >= snapshots * 3 // 4, f"only {freed} bytes returned after the trim"

        # The writer still works after the trim, and keeps its new buffer until idle again.
        store.wait(store.dump(blocks[:1], 0, src[:1]), timeout_s=BOUND_S)
        store.drain()
        stats = store.stats()
        assert stats["write_through_shards"] == count + 1
        assert stats["write_snapshot_bytes"] in (shard, 0)  # 0 if a second idle trim ran
    with ucm.open(config) as fresh:  # a new buffer: the load comes from posix
        dst = [[torch.zeros(shard, dtype=torch.uint8)] for _ in range(count)]
        fresh.wait(fresh.load(blocks, 0, dst), timeout_s=BOUND_S)
        assert all(torch.equal(d[0], s[0]) for d, s in zip(dst, src, strict=True))


def _assert_saved(worker: Any, store: ucm.Store, ids: list[bytes], want: torch.Tensor) -> None:
    """Waits (bounded) until the worker has collected a save of every one of ``ids`` (one
    ``SHARD`` each), then loads them back: block i holds ``want``'s i-th ``SHARD`` bytes."""
    deadline = time.monotonic() + BOUND_S
    while worker.stats.data["saved_blocks"] < len(ids):
        assert time.monotonic() < deadline, dict(worker.stats.data)
        worker.get_finished()
        time.sleep(0.01)
    dst = dst_for(len(ids))
    store.wait(store.load(ids, 0, dst), timeout_s=BOUND_S)
    assert [d[0].numpy().tobytes() for d in dst] == [
        want[i * SHARD : (i + 1) * SHARD].numpy().tobytes() for i in range(len(ids))
    ]


@contextlib.contextmanager
def _staged_saves_held_at_the_gate(
    unique_id: str, *, count: int, submit_timeout_s: float, first: int, pattern: int
) -> Iterator[tuple[ucm.Store, Any, torch.Tensor, list[bytes]]]:
    """No CacheBuffer (saves are staged), a tier that holds every dump at gate ``held``, and
    a dump queue of one whose submissions wait up to ``submit_timeout_s``: ``count`` steps,
    step i saving vLLM block i (request ``r<i>``, released) as block ``first + i``, the KV
    cache's bytes counting mod ``pattern``. Yields (store, worker, KV cache, ids) once every
    save is handed to the worker and save 0 is held at the gate; the gate opens on the way
    out."""
    from ucm.integration.addresses import BlockAddresses
    from ucm.integration.vllm.metadata import BlockTransfer, UcmConnectorMetadata
    from ucm.integration.vllm.worker import WorkerSide

    GATES.setdefault("held", threading.Event()).clear()
    config = {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [{"type": "recording", "space": "held", "gated": True}],
        "load": {"dump_queue_depth": 1, "dump_submit_timeout_s": submit_timeout_s},
    }
    kv = torch.arange(count * SHARD, dtype=torch.int64).remainder(pattern).to(torch.uint8)
    view = kv.view(count, SHARD)
    ids = [block(first + i) for i in range(count)]
    try:
        with ucm.open(config) as store:
            worker = WorkerSide(store, rank=0, shard_size=SHARD, stage_saves=True)
            worker.set_block_views([view], BlockAddresses([view], [SHARD], ["layer.0"], count))
            for step in range(count):
                saves = [BlockTransfer(f"r{step}", [step], [ids[step]])]
                worker.bind(UcmConnectorMetadata(saves=saves, released={f"r{step}"}))
                bounded(worker.submit_saves, "wait_for_save of a staged save")
                if step == 0:
                    assert ENTERED.setdefault("held", threading.Event()).wait(BOUND_S)
            yield store, worker, kv, ids
    finally:
        GATES["held"].set()


def test_a_workers_close_never_waits_for_each_staged_save_behind_a_stuck_tier(
    test_tiers: None, unique_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No CacheBuffer (saves are staged), a tier that holds every dump, a dump queue of one,
    and submissions that wait up to 4 s each: save 0 is held at the gate, save 1 fills the
    queue, and 10 more wait on the submitting thread. The worker's close returns within two
    of those waits, while the gate is still closed: once a submission timed out while it
    closes, the saves behind it are dropped, never submitted. Once the gate opens, saves 0 and
    1 are stored whole, and nothing else. On the code before, close waited 4 s for each
    queued save (40 s)."""
    with _staged_saves_held_at_the_gate(
        unique_id, count=12, submit_timeout_s=4, first=90, pattern=241
    ) as (store, worker, kv, ids):
        with caplog.at_level("WARNING", "vllm.ucm"):
            bounded(worker.close, "the worker's close", timeout_s=20.0, gate="held")
        assert not GATES["held"].is_set()
        # Saves 2-11: one or two timed out on the full queue, the rest were dropped.
        said = "blocks not saved: the worker closed while a tier did not keep up"
        assert len([r for r in caplog.records if said in r.getMessage()]) == 1
        GATES["held"].set()
        deadline = time.monotonic() + BOUND_S
        while store.lookup(ids[:2]) != [True, True]:
            assert time.monotonic() < deadline, store.lookup(ids)
            time.sleep(0.01)
        assert store.lookup(ids) == [True, True] + [False] * (len(ids) - 2)
        dst = dst_for(2)
        store.wait(store.load(ids[:2], 0, dst), timeout_s=BOUND_S)
        assert [d[0].numpy().tobytes() for d in dst] == [
            kv[i * SHARD : (i + 1) * SHARD].numpy().tobytes() for i in range(2)
        ]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_a_cuda_dump_frees_vllms_blocks_once_submitted_however_long_the_tier_holds_it(
    test_tiers: None, unique_id: str
) -> None:
    """A CUDA KV cache without a CacheBuffer: ``store.dump`` copies vLLM's blocks into its
    pinned staging slots before it returns, so a preemption does not wait for the dump that a
    tier holds at its gate, the finished request is reported at once, and the blocks vLLM then
    overwrites do not change what the tier stores."""
    from ucm.integration.vllm.metadata import BlockTransfer, UcmConnectorMetadata
    from ucm.integration.vllm.worker import WorkerSide

    GATES.setdefault("held", threading.Event()).clear()
    config = {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": 1,
        "tiers": [{"type": "recording", "space": "held", "gated": True}],
    }
    count = 4
    kv = torch.arange(count * SHARD, dtype=torch.int64, device="cuda").remainder(251)
    kv = kv.to(torch.uint8)
    want = kv.cpu()
    ids = [block(60 + i) for i in range(count)]
    try:
        with ucm.open(config, device_id=0) as store:
            worker = WorkerSide(store, rank=0, shard_size=SHARD)
            worker.set_block_views([kv.view(count, SHARD)])
            worker.bind(UcmConnectorMetadata(saves=[BlockTransfer("r", list(range(count)), ids)]))
            bounded(worker.submit_saves, "wait_for_save of a CUDA KV cache")
            assert ENTERED.setdefault("held", threading.Event()).wait(BOUND_S)
            preempted = UcmConnectorMetadata(preempted={"r"}, released={"r"})
            bounded(lambda: worker.handle_preemptions(preempted), "a preemption behind a held dump")
            kv.fill_(7)  # vLLM writes into the freed blocks
            torch.cuda.current_stream().synchronize()
            worker.bind(preempted)
            assert worker.get_finished() == {"r"}
            assert not GATES["held"].is_set()  # all of it while the tier still holds the dump
            GATES["held"].set()
            _assert_saved(worker, store, ids, want)
    finally:
        GATES["held"].set()


def test_a_full_dump_queue_never_holds_a_staged_saves_copy(
    test_tiers: None, unique_id: str
) -> None:
    """No CacheBuffer (saves are staged), a tier that holds every dump, and a dump queue of
    one whose submissions wait up to 45 s: save 0 is taken by the dispatcher and held at the
    gate, save 1 fills the queue, and save 2's submission waits for room. Save 3's copy out
    of vLLM's blocks does not wait behind that submission: the preemption of its request
    returns within 15 s, and its request is reported finished, while the gate is still closed.
    Once it opens, every save is stored with the bytes its blocks held before they were
    overwritten. On the code before, one thread copied and then submitted each save in turn,
    so save 3's copy waited for save 2's submission (45 s)."""
    from ucm.integration.vllm.metadata import UcmConnectorMetadata

    with _staged_saves_held_at_the_gate(
        unique_id, count=4, submit_timeout_s=45, first=70, pattern=251
    ) as (store, worker, kv, ids):
        want = kv.clone()
        preempted = UcmConnectorMetadata(preempted={"r3"})
        bounded(
            lambda: worker.handle_preemptions(preempted),
            "the preemption behind a save's submission to a full dump queue",
            timeout_s=15.0,
            gate="held",
        )
        kv.view(len(ids), SHARD)[3].fill_(0xEE)  # vLLM writes into the preempted request's blocks
        assert "r3" in worker.get_finished()
        assert not GATES["held"].is_set()
        GATES["held"].set()
        _assert_saved(worker, store, ids, want)
        assert worker.stats.data.get("save_failed_blocks", 0) == 0
        worker.close()
