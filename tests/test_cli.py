"""The ``ucm`` command line, run as a real subprocess the way a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def ucm(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ucm.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_schema_prints_only_json_with_every_tier_type() -> None:
    result = ucm("schema")
    assert result.returncode == 0, result.stderr
    schema = json.loads(result.stdout)  # nothing but JSON on stdout
    assert schema["title"] == "StackConfig"
    assert set(schema["required"]) == {"unique_id", "shards_per_block"}  # tiers or buffer
    mapping = schema["properties"]["tiers"]["items"]["discriminator"]["mapping"]
    assert {"buffer", "posix", "fsspec"} <= set(mapping)  # `type: buffer` first still valid
    # ... and the buffer's own typed section.
    assert {"$ref": "#/$defs/BufferTierConfig"} in schema["properties"]["buffer"]["anyOf"]
    assert schema["$defs"]["BufferTierConfig"]["properties"]["type"]["const"] == "buffer"


def test_validate_accepts_a_good_stack(tmp_path: Path) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        "unique_id: demo\nshard_size: 256KiB\nshards_per_block: 8\n"
        f"tiers:\n  - type: posix\n    path: {tmp_path}/nvme\n    capacity: 1GiB\n"
    )
    result = ucm("validate", str(stack))
    assert result.returncode == 0, result.stderr
    assert "valid stack 'demo'" in result.stdout
    assert "shard 256.0 KiB (1 tensor(s)), 8 shards per block" in result.stdout


BUFFER_FORMS = {
    "section": "buffer:\n  capacity: 64MiB\n  load_workers: 3\ntiers:\n",
    "first tier": "tiers:\n  - type: buffer\n    capacity: 64MiB\n    load_workers: 3\n",
}


@pytest.mark.parametrize("form", sorted(BUFFER_FORMS))
def test_validate_accepts_the_buffer_as_its_section_or_as_the_first_tier(
    tmp_path: Path, form: str
) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        "unique_id: demo\nshard_size: 256KiB\nshards_per_block: 8\n"
        + BUFFER_FORMS[form]
        + f"  - type: posix\n    path: {tmp_path}/nvme\n"
    )
    result = ucm("validate", str(stack), env={**os.environ, "COLUMNS": "400"})  # no wrapping
    assert result.returncode == 0, result.stderr
    assert "valid stack 'demo'" in result.stdout
    rows = [line for line in result.stdout.splitlines() if " buffer " in line or " posix " in line]
    assert len(rows) == 2, result.stdout
    assert rows[0].split("│")[1:3] == [" 0 ", " buffer "], rows
    assert "capacity=67108864" in rows[0] and "load_workers=3" in rows[0]
    assert rows[1].split("│")[1:3] == [" 1 ", " posix  "], rows


def test_validate_refuses_a_buffer_given_twice_naming_the_tier(tmp_path: Path) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        "unique_id: demo\nshard_size: 256KiB\nshards_per_block: 8\n"
        "buffer:\n  capacity: 64MiB\ntiers:\n  - type: buffer\n    capacity: 64MiB\n"
    )
    result = ucm("validate", str(stack))
    assert result.returncode == 1
    assert (
        "tiers[0].type: a stack has one buffer, already given as the buffer section; remove "
        "this tier (got 'buffer')"
    ) in " ".join(result.stderr.split())


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "tiers:\n  - type: posix\n    path: /tmp/x\n    capcity: 1GiB\n",
            "tiers[0].capcity: unknown key (misspelled?); not allowed here",
        ),
        (
            "tiers:\n  - type: nvme\n",
            "tiers[0].type: unknown tier type 'nvme'; installed tier types:",
        ),
        (
            "tiers:\n  - type: posix\n    path: /tmp/x\n    capacity: 12 parsecs\n",
            "tiers[0].capacity: Value error, invalid size '12 parsecs'",
        ),
    ],
)
def test_validate_names_the_bad_key_and_exits_non_zero(
    tmp_path: Path, body: str, expected: str
) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text("unique_id: demo\nshard_size: 4096\nshards_per_block: 2\n" + body)
    result = ucm("validate", str(stack))
    assert result.returncode == 1
    assert expected in " ".join(result.stderr.split()), result.stderr


def test_validate_missing_file(tmp_path: Path) -> None:
    result = ucm("validate", str(tmp_path / "absent.yaml"))
    assert result.returncode == 1
    assert "cannot read stack file" in result.stderr


@pytest.mark.timeout(300)
def test_demo_runs_ranks_and_reports_hits_with_verified_bytes(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    # The README's demo install (`.[torch]`) has no numpy: make it unimportable here too.
    blocker = tmp_path / "no-numpy" / "numpy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n"
    )
    path = os.pathsep.join(filter(None, [str(blocker.parent), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    result = ucm(
        "demo",
        "--ranks",
        "2",
        "--requests",
        "12",
        "--documents",
        "3",
        "--blocks",
        "6",
        "--json",
        str(out),
        timeout=280,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "KV blocks served from cache instead of recomputed" in result.stdout
    reports = json.loads(out.read_text())
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["errors"] == [] and report["verify_errors"] == 0
        assert report["requests"] == 12
        # 3 documents and 12 requests: most prefixes repeat, so most blocks are hits.
        assert report["hit_blocks"] > report["blocks"] // 2
        assert report["loaded_bytes"] == report["hit_blocks"] * 256 * 1024


def test_validate_shows_a_huge_setting_cut(tmp_path: Path) -> None:
    # 6,000 storage options of 10 items (aliases within the limit): the table shows a few.
    stack = tmp_path / "stack.yaml"
    options = "".join(f"      k{i}: &v{i} [x, x, x, x, x, x, x, x, x, x]\n" for i in range(3000))
    options += "".join(f"      m{i}: *v{i}\n" for i in range(3000))
    stack.write_text(
        "unique_id: big\nshard_size: 4096\nshards_per_block: 1\ntiers:\n"
        "  - type: fsspec\n    url: memory://big\n    storage_options:\n" + options
    )
    result = ucm("validate", str(stack))
    assert result.returncode == 0, result.stderr
    assert "storage_options={'k0':" in result.stdout
    assert "'k8'" not in result.stdout
    assert len(result.stdout) < 4000


@pytest.mark.parametrize(
    ("name", "content", "problem"),
    [
        ("missing.yaml", None, "cannot read stack file '{path}': No such file or directory"),
        ("adir", "dir", "cannot read stack file '{path}': Is a directory"),
        ("n.yaml", b"unique_id: x\n\xff", "cannot read stack file '{path}': not UTF-8 text"),
        ("bad.yaml", b"tiers: [\n", "{path}: not valid YAML: "),
        ("list.yaml", b"- a\n", "{path}: a stack must be a mapping, got list"),
        ("empty.yaml", b"", "{path}: a stack must be a mapping, got an empty file"),
        (
            "size.yaml",
            b"unique_id: d\nshard_size: 12XB\nbuffer: {capacity: 1MiB}\n",
            "{path}: invalid stack:\n  shard_size: Value error, invalid size '12XB'",
        ),
        (
            "spb.yaml",
            b"unique_id: d\nshard_size: 4096\nshards_per_block: 1\nbuffer: {capacity: 1MiB}\n",
            "{path}: shards_per_block is 1, but --ranks is 2: the demo runs one rank per shard; "
            "give --ranks 1, or leave shards_per_block out of the stack",
        ),
    ],
)
def test_demo_refuses_a_bad_stack_file_before_running(
    tmp_path: Path, name: str, content: bytes | str | None, problem: str
) -> None:
    # Each was a traceback (or, for the empty file, a run on the embedded stack, exit 0; for
    # shards_per_block, a run that silently overwrote it with --ranks).
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    result = ucm("demo", "--ranks", "2", "--stack", str(path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("invalid --stack: " + problem.format(path=path))
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_demo_runs_on_a_stack_file_without_shards_per_block(tmp_path: Path) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        f"unique_id: demo-{os.getpid()}\nshard_size: 8192\nbuffer: {{capacity: 1MiB}}\n"
        f"tiers: [{{type: posix, path: {tmp_path / 'disk'}}}]\n"
    )
    args = ("--requests", "4", "--documents", "2", "--blocks", "4")
    result = ucm("demo", "--ranks", "2", "--stack", str(stack), *args, timeout=200)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "KV blocks served from cache instead of recomputed" in result.stdout


@pytest.mark.parametrize(
    ("command", "option", "target", "problem"),
    [
        ("bench", "--json", "adir", "a directory; give a file to write"),
        ("bench", "--markdown", "adir", "a directory; give a file to write"),
        (
            "bench",
            "--json",
            "afile/r.json",
            "'{tmp}/afile' is not a directory; give a file to write",
        ),
        ("bench", "--plot", "afile", "not a directory; give a directory to write into"),
        ("bench", "--workdir", "afile", "not a directory; give a directory to write into"),
        ("demo", "--json", "adir", "a directory; give a file to write"),
    ],
)
def test_a_bad_output_path_is_refused_before_the_run(
    tmp_path: Path, command: str, option: str, target: str, problem: str
) -> None:
    # Each was a traceback after the whole run, its results lost.
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    path = tmp_path / target
    quick = ["--quick", "--only", "futex_wake"] if command == "bench" else ["--requests", "2"]
    result = ucm(command, *quick, option, str(path), timeout=200)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == f"error: {option} {str(path)!r}: {problem.format(tmp=tmp_path)}\n"
    assert result.stdout == ""  # nothing ran
