"""``trainguard stop JOB``: stop a job on purpose, as ``stopped`` (not ``failed``), so that it can
be continued later (``docs/operations.md``, "Stopping and continuing a job")."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from trainguard.agent import AgentError
from trainguard.agent.bus import BusConfig, BusError, TopicPartition, open_bus, partition_for
from trainguard.agent.keys import AgentKeys, CommandGate, agent_keys_from_env
from trainguard.agent.supervisor import encode_request, latest_command
from trainguard.daemon.cli._options import ConfiguredBus, ConfiguredPrefix, given_path, os_failure
from trainguard.schemas import Abort

__all__ = ["EXIT_NOT_STOPPED", "EXIT_UNCONFIRMED", "StopOutcome", "register", "stop_job"]

EXIT_NOT_STOPPED = 1
"""``trainguard stop``: the job had ended otherwise (failed, finished) and is not stopped."""

EXIT_UNCONFIRMED = 3
"""``trainguard stop``: the request is on the bus, but no daemon acted on it in time."""

_POLL_S = 0.5
"""Seconds between two looks at the commands and at the daemon group's position."""


@dataclass(frozen=True, slots=True)
class StopOutcome:
    """What became of a stop request.

    Attributes:
        code: the exit status: 0 (the job is stopped), :data:`EXIT_NOT_STOPPED` or
            :data:`EXIT_UNCONFIRMED`.
        message: what to tell the operator.
    """

    code: int
    message: str


def register(app: typer.Typer) -> None:
    """Add the ``stop`` command to ``app``."""
    app.command()(stop)


def stop(
    job: Annotated[str, typer.Argument(metavar="JOB", help="The job to stop.")],
    bus: ConfiguredBus = None,
    reason: Annotated[
        str, typer.Option(help="Why, in words: recorded in the abort and the audit trail.")
    ] = "",
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait for the daemon's confirmation.")
    ] = 60.0,
    config: Annotated[
        Path | None,
        typer.Option(
            parser=given_path,
            help="The daemon's TOML file, for its \\[bus] table and consumer group.",
        ),
    ] = None,
    topic_prefix: ConfiguredPrefix = None,
    daemon_group: Annotated[
        str | None,
        typer.Option(
            help="The daemon's consumer group; default: the config file's, else "
            "'<topic prefix>daemon'."
        ),
    ] = None,
) -> None:
    """Stop JOB on purpose: it ends 'stopped', not 'failed', and every node's `trainguard run`
    stops its workers and exits with status 4. Continue it later from its latest committed
    snapshot with the same `trainguard run` command and --continue, on every node.

    Sends a stop request on the bus (with the job's event MAC when TRAINGUARD_EVENT_KEY is set)
    and waits for the daemon's abort (signed, checked with TRAINGUARD_DAEMON_PUBLIC_KEYS when
    set). Exits 0 once the job is stopped (also when it was already), 1 when it had ended
    otherwise (failed, finished), 3 when no daemon acted on the request within --timeout (the
    request stays on the bus: a daemon that reads it later stops the job), 2 for bad input or
    an unreachable bus.
    """
    from trainguard.daemon.service import load_daemon_config

    try:
        settings = load_daemon_config(config, bus_url=bus)
        keys = agent_keys_from_env(os.environ)
    except OSError as exc:  # the agents' key loading words its own (AgentError)
        _fail(os_failure(exc, "read the config file", config))
    except (ValueError, AgentError) as exc:
        _fail(str(exc))
    bus_config = replace(settings.bus, create=False, client_id="trainguard-stop")
    if topic_prefix is not None:
        bus_config = replace(bus_config, prefix=topic_prefix)
    group = daemon_group or settings.group_id or f"{bus_config.prefix}daemon"
    if not timeout > 0:
        _fail(f"--timeout must be > 0 seconds, got {timeout}")
    try:
        outcome = asyncio.run(
            stop_job(bus_config, job, reason=reason, keys=keys, group=group, timeout_s=timeout)
        )
    except (BusError, AgentError) as exc:
        _fail(str(exc))
    color = typer.colors.GREEN if outcome.code == 0 else typer.colors.RED
    typer.secho(outcome.message, fg=color, err=outcome.code != 0)
    raise typer.Exit(outcome.code)


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


async def stop_job(
    bus_config: BusConfig,
    job_id: str,
    *,
    reason: str,
    keys: AgentKeys,
    group: str,
    timeout_s: float,
) -> StopOutcome:
    """Send a stop request for ``job_id`` and wait for the daemon's answer.

    Args:
        bus_config: the bus.
        job_id: the job.
        reason: the operator's words.
        keys: the job's event key (the request's MAC) and the daemon's public keys (its
            answer's signature).
        group: the daemon's consumer group: once its position on ``events`` passes the request
            without an abort, the daemon has ignored it (the job has ended otherwise).
        timeout_s: seconds to wait for the answer.

    Raises:
        BusError: the bus cannot be reached or read.
    """
    gate = CommandGate(job_id, 0, keys.verify)
    async with open_bus(bus_config) as bus:
        tp = TopicPartition("commands", partition_for(job_id, await bus.partitions("commands")))
        end = (await bus.end_offsets("commands"))[tp]
        latest, _ = await latest_command(bus, job_id, gate)
        if isinstance(latest, Abort):
            return _already(job_id, latest)
        generation = 0 if latest is None else latest.generation
        request = encode_request(
            job_id,
            "stop",
            generation=generation,
            host=socket.gethostname(),
            pid=os.getpid(),
            seq=time.time_ns(),  # one request per process; a reused pid still gets a newer seq
            reason=reason,
            key=keys.event,
        )
        sent = await bus.publish("events", job_id, request)
        events = TopicPartition("events", sent.partition)
        deadline = time.monotonic() + timeout_s
        async with await bus.assign({tp: end}) as consumer:
            while time.monotonic() < deadline:
                for record in await consumer.getmany(timeout_s=_POLL_S):
                    if record.key != job_id or record.value is None:
                        continue
                    command = gate.admit(record.value)
                    if isinstance(command, Abort) and command.generation >= generation:
                        return _answer(job_id, command)
                position = (await bus.group_positions(group, "events")).get(events)
                if position is not None and position > sent.offset:
                    # The daemon acted on everything up to the request: its abort, if any, is
                    # on the bus before that position was committed.
                    latest, _ = await latest_command(
                        bus, job_id, CommandGate(job_id, 0, keys.verify)
                    )
                    if isinstance(latest, Abort) and latest.generation >= generation:
                        return _answer(job_id, latest)
                    return StopOutcome(
                        EXIT_NOT_STOPPED,
                        f"the daemon read the stop request for job {job_id!r} but did not stop "
                        "it: the job has ended already, or the request was rejected (a job "
                        f"the daemon has no events of: a mistyped id? trainguard status "
                        f"{job_id}; the daemon's log says why)",
                    )
    return StopOutcome(
        EXIT_UNCONFIRMED,
        f"no daemon acted on the stop request for job {job_id!r} within {timeout_s:g} s (bus "
        f"{bus_config.url}, topic prefix {bus_config.prefix!r}, daemon group {group!r}): is "
        "`trainguard daemon` running on this bus? The request stays on the bus: a daemon that "
        "reads it stops the job.",
    )


def _already(job_id: str, abort: Abort) -> StopOutcome:
    if abort.outcome == "stopped":
        return StopOutcome(
            0, f"job {job_id!r} is stopped already (generation {abort.generation}): {abort.reason}"
        )
    return StopOutcome(
        EXIT_NOT_STOPPED,
        f"job {job_id!r} failed in generation {abort.generation}, nothing to stop: {abort.reason}",
    )


def _answer(job_id: str, abort: Abort) -> StopOutcome:
    if abort.outcome == "stopped":
        return StopOutcome(
            0,
            f"job {job_id!r} stopped in generation {abort.generation}; continue it with the same "
            "trainguard run command and --continue, on every node",
        )
    return StopOutcome(
        EXIT_NOT_STOPPED,
        f"job {job_id!r} failed before the stop took effect (generation {abort.generation}): "
        f"{abort.reason}",
    )
