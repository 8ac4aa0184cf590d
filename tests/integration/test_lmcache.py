"""UCM as LMCache's storage plugin, against the real lmcache 0.5.6 package: built by LMCache's
StorageManager from its config, driven through StorageManager and LMCacheEngine (with a CPU
implementation of LMCache's GPU connector), by two LMCache worker processes of one node, through
the seed-003 removal cases, a corrupt shard below and bad configs. Ref counts are asserted
exactly: a plugin that writes asynchronously must hold its own reference until written."""

from __future__ import annotations

import functools
import gc
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import pytest

try:
    with warnings.catch_warnings():
        # Each LMCache logger gets a handler opentelemetry deprecates; not ours to fix.
        warnings.simplefilter("ignore", DeprecationWarning)
        import lmcache  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs every engine (tools/install-test-env): a missing one fails
    pytest.skip(
        "lmcache is not installed (bash tools/install-test-env installs it)",
        allow_module_level=True,
    )

import torch

import ucm
from ucm.layout import Key
from ucm.ranks import RankGroup
from ucm.tier import Outcome, ShardViews, chunks, scatter

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from . import _lmcache as lm

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning"),
]

Register = Callable[[object, str], None]


@pytest.fixture
def unique_id() -> str:
    return f"lmc-{uuid.uuid4().hex[:12]}"


def buffer_over_posix(unique_id: str, path: Path, slots: int = 256) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "tiers": [
            {"type": "buffer", "capacity": slots * lm.CHUNK_BYTES},
            {"type": "posix", "path": str(path), "write": "through"},
        ],
    }


@pytest.fixture
def manager(unique_id: str, tmp_path: Path) -> Iterator[Any]:
    """LMCache's StorageManager with its LocalCPUBackend (L1) and UCM (buffer over posix)."""
    sm = lm.storage_manager(lm.config(buffer_over_posix(unique_id, tmp_path)), lm.metadata())
    yield sm
    sm.close()


def _store(sm: Any, hashes: Sequence[int]) -> list[Any]:
    keys = [lm.key(h) for h in hashes]
    sm.batched_put(keys, [lm.filled(sm, h) for h in hashes])
    assert sm.storage_backends["ucm"].flush(timeout_s=60)
    return keys


# ---- StorageManager: store, drop L1, retrieve from UCM -------------------------------------------


def test_storage_manager_builds_the_plugin_and_retrieves_byte_exact(manager: Any) -> None:
    backend = manager.storage_backends["ucm"]
    assert type(backend).__name__ == "UcmStorageBackend" and str(backend) == "UcmStorageBackend"
    assert list(manager.storage_backends) == ["LocalCPUBackend", "ucm"]
    # The stack's geometry comes from LMCache: one chunk of one worker per shard.
    assert backend.store.config.tensor_size_list == [lm.CHUNK_BYTES]
    assert backend.store.config.shards_per_block == 1
    assert backend.get_allocator_backend() is manager.storage_backends["LocalCPUBackend"]
    baseline = lm.active_allocations(manager)

    hashes = list(range(10, 18))
    keys = _store(manager, hashes)
    assert [backend.exists_in_put_tasks(k) for k in keys] == [False] * 8
    assert manager.batched_contains(keys) == (8, {"LocalCPUBackend": keys})
    # Drop the L1 copy: LMCache now finds every chunk in UCM only.
    assert manager.batched_remove(keys, locations=["LocalCPUBackend"]) == 8
    assert lm.active_allocations(manager) == baseline
    assert manager.contains(keys[0]) == "ucm"
    assert manager.batched_contains(keys) == (8, {"ucm": keys})
    # batched_contains is a prefix count: a gap stops it.
    gap = [*keys[:3], lm.key(999), *keys[3:]]
    assert backend.batched_contains(gap) == 3
    assert backend.batched_contains([]) == 0

    got = manager.batched_get(keys, location="ucm")
    assert [lm.content(obj) == lm.chunk_bytes(h) for obj, h in zip(got, hashes, strict=True)] == [
        True
    ] * 8
    # The caller's reference plus the L1 write-back LMCache makes after a get from below.
    assert [obj.get_ref_count() for obj in got] == [2] * 8
    assert lm.active_allocations(manager) == baseline + 8
    for obj in got:
        obj.ref_count_down()
    assert [obj.get_ref_count() for obj in got] == [1] * 8  # held by L1 only

    # A single blocking get, a miss, and a batch with a miss in the middle.
    manager.batched_remove(keys, locations=["LocalCPUBackend"])
    single = backend.get_blocking(keys[2])
    assert lm.content(single) == lm.chunk_bytes(12) and single.get_ref_count() == 1
    single.ref_count_down()
    assert backend.get_blocking(lm.key(999)) is None
    mixed = backend.batched_get_blocking([keys[0], lm.key(999), keys[1]])
    assert mixed[1] is None
    assert [lm.content(mixed[0]), lm.content(mixed[2])] == [lm.chunk_bytes(10), lm.chunk_bytes(11)]
    for obj in (mixed[0], mixed[2]):
        obj.ref_count_down()
    assert lm.active_allocations(manager) == baseline  # misses freed their allocation
    # The same chunk twice in one batch: one load, one object, two references.
    twice = backend.batched_get_blocking([keys[4], keys[4]])
    assert twice[0] is twice[1] and twice[0].get_ref_count() == 2
    assert lm.content(twice[0]) == lm.chunk_bytes(14)
    twice[0].ref_count_down()
    twice[0].ref_count_down()
    assert lm.active_allocations(manager) == baseline
    counters = backend.stats()["lmcache"]
    assert counters["put_chunks_stored"] == 8 and counters["get_hits"] == 13
    assert counters["get_misses"] == 2 and counters["puts_in_flight"] == 0


def test_put_futures_and_callbacks_then_a_second_put_writes_nothing(manager: Any) -> None:
    backend = manager.storage_backends["ucm"]
    # Straight through the interface: one future per chunk, a callback per stored key.
    keys = [lm.key(1), lm.key(2)]
    objs = [lm.filled(manager, 1), lm.filled(manager, 2)]
    called: list[Any] = []
    futures = backend.batched_submit_put_task(keys, objs, on_complete_callback=called.append)
    assert [future.result(timeout=60) for future in futures] == [True, True]
    assert called == keys
    assert [obj.get_ref_count() for obj in objs] == [1, 1]  # the plugin's reference is gone
    for obj in objs:
        obj.ref_count_down()
    again = [lm.filled(manager, 1), lm.filled(manager, 2)]
    assert backend.batched_submit_put_task(keys, again) is None
    assert [obj.get_ref_count() for obj in again] == [1, 1]  # no reference kept
    for obj in again:
        obj.ref_count_down()
    counters = backend.stats()["lmcache"]
    assert counters["put_chunks_present"] == 2 and counters["put_chunks_submitted"] == 2


def test_scheduler_role_answers_lookups_only(unique_id: str, tmp_path: Path) -> None:
    stack = buffer_over_posix(unique_id, tmp_path)
    worker = lm.storage_manager(lm.config(stack), lm.metadata())
    scheduler = lm.storage_manager(lm.config(stack), lm.metadata(role="scheduler"))
    try:
        keys = _store(worker, [5, 6])
        plugin = scheduler.storage_backends["ucm"]
        assert plugin.store.device_id < 0 and plugin.local_cpu_backend is None
        assert plugin.batched_contains([*keys, lm.key(7)]) == 2
        with pytest.raises(ucm.RoleError, match="not allowed on LMCache's scheduler"):
            plugin.get_blocking(keys[0])
    finally:
        scheduler.close()
        worker.close()


# ---- ref counts: the plugin's own reference while it writes --------------------------------------


class GateTierConfig(ucm.LowerTierConfig):
    type: Literal["gate"]


class GateTier(ucm.Tier):
    """A dict tier whose dumps wait for ``GATE``: a write that is still in flight, on demand."""

    type_name = "gate"
    config_model = GateTierConfig
    GATE = threading.Event()
    ENTERED = threading.Event()

    def __init__(self, config: ucm.TierConfig, context: ucm.TierContext) -> None:
        super().__init__(config, context)
        self._shards: dict[Key, bytes] = {}

    def lookup(self, keys: Sequence[Key]) -> list[bool]:
        return [key in self._shards for key in keys]

    def load(self, keys: Sequence[Key], destinations: Sequence[ShardViews]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for key, views in zip(keys, destinations, strict=True):
            if key in self._shards:
                scatter(self._shards[key], views)
                outcomes.append(None)
            else:
                outcomes.append(ucm.KeyMissingError("not in the gate tier"))
        return outcomes

    def dump(self, keys: Sequence[Key], sources: Sequence[ShardViews]) -> list[Outcome]:
        self.ENTERED.set()
        assert self.GATE.wait(timeout=60), "the test never opened the gate"
        self._shards.update((k, b"".join(v)) for k, v in zip(keys, sources, strict=True))
        return [None] * len(keys)

    def touch(self, block_ids: Sequence[bytes]) -> None:
        pass

    def batched_remove(self, keys: Sequence[Key], force: bool = False) -> int:
        removed = 0
        for part in chunks(list(dict.fromkeys(keys))):
            for key in part:
                removed += self._shards.pop(key, None) is not None
        return removed

    def stats(self) -> dict[str, int | float]:
        return {"hits": 0, "misses": 0, "remove_lock_acquisitions": 0}


class GatePlugin:
    @ucm.hookimpl
    def register_tiers(self, register: Callable[[type[ucm.Tier]], None]) -> None:
        register(GateTier)


@pytest.mark.parametrize("local_cpu", [True, False], ids=["with-L1", "allocator-only"])
def test_a_put_holds_its_own_reference_until_written(
    register_plugin: Register, unique_id: str, local_cpu: bool
) -> None:
    """StorageManager.batched_put drops its reference right after handing the objects over; the
    plugin holds one of its own until UCM has the bytes. With L1 off (allocator only), the
    plugin's reference is the object's last one: freed after the write, never twice. Over a
    CacheBuffer that writes through, a put is not staged and its dump reads the object: here
    the dump waits for write-through room (one shard of backlog, held at the gate)."""
    register_plugin(GatePlugin(), "gate-plugin")
    GateTier.GATE.clear()
    GateTier.ENTERED.clear()
    buffer = {
        "type": "buffer",
        "capacity": "4MiB",
        "write_queue_bytes": lm.CHUNK_BYTES,  # the first chunk's write-through fills it
        "write_through_wait_s": 60.0,  # a dump waits that long for write-through room
    }
    stack = {"unique_id": unique_id, "tiers": [buffer, {"type": "gate", "write": "through"}]}
    sm = lm.storage_manager(lm.config(stack, local_cpu=local_cpu), lm.metadata())
    try:
        backend = sm.storage_backends["ucm"]
        sm.batched_put([lm.key(9)], [lm.filled(sm, 9)])  # in the buffer; held at the gate
        assert GateTier.ENTERED.wait(timeout=60)
        deadline = time.monotonic() + 60
        while backend.exists_in_put_tasks(lm.key(9)) and time.monotonic() < deadline:
            time.sleep(0.01)  # its put ends once in the buffer; its reference goes after
        assert not backend.exists_in_put_tasks(lm.key(9))
        baseline = lm.active_allocations(sm)
        keys = [lm.key(h) for h in (1, 2, 3)]
        objs = [lm.filled(sm, h) for h in (1, 2, 3)]
        with lm.lmcache_logs() as logs:
            sm.batched_put(keys, objs)  # its dump waits for write-through room
            held = 2 if local_cpu else 1  # (L1) + this plugin; LMCache's own is gone
            assert [obj.get_ref_count() for obj in objs] == [held] * 3
            assert [backend.exists_in_put_tasks(k) for k in keys] == [True] * 3
            # The same chunks again while in flight: not written twice, no extra reference.
            assert backend.batched_submit_put_task(keys, objs) is None
            assert [obj.get_ref_count() for obj in objs] == [held] * 3
            GateTier.GATE.set()
            assert backend.flush(timeout_s=60)
            assert [obj.get_ref_count() for obj in objs] == [held - 1] * 3
            assert [backend.exists_in_put_tasks(k) for k in keys] == [False] * 3
            expected = baseline + (3 if local_cpu else 0)
            assert lm.active_allocations(sm) == expected
        assert not [m for m in logs.messages() if "Double free" in m or "negative" in m]
        got = backend.batched_get_blocking(keys)
        assert [lm.content(g) for g in got] == [lm.chunk_bytes(h) for h in (1, 2, 3)]
        for g in got:
            g.ref_count_down()
        assert lm.active_allocations(sm) == expected
    finally:
        GateTier.GATE.set()
        sm.close()


@pytest.mark.parametrize("local_cpu", [True, False], ids=["with-L1", "allocator-only"])
def test_a_staged_put_drops_its_reference_before_it_returns(
    register_plugin: Register, unique_id: str, local_cpu: bool
) -> None:
    """Without a CacheBuffer a put is staged: its chunk is copied into UCM's staging slots and
    the plugin's reference dropped before batched_submit_put_task returns, so a tier that
    holds the write holds none of LMCache's memory. With L1 off the chunks are freed at once,
    and new chunks are allocated (and may take that memory) while the tier still holds the
    write; the bytes stored are still the ones put."""
    register_plugin(GatePlugin(), "gate-plugin")
    GateTier.GATE.clear()
    GateTier.ENTERED.clear()
    stack = {"unique_id": unique_id, "tiers": [{"type": "gate"}]}
    sm = lm.storage_manager(lm.config(stack, local_cpu=local_cpu), lm.metadata())
    try:
        backend = sm.storage_backends["ucm"]
        baseline = lm.active_allocations(sm)
        keys = [lm.key(h) for h in (1, 2, 3)]
        objs = [lm.filled(sm, h) for h in (1, 2, 3)]
        with lm.lmcache_logs() as logs:
            sm.batched_put(keys, objs)
            assert GateTier.ENTERED.wait(timeout=60)  # the tier holds the write
            held = 1 if local_cpu else 0  # (L1); neither LMCache's nor this plugin's
            assert [obj.get_ref_count() for obj in objs] == [held] * 3
            assert lm.active_allocations(sm) == baseline + (3 if local_cpu else 0)
            assert [backend.exists_in_put_tasks(k) for k in keys] == [True] * 3
            assert backend.batched_submit_put_task(keys, objs) is None  # not written twice
            others = [lm.filled(sm, h) for h in (4, 5, 6)]  # may reuse the freed memory
            GateTier.GATE.set()
            assert backend.flush(timeout_s=60)
            assert [backend.exists_in_put_tasks(k) for k in keys] == [False] * 3
            for obj in others:
                obj.ref_count_down()
        assert not [m for m in logs.messages() if "Double free" in m or "negative" in m]
        got = backend.batched_get_blocking(keys)
        assert [lm.content(g) for g in got] == [lm.chunk_bytes(h) for h in (1, 2, 3)]
        for g in got:
            g.ref_count_down()
        assert backend.stats()["lmcache"]["put_chunks_stored"] == 3
    finally:
        GateTier.GATE.set()
        sm.close()


def test_puts_a_tier_holds_never_take_the_memory_a_retrieve_needs(
    register_plugin: Register, unique_id: str
) -> None:
    """Without a CacheBuffer, a put held its MemoryObj (a reference of the plugin's own) until
    the tier had the bytes, and L1 cannot evict a chunk so held. A tier that holds every
    write (a hung NFS) then held all of LMCache's CPU memory, and a blocking retrieve, which
    LMCache lets wait for memory (``busy_loop``), waited for it forever: the engine's load
    hung. Such puts are now staged (they hold UCM's staging slots, none of LMCache's memory)
    and capped at half of that memory in chunks; past it, a put is skipped (counted), and the
    retrieve gets memory at once."""
    from ucm.integration.lmcache import PUT_MEMORY_SHARE

    register_plugin(GatePlugin(), "gate-plugin")
    GateTier.GATE.clear()
    GateTier.ENTERED.clear()
    stack = {"unique_id": unique_id, "tiers": [{"type": "gate"}]}
    sm = lm.storage_manager(lm.config(stack, cpu_gb=0.002), lm.metadata())
    backend = sm.storage_backends["ucm"]
    meta = sm.metadata
    objs = []
    for _ in range(10_000):  # bounded: 2 MB of 8 KiB chunks
        obj = sm.allocate(meta.get_shapes(), meta.get_dtypes(), busy_loop=False, eviction=False)
        if obj is None:
            break
        objs.append(obj)
    keys = [lm.key(1000 + n) for n in range(len(objs))]
    outcome: list[Any] = []
    getter = threading.Thread(
        target=lambda: outcome.append(backend.batched_get_blocking([lm.key(7)])), daemon=True
    )
    try:
        assert len(objs) >= 64
        sm.batched_put(keys, objs)  # L1 and UCM; the gate holds UCM's writes
        assert GateTier.ENTERED.wait(timeout=60)
        getter.start()
        getter.join(30)  # the retrieve evicts an L1 chunk that no put holds
        assert not getter.is_alive(), "the retrieve waited for memory the held puts keep"
        assert outcome == [[None]]  # the gate holds no loads: key 7 is simply not there
        counted = backend.stats()["lmcache"]
        size = sm.storage_backends["LocalCPUBackend"].memory_allocator.size
        held = int(size * PUT_MEMORY_SHARE) // lm.CHUNK_BYTES
        assert counted["puts_in_flight"] == held
        assert counted["put_skipped_memory"] == len(objs) - held
    finally:
        GateTier.GATE.set()
        getter.join(60)
        sm.close()


def test_close_leaves_puts_a_tier_holds_running_after_queue_timeout_s(
    unique_id: str, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """LMCache closes its storage backends at shutdown, LocalCPUBackend first: that frees
    LMCache's CPU memory before this plugin is closed. Without a CacheBuffer a put was written
    into the tier from that memory, and the plugin's close waited up to 600 s for a tier that
    held it (a hung NFS). On the code before, the process died of a segmentation fault once
    the tier answered (here the 60 s timer opens the gate): the tier read freed memory. Now
    such a put is staged (its chunk copied into UCM's staging slots when it is submitted), and
    close waits the stack's ``queue_timeout_s``, as the store's close does, then leaves the
    write running; once the tier answers, the bytes stored are the chunks'."""
    from loadpath import _tiers
    from loadpath._tiers import CONTENTS, ENTERED, GATES

    _tiers.register()
    space = f"lmc-close-{uuid.uuid4().hex[:8]}"
    gate = GATES[space] = threading.Event()
    ENTERED[space] = threading.Event()
    stack = {
        "unique_id": unique_id,
        "load": {"queue_timeout_s": 1.0},
        "tiers": [{"type": "recording", "space": space, "gated": True}],
    }
    opener = threading.Timer(60.0, gate.set)  # bounds the wait of the code before
    opener.start()
    sm = lm.storage_manager(lm.config(stack), lm.metadata())
    try:
        backend = sm.storage_backends["ucm"]
        hashes = (1, 2, 3)
        keys = [lm.key(h) for h in hashes]
        sm.batched_put(keys, [lm.filled(sm, h) for h in hashes])
        assert ENTERED[space].wait(timeout=60)  # the tier holds the write
        with caplog.at_level("ERROR", logger="ucm.integration.lmcache"):
            sm.close()  # LocalCPUBackend first, then the plugin
        assert not gate.is_set(), "close waited for the tier"
        assert [r.getMessage() for r in caplog.records if r.name == "ucm.integration.lmcache"] == [
            "UCM: 3 LMCache chunk(s) still being written after 1 s (queue_timeout_s) at close: "
            "their writes go on until the tier answers"
        ]
        assert "ucm: a dump still running after 1.0 s at close (a tier holds its write); " in (
            capfd.readouterr().err
        )
        gate.set()  # the tier answers: the put left running ends and releases its chunk
        deadline = time.monotonic() + 60
        while backend.stats()["lmcache"]["puts_in_flight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        counted = backend.stats()["lmcache"]
        assert (counted["puts_in_flight"], counted["put_chunks_stored"]) == (0, 3)
        stored = CONTENTS[space]
        assert [stored[backend.ucm_key(k)] for k in keys] == [lm.chunk_bytes(h) for h in hashes]
    finally:
        opener.cancel()
        gate.set()
        sm.close()
        _tiers.unregister()


CLOSE_WITH_A_QUEUED_PUT = r"""
import json, sys, threading, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import _lmcache as lm
from loadpath import _tiers
from loadpath._tiers import CONTENTS, ENTERED, GATES

_tiers.register()
queue_timeout_s = float(sys.argv[4])
gate_s = None if sys.argv[5] == "after-close" else float(sys.argv[5])
space = "queued"
gate = GATES[space] = threading.Event()
ENTERED[space] = threading.Event()
buffer = {
    "type": "buffer",
    "capacity": "4MiB",
    "queue_timeout_s": queue_timeout_s,
    "write_queue_bytes": lm.CHUNK_BYTES,  # the first chunk's write-through fills it
    "write_through_wait_s": 60.0,  # a dump waits that long for write-through room
}
lower = {"type": "recording", "space": space, "gated": True, "write": "through"}
stack = {"unique_id": sys.argv[3], "tiers": [buffer, lower]}
sm = lm.storage_manager(lm.config(stack), lm.metadata())
backend = sm.storage_backends["ucm"]
sm.batched_put([lm.key(9)], [lm.filled(sm, 9)])  # in the buffer; its write-through held
assert ENTERED[space].wait(60)
first, queued = [1, 2, 3], [4, 5, 6]
# The dump thread takes the first batch and waits for write-through room; the second batch
# waits in the dump queue, its chunks not read yet.
sm.batched_put([lm.key(h) for h in first], [lm.filled(sm, h) for h in first])
sm.batched_put([lm.key(h) for h in queued], [lm.filled(sm, h) for h in queued])
if gate_s is not None:
    threading.Timer(gate_s, gate.set).start()
sm.close()  # LocalCPUBackend (it frees LMCache's CPU memory), then the plugin
closed_before_gate = not gate.is_set()
gate.set()  # the tier answers (at once, if the timer has not opened it yet)
stored = CONTENTS[space]
wanted = [backend.ucm_key(lm.key(h)) for h in [9] + first + queued]
for _ in range(600):  # the dumps a tier still held at close go on once it answers
    if all(key in stored for key in wanted) or not backend._in_flight:
        break
    time.sleep(0.1)
exact = [stored.get(key) == lm.chunk_bytes(h) for key, h in zip(wanted, [9] + first + queued)]
wrong = [key in stored and not right for key, right in zip(wanted, exact)]
print(
    json.dumps(
        {
            "exact": exact,
            "wrong": wrong,
            "in_flight": len(backend._in_flight),
            "closed_before_gate": closed_before_gate,
        }
    ),
    flush=True,
)
"""


CLOSE_WITH_A_LOAD_RUNNING = r"""
import json, sys, threading, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import _lmcache as lm
from loadpath import _tiers

_tiers.register()
slow = {"type": "slowposix", "path": sys.argv[4], "delay_s": 1.5}  # a load of 1 chunk: 1.5 s
stack = {"unique_id": sys.argv[3], "tiers": [slow]}
sm = lm.storage_manager(lm.config(stack), lm.metadata())
backend = sm.storage_backends["ucm"]
keys = [lm.key(h) for h in (1, 2)]
sm.batched_put(keys, [lm.filled(sm, h) for h in (1, 2)])
assert backend.flush(60)
got = []
loader = threading.Thread(target=lambda: got.extend(backend.batched_get_blocking(keys[:1])))
loader.start()
time.sleep(0.3)  # the load is reading its shard
sm.close()  # LocalCPUBackend (it frees LMCache's CPU memory), then the plugin
loader.join(60)
# A hit (its bytes are not read: the object's memory is LMCache's, freed by now).
print(json.dumps({"hits": [obj is not None for obj in got]}), flush=True)
"""


def test_lmcaches_close_frees_its_memory_only_once_the_gets_have_written_it(
    unique_id: str, tmp_path: Path
) -> None:
    """The same close order against a get: a get that is still reading from a tier when
    LMCache shuts down copies the chunk into a MemoryObj of LMCache's once it arrives (within
    ``load_deadline_s``). On the code before, LMCache had freed that memory by then: the
    process died of a segmentation fault. Now LocalCPUBackend's close waits for the gets
    running first (``load_deadline_s`` plus the stack's ``queue_timeout_s`` at most), and the
    get returns its hit before the memory goes."""
    tests = Path(__file__).resolve().parent
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            CLOSE_WITH_A_LOAD_RUNNING,
            str(tests),
            str(tests.parent),
            unique_id,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"hits": [True]}


def test_lmcaches_close_frees_its_memory_only_once_the_puts_have_read_it(unique_id: str) -> None:
    """LMCache's ``StorageManager.close()`` closes LocalCPUBackend, which frees LMCache's CPU
    memory, before the storage plugins. Over a CacheBuffer that writes through, a put is not
    staged: its dump reads the chunk until the buffer has it. Here a put's dump waits in the
    dump queue at shutdown (the dump thread waits for write-through room behind a gated
    tier, opened 2 s into the close). On the code before, LMCache freed the memory at once
    and the queued dump then read it: the process died of a segmentation fault (the same
    happened without any gate to 48 chunks of 2 MiB put just before ``close()``). Now
    LocalCPUBackend's close waits for the plugin's puts first, and every chunk is written
    through byte-exact. In a process of its own: the code before kills it."""
    done = _run_close_with_a_queued_put(unique_id, queue_timeout_s=60.0, gate_s=2.0)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "exact": [True] * 7,
        "wrong": [False] * 7,
        "in_flight": 0,
        "closed_before_gate": False,
    }


def test_lmcaches_memory_stays_mapped_when_a_put_reads_it_past_queue_timeout_s(
    unique_id: str,
) -> None:
    """The same shutdown, with the gate opened only once the whole close has returned
    (``queue_timeout_s`` 1 s). Past its bound the wait gives up, and on the code before
    LMCache then freed its memory under the queued dump: the process died of a segmentation
    fault once the gate opened. Now the close runs without the free: the memory stays mapped until
    the process exits, and each step says so. The chunks the closed store could not take are
    lost (LMCache's other backends hold them), never stored wrong."""
    done = _run_close_with_a_queued_put(unique_id, queue_timeout_s=1.0, gate_s=None)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "exact": [True] + [False] * 6,  # the chunk written through before the close
        "wrong": [False] * 7,
        "in_flight": 0,
        "closed_before_gate": True,
    }
    assert (
        "UCM: 6 LMCache chunk(s) still being copied into the CacheBuffer after 1 s "
        "(queue_timeout_s) when LMCache frees its CPU memory"
    ) in done.stderr
    assert (
        "UCM: LMCache's CPU memory stays mapped until this process exits "
        "(MixedMemoryAllocator): UCM still reads or writes it"
    ) in done.stderr


def _run_close_with_a_queued_put(
    unique_id: str, queue_timeout_s: float, gate_s: float | None
) -> subprocess.CompletedProcess[str]:
    """Runs CLOSE_WITH_A_QUEUED_PUT; its gate opens ``gate_s`` into the close, or once the
    close has returned (None)."""
    tests = Path(__file__).resolve().parent
    return subprocess.run(
        [
            sys.executable,
            "-c",
            CLOSE_WITH_A_QUEUED_PUT,
            str(tests),
            str(tests.parent),
            unique_id,
            str(queue_timeout_s),
            "after-close" if gate_s is None else str(gate_s),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


# ---- LMCacheEngine: store, drop L1, lookup, retrieve into the (CPU) paged KV cache -------------

TOKENS = 4 * lm.CHUNK
SLOTS = 96


def _kv_equal(dst: list[torch.Tensor], src: list[torch.Tensor], slots: torch.Tensor) -> bool:
    return all(
        torch.equal(d[:, slots].view(torch.int16), s[:, slots].view(torch.int16))
        for d, s in zip(dst, src, strict=True)
    )


@pytest.mark.parametrize("local_cpu", [True, False], ids=["with-L1", "allocator-only"])
def test_lmcache_engine_retrieves_from_ucm_byte_exact(
    unique_id: str, tmp_path: Path, local_cpu: bool
) -> None:
    cfg = lm.config(buffer_over_posix(unique_id, tmp_path), local_cpu=local_cpu)
    engine = lm.engine(cfg, lm.metadata())
    engine.post_init()
    try:
        sm = engine.storage_manager
        backend = sm.storage_backends["ucm"]
        tokens = torch.arange(1000, 1000 + TOKENS)
        src, slots = lm.paged_kv(TOKENS, SLOTS, seed=1)
        engine.store(tokens, kvcaches=src, slot_mapping=slots)
        assert backend.flush(timeout_s=60)
        assert backend.stats()["lmcache"]["put_chunks_stored"] == 4
        engine.clear(locations=["LocalCPUBackend"])  # drop the L1 copies (if any)
        baseline = lm.active_allocations(sm)
        assert baseline == 0
        assert engine.lookup(tokens, lookup_id="req-1", pin=True) == TOKENS
        keys = [key for _, _, key in engine.token_database.process_tokens(tokens)]
        assert [backend.pinned(k) for k in keys] == [1] * 4
        dst = [torch.zeros_like(cache) for cache in src]
        ret = engine.retrieve(tokens, kvcaches=dst, slot_mapping=slots, req_id="req-1")
        assert bool(ret.all())
        assert _kv_equal(dst, src, slots)
        untouched = torch.ones(SLOTS, dtype=torch.bool)
        untouched[slots] = False
        assert all(int(d[:, untouched].abs().sum()) == 0 for d in dst)
        engine.lookup_unpin("req-1")
        assert [backend.pinned(k) for k in keys] == [0] * 4
        # After the retrieve LMCache holds the chunks in L1 only when L1 is on; nothing leaked.
        assert lm.active_allocations(sm) == (4 if local_cpu else 0)
        # A longer prompt: the stored prefix hits, the rest is a miss.
        longer = torch.arange(1000, 1000 + TOKENS + 2 * lm.CHUNK)
        assert engine.lookup(longer, lookup_id="req-2", pin=False) == TOKENS
    finally:
        lm.destroy(engine)


def test_async_lookup_and_prefetch_load_from_ucm_in_batches(unique_id: str, tmp_path: Path) -> None:
    """LMCache's async path, with its real ZMQ lookup client and server in this process: the
    scheduler-side client asks, the worker's StorageManager runs batched_async_contains and
    batched_get_non_blocking on UCM, and the retrieve takes the prefetched chunks."""
    from lmcache.v1.lookup_client.lmcache_async_lookup_client import (
        LMCacheAsyncLookupClient,
        LMCacheAsyncLookupServer,
    )

    cfg = lm.config(
        buffer_over_posix(unique_id, tmp_path),
        local_cpu=False,
        enable_async_loading=True,
        lookup_timeout_ms=120_000,
    )
    meta = lm.metadata(engine_id=f"ucm-{uuid.uuid4().hex[:10]}")
    engine = lm.engine(cfg, meta)
    server = LMCacheAsyncLookupServer(engine, meta)
    engine.post_init(async_lookup_server=server)
    client = LMCacheAsyncLookupClient(cfg, meta)
    try:
        sm = engine.storage_manager
        backend = sm.storage_backends["ucm"]
        tokens = torch.arange(5000, 5000 + TOKENS)
        src, slots = lm.paged_kv(TOKENS, SLOTS, seed=2)
        engine.store(tokens, kvcaches=src, slot_mapping=slots)
        assert backend.flush(timeout_s=60)
        assert lm.active_allocations(sm) == 0
        before = dict(backend.stats()["lmcache"])

        assert client.lookup_cache("req-a") == -1  # unknown: the scheduler then asks
        client.lookup(tokens, "req-a")
        deadline = time.monotonic() + 120
        hit = None
        while hit is None and time.monotonic() < deadline:
            hit = client.lookup_cache("req-a")
        assert hit == TOKENS
        after = backend.stats()["lmcache"]
        # One batched lookup of the 4 chunks and one batched load of them.
        assert after["lookups"] - before.get("lookups", 0) == 1
        assert after["lookup_keys"] - before.get("lookup_keys", 0) == 4
        assert after["loads"] - before.get("loads", 0) == 1
        assert after["get_hits"] - before.get("get_hits", 0) == 4
        assert after["pinned_keys"] == 0  # the lookup's pins went with the prefetch
        dst = [torch.zeros_like(cache) for cache in src]
        ret = engine.retrieve(tokens, kvcaches=dst, slot_mapping=slots, req_id="req-a")
        assert bool(ret.all())
        assert _kv_equal(dst, src, slots)
        assert lm.active_allocations(sm) == 0  # the prefetched objects were released
    finally:
        _close_lookup(client, server)
        lm.destroy(engine)


def _close_lookup(client: Any, server: Any) -> None:
    """Closes LMCache's lookup client and server without its close race: their close() joins
    the receiving thread for 1 s only, then closes the socket that thread may still block in,
    and libzmq aborts the process. So stop both loops, wake each with one message of LMCache's
    own protocol, wait for the threads, then close."""
    client.running = False
    server.running = False
    client._send_cleanup_message("ucm-test-wake")  # the server handles it, then sees running
    server.send_response_to_scheduler("ucm-test-wake", 0)  # likewise for the client
    for thread in (server.thread, client.thread):
        thread.join(timeout=60)
        assert not thread.is_alive(), thread.name
    client.close()
    server.close()


# ---- pins hold in the CacheBuffer -------------------------------------------------------------


def test_a_pinned_chunk_survives_buffer_pressure_until_unpinned(unique_id: str) -> None:
    """Issue 24 defect 4: LMCache's lookup pin (StorageManager.batched_contains(pin=True)) holds
    the chunk in the CacheBuffer (every worker's shard of it, node-wide), so puts of many more
    chunks than the buffer holds evict everything else until LMCache unpins; then the chunk
    goes like the rest. A buffer-only stack of 8 chunks, L1 off."""
    stack = {
        "unique_id": unique_id,
        "tiers": [{"type": "buffer", "capacity": 8 * lm.CHUNK_BYTES}],
    }
    sm = lm.storage_manager(lm.config(stack, local_cpu=False), lm.metadata())
    try:
        backend = sm.storage_backends["ucm"]
        kept = _store(sm, [1, 2])
        assert sm.batched_contains(kept, pin=True) == (2, {"ucm": kept})
        assert [backend.pinned(k) for k in kept] == [1, 1]
        for first in range(100, 140, 4):  # 40 chunks through the 6 other slots
            _store(sm, range(first, first + 4))
        assert backend.stats()["ucm"]["tiers"][0]["evictions"] >= 34
        assert backend.batched_contains(kept) == 2
        assert [backend.held_shards(k) for k in kept] == [1, 1]
        assert backend.stats()["ucm"]["tiers"][0]["held_slots"] == 2
        got = sm.batched_get(kept, location="ucm")
        assert [lm.content(g) for g in got] == [lm.chunk_bytes(1), lm.chunk_bytes(2)]
        for g in got:
            g.ref_count_down()
        sm.batched_unpin(kept)
        assert [backend.pinned(k) for k in kept] == [0, 0]
        assert [backend.held_shards(k) for k in kept] == [0, 0]
        assert backend.stats()["ucm"]["tiers"][0]["held_slots"] == 0
        for first in range(200, 240, 4):
            _store(sm, range(first, first + 4))
        assert backend.batched_contains(kept) == 0
        stats = backend.stats()
        assert stats["lmcache"]["pinned_keys"] == 0
        # 2 by the pins above, 2 by the get (a bounded load pins what it copies), all released.
        assert stats["ucm"]["pinned_shards"] == stats["ucm"]["unpinned_shards"] == 4
        assert lm.active_allocations(sm) == 0
    finally:
        sm.close()


# ---- two LMCache worker processes of one node share one CacheBuffer ------------------------------


def test_two_worker_processes_share_one_buffer(unique_id: str) -> None:
    """World size 2, one process per worker, a buffer-only stack: chunk c is block id(c) with
    worker w's part as shard w. A chunk is a hit once both workers stored their shard, and each
    worker reads the other's shard byte-exact: both can only come from one shared buffer."""
    stack = {"unique_id": unique_id, "tiers": [{"type": "buffer", "capacity": "2MiB"}]}
    with RankGroup(parties=2, join_timeout=60) as group:
        for w in (0, 1):
            group.spawn(lm.worker, w, stack, group.barrier, group.results)
        reports = sorted(group.reports(timeout=180), key=lambda r: r["worker"])
    for report in reports:
        assert "error" not in report, report.get("error")
    assert reports[0]["before_peer"] == 0  # worker 0's shards alone: no chunk is complete
    for report in reports:
        assert report["hits"] == 6
        assert report["own_exact"] == [True] * 6
        assert report["peer_exact"] == [True] * 6
        assert report["unique_id"] == unique_id and report["tiers"] == ["buffer"]
        assert report["leaked"] == 0
        assert report["after_remove"] == (False, 5)
    assert reports[0]["removed"] == 1 and reports[1]["removed_again"] == 0
    assert group.join() == [0, 0]


# ---- seed 003: batched_remove through LMCache's plugin API --------------------------------------


def test_batched_remove_seed_cases(unique_id: str, tmp_path: Path) -> None:
    """Empty input, a batch delete, pinned entries preserved, missing keys and force, with lock
    acquisitions counted: one per chunk of REMOVE_CHUNK_KEYS keys, in the plugin (its pin lock)
    and in the posix tier below (its exclusive lock), never one per key."""
    n = 2500
    stack = buffer_over_posix(unique_id, tmp_path, slots=n + 64)
    sm = lm.storage_manager(lm.config(stack, local_cpu=False, cpu_gb=0.04), lm.metadata())
    try:
        backend = sm.storage_backends["ucm"]

        def locks() -> tuple[int, int]:
            stats = backend.stats()
            posix = next(t for t in stats["ucm"]["tiers"] if t["type"] == "posix")
            return (
                stats["lmcache"].get("remove_lock_acquisitions", 0),
                posix["remove_lock_acquisitions"],
            )

        # Empty input: nothing removed, no lock taken.
        start = locks()
        assert backend.batched_remove([]) == 0
        assert sm.batched_remove([], locations=["ucm"]) == 0
        assert locks() == start

        keys = []
        for first in range(0, n, 500):  # 500 chunks per put keeps LMCache's pool small
            keys += _store(sm, range(first, first + 500))
        assert backend.batched_contains(keys) == n
        # Pins the way LMCache takes them: a lookup with pin=True.
        assert sm.batched_contains(keys[:3], pin=True) == (3, {"ucm": keys[:3]})
        assert [backend.pinned(k) for k in keys[:3]] == [1, 1, 1]
        absent = [lm.key(10_000 + i) for i in range(48)]

        # A batch delete with pinned and missing keys, as LMCache's own eviction calls it.
        start = locks()
        assert backend.batched_remove([*keys, *absent], force=False) == n - 3
        expected = math.ceil((n + len(absent)) / ucm.REMOVE_CHUNK_KEYS)
        assert expected == 3
        assert tuple(b - a for a, b in zip(start, locks(), strict=True)) == (expected, expected)
        assert backend.batched_contains(keys[:3]) == 3  # pinned: kept
        assert [backend.contains(k) for k in keys[3:]] == [False] * (n - 3)
        kept = backend.batched_get_blocking(keys[:3])
        assert [lm.content(o) for o in kept] == [lm.chunk_bytes(h) for h in range(3)]
        for obj in kept:
            obj.ref_count_down()

        # Missing keys only: nothing to remove, and the count says so.
        assert backend.batched_remove(absent, force=False) == 0
        assert backend.remove(keys[5], force=False) is False

        # Force (StorageManager.batched_remove passes the interface's default, force=True).
        assert backend.remove(keys[0], force=False) is False  # still pinned
        assert sm.batched_remove(keys[:3], locations=["ucm"]) == 3
        assert [backend.pinned(k) for k in keys[:3]] == [0, 0, 0]
        assert backend.batched_contains(keys[:3]) == 0
        assert backend.unpin(keys[0]) is False
        assert lm.active_allocations(sm) == 0
    finally:
        sm.close()


# ---- a corrupt lower-tier shard is a miss --------------------------------------------------------


def test_corrupt_posix_shard_is_a_miss(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    first = lm.storage_manager(
        lm.config(buffer_over_posix(f"lmc-{uuid.uuid4().hex[:12]}", nvme), local_cpu=False),
        lm.metadata(),
    )
    try:
        keys = _store(first, [1, 2])
        block = first.storage_backends["ucm"].ucm_key(keys[0])[0]
    finally:
        first.close()
    # Flip bytes inside the first chunk's shard in the posix file (below any buffer).
    path = nvme / block.hex()[:2] / f"{block.hex()}.blk"
    data = bytearray(path.read_bytes())
    data[100:108] = bytes(255 - b for b in data[100:108])
    path.write_bytes(bytes(data))

    # A fresh node (a new buffer) over the same NVMe directory.
    sm = lm.storage_manager(
        lm.config(buffer_over_posix(f"lmc-{uuid.uuid4().hex[:12]}", nvme), local_cpu=False),
        lm.metadata(),
    )
    try:
        backend = sm.storage_backends["ucm"]
        got = sm.batched_get(keys, location="ucm")
        assert got[0] is None  # the corrupt chunk: a miss, LMCache recomputes it
        assert lm.content(got[1]) == lm.chunk_bytes(2)
        got[1].ref_count_down()
        assert lm.active_allocations(sm) == 0  # the failed load freed its allocation
        assert backend.stats()["lmcache"]["get_errors"] == 1
        assert backend.contains(keys[0]) is False  # the posix tier dropped the torn shard
        assert backend.get_blocking(keys[0]) is None
    finally:
        sm.close()


# ---- a get that raises anything is a miss: nothing leaks, the async path answers -------------


def _fail_loads(backend: Any, how: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Makes every load of ``backend`` fail the way ``how`` says; returns the error's name."""
    store = backend.store
    if how == "closed-store":  # real: the store is closed under the plugin
        store.close()
        return "StoreClosedError"
    if how == "queue-timeout":  # what a load queue full for queue_timeout_s raises

        def full(*args: Any) -> Any:
            raise TimeoutError("the load queue stayed full for 60.0 s (queue_timeout_s)")

        monkeypatch.setattr(store, "load_data", full)
        return "TimeoutError"

    def broken(task: Any) -> None:  # any other error, raised while waiting
        raise RuntimeError("injected: the wait failed")

    monkeypatch.setattr(store, "wait", broken)
    return "RuntimeError"


@pytest.mark.parametrize("how", ["closed-store", "queue-timeout", "wait-raises"])
def test_a_load_that_raises_is_a_miss_and_frees_every_allocation(
    manager: Any, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24 defect 3: every error of a load (not only a TaskError) is a miss to LMCache,
    through StorageManager.batched_get and the plugin's blocking gets, and every MemoryObj
    allocated for the batch goes back to LMCache's pool: no leak, no garbage-collection line."""
    backend = manager.storage_backends["ucm"]
    keys = _store(manager, [21, 22, 23, 24])
    assert manager.batched_remove(keys, locations=["LocalCPUBackend"]) == 4
    baseline = lm.active_allocations(manager)
    assert backend.batched_contains(keys) == 4
    name = _fail_loads(backend, how, monkeypatch)
    with lm.lmcache_logs() as logs:
        assert manager.batched_get(keys, location="ucm") == [None] * 4
        assert backend.get_blocking(keys[0]) is None
        assert backend.batched_get_blocking([*keys, keys[1]]) == [None] * 5
        assert lm.active_allocations(manager) == baseline
        gc.collect()
    assert not [m for m in logs.messages() if "garbage collected" in m], logs.messages()
    counters = backend.stats()["lmcache"]
    assert counters["get_misses"] == 10 and counters["get_errors"] == 10
    assert counters.get("get_hits", 0) == 0
    if how != "closed-store":  # the store still serves once the failure is gone
        monkeypatch.undo()
        got = backend.batched_get_blocking(keys)
        assert [lm.content(g) for g in got] == [lm.chunk_bytes(h) for h in (21, 22, 23, 24)]
        for g in got:
            g.ref_count_down()
        assert lm.active_allocations(manager) == baseline
    assert name in {"StoreClosedError", "TimeoutError", "RuntimeError"}


def test_a_prefetch_whose_load_raises_answers_and_releases_its_pins(
    unique_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The async path (LMCache's real lookup client and server): a load that raises during the
    prefetch answers the scheduler (0 tokens), releases the lookup's pins and frees the
    prefetch's allocations."""
    from lmcache.v1.lookup_client.lmcache_async_lookup_client import (
        LMCacheAsyncLookupClient,
        LMCacheAsyncLookupServer,
    )

    cfg = lm.config(
        buffer_over_posix(unique_id, tmp_path),
        local_cpu=False,
        enable_async_loading=True,
        lookup_timeout_ms=120_000,
    )
    meta = lm.metadata(engine_id=f"ucm-{uuid.uuid4().hex[:10]}")
    engine = lm.engine(cfg, meta)
    server = LMCacheAsyncLookupServer(engine, meta)
    engine.post_init(async_lookup_server=server)
    client = LMCacheAsyncLookupClient(cfg, meta)
    try:
        sm = engine.storage_manager
        backend = sm.storage_backends["ucm"]
        tokens = torch.arange(7000, 7000 + TOKENS)
        src, slots = lm.paged_kv(TOKENS, SLOTS, seed=3)
        engine.store(tokens, kvcaches=src, slot_mapping=slots)
        assert backend.flush(timeout_s=60)
        assert lm.active_allocations(sm) == 0
        _fail_loads(backend, "queue-timeout", monkeypatch)
        with lm.lmcache_logs() as logs:
            assert client.lookup_cache("req-fail") == -1  # unknown: the scheduler then asks
            client.lookup(tokens, "req-fail")
            deadline = time.monotonic() + 90
            hit = None
            while hit is None and time.monotonic() < deadline:
                hit = client.lookup_cache("req-fail")
            assert hit == 0  # answered: nothing was prefetched
            counters = backend.stats()["lmcache"]
            assert counters["lookup_hits"] == 4  # the lookup itself found (and pinned) all 4
            assert counters["pinned_keys"] == 0 and counters["lookups_pinned"] == 0
            assert counters["get_misses"] == 4 and counters["get_errors"] == 4
            ucm_counters = backend.stats()["ucm"]  # the buffer released what the pins held
            # 4 by the lookup, 4 by the prefetch's bounded load (its copy then raised).
            assert ucm_counters["pinned_shards"] == ucm_counters["unpinned_shards"] == 8
            assert ucm_counters["tiers"][0]["held_slots"] == 0
            assert lm.active_allocations(sm) == 0
            gc.collect()
        assert not [m for m in logs.messages() if "garbage collected" in m], logs.messages()
    finally:
        monkeypatch.undo()
        _close_lookup(client, server)
        lm.destroy(engine)


# ---- a stalled tier: gets bounded by the load deadline --------------------------------------


@pytest.mark.parametrize("with_buffer", [True, False], ids=["buffer", "no-buffer"])
def test_a_get_from_a_stalled_tier_returns_by_the_load_deadline_and_never_writes_later(
    tmp_path: Path, with_buffer: bool
) -> None:
    """A tier that answers look-ups and then stalls (a black-holed S3) holds a get for no
    longer than ``storage_plugin.ucm.load_deadline_s``: its chunks are misses (LMCache
    recomputes them), counted as late, their allocations go back to LMCache, and the bytes
    that arrive later never reach LMCache's memory, which it hands out again at once."""
    from loadpath import _tiers
    from loadpath._tiers import ENTERED, GATES

    _tiers.register()
    space = f"lmc-stall-{uuid.uuid4().hex[:8]}"
    GATES[space] = threading.Event()
    ENTERED[space] = threading.Event()
    lower = {"type": "recording", "space": space}
    writer = lm.storage_manager(
        lm.config(
            {
                "unique_id": f"lmc-{uuid.uuid4().hex[:12]}",
                "tiers": [{"type": "buffer", "capacity": 16 * lm.CHUNK_BYTES}, lower],
            },
            local_cpu=False,
        ),
        lm.metadata(),
    )
    try:
        keys = _store(writer, [31, 32, 33])
    finally:
        writer.close()  # the chunks are in the recording tier now

    tiers: list[dict[str, Any]] = [{**lower, "gated": True}]
    if with_buffer:
        tiers.insert(0, {"type": "buffer", "capacity": 16 * lm.CHUNK_BYTES})
    sm = lm.storage_manager(
        lm.config(
            {"unique_id": f"lmc-{uuid.uuid4().hex[:12]}", "tiers": tiers},
            local_cpu=False,
            extra_config={"storage_plugin.ucm.load_deadline_s": 0.5},
        ),
        lm.metadata(),
    )
    try:
        backend = sm.storage_backends["ucm"]
        assert backend.batched_contains(keys) == 3  # the tier answers look-ups
        started = time.monotonic()
        assert sm.batched_get(keys, location="ucm") == [None] * 3
        assert time.monotonic() - started < 60  # the stalled tier holds its load for 120 s
        assert ENTERED[space].is_set()
        assert lm.active_allocations(sm) == 0  # every allocation went back to LMCache
        counters = backend.stats()["lmcache"]
        assert counters["get_misses"] == 3 and counters["get_late"] == 3
        assert counters.get("get_errors", 0) == 0 and counters.get("get_hits", 0) == 0

        # LMCache hands the same memory out again; the late bytes must not land in it.
        reused = [lm.filled(sm, 90 + i) for i in range(3)]
        GATES[space].set()  # the tier answers now
        if with_buffer:
            backend.store.wait_prefetches()
        assert backend._loads.wait_late(60)
        assert [lm.content(obj) for obj in reused] == [lm.chunk_bytes(90 + i) for i in range(3)]
        for obj in reused:
            obj.ref_count_down()

        got = sm.batched_get(keys, location="ucm")
        assert [lm.content(obj) for obj in got] == [lm.chunk_bytes(h) for h in (31, 32, 33)]
        for obj in got:
            obj.ref_count_down()
        assert lm.active_allocations(sm) == 0
    finally:
        GATES[space].set()
        sm.close()
        _tiers.unregister()


@pytest.mark.parametrize(
    ("value", "shown"), [(0, "0"), (-2, "-2"), (3601, "3601"), ("1", "'1'"), (False, "False")]
)
def test_a_bad_load_deadline_is_refused_naming_the_key(
    unique_id: str, value: Any, shown: str
) -> None:
    cfg = lm.config(
        {"unique_id": unique_id, "tiers": [{"type": "buffer", "capacity": "1MiB"}]},
        extra_config={"storage_plugin.ucm.load_deadline_s": value},
    )
    with pytest.raises(ucm.ConfigError) as refused:
        _construct(cfg)
    assert str(refused.value) == (
        f"extra_config['storage_plugin.ucm.load_deadline_s']: {shown} is not valid: expected a "
        "number of seconds in (0, 3600] (default 10)"
    )


@pytest.mark.parametrize(
    ("value", "shown"), [(-1, "-1"), (65536, "65536"), ("9000", "'9000'"), (True, "True")]
)
def test_a_bad_metrics_port_is_refused_naming_the_key(
    unique_id: str, value: Any, shown: str
) -> None:
    cfg = lm.config(
        {"unique_id": unique_id, "tiers": [{"type": "buffer", "capacity": "1MiB"}]},
        extra_config={"storage_plugin.ucm.metrics_port": value},
    )
    with pytest.raises(ucm.ConfigError) as refused:
        _construct(cfg)
    assert str(refused.value) == (
        f"extra_config['storage_plugin.ucm.metrics_port']: {shown} is not valid: expected an "
        "integer port in [0, 65535] (0: a free port)"
    )


def test_a_worker_serves_ucm_prometheus_metrics_with_the_plugins_counters(
    unique_id: str, tmp_path: Path
) -> None:
    """``storage_plugin.<name>.metrics_port``: each worker serves UCM's own Prometheus endpoint
    (127.0.0.1), with this process's store counters and the plugin's (counters as
    ``*_total``, its levels as gauges); the endpoint closes with the plugin."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    cfg = lm.config(
        buffer_over_posix(unique_id, tmp_path),
        extra_config={"storage_plugin.ucm.metrics_port": 0},
    )
    sm = lm.storage_manager(cfg, lm.metadata())
    try:
        backend = sm.storage_backends["ucm"]
        url = backend.metrics_url
        assert url is not None and url.startswith("http://127.0.0.1:")
        keys = _store(sm, [41, 42])
        sm.batched_remove(keys, locations=["LocalCPUBackend"])
        got = backend.batched_get_blocking([keys[0], lm.key(998), keys[1]])
        assert got[1] is None
        for obj in (got[0], got[2]):
            obj.ref_count_down()
        with urllib.request.urlopen(url, timeout=30) as response:
            families = {
                family.name: family
                for family in text_string_to_metric_families(response.read().decode())
            }
        value = {s.name: s.value for family in families.values() for s in family.samples}
        assert value["ucm_lmcache_get_hits_total"] == 2
        assert value["ucm_lmcache_get_misses_total"] == 1
        assert value["ucm_lmcache_put_chunks_stored_total"] == 2
        assert families["ucm_lmcache_pinned_keys"].type == "gauge"
        assert value["ucm_lmcache_pinned_keys"] == 0
        assert value["ucm_store_loaded_shards_total"] == 2
        assert value["ucm_store_dumped_shards_total"] == 2
    finally:
        sm.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)


def _ucm_threads() -> set[tuple[str, int]]:
    """UCM's threads alive in this process, by name and OS thread id: Python's threads named
    ``ucm*`` and every task whose OS name (``/proc/self/task/*/comm``) starts with ``ucm``."""
    found = {(t.name, t.native_id or 0) for t in threading.enumerate() if t.name.startswith("ucm")}
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            name = comm.read_text().strip()
        except OSError:  # a thread that ended meanwhile
            continue
        if name.startswith("ucm"):
            found.add((name, int(comm.parent.name)))
    return found


def _ucm_threads_left(before: set[tuple[str, int]]) -> set[tuple[str, int]]:
    """UCM's threads started since ``before`` that are still alive after a bounded wait: a
    thread Python has joined still shows in ``/proc/self/task`` until the kernel reaps it, which
    on a busy machine waits for it to get a CPU (the write-through thread runs at nice 19)."""
    deadline = time.monotonic() + 30.0
    left = _ucm_threads() - before
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _ucm_threads() - before
    return left


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_plugin_refused_by_a_late_check_leaves_no_thread_or_port(
    unique_id: str, tmp_path: Path
) -> None:
    """An fp8 KV cache (LMCache says uint8) without ``kv_dtype``, with ``metrics_port`` set:
    LMCache's launcher logs the constructor's error and runs on without the plugin, and
    nothing of the plugin is left behind: no UCM thread, the metrics port free. (Before, the
    store and the endpoint were opened before this check and never closed: ucm-loader-*,
    ucm-dump and ucm-write-through ran on, and the port answered HTTP 500.)"""
    port = _free_port()
    before = _ucm_threads()
    cfg = lm.config(
        buffer_over_posix(unique_id, tmp_path),
        extra_config={"storage_plugin.ucm.metrics_port": port},
    )
    meta = lm.metadata()
    meta.kv_dtype = torch.uint8  # an fp8 KV cache, as LMCache's vLLM adapter reports it
    with lm.lmcache_logs() as logs:
        sm = lm.storage_manager(cfg, meta)
    try:
        assert "ucm" not in sm.storage_backends
        assert [m for m in logs.messages() if "backend ucm" in m] == [
            "Failed to create backend ucm: extra_config['storage_plugin.ucm.kv_dtype'] is "
            "missing: LMCache hands UCM this KV cache as torch.uint8, the storage dtype of every "
            "fp8 format, so chunks of fp8_e4m3 and fp8_e5m2 would share ids; state the format "
            "('fp8_e4m3', 'fp8_e5m2', 'fp8_inc', 'fp8_ds_mla', 'int8'; vLLM's --kv-cache-dtype)"
        ]
        assert _ucm_threads_left(before) == set()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # nothing listens there
    finally:
        sm.close()


def test_a_metrics_port_in_use_closes_the_store_it_opened(unique_id: str, tmp_path: Path) -> None:
    """The endpoint starts last, after the store opened: a port in use refuses the plugin by
    its key, and the constructor closes the store and the put completer before it raises (no
    UCM thread is left, and the stack's buffer opens again)."""
    cfg_of = functools.partial(lm.config, buffer_over_posix(unique_id, tmp_path))
    before = _ucm_threads()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ucm.ConfigError) as refused:
            _construct(cfg_of(extra_config={"storage_plugin.ucm.metrics_port": port}))
    assert str(refused.value).startswith(
        f"extra_config['storage_plugin.ucm.metrics_port']: port={port} is not valid: cannot "
        "listen on it ("
    )
    assert _ucm_threads_left(before) == set()
    backend = _construct(cfg_of())
    try:
        assert backend.stats()["lmcache"] == {
            "puts_in_flight": 0,
            "pinned_keys": 0,
            "lookups_pinned": 0,
        }
    finally:
        backend.close()
    assert _ucm_threads_left(before) == set()


def test_the_endpoint_answers_a_scrape_from_the_moment_it_is_served(
    unique_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scrape that comes as soon as the worker's endpoint listens (still inside the
    constructor) answers 200 with the plugin's counters. Before, the endpoint was served before
    the counters' and pins' locks existed, and such a scrape answered HTTP 500."""
    import urllib.error
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from ucm.integration import lmcache as plugin

    scrapes: list[tuple[int, str]] = []
    serve = plugin.serve_rank_metrics

    def serve_and_scrape(*args: Any, **kwargs: Any) -> Any:
        server = serve(*args, **kwargs)
        try:
            with urllib.request.urlopen(server.url, timeout=30) as response:
                scrapes.append((response.status, response.read().decode()))
        except urllib.error.HTTPError as exc:
            scrapes.append((exc.code, ""))
        return server

    monkeypatch.setattr(plugin, "serve_rank_metrics", serve_and_scrape)
    cfg = lm.config(
        buffer_over_posix(unique_id, tmp_path),
        extra_config={"storage_plugin.ucm.metrics_port": 0},
    )
    backend = _construct(cfg)
    try:
        assert [status for status, _ in scrapes] == [200]
        value = {
            sample.name: sample.value
            for family in text_string_to_metric_families(scrapes[0][1])
            for sample in family.samples
        }
        assert value["ucm_lmcache_puts_in_flight"] == 0
        assert value["ucm_lmcache_pinned_keys"] == 0
    finally:
        backend.close()


# ---- small leaks: lookup pins without a prefetch, a put batch that fails partway -------------


def test_lookup_pins_without_a_prefetch_expire(manager: Any) -> None:
    """Issue 24 defect 7: an async lookup's pins wait for its prefetch; a prefetch that never
    comes no longer keeps them (and their lookup id) forever: beyond lookup_pins_max lookups
    the oldest is released, and after lookup_pin_ttl_s every one is."""
    import asyncio

    backend = manager.storage_backends["ucm"]
    keys = _store(manager, [31, 32])
    backend.lookup_pins_max = 2
    for n in range(3):
        assert asyncio.run(backend.batched_async_contains(f"lk-{n}", keys, pin=True)) == 2
    # Three lookups pinned both keys; the oldest went over the bound of 2.
    assert [backend.pinned(k) for k in keys] == [2, 2]
    counters = backend.stats()["lmcache"]
    assert counters["lookups_pinned"] == 2 and counters["lookup_pins_expired"] == 1
    backend.lookup_pin_ttl_s = 0.2
    time.sleep(0.5)
    assert asyncio.run(backend.batched_async_contains("lk-new", keys[:1], pin=True)) == 1
    assert [backend.pinned(k) for k in keys] == [1, 0]  # only lk-new's pin is left
    counters = backend.stats()["lmcache"]
    assert counters["lookups_pinned"] == 1 and counters["lookup_pins_expired"] == 3
    # The prefetch of an expired lookup releases nothing twice; lk-new's releases its pin.
    loaded = asyncio.run(backend.batched_get_non_blocking("lk-0", keys))
    assert [backend.pinned(k) for k in keys] == [1, 0]
    for obj in loaded:
        obj.ref_count_down()
    loaded = asyncio.run(backend.batched_get_non_blocking("lk-new", keys[:1]))
    assert [lm.content(o) for o in loaded] == [lm.chunk_bytes(31)]
    loaded[0].ref_count_down()
    counters = backend.stats()["lmcache"]
    assert counters["pinned_keys"] == 0 and counters["lookups_pinned"] == 0


def test_a_put_batch_that_fails_partway_leaves_nothing_in_flight(manager: Any) -> None:
    """Issue 24 defect 7: a key the plugin refuses in the middle of a batch (another world
    size) fails the batch's submission without keeping the earlier keys in flight or their
    objects' references (a flush then returns at once, and the chunks can be put again)."""
    backend = manager.storage_backends["ucm"]
    baseline = lm.active_allocations(manager)
    keys = [lm.key(41), lm.key(42, world_size=2), lm.key(43)]
    objs = [lm.filled(manager, h) for h in (41, 42, 43)]
    assert backend.batched_submit_put_task(keys, objs) is None
    assert [backend.exists_in_put_tasks(k) for k in keys] == [False] * 3
    assert [obj.get_ref_count() for obj in objs] == [1] * 3
    assert backend.stats()["lmcache"]["puts_in_flight"] == 0
    assert backend.flush(timeout_s=5)
    futures = backend.batched_submit_put_task([keys[0], keys[2]], [objs[0], objs[2]])
    assert futures is not None and [f.result(timeout=60) for f in futures] == [True, True]
    for obj in objs:
        obj.ref_count_down()
    assert lm.active_allocations(manager) == baseline
    assert backend.batched_contains([keys[0], keys[2]]) == 2


# ---- bad plugin configs: errors that name the key ------------------------------------------------

KEY = "extra_config['storage_plugin.ucm.stack']"
K = re.escape(KEY)


def _construct(cfg: Any, meta: Any | None = None) -> Any:
    from ucm.integration.lmcache import UcmStorageBackend

    sm = lm.storage_manager(lm.config(plugin=False), lm.metadata())
    try:
        return UcmStorageBackend(
            config=cfg,
            dst_device="cpu",
            metadata=meta or lm.metadata(),
            local_cpu_backend=sm.storage_backends["LocalCPUBackend"],
            loop=None,
        )
    finally:
        sm.close()


@pytest.mark.parametrize(
    ("stack", "message"),
    [
        (None, rf"^{K} is missing: give the path of a YAML stack"),
        ("/nonexistent/stack.yaml", rf"^{K}: .*/nonexistent/stack.yaml"),
        (
            {"unique_id": "u", "tiers": [{"type": "nope"}]},
            rf"^{K} \(stack\): invalid stack:\n  tiers\[0\]\.type: unknown tier type 'nope'",
        ),
        (
            {"unique_id": "u", "shard_size": 4096, "tiers": [{"type": "buffer"}]},
            rf"^{K}: the stack states shard_size: 4096, but LMCache's KV cache has "
            rf"shard_size {lm.CHUNK_BYTES}",
        ),
        (
            {
                "unique_id": f"lmc-too-big-{uuid.uuid4().hex[:8]}",
                "tiers": [{"type": "buffer", "capacity": "100GiB"}],  # more than /dev/shm
            },
            rf"^{K}: tiers\[0\] \(buffer\): the buffer needs \d+ bytes of shared memory",
        ),
    ],
    ids=["missing", "unreadable", "invalid", "contradicts-geometry", "cannot-open"],
)
def test_a_bad_stack_raises_an_error_naming_the_key(stack: Any, message: str) -> None:
    with pytest.raises(ucm.ConfigError, match=message):
        _construct(lm.config(stack))


def test_storage_manager_logs_the_bad_config_by_key() -> None:
    """LMCache catches a plugin's constructor error and logs it (then runs without the plugin):
    the line names the key."""
    with lm.lmcache_logs() as logs:
        sm = lm.storage_manager(lm.config(None), lm.metadata())
    try:
        assert "ucm" not in sm.storage_backends
        assert any(
            m.startswith(f"Failed to create backend ucm: {KEY} is missing") for m in logs.messages()
        ), logs.messages()
    finally:
        sm.close()


def test_unsupported_lmcache_settings_are_named(tmp_path: Path) -> None:
    stack = {"unique_id": "u", "tiers": [{"type": "posix", "path": str(tmp_path)}]}
    with pytest.raises(ucm.ConfigError, match=r"^use_layerwise: True is not supported"):
        _construct(lm.config(stack, use_layerwise=True))
    from ucm.integration.lmcache import UcmStorageBackend

    with pytest.raises(ucm.ConfigError, match="has none: set max_local_cpu_size > 0"):
        UcmStorageBackend(config=lm.config(stack), metadata=lm.metadata(), local_cpu_backend=None)
    with pytest.raises(ucm.ConfigError, match="needs LMCache's config and metadata"):
        UcmStorageBackend(config=None, metadata=None)


# ---- the key mapping ----------------------------------------------------------------------------


def test_keys_map_chunks_to_blocks_and_workers_to_shards(tmp_path: Path) -> None:
    from lmcache.utils import CacheEngineKey

    stack = {
        "unique_id": f"lmc-{uuid.uuid4().hex[:12]}",
        "tiers": [{"type": "posix", "path": str(tmp_path)}],
    }
    backend = _construct(lm.config(stack), lm.metadata(world_size=2, worker_id=0))
    try:
        assert backend.store.config.shards_per_block == 2
        assert backend.store.config.tensor_size_list == [lm.CHUNK_BYTES]
        block, shard = backend.ucm_key(lm.key(7, 2, 0))
        assert len(block) == 16 and shard == 0
        assert backend.ucm_key(lm.key(7, 2, 1)) == (block, 1)  # same chunk, the other worker
        assert backend.ucm_key(lm.key(8, 2, 0))[0] != block
        tagged = CacheEngineKey(lm.MODEL, 2, 0, 7, lm.DTYPE, {"lmcache.tag.tenant": "a"})
        other = CacheEngineKey(lm.MODEL, 2, 0, 7, lm.DTYPE, {"lmcache.tag.tenant": "b"})
        assert len({block, backend.ucm_key(tagged)[0], backend.ucm_key(other)[0]}) == 3
        assert backend.ucm_key(tagged) == backend.ucm_key(
            CacheEngineKey(lm.MODEL, 2, 0, 7, lm.DTYPE, {"lmcache.tag.tenant": "a"})
        )
        assert backend.ucm_key(CacheEngineKey("other-model", 2, 0, 7, lm.DTYPE))[0] != block
        assert backend.ucm_key(CacheEngineKey(lm.MODEL, 2, 0, 7, torch.float16))[0] != block
        with pytest.raises(ucm.InvalidArgumentError, match="world size 4, but this LMCache worker"):
            backend.ucm_key(lm.key(7, 4, 0))
    finally:
        backend.close()


def test_mla_with_save_only_first_rank_is_one_shard_per_chunk(tmp_path: Path) -> None:
    """LMCache's MLA keys have world size 1 (the latent KV is the same on every rank)."""
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata

    meta = LMCacheMetadata(
        model_name=lm.MODEL,
        world_size=2,
        local_world_size=2,
        worker_id=1,
        local_worker_id=1,
        kv_dtype=lm.DTYPE,
        kv_shape=(lm.LAYERS, 1, lm.CHUNK, 1, 96),
        use_mla=True,
        chunk_size=lm.CHUNK,
    )
    stack = {
        "unique_id": f"lmc-{uuid.uuid4().hex[:12]}",
        "tiers": [{"type": "posix", "path": str(tmp_path)}],
    }
    backend = _construct(lm.config(stack), meta)
    try:
        assert backend.layout.fmt == MemoryFormat.KV_MLA_FMT
        assert backend.store.config.shards_per_block == 1
        assert backend.store.config.tensor_size_list == [lm.LAYERS * lm.CHUNK * 96 * 2]
        # Worker 1's key of world size 1 is shard 0, the same block as worker 0's.
        mine = backend.ucm_key(CacheEngineKey(lm.MODEL, 1, 1, 5, lm.DTYPE))
        assert mine == backend.ucm_key(CacheEngineKey(lm.MODEL, 1, 0, 5, lm.DTYPE))
        assert mine[1] == 0
    finally:
        backend.close()


# ---- the benchmark's path without lmcache ------------------------------------------------------


def test_the_benchmark_without_lmcache_says_so_and_fails_under_ci(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ucm.bench import BenchOptions, lmcache_plugin

    monkeypatch.setattr(lmcache_plugin, "_lmcache_available", lambda: False)
    monkeypatch.delenv("CI", raising=False)
    result = lmcache_plugin.BENCHMARK.run(BenchOptions(quick=True))
    assert [figure.name for figure in result.figures] == [
        "UCM load of LMCache-sized chunks (no LMCache)"
    ]
    assert all(figure.value > 0 and figure.baseline_value > 0 for figure in result.figures)
    assert result.notes[0].startswith("lmcache is not installed, so LMCache's backends")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(RuntimeError, match="lmcache is not installed: CI installs it"):
        lmcache_plugin.BENCHMARK.run(BenchOptions(quick=True))
