"""Namespace quotas in the stack YAML (``quotas:``): valid quotas resolve to exact slots, and
every bad quota fails with an error naming its YAML path, the value and what is valid."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ucm.config import BufferQuota, NamespaceQuota, Share
from ucm.errors import ConfigError
from ucm.stack import load_stack, parse_stack

BASE: dict[str, Any] = {
    "unique_id": "quotas",
    "shard_size": 4096,
    "shards_per_block": 1,
    "buffer": {"capacity": "1MiB"},  # 256 regular slots
    "tiers": [
        {"type": "posix", "path": "/tmp/ucm-quotas", "capacity": "1GiB"},
        {"type": "fsspec", "url": "memory://quotas", "name": "s3"},
    ],
}

YAML = """\
unique_id: quotas
shard_size: 4096
shards_per_block: 1
buffer: {capacity: 1MiB}
tiers:
  - {type: posix, path: /tmp/ucm-quotas, capacity: 1GiB}
  - {type: fsspec, url: "memory://quotas", name: s3}
quotas:
  namespaces:
    tenant-a:
      buffer: {guarantee: 40%, cap: 512KiB}
      tiers: {posix: 256MiB, s3: 10GiB}
    default:
      buffer: {guarantee: 12.5%}
  others:
    buffer: {cap: 25%}
    tiers: {posix: 64MiB}
"""


def problems_of(quotas: Any, base: dict[str, Any] = BASE) -> list[str]:
    with pytest.raises(ConfigError) as excinfo:
        parse_stack(base | {"quotas": quotas})
    return excinfo.value.problems


def test_a_yaml_file_with_quotas_resolves_to_exact_slots_and_bytes(tmp_path: Path) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text(YAML)
    stack = load_stack(path)
    quotas = stack.quotas
    assert quotas is not None
    tenant = quotas.for_namespace("tenant-a")
    assert tenant.buffer == BufferQuota(guarantee=Share(percent=40.0), cap=Share(bytes=524288))
    assert tenant.buffer.slots(256, 4096) == (102, 128)  # 40% of 256 rounded down; 512 KiB
    assert tenant.tiers == {"posix": 256 * 1024**2, "s3": 10 * 1024**3}
    assert quotas.for_namespace("default").buffer.slots(256, 4096) == (32, 256)
    # Every namespace not named takes `others`, each on its own.
    unnamed = quotas.for_namespace("tenant-z")
    assert unnamed is quotas.others
    assert unnamed.buffer.slots(256, 4096) == (0, 64)
    assert unnamed.tiers == {"posix": 64 * 1024**2}


def test_quotas_round_trip_through_the_json_dump() -> None:
    stack = load_stack(yaml.safe_load(YAML))
    dumped = stack.model_dump(mode="json")
    assert dumped["quotas"]["namespaces"]["tenant-a"]["buffer"] == {
        "guarantee": "40.0%",
        "cap": 524288,
    }
    again = parse_stack(dumped)
    assert again.quotas == stack.quotas


def test_a_stack_without_quotas_has_none_and_no_quota_is_everything() -> None:
    assert parse_stack(BASE).quotas is None
    assert NamespaceQuota().buffer.slots(256, 4096) == (0, 256)


def test_guarantees_of_exactly_100_percent_are_valid() -> None:
    quotas = {
        "namespaces": {
            "a": {"buffer": {"guarantee": "50%"}},
            "b": {"buffer": {"guarantee": "512KiB"}},
        }
    }
    assert parse_stack(BASE | {"quotas": quotas}).quotas is not None


def test_guarantees_adding_up_to_more_than_100_percent_name_each_namespace() -> None:
    quotas = {
        "namespaces": {
            "tenant-a": {"buffer": {"guarantee": "60%"}},
            "tenant-b": {"buffer": {"guarantee": "256KiB"}},
            "tenant-c": {"buffer": {"guarantee": "25%"}},
        }
    }
    assert problems_of(quotas) == [
        "quotas.namespaces: the CacheBuffer guarantees add up to 110% (tenant-a 60%, "
        "tenant-b 262144 bytes, tenant-c 25%); they may add up to 100% at most "
        "(got {'tenant-a': '60%', 'tenant-b': '262144 bytes', 'tenant-c': '25%'})"
    ]


@pytest.mark.parametrize(
    ("quotas", "problem"),
    [
        (
            {"namespaces": {"a": {"tiers": {"posx": "1GiB"}}}},
            "quotas.namespaces.a.tiers.posx: unknown tier 'posx'; the lower tiers of this "
            "stack are: posix, s3 (a tier's label is its `name`, else its type) (got 'posx')",
        ),
        (
            {"others": {"tiers": {"fsspec": "1GiB"}}},
            "quotas.others.tiers.fsspec: unknown tier 'fsspec'; the lower tiers of this stack "
            "are: posix, s3 (a tier's label is its `name`, else its type) (got 'fsspec')",
        ),
        (
            {"namespaces": {"a": {"tiers": {"buffer": "1GiB"}}}},
            "quotas.namespaces.a.tiers.buffer: the CacheBuffer's quota is the namespace's "
            "`buffer:` (guarantee, cap), not bytes under tiers (got 'buffer')",
        ),
        (
            {"namespaces": {"a": {"tiers": {"posix": -1}}}},
            "quotas.namespaces.a.tiers.posix: Value error, invalid size -1: must not be "
            "negative (got -1)",
        ),
        (
            {"namespaces": {"a": {"tiers": {"s3": 2**61}}}},
            f"quotas.namespaces.a.tiers.s3: Value error, invalid size {2**61}: more than the "
            f"1 EiB limit on a quota (got {2**61})",
        ),
        (
            {"namespaces": {"a": {"tiers": {"posix": "2GiB"}}}},
            "quotas.namespaces.a.tiers.posix: 2147483648 bytes is more than the tier's "
            "capacity (1073741824 bytes) (got 2147483648)",
        ),
        (
            {"namespaces": {"a": {"buffer": {"cap": -3}}}},
            "quotas.namespaces.a.buffer.cap: Value error, invalid share -3: must not be "
            "negative (got -3)",
        ),
        (
            {"namespaces": {"a": {"buffer": {"guarantee": "-5%"}}}},
            "quotas.namespaces.a.buffer.guarantee: Value error, invalid share '-5%': a "
            "percentage must be 0% to 100% (got '-5%')",
        ),
        (
            {"namespaces": {"a": {"buffer": {"cap": "120%"}}}},
            "quotas.namespaces.a.buffer.cap: Value error, invalid share '120%': a percentage "
            "must be 0% to 100% (got '120%')",
        ),
        (
            {"namespaces": {"a": {"buffer": {"cap": "2MiB"}}}},
            "quotas.namespaces.a.buffer.cap: 2097152 bytes is more than the CacheBuffer's "
            "capacity (1048576 bytes); give at most the capacity or a share such as '50%' "
            "(got 2097152)",
        ),
        (
            {"namespaces": {"a": {"buffer": {"cap": 0.5}}}},
            "quotas.namespaces.a.buffer.cap: Value error, invalid share 0.5: expected a share "
            "of the CacheBuffer such as '40%' (0% to 100%) or a byte size such as '4GiB' "
            "(write a fraction as a percentage) (got 0.5)",
        ),
        (
            {"namespaces": {"a": {"buffer": {"guarantee": "50%", "cap": "10%"}}}},
            "quotas.namespaces.a.buffer.guarantee: the guarantee (50%) is more than the cap "
            "(10%) (got '50%')",
        ),
        (
            {"others": {"buffer": {"guarantee": "1%"}}},
            "quotas.others.buffer.guarantee: a guarantee is given per named namespace (any "
            "number of namespaces may be unnamed, so theirs could not add up); name the "
            "namespace under quotas.namespaces (got '1%')",
        ),
        (
            {"namespaces": {"a b": {}}},
            "quotas.namespaces.a b: not a valid namespace name: expected 1 to 64 characters "
            "of A-Z a-z 0-9 '.' '_' '-', starting with a letter or a digit (got 'a b')",
        ),
        (
            {"namespaces": {"a": {"bufer": {}}}},
            "quotas.namespaces.a.bufer: unknown key (misspelled?); not allowed here (got {})",
        ),
    ],
)
def test_a_bad_quota_names_its_yaml_path_and_value(quotas: Any, problem: str) -> None:
    assert problems_of(quotas) == [problem]


def test_a_buffer_quota_without_a_buffer_tier_is_refused() -> None:
    base = {key: value for key, value in BASE.items() if key != "buffer"}
    assert problems_of({"namespaces": {"a": {"buffer": {"cap": "10%"}}}}, base) == [
        "quotas.namespaces.a.buffer.cap: this stack has no buffer tier: a CacheBuffer quota "
        "needs one (got '10%')"
    ]


def test_two_tiers_with_one_label_are_ambiguous() -> None:
    base = BASE | {
        "tiers": [{"type": "posix", "path": "/a"}, {"type": "posix", "path": "/b"}],
    }
    assert problems_of({"namespaces": {"a": {"tiers": {"posix": 1}}}}, base) == [
        "quotas.namespaces.a.tiers.posix: 2 tiers are labelled 'posix'; give them distinct "
        "`name`s (got 'posix')"
    ]


MOONCAKE_REFUSED = (
    "the mooncake tier 'pool' takes no per-namespace byte quota: Mooncake Store lists no keys "
    "and records no ages (its client API has no listing; the master keeps no write time), so "
    "the tier could neither measure a namespace's bytes nor drop its oldest blocks first; "
    "give the quota to a posix or fsspec tier, or none"
)


@pytest.mark.parametrize(
    ("quotas", "location", "value"),
    [
        ({"namespaces": {"a": {"tiers": {"pool": "1GiB"}}}}, "quotas.namespaces.a", 1 << 30),
        ({"others": {"tiers": {"pool": 4096}}}, "quotas.others", 4096),
    ],
)
def test_a_byte_quota_on_a_mooncake_tier_is_refused_not_ignored(
    quotas: Any, location: str, value: int
) -> None:
    """Mooncake Store cannot enforce one (docs/namespaces.md): the stack refuses it with the
    YAML path, instead of opening a tier that would silently ignore it."""
    base = BASE | {
        "tiers": [
            {
                "type": "mooncake",
                "name": "pool",
                "master_server_address": "127.0.0.1:50051",
                "local_hostname": "127.0.0.1",
            },
            {"type": "posix", "path": "/tmp/ucm-quotas"},
        ],
    }
    assert problems_of(quotas, base) == [f"{location}.tiers.pool: {MOONCAKE_REFUSED} (got {value})"]
    # The posix tier below still takes one.
    posix = {"namespaces": {"a": {"tiers": {"posix": "1GiB"}}}}
    assert parse_stack(base | {"quotas": posix}).quotas is not None
