"""Plugin hook specifications (pluggy project name ``ucm``).

Third-party packages expose a module with ``@ucm.hookimpl`` functions under the entry-point
group ``ucm.backends``; UCM's own tiers in ``ucm_backends`` use the very same hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .tier import Tier

hookspec = pluggy.HookspecMarker("ucm")
hookimpl = pluggy.HookimplMarker("ucm")


@hookspec
def register_tiers(register: Callable[[type[Tier]], None]) -> None:
    """Register tier types: call ``register(TierClass)`` once per class. The class names its
    ``type_name`` (the YAML ``type:``) and its pydantic ``config_model``."""
