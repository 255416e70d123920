"""``trainguard report JOB``: a job's goodput, time lost per incident and the checkpoint
interval its failure rate suggests, from its record on the bus or in an export file; in the
terminal (rich), as JSON, or as a self-contained HTML page with a timeline chart.

The I/O around :func:`trainguard.daemon.forensics._report.build_report`: reading the record
(:mod:`trainguard.daemon.forensics._job_log`), printing, writing the HTML file.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from trainguard.agent.bus import BusError
from trainguard.daemon.cli._options import (
    ConfigFile,
    ConfiguredBus,
    ConfiguredPrefix,
    ExportFile,
    os_failure,
)

if TYPE_CHECKING:
    from trainguard.daemon.forensics import JobLog, JobReport

__all__ = ["register"]


class OutputFormat(StrEnum):
    """How ``report`` prints: rich tables for people, one JSON document for tools."""

    text = "text"
    json = "json"


def register(app: typer.Typer) -> None:
    """Add the ``report`` command to ``app``."""
    app.command()(report)


def report(
    job: Annotated[
        str | None,
        typer.Argument(metavar="JOB", help="The job's id (default with --file: the file's job)."),
    ] = None,
    bus: ConfiguredBus = None,
    config: ConfigFile = None,
    topic_prefix: ConfiguredPrefix = None,
    file: ExportFile = None,
    output: Annotated[
        OutputFormat, typer.Option("--format", help="text (rich tables) or json (for tools).")
    ] = OutputFormat.text,
    html: Annotated[
        Path | None,
        typer.Option(help="Also write the report with a timeline chart to this HTML file."),
    ] = None,
) -> None:
    """Report a job's wall time, productive time and goodput, the time each incident cost
    (detection, restore, recomputed steps), incidents by cause, and the checkpoint interval
    suggested by the observed failures and checkpoint cost (Young-Daly), from its record.

    Definitions and formulas: docs/forensics.md. Exits 2 for an unknown job, an unreadable
    source or an HTML file that cannot be written.
    """
    import orjson

    from trainguard.daemon.forensics import build_report

    log = _read(job, bus, config, topic_prefix, file)
    events, audit, commands = _record(log)
    result = build_report(log.job_id, events, audit, commands)
    if html is not None:
        from trainguard.daemon.forensics import render_html

        try:
            html.write_text(render_html(result), encoding="utf-8")
        except OSError as exc:
            _fail(os_failure(exc, "write the HTML report", html))
    if output is OutputFormat.json:
        typer.echo(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    else:
        _print(result, log.source)
    if html is not None:
        typer.echo(f"HTML report: {html}", err=output is OutputFormat.json)


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _read(
    job: str | None,
    bus: str | None,
    config: Path | None,
    topic_prefix: str | None,
    file: Path | None,
) -> JobLog:
    """The job's log from ``file``, else from the bus."""
    from trainguard.daemon.forensics import MalformedExport, UnknownJob, read_bus, read_file
    from trainguard.daemon.service import load_daemon_config

    if file is not None:
        try:
            return read_file(file, job)
        except OSError as exc:
            _fail(os_failure(exc, "read the export file", file))
        except (UnknownJob, MalformedExport) as exc:
            _fail(str(exc))
    if job is None:
        _fail("name the JOB (or give --file)")
    try:
        settings = load_daemon_config(config, bus_url=bus)
    except OSError as exc:
        _fail(os_failure(exc, "read the config file", config))
    except ValueError as exc:
        _fail(str(exc))
    prefix = settings.bus.prefix if topic_prefix is None else topic_prefix
    bus_config = replace(settings.bus, prefix=prefix)
    try:
        return asyncio.run(
            read_bus(bus_config.url, bus_config.prefix, job, security=bus_config.security)
        )
    except (UnknownJob, BusError, TimeoutError) as exc:
        _fail(str(exc))


@dataclass(frozen=True, slots=True)
class _Stamped:
    """A decoded record with its append time (the report's ``Timed``)."""

    at_ms: int
    message: object


def _record(log: JobLog) -> tuple[list[_Stamped], list[dict[str, Any]], list[_Stamped]]:
    """The log's events as the daemon took them in, its audit entries as dicts, and its
    commands decoded (undecodable ones left out); exits 2 on a malformed audit trail.

    Events go through the daemon's intake (:func:`trainguard.daemon.core._intake.take`) with the
    job's audit trail as the authenticator, as a replay does: a record the daemon refused (not
    decodable, another job's, or not authentic, e.g. a forged heartbeat) is left out. So is an
    event the state machine rejected (a ``rejected`` decision in the trail: a stale
    generation, a duplicate, a conflicting world size, ...), which changed nothing. A record
    the daemon has not judged yet has no verdict in the trail and is taken as authentic, as a
    daemon without keys takes it (``docs/forensics.md``).
    """
    from trainguard.daemon.core import (
        MalformedAudit,
        Taken,
        entries_by_job,
        input_id,
        input_key,
        read_trail,
        take,
    )
    from trainguard.schemas import SchemaError, decode

    try:
        audit = entries_by_job(log.audit).get(log.job_id, [])
        trail = read_trail(audit)
    except MalformedAudit as exc:
        _fail(f"{log.source}: {exc}")
    rejected: dict[tuple[str, int], set[str]] = {}
    for group in trail.groups:
        for decision in group.decisions:
            if decision.get("decision") == "rejected":
                rejected.setdefault(group.key, set()).add(str(decision.get("code")))
    taken_in = [
        (rec.timestamp_ms, taken.message)
        for rec in log.events
        if isinstance(taken := take(rec, trail), Taken)
    ]
    keys = [input_key(input_id(message), at_ms) for at_ms, message in taken_in]
    copies = Counter(keys)
    seen: set[tuple[str, int]] = set()
    events = []
    for key, (at_ms, message) in zip(keys, taken_in, strict=True):
        # An input is named by its sender, seq and append time: copies of one send appended
        # in the same millisecond share it, and only those after the first are duplicates.
        codes = rejected.get(key)
        first_of_copies = codes == {"duplicate"} and copies[key] > 1 and key not in seen
        seen.add(key)
        if codes is None or first_of_copies:
            events.append(_Stamped(at_ms, message))
    commands = []
    for rec in log.commands:
        if rec.value is None:
            continue
        try:
            commands.append(_Stamped(rec.timestamp_ms, decode(rec.value)))
        except SchemaError:
            continue
    return events, audit, commands


def _print(result: JobReport, source: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from trainguard.daemon.forensics import (
        CAUSE_HEADER,
        DEFINITIONS,
        INCIDENT_HEADER,
        NUMERIC_COLUMNS,
        advice_rows,
        cause_rows,
        headline,
        incident_notes,
        incident_rows,
        time_rows,
    )

    console = Console()
    console.print(f"[bold]Job report[/bold] from {source}", highlight=False)
    facts = Table(show_header=False, box=None)
    for label, value in headline(result):
        facts.add_row(f"[dim]{label}[/dim]", value)
    console.print(facts)

    table = Table(title="Where the wall time went")
    for name in ("kind", "s", "share", "what"):
        table.add_column(name, justify="right" if name in NUMERIC_COLUMNS else "left")
    for row in time_rows(result):
        table.add_row(*row, style="bold" if row[0] in ("productive", "wall") else None)
    console.print(table)

    if result.incidents:
        table = Table(title="Incidents")
        for name in INCIDENT_HEADER:
            table.add_column(name, justify="right" if name in NUMERIC_COLUMNS else "left")
        for cells in incident_rows(result):
            table.add_row(*cells)
        console.print(table)
        for note in incident_notes(result):
            console.print(f"  [dim]{note}[/dim]", highlight=False)
        table = Table(title="Incidents by cause")
        for name in CAUSE_HEADER:
            table.add_column(name, justify="right" if name in NUMERIC_COLUMNS else "left")
        for cells in cause_rows(result):
            table.add_row(*cells)
        console.print(table)
    else:
        console.print("No incidents.")

    table = Table(title="Checkpoint interval (Young-Daly)", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for label, value in advice_rows(result):
        table.add_row(label, value)
    console.print(table)
    console.print(f"[dim]{DEFINITIONS}[/dim]", highlight=False)
