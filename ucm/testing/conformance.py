"""The tier conformance suite: behaviour every :class:`ucm.Tier` must have.

Subclass :class:`TierConformance` (the name does not start with ``Test``, so pytest collects only
your subclass) and provide a ``tier_factory`` fixture: a callable taking a :class:`ucm.Layout`
and returning a new, *empty* tier with that geometry (each call in a test may share storage with
earlier calls of the same test, but not with other tests). The suite closes every tier it made.

Stats contract checked here: ``stats()`` has at least :data:`REQUIRED_STATS`, where ``hits`` and
``misses`` count loaded and missing keys and ``remove_lock_acquisitions`` counts the lock
acquisitions ``batched_remove`` made (one per chunk of REMOVE_CHUNK_KEYS keys, seed 003).

Control records (``Tier.read_control``/``raise_control``, a stack's reset epochs) are checked
too: a tier that keeps none fails that case, and a stack holding it cannot read its epoch (its
engines fail closed, salting their ids with a nonce of their own).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence

import pytest

from .. import namespaces
from ..errors import KeyMissingError
from ..layout import Key, Layout
from ..tier import REMOVE_CHUNK_KEYS, EvictSink, Outcome, Tier, TierContext

TierFactory = Callable[[Layout], Tier]

SINGLE_TENSOR = Layout(shard_size=4096, shards_per_block=4, tensor_sizes=(4096,))
"""One tensor per shard."""
MULTI_VIEW = Layout(shard_size=4096, shards_per_block=2, tensor_sizes=(1024, 3000, 72))
"""Several tensors of different sizes per shard (scatter/gather)."""
MANY_SHARDS = Layout(shard_size=64, shards_per_block=100, tensor_sizes=(64,))
"""Tiny shards, many per block: lets the chunked-remove test pass 2,500 keys cheaply."""

REQUIRED_STATS = ("hits", "misses", "remove_lock_acquisitions")


def make_context(
    layout: Layout,
    *,
    evict_sink: EvictSink | None = None,
    position: int = 1,
    unique_id: str = "conformance",
    device_id: int = 0,
    local_rank_size: int = 1,
) -> TierContext:
    """A TierContext for a tier used on its own (tests, tools)."""
    return TierContext(
        layout=layout,
        unique_id=unique_id,
        device_id=device_id,
        local_rank_size=local_rank_size,
        position=position,
        evict_sink=evict_sink,
    )


def shard_bytes(key: Key, layout: Layout, salt: int = 0) -> bytes:
    """Deterministic pseudo-random shard content for ``key`` (differs per key and salt)."""
    # A bytes seed is hashed with sha512, so it is the same in every process (hash() is not).
    rng = random.Random(key[0] + f"/{key[1]}/{salt}/{layout.shard_size}".encode())
    return rng.randbytes(layout.shard_size)


def block_ids(count: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(count)]


def split(data: bytes | bytearray, layout: Layout) -> list[memoryview]:
    """``data`` cut into one memoryview per tensor of the layout."""
    views, pos, whole = [], 0, memoryview(data)
    for size in layout.tensor_sizes:
        views.append(whole[pos : pos + size])
        pos += size
    return views


def dump_keys(tier: Tier, keys: Sequence[Key], salt: int = 0) -> None:
    sources = [split(shard_bytes(k, tier.layout, salt), tier.layout) for k in keys]
    outcomes = tier.dump(keys, sources)
    assert outcomes == [None] * len(keys), f"dump failed: {outcomes}"


def load_keys(tier: Tier, keys: Sequence[Key]) -> tuple[list[Outcome], list[bytearray]]:
    buffers = [bytearray(tier.layout.shard_size) for _ in keys]
    outcomes = tier.load(keys, [split(b, tier.layout) for b in buffers])
    return outcomes, buffers


def assert_loads_exact(tier: Tier, keys: Sequence[Key], salt: int = 0) -> None:
    outcomes, buffers = load_keys(tier, keys)
    assert outcomes == [None] * len(keys), f"load failed: {outcomes}"
    for key, buffer in zip(keys, buffers, strict=True):
        assert bytes(buffer) == shard_bytes(key, tier.layout, salt), f"{key} not byte-exact"


class TierConformance:
    """Base class of a tier's conformance tests; see the module docstring."""

    @pytest.fixture
    def tier_factory(self) -> TierFactory:
        raise NotImplementedError("define a `tier_factory` fixture returning Layout -> Tier")

    @pytest.fixture
    def make_tier(self, tier_factory: TierFactory) -> Iterator[TierFactory]:
        made: list[Tier] = []

        def make(layout: Layout = SINGLE_TENSOR) -> Tier:
            tier = tier_factory(layout)
            made.append(tier)
            return tier

        yield make
        for tier in made:
            tier.close()

    def expected_remove_locks(self, tier: Tier, keys: list[Key]) -> int:
        """Lock acquisitions ``batched_remove(keys)`` should make: one per chunk of
        REMOVE_CHUNK_KEYS keys for a tier with one lock. A tier with finer locks (the buffer's
        bucket locks) overrides this with one acquisition per lock per chunk."""
        return math.ceil(len(keys) / REMOVE_CHUNK_KEYS)

    def wait_for_read_leases(self, tier: Tier) -> None:
        """Returns once the reads made so far no longer keep their keys from a remove without
        ``force``. Only a tier whose reads lease a key for a fixed time (Mooncake Store: the
        master leases every object read or looked up, and a plain remove keeps it until the
        lease runs out) has anything to wait for; it overrides this."""

    # ------------------------------------------------------------------------- dump / load

    def test_dump_load_single_tensor_byte_exact(self, make_tier: TierFactory) -> None:
        tier = make_tier(SINGLE_TENSOR)
        keys = SINGLE_TENSOR.keys_of_blocks(block_ids(3))
        dump_keys(tier, keys)
        assert_loads_exact(tier, keys)
        assert_loads_exact(tier, list(reversed(keys[:5])))  # any subset, any order

    def test_dump_load_multi_view_byte_exact(self, make_tier: TierFactory) -> None:
        tier = make_tier(MULTI_VIEW)
        keys = MULTI_VIEW.keys_of_blocks(block_ids(3))
        dump_keys(tier, keys)
        # Destinations are separate buffers per tensor, not views of one buffer.
        buffers = [[bytearray(size) for size in MULTI_VIEW.tensor_sizes] for _ in keys]
        outcomes = tier.load(keys, [[memoryview(b) for b in bufs] for bufs in buffers])
        assert outcomes == [None] * len(keys)
        for key, bufs in zip(keys, buffers, strict=True):
            assert b"".join(bufs) == shard_bytes(key, MULTI_VIEW)
            assert [len(b) for b in bufs] == list(MULTI_VIEW.tensor_sizes)

    def test_overwrite_replaces_data_and_keeps_other_shards(self, make_tier: TierFactory) -> None:
        tier = make_tier(SINGLE_TENSOR)
        keys = SINGLE_TENSOR.keys_of_blocks(block_ids(2))
        dump_keys(tier, keys, salt=1)
        dump_keys(tier, [keys[1]], salt=2)
        assert_loads_exact(tier, [keys[1]], salt=2)
        assert_loads_exact(tier, [keys[0], *keys[2:]], salt=1)

    def test_shards_of_one_block_dumped_separately(self, make_tier: TierFactory) -> None:
        tier = make_tier(SINGLE_TENSOR)
        keys = SINGLE_TENSOR.keys_of_blocks(block_ids(1))
        for key in reversed(keys):  # e.g. one rank after another
            dump_keys(tier, [key])
        assert_loads_exact(tier, keys)

    # ------------------------------------------------------------------------------ lookup

    def test_lookup_and_lookup_blocks(self, make_tier: TierFactory) -> None:
        tier = make_tier(SINGLE_TENSOR)
        partial, full, absent = block_ids(3)
        dump_keys(tier, [(partial, 0), (partial, 2)])
        dump_keys(tier, SINGLE_TENSOR.keys_of_blocks([full]))
        probe = [(partial, 0), (partial, 1), (partial, 2), (full, 3), (absent, 0)]
        assert tier.lookup(probe) == [True, False, True, True, False]
        assert tier.lookup_blocks([partial, full, absent]) == [False, True, False]
        assert tier.lookup([]) == []
        assert tier.lookup_blocks([]) == []

    # ------------------------------------------------------------------------ misses, stats

    def test_missing_key_is_a_key_missing_outcome(self, make_tier: TierFactory) -> None:
        tier = make_tier(SINGLE_TENSOR)
        present, absent = block_ids(2)
        dump_keys(tier, [(present, 0)])
        outcomes, buffers = load_keys(tier, [(absent, 1), (present, 0), (present, 3)])
        assert isinstance(outcomes[0], KeyMissingError)
        assert outcomes[1] is None
        assert isinstance(outcomes[2], KeyMissingError)
        assert bytes(buffers[1]) == shard_bytes((present, 0), SINGLE_TENSOR)

    def test_stats_keys_and_hit_miss_counts(self, make_tier: TierFactory) -> None:
        tier = make_tier(SINGLE_TENSOR)
        before = tier.stats()
        for name in REQUIRED_STATS:
            assert isinstance(before.get(name), int | float), f"stats() lacks {name!r}"
        present, absent = block_ids(2)
        dump_keys(tier, [(present, 0)])
        load_keys(tier, [(present, 0), (absent, 0)])
        after = tier.stats()
        assert after["hits"] - before["hits"] == 1
        assert after["misses"] - before["misses"] == 1

    # ------------------------------------------------------------------------------- touch

    def test_touch_absent_and_present_blocks(self, make_tier: TierFactory) -> None:
        tier = make_tier(SINGLE_TENSOR)
        present, absent = block_ids(2)
        dump_keys(tier, [(present, 1)])
        tier.touch([])
        tier.touch([absent, present, absent])
        assert tier.lookup([(absent, 0)]) == [False]
        assert_loads_exact(tier, [(present, 1)])

    # ------------------------------------------------------------ batched_remove (seed 003)

    def test_remove_empty_input_is_a_noop(self, make_tier: TierFactory) -> None:
        tier = make_tier(SINGLE_TENSOR)
        keys = SINGLE_TENSOR.keys_of_blocks(block_ids(1))
        dump_keys(tier, keys)
        before = tier.stats()["remove_lock_acquisitions"]
        assert tier.batched_remove([]) == 0
        assert tier.batched_remove([], force=True) == 0
        assert tier.stats()["remove_lock_acquisitions"] == before
        assert_loads_exact(tier, keys)

    def test_remove_batch_under_one_lock(self, make_tier: TierFactory) -> None:
        tier = make_tier(SINGLE_TENSOR)
        keys = SINGLE_TENSOR.keys_of_blocks(block_ids(3))
        dump_keys(tier, keys)
        before = tier.stats()["remove_lock_acquisitions"]
        assert tier.batched_remove(keys) == len(keys)
        assert tier.stats()["remove_lock_acquisitions"] - before == self.expected_remove_locks(
            tier, keys
        )
        assert tier.lookup(keys) == [False] * len(keys)
        outcomes, _ = load_keys(tier, keys[:2])
        assert all(isinstance(o, KeyMissingError) for o in outcomes)

    def test_remove_some_shards_keeps_the_others(self, make_tier: TierFactory) -> None:
        tier = make_tier(SINGLE_TENSOR)
        keys = SINGLE_TENSOR.keys_of_blocks(block_ids(2))
        dump_keys(tier, keys)
        assert tier.batched_remove([keys[1], keys[6]]) == 2
        assert tier.lookup(keys) == [k not in (keys[1], keys[6]) for k in keys]
        assert_loads_exact(tier, [k for k in keys if k not in (keys[1], keys[6])])

    def test_remove_preserves_pinned_entries(self, make_tier: TierFactory) -> None:
        tier = make_tier(SINGLE_TENSOR)
        keys = SINGLE_TENSOR.keys_of_blocks(block_ids(3))
        dump_keys(tier, keys)
        pinned = [keys[0], keys[5]]
        tier.pins.pin(pinned)
        assert tier.batched_remove(keys) == len(keys) - 2
        assert tier.lookup(keys) == [k in pinned for k in keys]
        assert_loads_exact(tier, pinned)
        tier.pins.unpin(pinned)
        self.wait_for_read_leases(tier)
        assert tier.batched_remove(keys) == 2
        assert tier.lookup(pinned) == [False, False]

    def test_remove_counts_missing_keys_as_not_removed(self, make_tier: TierFactory) -> None:
        tier = make_tier(SINGLE_TENSOR)
        present, absent = block_ids(2)
        dump_keys(tier, [(present, 0), (present, 1)])
        mixed = [(absent, 0), (present, 0), (present, 3), (absent, 2), (present, 1)]
        assert tier.batched_remove(mixed) == 2
        assert tier.batched_remove(mixed) == 0

    def test_remove_counts_duplicates_once(self, make_tier: TierFactory) -> None:
        tier = make_tier(SINGLE_TENSOR)
        (block,) = block_ids(1)
        dump_keys(tier, [(block, 0), (block, 1)])
        assert tier.batched_remove([(block, 0), (block, 0), (block, 1), (block, 0)]) == 2

    def test_remove_force_bypasses_pin(self, make_tier: TierFactory) -> None:
        tier = make_tier(SINGLE_TENSOR)
        keys = SINGLE_TENSOR.keys_of_blocks(block_ids(2))
        dump_keys(tier, keys)
        tier.pins.pin(keys[:3])
        assert tier.batched_remove(keys, force=True) == len(keys)
        assert tier.lookup(keys) == [False] * len(keys)
        tier.pins.unpin(keys[:3])

    def test_remove_takes_one_lock_per_chunk(self, make_tier: TierFactory) -> None:
        tier = make_tier(MANY_SHARDS)
        n = 2500
        blocks = block_ids(n // MANY_SHARDS.shards_per_block)
        keys = MANY_SHARDS.keys_of_blocks(blocks)
        assert len(keys) == n
        stored = keys[:: n // 50]  # 50 present keys spread over the chunks; the rest absent
        dump_keys(tier, stored)
        before = tier.stats()["remove_lock_acquisitions"]
        assert tier.batched_remove(keys) == len(stored)
        acquisitions = tier.stats()["remove_lock_acquisitions"] - before
        assert acquisitions == self.expected_remove_locks(tier, keys)
        assert math.ceil(n / REMOVE_CHUNK_KEYS) == 3
        assert tier.lookup(stored) == [False] * len(stored)

    # -------------------------------------------------------------------------- namespaces

    def test_namespaces_are_kept_apart_and_purged_exactly(self, make_tier: TierFactory) -> None:
        """The same block ids in three namespaces (the default among them) are three sets of
        keys: each loads its own bytes, usage counts each exactly, and a purge of one removes
        exactly its shards and leaves the others byte-exact."""
        tier = make_tier(SINGLE_TENSOR)
        blocks = block_ids(3, seed=22)
        names = ("conformance-a", "conformance-b", namespaces.DEFAULT_NAMESPACE)
        keys = {}
        for salt, name in enumerate(names):
            namespaces.register(name)
            keys[name] = SINGLE_TENSOR.keys_of_blocks(namespaces.scope(name, blocks))
            dump_keys(tier, keys[name], salt=salt)
        per_namespace = len(keys[names[0]])
        for salt, name in enumerate(names):
            assert_loads_exact(tier, keys[name], salt=salt)
        usage = tier.namespace_usage()
        if usage is not None:  # a tier whose store lists no keys (Mooncake) reports None
            assert usage == dict.fromkeys(names, per_namespace)
        assert tier.purge(names[0]) == per_namespace
        assert tier.lookup(keys[names[0]]) == [False] * per_namespace
        outcomes, _ = load_keys(tier, keys[names[0]][:2])
        assert all(isinstance(o, KeyMissingError) for o in outcomes)
        for salt, name in enumerate(names[1:], start=1):
            assert_loads_exact(tier, keys[name], salt=salt)
        assert tier.purge(names[0]) == 0
        usage = tier.namespace_usage()
        if usage is not None:
            assert usage == dict.fromkeys(names[1:], per_namespace)

    # --------------------------------------------------------------------- control records

    def test_control_records_are_monotonic_maxima_outside_the_blocks(
        self, make_tier: TierFactory
    ) -> None:
        """A control record (a reset epoch) only grows, and is no block: never listed or
        counted in usage, never removed by a remove or a purge of every namespace."""
        tier = make_tier(SINGLE_TENSOR)
        a, b = bytes(range(16)), bytes(range(16, 32))
        assert tier.read_control([]) == []
        assert tier.read_control([a, b]) == [None, None]
        tier.raise_control(a, 3)
        tier.raise_control(a, 1)  # never lowered
        assert tier.read_control([a, b]) == [3, None]
        tier.raise_control(a, 2**40)
        tier.raise_control(b, 0)
        assert tier.read_control([b, a]) == [0, 2**40]
        keys = SINGLE_TENSOR.keys_of_blocks(block_ids(2, seed=31))
        dump_keys(tier, keys)
        usage = tier.namespace_usage()
        if usage is not None:  # a tier whose store lists no keys (Mooncake) reports None
            assert usage == {namespaces.DEFAULT_NAMESPACE: len(keys)}
        assert tier.batched_remove(keys, force=True) == len(keys)
        assert tier.purge(namespaces.DEFAULT_NAMESPACE) == 0
        assert tier.read_control([a, b]) == [2**40, 0]

    # ------------------------------------------------------------------------------- close

    def test_close_is_idempotent(self, make_tier: TierFactory) -> None:
        tier = make_tier(SINGLE_TENSOR)
        dump_keys(tier, [(block_ids(1)[0], 0)])
        tier.flush()
        tier.close()
        tier.close()  # and once more by the fixture
