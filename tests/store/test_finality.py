"""The writers' side of the removal log (ucm.finality, core-native/src/removal_log.zig): which
keys a removal covers, what a writer removes again once its bytes have landed, and failing
closed when the ring no longer holds its window. The end-to-end cases (admission,
write-through in another process, write-back flushes) are in tests/loadpath."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from ucm import namespaces
from ucm.errors import InvalidArgumentError
from ucm.finality import Finality
from ucm.layout import Key
from ucm.native import _abi
from ucm.native.removals import RemovalKind, RemovalLog


def _ids(namespace: str, n: int) -> list[bytes]:
    namespaces.register(namespace)
    return namespaces.scope(namespace, [bytes([i]) * 16 for i in range(n)])


def test_the_log_reads_back_each_removal_after_a_generation() -> None:
    log = RemovalLog.private()
    assert log.generation() == 0
    assert log.since(0) == []
    first = log.append_purge(namespaces.tag("tenant-a"))
    last = log.append_removes([b"\x01" * 16, b"\x02" * 16, b"\x01" * 16])  # one per block
    assert (first, last) == (1, 3)
    removals = log.since(0)
    assert removals is not None
    assert [(r.generation, r.kind, r.id) for r in removals] == [
        (1, RemovalKind.PURGE, namespaces.tag("tenant-a") + bytes(8)),
        (2, RemovalKind.REMOVE, b"\x01" * 16),
        (3, RemovalKind.REMOVE, b"\x02" * 16),
    ]
    assert log.since(3) == []


def test_a_window_the_ring_no_longer_holds_is_none() -> None:
    log = RemovalLog.private()
    log.append_removes([i.to_bytes(16, "big") for i in range(_abi.REMOVAL_LOG_ENTRIES + 1)])
    assert log.since(0) is None
    window = log.since(1)
    assert window is not None and len(window) == _abi.REMOVAL_LOG_ENTRIES


def test_a_purge_covers_its_namespace_only_and_the_default_covers_no_registered_one() -> None:
    finality = Finality(RemovalLog.private())
    a, b, default = _ids("tenant-a", 3), _ids("tenant-b", 3), _ids("default", 3)
    keys: list[Key] = [(i, 0) for i in a + b + default]
    start = finality.start()
    finality.record_purge("tenant-a")
    assert finality.removed(start, keys) == [True] * 3 + [False] * 6
    start = finality.start()
    finality.record_purge("default")
    assert finality.removed(start, keys) == [False] * 6 + [True] * 3
    start = finality.start()
    finality.record_removes([b[1]])
    assert finality.removed(start, keys) == [False, False, False, False, True] + [False] * 4


class _Retract:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[Key]] = []
        self.fail = fail

    def __call__(self, keys: Sequence[Key]) -> None:
        self.calls.append(list(keys))
        if self.fail:
            raise OSError("tier down")


def test_settle_retracts_exactly_the_removed_keys_the_buffer_does_not_hold_again() -> None:
    a, b = _ids("tenant-a", 4), _ids("tenant-b", 2)
    again = {(a[3], 0)}
    finality = Finality(RemovalLog.private(), held=lambda keys: [k in again for k in keys])
    keys: list[Key] = [(i, 0) for i in a + b]
    start = finality.start()
    retract = _Retract()
    assert finality.settle(start, keys, retract) == 0  # nothing removed since: no call
    assert retract.calls == []
    finality.record_purge("tenant-a")
    assert finality.unremoved(start, keys) == [4, 5]
    assert finality.settle(start, keys, retract) == 3
    assert retract.calls == [[(a[0], 0), (a[1], 0), (a[2], 0)]]
    assert finality.counts() == {"writes_retracted": 4 + 3, "retract_failures": 0}


def test_settle_fails_closed_past_the_ring_and_counts_a_failing_retract() -> None:
    a = _ids("tenant-a", 2)
    finality = Finality(RemovalLog.private())
    keys: list[Key] = [(i, 0) for i in a]
    start = finality.start()
    finality.record_removes([i.to_bytes(16, "big") for i in range(_abi.REMOVAL_LOG_ENTRIES + 1)])
    retract = _Retract()
    assert finality.settle(start, keys, retract) == 2  # no removal of them, but unknowable
    assert retract.calls == [keys]
    failing = _Retract(fail=True)
    assert finality.settle(start, keys, failing) == 0
    assert finality.counts() == {"writes_retracted": 2, "retract_failures": 2}


def test_a_bad_id_is_refused_naming_its_length() -> None:
    with pytest.raises(InvalidArgumentError, match="id must be 16 bytes, got 3"):
        RemovalLog.private().append_removes([b"abc"])
