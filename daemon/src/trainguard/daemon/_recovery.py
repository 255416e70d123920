"""Restore coordination: open an incident, retry its restore, or give up and abort.

ARCHITECTURE.md section 4: on an incident the daemon increments the generation, chooses the
newest committed snapshot not known bad and issues ``restore``; a failure of the restore (a rank
of the new generation dying, the restore timing out, the target failing verification) retries
with a new generation, the same incident and the next attempt number; after
``max_restore_attempts`` the job is ``failed`` and aborted. At most one ``restore`` per attempt.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rpds import HashTrieMap, HashTrieSet

from trainguard.schemas import Abort, Manifest, Restore

from ._config import MachineConfig
from ._decisions import (
    Decision,
    IncidentClosed,
    IncidentOpened,
    Issue,
    JobFailed,
    Transition,
)
from ._state import Incident, IncidentCause, JobState


@dataclass(frozen=True, slots=True)
class Failure:
    """Evidence of a failure found by a handler or a deadline check.

    Attributes:
        cause: the detector.
        reason: the evidence, in words.
        ranks: the ranks it names (may be empty when none is known).
        hosts: their hosts (may be empty or repeat).
    """

    cause: IncidentCause
    reason: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]


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


def _new_generation(
    state: JobState, *, incident: Incident, command_seq: int, incidents: int
) -> JobState:
    """Enter the next generation, restoring: nothing heard in it yet; the world size is carried
    over as the expectation; pending shards and sender seqs of the old one can never matter."""
    return state._replace(
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
        reason=reason,
        target=incident.target,
        mode=config.restore_mode,
        attempt=incident.attempt,
    )


def _open(
    state: JobState, failure: Failure, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]]:
    """Open the job's next incident and issue its first restore."""
    number = state.incidents_opened + 1
    incident = Incident(
        incident_id=f"{state.job_id}/i{number}",
        cause=failure.cause,
        reason=failure.reason,
        opened_ns=state.clock_ns,
        attempt=1,
        target=state.latest_good_snapshot(),
        issued_ns=state.clock_ns,
    )
    generation = state.generation + 1
    seq = next_command_seq(state)
    restore = _restore(state, incident, generation, seq, failure.reason, config)
    new = _new_generation(state, incident=incident, command_seq=seq, incidents=number)
    return new, (
        Transition(
            old=state.phase,
            new="restoring",
            generation=generation,
            reason=f"incident {incident.incident_id}: {failure.reason}",
        ),
        IncidentOpened(
            incident_id=incident.incident_id,
            cause=failure.cause,
            generation=state.generation,
            ranks=tuple(sorted(set(failure.ranks))),
            hosts=tuple(sorted(set(failure.hosts))),
            reason=failure.reason,
        ),
        Issue(
            command=restore,
            reason=f"incident {incident.incident_id} attempt 1: restore "
            f"{target_text(incident.target)} in generation {generation}",
        ),
    )


def _retry(
    state: JobState, incident: Incident, failure: Failure, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]]:
    """Issue the next attempt of ``incident``'s restore, or abort after the last one."""
    if incident.attempt >= config.max_restore_attempts:
        return _abort(state, incident, failure, config)
    retried = replace(
        incident,
        attempt=incident.attempt + 1,
        target=state.latest_good_snapshot(),
        issued_ns=state.clock_ns,
        acks=HashTrieSet(),
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


def _abort(
    state: JobState, incident: Incident, failure: Failure, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]]:
    """Give up: the job is ``failed``, its ranks named by ``failure`` ``dead``, and aborted."""
    reason = (
        f"incident {incident.incident_id} not recovered after {incident.attempt} restore "
        f"attempt(s) (max_restore_attempts={config.max_restore_attempts}); last failure: "
        f"{failure.reason}"
    )
    seq = next_command_seq(state)
    abort = Abort(
        job_id=state.job_id,
        generation=state.generation,
        ts=state.clock_ns,
        seq=seq,
        daemon_id=config.daemon_id,
        reason=reason,
    )
    ranks = state.ranks
    for r in failure.ranks:
        record = ranks.get(r)
        if record is not None:
            ranks = ranks.insert(r, record._replace(status="dead"))
    new = state._replace(
        phase="failed", incident=None, command_seq=seq, failure=reason, ranks=ranks
    )
    return new, (
        Transition(old=state.phase, new="failed", generation=state.generation, reason=reason),
        Issue(command=abort, reason=reason),
        IncidentClosed(
            incident_id=incident.incident_id,
            outcome="failed",
            attempts=incident.attempt,
            reason=reason,
        ),
        JobFailed(reason=reason),
    )
