"""A job's record digested for its report (:mod:`trainguard.daemon.forensics._report`): the audit
trail's incidents, restores, resumes and commits; the events sorted by kind; each generation's
progress curve.

Pure: no I/O, no clock reads. Times are bus append times, ms since the Unix epoch.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainguard.daemon.core import plain_value
from trainguard.schemas import (
    Checkpoint,
    ClockTick,
    Heartbeat,
    HeartbeatBatch,
    Lifecycle,
    Restore,
    Resume,
)

__all__ = [
    "AuditDigest",
    "Curve",
    "EventDigest",
    "Opened",
    "Restored",
    "Timed",
    "read_audit",
    "read_events",
]


class Timed(Protocol):
    """A record of the job with its bus append time (``trainguard.daemon.demo._harness.Stamped`` is one)."""

    @property
    def at_ms(self) -> int:
        """Bus append time, ms since the Unix epoch."""
        ...

    @property
    def message(self) -> object:
        """The decoded message."""
        ...


@dataclass(frozen=True, slots=True)
class Opened:
    """An ``incident_opened`` decision of the audit, at the time of the input that opened it
    (the fields are the decision's; ``measures`` as the audit's JSON object)."""

    incident_id: str
    cause: str
    generation: int
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    reason: str
    onset_after_step: int | None
    measures: Mapping[str, Any]
    at_ms: int


@dataclass(frozen=True, slots=True)
class Restored:
    """A restore the daemon issued: its incident, the generation it starts, its target
    (``None`` fields: a restart from scratch), mode, when it was decided (or sent), and its
    ``ts`` (the daemon's clock when it decided it, ns: what manifests' ``ts`` compare with)."""

    incident_id: str
    generation: int
    target_step: int | None
    target_generation: int | None
    snapshot_id: str | None
    mode: str
    at_ms: int
    ts: int


@dataclass
class AuditDigest:
    """The audit trail digested; the first occurrence of each decision counts (a daemon that
    crashed before committing its position writes its last entry again).

    Attributes:
        opened: incidents by id.
        restores: restores by the generation they start.
        resumes: ``(step, at_ms)`` by generation.
        closed: ``(outcome, at_ms)`` by incident id.
        commits: ``(generation, step, at_ms)`` by snapshot id.
        ended: ``("finished" | "failed" | "stopped", at_ms)`` of the job's end, if it ended
            (and was not continued since).
        stops: ``at_ms`` of each generation's stop on request (first only).
    """

    opened: dict[str, Opened] = field(default_factory=dict)
    restores: dict[int, Restored] = field(default_factory=dict)
    resumes: dict[int, tuple[int, int]] = field(default_factory=dict)
    closed: dict[str, tuple[str, int]] = field(default_factory=dict)
    commits: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    ended: tuple[str, int] | None = None
    stops: dict[int, int] = field(default_factory=dict)


def read_audit(entries: Iterable[Mapping[str, Any]], commands: Iterable[Timed] = ()) -> AuditDigest:
    """Digest audit entries (dicts with ``at_ms`` and ``decisions``, the decisions'
    ``to_dict`` forms: :mod:`trainguard.daemon.core._decisions`; entries without decisions are
    skipped). A restore or resume found in ``commands`` takes that record's append time (when
    it was sent) instead of the time of the input that decided it, if it is exactly the command
    the audit says the daemon issued (every field but the signature): a command some other bus
    client wrote (a forgery, which agents ignore) moves no time.

    Raises:
        KeyError, ValueError, TypeError: an entry lacks a field its decision always has.
    """
    audit = AuditDigest()
    issued: dict[tuple[str, int], Mapping[str, Any]] = {}
    for entry in entries:
        decisions = entry.get("decisions") or ()
        if not decisions:
            continue  # a configuration entry (``_audit.py``) decides nothing
        at = int(entry["at_ms"])
        for d in decisions:
            kind = d.get("decision")
            if kind == "incident_opened" and d["incident_id"] not in audit.opened:
                audit.opened[d["incident_id"]] = Opened(
                    incident_id=d["incident_id"],
                    cause=d["cause"],
                    generation=int(d["generation"]),
                    ranks=tuple(d.get("ranks", ())),
                    hosts=tuple(d.get("hosts", ())),
                    reason=d.get("reason", ""),
                    onset_after_step=d.get("onset_after_step"),
                    measures=d.get("measures") or {},
                    at_ms=at,
                )
            elif kind == "issue":
                _read_command(audit, d["command"], at)
                command = d["command"]
                kind_of = str(command.get("schema", "")).partition("/")[0]
                issued.setdefault((kind_of, int(command["generation"])), command)
            elif kind == "incident_closed":
                audit.closed.setdefault(d["incident_id"], (d["outcome"], at))
            elif kind == "committed":
                # The snapshot's reference; audit entries of builds before restore/2 held the
                # whole manifest, with the same three fields.
                m = d["snapshot"] if "snapshot" in d else d["manifest"]
                audit.commits.setdefault(
                    m["snapshot_id"], (int(m["generation"]), int(m["step"]), at)
                )
            elif kind == "transition" and d["new"] in ("finished", "failed", "stopped"):
                # The latest end counts (a stopped or failed job may be continued and end again);
                # a re-derived entry repeats its input's time.
                audit.ended = (d["new"], at)
                if d["new"] == "stopped":
                    audit.stops.setdefault(int(d["generation"]), at)
            elif kind == "transition" and d["old"] in ("failed", "stopped"):
                audit.ended = None  # continued
    for item in commands:
        msg = item.message
        if not isinstance(msg, Restore | Resume):
            continue
        said = issued.get((msg.SCHEMA.partition("/")[0], msg.generation))
        if said is None or plain_value(dataclasses.replace(msg, auth=None)) != said:
            continue
        if isinstance(msg, Restore) and msg.generation in audit.restores:
            old = audit.restores[msg.generation]
            if old.incident_id == msg.incident_id:
                audit.restores[msg.generation] = dataclasses.replace(old, at_ms=item.at_ms)
        elif isinstance(msg, Resume) and msg.generation in audit.resumes:
            audit.resumes[msg.generation] = (audit.resumes[msg.generation][0], item.at_ms)
    return audit


def _read_command(audit: AuditDigest, command: Mapping[str, Any], at: int) -> None:
    schema = str(command.get("schema", ""))
    generation = int(command["generation"])
    if schema.startswith("restore/") and generation not in audit.restores:
        target = command.get("target")
        audit.restores[generation] = Restored(
            incident_id=command["incident_id"],
            generation=generation,
            target_step=None if target is None else int(target["step"]),
            target_generation=None if target is None else int(target["generation"]),
            snapshot_id=None if target is None else target["snapshot_id"],
            mode=command.get("mode", "restart"),
            at_ms=at,
            ts=int(command["ts"]),
        )
    elif schema.startswith("resume/"):
        audit.resumes.setdefault(generation, (int(command["step"]), at))


@dataclass
class EventDigest:
    """The job's events (ticks left out) sorted by kind, each with its append time.

    Attributes:
        start_ms, last_ms: the first and last event, ``None`` without events.
        world_size: the highest world size reported by a heartbeat.
        beats, shards, lifecycles: heartbeats (a batch's entries each as its rank's, at the
            batch's append time), checkpoint shards, lifecycle reports.
        progress: by generation, ``(at_ms, step)`` of every report of a step reached
            (heartbeats, and ``error``/``finished``/``exited`` reports naming a step).
        step_times: step times (seconds) reported by heartbeats in the ``train`` phase.
    """

    start_ms: int | None = None
    last_ms: int | None = None
    world_size: int = 0
    beats: list[tuple[int, Heartbeat]] = field(default_factory=list)
    shards: list[tuple[int, Checkpoint]] = field(default_factory=list)
    lifecycles: list[tuple[int, Lifecycle]] = field(default_factory=list)
    progress: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)

    def add_beat(self, at_ms: int, beat: Heartbeat) -> None:
        """Count ``beat``, appended at ``at_ms``."""
        self.beats.append((at_ms, beat))
        self.world_size = max(self.world_size, beat.world_size)
        self.progress.setdefault(beat.generation, []).append((at_ms, beat.step))
        time_s = beat.step_time_s
        if beat.phase == "train" and time_s is not None and math.isfinite(time_s):
            self.step_times.append(time_s)


def read_events(events: Iterable[Timed]) -> EventDigest:
    """Sort the job's events by append time (stable) and by kind."""
    out = EventDigest()
    for item in sorted(events, key=lambda e: e.at_ms):
        at, msg = item.at_ms, item.message
        if isinstance(msg, ClockTick):
            continue
        out.start_ms = at if out.start_ms is None else out.start_ms
        out.last_ms = at
        match msg:
            case Heartbeat():
                out.add_beat(at, msg)
            case HeartbeatBatch():
                # Each entry counts as its rank's heartbeat at the batch's append time, as
                # the daemon folds it.
                for beat in msg.heartbeats():
                    out.add_beat(at, beat)
            case Checkpoint():
                out.shards.append((at, msg))
            case Lifecycle():
                out.lifecycles.append((at, msg))
                if msg.step is not None and msg.kind in ("error", "finished", "exited"):
                    out.progress.setdefault(msg.generation, []).append((at, msg.step))
    return out


class Curve:
    """A generation's progress: the highest step reported by any rank over time, starting at
    ``(begin_ms, from_step)``; reports before ``begin_ms`` are ignored (an in-process restore's
    ranks report steps of the abandoned timeline until they reload). Between two reports the
    step is taken to grow linearly, so a step's time is known to within a heartbeat interval.
    """

    def __init__(self, begin_ms: int, from_step: int, points: Iterable[tuple[int, int]]) -> None:
        self.times = [begin_ms]
        self.steps = [from_step]
        for at, step in points:
            if at >= begin_ms and step > self.steps[-1]:
                self.times.append(at)
                self.steps.append(step)

    @property
    def last_step(self) -> int:
        """The highest step reported."""
        return self.steps[-1]

    def reached_ms(self, step: int) -> float:
        """When ``step`` was reached (ms): interpolated between the reports around it; the
        start for a step at or before ``from_step``, the last report for one never reported."""
        i = bisect.bisect_left(self.steps, step)
        if i == 0:
            return float(self.times[0])
        if i == len(self.steps):
            return float(self.times[-1])
        s0, s1, t0, t1 = self.steps[i - 1], self.steps[i], self.times[i - 1], self.times[i]
        return t0 + (step - s0) / (s1 - s0) * (t1 - t0)
