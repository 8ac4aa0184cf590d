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
    assert set(schema["required"]) >= {"unique_id", "shards_per_block", "tiers"}
    mapping = schema["properties"]["tiers"]["items"]["discriminator"]["mapping"]
    assert {"posix", "fsspec"} <= set(mapping)


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
