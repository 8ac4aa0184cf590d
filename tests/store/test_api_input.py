"""Bad input to the public Store API found by an audit: each call refuses it with a UCM error
naming the argument, the value and what is valid, and no call hangs on a closed store."""

from __future__ import annotations

import json
import re
import threading
import warnings
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ucm
from ucm import arguments
from ucm.errors import InvalidArgumentError, StoreClosedError
from ucm.loadqueue import DumpItem
from ucm.task import Progress

from .conftest import SHARED, block


def stack(*tiers: dict[str, Any], shards: int = 2) -> dict[str, Any]:
    return {
        "unique_id": "t",
        "shards_per_block": shards,
        "tensor_size_list": [32, 32],
        "tiers": list(tiers) or [{"type": "dict", "space": "top"}],
    }


def pair() -> list[torch.Tensor]:
    return [torch.zeros(32, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)]


def returns_within(call: Callable[[], Any], seconds: float = 10.0) -> BaseException | None:
    """Runs ``call`` on a thread; fails the test if it is still running after ``seconds``.
    Returns what it raised (None if it returned)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{call} still blocked after {seconds} s"
    return outcome[0]


# ---- a closed store ----------------------------------------------------------------------


WRITE_THROUGH = (
    {"type": "dict", "space": "top"},
    {"type": "dict", "space": "low", "write": "through"},
)


@pytest.mark.parametrize("tiers", [(), WRITE_THROUGH], ids=["one tier", "write-through"])
def test_drain_after_close_raises_store_closed(dict_tier, tiers) -> None:
    store = ucm.open(stack(*tiers))
    store.close()
    raised = returns_within(store.drain)
    assert isinstance(raised, StoreClosedError), raised
    assert str(raised) == "the store is closed; open a new one with ucm.open()"


def test_no_call_blocks_on_a_closed_store(dict_tier) -> None:
    tiers = ({"type": "dict", "space": "top"}, {"type": "dict", "space": "low"})
    store = ucm.open(stack(*tiers))
    SHARED["low"][(block(1), 0)] = bytes(64)
    store.prefetch([block(1)])
    task = store.dump([block(2)], 0, [pair()])
    store.close()
    assert returns_within(store.wait_prefetches) is None
    assert returns_within(lambda: store.wait(task)) is None
    assert store.check(task) is True
    assert returns_within(store.stats) is None  # figures as they were at close
    assert returns_within(store.namespace_tier_stats) is None
    assert returns_within(lambda: store.unpin([])) is None
    for call in (store.namespaces, lambda: store.purge("default"), lambda: store.pin([block(1)])):
        assert isinstance(returns_within(call), StoreClosedError)


def test_a_drain_queued_behind_close_is_ended_by_close(dict_tier) -> None:
    """A drain (or dump) racing close can queue its item after the dump thread's stop: close
    ends it instead of leaving its caller waiting for a thread that is gone."""
    store = ucm.open(stack())
    dumps = store._dumps
    assert dumps is not None
    dumps._pending.put(None)  # the dump thread stops here, as at close
    dumps._thread.join(10)
    marker = Progress([(bytes(16), 0)])
    dumps._pending.put(DumpItem(arguments.TaskKeys.of([]), arguments.ShardMemory(views=[]), marker))
    store.close()
    assert marker.done()
    failure = marker.failures(0)[(bytes(16), 0)]
    assert isinstance(failure, StoreClosedError)


# ---- what ucm.open and Store take ----------------------------------------------------------


class BytesPath:
    def __fspath__(self) -> bytes:
        return b"/tmp/stack.yaml"


OPEN_VALID = "a mapping or a ucm.StackConfig"


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (None, "NoneType None"),
        (123, "int 123"),
        ([1, 2], "list [1, 2]"),
        (b"/tmp/stack.yaml", "bytes b'/tmp/stack.yaml'"),
        (BytesPath(), "BytesPath <"),
    ],
)
def test_open_refuses_a_stack_of_the_wrong_type(value, shown) -> None:
    message = (
        "stack must be the path of a YAML file (str or os.PathLike), a mapping or a "
        f"ucm.StackConfig, got {shown}"
    )
    for call in (ucm.open, ucm.open_store):
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            call(value)


def test_open_still_takes_a_path_a_mapping_and_a_stack_config(dict_tier, tmp_path: Path) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text(json.dumps(stack()))  # JSON is YAML
    for source in (path, str(path), stack(), ucm.load_stack(stack())):
        ucm.open(source).close()


@pytest.mark.parametrize(
    ("value", "shown"),
    [({"unique_id": "t"}, "dict {'unique_id': 't'}"), ("stack.yaml", "str 'stack.yaml'")],
)
def test_store_refuses_anything_but_a_stack_config(value, shown) -> None:
    message = (
        "config must be a ucm.StackConfig (ucm.load_stack makes one from a path or a mapping; "
        f"ucm.open takes those too), got {shown}"
    )
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        ucm.Store(value)


def test_open_refuses_an_unknown_option(dict_tier) -> None:
    message = (
        "ucm.open got an unknown option write_queue_bytes=-5: its options are device_id, "
        "local_rank_size and namespace"
    )
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        ucm.open(stack(), write_queue_bytes=-5)


# ---- bounds and flags ------------------------------------------------------------------------


def test_a_wait_longer_than_threads_can_wait_is_capped(dict_tier) -> None:
    with ucm.open(stack()) as store:
        task = store.dump([block(1)], 0, [pair()])
        store.wait(task, timeout_s=1e300)
        store.wait(store.load([block(1)], 0, [pair()], submit_timeout_s=1e300), timeout_s=1e300)
    assert arguments.check_timeout_s(1e300) == threading.TIMEOUT_MAX


@pytest.mark.parametrize(
    ("wait_s", "message"),
    [
        ("x", "wait_s must be a finite number of seconds, 0 or more, got str 'x'"),
        (None, "wait_s must be a finite number of seconds, 0 or more, got NoneType None"),
        (-5, "wait_s=-5 is not valid: expected a finite number of seconds, 0 or more"),
        (float("nan"), "wait_s=nan is not valid: expected a finite number of seconds, 0 or more"),
    ],
)
def test_namespace_tier_stats_checks_wait_s(dict_tier, wait_s, message) -> None:
    with ucm.open(stack()) as store:
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            store.namespace_tier_stats(wait_s=wait_s)
        assert store.namespace_tier_stats(wait_s=1e300) == {"dict": None}


FLAG_CALLS = [
    (lambda s: s.lookup([block(1)], exact="no"), "exact must be a bool, got 'no'"),
    (lambda s: s.prefetch([block(1)], background="x"), "background must be a bool, got 'x'"),
    (lambda s: s.load([block(1)], 0, [pair()], background=1), "background must be a bool, got 1"),
    (
        lambda s: s.load_data([block(1)], 0, [[8192, 8192]], background=None),
        "background must be a bool, got None",
    ),
]


@pytest.mark.parametrize(("call", "message"), FLAG_CALLS)
def test_flags_must_be_bools(dict_tier, call, message) -> None:
    with ucm.open(stack()) as store, pytest.raises(InvalidArgumentError, match=re.escape(message)):
        call(store)


# ---- tensors ---------------------------------------------------------------------------------


def _quiet(make: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    def made() -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
            return make()

    return made


LAYOUTS = {
    "sparse_coo": _quiet(lambda: torch.zeros(32, dtype=torch.uint8).to_sparse()),
    "sparse_csr": _quiet(lambda: torch.zeros(4, 8, dtype=torch.uint8).to_sparse_csr()),
    "_mkldnn": _quiet(lambda: torch.zeros(8, dtype=torch.float32).to_mkldnn()),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUTS.keys())
@pytest.mark.parametrize("verb", ["load", "dump"])
def test_a_tensor_that_is_not_dense_is_refused_naming_it(dict_tier, layout, verb) -> None:
    name = "dst" if verb == "load" else "src"
    message = (
        f"{name}[0][0] is a torch.{layout} tensor; UCM copies a tensor's bytes and needs a "
        "dense (torch.strided) contiguous tensor: pass tensor.to_dense()"
    )
    with ucm.open(stack()) as store:
        odd = LAYOUTS[layout]()
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            getattr(store, verb)([block(1)], 0, [[odd, torch.zeros(32, dtype=torch.uint8)]])
        assert SHARED["top"] == {}


def test_loads_into_shared_memory_are_refused_naming_both_entries(dict_tier) -> None:
    with ucm.open(stack()) as store:
        ids = [block(1), block(2)]
        store.wait(store.dump(ids, 0, [pair(), pair()]))
        one = pair()
        message = (
            "dst[1][0] shares memory with dst[0][0]: a load writes each key's bytes to its own "
            "destination, so give every tensor distinct memory"
        )
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            store.load(ids, 0, [one, [one[0], torch.zeros(32, dtype=torch.uint8)]])
        # Views that overlap by part of a tensor, K and V of one key included.
        buffer = torch.zeros(128, dtype=torch.uint8)
        message = "dst[0][1] shares memory with dst[0][0]"
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            store.load(ids, 0, [[buffer[0:32], buffer[16:48]], [buffer[64:96], buffer[96:128]]])
        message = "dst[1][0] shares memory with dst[0][1]"
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            store.load(ids, 0, [[buffer[0:32], buffer[32:64]], [buffer[48:80], buffer[96:128]]])
        # Adjacent views of one buffer are distinct memory, and a dump may read one tensor twice.
        store.wait(
            store.load(
                ids, 0, [[buffer[i : i + 32] for i in (0, 32)], [buffer[64:96], buffer[96:]]]
            )
        )
        store.wait(store.dump([block(3), block(4)], 0, [one, one]))


@pytest.mark.parametrize(
    ("starts", "sizes", "overlap"),
    [
        ([4096, 4096 + 1000, 4096 + 4000], (1000, 3000, 96), False),  # K, V, extra packed
        ([4096, 4096 + 999, 4096 + 4000], (1000, 3000, 96), True),
        ([8192, 4096, 4096 + 1000, 8192 + 1000], (1000, 3000), True),  # sorted starts differ
        ([4096 + 500, 4096], (3000, 1000), True),
        ([4096 + 3000, 4096], (3000, 1000), False),
        ([4096, 4096], (64,), True),
        ([4096, 4096 + 64], (64,), False),
        ([4096], (64,), False),
    ],
)
def test_overlapping_ranges_are_found_for_any_sizes(starts, sizes, overlap) -> None:
    assert arguments._overlaps(array("Q", starts), sizes) is overlap


# ---- raw pointers ------------------------------------------------------------------------------


POINTER_CALLS = [
    (
        array("i", [5000, 5000]),
        "src_ptrs is an array('i'); packed addresses must be an array('Q'): one unsigned 64-bit "
        "address per tensor, key-major (2 per key)",
    ),
    (
        array("Q", [5000]),
        "src_ptrs holds 1 addresses but 1 block(s) of 2 tensor(s) need 2: packed addresses must "
        "be an array('Q')",
    ),
    (
        array("Q", [8192, 0]),
        "src_ptrs[1] (block 0, tensor 1)=0 is not valid: expected an integer address (at least "
        "4096: below is the null page)",
    ),
]


@pytest.mark.parametrize(("pointers", "message"), POINTER_CALLS)
def test_packed_addresses_of_the_wrong_form_are_named(dict_tier, pointers, message) -> None:
    with ucm.open(stack()) as store, pytest.raises(InvalidArgumentError, match=re.escape(message)):
        store.dump_data([block(1)], 0, pointers)
