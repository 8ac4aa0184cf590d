"""SGLang 0.5.23 for the SGLang tests: imported beside the CPU torch, and its real host KV pool.

**The torchvision stand-in (test environment only).** The test environment installs sglang with
``--no-deps`` beside ``torch==2.13.0+cpu`` (docs/sglang.md says why). SGLang's host-pool modules
import torchvision unconditionally, for image models only: ``sglang/srt/multimodal/
internvl_utils.py`` and ``sglang/srt/configs/deepseek_ocr.py`` (reached through
``sglang.srt.configs`` from ``memory_pool.py``). PyPI's torchvision is a CUDA build that breaks
beside the CPU torch, so the environment has none. When no torchvision is installed,
:func:`import_sglang` imports SGLang's modules while ``sys.modules`` holds three empty stand-in
modules that give those imports the names they bind (``torchvision.transforms``,
``torchvision.transforms.functional``, ``InterpolationMode``), and removes them right after:

- nothing of it is installed, and nothing leaves this file: later ``import torchvision`` fails as
  before, and SGLang's image transforms raise if ever called;
- transformers decides whether torchvision exists once (``is_torchvision_available`` is cached):
  it is asked first, before the stand-in exists, so it keeps the true answer (absent) and never
  takes the stand-in for a torchvision;
- the environment variables SGLang sets on import (its JIT cache directories) are put back, so
  the other engines' tests in the same pytest process see the environment they had.

With a working torchvision installed (an engine environment), SGLang imports it as usual and the
stand-in is never used.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from typing import Any

SGLANG_MODULES = (
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.storage.backend_factory",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.utils",
)

# The page geometry of the tests' host pools: 4 layers of 4 heads x 32 dims in bf16, pages of
# 16 tokens: 4 KiB per K or V tensor of a layer, 32 KiB per page.
LAYERS = 4
HEADS = 4
HEAD_DIM = 32
PAGE_TOKENS = 16


def ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def sglang_installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


@dataclass(frozen=True)
class SGLang:
    """The SGLang classes the tests use."""

    HiCacheStorageConfig: Any
    StorageBackendFactory: Any
    MHATokenToKVPool: Any
    MHATokenToKVPoolHost: Any
    MLATokenToKVPool: Any
    MLATokenToKVPoolHost: Any
    get_storage_hash_str: Any


def import_sglang() -> SGLang:
    """Imports SGLang's storage and host-pool modules (with the stand-in when needed)."""
    if importlib.util.find_spec("torchvision") is None and SGLANG_MODULES[-1] not in sys.modules:
        _import_with_standin()
    modules = [importlib.import_module(name) for name in SGLANG_MODULES]
    return SGLang(
        HiCacheStorageConfig=modules[0].HiCacheStorageConfig,
        StorageBackendFactory=modules[1].StorageBackendFactory,
        MHATokenToKVPool=modules[2].MHATokenToKVPool,
        MHATokenToKVPoolHost=modules[3].MHATokenToKVPoolHost,
        MLATokenToKVPool=modules[2].MLATokenToKVPool,
        MLATokenToKVPoolHost=modules[4].MLATokenToKVPoolHost,
        get_storage_hash_str=modules[5].get_storage_hash_str,
    )


def _import_with_standin() -> None:
    from transformers.utils import import_utils

    # Cached from now on: the true answer (no torchvision), asked before the stand-in exists.
    assert not import_utils.is_torchvision_available()
    standin = _torchvision_standin()
    assert not set(standin) & set(sys.modules), "a torchvision is already imported"
    environment = dict(os.environ)
    sys.modules.update(standin)
    try:
        for name in SGLANG_MODULES:
            importlib.import_module(name)
    finally:
        for name, module in standin.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
        os.environ.clear()
        os.environ.update(environment)


def _torchvision_standin() -> dict[str, types.ModuleType]:
    class InterpolationMode(enum.Enum):
        """The names of torchvision's enum, for default arguments of SGLang's image code."""

        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    def module(name: str) -> types.ModuleType:
        standin = types.ModuleType(
            name, "Stand-in of tests/integration/_sglang.py: not torchvision"
        )

        def missing(attribute: str) -> Any:
            raise AttributeError(
                f"{name}.{attribute}: torchvision is not installed; this stand-in "
                "(tests/integration/_sglang.py) only lets SGLang's modules import"
            )

        standin.__getattr__ = missing  # type: ignore[method-assign]
        return standin

    root = module("torchvision")
    transforms = module("torchvision.transforms")
    functional = module("torchvision.transforms.functional")
    functional.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    transforms.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    transforms.functional = functional  # type: ignore[attr-defined]
    root.transforms = transforms  # type: ignore[attr-defined]
    return {
        "torchvision": root,
        "torchvision.transforms": transforms,
        "torchvision.transforms.functional": functional,
    }


def host_pool(sgl: SGLang, layout: str = "layer_first", tokens: int = 256) -> Any:
    """A real SGLang CPU host KV pool: MHATokenToKVPoolHost over a CPU MHATokenToKVPool."""
    import torch

    device_pool = sgl.MHATokenToKVPool(
        tokens,
        PAGE_TOKENS,
        torch.bfloat16,
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
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_pool.size,
        start_layer=device_pool.start_layer,
        end_layer=device_pool.end_layer,
        write_back_staging=device_pool.hicache_write_back_staging,
    )


def mla_host_pool(sgl: SGLang, tokens: int = 256) -> Any:
    """A real SGLang CPU MLA host pool (one latent tensor per layer: kv_lora_rank 64 + rope 16)."""
    import torch

    device_pool = sgl.MLATokenToKVPool(
        tokens,
        PAGE_TOKENS,
        torch.bfloat16,
        64,
        16,
        LAYERS,
        "cpu",
        False,
        start_layer=0,
        end_layer=LAYERS - 1,
    )
    info = device_pool.get_device_pool_infos()[0].buffer_info
    return sgl.MLATokenToKVPoolHost(
        info,
        1.0,
        0,
        PAGE_TOKENS,
        "layer_first",
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_pool.size,
        start_layer=0,
        end_layer=LAYERS - 1,
        target_layer_num=LAYERS,
    )


TEST_WEIGHTS_ID = "ucm-test/tiny-mha@test"
"""The ``ucm_weights_id`` of tests whose backends run without SGLang's server args."""


def storage_config(
    sgl: SGLang,
    extra: dict[str, Any],
    tp_rank: int = 0,
    tp_size: int = 1,
    weights_id: str | None = TEST_WEIGHTS_ID,
    **fields: Any,
) -> Any:
    """HiCacheStorageConfig as SGLang's cache controller builds it for a TP rank (its defaults:
    ``tp_lcm_size=None``, no PP/CP/DCP), with the dynamic backend's extra config. Without
    SGLang's server args a backend needs ``ucm_weights_id``: ``weights_id`` (None: leave it
    out), unless ``extra`` names one."""
    if weights_id is not None:
        extra = {"ucm_weights_id": weights_id, **extra}
    values: dict[str, Any] = {
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": False,
        "model_name": "ucm-test/tiny-mha",
        "extra_config": {
            "backend_name": "ucm",
            "module_path": "ucm.integration.sglang",
            "class_name": "UcmHiCacheStorage",
            "interface_v1": True,
            **extra,
        },
    }
    values.update(fields)
    return sgl.HiCacheStorageConfig(**values)


def create_backend(sgl: SGLang, config: Any, pool: Any) -> Any:
    """What SGLang's cache controller does on attach: the factory's dynamic path, then the host
    pool's registration."""
    backend = sgl.StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def page_keys(sgl: SGLang, pages: int, seed: int) -> list[str]:
    """SGLang's own page keys (its prefix-chained page hashes) of ``pages`` pages of seeded
    random tokens, as its cache controller computes them for a storage lookup."""
    import random

    tokens = random.Random(seed).choices(range(32000), k=pages * PAGE_TOKENS)
    keys = sgl.get_storage_hash_str(tokens, None, page_size=PAGE_TOKENS)
    assert isinstance(keys, list) and len(keys) == pages
    return keys


def fill(pool: Any, seed: int) -> None:
    """Fills the whole host pool with seeded random bytes."""
    import torch

    data = pool.kv_buffer.view(torch.uint8)
    generator = torch.Generator().manual_seed(seed)
    data.copy_(torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=generator))


def page_bytes(pool: Any, host_indices: Any, page: int) -> bytes:
    """The bytes of page ``page`` of ``host_indices`` in SGLang's flat page format."""
    import torch

    start = int(host_indices[page * pool.page_size])
    flat = pool.get_data_page(start, flat=True)
    return bytes(flat.contiguous().view(torch.uint8).numpy())
