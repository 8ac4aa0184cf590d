"""LMCache chunks in UCM namespaces (``storage_plugin.ucm.namespace``), against the real lmcache
0.5.6 package. Per request: a chunk's request tag (``lmcache.tag.cache_salt`` by default, or the
tag ``tag:<name>`` names) picks its namespace, so the same tokens under two tenants never answer
each other, each tenant is listed, capped and purged on its own; driven through LMCacheEngine
(with a CPU implementation of LMCache's GPU connector) and StorageManager. Per engine
(``fixed:<name>``): two engines never share a chunk. Real LMCache StorageManagers over buffer +
posix."""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

try:
    import lmcache  # noqa: F401
except ImportError:
    if os.environ.get("CI"):
        raise
    pytest.skip("lmcache is not installed", allow_module_level=True)

import torch
from lmcache.utils import CacheEngineKey

import ucm
from ucm.integration.tenants import namespace_for

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
        (
            "lora",
            f"{backend_key}='lora' is not available with LMCache's storage plugin: LMCache "
            "0.5.6's CacheEngineKey (lmcache/utils.py) holds model name, world size, worker id, "
            "chunk hash, dtype and request configs: no LoRA adapter (LMCache #2961)",
        ),
        ("fixed:a/b", f"{backend_key}='a/b' is not a valid namespace name"),
        (
            "tenant",
            f"{backend_key}='tenant' is not valid: expected one of cache_salt, lora, tag:<name>, "
            "fixed:<name>",
        ),
        ("tag:", f"{backend_key}='tag:': tag:<name> needs the name of a request tag"),
    ):
        from ucm.integration.lmcache import UcmStorageBackend

        cfg = lm.config(stack, extra_config={"storage_plugin.ucm.namespace": value})
        with pytest.raises(ucm.ConfigError) as raised:
            UcmStorageBackend(config=cfg, metadata=lm.metadata(), local_cpu_backend=None)
        assert message in str(raised.value)


# ---- per request: a chunk's request tag names its namespace ---------------------------------

TOKENS = 4 * lm.CHUNK
SLOTS = 96


def _tagged(chunk_hash: int, **tags: str) -> Any:
    """A chunk key carrying LMCache request tags (``lmcache.tag.<name>`` request configs)."""
    configs = {f"lmcache.tag.{name}": value for name, value in tags.items()}
    return CacheEngineKey(lm.MODEL, 1, 0, chunk_hash, lm.DTYPE, configs)


def _salted(salt: str) -> dict[str, str]:
    """The request configs of a request whose kv_transfer_params carry this cache salt tag."""
    return {"lmcache.tag.cache_salt": salt}


def _kv_equal(dst: list[torch.Tensor], src: list[torch.Tensor], slots: torch.Tensor) -> bool:
    return all(
        torch.equal(d[:, slots].view(torch.int16), s[:, slots].view(torch.int16))
        for d, s in zip(dst, src, strict=True)
    )


def test_two_cache_salt_tags_are_two_namespaces_through_the_lmcache_engine(
    tmp_path: Path,
) -> None:
    """The default mapping (``cache_salt``): the same tokens stored by LMCacheEngine under two
    ``lmcache.tag.cache_salt`` values land in two namespaces (buffer and posix, exact counts),
    never hit across, and each retrieves byte-exact from its own; an untagged request is in the
    default namespace; a purge of one tenant leaves the other's chunks."""
    stack = {
        "unique_id": f"lmc-ns-{uuid.uuid4().hex[:12]}",
        "tiers": [
            {"type": "buffer", "capacity": 64 * lm.CHUNK_BYTES},
            {"type": "posix", "path": str(tmp_path / "posix"), "write": "through"},
        ],
    }
    engine = lm.engine(lm.config(stack, local_cpu=False), lm.metadata())
    engine.post_init()
    try:
        backend = engine.storage_manager.storage_backends["ucm"]
        assert backend.store.namespace == "default"
        tokens = torch.arange(3000, 3000 + TOKENS)
        src_a, slots = lm.paged_kv(TOKENS, SLOTS, seed=11)
        src_b, _ = lm.paged_kv(TOKENS, SLOTS, seed=12)
        engine.store(tokens, kvcaches=src_a, slot_mapping=slots, request_configs=_salted("t-a"))
        assert backend.flush(timeout_s=60)
        assert engine.lookup(tokens, lookup_id="a-1", request_configs=_salted("t-a")) == TOKENS
        # Tenant b, same tokens: no hit from tenant a's chunks, nor for an untagged request.
        assert engine.lookup(tokens, lookup_id="b-1", request_configs=_salted("t-b")) == 0
        assert engine.lookup(tokens, lookup_id="plain-1") == 0
        engine.store(tokens, kvcaches=src_b, slot_mapping=slots, request_configs=_salted("t-b"))
        engine.store(tokens, kvcaches=src_b, slot_mapping=slots)  # untagged: default namespace
        assert backend.flush(timeout_s=60)
        # Each tag value's namespace is derived from it (never the tag value itself).
        a, b = namespace_for("t-a"), namespace_for("t-b")
        assert backend.store.namespaces() == {"default": [4, 4], a: [4, 4], b: [4, 4]}
        figures = backend.store.stats()["namespaces"]
        assert {name: figures[name]["occupancy_slots"] for name in figures} == {
            "default": 4,
            a: 4,
            b: 4,
        }
        for salt, src in (("t-a", src_a), ("t-b", src_b)):
            dst = [torch.zeros_like(cache) for cache in src]
            ret = engine.retrieve(
                tokens,
                kvcaches=dst,
                slot_mapping=slots,
                req_id=f"get-{salt}",
                request_configs=_salted(salt),
            )
            assert bool(ret.all())
            assert _kv_equal(dst, src, slots)
        assert backend.store.purge(a) == [4, 4]
        assert engine.lookup(tokens, lookup_id="a-2", request_configs=_salted("t-a")) == 0
        assert engine.lookup(tokens, lookup_id="b-2", request_configs=_salted("t-b")) == TOKENS
        assert engine.lookup(tokens, lookup_id="plain-2") == TOKENS
    finally:
        lm.destroy(engine)


CAPPED = namespace_for("t-capped")
"""The namespace of the requests tagged t-capped (a quota names the derived name)."""


def _capped_manager(unique_id: str, namespace: str | None) -> Any:
    stack = {
        "unique_id": unique_id,
        "tiers": [{"type": "buffer", "capacity": 32 * lm.CHUNK_BYTES}],
        "quotas": {"namespaces": {CAPPED: {"buffer": {"cap": f"{3 * lm.CHUNK_BYTES}"}}}},
    }
    extra = {} if namespace is None else {"storage_plugin.ucm.namespace": namespace}
    return lm.storage_manager(lm.config(stack, local_cpu=False, extra_config=extra), lm.metadata())


def _put_one_by_one(manager: Any, keys: Sequence[Any], hashes: Sequence[int]) -> None:
    backend = manager.storage_backends["ucm"]
    for key, chunk_hash in zip(keys, hashes, strict=True):
        manager.batched_put([key], [lm.filled(manager, chunk_hash)])
        assert backend.flush(timeout_s=60)


def test_a_tenants_quota_applies_to_its_requests_only() -> None:
    """``quotas`` in the stack cap the namespace a request tag names: 6 chunks of tenant
    t-capped (cap: 3 chunks) leave its 3 newest in the buffer, having evicted its own 3 oldest,
    while tenant t-free's same 6 chunks all stay."""
    manager = _capped_manager(f"lmc-ns-{uuid.uuid4().hex[:12]}", None)
    try:
        backend = manager.storage_backends["ucm"]
        hashes = list(range(60, 66))
        capped = [_tagged(h, cache_salt="t-capped") for h in hashes]
        free = [_tagged(h, cache_salt="t-free") for h in hashes]
        _put_one_by_one(manager, capped, hashes)
        _put_one_by_one(manager, free, hashes)
        assert [backend.contains(key) for key in capped] == [False] * 3 + [True] * 3
        assert backend.batched_contains(free) == 6
        figures = backend.store.stats()["namespaces"]
        free_ns = namespace_for("t-free")
        assert figures[CAPPED]["cap_slots"] == 3
        assert (figures[CAPPED]["occupancy_slots"], figures[CAPPED]["evictions"]) == (3, 3)
        assert (figures[free_ns]["occupancy_slots"], figures[free_ns]["evictions"]) == (6, 0)
        assert backend.store.namespaces() == {CAPPED: [3], free_ns: [6]}
        got = backend.batched_get_blocking(capped[3:] + free)
        assert [lm.content(obj) for obj in got] == [lm.chunk_bytes(h) for h in hashes[3:] + hashes]
        for obj in got:
            obj.ref_count_down()
    finally:
        manager.close()


def test_tag_mode_reads_the_named_tag_and_a_mixed_batch_goes_to_each_namespace() -> None:
    """``tag:<name>`` maps the tag ``<name>`` (the cache_salt tag is then just a key field); a
    tenant key is hashed into a derived name (``namespace_for``); one batch of chunks of
    two tenants is stored, found, loaded and removed in each one's namespace."""
    manager = _capped_manager(f"lmc-ns-{uuid.uuid4().hex[:12]}", "tag:user")
    try:
        backend = manager.storage_backends["ucm"]
        alice = [_tagged(h, user="alice", cache_salt="x") for h in (70, 71)]
        mail = [_tagged(h, user="bob@example.com") for h in (70, 71)]
        untagged = [_tagged(70, cache_salt="alice")]
        bob = namespace_for("bob@example.com")
        assert bob.startswith("k-")
        alice_ns = namespace_for("alice")
        assert [backend.namespace_of(k) for k in (alice[0], mail[0], untagged[0])] == [
            alice_ns,
            bob,
            "default",
        ]
        keys = [alice[0], mail[0], alice[1], mail[1]]
        manager.batched_put(keys, [lm.filled(manager, h) for h in (70, 70, 71, 71)])
        assert backend.flush(timeout_s=60)
        assert backend.store.namespaces() == {alice_ns: [2], bob: [2]}
        assert backend.batched_contains(keys) == 4
        assert backend.batched_contains(untagged) == 0
        got = backend.batched_get_blocking(keys)
        assert [lm.content(obj) for obj in got] == [lm.chunk_bytes(h) for h in (70, 70, 71, 71)]
        for obj in got:
            obj.ref_count_down()
        assert backend.stats()["lmcache"]["loads"] == 2  # one load per namespace
        assert backend.batched_remove([alice[0], mail[1]]) == 2
        assert [backend.contains(k) for k in keys] == [False, True, True, False]
        assert backend.store.namespaces() == {alice_ns: [1], bob: [1]}
    finally:
        manager.close()


def test_a_mixed_batch_whose_one_tenant_fails_stores_the_other() -> None:
    """One put of two tenants' chunks is one UCM write per namespace: tenant t-none (a cap of
    0%: no slot) fails its chunks only, each future says which, and no reference leaks."""
    stack = {
        "unique_id": f"lmc-ns-{uuid.uuid4().hex[:12]}",
        "tiers": [{"type": "buffer", "capacity": 32 * lm.CHUNK_BYTES}],
        "quotas": {"namespaces": {namespace_for("t-none"): {"buffer": {"cap": "0%"}}}},
    }
    manager = lm.storage_manager(lm.config(stack, local_cpu=False), lm.metadata())
    try:
        backend = manager.storage_backends["ucm"]
        baseline = lm.active_allocations(manager)
        keys = [_tagged(80, cache_salt="t-ok"), _tagged(80, cache_salt="t-none")]
        keys += [_tagged(81, cache_salt="t-ok"), _tagged(81, cache_salt="t-none")]
        objs = [lm.filled(manager, h) for h in (80, 80, 81, 81)]
        futures = backend.batched_submit_put_task(keys, objs)
        assert futures is not None
        assert [f.result(timeout=60) for f in futures] == [True, False, True, False]
        assert backend.flush(timeout_s=60)
        counters = backend.stats()["lmcache"]
        assert (counters["put_chunks_stored"], counters["put_chunks_failed"]) == (2, 2)
        assert [obj.get_ref_count() for obj in objs] == [1] * 4
        for obj in objs:
            obj.ref_count_down()
        assert lm.active_allocations(manager) == baseline
        assert [backend.contains(key) for key in keys] == [True, False, True, False]
        assert backend.store.namespaces() == {namespace_for("t-ok"): [2]}
    finally:
        manager.close()


def test_vllms_request_reaches_the_plugin_as_its_tag_but_not_its_cache_salt() -> None:
    """What LMCache's vLLM adapter hands the engine of a vLLM request (``extract_request_
    configs_from_request``, used by ``vllm_v1_adapter``): the ``lmcache.*`` entries of its
    ``kv_transfer_params``, so the tag names the chunk's namespace; vLLM's own ``cache_salt`` is
    not among them."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            pytest.fail("vllm is not installed, and CI must run the vLLM tests")
        pytest.skip("vllm is not installed")
    from lmcache.integration.vllm.utils import extract_request_configs_from_request
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = {"lmcache.tag.cache_salt": "t-a", "do_remote_prefill": False}
    tagged = Request(
        "r0",
        list(range(32)),
        SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}),
        None,
        cache_salt="vllm-salt",
    )
    salted_only = Request(
        "r1", list(range(32)), SamplingParams(max_tokens=1), None, cache_salt="vllm-salt"
    )
    configs = extract_request_configs_from_request(tagged)
    assert configs == {"lmcache.tag.cache_salt": "t-a"}
    assert extract_request_configs_from_request(salted_only) is None
    stack = {
        "unique_id": f"lmc-ns-{uuid.uuid4().hex[:12]}",
        "tiers": [{"type": "buffer", "capacity": 8 * lm.CHUNK_BYTES}],
    }
    manager = lm.storage_manager(lm.config(stack, local_cpu=False), lm.metadata())
    try:
        backend = manager.storage_backends["ucm"]
        key = CacheEngineKey(lm.MODEL, 1, 0, 90, lm.DTYPE, configs)
        assert backend.namespace_of(key) == namespace_for("t-a")
        assert backend.namespace_of(CacheEngineKey(lm.MODEL, 1, 0, 90, lm.DTYPE)) == "default"
    finally:
        manager.close()
