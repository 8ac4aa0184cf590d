"""The native load queue through the Store: one task mixing hits, owners, a waiter on another
process's load and failures; an owner SIGKILLed mid-fill whose key this process takes over;
caller copies (the CUDA path's hand-off); check without blocking; no slot left held; a forked
child refused; a stack without a buffer runs the same queue on a null buffer."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ucm
from ucm import arguments
from ucm.config import LoadSettings
from ucm.errors import InvalidArgumentError, KeyMissingError, TaskError, TierError, UcmError
from ucm.loadqueue import LoadPath
from ucm.native import segments
from ucm.native.queue import TaskKind
from ucm.ranks import RankGroup

from . import _ranks
from ._tiers import CONTENTS, block, payload

SHARD = _ranks.SHARD


def stack(unique_id: str, *lower: dict[str, Any], **buffer: Any) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": 2,
        "tiers": [{"type": "buffer", "capacity": 64 * SHARD, **buffer}, *lower],
    }


def dst_for(n: int) -> list[list[torch.Tensor]]:
    return [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in range(n)]


def exact(blocks: list[bytes], dst: list[list[torch.Tensor]], shard: int = 0) -> list[bool]:
    return [
        d[0].numpy().tobytes() == payload(b, shard, SHARD) for b, d in zip(blocks, dst, strict=True)
    ]


def held(store: ucm.Store) -> int:
    return int(store.stats()["tiers"][0]["held_slots"])


def test_one_task_of_hits_owners_a_waiter_and_failures(
    test_tiers: None, unique_id: str, tmp_path: Path
) -> None:
    hits = [block(i) for i in range(4)]
    owned = [block(10 + i) for i in range(4)]
    waited, missing, broken = block(20), block(30), block(40)
    everything = [*hits, *owned, waited, broken]
    CONTENTS["low"] = {(b, 0): payload(b, 0, SHARD) for b in everything}
    slow = {"type": "slowposix", "path": str(tmp_path / "nvme"), "delay_s": 0.5}
    with ucm.open({"unique_id": "seed", **stack(unique_id)} | {"tiers": [slow]}) as seed:
        src = [
            [torch.frombuffer(bytearray(payload(b, 0, SHARD)), dtype=torch.uint8)]
            for b in everything
        ]
        seed.wait(seed.dump(everything, 0, src))
    slow["fail_keys"] = [f"{broken.hex()}:0"]
    config = stack(unique_id, slow)
    # Another rank (process) owns `waited` for ~3 s: this rank waits on its slot.
    other_config = stack(unique_id, {**slow, "delay_s": 3.0})
    with ucm.open(config, device_id=1, local_rank_size=2) as store:
        store.wait(
            store.dump(
                hits,
                0,
                [
                    [torch.frombuffer(bytearray(payload(b, 0, SHARD)), dtype=torch.uint8)]
                    for b in hits
                ],
            )
        )
        with RankGroup(parties=1) as group:
            group.spawn(_ranks.failing_owner, other_config, waited.hex(), group.results)
            core = store.tiers[0].core
            deadline = time.monotonic() + 60
            while core.slot_of((waited, 0)) is None:
                assert time.monotonic() < deadline, "the other rank never claimed its key"
                time.sleep(0.005)
            # Entry 1 is in this rank's own stride (device 1 of 2): claimed in the first step.
            blocks = [hits[0], waited, *hits[1:], *owned, missing, broken]
            dst = dst_for(len(blocks))
            task = store.load(blocks, 0, dst)
            assert store.check(task) is False  # the owned keys take 0.5 s each below
            with pytest.raises(TaskError) as info:
                store.wait(task)
            assert store.check(task) is True
            failures = info.value.failures
            assert set(failures) == {(missing, 0), (broken, 0)}
            assert type(failures[(missing, 0)]) is KeyMissingError
            assert type(failures[(broken, 0)]) is TierError
            assert "injected failure in slowposix" in str(failures[(broken, 0)])
            good = blocks[: len(hits) + len(owned) + 1]
            assert all(exact(good, dst[: len(good)]))
            stats = store.stats()
            tier = stats["tiers"][0]
            assert (tier["waited"], tier["owned"]) == (1, 6)
            assert (stats["hits"], stats["misses"]) == (5, 6)
            assert stats["failed_shards"] == 2
            assert held(store) == 0  # every reference the task took is released
            assert group.reports(timeout=60) == [("loaded", 0)]


@pytest.mark.timeout(120)
def test_an_owner_sigkilled_mid_fill_is_taken_over_and_nothing_leaks(
    test_tiers: None, unique_id: str, tmp_path: Path
) -> None:
    key = block(7)
    nvme = str(tmp_path / "nvme")
    with ucm.open(
        {
            "unique_id": "seed2",
            "shard_size": SHARD,
            "shards_per_block": 2,
            "tiers": [{"type": "posix", "path": nvme}],
        }
    ) as seed:
        seed.wait(
            seed.dump(
                [key], 0, [[torch.frombuffer(bytearray(payload(key, 0, SHARD)), dtype=torch.uint8)]]
            )
        )
    # The owner's loader sleeps 60 s per shard below; ours is fast (the same files).
    slow = stack(
        unique_id, {"type": "slowposix", "path": nvme, "delay_s": 60.0}, wait_timeout_s=20.0
    )
    with RankGroup(parties=1) as group:
        owner = group.spawn(_ranks.stuck_owner, slow, key.hex(), group.results)
        assert group.reports(timeout=60) == ["loading"]
        fast = stack(unique_id, {"type": "slowposix", "path": nvme}, wait_timeout_s=20.0)
        with ucm.open(fast, device_id=1, local_rank_size=2) as store:
            core = store.tiers[0].core
            deadline = time.monotonic() + 60
            while core.slot_of((key, 0)) is None:
                assert time.monotonic() < deadline, "the owner never claimed the key"
                time.sleep(0.005)
            task = store.load([key], 0, dst := dst_for(1))
            time.sleep(0.2)  # this rank is now waiting on the owner's slot
            assert store.check(task) is False
            os.kill(owner.pid, signal.SIGKILL)
            started = time.monotonic()
            store.wait(task)
            assert time.monotonic() - started < 15  # well within wait_timeout_s
            assert exact([key], dst) == [True]
            stats = store.stats()
            assert stats["takeovers"] == 1
            assert stats["tiers"][0]["waited"] == 1
            assert held(store) == 0
            store.tiers[0].core.reclaim_dead()
            slot = core.slot_of((key, 0))
            assert slot is not None and core.slot_info(slot).refcount == 0


class _HostCopies:
    """Stands in for the CUDA copier (no GPU here): the same hand-off (COPY_OUT work holding
    the Ready slot), with the "device" tensors in host memory, copied by memmove."""

    def __init__(self) -> None:
        self.copied = 0

    def copy(self, shards: list[tuple[int, list[tuple[Any, Any]]]]) -> None:
        for address, pairs in shards:
            for device_tensor, _staging in pairs:
                ctypes.memmove(device_tensor.data_ptr(), address, device_tensor.nbytes)
                address += device_tensor.nbytes
                self.copied += 1

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_caller_copies_get_the_ready_slot_and_release_it(test_tiers: None, unique_id: str) -> None:
    """The CUDA path's hand-off without a GPU: entries flagged for a caller copy come back to a
    loader thread with their Ready slot; the staging tensors are never used for them."""
    blocks = [block(i) for i in range(6)]
    CONTENTS["low"] = {(b, 0): payload(b, 0, SHARD) for b in blocks}
    with ucm.open(stack(unique_id, {"type": "recording", "space": "low"})) as store:
        path = store._native
        assert isinstance(path, LoadPath)
        copier = _HostCopies()
        path._cuda, path._cuda_checked = copier, True  # type: ignore[assignment]
        for _ in range(2):  # cold (owned, then handed out), then hits
            devices = [torch.zeros(SHARD, dtype=torch.uint8) for _ in blocks]
            staging = [torch.full((SHARD,), 0xEE, dtype=torch.uint8) for _ in blocks]
            memory = arguments.ShardMemory((SHARD,))
            for device, stage in zip(devices, staging, strict=True):
                memory.flat.append(stage.data_ptr())
                memory.cuda_pairs.append((device, stage))
                memory.cuda.append([(device, stage)])
            keys = [(b, 0) for b in blocks]
            job = path.submit(TaskKind.LOAD, arguments.TaskKeys.of(keys), memory)
            assert job.failures(30) == {}
            assert [d.numpy().tobytes() for d in devices] == [payload(b, 0, SHARD) for b in blocks]
            assert all(bool((s == 0xEE).all()) for s in staging)  # not copied through staging
            assert job.direct == set(range(len(blocks)))
        assert copier.copied == 2 * len(blocks)
        assert held(store) == 0


def test_a_forked_child_cannot_use_the_parents_queue(test_tiers: None, unique_id: str) -> None:
    CONTENTS["low"] = {(block(1), 0): payload(block(1), 0, SHARD)}
    with ucm.open(stack(unique_id, {"type": "recording", "space": "low"})) as store:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the parent's native threads do not exist here
            try:
                store.load([block(1)], 0, dst_for(1))
                message = b"loaded"
            except UcmError as exc:
                message = str(exc).encode()
            os.write(write, message[:500])
            os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        message = os.read(read, 600).decode()
        os.close(read)
        assert status == 0
        assert "belongs to the process that opened it" in message
        dst = dst_for(1)
        store.wait(store.load([block(1)], 0, dst))  # the parent's queue is unaffected
        assert exact([block(1)], dst) == [True]


def test_a_stack_without_a_buffer_runs_the_same_queue_on_a_null_buffer(
    test_tiers: None, unique_id: str
) -> None:
    CONTENTS["low"] = {(block(1), 0): payload(block(1), 0, SHARD)}
    lower = {"type": "recording", "space": "low"}
    with ucm.open(stack(unique_id, lower)) as store:
        assert isinstance(store._native, LoadPath) and store._native.queue.buffered
    plain = {"unique_id": unique_id, "shard_size": SHARD, "shards_per_block": 2, "tiers": [lower]}
    with ucm.open(plain) as store:
        assert isinstance(store._native, LoadPath) and not store._native.queue.buffered
        dst = dst_for(1)
        store.wait(store.load([block(1)], 0, dst))
        assert exact([block(1)], dst) == [True]
        # Every key of a null buffer's step is BYPASS work: loaded from the tier by a loader.
        native = store._native.queue.stats()
        assert (native["bypassed"], native["owned"], native["held_slots"]) == (1, 0, 0)
        stats = store.stats()
        assert (stats["load_tasks"], stats["hits"], stats["loaded_shards"]) == (1, 1, 1)
        # The null buffer takes no dumps (the top tier does, through the DumpQueue).
        from array import array

        source = (ctypes.c_ubyte * SHARD)()
        keys = arguments.TaskKeys.of([(block(2), 0)])
        addresses = array("Q", [ctypes.addressof(source)])
        with pytest.raises(InvalidArgumentError, match="refused the call"):
            store._native.queue.submit(
                TaskKind.DUMP, keys.ids, keys.shards, addresses, bytearray(1)
            )


def test_raw_addresses_as_lists_or_one_packed_array_and_bad_ones_named(
    test_tiers: None, unique_id: str
) -> None:
    from array import array

    blocks = [block(i) for i in range(3)]
    CONTENTS["low"] = {(b, 1): payload(b, 1, SHARD) for b in blocks}
    with ucm.open(stack(unique_id, {"type": "recording", "space": "low"})) as store:
        buffers = [(ctypes.c_ubyte * SHARD)() for _ in blocks]
        addresses = [ctypes.addressof(b) for b in buffers]
        for form in ([[a] for a in addresses], addresses, array("Q", addresses)):
            for b in buffers:
                ctypes.memset(b, 0, SHARD)
            store.wait(store.load_data(blocks, 1, form))
            assert [bytes(b) for b in buffers] == [payload(b, 1, SHARD) for b in blocks]
        bad = [
            ([[addresses[0]], [True], [addresses[2]]], r"dst_ptrs\[1\]\[0\]=True is not valid"),
            ([addresses[0], 64, addresses[2]], r"dst_ptrs\[1\]\[0\]=64 is not valid: .*null page"),
            (
                array("Q", addresses[:2]),
                r"dst_ptrs holds 2 addresses but 3 block\(s\) of 1 tensor\(s\) need 3",
            ),
            (
                [[addresses[0], addresses[1]], [addresses[1]], [addresses[2]]],
                r"must list 1 address",
            ),
        ]
        for form, message in bad:
            with pytest.raises(InvalidArgumentError, match=message):
                store.load_data(blocks, 1, form)
        with pytest.raises(InvalidArgumentError, match=r"repeats block_ids\[0\]"):
            store.load_data([blocks[0], blocks[0]], 1, addresses[:2])
        with pytest.raises(InvalidArgumentError, match=r"block_ids\[1\] must be exactly 16 bytes"):
            store.load_data([blocks[0], b"short", blocks[2]], 1, addresses)
        assert held(store) == 0


def test_a_background_load_is_the_same_load_and_only_a_load_may_be_one(
    test_tiers: None, unique_id: str
) -> None:
    """``background=True`` (an engine's asynchronous load: its copies yield the CPU between
    batches) moves the same bytes, from a lower tier and from the buffer; the native queue
    refuses the flag on any other kind of task."""
    from array import array

    from ucm.native.queue import TASK_FLAG_BACKGROUND

    blocks = [block(i) for i in range(6)]
    CONTENTS["low"] = {(b, 0): payload(b, 0, SHARD) for b in blocks}
    with ucm.open(stack(unique_id, {"type": "recording", "space": "low"})) as store:
        for _ in range(2):  # filled from the tier below, then hits in the buffer
            dst = dst_for(len(blocks))
            store.wait(store.load(blocks, 0, dst, background=True))
            assert exact(blocks, dst) == [True] * len(blocks)
            buffers = [(ctypes.c_ubyte * SHARD)() for _ in blocks]
            packed = array("Q", [ctypes.addressof(b) for b in buffers])
            store.wait(store.load_data(blocks, 0, packed, background=True))
            assert [bytes(b) for b in buffers] == [payload(b, 0, SHARD) for b in blocks]
        assert held(store) == 0
        native = store.tiers[0].queue  # type: ignore[attr-defined]
        keys = arguments.TaskKeys.of([(blocks[0], 0)])
        for kind in (TaskKind.DUMP, TaskKind.PREFETCH):
            with pytest.raises(InvalidArgumentError):
                native.submit(
                    kind,
                    keys.ids,
                    keys.shards,
                    array("Q", packed[:1]) if kind is TaskKind.DUMP else None,
                    bytearray(1),
                    flags=TASK_FLAG_BACKGROUND,
                )


def test_background_reads_keep_to_their_rate_and_loads_waited_on_are_never_paced(
    test_tiers: None, unique_id: str
) -> None:
    """``background_read_bytes_per_s`` spaces the starts of a background load's reads from the
    tiers below by a shard's time at that rate, across every loader of the process; the bytes
    are the same. A load the caller waits on (``background=False``) is never paced."""
    slow = [block(700 + i) for i in range(26)]
    quick = [block(740 + i) for i in range(6)]
    CONTENTS["low"] = {(b, 0): payload(b, 0, SHARD) for b in [*slow, *quick]}
    rate = 1 << 20  # the least rate: a 4 KiB shard every 3.9 ms
    config = stack(unique_id, {"type": "recording", "space": "low"})
    config["tiers"][0]["background_read_bytes_per_s"] = rate
    with ucm.open(config) as store:
        dst = dst_for(len(slow))
        started = time.monotonic()
        store.wait(store.load(slow, 0, dst, background=True))
        elapsed_s = time.monotonic() - started
        assert exact(slow, dst) == [True] * len(slow)
        # 26 reads, each started at least a shard's time after the one before: 0.098 s.
        assert elapsed_s >= (len(slow) - 1) * SHARD / rate - 0.005
        paced = store.stats()
        # Whether a read waits depends on how fast the one before it went; what waits is
        # counted, and no more than every loader waiting the whole time.
        loaders = LoadSettings().load_workers
        assert 0 <= paced["background_paced_shards"] <= len(slow) - 1
        assert paced["background_paced_us"] <= elapsed_s * 1e6 * loaders
        assert (paced["background_paced_us"] > 0) == (paced["background_paced_shards"] > 0)
        dst = dst_for(len(quick))
        store.wait(store.load(quick, 0, dst))
        assert exact(quick, dst) == [True] * len(quick)
        after = store.stats()
        assert after["background_paced_shards"] == paced["background_paced_shards"]
        assert after["background_paced_us"] == paced["background_paced_us"]


def test_a_pacer_books_each_read_after_the_last_and_lifting_it_ends_every_wait() -> None:
    import threading

    from ucm.loadqueue import Pacer

    pacer = Pacer(1000)  # bytes per second
    assert pacer.take(100) == 0.0  # an idle pacer: the first read starts at once
    started = time.monotonic()
    pacer.take(100)  # booked 0.1 s after the first
    pacer.take(200)  # 0.1 s after that
    assert time.monotonic() - started >= 0.2 - 0.005
    pacer.take(60_000)  # books the next minute
    waited: list[float] = []
    waiter = threading.Thread(target=lambda: waited.append(pacer.take(100)))
    waiter.start()
    time.sleep(0.05)
    pacer.lift()
    waiter.join(timeout=30)
    assert not waiter.is_alive() and waited[0] < 30
    assert pacer.take(10**9) == 0.0  # lifted: no new wait starts


def test_a_background_prefetch_reads_on_the_loaders_not_on_the_tiers_pool(
    unique_id: str, tmp_path: Path
) -> None:
    """An engine's asynchronous load prefetches with ``background=True``: the posix tier reads
    its blocks on the loader threads themselves, and starts none of its ``io_threads`` (up to
    that many more threads taking the engine's GIL in turn while it computes); the same
    prefetch in the foreground reads on the pool. Both move the same bytes."""
    import threading

    posix = {"type": "posix", "path": str(tmp_path / "nvme"), "io_threads": 4}
    blocks = [block(500 + i) for i in range(8)]
    with ucm.open({**stack(unique_id), "unique_id": f"{unique_id}-seed", "tiers": [posix]}) as seed:
        for shard in (0, 1):  # a prefetch moves up every shard of a block
            src = [
                [torch.frombuffer(bytearray(payload(b, shard, SHARD)), dtype=torch.uint8)]
                for b in blocks
            ]
            seed.wait(seed.dump(blocks, shard, src))

    def pool_threads_started(background: bool, suffix: str) -> int:
        before = {t.ident for t in threading.enumerate()}
        config = {**stack(unique_id, posix), "unique_id": f"{unique_id}-{suffix}"}
        # One loader: every block in one fill call, which the tier would spread on its pool.
        config["tiers"][0]["load_workers"] = 1
        try:
            with ucm.open(config) as store:
                task = store.prefetch(blocks, background=background)
                assert task is not None
                store.wait(task)
                started = [
                    t
                    for t in threading.enumerate()
                    if t.ident not in before and t.name.startswith("ucm-posix")
                ]
                dst = dst_for(len(blocks))
                store.wait(store.load(blocks, 0, dst))
                assert exact(blocks, dst) == [True] * len(blocks)
                # Every shard was prefetched: the load was all buffer hits.
                assert store.stats()["tiers"][0]["hits"] == len(blocks)
                return len(started)
        finally:
            segments.unlink(str(config["unique_id"]))

    assert pool_threads_started(background=True, suffix="bg") == 0
    assert pool_threads_started(background=False, suffix="fg") > 0


def test_threads_submitting_at_once_each_complete_their_own_task(
    test_tiers: None, unique_id: str
) -> None:
    """Each submit gets its own token: ctypes drops the GIL during the native call, so tasks
    submitted by several threads at once must never end up watching one another's task (a
    shared out-parameter gave two jobs one token). Tokens carry a generation: every task of
    the run has a distinct one."""
    import sys
    import threading

    threads_n, rounds, per_task = 4, 150, 2
    everything = [block(1000 + i) for i in range(threads_n * per_task)]
    CONTENTS["low"] = {(b, 0): payload(b, 0, SHARD) for b in everything}
    errors: list[str] = []
    tokens: list[int] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # as many thread switches around the native calls as possible
    try:
        with ucm.open(stack(unique_id, {"type": "recording", "space": "low"})) as store:
            start = threading.Barrier(threads_n)

            def worker(index: int) -> None:
                mine = everything[index * per_task : (index + 1) * per_task]
                start.wait(timeout=60)
                for round_ in range(rounds):
                    dst = dst_for(per_task)
                    task = store.load(mine, 0, dst)
                    tokens.append(task.completion.token)
                    store.wait(task)
                    if exact(mine, dst) != [True] * per_task:
                        errors.append(f"thread {index} round {round_}: {exact(mine, dst)}")
                        return

            workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
            for thread in workers:
                thread.start()
            for thread in workers:
                thread.join(timeout=300)
            assert not any(thread.is_alive() for thread in workers)
            assert errors == []
            assert len(tokens) == threads_n * rounds
            assert len(set(tokens)) == len(tokens)
            assert held(store) == 0
    finally:
        sys.setswitchinterval(interval)


def test_a_caller_reusing_its_lists_after_submit_changes_no_task(
    test_tiers: None, unique_id: str
) -> None:
    """The queue keeps copies of block ids and raw addresses: a caller may refill or resize
    its own list or array as soon as dump()/load_data() returned."""
    from array import array

    blocks = [block(2000 + i) for i in range(3)]
    others = [block(2100 + i) for i in range(3)]
    low = {"type": "recording", "space": "low", "write": "through"}
    with ucm.open(stack(unique_id, low)) as store:
        ids = list(blocks)
        src = [[torch.frombuffer(bytearray(payload(b, 0, SHARD)), dtype=torch.uint8)] for b in ids]
        task = store.dump(ids, 0, src)
        ids[:] = others  # the write-through and any failure must still name `blocks`
        store.wait(task)
    # close() finished the write-through: the tier below got the keys as they were submitted.
    assert set(CONTENTS["low"]) >= {(b, 0) for b in blocks}
    assert not {(b, 0) for b in others} & set(CONTENTS["low"])
    with ucm.open(stack(unique_id, {"type": "recording", "space": "low"})) as store:
        buffers = [(ctypes.c_ubyte * SHARD)() for _ in blocks]
        addresses = array("Q", [ctypes.addressof(b) for b in buffers])
        task = store.load_data(blocks, 0, addresses)
        scratch = [(ctypes.c_ubyte * SHARD)() for _ in blocks]
        addresses[:] = array("Q", [ctypes.addressof(b) for b in scratch])
        addresses.extend(range(4096, 4096 + 4096 * 64, 4096))  # may move its memory
        store.wait(task)
        assert [bytes(b) for b in buffers] == [payload(b, 0, SHARD) for b in blocks]
        assert all(bytes(b) == bytes(SHARD) for b in scratch)


_FREE_UNDER_A_WAIT = """
import sys, threading, time
import torch
import ucm

sys.path.insert(0, sys.argv[2])  # the tests' directory, as pytest puts it first
from loadpath import _tiers

_tiers.register()
cold = bytes([7]) * 16
_tiers.CONTENTS["low"] = {(cold, 0): bytes(4096)}
stack = {
    "unique_id": sys.argv[1], "shard_size": 4096, "shards_per_block": 1,
    "tiers": [
        {"type": "buffer", "capacity": 16 * 4096},
        {"type": "recording", "space": "low", "gated": True, "write": "none"},
    ],
}
store = ucm.open(stack)
queue = store._native.queue
entered = _tiers.ENTERED.setdefault("low", threading.Event())
dst = [[torch.zeros(4096, dtype=torch.uint8)]]
job = store.load([cold], 0, dst).completion  # the task's NativeJob: its token
assert entered.wait(60)  # the load's fill is held at the gate: the task does not complete
outcome = []
waiter = threading.Thread(target=lambda: outcome.append(queue.wait(job.token, 3.0)))
waiter.start()
time.sleep(0.5)  # the waiter is inside the native wait
queue.destroy()  # what Store.close does after its drain (here: without one)
waiter.join(60)
print("waiter", outcome, flush=True)
"""


def test_destroy_never_frees_the_queue_under_a_thread_inside_wait(unique_id: str) -> None:
    """A thread inside ``NativeQueue.wait`` when the queue is freed (``Store.close`` beside
    a ``Store.wait`` in another thread: a race) read the freed queue when its native wait
    returned: SIGSEGV. ``destroy`` waits for the threads inside ``wait`` and ``done`` to
    leave (within one wait slice); a wait then answers True: the queue's threads are
    stopped, and the task's unfinished entries read as failed."""
    done = subprocess.run(
        [sys.executable, "-c", _FREE_UNDER_A_WAIT, unique_id, str(Path(__file__).parents[1])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout == "waiter [True]\n", done.stderr
    assert done.returncode == 0, done.stderr
