"""Stopping a job on purpose and continuing it later: the ``job-request`` input.

An operator (``trainguard stop``), a supervisor that was signalled (``trainguard run`` on
SIGTERM or Ctrl-C) or one started with ``--continue`` sends a
:class:`~trainguard.schemas.JobRequest` on the job's stream of ``events``. It is folded here,
purely, like any other input, so a replay of the log reproduces what the daemon decided
(``docs/operations.md``, "Stopping and continuing a job", states the rules):

* **stop** of a live job (``starting``, ``running``, ``restoring``): the job ends ``stopped``,
  not ``failed``: an ``abort`` with ``outcome`` ``stopped`` of the current generation, the open
  incident (if any) closed as ``stopped``. A stop of a job that has ended already
  (``finished``, ``failed``, ``stopped``) changes nothing: every signalled supervisor of a job
  asks. One exception: a **late stop** of a ``failed`` job, one naming the generation its ranks
  last ran in while no rank joined any restore since (``JobState.left``, ``senders`` empty),
  ends it ``stopped`` too: the silence the daemon restored it for, and failed it for when
  nobody joined, was this stop's (made while the bus was away and delivered by the node's
  next supervisor; ``docs/recovery.md``, "A stop while the bus was away"). A late stop voids
  the restore as a late finish does: the cuts of the generation the ranks ran in
  (``Left.cuts``, steps whose shards all arrived after the restore) commit first. A stop of a generation older than the job's latest continuation was meant for the run
  before it and is rejected (``stale_generation``), so a late request never ends the continued
  run. A stop that is the job's first input (a job the daemon knows nothing of: a mistyped id)
  is rejected (``no_such_job``) rather than creating a stopped job.
* **continue** of a ``stopped`` or ``failed`` job, naming the generation it ended in: a restore
  of the next generation to the newest committed snapshot not known bad, coordinated like an
  incident's (cause ``continued``: acknowledgements, ``restore_timeout_s``, retries), with the
  crash-loop count started afresh. It is refused, with an ``abort`` of the same generation
  (``seq`` higher, same ``outcome``) whose reason says why, when the job committed snapshots but
  none is usable (a silent restart from its initial state would discard them) or the target's
  data version is not the job's. A continue of a job already continued from that generation
  (several nodes' supervisors ask) changes nothing; any other continue of a job that is not
  stopped or failed is rejected (``not_continuable``).

Requests are screened like events first: the job, the sender's clock skew
(``max_clock_skew_s``) and duplicates (a sender's ``seq``).
"""

from __future__ import annotations

from msgspec import structs

from trainguard.daemon.core._decisions import (
    Committed,
    Decision,
    IncidentClosed,
    IncidentOpened,
    Issue,
    Rejected,
    Transition,
)
from trainguard.daemon.core._evidence import seconds_text
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._recovery import (
    _new_generation,
    _refusal,
    _restore,
    next_command_seq,
    target_text,
)
from trainguard.daemon.core._state import Incident, JobState, Loop
from trainguard.schemas import Abort, JobRequest

__all__ = ["on_request"]

_CONTINUABLE = frozenset({"stopped", "failed"})
"""Phases a ``continue`` request restarts."""

_LIVE = frozenset({"starting", "running", "restoring"})
"""Phases a ``stop`` request ends."""

_MAX_REASON = 4096
"""Longest reason a command may carry (``common.v1.json#/$defs/reason``)."""


def on_request(
    state: JobState, request: JobRequest, at_ns: int, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]]:
    """Fold one ``job-request`` observed at bus time ``at_ns`` (ns), in any phase.

    Returns:
        The new state and its decisions (module docstring); a rejected or ignored request
        returns ``state`` itself.
    """
    rejected = _screen(state, request, at_ns, config)
    if rejected is not None:
        return state, (rejected,)
    if request.kind == "stop":
        return _stop(state, request, at_ns, config)
    return _continue(state, request, at_ns, config)


def _who(request: JobRequest) -> str:
    return f"host {request.host} (pid {request.pid})"


def _screen(
    state: JobState, request: JobRequest, at_ns: int, config: MachineConfig
) -> Rejected | None:
    """Why ``request`` must not be applied at all, or ``None``."""
    what = f"{request.kind} request from {_who(request)}"
    if request.job_id != state.job_id:
        return Rejected(
            code="wrong_job", reason=f"{what} is for job {request.job_id!r}, not {state.job_id!r}"
        )
    ahead = request.ts - at_ns
    if ahead > config.max_clock_skew_ns:
        return Rejected(
            code="future_timestamp",
            reason=f"{what} is timestamped {seconds_text(ahead)} after the bus received it "
            f"(at most {seconds_text(config.max_clock_skew_ns)} allowed: max_clock_skew_s)",
        )
    last = state.senders.get((None, request.host, request.pid))
    if last is not None and request.seq <= last:
        return Rejected(
            code="duplicate",
            reason=f"duplicate: {what} has seq {request.seq}, already accepted up to seq {last}",
        )
    if request.generation > state.generation:
        return Rejected(
            code="future_generation",
            reason=f"{what} names generation {request.generation}, but the daemon has only "
            f"created up to generation {state.generation}",
        )
    return None


def _accepted(state: JobState, request: JobRequest, at_ns: int) -> JobState:
    """``state`` with the request's time and ``seq`` recorded."""
    return structs.replace(
        state,
        clock_ns=max(state.clock_ns, at_ns),
        generation_started_ns=(
            at_ns if state.generation_started_ns is None else state.generation_started_ns
        ),
        senders=state.senders.insert((None, request.host, request.pid), request.seq),
    )


def _stop(
    state: JobState, request: JobRequest, at_ns: int, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]]:
    if request.generation < state.continued_generation:
        return state, (
            Rejected(
                code="stale_generation",
                reason=f"stale stop request from {_who(request)}: it names generation "
                f"{request.generation}, but the job was continued in generation "
                f"{state.continued_generation} since",
            ),
        )
    if state.generation_started_ns is None:
        return state, (
            Rejected(
                code="no_such_job",
                reason=f"stop request from {_who(request)} for job {state.job_id!r}, of which "
                "the daemon has no input: nothing to stop (a mistyped job id?)",
            ),
        )
    late = _late(state, request)
    if state.phase not in _LIVE and not (late and state.phase == "failed"):
        return state, ()  # ended already: every signalled supervisor of the job asks
    state = _accepted(state, request, at_ns)
    generation = state.generation
    reason = (
        f"stopped on request from {_who(request)} in generation {generation}"
        f"{f': {request.reason}' if request.reason else ''}"
    )
    if late:
        reason += (
            f" (a late stop: it names generation {request.generation}, the one the ranks last "
            f"ran in, and no rank joined a restore since: their silence was this stop's"
            f"{', which the job failed for' if state.phase == 'failed' else ''})"
        )
    seq = next_command_seq(state)
    abort = Abort(
        job_id=state.job_id,
        generation=generation,
        ts=state.clock_ns,
        seq=seq,
        daemon_id=config.daemon_id,
        reason=reason[:_MAX_REASON],
        outcome="stopped",
    )
    decisions: list[Decision] = []
    left = state.left
    if late and left is not None and left.cuts:
        # The restore is void, as for a late finish: the steps the ranks completed in the
        # generation they ran in, whose shards arrived after the restore, are the job's
        # timeline after all, and a continue starts from the newest of them.
        commits = tuple(
            Committed.of(
                cut,
                f"all {len(cut.shards)} ranks reported their shard of step {cut.step} in "
                f"generation {left.generation} (data version {cut.data_version!r}) after the "
                "restore was issued; committed as a late stop voids the restore",
            )
            for cut in left.cuts
        )
        decisions.extend(commits)
        state = state.committing(tuple(c.snapshot for c in commits), config.keep_snapshots)
    decisions += [
        Transition(old=state.phase, new="stopped", generation=generation, reason=reason),
        Issue(command=abort, reason=reason),
    ]
    if state.incident is not None:
        decisions.append(
            IncidentClosed(
                incident_id=state.incident.incident_id,
                outcome="stopped",
                attempts=state.incident.attempt,
                reason=reason,
            )
        )
    if state.held is not None:  # opened while the bus settled, its restore not issued yet
        decisions.append(
            IncidentClosed(
                incident_id=state.held.incident_id, outcome="stopped", attempts=0, reason=reason
            )
        )
    stopped = structs.replace(
        state, phase="stopped", incident=None, held=None, command_seq=seq, failure=None
    )
    return stopped, tuple(decisions)


def _late(state: JobState, request: JobRequest) -> bool:
    """Whether ``request`` names the generation the ranks last ran in before a restore that
    nobody joined, nor any later attempt (``JobState.left``, ``senders`` empty): its sender
    never saw the restore, whose cause was the silence of this stop."""
    left = state.left
    return (
        left is not None
        and not state.senders
        and request.generation == left.generation < state.generation
    )


def _continue(
    state: JobState, request: JobRequest, at_ns: int, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]]:
    if state.phase not in _CONTINUABLE:
        if request.generation < state.continued_generation:
            return state, ()  # continued from that generation already (another node asked)
        return state, (
            Rejected(
                code="not_continuable",
                reason=f"continue request from {_who(request)} for generation "
                f"{request.generation}, but the job is {state.phase} in generation "
                f"{state.generation}: only a stopped or failed job can be continued",
            ),
        )
    generation = state.generation
    if request.generation != generation:
        return state, (
            Rejected(
                code="stale_generation",
                reason=f"stale continue request from {_who(request)}: it names generation "
                f"{request.generation}, but the job {state.phase} in generation {generation}",
            ),
        )
    state = _accepted(state, request, at_ns)
    target = state.restore_target()
    refused = _refusal(state, target, None, config)
    if refused is not None:
        return _refuse(state, request, refused, config)
    phase = state.phase
    number = state.incidents_opened + 1
    incident_id = f"{state.job_id}/i{number}"
    reason = (
        f"continued on request from {_who(request)} after the job {phase} in generation "
        f"{generation}{f': {request.reason}' if request.reason else ''}"
    )
    incident = Incident(
        incident_id=incident_id,
        cause="continued",
        reason=reason,
        opened_ns=state.clock_ns,
        attempt=1,
        target=target,
        issued_ns=state.clock_ns,
    )
    seq = next_command_seq(state)
    restore = _restore(state, incident, generation + 1, seq, reason, config)
    new = structs.replace(
        _new_generation(state, incident=incident, command_seq=seq, incidents=number),
        failure=None,
        loop=Loop(),
        continued_generation=generation + 1,
    )
    return new, (
        Transition(old=phase, new="restoring", generation=generation + 1, reason=reason),
        IncidentOpened(
            incident_id=incident_id,
            cause="continued",
            generation=generation,
            ranks=(),
            hosts=(request.host,),
            reason=reason,
        ),
        Issue(
            command=restore,
            reason=f"incident {incident_id} attempt 1: restore {target_text(target)} in "
            f"generation {generation + 1}",
        ),
    )


def _refuse(
    state: JobState, request: JobRequest, why: str, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]]:
    """Answer a ``continue`` the job cannot take with an ``abort`` of its generation again."""
    reason = f"continue request from {_who(request)} refused: {why}; the job stays {state.phase}"
    seq = next_command_seq(state)
    abort = Abort(
        job_id=state.job_id,
        generation=state.generation,
        ts=state.clock_ns,
        seq=seq,
        daemon_id=config.daemon_id,
        reason=reason[:_MAX_REASON],
        outcome="stopped" if state.phase == "stopped" else "failed",
    )
    return structs.replace(state, command_seq=seq), (Issue(command=abort, reason=reason),)
