"""The plugin manager: built-in tiers, entry-point plugins, and the tier-type registry."""

from __future__ import annotations

import importlib
import importlib.metadata
import typing
from typing import Any

import pluggy

from . import hookspecs
from .config import TierConfig
from .errors import PluginError
from .tier import Tier

ENTRY_POINT_GROUP = "ucm.backends"
DEFAULT_PLUGINS = (
    "ucm.buffer",  # the CacheBuffer: part of the core package, registered like the others
    "ucm_backends.posix",
    "ucm_backends.fsspec_tier",
    "ucm_backends.mooncake",  # imports mooncake.store only when a mooncake tier opens
)

pm = pluggy.PluginManager("ucm")
pm.add_hookspecs(hookspecs)

_loaded = False


def load_plugins() -> None:
    """Registers the built-in tiers and every ``ucm.backends`` entry point, once."""
    global _loaded
    if _loaded:
        return
    for module_name in DEFAULT_PLUGINS:
        if pm.has_plugin(module_name):  # registered by an earlier, failed call
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise PluginError(f"built-in plugin {module_name!r} failed to import: {exc}") from exc
        pm.register(module, name=module_name)
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if pm.has_plugin(entry_point.name):
            continue
        origin = entry_point.dist.name if entry_point.dist is not None else "unknown distribution"
        try:
            plugin = entry_point.load()
        except Exception as exc:
            raise PluginError(
                f"plugin {entry_point.name!r} ({entry_point.value}, from {origin}) failed to "
                f"load: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            pm.register(plugin, name=entry_point.name)
            pm.check_pending()  # a hookimpl with a misspelled name would never be called
        except pluggy.PluginValidationError as exc:
            if pm.is_registered(plugin):
                pm.unregister(plugin)
            raise PluginError(
                f"plugin {entry_point.name!r} ({entry_point.value}, from {origin}) is "
                f"invalid: {exc}"
            ) from exc
    _loaded = True  # only now: a failed load is reported again, not skipped silently


def tier_types() -> dict[str, Any]:
    """``{type_name: TierClass}`` of every installed tier type."""
    load_plugins()
    found: dict[str, type[Tier]] = {}
    # Registration order (built-ins first), so a duplicate type always blames the later plugin.
    for name, plugin in pm.list_name_plugin():
        if plugin is None or not hasattr(plugin, "register_tiers"):
            continue

        def register(tier_class: type[Tier], _plugin: str = name) -> None:
            _check_tier_class(tier_class, _plugin)
            if tier_class.type_name in found and found[tier_class.type_name] is not tier_class:
                raise PluginError(
                    f"plugin {_plugin!r} registers tier type {tier_class.type_name!r}, which "
                    f"{found[tier_class.type_name].__module__} already registered"
                )
            found[tier_class.type_name] = tier_class

        try:
            plugin.register_tiers(register=register)
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(
                f"plugin {name!r} failed in register_tiers: {type(exc).__name__}: {exc}"
            ) from exc
    return found


def _check_tier_class(tier_class: Any, plugin: str) -> None:
    if not (isinstance(tier_class, type) and issubclass(tier_class, Tier)):
        raise PluginError(f"plugin {plugin!r} registered {tier_class!r}, which is not a ucm.Tier")
    type_name = getattr(tier_class, "type_name", None)
    model = getattr(tier_class, "config_model", None)
    if not isinstance(type_name, str) or not type_name:
        raise PluginError(f"plugin {plugin!r}: {tier_class.__name__}.type_name must be a str")
    if not (isinstance(model, type) and issubclass(model, TierConfig)):
        raise PluginError(
            f"plugin {plugin!r}: {tier_class.__name__}.config_model must subclass ucm.TierConfig"
        )
    annotation = model.model_fields["type"].annotation
    if typing.get_args(annotation) != (type_name,):
        raise PluginError(
            f"plugin {plugin!r}: {model.__name__}.type must be Literal[{type_name!r}], "
            f"got {annotation!r}"
        )
