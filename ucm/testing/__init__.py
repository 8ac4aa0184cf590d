"""Test helpers for tier authors: the reusable tier conformance suite.

Third-party tiers run it by subclassing :class:`TierConformance` in their own test suite::

    from ucm.testing import TierConformance

    class TestMyTier(TierConformance):
        @pytest.fixture
        def tier_factory(self, tmp_path):
            return lambda layout: MyTier(MyConfig(...), make_context(layout))
"""

from __future__ import annotations

from .conformance import (
    MANY_SHARDS,
    MULTI_VIEW,
    REQUIRED_STATS,
    SINGLE_TENSOR,
    TierConformance,
    TierFactory,
    make_context,
    shard_bytes,
)

__all__ = [
    "MANY_SHARDS",
    "MULTI_VIEW",
    "REQUIRED_STATS",
    "SINGLE_TENSOR",
    "TierConformance",
    "TierFactory",
    "make_context",
    "shard_bytes",
]
