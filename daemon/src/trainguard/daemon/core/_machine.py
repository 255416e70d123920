"""The per-job state machine: ``decide(state, input, config) -> (state', decisions)``.

Pure (ARCHITECTURE.md section 4): no I/O, no clock reads, no randomness, no logging. Time enters
only through the inputs' ``at_ns``; the shell acts on the returned decisions (publishes commands
and manifests, logs reasons, writes the audit trail).

Order of work for an observed event:

1. in a ``finished``, ``failed`` or ``stopped`` job, change nothing (the state is final);
2. screen it (wrong job, stale or future generation, duplicate ``seq``, world-size conflict,
   rank out of range): a rejected event leaves the state untouched and yields one
   :class:`Rejected` (but a ``finished`` or a checkpoint shard of the generation a restore
   nobody joined yet left, which :func:`~trainguard.daemon.core._outage.late_finish` and
   :func:`~trainguard.daemon.core._commit_rule.late_shard` judge);
3. when it ends a gap of more than ``bus_gap_s`` in the job's inputs (the bus or the daemon
   was away), stop time across the gap (:mod:`trainguard.daemon.core._outage`); then fold it (one
   handler per event type, running the detectors that event feeds), then settle
   phase changes it completes (all ranks heard, all restores acknowledged, and acknowledged
   as ordered, all ranks finished);
4. check the deadlines (heartbeat silence, stalls, startup, restore) at the new clock, or,
   while a restore is held after a gap, only whether the bus has settled (then issue it).

A :class:`Tick` runs steps 1, the gap rule of 3, and 4 only, after noting the command it shows on the bus
(``Tick.command_seq``): a timeout that starts with one of the daemon's own commands counts from
the first tick naming it, never from the input that decided it (a daemon catching up on a
backlog decides from old inputs but acts now). A :class:`~trainguard.schemas.JobRequest` (stop
or continue the job) is folded by :mod:`trainguard.daemon.core._stop` in any phase, also a final one.
A :class:`~trainguard.schemas.HeartbeatBatch` (a node's heartbeats in one record) is folded as
the heartbeats it carries, each as if it had come alone at the batch's append time
(:func:`_on_batch`), so a batched job is judged exactly as an unbatched one; but a batch the
bus delivered again is refused whole by its own ``seq``, and a heartbeat that a newer direct
event of its rank overtook on the way is stale, skipped without a rejection.
Recovery (incidents, restore retries, abort) lives in :mod:`trainguard.daemon.core._recovery`; the
detectors in :mod:`trainguard.daemon.core.detectors._stall` and
:mod:`trainguard.daemon.core.detectors._divergence` (``docs/detection.md`` tabulates them).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from typing import assert_never

from msgspec import structs
from rpds import HashTrieMap

from trainguard.daemon.core._commit_rule import commit, disagreement, late_shard, note_position
from trainguard.daemon.core._decisions import (
    Anomaly,
    Committed,
    Decision,
    IncidentClosed,
    Issue,
    RejectCode,
    Rejected,
    Transition,
)
from trainguard.daemon.core._evidence import (
    Measures,
    exit_status,
    hosts_text,
    ranks_text,
    said_text,
    seconds_text,
    steps_text,
)
from trainguard.daemon.core._inputs import Input, Observed, Tick
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._outage import (
    bridge,
    bridged_ns,
    bus_settling,
    gap_ns,
    late_finish,
    settling,
)
from trainguard.daemon.core._recovery import (
    Failure,
    acknowledged,
    cut_arrived,
    fail_now,
    fail_over,
    fail_unrepairable,
    finished_before_reload,
    give_up,
    next_command_seq,
    release,
    target_text,
    wrong_acks_text,
)
from trainguard.daemon.core._state import (
    LONG_PHASES,
    TERMINAL_PHASES,
    Ack,
    JobState,
    RankState,
    RankStatus,
    Sender,
)
from trainguard.daemon.core._stop import on_request
from trainguard.daemon.core.detectors._divergence import (
    judge_checksum,
    judge_lag,
    judge_loss,
    nan_loss,
    note_data_version,
)
from trainguard.daemon.core.detectors._stall import (
    least_deadline_ns,
    lower_due,
    rank_changed,
    scan_stalls,
    straggler,
    warm,
)
from trainguard.daemon.core.detectors._trend import advance
from trainguard.schemas import (
    EXIT_CONFIG,
    BatchedBeat,
    Checkpoint,
    DataCursorEvent,
    Event,
    Heartbeat,
    HeartbeatBatch,
    JobRequest,
    Lifecycle,
    Resume,
)

Decisions = tuple[Decision, ...]
_NONE: Decisions = ()


def decide(state: JobState, item: Input, config: MachineConfig) -> tuple[JobState, Decisions]:
    """Fold one input into a job's state.

    Args:
        state: the job's state before ``item``.
        item: an observed event of this job, or a clock tick.
        config: thresholds and the daemon's identity.

    Returns:
        The new state and the decisions taken, in the order the shell must act on them. A
        rejected event returns ``state`` itself and one :class:`Rejected`; a ``finished``,
        ``failed`` or ``stopped`` job returns ``state`` itself and no decision (but a
        :class:`Rejected` for an event of another job, and what a job request decides).

    Folding a heartbeat costs O(log32 n) in the number of ranks n (persistent maps), plus an
    amortised O(1) share of the occasional scans for silent, stalled or lagging ranks (see
    ``JobState.silence_floor_ns`` and ``Watch``) and of the statistics recomputed once per
    chunk of samples (:mod:`trainguard.daemon.core._window`).
    """
    if state.phase in TERMINAL_PHASES:
        return _at_rest(state, item, config)
    match item:
        case Observed(at_ns=at_ns, event=event):
            if isinstance(event, JobRequest):
                return on_request(state, event, at_ns, config)
            if isinstance(event, HeartbeatBatch):
                return _on_batch(state, event, item, config)
            broken = _broken_rule(state, event, at_ns, config)
            if (
                broken is None
                and type(event) is Heartbeat
                and state.world_size_generation == state.generation
            ):
                # The hot path: a heartbeat of the generation's stated world size (the rules
                # held, so it states that one). Its handler records time and seq itself,
                # sparing a copy of the state.
                state, bridged = _bridged(state, at_ns, config)
                sender = (event.rank, event.host, event.pid)
                state, decisions = _on_heartbeat(state, event, at_ns, sender, config)
                return _settled(state, config, bridged + decisions if bridged else decisions)
            if broken is not None:
                rejected = _rejection(state, event, at_ns, config, broken)
                if rejected.code == "stale_generation" and isinstance(
                    event, Lifecycle | Checkpoint
                ):
                    return _late(state, event, at_ns, config) or (state, (rejected,))
                return state, (rejected,)
            state, bridged = _bridged(state, at_ns, config)
            state = _accept(state, event, at_ns)
            state, decisions = _handle(state, event, config)
            return _settled(state, config, bridged + decisions if bridged else decisions)
        case Tick(at_ns=at_ns, command_seq=command_seq):
            state, bridged = _bridged(state, at_ns, config)
            state = _advance(state, at_ns)
            if command_seq is not None:
                state = _acted(state, command_seq, config)
            return _expire(state, config, bridged)
        case _:
            assert_never(item)


def _on_batch(
    state: JobState, batch: HeartbeatBatch, item: Observed, config: MachineConfig
) -> tuple[JobState, Decisions]:
    """Fold a node's batch of heartbeats: each entry as :func:`decide` folds the heartbeat of
    its rank observed alone at the batch's append time and offset, so that state and
    decisions are those of the heartbeats sent one by one, but for two rules of the batch
    record itself.

    * A batch whose ``seq`` is not above the highest of its supervisor's batches a heartbeat
      of which was folded in this generation (``JobState.relays``) is one the bus delivered
      again: one ``duplicate`` :class:`Rejected`, the state unchanged. Otherwise, once one of
      its heartbeats is folded, its ``seq`` becomes that highest.
    * In a batch that is not such a duplicate, an entry whose ``seq`` is not above the last
      one accepted from its rank's process is *stale*, not duplicate: the process's newer
      event, sent directly and sharing its counter, overtook the relay (the two ways to the
      bus are not ordered). It is skipped: no decision, no change of state.

    An entry that takes decide's hot path (a running generation's heartbeat that breaks no
    admission rule) is folded as it is, without building its
    :class:`~trainguard.schemas.Heartbeat`; any other goes through :func:`decide` as that
    heartbeat. The entries' rejections become one :class:`Rejected`, so the record is
    dead-lettered once; every other decision keeps its order."""
    if batch.job_id != state.job_id:
        return state, (_wrong_job(state, batch),)
    at_ns, host = item.at_ns, batch.host
    relay = (host, batch.pid)
    last = state.relays.get(relay)
    if last is not None and batch.seq <= last:
        reason = (
            f"duplicate: {_sender(batch)} has seq {batch.seq}, already accepted up to seq {last}"
        )
        return state, (Rejected(code="duplicate", reason=reason),)
    decisions: list[Decision] = []
    refused: list[Rejected] = []
    folded = False
    for beat in batch.beats:
        sender = (beat.rank, host, beat.pid)
        broken = _broken_sender_rule(state, beat, sender, at_ns, config)
        if broken == "duplicate":
            continue  # stale (docstring)
        if (
            broken is None
            and state.phase not in TERMINAL_PHASES
            and state.world_size_generation == state.generation
        ):
            state, bridged = _bridged(state, at_ns, config)
            state, decided = _on_heartbeat(state, beat, at_ns, sender, config)
            state, decided = _settled(state, config, bridged + decided if bridged else decided)
        else:
            state, decided = decide(state, item._replace(event=batch.heartbeat(beat)), config)
        kept = len(refused)
        for decision in decided:
            if type(decision) is Rejected:
                refused.append(decision)
            else:
                decisions.append(decision)
        folded = folded or len(refused) == kept  # a heartbeat not rejected was folded
    if folded:
        state = structs.replace(state, relays=state.relays.insert(relay, batch.seq))
    if refused:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        decisions.append(
            Rejected(
                code=refused[0].code,
                reason=f"{len(refused)} of {len(batch.beats)} heartbeats of the batch from host "
                f"{batch.host} (pid {batch.pid}) refused: {refused[0].reason}{more}",
            )
        )
    return state, tuple(decisions)


def _bridged(state: JobState, at_ns: int, config: MachineConfig) -> tuple[JobState, Decisions]:
    """Step 0 of an accepted event or a tick: when ``at_ns`` ends a gap in the job's inputs
    longer than ``bus_gap_s`` (an outage), stop time across it (:mod:`._outage`)."""
    gap = gap_ns(state, at_ns, config)
    if gap is None:
        return state, _NONE
    state, anomaly = bridge(state, at_ns, gap, config)
    return state, (anomaly,)


def _late(
    state: JobState, event: Lifecycle | Checkpoint, at_ns: int, config: MachineConfig
) -> tuple[JobState, Decisions] | None:
    """A ``finished`` (:func:`late_finish`) or a checkpoint shard (:func:`late_shard`) of the
    generation a restore nobody joined left, taken in like a tick (gap rule, clock,
    deadlines), or ``None``: the event is stale."""
    bridged_state, bridged = _bridged(state, at_ns, config)
    moved = _advance(bridged_state, at_ns)
    judged = (
        late_shard(moved, event, config)
        if isinstance(event, Checkpoint)
        else late_finish(moved, event, config)
    )
    if judged is None:
        return None
    state, decisions = judged
    if isinstance(event, Lifecycle):
        state, missed = finished_before_reload(state, event, config)
        decisions += missed
    return _expire(state, config, bridged + decisions)


def _settled(
    state: JobState, config: MachineConfig, decisions: Decisions
) -> tuple[JobState, Decisions]:
    """Steps 3 (the phase changes the event completes) and 4 (deadlines) after an event's
    handler; a running job with no deadline passed, the common case, returns at once."""
    if state.phase == "running" and state.finished_ranks != state.world_size and state.held is None:
        floor, due, clock = state.silence_floor_ns, state.watch.progress_due_ns, state.clock_ns
        if (floor is None or clock <= floor + config.heartbeat_timeout_ns) and (
            due is None or clock <= due
        ):
            return state, decisions
    state, settled = _settle(state, config)
    return _expire(state, config, decisions + settled if settled else decisions)


def fold(
    state: JobState, items: Iterable[Input], config: MachineConfig
) -> tuple[JobState, Decisions]:
    """Fold ``items`` in order with :func:`decide`; return the last state and every decision.

    The same state, inputs and config give the same result (replay, what-if runs).
    """
    collected: list[Decision] = []
    for item in items:
        state, decisions = decide(state, item, config)
        collected.extend(decisions)
    return state, tuple(collected)


def next_deadline(state: JobState, config: MachineConfig) -> int | None:
    """The earliest clock (ns) at which a :class:`Tick` could decide something, or ``None``.

    A lower bound: a tick at that time may find nothing due (a silent rank spoke meanwhile) and
    only move the bound forward; call again after every :func:`decide`.
    """
    if state.phase in TERMINAL_PHASES:
        return None
    if state.held is not None and state.settle_until_ns is not None:
        return state.settle_until_ns  # when the held restore is issued; nothing is judged before
    due: list[int] = []
    if state.silence_floor_ns is not None:
        due.append(state.silence_floor_ns + config.heartbeat_timeout_ns + 1)
    if state.phase == "starting" and state.generation_started_ns is not None:
        due.append(state.generation_started_ns + config.startup_timeout_ns + 1)
    if state.phase == "restoring" and state.incident is not None and _restore_acted(state):
        due.append(state.watch.acted_ns + config.restore_timeout_ns + 1)
    if state.phase == "running" and state.watch.progress_due_ns is not None:
        due.append(state.watch.progress_due_ns + 1)
    return min(due, default=None)


def unacted_command(state: JobState) -> int | None:
    """The ``seq`` of the job's latest command while no tick has shown it on the bus yet
    (``Tick.command_seq``), else ``None``.

    The timeouts that start with a command (a restore's; after a resume, the ranks' stall
    deadlines) wait for such a tick: the shell appends one to the job's events as soon as the
    command is published, and again after a restart that finds it missing.
    """
    if state.phase in TERMINAL_PHASES or state.watch.acted_seq >= state.command_seq:
        return None
    return state.command_seq


def _acted(state: JobState, command_seq: int, config: MachineConfig) -> JobState:
    """Note that the job's commands up to ``command_seq`` are on the bus at the current clock
    (a tick said so); a ``seq`` the machine has not issued counts as its latest one."""
    watch = state.watch
    seq = min(command_seq, state.command_seq)
    if seq <= watch.acted_seq:
        return state
    clock = state.clock_ns
    watch = watch._replace(acted_seq=seq, acted_ns=clock)
    if watch.held and seq >= state.command_seq:
        # The resume is out: the ranks' deadlines start now, none earlier than the shortest.
        watch = lower_due(watch._replace(held=False), clock + least_deadline_ns(config))
    return structs.replace(state, watch=watch)


def _restore_acted(state: JobState) -> bool:
    """Whether a tick has shown the current restore (the latest command while restoring) on
    the bus: its timeout runs from then."""
    return state.watch.acted_seq >= state.command_seq


def _at_rest(state: JobState, item: Input, config: MachineConfig) -> tuple[JobState, Decisions]:
    """A ``finished``, ``failed`` or ``stopped`` job is final: its state no longer changes, but
    for a job request (a ``continue``), and only an event for another job (a routing fault) is
    worth a decision."""
    if isinstance(item, Observed):
        event = item.event
        if isinstance(event, JobRequest):
            return on_request(state, event, item.at_ns, config)
        if event.job_id != state.job_id:
            return state, (_wrong_job(state, event),)
    return state, _NONE


def _advance(state: JobState, at_ns: int) -> JobState:
    """Move the clock to ``at_ns`` unless that is in its past; start generation 0's clock."""
    if at_ns <= state.clock_ns and state.generation_started_ns is not None:
        return state
    clock = max(state.clock_ns, at_ns)
    started = clock if state.generation_started_ns is None else state.generation_started_ns
    return structs.replace(state, clock_ns=clock, generation_started_ns=started)


def _stated_world_size(event: Event | BatchedBeat) -> int | None:
    """The world size ``event`` states, if its type carries one."""
    if isinstance(event, DataCursorEvent):
        return None
    return event.world_size


def _broken_rule(
    state: JobState, event: Event, at_ns: int, config: MachineConfig
) -> RejectCode | None:
    """The first rule ``event`` breaks, in the order below, or ``None`` when it may be applied
    to ``state``: the one place the admission rules are written (:func:`_rejection` words
    them). Cheap when every rule holds, since every event pays for it.

    1. ``wrong_job``: the event is for another job.
    2. ``stale_generation``, ``future_generation``: it is not of the job's generation.
    3. ``duplicate``: its ``seq`` is not above the last one accepted from its sender.
    4. ``world_size_conflict``: it states a world size other than the one the generation
       already stated.
    5. ``rank_out_of_range``: a rank it names is outside the world size it states (else the
       job's).
    6. ``future_timestamp``: it is timestamped more than ``max_clock_skew_s`` after its bus
       append time ``at_ns`` (ns).
    """
    if event.job_id != state.job_id:
        return "wrong_job"
    return _broken_sender_rule(state, event, (event.rank, event.host, event.pid), at_ns, config)


def _broken_sender_rule(
    state: JobState,
    event: Event | BatchedBeat,
    sender: Sender,
    at_ns: int,
    config: MachineConfig,
) -> RejectCode | None:
    """Rules 2-6 of :func:`_broken_rule` for ``event`` of ``sender`` (an event of the job, or
    an entry of one of its heartbeat batches, whose sender names the batch's host)."""
    if event.generation != state.generation:
        return "stale_generation" if event.generation < state.generation else "future_generation"
    last = state.senders.get(sender)
    if last is not None and event.seq <= last:
        return "duplicate"
    stated = _stated_world_size(event)
    if (
        stated is not None
        and stated != state.world_size
        and state.world_size_generation == state.generation
    ):
        return "world_size_conflict"
    if _outside(state, event, stated):
        return "rank_out_of_range"
    if event.ts - at_ns > config.max_clock_skew_ns:
        return "future_timestamp"
    return None


def _outside(state: JobState, event: Event | BatchedBeat, stated: int | None) -> list[int]:
    """The ranks ``event`` names (its sender's, or a supervisor's group) outside the world size
    it states, else the job's (when known)."""
    bound = stated if stated is not None else state.world_size
    rank = event.rank
    if rank is not None:  # a worker's event: the common case, without building a list
        if rank >= 0 and (bound is None or rank < bound):
            return []
        return [rank]
    return [r for r in _group_ranks(event) if r < 0 or (bound is not None and r >= bound)]


def _rejection(
    state: JobState, event: Event, at_ns: int, config: MachineConfig, code: RejectCode
) -> Rejected:
    """The rejection of ``event`` for the rule ``code`` of :func:`_broken_rule` it broke, its
    reason naming the evidence."""
    if code == "wrong_job":
        return _wrong_job(state, event)
    if code == "stale_generation":
        reason = (
            f"stale generation: {_sender(event)} is of generation {event.generation}, "
            f"the job is in generation {state.generation}"
        )
    elif code == "future_generation":
        reason = (
            f"{_sender(event)} claims generation {event.generation}, but the daemon has "
            f"only created up to generation {state.generation}"
        )
    elif code == "duplicate":
        last = state.senders.get((event.rank, event.host, event.pid))
        reason = (
            f"duplicate: {_sender(event)} has seq {event.seq}, already accepted up to seq {last}"
        )
    elif code == "world_size_conflict":
        reason = (
            f"{_sender(event)} states world size {_stated_world_size(event)}, but generation "
            f"{state.generation} runs with world size {state.world_size}"
        )
    elif code == "rank_out_of_range":
        stated = _stated_world_size(event)
        bound = stated if stated is not None else state.world_size
        outside = _outside(state, event, stated)
        reason = f"{_sender(event)} names {ranks_text(outside)}, outside world size {bound}"
    else:
        reason = (
            f"{_sender(event)} is timestamped {seconds_text(event.ts - at_ns)} after the bus "
            f"received it (at most {seconds_text(config.max_clock_skew_ns)} allowed: "
            "max_clock_skew_s)"
        )
    return Rejected(code=code, reason=reason)


def _wrong_job(state: JobState, event: Event | HeartbeatBatch) -> Rejected:
    return Rejected(
        code="wrong_job",
        reason=f"{_sender(event)} is for job {event.job_id!r}, not {state.job_id!r}",
    )


def _sender(event: Event | HeartbeatBatch) -> str:
    """``"Heartbeat from rank 1 on host h0 (pid 42)"``: an event named for a reason."""
    who = "supervisor" if event.rank is None else f"rank {event.rank}"
    return f"{type(event).__name__} from {who} on host {event.host} (pid {event.pid})"


def _group_ranks(event: Event | BatchedBeat) -> tuple[int, ...]:
    """The ranks a supervisor's event speaks for (only lifecycle events have them)."""
    return event.ranks if isinstance(event, Lifecycle) else ()


def _accept(state: JobState, event: Event, at_ns: int) -> JobState:
    """Record a screened event's time, ``seq`` and stated world size."""
    clock = max(state.clock_ns, at_ns)
    started = clock if state.generation_started_ns is None else state.generation_started_ns
    senders = state.senders.insert((event.rank, event.host, event.pid), event.seq)
    stated = _stated_world_size(event)
    if stated is None or (
        stated == state.world_size and state.world_size_generation == state.generation
    ):
        return structs.replace(
            state, clock_ns=clock, generation_started_ns=started, senders=senders
        )
    # First statement of the world size in this generation: it may differ from the one carried
    # over from the previous generation; ranks heard from beyond it no longer exist.
    ranks, incident, watch = state.ranks, state.incident, state.watch
    if any(r >= stated for r in ranks):
        ranks = HashTrieMap((r, s) for r, s in ranks.items() if r < stated)
        if incident is not None:
            incident = replace(
                incident, acks=HashTrieMap((r, a) for r, a in incident.acks.items() if r < stated)
            )
        versions = Counter(s.data_version for s in ranks.values() if s.data_version is not None)
        watch = watch._replace(
            long_phases=sum(
                1 for s in ranks.values() if s.status == "alive" and s.phase in LONG_PHASES
            ),
            versions=HashTrieMap(versions.items()),
        )
    return structs.replace(
        state,
        clock_ns=clock,
        generation_started_ns=started,
        senders=senders,
        world_size=stated,
        world_size_generation=state.generation,
        ranks=ranks,
        finished_ranks=sum(1 for s in ranks.values() if s.status == "finished"),
        incident=incident,
        watch=watch,
    )


def _handle(state: JobState, event: Event, config: MachineConfig) -> tuple[JobState, Decisions]:
    """Fold an accepted event by its type."""
    match event:
        case Heartbeat():
            # _accept recorded the seq: the handler's insert of the same is harmless.
            sender = (event.rank, event.host, event.pid)
            return _on_heartbeat(state, event, state.clock_ns, sender, config)
        case Checkpoint():
            return _on_checkpoint(state, event, config)
        case DataCursorEvent():
            return _on_data_cursor(state, event, config)
        case Lifecycle():
            return _on_lifecycle(state, event, config)
        case _:
            assert_never(event)


def _on_heartbeat(
    state: JobState,
    beat: Heartbeat | BatchedBeat,
    at_ns: int,
    sender: Sender,
    config: MachineConfig,
) -> tuple[JobState, Decisions]:
    """Fold a heartbeat: the rank's record, and in a running job the detectors it feeds (the hot
    path: O(log32 n) for the maps, O(1) amortised for the rest).

    A training heartbeat that raises the generation's highest step is a *lead sample*: its
    step time (unless the rank is in its start-up steps or just left a declared phase) joins
    the job's step times and its loss is judged for spikes; one sample per observed step,
    whatever the number of ranks. Every heartbeat is checked for a non-finite loss, for
    stragglers and, with a ``param_checksum``, against its replicas; every training heartbeat
    for step lag. A heartbeat in phase ``init`` reports where the rank will start (0 before its
    ``ready()``), not a step it trained: it sets the rank's first step and raises nothing.

    ``at_ns`` is the heartbeat's time; it is recorded here with its ``seq`` (as
    :func:`_accept` does for other events), so that folding a heartbeat copies the state once.
    ``sender`` is its ``(rank, host, pid)`` (an entry of a heartbeat batch names no host: the
    batch's).
    """
    clock = at_ns if at_ns > state.clock_ns else state.clock_ns
    started = clock if state.generation_started_ns is None else state.generation_started_ns
    step, rank, host, phase = beat.step, beat.rank, sender[1], beat.phase
    watch, trend = state.watch, state.trend
    running = state.phase == "running"
    training = phase != "init"
    prev = state.ranks.get(rank)
    decisions: Decisions = _NONE
    sampled = advanced = False
    # Its delay from the sender's clock to the bus's: the least one is the sender's clock
    # offset plus its quickest delivery, the excess how late this heartbeat is.
    delay = at_ns - beat.ts
    late = behind = prev_late = 0
    if prev is None or prev.step is None:
        rec = RankState(
            rank=rank,
            host=host,
            pid=beat.pid,
            status="alive" if prev is None else prev.status,
            phase=phase,
            last_heard_ns=clock,
            step=step,
            step_advanced_ns=clock,
            phase_since_ns=clock,
            first_step=step,
            after_phase=phase in LONG_PHASES,
            data_version=None if prev is None else prev.data_version,
            delay_floor_ns=delay,
            step_done_ns=clock,
        )
    else:
        first, delay_floor, done_ns = prev.first_step, prev.delay_floor_ns, prev.step_done_ns
        prev_late = prev.late_ns
        advanced = step > prev.step
        if first is None or not training:
            first = step  # in init: where the rank will start from
        if delay_floor is None or delay < delay_floor or prev.pid != beat.pid:
            delay_floor = delay
        late = delay - delay_floor
        # As late on the machine's clock, which stopped across the job's latest gap.
        behind = clock - bridged_ns(state.last_gap, clock - late) if late else 0
        advanced_ns = prev.step_advanced_ns
        if advanced:
            # The step completed step_age_s before the heartbeat was built: its deadline
            # counts from then as the bus clock shows it (late by the delivery), but not
            # before the rank last spoke (a heartbeat that waited in the agent's queue gives
            # the ones behind it time to arrive).
            age_ns = 0 if beat.step_age_s is None else round(beat.step_age_s * 1e9)
            advanced_ns = (
                clock if beat.step_age_s is None else max(clock - age_ns, prev.last_heard_ns)
            )
            # When the rank stopped, to compare with the others: as it dates it, however long
            # the heartbeat waited (its lateness), on the clock that stopped across a gap.
            done_ns = max(bridged_ns(state.last_gap, clock - late - age_ns), done_ns or 0)
        seconds = beat.step_time_s
        # The step time spans everything since the rank's previous step: not a sample of the
        # job's pace if that is one of its start-up steps or includes a declared phase of this
        # rank or of another one.
        average, samples, straggling = prev.step_time_s, prev.step_time_samples, prev.straggling
        if (
            running
            and advanced
            and seconds is not None
            and not prev.after_phase
            and step - first > config.startup_steps
            and not watch.long_phases
            and watch.long_phase_ended_ns <= (prev.step_advanced_ns or 0)
        ):
            sampled = True
            average, samples, straggling, report = straggler(
                prev, seconds, trend, state.generation, config
            )
            if report is not None:
                decisions = (report,)
        rec = structs.replace(
            prev,
            host=host,
            pid=beat.pid,
            phase=phase,
            last_heard_ns=clock,
            step=step,
            step_advanced_ns=advanced_ns,
            phase_since_ns=prev.phase_since_ns if prev.phase == phase else clock,
            first_step=first,
            step_time_s=average,
            step_time_samples=samples,
            straggling=straggling,
            after_phase=phase in LONG_PHASES or (prev.after_phase and not advanced),
            delay_floor_ns=delay_floor,
            step_done_ns=done_ns,
            late_ns=behind,
        )
    if not advanced or prev is None or prev.phase != phase or behind < prev_late:
        # A rank that advanced in the same phase, its heartbeat no less late than its previous
        # event, only moved its own deadline later: the bound stays valid without looking.
        watch = rank_changed(watch, prev, rec, clock, trend, config)
    failure: Failure | None = None
    lead_before = watch.lead_step
    lead = training and step > lead_before
    if lead:
        spike, sound, normal = watch.spike, watch.sound_step, None
        loss = beat.loss
        if running and prev is not None and loss is not None and math.isfinite(loss):
            if warm(rec, config):
                spike, is_normal, blip, failure = judge_loss(
                    watch, trend, step, loss, state.generation, config
                )
                if is_normal:
                    sound, normal = step - 1, loss
                if blip is not None:
                    decisions = (*decisions, blip)
            elif spike is None:
                sound = step - 1
        trend, shrunk = advance(trend, step, beat.step_time_s if sampled else None, normal, config)
        due = watch.progress_due_ns
        watch = watch._replace(
            lead_step=step,
            base_step=rec.first_step if watch.base_step is None else watch.base_step,
            sound_step=sound,
            spike=spike,
            progress_due_ns=due - shrunk if shrunk and due is not None else due,
        )
    state = structs.replace(
        state,
        generation_started_ns=started,
        clock_ns=clock,
        ranks=state.ranks.insert(rank, rec),
        senders=state.senders.insert(sender, beat.seq),
        silence_floor_ns=clock if state.silence_floor_ns is None else state.silence_floor_ns,
        trend=trend,
        watch=watch,
    )
    if not running:
        return state, decisions
    if beat.loss is not None and not math.isfinite(beat.loss):
        failure = nan_loss(state, rec, beat.loss)
    if failure is None and beat.param_checksum is not None:
        judged, anomalies, failure = judge_checksum(state, rec, step, beat.param_checksum, config)
        if judged is not watch:
            state = structs.replace(state, watch=judged)
            watch = judged
        decisions = (*decisions, *anomalies)
    if failure is None and training and lead_before - step > config.max_step_lag:
        failure = judge_lag(state, rec, lead_before, late, beat.step_time_s, config)
    if failure is None:
        return state, decisions
    state, acted = fail_over(state, failure, config)
    return state, decisions + acted


def _lateness(state: JobState, rec: RankState, pid: int, ts: int) -> int:
    """How late (ns, on the machine's clock) an event that process ``pid`` sent at ``ts`` (its
    clock) reaches the bus at the job's clock: its delay beyond rank ``rec``'s quickest
    heartbeat (``delay_floor_ns``), less the part of the job's latest gap it spans
    (``JobState.last_gap``: the machine's clock stopped across it); 0 when the floor is
    unknown or of another process (``RankState.late_ns``)."""
    floor = rec.delay_floor_ns
    if floor is None or pid != rec.pid:
        return 0
    clock = state.clock_ns
    late = clock - ts - floor
    return clock - bridged_ns(state.last_gap, clock - late) if late > 0 else 0


def _touch(
    state: JobState,
    rank: int,
    host: str,
    pid: int,
    config: MachineConfig,
    *,
    ts: int,
    step: int | None = None,
    status: RankStatus | None = None,
    restarted: bool = False,
    advanced_ns: int | None = None,
    done_ns: int | None = None,
) -> JobState:
    """Record that ``rank`` spoke at the current clock (any event but a heartbeat) in an event
    its process sent at ``ts`` (ns, its clock), which dates how late the event is
    (``RankState.late_ns``).

    ``restarted``: the rank (re)starts from ``step`` in this generation (its restore
    acknowledgement): its start-up steps and progress timeout count from here.
    ``advanced_ns``, ``done_ns``: when ``step`` advances the rank's, the daemon clock (ns) its
    progress is dated for its deadline and for naming the ranks that stopped together
    (``RankState.step_advanced_ns``, ``step_done_ns``; default: the current clock).
    """
    clock = state.clock_ns
    prev = state.ranks.get(rank)
    if prev is None:
        record = RankState(
            rank=rank,
            host=host,
            pid=pid,
            status=status or "alive",
            phase=None,
            last_heard_ns=clock,
            step=step,
            step_advanced_ns=None if step is None else clock,
            phase_since_ns=clock,
            first_step=step if restarted else None,
            step_done_ns=None if step is None else clock,
        )
        newly_finished = record.status == "finished"
    else:
        advanced = step is not None and (restarted or prev.step is None or step > prev.step)
        record = structs.replace(
            prev,
            host=host,
            pid=pid,
            status=status or prev.status,
            last_heard_ns=clock,
            step=prev.step if step is None else step,
            step_advanced_ns=(clock if advanced_ns is None else advanced_ns)
            if advanced
            else prev.step_advanced_ns,
            first_step=step if restarted else prev.first_step,
            step_done_ns=(clock if done_ns is None else done_ns) if advanced else prev.step_done_ns,
            late_ns=_lateness(state, prev, pid, ts),
        )
        newly_finished = record.status == "finished" and prev.status != "finished"
    return structs.replace(
        state,
        ranks=state.ranks.insert(rank, record),
        finished_ranks=state.finished_ranks + newly_finished,
        silence_floor_ns=clock if state.silence_floor_ns is None else state.silence_floor_ns,
        watch=rank_changed(state.watch, prev, record, clock, state.trend, config),
    )


def _shown(
    state: JobState, event: Checkpoint | DataCursorEvent
) -> tuple[int, int, int] | tuple[None, None, None]:
    """``(step, since, done)`` when the event's step lies beyond its rank's last reported
    step, else ``(None, None, None)``: a shard or a data cursor of a later step shows that the
    rank completed it.

    That is progress, as a heartbeat saying so would show it, counted when the event is
    folded: the heartbeats in between may never arrive. While the bus is away an agent keeps
    only its newest heartbeats (``heartbeat_queue``) but every shard and cursor, and sends them
    in order when the bus returns, one per round trip; a slow return then brings nothing but
    shards for longer than the progress timeout (``docs/detection.md``, "Bus outages"). The
    event does not say when the step completed: it is dated ``since``, the rank's previous
    event, the earliest a heartbeat's ``step_age_s`` can date it (so a stall is never found
    later than from the heartbeats). A shard or cursor of an earlier step (a background write
    announced after the heartbeats went on) shows nothing new.

    ``done`` dates it to compare with the other ranks (``RankState.step_done_ns``): at the
    previous event too, or when the event was sent if that is earlier (it waited in the
    agent's queue behind the previous one), on the clock that stopped across a gap.
    """
    rec = state.ranks.get(event.rank)
    step = event.step
    if rec is None or rec.step is None or step <= rec.step:
        return None, None, None
    # When it was sent, as for a heartbeat (the same process, the same clock).
    sent = state.clock_ns - _lateness(state, rec, event.pid, event.ts)
    return step, rec.last_heard_ns, max(min(sent, rec.last_heard_ns), rec.step_done_ns or 0)


def _on_cursor(
    state: JobState, rank: int, version: str, step: int, config: MachineConfig
) -> tuple[JobState, Decisions]:
    """Feed a rank's data version (from any data cursor it reported) to the detector."""
    rec = state.ranks.get(rank)
    if rec is None:
        return state, _NONE
    state, anomaly, failure, refusal = note_data_version(state, rec, version, step, config)
    if refusal is not None:
        return give_up(state, refusal, config)
    if failure is not None:
        return fail_over(state, failure, config)
    return state, _NONE if anomaly is None else (anomaly,)


def _touch_shown(
    state: JobState, event: Checkpoint | DataCursorEvent, config: MachineConfig
) -> JobState:
    """Record that a shard's or data cursor's rank spoke (:func:`_touch`), with the progress
    its step shows (:func:`_shown`)."""
    step, since, done = _shown(state, event)
    return _touch(
        state,
        event.rank,
        event.host,
        event.pid,
        config,
        ts=event.ts,
        step=step,
        advanced_ns=since,
        done_ns=done,
    )


def _on_data_cursor(
    state: JobState, event: DataCursorEvent, config: MachineConfig
) -> tuple[JobState, Decisions]:
    """Fold a data-cursor event: its data version, then (outside a restore) whether it agrees
    with what other ranks reported for its step; a disagreement fails the job."""
    generation = state.generation
    state = _touch_shown(state, event, config)
    state, noted = _on_cursor(state, event.rank, event.cursor.data_version, event.step, config)
    if state.generation != generation or state.phase in (*TERMINAL_PHASES, "restoring"):
        return state, noted
    odd = disagreement(state, event.rank, event.host, event.step, event.cursor, "data cursor")
    if odd is not None:
        state, failed = fail_now(state, odd, config)
        return state, noted + failed
    return note_position(state, event.rank, event.step, event.cursor, config), noted


def _on_checkpoint(
    state: JobState, event: Checkpoint, config: MachineConfig
) -> tuple[JobState, Decisions]:
    """Add a shard to its step; commit the step once every rank's shard is in. While restoring
    (ranks of an in-process restore still short of its step), a shard may hold the state the
    restore abandons: it is never committed."""
    generation = state.generation
    state = _touch_shown(state, event, config)
    state, noted = _on_cursor(state, event.rank, event.data_version, event.step, config)
    if state.generation != generation or state.phase in TERMINAL_PHASES:
        return state, noted  # the data version opened an incident or failed the job
    state, decisions = _add_shard(state, event, config)
    return state, noted + decisions


def _add_shard(
    state: JobState, event: Checkpoint, config: MachineConfig
) -> tuple[JobState, Decisions]:
    """Keep ``event`` among its step's shards; commit the step when it completes it."""
    if state.phase == "restoring":
        return state, (
            Anomaly(
                kind="checkpoint_ignored",
                reason=f"rank {event.rank} on host {event.host} reported its shard of step "
                f"{event.step} in generation {state.generation} before the restore completed; "
                f"not committed",
                ranks=(event.rank,),
                hosts=(event.host,),
            ),
        )
    newest = state.committed[-1] if state.committed else None
    if newest is not None and newest.generation == state.generation and event.step <= newest.step:
        # A newer step of this generation is committed already: this one can never be the
        # better target, and keeping it would let late shards accumulate.
        return state, _NONE
    odd = disagreement(state, event.rank, event.host, event.step, event.cursor, "checkpoint shard")
    if odd is not None:
        return fail_now(state, odd, config)
    shards = state.pending.get(event.step, HashTrieMap()).insert(event.rank, event)
    world_size = event.world_size  # equal to state.world_size: screened
    if len(shards) < world_size:
        return structs.replace(state, pending=state.pending.insert(event.step, shards)), _NONE
    pending = HashTrieMap((s, v) for s, v in state.pending.items() if s > event.step)
    result = commit(state.job_id, state.generation, event.step, world_size, shards, state.clock_ns)
    if isinstance(result, str):
        return structs.replace(state, pending=pending), (
            Anomaly(kind="checkpoint_mismatch", reason=result),
        )
    reason = (
        f"all {world_size} ranks reported their shard of step {event.step} in generation "
        f"{state.generation} (data version {result.data_version!r})"
    )
    decision = Committed.of(result, reason)
    state = structs.replace(state, pending=pending).committing(
        (decision.snapshot,), config.keep_snapshots
    )
    return state, (decision,)


def _on_lifecycle(
    state: JobState, event: Lifecycle, config: MachineConfig
) -> tuple[JobState, Decisions]:
    """Fold a lifecycle report of a worker (``rank`` set) or of a supervisor."""
    if event.kind == "exited":
        return _on_exited(state, event, config)
    if event.kind == "error":
        return _on_error(state, event, config)
    if event.rank is None:
        # A supervisor's started/restored/finished: recorded (seq, world size), not acted on;
        # workers speak for their ranks.
        return state, _NONE
    status: RankStatus | None = "finished" if event.kind == "finished" else None
    restored = event.kind == "restored"
    state = _touch(
        state,
        event.rank,
        event.host,
        event.pid,
        config,
        ts=event.ts,
        step=event.step,
        status=status,
        restarted=restored and event.step is not None,
    )
    incident = state.incident
    if restored and state.phase == "restoring" and incident is not None:
        ack = Ack(event.snapshot_id, event.step, event.cursor)
        state = structs.replace(
            state, incident=replace(incident, acks=incident.acks.insert(event.rank, ack))
        )
    # An acknowledgement's cursor is the snapshot's, not what the rank's data loader reads:
    # only data-cursor events and shards feed the data-version detector.
    return state, _NONE


def _on_exited(
    state: JobState, event: Lifecycle, config: MachineConfig
) -> tuple[JobState, Decisions]:
    """A worker, or a supervisor's process group, exited: an incident unless all finished."""
    status = exit_status(event.exit_code, event.signal)
    generation = state.generation
    if event.rank is None and not event.ranks:
        return state, (
            Anomaly(
                kind="exit_without_ranks",
                reason=f"the supervisor on host {event.host} (pid {event.pid}) reported an exit "
                f"{status} in generation {generation} without naming its ranks",
            ),
        )
    named = {event.rank} if event.rank is not None else set(event.ranks)
    records = {r: state.ranks.get(r) for r in named}
    dead = sorted(r for r, rec in records.items() if rec is None or rec.status != "finished")
    if not dead:
        return state, _NONE
    # The supervisor knows the last step a worker completed (agents record it for it), which
    # is better evidence than the last heartbeat's step.
    steps = (
        steps_text(
            (rec.step for r, rec in records.items() if rec is not None and r in dead),
            reported=True,
        )
        if event.step is None
        else f" after its last completed step {event.step}"
    )
    who = f"{ranks_text(dead)} on host {event.host}"
    said = said_text(event.message)  # the worker's last words, as its supervisor heard them
    if event.rank is not None:
        reason = f"{who} (pid {event.pid}) exited {status} in generation {generation}{steps}{said}"
    else:
        reason = (
            f"{who} exited {status} in generation {generation}{steps} "
            f"(reported by the supervisor, pid {event.pid}){said}"
        )
    if event.exit_code == EXIT_CONFIG and event.signal is None:
        # The process found its configuration unusable: a restarted one would find the same.
        reason += "; not restarted: a restarted worker would find the same configuration"
        failure = Failure("exited", reason, tuple(dead), (event.host,), step=event.step)
        return fail_unrepairable(state, failure, config)
    failure = Failure("exited", reason, tuple(dead), (event.host,), step=event.step)
    return fail_over(state, failure, config)


def _on_error(
    state: JobState, event: Lifecycle, config: MachineConfig
) -> tuple[JobState, Decisions]:
    """An error report; one naming a snapshot marks it bad (and retries a restore to it, or,
    for the job's initial state, another job's snapshot, fails a job that has no snapshot of
    its own); one saying a rank missed the current in-process restore's step falls back to a
    restart."""
    if event.rank is not None:
        # An error is about the step it names (a background write of step 50 that failed
        # after the rank went on to 60): it never moves the rank's step back.
        known = state.ranks.get(event.rank)
        behind = (
            known is not None
            and known.step is not None
            and event.step is not None
            and event.step < known.step
        )
        state = _touch(
            state,
            event.rank,
            event.host,
            event.pid,
            config,
            ts=event.ts,
            step=None if behind else event.step,
        )
        who = f"rank {event.rank} on host {event.host}"
    else:
        who = f"the supervisor on host {event.host} (pid {event.pid})"
    detail = f": {event.message}" if event.message else ""
    incident = state.incident
    if (
        event.missed_at_step is not None
        and state.phase == "restoring"
        and incident is not None
        and incident.mode == "in_process"
        and incident.at_step == event.missed_at_step
    ):
        named = (event.rank,) if event.rank is not None else event.ranks
        if event.step is not None and event.step < event.missed_at_step:
            # The agent declines when its loop ends first (RestoreMissed), too.
            reason = (
                f"{who} ended its training loop at step {event.step}, before step "
                f"{event.missed_at_step} of the in-process restore of generation "
                f"{state.generation}; restarting instead"
            )
        else:
            reason = (
                f"{who} was already past step {event.missed_at_step}"
                f"{'' if event.step is None else f' (at step {event.step})'} when the "
                f"in-process restore of generation {state.generation} arrived; restarting "
                "instead"
            )
        failure = Failure(
            "in_process_missed",
            reason,
            named,
            (event.host,),
            measures=Measures(
                at_step=event.missed_at_step, step=-1 if event.step is None else event.step
            ),
        )
        return fail_over(state, failure, config)
    sid = event.snapshot_id
    if sid is None:
        return state, (
            Anomaly(
                kind="rank_error",
                reason=f"{who} reported an error in generation {state.generation}{detail}",
            ),
        )
    own = state.owns(sid)
    if own and all(m.snapshot_id != sid for m in state.committed):
        return state, (
            Anomaly(
                kind="unknown_snapshot",
                reason=f"{who} reported that snapshot {sid} failed verification, but it is not "
                f"a committed snapshot of this job{detail}",
            ),
        )
    if not own and state.committed and state.committed[-1].parent != sid:
        return state, (
            Anomaly(
                kind="unknown_snapshot",
                reason=f"{who} reported that snapshot {sid} failed verification, but it is "
                f"neither a committed snapshot of this job nor the snapshot it started from "
                f"({state.committed[-1].parent}){detail}",
            ),
        )
    reason = f"{who} reported that snapshot {sid} failed verification{detail}"
    if all(bad != sid for bad, _ in state.bad_snapshots):
        state = structs.replace(state, bad_snapshots=(*state.bad_snapshots, (sid, reason)))
    if not own:
        # Another job's snapshot is the job's initial state (init_from). With no snapshot of
        # its own on the timeline, the ranks of this generation started from it: they cannot
        # train, and restoring the initial state would load it again (docs/recovery.md).
        noted = Anomaly(
            kind="snapshot_corrupt", reason=f"{reason}; the job's initial state is unusable"
        )
        if state.committed:
            return state, (noted,)
        named = (event.rank,) if event.rank is not None else event.ranks
        state, decisions = fail_over(
            state, Failure("snapshot_corrupt", reason, named, (event.host,)), config
        )
        return state, (noted, *decisions)
    noted = Anomaly(kind="snapshot_corrupt", reason=f"{reason}; no longer a restore target")
    incident = state.incident
    if (
        state.phase == "restoring"
        and incident is not None
        and incident.target is not None
        and incident.target.snapshot_id == sid
    ):
        named = (event.rank,) if event.rank is not None else event.ranks
        state, decisions = fail_over(
            state, Failure("snapshot_corrupt", reason, named, (event.host,)), config
        )
        return state, (noted, *decisions)
    return state, (noted,)


def _settle(state: JobState, config: MachineConfig) -> tuple[JobState, Decisions]:
    """Phase changes an event can complete: all finished, all heard, all restores acked."""
    world_size = state.world_size
    if world_size is None or state.world_size_generation != state.generation:
        return state, _NONE
    generation = state.generation
    incident, held = state.incident, state.held
    # A restore held for a divergence stands: the ranks finished a suspect state, and it is
    # issued (a restart: they cannot reload in process) when the hold ends.
    if state.finished_ranks == world_size and (held is None or held.onset_after_step is None):
        reason = f"all {world_size} ranks finished in generation {generation}"
        decisions: Decisions = (
            Transition(old=state.phase, new="finished", generation=generation, reason=reason),
        )
        if incident is not None:
            decisions += (
                IncidentClosed(
                    incident_id=incident.incident_id,
                    outcome="finished",
                    attempts=incident.attempt,
                    reason=reason,
                ),
            )
        if held is not None:
            # Its restore was held while the bus settled: the job finished meanwhile.
            decisions += (
                IncidentClosed(
                    incident_id=held.incident_id,
                    outcome="finished",
                    attempts=0,
                    reason=reason,
                ),
            )
        return structs.replace(state, phase="finished", incident=None, held=None), decisions
    if state.phase == "starting" and len(state.ranks) == world_size:
        reason = f"all {world_size} ranks reported in generation {generation}"
        return structs.replace(state, phase="running"), (
            Transition(old="starting", new="running", generation=generation, reason=reason),
        )
    if state.phase == "restoring" and incident is not None and len(incident.acks) == world_size:
        wrong = acknowledged(state, incident)
        if wrong is not None:
            return fail_over(state, wrong, config)
        step = 0 if incident.target is None else incident.target.step
        seq = next_command_seq(state)
        # Ranks of an in-process restore reported steps up to its at_step before reloading.
        # They wait for the resume: no stall deadline runs until a tick shows it on the bus.
        watch = state.watch._replace(lead_step=step, held=True)
        reason = (
            f"all {world_size} ranks acknowledged restore attempt {incident.attempt} of "
            f"{incident.incident_id} to {target_text(incident.target)} in generation {generation}"
        )
        resume = Resume(
            job_id=state.job_id,
            generation=generation,
            ts=state.clock_ns,
            seq=seq,
            daemon_id=config.daemon_id,
            step=step,
        )
        return structs.replace(
            state, phase="running", incident=None, command_seq=seq, watch=watch
        ), (
            Transition(old="restoring", new="running", generation=generation, reason=reason),
            Issue(command=resume, reason=reason),
            IncidentClosed(
                incident_id=incident.incident_id,
                outcome="resumed",
                attempts=incident.attempt,
                reason=reason,
            ),
        )
    return state, _NONE


def _expire(
    state: JobState, config: MachineConfig, decisions: Decisions
) -> tuple[JobState, Decisions]:
    """Check the deadlines at the current clock; at most one failure is acted on per input."""
    if state.phase in TERMINAL_PHASES:
        return state, decisions
    clock = state.clock_ns
    held = state.held
    if held is not None:
        # An incident is open, and its restore, due when the hold ends, restores every rank:
        # no deadline is judged before it. A checkpoint the hold waited for ends it early,
        # unless the bus settles after a gap meanwhile.
        if settling(state) and (bus_settling(state, config) or not cut_arrived(state, held)):
            return state, decisions
        state, released = release(state, held, config)
        return state, decisions + released
    failure: Failure | None = None
    floor = state.silence_floor_ns
    if floor is not None and clock > floor + config.heartbeat_timeout_ns:
        state, failure = _scan_silence(state, config)
    due = state.watch.progress_due_ns
    if failure is None and state.phase == "running" and due is not None and clock > due:
        state, failure = scan_stalls(state, config)
    started = state.generation_started_ns
    if (
        failure is None
        and state.phase == "starting"
        and started is not None
        and clock > started + config.startup_timeout_ns
    ):
        failure = _startup_failure(state, config)
    incident = state.incident
    if (
        failure is None
        and state.phase == "restoring"
        and incident is not None
        and _restore_acted(state)
        and clock > state.watch.acted_ns + config.restore_timeout_ns
    ):
        missing = tuple(r for r in range(state.world_size or 0) if r not in incident.acks)
        reason = (
            f"restore attempt {incident.attempt} of {incident.incident_id} to "
            f"{target_text(incident.target)} (generation {state.generation}) not acknowledged "
            f"within {seconds_text(config.restore_timeout_ns)}"
            + (f" by {ranks_text(missing)}" if missing else "")
            + wrong_acks_text(state, incident)
        )
        hosts = tuple(rec.host for r in missing if (rec := state.ranks.get(r)) is not None)
        failure = Failure("restore_timeout", reason, missing, hosts)
    if failure is None:
        return state, decisions
    state, more = fail_over(state, failure, config)
    return state, decisions + more


def _scan_silence(state: JobState, config: MachineConfig) -> tuple[JobState, Failure | None]:
    """Look at every alive rank (O(n), amortised over the heartbeats since the last scan):
    name those silent for longer than the heartbeat timeout, else raise the silence floor.

    A rank in a declared phase is left out: it may be silent (a long save holding the GIL
    stops its agent's heartbeats) up to the phase's limit, which the stall detector applies
    (:mod:`trainguard.daemon.core.detectors._stall`); its death is its supervisor's to report."""
    clock = state.clock_ns
    timeout = config.heartbeat_timeout_ns
    silent: list[RankState] = []
    floor: int | None = None
    for rec in state.ranks.values():
        if rec.status != "alive" or rec.phase in LONG_PHASES:
            continue
        if clock - rec.last_heard_ns > timeout:
            silent.append(rec)
        elif floor is None or rec.last_heard_ns < floor:
            floor = rec.last_heard_ns
    if not silent:
        return structs.replace(state, silence_floor_ns=floor), None
    silent.sort(key=lambda rec: rec.rank)
    longest = max(clock - rec.last_heard_ns for rec in silent)
    measures = Measures(silent_s=longest / 1e9, timeout_s=timeout / 1e9)
    reason = (
        f"no event from {ranks_text(rec.rank for rec in silent)} on "
        f"{hosts_text(rec.host for rec in silent)} for up to {seconds_text(longest)} "
        f"(heartbeat timeout {seconds_text(timeout)}) in generation {state.generation}"
        f"{steps_text((rec.step for rec in silent), reported=True)}"
    )
    return state, Failure(
        "heartbeat_timeout",
        reason,
        tuple(rec.rank for rec in silent),
        tuple(rec.host for rec in silent),
        measures=measures,
    )


def _startup_failure(state: JobState, config: MachineConfig) -> Failure:
    """The ranks of generation ``state.generation`` not heard from within the startup timeout."""
    timeout = seconds_text(config.startup_timeout_ns)
    world_size = state.world_size
    if world_size is None:
        reason = (
            f"no rank stated the world size within the startup timeout of {timeout} in "
            f"generation {state.generation}"
        )
        return Failure("startup_timeout", reason, (), ())
    missing = tuple(r for r in range(world_size) if r not in state.ranks)
    reason = (
        f"{ranks_text(missing)} of world size {world_size} not heard from within the startup "
        f"timeout of {timeout} in generation {state.generation}"
    )
    return Failure("startup_timeout", reason, missing, ())
