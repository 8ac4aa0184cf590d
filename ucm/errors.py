"""The exception hierarchy. Every error UCM raises on purpose derives from :class:`UcmError`."""

from __future__ import annotations

from collections.abc import Mapping


class UcmError(Exception):
    """Base class of every error raised by UCM."""


class ConfigError(UcmError, ValueError):
    """A stack configuration is invalid. The message names the YAML path of each problem."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]


class PluginError(UcmError):
    """A plugin failed to import or to register its tiers. The message names the plugin."""


class InvalidArgumentError(UcmError, ValueError):
    """A public call got a bad argument. The message names the argument, the value and what
    would be valid; nothing was touched."""


class RoleError(InvalidArgumentError):
    """The call is not allowed for this rank's role (e.g. load/dump on a scheduler)."""


class NativeLibraryError(UcmError, ImportError):
    """The native core (libucm_core.so) is missing or does not match this package."""


class StoreClosedError(UcmError):
    """The store was used after close()."""


class TierError(UcmError):
    """A tier failed an operation on one key (I/O error, corrupt data, endpoint down)."""


class KeyMissingError(TierError):
    """The key is not present in the tier (a miss, not a failure)."""


class NoBufferSlotError(TierError):
    """Every slot of the buffer is in use: a dump could not place the shard there."""


class BufferLockTimeoutError(TierError):
    """A bucket lock of the buffer stayed held by a live process past the lock timeout: the
    key could not be claimed there (a dump then writes it straight to the tiers below)."""


class LookupUnansweredError(TierError):
    """A look-up that must be exact (``Store.lookup(..., exact=True)``) reached a tier that did
    not answer: past its ``lookup_timeout_ms``, with its breaker open, or failing. Whether the
    keys are there is unknown (a bounded look-up would have answered "absent")."""


class TaskError(UcmError):
    """A load or dump task finished with failed keys. ``failures`` maps each failed key
    ``(block_id, shard_index)`` to the cause."""

    def __init__(self, failures: Mapping[tuple[bytes, int], BaseException | str]) -> None:
        self.failures: dict[tuple[bytes, int], BaseException | str] = dict(failures)
        lines = [
            f"block {block_id.hex()} shard {shard}: {_describe(cause)}"
            for (block_id, shard), cause in sorted(self.failures.items())
        ]
        shown = "; ".join(lines[:8])
        more = f" (and {len(lines) - 8} more)" if len(lines) > 8 else ""
        super().__init__(f"{len(lines)} key(s) failed: {shown}{more}")


def _describe(cause: BaseException | str) -> str:
    if isinstance(cause, str):
        return cause
    return f"{type(cause).__name__}: {cause}"
