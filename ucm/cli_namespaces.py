"""``ucm namespaces`` and ``ucm purge``: usage per namespace and tier, and removing one
namespace's blocks from every tier. Registered on the typer app in ``ucm.cli``."""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .errors import ConfigError, PluginError, UcmError
from .sizes import format_size

if TYPE_CHECKING:
    from .stack import StackConfig
    from .store import Store

errors = Console(stderr=True)


def _stack(path: Path) -> StackConfig:
    """The stack at ``path`` as ``ucm stats`` reads it (the live CacheBuffer's geometry when
    its top tier is a buffer); when no buffer of its ``unique_id`` is live, the stack without
    its buffer tier (nothing is cached there), whose geometry the stack must then state."""
    from .cli_ops import NoLiveBuffer, live_stack
    from .stack import parse_stack, read_stack_source

    try:
        return live_stack(path)
    except NoLiveBuffer:
        pass
    data, name = read_stack_source(path)
    data = dict(data)
    data.pop("buffer", None)
    tiers = data.get("tiers")
    if (
        isinstance(tiers, list)
        and tiers
        and isinstance(tiers[0], dict)
        and tiers[0].get("type") == "buffer"
    ):
        data["tiers"] = tiers[1:]
    if not data.get("tiers"):
        raise ConfigError(
            f"{name}: no live CacheBuffer for this stack's unique_id and no tier below it: "
            "nothing holds any block"
        )
    return parse_stack(data, source=name)


def _open(path: Path, cleanup: ExitStack) -> Store:
    from .store import Store

    try:
        config = _stack(path)
        return cleanup.enter_context(Store(config, device_id=-1))
    except (ConfigError, PluginError) as exc:
        errors.print(f"[red]invalid:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except UcmError as exc:
        errors.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def namespaces(
    stack: Annotated[Path, typer.Argument(help="YAML stack file.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List the shards and bytes each namespace holds in each tier.

    Attaches to the stack's live CacheBuffer (if any) as the scheduler role and lists every
    lower tier's key space. A tier that cannot list its keys (Mooncake Store) shows "-"."""
    with ExitStack() as cleanup:
        store = _open(stack, cleanup)
        try:
            usage = store.namespaces()
        except UcmError as exc:
            errors.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        labels = [f"{tier.label} ({tier.type_name})" for tier in store.tiers]
        shard_size = store.layout.shard_size
    if json_out:
        out = {
            "tiers": labels,
            "shard_size": shard_size,
            "namespaces": {
                name: [
                    None if n is None else {"shards": n, "bytes": n * shard_size} for n in counts
                ]
                for name, counts in usage.items()
            },
        }
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
        return
    table = Table(title=f"namespaces of {stack}: shards (bytes) per tier")
    table.add_column("namespace")
    for label in labels:
        table.add_column(label, justify="right")
    for name, counts in usage.items():
        cells = ["-" if n is None else f"{n} ({format_size(n * shard_size)})" for n in counts]
        table.add_row(name, *cells)
    Console().print(table)
    if not usage:
        Console().print("no blocks in any tier", highlight=False)


def purge(
    stack: Annotated[Path, typer.Argument(help="YAML stack file.")],
    namespace: Annotated[str, typer.Argument(help="The namespace whose blocks to remove.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Remove every block of NAMESPACE from every tier (batched; pinned and in-use shards too)
    and print how many shards each tier removed."""
    from .namespaces import check_namespace

    try:
        check_namespace(namespace, "NAMESPACE")
    except UcmError as exc:
        errors.print(f"[red]invalid:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    with ExitStack() as cleanup:
        store = _open(stack, cleanup)
        try:
            removed = store.purge(namespace)
        except UcmError as exc:
            errors.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        labels = [f"{tier.label} ({tier.type_name})" for tier in store.tiers]
    if json_out:
        out = {"namespace": namespace, "removed": dict(zip(labels, removed, strict=True))}
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
        return
    console = Console()
    for label, count in zip(labels, removed, strict=True):
        console.print(f"{label}: removed {count} shard(s)", highlight=False, soft_wrap=True)
    console.print(
        f"purged namespace {namespace!r}: {sum(removed)} shard(s) removed from "
        f"{len(labels)} tier(s)",
        highlight=False,
        soft_wrap=True,
    )
