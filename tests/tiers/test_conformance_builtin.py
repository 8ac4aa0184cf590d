"""The tier conformance suite against every built-in tier (and each fsspec backend we test)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from ucm.layout import Layout
from ucm.testing import TierConformance, TierFactory

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
