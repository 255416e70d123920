"""The job report's computation (``_report.py``) on synthetic records: a 2-rank job scripted
step by step, folded by the real state machine as the daemon folds it, so the audit entries
are the ones the daemon would write. Every expected number is worked out by hand in the test.

Times are milliseconds after ``T0`` (the job's first event); steps take 1 s, heartbeats report
each step the moment it ends, and shards are announced 200 ms (rank 0) and 210 ms (rank 1)
after their step.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.support.report_script import HOST, JOB, T0, Script, killed_once
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.demo._harness import Stamped
from trainguard.daemon.forensics._report import (
    SEGMENT_KINDS,
    JobReport,
    build_report,
    daly_interval_s,
    young_interval_s,
)
from trainguard.daemon.forensics._report_html import MAX_RANK_LANES, render_html
from trainguard.schemas import (
    Heartbeat,
    HeartbeatBatch,
    Resume,
    Signature,
    batched_beat,
)


def assert_partition(report: JobReport) -> None:
    """The segments tile ``[start, end)`` in order and the kinds add up to the wall time."""
    assert report.segments[0].start_ms == report.start_ms
    assert report.segments[-1].end_ms == report.end_ms
    for a, b in zip(report.segments, report.segments[1:], strict=False):
        assert a.end_ms == b.start_ms
        assert a.start_ms < a.end_ms
    assert sum(report.time_s.values()) == pytest.approx(report.wall_s)
    assert set(report.time_s) == set(SEGMENT_KINDS)


def test_a_stop_and_its_continuation_split_the_wall_time_as_worked_out_by_hand() -> None:
    """Steps 1-25 end at 11..35 s (commits at 10 and 20); stopped at 35.5 s; continued at
    100 s from step 20; the new processes acknowledge at 105 and 105.5 s; steps 21-40 end at
    106.5..125.5 s; both finish at 125.6 s."""
    job = Script()
    job.start(0, 10_000)
    job.train(range(1, 26), 11_000)
    job.request("stop", 35_500)
    assert job.report().ended == "stopped"
    job.request("continue", 100_000)
    job.restart(101_000, (105_000, 105_500))
    job.train(range(21, 41), 106_500)
    job.finish(40, 125_600)
    report = job.report()
    assert_partition(report)
    assert (report.ended, report.end_ms) == ("finished", T0 + 125_600)
    assert report.time_s == pytest.approx(
        {
            "startup": 10.0,
            "productive": 20.0 + 20.0,  # steps 1-20 (10 -> 30 s), steps 21-40 (105.5 -> 125.5 s)
            "recomputed": 5.5,  # steps 21-25 and half a step: 30 -> 35.5 s, the stop
            "stopped": 64.5,  # stop 35.5 s -> continued 100 s
            "detection": 0.0,  # a continuation has no onset before it
            "restore": 5.5,  # continued 100 s -> resume at the last ack, 105.5 s
            "tail": 0.1,
            "other": 0.0,
        }
    )
    [incident] = report.incidents
    assert incident.cause == "continued"


def test_one_kill_splits_the_wall_time_as_worked_out_by_hand() -> None:
    job = killed_once()
    report = job.report()
    assert_partition(report)
    assert (report.ended, report.start_ms, report.end_ms) == ("finished", T0, T0 + 65_600)
    assert report.wall_s == pytest.approx(65.6)
    assert report.time_s == pytest.approx(
        {
            "startup": 10.0,  # 0 -> 10 s: the first step (1 s) began at 10 s
            "productive": 20.0 + 20.0,  # steps 1-20 (10 -> 30 s), steps 21-40 (45.5 -> 65.5 s)
            "recomputed": 5.5,  # steps 21-25 and half a step: 30 -> 35.5 s
            "detection": 0.01,  # died 35.5 s, incident 35.51 s
            "restore": 9.99,  # incident 35.51 s -> resume at the last ack, 45.5 s
            "tail": 0.1,  # last step 65.5 s -> finished 65.6 s
            "stopped": 0.0,
            "other": 0.0,
        }
    )
    assert report.productive_s == pytest.approx(40.0)
    assert report.goodput == pytest.approx(40.0 / 65.6)
    assert (report.first_step, report.final_step, report.steps_recomputed) == (0, 40, 5)
    assert report.step_time_s == 1.0
    assert report.world_size == 2
    assert report.causes == {"exited": 1}


def test_one_kill_incident_costs() -> None:
    [incident] = killed_once().report().incidents
    assert (incident.incident_id, incident.cause, incident.generation) == (f"{JOB}/i1", "exited", 0)
    assert (incident.ranks, incident.hosts) == ((1,), (HOST,))
    assert incident.onset_ms == T0 + 35_500
    assert "exit report" in incident.onset_evidence
    assert incident.detection_s == pytest.approx(0.01)
    assert incident.restore_s == pytest.approx(9.99)
    assert (incident.outcome, incident.attempts, incident.mode) == ("resumed", 1, "restart")
    assert (incident.target_step, incident.target_snapshot) == (20, f"{JOB}/g0/s20")
    assert (incident.reached_step, incident.recomputed_steps) == (25, 5)
    assert incident.recomputed_s == pytest.approx(5.5)
    assert incident.lost_s == pytest.approx(0.01 + 9.99 + 5.5)


def test_young_daly_from_the_observed_failure_and_shard_writes() -> None:
    advice = killed_once().report().checkpoint
    # Shards of steps 10, 20 (generation 0), 30, 40 (generation 1), every 10 steps = 10 s.
    assert (advice.checkpoints, advice.interval_steps, advice.interval_s) == (4, 10, 10.0)
    # No declared checkpoint phase: the cost is the slowest shard's write, step end -> 210 ms.
    assert advice.phase_cost_s is None
    assert advice.write_s == pytest.approx(0.21)
    assert advice.cost_s == pytest.approx(0.21)
    assert "shard writes" in advice.cost_source
    # One failure in 65.6 s of wall time less 9.99 s of restore.
    assert advice.failures == 1
    assert not advice.mtbf_is_lower_bound
    assert advice.exposure_s == pytest.approx(55.61)
    assert advice.mtbf_s == pytest.approx(55.61)
    young = math.sqrt(2 * 0.21 * 55.61)  # 4.8328 s
    assert advice.young_s == pytest.approx(young)
    assert advice.young_s == pytest.approx(4.8328, abs=1e-4)
    ratio = 0.21 / (2 * 55.61)
    assert advice.daly_s == pytest.approx(young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - 0.21)
    assert advice.daly_s == pytest.approx(4.6938, abs=1e-4)
    assert advice.young_steps == pytest.approx(young)  # 1 s steps
    assert "Young" in advice.sources[0]
    assert "Daly" in advice.sources[1]


def test_without_failures_the_mtbf_is_a_lower_bound() -> None:
    job = Script()
    job.start(0, 10_000)
    job.train(range(1, 31), 11_000)
    job.finish(30, 40_100)
    report = job.report()
    assert_partition(report)
    assert report.incidents == ()
    assert report.time_s["productive"] == pytest.approx(30.0)  # 10 -> 40 s
    assert report.goodput == pytest.approx(30.0 / 40.1)
    advice = report.checkpoint
    assert (advice.failures, advice.mtbf_is_lower_bound) == (0, True)
    assert advice.mtbf_s == pytest.approx(40.1)  # M > the whole wall time
    assert advice.young_s == pytest.approx(math.sqrt(2 * 0.21 * 40.1))  # a lower bound


def test_a_declared_checkpoint_phase_is_the_cost() -> None:
    job = Script()
    job.start(0, 10_000)
    # Each shard written on the training thread: phase declared 1 ms after the step, shard
    # announced 300 + 200/210 ms later, the slowest rank's 511 ms after the declaration - 1.
    last = job.train(range(1, 31), 11_000, declared=300)
    job.finish(30, last + 600)
    advice = job.report().checkpoint
    assert advice.phase_cost_s == pytest.approx(0.509)
    assert advice.cost_s == advice.phase_cost_s
    assert "declared checkpoint phases" in advice.cost_source


def test_a_hang_is_detected_from_the_last_step_advance() -> None:
    job = Script()
    job.start(0, 10_000)
    # Both ranks stop after step 25 (35 s) and keep heartbeating it every second.
    job.train(range(1, 46), 11_000, stuck_at=25)
    opened = [d for e in job.audit for d in e["decisions"] if d["decision"] == "incident_opened"]
    assert [d["cause"] for d in opened] == ["progress_timeout"]
    stalled_s = opened[0]["measures"]["stalled_s"]
    job.restart(60_000, (61_000, 61_000))
    job.train(range(21, 31), 62_000)
    job.finish(30, 71_100)
    report = job.report()
    assert_partition(report)
    [incident] = report.incidents
    assert incident.onset_ms == T0 + 35_000  # the step last advanced at 35 s
    assert incident.detection_s == pytest.approx(stalled_s)
    assert "last step advance" in incident.onset_evidence
    assert (incident.reached_step, incident.target_step, incident.recomputed_steps) == (25, 20, 5)
    assert incident.recomputed_s == pytest.approx(5.0)  # steps 21-25: 30 -> 35 s


def test_a_restore_past_an_uncommitted_generation_loses_all_of_it() -> None:
    """Generation 1 resumes from step 20, dies at step 27 before committing 30: generation 2
    restores generation 0's step 20 again, so nothing of generation 1 survives."""
    job = Script()
    job.start(0, 10_000)
    job.train(range(1, 26), 11_000)
    job.supervisor_exit(1, 35_510, died=35_500)
    job.restart(40_000, (45_000, 45_500))
    job.train(range(21, 28), 46_500)  # step 27 ends at 52.5 s
    job.supervisor_exit(0, 53_010, died=53_000)
    target = job.last_restore().target
    assert target is not None
    assert target.snapshot_id == f"{JOB}/g0/s20"
    job.restart(55_000, (56_000, 56_000))
    job.train(range(21, 41), 57_000)  # step 40 ends at 76 s
    job.finish(40, 76_100)
    report = job.report()
    assert_partition(report)
    assert report.time_s["productive"] == pytest.approx(20.0 + 20.0)  # 10 -> 30 s, 56 -> 76 s
    # Generation 0 after step 20 (30 -> 35.5 s) and all of generation 1 (45.5 -> 53 s).
    assert report.time_s["recomputed"] == pytest.approx(5.5 + 7.5)
    _first, second = report.incidents
    assert (second.generation, second.target_step, second.recomputed_steps) == (1, 20, 7)
    assert second.recomputed_s == pytest.approx(7.5)
    assert report.steps_recomputed == 5 + 7
    assert [g.generation for g in report.generations] == [0, 1, 2]
    assert [g.from_step for g in report.generations] == [0, 20, 20]


def test_ticks_and_an_empty_audit_make_a_running_job() -> None:
    job = Script()
    job.start(0, 3_000)
    job.train(range(1, 6), 4_000)
    report = build_report(JOB, job.events, [])
    assert report.ended == "running"
    assert report.end_ms == job.events[-1].at_ms
    assert_partition(report)
    assert report.time_s["productive"] == pytest.approx(5.0)


def test_formulas() -> None:
    assert young_interval_s(2.0, 100.0) == pytest.approx(20.0)
    # Daly with C / 2M = 0.01: 20 * (1 + 0.1 / 3 + 0.01 / 9) - 2.
    assert daly_interval_s(2.0, 100.0) == pytest.approx(20 * (1 + 0.1 / 3 + 0.01 / 9) - 2)
    assert daly_interval_s(300.0, 100.0) == 100.0  # C >= 2M: checkpoint every M


def test_chart_lanes() -> None:
    report = killed_once().report()
    lanes = {(s.rank, s.generation, s.phase) for s in report.ranks}
    assert lanes == {(r, g, p) for r in (0, 1) for g in (0, 1) for p in ("init", "train")}
    [dead] = [s for s in report.ranks if (s.rank, s.generation, s.phase) == (1, 0, "train")]
    assert (dead.first_step, dead.last_step, dead.end_ms) == (1, 25, T0 + 35_510)
    kinds = [m.kind for m in report.marks]
    assert kinds.count("checkpoint") == 8
    assert kinds.count("committed") == 4
    assert [m.rank for m in report.marks if m.kind == "exited"] == [1]


@pytest.mark.parametrize("skew_ms", [-3_600_000, 120_000])
def test_an_exit_time_stamp_off_the_bus_clock_is_not_trusted(skew_ms: int) -> None:
    """A supervisor whose clock is an hour behind or two minutes ahead of the bus's (an
    hour ahead would be rejected: max_clock_skew_s)."""
    job = Script()
    job.start(0, 10_000)
    job.train(range(1, 26), 11_000)
    job.supervisor_exit(1, 35_510, died=35_500 + skew_ms)
    [incident] = job.report().incidents
    assert incident.onset_ms == T0 + 35_510
    assert incident.detection_s == 0.0
    assert "append time" in incident.onset_evidence


def test_a_failed_job_keeps_only_its_newest_committed_snapshot() -> None:
    """The crash-loop guard (one restore without progress allowed) fails the job at its second
    kill, at step 27 of generation 1: the final timeline ends at the newest commit, step 20."""
    job = Script(cfg=MachineConfig(daemon_id="d", max_restore_cycles=1))
    job.start(0, 10_000)
    job.train(range(1, 26), 11_000)
    job.supervisor_exit(1, 35_510, died=35_500)
    job.restart(40_000, (45_000, 45_500))
    job.train(range(21, 28), 46_500)
    job.supervisor_exit(0, 53_010, died=53_000)
    report = job.report()
    assert_partition(report)
    assert (report.ended, report.end_ms, report.final_step) == ("failed", T0 + 53_010, 20)
    assert report.time_s["productive"] == pytest.approx(20.0)  # steps 1-20, 10 -> 30 s
    assert report.time_s["recomputed"] == pytest.approx(5.5 + 7.5)
    second = report.incidents[1]
    assert (second.outcome, second.attempts, second.target_step) == ("failed", 0, None)
    assert (second.reached_step, second.recomputed_steps) == (27, 7)
    assert second.restore_s == 0.0


def test_the_chart_draws_at_most_64_ranks() -> None:
    events = [
        Stamped(
            T0 + 1000 * step + rank,
            Heartbeat(
                job_id=JOB,
                generation=0,
                ts=0,
                seq=step,
                rank=rank,
                host=HOST,
                pid=rank,
                world_size=70,
                step=step,
                phase="train" if step else "init",
                step_time_s=1.0,
            ),
        )
        for step in range(5)
        for rank in range(70)
    ]
    page = render_html(build_report(JOB, events, []))
    assert MAX_RANK_LANES == 64
    assert ">rank 63<" in page
    assert ">rank 64<" not in page
    assert "showing 64 of 70 ranks" in page


def test_only_the_commands_the_daemon_issued_move_restore_times() -> None:
    """A resume takes its bus append time from the ``commands`` record that is exactly the
    command the audit says was issued (signed or not); a forged one, which agents ignore,
    moves nothing."""
    job = killed_once()
    [resume_at] = [i for i, c in enumerate(job.commands) if isinstance(c.message, Resume)]
    genuine = job.commands[resume_at]
    signed = dataclasses.replace(genuine.message, auth=Signature(kid="0" * 16, sig="AA=="))
    forged = dataclasses.replace(genuine.message, seq=genuine.message.seq + 1)
    job.commands[resume_at] = Stamped(genuine.at_ms + 300, signed)
    job.commands.append(Stamped(genuine.at_ms + 5_000, forged))
    [incident] = job.report().incidents
    assert incident.restore_s == pytest.approx(9.99 + 0.3)  # the genuine record's time only


def test_a_batch_reports_its_ranks_heartbeats_as_if_each_had_come_alone() -> None:
    """A supervisor batching its node's heartbeats (``heartbeat-batch``) changes nothing in
    the report: the same job with every two heartbeats appended together in one batch (at the
    later one's append time) gives the same split of the wall time, step time and incidents.
    The report once ignored batches: no rank was seen alive, the world size was 0."""
    job = killed_once()
    batched: list[Stamped] = []
    pending: list[Stamped] = []
    for item in job.events:
        if isinstance(item.message, Heartbeat):
            pending.append(item)
            if len(pending) == 2:
                batched.append(_batch(pending))
                pending = []
        else:
            batched += [_batch([beat]) for beat in pending]
            pending = []
            batched.append(item)
    batched += [_batch([beat]) for beat in pending]
    assert len(batched) < len(job.events)

    alone, together = job.report(), build_report(JOB, batched, job.audit, job.commands)
    assert together.world_size == alone.world_size == 2
    assert together.step_time_s == alone.step_time_s
    assert together.time_s == pytest.approx(alone.time_s, abs=1e-3)
    assert together.incidents == alone.incidents


def _batch(items: list[Stamped]) -> Stamped:
    """``items`` (heartbeats of one host) as one batch appended when the last of them was."""
    beats = [item.message for item in items]
    assert all(isinstance(b, Heartbeat) for b in beats)
    return Stamped(
        items[-1].at_ms,
        HeartbeatBatch(
            job_id=JOB,
            ts=beats[-1].ts,
            seq=beats[-1].seq,
            host=HOST,
            pid=1,
            beats=tuple(batched_beat(b) for b in beats),
        ),
    )
