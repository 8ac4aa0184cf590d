"""The ``ucm`` command line: validate, schema, demo, bench, stats, namespaces, purge, gc."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import cli_namespaces, cli_ops
from .errors import ConfigError, PluginError
from .sizes import format_size

if TYPE_CHECKING:
    from .config import TierConfig

app = typer.Typer(
    name="ucm",
    help="UCM: a layered, cascading cache for LLM KV-cache blocks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
errors = Console(stderr=True)


@app.command()
def validate(
    file: Annotated[Path, typer.Argument(help="YAML stack file to check.")],
) -> None:
    """Check a stack file; print its tiers, or each problem with its YAML path (exit 1)."""
    from .stack import load_stack

    try:
        stack = load_stack(file)
    except (ConfigError, PluginError) as exc:
        errors.print(f"[red]invalid:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    console.print(f"{file}: valid stack '{stack.unique_id}'", soft_wrap=True, highlight=False)
    table = Table()
    table.add_column("#", justify="right")
    table.add_column("type")
    table.add_column("settings")
    for position, tier in enumerate(stack.tiers):
        table.add_row(str(position), tier.type, _settings(tier))
    console.print(table)
    sizes = stack.resolved_tensor_sizes
    console.print(
        f"shard {format_size(stack.resolved_shard_size)} ({len(sizes)} tensor(s)), "
        f"{stack.shards_per_block} shards per block"
    )


@app.command()
def schema() -> None:
    """Print the JSON Schema of a stack (only JSON on stdout)."""
    from .stack import stack_json_schema

    sys.stdout.write(json.dumps(stack_json_schema(), indent=2) + "\n")


@app.command()
def demo(
    ranks: Annotated[int, typer.Option(min=1, max=16, help="Rank processes (TP size).")] = 4,
    requests: Annotated[int, typer.Option(min=1, help="Requests each rank serves.")] = 60,
    documents: Annotated[int, typer.Option(min=1, help="Distinct prompts (prefix trees).")] = 24,
    blocks: Annotated[int, typer.Option(min=2, help="Blocks in a full prompt.")] = 16,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 1,
    stack: Annotated[
        Path | None, typer.Option(help="Run on this stack file instead of the embedded one.")
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the results as JSON here.")
    ] = None,
) -> None:
    """Run a multi-rank prefix-caching workload and print hit rate and throughput."""
    from .demo import DemoSettings, run_demo

    settings = DemoSettings(
        ranks=ranks, requests=requests, documents=documents, blocks_per_document=blocks, seed=seed
    )
    cli_ops.check_outputs(("--json", json_out, False))
    stack_data = _demo_stack(stack, ranks) if stack is not None else None
    reports = run_demo(settings, stack=stack_data)
    table = Table(title=f"ucm demo: {ranks} ranks, {requests} requests each")
    for column in (
        "rank",
        "blocks",
        "hit blocks",
        "hit rate",
        "loaded",
        "load GB/s",
        "dumped",
        "dump GB/s",
        "verify errors",
    ):
        table.add_column(column, justify="right")
    failed = False
    totals = {"blocks": 0, "hits": 0, "loaded": 0, "load_s": 0.0, "dumped": 0, "dump_s": 0.0}
    for report in reports:
        failed |= bool(report.errors) or report.verify_errors > 0
        totals["blocks"] += report.blocks
        totals["hits"] += report.hit_blocks
        totals["loaded"] += report.loaded_bytes
        totals["load_s"] += report.load_seconds
        totals["dumped"] += report.dumped_bytes
        totals["dump_s"] += report.dump_seconds
        table.add_row(
            str(report.rank),
            str(report.blocks),
            str(report.hit_blocks),
            _rate(report.hit_blocks, report.blocks),
            format_size(report.loaded_bytes),
            _gbps(report.loaded_bytes, report.load_seconds),
            format_size(report.dumped_bytes),
            _gbps(report.dumped_bytes, report.dump_seconds),
            str(report.verify_errors),
        )
    table.add_row(
        "all",
        str(totals["blocks"]),
        str(totals["hits"]),
        _rate(int(totals["hits"]), int(totals["blocks"])),
        format_size(int(totals["loaded"])),
        _gbps(int(totals["loaded"]), totals["load_s"]),
        format_size(int(totals["dumped"])),
        _gbps(int(totals["dumped"]), totals["dump_s"]),
        str(sum(r.verify_errors for r in reports)),
        style="bold",
    )
    console.print(table)
    computed = totals["blocks"] - totals["hits"]
    console.print(
        f"KV blocks served from cache instead of recomputed: {totals['hits']} of "
        f"{totals['blocks']} ({_rate(int(totals['hits']), int(totals['blocks']))}); "
        f"computed {computed}."
    )
    for report in reports:
        for error in report.errors:
            errors.print(f"[red]rank {report.rank}:[/red] {error}", highlight=False)
    if json_out:
        from dataclasses import asdict

        with cli_ops.writing("--json", json_out) as written:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps([asdict(r) for r in reports], indent=2))
        failed |= not written
    if failed:
        raise typer.Exit(1)


def _demo_stack(path: Path, ranks: int) -> dict[str, Any]:
    """The mapping of ``ucm demo --stack``, checked before any rank starts: a file that cannot
    be read or is not a valid stack, or whose ``shards_per_block`` is not ``--ranks`` (the demo
    runs one rank per shard; left out, it is ``--ranks``), exits 2 naming the problem."""
    from .demo import shards_mismatch
    from .stack import parse_stack, read_stack_source

    try:
        data, name = read_stack_source(path)
        stack = {"shards_per_block": ranks, **data}
        config = parse_stack(stack, source=name)
        if config.shards_per_block != ranks:
            raise ConfigError(f"{name}: {shards_mismatch(config.shards_per_block, ranks)}")
    except (ConfigError, PluginError) as exc:
        errors.print(
            f"[red]invalid --stack:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(2) from None
    return stack


app.command("bench")(cli_ops.bench)
app.command("stats")(cli_ops.stats)
app.command("namespaces")(cli_namespaces.namespaces)
app.command("purge")(cli_namespaces.purge)


@app.command()
def gc(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Report what would be removed; remove nothing.")
    ] = False,
) -> None:
    """Remove what dead UCM processes left in /dev/shm; never touch a buffer a live process
    uses. Lists every name removed and kept, with counts (exit 1 on errors)."""
    from . import shm_gc

    report = shm_gc.collect(dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for verdict in report.verdicts:
        label = verb if verdict.action == "removed" else "kept"
        for path in verdict.paths:
            console.print(f"{label} {path} ({verdict.reason})", soft_wrap=True, highlight=False)
    for error in report.errors:
        errors.print(f"error: {escape(error)}", highlight=False, soft_wrap=True)
    removed_ids = sum(v.action == "removed" for v in report.verdicts)
    kept_ids = sum(v.action == "kept" for v in report.verdicts)
    console.print(
        f"{verb} {len(report.removed)} file(s) of {removed_ids} buffer(s); kept "
        f"{len(report.kept)} file(s) of {kept_ids} buffer(s); {len(report.errors)} error(s)",
        highlight=False,
        soft_wrap=True,
    )
    if report.errors:
        raise typer.Exit(1)


SETTING_CHARS_MAX = 200
"""Most characters ``ucm validate`` shows of one setting's value (a long one ends in ...)."""


def _settings(tier: TierConfig) -> str:
    """A tier's settings as ``key=value, ...``, each value cut while its repr is built: a
    mapping such as ``storage_options`` may be as large as the stack's YAML allows."""
    from pydantic import BaseModel

    from .stack import short_str

    parts = []
    for key in type(tier).model_fields:
        value = getattr(tier, key)
        if key == "type" or value is None:
            continue
        if isinstance(value, BaseModel):  # a small model of ours (codec, admit, breaker)
            value = tier.model_dump(include={key}, exclude_none=True)[key]
        parts.append(f"{key}={short_str(value, SETTING_CHARS_MAX)}")
    return ", ".join(parts)


def _rate(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _gbps(num_bytes: int, seconds: float) -> str:
    return f"{num_bytes / seconds / 1e9:.2f}" if seconds > 0 else "-"


def main() -> None:
    from . import shm_gc

    if sys.argv[1:2] != ["gc"]:  # a ucm start reclaims dead buffers' names (bounded)
        shm_gc.sweep_at_open(exclude=None)
    app()


if __name__ == "__main__":
    main()
