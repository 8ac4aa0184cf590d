"""Number and flag types of the stack's settings, shared by every config model (``ucm.config``,
``ucm.codecs``, the tiers' models): pydantic's lax ``int`` and ``float`` take ``true`` as 1 and
its lax ``bool`` takes ``0``, ``'yes'`` or ``'off'``, so a YAML slip would pass unnoticed.
A leaf module (it imports nothing of ``ucm``)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError("number_not_bool", "expected a number, not a boolean")
    return value


def _only_bool(value: Any) -> Any:
    if not isinstance(value, bool):
        raise PydanticCustomError("flag_not_bool", "expected true or false")
    return value


Int = Annotated[int, BeforeValidator(_not_bool)]
"""An integer setting: ``true``/``false`` refused (an integer-valued float or string still
converts, as pydantic's lax ``int`` does)."""

Flag = Annotated[bool, BeforeValidator(_only_bool)]
"""A boolean setting: ``true`` or ``false`` only (not ``0``, ``1``, ``'yes'``, ``'off'``)."""

SECONDS_MAX = 86_400.0
"""Longest duration a seconds setting takes (a day): the native side counts time in u64
nanoseconds, and a longer timeout is a typo or a stand-in for "forever", which no setting
means."""

Seconds = Annotated[
    float, Field(gt=0, le=SECONDS_MAX, allow_inf_nan=False), BeforeValidator(_not_bool)
]
"""A duration in seconds: a number (``5`` or ``0.5``, not a boolean), finite, more than 0, at
most ``SECONDS_MAX`` (a day)."""

SecondsOrZero = Annotated[
    float, Field(ge=0, le=SECONDS_MAX, allow_inf_nan=False), BeforeValidator(_not_bool)
]
"""A duration in seconds that may be 0: as ``Seconds`` otherwise."""
