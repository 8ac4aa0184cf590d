"""The runtime-integration example runs and saves compute; the example stacks validate (and the
one-node stack runs, with its paths and sizes scaled down)."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import torch
import yaml

import ucm
from ucm.native import segments

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_decode_loop_loads_cached_prefixes_and_reports_the_saving() -> None:
    script = EXAMPLES / "runtime-integration" / "decode_loop.py"
    completed = subprocess.run(
        [sys.executable, str(script), "--requests", "5", "--decode", "2", "--verify"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.splitlines()
    # 5 requests of 9 blocks: a 3-block system prompt shared by all, 3 documents of 5 blocks.
    assert lines[0].startswith("request  0: 9 blocks, 0 loaded from UCM, 9 prefilled")
    assert lines[1].startswith("request  1: 9 blocks, 3 loaded from UCM, 6 prefilled")
    assert lines[3].startswith("request  3: 9 blocks, 8 loaded from UCM, 1 prefilled")
    summary = lines[-1]
    match = re.match(
        r"saved (\d+) of (\d+) block prefills \((\d+)%\): ~(\d+) ms of compute", summary
    )
    assert match is not None, summary
    assert (int(match.group(1)), int(match.group(2))) == (0 + 3 + 3 + 8 + 8, 45)
    assert int(match.group(4)) > 0


def test_example_stacks_validate() -> None:
    one = ucm.load_stack(EXAMPLES / "stacks" / "one-node.yaml")
    assert [tier.type for tier in one.tiers] == ["buffer", "posix"]
    assert one.shards_per_block == 8 and one.resolved_shard_size == 262144
    many = ucm.load_stack(EXAMPLES / "stacks" / "many-nodes.yaml")
    assert [tier.type for tier in many.tiers] == ["buffer", "mooncake", "posix", "fsspec"]
    assert [getattr(tier, "write", None) for tier in many.tiers] == [
        None,
        "through",
        "through",
        "back",
    ]
    assert many.tiers[2].promote is True  # type: ignore[attr-defined]
    for path in (EXAMPLES / "stacks").glob("*.yaml"):
        completed = subprocess.run(
            [sys.executable, "-m", "ucm.cli", "validate", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert completed.returncode == 0, completed.stdout + completed.stderr


def test_one_node_stack_runs_scaled_down(tmp_path: Path) -> None:
    data = yaml.safe_load((EXAMPLES / "stacks" / "one-node.yaml").read_text())
    data["unique_id"] = f"ex-{uuid.uuid4().hex[:10]}"
    data["tiers"][0].update(capacity="8MiB", reserved_slots=4)
    data["tiers"][1].update(path=str(tmp_path / "nvme"), capacity="64MiB")
    ids = [bytes([i]) * 16 for i in range(4)]
    try:
        with ucm.open(data, device_id=3, local_rank_size=8) as store:
            src = [
                [
                    torch.full((131072,), i, dtype=torch.uint8),
                    torch.full((131072,), 9, dtype=torch.uint8),
                ]
                for i in range(4)
            ]
            store.wait(store.dump(ids, 3, src))
            dst = [[torch.zeros(131072, dtype=torch.uint8) for _ in range(2)] for _ in ids]
            store.wait(store.load(ids, 3, dst))
            assert all(
                torch.equal(a, b)
                for s, d in zip(src, dst, strict=True)
                for a, b in zip(s, d, strict=True)
            )
    finally:
        segments.unlink(data["unique_id"])
