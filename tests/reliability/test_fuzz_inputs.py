"""Bad input, fuzzed with hypothesis: random YAML stacks and random arguments to every public
Store call. Only documented errors come out (ConfigError / PluginError for stacks, UcmError
subclasses for calls), never another exception, a hang or a crash. Raw-pointer calls are fuzzed
in a child process, and only on their validation paths: no random address ever reaches a copy."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucm
from ucm.errors import ConfigError, PluginError, UcmError
from ucm.native import segments

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# ---- YAML stacks --------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["8GiB", "-1", "1.5KiB", "0", "1e9", "64 MiB", "buffer", "posix", "fsspec"]),
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
TIER_KEYS = [
    "type", "capacity", "reserved_slots", "wait_timeout_s", "path", "url", "storage_options",
    "write", "promote", "io_threads", "lock_timeout", "o_direct", "fsync", "name", "bogus",
]  # fmt: skip
STACK_KEYS = ["unique_id", "shard_size", "tensor_size_list", "shards_per_block", "tiers", "x"]


def base_stack(tmp: str) -> dict[str, Any]:
    return {
        "unique_id": "fuzz",
        "shard_size": 4096,
        "shards_per_block": 2,
        "tiers": [
            {"type": "buffer", "capacity": "64KiB"},
            {"type": "posix", "path": tmp},
            {"type": "fsspec", "url": "memory://fuzz"},
        ],
    }


@st.composite
def mutated_stacks(draw: st.DrawFn) -> Any:
    """A valid stack with a few keys replaced, added or removed at random."""
    stack: dict[str, Any] = base_stack("/tmp/ucm-fuzz-never-created")
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.sampled_from(["stack", "tier", "tiers"]))
        if where == "stack":
            key = draw(st.sampled_from(STACK_KEYS))
            if draw(st.booleans()):
                stack[key] = draw(values)
            else:
                stack.pop(key, None)
        elif where == "tier" and isinstance(stack.get("tiers"), list) and stack["tiers"]:
            tiers = stack["tiers"]
            index = draw(st.integers(0, len(tiers) - 1))
            if isinstance(tiers[index], dict):
                tiers[index][draw(st.sampled_from(TIER_KEYS))] = draw(values)
            else:
                tiers[index] = draw(values)
        else:
            stack["tiers"] = draw(st.lists(values, max_size=3))
    return stack


def _assert_only_documented(source: Any) -> None:
    try:
        config = ucm.load_stack(source)
    except (ConfigError, PluginError) as error:
        assert str(error)  # a message that says what is wrong
        return
    assert isinstance(config, ucm.StackConfig)


@FUZZ
@given(stack=mutated_stacks())
def test_fuzzed_stack_mappings_raise_only_config_errors(stack: Any) -> None:
    _assert_only_documented(stack)


@FUZZ
@given(data=st.one_of(values, mutated_stacks()))
def test_fuzzed_yaml_files_raise_only_config_errors(data: Any, tmp_path: Path) -> None:
    path = tmp_path / f"{uuid.uuid4().hex}.yaml"
    path.write_text(yaml.safe_dump(data))
    _assert_only_documented(path)


@FUZZ
@given(text=st.text(max_size=200))
def test_fuzzed_yaml_text_raises_only_config_errors(text: str, tmp_path: Path) -> None:
    path = tmp_path / f"{uuid.uuid4().hex}.yaml"
    path.write_text(text)
    _assert_only_documented(path)


def test_deeply_nested_yaml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text("tiers: " + "[" * 5000 + "]" * 5000)
    _assert_only_documented(path)


# ---- Store calls (in process: tensors, ids, indexes, tasks) --------------------------------

TENSOR_SIZES = [1024, 3072]
SHARDS_PER_BLOCK = 4


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ucm.Store]:
    unique_id = f"fuzz-{uuid.uuid4().hex[:12]}"
    config = {
        "unique_id": unique_id,
        "tensor_size_list": TENSOR_SIZES,
        "shards_per_block": SHARDS_PER_BLOCK,
        "tiers": [
            {"type": "buffer", "capacity": 32 * sum(TENSOR_SIZES), "wait_timeout_s": 1.0},
            {"type": "posix", "path": str(tmp_path_factory.mktemp("fuzz-nvme"))},
        ],
    }
    with ucm.open(config) as opened:
        yield opened
    segments.unlink(unique_id)


block_ids_strategy = st.one_of(
    st.lists(st.binary(min_size=16, max_size=16), max_size=4),
    st.lists(
        st.one_of(
            st.binary(max_size=20),
            st.text(max_size=16),
            st.integers(),
            st.none(),
            st.builds(bytearray, st.binary(min_size=16, max_size=16)),
        ),
        max_size=4,
    ),
    st.binary(max_size=32),
    st.text(max_size=4),
    st.none(),
    st.integers(),
)
shard_index_strategy = st.one_of(
    st.integers(min_value=-5, max_value=SHARDS_PER_BLOCK + 5),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.lists(st.one_of(st.integers(-2, 6), st.booleans(), st.floats(), st.none()), max_size=5),
    st.booleans(),
    st.floats(),
    st.none(),
    st.text(max_size=3),
)


@st.composite
def tensors(draw: st.DrawFn) -> Any:
    """One tensor, right or wrong: size, dtype, contiguity, grad, device, shape."""
    import torch

    size = draw(st.sampled_from([*TENSOR_SIZES, 0, 1, 2048, 4096]))
    dtype = draw(st.sampled_from([torch.uint8, torch.float16, torch.float32, torch.int64]))
    count = max(1, size // torch.tensor([], dtype=dtype).element_size())
    kind = draw(st.sampled_from(["plain", "strided", "grad", "meta", "scalar", "2d"]))
    if kind == "meta":
        return torch.empty(count, dtype=dtype, device="meta")
    if kind == "scalar":
        return torch.tensor(1, dtype=dtype)
    if kind == "strided":
        return torch.zeros(count * 2, dtype=dtype)[::2]
    if kind == "grad" and dtype.is_floating_point:
        return torch.zeros(count, dtype=dtype, requires_grad=True)
    if kind == "2d" and count % 2 == 0:
        return torch.zeros(2, count // 2, dtype=dtype)
    return torch.zeros(count, dtype=dtype)


tensor_lists = st.one_of(
    st.lists(st.lists(tensors(), max_size=3), max_size=4),
    st.lists(tensors(), max_size=4),
    st.lists(st.one_of(st.none(), st.integers(), st.text(max_size=3)), max_size=3),
    st.none(),
    st.text(max_size=3),
)


def _call(function: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return function(*args, **kwargs)
    except UcmError as error:
        assert str(error)
        return None


@st.composite
def nearly_valid_tensors(draw: st.DrawFn, count: int) -> Any:
    """One [K, V] pair of uint8 tensors of the layout's sizes per block, sometimes one of them
    replaced by a random (usually wrong) tensor: reaches the checks after the first one."""
    import torch

    rows = [[torch.zeros(size, dtype=torch.uint8) for size in TENSOR_SIZES] for _ in range(count)]
    if rows and draw(st.booleans()):
        row = draw(st.integers(0, count - 1))
        rows[row][draw(st.integers(0, 1))] = draw(tensors())
    return rows


@FUZZ
@given(block_ids=block_ids_strategy, shard_index=shard_index_strategy, data=st.data())
def test_fuzzed_load_and_dump_arguments_raise_only_ucm_errors(
    store: ucm.Store, block_ids: Any, shard_index: Any, data: st.DataObject
) -> None:
    count = len(block_ids) if isinstance(block_ids, list) else 1
    dst = data.draw(st.one_of(nearly_valid_tensors(count), tensor_lists))
    for call in (store.load, store.dump):
        task = _call(call, block_ids, shard_index, dst)
        if task is not None:  # everything was valid: the task runs and finishes
            _call(store.wait, task)
            assert store.check(task) is True


@FUZZ
@given(
    block_ids=block_ids_strategy,
    force=st.one_of(st.booleans(), st.none(), st.integers(), st.text(max_size=2)),
    task=st.one_of(st.none(), st.integers(), st.text(max_size=3), st.lists(st.integers())),
)
def test_fuzzed_block_calls_raise_only_ucm_errors(
    store: ucm.Store, block_ids: Any, force: Any, task: Any
) -> None:
    for call in (store.lookup, store.lookup_on_prefix, store.touch, store.prefetch):
        _call(call, block_ids)
    _call(store.remove, block_ids, force)
    _call(store.wait, task)
    _call(store.check, task)
    store.wait_prefetches()


@FUZZ
@given(
    device_id=st.one_of(st.integers(-(2**65), 2**65), st.booleans(), st.none(), st.floats()),
    local_rank_size=st.one_of(st.integers(-3, 2**65), st.booleans(), st.none(), st.text()),
)
def test_fuzzed_rank_parameters_raise_only_ucm_errors(
    device_id: Any, local_rank_size: Any, tmp_path: Path
) -> None:
    config = {
        "unique_id": "fuzz-ranks",
        "shard_size": 4096,
        "shards_per_block": 1,
        "tiers": [{"type": "posix", "path": str(tmp_path)}],
    }
    opened = _call(ucm.open, config, device_id=device_id, local_rank_size=local_rank_size)
    if opened is not None:
        opened.close()


def test_calls_on_a_closed_store_raise_store_closed(tmp_path: Path) -> None:
    config = {
        "unique_id": "fuzz-closed",
        "shard_size": 4096,
        "shards_per_block": 1,
        "tiers": [{"type": "posix", "path": str(tmp_path)}],
    }
    store = ucm.open(config)
    store.close()
    for call, args in (
        (store.lookup, ([bytes(16)],)),
        (store.touch, ([bytes(16)],)),
        (store.remove, ([bytes(16)],)),
        (store.prefetch, ([bytes(16)],)),
        (store.load_data, ([bytes(16)], 0, [[1]])),
    ):
        with pytest.raises(ucm.StoreClosedError):
            call(*args)
    store.close()  # idempotent


# ---- raw pointers, in a child process ---------------------------------------------------------

POINTER_FUZZ = r"""
import ctypes, sys, uuid
from hypothesis import HealthCheck, given, settings, strategies as st
import ucm
from ucm.native import segments

SIZES = [1024, 3072]
unique_id = f"fuzz-ptr-{uuid.uuid4().hex[:12]}"
config = {
    "unique_id": unique_id,
    "tensor_size_list": SIZES,
    "shards_per_block": 2,
    "tiers": [
        {"type": "buffer", "capacity": 16 * sum(SIZES), "wait_timeout_s": 1.0},
        {"type": "posix", "path": sys.argv[1]},
    ],
}
store = ucm.open(config)
# Real memory of the right size: the only addresses a fuzzed call may ever receive.
memory = [[ctypes.create_string_buffer(size) for size in SIZES] for _ in range(4)]
def address(block, tensor):
    return ctypes.addressof(memory[block][tensor])

# Pointer entries are never a random positive int: bad types, zero, negatives, or real memory.
bad_scalar = st.one_of(
    st.integers(max_value=0), st.none(), st.booleans(), st.floats(), st.text(max_size=3),
    st.binary(max_size=3),
)

@st.composite
def pointers(draw, count):
    rows = []
    for block in range(draw(st.integers(0, count + 1))):
        shape = draw(st.sampled_from(["row", "short", "long", "scalar", "bad"]))
        good = [address(block % 4, j) for j in range(2)]
        if shape == "row":
            row = [draw(st.one_of(st.just(good[j]), bad_scalar)) for j in range(2)]
        elif shape == "short":
            row = good[:1]
        elif shape == "long":
            row = good + [good[0]]
        elif shape == "scalar":
            row = good[0]
        else:
            row = draw(bad_scalar)
        rows.append(row)
    return draw(st.one_of(st.just(rows), bad_scalar))

ids = st.lists(st.binary(min_size=16, max_size=16), min_size=0, max_size=4, unique=True)

@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def fuzz(data):
    block_ids = data.draw(ids)
    shard_index = data.draw(st.one_of(st.integers(-1, 3), st.lists(st.integers(-1, 2))))
    for call in (store.load_data, store.dump_data):
        try:
            task = call(block_ids, shard_index, data.draw(pointers(len(block_ids))))
        except ucm.UcmError:
            continue
        try:
            store.wait(task)
        except ucm.TaskError:
            pass

fuzz()
store.close()
segments.unlink(unique_id)
print("fuzzed ok")
"""


@pytest.mark.timeout(180)
def test_fuzzed_pointer_calls_raise_only_ucm_errors_in_a_child(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, "-c", POINTER_FUZZ, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert completed.returncode == 0, (completed.returncode, completed.stderr[-3000:])
    assert completed.stdout.strip().endswith("fuzzed ok")


STATS_AFTER_CLOSE = r"""
import sys
import ucm
config = {
    "unique_id": sys.argv[1],
    "shard_size": 4096,
    "shards_per_block": 1,
    "tiers": [{"type": "buffer", "capacity": "64KiB"}, {"type": "posix", "path": sys.argv[2]}],
}
store = ucm.open(config)
store.close()
try:
    stats = store.stats()
    print("stats", type(stats).__name__)
except ucm.UcmError as error:
    print("refused", type(error).__name__)
"""


def test_stats_after_close_of_a_buffer_stack_does_not_crash(tmp_path: Path) -> None:
    unique_id = f"fuzz-stats-{uuid.uuid4().hex[:12]}"
    completed = subprocess.run(
        [sys.executable, "-c", STATS_AFTER_CLOSE, unique_id, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    segments.unlink(unique_id)
    assert completed.returncode == 0, (completed.returncode, completed.stderr[-2000:])
    assert completed.stdout.split()[0] in ("stats", "refused"), completed.stdout
