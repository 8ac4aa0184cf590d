"""Stack configuration: ``StackConfig``, YAML loading, the JSON Schema, errors that name the
YAML path.

A stack is ``unique_id`` + shard geometry + an optional ``buffer:`` section (the node-wide
CacheBuffer, the core's own tier, typed ``BufferTierConfig``) + an ordered list of tiers (top
first). The buffer may also be written as the first tier (``tiers[0].type: buffer``); either
way ``StackConfig.buffer`` holds it and ``StackConfig.tiers`` lists it first, so the two views
agree (``buffer is tiers[0]``). Each tier type
has its own model (``extra="forbid"``, derived from ``ucm.config.TierConfig``) selected by its
``type`` field; plugin tiers join through the ``register_tiers`` hook, so the set of valid types
is whatever is installed. This module sits above ``ucm.plugins`` (it asks it for the installed
types); ``ucm.config`` is the leaf below both.
"""

from __future__ import annotations

import os
import reprlib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .buffer import BufferTierConfig
from .config import AdmitConfig, LoadSettings, QuotasConfig, Share, Size, TierConfig
from .errors import ConfigError
from .fieldtypes import Int
from .namespaces import NAME_PATTERN, NAME_RULE
from .native import _abi
from .plugins import tier_types


def _dispatch_tier(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    if isinstance(value, TierConfig):
        return value
    if not isinstance(value, Mapping):
        raise PydanticCustomError("tier_not_mapping", "a tier must be a mapping with a 'type' key")
    installed = tier_types()
    type_name = value.get("type")
    if type_name is None:
        raise PydanticCustomError(
            "tier_type_missing",
            "missing 'type'; installed tier types: {installed}",
            {"installed": ", ".join(sorted(installed))},
        )
    tier_class = installed.get(type_name) if isinstance(type_name, str) else None
    if tier_class is None:
        raise PydanticCustomError(
            "tier_type_unknown",
            "unknown tier type {type}; installed tier types: {installed}",
            {"type": repr(type_name), "installed": ", ".join(sorted(installed))},
        )
    return tier_class.config_model.model_validate(dict(value))


TierEntry = Annotated[SerializeAsAny[TierConfig], WrapValidator(_dispatch_tier)]


class StackConfig(BaseModel):
    """A tier stack. ``shard_size`` or ``tensor_size_list`` gives the shard geometry."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    unique_id: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="Names the node-wide shared segments: one CacheBuffer per unique_id.",
    )
    shard_size: Size | None = Field(default=None, description="Bytes per shard.")
    tensor_size_list: list[Annotated[Int, Field(gt=0)]] | None = Field(
        default=None, description="Byte sizes of the tensors a shard is made of, in order."
    )
    shards_per_block: Int = Field(gt=0, description="Shards (e.g. TP ranks) per block.")
    buffer: BufferTierConfig | None = Field(
        default=None,
        exclude=True,  # serialized as tiers[0], the one place a re-parse reads it from
        description="The node-wide CacheBuffer (shared host memory above every tier). Also "
        "accepted as the first tier, `tiers[0].type: buffer`; give it one way, not both.",
    )
    tiers: list[TierEntry] = Field(
        default_factory=list,
        description="Tiers, fastest first (the buffer first when it is written as a tier).",
    )
    load: LoadSettings | None = Field(
        default=None,
        description="The load path's settings (queue depths, load_workers, step_keys, ...) of "
        "a stack without a buffer tier; with one, they are keys of the buffer tier.",
    )
    quotas: QuotasConfig | None = Field(
        default=None,
        description="Per-namespace quotas: a guarantee and a cap in the CacheBuffer, bytes on "
        "each lower tier; `others` for every namespace not named (docs/namespaces.md).",
    )

    @model_validator(mode="after")
    def _check_geometry(self) -> StackConfig:
        if self.shard_size is None and self.tensor_size_list is None:
            raise PydanticCustomError(
                "geometry_missing", "give shard_size (bytes per shard) or tensor_size_list"
            )
        if self.tensor_size_list is not None:
            if len(self.tensor_size_list) == 0:
                raise PydanticCustomError(
                    "geometry_empty", "tensor_size_list must list at least one tensor size"
                )
            total = sum(self.tensor_size_list)
            if self.shard_size is not None and self.shard_size != total:
                raise PydanticCustomError(
                    "geometry_mismatch",
                    "shard_size {shard_size} differs from sum(tensor_size_list) = {total}",
                    {"shard_size": self.shard_size, "total": total},
                )
        elif self.shard_size == 0:
            raise PydanticCustomError("geometry_zero", "shard_size must be at least 1 byte")
        in_section = self.buffer is not None
        self._place_buffer()
        self._check_admission(1 if in_section else 0)
        self._check_capacities(1 if in_section else 0)
        if self.load is not None and self.buffer is not None:
            raise PydanticCustomError(
                "load_with_buffer",
                "load: a stack with a buffer tier takes the load path's settings as keys of the "
                "buffer (its buffer section or tiers[0]); remove the load section or move its "
                "keys there",
            )
        if self.quotas is not None:
            self._check_quotas(self.quotas)
        return self

    def _check_quotas(self, quotas: QuotasConfig) -> None:
        """Cross-checks ``quotas:`` against the stack: valid names, a buffer for buffer quotas,
        shares within the buffer's capacity, guarantees within caps and within 100% in all,
        tier labels naming exactly one lower tier."""
        for name in quotas.namespaces:
            if NAME_PATTERN.fullmatch(name) is None:
                raise _located(
                    f"quotas.namespaces.{name}",
                    f"not a valid namespace name: expected {NAME_RULE}",
                    name,
                )
        if quotas.others.buffer.guarantee is not None:
            raise _located(
                "quotas.others.buffer.guarantee",
                "a guarantee is given per named namespace (any number of namespaces may be "
                "unnamed, so theirs could not add up); name the namespace under "
                "quotas.namespaces",
                str(quotas.others.buffer.guarantee),
            )
        entries = [(f"quotas.namespaces.{name}", q) for name, q in quotas.namespaces.items()]
        entries.append(("quotas.others", quotas.others))
        capacity = self.buffer.capacity if self.buffer is not None else 0
        guaranteed: list[tuple[str, Share]] = []
        for path, quota in entries:
            guarantee, cap = quota.buffer.guarantee, quota.buffer.cap
            for key, share in (("guarantee", guarantee), ("cap", cap)):
                if share is None:
                    continue
                if self.buffer is None:
                    raise _located(
                        f"{path}.buffer.{key}",
                        "this stack has no buffer tier: a CacheBuffer quota needs one",
                        str(share),
                    )
                if share.bytes is not None and share.bytes > capacity:
                    raise _located(
                        f"{path}.buffer.{key}",
                        f"{share.bytes} bytes is more than the CacheBuffer's capacity "
                        f"({capacity} bytes); give at most the capacity or a share such as '50%'",
                        share.bytes,
                    )
            if (
                guarantee is not None
                and cap is not None
                and guarantee.fraction(capacity) > cap.fraction(capacity)
            ):
                raise _located(
                    f"{path}.buffer.guarantee",
                    f"the guarantee ({guarantee}) is more than the cap ({cap})",
                    str(guarantee),
                )
            if guarantee is not None:
                guaranteed.append((path.rsplit(".", 1)[1], guarantee))
            self._check_tier_quotas(path, quota.tiers)
        total = sum(share.fraction(capacity) for _, share in guaranteed)
        if total > 1.0 + 1e-9:
            parts = ", ".join(f"{name} {share}" for name, share in guaranteed)
            raise _located(
                "quotas.namespaces",
                f"the CacheBuffer guarantees add up to {total * 100:g}% ({parts}); they may "
                "add up to 100% at most",
                {name: str(share) for name, share in guaranteed},
            )

    def _check_tier_quotas(self, path: str, tiers: Mapping[str, int]) -> None:
        lower = [tier.label for tier in self.tiers if tier is not self.buffer]
        for label in tiers:
            where = f"{path}.tiers.{label}"
            if self.buffer is not None and label == self.buffer.label:
                raise _located(
                    where,
                    "the CacheBuffer's quota is the namespace's `buffer:` (guarantee, cap), "
                    "not bytes under tiers",
                    label,
                )
            matches = lower.count(label)
            if matches == 0:
                known = ", ".join(lower) if lower else "none"
                raise _located(
                    where,
                    f"unknown tier {label!r}; the lower tiers of this stack are: {known} "
                    "(a tier's label is its `name`, else its type)",
                    label,
                )
            if matches > 1:
                raise _located(
                    where,
                    f"{matches} tiers are labelled {label!r}; give them distinct `name`s",
                    label,
                )
            tier = next(tier for tier in self.tiers if tier.label == label)
            refused = type(tier).namespace_bytes_refused
            if refused is not None:
                raise _located(
                    where,
                    f"the {tier.type} tier {label!r} takes no per-namespace byte quota: {refused}",
                    tiers[label],
                )
            tier_capacity = getattr(tier, "capacity", None)
            if isinstance(tier_capacity, int) and tiers[label] > tier_capacity:
                raise _located(
                    where,
                    f"{tiers[label]} bytes is more than the tier's capacity ({tier_capacity} "
                    "bytes)",
                    tiers[label],
                )

    def _place_buffer(self) -> None:
        """One buffer, first: the ``buffer:`` section or ``tiers[0]``, never both, never lower.
        Both views are then set (``buffer is tiers[0]``)."""
        in_section = self.buffer is not None
        for position, tier in enumerate(self.tiers):
            if not isinstance(tier, BufferTierConfig):
                continue
            if self.buffer is not None:
                where = "the buffer section" if in_section else "tiers[0]"
                raise _located(
                    f"tiers[{position}].type",
                    f"a stack has one buffer, already given as {where}; remove this tier",
                    tier.type,
                )
            if position > 0:
                raise _located(
                    f"tiers[{position}].type",
                    "the buffer tier must be the first tier (the node-wide host-memory cache sits "
                    "above every other tier); move it to tiers[0] or to the buffer section",
                    tier.type,
                )
            object.__setattr__(self, "buffer", tier)
        if self.buffer is not None and (not self.tiers or self.tiers[0] is not self.buffer):
            object.__setattr__(self, "tiers", [self.buffer, *self.tiers])
        if not self.tiers:
            raise _located("tiers", "give a buffer section or at least one tier", self.tiers)

    def _check_capacities(self, offset: int) -> None:
        """A lower tier's ``capacity`` must hold one block (``TierConfig.block_footprint``;
        one shard where the tier cannot say): a smaller one evicts every block it is given, so
        every dump would succeed and store nothing."""
        shard_size, spb = self.resolved_shard_size, self.shards_per_block
        for position, tier in enumerate(self.tiers):
            capacity = getattr(tier, "capacity", None)
            if tier is self.buffer or not isinstance(capacity, int):
                continue
            footprint = tier.block_footprint(shard_size, spb)
            least, held = footprint or (shard_size, f"one shard of {shard_size} bytes")
            if capacity < least:
                raise _located(
                    f"tiers[{position - offset}].capacity",
                    f"{capacity} bytes cannot hold one block, which this {tier.type} tier "
                    f"stores in {least} bytes ({held}); give at least {least} bytes, or no "
                    "capacity for no bound",
                    capacity,
                )

    def _check_admission(self, offset: int) -> None:
        """``admit:`` conditions need the CacheBuffer (it counts the uses) and a tier the
        cascade writes; at most ``BUFFER_ADMISSION_TIERS_MAX`` gated tiers (bits per slot)."""
        gated = 0
        for position, tier in enumerate(self.tiers):
            rule = getattr(tier, "admit", None)
            if not isinstance(rule, AdmitConfig) or rule.always:
                continue
            where = f"tiers[{position - offset}].admit"  # the YAML's index
            if self.buffer is None:
                raise _located(
                    where,
                    "admission counts uses in the CacheBuffer: give the stack a buffer tier "
                    "(the buffer section or tiers[0]), or use admit: always",
                    rule.describe(),
                )
            if getattr(tier, "write", None) == "none":
                raise _located(
                    where,
                    "a `write: none` tier is never written by the cascade, so there is nothing "
                    "to admit; use write: through or write: back, or admit: always",
                    rule.describe(),
                )
            gated += 1
            if gated > _abi.BUFFER_ADMISSION_TIERS_MAX:
                raise _located(
                    where,
                    f"at most {_abi.BUFFER_ADMISSION_TIERS_MAX} tiers of a stack may have an "
                    "admit condition (one bit each per CacheBuffer slot)",
                    rule.describe(),
                )

    @property
    def load_settings(self) -> LoadSettings:
        """The load path's settings: the buffer tier's (its config is a ``LoadSettings``), or
        the ``load:`` section's, or the defaults."""
        if self.buffer is not None:
            return self.buffer.load_settings()
        return self.load or LoadSettings()

    @property
    def resolved_shard_size(self) -> int:
        if self.tensor_size_list is not None:
            return sum(self.tensor_size_list)
        assert self.shard_size is not None
        return self.shard_size

    @property
    def resolved_tensor_sizes(self) -> tuple[int, ...]:
        if self.tensor_size_list is not None:
            return tuple(self.tensor_size_list)
        return (self.resolved_shard_size,)


def _located(location: str, message: str, value: Any) -> PydanticCustomError:
    """An error at a YAML path other than the validator's own, about ``value`` (the
    ``_problems`` of the error read both)."""
    return PydanticCustomError(
        "stack_located", "{message}", {"location": location, "message": message, "value": value}
    )


def format_location(loc: tuple[int | str, ...]) -> str:
    """``('tiers', 1, 'capacity')`` → ``tiers[1].capacity``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "(top level)"


def _problems(error: ValidationError) -> list[str]:
    problems = []
    for item in error.errors(include_url=False):
        location = format_location(_strip_validator_tags(item["loc"]))
        message = item["msg"]
        value = item.get("input")
        if item["type"] == "stack_located":
            context = item.get("ctx", {})
            location, value = str(context["location"]), context["value"]
        if item["type"] == "extra_forbidden":
            message = "unknown key (misspelled?); not allowed here"
        elif item["type"].startswith("tier_type") and not location.endswith(".type"):
            location += ".type"
        problems.append(f"{location}: {message} (got {_short(value)})")
    return problems


def _strip_validator_tags(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    # Wrap validators and SerializeAsAny add synthetic segments such as 'function-wrap[...]'.
    return tuple(p for p in loc if not (isinstance(p, str) and "[" in p and "(" in p))


class _InOrderRepr(reprlib.Repr):
    """``reprlib.Repr`` that keeps a mapping's keys in their order (as ``repr`` does; reprlib
    sorts them): the YAML's order."""

    def repr_dict(self, x: dict[Any, Any], level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = []
        for count, (key, value) in enumerate(x.items()):
            if count == self.maxdict:
                pieces.append("...")
                break
            pieces.append(f"{self.repr1(key, level - 1)}: {self.repr1(value, level - 1)}")
        return "{" + ", ".join(pieces) + "}"


def _bounded_repr() -> reprlib.Repr:
    bounded = _InOrderRepr()
    bounded.maxlevel = 4
    bounded.maxdict = bounded.maxlist = bounded.maxtuple = bounded.maxset = 8
    bounded.maxfrozenset = bounded.maxdeque = bounded.maxarray = 8
    bounded.maxstring = bounded.maxother = 100
    bounded.maxlong = 60
    return bounded


_REPR = _bounded_repr()
"""A repr cut while it is built (at most 8 items of a container, 4 levels deep): a value
that an alias-laden mapping makes huge costs no more to show than a small one."""


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)``, at most ``limit`` characters, in time bounded whatever its size."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_str(value: Any, limit: int = 80) -> str:
    """``str(value)`` for a string, else :func:`short_repr`: bounded likewise."""
    if isinstance(value, str):
        return value if len(value) <= limit else value[: limit - 3] + "..."
    return short_repr(value, limit)


def _short(value: Any) -> str:
    return short_repr(value)


def parse_stack(data: Mapping[str, Any] | StackConfig, source: str = "stack") -> StackConfig:
    """Validates a mapping into a StackConfig; raises ConfigError naming each bad YAML path."""
    if isinstance(data, StackConfig):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: a stack must be a mapping, got {type(data).__name__}")
    try:
        return StackConfig.model_validate(dict(data))
    except ValidationError as exc:
        problems = _problems(exc)
        message = f"{source}: invalid stack:\n  " + "\n  ".join(problems)
        raise ConfigError(message, problems) from None


YAML_NODES_MAX = 100_000
"""Most YAML nodes a stack file may stand for once its aliases are expanded: a stack is a few
hundred; an alias bomb (a small file that expands to billions) is refused before anything
walks it."""


class _StackYamlError(yaml.YAMLError):
    """A YAML document that parses but is refused as a stack source (duplicate keys, aliases
    that expand too far); its message is complete."""


class _StackLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys of a mapping (YAML forbids them;
    PyYAML keeps the last one silently) and documents whose aliases expand past
    ``YAML_NODES_MAX`` nodes."""

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            _check_expansion(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                key_node, yaml.ScalarNode
            ):
                continue  # keys a merge (<<) brings in may be overridden; not scalar: rare
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: constructing the mapping refuses it
            if first is not None:
                raise _StackYamlError(
                    f"duplicate key {short_repr(key)} at line {line} (first at line "
                    f"{first}); give each key once"
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


def _check_expansion(root: yaml.Node) -> None:
    """Refuses a document whose aliases expand past ``YAML_NODES_MAX`` nodes (or into a cycle),
    counting each node once per place it appears, without expanding anything."""
    sizes: dict[int, int] = {}
    visiting: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in visiting:
            raise _StackYamlError("an alias refers to a node that contains it (a cycle)")
        visiting.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(item) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        visiting.discard(key)
        sizes[key] = total = min(total, YAML_NODES_MAX + 1)
        return total

    if size(root) > YAML_NODES_MAX:
        raise _StackYamlError(
            f"its aliases expand to more than {YAML_NODES_MAX} YAML nodes (an alias bomb?); a "
            "stack is a few hundred"
        )


def parse_stack_yaml(text: str, name: str) -> Any:
    """The document of a stack's YAML ``text`` (``name``: what errors call it). Raises
    ConfigError for bad YAML, duplicate keys, aliases that expand too far, or a document too
    deep; any document else (a non-mapping too: :func:`parse_stack` refuses it)."""
    try:
        return yaml.load(text, Loader=_StackLoader)  # a SafeLoader
    except _StackYamlError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{name}: not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{name}: YAML nested too deeply to be a stack") from None


def read_stack_source(
    source: str | os.PathLike[str] | Mapping[str, Any],
) -> tuple[Mapping[str, Any], str]:
    """The raw mapping of a stack (a YAML file's contents, or the mapping itself) and the name
    errors use for it. Raises ConfigError for an unreadable file, one that is not UTF-8 text,
    bad YAML or a non-mapping."""
    if isinstance(source, Mapping):
        return source, "stack"
    path = Path(source)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read stack file {str(path)!r}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"cannot read stack file {str(path)!r}: not UTF-8 text (byte 0x{raw[exc.start]:02x} "
            f"at offset {exc.start})"
        ) from None
    data = parse_stack_yaml(text, str(path))
    if not isinstance(data, Mapping):
        got = "an empty file" if data is None else type(data).__name__
        raise ConfigError(f"{path}: a stack must be a mapping, got {got}")
    return data, str(path)


def load_stack(source: str | os.PathLike[str] | Mapping[str, Any] | StackConfig) -> StackConfig:
    """Loads a stack from a YAML file path, a mapping, or returns a StackConfig unchanged."""
    if isinstance(source, StackConfig):
        return source
    data, name = read_stack_source(source)
    return parse_stack(data, source=name)


def stack_json_schema() -> dict[str, Any]:
    """JSON Schema of a stack with the tier union of every installed tier type."""
    from pydantic import create_model

    models = tuple(cls.config_model for cls in tier_types().values())
    union: Any = Annotated[Union[models], Field(discriminator="type")]  # noqa: UP007
    schema_model = create_model(
        "StackConfig",
        __base__=StackConfig,
        tiers=(list[union], StackConfig.model_fields["tiers"]),
    )
    return schema_model.model_json_schema()
