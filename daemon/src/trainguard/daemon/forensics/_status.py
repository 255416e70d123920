"""``trainguard status``: the jobs' current state, folded from the bus.

Not asked of a running daemon: the job's events (ticks included) are read from ``events`` and
folded through the same pure state machine (:func:`~trainguard.daemon.decide`) with the
daemon's configuration, so the answer is the state the owning daemon holds (as of the last
record read), with or without a daemon running.

**Only what the daemon folded.** Status holds no keys. As a replay does
(:mod:`trainguard.daemon.core._intake`), it takes each record in with the job's audit trail as its
:class:`~trainguard.daemon.core._intake.Authenticator`: a record the daemon refused as not
authentic (a forged heartbeat, say) has a ``refused`` entry on ``audit`` and is left out (and
counted: :attr:`JobStatus.refused`). ``audit`` is read after ``events``, so the trail holds the
daemon's verdict on every record read that the daemon had judged by then.

**Records not judged yet.** A record the daemon has not judged when the audit is read (it lags
behind, or no daemon runs) has no verdict there; the trail cannot tell it from an authentic
record (the daemon writes nothing for an authentic record that decides nothing), so status
folds it as a daemon without keys would: as authentic. With a daemon running this is the
records of its last poll (milliseconds); while it is down or behind (its consumer lag,
``trainguard_consumer_lag_records``), a forged record shows until the daemon catches up,
refuses it and records so, and the next ``status`` leaves it out.

Cost: a full fold of every event of every job shown, from offset 0 (all of ``events`` for the
table, the job's partition for one job), plus a read of ``audit`` (its entries for decisions
and refusals only). Reading, decoding, validating and folding take about 25 us per event on
one core (measured on the embedded bus: 100,000 heartbeats of 20 jobs in 2.6 s of CPU), so
hundreds of jobs of some thousand events each answer in seconds; the records read are held in
memory until the audit is read. On Kafka, records the topic's retention already deleted are
missing from the fold.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from trainguard.agent.bus import Bus, BusConfig, Record, TopicPartition, open_bus, partition_for
from trainguard.daemon.core import (
    TERMINAL_PHASES,
    Anomaly,
    AuditTrail,
    Committed,
    IncidentOpened,
    Input,
    JobState,
    MachineConfig,
    Refused,
    Taken,
    decide,
    entries_by_job,
    new_job,
    read_trail,
    take,
)
from trainguard.schemas import JSONValue

__all__ = ["JobStatus", "job_summary", "rank_summaries", "read_status", "read_topic"]

_NS_PER_S = 1_000_000_000
_STALL_TIMEOUT_S = 120.0
"""Longest wait for the next records of a topic before giving up on reaching its end."""


@dataclass(frozen=True, slots=True)
class JobStatus:
    """One job as the bus tells it.

    Attributes:
        state: the state machine's state after the job's last input.
        inputs: inputs folded (events and ticks that decoded and named the job).
        last_incident: the latest incident opened, or ``None``.
        last_incident_ns: the daemon clock (bus time, ns) when it opened.
        refused: records of the job left out because the daemon refused them as not
            authentic (its audit trail says so; module docstring).
        not_committed: why the job's latest step with every shard in did not commit (its
            ranks' shards or data cursors disagree), until a step commits again; else
            ``None``.
    """

    state: JobState
    inputs: int = 0
    last_incident: IncidentOpened | None = None
    last_incident_ns: int | None = None
    refused: int = 0
    not_committed: str | None = None


def _fold_one(jobs: dict[str, JobStatus], job: str, item: Input, config: MachineConfig) -> None:
    """Fold one input of ``job`` (the daemon's fold), noting an incident it opens and whether
    its steps commit."""
    status = jobs.get(job) or JobStatus(new_job(job))
    state, decisions = decide(status.state, item, config)
    last, last_ns, blocked = status.last_incident, status.last_incident_ns, status.not_committed
    for decision in decisions:
        if isinstance(decision, IncidentOpened):
            last, last_ns = decision, state.clock_ns
            if decision.cause == "cursor_mismatch":
                blocked = decision.reason
        elif isinstance(decision, Committed):
            blocked = None
        elif isinstance(decision, Anomaly) and decision.kind == "checkpoint_mismatch":
            blocked = decision.reason
    # Positional: this runs for every input, and ``dataclasses.replace`` costs several times more.
    jobs[job] = JobStatus(state, status.inputs + 1, last, last_ns, status.refused, blocked)


async def read_status(
    bus: BusConfig, config: MachineConfig, job: str | None = None
) -> dict[str, JobStatus]:
    """Read ``events`` from offset 0 to its end offsets at the time of the call, then
    ``audit`` likewise, and fold the events the daemon did not refuse (module docstring).

    Args:
        bus: how to reach the bus (its topic prefix included).
        config: the state machine's settings (the daemon's ``[machine]`` table), for a job
            the daemon has recorded no decision of yet; a job with decisions on ``audit`` is
            folded under the configuration of its newest ones (the daemon's own, which folds
            the log from offset 0 under it).
        job: only this job (only its partition is read), or ``None`` for every job.

    Returns:
        job id -> status; empty when the bus holds no event of ``job`` the daemon folded.

    Raises:
        trainguard.agent.bus.BusError: the bus is unreachable.
        TimeoutError: no record arrived for 120 s before the end offsets were reached.
        MalformedAudit: an audit entry is not in the audit format (named by its position).
    """
    async with open_bus(bus) as b:
        partitions = None
        if job is not None:
            partitions = {partition_for(job, await b.partitions("events"))}
        events = [
            r async for r in read_topic(b, "events", partitions) if job is None or r.key == job
        ]
        # After the events: the trail then holds every verdict the daemon gave on them so far.
        audit = [r async for r in read_topic(b, "audit", partitions)]
    trails = {
        key: read_trail(entries)
        for key, entries in entries_by_job(audit).items()
        if job is None or key == job
    }
    # Each job under the configuration its daemon decides it with now: a daemon folds the
    # log from offset 0 under its own settings (those of its newest decisions on the trail),
    # which may differ from this command's (``--restore-timeout`` given to the daemon only).
    machines = {key: _deciding(trail, config) for key, trail in trails.items()}
    jobs: dict[str, JobStatus] = {}
    refused: dict[str, int] = {}
    for record in events:
        trail: AuditTrail | None = trails.get(record.key) if record.key is not None else None
        taken = take(record, trail)
        if isinstance(taken, Taken):
            _fold_one(jobs, taken.job_id, taken.input, machines.get(taken.job_id, config))
        elif isinstance(taken, Refused) and taken.auth is not None and record.key is not None:
            refused[record.key] = refused.get(record.key, 0) + 1
    for key, count in refused.items():
        if key in jobs:
            jobs[key] = replace(jobs[key], refused=count)
    return jobs


def _deciding(trail: AuditTrail, default: MachineConfig) -> MachineConfig:
    """The configuration of the job's newest recorded decisions, or ``default`` if the trail
    has none yet.

    Raises:
        MalformedAudit: that configuration's entry is missing or does not rebuild.
    """
    return trail.machine(trail.groups[-1].config_id) if trail.groups else default


async def read_topic(
    bus: Bus, topic: str, partitions: set[int] | None = None
) -> AsyncIterator[Record]:
    """The records of ``topic`` (of ``partitions``, or all) up to its end offsets at the time
    of the call, each partition's in offset order.

    Raises:
        trainguard.agent.bus.BusError: the bus failed.
        TimeoutError: no record arrived for 120 s before the end offsets were reached.
    """
    ends = {
        tp: end
        for tp, end in (await bus.end_offsets(topic)).items()
        if end > 0 and (partitions is None or tp.partition in partitions)
    }
    if not ends:
        return
    seen: dict[TopicPartition, int] = dict.fromkeys(ends, 0)
    deadline = time.monotonic() + _STALL_TIMEOUT_S
    async with await bus.assign(dict.fromkeys(ends, 0)) as consumer:
        while any(seen[tp] < end for tp, end in ends.items()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} stalled for {_STALL_TIMEOUT_S:g} s")
            records = await consumer.getmany(timeout_s=0.5, max_records=10_000)
            if records:
                deadline = time.monotonic() + _STALL_TIMEOUT_S
            for record in records:
                if record.offset < ends[record.tp]:
                    yield record
            # The consumer's position, not the last record's offset: a partition written in
            # transactions ends with markers that no record carries.
            for tp in ends:
                seen[tp] = max(seen[tp], await consumer.position(tp))


def job_summary(status: JobStatus, now_ns: int) -> dict[str, JSONValue]:
    """One job's row: phase, generation, step (highest of the current generation's ranks),
    last committed step, why its steps do not commit (``not_committed``, or ``None``), ranks
    alive of the world size (``None`` once the job ended), incidents, the latest incident (id, cause, reason, seconds since
    it opened, whether still open), seconds since its last input, inputs folded, and records
    left out as refused by the daemon. Ages are ``now_ns`` (wall clock) minus bus times."""
    state = status.state
    steps = [r.step for r in state.ranks.values() if r.step is not None]
    last: dict[str, JSONValue] | None = None
    if status.last_incident is not None and status.last_incident_ns is not None:
        opened = status.last_incident
        last = {
            "id": opened.incident_id,
            "cause": opened.cause,
            "reason": opened.reason,
            "age_s": _age_s(now_ns, status.last_incident_ns),
            "open": state.incident is not None and state.incident.incident_id == opened.incident_id,
        }
    return {
        "job_id": state.job_id,
        "phase": state.phase,
        "generation": state.generation,
        "step": max(steps, default=None),
        "committed_step": state.committed[-1].step if state.committed else None,
        "not_committed": status.not_committed,
        # An ended job's ranks are not followed any more (their exits after the end are late
        # inputs, ignored): counting them alive would be a guess.
        "ranks_alive": None
        if state.phase in TERMINAL_PHASES
        else sum(r.status == "alive" for r in state.ranks.values()),
        "world_size": state.world_size,
        "incidents": state.incidents_opened,
        "last_incident": last,
        "failure": state.failure,
        "last_input_age_s": _age_s(now_ns, state.clock_ns),
        "inputs": status.inputs,
        "refused": status.refused,
    }


def rank_summaries(status: JobStatus, now_ns: int) -> list[dict[str, JSONValue]]:
    """The current generation's ranks, ascending: host, pid, status, declared phase, step,
    seconds since last heard, smoothed step time (seconds), straggling."""
    return [
        {
            "rank": r.rank,
            "host": r.host,
            "pid": r.pid,
            "status": r.status,
            "phase": r.phase,
            "step": r.step,
            "last_heard_s": _age_s(now_ns, r.last_heard_ns),
            "step_time_s": r.step_time_s,
            "straggling": r.straggling,
        }
        for r in sorted(status.state.ranks.values(), key=lambda r: r.rank)
    ]


def _age_s(now_ns: int, then_ns: int) -> float:
    return round(max(0, now_ns - then_ns) / _NS_PER_S, 3)
