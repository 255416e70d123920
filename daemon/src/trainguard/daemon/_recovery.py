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

Crash-loop guard: an incident opened without progress (the highest step ever reached grew by
less than ``crash_loop_progress_steps`` since the first incident of the current run) extends the
run; once ``max_restore_cycles`` restores of a run led to no progress, the next incident fails
the job instead of restoring again.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import KW_ONLY, dataclass, replace

from rpds import HashTrieMap, HashTrieSet

from trainguard.schemas import Abort, Manifest, Restore, RestoreMode, StepRange

from ._config import MachineConfig
from ._decisions import (
    Decision,
    IncidentClosed,
    IncidentOpened,
    Issue,
    JobFailed,
    Transition,
)
from ._evidence import NO_MEASURES, Measures
from ._state import Incident, IncidentCause, JobState, Loop, Watch

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
    """

    cause: IncidentCause
    reason: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    _: KW_ONLY
    onset_after_step: int | None = None
    measures: Measures = NO_MEASURES
    skip: StepRange | None = None


def target_text(target: Manifest | None) -> str:
    """A restore target in words: its snapshot id, or the start from scratch."""
    return "scratch (no committed snapshot)" if target is None else target.snapshot_id


def next_command_seq(state: JobState) -> int:
    """``seq`` for the job's next command (per-job counter, from 1)."""
    return state.command_seq + 1


def fail_over(
    state: JobState, failure: Failure, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]]:
    """Act on ``failure`` in the current generation: open an incident and restore, or, while
    restoring, retry the open incident's restore (abort after the last attempt)."""
    if state.phase == "restoring" and state.incident is not None:
        return _retry(state, state.incident, failure, config)
    return _open(state, failure, config)


def give_up(
    state: JobState,
    reason: str,
    config: MachineConfig,
    *,
    dead: tuple[int, ...] = (),
    opened: IncidentOpened | None = None,
) -> tuple[JobState, tuple[Decision, ...]]:
    """Fail the job for good: abort it, mark the ranks ``dead`` dead, close the open incident
    (or ``opened``, an incident that gets no restore) as ``failed``.

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
            ranks = ranks.insert(r, record._replace(status="dead"))
    decisions: list[Decision] = [] if opened is None else [opened]
    decisions += [
        Transition(old=state.phase, new="failed", generation=state.generation, reason=reason),
        Issue(command=abort, reason=reason),
    ]
    incident = state.incident
    closing = (
        (incident.incident_id, incident.attempt)
        if incident is not None
        else None
        if opened is None
        else (opened.incident_id, 0)
    )
    if closing is not None:
        incident_id, attempts = closing
        decisions.append(
            IncidentClosed(
                incident_id=incident_id, outcome="failed", attempts=attempts, reason=reason
            )
        )
    decisions.append(JobFailed(reason=reason))
    new = state._replace(
        phase="failed", incident=None, command_seq=seq, failure=reason, ranks=ranks
    )
    return new, tuple(decisions)


def _timeline(state: JobState, target: Manifest | None) -> JobState:
    """Forget the snapshots committed after ``target`` (all of them for a start from scratch):
    the restore abandons the timeline they belong to."""
    committed = state.committed
    wanted = None if target is None else target.snapshot_id
    index = next((i for i, m in enumerate(committed) if m.snapshot_id == wanted), None)
    kept = () if index is None else committed[: index + 1]
    if len(kept) == len(committed):
        return state
    ids = {m.snapshot_id for m in kept}
    return state._replace(
        committed=kept, bad_snapshots=frozenset(s for s in state.bad_snapshots if s in ids)
    )


def _new_generation(
    state: JobState, *, incident: Incident, command_seq: int, incidents: int
) -> JobState:
    """Enter the next generation, restoring: nothing heard in it yet; the world size is carried
    over as the expectation; pending shards and sender seqs of the old one can never matter;
    the generation's detectors start afresh from the target's step."""
    target = incident.target
    base = None if target is None else target.step
    return _timeline(state, target)._replace(
        phase="restoring",
        generation=state.generation + 1,
        generation_started_ns=state.clock_ns,
        ranks=HashTrieMap(),
        finished_ranks=0,
        senders=HashTrieMap(),
        pending=HashTrieMap(),
        silence_floor_ns=None,
        incident=incident,
        incidents_opened=incidents,
        command_seq=command_seq,
        watch=Watch(base_step=base),
    )


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
    ``in_process_lead_s`` seconds at the job's median step time."""
    if config.restore_mode != "in_process" or failure.cause not in IN_PROCESS_CAUSES:
        return "restart", None
    margin = config.in_process_margin_steps
    typical = state.trend.step_time_median_s
    if typical is not None and typical > 0:
        margin = max(margin, math.ceil(config.in_process_lead_s / typical))
    return "in_process", max(state.watch.lead_step, 0) + margin


def _refusal(state: JobState, target: Manifest | None, config: MachineConfig) -> str | None:
    """Why restoring ``target`` is refused (its data version is not the job's), or ``None``."""
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


def _next_loop(
    state: JobState, incident_id: str, cause: IncidentCause, config: MachineConfig
) -> Loop:
    """The crash-loop count once incident ``incident_id`` opens."""
    loop, high = state.loop, state.trend.high_water_step
    if loop.mark_step is None or high >= loop.mark_step + config.crash_loop_progress_steps:
        return Loop(streak=0, mark_step=high, incidents=((incident_id, cause),))
    return Loop(
        streak=loop.streak + 1,
        mark_step=loop.mark_step,
        incidents=(*loop.incidents, (incident_id, cause)),
    )


def _loop_reason(loop: Loop, failure: Failure, config: MachineConfig) -> str:
    """The loud reason of a crash loop: how many incidents, their repeating causes, the step
    the job could not get past."""
    counts = Counter(cause for _, cause in loop.incidents)
    causes = ", ".join(
        f"{cause} x{n}" for cause, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    )
    first, last = loop.incidents[0][0], loop.incidents[-1][0]
    return (
        f"crash loop: {len(loop.incidents)} incidents in a row ({first} .. {last}) repeating "
        f"{causes}, and the job never got {config.crash_loop_progress_steps} steps past step "
        f"{loop.mark_step} between them (max_restore_cycles={config.max_restore_cycles}); "
        f"no more restores. Latest: {failure.reason}"
    )


def _open(
    state: JobState, failure: Failure, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]]:
    """Open the job's next incident and issue its first restore (or fail the job: a crash
    loop, or a target on another data version)."""
    number = state.incidents_opened + 1
    incident_id = f"{state.job_id}/i{number}"
    opened = IncidentOpened(
        incident_id=incident_id,
        cause=failure.cause,
        generation=state.generation,
        ranks=tuple(sorted(set(failure.ranks))),
        hosts=tuple(sorted(set(failure.hosts))),
        reason=failure.reason,
        onset_after_step=failure.onset_after_step,
        measures=failure.measures,
    )
    loop = _next_loop(state, incident_id, failure.cause, config)
    state = state._replace(loop=loop)
    if loop.streak >= config.max_restore_cycles:
        state = state._replace(incidents_opened=number)
        return give_up(state, _loop_reason(loop, failure, config), config, opened=opened)
    target = state.restore_target(failure.onset_after_step)
    refused = _refusal(state, target, config)
    if refused is not None:
        state = state._replace(incidents_opened=number)
        return give_up(state, f"incident {incident_id}: {refused}", config, opened=opened)
    mode, at_step = _mode(state, failure, config)
    incident = Incident(
        incident_id=incident_id,
        cause=failure.cause,
        reason=failure.reason,
        opened_ns=state.clock_ns,
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
    new = _new_generation(state, incident=incident, command_seq=seq, incidents=number)
    how = "" if at_step is None else f" in process at step {at_step}"
    return new, (
        Transition(
            old=state.phase,
            new="restoring",
            generation=generation,
            reason=f"incident {incident_id}: {failure.reason}",
        ),
        opened,
        Issue(
            command=restore,
            reason=f"incident {incident_id} attempt 1: restore {target_text(target)}{how} in "
            f"generation {generation}",
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
        return give_up(state, reason, config, dead=failure.ranks)
    target = state.restore_target(incident.onset_after_step)
    refused = _refusal(state, target, config)
    if refused is not None:
        return give_up(state, f"incident {incident.incident_id}: {refused}", config)
    retried = replace(
        incident,
        attempt=incident.attempt + 1,
        target=target,
        issued_ns=state.clock_ns,
        acks=HashTrieSet(),
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
            f"generation {generation} because {failure.reason}",
        ),
    )
