"""Tier configuration: the base models every tier's pydantic model derives from, and ``Size``.

A leaf module (of ``ucm`` it imports ``sizes`` only): the tier interface,
the plugins and third-party tiers import it. The stack itself (``StackConfig``, YAML loading,
the JSON Schema) is ``ucm.stack``, above the plugins, whose tier types it dispatches on.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
)

from .sizes import parse_size

Size = Annotated[int, BeforeValidator(parse_size), Field(ge=0)]
"""A byte count; accepts ``8GiB``-style strings."""

WritePolicy = Literal["through", "back", "none"]


class TierConfig(BaseModel):
    """Base of every tier model. Subclasses narrow ``type`` to a ``Literal`` of their name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str
    name: str | None = Field(
        default=None, description="Label used in stats and errors (defaults to the type)."
    )

    @property
    def label(self) -> str:
        return self.name or self.type


class LowerTierConfig(TierConfig):
    """Base for tiers that can sit below the top of a stack."""

    write: WritePolicy = Field(
        default="through",
        description=(
            "through: dumps are written here asynchronously; back: written here when evicted "
            "from the tier above; none: never written by the cascade (read-only)."
        ),
    )
    promote: bool = Field(
        default=False,
        description="Also store keys that were loaded from a tier below this one.",
    )
