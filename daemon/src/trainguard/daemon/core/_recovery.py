"""Restore coordination: open an incident, retry its restore, or give up and abort.

ARCHITECTURE.md section 4: on an incident the daemon increments the generation, chooses the
target and issues ``restore``; a failure of the restore (a rank of the new generation dying,
the restore timing out, the target failing verification, a rank missing an in-process restore
point) retries with a new generation, the same incident and the next attempt number; after
``max_restore_attempts`` the job is ``failed`` and aborted. At most one ``restore`` per attempt.

Target rule: the newest committed snapshot not known bad whose step is at or before the
incident's last known-good step (``onset_after_step``), or any committed snapshot when the
onset is the incident time (dead or stalled ranks). Issuing a restore to target X drops every
snapshot committed after X from the restore targets: they belong to the abandoned timeline (for
a divergence, they may hold the diverged state), and a step re-committed in a later generation
is another snapshot.

No silent restart from scratch: when no committed snapshot of the job's timeline can be
restored (each failed verification or was written after the onset), the job fails with a reason
naming every one of them, unless ``allow_restart_from_scratch`` allows the restart from the
initial state (which then says so in its reason). An initial state that failed verification (the
snapshot of another job the job started from, ``init_from``) is never restored: a job with no
snapshot of its own fails at once.

Acknowledgements: a restore resumes only once every rank acknowledged exactly the target's
snapshot, step and data position (:func:`acknowledged`); otherwise it is retried.

Crash-loop guard: an incident opened without progress (the highest step ever reached grew by
less than ``crash_loop_progress_steps`` since the first incident of the current run) extends the
run; once ``max_restore_cycles`` restores of a run led to no progress, the next incident fails
the job instead of restoring again. An incident that strikes within ``startup_steps`` steps
after a restore is evidence against that restore: its reason says so, and the crash loop's
reason names those incidents and suspects an incomplete restore.

Bus outages (:mod:`trainguard.daemon.core._outage`): while the bus settles after a gap in the job's
inputs, an incident opens but its first restore is held (``JobState.held``) until the settle
deadline, when :func:`release` issues it with the target chosen then; a failure meanwhile joins
it, and a job that finishes or is stopped meanwhile is never restored. Shards of the generation
a restore left that arrive after it (a late cut, :func:`trainguard.daemon.core._commit_rule.late_shard`)
never change an issued restore's target nor a retry's.

Checkpoints in flight (:func:`awaited_cut`): a rank's exit report can reach the daemon before
the other ranks' shards of a step it completed (they are still being written, or sit in their
agents' outboxes), though its own shard came first (its supervisor forwards what it left
unsent before reporting the exit). The incident then opens at once, but its restore is held,
at most ``cut_settle_s`` of bus time, until that step commits and becomes the target, or can no
longer commit (a rank that lacks its shard exited too); a failure meanwhile joins it, as in a
settle window.

``docs/recovery.md`` states these rules.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass, replace

from msgspec import structs
from rpds import HashTrieMap

from trainguard.daemon.core._decisions import (
    Anomaly,
    Decision,
    IncidentClosed,
    IncidentOpened,
    Issue,
    JobFailed,
    Transition,
)
from trainguard.daemon.core._evidence import NO_MEASURES, Measures, ranks_text, seconds_text
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._outage import settling
from trainguard.daemon.core._state import (
    Ack,
    AfterRestore,
    Held,
    Incident,
    IncidentCause,
    JobState,
    Left,
    Loop,
    Watch,
)
from trainguard.schemas import (
    Abort,
    DataCursor,
    Lifecycle,
    Restore,
    RestoreMode,
    SnapshotRef,
    StepRange,
)

IN_PROCESS_CAUSES: frozenset[IncidentCause] = frozenset(
    {"nan_loss", "loss_spike", "checksum_mismatch"}
)
"""Incidents in which every process is alive and responsive: restorable in process."""

_MAX_REASON = 4096
"""Longest reason a command may carry (``common.v1.json#/$defs/reason``)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """Evidence of a failure found by a handler or a deadline check.

    Attributes:
        cause: the detector.
        reason: the evidence, in words.
        ranks: the ranks it names (may be empty when none is known).
        hosts: their hosts (may be empty or repeat).
        onset_after_step: the last step known good (targets are committed steps ``<=`` it),
            or ``None`` when the onset is the failure's time.
        measures: the numbers the detector compared.
        skip: steps whose batches the restored ranks skip, or ``None``.
        step: the step the failure struck at when its evidence says so (the last step an
            exited worker completed), else ``None``: the named ranks' last reported steps
            stand for it.
    """

    cause: IncidentCause
    reason: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    _: KW_ONLY
    onset_after_step: int | None = None
    measures: Measures = NO_MEASURES
    skip: StepRange | None = None
    step: int | None = None


def target_text(target: SnapshotRef | None) -> str:
    """A restore target in words: its snapshot id, or the start from scratch."""
    return "scratch (no committed snapshot)" if target is None else target.snapshot_id


def next_command_seq(state: JobState) -> int:
    """``seq`` for the job's next command (per-job counter, from 1)."""
    return state.command_seq + 1


def fail_over(
    state: JobState, failure: Failure, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]]:
    """Act on ``failure`` in the current generation: open an incident and restore, or, while
    restoring, retry the open incident's restore (abort after the last attempt). While the bus
    settles after a gap the incident opens but its restore is held (:func:`release` issues
    it), and a failure found while one is held joins it."""
    if state.phase == "restoring" and state.incident is not None:
        return _retry(state, state.incident, failure, config)
    if state.held is not None:
        return _join(state, state.held, failure)
    return _open(state, failure, config)


def finished_before_reload(
    state: JobState, event: Lifecycle, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]]:
    """A rank's ``finished`` ``event`` of the generation the current restore left, counted by
    the late-finish rule (:func:`trainguard.daemon.core._outage.late_finish`), which left the
    restore standing. An ``in_process`` restore is then missed (a finished process cannot
    reload in process): its incident fails over to the next attempt as an
    ``in_process_missed`` failure, a restart whose supervisors start the ranks again. Any
    other restore: nothing more to do."""
    incident = state.incident
    if state.phase != "restoring" or incident is None or incident.mode != "in_process":
        return state, ()
    at_step = -1 if incident.at_step is None else incident.at_step
    failure = Failure(
        "in_process_missed",
        f"rank {event.rank} on host {event.host} finished in generation {event.generation} "
        f"before the in-process restore of generation {state.generation} at step {at_step}; "
        "restarting instead",
        () if event.rank is None else (event.rank,),
        (event.host,),
        measures=Measures(at_step=at_step, step=-1 if event.step is None else event.step),
    )
    return fail_over(state, failure, config)


def give_up(
    state: JobState,
    reason: str,
    config: MachineConfig,
    *,
    dead: tuple[int, ...] = (),
    opened: IncidentOpened | None = None,
) -> tuple[JobState, tuple[Decision, ...]]:
    """Fail the job for good: abort it, mark the ranks ``dead`` dead, close the open incident
    (or ``opened``, an incident that gets no restore, or the held one) as ``failed``.

    Returns:
        The ``failed`` state and ``[opened], Transition, Issue(Abort), [IncidentClosed],
        JobFailed``.
    """
    seq = next_command_seq(state)
    abort = Abort(
        job_id=state.job_id,
        generation=state.generation,
        ts=state.clock_ns,
        seq=seq,
        daemon_id=config.daemon_id,
        reason=reason[:_MAX_REASON],
    )
    ranks = state.ranks
    for r in dead:
        record = ranks.get(r)
        if record is not None:
            ranks = ranks.insert(r, structs.replace(record, status="dead"))
    decisions: list[Decision] = [] if opened is None else [opened]
    decisions += [
        Transition(old=state.phase, new="failed", generation=state.generation, reason=reason),
        Issue(command=abort, reason=reason),
    ]
    incident, held = state.incident, state.held
    closing = (
        (incident.incident_id, incident.attempt)
        if incident is not None
        else (opened.incident_id, 0)
        if opened is not None
        else None
        if held is None
        else (held.incident_id, 0)
    )
    if closing is not None:
        incident_id, attempts = closing
        decisions.append(
            IncidentClosed(
                incident_id=incident_id, outcome="failed", attempts=attempts, reason=reason
            )
        )
    decisions.append(JobFailed(reason=reason))
    new = structs.replace(
        state,
        phase="failed",
        incident=None,
        held=None,
        command_seq=seq,
        failure=reason,
        ranks=ranks,
    )
    return new, tuple(decisions)


def _timeline(state: JobState, target: SnapshotRef | None) -> JobState:
    """Forget the snapshots committed after ``target`` (all of them for a start from scratch):
    the restore abandons the timeline they belong to. Why those of them that failed
    verification failed is kept (``JobState.bad_snapshots``): a give-up names them."""
    committed = state.committed
    wanted = None if target is None else target.snapshot_id
    index = next((i for i, m in enumerate(committed) if m.snapshot_id == wanted), None)
    kept = () if index is None else committed[: index + 1]
    if len(kept) == len(committed):
        return state
    return structs.replace(state, committed=kept)


def _new_generation(
    state: JobState, *, incident: Incident, command_seq: int, incidents: int
) -> JobState:
    """Enter the next generation, restoring: nothing heard in it yet; the world size is carried
    over as the expectation; sender seqs of the old one can never matter, and its pending
    shards only to a late cut of it (``JobState.left``); the generation's detectors start
    afresh from the target's step."""
    target = incident.target
    base = None if target is None else target.step
    left = state.left
    if state.senders or left is None:
        # Some process was heard in the generation this restore leaves: the ranks last ran in
        # it. A retry of a restore nobody joined keeps the generation they ran in.
        finished = sorted(r for r, rec in state.ranks.items() if rec.status == "finished")
        left = Left(state.generation, tuple(finished), pending=state.pending)
    return structs.replace(
        _timeline(state, target),
        phase="restoring",
        generation=state.generation + 1,
        generation_started_ns=state.clock_ns,
        ranks=HashTrieMap(),
        finished_ranks=0,
        senders=HashTrieMap(),
        relays=HashTrieMap(),
        pending=HashTrieMap(),
        silence_floor_ns=None,
        incident=incident,
        held=None,
        incidents_opened=incidents,
        command_seq=command_seq,
        watch=Watch(base_step=base),
        left=left,
    )


_POSITION: tuple[tuple[str, str], ...] = (
    ("data_version", "data version"),
    ("seed", "seed"),
    ("epoch", "epoch"),
    ("offset", "offset"),
)
"""The fields of a data cursor an acknowledgement must match, with their names in reasons
(``world_size`` is informational: a restore may re-partition the remaining samples)."""

_LISTED_ACKS = 8
"""Wrong acknowledgements described in a reason before the rest are only counted."""


def acknowledged(state: JobState, incident: Incident) -> Failure | None:
    """Judge the acknowledgements of ``incident``'s current attempt, once every rank's is in.

    A rank's ``lifecycle restored`` must name the target's snapshot and stand at its step and
    data position: the cursor's data version, seed, epoch and global sample offset, compared
    as they are (both are cursors in the same units); an acknowledgement without a cursor
    does not match a target, which always has one. For the job's initial state (target
    ``None``) the daemon knows no position of its own: the ranks must agree with one another,
    the largest group of agreeing ranks (the one holding the lowest rank on a tie) being the
    reference.

    Returns:
        ``None`` when every acknowledgement matches, else a ``restore_mismatch`` failure
        naming each rank that does not, with what it acknowledged and what was expected.
    """
    wrong = wrong_acks(state, incident)
    if not wrong:
        return None
    ranks = tuple(r for r, _ in wrong)
    hosts = tuple(rec.host for r in ranks if (rec := state.ranks.get(r)) is not None)
    reason = (
        f"restore attempt {incident.attempt} of {incident.incident_id} to "
        f"{target_text(incident.target)} (generation {state.generation}) was not carried out "
        f"as ordered: {_listed(wrong)}"
    )
    return Failure(
        "restore_mismatch", reason, ranks, hosts, measures=Measures(wrong_acks=len(wrong))
    )


def wrong_acks(state: JobState, incident: Incident) -> list[tuple[int, str]]:
    """``(rank, what it acknowledged against what was expected)`` for every acknowledgement
    received so far that does not match (see :func:`acknowledged`), by rank."""
    acks = sorted(incident.acks.items())
    target = incident.target
    if target is not None:
        expected = Ack(target.snapshot_id, target.step, target.cursor)
        source = "expected"
        reference: set[int] = set()
    else:
        groups: dict[tuple[object, ...], list[tuple[int, Ack]]] = {}
        for rank, ack in acks:
            groups.setdefault(_position(ack), []).append((rank, ack))
        if len(groups) < 2:
            return []
        members = max(groups.values(), key=lambda group: (len(group), -group[0][0]))
        expected = members[0][1]
        source = f"{ranks_text(r for r, _ in members)} acknowledged"
        reference = {r for r, _ in members}
    out: list[tuple[int, str]] = []
    for rank, ack in acks:
        if rank in reference:
            continue
        differences = _differences(ack, expected, source)
        if differences:
            rec = state.ranks.get(rank)
            who = f"rank {rank}" if rec is None else f"rank {rank} on host {rec.host}"
            out.append((rank, f"{who} acknowledged {', '.join(differences)}"))
    return out


def _position(ack: Ack) -> tuple[object, ...]:
    """What of ``ack`` must match: snapshot, step and the cursor's position fields."""
    cursor = ack.cursor
    where = None if cursor is None else tuple(getattr(cursor, name) for name, _ in _POSITION)
    return (ack.snapshot_id, ack.step, where)


def _differences(ack: Ack, expected: Ack, source: str) -> list[str]:
    """What ``ack`` says differently from ``expected``: ``"step 0 (expected 20)"``, ..."""
    out: list[str] = []
    if ack.snapshot_id != expected.snapshot_id:
        out.append(
            f"snapshot {_snapshot(ack.snapshot_id)} ({source} {_snapshot(expected.snapshot_id)})"
        )
    if ack.step != expected.step:
        out.append(f"step {_step(ack.step)} ({source} {_step(expected.step)})")
    got, wanted = ack.cursor, expected.cursor
    if got is None and wanted is not None:
        out.append(f"no data cursor ({source} {_cursor_text(wanted)})")
    elif got is not None and wanted is None:
        out.append(f"data cursor {_cursor_text(got)} ({source} none)")
    elif got is not None and wanted is not None:
        for name, label in _POSITION:
            mine, theirs = getattr(got, name), getattr(wanted, name)
            if mine != theirs:
                out.append(f"{label} {_value(mine)} ({source} {_value(theirs)})")
    return out


def _cursor_text(cursor: DataCursor) -> str:
    """``"offset 640 of epoch 0 (seed 7, data version 'v1')"``."""
    return (
        f"offset {cursor.offset} of epoch {cursor.epoch} (seed {cursor.seed}, data version "
        f"{cursor.data_version!r})"
    )


def _snapshot(snapshot_id: str | None) -> str:
    return "none (the initial state)" if snapshot_id is None else snapshot_id


def _step(step: int | None) -> str:
    return "none" if step is None else str(step)


def _value(value: object) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _listed(wrong: list[tuple[int, str]]) -> str:
    """The first few wrong acknowledgements, and a count of the rest."""
    text = "; ".join(what for _, what in wrong[:_LISTED_ACKS])
    more = len(wrong) - _LISTED_ACKS
    return text + (f"; and {more} more rank(s)" if more > 0 else "")


def wrong_acks_text(state: JobState, incident: Incident) -> str:
    """``"; rank 2 on host h1 acknowledged step 0 (expected 20)"`` for the wrong
    acknowledgements received so far (a restore timeout's reason), or ``""``."""
    wrong = wrong_acks(state, incident)
    return f"; {_listed(wrong)}" if wrong else ""


def _restore(
    state: JobState,
    incident: Incident,
    generation: int,
    seq: int,
    reason: str,
    config: MachineConfig,
) -> Restore:
    """The ``restore`` command of ``incident``'s current attempt, stamped with the clock."""
    return Restore(
        job_id=state.job_id,
        generation=generation,
        ts=state.clock_ns,
        seq=seq,
        daemon_id=config.daemon_id,
        incident_id=incident.incident_id,
        reason=reason[:_MAX_REASON],
        target=incident.target,
        mode=incident.mode,
        attempt=incident.attempt,
        at_step=incident.at_step,
        skip=incident.skip,
    )


def _mode(
    state: JobState, failure: Failure, config: MachineConfig
) -> tuple[RestoreMode, int | None]:
    """The first restore's mode, and for ``in_process`` its ``at_step``: the highest step any
    rank reported plus a margin of at least ``in_process_margin_steps`` steps and
    ``in_process_lead_s`` seconds at the job's median step time. ``restart`` when the restore
    mode is not ``in_process``, the cause is not one of :data:`IN_PROCESS_CAUSES`, or a rank of
    the generation reported ``finished`` (its process is ending: it cannot reload)."""
    if (
        config.restore_mode != "in_process"
        or failure.cause not in IN_PROCESS_CAUSES
        or state.finished_ranks
    ):
        # A rank that finished cannot reload in process: its supervisor starts it again.
        return "restart", None
    margin = config.in_process_margin_steps
    typical = state.trend.step_time_median_s
    if typical is not None and typical > 0:
        margin = max(margin, math.ceil(config.in_process_lead_s / typical))
    return "in_process", max(state.watch.lead_step, 0) + margin


def _refusal(
    state: JobState, target: SnapshotRef | None, onset_after_step: int | None, config: MachineConfig
) -> str | None:
    """Why restoring ``target`` is refused, or ``None``: the initial state of a job with
    committed snapshots (unless ``allow_restart_from_scratch``), or a target on another data
    version than the job's; or the initial state once it failed verification (the snapshot of
    another job the job started from, ``init_from``: a restart from the initial state loads it
    again, whatever ``allow_restart_from_scratch`` says)."""
    initial = _initial_failure(state) if target is None else None
    if initial is not None:
        sid, why = initial
        lead = (
            f"{_unusable(state, onset_after_step)}, and the job's initial state cannot be "
            f"restored either"
            if state.committed
            else "the job has no committed snapshot of its own, and its initial state cannot "
            "be restored"
        )
        allowed = (
            " (allow_restart_from_scratch does not apply: a restart from the initial state "
            f"loads {sid} again; start a new job without init_from to train from scratch)"
            if config.allow_restart_from_scratch
            else ""
        )
        return (
            f"{lead}: it is snapshot {sid} of another job (init_from), and {why}; nothing is "
            f"left to restore{allowed}"
        )
    if target is None and state.committed and not config.allow_restart_from_scratch:
        return (
            f"{_unusable(state, onset_after_step)}; restarting from the job's initial state "
            f"would discard every step trained (up to step {state.trend.high_water_step}), so "
            f"it is refused (set allow_restart_from_scratch to restart from there)"
        )
    current = state.data_version
    if target is None or current is None or config.allow_data_version_change:
        return None
    if target.data_version == current:
        return None
    return (
        f"restore target {target.snapshot_id} was written on data version "
        f"{target.data_version!r}, but the job runs on {current!r}: restoring across a data "
        f"version change is refused (set allow_data_version_change to allow it)"
    )


def _initial_failure(state: JobState) -> tuple[str, str] | None:
    """``(snapshot id, why)`` once a rank reported that the job's initial state, a snapshot of
    another job (``init_from``), failed verification, else ``None``."""
    return next((bad for bad in state.bad_snapshots if not state.owns(bad[0])), None)


def _unusable(state: JobState, onset_after_step: int | None) -> str:
    """Every committed snapshot of the job's timeline, and every one this timeline's restores
    abandoned after it failed verification, with why it cannot be restored."""
    bad = dict(state.bad_snapshots)
    why = [f"{sid}: {reason}" for sid, reason in state.bad_snapshots if state.owns(sid)]
    why += [
        f"{m.snapshot_id}: written at step {m.step}, after the incident's onset (known sound "
        f"up to step {onset_after_step})"
        for m in reversed(state.committed)
        if m.snapshot_id not in bad
    ]
    return f"no committed snapshot can be restored ({'; '.join(why)})"


def _scratch_note(state: JobState, target: SnapshotRef | None, onset_after_step: int | None) -> str:
    """For a restart from the initial state of a job with committed snapshots (allowed by
    ``allow_restart_from_scratch``): why none of them is used, loudly; else ``""``."""
    if target is not None or not state.committed:
        return ""
    return (
        f"; {_unusable(state, onset_after_step)}: restarting from the job's initial state, "
        f"discarding every step trained (allow_restart_from_scratch)"
    )


def _after_restore(
    state: JobState, incident_id: str, failure: Failure, config: MachineConfig
) -> AfterRestore | None:
    """``failure`` as evidence against the restore that began the current generation: when
    it struck within ``startup_steps`` steps after the restored step, else ``None``. Where it
    struck: ``failure.step``, else the furthest last step of the ranks it names, else (it
    names none) the generation's highest step."""
    base = state.watch.base_step
    if state.generation == 0 or base is None:
        return None
    step = failure.step
    if step is None and failure.ranks:
        known = [rec.step for r in failure.ranks if (rec := state.ranks.get(r)) is not None]
        step = max((s for s in known if s is not None), default=None)
    elif step is None and state.watch.lead_step >= 0:
        step = state.watch.lead_step  # an incident of the whole job (a loss spike)
    if step is None or not base <= step <= base + config.startup_steps:
        return None
    return AfterRestore(incident_id, tuple(sorted(set(failure.ranks))), step, base)


def _after_restore_text(evidence: AfterRestore) -> str:
    """``"step 1101 is the first step after the restore to step 1100"`` and the like."""
    step, base = evidence.step, evidence.base_step
    if step == base:
        return f"it struck before the first step after the restore to step {base} completed"
    if step == base + 1:
        return f"step {step} is the first step after the restore to step {base}"
    return f"step {step} is {step - base} steps after the restore to step {base}"


def _next_loop(
    state: JobState,
    incident_id: str,
    failure: Failure,
    evidence: AfterRestore | None,
    config: MachineConfig,
) -> Loop:
    """The crash-loop count once incident ``incident_id`` opens for ``failure``
    (``evidence``: it struck right after a restore).

    The highest step reached is the heartbeats' high-water step or the step the failure
    names (an exit report's last completed step), whichever is higher: a worker that trains
    several steps per heartbeat exits past its last heartbeat, and a mark taken from the
    heartbeats alone would count the next generation's rerun of those steps as progress."""
    loop = state.loop
    high = max(state.trend.high_water_step, -1 if failure.step is None else failure.step)
    cause = failure.cause
    early = () if evidence is None else (evidence,)
    if loop.mark_step is None or high >= loop.mark_step + config.crash_loop_progress_steps:
        return Loop(
            streak=0, mark_step=high, incidents=((incident_id, cause),), after_restore=early
        )
    return Loop(
        streak=loop.streak + 1,
        mark_step=loop.mark_step,
        incidents=(*loop.incidents, (incident_id, cause)),
        after_restore=(*loop.after_restore, *early),
    )


def _loop_reason(loop: Loop, failure: Failure, config: MachineConfig) -> str:
    """The loud reason of a crash loop: how many incidents, their repeating causes, the step
    the job could not get past, and those that struck right after a restore."""
    counts = Counter(cause for _, cause in loop.incidents)
    causes = ", ".join(
        f"{cause} x{n}" for cause, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    )
    first, last = loop.incidents[0][0], loop.incidents[-1][0]
    return (
        f"crash loop: {len(loop.incidents)} incidents in a row ({first} .. {last}) repeating "
        f"{causes}, and the job never got {config.crash_loop_progress_steps} steps past step "
        f"{loop.mark_step} between them (max_restore_cycles={config.max_restore_cycles}); "
        f"no more restores.{_suspicion(loop, config)} Latest: {failure.reason}"
    )


def _suspicion(loop: Loop, config: MachineConfig) -> str:
    """What the run's incidents right after restores suggest, or ``""`` when there were
    none: where they struck (ranks and steps) and the suspect, an incomplete restore."""
    early = loop.after_restore
    if not early:
        return ""
    where: dict[tuple[tuple[int, ...], int], list[str]] = {}
    for evidence in early:
        where.setdefault((evidence.ranks, evidence.step), []).append(evidence.incident_id)
    places = "; ".join(
        f"{ranks_text(ranks) if ranks else 'no rank named'} at step {step} ({', '.join(ids)})"
        for (ranks, step), ids in where.items()
    )
    mark = loop.mark_step
    # Steps the job had passed before were computed without the failure then: a batch that
    # always fails is ruled out, and the restored state is the suspect. The mark itself may be
    # where the run's first failure struck (its exit's last completed step, its NaN's step):
    # only steps below it were trained past.
    passed = mark is not None and all(e.step < mark for e in early)
    seen = f", steps the job had trained past before (it reached step {mark})" if passed else ""
    other = "" if passed else ", or a batch that fails whenever it is trained"
    return (
        f" {len(early)} of the {len(loop.incidents)} incidents struck within "
        f"{config.startup_steps} steps after a restore ({places}){seen}: suspect an "
        f"incomplete restore, state that the checkpoint does not carry (a gradient scaler, "
        f"a learning-rate scheduler, an optimizer's or data loader's state, RNG streams) or "
        f"that the restarted process rebuilds differently{other}."
    )


def _opened(state: JobState, incident_id: str, failure: Failure) -> IncidentOpened:
    """The decision opening incident ``incident_id`` for ``failure``."""
    return IncidentOpened(
        incident_id=incident_id,
        cause=failure.cause,
        generation=state.generation,
        ranks=tuple(sorted(set(failure.ranks))),
        hosts=tuple(sorted(set(failure.hosts))),
        reason=failure.reason,
        onset_after_step=failure.onset_after_step,
        measures=failure.measures,
    )


def fail_now(
    state: JobState,
    failure: Failure,
    config: MachineConfig,
    *,
    dead: tuple[int, ...] = (),
) -> tuple[JobState, tuple[Decision, ...]]:
    """Open an incident for ``failure`` and fail the job at once, without a restore: for a
    failure no restore can repair (ranks whose data orders disagree rebuild the same
    disagreement from their own settings after any restore). The ranks ``dead`` are marked
    dead.

    Returns:
        The ``failed`` state and :func:`give_up`'s decisions, the incident's opening first.
    """
    number = state.incidents_opened + 1
    incident_id = f"{state.job_id}/i{number}"
    opened = _opened(state, incident_id, failure)
    state = structs.replace(state, incidents_opened=number)
    return give_up(
        state, f"incident {incident_id}: {failure.reason}", config, dead=dead, opened=opened
    )


def fail_unrepairable(
    state: JobState, failure: Failure, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]]:
    """Fail the job for ``failure`` of the ranks it names, which no restore can repair (a
    worker that exited with :data:`~trainguard.schemas.EXIT_CONFIG`: a restarted one would
    find the same configuration). The incident that is open (restoring) or held fails with it;
    without one, one opens for ``failure`` and fails at once (:func:`fail_now`). The ranks are
    marked dead.

    Returns:
        The ``failed`` state and :func:`give_up`'s decisions.
    """
    current = state.incident or state.held
    if current is None:
        return fail_now(state, failure, config, dead=failure.ranks)
    reason = f"incident {current.incident_id}: {failure.reason}"
    return give_up(state, reason, config, dead=failure.ranks)


def _open(
    state: JobState, failure: Failure, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]]:
    """Open the job's next incident and issue its first restore (or fail the job: a crash
    loop, or a target on another data version); while the bus settles after a gap, hold the
    restore instead (:func:`release` issues it)."""
    number = state.incidents_opened + 1
    incident_id = f"{state.job_id}/i{number}"
    evidence = _after_restore(state, incident_id, failure, config)
    if evidence is not None:
        failure = replace(failure, reason=f"{failure.reason}; {_after_restore_text(evidence)}")
    opened = _opened(state, incident_id, failure)
    state = structs.replace(state, incidents_opened=number)
    if settling(state):
        return _hold(state, incident_id, failure, evidence, opened)
    awaits = None
    if failure.cause == "exited" and config.cut_settle_ns:
        awaits = awaited_cut(state, failure.ranks, failure.onset_after_step)
    if awaits is not None:
        state = structs.replace(state, settle_until_ns=state.clock_ns + config.cut_settle_ns)
        return _hold(state, incident_id, failure, evidence, opened, awaits=awaits)
    return _first_restore(
        state, incident_id, failure, evidence, config, opened=opened, opened_ns=state.clock_ns
    )


def _first_restore(
    state: JobState,
    incident_id: str,
    failure: Failure,
    evidence: AfterRestore | None,
    config: MachineConfig,
    *,
    opened: IncidentOpened | None,
    opened_ns: int,
    restart: bool = False,
    held_note: str = "",
) -> tuple[JobState, tuple[Decision, ...]]:
    """Issue the first restore of incident ``incident_id`` (already counted in
    ``incidents_opened``), or fail the job: a crash loop, or no restorable target.

    ``opened``: its opening decision, to decide with the restore (``None``: decided when it
    was held). ``restart``: restart whatever ``restore_mode`` says. ``held_note`` ends the
    restore's reason."""
    loop = _next_loop(state, incident_id, failure, evidence, config)
    state = structs.replace(state, loop=loop)
    if loop.streak >= config.max_restore_cycles:
        return give_up(state, _loop_reason(loop, failure, config), config, opened=opened)
    target = state.restore_target(failure.onset_after_step)
    refused = _refusal(state, target, failure.onset_after_step, config)
    if refused is not None:
        return give_up(state, f"incident {incident_id}: {refused}", config, opened=opened)
    note = _scratch_note(state, target, failure.onset_after_step)
    mode, at_step = ("restart", None) if restart else _mode(state, failure, config)
    incident = Incident(
        incident_id=incident_id,
        cause=failure.cause,
        reason=failure.reason,
        opened_ns=opened_ns,
        attempt=1,
        target=target,
        issued_ns=state.clock_ns,
        onset_after_step=failure.onset_after_step,
        mode=mode,
        at_step=at_step,
        skip=failure.skip,
    )
    generation = state.generation + 1
    seq = next_command_seq(state)
    restore = _restore(state, incident, generation, seq, failure.reason, config)
    new = _new_generation(
        state, incident=incident, command_seq=seq, incidents=state.incidents_opened
    )
    how = "" if at_step is None else f" in process at step {at_step}"
    return new, (
        Transition(
            old=state.phase,
            new="restoring",
            generation=generation,
            reason=f"incident {incident_id}: {failure.reason}",
        ),
        *(() if opened is None else (opened,)),
        Issue(
            command=restore,
            reason=f"incident {incident_id} attempt 1: restore {target_text(target)}{how} in "
            f"generation {generation}{note}{held_note}",
        ),
    )


def awaited_cut(state: JobState, ranks: Iterable[int], onset_after_step: int | None) -> int | None:
    """The checkpoint a restore for the exited ``ranks`` waits for: the newest step of the
    current generation, uncommitted, at or before ``onset_after_step`` (if set), of which every
    rank of ``ranks`` reported its shard while some other rank has not; ``None`` if there is
    none (``docs/recovery.md``, "A checkpoint in flight is waited for")."""
    world_size = state.world_size
    gone = set(ranks)
    steps = [
        step
        for step, shards in state.pending.items()
        if (onset_after_step is None or step <= onset_after_step)
        and world_size is not None
        and len(shards) < world_size
        and gone.issubset(shards.keys())
    ]
    return max(steps, default=None)


def cut_arrived(state: JobState, held: Held) -> bool:
    """Whether the checkpoint ``held`` waits for (``Held.awaits``) committed, or can no longer
    commit (a rank that lacks its shard joined the incident): its restore need not wait for the
    settle deadline. ``False`` for a hold of the bus's settle window."""
    if held.awaits is None:
        return False
    return awaited_cut(state, held.ranks, held.onset_after_step) != held.awaits


def _hold(
    state: JobState,
    incident_id: str,
    failure: Failure,
    evidence: AfterRestore | None,
    opened: IncidentOpened,
    *,
    awaits: int | None = None,
) -> tuple[JobState, tuple[Decision, ...]]:
    """Open incident ``incident_id`` for ``failure``, holding its restore until
    ``settle_until_ns``: while the bus settles, or (``awaits``) for the checkpoint of that
    step, which the failed ranks completed and other ranks' shards not yet."""
    held = Held(
        incident_id=incident_id,
        cause=failure.cause,
        reason=failure.reason,
        ranks=opened.ranks,
        hosts=opened.hosts,
        opened_ns=state.clock_ns,
        onset_after_step=failure.onset_after_step,
        skip=failure.skip,
        step=failure.step,
        evidence=evidence,
        awaits=awaits,
    )
    wait = seconds_text((state.settle_until_ns or state.clock_ns) - state.clock_ns)
    if awaits is None:
        why = (
            f"restore held for {wait}, until the bus has settled after a gap (outage_settle_s): "
            f"checkpoints the ranks made during the outage commit first"
        )
    else:
        have = len(state.pending.get(awaits, HashTrieMap()))
        why = (
            f"restore held for at most {wait} (cut_settle_s): {ranks_text(held.ranks)} reported "
            f"the shard of step {awaits} before exiting, {have} of {state.world_size} ranks "
            f"have; the others' shards are written or on their way, and the step commits first"
        )
    note = Anomaly(
        kind="restore_held",
        reason=f"incident {incident_id}: {why}",
        ranks=held.ranks,
        hosts=held.hosts,
    )
    return structs.replace(state, held=held), (opened, note)


def _join(state: JobState, held: Held, failure: Failure) -> tuple[JobState, tuple[Decision, ...]]:
    """``failure``, found while ``held``'s restore waits, joins it: that restore restores every
    rank, to a target before the earliest onset of either, by restarting unless both are
    failures of responsive processes."""
    bounds = [s for s in (held.onset_after_step, failure.onset_after_step) if s is not None]
    steps = [s for s in (held.step, failure.step) if s is not None]
    joined = held._replace(
        ranks=tuple(sorted({*held.ranks, *failure.ranks})),
        hosts=tuple(sorted({*held.hosts, *failure.hosts})),
        onset_after_step=min(bounds, default=None),
        skip=held.skip if held.skip is not None else failure.skip,
        step=max(steps, default=None),
        restart=held.restart or failure.cause not in IN_PROCESS_CAUSES,
    )
    until = (
        "until the bus has settled after a gap"
        if held.awaits is None
        else f"for the checkpoint of step {held.awaits}"
    )
    note = Anomaly(
        kind="restore_held",
        reason=f"{failure.reason}; joins incident {held.incident_id}, whose restore is held "
        f"{until}",
        ranks=tuple(sorted(set(failure.ranks))),
        hosts=tuple(sorted(set(failure.hosts))),
        measures=failure.measures,
    )
    return structs.replace(state, held=joined), (note,)


def release(
    state: JobState, held: Held, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]]:
    """The hold is over (the bus has settled, or the checkpoint it waited for arrived or
    cannot: :func:`cut_arrived`): issue ``held``'s first restore (``state.held``), its target
    chosen now, among the snapshots committed while it waited (or fail the job, as
    :func:`_open` would have).

    Returns:
        The ``restoring`` state and ``Transition, Issue(Restore)``, or :func:`give_up`'s.
    """
    failure = Failure(
        held.cause,
        held.reason,
        held.ranks,
        held.hosts,
        onset_after_step=held.onset_after_step,
        skip=held.skip,
        step=held.step,
    )
    return _first_restore(
        state,
        held.incident_id,
        failure,
        held.evidence,
        config,
        opened=None,
        opened_ns=held.opened_ns,
        restart=held.restart,
        held_note=(
            "; held until the bus had settled after a gap"
            if held.awaits is None
            else f"; held for the checkpoint of step {held.awaits}"
        ),
    )


def _retry(
    state: JobState, incident: Incident, failure: Failure, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]]:
    """Issue the next attempt of ``incident``'s restore (always a restart), or abort after the
    last one."""
    if incident.attempt >= config.max_restore_attempts:
        reason = (
            f"incident {incident.incident_id} not recovered after {incident.attempt} restore "
            f"attempt(s) (max_restore_attempts={config.max_restore_attempts}); last failure: "
            f"{failure.reason}"
        )
        # Ranks that acknowledged wrongly are alive: only silent or exited ones are dead.
        dead = () if failure.cause == "restore_mismatch" else failure.ranks
        return give_up(state, reason, config, dead=dead)
    target = state.restore_target(incident.onset_after_step)
    refused = _refusal(state, target, incident.onset_after_step, config)
    if refused is not None:
        return give_up(state, f"incident {incident.incident_id}: {refused}", config)
    note = _scratch_note(state, target, incident.onset_after_step)
    retried = replace(
        incident,
        attempt=incident.attempt + 1,
        target=target,
        issued_ns=state.clock_ns,
        acks=HashTrieMap(),
        mode="restart",
        at_step=None,
    )
    generation = state.generation + 1
    seq = next_command_seq(state)
    restore = _restore(
        state, retried, generation, seq, f"attempt {retried.attempt}: {failure.reason}", config
    )
    new = _new_generation(
        state,
        incident=retried,
        command_seq=seq,
        incidents=state.incidents_opened,
    )
    return new, (
        Issue(
            command=restore,
            reason=f"incident {incident.incident_id} attempt {retried.attempt} of "
            f"{config.max_restore_attempts}: restore {target_text(retried.target)} in "
            f"generation {generation} because {failure.reason}{note}",
        ),
    )
