"""LMCache engines in a fixed namespace each (``storage_plugin.ucm.namespace: fixed:<name>``):
the same chunks stored by two engines in two namespaces never answer each other, each is listed
and purged on its own with exact counts. Real LMCache StorageManagers over buffer + posix."""

from __future__ import annotations

import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest

try:
    import lmcache  # noqa: F401
except ImportError:
    import os

    if os.environ.get("CI"):
        raise
    pytest.skip("lmcache is not installed", allow_module_level=True)

import ucm

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from . import _lmcache as lm

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning"),
]


def _manager(stack: dict[str, Any], namespace: str | None) -> Any:
    extra = {} if namespace is None else {"storage_plugin.ucm.namespace": namespace}
    return lm.storage_manager(lm.config(stack, extra_config=extra), lm.metadata())


def test_two_engines_in_two_fixed_namespaces_never_share_a_chunk(tmp_path: Path) -> None:
    stack = {
        "unique_id": f"lmc-ns-{uuid.uuid4().hex[:12]}",
        "tiers": [
            {"type": "buffer", "capacity": 64 * lm.CHUNK_BYTES},
            {"type": "posix", "path": str(tmp_path / "posix"), "write": "through"},
        ],
    }
    hashes = list(range(40, 46))
    keys = [lm.key(h) for h in hashes]
    team_a = _manager(stack, "fixed:team-a")
    try:
        backend = team_a.storage_backends["ucm"]
        assert backend.store.namespace == "team-a"
        team_a.batched_put(keys, [lm.filled(team_a, h) for h in hashes])
        assert backend.flush(timeout_s=60)
        assert backend.batched_contains(keys) == 6
        team_b = _manager(stack, "fixed:team-b")  # the same node's buffer, another namespace
        try:
            other = team_b.storage_backends["ucm"]
            assert other.batched_contains(keys) == 0
            assert other.get_blocking(keys[0]) is None
            usage = other.store.namespaces()
            assert usage == {"team-a": [6, 6]}  # buffer, posix
            assert other.store.purge("team-b") == [0, 0]
            assert backend.batched_contains(keys) == 6
            assert other.store.purge("team-a") == [6, 6]
            assert backend.batched_contains(keys) == 0
        finally:
            team_b.close()
    finally:
        team_a.close()


def test_a_bad_or_unavailable_namespace_setting_names_the_key(tmp_path: Path) -> None:
    stack = {
        "unique_id": f"lmc-ns-{uuid.uuid4().hex[:12]}",
        "tiers": [{"type": "posix", "path": str(tmp_path / "posix")}],
    }
    backend_key = "extra_config['storage_plugin.ucm.namespace']"
    for value, message in (
        ("lora", f"{backend_key}='lora' is not available with LMCache's storage plugin interface"),
        ("fixed:a/b", f"{backend_key}='a/b' is not a valid namespace name"),
        ("tenant", f"{backend_key}='tenant' is not valid: expected one of cache_salt, lora"),
    ):
        from ucm.integration.lmcache import UcmStorageBackend

        cfg = lm.config(stack, extra_config={"storage_plugin.ucm.namespace": value})
        with pytest.raises(ucm.ConfigError) as raised:
            UcmStorageBackend(config=cfg, metadata=lm.metadata(), local_cpu_backend=None)
        assert message in str(raised.value)
