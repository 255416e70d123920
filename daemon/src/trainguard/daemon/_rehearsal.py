"""Run a real job under trainguard, with failures injected, and read back what happened.

Used by ``trainguard demo``, the scenario tests and the recovery benchmark. Everything runs as
separate OS processes, exactly as in production: a ``trainguard daemon``, a ``trainguard run``
supervisor, and the workers it starts; faults are injected inside the workers through
``TRAINGUARD_FAULTS`` (see :mod:`trainguard.agent._faults`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from trainguard.agent.bus import DEFAULT_TOPICS, BusConfig, Record, open_bus
from trainguard.schemas import (
    Abort,
    Command,
    Event,
    Heartbeat,
    Lifecycle,
    Restore,
    Resume,
    SchemaError,
    decode,
)

__all__ = [
    "JobRecord",
    "Stamped",
    "read_job_record",
    "start_daemon",
    "stop_process",
    "supervise",
    "wait_all",
]

_CLI = [sys.executable, "-m", "trainguard.daemon.cli"]


def start_daemon(
    bus_url: str,
    *,
    prefix: str,
    log_path: Path,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``trainguard daemon`` in its own process group; its JSON log goes to ``log_path``."""
    log = log_path.open("ab")
    return subprocess.Popen(
        [*_CLI, "daemon", "--bus", bus_url, "--topic-prefix", prefix, *args],
        stdout=log,
        stderr=log,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def supervise(
    job_id: str,
    command: Sequence[str],
    *,
    bus_url: str,
    prefix: str,
    nproc_per_node: int,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    grace_s: float = 5.0,
) -> subprocess.Popen[bytes]:
    """Start ``trainguard run --nproc-per-node N -- command`` (the node's supervisor)."""
    log = log_path.open("ab")
    return subprocess.Popen(
        [
            *_CLI,
            "run",
            "--job",
            job_id,
            "--bus",
            bus_url,
            "--topic-prefix",
            prefix,
            "--nproc-per-node",
            str(nproc_per_node),
            "--grace",
            str(grace_s),
            "--",
            *command,
        ],
        stdout=log,
        stderr=log,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def stop_process(
    proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 30
) -> int:
    """Send ``sig`` to the process's group, wait, SIGKILL after ``timeout_s``; return its code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.wait()


@dataclass(frozen=True, slots=True)
class Stamped:
    """A decoded message with the bus append time of its record (ms since the Unix epoch)."""

    at_ms: int
    message: Any


@dataclass
class JobRecord:
    """Everything the bus holds about one job, in bus order per topic.

    Attributes:
        events: the job's events (``ClockTick`` records included), decoded.
        commands: the daemon's commands for the job.
        audit: the daemon's decisions (``{"offset": ..., "decisions": [...]}`` dicts).
        rejected: ``events`` records that did not decode.
    """

    events: list[Stamped] = field(default_factory=list)
    commands: list[Stamped] = field(default_factory=list)
    audit: list[dict[str, Any]] = field(default_factory=list)
    rejected: int = 0

    def restores(self) -> list[Restore]:
        """The restore commands issued, in order."""
        return [c.message for c in self.commands if isinstance(c.message, Restore)]

    def resumes(self) -> list[Resume]:
        """The resume commands issued, in order."""
        return [c.message for c in self.commands if isinstance(c.message, Resume)]

    def aborts(self) -> list[Abort]:
        """The abort commands issued."""
        return [c.message for c in self.commands if isinstance(c.message, Abort)]

    def first(self, kind: type, **match: Any) -> Stamped | None:
        """The first event or command of ``kind`` whose attributes equal ``match``."""
        for item in (*self.events, *self.commands):
            if isinstance(item.message, kind) and all(
                getattr(item.message, k) == v for k, v in match.items()
            ):
                return item
        return None

    def kills(self) -> list[Lifecycle]:
        """Supervisor reports of workers that died of a signal."""
        return [
            e.message
            for e in self.events
            if isinstance(e.message, Lifecycle)
            and e.message.kind == "exited"
            and e.message.signal is not None
        ]

    def max_step(self, generation: int) -> int:
        """Highest step any rank reported in ``generation`` (heartbeats), or 0."""
        steps = [
            e.message.step
            for e in self.events
            if isinstance(e.message, Heartbeat) and e.message.generation == generation
        ]
        return max(steps, default=0)

    def decisions(self) -> list[dict[str, Any]]:
        """Every decision of the audit trail, flattened, in order."""
        return [d for entry in self.audit for d in entry["decisions"]]


async def read_job_record(bus_url: str, prefix: str, job_id: str) -> JobRecord:
    """Read the job's events, commands and audit entries from the bus (from offset 0)."""
    record = JobRecord()
    config = BusConfig(url=bus_url, prefix=prefix, topics=DEFAULT_TOPICS, client_id="rehearsal")
    async with open_bus(config) as bus:
        for topic in ("events", "commands", "audit"):
            for rec in await _read_topic(bus, topic):
                if rec.key != job_id or rec.value is None:
                    continue
                if topic == "audit":
                    record.audit.append(orjson.loads(rec.value))
                    continue
                try:
                    message: Event | Command = decode(rec.value)  # type: ignore[assignment]
                except SchemaError:
                    record.rejected += 1
                    continue
                target = record.events if topic == "events" else record.commands
                target.append(Stamped(rec.timestamp_ms, message))
    return record


async def _read_topic(bus: Any, topic: str) -> list[Record]:
    ends = await bus.end_offsets(topic)
    pending = {tp: end for tp, end in ends.items() if end > 0}
    out: list[Record] = []
    if not pending:
        return out
    async with await bus.assign(dict.fromkeys(pending, 0)) as consumer:
        seen = dict.fromkeys(pending, 0)
        deadline = time.monotonic() + 60
        while any(seen[tp] < end for tp, end in pending.items()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} stalled")
            for rec in await consumer.getmany(timeout_s=0.5, max_records=10_000):
                if rec.offset < pending[rec.tp]:
                    out.append(rec)
                seen[rec.tp] = max(seen[rec.tp], rec.offset + 1)
    out.sort(key=lambda r: (r.partition, r.offset))
    return out


def wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Wait for every process; raises ``TimeoutError`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"process {proc.args!r} still running after {timeout_s} s") from exc
