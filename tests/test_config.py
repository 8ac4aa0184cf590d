"""Stack configuration: valid stacks from dicts and YAML files, and invalid ones rejected with
messages that name the YAML path, the value and what is valid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ucm
from ucm import plugins
from ucm.buffer import BufferTierConfig
from ucm.config import LoadSettings, LowerTierConfig
from ucm.errors import ConfigError, UcmError
from ucm.sizes import VALID_SIZE_HINT
from ucm.stack import (
    StackConfig,
    format_location,
    load_stack,
    parse_stack,
    stack_json_schema,
)

BASE: dict[str, Any] = {"unique_id": "llama3-70b", "shard_size": 262144, "shards_per_block": 8}
UNIQUE_ID_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


def installed() -> str:
    return ", ".join(sorted(plugins.tier_types()))


def problems_of(data: Any) -> list[str]:
    with pytest.raises(ConfigError) as excinfo:
        parse_stack(data)
    error = excinfo.value
    assert str(error) == "stack: invalid stack:\n  " + "\n  ".join(error.problems)
    return error.problems


# -- valid stacks ----------------------------------------------------------------------------


def test_dict_stack_with_builtin_tiers_and_defaults(tmp_path: Path) -> None:
    stack = parse_stack(
        BASE
        | {
            "tiers": [
                {"type": "posix", "path": str(tmp_path / "nvme"), "capacity": "500GiB"},
                {"type": "fsspec", "url": "memory://kv/llama3", "write": "back"},
            ]
        }
    )
    assert isinstance(stack, StackConfig)
    assert stack.unique_id == "llama3-70b"
    assert stack.shard_size == 262144
    assert stack.tensor_size_list is None
    assert stack.resolved_shard_size == 262144
    assert stack.resolved_tensor_sizes == (262144,)
    posix, remote = stack.tiers
    assert (posix.type, posix.label) == ("posix", "posix")
    assert isinstance(posix, LowerTierConfig)
    assert posix.model_dump(include={"path", "capacity", "write", "promote", "name"}) == {
        "path": str(tmp_path / "nvme"),
        "capacity": 500 * 1024**3,
        "write": "through",
        "promote": False,
        "name": None,
    }
    assert remote.model_dump(include={"url", "storage_options", "write", "capacity"}) == {
        "url": "memory://kv/llama3",
        "storage_options": {},
        "write": "back",
        "capacity": None,
    }


def test_yaml_file_stack_with_tensor_size_list(tmp_path: Path) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text(
        f"""\
unique_id: llama3-70b          # names the node-wide shared segments
tensor_size_list: [131072, 131072]
shards_per_block: 8
tiers:
  - type: posix
    name: nvme
    path: {tmp_path / "nvme"}
    capacity: 500GiB
    write: through
  - type: fsspec
    url: s3://kv-cache/llama3
    storage_options: {{endpoint_url: "http://127.0.0.1:5000"}}
    write: back
    promote: true
"""
    )
    for source in (path, str(path)):
        stack = load_stack(source)
        assert stack.shard_size is None
        assert stack.tensor_size_list == [131072, 131072]
        assert stack.resolved_shard_size == 262144
        assert stack.resolved_tensor_sizes == (131072, 131072)
        assert stack.shards_per_block == 8
        assert [tier.type for tier in stack.tiers] == ["posix", "fsspec"]
        assert stack.tiers[0].label == "nvme"
        assert stack.tiers[0].model_dump()["capacity"] == 500 * 1024**3
        assert stack.tiers[1].model_dump(include={"storage_options", "write", "promote"}) == {
            "storage_options": {"endpoint_url": "http://127.0.0.1:5000"},
            "write": "back",
            "promote": True,
        }


@pytest.mark.parametrize(
    ("geometry", "shard_size", "tensor_sizes"),
    [
        ({"shard_size": "256KiB"}, 262144, (262144,)),
        ({"shard_size": "1MB"}, 1_000_000, (1_000_000,)),
        ({"shard_size": 1}, 1, (1,)),
        ({"tensor_size_list": [4096, 1024, 3]}, 5123, (4096, 1024, 3)),
        ({"shard_size": "8KiB", "tensor_size_list": [4096, 4096]}, 8192, (4096, 4096)),
    ],
)
def test_shard_geometry(
    geometry: dict[str, Any], shard_size: int, tensor_sizes: tuple[int, ...]
) -> None:
    data = {k: v for k, v in BASE.items() if k != "shard_size"} | geometry
    stack = parse_stack(data | {"tiers": [{"type": "posix", "path": "/tmp/ucm"}]})
    assert stack.resolved_shard_size == shard_size
    assert stack.resolved_tensor_sizes == tensor_sizes


def test_stack_without_buffer_is_valid_and_scratch_tier_from_a_plugin(scratch_tier: Any) -> None:
    stack = parse_stack(BASE | {"tiers": [{"type": "scratch", "capacity": "8GiB"}]})
    assert type(stack.tiers[0]) is scratch_tier.config_model
    assert stack.tiers[0].model_dump()["capacity"] == 8 * 1024**3


def test_parse_and_load_return_a_stack_config_unchanged() -> None:
    stack = parse_stack(BASE | {"tiers": [{"type": "posix", "path": "/tmp/ucm"}]})
    assert parse_stack(stack) is stack
    assert load_stack(stack) is stack


def test_stack_round_trips_through_its_json_dump(tmp_path: Path) -> None:
    stack = parse_stack(
        BASE
        | {
            "tiers": [
                {"type": "posix", "path": str(tmp_path), "capacity": "1GiB", "write": "none"},
                {"type": "fsspec", "url": "memory://x", "storage_options": {"a": 1}},
            ]
        }
    )
    dumped = stack.model_dump(mode="json")
    assert dumped["tiers"][0]["capacity"] == 1024**3
    assert dumped["tiers"][1]["storage_options"] == {"a": 1}
    assert parse_stack(dumped) == stack


def test_stack_configs_are_frozen() -> None:
    stack = parse_stack(BASE | {"tiers": [{"type": "posix", "path": "/tmp/ucm"}]})
    with pytest.raises(ValueError, match="frozen"):
        stack.shards_per_block = 4  # type: ignore[misc]


def test_json_schema_has_every_installed_tier_type(scratch_tier: Any) -> None:
    schema = stack_json_schema()
    json.dumps(schema)  # serialisable, as `ucm schema` prints it
    tiers = schema["properties"]["tiers"]
    mapping = tiers["items"]["discriminator"]["mapping"]
    assert sorted(mapping) == sorted(plugins.tier_types())
    assert {"buffer", "posix", "fsspec", "scratch"} <= set(mapping)  # `type: buffer` still a tier
    # The buffer's own section, typed: the buffer tier's model.
    assert schema["properties"]["buffer"]["anyOf"] == [
        {"$ref": "#/$defs/BufferTierConfig"},
        {"type": "null"},
    ]
    assert "capacity" in schema["$defs"]["BufferTierConfig"]["required"]
    assert set(schema["required"]) == {"unique_id", "shards_per_block"}


# -- the buffer: its own section, or the first tier --------------------------------------------

LOWER: dict[str, Any] = {"type": "posix", "path": "/tmp/ucm-lower"}
TUNED: dict[str, Any] = {"capacity": "64MiB", "load_workers": 3, "step_keys": 7}


def test_the_buffer_section_and_the_buffer_as_first_tier_are_one_stack() -> None:
    section = parse_stack(BASE | {"buffer": TUNED, "tiers": [LOWER]})
    first_tier = parse_stack(BASE | {"tiers": [{"type": "buffer", **TUNED}, LOWER]})
    for stack in (section, first_tier):
        assert isinstance(stack.buffer, BufferTierConfig)
        assert stack.buffer is stack.tiers[0]  # both views agree
        assert [tier.type for tier in stack.tiers] == ["buffer", "posix"]
        assert (stack.buffer.capacity, stack.buffer.load_workers) == (64 << 20, 3)
    assert section == first_tier
    # Serialized once, as the first tier: the dump parses back to the same stack.
    dumped = section.model_dump(mode="json")
    assert "buffer" not in dumped and dumped["tiers"][0]["type"] == "buffer"
    assert parse_stack(dumped) == section


def test_a_buffer_section_alone_is_a_stack() -> None:
    stack = parse_stack(BASE | {"buffer": {"capacity": "1MiB"}})
    assert stack.buffer is not None and stack.tiers == [stack.buffer]


def test_a_stack_without_a_buffer_has_none() -> None:
    stack = parse_stack(BASE | {"tiers": [LOWER]})
    assert stack.buffer is None and [tier.type for tier in stack.tiers] == ["posix"]


def test_with_and_without_a_buffer_the_stack_takes_the_same_settings_model() -> None:
    tuned = {"load_workers": 3, "step_keys": 7, "copy_threads": 2, "load_queue_depth": 5}
    stacks = [
        parse_stack(BASE | {"buffer": {"capacity": "1MiB", **tuned}, "tiers": [LOWER]}),
        parse_stack(BASE | {"tiers": [{"type": "buffer", "capacity": "1MiB", **tuned}, LOWER]}),
        parse_stack(BASE | {"tiers": [LOWER], "load": tuned}),
    ]
    settings = [stack.load_settings for stack in stacks]
    assert [type(one) for one in settings] == [LoadSettings] * 3
    assert settings[0] == settings[1] == settings[2]
    assert {name: getattr(settings[0], name) for name in tuned} == tuned
    assert parse_stack(BASE | {"tiers": [LOWER]}).load_settings == LoadSettings()


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (
            {"buffer": {"capacity": "1MiB"}, "tiers": [{"type": "buffer", "capacity": "1MiB"}]},
            "tiers[0].type: a stack has one buffer, already given as the buffer section; remove "
            "this tier (got 'buffer')",
        ),
        (
            {"buffer": {"capacity": "1MiB"}, "tiers": [LOWER, {"type": "buffer", "capacity": 1}]},
            "tiers[1].type: a stack has one buffer, already given as the buffer section; remove "
            "this tier (got 'buffer')",
        ),
        (
            {"tiers": [{"type": "buffer", "capacity": "1MiB"}, {"type": "buffer", "capacity": 1}]},
            "tiers[1].type: a stack has one buffer, already given as tiers[0]; remove this tier "
            "(got 'buffer')",
        ),
        (
            {"tiers": [LOWER, {"type": "buffer", "capacity": "1MiB"}]},
            "tiers[1].type: the buffer tier must be the first tier (the node-wide host-memory "
            "cache sits above every other tier); move it to tiers[0] or to the buffer section "
            "(got 'buffer')",
        ),
        (
            {"buffer": {"capacity": "1MiB", "capcity": 1}},
            "buffer.capcity: unknown key (misspelled?); not allowed here (got 1)",
        ),
        (
            {"buffer": {"type": "posix", "capacity": "1MiB"}},
            "buffer.type: Input should be 'buffer' (got 'posix')",
        ),
        (
            {"buffer": "64MiB"},
            "buffer: Input should be a valid dictionary or instance of BufferTierConfig "
            "(got '64MiB')",
        ),
    ],
)
def test_a_misplaced_or_second_buffer_is_refused_at_its_yaml_path(
    data: dict[str, Any], problem: str
) -> None:
    assert problems_of(BASE | data) == [problem]


def test_a_load_section_beside_a_buffer_section_is_refused() -> None:
    (problem,) = problems_of(BASE | {"buffer": {"capacity": "1MiB"}, "load": {"step_keys": 8}})
    assert problem.startswith(
        "(top level): load: a stack with a buffer tier takes the load path's settings as keys "
        "of the buffer (its buffer section or tiers[0]); remove the load section or move its "
        "keys there"
    )


# -- invalid stacks: exact messages -----------------------------------------------------------


def test_unknown_tier_type_names_it_and_lists_installed_types() -> None:
    data = BASE | {"tiers": [{"type": "posix", "path": "/x"}, {"type": "nvme", "path": "/y"}]}
    assert problems_of(data) == [
        f"tiers[1].type: unknown tier type 'nvme'; installed tier types: {installed()} "
        "(got {'type': 'nvme', 'path': '/y'})"
    ]


def test_unknown_tier_type_lists_installed_types_at_its_yaml_path() -> None:
    (problem,) = problems_of(BASE | {"tiers": [{"type": "posix", "path": "/x"}, {"type": "nvme"}]})
    assert problem.startswith("tiers[1].type: unknown tier type ")
    assert problem.endswith(f"; installed tier types: {installed()} (got {{'type': 'nvme'}})")
    assert installed().startswith("buffer, fsspec, mooncake, posix")


def test_unknown_tier_type_lists_a_plugin_type(scratch_tier: Any) -> None:
    (problem,) = problems_of(BASE | {"tiers": [{"type": "ramdisk", "capacity": "8GiB"}]})
    assert "scratch" in installed().split(", ")
    assert problem.endswith(
        f"; installed tier types: {installed()} (got {{'type': 'ramdisk', 'capacity': '8GiB'}})"
    )


def test_missing_tier_type_lists_installed_types() -> None:
    assert problems_of(BASE | {"tiers": [{"path": "/x"}]}) == [
        f"tiers[0].type: missing 'type'; installed tier types: {installed()} (got {{'path': '/x'}})"
    ]


def test_misspelled_key_is_rejected_with_its_yaml_path(scratch_tier: Any) -> None:
    data = BASE | {
        "tiers": [{"type": "posix", "path": "/x"}, {"type": "scratch", "capcity": "8GiB"}]
    }
    assert problems_of(data) == [
        "tiers[1].capcity: unknown key (misspelled?); not allowed here (got '8GiB')"
    ]


def test_misspelled_key_in_a_yaml_file_names_the_file_and_the_path(tmp_path: Path) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text(
        "unique_id: m\nshard_size: 4KiB\nshards_per_block: 2\ntiers:\n"
        "  - type: posix\n    path: /x\n  - type: fsspec\n    url: memory://x\n    wirte: back\n"
    )
    with pytest.raises(ConfigError) as excinfo:
        load_stack(path)
    assert str(excinfo.value) == (
        f"{path}: invalid stack:\n"
        "  tiers[1].wirte: unknown key (misspelled?); not allowed here (got 'back')"
    )


def test_misspelled_top_level_key() -> None:
    assert problems_of(BASE | {"shard_sise": 3, "tiers": [{"type": "posix", "path": "/x"}]}) == [
        "shard_sise: unknown key (misspelled?); not allowed here (got 3)"
    ]


@pytest.mark.parametrize(
    ("tier", "problem"),
    [
        (
            {"type": "posix", "path": "/x", "capacity": "8 GiBs"},
            f"tiers[0].capacity: Value error, invalid size '8 GiBs': expected {VALID_SIZE_HINT} "
            "(got '8 GiBs')",
        ),
        (
            {"type": "fsspec", "url": "memory://x", "capacity": "-1GiB"},
            f"tiers[0].capacity: Value error, invalid size '-1GiB': expected {VALID_SIZE_HINT} "
            "(got '-1GiB')",
        ),
        (
            {"type": "posix", "path": "/x", "capacity": "0.5B"},
            "tiers[0].capacity: Value error, invalid size '0.5B': not a whole number of bytes "
            "(got '0.5B')",
        ),
    ],
)
def test_bad_size_string_names_the_value(tier: dict[str, Any], problem: str) -> None:
    assert problems_of(BASE | {"tiers": [tier]}) == [problem]


def test_bad_shard_size_names_the_value() -> None:
    assert problems_of(
        BASE | {"shard_size": "lots", "tiers": [{"type": "posix", "path": "/x"}]}
    ) == [f"shard_size: Value error, invalid size 'lots': expected {VALID_SIZE_HINT} (got 'lots')"]


def test_missing_geometry() -> None:
    data = {"unique_id": "m", "shards_per_block": 2, "tiers": [{"type": "posix", "path": "/x"}]}
    assert problems_of(data) == [
        "(top level): give shard_size (bytes per shard) or tensor_size_list "
        # the input is shown shortened to 80 characters
        "(got {'unique_id': 'm', 'shards_per_block': 2, 'tiers': [{'type': 'posix', 'path':...)"
    ]


def test_shard_size_differing_from_the_tensor_sizes() -> None:
    (problem,) = problems_of(
        BASE
        | {
            "shard_size": 1024,
            "tensor_size_list": [512, 256],
            "tiers": [{"type": "posix", "path": "/x"}],
        }
    )
    assert problem.startswith(
        "(top level): shard_size 1024 differs from sum(tensor_size_list) = 768 (got "
    )


@pytest.mark.parametrize(
    ("geometry", "problem"),
    [
        ({"shard_size": 0}, "(top level): shard_size must be at least 1 byte (got "),
        (
            {"shard_size": None, "tensor_size_list": []},
            "(top level): tensor_size_list must list at least one tensor size (got ",
        ),
        (
            {"shard_size": None, "tensor_size_list": [4096, 0]},
            "tensor_size_list[1]: Input should be greater than 0 (got 0)",
        ),
        ({"shards_per_block": 0}, "shards_per_block: Input should be greater than 0 (got 0)"),
    ],
)
def test_bad_geometry(geometry: dict[str, Any], problem: str) -> None:
    (found,) = problems_of(BASE | geometry | {"tiers": [{"type": "posix", "path": "/x"}]})
    assert found.startswith(problem)


@pytest.mark.parametrize("tiers", [[], None, "posix"])
def test_empty_or_missing_tiers(tiers: Any) -> None:
    data = BASE | {"tiers": tiers} if tiers is not None else dict(BASE)
    expected = {
        "[]": "tiers: give a buffer section or at least one tier (got [])",
        "None": "tiers: give a buffer section or at least one tier (got [])",
        "'posix'": "tiers: Input should be a valid list (got 'posix')",
    }[repr(tiers)]
    assert problems_of(data) == [expected]


@pytest.mark.parametrize("unique_id", ["bad id!", "", "-leading-dash", "x" * 65, "a/b"])
def test_bad_unique_id(unique_id: str) -> None:
    data = BASE | {"unique_id": unique_id, "tiers": [{"type": "posix", "path": "/x"}]}
    assert problems_of(data) == [
        f"unique_id: String should match pattern '{UNIQUE_ID_PATTERN}' (got {unique_id!r})"
    ]


def test_bad_write_policy_lists_the_valid_ones() -> None:
    data = BASE | {"tiers": [{"type": "posix", "path": "/x", "write": "later"}]}
    assert problems_of(data) == [
        "tiers[0].write: Input should be 'through', 'back' or 'none' (got 'later')"
    ]


def test_builtin_tier_missing_its_required_key() -> None:
    data = BASE | {"tiers": [{"type": "posix"}, {"type": "fsspec"}]}
    assert problems_of(data) == [
        "tiers[0].path: Field required (got {'type': 'posix'})",
        "tiers[1].url: Field required (got {'type': 'fsspec'})",
    ]


def test_every_problem_is_reported_at_once() -> None:
    data = {
        "unique_id": "ok",
        "shard_size": "8 GiBs",
        "shards_per_block": 2,
        "tiers": [
            {"type": "posix", "path": "/x", "capcity": 1},
            {"type": "posix", "path": "/y", "promote": "maybe"},
        ],
    }
    assert problems_of(data) == [
        f"shard_size: Value error, invalid size '8 GiBs': expected {VALID_SIZE_HINT} "
        "(got '8 GiBs')",
        "tiers[0].capcity: unknown key (misspelled?); not allowed here (got 1)",
        "tiers[1].promote: expected true or false (got 'maybe')",
    ]


def test_a_tier_that_is_not_a_mapping() -> None:
    (problem,) = problems_of(BASE | {"tiers": ["posix"]})
    assert problem.startswith("tiers[0]: a tier must be a mapping with a 'type' key")
    assert problem.endswith("(got 'posix')")


@pytest.mark.parametrize("data", [["unique_id", "m"], "stack", 7])
def test_a_stack_that_is_not_a_mapping(data: Any) -> None:
    with pytest.raises(ConfigError) as excinfo:
        parse_stack(data)
    assert str(excinfo.value) == f"stack: a stack must be a mapping, got {type(data).__name__}"


def test_config_error_is_a_ucm_error_and_a_value_error() -> None:
    with pytest.raises(ConfigError) as excinfo:
        parse_stack(BASE | {"tiers": []})
    assert isinstance(excinfo.value, UcmError)
    assert isinstance(excinfo.value, ValueError)
    assert ucm.ConfigError is ConfigError


# -- files ------------------------------------------------------------------------------------


def test_unreadable_stack_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as excinfo:
        load_stack(missing)
    assert (
        str(excinfo.value) == f"cannot read stack file {str(missing)!r}: No such file or directory"
    )
    with pytest.raises(ConfigError) as excinfo:
        load_stack(tmp_path)
    assert str(excinfo.value) == f"cannot read stack file {str(tmp_path)!r}: Is a directory"


def test_invalid_yaml_names_the_file_and_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("unique_id: m\ntiers:\n  - type: posix\n   path: [unclosed\n")
    with pytest.raises(ConfigError) as excinfo:
        load_stack(path)
    message = str(excinfo.value)
    assert message.startswith(f"{path}: not valid YAML: ")
    assert "line 4" in message


@pytest.mark.parametrize(
    ("text", "kind"), [("", "an empty file"), ("- a\n- b\n", "list"), ("42\n", "int")]
)
def test_yaml_file_that_is_not_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as excinfo:
        load_stack(path)
    assert str(excinfo.value) == f"{path}: a stack must be a mapping, got {kind}"


# -- helpers --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loc", "text"),
    [
        (("tiers", 1, "capacity"), "tiers[1].capacity"),
        (("tensor_size_list", 0), "tensor_size_list[0]"),
        (("unique_id",), "unique_id"),
        ((), "(top level)"),
    ],
)
def test_format_location(loc: tuple[int | str, ...], text: str) -> None:
    assert format_location(loc) == text


@given(size=st.integers(min_value=1, max_value=2**40))
def test_any_byte_count_is_a_valid_shard_size(size: int) -> None:
    stack = StackConfig.model_validate(
        BASE | {"shard_size": size, "tiers": [{"type": "posix", "path": "/x"}]}
    )
    assert stack.resolved_shard_size == size


# -- the reference documents every key ----------------------------------------------------------


def test_configuration_reference_documents_every_stack_key() -> None:
    reference = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    for key in StackConfig.model_fields:
        assert f"| `{key}`" in reference, f"docs/configuration.md lacks the stack key {key!r}"


@pytest.mark.parametrize("module", plugins.DEFAULT_PLUGINS)
def test_configuration_reference_documents_every_builtin_tier_key(module: str) -> None:
    reference = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    for type_name, tier in plugins.tier_types().items():
        if tier.__module__ != module:
            continue
        heading = f"### `type: {type_name}`"
        assert heading in reference, f"docs/configuration.md lacks a section {heading!r}"
        section = reference.split(heading, 1)[1].split("\n### ", 1)[0]
        for key in tier.config_model.model_fields:
            shared = {"type", "name", "write", "promote", "admit", "codec", "lookup_timeout_ms"}
            if key in shared | {"breaker"}:
                continue  # documented once, in "Keys every tier has"
            assert f"| `{key}`" in section, f"{heading} in docs/configuration.md lacks {key!r}"


def test_a_background_read_rate_below_the_least_names_the_value_and_the_least() -> None:
    buffer = {"type": "buffer", "capacity": "1GiB", "background_read_bytes_per_s": "1KiB"}
    assert problems_of(BASE | {"tiers": [buffer]}) == [
        "tiers[0].background_read_bytes_per_s: Value error, background_read_bytes_per_s=1024 "
        "is below the least rate, 1048576 (1MiB per second); leave it null for no cap "
        "(got '1KiB')"
    ]
    paced = parse_stack(BASE | {"tiers": [{**buffer, "background_read_bytes_per_s": "512MiB"}]})
    assert paced.buffer is not None
    assert paced.buffer.load_settings().background_read_bytes_per_s == 512 << 20


# -- bad input: each refused with the YAML path, the value and what is valid -------------------

SMALL: dict[str, Any] = {"unique_id": "small", "shard_size": 4096, "shards_per_block": 2}


def test_a_lower_tier_capacity_below_one_block_is_refused_with_the_least(tmp_path: Path) -> None:
    # Such a tier evicted every block it was given: each dump "succeeded" and stored nothing.
    posix = {"type": "posix", "path": str(tmp_path), "capacity": 100}
    assert problems_of(SMALL | {"buffer": {"capacity": "1MiB"}, "tiers": [posix]}) == [
        "tiers[0].capacity: 100 bytes cannot hold one block, which this posix tier stores in "
        "12288 bytes (one file: 2 shard(s) of 4096 bytes and a 4096-byte footer, "
        "4096-aligned); give at least 12288 bytes, or no capacity for no bound (got 100)"
    ]
    fsspec = {"type": "fsspec", "url": "memory://small", "capacity": 0}
    assert problems_of(SMALL | {"tiers": [{"type": "buffer", "capacity": "1MiB"}, fsspec]}) == [
        "tiers[1].capacity: 0 bytes cannot hold one block, which this fsspec tier stores in "
        "8288 bytes (2 object(s) of a 48-byte envelope header and a 4096-byte shard); give at "
        "least 8288 bytes, or no capacity for no bound (got 0)"
    ]
    # Exactly one block is enough; so is a tier type that cannot say, given one shard.
    parse_stack(SMALL | {"tiers": [posix | {"capacity": "12KiB"}, fsspec | {"capacity": 8288}]})


def test_a_tier_type_that_cannot_say_its_block_size_needs_one_shard(scratch_tier: Any) -> None:
    assert problems_of(SMALL | {"tiers": [{"type": "scratch", "capacity": 4095}]}) == [
        "tiers[0].capacity: 4095 bytes cannot hold one block, which this scratch tier stores "
        "in 4096 bytes (one shard of 4096 bytes); give at least 4096 bytes, or no capacity for "
        "no bound (got 4095)"
    ]


BOMB = "".join(
    [
        "unique_id: bomb\nshard_size: 4096\nshards_per_block: 1\ntiers:\n  - type: fsspec\n",
        "    url: memory://bomb\n    storage_options:\n",
        "      a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n",
        *(f"      a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)),
    ]
)


@pytest.mark.timeout(30)
def test_a_yaml_alias_bomb_is_refused_before_anything_walks_it(tmp_path: Path) -> None:
    # 20 lines that stand for a billion nodes: validating (and printing) them hung.
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    with pytest.raises(ConfigError) as info:
        load_stack(path)
    assert str(info.value) == (
        f"{path}: its aliases expand to more than 100000 YAML nodes (an alias bomb?); a stack "
        "is a few hundred"
    )
    # Aliases that expand to a few nodes stay valid.
    path.write_text(BOMB.split("      a0:")[0] + "      a: &a {k: v}\n      b: *a\n")
    assert load_stack(path).tiers[0].model_dump()["storage_options"] == {
        "a": {"k": "v"},
        "b": {"k": "v"},
    }


@pytest.mark.timeout(30)
def test_a_huge_value_in_an_error_is_cut_while_its_repr_is_built() -> None:
    # A mapping from Python may share one list a billion times over; its repr is never whole.
    huge: Any = ["x"] * 10
    for _ in range(8):
        huge = [huge] * 10
    assert problems_of(BASE | {"tiers": [{"type": "posix", "path": "/x"}], "extra": huge}) == [
        "extra: unknown key (misspelled?); not allowed here (got [[[[[...], [...], [...], "
        "[...], [...], [...], [...], [...], ...], [[...], [.....)"
    ]


def test_a_stack_file_that_is_not_utf8_names_the_byte_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "n.yaml"
    path.write_bytes(b"unique_id: x\n\xff\xfe bad\n")
    with pytest.raises(ConfigError) as info:
        load_stack(path)
    assert str(info.value) == (
        f"cannot read stack file {str(path)!r}: not UTF-8 text (byte 0xff at offset 13)"
    )


def test_a_duplicate_yaml_key_is_refused_naming_the_key_and_lines(tmp_path: Path) -> None:
    # PyYAML keeps the last of two equal keys: the first one was lost silently.
    path = tmp_path / "dup.yaml"
    path.write_text("unique_id: a\nunique_id: b\nshard_size: 4096\nshards_per_block: 1\n")
    with pytest.raises(ConfigError) as info:
        load_stack(path)
    assert str(info.value) == (
        f"{path}: duplicate key 'unique_id' at line 2 (first at line 1); give each key once"
    )
    path.write_text("tiers: [{type: posix, path: /a, path: /b}]\n")
    with pytest.raises(ConfigError, match="duplicate key 'path' at line 1 \\(first at line 1\\)"):
        load_stack(path)
    # A merge (<<) brings keys in that the mapping may override: not duplicates.
    path.write_text(
        "unique_id: m\nshard_size: 4096\nshards_per_block: 1\n"
        "tiers: [&t {type: posix, path: /a}, {<<: *t, path: /b}]\n"
    )
    assert [tier.model_dump()["path"] for tier in load_stack(path).tiers] == ["/a", "/b"]


SECONDS_KEYS = [
    "queue_timeout_s",
    "dump_submit_timeout_s",
    "wait_timeout_s",
    "write_through_wait_s",
    "write_snapshot_idle_s",
    "flush_interval_s",
]


@pytest.mark.parametrize("key", [*SECONDS_KEYS, "lock_timeout"])
def test_a_seconds_setting_must_be_finite_and_at_most_a_day(key: str, tmp_path: Path) -> None:
    # .inf passed validation and crashed with OverflowError converting it to nanoseconds.
    where = "tiers[0]" if key == "lock_timeout" else "buffer"

    def stack(value: str) -> Path:
        tier = f"tiers: [{{type: posix, path: {tmp_path}, {key}: {value}}}]\n"
        if key != "lock_timeout":
            tier = f"buffer: {{capacity: 1MiB, {key}: {value}}}\n"
        path = tmp_path / "stack.yaml"
        path.write_text("unique_id: s\nshard_size: 4096\nshards_per_block: 1\n" + tier)
        return path

    for value, shown in ((".inf", "inf"), (".nan", "nan"), ("-.inf", "-inf")):
        with pytest.raises(ConfigError) as info:
            load_stack(stack(value))
        assert info.value.problems == [
            f"{where}.{key}: Input should be a finite number (got {shown})"
        ]
    with pytest.raises(ConfigError) as info:
        load_stack(stack("86401"))
    assert info.value.problems == [
        f"{where}.{key}: Input should be less than or equal to 86400 (got 86401)"
    ]
    load_stack(stack("86400"))
    load_stack(stack("5"))  # an integer is a number of seconds


@pytest.mark.parametrize(
    ("section", "key", "value", "problem"),
    [
        ("buffer", "reserved_slots", True, "expected a number, not a boolean"),
        ("buffer", "load_workers", True, "expected a number, not a boolean"),
        ("buffer", "wait_timeout_s", True, "expected a number, not a boolean"),
        ("buffer", "prealloc", 0, "expected true or false"),
        ("buffer", "rearrange", "yes", "expected true or false"),
        ("posix", "io_threads", True, "expected a number, not a boolean"),
        ("posix", "lock_timeout", False, "expected a number, not a boolean"),
        ("posix", "o_direct", 0, "expected true or false"),
        ("posix", "fsync", 1, "expected true or false"),
        ("top", "shards_per_block", True, "expected a number, not a boolean"),
    ],
)
def test_a_boolean_is_no_number_and_a_number_no_boolean(
    section: str, key: str, value: Any, problem: str
) -> None:
    # Pydantic's lax int and float took true as 1, and its lax bool took 0 as false.
    stack: dict[str, Any] = SMALL | {"tiers": [{"type": "posix", "path": "/x"}]}
    where = key
    if section == "buffer":
        stack["buffer"], where = {"capacity": "1MiB", key: value}, f"buffer.{key}"
    elif section == "posix":
        stack["tiers"], where = [{"type": "posix", "path": "/x", key: value}], f"tiers[0].{key}"
    else:
        stack[key] = value
    assert problems_of(stack) == [f"{where}: {problem} (got {value!r})"]


def test_a_number_of_seconds_may_be_an_integer() -> None:
    buffer = {"capacity": "1MiB", "wait_timeout_s": 5, "write_through_wait_s": 0}
    stack = parse_stack(SMALL | {"buffer": buffer})
    assert stack.load_settings.wait_timeout_s == 5.0
