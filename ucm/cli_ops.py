"""``ucm bench`` and ``ucm stats``: the numbers users choose a cache by, and a live view of a
running CacheBuffer. Registered on the typer app in ``ucm.cli``."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .errors import ConfigError, InvalidArgumentError, PluginError, UcmError
from .sizes import format_size

if TYPE_CHECKING:
    from .bench import Benchmark
    from .bench._runner import BenchOutcome, SuiteReport
    from .metrics import Snapshot
    from .stack import StackConfig

errors = Console(stderr=True)


def _stdout() -> Console:
    # Piped output (CI logs, tests) still gets a table wide enough to read.
    return Console() if sys.stdout.isatty() else Console(width=160)


# ---- ucm bench -----------------------------------------------------------------------------------


def bench(
    quick: Annotated[
        bool, typer.Option("--quick", help="Small sizes: the whole suite in under 2 minutes.")
    ] = False,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write machine info and every figure here.")
    ] = None,
    plot_dir: Annotated[
        Path | None, typer.Option("--plot", help="Write each result's plots as PNGs here.")
    ] = None,
    only: Annotated[
        list[str] | None,
        typer.Option("--only", help="Run only this benchmark (repeatable; see --list)."),
    ] = None,
    markdown_out: Annotated[
        Path | None,
        typer.Option("--markdown", help="Also write the results as a Markdown table here."),
    ] = None,
    list_only: Annotated[
        bool, typer.Option("--list", help="List the benchmarks and exit.")
    ] = False,
    workdir: Annotated[
        Path | None,
        typer.Option(help="Scratch directory on a real filesystem (default: the system temp)."),
    ] = None,
) -> None:
    """Run every benchmark: each figure beside its same-run baseline, as a ratio."""
    import tempfile

    from .bench import discover
    from .bench._runner import SuiteReport, machine_info, run_one, select, write_plots

    console = _stdout()
    check_outputs(
        ("--json", json_out, False),
        ("--markdown", markdown_out, False),
        ("--plot", plot_dir, True),
        ("--workdir", workdir, True),
    )
    benchmarks = discover()
    if list_only:
        for benchmark in benchmarks:
            sys.stdout.write(f"{benchmark.name}\t{benchmark.title}\n")
        return
    try:
        chosen = select(benchmarks, only or [])
    except ValueError as exc:
        errors.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if not chosen:
        errors.print("[red]error:[/red] no benchmarks found in ucm.bench", highlight=False)
        raise typer.Exit(1)
    if plot_dir is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            errors.print(
                "[red]error:[/red] --plot needs matplotlib: pip install 'ucm[bench]'",
                highlight=False,
            )
            raise typer.Exit(2) from None
    if workdir is not None:
        with writing("--workdir", workdir) as made:
            workdir.mkdir(parents=True, exist_ok=True)
        if not made:
            raise typer.Exit(2)
    report = SuiteReport(quick=quick, machine=machine_info(), started_at=time.time())
    console.print(_machine_table(report.machine))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ucm-bench-", dir=workdir) as scratch:
        for outcome in _run_with_progress(chosen, quick, Path(scratch), run_one):
            report.outcomes.append(outcome)
    report.seconds = time.perf_counter() - started
    console.print(_results_table(report))
    _print_notes(console, report)
    # The paths were checked before the run; one that fails now (a full disk, a file system
    # gone read-only) is reported and the other outputs are still written.
    unwritten = False
    if plot_dir is not None:
        taken: set[str] = set()
        with writing("--plot", plot_dir) as ok:
            for outcome in report.outcomes:
                write_plots(outcome, plot_dir, taken)
        unwritten |= not ok
    if json_out is not None:
        with writing("--json", json_out) as ok:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps(report.to_json(), indent=2, allow_nan=False) + "\n")
            console.print(f"JSON: {json_out}", highlight=False)
        unwritten |= not ok
    if markdown_out is not None:
        from .bench._runner import markdown_report

        with writing("--markdown", markdown_out) as ok:
            markdown_out.parent.mkdir(parents=True, exist_ok=True)
            markdown_out.write_text(markdown_report(report, relative_to=markdown_out.parent))
            console.print(f"Markdown: {markdown_out}", highlight=False)
        unwritten |= not ok
    for outcome in report.failed:
        errors.print(
            f"[red]FAILED[/red] {escape(outcome.name)}: {escape(outcome.error or '')}",
            highlight=False,
            soft_wrap=True,
        )
    if report.failed or unwritten:
        raise typer.Exit(1)


class _Written:
    """Whether a :func:`writing` block wrote its output (truthy) or failed."""

    def __init__(self) -> None:
        self.ok = True

    def __bool__(self) -> bool:
        return self.ok


@contextmanager
def writing(option: str, path: Path) -> Iterator[_Written]:
    """Runs a block that writes ``option``'s ``path``; an OSError in it is printed as an
    error naming the option and path (no traceback), and the result is falsy."""
    written = _Written()
    try:
        yield written
    except OSError as exc:
        written.ok = False
        problem = f"{option} {str(path)!r}: cannot write: {exc.strerror or exc}"
        errors.print(f"[red]error:[/red] {escape(problem)}", highlight=False, soft_wrap=True)


def output_problem(path: Path, option: str, directory: bool = False) -> str | None:
    """Why ``option``'s ``path`` cannot be written (None: it can): a file to write (or, with
    ``directory``, a directory to create or fill) whose missing parents are made. Checked
    before a run, so that a bad path never costs the run's results."""
    shown = f"{option} {str(path)!r}"
    want = "a directory to write into" if directory else "a file to write"
    try:
        if path.exists() and path.is_dir() != directory:
            what = "a directory" if path.is_dir() else "not a directory"
            return f"{shown}: {what}; give {want}"
        probe = path
        while not probe.exists():
            probe = probe.parent
        if probe != path and not probe.is_dir():
            return f"{shown}: {str(probe)!r} is not a directory; give {want}"
        if not os.access(probe, os.W_OK | (os.X_OK if probe.is_dir() else 0)):
            return f"{shown}: {str(probe)!r} is not writable; give {want} in a writable place"
    except OSError as exc:
        return f"{shown}: {exc.strerror}; give {want}"
    return None


def check_outputs(*outputs: tuple[str, Path | None, bool]) -> None:
    """Exits 2 naming the first (option, path, is a directory) whose path cannot be written
    (:func:`output_problem`); a None path is not given."""
    for option, path, directory in outputs:
        problem = None if path is None else output_problem(path, option, directory)
        if problem is not None:
            errors.print(f"[red]error:[/red] {escape(problem)}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)


def _run_with_progress(
    benchmarks: Sequence[Benchmark], quick: bool, scratch: Path, run_one: Any
) -> list[BenchOutcome]:
    """Runs each benchmark under a progress bar on stderr: the bar counts benchmarks, the line
    shows the current one's latest progress message."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    outcomes: list[BenchOutcome] = []
    if not errors.is_terminal:
        # Logs (CI, pipes): a plain line per step instead of a live bar nobody sees redrawn.
        for index, benchmark in enumerate(benchmarks, start=1):
            prefix = f"[{index}/{len(benchmarks)}] {benchmark.name}"
            errors.print(f"{prefix}: starting", highlight=False, markup=False)

            def log(message: str, prefix: str = prefix) -> None:
                errors.print(f"{prefix}: {message}", highlight=False, markup=False)

            outcome = run_one(benchmark, quick=quick, workdir=scratch, progress=log)
            status = f"FAILED ({outcome.error})" if outcome.failed else "done"
            log(f"{status} in {outcome.seconds:.1f} s")
            outcomes.append(outcome)
        return outcomes
    progress = Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.fields[current]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[message]}"),
        console=errors,
        transient=False,
    )
    with progress:
        task = progress.add_task("bench", total=len(benchmarks), current="", message="")
        for benchmark in benchmarks:
            progress.update(task, current=benchmark.name, message="starting")

            def show(message: str) -> None:
                progress.update(task, message=escape(message[:80]))

            outcome = run_one(benchmark, quick=quick, workdir=scratch, progress=show)
            status = f"failed ({outcome.error})" if outcome.failed else "done"
            progress.update(task, advance=1, message=escape(f"{status} in {outcome.seconds:.1f} s"))
            outcomes.append(outcome)
        progress.update(task, current="all", message="")
    return outcomes


def _machine_table(machine: dict[str, Any]) -> Table:
    table = Table(title="machine", show_header=False)
    table.add_column("what")
    table.add_column("value")
    memory = machine.get("memory_bytes")
    shm = machine.get("dev_shm_bytes")
    rows = (
        ("CPU", str(machine.get("cpu_model"))),
        ("cores", f"{machine.get('cores')} ({machine.get('cores_usable')} usable)"),
        ("memory", format_size(memory) if memory else "?"),
        ("/dev/shm", format_size(shm) if shm else "?"),
        ("kernel", f"{machine.get('os')} {machine.get('kernel')} {machine.get('machine')}"),
        ("python", str(machine.get("python"))),
        ("torch", str(machine.get("torch") or "not installed")),
        ("load (1 min)", f"{machine.get('loadavg_1m'):.2f}" if machine.get("loadavg_1m") else "?"),
    )
    for name, value in rows:
        table.add_row(name, escape(value))
    return table


def _results_table(report: SuiteReport) -> Table:
    from .bench._runner import format_number

    title = "ucm bench" + (" --quick" if report.quick else "")
    table = Table(title=title, show_lines=False)
    # Numbers never wrap; the prose columns share what is left, the figure name most.
    table.add_column("benchmark", no_wrap=True)
    table.add_column("figure", ratio=3)
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("baseline", ratio=2)
    table.add_column("baseline value", justify="right", no_wrap=True)
    table.add_column("ratio", justify="right", no_wrap=True)
    table.add_column("target", ratio=2)
    table.add_column("met", justify="center", no_wrap=True)
    for outcome in report.outcomes:
        figures = outcome.result.figures if outcome.result is not None else []
        label = f"{outcome.name}\n[dim]{outcome.seconds:.1f} s[/dim]"
        if outcome.over_budget:
            label = f"{outcome.name}\n[yellow]{outcome.seconds:.1f} s (over budget)[/yellow]"
        if outcome.failed:
            table.add_row(
                label,
                f"[red]FAILED[/red]: {escape(outcome.error or '')}",
                *[""] * 6,
                end_section=True,
            )
            continue
        for index, figure in enumerate(figures):
            met = figure.met
            mark = "–" if met is None else ("[green]✓[/green]" if met else "[red]✗[/red]")
            table.add_row(
                label if index == 0 else "",
                escape(figure.name),
                escape(f"{format_number(figure.value)} {figure.unit}"),
                escape(figure.baseline),
                escape(f"{format_number(figure.baseline_value)} {figure.unit}"),
                f"{figure.ratio:.2f}×",
                escape(figure.target or ""),
                mark,
                end_section=index == len(figures) - 1,
            )
    return table


def _print_notes(console: Console, report: SuiteReport) -> None:
    for outcome in report.outcomes:
        notes = outcome.result.notes if outcome.result is not None else []
        for note in notes:
            console.print(
                f"[bold]{escape(outcome.name)}[/bold]: {escape(note)}",
                soft_wrap=True,
                highlight=False,
            )
        for path in outcome.plot_paths:
            console.print(f"[dim]{escape(outcome.name)} plot: {escape(path)}[/dim]", soft_wrap=True)
    summary = report.to_json()["summary"]
    line = (
        f"{summary['figures']} figures from {summary['benchmarks']} benchmarks; targets met "
        f"{summary['targets_met']}, missed {summary['targets_missed']}; "
        f"{len(summary['failed'])} failed; {report.seconds:.1f} s"
    )
    if report.budget_s is not None:
        verdict = "within" if report.seconds <= report.budget_s else "[red]over[/red]"
        line += f" ({verdict} the {report.budget_s:.0f} s quick budget)"
    console.print(line, highlight=False)


# ---- ucm stats -----------------------------------------------------------------------------------


def stats(
    stack: Annotated[Path, typer.Argument(help="YAML stack file of the running ranks.")],
    watch: Annotated[
        bool, typer.Option("--watch", help="Refresh until Ctrl-C (or --count refreshes).")
    ] = False,
    interval: Annotated[
        float, typer.Option(min=0.05, max=3600.0, help="Seconds between refreshes.")
    ] = 2.0,
    count: Annotated[
        int | None,
        typer.Option(min=1, help="Stop after this many readings (with --watch or --serve)."),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print JSON (one line per reading with --watch).")
    ] = False,
    serve: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=65535,
            help="Also serve Prometheus metrics on 127.0.0.1:PORT (0 picks one) until Ctrl-C.",
        ),
    ] = None,
    by_namespace: Annotated[
        bool,
        typer.Option(
            "--by-namespace",
            help="Also show each namespace's slots, bytes, guarantee, cap, hits, misses and "
            "evictions (node-wide), and its bytes and evictions on each lower tier (--json "
            "always has them).",
        ),
    ] = False,
) -> None:
    """Attach to a live CacheBuffer as the scheduler role and show its counters.

    The shard geometry and capacity come from the live buffer's header, so the stack an engine
    was given (``unique_id`` and ``tiers`` only, as for vLLM) works as it is."""
    from . import metrics
    from .store import Store

    try:
        config = live_stack(stack)
    except (ConfigError, PluginError) as exc:
        errors.print(f"[red]invalid:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except NoLiveBuffer as exc:
        errors.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    console = _stdout()
    with ExitStack() as cleanup:
        try:
            store = cleanup.enter_context(Store(config, device_id=-1))
        except UcmError as exc:
            errors.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        region = store.buffer.region if store.buffer is not None else None
        if region is not None and (region.created or region.replaced_stale):
            errors.print(
                f"[red]error:[/red] no live CacheBuffer for unique_id {config.unique_id!r}: "
                "every rank that used it has exited",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1)
        if serve is not None:
            try:
                server = cleanup.enter_context(metrics.serve(store, port=serve))
            except UcmError as exc:  # the port is taken, or not ours to bind
                errors.print(
                    f"[red]error:[/red] --serve {serve}: {escape(str(exc))}",
                    highlight=False,
                    soft_wrap=True,
                )
                raise typer.Exit(2) from None
            errors.print(f"serving Prometheus metrics on {server.url}", highlight=False)
        readings = count if count is not None else (None if watch or serve is not None else 1)
        _stats_loop(console, store, readings, interval, json_out, watch, by_namespace)


class NoLiveBuffer(Exception):
    """No CacheBuffer of the stack's unique_id is published on this node."""


def live_stack(path: Path) -> StackConfig:
    """The stack at ``path``, with the geometry of the live CacheBuffer of its ``unique_id``
    when its top tier is ``buffer``: the shard size and the slot counts (regular, reserved)
    from the buffer's header. A stack for an engine states only ``unique_id`` and ``tiers``
    (the engine derives the geometry from its KV cache); one that states a shard size other
    than the live buffer's is refused. ``shards_per_block`` is not recorded in the buffer and
    nothing ``ucm stats`` reads depends on it: 1 unless the stack states it."""
    from .native.buffer import live_geometry
    from .native.segments import ctrl_path
    from .stack import parse_stack, read_stack_source

    data, name = read_stack_source(path)
    tiers = data.get("tiers")
    tiers = tiers if isinstance(tiers, list) else []
    section = data.get("buffer")
    # The buffer: its own section, or the first tier (``parse_stack`` refuses both at once).
    top = section if section is not None else (tiers[0] if tiers else None)
    unique_id = data.get("unique_id")
    if not (
        isinstance(top, Mapping)
        and (section is not None or top.get("type") == "buffer")
        and isinstance(unique_id, str)
    ):
        return parse_stack(data, source=name)
    try:
        control = ctrl_path(unique_id)
    except InvalidArgumentError:
        return parse_stack(data, source=name)  # the stack's own error names the bad unique_id
    # A bad stack is a config error whether or not its buffer is live: checked first, with the
    # geometry the live buffer gives (when the stack leaves it out) stood in for by 1 byte.
    _merge_geometry(data, section is not None, top, tiers, shard_size=1, capacity=None, name=name)
    try:
        geometry = live_geometry(unique_id)
    except FileNotFoundError:
        raise NoLiveBuffer(
            f"no live CacheBuffer for unique_id {unique_id!r}: {control} does not exist; start "
            "a rank that opens this stack first (an engine with UCM attached, or ucm.open with "
            "device_id >= 0): `ucm stats` attaches to a running buffer and never creates one"
        ) from None
    except InvalidArgumentError as exc:
        raise ConfigError(f"{name}: unique_id {unique_id!r}: {exc}") from None
    config = _merge_geometry(
        data,
        section is not None,
        top,
        tiers,
        shard_size=geometry.shard_size_bytes,
        capacity=(
            geometry.slot_count_regular * geometry.shard_size_bytes,
            geometry.slot_count_reserved,
        ),
        name=name,
    )
    if config.resolved_shard_size != geometry.shard_size_bytes:
        raise ConfigError(
            f"{name}: the stack states a shard size of {config.resolved_shard_size} bytes, but "
            f"the live CacheBuffer {unique_id!r} holds shards of {geometry.shard_size_bytes} "
            "bytes (from its header); leave shard_size and tensor_size_list out of the stack: "
            "`ucm stats` reads them from the live buffer"
        )
    return config


def _merge_geometry(
    data: Mapping[str, Any],
    in_section: bool,
    top: Mapping[str, Any],
    tiers: list[Any],
    shard_size: int,
    capacity: tuple[int, int] | None,
    name: str = "stack",
) -> StackConfig:
    """``data`` validated with ``shard_size`` where it states no geometry, 1 shard per block
    unless it states one, and the buffer's (capacity, reserved slots) set to ``capacity``
    (None: as stated, 1 byte when not)."""
    from .stack import parse_stack

    merged = dict(data)
    if merged.get("shard_size") is None and merged.get("tensor_size_list") is None:
        merged["shard_size"] = shard_size
    merged.setdefault("shards_per_block", 1)
    if capacity is not None:
        live_top = {**top, "capacity": capacity[0], "reserved_slots": capacity[1]}
    else:
        live_top = {"capacity": 1, **top}
    if in_section:
        merged["buffer"] = live_top
    else:
        merged["tiers"] = [live_top, *tiers[1:]]
    return parse_stack(merged, source=name)


def _stats_loop(
    console: Console,
    store: Any,
    readings: int | None,
    interval: float,
    json_out: bool,
    watch: bool,
    by_namespace: bool = False,
) -> None:
    """Takes ``readings`` snapshots ``interval`` apart (None: until Ctrl-C). With ``watch`` each
    one is shown (rich Live, or one JSON line each); otherwise only the first is, and the loop
    only keeps the metrics endpoint up."""
    from rich.live import Live

    from .metrics import snapshot

    previous: Snapshot | None = None
    taken = 0
    with ExitStack() as cleanup:
        live = watch and not json_out
        view = cleanup.enter_context(Live(console=console, auto_refresh=False)) if live else None
        try:
            while readings is None or taken < readings:
                if taken:
                    time.sleep(interval)
                if taken and not watch:
                    taken += 1
                    continue
                # The first reading waits (bounded) for the lower tiers' first per-namespace
                # scans; later ones show what the tiers know, like a scrape.
                shot = snapshot(store, scan_wait_s=0.0 if taken else FIRST_SCAN_WAIT_S)
                taken += 1
                if json_out:
                    text = json.dumps(shot.to_json(), indent=None if watch else 2)
                    sys.stdout.write(text + "\n")
                    sys.stdout.flush()
                elif view is not None:
                    view.update(stats_view(shot, previous, by_namespace), refresh=True)
                else:
                    console.print(stats_view(shot, previous, by_namespace))
                previous = shot
        except KeyboardInterrupt:
            pass


FIRST_SCAN_WAIT_S = 30.0
"""How long ``ucm stats`` waits for the lower tiers' first per-namespace scans."""


def stats_view(
    shot: Snapshot, previous: Snapshot | None = None, by_namespace: bool = False
) -> RenderableType:
    """The rich rendering of a snapshot; with ``previous``, counters also show a rate per second;
    with ``by_namespace``, a table of each namespace's node-wide figures."""
    parts: list[RenderableType] = []
    stamp = time.strftime("%H:%M:%S", time.localtime(shot.taken_at))
    if shot.buffer is not None and shot.occupancy is not None:
        occupancy = shot.occupancy
        hit_rate = shot.hit_rate
        summary = Table(
            title=f"CacheBuffer {shot.unique_id!r} at {stamp}: node-wide, shared by every rank",
            show_header=False,
        )
        summary.add_column("what")
        summary.add_column("value", justify="right")
        summary.add_row(
            "occupancy",
            f"{occupancy.resident} / {occupancy.capacity_slots} slots "
            f"({100 * occupancy.resident_fraction:.1f}%)",
        )
        summary.add_row(
            "reserved pool", f"{occupancy.resident_reserved} / {occupancy.reserved_slots} resident"
        )
        summary.add_row("hit rate", "-" if hit_rate is None else f"{100 * hit_rate:.1f}%")
        if shot.attached_pids is not None:
            pids = ", ".join(map(str, shot.attached_pids[:8]))
            more = "…" if len(shot.attached_pids) > 8 else ""
            summary.add_row(
                "processes attached", f"{len(shot.attached_pids)} (pids {pids or '-'}{more})"
            )
        summary.add_row("waiters now", str(occupancy.waiters))
        summary.add_row("filling now", str(occupancy.filling))
        summary.add_row("in use now", str(occupancy.in_use))
        summary.add_row("preallocated (unclaimed)", str(occupancy.preallocated))
        summary.add_row("free", str(occupancy.free))
        summary.add_row("detached", str(occupancy.detached))
        counters = Table(title="CacheBuffer counters (node-wide, since creation)")
        counters.add_column("counter")
        counters.add_column("value", justify="right")
        rate = previous is not None and previous.buffer is not None
        if rate:
            counters.add_column("per s", justify="right")
        elapsed = shot.taken_at - previous.taken_at if previous is not None else 0.0
        for name, value in shot.buffer.items():
            row = [name, str(value)]
            if rate and previous is not None and previous.buffer is not None:
                delta = value - previous.buffer.get(name, 0)
                row.append(f"{delta / elapsed:.1f}" if elapsed > 0 else "-")
            counters.add_row(*row)
        # Side by side: the whole view fits a terminal, which --watch redraws in place.
        side_by_side = Table.grid(padding=(0, 2))
        side_by_side.add_row(summary, counters)
        parts.append(side_by_side)
    else:
        parts.append(Text("This stack has no buffer tier: no node-wide counters to show."))
    tiers = Table(
        title=(
            f"tiers as seen by this process (pid {shot.pid}, the scheduler role): its own "
            "counters, not the ranks'"
        )
    )
    tiers.add_column("#", justify="right")
    tiers.add_column("type")
    tiers.add_column("counters")
    for position, tier in enumerate(shot.tiers):
        values = ", ".join(
            f"{name}={_stat(value)}" for name, value in tier.items() if name not in ("type", "name")
        )
        tiers.add_row(str(position), escape(str(tier.get("type"))), escape(values))
    parts.append(tiers)
    if by_namespace:
        parts.append(namespace_view(shot))
    return Group(*parts)


NAMESPACE_COLUMNS = (
    "occupancy_slots",
    "occupancy_bytes",
    "guarantee_slots",
    "cap_slots",
    "hits",
    "misses",
    "evictions",
)


def namespace_view(shot: Snapshot) -> RenderableType:
    """Each namespace's CacheBuffer figures (node-wide), the most slots first, then each
    namespace's bytes and evictions on the lower tiers."""
    buffer = _buffer_namespace_view(shot)
    if not shot.namespace_tiers:
        return buffer
    return Group(buffer, tier_namespace_view(shot))


def tier_namespace_view(shot: Snapshot) -> RenderableType:
    """Each namespace's bytes on each lower tier ("-": the tier cannot tell, or has not
    finished its first scan) and this process's evictions of its shards there, the most
    bytes first."""
    table = Table(
        title="namespaces in the lower tiers (bytes: as of each tier's last scan; evictions: "
        "this process's)"
    )
    table.add_column("namespace")
    for label in shot.namespace_tiers:
        table.add_column(f"{escape(label)} bytes", justify="right")
        table.add_column(f"{escape(label)} evictions", justify="right")
    # Every namespace the buffer or a tier knows: a tier that cannot tell shows "-" for each.
    totals: dict[str, int] = dict.fromkeys(shot.namespaces, 0)
    for per_namespace in shot.namespace_tiers.values():
        for name, figures in (per_namespace or {}).items():
            totals[name] = totals.get(name, 0) + figures["bytes"]
    for name in sorted(totals, key=lambda name: (-totals[name], name)):
        cells = []
        for per_namespace in shot.namespace_tiers.values():
            if per_namespace is None:
                cells += ["-", "-"]
            else:
                figures = per_namespace.get(name, {"bytes": 0, "evictions": 0})
                cells += [str(figures["bytes"]), str(figures["evictions"])]
        table.add_row(escape(name), *cells)
    return table


def _buffer_namespace_view(shot: Snapshot) -> RenderableType:
    if not shot.namespaces:
        return Text("No namespace figures: this stack has no buffer tier.")
    table = Table(title="namespaces in the CacheBuffer (node-wide, since creation)")
    table.add_column("namespace")
    for column in NAMESPACE_COLUMNS:
        table.add_column(column.replace("_", " "), justify="right")
    ranked = sorted(
        shot.namespaces.items(), key=lambda item: (-item[1]["occupancy_slots"], item[0])
    )
    for name, figures in ranked:
        table.add_row(escape(name), *(str(figures[column]) for column in NAMESPACE_COLUMNS))
    return table


def _stat(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
