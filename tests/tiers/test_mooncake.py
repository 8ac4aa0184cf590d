"""The mooncake tier on its own, against a real mooncake_master on 127.0.0.1: naming, integrity,
leases, zero-copy registration, configuration errors, an unreachable or killed master. The
conformance suite runs in test_conformance_builtin.py; several nodes in test_mooncake_nodes.py."""

from __future__ import annotations

import dataclasses
import mmap
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from ucm_backends.mooncake import (
    ARENA_BYTES,
    HEADER_BYTES,
    INSTALL_HINT,
    MooncakeConfig,
    MooncakeTier,
)

import ucm
from harness.mooncake import MooncakeMaster
from harness.s3 import free_port
from ucm import envelope
from ucm.errors import ConfigError, KeyMissingError, TierError
from ucm.layout import Layout
from ucm.native.checksum import checksum
from ucm.native.pybuffer import buffer_address
from ucm.stack import parse_stack
from ucm.testing import make_context
from ucm.testing.conformance import (
    assert_loads_exact,
    block_ids,
    dump_keys,
    load_keys,
    shard_bytes,
    split,
)
from ucm.tier import HOST_MEMORY_OPTION, NAMESPACE_BYTES_OPTION, NamespaceBytes, TierContext

from .conftest import mooncake_tier

LAYOUT = Layout(shard_size=8192, shards_per_block=2, tensor_sizes=(8192,))
BOUND_S = 30.0
"""Generous bound on one call against a dead master (Mooncake answers within ~5 s here)."""


def prefix() -> str:
    return f"t{time.monotonic_ns()}"


def test_master_listens_on_loopback_only(mooncake_master: MooncakeMaster) -> None:
    addresses = mooncake_master.listening_addresses()
    assert {port for _host, port in addresses} == {
        mooncake_master.port,
        mooncake_master.metrics_port,
    }
    assert {host for host, _port in addresses} == {"127.0.0.1"}


def test_objects_are_named_by_block_and_shard_not_unique_id(
    mooncake_master: MooncakeMaster,
) -> None:
    namespace = prefix()
    writer = mooncake_tier(
        mooncake_master, LAYOUT, make_context(LAYOUT, unique_id="node-a"), key_prefix=namespace
    )
    reader = mooncake_tier(
        mooncake_master, LAYOUT, make_context(LAYOUT, unique_id="node-b"), key_prefix=namespace
    )
    try:
        (block,) = block_ids(1, seed=7)
        dump_keys(writer, [(block, 1)])
        assert writer.object_name((block, 1)) == f"{namespace}/{block.hex()}/1"
        assert reader.client.batch_is_exist([f"{namespace}/{block.hex()}/1"]) == [1]
        assert reader.client.get_size(f"{namespace}/{block.hex()}/1") == HEADER_BYTES + 8192
        assert_loads_exact(reader, [(block, 1)])
    finally:
        writer.close()
        reader.close()


def _corrupt_and_load(tier: Any, key: Any, raw: bytes) -> Any:
    name = tier.object_name(key)
    assert tier.client.batch_remove([name], True) == [0]
    assert tier.client.put(name, raw) == 0
    outcomes, _ = load_keys(tier, [key])
    return outcomes[0]


def test_corrupt_or_foreign_objects_fail_are_removed_and_never_come_back(
    mooncake_master: MooncakeMaster,
) -> None:
    tier = mooncake_tier(mooncake_master, LAYOUT, key_prefix=prefix())
    try:
        blocks = block_ids(4, seed=3)
        keys = [(block, 0) for block in blocks]
        dump_keys(tier, keys)
        good = shard_bytes(keys[0], LAYOUT)
        stored_header = tier.header(keys[0], [memoryview(good)])
        flipped = bytearray(good)
        flipped[4000] ^= 0x01
        other_key_header = tier.header(keys[3], [memoryview(good)])
        cases = [
            (keys[0], stored_header + bytes(flipped), "checksum mismatch"),
            (keys[1], b"not a ucm object", f"16 bytes, expected {HEADER_BYTES + 8192}"),
            (keys[2], other_key_header + good, "the envelope names another key"),
            (keys[3], b"XXXX" + bytes(44) + good, "not a UCM envelope: bad magic"),
        ]
        before = tier.stats()
        for key, raw, problem in cases:
            outcome = _corrupt_and_load(tier, key, raw)
            assert isinstance(outcome, TierError) and not isinstance(outcome, KeyMissingError)
            assert str(outcome) == (
                f"mooncake tier 'mooncake': block {key[0].hex()} shard 0 is corrupt ({problem}); "
                "it was removed"
            )
            assert tier.lookup([key]) == [False]
        assert tier.stats()["corrupt"] - before["corrupt"] == 4
        assert tier.stats()["hits"] == before["hits"]
        # A dump puts the good shard back (what the stack's repair does).
        dump_keys(tier, keys)
        assert_loads_exact(tier, keys)
    finally:
        tier.close()


def test_object_of_the_older_format_is_a_miss_and_is_replaced(
    mooncake_master: MooncakeMaster,
) -> None:
    # A whole, valid UCMK object (the format before the shard envelope): never data, a miss.
    tier = mooncake_tier(mooncake_master, LAYOUT, key_prefix=prefix())
    try:
        (block,) = block_ids(1, seed=11)
        key = (block, 0)
        name = tier.object_name(key)
        data = shard_bytes(key, LAYOUT)
        old = struct.pack(
            "<4sHHQQQ", b"UCMK", 1, 0, 8192, checksum([data]), checksum([name.encode()])
        )
        assert tier.client.put(name, old + data) == 0
        before = tier.stats()
        outcomes, buffers = load_keys(tier, [key])
        assert isinstance(outcomes[0], KeyMissingError)
        assert str(outcomes[0]) == (
            f"mooncake tier 'mooncake': block {block.hex()} shard 0 is not readable here "
            "(written in an older format, a mooncake object (UCMK)); it was removed"
        )
        assert buffers[0] == bytearray(8192)
        assert tier.lookup([key]) == [False]
        stats = tier.stats()
        assert stats["misses"] - before["misses"] == 1
        assert (stats["corrupt"], stats["hits"]) == (before["corrupt"], before["hits"])
        assert tier.client.put(name, old + data) == 0
        dump_keys(tier, [key])  # a dump replaces an old-format object
        assert tier.client.get_size(name) == HEADER_BYTES + 8192
        assert_loads_exact(tier, [key])
    finally:
        tier.close()


def test_object_of_a_newer_envelope_version_is_a_miss_and_is_never_removed(
    mooncake_master: MooncakeMaster,
) -> None:
    # A pool shared by the nodes of a rolling upgrade: a newer UCM's objects (a later envelope
    # version, of the plain size, smaller or larger) are misses here, never removed, replaced
    # or counted corrupt, by a load or a dump.
    tier = mooncake_tier(mooncake_master, LAYOUT, key_prefix=prefix())
    try:
        keys = [(block, 0) for block in block_ids(3, seed=13)]
        payloads = [8192, 4096, 9000]  # as big as a plain shard, smaller (a codec), larger
        stored: dict[str, bytes] = {}
        for key, size in zip(keys, payloads, strict=True):
            data = shard_bytes(key, LAYOUT)
            header = bytearray(tier.header(key, [memoryview(data)]))
            header[4] = envelope.VERSION + 1  # the version byte, after the magic
            stored[tier.object_name(key)] = bytes(header) + (data * 2)[:size]
        for name, raw in stored.items():
            assert tier.client.put(name, raw) == 0

        def assert_kept() -> None:
            for name, raw in stored.items():
                assert bytes(tier.client.get(name)) == raw, name

        before = tier.stats()
        tier.lookup(keys)
        outcomes, _ = load_keys(tier, keys)
        for key, outcome in zip(keys, outcomes, strict=True):
            assert isinstance(outcome, KeyMissingError), outcome
            assert str(outcome).startswith(
                f"mooncake tier 'mooncake': block {key[0].hex()} shard 0 is not readable here "
                f"(envelope version {envelope.VERSION + 1}"
            ), outcome
            assert str(outcome).endswith("it was kept for the UCM that wrote it"), outcome
        assert_kept()
        dump_keys(tier, keys)  # this node recomputed them: the newer objects stay
        assert_kept()
        tier.touch([key[0] for key in keys])
        assert_kept()
        stats = tier.stats()
        assert stats["corrupt"] == before["corrupt"]
        assert stats["replaced"] == before["replaced"]
        assert stats["misses"] - before["misses"] == len(keys)
        assert stats["newer_kept"] - before["newer_kept"] == 2 * len(keys)
    finally:
        tier.close()


def test_redump_of_identical_bytes_keeps_the_object(mooncake_master: MooncakeMaster) -> None:
    tier = mooncake_tier(mooncake_master, LAYOUT, key_prefix=prefix())
    try:
        keys = LAYOUT.keys_of_blocks(block_ids(2, seed=4))
        dump_keys(tier, keys)
        dump_keys(tier, keys)
        dump_keys(tier, keys[:1], salt=9)
        stats = tier.stats()
        assert (stats["unchanged"], stats["replaced"]) == (len(keys), 1)
        assert stats["bytes_written"] == (len(keys) + 1) * 8192
        assert_loads_exact(tier, keys[:1], salt=9)
        assert_loads_exact(tier, keys[1:])
    finally:
        tier.close()


def test_a_leased_key_is_removed_only_with_force(new_master: Callable[..., Any]) -> None:
    master = new_master(lease_ttl_ms=60_000)  # every read below leases for a minute
    tier = mooncake_tier(master, LAYOUT)
    try:
        keys = LAYOUT.keys_of_blocks(block_ids(2, seed=5))
        dump_keys(tier, keys)
        assert tier.batched_remove(keys[:1]) == 1  # never read: no lease
        assert_loads_exact(tier, keys[1:2])  # a load leases
        assert tier.lookup(keys[2:3]) == [True]  # so does a lookup
        tier.touch([keys[3][0]])  # and a touch (a lookup of the block's shards)
        assert tier.batched_remove(keys) == 0
        assert tier.stats()["leased_kept"] == 3
        assert tier.lookup(keys) == [False, True, True, True]
        assert tier.batched_remove(keys, force=True) == 3
        assert tier.lookup(keys) == [False] * 4
    finally:
        tier.close()


def _region(nbytes: int) -> tuple[mmap.mmap, memoryview, int]:
    """Page-aligned memory like buffer slots (unmapped when the last view of it goes)."""
    memory = mmap.mmap(-1, nbytes)
    view = memoryview(memory)
    return memory, view, buffer_address(view)


def test_host_memory_is_registered_once_and_other_memory_per_call(
    mooncake_master: MooncakeMaster,
) -> None:
    _memory, view, address = _region(64 * 8192)
    plain = make_context(LAYOUT)
    options = {HOST_MEMORY_OPTION: ((address, 64 * 8192),)}
    context = TierContext(**{**plain.__dict__, "options": options})
    tier = mooncake_tier(mooncake_master, LAYOUT, context, key_prefix=prefix())
    try:
        assert tier.stats()["registered_bytes"] == 64 * 8192
        keys = LAYOUT.keys_of_blocks(block_ids(4, seed=6))
        for i, key in enumerate(keys):
            view[i * 8192 : (i + 1) * 8192] = shard_bytes(key, LAYOUT)
        slots = [[view[i * 8192 : (i + 1) * 8192]] for i in range(len(keys))]
        before = tier.stats()["call_registrations"]
        assert tier.dump(keys, slots) == [None] * len(keys)  # from slots: nothing to register
        targets = [[view[(32 + i) * 8192 : (33 + i) * 8192]] for i in range(len(keys))]
        assert tier.load(keys, targets) == [None] * len(keys)
        assert [bytes(t[0]) for t in targets] == [shard_bytes(k, LAYOUT) for k in keys]
        assert tier.stats()["call_registrations"] == before
        # The host memory and this thread's header arena, each registered once.
        assert tier.stats()["registered_bytes"] == 64 * 8192 + ARENA_BYTES
        # Caller memory outside it: registered for the call (adjacent buffers coalesced).
        outcomes, buffers = load_keys(tier, keys)
        assert outcomes == [None] * len(keys)
        assert tier.stats()["call_registrations"] > before
        assert tier.registrations._refs == {}  # every per-call region released
        assert [bytes(b) for b in buffers] == [shard_bytes(k, LAYOUT) for k in keys]
    finally:
        tier.close()


def test_overlapping_registrations_wait_for_each_other(mooncake_master: MooncakeMaster) -> None:
    """The transfer engine refuses overlapping regions: a call whose memory overlaps another
    call's per-call region only partly waits for it, then registers its own."""
    tier: Any = mooncake_tier(mooncake_master, LAYOUT, key_prefix=prefix())
    _memory, _view, address = _region(4 * 8192)
    try:
        registrations = tier.registrations
        entered = threading.Event()
        release = threading.Event()
        order: list[str] = []

        def first() -> None:
            with registrations.covering([(address, 2 * 8192)]):
                order.append("first in")
                entered.set()
                release.wait(timeout=BOUND_S)
                order.append("first out")

        thread = threading.Thread(target=first)
        thread.start()
        assert entered.wait(timeout=BOUND_S)
        threading.Timer(0.3, release.set).start()
        with registrations.covering([(address + 8192, 2 * 8192)]):
            order.append("second in")
        thread.join(timeout=BOUND_S)
        assert order == ["first in", "first out", "second in"]
        with registrations.covering([(address, 8192), (address + 4096, 8192)]):
            pass  # overlapping ranges of one call are merged into one region
        assert registrations._refs == {}
    finally:
        tier.close()


def test_bad_config_values_name_the_yaml_path() -> None:
    base = {
        "type": "mooncake",
        "master_server_address": "127.0.0.1:50051",
        "local_hostname": "127.0.0.1",
    }
    stack = {"unique_id": "cfg", "shard_size": 4096, "shards_per_block": 1}
    cases = [
        ({"global_segment_size": "lots"}, "tiers[1].global_segment_size: "),
        (
            {"global_segment_size": "4MiB"},
            "tiers[1].global_segment_size: Value error, 4194304 bytes is not a valid segment: "
            "Mooncake mounts 0 (contribute nothing) or at least 16777216 bytes (16MiB)",
        ),
        ({"local_buffer_size": -1}, "tiers[1].local_buffer_size: "),
        ({"protocol": "udp"}, "tiers[1].protocol: Input should be 'tcp' or 'rdma'"),
        (
            {"master_server_address": "nohost"},
            "tiers[1].master_server_address: Value error, "
            "'nohost' is not a master address: expected host:port",
        ),
        ({"master_server_address": "127.0.0.1:99999"}, "tiers[1].master_server_address: "),
        (
            {"protocol": "rdma"},
            "tiers[1].device_name: Value error, protocol rdma needs device_name",
        ),
        ({"replica_num": 0}, "tiers[1].replica_num: "),
        ({"connect_timeout": 0}, "tiers[1].connect_timeout: "),
        ({"key_prefix": "a/b"}, "tiers[1].key_prefix: "),
        ({"segment_size": "1GiB"}, "tiers[1].segment_size: unknown key"),
        ({"write": "sometimes"}, "tiers[1].write: "),
    ]
    for change, expected in cases:
        tiers = [{"type": "buffer", "capacity": 4096 * 16}, {**base, **change}]
        with pytest.raises(ConfigError) as raised:
            parse_stack({**stack, "tiers": tiers})
        assert expected in str(raised.value), (change, str(raised.value))
    tiers = [{"type": "buffer", "capacity": 65536}, {**base, "global_segment_size": "256MiB"}]
    parsed = parse_stack({**stack, "tiers": tiers}).tiers[1]
    assert isinstance(parsed, MooncakeConfig) and parsed.global_segment_size == 256 << 20
    assert (parsed.metadata_server, parsed.protocol, parsed.write) == (
        "P2PHANDSHAKE",
        "tcp",
        "through",
    )


def test_missing_mooncake_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails like a missing one
    config = MooncakeConfig(master_server_address="127.0.0.1:1", local_hostname="127.0.0.1")
    with pytest.raises(ConfigError) as raised:
        MooncakeTier(config, make_context(LAYOUT))
    assert "the mooncake tier needs mooncake.store, which failed to import" in str(raised.value)
    assert INSTALL_HINT in str(raised.value)
    assert "pip install 'ucm[mooncake]'" in INSTALL_HINT


def test_a_namespace_byte_quota_is_refused_at_open_before_the_master_is_asked() -> None:
    """The stack refuses `quotas...tiers.<mooncake label>` at parse time
    (tests/test_quotas_config.py); a tier opened with the option some other way refuses it
    too, instead of ignoring it. Nothing listens at port 1: the refusal comes first."""
    config = MooncakeConfig(master_server_address="127.0.0.1:1", local_hostname="127.0.0.1")
    context = dataclasses.replace(
        make_context(LAYOUT),
        options={NAMESPACE_BYTES_OPTION: NamespaceBytes(named={"tenant-a": 1 << 20})},
    )
    with pytest.raises(ConfigError) as raised:
        MooncakeTier(config, context)
    assert str(raised.value) == (
        "tiers[1] (mooncake): takes no per-namespace byte quota: "
        f"{MooncakeConfig.namespace_bytes_refused}"
    )


def test_unreachable_master_fails_at_open_in_bounded_time(mooncake: None) -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(TierError) as raised:
        mooncake_tier_at(f"127.0.0.1:{port}", connect_timeout=2)
    assert time.monotonic() - started < BOUND_S
    assert str(raised.value).startswith(
        f"mooncake tier 'mooncake': cannot reach the master at 127.0.0.1:{port} within 2s"
    )


def mooncake_tier_at(address: str, **options: Any) -> MooncakeTier:
    config = MooncakeConfig(master_server_address=address, local_hostname="127.0.0.1", **options)
    return MooncakeTier(config, make_context(LAYOUT))


@pytest.mark.parametrize(
    ("writes", "refused"),
    [
        (["back"], True),  # the pool at the top: its evictions would be posix's only source
        (["through", "back"], False),  # the through tier holds every dump, feeds the back one
        (["back", "back"], True),
    ],
)
def test_write_back_right_below_a_mooncake_tier_is_refused(
    mooncake_master: MooncakeMaster, tmp_path: Any, writes: list[str], refused: bool
) -> None:
    buffer = [{"type": "buffer", "capacity": 8192 * 16}] if len(writes) > 1 else []
    stack = {
        "unique_id": f"wb-{prefix()}",
        "shard_size": 8192,
        "shards_per_block": 2,
        "tiers": [
            *buffer,
            {
                "type": "mooncake",
                "master_server_address": mooncake_master.address,
                "local_hostname": "127.0.0.1",
            },
            *[
                {"type": "posix", "path": str(tmp_path / f"nvme{i}"), "write": write}
                for i, write in enumerate(writes)
            ],
        ],
    }
    if not refused:
        ucm.open(stack).close()
        return
    with pytest.raises(ConfigError) as raised:
        ucm.open(stack)
    position = len(buffer)
    assert f"tiers[{position}] (mooncake): a write: back tier below it would get shards only " in (
        str(raised.value)
    )


def test_scheduler_contributes_no_memory_and_answers_lookups(
    mooncake_master: MooncakeMaster,
) -> None:
    namespace = prefix()
    worker = mooncake_tier(mooncake_master, LAYOUT, key_prefix=namespace)
    scheduler = mooncake_tier(
        mooncake_master, LAYOUT, make_context(LAYOUT, device_id=-1), key_prefix=namespace
    )
    try:
        keys = LAYOUT.keys_of_blocks(block_ids(1, seed=8))
        dump_keys(worker, keys)
        assert scheduler.stats()["global_segment_bytes"] == 0
        assert worker.stats()["global_segment_bytes"] == 16 << 20
        assert scheduler.lookup_blocks([keys[0][0], b"\0" * 16]) == [True, False]
    finally:
        worker.close()
        scheduler.close()


def test_master_killed_fails_in_bounded_time_and_a_master_back_serves_again(
    new_master: Callable[..., MooncakeMaster],
) -> None:
    master = new_master()
    tier = mooncake_tier(master, LAYOUT)
    try:
        keys = LAYOUT.keys_of_blocks(block_ids(2, seed=9))
        dump_keys(tier, keys[:2])
        master.kill()
        started = time.monotonic()
        loaded, _ = load_keys(tier, keys[:1])  # finds the master gone
        assert tier.lookup(keys[:2]) == [False, False]  # from now on: at once, no RPC
        dumped = tier.dump(keys[2:3], [split(shard_bytes(keys[2], LAYOUT), LAYOUT)])
        with pytest.raises(TierError, match=r"batched_remove: the master at 127\.0\.0\.1:"):
            tier.batched_remove(keys[1:2])
        elapsed = time.monotonic() - started
        assert elapsed < BOUND_S, f"calls against a dead master took {elapsed:.1f}s"
        assert isinstance(loaded[0], TierError) and not isinstance(loaded[0], KeyMissingError)
        assert str(loaded[0]).endswith(": loading failed: RPC_FAIL (master unreachable?) (-900)")
        assert isinstance(dumped[0], TierError)
        assert f": the master at {master.address} did not answer " in str(dumped[0])
        assert tier.stats()["master_down_skips"] == 2 + 1 + 1
        # The same master address comes back (empty: a master without HA keeps no state).
        master.start()
        deadline = time.monotonic() + BOUND_S
        while tier.dump(keys[2:3], [split(shard_bytes(keys[2], LAYOUT), LAYOUT)]) != [None]:
            assert time.monotonic() < deadline, "the tier never served the restarted master"
            time.sleep(0.2)
        assert tier.lookup(keys) == [False, False, True, False]
        dump_keys(tier, keys)
        assert_loads_exact(tier, keys)
    finally:
        tier.close()
