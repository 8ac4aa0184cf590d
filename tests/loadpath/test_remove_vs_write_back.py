"""A remove is final against a write-back flush in flight (DESIGN.md "Cascade semantics"):
``Store.remove(force=True)`` (what ``ucm purge`` does, through ``Store.purge``) of a block whose
dirty buffer slots a flusher is writing down to a ``write: back`` tier must not see the block
come back on any tier when that write lands after the remove. The lower tier is a real posix
tier whose writes are held at a gate, so the flush is in flight for as long as the test says.
The flush is the flushers' own step (``BufferTier.flush_some``) run on a thread of the test, so
that it takes every shard of the block in one batch and the test knows when it is over."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

import ucm

from ._tiers import ENTERED, GATES, block
from .test_loadqueue import BOUND_S, SHARD
from .test_saves import src_for

SHARDS = 2


def _stack(unique_id: str, tmp_path: Path, **buffer: Any) -> dict[str, Any]:
    return {
        "unique_id": unique_id,
        "shard_size": SHARD,
        "shards_per_block": SHARDS,
        "tiers": [
            # No idle flush (the test runs the flush), and a dirty_max large enough that the
            # dump itself writes nothing down.
            {"type": "buffer", "capacity": 64 * SHARD, "flush_interval_s": 3600, **buffer},
            {
                "type": "slowposix",
                "path": str(tmp_path / "nvme"),
                "write": "back",
                "dump_gate": "nvme",
            },
        ],
    }


class _Flush:
    """One flush of the buffer's dirty slots, on a thread: (claimed, written) once over."""

    def __init__(self, store: ucm.Store) -> None:
        assert store.buffer is not None
        buffer = store.buffer
        self.result: list[tuple[int, int]] = []
        self.thread = threading.Thread(target=lambda: self.result.append(buffer.flush_some()))
        self.thread.start()

    def wait(self) -> None:
        self.thread.join(BOUND_S)
        assert not self.thread.is_alive(), "the flush never finished"
        assert self.result == [(SHARDS, SHARDS)]  # written, and nothing failed


def _dump_and_hold_its_flush(store: ucm.Store, x: bytes) -> _Flush:
    """Dumps every shard of ``x`` (dirty in the buffer) and returns once a flush's write of
    them is held at the posix tier's gate."""
    for shard in range(SHARDS):
        store.wait(store.dump([x], shard, src_for([x], shard)), timeout_s=BOUND_S)
    assert store.buffer is not None
    assert store.buffer.dirty_slots() == SHARDS
    flush = _Flush(store)
    assert ENTERED.setdefault("nvme", threading.Event()).wait(BOUND_S), "no flush started"
    return flush


def _assert_absent_everywhere(store: ucm.Store, x: bytes) -> None:
    keys = [(x, shard) for shard in range(SHARDS)]
    on_tiers = {tier.label: tier.lookup(keys) for tier in store.tiers}
    assert store.lookup([x]) == [False], f"the removed block is back: {on_tiers}"
    assert on_tiers == {tier.label: [False] * SHARDS for tier in store.tiers}
    assert store.lookup_on_prefix([x]) == -1


@pytest.mark.timeout(300)
def test_a_force_remove_during_a_write_back_flush_is_final(
    test_tiers: None, unique_id: str, tmp_path: Path
) -> None:
    """The remove waits (bounded) for this process's flush of the block before it clears
    the tiers below: when the remove returns the block is on no tier, and stays so. Before
    the fix the remove returned while the write was held, and the write then put the block
    back on posix."""
    gate = GATES.setdefault("nvme", threading.Event())
    gate.clear()
    with ucm.open(_stack(unique_id, tmp_path, wait_timeout_s=BOUND_S)) as store:
        try:
            x = block(7)
            flush = _dump_and_hold_its_flush(store, x)
            assert store.buffer is not None
            buffer_keys = [(x, shard) for shard in range(SHARDS)]
            removed: list[int] = []
            remover = threading.Thread(target=lambda: removed.append(store.remove([x], True)))
            remover.start()
            deadline = time.monotonic() + BOUND_S
            while any(store.buffer.lookup(buffer_keys)):  # the remove has reached the buffer
                assert time.monotonic() < deadline, "the remove never removed the buffer's slots"
                time.sleep(0.01)
            gate.set()  # the flush's write lands after the remove took the block out
            remover.join(BOUND_S)
            assert not remover.is_alive(), "remove did not return"
            # The remove waited for the flush's write and its removal of what it wrote.
            _assert_absent_everywhere(store, x)
            flush.wait()
            _assert_absent_everywhere(store, x)
            assert removed == [SHARDS]
            # The remove waited for the flush, so its write landed before the remove cleared
            # the tier below, and the remove took it: nothing left for the flush to retract.
            assert store.buffer.stats()["writes_retracted"] == 0
        finally:
            gate.set()
    with ucm.open(_stack(unique_id, tmp_path)) as fresh:  # no answer kept in memory by the first
        _assert_absent_everywhere(fresh, x)


@pytest.mark.timeout(300)
def test_a_flush_that_outlives_the_remove_deletes_what_it_wrote(
    test_tiers: None, unique_id: str, tmp_path: Path
) -> None:
    """The flush is still held when the remove returns (its wait for the flush is past its
    bound, as when the flusher is another rank's, or ``ucm purge`` runs in a process of its
    own): once the write lands, the flusher finds the remove in the removal log
    (ucm.finality) and deletes the block from the tier it wrote to."""
    gate = GATES.setdefault("nvme", threading.Event())
    gate.clear()
    with ucm.open(_stack(unique_id, tmp_path, wait_timeout_s=0.2)) as store:
        try:
            x = block(8)
            flush = _dump_and_hold_its_flush(store, x)
            assert store.remove([x], force=True) == SHARDS
            assert flush.thread.is_alive()  # still held at the gate
            gate.set()
            flush.wait()
            _assert_absent_everywhere(store, x)
            assert store.buffer is not None
            assert store.buffer.stats()["writes_retracted"] == SHARDS
        finally:
            gate.set()
    with ucm.open(_stack(unique_id, tmp_path)) as fresh:
        _assert_absent_everywhere(fresh, x)
