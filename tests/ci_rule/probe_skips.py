"""Probe for test_ci_rule.py (not collected by a normal run: no test_ prefix)."""

import pytest


def test_skips() -> None:
    pytest.skip("an optional dependency is missing")


@pytest.mark.cuda
def test_cuda_skips() -> None:
    pytest.skip("needs a CUDA GPU")


@pytest.mark.xfail(strict=True)
def test_expected_failure() -> None:
    raise AssertionError("known")


def test_passes() -> None:
    pass
