"""The key and geometry module every engine integration shares (ucm.integration.keys)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import pytest
import torch

import ucm
from ucm.integration.keys import (
    EngineGeometry,
    KeySpace,
    chain_block_ids,
    engine_stack,
    named_block_id,
)

SPACE = KeySpace(
    engine="vllm",
    model="/models/llama-tiny",
    dtype="torch.float32",
    block_tokens=4,
    kv_layout="[num_blocks, kv_heads, block_size, 2*head_size] x 2 layers",
    tp_size=1,
)
GEOMETRY = EngineGeometry(tensor_sizes=(4096, 4096), shards_per_block=2, description="2 layers")


def test_chain_ids_name_the_whole_prefix() -> None:
    salt = SPACE.salt()
    tokens = list(range(100, 111))  # 2 full blocks of 4 and a partial one of 3
    ids = chain_block_ids(salt, tokens, 4)
    assert len(ids) == 2
    assert all(isinstance(i, bytes) and len(i) == 16 for i in ids)
    assert ids == chain_block_ids(salt, tokens, 4)  # deterministic
    # Same first block, different second block: the first id is shared, the second is not.
    other = chain_block_ids(salt, [*tokens[:4], 7, 7, 7, 7], 4)
    assert other[0] == ids[0] and other[1] != ids[1]
    # A different first block changes every later id, even with equal later tokens.
    shifted = chain_block_ids(salt, [0, *tokens[1:]], 4)
    assert shifted[0] != ids[0] and shifted[1] != ids[1]
    # A continued chain gives the same ids as one computed from the start.
    assert chain_block_ids(salt, tokens, 4, parent=ids[0], start_block=1) == ids[1:]
    with pytest.raises(ValueError, match="parent"):
        chain_block_ids(salt, tokens, 4, start_block=1)


def test_every_key_space_field_changes_the_ids() -> None:
    tokens = list(range(8))
    base = chain_block_ids(SPACE.salt(), tokens, 4)
    variants = [
        dataclasses.replace(SPACE, engine="sglang"),
        dataclasses.replace(SPACE, model="/models/other"),
        dataclasses.replace(SPACE, dtype="torch.bfloat16"),
        dataclasses.replace(SPACE, block_tokens=8),
        dataclasses.replace(SPACE, kv_layout="[2, num_blocks, block_size, kv_heads, head_size]"),
        dataclasses.replace(SPACE, tp_size=2),
        dataclasses.replace(SPACE, extra=(("kv_cache_dtype", "fp8"),)),
    ]
    seen = {base[0]}
    for space in variants:
        first = chain_block_ids(space.salt(), tokens, 4)[0]
        assert first not in seen, space
        seen.add(first)
    salted = chain_block_ids(SPACE.salt("tenant-a"), tokens, 4)[0]
    assert salted not in seen
    assert salted != chain_block_ids(SPACE.salt("tenant-b"), tokens, 4)[0]


def test_named_ids_are_typed_and_distinct_from_chain_ids() -> None:
    salt = SPACE.salt()
    ids = {
        named_block_id(salt, 5),
        named_block_id(salt, "5"),
        named_block_id(salt, b"5"),
        named_block_id(salt, -5),
    }
    assert len(ids) == 4
    assert named_block_id(salt, "abc") == named_block_id(salt, "abc")
    other = dataclasses.replace(SPACE, tp_size=2).salt()
    assert named_block_id(salt, "abc") != named_block_id(other, "abc")
    assert all(len(i) == 16 for i in ids)


def test_ids_are_stable_across_processes() -> None:
    """Python's hash() is randomised per process; UCM ids must not be."""
    code = (
        "from ucm.integration.keys import KeySpace, chain_block_ids;"
        "s = KeySpace('vllm', 'm', 'f32', 4, 'l', 1).salt('x');"
        "print(chain_block_ids(s, list(range(8)), 4)[1].hex())"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(outputs) == 1
    salt = KeySpace("vllm", "m", "f32", 4, "l", 1).salt("x")
    assert outputs == {chain_block_ids(salt, list(range(8)), 4)[1].hex()}


def test_engine_stack_adds_the_geometry(tmp_path: Path) -> None:
    stack = {"unique_id": "engine-keys", "tiers": [{"type": "posix", "path": str(tmp_path)}]}
    config = engine_stack(stack, GEOMETRY, key="extra['ucm_stack']", engine="vLLM")
    assert isinstance(config, ucm.StackConfig)
    assert config.tensor_size_list == [4096, 4096]
    assert config.shards_per_block == 2
    assert config.resolved_shard_size == 8192
    path = tmp_path / "stack.yaml"
    path.write_text(f"unique_id: engine-keys\ntiers:\n  - type: posix\n    path: {tmp_path}\n")
    assert engine_stack(str(path), GEOMETRY, key="k", engine="vLLM") == config
    assert engine_stack(path, GEOMETRY, key="k", engine="vLLM") == config
    # A stated geometry that agrees is accepted; a StackConfig goes through the same check.
    agreeing = {**stack, "shard_size": 8192, "shards_per_block": 2}
    assert engine_stack(agreeing, GEOMETRY, key="k", engine="vLLM") == config
    assert engine_stack(config, GEOMETRY, key="k", engine="vLLM") == config


@pytest.mark.parametrize(
    ("stated", "named"),
    [
        ({"shards_per_block": 4}, "shards_per_block: 4"),
        ({"shard_size": 1024}, "shard_size: 1024"),
        ({"tensor_size_list": [4096]}, "tensor_size_list: [4096]"),
    ],
)
def test_engine_stack_refuses_a_contradicting_geometry(
    tmp_path: Path, stated: dict[str, object], named: str
) -> None:
    stack = {"unique_id": "u", "tiers": [{"type": "posix", "path": str(tmp_path)}], **stated}
    with pytest.raises(ucm.ConfigError) as info:
        engine_stack(stack, GEOMETRY, key="kv_connector_extra_config['ucm_stack']", engine="vLLM")
    message = str(info.value)
    assert message.startswith("kv_connector_extra_config['ucm_stack']: the stack states ")
    assert named in message
    assert (
        "vLLM's KV cache has shard_size 8192, tensor_size_list [4096, 4096], shards_per_block 2"
        " (2 layers)" in message
    )


def test_engine_stack_errors_name_the_key(tmp_path: Path) -> None:
    key = "kv_connector_extra_config['ucm_stack']"
    with pytest.raises(
        ucm.ConfigError,
        match=r"^kv_connector_extra_config\['ucm_stack'\] is "
        "missing: give the path of a YAML stack",
    ):
        engine_stack(None, GEOMETRY, key=key, engine="vLLM")
    with pytest.raises(ucm.ConfigError, match=r"\['ucm_stack'\]: cannot read stack file"):
        engine_stack(str(tmp_path / "absent.yaml"), GEOMETRY, key=key, engine="vLLM")
    with pytest.raises(ucm.ConfigError, match=r"must be the path of a YAML stack or a dict, got"):
        engine_stack(42, GEOMETRY, key=key, engine="vLLM")  # type: ignore[arg-type]
    bad = {"unique_id": "u", "tiers": [{"type": "posix", "path": str(tmp_path), "capcity": 1}]}
    with pytest.raises(ucm.ConfigError) as info:
        engine_stack(bad, GEOMETRY, key=key, engine="vLLM")
    assert str(info.value).startswith(f"{key} (stack): invalid stack")
    assert "tiers[0].capcity: unknown key" in str(info.value)
    unknown = {"unique_id": "u", "tiers": [{"type": "nvme"}]}
    with pytest.raises(ucm.ConfigError, match=r"unknown tier type 'nvme'; installed tier types"):
        engine_stack(unknown, GEOMETRY, key=key, engine="vLLM")


def test_importing_the_integration_package_imports_no_engine() -> None:
    code = (
        "import sys, ucm.integration, ucm.integration.keys;"
        "print(sorted(m for m in ('torch', 'vllm', 'lmcache', 'sglang') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- reset epochs -------------------------------------------------------------------------------


def test_epochs_are_control_records_every_process_sees(tmp_path: Path) -> None:
    """The current epoch is the stack's control record: raised by a reset, read by every
    process (a scheduler-role store too), per writer, never lowered, and no block."""
    from ucm.integration.keys import Epochs

    stack = {
        "unique_id": f"epochs-{uuid.uuid4().hex[:8]}",
        "tensor_size_list": [64, 64],
        "shards_per_block": 2,
        "tiers": [
            {"type": "buffer", "capacity": 16 * 128},
            {"type": "posix", "path": str(tmp_path), "lookup_timeout_ms": 60_000},
        ],
    }
    base = SPACE.salt()
    assert SPACE.salt(epoch=0) == base and SPACE.salt(epoch=1) != base
    epochs, other = Epochs(base), Epochs(base, writer="tp1")
    assert epochs.name != other.name and len(epochs.name) == 16
    with ucm.open(stack, device_id=0, local_rank_size=2) as worker:
        scheduler = ucm.open(stack, device_id=-1, local_rank_size=2)
        assert epochs.current(scheduler) == 0
        assert epochs.begin(worker) == 1 and epochs.current(scheduler) == 1
        assert epochs.begin(scheduler, after=5) == 6  # this process was already in epoch 5
        assert epochs.current(worker) == 6
        worker.raise_control(epochs.name, 2)  # a late raise never lowers it
        assert epochs.current(scheduler) == 6
        assert other.current(scheduler) == 0  # another writer's sequence
        # Held by the buffer's node-wide table and by posix alike; no block of either.
        assert [tier.read_control([epochs.name]) for tier in worker.tiers] == [[6], [6]]
        assert worker.tiers[1].list_keys() == []
        assert worker.buffer is not None
        assert sum(row.occupancy_slots for row in worker.buffer.core.namespaces()) == 0
        scheduler.close()
    # Every process closed (the buffer gone): posix still holds it.
    with ucm.open(stack, device_id=-1, local_rank_size=1) as later:
        assert epochs.current(later) == 6
    with pytest.raises(ValueError, match="epoch must be an int >= 0"):
        SPACE.salt(epoch=-1)


def test_control_record_reads_name_the_bad_argument_and_a_tier_without_records_fails_closed(
    tmp_path: Path,
) -> None:
    from ucm.integration.keys import Epochs, EpochState
    from ucm.tier import Tier

    stack = _slow_markers_stack(tmp_path, f"epochs-args-{uuid.uuid4().hex[:8]}")
    stack["tiers"][0]["lookup_timeout_ms"] = 60_000  # type: ignore[index]
    with ucm.open(stack, device_id=0) as store:
        with pytest.raises(ucm.InvalidArgumentError, match=r"names\[0\]=b'short' is not valid"):
            store.read_control([b"short"])
        with pytest.raises(ucm.InvalidArgumentError, match="value=-1 is not valid"):
            store.raise_control(bytes(16), -1)
        # A tier type that keeps no control records (a third party's): the read fails closed.
        tier = store.tiers[0]
        tier.read_control = partial(Tier.read_control, tier)  # type: ignore[method-assign]
        with pytest.raises(ucm.LookupUnansweredError, match="keeps no control records"):
            store.read_control([bytes(16)])
        state = EpochState(Epochs(SPACE.salt()), store)
        try:
            assert state.start() is None  # unknown: ids carry a nonce
        finally:
            state.close()


def test_a_damaged_record_file_fails_closed_never_reads_as_zero(tmp_path: Path) -> None:
    from ucm.integration.keys import Epochs

    stack = _slow_markers_stack(tmp_path, f"epochs-torn-{uuid.uuid4().hex[:8]}")
    stack["tiers"][0]["lookup_timeout_ms"] = 60_000  # type: ignore[index]
    epochs = Epochs(SPACE.salt())
    with ucm.open(stack, device_id=0) as store:
        assert epochs.begin(store) == 1
        assert epochs.begin(store) == 2
    files = list((tmp_path / "control" / epochs.name.hex()).iterdir())
    assert [f.name for f in files] == [f"{2:020d}"]  # lower values are dropped
    files[0].write_bytes(files[0].read_bytes()[:-1])  # torn
    with (
        ucm.open(stack, device_id=0) as store,
        pytest.raises(ucm.LookupUnansweredError, match="torn or corrupt"),
    ):
        epochs.current(store)


SLOW_TIMEOUT_MS = 1000
"""The records tier's deadline in the slow-tier tests."""
SLOW_READ_S = 2.5
"""How long a gated record read takes: past SLOW_TIMEOUT_MS."""


def _slow_markers_stack(tmp_path: Path, unique_id: str) -> dict[str, object]:
    return {
        "unique_id": unique_id,
        "tensor_size_list": [64, 64],
        "shards_per_block": 2,
        "tiers": [
            {
                "type": "posix",
                "path": str(tmp_path),
                # Long enough for a busy machine to answer a healthy read; the gate below
                # holds a read well past it.
                "lookup_timeout_ms": SLOW_TIMEOUT_MS,
                "breaker": {"probe_interval_ms": 100},
            }
        ],
    }


class _Gate:
    """Makes a tier's control record reads answer past their deadline while ``slow`` is set."""

    def __init__(self, tier: object) -> None:
        self.slow = threading.Event()
        self.slow.set()
        answer = tier.read_control  # type: ignore[attr-defined]

        def read_control(names: Sequence[bytes]) -> list[int | None]:
            if self.slow.is_set():
                time.sleep(SLOW_READ_S)
            return list(answer(names))

        tier.read_control = read_control  # type: ignore[attr-defined]


def test_an_epoch_read_while_the_records_tier_does_not_answer_is_never_a_lower_one(
    tmp_path: Path,
) -> None:
    """A tier past its deadline answers "absent" to a request's look-up; the epoch's read must
    not take that for "no record" (the epoch would fall back, and blocks saved before the
    reset be served once the tier answers again): it raises, naming the tier and why."""
    from ucm.integration.keys import Epochs

    stack = _slow_markers_stack(tmp_path, "epochs-slow")
    epochs = Epochs(SPACE.salt())
    with ucm.open(stack, device_id=0, local_rank_size=1) as worker:
        assert epochs.begin(worker) == 1
    with ucm.open(stack, device_id=-1, local_rank_size=1) as scheduler:
        _Gate(scheduler.tiers[0])
        with pytest.raises(ucm.LookupUnansweredError) as raised:
            epochs.current(scheduler)
        assert "tier 'posix' did not answer a control record read" in str(raised.value)
        assert f"lookup_timeout_ms={SLOW_TIMEOUT_MS}" in str(raised.value)


def _poll_until(state: object, bound_s: float = 30.0) -> int:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        adopted = state.poll()  # type: ignore[attr-defined]
        if adopted is not None:
            return adopted  # type: ignore[no-any-return]
        time.sleep(0.02)
    raise AssertionError(f"the epoch was not adopted within {bound_s} s")


def test_an_unknown_epoch_salts_ids_with_a_nonce_until_the_tier_answers(tmp_path: Path) -> None:
    """EpochState: unknown at start (the records' tier past its deadline), a nonce; adopted,
    on the engine's thread, once a retry on its own thread reads it; never a lower epoch."""
    from ucm.integration.keys import Epochs, EpochState, provisional_salt

    stack = _slow_markers_stack(tmp_path, "epochs-state")
    epochs = Epochs(SPACE.salt())
    with ucm.open(stack, device_id=0, local_rank_size=1) as worker:
        assert epochs.begin(worker) == 1 and epochs.begin(worker) == 2
    with ucm.open(stack, device_id=-1, local_rank_size=1) as scheduler:
        gate = _Gate(scheduler.tiers[0])
        state = EpochState(epochs, scheduler, retry_s=0.05)
        try:
            assert state.start() is None and state.epoch is None
            salt = provisional_salt(SPACE.salt(), state.nonce)
            assert salt not in {SPACE.salt(epoch=n) for n in range(4)}
            other = EpochState(epochs, scheduler, retry_s=0.05)
            assert other.start() is None and other.nonce != state.nonce  # per process
            time.sleep(0.3)
            assert state.poll() is None  # retries while the tier is slow: still unknown
            assert state.epoch is None
            gate.slow.clear()
            assert _poll_until(state) == 2
            assert state.epoch == 2 and state.poll() is None and state.unrecorded is None
            other.close()
        finally:
            state.close()


def test_a_reset_while_the_epoch_cannot_be_read_is_pending_then_goes_past_the_stack(
    tmp_path: Path,
) -> None:
    from ucm.integration.keys import Epochs, EpochState

    stack = _slow_markers_stack(tmp_path, "epochs-pending")
    epochs = Epochs(SPACE.salt())
    with ucm.open(stack, device_id=0, local_rank_size=1) as worker:
        assert epochs.begin(worker) == 1
        state = EpochState(epochs, worker, retry_s=0.05)
        try:
            assert state.start() == 1
            assert state.reset() == 2  # the tier answers: recorded at once
            assert epochs.current(worker) == 2 and state.unrecorded is None
            gate = _Gate(worker.tiers[0])
            nonce = state.nonce
            assert state.reset() is None  # cannot read the stack's epoch: pending
            assert state.epoch is None and state.nonce != nonce
            worker.tiers[0].raise_control(epochs.name, 5)  # another process reset 3 times
            gate.slow.clear()
            assert _poll_until(state) == 6  # past the stack's
            assert state.epoch == 6
            deadline = time.monotonic() + 30
            while state.unrecorded is not None:  # recorded from the next polls
                assert time.monotonic() < deadline, "the pending reset was never recorded"
                state.poll()
                time.sleep(0.02)
            assert epochs.current(worker) == 6
        finally:
            state.close()


def test_a_reset_a_tier_did_not_take_is_recorded_again_until_it_is(tmp_path: Path) -> None:
    from ucm.integration.keys import Epochs, EpochState

    stack = _slow_markers_stack(tmp_path, f"epochs-retry-{uuid.uuid4().hex[:8]}")
    stack["tiers"][0]["lookup_timeout_ms"] = 60_000  # type: ignore[index]
    epochs = Epochs(SPACE.salt())
    with ucm.open(stack, device_id=0) as store:
        tier = store.tiers[0]
        answer = tier.raise_control
        failing = threading.Event()
        failing.set()

        def raise_control(name: bytes, value: int) -> None:
            if failing.is_set():
                raise ucm.TierError("disk full (injected)")
            answer(name, value)

        tier.raise_control = raise_control  # type: ignore[method-assign]
        state = EpochState(epochs, store, retry_s=0.05)
        try:
            assert state.start() == 0
            assert state.reset() == 1  # this process is in epoch 1 at once
            assert state.unrecorded == 1 and epochs.current(store) == 0
            failing.clear()
            deadline = time.monotonic() + 30
            while state.unrecorded is not None:
                assert time.monotonic() < deadline, "the reset was never recorded"
                assert state.poll() is None
                time.sleep(0.02)
            assert epochs.current(store) == 1
        finally:
            state.close()


def test_epoch_reads_stuck_in_a_tier_never_take_the_requests_look_up_threads(
    tmp_path: Path,
) -> None:
    """An engine whose epoch is unknown reads it again every few seconds; against a tier that
    hangs each read stays on a thread until the tier's client gives up. Those reads run on
    the tier's own exact-look-up thread, so however many pile up (a breaker set never to
    open), a request's look-up still gets one of the tier's look-up threads and its answer."""
    from ucm.breaker import EXACT_LOOKUP_THREADS, LOOKUP_THREADS
    from ucm.integration.keys import Epochs

    stack = _slow_markers_stack(tmp_path, "epochs-stuck")
    stack["tiers"][0]["breaker"] = {"failures": 1_000_000}  # type: ignore[index]
    epochs = Epochs(SPACE.salt())
    block = bytes(range(16))
    with ucm.open(stack, device_id=0, local_rank_size=1) as worker:
        assert epochs.begin(worker) == 1
        src = [[torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)]]
        for shard in range(2):
            worker.wait(worker.dump([block], shard, src))
    with ucm.open(stack, device_id=-1, local_rank_size=1) as scheduler:
        tier = scheduler.tiers[0]
        answer = tier.read_control
        hanging, release = threading.Event(), threading.Event()
        hanging.set()

        def read_control(names: Sequence[bytes]) -> list[int | None]:
            if hanging.is_set():  # a black hole while the epoch is read
                release.wait(60)
            return list(answer(names))

        tier.read_control = read_control  # type: ignore[method-assign]
        try:
            messages = []
            for _ in range(LOOKUP_THREADS + 2):
                with pytest.raises(ucm.LookupUnansweredError) as raised:
                    epochs.current(scheduler)
                messages.append(str(raised.value))
            hanging.clear()  # the tier answers new calls; the epoch's reads are still stuck
            # A request's look-up is answered.
            assert scheduler.lookup([block]) == [True]
            assert f"lookup_timeout_ms={SLOW_TIMEOUT_MS}" in messages[0]
            assert messages[-1].endswith(
                f"all {EXACT_LOOKUP_THREADS} of its exact look-up threads are held by earlier calls"
            )
            assert scheduler.stats()["tiers"][0]["lookup_busy"] == LOOKUP_THREADS + 1
        finally:
            release.set()


def test_multi_node_tp_warns_naming_the_shared_tier_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from ucm.integration.keys import warn_node_local
    from ucm.stack import parse_stack

    def stack(*tiers: dict[str, object]) -> ucm.StackConfig:
        return parse_stack(
            {"unique_id": "w", "tensor_size_list": [64], "shards_per_block": 4, "tiers": tiers}
        )

    buffer_only = stack({"type": "buffer", "capacity": "1MiB"})
    with_posix = stack({"type": "buffer", "capacity": "1MiB"}, {"type": "posix", "path": "/x"})
    with caplog.at_level(logging.WARNING, logger="ucm.integration.keys"):
        assert not warn_node_local("vLLM", 1, 4, buffer_only)  # one node
        assert not warn_node_local("vLLM", 2, 1, buffer_only)  # one shard per block (MLA)
        assert warn_node_local("vLLM", 2, 4, with_posix)
    (message,) = [record.getMessage() for record in caplog.records]
    assert message.startswith("UCM: vLLM runs tensor parallelism over 2 nodes: a block is 4 shards")
    assert "this stack's lower tier(s) ['posix'] hit only if every node shares them" in message
    assert message.endswith(
        "Fix: give the stack a shared lower tier (posix on a shared filesystem, s3, mooncake)"
    )


def test_an_fp8_tier_must_name_the_engines_kv_dtype(tmp_path: Path) -> None:
    """The lossy fp8 codec sees bytes only: an engine whose KV dtype differs from a tier's
    `source_dtype` is refused at open, naming the tier's YAML path (with a `buffer:` section
    too, whose parsed tiers start with the buffer)."""
    geometry = dataclasses.replace(GEOMETRY, dtype="torch.bfloat16")
    fp8 = {"type": "fp8", "source_dtype": "float16"}
    tiers = [
        {"type": "posix", "path": str(tmp_path / "a")},
        {"type": "posix", "path": str(tmp_path / "b"), "codec": fp8},
    ]
    stack = {"unique_id": "engine-fp8", "tiers": tiers}
    with pytest.raises(ucm.ConfigError) as info:
        engine_stack(stack, geometry, key="extra['ucm_stack']", engine="vLLM")
    assert str(info.value) == (
        "extra['ucm_stack']: tiers[1].codec.source_dtype is 'float16', but vLLM's KV cache "
        "holds bfloat16: the lossy fp8 codec must name the KV dtype (source_dtype: bfloat16)"
    )
    with_buffer = {**stack, "buffer": {"capacity": 1 << 20}}
    with pytest.raises(ucm.ConfigError, match=r"^k: tiers\[1\]\.codec\.source_dtype is"):
        engine_stack(with_buffer, geometry, key="k", engine="vLLM")
    fp8_kv = dataclasses.replace(GEOMETRY, dtype="torch.float8_e4m3fn")
    with pytest.raises(ucm.ConfigError, match=r"fp8 stores float16, bfloat16, float32 KV only"):
        engine_stack(stack, fp8_kv, key="k", engine="vLLM")
    # The engine's own dtype, or an engine that does not say, is accepted.
    right = {
        **stack,
        "tiers": [tiers[0], {**tiers[1], "codec": {**fp8, "source_dtype": "bfloat16"}}],
    }
    assert engine_stack(right, geometry, key="k", engine="vLLM").tiers[1].codec == (
        ucm.codecs.Fp8Codec(source_dtype="bfloat16")
    )
    assert engine_stack(stack, GEOMETRY, key="k", engine="vLLM").resolved_shard_size == 8192
