"""Immutable state of one job as the state machine sees it.

``JobState`` and ``RankState`` are frozen ``msgspec`` structs: a new state differs from the old
one in a few fields, and ``msgspec.structs.replace`` (written in C) derives it by field name at
about the cost of building a tuple by position (measured here, 27 fields of ``JobState`` with 7
changed: 0.3-0.5 us, where a named tuple's ``_replace`` takes 2.2 us and
``dataclasses.replace`` of a frozen dataclass about 9 us for 18 fields); this is paid on every
heartbeat. They are not tracked by the garbage collector (``gc=False``): a frozen struct of
immutable values built before it (numbers, strings, tuples, persistent maps, frozen
dataclasses) can never be part of a reference cycle, and tracked they made the fold's
collections cost a third more (15 against 9.3 us per input of the replay bench's job).

The smaller records (``Watch``, ``Trend``, ...) are named tuples, compared only with records of
their own type. Collections that change on the hot path (per-rank records, per-sender sequence
numbers, pending checkpoint shards, restore acknowledgements) are persistent hash tries from
``rpds``: an update returns a new map sharing all but O(log32 n) nodes with the old one, so
folding a heartbeat does not copy the state of every rank, and an old state stays valid (and
comparable) after a new one is derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, TypeAlias

from msgspec import Struct
from msgspec.structs import replace
from rpds import HashTrieMap

from trainguard.daemon.core._window import Window
from trainguard.schemas import (
    Checkpoint,
    DataCursor,
    Manifest,
    Phase,
    RestoreMode,
    SnapshotRef,
    StepRange,
)

JobPhase: TypeAlias = Literal["starting", "running", "restoring", "finished", "failed", "stopped"]
"""``starting -> running <-> restoring -> ... -> finished | failed | stopped``; a ``stopped``
or ``failed`` job goes back to ``restoring`` when it is continued (``docs/operations.md``)."""

RankStatus: TypeAlias = Literal["alive", "dead", "finished"]

IncidentCause: TypeAlias = Literal[
    "exited",
    "heartbeat_timeout",
    "startup_timeout",
    "restore_timeout",
    "snapshot_corrupt",
    "progress_timeout",
    "phase_timeout",
    "nan_loss",
    "loss_spike",
    "checksum_mismatch",
    "step_lag",
    "data_version_mismatch",
    "in_process_missed",
    "restore_mismatch",
    "cursor_mismatch",
    "continued",
]
"""What opened an incident or forced a restore to be retried (the detector's name);
``continued``: an operator continued a stopped or failed job (its restore is coordinated as an
incident's)."""

LONG_PHASES: frozenset[Phase] = frozenset({"init", "checkpoint", "eval", "data"})
"""Declared phases with their own time limits (``MachineConfig.phase_*_s``)."""

Sender: TypeAlias = tuple[int | None, str, int]
"""An event's sender: ``(rank, host, pid)``; ``rank`` is ``None`` for a supervisor."""

TERMINAL_PHASES: frozenset[JobPhase] = frozenset({"finished", "failed", "stopped"})
"""Phases in which the job's state no longer changes, but for a ``continue`` request of a
``stopped`` or ``failed`` job."""

new_tuple = tuple.__new__
"""``new_tuple(NamedTupleClass, (every field, in order))`` builds the named tuple in C, where the
class's own ``__new__`` is generated Python code taking the fields as arguments: about 0.1 us
less per call, used where every record the daemon or a replay takes in builds two. It
checks nothing: the caller passes every field, in order."""


class RankState(Struct, frozen=True, gc=False):
    """What the daemon knows about one rank in the current generation.

    Attributes:
        rank: the rank, ``0 <= rank < world_size``.
        host: host name of the rank's process, as last reported.
        pid: process id of the rank's process, as last reported.
        status: ``alive``, ``finished`` (sent ``lifecycle finished``) or ``dead`` (named by the
            failure that ended the job).
        phase: the phase its last heartbeat declared, or ``None`` before its first heartbeat.
        last_heard_ns: daemon clock (ns) at its last event of any kind; heartbeat timeouts
            count from here.
        step: last step it reported (heartbeat, lifecycle event such as a restore
            acknowledgement, or a shard or data cursor of a later step), or ``None``. In
            phase ``init`` the step it will start from (0 until its ``ready()``), no step
            trained.
        step_advanced_ns: daemon clock (ns) when ``step`` last increased, or ``None``: the
            append time of the heartbeat that showed it, less the step's age when the
            heartbeat states it (``step_age_s``), but not before the rank's previous event;
            the rank's previous event when a shard or data cursor showed it. Stall
            deadlines count from here.
        phase_since_ns: daemon clock (ns) when ``phase`` was first reported in its current run
            (declared phases are limited from here), or of the rank's first event.
        first_step: the step the rank (re)started from in this generation: the step of its
            last heartbeat in phase ``init`` (else of its first heartbeat), or of its restore
            acknowledgement; ``None`` before.
        step_time_s: exponentially weighted average of its sampled step times (seconds), or
            ``None`` before the first sample.
        step_time_samples: step times folded into ``step_time_s``.
        straggling: reported as a straggler and not back under the threshold since.
        after_phase: a declared phase was reported since ``step`` last advanced, so the next
            step time includes the phase and is not sampled.
        data_version: the data version of its latest data cursor in this generation.
        delay_floor_ns: the least ``append time - ts`` (ns) of its current process's
            heartbeats: its clock offset plus its quickest delivery. A heartbeat's delay beyond
            it is how long the heartbeat took longer than usual to reach the bus (queued while
            the bus was slow), whatever the sender's clock says. ``None`` before a heartbeat.
        step_done_ns: daemon clock (ns) at which the rank completed ``step`` as its own
            records date it, or ``None`` when ``step_advanced_ns`` is: the bus time a
            heartbeat was sent (its append time less its delay beyond ``delay_floor_ns``)
            less its ``step_age_s``; for a shard or data cursor, the rank's previous event or
            the record's own sending, whichever is earlier; on the machine's clock across
            the job's latest gap (``JobState.last_gap``); never before the completion of the
            rank's previous step. Unlike ``step_advanced_ns`` it does not depend on how long
            the record waited to reach the bus, so the ranks' times compare: a stall names
            the ranks that stopped together by it (:mod:`trainguard.daemon.core.detectors._stall`).
        late_ns: how late (ns) its latest event reached the bus: its ``append time - ts``
            beyond ``delay_floor_ns`` (0 when that is unknown or of another process, or for an
            event quicker than the floor). What the rank did after sending it is still on its
            way: its progress deadline is extended by as much (:mod:`trainguard.daemon.core.detectors._stall`).
            A delay, not a time: a gap does not move it.
    """

    rank: int
    host: str
    pid: int
    status: RankStatus
    phase: Phase | None
    last_heard_ns: int
    step: int | None
    step_advanced_ns: int | None
    phase_since_ns: int = 0
    first_step: int | None = None
    step_time_s: float | None = None
    step_time_samples: int = 0
    straggling: bool = False
    after_phase: bool = False
    data_version: str | None = None
    delay_floor_ns: int | None = None
    step_done_ns: int | None = None
    late_ns: int = 0


class Ack(NamedTuple):
    """What a rank's ``lifecycle restored`` says it restored (``docs/recovery.md``).

    Attributes:
        snapshot_id: the snapshot it loaded, ``None`` for the job's initial state.
        step: the step it stands at, ``None`` when the acknowledgement names none.
        cursor: its data cursor at ``step``, ``None`` when it names none.
    """

    snapshot_id: str | None
    step: int | None
    cursor: DataCursor | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Incident:
    """An open incident and the progress of its restore.

    Attributes:
        incident_id: ``<job_id>/i<n>``, ``n`` counting the job's incidents from 1.
        cause: what opened it.
        reason: the evidence that opened it.
        opened_ns: daemon clock (ns) when it opened.
        attempt: the current restore attempt, 1 for the first.
        target: the snapshot the current attempt restores, ``None`` for a start from scratch.
        issued_ns: daemon clock (ns) when the current attempt's ``restore`` was issued. It
            times out ``restore_timeout_s`` after a tick showed it on the bus
            (``Watch.acted_ns``), which a daemon catching up on a backlog writes much later.
        acks: rank -> what it acknowledged restoring in the current attempt (``lifecycle
            restored``); checked against ``target`` once every rank acknowledged.
        onset_after_step: the incident began after this step (the last one known good), so
            every target is a committed step ``<=`` it; ``None`` when the onset is the incident
            time (a dead or stalled rank: any committed snapshot so far will do).
        mode: the current attempt's restore mode.
        at_step: the current attempt's step boundary for an ``in_process`` restore.
        skip: the steps whose batches the restored ranks skip, or ``None``.
    """

    incident_id: str
    cause: IncidentCause
    reason: str
    opened_ns: int
    attempt: int
    target: SnapshotRef | None
    issued_ns: int
    acks: HashTrieMap[int, Ack] = field(default_factory=HashTrieMap)
    onset_after_step: int | None = None
    mode: RestoreMode = "restart"
    at_step: int | None = None
    skip: StepRange | None = None


class Trend(NamedTuple):
    """The job's step-time and loss series, kept across generations (the job's pace and loss
    level survive a restore), and what the detectors derive from them.

    Attributes:
        step_times: sampled step times, seconds (see ``docs/detection.md`` for which).
        losses: sampled finite losses that opened no spike.
        progress_timeout_ns: the adaptive progress timeout (ns), or ``None`` before
            ``progress_min_samples`` step times.
        step_time_quantile_s: the ``progress_quantile`` of ``step_times`` it derives from.
        step_time_median_s: the median of ``step_times`` (stragglers, in-process margin).
        loss_median: median of ``losses``, or ``None`` before ``loss_min_samples``.
        loss_mad: median absolute deviation of ``losses`` (with ``loss_median``).
        high_water_step: the highest step any rank ever reported (-1: none).
    """

    step_times: Window = Window()
    losses: Window = Window()
    progress_timeout_ns: int | None = None
    step_time_quantile_s: float | None = None
    step_time_median_s: float | None = None
    loss_median: float | None = None
    loss_mad: float | None = None
    high_water_step: int = -1


class Spike(NamedTuple):
    """A loss spike seen but not yet confirmed (it may still return to the trend).

    Attributes:
        onset_after_step: the last step known sound when it opened (``Watch.sound_step``,
            else the generation's base step).
        skip_from: the first step whose batch a restore for it skips: the step after the
            latest normal loss sample (whose batch trained normally), else after the
            generation's base step.
        first_step: step of the first spiking sample.
        first_loss: its loss.
        z: its robust z-score.
        peak_loss: the highest loss since.
        samples: spiking samples so far (the first included).
        median: the loss median it was judged against (frozen while it lasts).
        mad: the median absolute deviation it was judged against.
    """

    onset_after_step: int | None
    skip_from: int
    first_step: int
    first_loss: float
    z: float
    peak_loss: float
    samples: int
    median: float
    mad: float


class Watch(NamedTuple):
    """Detector state of the current generation; a new generation starts a fresh one.

    Attributes:
        base_step: the step the generation started from (the restore target's, else the
            first step reported), ``None`` before it is known. Taken as known good: the
            default bound of step-bounded onsets.
        lead_step: the highest training step reported in the generation (-1: none); a
            heartbeat that raises it is a *lead sample* of step time and loss.
        progress_due_ns: a lower bound of the earliest stall deadline of any rank, or
            ``None``; ranks are scanned only once the clock passes it (O(1) amortised).
        long_phases: alive ranks in a declared phase now.
        long_phase_ended_ns: daemon clock (ns) when ``long_phases`` last fell to 0.
        sound_step: the latest step after which the parameters are known sound from the loss:
            the step before the latest normal loss sample (the loss of step s is computed
            from the parameters after step s - 1; the update of step s itself may already be
            poisoned by another rank's gradient), or ``None`` before one.
        spike: a loss spike being watched, or ``None``.
        checksums: ``(step, replica group)`` -> rank -> parameter checksum, for groups not
            complete yet.
        agreed: replica group -> the latest step at which its checksums agreed.
        versions: data version -> ranks whose latest cursor has it.
        positions: step -> ``(rank, cursor)`` of the first data-cursor event of that step in
            the generation, the reference later cursors of the step must agree with; steps
            more than ``max_step_lag`` behind the newest are dropped.
        acted_seq: the ``seq`` of the latest of the job's commands that a tick showed on the
            bus in this generation (``Tick.command_seq``, at most ``JobState.command_seq``).
            The generation's restore is acted on once it reaches that restore's ``seq``.
        acted_ns: daemon clock (ns) of the tick that raised ``acted_seq``: the restore timeout
            counts from here, and no stall deadline of the generation starts before it.
        held: the generation's ``resume`` was issued but no tick has shown it on the bus yet:
            the ranks wait for it, so no stall deadline runs.
    """

    base_step: int | None = None
    lead_step: int = -1
    progress_due_ns: int | None = None
    long_phases: int = 0
    long_phase_ended_ns: int = 0
    sound_step: int | None = None
    spike: Spike | None = None
    checksums: HashTrieMap[tuple[int, int], HashTrieMap[int, str]] = HashTrieMap()
    agreed: HashTrieMap[int, int] = HashTrieMap()
    versions: HashTrieMap[str, int] = HashTrieMap()
    positions: HashTrieMap[int, tuple[int, DataCursor]] = HashTrieMap()
    acted_seq: int = 0
    acted_ns: int = 0
    held: bool = False


class AfterRestore(NamedTuple):
    """An incident that struck within the first steps after a restore (evidence against it).

    Attributes:
        incident_id: the incident.
        ranks: the ranks its failure named.
        step: the step it struck at (the furthest of those ranks' last completed steps).
        base_step: the step the restore had put the job back to.
    """

    incident_id: str
    ranks: tuple[int, ...]
    step: int
    base_step: int


class Loop(NamedTuple):
    """Crash-loop guard: the current run of incidents without progress.

    Attributes:
        streak: incidents of the run after its first one (each opened without progress).
        mark_step: ``Trend.high_water_step`` when the run's first incident opened (``None``
            before any incident); progress means getting ``crash_loop_progress_steps`` past it.
        incidents: ids and causes of the run's incidents, oldest first.
        after_restore: the run's incidents that struck within the first steps after a
            restore, oldest first.
    """

    streak: int = 0
    mark_step: int | None = None
    incidents: tuple[tuple[str, IncidentCause], ...] = ()
    after_restore: tuple[AfterRestore, ...] = ()


class Held(NamedTuple):
    """An incident whose first restore waits until ``JobState.settle_until_ns``, its target
    chosen then: one opened while the bus settled after a gap (the checkpoints the ranks made
    during the outage arrive after it and commit first), or one of exited ranks that had
    reported their shards of a step the other ranks' shards had not completed yet (released
    early once that step commits or can no longer commit).

    Attributes:
        incident_id: the incident (its ``IncidentOpened`` was decided when it was held).
        cause: the detector that opened it.
        reason: its evidence (with what it says against the latest restore, if anything).
        ranks: the ranks named by it and by every failure that joined it while held, ascending.
        hosts: their hosts, sorted, without repeats.
        opened_ns: daemon clock (ns) when it opened.
        onset_after_step: the earliest last-known-good step among its failures (targets are
            committed steps ``<=`` it), or ``None`` when none bounds the onset.
        skip: steps whose batches the restored ranks skip, or ``None``.
        step: the highest step its failures say they struck at, or ``None``.
        evidence: it struck within the first steps after a restore (crash-loop evidence).
        restart: a failure that joined it leaves no restorable process (a dead or silent
            rank): its restore restarts, whatever ``restore_mode`` says.
        awaits: for a hold of its own (not the bus's settle window), the step of the current
            generation whose checkpoint the restore waits for: the exited ranks reported their
            shards of it, some other rank had not yet (``cut_settle_s``,
            :func:`trainguard.daemon.core._recovery.awaited_cut`); ``None`` for a settle hold.
    """

    incident_id: str
    cause: IncidentCause
    reason: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    opened_ns: int
    onset_after_step: int | None = None
    skip: StepRange | None = None
    step: int | None = None
    evidence: AfterRestore | None = None
    restart: bool = False
    awaits: int | None = None


class Left(NamedTuple):
    """The generation the latest restore left, while no rank has joined the restore's
    generation: what a late ``finished`` or checkpoint shard of it is judged against
    (``JobState.left``; ``docs/recovery.md``, "A job that finished is never restored").

    Attributes:
        generation: the generation the ranks last ran in (the one before the first of the
            restores nobody has joined yet).
        finished: its ranks known to have finished, ascending: those that had reported
            ``finished`` before the restore, and those whose report arrived after it.
        pending: step -> rank -> shard of that generation for steps no cut of it completed
            yet: the generation's uncommitted shards when the restore left it, and shards of
            it that arrived after the restore (only steps above the newest of ``cuts``).
        cuts: manifests of the steps of that generation whose shards all arrived after the
            restore (or completed a step then), oldest first, at most ``keep_snapshots``:
            consistent cuts, committed only if the job finishes in that generation (the
            restore void), else never.
    """

    generation: int
    finished: tuple[int, ...] = ()
    pending: HashTrieMap[int, HashTrieMap[int, Checkpoint]] = HashTrieMap()
    cuts: tuple[Manifest, ...] = ()


class JobState(Struct, frozen=True, gc=False):
    """The state machine's whole knowledge of one job; derive new states, never mutate.

    Attributes:
        job_id: the job.
        phase: the job's phase.
        generation: the current fencing generation; events of other generations are rejected.
        generation_started_ns: daemon clock (ns) when the current generation began (the job's
            first input for generation 0, the ``restore`` for later ones); ``None`` before any
            input.
        clock_ns: the daemon's clock, the largest input time seen so far (ns); 0 before any
            input. Append times of different writers may be slightly out of order; the clock
            never goes back.
        world_size: ranks in the job, or ``None`` until some event states it. Carried into a
            new generation as the expectation until an event of that generation states it.
        world_size_generation: the generation in which ``world_size`` was last stated
            (-1: never). Within one generation a different world size is a conflict.
        ranks: rank -> record, for ranks heard from in the current generation only.
        finished_ranks: how many of ``ranks`` have status ``finished``.
        senders: ``(rank, host, pid)`` -> highest ``seq`` accepted from that sender in the
            current generation (older generations' events are rejected before this is read,
            so it is cleared on every new generation).
        relays: ``(host, pid)`` of a supervisor -> highest ``seq`` of its heartbeat batches a
            heartbeat of which was folded in the current generation (cleared with
            ``senders``): a batch not above it is one the bus delivered again. Kept apart
            from ``senders``, because the supervisor's lifecycle events share that counter
            but reach the bus by another way (its outbox, its journal), in another order.
        pending: step -> rank -> checkpoint shard, for steps of the current generation not
            committed yet.
        committed: committed snapshots in commit order (newest last), at most
            ``keep_snapshots``.
        bad_snapshots: ``(snapshot id, why)`` of each committed snapshot whose shards failed
            verification, in the order reported. A restore keeps those of the snapshots it
            abandons (the incident's give-up reason names every snapshot tried); the next
            commit forgets those no longer committed. The job's initial state, a snapshot of
            another job (``init_from``), is kept once it failed verification.
        incident: the open incident, or ``None``.
        incidents_opened: incidents opened so far (numbers incident ids).
        command_seq: ``seq`` of the last command issued (0: none yet).
        silence_floor_ns: a lower bound of ``last_heard_ns`` over the alive ranks outside
            declared phases (whose silence their phase limits bound), or ``None`` when there
            is none. Heartbeat timeouts are looked for only once the clock
            passes this bound plus the timeout, which keeps folding a heartbeat O(1) in the
            number of ranks (amortised).
        failure: why the job failed, once ``phase`` is ``failed``.
        trend: step-time and loss series of the job (all generations).
        watch: detector state of the current generation.
        data_version: the data version the job runs on (what its ranks last agreed on, in any
            generation), or ``None`` before any data cursor.
        loop: the crash-loop guard's count.
        continued_generation: the generation the job's latest continuation (a ``continue``
            request of a ``stopped`` or ``failed`` job) started, 0 before any: a ``stop``
            request of an older generation was meant for the run before it and is stale.
        settle_until_ns: daemon clock (ns) at which the bus counts as settled after the latest
            gap in the job's inputs (``MachineConfig.bus_gap_s``): the gap's end plus
            ``outage_settle_s``; ``None`` before any gap.
        held: the incident whose restore waits for ``settle_until_ns``, or ``None``. Only a
            ``starting`` or ``running`` job holds one.
        left: the generation the latest restore left and its finished ranks, set when a
            restore leaves a generation some process was heard in (kept by a retry nobody
            joined), or ``None`` before any restore. Read only while the job is ``restoring``
            and no event of the current generation was accepted (``senders`` empty): a
            ``finished`` or a checkpoint shard of that generation arriving then is no stale
            event (``docs/recovery.md``, "A job that finished is never restored").
        last_gap: ``(from_ns, to_ns)``, the bus times of the job's last input before the
            latest gap in its inputs (``MachineConfig.bus_gap_s``) and of its first after it,
            or ``None`` before any gap: time stopped across it
            (:func:`trainguard.daemon.core._outage.bridge`), so a time a rank's record states
            from before ``to_ns`` is put on the machine's clock with
            :func:`trainguard.daemon.core._outage.bridged_ns`.
    """

    job_id: str
    phase: JobPhase = "starting"
    generation: int = 0
    generation_started_ns: int | None = None
    clock_ns: int = 0
    world_size: int | None = None
    world_size_generation: int = -1
    # Persistent maps are immutable, so one empty map can be every state's default.
    ranks: HashTrieMap[int, RankState] = HashTrieMap()
    finished_ranks: int = 0
    senders: HashTrieMap[Sender, int] = HashTrieMap()
    relays: HashTrieMap[tuple[str, int], int] = HashTrieMap()
    pending: HashTrieMap[int, HashTrieMap[int, Checkpoint]] = HashTrieMap()
    committed: tuple[SnapshotRef, ...] = ()
    bad_snapshots: tuple[tuple[str, str], ...] = ()
    incident: Incident | None = None
    incidents_opened: int = 0
    command_seq: int = 0
    silence_floor_ns: int | None = None
    failure: str | None = None
    trend: Trend = Trend()
    watch: Watch = Watch()
    data_version: str | None = None
    loop: Loop = Loop()
    continued_generation: int = 0
    settle_until_ns: int | None = None
    held: Held | None = None
    left: Left | None = None
    last_gap: tuple[int, int] | None = None

    def owns(self, snapshot_id: str) -> bool:
        """Whether ``snapshot_id`` (``<job_id>/g<generation>/s<step>``) is a snapshot of this
        job; a snapshot of another job a rank reports can only be the job's initial state
        (``init_from``)."""
        return snapshot_id.partition("/")[0] == self.job_id

    def committing(self, snapshots: tuple[SnapshotRef, ...], keep: int) -> JobState:
        """This state with ``snapshots`` committed after ``committed`` (the newest ``keep``
        kept); the bad snapshots no longer committed are forgotten (they belong to an
        abandoned timeline), never the job's initial state's (another job's snapshot)."""
        committed = (*self.committed, *snapshots)[-keep:]
        kept = {m.snapshot_id for m in committed}
        bad = tuple(
            (sid, why) for sid, why in self.bad_snapshots if sid in kept or not self.owns(sid)
        )
        return replace(self, committed=committed, bad_snapshots=bad)

    def restore_target(self, onset_after_step: int | None = None) -> SnapshotRef | None:
        """The restore target: the newest committed snapshot not known bad whose step is
        ``<= onset_after_step`` (any step when ``None``), or ``None`` (start from scratch).

        Commit order is the order that matters: ``committed`` only holds the current
        timeline's snapshots (a restore drops those committed after its target), so a step
        re-committed in a later generation is found first.
        """
        bad = {sid for sid, _ in self.bad_snapshots}
        for snapshot in reversed(self.committed):
            if snapshot.snapshot_id in bad:
                continue
            if onset_after_step is None or snapshot.step <= onset_after_step:
                return snapshot
        return None


def new_job(job_id: str) -> JobState:
    """The state of a job the daemon has not seen any input for: ``starting``, generation 0."""
    return JobState(job_id=job_id)


class Unjoined(NamedTuple):
    """A restore nobody has joined yet, as a late event of the generation it left is judged
    against it (:func:`unjoined`).

    Attributes:
        left: the generation the restore left (``JobState.left``).
        incident: the restore's incident.
        world_size: the job's world size.
        restore: the restore, for an anomaly's reason (``the restore of <incident> to
            generation <g> (attempt <n>)``).
    """

    left: Left
    incident: Incident
    world_size: int
    restore: str


def unjoined(state: JobState, generation: int, rank: int | None) -> Unjoined | None:
    """The restore a late event of ``generation`` from ``rank`` may still count against: the
    job is ``restoring``, no event of the restore's generation was accepted (``senders``
    empty), ``generation`` is the one the restore left and ``rank`` is a rank of the job's
    world size; else ``None`` (the event is stale). The shared condition of the late-finish
    and late-checkpoint rules (``docs/recovery.md``)."""
    left, incident, world_size = state.left, state.incident, state.world_size
    if (
        left is None
        or incident is None
        or world_size is None
        or state.phase != "restoring"
        or state.senders
        or generation != left.generation
        or rank is None
        or not 0 <= rank < world_size
    ):
        return None
    restore = (
        f"the restore of {incident.incident_id} to generation {state.generation} (attempt "
        f"{incident.attempt})"
    )
    return Unjoined(left, incident, world_size, restore)
