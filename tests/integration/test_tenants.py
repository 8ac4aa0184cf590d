"""How an engine's tenant key becomes a namespace (``ucm.integration.tenants``), and vLLM's
scheduler side applying it to real ``vllm.v1.request.Request`` objects: each request's ids are
its namespace's scoped ids, and each new namespace is announced to the workers once."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from types import SimpleNamespace
from typing import Any

import pytest

from ucm import ConfigError, namespaces
from ucm.integration.tenants import TenantMapping, namespace_for


def test_tenant_keys_become_valid_namespace_names() -> None:
    assert namespace_for(None) == namespace_for("") == namespaces.DEFAULT_NAMESPACE
    assert (
        namespace_for("tenant-a") == "k-" + hashlib.blake2b(b"tenant-a", digest_size=16).hexdigest()
    )
    hashed = namespace_for("user@example.com")
    assert hashed == namespace_for("user@example.com")  # reproducible: `ucm purge` can name it
    assert hashed.startswith("k-") and len(hashed) == 34
    assert namespaces.check_namespace(hashed) == hashed
    assert namespace_for("x" * 65) != namespace_for("x" * 66)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, TenantMapping("cache_salt")),
        ("cache_salt", TenantMapping("cache_salt")),
        ("lora", TenantMapping("lora")),
        ("fixed:team-7", TenantMapping("fixed", "team-7")),
    ],
)
def test_the_mapping_settings(value: Any, expected: TenantMapping) -> None:
    assert TenantMapping.parse(value, "ucm_namespace") == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "salt",
            "ucm_namespace='salt' is not valid: expected one of cache_salt, lora, fixed:<name>",
        ),
        (7, "ucm_namespace=7 is not valid: expected one of cache_salt, lora, fixed:<name>"),
        (
            "fixed:a b",
            "ucm_namespace='a b' is not a valid namespace name: expected 1 to 64 characters",
        ),
    ],
)
def test_bad_mapping_settings_name_the_key_value_and_choices(value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        TenantMapping.parse(value, "ucm_namespace")
    assert message in str(raised.value)


def test_tag_mode_only_where_requests_carry_tags() -> None:
    """``tag:<name>`` is a mode of integrations whose requests carry named tags (LMCache's); the
    cache_salt mode reads the tag ``cache_salt`` there."""
    assert TenantMapping.parse("tag:user", "k", tags=True) == TenantMapping("tag", tag="user")
    assert TenantMapping.parse("tag:user", "k", tags=True).tag_name == "user"
    assert TenantMapping.parse(None, "k", tags=True).tag_name == "cache_salt"
    assert TenantMapping.parse("fixed:t", "k", tags=True).tag_name is None
    with pytest.raises(ConfigError) as raised:
        TenantMapping.parse("tag:user", "k")
    assert "k='tag:user' is not valid: expected one of cache_salt, lora, fixed:<name>" in str(
        raised.value
    )
    with pytest.raises(ConfigError) as raised:
        TenantMapping.parse("tag: user", "k", tags=True)
    assert "k='tag: user': tag:<name> needs the name of a request tag" in str(raised.value)


def test_an_engine_without_tenant_keys_takes_fixed_or_the_default_and_refuses_the_rest() -> None:
    """Left out, the setting means the default namespace; a stated per-request mode is refused
    with the reason the integration gives."""
    why = "its calls carry hashes only"
    assert TenantMapping.parse(None, "k").engine_namespace("k", "E", why) == "default"
    assert TenantMapping.parse("fixed:t", "k").engine_namespace("k", "E", why) == "t"
    for value in ("cache_salt", "lora"):
        with pytest.raises(ConfigError) as raised:
            TenantMapping.parse(value, "k").engine_namespace("k", "E", why)
        assert str(raised.value) == (
            f"k={value!r} is not available with E: its calls carry hashes only. Use "
            "fixed:<name> (one namespace for the whole engine), or leave the setting out (the "
            "default namespace)"
        )


def test_each_mode_picks_the_namespace_of_a_request() -> None:
    s1, ad = namespace_for("s1"), namespace_for("ad")
    assert TenantMapping().namespace(cache_salt="s1", lora_name="ad") == s1
    assert TenantMapping().namespace() == namespaces.DEFAULT_NAMESPACE
    assert TenantMapping("lora").namespace(cache_salt="s1", lora_name="ad") == ad
    assert TenantMapping("lora").namespace(cache_salt="s1") == namespaces.DEFAULT_NAMESPACE
    assert TenantMapping("fixed", "t").namespace(cache_salt="s1", lora_name="ad") == "t"


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            pytest.fail("vllm is not installed, and CI must run the vLLM tests")
        pytest.skip("vllm is not installed")


def test_vllm_extra_config_refuses_a_bad_mapping() -> None:
    _require_vllm()
    from ucm.integration.vllm.config import check_extra_config

    with pytest.raises(ConfigError) as raised:
        check_extra_config({"ucm_stack": {}, "ucm_namespace": "per-user"})
    assert str(raised.value).startswith(
        "kv_connector_extra_config['ucm_namespace']='per-user' is not valid: expected one of "
        "cache_salt, lora, fixed:<name>"
    )
    check_extra_config({"ucm_stack": {}, "ucm_namespace": "fixed:team-7"})


@pytest.mark.parametrize(
    ("mapping", "expected"),
    [
        (
            TenantMapping(),
            [namespace_for("salt-a"), namespace_for("salt-b"), namespace_for("salt-a"), "default"],
        ),
        (TenantMapping("lora"), [namespace_for("adapter-1"), "default"] * 2),
        (TenantMapping("fixed", "team-7"), ["team-7"] * 4),
    ],
)
def test_vllm_scheduler_scopes_each_request_to_its_namespace(
    mapping: TenantMapping, expected: list[str]
) -> None:
    _require_vllm()
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

    from ucm.integration.keys import KeySpace, chain_block_ids
    from ucm.integration.vllm.scheduler import SchedulerSide

    space = KeySpace(
        engine="vllm", model="m", dtype="float32", block_tokens=16, kv_layout="x", tp_size=1
    )
    asked: list[bytes] = []

    def lookup(ids: Any) -> list[bool]:
        asked.extend(ids)
        return [False] * len(ids)

    side = SchedulerSide(
        lookup=lookup,
        key_space=space,
        block_tokens=16,
        shards_per_block=1,
        block_table=lambda _state, _req_id: None,
        tenants=mapping,
    )
    tokens = list(range(3, 3 + 40))  # 2 full blocks
    adapter = LoRARequest("adapter-1", 1, "/nonexistent/adapter-1")
    requests = [
        Request(
            "r0",
            tokens,
            SamplingParams(max_tokens=1),
            None,
            cache_salt="salt-a",
            lora_request=adapter,
        ),
        Request("r1", tokens, SamplingParams(max_tokens=1), None, cache_salt="salt-b"),
        Request(
            "r2",
            tokens,
            SamplingParams(max_tokens=1),
            None,
            cache_salt="salt-a",
            lora_request=adapter,
        ),
        Request("r3", tokens, SamplingParams(max_tokens=1), None),
    ]
    for request in requests:
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    for index, (request, name) in enumerate(zip(requests, expected, strict=True)):
        lora = request.lora_request
        salted = space
        if lora is not None:
            from dataclasses import replace

            from ucm.integration.salts import lora_identity

            salted = replace(space, extra=(*space.extra, ("lora", lora_identity(lora))))
        chain = chain_block_ids(salted.salt(request.cache_salt), tokens[:32], 16)
        assert asked[2 * index : 2 * index + 2] == namespaces.scope(name, chain)
    output = SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={},
    )
    meta = side.build_connector_meta(output)  # type: ignore[arg-type]
    assert meta.namespaces == set(expected)  # each announced once...
    assert side.build_connector_meta(output).namespaces == set()  # type: ignore[arg-type]


CONFIGURED = ("default", "tenant-a", "team-7")
"""Names an operator configures (``fixed:<name>``, quotas, ``ucm.open(namespace=...)``)."""


def test_a_tenant_key_that_looks_like_a_configured_name_never_lands_there() -> None:
    """Derived names (``k-`` + 32 hex digits) and configured names are disjoint: a request
    whose cache_salt (or LoRA name) is "default" or "tenant-a" gets a namespace of its own."""
    for name in CONFIGURED:
        derived = namespace_for(name)
        assert derived not in CONFIGURED
        assert re.fullmatch(r"k-[0-9a-f]{32}", derived), derived
        assert TenantMapping().namespace(cache_salt=name) == derived
        assert TenantMapping("lora").namespace(lora_name=name) == derived
    assert namespace_for("tenant-a") != namespace_for("tenant-b")


def test_a_configured_name_of_the_derived_form_is_refused() -> None:
    taken = namespace_for("bob")
    with pytest.raises(ConfigError) as raised:
        TenantMapping.parse(f"fixed:{taken}", "ucm_namespace")
    assert str(raised.value) == (
        f"ucm_namespace='fixed:{taken}': names of the form k-<32 hex digits> are the namespaces "
        "derived from tenant keys (cache_salt, LoRA names, request tags); a configured "
        "namespace must not take that form, so that no tenant key can land in it"
    )


def test_lmcache_tag_path_keeps_tenant_keys_out_of_configured_namespaces() -> None:
    if importlib.util.find_spec("lmcache") is None:
        if os.environ.get("CI"):
            pytest.fail("lmcache is not installed, and CI must run the LMCache tests")
        pytest.skip("lmcache is not installed")
    from ucm.integration.lmcache import UcmStorageBackend

    for mapping in (TenantMapping(), TenantMapping("tag", tag="user")):
        plugin = SimpleNamespace(tenants=mapping)
        for name in CONFIGURED:
            tags = ((mapping.tag_name, name),)
            got = UcmStorageBackend._tag_namespace(plugin, tags)  # type: ignore[arg-type]
            assert got == namespace_for(name) and got not in CONFIGURED


def test_vllm_scheduler_keeps_salts_out_of_configured_namespaces() -> None:
    _require_vllm()
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from ucm.integration.keys import KeySpace, chain_block_ids
    from ucm.integration.vllm.scheduler import SchedulerSide

    space = KeySpace(
        engine="vllm", model="m", dtype="float32", block_tokens=16, kv_layout="x", tp_size=1
    )
    asked: list[bytes] = []

    def lookup(ids: Any) -> list[bool]:
        asked.extend(ids)
        return [False] * len(ids)

    side = SchedulerSide(
        lookup=lookup,
        key_space=space,
        block_tokens=16,
        shards_per_block=1,
        block_table=lambda _state, _req_id: None,
        tenants=TenantMapping(),
    )
    tokens = list(range(3, 3 + 40))  # 2 full blocks
    for index, salt in enumerate(CONFIGURED):
        request = Request(f"r{index}", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt)
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
        chain = chain_block_ids(space.salt(salt), tokens[:32], 16)
        got = asked[2 * index : 2 * index + 2]
        assert got == namespaces.scope(namespace_for(salt), chain)
        assert got != namespaces.scope(salt, chain)
