"""``trainguard replay``, ``trainguard export`` and ``trainguard import``: a job's recorded log
folded again through the state machine, checked against the audit trail, re-run under another
configuration, and carried between buses as one file (``docs/forensics.md``).

Exit status of ``replay``: 0 the replay reproduces the recorded decisions (or ``--no-verify``),
1 it does not (the first difference is printed), 2 a usage error: an unknown job, a bad
window, an unreadable source or configuration.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from enum import StrEnum
from importlib.metadata import version as _dist_version
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, NoReturn

import orjson
import typer

from trainguard.agent.bus import (
    DEFAULT_BUS_URL,
    BusError,
    KafkaSecurity,
    Record,
    load_kafka_security,
)
from trainguard.daemon.cli._options import (
    DEFAULT_PREFIX,
    BusOption,
    ExportFile,
    PrefixOption,
    given_path,
    os_failure,
)

if TYPE_CHECKING:
    from rich.console import Console

    from trainguard.daemon.core import AuditTrail, MachineConfig
    from trainguard.daemon.forensics import ExportHeader, JobLog, Replay

__all__ = ["register"]


class OutputFormat(StrEnum):
    """How ``replay`` prints: text (rich) for people, JSON Lines for tools."""

    text = "text"
    jsonl = "jsonl"


def register(app: typer.Typer) -> None:
    """Add ``replay``, ``export`` and ``import`` to ``app``."""
    app.command()(replay)
    app.command()(export)
    app.command(name="import")(import_record)


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _security() -> KafkaSecurity:
    """Kafka TLS/SASL settings from the ``TRAINGUARD_KAFKA_*`` variables (``replay``'s
    ``--what-if`` file is no bus configuration, so it does not carry them); exits 2 when they are
    invalid."""
    try:
        return load_kafka_security()
    except ValueError as exc:
        _fail(str(exc))


def replay(
    job: Annotated[str, typer.Argument(metavar="JOB", help="The job id.")],
    bus: BusOption = DEFAULT_BUS_URL,
    topic_prefix: PrefixOption = DEFAULT_PREFIX,
    file: ExportFile = None,
    since: Annotated[
        str | None,
        typer.Option(
            help="Show and verify from this bus time on: ISO 8601 (UTC without a zone) or ms "
            "since the epoch."
        ),
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="Show and verify up to this bus time (read no further).")
    ] = None,
    from_offset: Annotated[
        int | None, typer.Option(help="Show and verify from this offset of the job's partition.")
    ] = None,
    to_offset: Annotated[
        int | None, typer.Option(help="Show and verify up to this offset (read no further).")
    ] = None,
    output_format: Annotated[
        OutputFormat, typer.Option("--format", help="text for people, jsonl for tools.")
    ] = OutputFormat.text,
    what_if_file: Annotated[
        Path | None,
        typer.Option(
            "--what-if",
            parser=given_path,
            help="A daemon TOML file whose \\[machine] settings replace the recorded "
            "ones (settings it leaves out, and daemon_id, stay as recorded); prints the "
            "decisions that would change.",
        ),
    ] = None,
    verify: Annotated[
        bool,
        typer.Option(help="Check that the replay reproduces the recorded decisions exactly."),
    ] = True,
    every: Annotated[
        bool,
        typer.Option(
            "--all", help="Show every input (heartbeats and ticks that decide nothing are folded)."
        ),
    ] = False,
    timeline: Annotated[
        bool,
        typer.Option(
            "--timeline/--no-timeline",
            help="Print the timeline; --no-timeline prints the header and the verdict only, and "
            "holds nothing per input (a long job's check: faster, in constant memory).",
        ),
    ] = True,
) -> None:
    """Fold a job's recorded events and ticks through the state machine again: print its
    timeline, check the recorded decisions, or (--what-if) what another configuration would
    have decided.

    Example: trainguard replay j1 --bus sqlite:///bus.db --since 2026-01-05T12:00:00Z
    """
    from rich.console import Console

    from trainguard.daemon.core import MalformedAudit
    from trainguard.daemon.forensics import (
        MalformedExport,
        UnknownJob,
        Window,
        parse_time,
        read_bus,
        read_file,
        replay_file,
    )

    try:
        window = Window(
            since_ms=None if since is None else parse_time(since),
            until_ms=None if until is None else parse_time(until),
            from_offset=from_offset,
            to_offset=to_offset,
        )
    except ValueError as exc:
        _fail(str(exc))
    log: JobLog | None = None
    try:
        if file is not None and not window.bounded and what_if_file is None:
            # The whole file, replayed as it is read.
            done = replay_file(file, job, _default_config(), timeline=timeline)
            trail, result = done.trail, done.result
            span = _Span(done.source, done.partition, done.count, done.first, done.last, None)
        else:
            if file is not None:
                log = read_file(file, job, window)
            else:
                log = asyncio.run(read_bus(bus, topic_prefix, job, window, security=_security()))
            trail = log.trail()
            result = _replayed(log, trail, timeline=timeline)
            events = log.events
            shown = events[log.start] if window.bounded else None
            span = _Span(log.source, log.partition, len(events), events[0], events[-1], shown)
    except OSError as exc:  # only the export file is read from disk (the bus words its own)
        _fail(os_failure(exc, "read the export file", file))
    except (UnknownJob, MalformedExport, MalformedAudit, BusError) as exc:
        _fail(str(exc))
    console = Console(highlight=False, soft_wrap=True)
    jsonl = output_format is OutputFormat.jsonl
    if not jsonl:
        _print_header(console, job, span, trail, result)
    if what_if_file is None:
        if timeline:
            _print_rows(console, result, span, jsonl=jsonl, every=every)
    elif log is not None:  # --what-if reads the whole log (above)
        try:
            _what_if(console, log, trail, what_if_file, jsonl=jsonl)
        except MalformedAudit as exc:
            _fail(str(exc))
    if verify:
        _verdict(console, result, trail, jsonl=jsonl)


def _replayed(log: JobLog, trail: AuditTrail, *, timeline: bool) -> Replay:
    from trainguard.daemon.forensics import replay as replay_log

    return replay_log(
        log.job_id, log.events, trail, _default_config(), start=log.start, timeline=timeline
    )


def _default_config() -> MachineConfig:
    """The configuration of a job whose daemon recorded none (it decided nothing)."""
    from trainguard.daemon.core import MachineConfig

    return MachineConfig(daemon_id="replay")


def _emit(obj: dict[str, Any]) -> None:
    typer.echo(orjson.dumps(obj).decode())


class _Span(NamedTuple):
    """What the header says of the event records read: where from, how many, first and last, and
    the window's first record (``None`` without a window)."""

    source: str
    partition: int
    records: int
    first: Record
    last: Record
    shown: Record | None


def _print_header(
    console: Console, job: str, span: _Span, trail: AuditTrail, result: Replay
) -> None:
    from trainguard.daemon.forensics import iso

    first, last = span.first, span.last
    console.print(
        f"[bold]job {job}[/bold] from {span.source}, events partition {span.partition}: "
        f"{span.records} records, offsets {first.offset}-{last.offset}, "
        f"{iso(first.timestamp_ms)} to {iso(last.timestamp_ms)}",
        markup=True,
    )
    if span.shown is not None:
        shown = span.shown
        console.print(f"window: from offset {shown.offset} ({iso(shown.timestamp_ms)})")
    if not trail.configs:
        console.print(
            "no configuration recorded (the daemon decided nothing for this job): folded "
            "under the defaults"
        )
        return
    runs = result.runs
    if len(runs) == 1:
        config_id = runs[0][0]
        console.print(
            f"recorded configuration {config_id} "
            f"(daemon_id {trail.configs[config_id].get('daemon_id')}){_rules_text(trail, config_id)}"
        )
        return
    console.print(
        f"decided by {len(runs)} daemon runs (one per daemon process that acted for the job: "
        "a restart or another instance taking over starts the next):"
    )
    previous: Mapping[str, Any] | None = None
    for config_id, offset in runs:
        config = trail.configs[config_id]
        handover = "" if previous is None else f": {handover_text(previous, config)}"
        console.print(
            f"  {config_id} (daemon_id {config.get('daemon_id')}){_rules_text(trail, config_id)} "
            f"from offset {offset}{handover}"
        )
        previous = config


def _rules_text(trail: AuditTrail, config_id: str) -> str:
    """``""`` when run ``config_id`` was decided under this build's rules, else what the trail
    says of its rules (docs/forensics.md, "Replaying a trail of another build")."""
    from trainguard.daemon.core import RULES_VERSION

    rules = trail.rules.get(config_id, RULES_VERSION)
    if rules == RULES_VERSION:
        return ""
    recorded = "no rules version recorded" if rules is None else f"rules version {rules}"
    return f", {recorded}; this build's: {RULES_VERSION}"


def handover_text(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """What the audit trail shows of one daemon run following another, from the two runs'
    recorded configurations (``daemon_id`` and the machine settings).

    A new ``daemon_id`` is another daemon process: the trail cannot tell a restart (the
    default ``daemon_id`` is ``host-pid``) from another instance taking over, so it says
    neither. Settings are compared without ``daemon_id``, which is why two instances with the
    same settings have different configuration ids. Returns e.g. ``another daemon process took
    over, same settings`` or ``daemon_id d1 again, with different settings:
    heartbeat_timeout_s 10.0 -> 20.0``.
    """
    changed = [
        f"{key} {before.get(key)} -> {after.get(key)}"
        for key in sorted(before.keys() | after.keys())
        if key != "daemon_id" and before.get(key) != after.get(key)
    ]
    settings = f"with different settings: {', '.join(changed)}" if changed else "same settings"
    if before.get("daemon_id") == after.get("daemon_id"):
        return f"daemon_id {after.get('daemon_id')} again, {settings}"
    return f"another daemon process took over, {settings}"


def _print_rows(console: Console, result: Replay, span: _Span, *, jsonl: bool, every: bool) -> None:
    from trainguard.daemon.forensics import print_timeline, row_json

    if jsonl:
        for row in result.rows:
            _emit(row_json(row))
        return
    print_timeline(console, result.rows, origin_ns=span.first.timestamp_ms * 1_000_000, every=every)


def _what_if(console: Console, log: JobLog, trail: AuditTrail, path: Path, *, jsonl: bool) -> None:
    import dataclasses
    import tomllib

    from trainguard.daemon.core import config_fields
    from trainguard.daemon.forensics import change_json, print_config_change, print_what_if, what_if
    from trainguard.daemon.service import load_daemon_config

    try:
        settings = load_daemon_config(path)
        with path.open("rb") as f:
            keys = tomllib.load(f).get("machine", {}).keys() - {"daemon_id"}
    except OSError as exc:
        _fail(os_failure(exc, "read the what-if config file", path))
    except ValueError as exc:  # messages name the file
        _fail(str(exc))
    # The file's [machine] keys, with the values load_daemon_config checked and converted.
    overrides = {k: getattr(settings.machine, k) for k in keys}
    try:
        first = next(iter(trail.configs), None)
        baseline = _default_config() if first is None else trail.machine(first)
        variant = dataclasses.replace(baseline, **overrides)
    except (TypeError, ValueError) as exc:
        _fail(f"{path}: {exc}")
    before, after = config_fields(baseline), config_fields(variant)
    result = what_if(
        log.job_id,
        log.events,
        baseline,
        variant,
        tick_interval_s=settings.tick_interval_s,
        poll_s=settings.poll_s,
        pulse_s=settings.pulse_s,
        start=log.start,
        auth=trail,
    )
    if jsonl:
        for key in sorted(before):
            if before[key] != after[key]:
                _emit(
                    {"type": "config", "key": key, "recorded": before[key], "what_if": after[key]}
                )
        for change in result.changes:
            _emit(change_json(change))
        _emit(
            {
                "type": "what_if",
                "changes": len(result.changes),
                "horizon_ms": None if result.horizon_ns is None else result.horizon_ns // 1_000_000,
                "rejected_before": dict(result.rejected_before),
                "rejected_after": dict(result.rejected_after),
            }
        )
        return
    if len(trail.configs) > 1:
        console.print(
            f"the job was decided under {len(trail.configs)} configurations; the what-if "
            "compares with the first"
        )
    if before == after:
        console.print(f"what-if: {path} sets the recorded configuration (no setting differs)")
    else:
        console.print(f"what-if: {path} differs from the recorded configuration in:")
        print_config_change(console, before, after)
    console.print(
        "both runs fold the recorded events with the daemon's ticks modelled (a tick poll_s "
        f"= {settings.poll_s} s after each deadline, at most one per tick_interval_s = "
        f"{settings.tick_interval_s} s, and a pulse after pulse_s = {settings.pulse_s} s "
        "without input); the recorded ticks are left out",
        style="dim",
    )
    print_what_if(console, result, origin_ns=log.events[0].timestamp_ms * 1_000_000)


def _verdict(console: Console, result: Replay, trail: AuditTrail, *, jsonl: bool) -> None:
    from trainguard.daemon.core import RULES_VERSION
    from trainguard.daemon.forensics import difference_json, print_difference, verify

    difference = verify(result.replayed, result.recorded)
    # The rules of the run the difference is in (the configuration the trail recorded for it,
    # which the replay folds under too), when they are not this build's.
    recorded = None if difference is None else difference.expected_config or difference.got_config
    other_rules = recorded is not None and trail.rules.get(recorded, RULES_VERSION) != RULES_VERSION
    if jsonl:
        _emit(
            {
                "type": "verdict",
                "ok": difference is None,
                "replayed": len(result.replayed),
                "recorded": len(result.recorded),
                "runs": [config_id for config_id, _ in result.runs],
                "difference": None if difference is None else difference_json(difference),
                "rules": RULES_VERSION,
                "recorded_rules": trail.rules.get(recorded) if recorded is not None else None,
            }
        )
    elif difference is None:
        duplicates = len(result.recorded) - len(result.replayed)
        again = f"; {duplicates} re-derived duplicates skipped" if duplicates else ""
        console.print(
            f"[bold green]✓ the replay reproduces the recorded decisions:[/bold green] "
            f"{len(result.replayed)} decision groups under {len(result.runs)} run(s){again}"
        )
    else:
        print_difference(console, difference)
        if other_rules:
            assert recorded is not None
            rules = trail.rules.get(recorded)
            console.print(
                "  These decisions were recorded "
                + (
                    "by a build that recorded no rules version (before 2026-12-05)"
                    if rules is None
                    else f"under rules version {rules}"
                )
                + f"; this build decides under rules version {RULES_VERSION}. Where the rules "
                "changed in between, the replay decides differently: replay the trail with the "
                "build that recorded it to check the daemon (docs/forensics.md).",
                style="yellow",
            )
    if difference is not None:
        raise typer.Exit(1)


def export(
    job: Annotated[str, typer.Argument(metavar="JOB", help="The job id.")],
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            help="The file to write, e.g. job.tgjsonl.gz; - writes it to standard output.",
        ),
    ],
    bus: BusOption = DEFAULT_BUS_URL,
    topic_prefix: PrefixOption = DEFAULT_PREFIX,
) -> None:
    """Write a job's full record (events and ticks, commands, manifests, audit trail) to one
    gzip-compressed JSON Lines file, for a bug report or a replay elsewhere."""
    from trainguard.daemon.forensics import ExportHeader, UnknownJob, dump, read_bus

    try:
        log = asyncio.run(read_bus(bus, topic_prefix, job, security=_security()))
    except (UnknownJob, BusError) as exc:
        _fail(str(exc))
    header = ExportHeader(
        job_id=job,
        source=log.source,
        partition=log.partition,
        partitions=log.partitions,
        exported_at_ms=time.time_ns() // 1_000_000,
        trainguard=_dist_version("trainguard"),
    )
    records = {
        "events": log.events,
        "commands": log.commands,
        "manifests": log.manifests,
        "audit": log.audit,
    }
    to_stdout = str(output) == "-"
    if to_stdout and sys.stdout.isatty():
        _fail("-o - writes gzip to standard output, which is a terminal: redirect it (> FILE)")
    try:
        size = _dump_to_stdout(header, records) if to_stdout else dump(output, header, records)
    except OSError as exc:
        _fail(os_failure(exc, "write", output))
    counts = ", ".join(f"{k} {len(v)}" for k, v in records.items())
    where = "standard output" if to_stdout else output
    # With the file on standard output, the summary goes to standard error.
    typer.echo(f"wrote job {job} (records: {counts}) to {where}, {size} bytes", err=to_stdout)


def _dump_to_stdout(header: ExportHeader, records: Mapping[str, Sequence[Record]]) -> int:
    """Write the job record to standard output (through a temporary file: ``dump`` writes
    atomically by name); its size in bytes."""
    import shutil
    import tempfile

    from trainguard.daemon.forensics import dump

    with tempfile.TemporaryDirectory(prefix="trainguard-export-") as folder:
        path = Path(folder) / "job.tgjsonl.gz"
        size = dump(path, header, records)
        with path.open("rb") as f:
            shutil.copyfileobj(f, sys.stdout.buffer)
        sys.stdout.buffer.flush()
    return size


def import_record(
    file: Annotated[
        Path, typer.Argument(metavar="FILE", help="A job record written by trainguard export.")
    ],
    bus: BusOption = DEFAULT_BUS_URL,
    topic_prefix: PrefixOption = DEFAULT_PREFIX,
) -> None:
    """Write an exported job record onto an embedded bus, keeping every record's bus time, so
    that trainguard replay (and report, status, checkpoints) read it as if it ran there.

    The bus must not hold the job already; do not run a daemon on it.
    """
    from trainguard.daemon.forensics import ImportRefused, MalformedExport, import_file

    try:
        header, written = asyncio.run(import_file(file, bus, topic_prefix))
    except OSError as exc:
        _fail(os_failure(exc, "read the export file", file))
    except (ImportRefused, MalformedExport, BusError) as exc:
        _fail(str(exc))
    counts = ", ".join(f"{topic} {n}" for topic, n in written.items())
    # Quoted for the shell: the command is meant to be pasted (a path may hold a space).
    again = shlex.join(
        ["trainguard", "replay", header.job_id, "--bus", bus, "--topic-prefix", topic_prefix]
    )
    typer.echo(
        f"imported job {header.job_id} (records: {counts}) into {bus} (prefix "
        f"{topic_prefix!r}); replay it with: {again}"
    )
