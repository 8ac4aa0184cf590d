"""The tier conformance suite against every built-in tier (and each fsspec backend we test);
the example plugin runs it in tests/test_example_plugin.py."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from ucm_backends.buffer import BufferTier, BufferTierConfig

from ucm.layout import Layout
from ucm.testing import TierConformance, TierFactory, make_context

from .conftest import fsspec_tier, posix_tier


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


def _buffer_gap(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=f"buffer tier (issue 4): {reason}")


_LOCKS_PER_BUCKET = _buffer_gap(
    "remove_lock_acquisitions counts bucket-lock acquisitions (3 for 12 keys, 27 for 2,500), "
    "not one per chunk of REMOVE_CHUNK_KEYS keys"
)


class TestBufferConformance(TierConformance):
    """The shared CacheBuffer used as a plain tier (its own segments per test)."""

    @pytest.fixture
    def tier_factory(self) -> TierFactory:
        unique_id = f"conformance-{uuid.uuid4().hex[:12]}"

        def make(layout: Layout) -> Any:
            config = BufferTierConfig(capacity=layout.shard_size * 4096)
            return BufferTier(config, make_context(layout, unique_id=unique_id, position=0))

        return make

    # Where the buffer tier does not (yet) behave as the Tier interface says: each xfail is
    # strict, so it turns into a failure the day the gap closes and the marker must go. (The
    # overrides wrap the inherited tests: marking the inherited function itself would mark it
    # for every tier.)
    @_LOCKS_PER_BUCKET
    def test_remove_batch_under_one_lock(self, make_tier: TierFactory) -> None:
        super().test_remove_batch_under_one_lock(make_tier)

    @_LOCKS_PER_BUCKET
    def test_remove_takes_one_lock_per_chunk(self, make_tier: TierFactory) -> None:
        super().test_remove_takes_one_lock_per_chunk(make_tier)
