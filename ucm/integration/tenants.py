"""How an engine's tenant key becomes a UCM namespace (every integration).

An integration's ``ucm_namespace`` setting (vLLM: ``kv_connector_extra_config["ucm_namespace"]``;
LMCache: ``extra_config["storage_plugin.ucm.namespace"]``; SGLang: ``"ucm_namespace"`` in the
storage backend's extra config) is one of:

- ``"cache_salt"`` (the default): a request's tenant key derives its namespace (vLLM's per-request
  ``cache_salt``; LMCache's request tag ``cache_salt``, that is ``lmcache.tag.cache_salt`` in a
  request's ``kv_transfer_params``); a request without one is in the default namespace;
- ``"lora"``: the request's LoRA adapter name; a request without an adapter is in the default
  namespace;
- ``"tag:<name>"`` (LMCache only): the request tag ``<name>`` (``lmcache.tag.<name>``);
- ``"fixed:<name>"``: every request of this engine is in namespace ``<name>``.

Which modes an integration offers depends on what reaches its storage calls: vLLM's connector
sees each request (all modes); LMCache's storage plugin sees each chunk's ``CacheEngineKey``,
whose request tags carry a tenant key but no LoRA adapter (``cache_salt``, ``tag:<name>``,
``fixed:<name>``); SGLang's HiCache backend sees page hashes only (``fixed:<name>``; left out,
the default namespace). A mode an integration cannot honour is refused by name, with the reason.

Every tenant key becomes ``k-`` followed by 32 hex digits of its BLAKE2b hash (a *derived*
name), whatever it looks like, so ``ucm namespaces`` and ``ucm purge`` name it reproducibly
(:func:`namespace_for` computes it). A configured name (``fixed:<name>``) may not take that form.
So derived and configured names are disjoint: a request whose ``cache_salt`` is ``"default"`` or
``"tenant-a"`` never lands in the configured namespace of that name.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import ConfigError, InvalidArgumentError
from ..namespaces import DEFAULT_NAMESPACE, check_namespace

MODES = ("cache_salt", "lora", "fixed:<name>")
"""The modes of every integration (vLLM's)."""

TAG_MODE = "tag:<name>"
"""The mode of integrations whose requests carry named tags (LMCache's request tags)."""

CACHE_SALT_TAG = "cache_salt"
"""The request tag that ``cache_salt`` mode reads where tenant keys are tags (LMCache:
``lmcache.tag.cache_salt``)."""


DERIVED_PATTERN = re.compile(r"k-[0-9a-f]{32}")
"""The form of every name derived from a tenant key, and of no configured name."""


def namespace_for(tenant_key: str | None) -> str:
    """The namespace of a tenant key: the default without one, else its derived name (see the
    module docstring)."""
    if not tenant_key:
        return DEFAULT_NAMESPACE
    return "k-" + hashlib.blake2b(tenant_key.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class TenantMapping:
    """One integration's mapping (the ``ucm_namespace`` setting, parsed)."""

    mode: Literal["cache_salt", "lora", "tag", "fixed"] = "cache_salt"
    fixed: str = DEFAULT_NAMESPACE
    tag: str = ""
    """``tag:<name>``'s tag name."""
    stated: bool = field(default=True, compare=False)
    """False when the setting was left out (then ``cache_salt``, the default)."""

    @classmethod
    def parse(cls, value: Any, key: str, *, tags: bool = False) -> TenantMapping:
        """The mapping a setting names; ConfigError naming ``key``, the value and the modes.
        ``tags``: the integration's requests carry named tags, so ``tag:<name>`` is a mode."""
        if value is None:
            return cls("cache_salt", stated=False)
        if value == "cache_salt":
            return cls("cache_salt")
        if value == "lora":
            return cls("lora")
        if isinstance(value, str) and value.startswith("fixed:"):
            try:
                name = check_namespace(value[len("fixed:") :], key)
            except InvalidArgumentError as exc:
                raise ConfigError(str(exc)) from None
            if DERIVED_PATTERN.fullmatch(name) is not None:
                raise ConfigError(
                    f"{key}={value!r}: names of the form k-<32 hex digits> are the namespaces "
                    "derived from tenant keys (cache_salt, LoRA names, request tags); a "
                    "configured namespace must not take that form, so that no tenant key can "
                    "land in it"
                )
            return cls("fixed", name)
        if tags and isinstance(value, str) and value.startswith("tag:"):
            name = value[len("tag:") :]
            if not name or name != name.strip():
                raise ConfigError(
                    f"{key}={value!r}: tag:<name> needs the name of a request tag (the <name> of "
                    "lmcache.tag.<name>), without surrounding spaces"
                )
            return cls("tag", tag=name)
        modes = (*MODES[:2], TAG_MODE, MODES[2]) if tags else MODES
        tag_help = "; tag:<name>: the request tag <name>" if tags else ""
        raise ConfigError(
            f"{key}={value!r} is not valid: expected one of {', '.join(modes)} (cache_salt: "
            "each request's cache salt names its namespace; lora: its LoRA adapter's name"
            f"{tag_help}; fixed:<name>: every request in namespace <name>)"
        )

    def engine_namespace(self, key: str, engine: str, why: str) -> str:
        """The one namespace of an engine whose storage calls carry no per-request tenant key
        (SGLang's): ``fixed:<name>``'s name, else (the setting left out) the default namespace.
        A per-request mode that is stated (``cache_salt``, ``lora``) is refused: ConfigError
        naming ``key`` and the mode, saying ``why`` no tenant key reaches ``engine``."""
        if self.mode == "fixed":
            return self.fixed
        if not self.stated:
            return DEFAULT_NAMESPACE
        raise ConfigError(
            f"{key}={self.mode!r} is not available with {engine}: {why}. Use fixed:<name> (one "
            "namespace for the whole engine), or leave the setting out (the default namespace)"
        )

    @property
    def tag_name(self) -> str | None:
        """The request tag naming a request's namespace (``cache_salt`` mode reads the tag
        ``cache_salt``), for integrations whose tenant keys are tags; None for lora and fixed."""
        if self.mode == "tag":
            return self.tag
        return CACHE_SALT_TAG if self.mode == "cache_salt" else None

    def namespace(self, cache_salt: str | None = None, lora_name: str | None = None) -> str:
        """The namespace of one request (its tenant key is ``cache_salt``, its tag's value in
        ``tag`` mode)."""
        if self.mode == "fixed":
            return self.fixed
        name = namespace_for(lora_name if self.mode == "lora" else cache_salt)
        check_namespace(name)  # registers it, so this process resolves its keys
        return name
