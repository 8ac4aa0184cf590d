"""UCM: a layered, cascading cache for LLM KV-cache blocks.

``import ucm`` is cheap: torch and the native core are imported only when first needed.
"""

from __future__ import annotations

from .config import LowerTierConfig, TierConfig
from .errors import (
    ConfigError,
    InvalidArgumentError,
    KeyMissingError,
    LookupUnansweredError,
    NativeLibraryError,
    PluginError,
    RoleError,
    StoreClosedError,
    TaskError,
    TierError,
    UcmError,
)
from .hookspecs import hookimpl
from .layout import Key, Layout
from .namespaces import DEFAULT_NAMESPACE
from .stack import StackConfig, load_stack
from .store import Pin, Store, open_store
from .task import Task
from .tier import REMOVE_CHUNK_KEYS, Tier, TierContext

open = open_store

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_NAMESPACE",
    "REMOVE_CHUNK_KEYS",
    "ConfigError",
    "InvalidArgumentError",
    "Key",
    "KeyMissingError",
    "Layout",
    "LookupUnansweredError",
    "LowerTierConfig",
    "NativeLibraryError",
    "Pin",
    "PluginError",
    "RoleError",
    "StackConfig",
    "Store",
    "StoreClosedError",
    "Task",
    "TaskError",
    "Tier",
    "TierConfig",
    "TierContext",
    "TierError",
    "UcmError",
    "__version__",
    "hookimpl",
    "load_stack",
    "open",
]
