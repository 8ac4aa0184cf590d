"""The tier conformance suite against every built-in tier (and each fsspec backend we test);
the example plugin runs it in tests/test_example_plugin.py."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from harness.mooncake import MooncakeMaster
from ucm.buffer import BufferTier, BufferTierConfig
from ucm.layout import Key, Layout
from ucm.testing import TierConformance, TierFactory, make_context
from ucm.tier import chunks

from .conftest import MOONCAKE_LEASE_MS, fsspec_tier, mooncake_tier, posix_tier


class TestPosixConformance(TierConformance):
    @pytest.fixture
    def tier_factory(self, tmp_path: Path) -> TierFactory:
        return lambda layout: posix_tier(tmp_path / "nvme", layout)


class TestPosixODirectConformance(TierConformance):
    @pytest.fixture
    def tier_factory(self, tmp_path: Path) -> TierFactory:
        return lambda layout: posix_tier(tmp_path / "nvme", layout, o_direct=True)


class TestFsspecMemoryConformance(TierConformance):
    @pytest.fixture
    def tier_factory(self, memory_url: str) -> TierFactory:
        return lambda layout: fsspec_tier(memory_url, layout)


class TestFsspecFileConformance(TierConformance):
    @pytest.fixture
    def tier_factory(self, tmp_path: Path) -> TierFactory:
        return lambda layout: fsspec_tier(f"file://{tmp_path}/store", layout)


class TestFsspecS3Conformance(TierConformance):
    @pytest.fixture
    def tier_factory(self, s3_endpoint: str, s3_options: dict[str, Any]) -> TierFactory:
        def make(layout: Layout) -> Any:
            return fsspec_tier(
                f"s3://ucm-test/{uuid.uuid4().hex}", layout, storage_options=s3_options
            )

        return make


class TestBufferConformance(TierConformance):
    """The shared CacheBuffer used as a plain tier (its own segments per test)."""

    @pytest.fixture
    def tier_factory(self) -> TierFactory:
        unique_id = f"conformance-{uuid.uuid4().hex[:12]}"

        def make(layout: Layout) -> Any:
            config = BufferTierConfig(capacity=layout.shard_size * 4096)
            return BufferTier(config, make_context(layout, unique_id=unique_id, position=0))

        return make

    def expected_remove_locks(self, tier: Any, keys: list[Key]) -> int:
        # Bucket locks, not one tier lock: a chunk takes each distinct bucket lock it needs
        # once (a block's shards share a bucket), never once per key.
        return sum(
            len({tier.core.bucket_of(block_id) for block_id, _ in chunk})
            for chunk in chunks(list(dict.fromkeys(keys)))
        )


class TestMooncakeConformance(TierConformance):
    """Against a real mooncake_master; each test's tiers are clients of their own pool
    namespace (key_prefix), so tests never see each other's objects."""

    @pytest.fixture
    def tier_factory(self, mooncake_master: MooncakeMaster) -> TierFactory:
        prefix = f"conformance-{uuid.uuid4().hex[:12]}"
        return lambda layout: mooncake_tier(mooncake_master, layout, key_prefix=prefix)

    def wait_for_read_leases(self, tier: Any) -> None:
        time.sleep(MOONCAKE_LEASE_MS / 1000 + 0.2)
