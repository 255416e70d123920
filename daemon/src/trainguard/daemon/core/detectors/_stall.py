"""Stall detectors: a rank whose step does not advance, a declared phase over its limit, and
stragglers (reported only).

Each alive rank that has heartbeated has a *stall deadline*:

* in a declared phase (``init``, ``checkpoint``, ``eval``, ``data``): the time it was first
  seen in that phase plus the phase's limit;
* training, while no rank is in a declared phase: the latest of the time its step last
  advanced (shown by a heartbeat, or by a shard or data cursor of a later step:
  ``RankState.step_advanced_ns``), the time it was first seen training, and the time the
  last declared phase of any rank ended, plus its progress timeout: the start-up allowance
  during its first ``startup_steps`` steps in the generation (or while the job has too few
  step-time samples), else the job's adaptive timeout (:mod:`trainguard.daemon.core.detectors._trend`), plus
  one heartbeat interval (a step's end is seen only when the next heartbeat reports it),
  plus how late its latest event reached the bus (``RankState.late_ns``), at most the
  heartbeat timeout (see below);
* training while some rank is in a declared phase: none (the others may be waiting for it in
  a collective; the phase's own limit bounds the wait);
* training but silent since that time: none (a rank that stopped talking is the heartbeat
  timeout's case; this detector is for ranks whose heartbeats go on without progress);
* while the generation's ``resume`` is not known to be on the bus (``Watch.held``): none (the
  ranks wait for it). No deadline of a restored generation counts from before the tick that
  showed its latest command on the bus (``Watch.acted_ns``): the daemon's own delay in acting
  (a backlog it caught up on) is never the ranks' time.

A rank is judged on its own clock: its latest event, late by ``late_ns`` (its delay beyond its
quickest heartbeat's, on the machine's clock, which stopped across the job's latest gap), tells
what it did until it was sent; what it did since is behind it in its agent's queue, at least
as late while the queue drains (the agent sends in order, one record per round trip after an
outage). So its deadline is pushed back by as much: a job whose whole remaining run happened
while the bus was away, delivered one record per round trip, is not found stalled between its
last step and its ``finished`` because those records arrive slower than they were sent. Once
the backlog is delivered its events are on time again and the usual deadline applies; a rank
that stops sending is the heartbeat timeout's case, counted from its last event's arrival. The
extension is at most ``heartbeat_timeout_s``, the longest the daemon waits for a rank's word:
a sender whose clock stepped back would otherwise look late for good and never be judged.

A rank in a declared phase is bounded by the phase's limit whether it heartbeats or not (a long
save may hold the GIL and silence the agent's heartbeat thread): the heartbeat timeout leaves
it alone (``_machine._scan_silence``), its death is reported by its supervisor.

``Watch.progress_due_ns`` is kept a lower bound of every deadline: each rank's new deadline is
folded in with ``min`` when it changes, a shrinking adaptive timeout lowers the bound by as
much, and the end of the last declared phase lowers it to the earliest deadline that can
follow. The ranks are scanned (O(n)) only when the clock passes the bound; a scan that finds
no stall sets the bound to the exact earliest deadline. Folding a heartbeat stays O(1).

Attribution: a stall names every training rank whose last progress lies within one heartbeat
interval of the earliest last progress of any training rank, whether its own deadline passed
yet or not; in a collective hang the stuck rank is among them (``docs/detection.md`` says what
this can and cannot tell apart). Last progress is dated here as the rank's own records date
its step's completion (``RankState.step_done_ns``: however long they waited to reach the bus,
on the clock that stopped across a gap), not as its deadline counts (``step_advanced_ns``,
which depends on how many records each agent had queued before it after an outage).

Wording: "kept heartbeating without completing a step" when every named rank was heard within
two heartbeat intervals of the clock; otherwise the ranks "completed no step", and the reason
says how long the silent ones sent nothing (``silent_s``): a rank that stopped sending at all
can pass its progress deadline before its heartbeat timeout.
"""

from __future__ import annotations

from msgspec import structs

from trainguard.daemon.core._decisions import Anomaly
from trainguard.daemon.core._evidence import (
    Measures,
    hosts_text,
    number_text,
    ranks_text,
    seconds_text,
    steps_text,
)
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._recovery import Failure
from trainguard.daemon.core._state import LONG_PHASES, JobState, RankState, Trend, Watch

_NS_PER_S = 1_000_000_000


def progress_timeout_ns(rec: RankState, trend: Trend, config: MachineConfig) -> int:
    """The progress timeout (ns) of training rank ``rec``: the start-up allowance during its
    start-up steps or before the job has enough step-time samples, else the adaptive one."""
    timeout = trend.progress_timeout_ns
    if timeout is None or not warm(rec, config):
        return config.startup_allowance_ns
    return timeout


def warm(rec: RankState, config: MachineConfig) -> bool:
    """Whether ``rec`` completed its start-up steps in this generation."""
    return (
        rec.step is not None
        and rec.first_step is not None
        and rec.step - rec.first_step >= config.startup_steps
    )


def stall_deadline(rec: RankState, watch: Watch, trend: Trend, config: MachineConfig) -> int | None:
    """The daemon clock (ns) after which ``rec`` is stalled, or ``None`` when it cannot be
    (not alive, no heartbeat yet, the generation's resume not yet on the bus, or training
    while another rank is in a declared phase)."""
    phase = rec.phase
    if rec.status != "alive" or phase is None or watch.held:
        return None
    if phase in LONG_PHASES:
        return max(rec.phase_since_ns, watch.acted_ns) + config.phase_limits_ns[phase]
    if watch.long_phases:
        return None
    since = _training_since(rec, watch)
    if rec.last_heard_ns <= since:
        return None  # silent since: the heartbeat timeout decides, not this detector
    timeout = progress_timeout_ns(rec, trend, config) + config.heartbeat_interval_ns
    return since + timeout + behind_ns(rec, config)


def behind_ns(rec: RankState, config: MachineConfig) -> int:
    """How far (ns) rank ``rec``'s progress deadline is extended: the lateness of its latest
    event (``RankState.late_ns``), at most the heartbeat timeout (see the module docstring)."""
    return min(rec.late_ns, config.heartbeat_timeout_ns)


def _training_since(rec: RankState, watch: Watch) -> int:
    """Daemon clock (ns) from which training rank ``rec``'s progress timeout counts."""
    return max(
        rec.phase_since_ns, watch.long_phase_ended_ns, rec.step_advanced_ns or 0, watch.acted_ns
    )


def _stopped_ns(rec: RankState, watch: Watch) -> int:
    """Daemon clock (ns) at which training rank ``rec`` last progressed, to compare with the
    other ranks: as :func:`_training_since`, with its step's completion as the rank dated it
    (``RankState.step_done_ns``) rather than as it reached the bus."""
    return max(rec.phase_since_ns, watch.long_phase_ended_ns, rec.step_done_ns or 0, watch.acted_ns)


def least_deadline_ns(config: MachineConfig) -> int:
    """The shortest time (ns) from a moment when deadlines restart (the last declared phase
    ended, the generation's resume reached the bus) to any deadline that can follow."""
    return min(
        config.progress_floor_ns, config.startup_allowance_ns, *config.phase_limits_ns.values()
    )


def lower_due(watch: Watch, deadline: int | None) -> Watch:
    """``watch`` with its deadline bound lowered to ``deadline`` if that is earlier."""
    due = watch.progress_due_ns
    if deadline is None or (due is not None and due <= deadline):
        return watch
    return watch._replace(progress_due_ns=deadline)


def rank_changed(
    watch: Watch,
    prev: RankState | None,
    rec: RankState,
    clock: int,
    trend: Trend,
    config: MachineConfig,
) -> Watch:
    """Account for ``rec`` replacing ``prev``: the count of ranks in declared phases, the time
    the last one ended, and the deadline bound."""
    was_long = prev is not None and prev.status == "alive" and prev.phase in LONG_PHASES
    is_long = rec.status == "alive" and rec.phase in LONG_PHASES
    if was_long != is_long:
        count = watch.long_phases + (1 if is_long else -1)
        watch = watch._replace(long_phases=count)
        if count == 0:
            # Training deadlines resume from now; none can be earlier than the shortest
            # timeout after now.
            watch = lower_due(
                watch._replace(long_phase_ended_ns=clock), clock + least_deadline_ns(config)
            )
    return lower_due(watch, stall_deadline(rec, watch, trend, config))


def scan_stalls(state: JobState, config: MachineConfig) -> tuple[JobState, Failure | None]:
    """Look at every rank (O(n), amortised over the heartbeats since the last scan): name the
    stalled ones, else set the deadline bound to the earliest deadline."""
    clock, watch, trend = state.clock_ns, state.watch, state.trend
    in_phase: list[RankState] = []
    stalled = False
    # Training ranks due within one more heartbeat interval: they stopped with the stalled
    # ones (a step's end is seen up to one interval late), so the incident names them too.
    due: list[RankState] = []
    # Every training rank with a deadline, for attribution: in a collective every rank waits
    # for the stuck one and they all stopped at about the same time, so the incident also
    # names each rank whose last progress is within a heartbeat interval of the earliest,
    # whether its own deadline (longer during start-up steps) is near or not.
    training: list[RankState] = []
    nearest: int | None = None
    for rec in state.ranks.values():
        deadline = stall_deadline(rec, watch, trend, config)
        if deadline is None:
            continue
        if clock <= deadline:
            nearest = deadline if nearest is None else min(nearest, deadline)
        if rec.phase in LONG_PHASES:
            if clock > deadline:
                in_phase.append(rec)
            continue
        training.append(rec)
        stalled = stalled or clock > deadline
        if deadline <= clock + config.heartbeat_interval_ns:
            due.append(rec)
    if in_phase:
        return state, _phase_failure(state, sorted(in_phase, key=_rank_of), config)
    if stalled:
        window = min(_stopped_ns(rec, watch) for rec in training) + config.heartbeat_interval_ns
        first = [rec for rec in training if _stopped_ns(rec, watch) <= window]
        return state, _progress_failure(state, due, sorted(first, key=_rank_of), config)
    return structs.replace(state, watch=watch._replace(progress_due_ns=nearest)), None


def _rank_of(rec: RankState) -> int:
    return rec.rank


def _phase_failure(state: JobState, ranks: list[RankState], config: MachineConfig) -> Failure:
    clock = state.clock_ns
    worst = max(ranks, key=lambda rec: clock - rec.phase_since_ns)
    phase = worst.phase or "init"
    limit = config.phase_limits_ns[phase]
    spent = clock - worst.phase_since_ns
    phases = ", ".join(sorted({str(rec.phase) for rec in ranks}))
    reason = (
        f"{ranks_text(rec.rank for rec in ranks)} on {hosts_text(rec.host for rec in ranks)} "
        f"stayed in declared phase {phases} for up to {seconds_text(spent)} (limit of "
        f"{phase}: {seconds_text(limit)}) in generation {state.generation}"
        f"{steps_text(rec.step for rec in ranks)}"
    )
    measures = Measures(phase=phase, in_phase_s=spent / _NS_PER_S, limit_s=limit / _NS_PER_S)
    return Failure(
        "phase_timeout",
        reason,
        tuple(rec.rank for rec in ranks),
        tuple(rec.host for rec in ranks),
        measures=measures,
    )


def _progress_failure(
    state: JobState, stalled: list[RankState], first: list[RankState], config: MachineConfig
) -> Failure:
    """The stall of the ranks past their deadline or due within a heartbeat interval
    (``stalled``, the first of them past it), naming them and ``first``, the training ranks
    whose last progress is within a heartbeat interval of the earliest; its reason says
    whether each named rank went on heartbeating (see the module docstring)."""
    clock, watch, trend = state.clock_ns, state.watch, state.trend

    def since_of(rec: RankState) -> int:
        return _training_since(rec, watch)

    def stopped_of(rec: RankState) -> int:
        return _stopped_ns(rec, watch)

    ranks = sorted({rec.rank: rec for rec in (*stalled, *first)}.values(), key=_rank_of)
    timeout = progress_timeout_ns(min(stalled, key=since_of), trend, config)
    longest = clock - min(map(since_of, ranks))
    quantile_s = trend.step_time_quantile_s
    if timeout == trend.progress_timeout_ns and quantile_s is not None:
        how = (
            f"adaptive: {config.progress_factor:g} x p{config.progress_quantile * 100:g} step "
            f"time {number_text(quantile_s)} s over {trend.step_times.filled} samples, within "
            f"[{seconds_text(config.progress_floor_ns)}, {seconds_text(config.progress_ceiling_ns)}]"
        )
    else:
        how = f"start-up allowance during the first {config.startup_steps} steps"
    # A rank that heartbeats was heard within an interval, plus the delivery's jitter and the
    # tick that scans: one more interval allows for those and for one late heartbeat. Longer,
    # it missed a heartbeat and may have stopped sending at all (stopped, cut off): the
    # progress deadline can pass before the heartbeat timeout does.
    silent = [rec for rec in ranks if clock - rec.last_heard_ns > 2 * config.heartbeat_interval_ns]
    quiet = max((clock - rec.last_heard_ns for rec in silent), default=0)
    if len(first) > 1:
        mute = {rec.rank for rec in silent}
        if all(rec.rank in mute for rec in first):
            # Silent together: not a collective's wait (whose ranks go on heartbeating), but
            # processes gone or frozen together: a lost node, a killed supervisor, a pause.
            usually = (
                "ranks that stop and go silent together are usually gone or frozen together "
                "(a lost node or supervisor, a paused process group), not waiting in a collective"
            )
        else:
            usually = (
                "ranks that stop together are usually all waiting in a collective for one "
                "stuck rank, which heartbeats cannot tell apart"
            )
        together = (
            f"; {ranks_text(rec.rank for rec in first)} stopped within a heartbeat interval "
            f"of each other: {usually}"
        )
    elif len(ranks) > 1:
        together = f"; rank {first[0].rank} stopped first"
    else:
        together = ""
    whom = f"{ranks_text(rec.rank for rec in ranks)} on {hosts_text(rec.host for rec in ranks)}"
    why = (
        f"(progress timeout {seconds_text(timeout)}, {how}, plus a heartbeat interval of "
        f"{seconds_text(config.heartbeat_interval_ns)})"
    )
    where = f"in generation {state.generation}{steps_text(rec.step for rec in ranks)}{together}"
    if not silent:
        did = f"kept heartbeating without completing a step for up to {seconds_text(longest)}"
        reason = f"{whom} {did} {why} {where}"
    else:
        who = "" if len(silent) == len(ranks) else f"{ranks_text(rec.rank for rec in silent)} "
        reason = (
            f"{whom} completed no step for up to {seconds_text(longest)} {why}, and {who}sent "
            f"nothing for up to {seconds_text(quiet)}, {where}"
        )
    measures = Measures(
        stalled_s=longest / _NS_PER_S,
        timeout_s=timeout / _NS_PER_S,
        step_time_quantile_s=quantile_s if quantile_s is not None else "none",
        quantile=config.progress_quantile,
        factor=config.progress_factor,
        samples=trend.step_times.filled,
        stopped_within_s=(max(map(stopped_of, first)) - min(map(stopped_of, first))) / _NS_PER_S,
        # Only when a named rank went silent: the measures of a stall where every rank
        # heartbeats stay as recorded before.
        **({"silent_s": quiet / _NS_PER_S} if silent else {}),
    )
    return Failure(
        "progress_timeout",
        reason,
        tuple(rec.rank for rec in ranks),
        tuple(rec.host for rec in ranks),
        measures=measures,
    )


def straggler(
    prev: RankState, seconds: float, trend: Trend, generation: int, config: MachineConfig
) -> tuple[float, int, bool, Anomaly | None]:
    """Fold a sampled step time (seconds) of rank ``prev`` into its average and compare it with
    the job's median step time.

    Returns:
        The new average (s), sample count and straggling flag, and an :class:`Anomaly` when
        the rank just became a straggler: its average exceeds ``straggler_factor`` times the
        job's median after at least ``straggler_min_reports`` samples. It is reported once
        until the average falls back under the threshold.
    """
    alpha = config.straggler_alpha
    samples = prev.step_time_samples + 1
    # The bias-corrected exponential average (as Adam's moments, Kingma & Ba 2015, section 3):
    # the gain falls from 1 to alpha, so the first samples weigh no more than later ones. Seeded
    # with the first sample and weighted alpha from then on, one slow first step held a rank's
    # average above the factor for its first dozen samples: a false straggler at a noisy pace.
    gain = alpha / (1.0 - (1.0 - alpha) ** samples)
    average = (
        seconds
        if prev.step_time_s is None
        else prev.step_time_s + gain * (seconds - prev.step_time_s)
    )
    typical = trend.step_time_median_s
    if typical is None or samples < config.straggler_min_reports:
        return average, samples, False, None
    slow = average > config.straggler_factor * typical
    if not slow or prev.straggling:
        return average, samples, slow, None
    reason = (
        f"rank {prev.rank} on host {prev.host} is a straggler: its average step time "
        f"{number_text(average)} s exceeds {config.straggler_factor:g} x the job's median "
        f"{number_text(typical)} s in generation {generation} at step {prev.step}"
    )
    anomaly = Anomaly(
        kind="straggler",
        reason=reason,
        ranks=(prev.rank,),
        hosts=(prev.host,),
        measures=Measures(
            step_time_s=average,
            median_step_time_s=typical,
            factor=config.straggler_factor,
            samples=samples,
        ),
    )
    return average, samples, True, anomaly
