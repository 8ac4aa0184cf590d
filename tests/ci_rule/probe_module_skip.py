"""Probe for test_ci_rule.py: a whole module skipped at import."""

import pytest

pytest.importorskip("a_module_that_does_not_exist_anywhere")


def test_never_runs() -> None:
    pass
