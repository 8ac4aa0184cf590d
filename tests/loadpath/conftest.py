"""Fixtures of the load-path tests: the test tiers of ``_tiers`` registered for one test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from ucm.native import segments

from . import _tiers


@pytest.fixture
def test_tiers() -> Iterator[None]:
    _tiers.register()
    _tiers.RECORDED.clear()
    _tiers.CONTENTS.clear()
    _tiers.CORRUPT.clear()
    _tiers.ENTERED.clear()
    _tiers.GATES.clear()
    try:
        yield
    finally:
        for gate in _tiers.GATES.values():
            gate.set()  # nothing stays held at a gate past its test
        _tiers.unregister()


@pytest.fixture
def unique_id() -> Iterator[str]:
    name = f"lp-{uuid.uuid4().hex[:12]}"
    yield name
    segments.unlink(name)  # the node-wide segments outlive the store by design
