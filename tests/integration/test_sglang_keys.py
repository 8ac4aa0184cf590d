"""What an SGLang page id covers, and what ``clear`` does, against the real sglang 0.5.23.

Backends are made as SGLang's cache controller makes them (``StorageBackendFactory``'s dynamic
path, then ``register_mem_pool_host`` with a real CPU host pool over a real device pool). Where a
case needs SGLang's server args (``--kv-cache-dtype``, ``--nnodes``, model overrides), the test
publishes a real ``ServerArgs`` for a model config written locally, as an SGLang scheduler
process does before it builds its cache, and resets SGLang's runtime context afterwards.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ucm import ConfigError
from ucm.native import segments

from ._sglang import (
    HEAD_DIM,
    HEADS,
    LAYERS,
    PAGE_TOKENS,
    SGLang,
    ci,
    create_backend,
    fill,
    host_pool,
    import_sglang,
    mla_host_pool,
    page_keys,
    sglang_installed,
    storage_config,
)


@pytest.fixture(scope="module")
def sgl() -> SGLang:
    if not sglang_installed():
        if ci():
            pytest.fail("sglang is not installed and CI is set: bash tools/install-test-env")
        pytest.skip("sglang is not installed (bash tools/install-test-env installs it)")
    return import_sglang()


@pytest.fixture
def unique_id() -> Iterator[Callable[[], str]]:
    made: list[str] = []

    def make() -> str:
        made.append(f"sglk-{uuid.uuid4().hex[:12]}")
        return made[-1]

    yield make
    for name in made:
        segments.unlink(name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama model config (no weights needed: ServerArgs reads the config only)."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("sglang-model") / "llama"
    LlamaConfig(
        vocab_size=512,
        hidden_size=HEADS * HEAD_DIM,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=HEAD_DIM,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(str(path))
    return path


@pytest.fixture
def publish(sgl: SGLang, model_dir: Path) -> Iterator[Callable[..., Any]]:
    """Publishes SGLang's ServerArgs for ``model_dir`` (keyword arguments: ServerArgs fields)."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    def make(**fields: Any) -> Any:
        args = ServerArgs(model_path=str(model_dir), device="cpu", **fields)
        runtime_context.publish(args, role="scheduler")
        return args

    yield make
    runtime_context.reset_context()


def fp8_host_pool(sgl: SGLang, dtype: Any) -> Any:
    """SGLang's own pools for an fp8 KV cache: the device pool stores it as torch.uint8."""
    device_pool = sgl.MHATokenToKVPool(
        256,
        PAGE_TOKENS,
        dtype,
        HEADS,
        HEAD_DIM,
        LAYERS,
        "cpu",
        False,
        start_layer=0,
        end_layer=LAYERS - 1,
    )
    info = device_pool.get_device_pool_infos()[0].buffer_info
    return sgl.MHATokenToKVPoolHost(
        info,
        1.0,
        0,
        PAGE_TOKENS,
        "layer_first",
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_pool.size,
        start_layer=device_pool.start_layer,
        end_layer=device_pool.end_layer,
        write_back_staging=device_pool.hicache_write_back_staging,
    )


def pages_at(pool: Any, pages: list[int]) -> Any:
    import torch

    return torch.cat(
        [
            torch.arange(p * pool.page_size, (p + 1) * pool.page_size, dtype=torch.int64)
            for p in pages
        ]
    )


def keys_of(sgl: SGLang, count: int) -> list[str]:
    return page_keys(sgl, count, seed=uuid.uuid4().int)


def stack_of(unique_id: str, lower: Path | None = None) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [{"type": "buffer", "capacity": "4MiB"}]
    if lower is not None:
        # A restarted backend reads the clear's epoch record from posix: a generous deadline.
        tiers.append({"type": "posix", "path": str(lower), "lookup_timeout_ms": 60_000})
    return {"unique_id": unique_id, "tiers": tiers}


def _store_pages(backend: Any, pool: Any, keys: list[str], seed: int = 1) -> None:
    fill(pool, seed=seed)
    assert backend.batch_set_v1(keys, pages_at(pool, list(range(len(keys))))) == [True] * len(keys)


# ---- fp8 formats (issue 24 defect 1) -------------------------------------------------------


def test_fp8_e4m3_and_e5m2_pages_never_meet(
    sgl: SGLang, unique_id: Callable[[], str], publish: Callable[..., Any]
) -> None:
    """Both formats live in a torch.uint8 host pool; SGLang's --kv-cache-dtype tells them apart."""
    import torch

    stack = stack_of(unique_id())
    keys = keys_of(sgl, 3)
    publish(kv_cache_dtype="fp8_e4m3")
    e4m3_pool = fp8_host_pool(sgl, torch.float8_e4m3fn)
    assert e4m3_pool.dtype == torch.uint8
    e4m3 = create_backend(sgl, storage_config(sgl, {"ucm_stack": stack}), e4m3_pool)
    try:
        _store_pages(e4m3, e4m3_pool, keys)
        assert e4m3.batch_exists(keys) == 3
        publish(kv_cache_dtype="fp8_e5m2")
        e5m2_pool = fp8_host_pool(sgl, torch.float8_e5m2)
        assert e5m2_pool.dtype == torch.uint8
        e5m2 = create_backend(sgl, storage_config(sgl, {"ucm_stack": stack}), e5m2_pool)
        try:
            assert e5m2.block_id(keys[0]) != e4m3.block_id(keys[0])
            assert e5m2.batch_exists(keys) == 0
            assert e5m2.batch_get_v1(keys, pages_at(e5m2_pool, [4, 5, 6])) == [False] * 3
        finally:
            e5m2.close()
    finally:
        e4m3.close()


def test_without_server_args_the_weights_id_is_required(
    sgl: SGLang, unique_id: Callable[[], str]
) -> None:
    """Without SGLang's server args nothing names the weights, overrides or quantization: the
    backend refuses to start unless ``ucm_weights_id`` is stated (never a key space that two
    models would share)."""
    config = storage_config(sgl, {"ucm_stack": stack_of(unique_id())}, weights_id=None)
    with pytest.raises(ConfigError) as raised:
        create_backend(sgl, config, host_pool(sgl))
    assert str(raised.value) == (
        "SGLang's server args are not available (a backend created outside an SGLang scheduler "
        "process), so UCM's page ids cannot cover the model's weights, its config overrides "
        "(--json-model-override-args) or its quantization: state "
        "hicache_storage_backend_extra_config['ucm_weights_id'] = '<an id of the weights, "
        "overrides and quantization>', so that two models' pages never share a key"
    )
    stated = storage_config(
        sgl, {"ucm_stack": stack_of(unique_id()), "ucm_weights_id": "llama-w1"}, weights_id=None
    )
    pool = host_pool(sgl)
    backend = create_backend(sgl, stated, pool)
    try:
        keys = keys_of(sgl, 2)
        _store_pages(backend, pool, keys)
        assert backend.batch_exists(keys) == 2
    finally:
        backend.close()


def test_a_one_byte_pool_without_a_known_format_is_refused(
    sgl: SGLang, unique_id: Callable[[], str]
) -> None:
    import torch

    pool = fp8_host_pool(sgl, torch.float8_e5m2)
    config = storage_config(sgl, {"ucm_stack": stack_of(unique_id())})
    with pytest.raises(ConfigError) as raised:
        create_backend(sgl, config, pool)
    assert str(raised.value).startswith(
        "SGLang's host KV pool stores torch.uint8, which holds every fp8 format alike"
    )
    assert "hicache_storage_backend_extra_config['ucm_kv_dtype'] = 'fp8_e4m3' or" in str(
        raised.value
    )


def test_a_stated_format_tells_the_fp8_pools_apart(
    sgl: SGLang, unique_id: Callable[[], str]
) -> None:
    import torch

    stack = stack_of(unique_id())
    backends = []
    try:
        for name, dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
            pool = fp8_host_pool(sgl, dtype)
            config = storage_config(sgl, {"ucm_stack": stack, "ucm_kv_dtype": name})
            backends.append((create_backend(sgl, config, pool), pool))
        keys = keys_of(sgl, 2)
        _store_pages(*backends[0], keys)
        assert backends[0][0].batch_exists(keys) == 2
        assert backends[1][0].batch_exists(keys) == 0
    finally:
        for backend, _ in backends:
            backend.close()


def test_a_stated_format_that_contradicts_sglang_is_refused(
    sgl: SGLang, unique_id: Callable[[], str], publish: Callable[..., Any]
) -> None:
    import torch

    publish(kv_cache_dtype="fp8_e4m3")
    pool = fp8_host_pool(sgl, torch.float8_e4m3fn)
    config = storage_config(sgl, {"ucm_stack": stack_of(unique_id()), "ucm_kv_dtype": "fp8_e5m2"})
    with pytest.raises(ConfigError) as raised:
        create_backend(sgl, config, pool)
    assert str(raised.value) == (
        "hicache_storage_backend_extra_config['ucm_kv_dtype']='fp8_e5m2', but SGLang runs with "
        "--kv-cache-dtype fp8_e4m3: leave ucm_kv_dtype out or make it match"
    )


def test_model_overrides_change_the_page_ids(
    sgl: SGLang, unique_id: Callable[[], str], publish: Callable[..., Any]
) -> None:
    stack = stack_of(unique_id())
    keys = keys_of(sgl, 2)
    publish()
    pool = host_pool(sgl)
    plain = create_backend(sgl, storage_config(sgl, {"ucm_stack": stack}), pool)
    try:
        _store_pages(plain, pool, keys)
        publish(json_model_override_args='{"rope_theta": 500}')
        other = create_backend(sgl, storage_config(sgl, {"ucm_stack": stack}), host_pool(sgl))
        try:
            assert other.batch_exists(keys) == 0
        finally:
            other.close()
    finally:
        plain.close()


def test_an_empty_model_name_is_refused(sgl: SGLang, unique_id: Callable[[], str]) -> None:
    for name in ("", None):
        config = storage_config(sgl, {"ucm_stack": stack_of(unique_id())}, model_name=name)
        with pytest.raises(ConfigError) as raised:
            create_backend(sgl, config, host_pool(sgl))
        assert str(raised.value).startswith(
            f"HiCacheStorageConfig.model_name={name!r}: the UCM backend salts every page key "
            "with the model name"
        )


# ---- clear (issue 24 defect 2) -------------------------------------------------------------


def test_clear_serves_nothing_stored_before_it_on_any_tier(
    sgl: SGLang, unique_id: Callable[[], str], tmp_path: Path
) -> None:
    stack = stack_of(unique_id(), lower=tmp_path / "posix")
    pool = host_pool(sgl)
    backend = create_backend(sgl, storage_config(sgl, {"ucm_stack": stack}), pool)
    before, after = keys_of(sgl, 3), keys_of(sgl, 2)
    try:
        _store_pages(backend, pool, before)
        assert backend.batch_exists(before) == 3
        backend.clear()
        assert backend.batch_exists(before) == 0
        assert backend.batch_get_v1(before, pages_at(pool, [5, 6, 7])) == [False] * 3
        assert not backend.exists(before[0])
        assert backend.epoch == 1
        _store_pages(backend, pool, after, seed=2)
        assert backend.batch_exists(after) == 2
    finally:
        backend.close()
    # A backend opened later on the stack (a restart: its buffer is gone, the posix tier holds
    # everything) starts in the cleared epoch: the old pages are still on disk, never served.
    segments.unlink(stack["unique_id"])
    restarted = create_backend(sgl, storage_config(sgl, {"ucm_stack": stack}), host_pool(sgl))
    try:
        assert restarted.epoch == 1
        assert restarted.batch_exists(before) == 0
        assert restarted.batch_exists(after) == 2
        restarted.clear()
        assert restarted.epoch == 2 and restarted.batch_exists(after) == 0
    finally:
        restarted.close()


def test_a_backend_started_while_the_records_tier_is_slow_never_takes_an_older_epoch(
    sgl: SGLang, unique_id: Callable[[], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The posix tier holding the clear's epoch record answers past its deadline when a
    backend starts. It must not start in epoch 0 (it would serve pages stored before the clear
    once the tier answers): its page ids carry a nonce until it reads epoch 1. A clear made
    while the tier is slow is pending, and begins epoch 2 once the tier answers."""
    import threading
    import time

    from ucm_backends.posix import PosixTier

    stack = stack_of(unique_id(), lower=tmp_path / "posix")
    stack["tiers"][1].update({"lookup_timeout_ms": 200, "breaker": {"probe_interval_ms": 500}})
    before, after, mine = keys_of(sgl, 3), keys_of(sgl, 2), keys_of(sgl, 2)
    pool = host_pool(sgl)
    backend = create_backend(sgl, storage_config(sgl, {"ucm_stack": stack}), pool)
    try:
        _store_pages(backend, pool, before)
        backend.clear()
        _store_pages(backend, pool, after, seed=2)
        assert backend.epoch == 1 and backend.batch_exists(after) == 2
    finally:
        backend.close()
    segments.unlink(stack["unique_id"])  # a restart: only the posix tier holds the record

    slow = threading.Event()
    slow.set()
    answer = PosixTier.read_control

    def read_control(self: PosixTier, names: Any) -> list[int | None]:
        if slow.is_set():
            time.sleep(0.6)
        return answer(self, names)

    def adopted(rank: Any, epoch: int) -> None:
        began = time.monotonic()
        while rank.epoch != epoch and time.monotonic() - began < 60:
            rank.batch_exists(mine)  # every call adopts a read epoch
            time.sleep(0.05)
        assert rank.epoch == epoch

    monkeypatch.setattr(PosixTier, "read_control", read_control)
    pool = host_pool(sgl)
    restarted = create_backend(sgl, storage_config(sgl, {"ucm_stack": stack}), pool)
    try:
        assert restarted.epoch is None  # unknown: page ids carry a nonce
        _store_pages(restarted, pool, mine, seed=3)
        assert restarted.batch_exists(mine) == 2  # what it saved itself is served
        slow.clear()
        adopted(restarted, 1)
        assert restarted.batch_exists(before) == 0  # stored before the clear: never served
        assert restarted.batch_exists(after) == 2
        slow.set()
        restarted.clear()  # the stack's epoch cannot be read: pending
        assert restarted.epoch is None and restarted.batch_exists(after) == 0
        slow.clear()
        adopted(restarted, 2)
        assert restarted.batch_exists(after) == 0
    finally:
        restarted.close()
    segments.unlink(stack["unique_id"])
    later = create_backend(sgl, storage_config(sgl, {"ucm_stack": stack}), host_pool(sgl))
    try:
        assert later.epoch == 2  # the pending clear's epoch was recorded
    finally:
        later.close()


@pytest.mark.parametrize("mla", [False, True])
def test_tp_ranks_that_clear_agree_on_the_epoch(
    sgl: SGLang, unique_id: Callable[[], str], mla: bool
) -> None:
    """SGLang clears every TP rank on its own, one after the other; they end in one epoch."""
    stack = stack_of(unique_id())
    fields: dict[str, Any] = {"tp_size": 2, "is_mla_model": mla}
    pools = [mla_host_pool(sgl) if mla else host_pool(sgl) for _ in range(2)]
    ranks = [
        create_backend(
            sgl, storage_config(sgl, {"ucm_stack": stack}, tp_rank=r, **fields), pools[r]
        )
        for r in range(2)
    ]
    try:
        keys = keys_of(sgl, 2)
        for rank, pool in zip(ranks, pools, strict=True):
            _store_pages(rank, pool, keys)
        assert [rank.batch_exists(keys) for rank in ranks] == [2, 2]
        for _ in range(2):
            for rank in ranks:
                rank.clear()
        assert [rank.batch_exists(keys) for rank in ranks] == [0, 0]
        assert ranks[0].block_id(keys[0]) == ranks[1].block_id(keys[0])
        assert [rank.epoch for rank in ranks] == [2, 2]
    finally:
        for rank in ranks:
            rank.close()


# ---- multi-node TP (issue 24 defect 6) -----------------------------------------------------


def test_multi_node_tp_on_a_node_local_stack_warns(
    sgl: SGLang,
    unique_id: Callable[[], str],
    publish: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    publish(tp_size=2, nnodes=2, node_rank=0, dist_init_addr="127.0.0.1:5000")
    config = storage_config(sgl, {"ucm_stack": stack_of(unique_id())}, tp_rank=0, tp_size=2)
    with caplog.at_level(logging.WARNING):
        backend = create_backend(sgl, config, host_pool(sgl))
    backend.close()
    warnings = [r.getMessage() for r in caplog.records if "over 2 nodes" in r.getMessage()]
    assert warnings == [
        "UCM: SGLang runs tensor parallelism over 2 nodes: a block is 2 shards (one per TP "
        "rank), and a node's buffer holds only its own ranks' shards, so a block is complete "
        "only in a tier shared by every node; this stack has no tier below the buffer, so it "
        "never hits. Fix: give the stack a shared lower tier (posix on a shared filesystem, "
        "s3, mooncake)"
    ]
