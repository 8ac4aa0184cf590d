"""Tier configuration: the base models every tier's pydantic model derives from, ``Size``, and
``LoadSettings``, the one model of the load path's settings.

A leaf module (of ``ucm`` it imports ``sizes``, ``codecs``' models and the generated ABI's
limits only): the tier
interface, the plugins and third-party tiers import it. The stack itself (``StackConfig``, YAML
loading, the JSON Schema) is ``ucm.stack``, above the plugins, whose tier types it dispatches on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    field_validator,
)
from pydantic_core import PydanticCustomError

from .codecs import CodecConfig, NoCodec
from .fieldtypes import Flag, Int, Seconds, SecondsOrZero
from .native import _abi
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

    namespace_bytes_refused: ClassVar[str | None] = None
    """Why this tier type takes no per-namespace byte quota (``quotas.namespaces.<name>.tiers``,
    ``quotas.others.tiers``): the stack refuses one with this reason instead of opening a tier
    that would ignore it. None: the tier takes one (``ucm.tier.NAMESPACE_BYTES_OPTION``)."""

    @property
    def label(self) -> str:
        return self.name or self.type

    def block_footprint(self, shard_size: int, shards_per_block: int) -> tuple[int, str] | None:
        """Bytes this tier stores for one whole block of the stack's geometry (uncompressed),
        and how they add up, in words: the least ``capacity`` that holds a block (the stack
        refuses a smaller one, which would evict every block it is given). None: the tier
        cannot say; the least is then one shard."""
        return None


class BreakerConfig(BaseModel):
    """A lower tier's circuit breaker (YAML ``tiers[i].breaker``; ``ucm.breaker`` runs it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    failures: Int = Field(
        default=3,
        ge=1,
        le=1_000_000,
        description="Consecutive failed or timed-out calls that open the breaker.",
    )
    probe_interval_ms: Int = Field(
        default=10_000,
        ge=1,
        le=24 * 3600 * 1000,
        description="How long an open breaker answers 'miss' before letting one probe through.",
    )


class AdmitConfig(BaseModel):
    """When a lower tier accepts a shard (YAML ``tiers[i].admit``; the Store runs it over the
    CacheBuffer's use counts, see docs/configuration.md). ``always`` (the string) is
    ``AdmitConfig()``: no condition. ``after_reuse: N``: the shard goes down once it was used N
    times in the CacheBuffer, counted node-wide (every rank and engine of the node).
    ``min_residency_ms: T``: once it stayed T milliseconds in the CacheBuffer after its dump.
    Both: once both hold."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    after_reuse: Int | None = Field(
        default=None,
        ge=1,
        le=_abi.BUFFER_REUSES_MAX,
        description="Uses (node-wide CacheBuffer hits, and waits on another rank's load of "
        "it) a shard needs before it is written to this tier.",
    )
    min_residency_ms: Int | None = Field(
        default=None,
        ge=1,
        le=24 * 3600 * 1000,
        description="Milliseconds a shard must stay in the CacheBuffer after its dump before "
        "it is written to this tier.",
    )

    @property
    def always(self) -> bool:
        """No condition: every shard is written as without ``admit:``."""
        return self.after_reuse is None and self.min_residency_ms is None

    def describe(self) -> str:
        if self.always:
            return "always"
        parts = []
        if self.after_reuse is not None:
            parts.append(f"after_reuse: {self.after_reuse}")
        if self.min_residency_ms is not None:
            parts.append(f"min_residency_ms: {self.min_residency_ms}")
        return "{" + ", ".join(parts) + "}"


ADMIT_VALID = (
    "'always', or a mapping with after_reuse: N (1..65535 uses) and/or min_residency_ms: T "
    "(1..86400000 ms)"
)


def _parse_admit(value: Any) -> Any:
    if isinstance(value, AdmitConfig):
        return value
    if isinstance(value, str):
        if value == "always":
            return AdmitConfig()
        raise PydanticCustomError(
            "admit_unknown",
            "unknown admission policy {value}; valid: {valid}",
            {"value": repr(value), "valid": ADMIT_VALID},
        )
    if not isinstance(value, Mapping) or not value:
        raise PydanticCustomError(
            "admit_invalid", "not an admission policy; valid: {valid}", {"valid": ADMIT_VALID}
        )
    return value


def _dump_admit(value: AdmitConfig) -> Any:
    """``always`` as the string, a condition as its keys: what ``admit:`` accepts back (a stack
    dumped with ``exclude_none`` must validate again)."""
    if value.always:
        return "always"
    return value.model_dump(exclude_none=True)


Admit = Annotated[
    AdmitConfig, BeforeValidator(_parse_admit), PlainSerializer(_dump_admit, return_type=Any)
]


class LowerTierConfig(TierConfig):
    """Base for tiers that can sit below the top of a stack."""

    write: WritePolicy = Field(
        default="through",
        description=(
            "through: dumps are written here asynchronously; back: written here when evicted "
            "from the tier above; none: never written by the cascade (read-only)."
        ),
    )
    promote: Flag = Field(
        default=False,
        description="Also store keys that were loaded from a tier below this one.",
    )
    codec: CodecConfig = Field(
        default_factory=NoCodec,
        description="How this tier stores the shards it writes: none, lz4, {type: zstd, level, "
        "shuffle}, or the LOSSY {type: fp8, source_dtype}. Recorded in each shard's envelope; "
        "shards written under an earlier codec stay readable (ucm.codecs).",
    )
    admit: Admit = Field(
        default_factory=AdmitConfig,
        description="Which shards this tier accepts: always (default), {after_reuse: N}: once "
        "used N times node-wide in the CacheBuffer, {min_residency_ms: T}: once they stayed T ms "
        "in the CacheBuffer, or both. Needs a buffer tier at the top of the stack.",
    )
    lookup_timeout_ms: Int = Field(
        default=1000,
        ge=1,
        le=3_600_000,
        description="Longest a look-up waits for this tier (milliseconds); past it the tier's "
        "answer is 'miss' (the engine recomputes). Bounds what a hung tier costs the engine's "
        "scheduler thread.",
    )
    breaker: BreakerConfig = Field(
        default_factory=BreakerConfig,
        description="Circuit breaker: after `failures` consecutive failed or timed-out calls "
        "the tier is skipped (look-ups and loads answer 'miss') until a probe succeeds.",
    )


BACKGROUND_READ_RATE_MIN = 1 << 20
"""Least ``background_read_bytes_per_s``: a slower cap would hold a loader thread for seconds
per shard."""


class LoadSettings(BaseModel):
    """The load path's settings: queue depths, concurrency, step size, timeouts. One model,
    valid with or without a buffer: the ``buffer`` tier's config is one (its keys of these
    names), and a stack without a buffer takes one in its ``load:`` section. The bounds are
    the native queue's limits (``constants.zig``, through the generated ``ucm.native._abi``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    load_queue_depth: Int = Field(
        default=64,
        ge=1,
        le=_abi.QUEUE_LANE_DEPTH_MAX,
        description="Load tasks queued for the dispatcher before load() blocks; prefetches "
        "have a queue of their own of the same depth.",
    )
    dump_queue_depth: Int = Field(
        default=64,
        ge=1,
        le=_abi.QUEUE_LANE_DEPTH_MAX,
        description="Dump tasks queued for the dump dispatcher before dump() blocks.",
    )
    queue_timeout_s: Seconds = Field(
        default=60.0,
        description="Longest load() blocks on a full queue before raising TimeoutError "
        "(dump(): dump_submit_timeout_s); also how long close() waits for running tasks and "
        "for the write-through backlog.",
    )
    dump_submit_timeout_s: Seconds = Field(
        default=1.0,
        description="Longest dump() blocks on a full dump queue before raising TimeoutError "
        "(the task is then not taken): the bound on an engine's save call, such as vLLM's "
        "wait_for_save.",
    )
    load_workers: Int = Field(
        default=4,
        ge=1,
        le=_abi.QUEUE_FILL_PARTS_MAX,
        description="Concurrent loads from the tiers below, per rank (loader threads; a step's "
        "keys are cut into this many batches).",
    )
    step_keys: Int = Field(
        default=1024,
        ge=1,
        le=_abi.QUEUE_STEP_KEYS_MAX,
        description="Most keys one dispatcher step claims (one batched Get).",
    )
    copy_threads: Int = Field(
        default=4,
        ge=1,
        le=_abi.QUEUE_COPY_THREADS_MAX,
        description="Native threads copying shard bytes between buffer slots and caller memory.",
    )
    rearrange: Flag = Field(
        default=True,
        description="Walk each load task in RearrangeIndex order (false: natural order, kept "
        "only to measure what the rotation buys).",
    )
    prealloc: Flag = Field(
        default=True,
        description="Prewarm (block, index + 1) of each loaded block in the dispatcher's idle "
        "window (seed 3.4; with a buffer only).",
    )
    wait_timeout_s: Seconds = Field(
        default=30.0,
        description="Longest a rank waits for another rank's load before loading it itself.",
    )
    write_queue_bytes: Size = Field(
        default=256 * 1024 * 1024,
        description="Bytes of dumped shards waiting for write-through (the backlog); a dump "
        "that finds no room within write_through_wait_s is not written through: its shards "
        "are counted in write_through_skipped and stay in the top tier only. Also the most "
        "snapshot memory a process keeps, once written, for the next dumps (freed after "
        "write_snapshot_idle_s).",
    )
    write_through_wait_s: SecondsOrZero = Field(
        default=0.0,
        description="Longest a dump waits for room in the write-through backlog before its "
        "shards skip the write-through tiers (0: never waits).",
    )
    write_snapshot_idle_s: Seconds = Field(
        default=30.0,
        description="How long the write-through writer may sit idle (seconds, at most a day) "
        "before it frees the snapshot memory it keeps for the next dumps (up to "
        "write_queue_bytes) and hands the pages back to the system.",
    )

    background_read_bytes_per_s: Size | None = Field(
        default=None,
        description="Most bytes per second that background loads (an engine's asynchronous "
        "load, a prefetch) read from the tiers below, per process (null: no cap): it leaves "
        "the tiers' bandwidth and the node's memory bus to the rest, at the cost of a longer "
        "load for the request that waits for it. Loads the engine waits on are never paced, "
        "and close() lifts the cap. At least 1MiB.",
    )

    @field_validator("background_read_bytes_per_s")
    @classmethod
    def _check_read_rate(cls, value: int | None) -> int | None:
        if value is not None and value < BACKGROUND_READ_RATE_MIN:
            raise ValueError(
                f"background_read_bytes_per_s={value} is below the least rate, "
                f"{BACKGROUND_READ_RATE_MIN} (1MiB per second); leave it null for no cap"
            )
        return value

    def load_settings(self) -> LoadSettings:
        """These settings as a plain ``LoadSettings`` (a model that extends it, such as the
        buffer tier's config, keeps only the load path's keys)."""
        if type(self) is LoadSettings:
            return self
        return LoadSettings.model_validate(self.model_dump(include=set(LoadSettings.model_fields)))


# ---------------------------------------------------------------------------------------------
# Namespace quotas (YAML ``quotas:``; the namespaces themselves are ``ucm.namespaces``).

QUOTA_BYTES_MAX = 1 << 60
"""Largest byte quota (1 EiB): anything larger is a typo, not a plan."""

SHARE_HINT = "a share of the CacheBuffer such as '40%' (0% to 100%) or a byte size such as '4GiB'"


class Share(BaseModel):
    """A part of the CacheBuffer's regular slots: a fraction of them (``'40%'``) or a byte size
    (``'4GiB'``). ``percent`` or ``bytes`` is set, never both."""

    model_config = ConfigDict(frozen=True)

    percent: float | None = None
    bytes: int | None = None

    def slots(self, slot_count_regular: int, shard_size_bytes: int) -> int:
        """Whole slots this share stands for in a buffer of ``slot_count_regular`` slots of
        ``shard_size_bytes`` (rounded down: a share never promises a slot it does not cover)."""
        if self.percent is not None:
            return int(slot_count_regular * self.percent / 100.0)
        assert self.bytes is not None
        return min(self.bytes // shard_size_bytes, slot_count_regular)

    def fraction(self, capacity_bytes: int) -> float:
        """This share as a fraction of ``capacity_bytes`` (the buffer's regular bytes)."""
        if self.percent is not None:
            return self.percent / 100.0
        assert self.bytes is not None
        return self.bytes / capacity_bytes if capacity_bytes > 0 else float("inf")

    def __str__(self) -> str:
        return f"{self.percent:g}%" if self.percent is not None else f"{self.bytes} bytes"


def _parse_share(value: object) -> Share:
    if isinstance(value, Share):
        return value
    if isinstance(value, str) and value.strip().endswith("%"):
        text = value.strip()[:-1].strip()
        try:
            percent = float(text)
        except ValueError:
            raise ValueError(f"invalid share {value!r}: expected {SHARE_HINT}") from None
        if not 0.0 <= percent <= 100.0:
            raise ValueError(f"invalid share {value!r}: a percentage must be 0% to 100%")
        return Share(percent=percent)
    if isinstance(value, float) and not isinstance(value, bool):
        raise ValueError(
            f"invalid share {value!r}: expected {SHARE_HINT} (write a fraction as a percentage)"
        )
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise ValueError(f"invalid share {value!r}: must not be negative")
    try:
        size = parse_size(value)
    except ValueError:
        raise ValueError(f"invalid share {value!r}: expected {SHARE_HINT}") from None
    return Share(bytes=_quota_bytes(size))


def _share_yaml(share: Share) -> str | int:
    if share.percent is not None:
        return f"{share.percent!r}%"
    assert share.bytes is not None
    return share.bytes


ShareValue = Annotated[Share, BeforeValidator(_parse_share), PlainSerializer(_share_yaml)]
"""A ``Share`` written as ``'40%'`` or as a byte size."""


def _quota_bytes(value: object) -> int:
    size = parse_size(value)
    if size > QUOTA_BYTES_MAX:
        raise ValueError(f"invalid size {value!r}: more than the 1 EiB limit on a quota")
    return size


QuotaBytes = Annotated[int, BeforeValidator(_quota_bytes)]
"""A lower tier's byte quota; accepts ``20GiB``-style strings, at most 1 EiB."""


class BufferQuota(BaseModel):
    """A namespace's part of the CacheBuffer (YAML ``quotas.namespaces.<name>.buffer``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    guarantee: ShareValue | None = Field(
        default=None,
        description="Slots no other namespace's inserts can take from this namespace: "
        "eviction for another namespace never pushes it below this. A share ('40%') or bytes.",
    )
    cap: ShareValue | None = Field(
        default=None,
        description="Most of the CacheBuffer this namespace holds: an insert beyond it evicts "
        "one of this namespace's own blocks. A share ('60%') or bytes.",
    )

    def slots(self, slot_count_regular: int, shard_size_bytes: int) -> tuple[int, int]:
        """(guarantee, cap) in whole slots of a buffer of ``slot_count_regular`` regular slots
        of ``shard_size_bytes``: what the native namespace table holds. No guarantee is 0
        slots; no cap is every regular slot."""
        guarantee = 0
        if self.guarantee is not None:
            guarantee = self.guarantee.slots(slot_count_regular, shard_size_bytes)
        cap = slot_count_regular
        if self.cap is not None:
            cap = self.cap.slots(slot_count_regular, shard_size_bytes)
        # Rounding a byte cap and a percent guarantee to slots may cross by one slot.
        return guarantee, max(cap, guarantee)


class NamespaceQuota(BaseModel):
    """One namespace's quotas: its part of the CacheBuffer and its bytes on lower tiers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    buffer: BufferQuota = Field(
        default_factory=BufferQuota, description="Guarantee and cap in the CacheBuffer."
    )
    tiers: dict[str, QuotaBytes] = Field(
        default_factory=dict,
        description="Most bytes this namespace holds on each lower tier, by tier label "
        "(its `name`, else its type); the oldest of its blocks there go first.",
    )


class QuotasConfig(BaseModel):
    """YAML ``quotas:``: per named namespace, and ``others`` for every namespace not named
    (each of them on its own). Checked against the stack (tier labels, the buffer's capacity)
    by ``ucm.stack``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespaces: dict[str, NamespaceQuota] = Field(
        default_factory=dict, description="Quotas of named namespaces ('default' included)."
    )
    others: NamespaceQuota = Field(
        default_factory=NamespaceQuota,
        description="Quotas of each namespace not named under `namespaces` (a cap and tier "
        "bytes; a guarantee must name its namespace).",
    )

    def for_namespace(self, namespace: str) -> NamespaceQuota:
        """The quotas that apply to ``namespace``: its own, else ``others``."""
        return self.namespaces.get(namespace, self.others)
