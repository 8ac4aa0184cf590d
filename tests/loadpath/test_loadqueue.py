"""The load path of one rank: dispatcher order, many tasks in flight, non-blocking check,
TaskError, idle-window Prealloc (Scenario E), repair and promotion, dumps beside loads."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import Any

import pytest
import torch

import ucm
from ucm.errors import TaskError
from ucm.native.buffer import State

from ._tiers import CONTENTS, CORRUPT, ENTERED, GATES, RECORDED, block, payload

SHARD = 4096
BOUND_S = 60.0
"""Bound on a step a test waits for: generous on a busy machine, still a failure on a hang."""


def stack(
    unique_id: str, *lower: dict[str, Any], slots: int = 64, shards: int = 4, **buffer: Any
) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": shards,
        "tiers": [{"type": "buffer", "capacity": slots * SHARD, **buffer}, *lower],
    }


def fill_space(space: str, blocks: list[bytes], shards: range) -> None:
    data = CONTENTS.setdefault(space, {})
    for b in blocks:
        for s in shards:
            data[(b, s)] = payload(b, s, SHARD)


def dst_for(n: int) -> list[list[torch.Tensor]]:
    return [[torch.zeros(SHARD, dtype=torch.uint8)] for _ in range(n)]


def exact(blocks: list[bytes], shard: int | list[int], dst: list[list[torch.Tensor]]) -> bool:
    shards = shard if isinstance(shard, list) else [shard] * len(blocks)
    return all(
        d[0].numpy().tobytes() == payload(b, s, SHARD)
        for b, s, d in zip(blocks, shards, dst, strict=True)
    )


def test_dispatcher_claims_in_rearrange_index_order(test_tiers: None, unique_id: str) -> None:
    blocks = [block(i) for i in range(12)]
    fill_space("low", blocks, range(4))
    lower = {"type": "recording", "space": "low"}
    config = stack(unique_id, lower, load_workers=1)
    with ucm.open(config, device_id=6, local_rank_size=4) as store:  # 6 % 4 = 2
        dst = dst_for(12)
        store.wait(store.load(blocks, 1, dst))
        assert exact(blocks, 1, dst)
    # One loader, one stride per step: the tier below saw the own stride first, then rotation.
    order = [int.from_bytes(b, "big") for b, _ in RECORDED["low"]]
    assert order == [2, 6, 10, 3, 7, 11, 0, 4, 8, 1, 5, 9]


def plain_stack(unique_id: str, *tiers: dict[str, Any], **load: Any) -> dict[str, Any]:
    """A stack without a buffer: the same load engine on a null buffer, tuned by ``load:``."""
    return {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": 4,
        "tiers": list(tiers),
        "load": load,
    }


def test_without_a_buffer_the_loader_sees_rearrange_index_order(
    test_tiers: None, unique_id: str
) -> None:
    blocks = [block(i) for i in range(12)]
    fill_space("low", blocks, range(4))
    config = plain_stack(unique_id, {"type": "recording", "space": "low"}, load_workers=1)
    with ucm.open(config, device_id=6, local_rank_size=4) as store:  # 6 % 4 = 2
        dst = dst_for(12)
        store.wait(store.load(blocks, 1, dst))
        assert exact(blocks, 1, dst)
        assert (store.stats()["hits"], store.stats()["misses"]) == (12, 0)  # the top tier's
    order = [int.from_bytes(b, "big") for b, _ in RECORDED["low"]]
    assert order == [2, 6, 10, 3, 7, 11, 0, 4, 8, 1, 5, 9]
    # Natural order, the baseline: asked of the same queue.
    RECORDED["low"].clear()
    natural = plain_stack(unique_id, {"type": "recording", "space": "low"}, load_workers=1)
    natural["load"]["rearrange"] = False
    with ucm.open(natural, device_id=6, local_rank_size=4) as store:
        store.wait(store.load(blocks, 1, dst_for(12)))
    assert [int.from_bytes(b, "big") for b, _ in RECORDED["low"]] == list(range(12))


def test_with_and_without_a_buffer_the_stack_takes_the_same_settings_model(
    test_tiers: None, unique_id: str
) -> None:
    from ucm.config import LoadSettings

    lower = {"type": "recording", "space": "low"}
    tuned = {"load_workers": 3, "step_keys": 7, "copy_threads": 2, "load_queue_depth": 5}
    with ucm.open(stack(unique_id, lower, **tuned)) as buffered:
        assert type(buffered.settings) is LoadSettings
        assert isinstance(buffered.tiers[0].config, LoadSettings)  # the buffer tier's keys
        with_buffer = buffered.settings.model_dump()
        assert {name: with_buffer[name] for name in tuned} == tuned
        assert buffered.tiers[0].queue.settings == buffered.settings
    with ucm.open(plain_stack(unique_id, lower, **tuned)) as plain:
        assert type(plain.settings) is LoadSettings
        assert plain.settings.model_dump() == with_buffer
        assert plain._native is not None and plain._native.queue.settings is plain.settings
    # The bounds are the native queue's limits, with or without a buffer.
    for config in (
        stack(unique_id, lower, step_keys=1 << 16),
        plain_stack(unique_id, lower, step_keys=1 << 16),
    ):
        with pytest.raises(
            ucm.ConfigError, match=r"step_keys: Input should be less than or equal to 32768"
        ):
            ucm.open(config)
    with pytest.raises(ucm.ConfigError, match=r"load: a stack with a buffer tier takes"):
        ucm.open({**stack(unique_id, lower), "load": {"load_workers": 2}})


def bounded(
    call: Callable[[], Any], what: str, *, timeout_s: float = BOUND_S, gate: str = "low"
) -> Any:
    """``call()`` in another thread, failing the test (not hanging it) past ``timeout_s``;
    then the tier's ``gate`` opens, so that the thread can finish."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(call)
        try:
            return future.result(timeout=timeout_s)
        except FuturesTimeout:
            GATES.setdefault(gate, threading.Event()).set()  # let the thread finish
            raise AssertionError(f"{what} did not return within {timeout_s} s") from None


def test_many_tasks_in_flight_check_does_not_block(test_tiers: None, unique_id: str) -> None:
    blocks = [block(i) for i in range(9)]
    fill_space("low", blocks, range(4))
    lower = {"type": "recording", "space": "low", "gated": True}
    gate = GATES.setdefault("low", threading.Event())
    with ucm.open(stack(unique_id, lower, load_workers=2)) as store:
        dsts = [dst_for(3) for _ in range(3)]
        tasks = [store.load(blocks[3 * t : 3 * t + 3], t, dsts[t]) for t in range(3)]
        # Every load is held at the tier below: check answers without waiting for them.
        states = bounded(lambda: [store.check(task) for task in tasks], "check()")
        assert states == [False, False, False]
        gate.set()
        for task in reversed(tasks):
            store.wait(task)
        assert [store.check(task) for task in tasks] == [True] * 3
        for t in range(3):
            assert exact(blocks[3 * t : 3 * t + 3], t, dsts[t])
        stats = store.stats()
        assert (stats["hits"], stats["misses"], stats["loaded_shards"]) == (0, 9, 9)
        assert stats["load_tasks"] == 3


def test_wait_names_each_failed_key_and_loads_the_others(test_tiers: None, unique_id: str) -> None:
    blocks = [block(i) for i in range(6)]
    fill_space("low", blocks, range(4))
    del CONTENTS["low"][(block(4), 0)]  # missing everywhere
    CORRUPT["low"] = {(block(1), 0)}  # a corrupt copy with nothing below it
    with ucm.open(stack(unique_id, {"type": "recording", "space": "low"})) as store:
        dst = dst_for(6)
        task = store.load(blocks, 0, dst)
        with pytest.raises(TaskError) as info:
            store.wait(task)
        assert set(info.value.failures) == {(block(1), 0), (block(4), 0)}
        message = str(info.value)
        assert message.startswith("2 key(s) failed: ")
        assert f"block {block(1).hex()} shard 0: TierError: corrupt shard in low" in message
        assert f"block {block(4).hex()} shard 0: KeyMissingError: not found in any" in message
        assert store.check(task) is True
        good = [i for i in range(6) if i not in (1, 4)]
        assert exact([blocks[i] for i in good], 0, [dst[i] for i in good])
        # Failed keys are not remembered in the buffer: once the data is back, they load.
        CONTENTS["low"][(block(4), 0)] = payload(block(4), 0, SHARD)
        CORRUPT["low"].clear()
        again = dst_for(2)
        store.wait(store.load([block(1), block(4)], 0, again))
        assert exact([block(1), block(4)], 0, again)
        assert store.stats()["tiers"][0]["commits_failed"] == 2


def test_a_corrupt_copy_is_repaired_from_the_tier_that_served_it(test_tiers: None) -> None:
    tiers = [
        {"type": "recording", "space": "top"},
        {"type": "recording", "space": "nvme"},
        {"type": "recording", "space": "s3", "write": "none"},
    ]
    config = {"unique_id": "rp", "shard_size": 64, "shards_per_block": 1, "tiers": tiers}
    good, torn, missing = block(1), block(2), block(3)
    for b in (good, torn, missing):
        CONTENTS.setdefault("s3", {})[(b, 0)] = payload(b, 0, 64)
    CONTENTS["nvme"] = {(good, 0): payload(good, 0, 64), (torn, 0): b"torn" * 16}
    CORRUPT["nvme"] = {(torn, 0)}
    with ucm.open(config) as store:
        dst = [[torch.zeros(64, dtype=torch.uint8)] for _ in range(3)]
        store.wait(store.load([good, torn, missing], 0, dst))
        assert [d[0].numpy().tobytes() for d in dst] == [
            payload(b, 0, 64) for b in (good, torn, missing)
        ]
        # nvme failed the torn key with an error (not a miss): it gets the good shard back;
        # the plain miss is not written there (nvme has no `promote`), the top tier gets all.
        assert CONTENTS["nvme"][(torn, 0)] == payload(torn, 0, 64)
        assert CORRUPT["nvme"] == set()
        assert (missing, 0) not in CONTENTS["nvme"]
        assert set(CONTENTS["top"]) == {(good, 0), (torn, 0), (missing, 0)}
        stats = store.stats()
        assert stats["repaired_shards"] == 1
        assert stats["tier1_errors"] == 1
        assert stats["promoted_shards"] == 3


def test_repair_below_the_buffer(test_tiers: None, unique_id: str) -> None:
    torn = block(7)
    CONTENTS["nvme"] = {(torn, 2): b"x" * SHARD}
    CORRUPT["nvme"] = {(torn, 2)}
    fill_space("s3", [torn], range(4))
    lower = ({"type": "recording", "space": "nvme"}, {"type": "recording", "space": "s3"})
    with ucm.open(stack(unique_id, *lower)) as store:
        dst = dst_for(1)
        store.wait(store.load([torn], 2, dst))
        assert exact([torn], 2, dst)
        assert CONTENTS["nvme"][(torn, 2)] == payload(torn, 2, SHARD)
        assert store.stats()["repaired_shards"] == 1
        assert store.stats()["tiers"][0]["owned"] == 1


def test_prealloc_prewarms_the_next_index_scenario_e(test_tiers: None, unique_id: str) -> None:
    ids = [block(i) for i in range(4)]  # B0..B3
    fill_space("low", ids, range(3))
    fillers = [block(100 + i) for i in range(8)]
    lower = {"type": "recording", "space": "low"}
    # 8 regular slots (filled below with other data), 4 reserved for Prealloc.
    config = stack(unique_id, lower, slots=8, shards=3, reserved_slots=4, step_keys=4)
    with ucm.open(config) as store:
        store.wait(store.dump(fillers, 0, [[torch.full((SHARD,), 1, dtype=torch.uint8)]] * 8))
        core = store.tiers[0].core
        assert all(core.slot_of((f, 0)) is not None for f in fillers)  # the regular pool is full
        s = 1
        dst = dst_for(3)
        store.wait(store.load(ids[:3], s, dst))  # B0.s, B1.s, B2.s
        assert exact(ids[:3], s, dst)
        deadline = time.monotonic() + 10
        while store.stats().get("prewarmed", 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # the idle window follows the task's completion
        assert store.stats()["prewarmed"] == 3
        for b in ids[:3]:
            slot = core.slot_of((b, s + 1))
            assert slot is not None
            info = core.slot_info(slot)
            assert (info.refcount, info.state, info.preallocated) == (0, State.IDLE, True)
            assert info.reserved  # the regular pool was full
        assert core.slot_of((ids[3], s + 1)) is None  # B3 is not in the task: untouched
        assert store.lookup(ids[:1]) == [True]  # idle prewarmed slots are not data
        assert store.tiers[0].lookup([(ids[0], s + 1)]) == [False]
        before = store.stats()["tiers"][0]["prealloc_hits"]
        dst = dst_for(3)
        store.wait(store.load(ids[:3], s + 1, dst))  # takes the prewarmed slots over
        assert exact(ids[:3], s + 1, dst)
        assert store.stats()["tiers"][0]["prealloc_hits"] - before == 3
        # The last index has no next one: nothing is prewarmed after it.
        deadline = time.monotonic() + 10
        while core.slot_of((ids[0], 2)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        prewarmed = store.stats()["prewarmed"]
        store.wait(store.load(ids[:3], 2, dst_for(3)))
        time.sleep(0.1)
        assert store.stats()["prewarmed"] == prewarmed


def test_prealloc_can_be_switched_off(test_tiers: None, unique_id: str) -> None:
    ids = [block(i) for i in range(3)]
    fill_space("low", ids, range(2))
    config = stack(unique_id, {"type": "recording", "space": "low"}, shards=2, prealloc=False)
    with ucm.open(config) as store:
        store.wait(store.load(ids, 0, dst_for(3)))
        time.sleep(0.1)
        assert store.stats().get("prewarmed", 0) == 0
        assert store.tiers[0].core.slot_of((ids[0], 1)) is None


def test_dumps_do_not_starve_loads(test_tiers: None, unique_id: str) -> None:
    hot = [block(i) for i in range(4)]
    slow = {"type": "recording", "space": "slow", "write": "through", "gated": True}
    gate = GATES.setdefault("slow", threading.Event())
    with ucm.open(stack(unique_id, slow, slots=128)) as store:
        gate.set()
        src = [[torch.full((SHARD,), i, dtype=torch.uint8)] for i in range(4)]
        store.wait(store.dump(hot, 0, src))
        store.drain()
        # The write-through tier now holds every dump at its gate: a backlog that does not
        # drain until the test says so.
        gate.clear()
        entered = ENTERED["slow"]
        entered.clear()
        backlog = [block(50 + i) for i in range(8)]
        dumps = [store.dump([b], 1, [[torch.zeros(SHARD, dtype=torch.uint8)]]) for b in backlog]
        for task in dumps:  # acknowledged once in the buffer, before the write-through

            def acked(task: ucm.Task = task) -> None:
                store.wait(task)

            bounded(acked, "a dump task")
        assert entered.wait(BOUND_S)
        dst = dst_for(4)

        def load_hot() -> None:
            store.wait(store.load(hot, 0, dst))

        bounded(load_hot, "a load behind the write-through backlog")
        assert [int(d[0][0]) for d in dst] == [0, 1, 2, 3]
        assert store.stats()["write_queue_bytes"] > 0  # still held: the load went past it
        gate.set()
        store.drain()
        assert store.stats()["write_queue_bytes"] == 0


def test_a_load_of_buffer_hits_never_waits_behind_prefetches_stalled_below(
    test_tiers: None, unique_id: str
) -> None:
    """A prefetch's step waits for its fills from the tiers below, up to ``wait_timeout_s``.
    Prefetches have a lane of their own, so an engine's load of blocks the buffer holds (a
    memcpy; vLLM's synchronous loads, the bounded gets' pinned copies) is not queued behind
    prefetches held by a stalled tier (a black-holed S3 under vLLM's asynchronous loads)."""
    hot = [block(i) for i in range(4)]
    cold = [block(10 + i) for i in range(4)]
    fill_space("low", hot + cold, range(4))
    lower = {"type": "recording", "space": "low", "gated": True}
    gate = GATES.setdefault("low", threading.Event())
    entered = ENTERED.setdefault("low", threading.Event())
    # wait_timeout_s far past BOUND_S: a load queued behind the prefetches would wait it out.
    with ucm.open(stack(unique_id, lower, slots=128, wait_timeout_s=600.0)) as store:
        gate.set()
        warm = store.prefetch(hot)
        assert warm is not None
        store.wait(warm)
        gate.clear()
        entered.clear()
        held = [store.prefetch([b], background=True) for b in cold]
        assert entered.wait(BOUND_S)  # the first prefetch's fill is held at the gate
        dst = dst_for(4)

        def load_hot() -> None:
            store.wait(store.load(hot, 0, dst))

        bounded(load_hot, "a load of buffer hits behind prefetches held below")
        assert exact(hot, 0, dst)
        assert not any(task is not None and store.check(task) for task in held)
        gate.set()
        for task in held:
            assert task is not None
            store.wait(task)
        dst = dst_for(4)
        store.wait(store.load(cold, 1, dst))  # the prefetches brought them up
        assert exact(cold, 1, dst)
        assert len(RECORDED["low"]) == 4 * 8  # every shard read from below once


def test_a_no_fill_load_fails_a_key_being_filled_instead_of_waiting_for_the_fill(
    test_tiers: None, unique_id: str
) -> None:
    """``fill=False`` (vLLM's synchronous loads: a memcpy at most) never waits on a tier: a
    key that a prefetch of this process is filling from a stalled tier below fails at once,
    missing, instead of waiting for that fill (``wait_timeout_s``, extended while the filler
    is this process's); the keys the buffer holds load byte-exact."""
    hot, cold = block(0), block(1)
    fill_space("low", [hot, cold], range(4))
    lower = {"type": "recording", "space": "low", "gated": True}
    gate = GATES.setdefault("low", threading.Event())
    entered = ENTERED.setdefault("low", threading.Event())
    # wait_timeout_s far past BOUND_S: a load waiting for the held fill would wait it out.
    with ucm.open(stack(unique_id, lower, wait_timeout_s=600.0)) as store:
        gate.set()
        warm = store.prefetch([hot])
        assert warm is not None
        store.wait(warm)
        gate.clear()
        entered.clear()
        held = store.prefetch([cold], background=True)
        assert held is not None
        assert entered.wait(BOUND_S)  # the prefetch owns cold's shards, held at the gate
        dst = dst_for(2)

        def load_no_fill() -> TaskError:
            task = store.load([hot, cold], 0, dst, fill=False)
            with pytest.raises(TaskError) as info:
                store.wait(task)
            return info.value

        error = bounded(load_no_fill, "a fill=False load of a key being filled below")
        assert set(error.failures) == {(cold, 0)}
        assert str(error) == (
            f"1 key(s) failed: block {cold.hex()} shard 0: KeyMissingError: not in the buffer"
        )
        assert exact([hot], 0, dst[:1])
        assert not store.check(held)  # still held at the gate: nothing waited for it
        gate.set()
        store.wait(held)
        dst = dst_for(2)
        store.wait(store.load([hot, cold], 0, dst, fill=False))  # brought up: both in the buffer
        assert exact([hot, cold], 0, dst)
        assert len(RECORDED["low"]) == 2 * 4  # every shard read from below once


def test_prefetches_stalled_below_never_take_every_task_record_from_the_loads(
    test_tiers: None, unique_id: str
) -> None:
    """A prefetch step that waited ``wait_timeout_s`` for its fills moves on, and its task
    stays in flight until the stalled tier answers: an engine that keeps prefetching holds
    more and more task records. They come from one pool (``QUEUE_TASKS_MAX``) shared by the
    three lanes: each lane holds at most ``QUEUE_LANE_DEPTH_MAX`` tasks in flight, so a load
    of blocks the buffer holds still finds a record (its submit does not time out)."""
    from ucm.native import _abi

    per_lane, records = _abi.QUEUE_LANE_DEPTH_MAX, _abi.QUEUE_TASKS_MAX
    hot = block(0)
    cold = [block(1 + i) for i in range(records)]
    fill_space("low", [hot, *cold], range(1))
    lower = {"type": "recording", "space": "low", "gated": True}
    gate = GATES.setdefault("low", threading.Event())
    entered = ENTERED.setdefault("low", threading.Event())
    config = stack(
        unique_id, lower, slots=records + 512, shards=1, wait_timeout_s=0.01, load_workers=1
    )
    with ucm.open(config) as store:
        gate.set()
        warm = store.prefetch([hot])
        assert warm is not None
        store.wait(warm)
        gate.clear()
        entered.clear()
        held = []
        refused = 0
        for b in cold:  # one key each: its slot is owned, its fill held at the gate
            try:
                task = store.prefetch([b], background=True, submit_timeout_s=2.0)
            except TimeoutError as exc:
                assert "prefetch queue stayed full" in str(exc)
                refused += 1
                break
            assert task is not None
            held.append(task)
        assert entered.is_set()
        dst = dst_for(1)
        # The load lane is empty: its submit takes a record at once (10 s: a generous bound).
        store.wait(store.load([hot], 0, dst, fill=False, submit_timeout_s=10.0))
        assert exact([hot], 0, dst)
        assert refused == 1
        assert len(held) == per_lane
        assert not any(store.check(task) for task in held)
        gate.set()
        for task in held:
            store.wait(task, timeout_s=BOUND_S)


_EXIT_SCRIPT = """
import sys, threading, time
import torch
import ucm

sys.path.insert(0, sys.argv[3])  # the tests' directory, as pytest puts it first
from loadpath import _tiers

_tiers.register()
unique_id, close = sys.argv[1], sys.argv[2] == "close"
cold = bytes([7]) * 16
_tiers.CONTENTS["low"] = {(cold, s): bytes(4096) for s in range(4)}
stack = {
    "unique_id": unique_id, "shard_size": 4096, "shards_per_block": 4,
    "tiers": [
        {"type": "buffer", "capacity": 64 * 4096, "queue_timeout_s": 2.0},
        {"type": "recording", "space": "low", "gated": True},
    ],
}
store = ucm.open(stack)
entered = _tiers.ENTERED.setdefault("low", threading.Event())
held = store.prefetch([cold])  # its fill stays at the gate: the tier never answers
assert entered.wait(60)
load = store.load([cold], 0, [[torch.zeros(4096, dtype=torch.uint8)]])
time.sleep(0.3)  # the load's dispatcher waits on the slot the prefetch fills
assert not store.check(load)
if close:
    store.close()  # gives up on the tasks after queue_timeout_s, leaving the queue running
print("exiting", flush=True)
"""


@pytest.mark.parametrize("close", ["close", "no-close"])
def test_a_process_exits_cleanly_while_a_load_waits_on_a_fill_held_below(
    unique_id: str, close: str
) -> None:
    """A process that exits (after ``close()`` gave up on stalled tasks, or without it) while
    a load's dispatcher waits on a slot that a fill from a stalled tier holds: the native
    threads stop before the shared memory is unmapped at exit (they read it: SIGSEGV)."""
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, unique_id, close, str(Path(__file__).parents[1])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout == "exiting\n", done.stderr
    assert done.returncode == 0, done.stderr


def test_a_full_load_queue_times_out_naming_the_knob(test_tiers: None, unique_id: str) -> None:
    blocks = [block(i) for i in range(4)]
    fill_space("low", blocks, range(4))
    lower = {"type": "recording", "space": "low", "gated": True}
    gate = GATES.setdefault("low", threading.Event())
    config = stack(unique_id, lower, load_queue_depth=1, queue_timeout_s=0.1, load_workers=1)
    with ucm.open(config) as store:
        tasks = [store.load([blocks[0]], 0, dst_for(1))]
        # Taken by the dispatcher once its load reaches the tier below (held at the gate).
        assert ENTERED.setdefault("low", threading.Event()).wait(BOUND_S)
        tasks.append(store.load([blocks[1]], 0, dst_for(1)))  # fills the queue
        with pytest.raises(TimeoutError, match="raise load_queue_depth / queue_timeout_s"):
            store.load([blocks[2]], 0, dst_for(1))
        gate.set()
        for task in tasks:
            store.wait(task)


def test_a_full_load_queue_without_a_buffer_times_out_naming_the_knob(
    test_tiers: None, unique_id: str
) -> None:
    blocks = [block(i) for i in range(4)]
    fill_space("low", blocks, range(4))
    lower = {"type": "recording", "space": "low", "gated": True}
    gate = GATES.setdefault("low", threading.Event())
    config = plain_stack(unique_id, lower, load_queue_depth=1, queue_timeout_s=0.1, load_workers=1)
    with ucm.open(config) as store:
        tasks = [store.load([blocks[0]], 0, dst_for(1))]
        assert ENTERED.setdefault("low", threading.Event()).wait(BOUND_S)
        tasks.append(store.load([blocks[1]], 0, dst_for(1)))  # fills the queue
        with pytest.raises(TimeoutError, match="raise load_queue_depth / queue_timeout_s"):
            store.load([blocks[2]], 0, dst_for(1))
        gate.set()
        for task in tasks:
            store.wait(task)


def test_raw_pointer_load_through_the_buffer(test_tiers: None, unique_id: str) -> None:
    import ctypes

    fill_space("low", [block(1)], range(4))
    config = stack(unique_id, {"type": "recording", "space": "low"})
    config["tensor_size_list"] = [1000, 3096]
    del config["shard_size"]
    with ucm.open(config) as store:
        first, second = (ctypes.c_ubyte * 1000)(), (ctypes.c_ubyte * 3096)()
        ptrs = [[ctypes.addressof(first), ctypes.addressof(second)]]
        for _ in range(2):  # cold (owner), then a hit
            store.wait(store.load_data([block(1)], [3], ptrs))
            assert bytes(first) + bytes(second) == payload(block(1), 3, SHARD)
        assert (store.stats()["hits"], store.stats()["misses"]) == (1, 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_cuda_destinations_copy_from_registered_buffer_memory(
    test_tiers: None, unique_id: str
) -> None:
    blocks = [block(i) for i in range(8)]
    fill_space("low", blocks, range(4))
    with ucm.open(stack(unique_id, {"type": "recording", "space": "low"})) as store:
        for _ in range(2):  # cold, then hits
            dst = [[torch.zeros(SHARD, dtype=torch.uint8, device="cuda")] for _ in blocks]
            store.wait(store.load(blocks, 2, dst))
            assert all(
                d[0].cpu().numpy().tobytes() == payload(b, 2, SHARD)
                for b, d in zip(blocks, dst, strict=True)
            )
        assert store._native is not None and store._native._cuda is not None
        assert store.stats().get("cuda_register_failures", 0) == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_cuda_dump_then_load_round_trip(test_tiers: None, unique_id: str, tmp_path: Path) -> None:
    lower = {"type": "posix", "path": str(tmp_path / "nvme")}
    with ucm.open(stack(unique_id, lower)) as store:
        src = [[torch.arange(SHARD, device="cuda").to(torch.uint8)] for _ in range(3)]
        ids = [block(i) for i in range(3)]
        store.wait(store.dump(ids, 0, src))
        dst = [[torch.zeros(SHARD, dtype=torch.uint8, device="cuda")] for _ in ids]
        store.wait(store.load(ids, 0, dst))
        assert all(torch.equal(s[0], d[0]) for s, d in zip(src, dst, strict=True))


def test_write_through_snapshots_reuse_their_buffers_byte_exact_and_bounded() -> None:
    """The write-through writer's snapshots go into reused buffers (a fresh one costs a zero
    fill and new pages): 32 shards in 8 rounds through 4 buffers, every shard written with its
    own bytes, never a reused buffer's old ones; at most the backlog's bound is kept."""
    from collections import Counter

    from ucm.loadqueue import WriteQueue

    written: list[bytes] = []
    buffers: list[object] = []  # kept alive: a fresh buffer can never take a freed one's id

    class Recording:
        def dump(self, keys: list[Any], views: list[list[memoryview]]) -> list[None]:
            for shard in views:
                written.append(bytes(shard[0]))
                buffers.append(shard[0].obj)
            return [None] * len(keys)

    counts: Counter[str] = Counter()

    def count(name: str, amount: int = 1) -> None:
        counts[name] += amount

    writer = WriteQueue(4 * SHARD, count)
    try:
        for round_ in range(8):
            # Two views per shard: the snapshot joins them.
            src = [[memoryview(bytes([round_ * 4 + i]) * (SHARD // 2))] * 2 for i in range(4)]
            keys = [(block(i), 0) for i in range(4)]
            assert writer.put([Recording()], keys, src) == 4  # type: ignore[list-item]
            writer.drain()
        assert written == [bytes([r * 4 + i]) * SHARD for r in range(8) for i in range(4)]
        assert len({id(buffer) for buffer in buffers}) == 4
        assert counts == Counter({"write_through_shards": 32, "write_through_failures": 0})
        # A dump larger than the bound is taken whole by an empty backlog; only the bound's
        # worth of its buffers is kept afterwards.
        big = [[memoryview(bytes([200 + i]) * SHARD)] for i in range(6)]
        assert writer.put([Recording()], [(block(i), 1) for i in range(6)], big) == 6  # type: ignore[list-item]
        writer.drain()
        assert written[-6:] == [bytes([200 + i]) * SHARD for i in range(6)]
        assert writer._free_bytes == 4 * SHARD
    finally:
        writer.close()
