"""``trainguard status [JOB]``: a table of jobs, or one job's ranks, folded from the bus."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from trainguard.agent.bus import BusError
from trainguard.daemon.cli._options import (
    ConfiguredBus,
    ConfiguredPrefix,
    console,
    given_path,
    os_failure,
    other_prefixes,
)

if TYPE_CHECKING:
    from rich.console import JustifyMethod

__all__ = ["register"]


class OutputFormat(StrEnum):
    """How ``status`` prints: rich tables for people (``text``, as every command names it), one
    JSON document for tools."""

    text = "text"
    json = "json"


def register(app: typer.Typer) -> None:
    """Add the ``status`` command to ``app``."""
    app.command()(status)


def status(
    job: Annotated[
        str | None,
        typer.Argument(metavar="JOB", help="Show this job's ranks; default: a table of all jobs."),
    ] = None,
    bus: ConfiguredBus = None,
    config: Annotated[
        Path | None,
        typer.Option(
            parser=given_path,
            help="The daemon's TOML file: its \\[bus] and \\[machine] tables (the detectors' "
            "settings decide the state).",
        ),
    ] = None,
    topic_prefix: ConfiguredPrefix = None,
    output: Annotated[
        OutputFormat, typer.Option("--format", help="text (rich tables) or json (for tools).")
    ] = OutputFormat.text,
) -> None:
    """Show the jobs on the bus: phase, generation, step, last committed step, ranks alive and
    the latest incident; with JOB, that job's ranks.

    Read from the bus, not asked of a daemon: every job's events are folded through the
    daemon's state machine (a full fold per job; docs/operations.md), leaving out the records
    the daemon refused as not authentic (its audit trail says which); records it has not judged
    yet are folded as authentic. Exits 2 for an unknown JOB, an unreachable bus or a malformed
    audit trail.
    """
    import orjson

    from trainguard.daemon.core import MalformedAudit
    from trainguard.daemon.forensics import job_summary, rank_summaries, read_status
    from trainguard.daemon.service import load_daemon_config

    try:
        settings = load_daemon_config(config, bus_url=bus)
    except OSError as exc:
        _fail(os_failure(exc, "read the config file", config))
    except ValueError as exc:
        _fail(str(exc))
    bus_config = replace(settings.bus, create=False)
    if topic_prefix is not None:
        bus_config = replace(bus_config, prefix=topic_prefix)
    try:
        jobs = asyncio.run(read_status(bus_config, settings.machine, job))
    except (BusError, TimeoutError, MalformedAudit) as exc:
        _fail(str(exc))
    now = time.time_ns()
    where = f"{bus_config.url} (topic prefix {bus_config.prefix!r})"
    if job is not None:
        found = jobs.get(job)
        if found is None:
            _fail(f"no events of job {job!r} on {where}; {asyncio.run(other_prefixes(bus_config))}")
        summary = job_summary(found, now)
        ranks = rank_summaries(found, now)
        if output is OutputFormat.json:
            typer.echo(orjson.dumps({**summary, "ranks": ranks}, option=orjson.OPT_INDENT_2))
        else:
            _print_job(summary, ranks)
        return
    rows = [job_summary(s, now) for _, s in sorted(jobs.items())]
    if output is OutputFormat.json:
        typer.echo(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    elif not rows:
        typer.echo(f"no jobs on {where}; {asyncio.run(other_prefixes(bus_config))}")
    else:
        _print_jobs(rows)


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _print_jobs(rows: Sequence[Mapping[str, object]]) -> None:
    from rich.table import Table

    table = Table(title="jobs")
    for name in ("job", "phase", "gen", "step", "commit", "ranks", "inc", "last incident"):
        numeric = name in ("gen", "step", "commit", "ranks", "inc")
        table.add_column(
            name, justify="right" if numeric else "left", no_wrap=name != "last incident"
        )
    for row in rows:
        table.add_row(
            str(row["job_id"]),
            _phase(str(row["phase"])),
            str(row["generation"]),
            _text(row["step"]),
            _text(row["committed_step"]) + (" [red]blocked[/red]" if row["not_committed"] else ""),
            f"{_text(row['ranks_alive'])}/{_text(row['world_size'])}",
            str(row["incidents"]),
            _incident(row["last_incident"]),
        )
    console().print(table)


def _print_job(summary: Mapping[str, object], ranks: Sequence[Mapping[str, object]]) -> None:
    from rich.table import Table

    out = console()
    out.print(
        f"[bold]{summary['job_id']}[/bold]  {_phase(str(summary['phase']))}  generation "
        f"{summary['generation']}  step {_text(summary['step'])}  committed "
        f"{_text(summary['committed_step'])}  last input {_age(summary['last_input_age_s'])} ago",
        highlight=False,
    )
    last = summary["last_incident"]
    if isinstance(last, dict):
        state = "open" if last["open"] else "closed"
        out.print(
            f"incident {last['id']} ({last['cause']}, {state}, {_age(last['age_s'])} ago): "
            f"{last['reason']}",
            highlight=False,
        )
    if summary["not_committed"]:
        out.print(f"[red]not committing:[/red] {summary['not_committed']}", highlight=False)
    if summary["failure"]:
        out.print(f"[red]failed:[/red] {summary['failure']}", highlight=False)
    if summary["phase"] in ("stopped", "failed"):
        # A failed job fails again unless its cause (a configuration error, say) is fixed.
        first = "once the cause is fixed, continue" if summary["phase"] == "failed" else "continue"
        out.print(
            f"{first} it from committed step {_text(summary['committed_step'])} with the same "
            "trainguard run command and --continue, on every node (docs/operations.md)",
            highlight=False,
        )
    if summary["refused"]:
        out.print(
            f"{summary['refused']} record(s) left out: the daemon refused them as not authentic",
            highlight=False,
        )
    if not ranks:
        out.print(f"no rank heard from in generation {summary['generation']} yet")
        return
    table = Table(title=f"ranks of generation {summary['generation']}")
    cells = [
        (
            str(r["rank"]),
            str(r["host"]),
            str(r["pid"]),
            str(r["status"]),
            _text(r["phase"]),
            _text(r["step"]),
            f"{_age(r['last_heard_s'])} ago",
            "-" if not isinstance(r["step_time_s"], float) else f"{r['step_time_s']:.3g} s",
            "yes" if r["straggling"] else "",
        )
        for r in ranks
    ]
    names = ("rank", "host", "pid", "status", "phase", "step", "heard", "step time", "slow")
    for i, name in enumerate(names):
        justify: JustifyMethod = "right" if name in ("rank", "pid", "step") else "left"
        if name == "host":  # the one long value: folded in a narrow terminal
            table.add_column(name, justify=justify, overflow="fold")
            continue
        # Short values at their full width: a state or phase cropped to "checkpo…" says nothing.
        width = max(len(name), *(len(row[i]) for row in cells))
        table.add_column(name, justify=justify, no_wrap=True, min_width=width)
    for row in cells:
        table.add_row(*row)
    out.print(table)


_PHASE_STYLE = {
    "running": "green",
    "restoring": "yellow",
    "failed": "red",
    "finished": "blue",
    "stopped": "magenta",
}


def _phase(phase: str) -> str:
    style = _PHASE_STYLE.get(phase)
    return f"[{style}]{phase}[/{style}]" if style else phase


def _text(value: object) -> str:
    return "-" if value is None else str(value)


def _incident(last: object) -> str:
    if not isinstance(last, dict):
        return "-"
    return f"{last['cause']} {_age(last['age_s'])} ago{' (open)' if last['open'] else ''}"


def _age(seconds: object) -> str:
    """``"42s"``, ``"3m05s"``, ``"2h01m"``, ``"3d04h"``."""
    s = int(seconds) if isinstance(seconds, int | float) else 0
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
