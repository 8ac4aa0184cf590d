"""What an engine's configuration says about its KV bytes, as key-space fields (no engine import).

A block id must change whenever the KV bytes for the same tokens can change. The tokens, the
model path and the tensor layout are not enough; these functions turn the rest into the
``extra`` fields of a :class:`~ucm.integration.keys.KeySpace`:

- :func:`weights_fingerprint`: *which weights* a model path holds. A local directory is named by
  the names, sizes and modification times (ns) of its weight files and the bytes of its small
  JSON files (``config.json``, the safetensors index, quantization configs: per-checkpoint KV
  scales live in the weights or there), so a checkpoint overwritten in place gets new ids. A Hub
  id is named by the commit its revision resolves to in the local Hugging Face cache (the engine
  downloads it there before UCM starts), so an unpinned model that moves gets new ids. An
  operator who copies one checkpoint to several nodes without keeping modification times states
  ``weights_id`` instead (the integration's ``ucm_weights_id`` key), and is then responsible for
  changing it with the weights.
- :func:`vllm_fields`: a vLLM engine's resolved model config (every ``hf_overrides`` / rope /
  sliding-window change shows in it), the model dtype, quantization, KV-cache dtype and
  KV-scale settings, and the weights.
- :func:`lora_fingerprint`: a LoRA adapter's identity (its path and the fingerprint of its files),
  not its name, which a server may reuse for other weights.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
"""Files whose size and modification time name a checkpoint's weights."""

SMALL_FILE_BYTES = 1 << 20
"""JSON files up to this size are hashed whole (configs, indexes, quantization configs)."""

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_commit_hash", "_name_or_path"})
"""Keys of a resolved HF config that do not change the KV (the path is salted on its own)."""


def weights_fingerprint(model: str, revision: str | None = None) -> str:
    """A digest naming the weights ``model`` (a local directory or a Hub id) holds now."""
    path = Path(model).expanduser()
    if path.is_dir():
        return "dir:" + _directory_digest(path)
    if path.is_file():  # e.g. a single GGUF file
        stat = path.stat()
        return f"file:{stat.st_size}:{stat.st_mtime_ns}"
    return "hub:" + _hub_commit(model, revision)


def lora_fingerprint(name: str, path: str | None) -> str:
    """A LoRA adapter's identity: its path and the fingerprint of its files (the name alone may
    be reused for other weights)."""
    if not path:
        return f"name:{name}"
    return f"path:{path}:{weights_fingerprint(path)}"


def lora_identity(lora_request: Any) -> str | None:
    """:func:`lora_fingerprint` of a vLLM ``LoRARequest`` (None without one): a listing of the
    adapter's directory per new request, so an adapter replaced in place gets new ids."""
    if lora_request is None:
        return None
    name = str(getattr(lora_request, "lora_name", ""))
    path = str(getattr(lora_request, "lora_path", "") or "")
    return lora_fingerprint(name, path)


def config_digest(value: Any) -> str:
    """A stable digest of a config value (a dict, a transformers config, a list...)."""
    if hasattr(value, "to_dict") and callable(value.to_dict):
        value = value.to_dict()
    if isinstance(value, Mapping):
        value = {k: v for k, v in value.items() if k not in _VOLATILE_CONFIG_KEYS}
    encoded = json.dumps(value, sort_keys=True, separators=(",", ":"), default=_json_default)
    return hashlib.blake2b(encoded.encode(), digest_size=16).hexdigest()


def vllm_fields(vllm_config: Any, weights_id: str | None = None) -> tuple[tuple[str, str], ...]:
    """The key-space fields of a vLLM engine beyond its layout (see the module docstring)."""
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    overrides = model_config.hf_overrides
    if callable(overrides):
        overrides = f"callable:{getattr(overrides, '__module__', '')}." + getattr(
            overrides, "__qualname__", repr(overrides)
        )
    weights = weights_id or weights_fingerprint(
        str(model_config.model), model_config.revision or None
    )
    fields = {
        "revision": str(model_config.revision or ""),
        "weights": weights,
        "hf_config": config_digest(model_config.hf_config),
        "hf_overrides": config_digest(overrides),
        "model_dtype": str(model_config.dtype),
        "quantization": str(model_config.quantization or ""),
        "kv_cache_dtype": str(cache_config.cache_dtype),
        "kv_cache_dtype_skip_layers": ",".join(
            getattr(cache_config, "kv_cache_dtype_skip_layers", []) or []
        ),
        "calculate_kv_scales": str(getattr(cache_config, "calculate_kv_scales", "")),
    }
    return tuple(sorted(fields.items()))


def _json_default(value: Any) -> Any:
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return value.to_dict()
    return repr(value)


def _directory_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for entry in sorted(path.iterdir(), key=lambda p: p.name):
        if not entry.is_file():
            continue
        stat = entry.stat()
        if entry.name.endswith(WEIGHT_SUFFIXES):
            digest.update(f"w\0{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        elif entry.name.endswith(".json") and stat.st_size <= SMALL_FILE_BYTES:
            digest.update(f"j\0{entry.name}\0".encode())
            digest.update(entry.read_bytes())
    return digest.hexdigest()


def _hub_commit(model: str, revision: str | None) -> str:
    """The commit ``revision`` of Hub model ``model`` resolves to in the local HF cache."""
    if revision and _COMMIT.match(revision):
        return revision
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - every engine installs huggingface_hub
        return f"unresolved:{model}@{revision or 'main'}"
    folder = "models--" + model.replace("/", "--")
    ref = Path(constants.HF_HUB_CACHE) / folder / "refs" / (revision or "main")
    try:
        return ref.read_text().strip()
    except OSError:
        return f"unresolved:{model}@{revision or 'main'}"


__all__ = [
    "SMALL_FILE_BYTES",
    "WEIGHT_SUFFIXES",
    "config_digest",
    "lora_fingerprint",
    "lora_identity",
    "vllm_fields",
    "weights_fingerprint",
]
