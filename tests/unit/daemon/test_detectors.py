"""Example tests of the detectors, the restore target rule, the crash-loop guard and in-process
restores: one scenario each, faults as data (see ``docs/detection.md``)."""

from __future__ import annotations

import math

import pytest

from tests.support.machine_scenarios import (
    T0,
    S,
    Sim,
    acted,
    config,
    issued,
    killed_job,
    of_type,
    run,
    running_job,
    two_ranks_training,
)
from tests.support.traces import (
    Faults,
    Job,
    Pace,
    PhaseSpec,
    drive,
    every,
    opened,
    progress_bound_ns,
    simulate,
)
from trainguard.daemon.core._decisions import (
    Anomaly,
    Committed,
    IncidentClosed,
    IncidentOpened,
    Issue,
    JobFailed,
)
from trainguard.daemon.core._inputs import Input
from trainguard.daemon.core._machine import next_deadline
from trainguard.daemon.core._state import JobState
from trainguard.schemas import Abort, Restore, Resume, StepRange

CFG = config()


def wobble(step: int) -> float:
    """A healthy loss: 2.0 with a small deterministic wobble (so its MAD is not zero)."""
    return 2.0 + 0.02 * ((step * 7) % 5)


# -- stalls ------------------------------------------------------------------------------------


def test_a_fast_job_that_hangs_is_caught_within_ten_seconds() -> None:
    job = Job(steps=400, pace=Pace("constant", 0.25), faults=Faults(hang_after=200), tail_s=60)
    trace = simulate(job)
    _, folded = drive(trace.inputs, first_incident=True)
    [(at, incident)] = opened(folded)
    assert incident.cause == "progress_timeout"
    assert trace.ends[200] + 5 * S < at <= trace.ends[200] + 10 * S
    assert incident.measures["timeout_s"] == 5.0  # 3 x 0.25 s, floored
    assert incident.onset_after_step is None  # a hang: any committed snapshot will do
    assert "kept heartbeating without completing a step" in incident.reason


def test_a_slow_job_is_not_caught_but_its_hang_is() -> None:
    job = Job(
        world_size=2,
        steps=60,
        pace=Pace("lognormal", 60.0, spread=0.1),
        faults=Faults(hang_after=40),
        tail_s=400,
    )
    trace = simulate(job)
    _, folded = drive(trace.inputs, first_incident=True)
    [(at, incident)] = opened(folded)
    assert incident.cause == "progress_timeout"
    assert trace.ends[40] + 120 * S < at <= trace.ends[40] + progress_bound_ns(job, CFG)


def test_the_first_steps_after_start_use_the_startup_allowance() -> None:
    """Compilation makes the first steps of a 0.25 s/step job take minutes each: no incident;
    once the job runs at its pace, a stall of 5 s is one."""
    sim = Sim(world_size=2)
    inputs: list[Input] = list(sim.start(T0))
    ends = [T0 + 300 * S * k for k in range(1, 6)]  # steps 1-5: 300 s each
    ends += [ends[-1] + S // 4 * k for k in range(1, 200)]  # then 0.25 s each
    at, step = T0, 0
    while at < ends[-1] + 8 * S:  # heartbeats every second; the job hangs after its last step
        at += S
        while step < len(ends) and ends[step] <= at:
            step += 1
        seconds = 300.0 if step <= 5 else 0.25
        inputs += [sim.heartbeat(r, step, at + r, step_time_s=seconds) for r in (0, 1)]
    state, folded = drive(inputs, first_incident=True)
    [(when, incident)] = opened(folded)
    assert incident.cause == "progress_timeout"
    assert state.trend.progress_timeout_ns == 5 * S
    assert ends[-1] + 5 * S < when <= ends[-1] + 7 * S


def test_declared_phases_within_their_limits_are_no_stall() -> None:
    phases = (
        PhaseSpec(100, "checkpoint", 25.0),
        PhaseSpec(150, "eval", 120.0, ranks=(0,)),  # the others wait in a collective
        PhaseSpec(200, "data", 60.0),
    )
    job = Job(steps=300, pace=Pace("constant", 0.25), phases=phases)
    state, folded = drive(simulate(job).inputs)
    assert opened(folded) == []
    assert of_type(every(folded), Anomaly) == []
    assert state.phase == "finished"


def test_a_phase_beyond_its_limit_is_an_incident() -> None:
    job = Job(
        steps=300,
        pace=Pace("constant", 0.25),
        faults=Faults(stuck_in=(1, 100, "eval")),
        tail_s=2000,
    )
    trace = simulate(job)
    _, folded = drive(trace.inputs, first_incident=True)
    [(at, incident)] = opened(folded)
    [(_, _, start)] = trace.phase_starts
    assert incident.cause == "phase_timeout"
    assert (incident.ranks, incident.hosts) == ((1,), ("h0",))
    assert start + 1800 * S < at <= start + 1800 * S + S
    assert incident.measures["limit_s"] == 1800.0


def test_a_silent_rank_is_the_heartbeat_timeouts_case() -> None:
    sim = Sim()
    state, _ = running_job(sim, 40)
    quiet = [sim.heartbeat(r, 40 + k, T0 + (41 + k) * S) for k in range(12) for r in (0, 1, 3)]
    _, folded = drive(quiet, state)
    [(_, incident)] = opened(folded)
    assert incident.cause == "heartbeat_timeout"
    assert incident.ranks == (2,)


def test_ranks_that_stop_and_go_silent_together_are_not_said_to_wait_in_a_collective() -> None:
    """Every rank stops after step 39 and, two heartbeats later, sends nothing more (its
    supervisor killed, its node lost): the progress deadline passes before the heartbeat
    timeout, and the reason says what silence together usually is, not a collective's wait
    (whose ranks go on heartbeating)."""
    sim = Sim()
    state, _ = running_job(sim, 40)
    stopped = [
        sim.heartbeat(r, 39, T0 + (41 + k) * S + r * S // 5) for k in range(2) for r in range(4)
    ]
    _, folded = drive(stopped, state, until=T0 + 120 * S, first_incident=True)
    [(_, incident)] = opened(folded)
    assert incident.cause == "progress_timeout"
    assert incident.ranks == (0, 1, 2, 3)
    assert "gone or frozen together" in incident.reason
    assert "usually all waiting in a collective" not in incident.reason


def test_ranks_that_stop_together_are_all_named_and_a_lone_stall_only_itself() -> None:
    """In a collective every rank waits for the stuck one: all stop within a heartbeat of each
    other, and heartbeats cannot tell which one is stuck, so the incident names them all. A
    rank that stops while the others go on is named alone."""
    sim = Sim()
    state, _ = running_job(sim, 40)
    stopped = [
        sim.heartbeat(r, 39, T0 + (41 + k) * S + r * S // 5) for k in range(10) for r in range(4)
    ]
    _, folded = drive(stopped, state, first_incident=True)
    [(_, incident)] = opened(folded)
    assert incident.cause == "progress_timeout"
    assert incident.ranks == (0, 1, 2, 3)
    assert "waiting in a collective" in incident.reason

    sim = Sim()
    state, _ = running_job(sim, 40)
    lone = [
        sim.heartbeat(r, 39 if r == 2 else 40 + k, T0 + (41 + k) * S + r)
        for k in range(10)
        for r in range(4)
    ]
    _, folded = drive(lone, state, first_incident=True)
    [(_, incident)] = opened(folded)
    assert incident.cause == "progress_timeout"
    assert incident.ranks == (2,)
    assert "collective" not in incident.reason


@pytest.mark.parametrize(
    ("heartbeating", "words", "silent_s"),
    [
        ((0, 1), "kept heartbeating without completing a step for up to 6 s (", None),
        ((0,), "completed no step for up to 6 s (", 5.5),
        ((), "completed no step for up to 6 s (", 5.5),
    ],
)
def test_a_stall_s_reason_says_heartbeats_went_on_only_if_every_named_rank_was_heard(
    heartbeating: tuple[int, ...], words: str, silent_s: float | None
) -> None:
    """Both ranks complete step 41 at 42 s and report it at 42.5 s (step age 0.5 s), then
    stop: the deadline passes at 48 s, 5.5 s after their last heartbeat, before the heartbeat
    timeout (10 s). A rank that goes on heartbeating kept heartbeating; one that sent nothing
    since did not, and the reason says for how long it sent nothing (``silent_s``), naming it
    when the other one heartbeats."""
    sim = Sim(world_size=2)
    inputs = two_ranks_training(sim, 40)
    inputs += [sim.heartbeat(r, 41, T0 + 42 * S + S // 2 + r, step_age_s=0.5) for r in (0, 1)]
    inputs += [sim.heartbeat(r, 41, T0 + k * S + r) for k in range(43, 50) for r in heartbeating]
    _, folded = drive(inputs, until=T0 + 50 * S, first_incident=True)
    [(at, incident)] = opened(folded)
    assert incident.cause == "progress_timeout"
    assert incident.ranks == (0, 1)
    assert at == T0 + 48 * S + 1
    assert words in incident.reason
    assert incident.measures.get("silent_s") == (silent_s and pytest.approx(silent_s, abs=1e-6))
    if silent_s is None:
        assert "sent nothing" not in incident.reason
    elif heartbeating:
        assert ", and rank 1 sent nothing for up to 5.5 s, in generation 0 at step 41" in (
            incident.reason
        )
    else:
        assert ", and sent nothing for up to 5.5 s, in generation 0 at step 41" in incident.reason
    assert "kept heartbeating" not in incident.reason or silent_s is None


def test_next_deadline_covers_the_progress_timeout() -> None:
    """A rank's stall deadline starts with its first heartbeat without progress (before that
    it is either advancing or silent); the shell must tick at it."""
    sim = Sim()
    state, _ = running_job(sim, 40)
    assert state.watch.progress_due_ns is None
    state, _ = run([sim.heartbeat(r, 39, T0 + 40 * S + S // 2 + r) for r in range(4)], state)
    last_advance = T0 + 40 * S  # rank 0's heartbeat of step 39
    assert (
        state.watch.progress_due_ns == last_advance + 6 * S
    )  # timeout 5 s + heartbeat interval 1 s
    assert next_deadline(state, CFG) == last_advance + 6 * S + 1


def test_a_straggler_is_reported_once_and_not_restored() -> None:
    sim = Sim()
    inputs: list[Input] = list(sim.start(T0))
    for step in range(80):
        at = T0 + S + step * S
        for r in range(4):
            slow = r == 3 and step >= 40
            inputs.append(sim.heartbeat(r, step, at + r, step_time_s=3.0 if slow else 1.0))
    state, folded = drive(inputs)
    [report] = of_type(every(folded), Anomaly)
    assert report.kind == "straggler"
    assert (report.ranks, report.hosts) == ((3,), ("h1",))
    assert report.measures["median_step_time_s"] == 1.0
    assert float(report.measures["step_time_s"]) > 2.0
    assert opened(folded) == []
    assert state.ranks[3].straggling


# -- divergence --------------------------------------------------------------------------------


def test_a_nan_loss_restores_the_last_snapshot_before_the_last_normal_loss() -> None:
    sim = Sim()
    state, _ = running_job(sim, 41)  # commits 10, 20, 30, 40; lead samples up to step 40
    state, decisions = run([sim.nan(2, 41, T0 + 42 * S)], state)
    [incident] = of_type(decisions, IncidentOpened)
    assert incident.cause == "nan_loss"
    assert (incident.ranks, incident.hosts) == ((2,), ("h1",))
    # The loss of step 40 was normal: the parameters after step 39 were sound; the update of
    # step 40 may carry another rank's NaN gradient, so snapshot 40 is no target.
    assert incident.onset_after_step == 39
    assert math.isnan(float(incident.measures["loss"]))
    [restore] = issued(decisions, Restore)
    assert restore.target is not None
    assert restore.target.snapshot_id == "job/g0/s30"
    assert incident.to_dict()["measures"] == {"loss": "nan", "step": 41, "sound_step": 39}


def test_a_persisting_loss_spike_restores_before_it_and_skips_its_batches() -> None:
    sim = Sim()
    spike = 80
    loss = lambda step: wobble(step) * (3.0 if step >= spike else 1.0)  # noqa: E731
    _, folded = drive(
        [*sim.start(T0), *sim.train(range(100), start=T0 + S, loss=loss)], first_incident=True
    )
    [(_, incident)] = opened(folded)
    assert incident.cause == "loss_spike"
    assert incident.onset_after_step == spike - 2  # the last normal loss was at step 79
    assert incident.measures["samples"] == CFG.loss_spike_persist
    assert float(incident.measures["z"]) >= CFG.loss_spike_z
    [restore] = issued(every(folded), Restore)
    assert restore.target is not None
    assert restore.target.snapshot_id == "job/g0/s70"  # s80 was committed during the spike
    # The batches of the spike: from the step after the last normal loss (79) on.
    assert restore.skip == StepRange(from_step=spike, to_step=spike + CFG.loss_spike_persist - 1)
    assert "job/g0/s80" in {c.manifest.snapshot_id for c in of_type(every(folded), Committed)}


def test_a_loss_blip_is_reported_not_restored() -> None:
    sim = Sim()
    loss = lambda step: wobble(step) * (3.0 if step == 80 else 1.0)  # noqa: E731
    state, folded = drive([*sim.start(T0), *sim.train(range(100), start=T0 + S, loss=loss)])
    assert opened(folded) == []
    [blip] = of_type(every(folded), Anomaly)
    assert blip.kind == "loss_blip"
    assert (blip.measures["first_step"], blip.measures["returned_step"]) == (80, 81)
    assert state.watch.spike is None


def test_a_checksum_majority_names_the_odd_rank_and_suspects_its_host() -> None:
    sim = Sim()
    state, _ = running_job(sim, 36)
    agree = [sim.checksum(r, 30, T0 + 37 * S) for r in range(4)]
    differ = [sim.checksum(r, 35, T0 + 38 * S, odd=r == 3) for r in range(4)]
    state, decisions = run([*agree, *differ], state)
    suspect, *_ = of_type(decisions, Anomaly)
    assert suspect.kind == "suspect_host"
    assert (suspect.ranks, suspect.hosts) == ((3,), ("h1",))
    [incident] = of_type(decisions, IncidentOpened)
    assert incident.cause == "checksum_mismatch"
    assert (incident.ranks, incident.hosts, incident.onset_after_step) == ((3,), ("h1",), 30)
    assert "majority" in incident.reason
    [restore] = issued(decisions, Restore)
    assert restore.target is not None
    assert restore.target.snapshot_id == "job/g0/s30"  # agreement at 30 proves s30 sound


def test_checksums_without_a_majority_name_every_replica() -> None:
    sim = Sim(world_size=2)
    state, _ = running_job(sim, 36)
    state, decisions = run(
        [sim.checksum(0, 35, T0 + 37 * S), sim.checksum(1, 35, T0 + 37 * S, odd=True)], state
    )
    [incident] = of_type(decisions, IncidentOpened)
    assert incident.ranks == (0, 1)
    assert of_type(decisions, Anomaly) == []  # no host is suspected
    assert "no majority" in incident.reason


def test_checksums_are_compared_within_replica_groups_only() -> None:
    cfg = config(model_parallel_size=2)  # ranks 0, 2 hold one shard; 1, 3 the other
    sim = Sim()
    state, _ = running_job(sim, 36, cfg=cfg)
    sums = [sim.checksum(r, 30, T0 + 37 * S, odd=r % 2 == 1) for r in range(4)]
    state, decisions = run(sums, state, cfg)
    assert decisions == ()
    assert dict(state.watch.agreed.items()) == {0: 30, 1: 30}


def test_ranks_further_apart_than_the_lag_are_an_incident() -> None:
    sim = Sim()
    state, _ = running_job(sim, 150)
    state, decisions = run([sim.heartbeat(1, 3, T0 + 151 * S)], state)  # restarted behind our back
    [incident] = of_type(decisions, IncidentOpened)
    assert incident.cause == "step_lag"
    assert incident.ranks == (1,)
    assert incident.measures["lag"] == 146


def test_ranks_disagreeing_on_the_data_version_are_an_incident() -> None:
    sim = Sim()
    state, _ = run(sim.start(T0))
    shards = [
        sim.checkpoint(r, 10, T0 + S + r, data_version="v2" if r == 3 else "v1") for r in range(4)
    ]
    state, decisions = run(shards, state)
    [incident] = of_type(decisions, IncidentOpened)
    assert incident.cause == "data_version_mismatch"
    assert (incident.ranks, incident.hosts) == ((3,), ("h1",))
    assert of_type(decisions, Committed) == []


def test_restoring_onto_another_data_version_is_refused() -> None:
    sim, state, restore = killed_job()
    state, decisions = run(
        [*sim.recover(restore, T0 + 45 * S), sim.cursor(0, 31, T0 + 46 * S, data_version="v2")],
        state,
    )
    [failed] = of_type(decisions, JobFailed)
    assert "data version" in failed.reason
    assert "allow_data_version_change" in failed.reason
    assert issued(decisions, Abort)
    assert state.phase == "failed"


def test_an_allowed_data_version_change_is_reported() -> None:
    cfg = config(allow_data_version_change=True)
    sim = Sim()
    state, _ = running_job(sim, 38, cfg=cfg)
    state, decisions = run([sim.kill(1, T0 + 39 * S)], state, cfg)
    [restore] = issued(decisions, Restore)
    inputs = [
        *sim.recover(restore, T0 + 43 * S),
        *(sim.cursor(r, 31, T0 + 44 * S, data_version="v2") for r in range(4)),
    ]
    state, decisions = run(inputs, state, cfg)
    [changed] = of_type(decisions, Anomaly)
    assert changed.kind == "data_version_changed"
    assert state.data_version == "v2"
    assert state.phase == "running"
    shards = [sim.checkpoint(r, 40, T0 + 48 * S + r, data_version="v2") for r in range(4)]
    state, decisions = run(shards, state, cfg)
    [committed] = of_type(decisions, Committed)
    assert committed.manifest.data_version == "v2"


# -- the restore target rule -------------------------------------------------------------------


def test_a_bounded_onset_restores_at_or_before_the_last_agreement() -> None:
    """Checksums agree at 25 and disagree at 45: snapshots 30 and 40 may hold the odd state,
    the target is 20; they are abandoned, and a step re-committed later is another snapshot."""
    sim = Sim()
    state, _ = running_job(sim, 46)
    agree = [sim.checksum(r, 25, T0 + 47 * S) for r in range(4)]
    differ = [sim.checksum(r, 45, T0 + 48 * S, odd=r == 0) for r in range(4)]
    state, decisions = run([*agree, *differ], state)
    [restore] = issued(decisions, Restore)
    assert restore.target is not None
    assert restore.target.snapshot_id == "job/g0/s20"
    assert [m.snapshot_id for m in state.committed] == ["job/g0/s10", "job/g0/s20"]
    state, _ = run(sim.recover(restore, T0 + 50 * S), state)
    state, _ = run(sim.train(range(21, 36), start=T0 + 51 * S), state)
    assert [m.snapshot_id for m in state.committed][-1] == "job/g1/s30"
    state, decisions = run([sim.nan(2, 36, T0 + 70 * S)], state)
    [second] = issued(decisions, Restore)
    assert second.target is not None
    assert second.target.snapshot_id == "job/g1/s30"  # never g0/s30 of the abandoned timeline


# -- crash loops -------------------------------------------------------------------------------


def test_a_crash_loop_fails_the_job_naming_the_repeating_cause() -> None:
    sim, state, restore = killed_job()  # incident 1: rank 1 killed at step 37
    restores = [restore]
    every_decision: list[object] = []
    for cycle in range(3):
        at = T0 + (100 + 20 * cycle) * S
        state, _ = run(sim.recover(restores[-1], at), state)
        state, _ = run(sim.train(range(31, 35), start=at + S, checkpoint_every=0), state)
        state, decisions = run([sim.kill(1, at + 6 * S)], state)
        every_decision += decisions
        restores += issued(decisions, Restore)
    assert len(restores) == 3  # the fourth incident got no restore
    [failed] = of_type(decisions, JobFailed)
    assert failed.reason.startswith(
        "crash loop: 4 incidents in a row (job/i1 .. job/i4) repeating exited x4"
    )
    assert "max_restore_cycles=3" in failed.reason
    [closed] = of_type(decisions, IncidentClosed)
    assert (closed.incident_id, closed.outcome, closed.attempts) == ("job/i4", "failed", 0)
    assert [type(d).__name__ for d in decisions] == [
        "IncidentOpened",
        "Transition",
        "Issue",
        "IncidentClosed",
        "JobFailed",
    ]
    assert state.phase == "failed"


def exits_after_step(step: int) -> tuple[JobState, JobFailed, int]:
    """A 4-rank job heartbeating steps 0..23 (commits at 10 and 20) whose rank 1 exits with
    code 7 after ``step`` (its exit report's last completed step), and again after ``step`` in
    each generation restored to step 20 (heartbeats 21..``step``), four times: the state, the
    job's failure and the restores issued."""
    sim = Sim()
    state, _ = running_job(sim, 24)
    restores: list[Restore] = []
    for _ in range(4):
        if restores:
            at = state.clock_ns + S
            state, _ = run(sim.recover(restores[-1], at), state)
            state, _ = run(sim.train(range(21, step + 1), start=at + S, checkpoint_every=0), state)
        at = state.clock_ns + S  # right after the last input: no gap (an outage) before it
        exited = sim.supervisor((1,), "exited", at, exit_code=7, step=step)
        state, decisions = run([exited], state)
        restores += issued(decisions, Restore)
        if state.phase == "restoring":
            state, _ = run([acted(state, at)], state)
    [failed] = of_type(decisions, JobFailed)
    return state, failed, len(restores)


def test_the_exit_reports_step_counts_as_reached_in_a_crash_loop() -> None:
    """The worker exits after step 35 while its last heartbeat said 23 (it trained faster than
    it heartbeats): the crash loop's mark is step 35, so later generations that reach 35 again
    are no progress, and the fourth exit fails the job."""
    state, failed, restores = exits_after_step(35)
    assert restores == 3
    assert "never got 10 steps past step 35" in failed.reason
    assert state.phase == "failed"


def test_a_crash_loop_at_the_furthest_step_does_not_rule_out_a_bad_batch() -> None:
    """Every generation exits after step 23, the furthest step the job ever reached: the
    steps after it were never trained, so a batch that fails whenever it is trained is still
    a suspect, not only the restore."""
    state, failed, restores = exits_after_step(23)
    assert restores == 3
    assert state.phase == "failed"
    assert "3 of the 4 incidents struck within 5 steps after a restore" in failed.reason
    assert "trained past before" not in failed.reason
    assert "or a batch that fails whenever it is trained" in failed.reason


def test_a_job_that_progresses_between_incidents_is_no_crash_loop() -> None:
    sim, state, restore = killed_job()
    high = 37
    for _ in range(6):
        at = state.clock_ns + S
        target = restore.target.step if restore.target else 0
        state, _ = run(sim.recover(restore, at), state)
        steps = range(target + 1, high + CFG.crash_loop_progress_steps + 2)
        state, _ = run(sim.train(steps, start=at + S), state)
        high = steps[-1]
        state, decisions = run([sim.kill(2, state.clock_ns + S)], state)
        [restore] = issued(decisions, Restore)
    assert state.phase == "restoring"
    assert state.loop.streak == 0


# -- in-process restores -----------------------------------------------------------------------


def in_process_nan() -> tuple[Sim, JobState, Restore]:
    cfg = config(restore_mode="in_process")
    sim = Sim()
    state, _ = running_job(sim, 61, cfg=cfg)
    state, decisions = run([sim.nan(1, 60, T0 + 62 * S)], state, cfg)
    [restore] = issued(decisions, Restore)
    return sim, state, restore


def test_an_in_process_restore_names_a_future_step_boundary() -> None:
    cfg = config(restore_mode="in_process")
    sim, state, restore = in_process_nan()
    assert restore.mode == "in_process"
    # The highest step reported was 60; 5 s of lead at 1 s per step beats the 2-step minimum.
    assert restore.at_step == 65
    assert restore.generation == 1
    sim.generation = 1  # the ranks adopt the restore's generation when it arrives
    going_on = [sim.heartbeat(r, 62, T0 + 63 * S + r, loss=math.nan) for r in range(4)]
    shard = sim.checkpoint(0, 62, T0 + 63 * S + 10)
    state, decisions = run([*going_on, shard], state, cfg)
    [ignored] = of_type(decisions, Anomaly)
    assert ignored.kind == "checkpoint_ignored"
    assert of_type(decisions, IncidentOpened) == []
    acks = [
        sim.lifecycle(
            r,
            "restored",
            T0 + 66 * S + r,
            step=restore.target.step if restore.target else 0,
            cursor=restore.target.cursor if restore.target else None,
            snapshot_id=restore.target.snapshot_id if restore.target else None,
        )
        for r in range(4)
    ]
    state, decisions = run(acks, state, cfg)
    [resume] = issued(decisions, Resume)
    assert resume.generation == 1
    assert state.committed[-1].snapshot_id == "job/g0/s50"


def test_a_rank_past_the_step_boundary_falls_back_to_a_restart() -> None:
    cfg = config(restore_mode="in_process")
    sim, state, restore = in_process_nan()
    sim.generation = 1
    state, decisions = run([sim.missed(2, 65, 67, T0 + 63 * S)], state, cfg)
    [retry] = issued(decisions, Restore)
    assert (retry.mode, retry.at_step, retry.attempt, retry.generation) == ("restart", None, 2, 2)
    assert retry.target == restore.target
    assert "already past step 65" in retry.reason


def test_a_loop_that_ended_before_the_step_boundary_is_said_so() -> None:
    """The agent also declines when its loop ends before ``at_step`` (``RestoreMissed``): the
    reason said "already past step 65 (at step 60)", a contradiction a tester reported."""
    cfg = config(restore_mode="in_process")
    sim, state, _ = in_process_nan()
    sim.generation = 1
    state, decisions = run([sim.missed(2, 65, 60, T0 + 63 * S)], state, cfg)
    [retry] = issued(decisions, Restore)
    assert retry.mode == "restart"
    assert "ended its training loop at step 60, before step 65" in retry.reason
    assert "already past" not in retry.reason


def test_a_dead_process_always_restarts() -> None:
    cfg = config(restore_mode="in_process")
    sim = Sim()
    state, _ = running_job(sim, 38, cfg=cfg)
    _, decisions = run([sim.kill(1, T0 + 39 * S)], state, cfg)
    [restore] = issued(decisions, Restore)
    assert (restore.mode, restore.at_step) == ("restart", None)


# -- evidence and configuration ----------------------------------------------------------------


def test_every_incident_carries_its_measures_as_json() -> None:
    sim = Sim()
    state, _ = running_job(sim, 12)
    quiet = [sim.heartbeat(r, 12, T0 + 13 * S) for r in (0, 1, 3)]
    _, folded = drive(quiet, state, until=T0 + 30 * S)
    [(_, incident)] = opened(folded)
    measures = incident.to_dict()["measures"]
    assert isinstance(measures, dict)
    assert measures["timeout_s"] == 10.0
    assert [d.to_dict()["decision"] for d in every(folded)][:3] == [
        "transition",
        "incident_opened",
        "issue",
    ]
    assert isinstance(every(folded)[2], Issue)


@pytest.mark.parametrize(
    "bad",
    [
        {"progress_quantile": 0.0},
        {"progress_quantile": 1.5},
        {"progress_factor": -1.0},
        {"progress_floor_s": 100.0, "progress_ceiling_s": 10.0},
        {"progress_window": 12},
        {"loss_window": 0},
        {"straggler_factor": 1.0},
        {"straggler_alpha": 0.0},
        {"loss_spike_return_z": 7.0},
        {"loss_spike_persist": 0},
        {"model_parallel_size": 0},
        {"max_restore_cycles": 0},
        {"phase_eval_s": 0.0},
        {"startup_allowance_s": math.inf},
        {"in_process_lead_s": -1.0},
    ],
)
def test_detector_config_rejects_nonsense(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case has its own message
        config(**bad)
