"""How an engine's tenant key becomes a UCM namespace (every integration).

An integration's ``ucm_namespace`` setting (vLLM: ``kv_connector_extra_config["ucm_namespace"]``;
LMCache: ``extra_config["storage_plugin.ucm.namespace"]``; SGLang: ``"ucm_namespace"`` in the
storage backend's extra config) is one of:

- ``"cache_salt"`` (the default): a request's tenant key names its namespace (vLLM's per-request
  ``cache_salt``); a request without one is in the default namespace;
- ``"lora"``: the request's LoRA adapter name; a request without an adapter is in the default
  namespace;
- ``"fixed:<name>"``: every request of this engine is in namespace ``<name>``.

A tenant key that is already a valid namespace name (see :mod:`ucm.namespaces`) is used as it
is; any other (longer, or with other characters) becomes ``k-`` followed by 32 hex digits of its
BLAKE2b hash, so ``ucm namespaces`` and ``ucm purge`` name it reproducibly
(:func:`namespace_for` computes it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ConfigError, InvalidArgumentError
from ..namespaces import DEFAULT_NAMESPACE, NAME_PATTERN, check_namespace

MODES = ("cache_salt", "lora", "fixed:<name>")


def namespace_for(tenant_key: str | None) -> str:
    """The namespace of a tenant key (see the module docstring)."""
    if not tenant_key:
        return DEFAULT_NAMESPACE
    if NAME_PATTERN.fullmatch(tenant_key) is not None:
        return tenant_key
    return "k-" + hashlib.blake2b(tenant_key.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class TenantMapping:
    """One integration's mapping (the ``ucm_namespace`` setting, parsed)."""

    mode: Literal["cache_salt", "lora", "fixed"] = "cache_salt"
    fixed: str = DEFAULT_NAMESPACE

    @classmethod
    def parse(cls, value: Any, key: str) -> TenantMapping:
        """The mapping a setting names; ConfigError naming ``key``, the value and the modes."""
        if value is None or value == "cache_salt":
            return cls("cache_salt")
        if value == "lora":
            return cls("lora")
        if isinstance(value, str) and value.startswith("fixed:"):
            try:
                return cls("fixed", check_namespace(value[len("fixed:") :], key))
            except InvalidArgumentError as exc:
                raise ConfigError(str(exc)) from None
        raise ConfigError(
            f"{key}={value!r} is not valid: expected one of {', '.join(MODES)} (cache_salt: "
            "each request's cache salt names its namespace; lora: its LoRA adapter's name; "
            "fixed:<name>: every request in namespace <name>)"
        )

    def engine_namespace(self, key: str, engine: str) -> str:
        """The one namespace of an engine whose storage calls carry no per-request tenant key
        (LMCache's and SGLang's): ``fixed:<name>``'s name, else the default namespace; ``lora``
        is refused (ConfigError naming ``key``)."""
        if self.mode == "lora":
            raise ConfigError(
                f"{key}='lora' is not available with {engine}: its storage calls carry no LoRA "
                "adapter; use cache_salt (the default namespace) or fixed:<name>"
            )
        return self.fixed if self.mode == "fixed" else DEFAULT_NAMESPACE

    def namespace(self, cache_salt: str | None = None, lora_name: str | None = None) -> str:
        """The namespace of one request."""
        if self.mode == "fixed":
            return self.fixed
        name = namespace_for(cache_salt if self.mode == "cache_salt" else lora_name)
        check_namespace(name)  # registers it, so this process resolves its keys
        return name
