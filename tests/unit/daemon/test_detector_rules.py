"""The rules of issue 12 on the pure state machine, one failing input each (synthetic, 1 Hz
heartbeats per rank, default settings unless stated): time after a backlog, silence in a
declared phase, the rank that stopped first, step lag at equal times and before ``ready()``,
and loss spikes that heal themselves (``docs/detection.md``). The spike detector's false-alarm
rates are property tests: ``tests/properties/test_spike_false_alarms.py``."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import replace

import pytest

from tests.support.machine_scenarios import (
    T0,
    S,
    Sim,
    acted,
    config,
    issued,
    of_type,
    pulses,
    run,
)
from tests.support.traces import Faults, Job, Pace, drive, every, opened, simulate
from trainguard.daemon.core._decisions import (
    Anomaly,
    Committed,
    Decision,
    IncidentClosed,
    IncidentOpened,
    Issue,
    Rejected,
    Transition,
)
from trainguard.daemon.core._inputs import Input, Observed, Tick
from trainguard.daemon.core._machine import decide, next_deadline, unacted_command
from trainguard.daemon.core._state import JobState
from trainguard.schemas import Restore, Resume, StepRange

CFG = config()
MINUTE = 60 * S


def story(decisions: Iterable[Decision]) -> list[tuple[object, ...]]:
    """What was decided, without the times: rejections left out (stale reports of an
    abandoned generation), commands by generation, attempt, target and skip."""
    out: list[tuple[object, ...]] = []
    for d in decisions:
        match d:
            case Issue(command=Restore() as r):
                target = None if r.target is None else r.target.snapshot_id
                out.append(("restore", r.generation, r.attempt, target, r.skip))
            case Issue(command=command):
                out.append((type(command).__name__.lower(), command.generation))
            case IncidentOpened():
                out.append(("incident", d.cause, d.ranks, d.onset_after_step))
            case IncidentClosed():
                out.append(("closed", d.incident_id, d.outcome, d.attempts))
            case Transition():
                out.append(("transition", d.old, d.new, d.generation))
            case Committed():
                out.append(("committed", d.manifest.snapshot_id))
            case Rejected():
                pass
            case _:
                out.append((d.KIND,))
    return out


def sent_at(item: Observed, ts: int) -> Observed:
    """``item`` as sent at ``ts`` by its sender's clock (appended at ``item.at_ns``)."""
    return item._replace(event=replace(item.event, ts=ts))


def fold_as_shell(
    inputs: Iterable[Input], state: JobState | None = None, *, published: bool = True
) -> tuple[JobState, list[Decision]]:
    """Fold ``inputs`` and, as the daemon's shell does once it published a command (when
    ``published``), a tick naming it right after the input that issued it."""
    state, decisions = run([], state)
    collected = list(decisions)
    for item in inputs:
        state, decided = run([item], state)
        collected += decided
        if published and unacted_command(state) is not None:
            state, decided = run([acted(state, state.clock_ns)], state)
            collected += decided
    return state, collected


# -- 3. time after a backlog -------------------------------------------------------------------


def nan_job(sim: Sim, *, until: int, nan_step: int, start: int = T0) -> list[Input]:
    """A 2-rank job: 1 s steps, every rank heartbeating each step, a shard every 10 steps; the
    loss turns NaN at ``nan_step`` on rank 1 and on every rank after it (the all-reduce), and
    the ranks keep training and checkpointing: they never heard of a restore. Steps up to
    ``until``."""
    inputs: list[Input] = list(sim.start(start))
    for step in range(until + 1):
        at = start + S + step * S
        for r in range(sim.world_size):
            bad = step > nan_step or (step == nan_step and r == 1)
            loss = math.nan if bad else 2.0 + 0.02 * ((step * 7) % 5)
            inputs.append(sim.heartbeat(r, step, at + r * 1_000_000, loss=loss))
        if step and step % 10 == 0:
            inputs += [sim.checkpoint(r, step, at + S // 2 + r) for r in range(sim.world_size)]
    return inputs


def recovered(sim: Sim, state: JobState, at: int) -> list[Input]:
    """The restarted ranks of ``state``'s restore start, heartbeat and acknowledge at ``at``."""
    assert state.incident is not None
    restore = Restore(
        job_id=state.job_id,
        generation=state.generation,
        ts=0,
        seq=state.command_seq,
        daemon_id=CFG.daemon_id,
        incident_id=state.incident.incident_id,
        reason="-",
        target=state.incident.target,
    )
    return sim.recover(restore, at)


def test_a_daemon_back_from_ten_minutes_away_decides_what_it_would_have_decided() -> None:
    """The daemon is away from minute 1 to minute 11; a NaN appears at minute 1.5 and the
    ranks, told nothing, keep training and committing. Back, it folds the backlog: the restore
    it decides from the NaN is published now, so its timeout counts from now. One restore,
    one resume, as with a daemon that was up all along; no retry, no generation skipped."""
    away_from, back_at, nan_step = T0 + MINUTE, T0 + 11 * MINUTE, 90
    steps = (back_at - T0) // S - 2

    # Up all along: it ticks, acts on the NaN at once; the ranks restart 5 s later.
    sim = Sim(world_size=2)
    job = nan_job(sim, until=steps, nan_step=nan_step)
    nan_at = T0 + S + nan_step * S + 1_000_000  # rank 1's heartbeat
    up, up_decisions = fold_as_shell(i for i in job if i.at_ns <= nan_at)
    assert up.phase == "restoring"
    up, more = fold_as_shell(recovered(sim, up, nan_at + 5 * S), up)
    up_decisions += more

    # Away: no tick for ten minutes; the backlog is folded when it comes back, the restore is
    # published then, and only then can the ranks restart.
    sim = Sim(world_size=2)
    job = nan_job(sim, until=steps, nan_step=nan_step)
    before = [i for i in job if i.at_ns < away_from]
    backlog = [i for i in job if i.at_ns >= away_from]
    state, decisions = fold_as_shell(before, published=True)
    state, decided = fold_as_shell(backlog, state, published=False)
    decisions += decided
    assert state.phase == "restoring"
    # Back: the shell publishes the restore and appends the tick naming it.
    waiting = state
    state, decided = fold_as_shell([acted(state, back_at)], state)
    decisions += decided
    assert not issued(decided, Restore)  # the old code retried here (restore_timeout)
    assert unacted_command(waiting) == waiting.command_seq == 1
    assert next_deadline(waiting, CFG) is None  # no restore timeout before it is out
    assert next_deadline(state, CFG) == back_at + CFG.restore_timeout_ns + 1
    state, decided = fold_as_shell(recovered(sim, state, back_at + 5 * S), state)
    decisions += decided

    # Away, the daemon wrote no tick: the backlog's reports of generation 0 are stale, so its
    # tick naming the restore is the job's first input after a gap of nine minutes, which the
    # machine records; no time it judges includes that gap (the restore times out from then).
    [gap] = [d for d in decisions if isinstance(d, Anomaly)]
    assert gap.kind == "bus_gap"
    assert story(d for d in decisions if d is not gap) == story(up_decisions)
    [restore] = issued(decisions, Restore)
    assert (restore.generation, restore.attempt) == (1, 1)
    assert restore.target is not None
    assert restore.target.snapshot_id == "job/g0/s80"
    [resume] = issued(decisions, Resume)
    assert resume.generation == 1
    assert state.phase == "running"
    # The backlog's reports of generation 0 after the NaN are stale, and nothing more.
    assert {d.code for d in of_type(decisions, Rejected)} == {"stale_generation"}


def test_the_restore_timeout_counts_from_the_tick_naming_the_restore() -> None:
    """Ticks that do not name the restore (written before it was published, or by an old
    daemon) start no restore timeout; the first tick naming it does; nobody acknowledging,
    the retry comes a restore timeout after that tick and is named in turn."""
    sim = Sim(world_size=2)
    job = nan_job(sim, until=40, nan_step=30)
    state, _ = run(job)
    assert state.phase == "restoring"
    decided_at = state.clock_ns
    late = decided_at + 30 * MINUTE
    state, decisions = run([Tick(late), Tick(late + S, 0)], state)
    assert [d.kind for d in of_type(decisions, Anomaly)] == ["bus_gap"]  # away 30 minutes
    assert len(decisions) == 1
    assert unacted_command(state) == 1
    state, decisions = run([Tick(late + 2 * S, 1)], state)
    assert decisions == ()
    assert state.watch.acted_ns == late + 2 * S
    due = late + 2 * S + CFG.restore_timeout_ns
    state, decisions = run([*pulses(state, due), Tick(due)], state)
    assert decisions == ()
    state, decisions = run([Tick(due + 1)], state)
    [retry] = issued(decisions, Restore)
    assert (retry.generation, retry.attempt) == (2, 2)
    assert "not acknowledged within 120 s" in retry.reason
    assert unacted_command(state) == 2
    # A tick naming a command the machine never issued counts as its latest one.
    state, _ = run([Tick(due + 2, 99)], state)
    assert (state.watch.acted_seq, state.watch.acted_ns) == (2, due + 2)


def test_no_stall_deadline_runs_before_the_resume_is_on_the_bus() -> None:
    """The ranks wait for the resume in phase ``init``: a daemon that decided it from the last
    acknowledgement of a backlog but publishes it 25 minutes later (past the init limit) has
    no stall to judge; the ranks' deadlines count from the tick that shows the resume out."""
    sim = Sim(world_size=2)
    job = nan_job(sim, until=40, nan_step=30)
    state, _ = fold_as_shell(job)
    acks_at = state.clock_ns + 5 * S
    state, decisions = fold_as_shell(recovered(sim, state, acks_at), state, published=False)
    [resume] = issued(decisions, Resume)
    assert state.watch.held
    waiting = [
        sim.heartbeat(r, resume.step, acks_at + k * S, phase="init", loss=None)
        for k in range(1, 25 * 60)
        for r in (0, 1)
    ]
    state, waited = run(waiting, state)
    assert waited == ()
    back = acks_at + 25 * MINUTE
    state, ticked = run([acted(state, back)], state)
    assert ticked == ()
    assert not state.watch.held
    # Still waiting in init after the resume is out: the init limit counts from the tick.
    still = [
        sim.heartbeat(r, resume.step, back + k * S, phase="init", loss=None)
        for k in range(1, 21 * 60)
        for r in (0, 1)
    ]
    _, folded = drive(still, state, first_incident=True)
    [(at, incident)] = opened(folded)
    assert incident.cause == "phase_timeout"
    assert back + CFG.phase_limits_ns["init"] < at <= back + CFG.phase_limits_ns["init"] + S


# -- 4. declared phases bound silence ----------------------------------------------------------


def test_a_rank_silent_in_a_declared_phase_is_bounded_by_its_limit_not_the_heartbeat_timeout() -> (
    None
):
    """Rank 0 declares ``checkpoint`` after step 40 and sends nothing for 10 minutes (a save
    holding the GIL); rank 1 waits for it, heartbeating. No incident until the checkpoint
    limit (900 s) passes: then a phase timeout naming rank 0."""
    sim = Sim(world_size=2)
    state, _ = run([*sim.start(T0), *sim.train(range(41), start=T0 + S)])
    saving = T0 + 42 * S
    state, _ = run([sim.heartbeat(0, 40, saving, phase="checkpoint")], state)
    waiting = [sim.heartbeat(1, 40, saving + k * S) for k in range(1, 10 * 60)]
    state, folded = drive(waiting, state)
    assert opened(folded) == []  # the old code: heartbeat_timeout of rank 0 after 10 s
    state, folded = drive(
        [sim.heartbeat(1, 40, saving + k * S) for k in range(10 * 60, 16 * 60)], state
    )
    [(at, incident)] = opened(folded)
    assert incident.cause == "phase_timeout"
    assert incident.ranks == (0,)
    assert saving + CFG.phase_limits_ns["checkpoint"] < at <= saving + 901 * S


def test_the_death_of_a_rank_in_a_declared_phase_is_its_supervisors_report() -> None:
    sim = Sim(world_size=2)
    state, _ = run([*sim.start(T0), *sim.train(range(41), start=T0 + S)])
    state, _ = run([sim.heartbeat(0, 40, T0 + 42 * S, phase="checkpoint")], state)
    state, decisions = run([sim.kill(0, T0 + 50 * S)], state)
    [incident] = of_type(decisions, IncidentOpened)
    assert (incident.cause, incident.ranks) == ("exited", (0,))


# -- 5. the rank that stopped first ------------------------------------------------------------


def test_a_collective_hang_names_the_rank_whose_report_came_late() -> None:
    """Four ranks complete step 39 together and hang (rank 0 stuck, the others waiting for it
    in the collective). Rank 0's heartbeat happens to come 0.9 s after the step, late on the
    bus by 0.3 s more; the others' come at once. Dated by the heartbeats' step ages, every
    rank stopped at the same time: all four are named (the old code left rank 0 out)."""
    sim = Sim()
    state, _ = run([*sim.start(T0), *sim.train(range(39), start=T0 + S)])
    done = T0 + 40 * S  # step 39 completes on every rank
    beats: list[Input] = []
    for k in range(12):
        for r in range(4):
            sent = done + k * S + (9 * S // 10 if r == 0 else S // 20)
            arrives = sent + (3 * S // 10 if r == 0 else 0)
            beats.append(sent_at(sim.heartbeat(r, 39, arrives, step_age_s=(sent - done) / S), sent))
    beats.sort(key=lambda i: i.at_ns)
    _, folded = drive(beats, state, first_incident=True)
    [(_, incident)] = opened(folded)
    assert incident.cause == "progress_timeout"
    assert incident.ranks == (0, 1, 2, 3)
    assert "stopped within a heartbeat interval of each other" in incident.reason
    # Rank 0's report came 0.3 s late on the bus; dated by its sending (its delay beyond the
    # least one of its heartbeats), its step completed with the others'.
    assert incident.measures["stopped_within_s"] == pytest.approx(0.0)


@pytest.mark.parametrize("seed", range(12))
def test_a_synchronous_hang_always_names_every_rank(seed: int) -> None:
    """``hang@step=210,rank=0`` in a 4-rank synchronous job: every rank reports step 210 and
    the heartbeats cannot tell the stuck rank from those waiting for it, so every rank whose
    last progress is within a heartbeat interval of the earliest is named, rank 0 among them,
    whatever the heartbeats' phases, jitter and bus delays."""
    job = Job(
        steps=300,
        pace=Pace("constant", 0.25),
        jitter_s=0.45,
        delay_s=0.3,
        faults=Faults(hang_after=210),
        tail_s=30,
        seed=seed,
    )
    _, folded = drive(simulate(job).inputs, first_incident=True)
    [(_, incident)] = opened(folded)
    assert incident.cause == "progress_timeout"
    assert incident.ranks == (0, 1, 2, 3)


def test_a_rank_that_stopped_first_is_named_though_its_own_deadline_is_later() -> None:
    """Rank 2 stops at step 3, within its start-up steps (judged by the 600 s start-up
    allowance); ranks 0 and 1 train on to step 20 (by then judged by the adaptive 5 s) and
    stop there. When their deadline passes, rank 2, whose last progress is the earliest, is
    named with them (the old code named ranks 0 and 1 only)."""
    sim = Sim(world_size=3)
    inputs: list[Input] = list(sim.start(T0))
    for k in range(31):
        at = T0 + S + k * S
        inputs += [sim.heartbeat(r, min(k, 3 if r == 2 else 20), at + r) for r in range(3)]
    _, folded = drive(inputs, first_incident=True)
    [(at, incident)] = opened(folded)
    assert incident.cause == "progress_timeout"
    assert incident.ranks == (0, 1, 2)
    assert "rank 2 stopped first" in incident.reason
    assert at < T0 + 30 * S  # ranks 0 and 1's deadline, long before rank 2's


def test_a_lone_stall_names_only_the_rank_that_stopped() -> None:
    sim = Sim()
    state, _ = run([*sim.start(T0), *sim.train(range(40), start=T0 + S)])
    lone = [
        sim.heartbeat(r, 39 if r == 2 else 40 + k, T0 + (41 + k) * S + r)
        for k in range(10)
        for r in range(4)
    ]
    _, folded = drive(lone, state, first_incident=True)
    [(_, incident)] = opened(folded)
    assert incident.ranks == (2,)
    assert "collective" not in incident.reason


# -- 6. step lag at equal times ----------------------------------------------------------------


def test_a_fast_job_whose_heartbeats_are_a_second_apart_shows_no_lag() -> None:
    """2 ranks at about 150 steps/s, heartbeats 1 s apart and out of phase (rank 1's come
    0.7 s after rank 0's): a report of rank 1 shows about 100 steps more than rank 0's last
    one, taken 0.7 s earlier. No incident (the old code restored it for step_lag)."""
    sim = Sim(world_size=2)
    inputs: list[Input] = list(sim.start(T0))
    rate = 150
    for k in range(120):
        for r, offset in ((0, 0), (1, 7 * S // 10)):
            at = T0 + S + k * S + offset
            step = (at - T0 - S) * rate // S
            inputs.append(sim.heartbeat(r, step, at, step_time_s=1 / rate))
    _, folded = drive(inputs)
    assert opened(folded) == []


def test_a_heartbeat_that_reaches_the_bus_late_is_allowed_its_delay() -> None:
    """A fast job (200 steps/s) whose rank 1 heartbeat sat 0.8 s in its agent's queue while
    the bus was slow: its step is 160 steps old when it lands. No lag; a rank really behind
    is still caught at its next heartbeat."""
    sim = Sim(world_size=2)
    inputs: list[Input] = list(sim.start(T0))
    rate = 200
    for k in range(60):
        at = T0 + S + k * S
        for r in (0, 1):
            inputs.append(sim.heartbeat(r, k * rate, at + r * S // 10, step_time_s=1 / rate))
    queued = sim.heartbeat(1, 60 * rate, T0 + 61 * S + S // 2, step_time_s=1 / rate)
    inputs += [
        sim.heartbeat(0, 61 * rate, T0 + 61 * S + S // 3, step_time_s=1 / rate),
        sent_at(queued, queued.at_ns - 8 * S // 10),
    ]
    state, folded = drive(inputs)
    assert opened(folded) == []
    behind = sim.heartbeat(1, 61 * rate - 300, T0 + 62 * S, step_time_s=1 / rate)
    state, decisions = run([behind], state)
    [incident] = of_type(decisions, IncidentOpened)
    assert (incident.cause, incident.ranks) == ("step_lag", (1,))


def test_heartbeats_before_ready_are_no_steps() -> None:
    """A 2-rank job started from another job's snapshot of step 147: rank 0 is ready and
    training while rank 1 still loads it, heartbeating step 0 in phase ``init``. No lag (the
    old code restored it at once: "rank 1 at step 0 trail the lead step 147"), and the
    generation starts from step 147: its start-up steps and its known-good step."""
    sim = Sim(world_size=2)
    inputs: list[Input] = list(sim.start(T0))
    inputs += [sim.heartbeat(r, 0, T0 + S + r, phase="init", loss=None) for r in (0, 1)]
    inputs.append(sim.heartbeat(0, 147, T0 + 2 * S, phase="init", loss=None))  # ready(147)
    for k in range(1, 30):
        at = T0 + (2 + k) * S
        inputs.append(sim.heartbeat(0, 147 + k, at))
        if k < 20:  # still loading the snapshot
            inputs.append(sim.heartbeat(1, 0, at + 1, phase="init", loss=None))
        elif k == 20:  # ready(147)
            inputs.append(sim.heartbeat(1, 147, at + 1, phase="init", loss=None))
        else:
            inputs.append(sim.heartbeat(1, 147 + k - 20, at + 1))
    state, folded = drive(inputs)
    assert opened(folded) == []
    assert state.phase == "running"
    assert state.watch.base_step == 147
    assert state.ranks[0].first_step == 147
    assert state.ranks[1].first_step == 147


# -- 7. loss spikes that heal themselves -------------------------------------------------------


def noisy(seed: int = 7) -> Callable[[int], float]:
    """Loss 3.0 +- 0.05 (seeded Gaussian noise), one value per step."""
    rng = random.Random(seed)
    values = [3.0 + rng.gauss(0.0, 0.05) for _ in range(2000)]
    return lambda step: values[step]


def spiking(base: Callable[[int], float], spike: dict[int, float]) -> Callable[[int], float]:
    return lambda step: spike.get(step, base(step))


def spike_job(loss: Callable[[int], float], steps: int = 600) -> list[Input]:
    """2 ranks, 1 s steps, both heartbeating every step with ``loss(step)``, a commit every
    100 steps."""
    sim = Sim(world_size=2)
    return [
        *sim.start(T0),
        *sim.train(range(steps), start=T0 + S, checkpoint_every=100, loss=loss),
    ]


def test_a_short_spike_that_heals_itself_is_reported_not_restored() -> None:
    loss = spiking(noisy(), {510: 8.0, 511: 6.0, 512: 4.5, 513: 3.5, 514: 3.1})
    _, folded = drive(spike_job(loss))
    assert opened(folded) == []  # the old code restored it: 4 samples at z >= 3
    assert issued(every(folded), Restore) == []
    [blip] = of_type(every(folded), Anomaly)
    assert blip.kind == "loss_blip"
    assert blip.measures["first_step"] == 510


def test_a_lasting_spike_restores_before_it_and_skips_from_its_first_sample() -> None:
    """Loss 8.0 or more from step 510 on, for twice the loss window: one incident, restore
    of generation 1 to step 500, skipping from step 510 (the last normal loss was at step
    509: its batch trained normally; the old code skipped from 509)."""
    rng = random.Random(3)
    high = {s: 8.0 + abs(rng.gauss(0.0, 0.5)) for s in range(510, 510 + 2 * CFG.loss_window)}
    _, folded = drive(spike_job(spiking(noisy(), high)))
    [(_, incident)] = opened(folded)
    assert incident.cause == "loss_spike"
    assert incident.measures["first_step"] == 510
    assert incident.onset_after_step == 508  # parameters after 508 gave the normal loss of 509
    [restore] = issued(every(folded), Restore)
    assert restore.generation == 1
    assert restore.target is not None
    assert restore.target.step == 500
    assert restore.skip == StepRange(from_step=510, to_step=510 + CFG.loss_spike_persist - 1)


def test_a_spike_that_falls_back_too_slowly_is_restored_at_the_heal_limit() -> None:
    """A spike that halves at once but then stays above the return threshold: healing, so
    not restored after 4 samples; restored after ``loss_spike_heal_samples``."""
    slow = {510: 8.0, **{s: 4.0 for s in range(511, 560)}}
    _, folded = drive(spike_job(spiking(noisy(), slow)))
    [(_, incident)] = opened(folded)
    assert incident.cause == "loss_spike"
    assert incident.measures["samples"] == CFG.loss_spike_heal_samples
    assert incident.measures["healing"] is True
    [restore] = issued(every(folded), Restore)
    assert restore.skip == StepRange(from_step=510, to_step=510 + CFG.loss_spike_heal_samples - 1)


def test_a_spike_that_climbs_again_while_healing_is_restored_at_once() -> None:
    swinging = {510: 8.0, 511: 4.0, 512: 3.8, 513: 3.6, 514: 3.7, 515: 9.0}
    _, folded = drive(spike_job(spiking(noisy(), swinging)))
    [(at, incident)] = opened(folded)
    assert incident.measures["samples"] == 6
    assert incident.measures["healing"] is False
    assert at < T0 + 517 * S


def test_the_heal_limit_is_checked() -> None:
    with pytest.raises(ValueError, match="loss_spike_heal_samples"):
        config(loss_spike_heal_samples=3)


# -- 8. the loss-spike detector's settings, and ticks ----------------------------------------------


@pytest.mark.parametrize("value", [0.0, 1e-13, 0.02, math.nan, -1e-7])
def test_the_spike_false_alarm_rate_is_checked(value: float) -> None:
    with pytest.raises(ValueError, match="loss_spike_false_alarm"):
        config(loss_spike_false_alarm=value)


def test_decide_folds_ticks_naming_commands_in_order() -> None:
    """A tick naming a command lower than one already seen changes nothing."""
    sim = Sim(world_size=2)
    state, _ = fold_as_shell(nan_job(sim, until=40, nan_step=30))
    before = state
    state, decisions = decide(state, Tick(state.clock_ns, 0), CFG)
    assert decisions == ()
    assert state.watch == before.watch
