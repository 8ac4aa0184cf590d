"""The public Store API over a stack of tiers: byte-exact round trips for every shard layout,
cascade semantics, failures, remove counts, and every documented bad-argument error."""

from __future__ import annotations

import ctypes
import re
from typing import Any

import pytest
import torch

import ucm
from ucm.errors import InvalidArgumentError, RoleError, StoreClosedError, TaskError

from .conftest import SHARED, block, payload

LAYOUTS = {
    "one tensor per shard": {"shard_size": 4096},
    "K and V": {"tensor_size_list": [2048, 2048]},
    "layer plus chunk": {"tensor_size_list": [512] * 8},
    "different sizes": {"tensor_size_list": [1000, 3000, 96]},
}


def stack(geometry: dict[str, Any], *tiers: dict[str, Any], shards: int = 4) -> dict[str, Any]:
    return {"unique_id": "t", "shards_per_block": shards, **geometry, "tiers": list(tiers)}


def tensors_for(store: ucm.Store, block_id: bytes, shard: int) -> list[torch.Tensor]:
    data = payload(block_id, shard, store.layout.shard_size)
    out, offset = [], 0
    for n in store.layout.tensor_sizes:
        out.append(torch.frombuffer(bytearray(data[offset : offset + n]), dtype=torch.uint8))
        offset += n
    return out


def empty_for(store: ucm.Store) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=torch.uint8) for n in store.layout.tensor_sizes]


def joined(tensors: list[torch.Tensor]) -> bytes:
    return b"".join(t.numpy().tobytes() for t in tensors)


@pytest.mark.parametrize("geometry", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_dump_then_load_is_byte_exact_for_every_layout(dict_tier, geometry) -> None:
    with ucm.open(stack(geometry, {"type": "dict", "space": "top"})) as store:
        blocks = [block(i) for i in range(6)]
        shards = [i % 4 for i in range(6)]
        src = [tensors_for(store, b, s) for b, s in zip(blocks, shards, strict=True)]
        store.wait(store.dump(blocks, shards, src))
        dst = [empty_for(store) for _ in blocks]
        task = store.load(blocks, shards, dst)
        store.wait(task)
        assert store.check(task) is True
        for b, s, tensors in zip(blocks, shards, dst, strict=True):
            assert joined(tensors) == payload(b, s, store.layout.shard_size)


def test_typed_tensors_keep_their_bytes(dict_tier) -> None:
    geometry = {"tensor_size_list": [2 * 8 * 16, 2 * 8 * 16]}  # fp16 K and V of shape (8, 16)
    with ucm.open(stack(geometry, {"type": "dict", "space": "top"})) as store:
        k = torch.randn(8, 16).to(torch.float16)
        v = torch.randn(8, 16).to(torch.float16)
        store.wait(store.dump([block(1)], [2], [[k, v]]))
        k2, v2 = torch.empty(8, 16, dtype=torch.float16), torch.empty(8, 16, dtype=torch.float16)
        store.wait(store.load([block(1)], [2], [[k2, v2]]))
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_raw_pointer_calls_round_trip(dict_tier) -> None:
    geometry = {"tensor_size_list": [100, 300]}
    with ucm.open(stack(geometry, {"type": "dict", "space": "top"})) as store:
        src = [(ctypes.c_ubyte * 100)(*range(100)), (ctypes.c_ubyte * 300)(*[7] * 300)]
        store.wait(
            store.dump_data([block(9)], [0], [[ctypes.addressof(src[0]), ctypes.addressof(src[1])]])
        )
        dst = [(ctypes.c_ubyte * 100)(), (ctypes.c_ubyte * 300)()]
        store.wait(
            store.load_data([block(9)], [0], [[ctypes.addressof(dst[0]), ctypes.addressof(dst[1])]])
        )
        assert bytes(dst[0]) == bytes(range(100))
        assert bytes(dst[1]) == b"\x07" * 300


def test_lookup_and_prefix_with_a_hole(dict_tier) -> None:
    with ucm.open(stack({"shard_size": 64}, {"type": "dict", "space": "top"}, shards=2)) as store:
        present = [block(0), block(1), block(3)]
        for b in present:
            store.wait(
                store.dump([b, b], [0, 1], [tensors_for(store, b, 0), tensors_for(store, b, 1)])
            )
        store.wait(store.dump([block(2)], [0], [tensors_for(store, block(2), 0)]))  # half a block
        ids = [block(i) for i in range(4)]
        assert store.lookup(ids) == [True, True, False, True]
        assert store.lookup_on_prefix(ids) == 1
        assert store.lookup_on_prefix([block(2), block(0)]) == -1
        assert store.lookup_on_prefix(present[:2]) == 1
        assert store.lookup([]) == []
        assert store.lookup_on_prefix([]) == -1


def test_load_falls_through_and_promotes_into_the_top_tier(dict_tier) -> None:
    tiers = (
        {"type": "dict", "space": "top"},
        {"type": "dict", "space": "mid", "promote": True},
        {"type": "dict", "space": "low", "write": "none"},
    )
    with ucm.open(stack({"shard_size": 128}, *tiers)) as store:
        key = (block(5), 3)
        SHARED["low"][key] = payload(*key, 128)
        dst = [empty_for(store)]
        store.wait(store.load([block(5)], [3], dst))
        assert joined(dst[0]) == payload(*key, 128)
        assert SHARED["top"][key] == payload(*key, 128)
        assert SHARED["mid"][key] == payload(*key, 128)
        stats = store.stats()
        assert (stats["hits"], stats["misses"], stats["promoted_shards"]) == (0, 1, 2)
        store.wait(store.load([block(5)], [3], [empty_for(store)]))
        assert store.stats()["hits"] == 1


def test_intermediate_tier_without_promote_is_skipped(dict_tier) -> None:
    tiers = (
        {"type": "dict", "space": "top"},
        {"type": "dict", "space": "mid"},
        {"type": "dict", "space": "low"},
    )
    with ucm.open(stack({"shard_size": 32}, *tiers)) as store:
        key = (block(1), 0)
        SHARED["low"][key] = payload(*key, 32)
        store.wait(store.load([block(1)], [0], [empty_for(store)]))
        assert key in SHARED["top"] and key not in SHARED["mid"]


def test_dump_writes_through_asynchronously_and_close_finishes_it(dict_tier) -> None:
    tiers = (
        {"type": "dict", "space": "top"},
        {"type": "dict", "space": "nvme", "write": "through"},
        {"type": "dict", "space": "ro", "write": "none"},
        {"type": "dict", "space": "s3", "write": "back"},
    )
    store = ucm.open(stack({"shard_size": 256}, *tiers))
    blocks = [block(i) for i in range(20)]
    src = [tensors_for(store, b, 1) for b in blocks]
    store.wait(store.dump(blocks, 1, src))
    for tensors in src:  # the caller may reuse its tensors at once
        tensors[0].zero_()
    assert len(SHARED["top"]) == 20
    store.close()
    assert {k: v for k, v in SHARED["nvme"].items()} == {(b, 1): payload(b, 1, 256) for b in blocks}
    assert SHARED["ro"] == {} and SHARED["s3"] == {}
    assert store.stats()["write_through_shards"] == 20


def test_the_evict_sink_writes_what_a_tier_evicts_to_the_back_tier(dict_tier) -> None:
    """The Store's side of write-back: the sink a tier gets delivers its evictions to the
    `write: back` tier. (What a failed write-down means for the evicting tier is the tier's
    own rule: asserted on the real tiers in test_store_real_tiers.py and test_write_back.py.)"""
    tiers = (
        {"type": "dict", "space": "top", "capacity_shards": 2},
        {"type": "dict", "space": "back", "write": "back"},
    )
    with ucm.open(stack({"shard_size": 64}, *tiers)) as store:
        blocks = [block(i) for i in range(5)]
        store.wait(store.dump(blocks, 0, [tensors_for(store, b, 0) for b in blocks]))
        assert set(SHARED["top"]) == {(block(3), 0), (block(4), 0)}
        assert SHARED["back"] == {(b, 0): payload(b, 0, 64) for b in blocks[:3]}
        dst = [empty_for(store) for _ in blocks]
        store.wait(store.load(blocks, 0, dst))
        assert [joined(d) for d in dst] == [payload(b, 0, 64) for b in blocks]
        assert store.stats()["written_back_shards"] >= 3


def test_the_evict_sink_reports_a_failed_write_back_per_key(dict_tier) -> None:
    """The sink returns the write-back tier's per-key failure, so the evicting tier can keep
    the shard (here the dict tier keeps it; the real tiers' own tests assert that they do)."""
    tiers = (
        {"type": "dict", "space": "top", "capacity_shards": 1},
        {"type": "dict", "space": "back", "write": "back", "fail_blocks": [block(0).hex()]},
    )
    with ucm.open(stack({"shard_size": 64}, *tiers)) as store:
        store.wait(
            store.dump([block(0), block(1)], 0, [tensors_for(store, block(i), 0) for i in (0, 1)])
        )
        assert (block(0), 0) in SHARED["top"]  # its write-down failed: not dropped


def test_a_failing_key_fails_alone_and_is_named(dict_tier) -> None:
    bad = block(2)
    tiers = (
        {"type": "dict", "space": "top"},
        {"type": "dict", "space": "low", "fail_blocks": [bad.hex()]},
    )
    with ucm.open(stack({"shard_size": 64}, *tiers)) as store:
        blocks = [block(i) for i in range(4)]
        for b in blocks:
            if b != bad:
                SHARED["low"][(b, 0)] = payload(b, 0, 64)
        dst = [empty_for(store) for _ in blocks]
        task = store.load(blocks, 0, dst)
        with pytest.raises(TaskError) as info:
            store.wait(task)
        assert set(info.value.failures) == {(bad, 0)}
        assert f"block {bad.hex()} shard 0: TierError: injected failure in low" in str(info.value)
        for b, d in zip(blocks, dst, strict=True):
            if b != bad:
                assert joined(d) == payload(b, 0, 64)
        # Failures are not remembered: once the tier recovers, the key loads.
        SHARED["top"][(bad, 0)] = payload(bad, 0, 64)
        store.wait(store.load([bad], 0, [empty_for(store)]))


def test_missing_key_is_a_task_error_naming_it(dict_tier) -> None:
    config = stack({"shard_size": 64}, {"type": "dict", "space": "top"})
    with (
        ucm.open(config) as store,
        pytest.raises(TaskError, match=r"block 0+7 shard 1: KeyMissingError: not found in any"),
    ):
        store.wait(store.load([block(7)], [1], [empty_for(store)]))


def test_remove_counts_distinct_shards_across_tiers(dict_tier) -> None:
    tiers = ({"type": "dict", "space": "top"}, {"type": "dict", "space": "low", "write": "none"})
    with ucm.open(stack({"shard_size": 16}, *tiers, shards=2)) as store:
        for s in (0, 1):
            SHARED["top"][(block(1), s)] = b"x" * 16
            SHARED["low"][(block(1), s)] = b"x" * 16
        SHARED["top"][(block(2), 0)] = b"y" * 16
        SHARED["low"][(block(2), 1)] = b"y" * 16
        assert store.remove([]) == 0
        assert store.remove([block(99)]) == 0
        assert store.remove([block(1), block(2), block(1)]) == 4
        assert SHARED["top"] == {} and SHARED["low"] == {}


def test_remove_keeps_pinned_shards_unless_forced(dict_tier) -> None:
    with ucm.open(stack({"shard_size": 16}, {"type": "dict", "space": "top"}, shards=1)) as store:
        SHARED["top"][(block(1), 0)] = b"a" * 16
        SHARED["top"][(block(2), 0)] = b"b" * 16
        store.tiers[0].pins.pin([(block(1), 0)])
        assert store.remove([block(1), block(2)]) == 1
        assert (block(1), 0) in SHARED["top"]
        assert store.remove([block(1)], force=True) == 1
        assert SHARED["top"] == {}


def test_scheduler_answers_lookups_but_cannot_move_data(dict_tier) -> None:
    with ucm.open(stack({"shard_size": 16}, {"type": "dict", "space": "top"}, shards=1)) as worker:
        worker.wait(worker.dump([block(1)], 0, [tensors_for(worker, block(1), 0)]))
    with ucm.open(
        stack({"shard_size": 16}, {"type": "dict", "space": "top"}, shards=1), device_id=-1
    ) as scheduler:
        assert scheduler.lookup([block(1), block(2)]) == [True, False]
        message = "load is not allowed on a scheduler (device_id=-1)"
        with pytest.raises(RoleError, match=re.escape(message)):
            scheduler.load([block(1)], 0, [[torch.empty(16, dtype=torch.uint8)]])
        with pytest.raises(RoleError, match="dump is not allowed on a scheduler"):
            scheduler.dump_data([block(1)], 0, [[12345]])


def test_closed_store_refuses_calls(dict_tier) -> None:
    store = ucm.open(stack({"shard_size": 16}, {"type": "dict", "space": "top"}, shards=1))
    store.close()
    store.close()  # idempotent
    with pytest.raises(StoreClosedError, match="the store is closed"):
        store.lookup([block(1)])


def test_prefetch_moves_blocks_up(dict_tier) -> None:
    tiers = ({"type": "dict", "space": "top"}, {"type": "dict", "space": "low"})
    with ucm.open(stack({"shard_size": 16}, *tiers, shards=2)) as store:
        for s in (0, 1):
            SHARED["low"][(block(4), s)] = payload(block(4), s, 16)
        store.prefetch([block(4)])
        store.wait_prefetches()
        for s in (0, 1):
            assert SHARED["top"][(block(4), s)] == payload(block(4), s, 16)


# ---- bad arguments: rejected before anything is touched, naming argument and value ----------

BAD_CALLS = [
    (
        lambda s, t: s.load([b"short"], [0], [t]),
        r"block_ids\[0\] must be exactly 16 bytes, got 5 bytes",
    ),
    (
        lambda s, t: s.load(b"x" * 16, [0], [t]),
        r"block_ids must be a list of 16-byte block ids, got bytes",
    ),
    (lambda s, t: s.load([12], [0], [t]), r"block_ids\[0\] must be bytes of length 16, got int"),
    (
        lambda s, t: s.load([block(1)], [4], [t]),
        r"shard_index\[0\]=4 is out of range: expected an int in \[0, 4\)",
    ),
    (lambda s, t: s.load([block(1)], [-1], [t]), r"shard_index\[0\]=-1 is out of range"),
    (
        lambda s, t: s.load([block(1)], [0, 1], [t]),
        r"shard_index has 2 entries but block_ids has 1",
    ),
    (lambda s, t: s.load([block(1)], ["0"], [t]), r"shard_index\[0\]='0' is not valid"),
    (lambda s, t: s.load([block(1)], [0], [t, t]), r"dst has 2 entries but block_ids has 1"),
    (
        lambda s, t: s.load([block(1)], [0], [[t[0]]]),
        r"dst\[0\] has 1 tensor\(s\) but the shard layout has 2",
    ),
    (
        lambda s, t: s.load([block(1)], [0], [[torch.empty(10, dtype=torch.uint8), t[1]]]),
        r"dst\[0\]\[0\] has 10 bytes \(\(10,\) torch.uint8\) but the layout expects 32 bytes "
        r"\(tensor_size_list\[0\]\)",
    ),
    (
        lambda s, t: s.load([block(1)], [0], [[torch.empty(8, 8, dtype=torch.uint8)[:, :4], t[1]]]),
        r"dst\[0\]\[0\] is not contiguous",
    ),
    (
        lambda s, t: s.dump([block(1)], [0], [[b"x" * 32, t[1]]]),
        r"src\[0\]\[0\] must be a torch.Tensor, got bytes",
    ),
    (
        lambda s, t: s.load([block(1), block(1)], [0, 0], [t, t]),
        r"block_ids\[1\] with shard_index 0 repeats block_ids\[0\]",
    ),
    (lambda s, t: s.load_data([block(1)], [0], [[0, 1]]), r"dst_ptrs\[0\]\[0\]=0 is not valid"),
    (lambda s, t: s.load_data([block(1)], [0], [[1]]), r"dst_ptrs\[0\] must list 2 address\(es\)"),
    (lambda s, t: s.remove([block(1)], force="yes"), r"force must be a bool, got 'yes'"),
    (lambda s, t: s.wait("task"), r"task must be a ucm Task returned by load/dump, got str"),
    (lambda s, t: s.check(None), r"task must be a ucm Task"),
    (
        lambda s, t: s.wait(s.load([], [], []), timeout_s=-1),
        r"timeout_s=-1 is not valid: expected None \(no bound\) or a finite number of seconds, "
        r"0 or more",
    ),
    (
        lambda s, t: s.wait(s.load([], [], []), timeout_s=float("nan")),
        r"timeout_s=nan is not valid",
    ),
    (
        lambda s, t: s.wait(s.load([], [], []), timeout_s="5"),
        r"timeout_s must be None \(no bound\) or a finite number of seconds, 0 or more, got "
        r"str '5'",
    ),
    (lambda s, t: s.wait(s.load([], [], []), timeout_s=True), r"timeout_s must be .* got bool"),
    (lambda s, t: s.touch([b"1" * 17]), r"block_ids\[0\] must be exactly 16 bytes, got 17 bytes"),
]


@pytest.mark.parametrize(("call", "message"), BAD_CALLS)
def test_bad_arguments_raise_naming_argument_and_value(dict_tier, call, message) -> None:
    with ucm.open(stack({"tensor_size_list": [32, 32]}, {"type": "dict", "space": "top"})) as store:
        tensors = [torch.empty(32, dtype=torch.uint8), torch.empty(32, dtype=torch.uint8)]
        with pytest.raises(InvalidArgumentError, match=message):
            call(store, tensors)
        assert SHARED["top"] == {}  # nothing touched
        assert isinstance(InvalidArgumentError("x"), ucm.UcmError)


def test_bad_rank_parameters(dict_tier) -> None:
    config = stack({"shard_size": 16}, {"type": "dict", "space": "top"})
    with pytest.raises(InvalidArgumentError, match="local_rank_size must be >= 1, got 0"):
        ucm.open(config, device_id=0, local_rank_size=0)
    with pytest.raises(InvalidArgumentError, match=r"device_id must be an int .* got '0'"):
        ucm.open(config, device_id="0")


def test_import_ucm_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, ucm; ucm.open; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
