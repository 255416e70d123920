"""``trainguard sim``: simulate a large job with failures against the real daemon and compare
its goodput with the Young-Daly model (``docs/sim.md``).

The I/O around :mod:`trainguard.daemon.sim`: options, the failure plan, the run folder, the
output.
"""

from __future__ import annotations

import math
import signal
import tempfile
import uuid
from enum import StrEnum
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from trainguard.agent.bus import BusError
from trainguard.daemon.cli._options import given_path, os_failure

__all__ = ["register"]


class OutputFormat(StrEnum):
    """How ``sim`` prints: rich tables for people, one JSON document for tools."""

    text = "text"
    json = "json"


def register(app: typer.Typer) -> None:
    """Add the ``sim`` command to ``app``."""
    app.command()(sim)


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _warn(message: str) -> None:
    typer.secho(f"warning: {message}", fg=typer.colors.YELLOW, err=True)


def sim(
    ranks: Annotated[int, typer.Option(help="World size of the simulated job.")] = 256,
    ranks_per_host: Annotated[int, typer.Option(help="Ranks per node.")] = 8,
    batch_heartbeats: Annotated[
        bool,
        typer.Option(
            help="Send each node's heartbeats as one heartbeat-batch record (what a supervisor "
            "with heartbeat batching sends) instead of one record per rank."
        ),
    ] = False,
    mtbf: Annotated[
        float, typer.Option(help="Mean time between failures, seconds of training time.")
    ] = 600.0,
    checkpoint_cost: Annotated[
        float, typer.Option(help="C: seconds training stands still for one checkpoint.")
    ] = 0.78,
    checkpoint_interval: Annotated[
        float | None,
        typer.Option(
            help="Seconds of compute between checkpoints (rounded to whole steps); default: "
            "Young's interval sqrt(2 C M)."
        ),
    ] = None,
    restart_time: Annotated[
        float, typer.Option(help="R: seconds from a restore command to every rank's ack.")
    ] = 30.0,
    step_time: Annotated[float, typer.Option(help="Seconds per training step.")] = 1.0,
    failures: Annotated[
        int | None,
        typer.Option(help="Faults to inject (drawn at rate 1/M); the run ends at the next one."),
    ] = None,
    duration: Annotated[
        float | None,
        typer.Option(help="Seconds of training time to simulate (instead of --failures)."),
    ] = None,
    kinds: Annotated[
        str, typer.Option(help="Fault kinds, taking turns: kill, hang, nan, sdc, node.")
    ] = "kill,hang,nan,sdc,node",
    trace: Annotated[
        Path | None,
        typer.Option(
            parser=given_path,
            help="Inject the faults of this file instead: lines '<after_s>,<kind>[,<rank>]' "
            "(training seconds).",
        ),
    ] = None,
    bus: Annotated[
        str | None,
        typer.Option(
            help="kafka://host:port runs in real time on Kafka (a fresh topic prefix); "
            "default: a fresh embedded bus in the run folder, in simulated time."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seeds the fault draws.")] = 0,
    kill_daemon_at: Annotated[
        float | None,
        typer.Option(help="SIGKILL the daemon at this simulated second and start a new one."),
    ] = None,
    run_dir: Annotated[
        Path | None,
        typer.Option(
            parser=given_path,
            help="Folder for the bus, keys, daemon config and logs; default: a fresh "
            "temporary folder.",
        ),
    ] = None,
    window: Annotated[
        float,
        typer.Option(
            help="Embedded bus: simulated seconds one round may cover undisturbed (0: one "
            "instant a round, so that the lag is each instant's, as at real-time pacing)."
        ),
    ] = 10.0,
    output: Annotated[
        OutputFormat, typer.Option("--format", help="text (rich tables) or json (for tools).")
    ] = OutputFormat.text,
) -> None:
    """Simulate a job of many ranks with failures (kill, hang, NaN, silent data corruption,
    node loss) against the real daemon, and report goodput measured next to the Young-Daly
    model's, the daemon's lag and CPU per record, and each fault's time to its restore.

    Exits 0 when every fault got exactly one restore and the job ran to its end, 1 otherwise,
    2 for bad options or a daemon that could not run.
    """
    import orjson
    from rich.console import Console

    from trainguard.daemon.forensics import young_interval_s
    from trainguard.daemon.sim import (
        FAULT_KINDS,
        SimConfig,
        SimFailed,
        SimParams,
        TraceError,
        draw_faults,
        parse_trace,
        print_summary,
        run_simulation,
        summarize,
    )

    named = [k.strip() for k in kinds.split(",") if k.strip()]
    chosen = tuple(k for k in FAULT_KINDS for n in named if n == k)
    unknown = [n for n in named if n not in FAULT_KINDS]
    if unknown or not chosen:
        which = f"unknown {', '.join(unknown)}" if unknown else "no kind given"
        _fail(f"--kinds: {which} (choose from {', '.join(FAULT_KINDS)})")
    if trace is not None and failures is not None:
        _fail("give --trace FILE or --failures N, not both (the trace names the faults)")
    if (failures is None) == (duration is None) and trace is None:
        _fail("give either --failures N or --duration SECONDS (or --trace FILE)")
    if ranks < 1 or ranks_per_host < 1:
        flag, value = ("--ranks", ranks) if ranks < 1 else ("--ranks-per-host", ranks_per_host)
        _fail(f"{flag} must be at least 1, not {value}")
    if ranks_per_host > ranks:
        _fail(f"--ranks-per-host ({ranks_per_host}) must not exceed --ranks ({ranks})")
    # Formulas divide by these or take their roots: refuse what would break them.
    for flag, seconds, zero_ok in (
        ("--mtbf", mtbf, False),
        ("--step-time", step_time, False),
        ("--checkpoint-interval", checkpoint_interval, False),
        ("--duration", duration, False),
        ("--window", window, True),
        ("--checkpoint-cost", checkpoint_cost, True),
        ("--kill-daemon-at", kill_daemon_at, True),
    ):
        if seconds is not None and not (
            math.isfinite(seconds) and (seconds >= 0 if zero_ok else seconds > 0)
        ):
            bound = ">= 0" if zero_ok else "> 0"
            _fail(f"{flag} must be a finite number of seconds {bound}, not {seconds:g}")
    if kill_daemon_at is not None and duration is not None and kill_daemon_at >= duration:
        _fail(f"--kill-daemon-at ({kill_daemon_at:g}) must come before --duration ({duration:g})")
    interval = checkpoint_interval or young_interval_s(checkpoint_cost, mtbf)
    try:
        params = SimParams(
            ranks=ranks,
            ranks_per_host=ranks_per_host,
            batch_heartbeats=batch_heartbeats,
            step_s=step_time,
            checkpoint_cost_s=checkpoint_cost,
            checkpoint_every=max(1, round(interval / step_time)),
            restart_s=restart_time,
        )
        if trace is not None:
            faults = parse_trace(trace.read_text().splitlines(), ranks)
            horizon = duration or ((faults[-1].after_s if faults else 0.0) + mtbf)
            if not faults:
                _warn(f"{trace} names no fault: the run has none ({horizon:g} s of training)")
        elif failures is not None:
            faults, horizon = draw_faults(failures, mtbf, chosen, ranks, seed)
        else:
            assert duration is not None
            faults, _ = draw_faults(int(3 * duration / mtbf) + 10, mtbf, chosen, ranks, seed)
            faults = tuple(f for f in faults if f.after_s < duration)
            horizon = duration
    except OSError as exc:
        _fail(os_failure(exc, "read the trace", trace))
    except (TraceError, ValueError) as exc:
        _fail(str(exc))
    folder = run_dir or Path(tempfile.mkdtemp(prefix="trainguard-sim-"))
    url = bus or f"sqlite://{folder / 'bus.db'}"
    prefix = f"sim-{uuid.uuid4().hex[:8]}." if bus is not None else "trainguard."
    config = SimConfig(
        params=params,
        faults=faults,
        horizon_s=horizon,
        bus_url=url,
        run_dir=folder,
        prefix=prefix,
        window_s=window,
        kill_daemon_at_s=kill_daemon_at,
    )
    # SIGTERM (a timeout, a scheduler) ends the run as Ctrl-C does, through the cleanup that
    # stops the daemon process; Python's default would exit at once and leave it running.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        measured = run_simulation(config)
    except (SimFailed, BusError, FileExistsError) as exc:
        _fail(f"{exc} (run folder {folder})")
    if kill_daemon_at is not None and len(measured.daemons) == 1:
        _warn(
            f"--kill-daemon-at {kill_daemon_at:g}: the run ended at simulated second "
            f"{measured.model.accounting.wall_s():.0f}, before it; the daemon was not killed"
        )
    summary = summarize(measured, params, mtbf, "kafka" if bus is not None else "sqlite")
    data = summary.as_dict()
    data["run_dir"] = str(folder)
    if output is OutputFormat.json:
        typer.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
    else:
        print_summary(summary, Console())
        typer.echo(f"run folder: {folder}")
    ok = data["one_restore_per_fault"] and measured.model.phase != "failed"
    raise typer.Exit(0 if ok else 1)
