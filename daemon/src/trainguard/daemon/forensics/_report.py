"""A job's report from its record: where the wall time went, what each incident cost, and the
checkpoint interval the observed failure rate and checkpoint cost suggest.

Pure: no I/O, no clock reads. The input is what the bus holds about one job (its events with
their bus append times, the daemon's audit entries, optionally its commands);
:func:`build_report` returns a :class:`JobReport` that the ``trainguard report`` command
prints, writes as JSON, or draws as HTML (:mod:`trainguard.daemon.forensics._report_html`).

All times are bus append times in milliseconds since the Unix epoch (one clock, the broker's or
the embedded bus's), except the death of a process, which is its supervisor's ``exited``
report's own ``ts``. Steps are training steps as the agents report them.

**How the wall time is split** (every millisecond of ``[start, end]`` goes to one kind, so the
kinds add up to the wall time; ``docs/forensics.md`` has the same in prose):

* ``startup``: from the job's first event to the first training step of generation 0 (process
  start, imports, rendezvous, loading). The first step's start is estimated as the first
  training heartbeat's time minus the steps it reports times the median step time.
* ``productive``: a generation advancing steps that survive in the final timeline.
* ``recomputed``: a generation advancing steps that a later restore threw away.
* ``detection``: from the failure's onset (estimated per cause, :attr:`IncidentReport.onset`)
  to the incident.
* ``restore``: from the incident to the ``resume`` of the generation that took over (restart,
  loading, the barrier), or to the job's end when nothing resumed.
* ``tail``: after the final timeline's last step (final checkpoint, shutdown).
* ``stopped``: from a stop on request to the job's continuation (or the job's end): no work
  was asked for.
* ``other``: anything the record does not explain (e.g. a generation that resumed without
  heartbeats).

The final timeline is followed backwards from its last step: the last generation's steps
survive, then those of the generation its restore target was written in, up to that target,
and so on. For a job that failed or was stopped it starts from the newest committed snapshot
(a continuation resumes from there).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from trainguard.daemon.forensics._report_lanes import Mark, RankSpan, marks, rank_spans
from trainguard.daemon.forensics._report_record import (
    AuditDigest,
    Curve,
    EventDigest,
    Opened,
    Timed,
    read_audit,
    read_events,
)
from trainguard.daemon.forensics._young_daly import (
    DALY_SOURCE,
    YOUNG_SOURCE,
    daly_interval_s,
    model_goodput,
    young_interval_s,
)
from trainguard.schemas import Checkpoint, Heartbeat

__all__ = [
    "SEGMENT_KINDS",
    "CheckpointAdvice",
    "GenerationSpan",
    "IncidentReport",
    "JobReport",
    "Mark",
    "RankSpan",
    "Segment",
    "SegmentKind",
    "Timed",
    "build_report",
    "daly_interval_s",
    "model_goodput",
    "young_interval_s",
]

SegmentKind: TypeAlias = Literal[
    "startup", "productive", "recomputed", "detection", "restore", "tail", "stopped", "other"
]
SEGMENT_KINDS: tuple[SegmentKind, ...] = (
    "productive",
    "recomputed",
    "detection",
    "restore",
    "startup",
    "tail",
    "stopped",
    "other",
)
"""Every kind of wall time, in the order reports list them."""

_MS = 1000.0
_SKEW_MS = 1000
"""How far a supervisor's clock may run ahead of the bus's before its exit time stamp is
ignored (ms)."""


# -- the report ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch ``[start_ms, end_ms)`` of the job's wall time and what it went to."""

    kind: SegmentKind
    start_ms: int
    end_ms: int
    generation: int
    incident_id: str | None = None


@dataclass(frozen=True, slots=True)
class GenerationSpan:
    """Generation ``generation`` from its restore command (the job's first event for 0) to
    the next generation's; ``resumed_ms`` is when it started training (its ``resume``, for 0
    the estimated first step), ``None`` if it never did; ``from_step`` the step it started
    from."""

    generation: int
    start_ms: int
    end_ms: int
    resumed_ms: int | None
    from_step: int


@dataclass(frozen=True, slots=True)
class IncidentReport:
    """What one incident cost.

    Attributes:
        incident_id: ``<job_id>/i<n>``.
        cause: the detector that fired (``exited``, ``progress_timeout``, ...).
        generation: the generation it happened in.
        ranks: ranks the evidence named; hosts: their hosts.
        reason: the daemon's reason.
        opened_ms: when the daemon opened it (the time of the input that showed it).
        onset_ms: estimated start of the failure (see :attr:`onset_evidence`).
        onset_evidence: how ``onset_ms`` was estimated, in words.
        detection_s: ``opened - onset``, seconds.
        outcome: ``resumed``, ``failed``, ``finished``, or ``None`` while still open.
        restore_s: from ``opened`` to the resume of the generation that took over (or to the
            incident's close or the job's end), seconds.
        attempts: restore commands issued for it.
        target_step: the step restored to (the last attempt's), ``None`` when there was no
            restore; target_snapshot its snapshot id (``None`` also for a restart from scratch).
        mode: ``restart`` or ``in_process`` (the last attempt's), ``None`` without restore.
        reached_step: the highest step reported before the training resumed.
        recomputed_steps: steps trained in the abandoned generation(s) after the restore
            target (after the last surviving step when there was no restore).
        recomputed_s: the time the abandoned generation spent on them, seconds.
        lost_s: ``detection_s + restore_s + recomputed_s``.
    """

    incident_id: str
    cause: str
    generation: int
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    reason: str
    opened_ms: int
    onset_ms: int
    onset_evidence: str
    detection_s: float
    outcome: str | None
    restore_s: float
    attempts: int
    target_step: int | None
    target_snapshot: str | None
    mode: str | None
    reached_step: int
    recomputed_steps: int
    recomputed_s: float
    lost_s: float


@dataclass(frozen=True, slots=True)
class CheckpointAdvice:
    """The job's checkpoint interval next to the one its failure rate and checkpoint cost
    suggest (Young; Daly's higher-order estimate beside it).

    Young: ``tau = sqrt(2 * C * M)`` (:data:`YOUNG_SOURCE`); Daly, for ``C < 2 M``:
    ``tau = sqrt(2 C M) * (1 + sqrt(C / (2 M)) / 3 + (C / (2 M)) / 9) - C``, else ``M``
    (:data:`DALY_SOURCE`). ``tau`` is compute time between checkpoints, ``C`` the cost of one
    checkpoint, ``M`` the mean time between failures.

    Attributes:
        checkpoints: checkpoints taken (distinct generation and step with a shard announced).
        interval_steps: median steps between consecutive checkpoints of a generation.
        interval_s: median seconds between them (first shard announced to first shard
            announced), ``None`` with fewer than two.
        phase_cost_s: declared ``checkpoint`` phase time per checkpoint (the training stood
            still: a blocking write, or waiting for the previous background write), ``None``
            when no rank declared the phase.
        write_s: mean time from a step being reached to its slowest shard being announced
            (background writes overlap training, so this bounds their cost from above; its
            resolution is the heartbeat interval), ``None`` without checkpoints.
        cost_s: ``C``: ``phase_cost_s`` when measured, else ``write_s``.
        cost_source: where ``cost_s`` comes from, in words.
        failures: incidents opened.
        exposure_s: time the job could fail in: wall time minus restore time.
        mtbf_s: ``M = exposure_s / failures``; with no failure, ``exposure_s`` as a lower
            bound (``mtbf_is_lower_bound``).
        mtbf_is_lower_bound: no failure was observed: ``M > exposure_s``, and the intervals
            are lower bounds.
        young_s: Young's interval, seconds; ``None`` without a cost.
        daly_s: Daly's interval, seconds; ``None`` without a cost.
        young_steps: ``young_s`` in steps of the median step time; daly_steps likewise.
        downtime_s: ``D + R``: mean seconds from a failure's onset to the resume of the
            generation that took over (the incidents' ``detection_s + restore_s``), ``None``
            without an incident.
        model_goodput: the first-order model's goodput
            (:func:`~trainguard.daemon.forensics._young_daly.model_goodput`) for this job's
            ``C``, ``M``, ``downtime_s`` and its own interval (``interval_s`` minus ``C``:
            compute between checkpoints); ``None`` without a failure, a cost or an interval.
        model_goodput_young: the same at Young's interval: what checkpointing every
            ``young_s`` would give.
    """

    checkpoints: int
    interval_steps: float | None
    interval_s: float | None
    phase_cost_s: float | None
    write_s: float | None
    cost_s: float | None
    cost_source: str
    failures: int
    exposure_s: float
    mtbf_s: float
    mtbf_is_lower_bound: bool
    young_s: float | None
    daly_s: float | None
    young_steps: float | None
    daly_steps: float | None
    downtime_s: float | None = None
    model_goodput: float | None = None
    model_goodput_young: float | None = None
    formula: str = "tau = sqrt(2 * C * M)"
    sources: tuple[str, ...] = (YOUNG_SOURCE, DALY_SOURCE)


@dataclass(frozen=True, slots=True)
class JobReport:
    """A job's report (see the module docstring for the definitions).

    Attributes:
        job_id: the job.
        start_ms: the job's first event.
        end_ms: the daemon's ``finished``, ``failed`` or ``stopped`` transition (the latest,
            unless the job was continued since), else the last event.
        ended: ``finished``, ``failed``, ``stopped``, or ``running`` (no end in the record
            yet, or continued since its last end).
        wall_s: ``end - start``, seconds.
        productive_s: time spent advancing steps of the final timeline, seconds.
        goodput: ``productive_s / wall_s`` (0 for an empty record).
        time_s: seconds per :data:`SEGMENT_KINDS` kind; they add up to ``wall_s``.
        world_size: ranks of the job (the highest world size reported).
        first_step: the step generation 0 started from; final_step: the final timeline's last.
        steps_recomputed: steps thrown away by restores (sum over incidents).
        step_time_s: median step time reported by the heartbeats, ``None`` without samples.
        incidents: in order of opening.
        causes: incidents per cause.
        checkpoint: the checkpoint interval advice.
        segments: the partition of the wall time, in time order.
        generations: each generation's lifetime.
        ranks: each rank's phases over time (for the timeline chart).
        marks: checkpoints, commits, exits and errors (for the timeline chart).
    """

    job_id: str
    start_ms: int
    end_ms: int
    ended: str
    wall_s: float
    productive_s: float
    goodput: float
    time_s: dict[str, float]
    world_size: int
    first_step: int
    final_step: int
    steps_recomputed: int
    step_time_s: float | None
    incidents: tuple[IncidentReport, ...]
    causes: dict[str, int]
    checkpoint: CheckpointAdvice
    segments: tuple[Segment, ...]
    generations: tuple[GenerationSpan, ...]
    ranks: tuple[RankSpan, ...] = field(repr=False)
    marks: tuple[Mark, ...] = field(repr=False)


# -- the computation ---------------------------------------------------------------------------


@dataclass
class _Generation:
    """A generation that trained: from ``begin_ms`` (its resume; for generation 0 its
    estimated first step) to ``stop_ms`` (the onset of the failure that ended it, or the job's
    end), steps from ``from_step`` on; ``keep_step`` is its last step in the final timeline,
    ``ended_by`` the incident that ended it."""

    number: int
    begin_ms: int
    from_step: int
    curve: Curve
    stop_ms: int = 0
    keep_step: int = 0
    ended_by: str | None = None


def build_report(
    job_id: str,
    events: Iterable[Timed],
    audit: Iterable[Mapping[str, Any]],
    commands: Iterable[Timed] = (),
) -> JobReport:
    """Compute the report of job ``job_id`` from its record.

    Args:
        job_id: the job.
        events: the job's events with their bus append times (ticks are ignored).
        audit: the daemon's audit entries for the job, in bus order (dicts with ``at_ms`` and
            ``decisions``, as :mod:`trainguard.daemon.service._daemon` writes them).
        commands: the job's commands with their append times, optional: when a restore or
            resume is there, its append time (when it was sent) replaces the audit's (the time
            of the input that decided it). The commands topic is compacted, so the audit
            alone must suffice.

    Raises:
        KeyError, ValueError, TypeError: an audit entry lacks a field a decision always has.
    """
    ev = read_events(events)
    au = read_audit(audit, commands)
    step_time = statistics.median(ev.step_times) if ev.step_times else None
    start = ev.start_ms if ev.start_ms is not None else 0
    last = ev.last_ms if ev.last_ms is not None else start
    ended, end = au.ended if au.ended is not None else ("running", last)
    end = max(end, start)

    gens = _generations(ev, au, step_time, start)
    opened = sorted(au.opened.values(), key=lambda o: o.at_ms)
    incident_gens = {o.incident_id: _incident_generations(o, au) for o in opened}
    restore_end = {
        o.incident_id: _restore_end(o, au, incident_gens[o.incident_id], end) for o in opened
    }
    onsets = {o.incident_id: _onset(o, ev, gens, start) for o in opened}
    for gen in gens.values():
        hit = next(
            (o for o in opened if o.generation == gen.number and o.at_ms >= gen.begin_ms), None
        )
        gen.stop_ms = min(onsets[hit.incident_id][0], hit.at_ms) if hit else end
        gen.stop_ms = min(gen.stop_ms, au.stops.get(gen.number, gen.stop_ms))
        gen.stop_ms = max(gen.begin_ms, min(gen.stop_ms, end))
        gen.ended_by = hit.incident_id if hit else None
    final_step = _final_timeline(gens, au, ended)

    segments = _segments(gens, opened, au.stops, onsets, restore_end, start, end, ended)
    time_s: dict[str, float] = dict.fromkeys(SEGMENT_KINDS, 0.0)
    for seg in segments:
        time_s[seg.kind] += (seg.end_ms - seg.start_ms) / _MS
    wall = (end - start) / _MS

    incidents = tuple(
        _incident(
            o,
            ev,
            au,
            gens,
            onsets[o.incident_id],
            restore_end[o.incident_id],
            incident_gens[o.incident_id],
        )
        for o in opened
    )
    first_step = gens[0].from_step if 0 in gens else 0
    return JobReport(
        job_id=job_id,
        start_ms=start,
        end_ms=end,
        ended=ended,
        wall_s=wall,
        productive_s=time_s["productive"],
        goodput=time_s["productive"] / wall if wall > 0 else 0.0,
        time_s=time_s,
        world_size=ev.world_size,
        first_step=first_step,
        final_step=final_step,
        steps_recomputed=sum(i.recomputed_steps for i in incidents),
        step_time_s=step_time,
        incidents=incidents,
        causes=dict(Counter(i.cause for i in incidents)),
        checkpoint=_advice(ev, gens, incidents, wall - time_s["restore"], step_time),
        segments=segments,
        generations=_generation_spans(au, gens, start, end),
        ranks=rank_spans(ev),
        marks=marks(ev, au),
    )


def _generations(
    ev: EventDigest, au: AuditDigest, step_time: float | None, start: int
) -> dict[int, _Generation]:
    """The generations that trained: 0 from its estimated first step, the others from their
    resume, with their progress curves."""
    out: dict[int, _Generation] = {}
    first = next(((at, b) for at, b in ev.beats if b.generation == 0 and b.phase != "init"), None)
    if first is not None:
        at1, beat = first
        before = [(at, b.step) for at, b in ev.beats if b.generation == 0 and at < at1]
        prev_at, from_step = before[-1] if before else (start, max(0, beat.step - 1))
        estimate = at1 - (beat.step - from_step) * (step_time or 0.0) * _MS
        begin = max(prev_at, round(estimate))
        out[0] = _Generation(0, begin, from_step, Curve(begin, from_step, ev.progress.get(0, ())))
    for generation, (step, at) in sorted(au.resumes.items()):
        curve = Curve(at, step, ev.progress.get(generation, ()))
        out[generation] = _Generation(generation, at, step, curve)
    return out


def _incident_generations(o: Opened, au: AuditDigest) -> list[int]:
    """The generations of ``o``'s restore attempts, in order."""
    return sorted(g for g, r in au.restores.items() if r.incident_id == o.incident_id)


def _restore_end(o: Opened, au: AuditDigest, attempts: list[int], end: int) -> int:
    """When ``o``'s restore ended: the resume of its last attempt's generation, else its
    close, else the job's end."""
    if attempts and attempts[-1] in au.resumes:
        return max(o.at_ms, au.resumes[attempts[-1]][1])
    closed = au.closed.get(o.incident_id)
    return max(o.at_ms, closed[1] if closed else end)


def _onset(
    o: Opened, ev: EventDigest, gens: Mapping[int, _Generation], start: int
) -> tuple[int, str]:
    """The failure's estimated onset (ms) and how it was estimated, clamped to the
    generation's training (or the job's start) and the incident."""
    at, m = o.at_ms, o.measures
    ranks = set(o.ranks)
    gen = gens.get(o.generation)
    onset: float | None = None
    how = "not estimated for this cause (the incident's time)"
    if o.cause == "exited":
        exits = [
            (a, lc)
            for a, lc in ev.lifecycles
            if lc.kind == "exited"
            and lc.generation == o.generation
            and a <= at
            and (lc.rank in ranks or ranks & set(lc.ranks))
        ]
        if exits:
            appended, stamped = exits[-1][0], exits[-1][1].ts / 1e6
            # The sender's clock is trusted where it fits the bus's: within the generation,
            # and at most _SKEW_MS after the append time (the append time has ms resolution).
            low = gen.begin_ms if gen is not None else start
            if low <= stamped <= appended + _SKEW_MS:
                onset, how = min(stamped, appended), "the exit report's time stamp"
            else:
                onset = appended
                how = "the exit report's append time (its own time stamp does not fit the bus's)"
    elif o.cause in ("heartbeat_timeout", "progress_timeout", "phase_timeout"):
        name = {"heartbeat_timeout": "silent_s", "progress_timeout": "stalled_s"}.get(
            o.cause, "in_phase_s"
        )
        value = m.get(name)
        if isinstance(value, int | float):
            onset = at - value * _MS
            how = {
                "silent_s": "the last event heard from the rank (the daemon's silent_s)",
                "stalled_s": "the rank's last step advance (the daemon's stalled_s)",
                "in_phase_s": "the rank's entry into the phase (the daemon's in_phase_s)",
            }[name]
    elif o.cause == "startup_timeout":
        onset, how = start, "the generation's start (ranks never heard from)"
    elif o.cause == "nan_loss":
        bad = next(
            (
                a
                for a, b in ev.beats
                if b.generation == o.generation and b.loss is not None and not math.isfinite(b.loss)
            ),
            None,
        )
        if bad is not None:
            onset, how = bad, "the first heartbeat with a non-finite loss"
    if onset is None and o.onset_after_step is not None and gen is not None:
        onset = gen.curve.reached_ms(o.onset_after_step + 1)
        how = f"step {o.onset_after_step + 1} reached (the last step known good + 1)"
    low = gen.begin_ms if gen is not None else start
    if onset is None:
        return at, how
    return max(low, min(at, round(onset))), how


def _final_timeline(gens: dict[int, _Generation], au: AuditDigest, ended: str) -> int:
    """Set every generation's ``keep_step`` (its last step in the final timeline; its
    ``from_step`` if none survives) by following the final timeline backwards; return its
    last step."""
    for gen in gens.values():
        gen.keep_step = gen.from_step
    if not gens:
        return 0
    if ended in ("failed", "stopped"):
        if not au.commits:
            return gens[min(gens)].from_step
        number, step, _ = max(au.commits.values(), key=lambda c: c[2])
        head = step
    else:
        number = max(gens)
        step = head = gens[number].curve.last_step
    while number in gens:
        gen = gens[number]
        gen.keep_step = max(gen.from_step, step)
        restore = au.restores.get(number)
        if number == 0 or restore is None or restore.target_generation is None:
            break
        number, step = restore.target_generation, gen.from_step
    return head


def _segments(
    gens: Mapping[int, _Generation],
    opened: Sequence[Opened],
    stops: Mapping[int, int],
    onsets: Mapping[str, tuple[int, str]],
    restore_end: Mapping[str, int],
    start: int,
    end: int,
    ended: str,
) -> tuple[Segment, ...]:
    """The partition of ``[start, end)`` (see the module docstring); ``stops``: the time of
    each generation's stop on request."""
    raw: list[Segment] = []
    # Without a training step in generation 0, start-up lasts until the first failure.
    first_onset = min((onsets[o.incident_id][0] for o in opened), default=end)
    raw.append(Segment("startup", start, gens[0].begin_ms if 0 in gens else first_onset, 0))
    for gen in gens.values():
        kept = round(gen.curve.reached_ms(gen.keep_step))
        split = max(gen.begin_ms, min(kept, gen.stop_ms))
        raw.append(Segment("productive", gen.begin_ms, split, gen.number))
        tail = gen.ended_by is None and ended not in ("failed", "stopped")
        raw.append(
            Segment("tail" if tail else "recomputed", split, gen.stop_ms, gen.number, gen.ended_by)
        )
    for generation, at in stops.items():
        # Until the continuation of that generation, if any, else the job's end.
        resumed = min((o.at_ms for o in opened if o.generation == generation), default=end)
        raw.append(Segment("stopped", at, max(at, resumed), generation))
    for o in opened:
        onset = onsets[o.incident_id][0]
        raw.append(Segment("detection", onset, o.at_ms, o.generation, o.incident_id))
        raw.append(
            Segment("restore", o.at_ms, restore_end[o.incident_id], o.generation, o.incident_id)
        )
    out: list[Segment] = []
    cursor = start
    for seg in sorted(raw, key=lambda s: (s.start_ms, s.end_ms)):
        lo, hi = max(seg.start_ms, cursor), min(seg.end_ms, end)
        if hi <= lo:
            continue
        if lo > cursor:
            out.append(Segment("other", cursor, lo, seg.generation))
        out.append(Segment(seg.kind, lo, hi, seg.generation, seg.incident_id))
        cursor = hi
    if cursor < end:
        out.append(Segment("other", cursor, end, max(gens, default=0)))
    return tuple(out)


def _incident(
    o: Opened,
    ev: EventDigest,
    au: AuditDigest,
    gens: Mapping[int, _Generation],
    onset: tuple[int, str],
    restore_end: int,
    attempts: list[int],
) -> IncidentReport:
    """What incident ``o`` cost; ``attempts``: the generations of its restores."""
    last = au.restores[attempts[-1]] if attempts else None
    closed = au.closed.get(o.incident_id)
    involved = {o.generation, *attempts}
    reached = max(
        (
            step
            for g in involved
            for at, step in ev.progress.get(g, ())
            if g == o.generation or at < restore_end
        ),
        default=0,
    )
    gen = gens.get(o.generation)
    recomputed_steps, recomputed_s = 0, 0.0
    if gen is not None:
        if last is not None:
            base = max(gen.from_step, last.target_step if last.target_step is not None else 0)
        else:
            base = gen.keep_step
        reached = max(reached, gen.from_step)
        recomputed_steps = max(0, reached - base)
        lost_from = max(gen.begin_ms, min(gen.stop_ms, round(gen.curve.reached_ms(base))))
        recomputed_s = (gen.stop_ms - lost_from) / _MS
    detection_s = (o.at_ms - onset[0]) / _MS
    restore_s = (restore_end - o.at_ms) / _MS
    return IncidentReport(
        incident_id=o.incident_id,
        cause=o.cause,
        generation=o.generation,
        ranks=o.ranks,
        hosts=o.hosts,
        reason=o.reason,
        opened_ms=o.at_ms,
        onset_ms=onset[0],
        onset_evidence=onset[1],
        detection_s=detection_s,
        outcome=closed[0] if closed else None,
        restore_s=restore_s,
        attempts=len(attempts),
        target_step=None if last is None else (last.target_step or 0),
        target_snapshot=None if last is None else last.snapshot_id,
        mode=None if last is None else last.mode,
        reached_step=reached,
        recomputed_steps=recomputed_steps,
        recomputed_s=recomputed_s,
        lost_s=detection_s + restore_s + recomputed_s,
    )


def _advice(
    ev: EventDigest,
    gens: Mapping[int, _Generation],
    incidents: Sequence[IncidentReport],
    exposure_s: float,
    step_time: float | None,
) -> CheckpointAdvice:
    """The checkpoint interval the job used, its checkpoint cost, Young's and Daly's
    intervals for the observed failures in ``exposure_s`` seconds, and the goodput the
    first-order model predicts at the job's interval and at Young's."""
    failures = len(incidents)
    first_at: dict[tuple[int, int], int] = {}
    slowest: dict[tuple[int, int], int] = {}
    for at, c in ev.shards:
        key = (c.generation, c.step)
        first_at.setdefault(key, at)
        slowest[key] = max(slowest.get(key, at), at)
    steps_gaps: list[float] = []
    time_gaps: list[float] = []
    ordered = sorted(first_at.items())
    for (k0, t0), (k1, t1) in itertools.pairwise(ordered):
        if k0[0] == k1[0]:
            steps_gaps.append(k1[1] - k0[1])
            time_gaps.append((t1 - t0) / _MS)
    writes = [
        max(0.0, (at - gens[g].curve.reached_ms(step)) / _MS)
        for (g, step), at in slowest.items()
        if g in gens
    ]
    write_s = statistics.fmean(writes) if writes else None
    stalls = _phase_stalls(ev)
    phase_s = sum(stalls.values()) / max(len(first_at), len(stalls)) if stalls else None
    if phase_s is not None:
        cost, source = phase_s, "declared checkpoint phases (training stood still)"
    elif write_s is not None:
        cost = write_s
        source = (
            "shard writes, step reached -> shard announced (an upper bound for background writes)"
        )
    else:
        cost, source = None, "no checkpoint in the record"
    lower = failures == 0
    exposure_s = max(exposure_s, 0.0)
    mtbf = exposure_s if lower else exposure_s / failures
    young = daly = None
    if cost is not None and mtbf > 0:
        young, daly = young_interval_s(cost, mtbf), daly_interval_s(cost, mtbf)

    def steps(seconds: float | None) -> float | None:
        return seconds / step_time if seconds is not None and step_time else None

    interval_s = statistics.median(time_gaps) if time_gaps else None
    downtime = (
        statistics.fmean(i.detection_s + i.restore_s for i in incidents) if incidents else None
    )
    model = model_young = None
    if downtime is not None and cost is not None and mtbf > 0:
        model_young = model_goodput(cost, mtbf, downtime)
        if interval_s is not None and interval_s > cost:
            model = model_goodput(cost, mtbf, downtime, interval_s - cost)
    return CheckpointAdvice(
        checkpoints=len(first_at),
        interval_steps=statistics.median(steps_gaps) if steps_gaps else None,
        interval_s=interval_s,
        phase_cost_s=phase_s,
        write_s=write_s,
        cost_s=cost,
        cost_source=source,
        failures=failures,
        exposure_s=exposure_s,
        mtbf_s=mtbf,
        mtbf_is_lower_bound=lower,
        young_s=young,
        daly_s=daly,
        young_steps=steps(young),
        daly_steps=steps(daly),
        downtime_s=downtime,
        model_goodput=model,
        model_goodput_young=model_young,
    )


def _phase_stalls(ev: EventDigest) -> dict[tuple[int, int], float]:
    """Seconds each checkpoint kept the job in the declared ``checkpoint`` phase, by
    (generation, step), the slowest rank's: from a rank's heartbeat declaring the phase to its
    next shard announcement or next heartbeat in another phase, whichever comes first."""
    if not any(b.phase == "checkpoint" for _, b in ev.beats):
        return {}
    per_rank: dict[int, list[tuple[int, Heartbeat | Checkpoint]]] = {}
    for at, b in ev.beats:
        per_rank.setdefault(b.rank, []).append((at, b))
    for at, c in ev.shards:
        per_rank.setdefault(c.rank, []).append((at, c))
    stalls: dict[tuple[int, int], float] = {}
    for items in per_rank.values():
        items.sort(key=lambda item: item[0])
        opened: tuple[int, int, int] | None = None
        for at, msg in items:
            if opened is not None and (isinstance(msg, Checkpoint) or msg.phase != "checkpoint"):
                gen, step, began = opened
                if msg.generation == gen:
                    key = (gen, step)
                    stalls[key] = max(stalls.get(key, 0.0), (at - began) / _MS)
                opened = None
            if opened is None and isinstance(msg, Heartbeat) and msg.phase == "checkpoint":
                opened = (msg.generation, msg.step, at)
    return stalls


def _generation_spans(
    au: AuditDigest, gens: Mapping[int, _Generation], start: int, end: int
) -> tuple[GenerationSpan, ...]:
    """Each generation from its restore command (0: the job's start) to the next one's."""
    starts = {0: start, **{g: r.at_ms for g, r in au.restores.items()}}
    numbers = sorted(starts)
    out = []
    for i, g in enumerate(numbers):
        until = starts[numbers[i + 1]] if i + 1 < len(numbers) else end
        gen, restore = gens.get(g), au.restores.get(g)
        if gen is not None:
            from_step = gen.from_step
        else:
            from_step = restore.target_step or 0 if restore is not None else 0
        began = gen.begin_ms if gen is not None else None
        out.append(GenerationSpan(g, starts[g], max(starts[g], until), began, from_step))
    return tuple(out)
