"""Replay a job's log through the state machine: its timeline, a check against the audit trail,
and what-if runs under another configuration.

Pure (no I/O, no clock reads): the caller reads the log (:mod:`trainguard.daemon.forensics._job_log`) and
prints the results (:mod:`trainguard.daemon.forensics._timeline`).

**Replay** (:func:`replay`). The job's records on ``events`` are taken in exactly as the daemon
takes them (:func:`trainguard.daemon.core._intake.take`; the records the daemon refused as not
authentic are refused again from the trail's record of it, so no key is needed) and folded with :func:`decide` from
:func:`new_job`, ticks included, under the configuration(s) the audit trail recorded. A job
whose daemon restarted with another configuration (another ``daemon_id``, say) was decided by
several *runs*: a restarted daemon folds the log again from offset 0 under its own
configuration, silently up to its consumer group's committed position, and acts from there.
So each run is a fold from the start under its configuration, and its decisions are the ones
from where it took over: its first recorded decision, or the input after the previous run's
last one, whichever comes first (inputs between the two produced no decision, so which daemon
folded them is unknown: they are checked under the later configuration). The inputs a crashed
daemon acted on but had not committed are decided again by the next run: the trail holds both
groups, and so does the replay.

**Verification** (:func:`verify`): the replayed decision groups equal the recorded ones
exactly, in order, matched by input identity (:func:`trainguard.daemon.core._audit_entry.input_id` and the
append time), configuration id and decisions. A daemon that crashed after writing an entry but
before committing its position writes the same entry again when it (or its successor with the
same configuration) re-derives it: such exact duplicates of an earlier entry are skipped.

**What-if** (:func:`what_if`): the job's events (recorded ticks left out) are folded twice,
under a baseline and a variant configuration, with ticks synthesised the way the shell writes
them (``DaemonService._write_due_ticks``): while the job is not finished or failed, its loop
writes a tick once its clock has passed ``next_deadline(state)`` and ``tick_interval_s`` has
passed since the job's last tick, checking after every poll of at most ``poll_s``. The model
puts that tick at ``max(next_deadline, last tick + tick_interval_s) + poll_s`` (the longest the
loop takes to notice), or, the daemon's pulse, ``pulse_s + poll_s`` after the job's latest
input if that is earlier, whenever that comes before the next event, or before the end of the
log (the last record's time: the daemon ran at least that long); and after an input that issued
a command, a tick naming it ``poll_s`` later (the shell publishes the command and appends that
tick after the batch the input came in). Every modelled tick names the latest command. Where
the recorded log (its ticks included) has a gap longer than the configuration's ``bus_gap_s``,
the bus or the daemon was away: a modelled tick due inside it lands at its end (as the shell's
queued tick does), so the fold sees the outage the daemon saw. Where
it differs: the shell's tick lands earlier when records keep its loop busy, and later by the
bus's append latency (not modelled); and a daemon that was down or behind ticked later still. The two folds' decisions
are aligned
(:class:`difflib.SequenceMatcher` on what each decision is about, see :func:`_decision_key`)
into changes: decisions that disappear, appear or differ (same decision, other time or
evidence). Rejected inputs are counted, not listed. Past the first changed *command* (the
*horizon*), the recorded inputs reflect what the workers did on the recorded commands, so later
changes are consequences rather than findings: they are marked ``beyond_horizon``.
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias, cast

import orjson

from trainguard.daemon.core import (
    TERMINAL_PHASES,
    Anomaly,
    AuditTrail,
    Authenticator,
    Committed,
    Decision,
    Group,
    IncidentClosed,
    IncidentOpened,
    InputKey,
    Issue,
    JobFailed,
    JobPhase,
    JobState,
    MachineConfig,
    RawRecord,
    Refused,
    Rejected,
    Taken,
    Tick,
    Transition,
    config_id,
    decide,
    exit_status,
    input_key,
    new_job,
    next_deadline,
    plain_decisions,
    plain_value,
    take,
    unacted_command,
)
from trainguard.schemas import (
    Abort,
    Checkpoint,
    ClockTick,
    DataCursorEvent,
    Event,
    Heartbeat,
    HeartbeatBatch,
    JobRequest,
    JSONValue,
    Lifecycle,
    Manifest,
    Restore,
    Resume,
    SchemaError,
    decode,
    snapshot_ref,
)

__all__ = [
    "Change",
    "Difference",
    "Replay",
    "Row",
    "WhatIf",
    "replay",
    "verify",
    "what_if",
]

_NS_PER_MS = 1_000_000

RowKind: TypeAlias = Literal[
    "heartbeat",
    "heartbeat-batch",
    "checkpoint",
    "data-cursor",
    "lifecycle",
    "job-request",
    "tick",
    "synthetic-tick",
    "refused",
]

_KINDS: dict[type, RowKind] = {
    Heartbeat: "heartbeat",
    HeartbeatBatch: "heartbeat-batch",
    Checkpoint: "checkpoint",
    DataCursorEvent: "data-cursor",
    Lifecycle: "lifecycle",
    JobRequest: "job-request",
}

SYNTHETIC_DAEMON_ID = "what-if"
"""``daemon_id`` in the identity of the ticks a what-if run synthesises."""


@dataclass(frozen=True, slots=True)
class Row:
    """One line of a job's timeline: an input and what the state machine made of it.

    Attributes:
        at_ns: the input's time (its record's append time, or a synthesised tick's time), ns
            since the Unix epoch.
        offset: the record's offset in its partition; ``None`` for a synthesised tick.
        kind: the input's type, ``synthetic-tick`` for a tick a what-if run added, ``refused``
            for a record that is no input (``refused`` says why).
        rank: the sending rank, ``None`` for ticks and supervisors.
        ranks: the ranks a supervisor's lifecycle event names.
        generation: the generation the sender stated, ``None`` for ticks and refused records.
        summary: what the input said, in a few words (``step 30 train, loss 1.92``).
        input_id: the input's identity (``None`` for a refused record).
        phase_before: the job's phase before the input.
        phase_after: the job's phase after it.
        generation_after: the job's generation after it.
        decisions: the decisions it produced, in order.
        config_id: the configuration it was folded under.
        refused: why the record is no input, else ``None``.
    """

    at_ns: int
    offset: int | None
    kind: RowKind
    rank: int | None
    ranks: tuple[int, ...]
    generation: int | None
    summary: str
    input_id: Mapping[str, JSONValue] | None
    phase_before: JobPhase
    phase_after: JobPhase
    generation_after: int
    decisions: tuple[Decision, ...]
    config_id: str
    refused: str | None = None

    @property
    def transition(self) -> tuple[JobPhase, JobPhase] | None:
        """``(old, new)`` when the input changed the job's phase."""
        if self.phase_before == self.phase_after:
            return None
        return self.phase_before, self.phase_after


@dataclass(frozen=True, slots=True)
class Replay:
    """What :func:`replay` derived.

    Attributes:
        rows: the timeline from the first shown record on (one row per record).
        replayed: the decision groups of the shown inputs, in the order the audit trail would
            hold them (a run's re-derived groups after the previous run's).
        recorded: the audit trail's groups of the shown inputs, in audit order; entries for
            inputs appended after the log was read are left out.
        runs: each run's configuration id and the offset of the first input it decides
            (``None`` for a run with no input), in order.
        state: the job's state after the last input (under the last run's configuration).
    """

    rows: tuple[Row, ...]
    replayed: tuple[Group, ...]
    recorded: tuple[Group, ...]
    runs: tuple[tuple[str, int | None], ...]
    state: JobState


@dataclass(frozen=True, slots=True)
class Difference:
    """The first place where a replay and the audit trail disagree.

    Attributes:
        input_id: the input's identity.
        at_ms: its append time, ms since the Unix epoch.
        offset: its offset where it was read (recorded offset when only the trail has it).
        expected: the recorded decisions (empty: the trail records none for this input).
        got: the replayed decisions (empty: the replay decides nothing here).
        expected_config: the recorded configuration id, ``None`` with ``expected`` empty.
        got_config: the replay's configuration id, ``None`` with ``got`` empty.
        pending: the replay decides something after the trail's last recorded input: the
            daemon may not have folded this input yet (it lags, or it stopped).
    """

    input_id: Mapping[str, JSONValue]
    at_ms: int
    offset: int | None
    expected: tuple[Mapping[str, JSONValue], ...]
    got: tuple[Mapping[str, JSONValue], ...]
    expected_config: str | None
    got_config: str | None
    pending: bool = False


@dataclass(frozen=True, slots=True)
class Change:
    """A decision that a what-if run changes.

    Attributes:
        change: ``disappears`` (baseline only), ``appears`` (variant only) or ``differs``
            (both, at another time or with other evidence).
        at_ns: the earlier of its times, ns since the Unix epoch.
        before: the baseline's decision, ``None`` when it appears.
        after: the variant's decision, ``None`` when it disappears.
        before_at_ns: time of the baseline's decision, or ``None``.
        after_at_ns: time of the variant's decision, or ``None``.
        beyond_horizon: after the first changed command: a consequence, not a finding.
    """

    change: Literal["disappears", "appears", "differs"]
    at_ns: int
    before: Decision | None
    after: Decision | None
    before_at_ns: int | None
    after_at_ns: int | None
    beyond_horizon: bool = False


@dataclass(frozen=True, slots=True)
class WhatIf:
    """What :func:`what_if` found.

    Attributes:
        baseline: timeline of the baseline fold (synthesised ticks included).
        variant: timeline of the variant fold.
        changes: the changed decisions in time order.
        horizon_ns: time of the first changed command, or ``None`` when no command changes.
        rejected_before: rejected inputs of the baseline by code.
        rejected_after: rejected inputs of the variant by code.
    """

    baseline: tuple[Row, ...]
    variant: tuple[Row, ...]
    changes: tuple[Change, ...]
    horizon_ns: int | None
    rejected_before: Mapping[str, int] = field(default_factory=dict)
    rejected_after: Mapping[str, int] = field(default_factory=dict)


# -- replay -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Run:
    """A daemon's share of the job: the decisions of the inputs with indices ``first`` to
    ``last`` (inclusive) under configuration ``config``."""

    config: str
    first: int
    last: int


_Outcome: TypeAlias = tuple[JobPhase, JobPhase, int, tuple[Decision, ...]]
"""What folding one record did: phase before, phase after, generation after, decisions."""


def replay(
    job_id: str,
    records: Iterable[RawRecord],
    trail: AuditTrail,
    default: MachineConfig,
    *,
    start: int = 0,
    timeline: bool = True,
) -> Replay:
    """Replay ``job_id`` from its ``records`` under the configurations ``trail`` recorded
    (module docstring).

    Args:
        job_id: the job.
        records: the records keyed by the job on its ``events`` partition, in offset order
            from the first (the state at any point depends on everything before it). Read
            once, in order, when the trail records at most one configuration (a generator
            will do: nothing but what the result holds is kept); held whole otherwise.
        trail: the job's audit trail (:func:`trainguard.daemon.core._audit_entry.read_trail`).
        default: the configuration to fold under when the trail records none (the daemon
            never decided anything for the job).
        start: index in ``records`` of the first record to show and verify (a window's
            start); the records before it are folded but neither shown nor compared.
        timeline: build the timeline's rows; without, ``rows`` is empty (a verification
            only, with less memory).

    Returns:
        The timeline, the replayed and recorded groups to compare with :func:`verify`, the
        runs' configuration ids and the final state.

    Raises:
        MalformedAudit: a decision entry names a configuration no config entry records, or a
            recorded configuration does not rebuild.

    Costs one fold of the records per distinct recorded configuration.
    """
    recorded = dict.fromkeys(group.config_id for group in trail.groups)
    if len(recorded) > 1:
        return _replay_runs(job_id, tuple(records), trail, default, start, timeline)
    config = next(iter(recorded), config_id(default))
    machine = default if config == config_id(default) else trail.machine(config)
    return _replay_streamed(job_id, records, trail, (config, machine), start, timeline)


def _replay_streamed(
    job_id: str,
    records: Iterable[RawRecord],
    trail: AuditTrail,
    config: tuple[str, MachineConfig],
    start: int,
    timeline: bool,
) -> Replay:
    """:func:`replay` of a job decided under one configuration (``(id, configuration)``):
    one run, so each record is taken in, folded and shown as it is read.

    Only the inputs whose append time equals a recorded group's are keyed (the keys
    :func:`_recorded_shown` matches, by their last index): an input key costs a JSON
    serialisation, and a million of them (with the ``Taken`` they come from) would be held
    for the hundred or so the trail names.
    """
    cid, machine = config
    wanted = {group.at_ms for group in trail.groups}
    last_index: dict[InputKey, int] = {}
    rows: list[Row] = []
    replayed: list[Group] = []
    state = new_job(job_id)
    first_offset: int | None = None
    first_ms = 0
    i = -1
    record: RawRecord | None = None
    auth = _authenticator(trail)
    # Kept to what each record needs (a million times): the count and the last time are read
    # after the loop.
    for i, record in enumerate(records):
        at_ms = record.timestamp_ms
        if i == start:
            first_ms = at_ms
        if i == 0:
            first_offset = record.offset
        item = take(record, auth)
        phase = state.phase
        decisions: tuple[Decision, ...] = ()
        if type(item) is Taken:
            state, decisions = decide(state, item.input, machine)
            if at_ms in wanted:
                last_index[input_key(item.input_id, at_ms)] = i
            if decisions and i >= start:
                replayed.append(
                    Group(
                        input_id=item.input_id,
                        at_ms=at_ms,
                        offset=record.offset,
                        config_id=cid,
                        decisions=plain_decisions(decisions),
                    )
                )
        if timeline and i >= start:
            rows.append(_row(record, item, phase, state.phase, state.generation, decisions, cid))
    count = i + 1
    last_ms = 0 if record is None else record.timestamp_ms
    shown: list[Group] = []
    if start < count:
        # As _recorded_shown: the groups of shown inputs, and of inputs the log lacks (a gap)
        # within the shown records' times.
        for group in trail.groups:
            index = last_index.get(group.key)
            if index >= start if index is not None else first_ms <= group.at_ms < last_ms:
                shown.append(group)
    return Replay(
        rows=tuple(rows),
        replayed=tuple(replayed),
        recorded=tuple(shown),
        runs=((cid, first_offset),),
        state=state,
    )


def _authenticator(trail: AuditTrail) -> AuditTrail | None:
    """What judges authenticity in a replay: the trail's recorded refusals; ``None`` (every
    record authentic, as the trail would say) when it records none, which spares two calls a
    record."""
    return trail if trail.refused else None


def _replay_runs(
    job_id: str,
    records: Sequence[RawRecord],
    trail: AuditTrail,
    default: MachineConfig,
    start: int,
    timeline: bool,
) -> Replay:
    """:func:`replay` of a job decided by several daemon runs: every record is taken in and
    keyed first, to split the inputs among the runs (:func:`_runs`); each configuration then
    folds them all."""
    auth = _authenticator(trail)
    taken = [take(r, auth) for r in records]
    keys = [
        input_key(t.input_id, r.timestamp_ms) if isinstance(t, Taken) else None
        for t, r in zip(taken, records, strict=True)
    ]
    runs = _runs(trail.groups, keys, config_id(default))
    outcomes: list[dict[int, _Outcome]] = [{} for _ in runs]
    final: dict[str, JobState] = {}
    for config in dict.fromkeys(run.config for run in runs):
        machine = default if config == config_id(default) else trail.machine(config)
        mine = [(k, run) for k, run in enumerate(runs) if run.config == config]
        state = new_job(job_id)
        for i in range(max(run.last for _, run in mine) + 1):
            before = state
            item = taken[i]
            decisions: tuple[Decision, ...] = ()
            if isinstance(item, Taken):
                state, decisions = decide(state, item.input, machine)
            if i >= start and (timeline or decisions):
                for k, run in mine:
                    if run.first <= i <= run.last:
                        outcomes[k][i] = (before.phase, state.phase, state.generation, decisions)
        final[config] = state
    rows: dict[int, Row] = {}
    replayed: list[Group] = []
    for k, run in enumerate(runs):
        for i, (old, new, generation, decisions) in sorted(outcomes[k].items()):
            item = taken[i]
            if timeline and i not in rows:
                rows[i] = _row(records[i], item, old, new, generation, decisions, run.config)
            if decisions and isinstance(item, Taken):
                replayed.append(
                    Group(
                        input_id=item.input_id,
                        at_ms=records[i].timestamp_ms,
                        offset=records[i].offset,
                        config_id=run.config,
                        decisions=plain_decisions(decisions),
                    )
                )
    return Replay(
        rows=tuple(rows[i] for i in sorted(rows)),
        replayed=tuple(replayed),
        recorded=_recorded_shown(trail.groups, records, keys, start),
        runs=tuple(
            (run.config, records[run.first].offset if run.first < len(records) else None)
            for run in runs
        ),
        state=final[runs[-1].config],
    )


def _runs(groups: Sequence[Group], keys: Sequence[InputKey | None], default: str) -> list[_Run]:
    """Split the job's inputs (``keys``, by index) among the runs the trail's ``groups`` show
    (module docstring): one per stretch of consecutive groups under one configuration."""
    n = len(keys)
    where: dict[InputKey, int] = {}
    for i, key in enumerate(keys):
        if key is not None:
            where.setdefault(key, i)
    stretches: list[tuple[str, list[int]]] = []
    for group in groups:
        index = where.get(group.key)
        if not stretches or stretches[-1][0] != group.config_id:
            stretches.append((group.config_id, []))
        if index is not None:
            stretches[-1][1].append(index)
    if not stretches:
        return [_Run(default, 0, n - 1)]
    runs: list[_Run] = []
    reached = -1  # the last input any earlier run decided
    for k, (config, indices) in enumerate(stretches):
        first = 0 if k == 0 else min(min(indices, default=reached + 1), reached + 1)
        last = n - 1 if k == len(stretches) - 1 else max(indices, default=first - 1)
        runs.append(_Run(config, first, last))
        reached = max(reached, last)
    return runs


def _recorded_shown(
    groups: Sequence[Group],
    records: Sequence[RawRecord],
    keys: Sequence[InputKey | None],
    start: int,
) -> tuple[Group, ...]:
    """The recorded groups to compare: those of the shown inputs, and those naming an input
    the log does not hold at a time within the shown records (a gap in the log). Groups of
    inputs appended after the log was read (or after a window's end), which may share the
    last record's millisecond, are left out."""
    if start >= len(records):
        return ()
    known = {k for k in keys if k is not None}
    shown = {k for k in keys[start:] if k is not None}
    first_ms, last_ms = records[start].timestamp_ms, records[-1].timestamp_ms
    return tuple(
        g
        for g in groups
        if g.key in shown or (g.key not in known and first_ms <= g.at_ms < last_ms)
    )


def _row(
    record: RawRecord,
    item: Taken | Refused,
    before: JobPhase,
    after: JobPhase,
    generation: int,
    decisions: tuple[Decision, ...],
    config: str,
    *,
    synthetic: bool = False,
) -> Row:
    at_ns = record.timestamp_ms * _NS_PER_MS
    if isinstance(item, Refused):
        return Row(
            at_ns=at_ns,
            offset=record.offset,
            kind="refused",
            rank=None,
            ranks=(),
            generation=None,
            summary=item.reason,
            input_id=None,
            phase_before=before,
            phase_after=after,
            generation_after=generation,
            decisions=decisions,
            config_id=config,
            refused=item.reason,
        )
    message = item.message
    kind: RowKind
    rank: int | None = None
    ranks: tuple[int, ...] = ()
    stated: int | None = None
    if isinstance(message, ClockTick):
        kind = "synthetic-tick" if synthetic else "tick"
        text = "modelled at a deadline" if synthetic else f"written by {message.daemon_id}"
    else:
        kind = _KINDS[type(message)]
        text = summary(message)
        if isinstance(message, HeartbeatBatch):
            ranks = tuple(b.rank for b in message.beats)
        else:
            rank, stated = message.rank, message.generation
        if isinstance(message, Lifecycle):
            ranks = message.ranks
    return Row(
        at_ns=item.input.at_ns,
        offset=None if synthetic else record.offset,
        kind=kind,
        rank=rank,
        ranks=ranks,
        generation=stated,
        summary=text,
        input_id=item.input_id,
        phase_before=before,
        phase_after=after,
        generation_after=generation,
        decisions=decisions,
        config_id=config,
    )


def summary(event: Event | JobRequest | HeartbeatBatch) -> str:
    """A few words on what ``event`` reports (``step 30 train, 0.31 s/step, loss 1.92``)."""
    match event:
        case HeartbeatBatch():
            steps = sorted({b.step for b in event.beats})
            at = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
            return f"{len(event.beats)} heartbeats of host {event.host}, {at}"
        case JobRequest():
            return f"{event.kind} the job" + (f": {event.reason}" if event.reason else "")
        case Heartbeat():
            parts = [f"step {event.step} {event.phase}"]
            if event.step_time_s is not None:
                parts.append(f"{event.step_time_s:.3g} s/step")
            if event.loss is not None:
                parts.append(f"loss {event.loss:.4g}")
            if event.param_checksum is not None:
                parts.append(f"checksum {event.param_checksum[:12]}")
            return ", ".join(parts)
        case Checkpoint():
            return f"shard of step {event.step}, {event.size_bytes} bytes, {event.digest[:19]}"
        case DataCursorEvent():
            cursor = event.cursor
            return (
                f"cursor at step {event.step}: epoch {cursor.epoch}, offset {cursor.offset}, "
                f"data {cursor.data_version}"
            )
        case Lifecycle():
            parts = [event.kind]
            if event.ranks:
                parts.append("ranks " + ",".join(map(str, event.ranks)))
            if event.kind == "exited":
                parts.append(exit_status(event.exit_code, event.signal))
            if event.step is not None:
                parts.append(f"step {event.step}")
            if event.snapshot_id is not None:
                parts.append(f"snapshot {event.snapshot_id}")
            if event.message:
                parts.append(event.message)
            return ", ".join(parts)


# -- verification -----------------------------------------------------------------------------


def verify(replayed: Sequence[Group], recorded: Sequence[Group]) -> Difference | None:
    """The first difference between replayed and recorded decision groups, or ``None``.

    Both in audit order. They must match one to one, in order: same input (identity and
    append time), same configuration id, same decisions. A recorded group equal to an earlier
    recorded one (a decision entry written again after a daemon crashed between acting and
    committing) is skipped. When the two name different inputs, the difference is at the
    earlier of them (by append time).
    """
    seen: set[tuple[InputKey, str, bytes]] = set()
    last_recorded_ms = max((g.at_ms for g in recorded), default=None)
    i = 0
    for rec in recorded:
        fingerprint = (rec.key, rec.config_id, _canonical(rec.decisions))
        if fingerprint in seen:
            continue
        got = replayed[i] if i < len(replayed) else None
        if got is None or got.key != rec.key:
            if got is not None and got.at_ms <= rec.at_ms:
                return _unrecorded(got, pending=False)
            return Difference(
                input_id=rec.input_id,
                at_ms=rec.at_ms,
                offset=rec.offset,
                expected=rec.decisions,
                got=(),
                expected_config=rec.config_id,
                got_config=None,
            )
        if got.config_id != rec.config_id or _comparable(got.decisions) != _comparable(
            [_with_references(d) for d in rec.decisions]
        ):
            return Difference(
                input_id=rec.input_id,
                at_ms=rec.at_ms,
                offset=got.offset,
                expected=rec.decisions,
                got=got.decisions,
                expected_config=rec.config_id,
                got_config=got.config_id,
            )
        seen.add(fingerprint)
        i += 1
    if i < len(replayed):
        extra = replayed[i]
        return _unrecorded(
            extra, pending=last_recorded_ms is None or extra.at_ms >= last_recorded_ms
        )
    return None


def _unrecorded(group: Group, *, pending: bool) -> Difference:
    return Difference(
        input_id=group.input_id,
        at_ms=group.at_ms,
        offset=group.offset,
        expected=(),
        got=group.decisions,
        expected_config=None,
        got_config=group.config_id,
        pending=pending,
    )


def _canonical(decisions: Iterable[Mapping[str, JSONValue]]) -> bytes:
    return orjson.dumps(list(decisions), option=orjson.OPT_SORT_KEYS)


def _with_references(decision: Mapping[str, JSONValue]) -> Mapping[str, JSONValue]:
    """A recorded decision as this build states it: builds before ``restore/2`` recorded a
    commit's and a restore target's whole manifest where this build names the snapshot by
    reference (``snapshot_ref``, derived from that manifest), so the same decision compares
    equal. Anything else, and a manifest that does not decode, is left as it is (and shows
    as a difference)."""
    kind = decision.get("decision")
    if kind == "committed" and "manifest" in decision:
        ref = _reference(decision["manifest"])
        if ref is not None:
            return {"decision": kind, "snapshot": ref, "reason": decision.get("reason")}
    command = decision.get("command")
    if kind == "issue" and isinstance(command, Mapping):
        schema = command.get("schema")
        if isinstance(schema, str) and schema.startswith("restore/1."):
            target = command.get("target")
            ref = None if target is None else _reference(target)
            if target is None or ref is not None:
                upgraded = {**command, "schema": "restore/2.0", "target": ref}
                return {**decision, "command": upgraded}
    return decision


def _reference(manifest: JSONValue) -> JSONValue | None:
    """The wire form of the reference of a manifest's wire form, or ``None`` (not one)."""
    try:
        decoded = decode(orjson.dumps(manifest), expect=Manifest, max_bytes=2**62)
    except (SchemaError, TypeError):
        return None
    return plain_value(snapshot_ref(decoded))


def _comparable(value: object) -> JSONValue:
    """Decisions as a replay compares them across builds: a message's ``schema`` without its
    minor version, and null properties left out. A newer minor version only adds optional
    properties (``docs/wire-contract.md``, "Versions"), null unless set, so a decision
    recorded by an older build equals the same decision made now; any value that differs
    still shows."""
    if isinstance(value, Mapping):
        out: dict[str, JSONValue] = {}
        for key, item in value.items():
            if item is None:
                continue
            if key == "schema" and isinstance(item, str):
                out[key] = item.rpartition(".")[0] or item
            else:
                out[key] = _comparable(item)
        return out
    if isinstance(value, list | tuple):
        return [_comparable(item) for item in value]
    return cast(JSONValue, value)


# -- what-if ----------------------------------------------------------------------------------


def what_if(
    job_id: str,
    records: Sequence[RawRecord],
    baseline: MachineConfig,
    variant: MachineConfig,
    *,
    tick_interval_s: float,
    poll_s: float,
    pulse_s: float = 1.0,
    start: int = 0,
    end_ns: int | None = None,
    auth: Authenticator | None = None,
) -> WhatIf:
    """Fold the job's events under ``baseline`` and ``variant`` with modelled ticks, and list
    the decisions that change (module docstring).

    Args:
        job_id: the job.
        records: the job's records on ``events`` in offset order from the first.
        baseline: the configuration the job ran under (the recorded one).
        variant: the configuration to try.
        tick_interval_s: the daemon's least time between two ticks of a job, seconds
            (``[service] tick_interval_s``), > 0.
        poll_s: the daemon's longest wait for events between two looks at the clock, seconds
            (``[service] poll_s``), >= 0.
        pulse_s: the daemon's pulse, seconds (``[service] pulse_s``), > 0: it ticks a job that
            has had no input for this long; modelled no longer than a daemon may be configured
            with under each configuration (``2 * pulse_s + poll_s < bus_gap_s``).
        start: index of the first record whose changes are reported (a window's start).
        end_ns: ticks are synthesised up to this time (ns since the epoch); default: the last
            record's append time (the daemon ran at least that long).
        auth: the verdicts on authenticity to apply (the job's audit trail: what the daemon
            refused as not authentic is left out of both folds); ``None`` takes every record.

    Raises:
        ValueError: ``tick_interval_s`` or ``pulse_s`` is not > 0, or ``poll_s`` is negative.
    """
    if not tick_interval_s > 0:
        raise ValueError(f"tick_interval_s must be > 0, got {tick_interval_s!r}")
    if not poll_s >= 0:
        raise ValueError(f"poll_s must be >= 0, got {poll_s!r}")
    if not pulse_s > 0:
        raise ValueError(f"pulse_s must be > 0, got {pulse_s!r}")
    interval_ns, poll_ns = round(tick_interval_s * 1e9), round(poll_s * 1e9)
    pulse_ns = round(pulse_s * 1e9)
    if end_ns is None:
        end_ns = records[-1].timestamp_ms * _NS_PER_MS if records else 0
    taken = [take(r, auth) for r in records]
    folds = [
        _fold_modelled(job_id, records, taken, config, (interval_ns, poll_ns, pulse_ns), end_ns)
        for config in (baseline, variant)
    ]
    shown_from = records[start].timestamp_ms * _NS_PER_MS if start < len(records) else end_ns + 1
    before, after = ([row for row in rows if row.at_ns >= shown_from] for rows in folds)
    changes = _changes(before, after)
    return WhatIf(
        baseline=tuple(before),
        variant=tuple(after),
        changes=changes,
        horizon_ns=next((c.at_ns for c in changes if _is_command(c)), None),
        rejected_before=_rejections(before),
        rejected_after=_rejections(after),
    )


@dataclass(frozen=True, slots=True)
class _Synthetic:
    """The record a synthesised tick stands for (for :func:`_row`)."""

    offset: int
    timestamp_ms: int
    key: str | None = None
    value: bytes | None = None


def _fold_modelled(
    job_id: str,
    records: Sequence[RawRecord],
    taken: Sequence[Taken | Refused],
    config: MachineConfig,
    timing: tuple[int, int, int],
    end_ns: int,
) -> list[Row]:
    """Fold the events (recorded ticks left out) under ``config`` with the shell's ticks
    modelled (module docstring); ``timing`` is ``(tick interval, poll, pulse)`` in ns."""
    cid = config_id(config)
    rows: list[Row] = []
    state = new_job(job_id)
    last_tick = 0  # the shell's _last_tick_ns default
    seq = 0
    resumed = 0  # the end of the latest gap in the recorded log: no tick lands before it

    def ticks_until(until_ns: int) -> None:
        nonlocal state, last_tick, seq
        while state.phase not in TERMINAL_PHASES:
            at = _modelled_tick(state, config, last_tick, timing)
            if at is None:
                return
            # A tick due while the bus was away reached it when the bus came back.
            at = max(at, resumed)
            if at > until_ns:
                return
            seq += 1
            message = ClockTick(
                job_id=job_id,
                generation=state.generation,
                ts=at,
                seq=seq,
                daemon_id=SYNTHETIC_DAEMON_ID,
                command_seq=state.command_seq,
            )
            before = state
            state, decisions = decide(state, Tick(at, state.command_seq), config)
            last_tick = at
            tick = Taken(job_id, Tick(at, message.command_seq), message)
            record = _Synthetic(offset=-1, timestamp_ms=at // _NS_PER_MS)
            rows.append(
                _row(
                    record,
                    tick,
                    before.phase,
                    state.phase,
                    state.generation,
                    decisions,
                    cid,
                    synthetic=True,
                )
            )

    previous_ns: int | None = None  # the append time of the record before, ticks included
    for record, item in zip(records, taken, strict=True):
        at_ns = record.timestamp_ms * _NS_PER_MS
        if previous_ns is not None and at_ns - previous_ns > config.bus_gap_ns:
            ticks_until(previous_ns)  # nothing reached the bus in the gap: no tick either
            resumed = at_ns
        ticks_until(at_ns)
        previous_ns = at_ns
        if isinstance(item, Taken) and isinstance(item.input, Tick):
            continue  # the recorded daemon's ticks; the model writes its own
        if isinstance(item, Taken):
            before = state
            state, decisions = decide(state, item.input, config)
            rows.append(
                _row(record, item, before.phase, state.phase, state.generation, decisions, cid)
            )
        else:
            rows.append(_row(record, item, state.phase, state.phase, state.generation, (), cid))
    ticks_until(end_ns)
    return rows


def _modelled_tick(
    state: JobState, config: MachineConfig, last_tick: int, timing: tuple[int, int, int]
) -> int | None:
    """When the shell writes the job's next tick (ns; ``None``: never): ``poll_s`` after an
    input that issued a command; else at its next deadline, ``tick_interval_s`` after its last
    tick at the earliest, or at its pulse, whichever comes first, each noticed up to a poll
    late."""
    interval_ns, poll_ns, pulse_ns = timing
    if unacted_command(state) is not None:
        return state.clock_ns + poll_ns
    # A daemon runs only with 2 * pulse_s + poll_s + commit_interval_s < bus_gap_s: model one
    # that would run under ``config`` (a variant may shorten bus_gap_s; commits taken as instant).
    pulse_ns = max(1, min(pulse_ns, (config.bus_gap_ns - poll_ns) // 2 - 1))
    due = next_deadline(state, config)
    at = None if due is None else max(due, last_tick + interval_ns) + poll_ns
    if state.generation_started_ns is None:
        return at
    pulse = state.clock_ns + pulse_ns + poll_ns
    return pulse if at is None else min(at, pulse)


def _timed(rows: Iterable[Row]) -> list[tuple[int, Decision, Hashable]]:
    """Every decision but rejections with its input's time and its alignment key."""
    out: list[tuple[int, Decision, Hashable]] = []
    causes: dict[str, str] = {}
    cause: str | None = None  # of the open incident
    for row in rows:
        # An input's decisions belong together: the transition to restoring comes before the
        # incident that causes it.
        for decision in row.decisions:
            if isinstance(decision, IncidentOpened):
                cause = causes[decision.incident_id] = decision.cause
        for decision in row.decisions:
            if not isinstance(decision, Rejected):
                out.append((row.at_ns, decision, _decision_key(decision, cause, causes)))
        if any(isinstance(d, IncidentClosed) for d in row.decisions):
            cause = None
    return out


def _decision_key(decision: Decision, cause: str | None, causes: Mapping[str, str]) -> Hashable:
    """What a decision is about, for aligning two runs: equal keys are the same decision
    (perhaps at another time or with other evidence). Decisions that belong to an incident
    carry its cause, so a restore for a hang does not pair with a restore for a dead rank."""
    match decision:
        case Transition():
            return ("transition", decision.old, decision.new, decision.generation, cause)
        case Committed():
            return ("committed", decision.manifest.snapshot_id)
        case IncidentOpened():
            return ("incident_opened", decision.incident_id, decision.cause)
        case IncidentClosed():
            return ("incident_closed", decision.incident_id, decision.outcome, cause)
        case Issue(command=Restore() as restore):
            incident = causes.get(restore.incident_id)
            return ("restore", restore.generation, restore.attempt, incident)
        case Issue(command=Resume() as resume):
            return ("resume", resume.generation, cause)
        case Issue(command=Abort() as abort):
            return ("abort", abort.generation)
        case Anomaly():
            return ("anomaly", decision.kind, decision.ranks)
        case JobFailed():
            return ("job_failed",)
    return ("rejected", decision.KIND)


def _changes(before: Sequence[Row], after: Sequence[Row]) -> tuple[Change, ...]:
    old, new = _timed(before), _timed(after)
    matcher = difflib.SequenceMatcher(
        a=[k for _, _, k in old], b=[k for _, _, k in new], autojunk=False
    )
    changes: list[Change] = []
    for op, a1, a2, b1, b2 in matcher.get_opcodes():
        if op == "equal":
            for (ta, da, _), (tb, db, _) in zip(old[a1:a2], new[b1:b2], strict=True):
                if ta != tb or da != db:
                    changes.append(Change("differs", min(ta, tb), da, db, ta, tb))
            continue
        changes.extend(Change("disappears", t, d, None, t, None) for t, d, _ in old[a1:a2])
        changes.extend(Change("appears", t, None, d, None, t) for t, d, _ in new[b1:b2])
    changes.sort(key=lambda c: c.at_ns)
    horizon = next((c.at_ns for c in changes if _is_command(c)), None)
    if horizon is None:
        return tuple(changes)
    return tuple(
        Change(
            c.change,
            c.at_ns,
            c.before,
            c.after,
            c.before_at_ns,
            c.after_at_ns,
            beyond_horizon=c.at_ns > horizon,
        )
        for c in changes
    )


def _is_command(change: Change) -> bool:
    return isinstance(change.before, Issue) or isinstance(change.after, Issue)


def _rejections(rows: Iterable[Row]) -> dict[str, int]:
    return dict(Counter(d.code for row in rows for d in row.decisions if isinstance(d, Rejected)))
