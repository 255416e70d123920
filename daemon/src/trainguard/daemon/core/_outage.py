"""A bus outage is not a failure: time stops across a gap in a job's inputs.

While the bus and the daemon work, a live job's inputs are dense in bus time: its ranks
heartbeat, and the daemon appends a tick for every quiet job at least every ``pulse_s``. So
two consecutive inputs further apart than ``MachineConfig.bus_gap_s`` mean that nothing could
be appended in between: the bus, or the daemon that writes the ticks, was away. What the ranks
sent meanwhile arrives after the gap, in a burst, with the bus time of its return; judged
against the clock before the gap, every rank would look silent or stalled at once.

The rule (:func:`bridge`, pure, applied by :func:`trainguard.daemon.core._machine.decide` to the
first event or tick after such a gap): every time the detectors measure from moves forward by
the gap, so no duration the machine judges includes it, and the bus *settles* for
``outage_settle_s`` from the gap's end (``JobState.settle_until_ns``). A failure found while
it settles opens its incident but holds its restore until then (``JobState.held``,
:mod:`trainguard.daemon.core._recovery`): the checkpoints the ranks made during the outage commit
first and become the target. The gap is measured on the job's own inputs, which the log holds,
so a replay of the log decides the same (``docs/detection.md``, "Bus outages").

A job that finished while the bus was away can still be taken for a failed one: its ranks'
``finished`` reports may reach the bus only after the settle deadline issued a restore (their
supervisor was signalled while it waited for the bus, and the next one forwards them later).
The rule of :func:`late_finish`: while nobody has joined the restore's generation, a
``finished`` of the generation the ranks last ran in (``JobState.left``) is no stale event;
once every rank of that generation has finished, the job is finished and the restore void,
and the steps of that generation whose shards arrived in the same burst, held meanwhile
(:func:`trainguard.daemon.core._commit_rule.late_shard`), commit (``docs/recovery.md``, "A job that
finished is never restored").
"""

from __future__ import annotations

from dataclasses import replace

from msgspec import structs
from rpds import HashTrieMap

from trainguard.daemon.core._decisions import (
    Anomaly,
    Committed,
    Decision,
    IncidentClosed,
    Transition,
)
from trainguard.daemon.core._evidence import Measures, ranks_text, seconds_text
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import JobState, RankState, unjoined
from trainguard.schemas import Lifecycle

__all__ = ["bridge", "bridged_ns", "bus_settling", "gap_ns", "late_finish", "settling"]

_NS_PER_S = 1_000_000_000


def gap_ns(state: JobState, at_ns: int, config: MachineConfig) -> int | None:
    """How far ``at_ns`` (ns) lies after the job's clock when that is more than ``bus_gap_s``
    (an outage), else ``None``; also ``None`` before the job's first input."""
    if state.generation_started_ns is None:
        return None
    gap = at_ns - state.clock_ns
    return gap if gap > config.bus_gap_ns else None


def bus_settling(state: JobState, config: MachineConfig) -> bool:
    """Whether the job's clock is within ``outage_settle_s`` after the end of its latest gap
    (whatever else holds a restore meanwhile)."""
    gap = state.last_gap
    return gap is not None and state.clock_ns < gap[1] + config.outage_settle_ns


def settling(state: JobState) -> bool:
    """Whether the bus is still settling after a gap at the job's clock: a failure found now
    holds its restore until ``settle_until_ns``."""
    until = state.settle_until_ns
    return until is not None and state.clock_ns < until


def bridge(
    state: JobState, at_ns: int, gap: int, config: MachineConfig
) -> tuple[JobState, Anomaly]:
    """Stop time across a gap of ``gap`` ns ending at ``at_ns`` (the first input after it).

    Every daemon-clock time the detectors count from moves forward by ``gap``: each rank's
    ``last_heard_ns``, ``step_advanced_ns``, ``step_done_ns`` and ``phase_since_ns``; the
    silence floor; the
    generation's start; the stall bound, the end of the last declared phase and the tick that
    showed the latest command (``Watch``); an open incident's ``issued_ns``. The clock itself
    moves to ``at_ns`` with the input, as always. Times that record what happened
    (``Incident.opened_ns``, manifests' ``ts``) and delays (``RankState.delay_floor_ns``, ``late_ns``) stay.
    The bus settles until ``at_ns + outage_settle_s``. The gap is kept (``JobState.last_gap``)
    for the times the ranks' later records state (:func:`bridged_ns`).

    Returns:
        The bridged state (its clock still before the gap) and the ``bus_gap`` anomaly that
        records it, with ``from_ns`` and ``to_ns`` (bus times, ns) and ``gap_s``.
    """
    ranks = HashTrieMap((r, _shifted_rank(rec, gap)) for r, rec in state.ranks.items())
    watch = state.watch
    due = watch.progress_due_ns
    watch = watch._replace(
        progress_due_ns=None if due is None else due + gap,
        long_phase_ended_ns=_later(watch.long_phase_ended_ns, gap),
        acted_ns=_later(watch.acted_ns, gap),
    )
    incident = state.incident
    if incident is not None:
        incident = replace(incident, issued_ns=incident.issued_ns + gap)
    floor, started = state.silence_floor_ns, state.generation_started_ns
    settle_until = at_ns + config.outage_settle_ns
    bridged = structs.replace(
        state,
        ranks=ranks,
        watch=watch,
        incident=incident,
        silence_floor_ns=None if floor is None else floor + gap,
        generation_started_ns=None if started is None else started + gap,
        settle_until_ns=settle_until,
        last_gap=(state.clock_ns, at_ns),
    )
    held = (
        f"; restores held until the bus has settled ({seconds_text(config.outage_settle_ns)}, "
        f"outage_settle_s)"
        if config.outage_settle_ns
        else ""
    )
    anomaly = Anomaly(
        kind="bus_gap",
        reason=f"no input of the job for {seconds_text(gap)} of bus time (more than bus_gap_s "
        f"{seconds_text(config.bus_gap_ns)}) in generation {state.generation}: the bus or the "
        f"daemon was away; timeouts do not count the gap{held}",
        measures=Measures(
            gap_s=gap / _NS_PER_S,
            from_ns=state.clock_ns,
            to_ns=at_ns,
            settle_until_ns=settle_until,
        ),
    )
    return bridged, anomaly


def _shifted_rank(rec: RankState, gap: int) -> RankState:
    advanced, done = rec.step_advanced_ns, rec.step_done_ns
    return structs.replace(
        rec,
        last_heard_ns=rec.last_heard_ns + gap,
        step_advanced_ns=None if advanced is None else advanced + gap,
        phase_since_ns=rec.phase_since_ns + gap,
        step_done_ns=None if done is None else done + gap,
    )


def bridged_ns(last_gap: tuple[int, int] | None, at_ns: int) -> int:
    """The bus time ``at_ns`` (ns) at which a rank's record says it did something (sent it,
    completed a step) on the machine's clock, which stopped across the job's latest gap
    ``last_gap`` (``JobState.last_gap``): a time during the gap is its end, a time before it
    moves forward by its length, a later time stays.

    Such a time may lie before the gap although the record came after it: what the ranks did
    while the bus was away (or in flight when it left) arrives when it returns, and their
    records, dated so, compare with the times the machine holds, which the gap moved. A time
    before an earlier gap moves by the latest gap only (earlier than on the machine's clock).
    """
    if last_gap is None:
        return at_ns
    start, end = last_gap
    if at_ns >= end:
        return at_ns
    return end if at_ns >= start else at_ns + (end - start)


def _later(at_ns: int, gap: int) -> int:
    """``at_ns`` moved by ``gap``; 0 (never) stays 0."""
    return at_ns + gap if at_ns else 0


def late_finish(
    state: JobState, event: Lifecycle, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]] | None:
    """Judge a ``finished`` of an older generation than the job's (otherwise a stale event).

    It counts when the job is ``restoring``, no event of the current generation has been
    accepted (``senders`` empty: no process joined the restore), and it is a rank's
    ``finished`` of the generation the ranks last ran in (``JobState.left``), not counted yet.
    Then the rank is recorded as finished in that generation (a ``late_finish`` anomaly says
    so); once all ``world_size`` ranks of it are, unless the restore's incident has an onset
    step (a divergence: ``nan_loss``, ``loss_spike``, ``checksum_mismatch``; the ranks
    finished a suspect state, and the anomaly says the restore stands), the job is
    ``finished``: the restore is void, the steps of that generation whose shards completed
    after the restore
    (``Left.cuts``, :func:`trainguard.daemon.core._commit_rule.late_shard`) are committed, oldest
    first (a ``Committed`` each, ``keep_snapshots`` kept), its incident closes with outcome
    ``finished``, and no command is issued (the restore's ranks never joined; a supervisor
    that rejoins finds the same on the log). The clock is the caller's to move, as for any
    input.

    Returns:
        The new state and its decisions, or ``None`` when the rule does not apply (the event
        is then stale, as before).
    """
    pending_restore = unjoined(state, event.generation, event.rank)
    if (
        pending_restore is None
        or event.kind != "finished"
        or event.rank is None  # a rank's, as unjoined checked: for the type checker
        or event.rank in pending_restore.left.finished
    ):
        return None
    left, incident, world_size, restore = pending_restore
    finished = tuple(sorted((*left.finished, event.rank)))
    state = structs.replace(state, left=left._replace(finished=finished))
    reason = (
        f"rank {event.rank} on host {event.host} (pid {event.pid}) reported finished "
        f"in generation {left.generation} after {restore} was issued, before any rank joined "
        f"it: {len(finished)} of {world_size} ranks of generation {left.generation} finished"
    )
    onset = incident.onset_after_step
    if onset is not None:
        # A divergence: the ranks finished a suspect state, so their finish voids nothing.
        reason += (
            f", with parameters known sound only up to step {onset} ({incident.cause}): the "
            "restore stands"
        )
    noted = Anomaly(kind="late_finish", reason=reason)
    if len(finished) < world_size or onset is not None:
        return state, (noted,)
    reason = (
        f"all {world_size} ranks finished in generation {left.generation}, the last "
        f"({ranks_text(finished[-1:])}) after {restore} was issued and before any rank joined "
        f"it: the job is finished and the restore void"
    )
    # The generation the ranks finished in is the job's timeline after all: the steps it
    # completed after the restore commit now, as they would have without the outage.
    committed = tuple(
        Committed.of(
            cut,
            f"all {world_size} ranks reported their shard of step {cut.step} in "
            f"generation {left.generation} (data version {cut.data_version!r}) after {restore} "
            f"was issued; committed as the restore is void",
        )
        for cut in left.cuts
    )
    state = state.committing(tuple(c.snapshot for c in committed), config.keep_snapshots)
    return structs.replace(state, phase="finished", incident=None, held=None), (
        noted,
        *committed,
        Transition(old="restoring", new="finished", generation=state.generation, reason=reason),
        IncidentClosed(
            incident_id=incident.incident_id,
            outcome="finished",
            attempts=incident.attempt,
            reason=reason,
        ),
    )
