"""Every restore keeps its promise (issue 12, ``docs/recovery.md``), on the pure machine:
acknowledgements are checked against the target, a job with committed snapshots never restarts
from scratch silently, incidents right after a restore say so (and a crash loop of them suspects
the restore), and ranks that disagree on the data order fail the job at the first disagreement.

Synthetic jobs heartbeat once a second per rank (``Sim``); ``G`` is generation 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

from tests.support.machine_scenarios import (
    T0,
    S,
    Sim,
    config,
    cursor_at,
    issued,
    killed_job,
    of_type,
    run,
)
from trainguard.daemon.core._decisions import (
    Anomaly,
    Committed,
    Decision,
    IncidentOpened,
    JobFailed,
)
from trainguard.daemon.core._inputs import Input, Observed, Tick
from trainguard.daemon.core._machine import decide
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import JobState
from trainguard.daemon.core._state_codec import decode_state, encode_state
from trainguard.schemas import (
    Abort,
    Checkpoint,
    DataCursor,
    DataCursorEvent,
    Restore,
    Resume,
)

CFG = config()


def rejoin(
    sim: Sim, restore: Restore, at: int, acks: Mapping[int, tuple[int, DataCursor | None]]
) -> list[Input]:
    """Every rank restarts into ``restore``'s generation, heartbeats in ``init`` once a second
    until ``at + 5 s`` and acknowledges with the step and cursor ``acks`` gives it (the
    target's when not given), naming the target's snapshot."""
    sim.generation = restore.generation
    target = restore.target
    out: list[Input] = []
    for r in ranks(sim):
        out.append(sim.lifecycle(r, "started", at + r, world_size=sim.world_size))
    for second in range(5):
        out += [sim.heartbeat(r, 0, at + second * S + r, phase="init") for r in ranks(sim)]
    for r in ranks(sim):
        right = (0, None) if target is None else (target.step, target.cursor)
        step, cursor = acks.get(r, right)
        out.append(
            sim.lifecycle(
                r,
                "restored",
                at + 5 * S + r,
                step=step,
                cursor=cursor,
                snapshot_id=None if target is None else target.snapshot_id,
            )
        )
    return out


def ranks(sim: Sim) -> range:
    return range(sim.world_size)


def commands(decisions: tuple[Decision, ...]) -> list[Restore | Resume | Abort]:
    return [*issued(decisions, Restore), *issued(decisions, Resume), *issued(decisions, Abort)]


# -- 1. acknowledgements are checked ------------------------------------------------------------


def test_two_ranks_acknowledging_step_0_get_a_new_restore_and_only_right_acks_resume() -> None:
    """4 ranks on 2 hosts, commits at 10 and 20, rank 3 exits at 25: restore(G+1, 20). Ranks
    0-1 acknowledge step 20 at its cursor, ranks 2-3 step 0 at cursor 0: no resume of G+1, but
    restore(G+2, 20) within the restore timeout naming both; right acks then resume G+2 once."""
    sim = Sim()
    state, _ = run([*sim.start(T0), *sim.train(range(26), start=T0 + S)])
    state, decisions = run([sim.crash(3, T0 + 27 * S)], state)
    [first] = issued(decisions, Restore)
    assert first.target is not None
    assert (first.generation, first.target.snapshot_id) == (1, "job/g0/s20")
    wrong = {r: (0, cursor_at(0, 4)) for r in (2, 3)}
    state, decisions = run(rejoin(sim, first, T0 + 28 * S, wrong), state)
    assert issued(decisions, Resume) == []
    [retry] = issued(decisions, Restore)
    assert retry.target == first.target
    assert (retry.generation, retry.attempt) == (2, 2)
    assert retry.ts - first.ts < CFG.restore_timeout_ns
    for rank in (2, 3):
        assert (
            f"rank {rank} on host h1 acknowledged step 0 (expected 20), offset 0 (expected 640)"
            in retry.reason
        )
    assert "rank 0" not in retry.reason
    assert "rank 1" not in retry.reason
    state, decisions = run(rejoin(sim, retry, T0 + 40 * S, {}), state)
    [resume] = issued(decisions, Resume)
    assert (resume.generation, resume.step) == (2, 20)
    state, decisions = run(sim.train(range(21, 60), start=T0 + 46 * S), state)
    assert commands(decisions) == []
    assert (state.phase, state.generation) == ("running", 2)


def step_300_job(attempts: int) -> tuple[Sim, JobState, Restore, MachineConfig]:
    """2 ranks, 160 samples a step, commits every 100 steps (step 300 at offset 48,000); rank 0
    exits after step 320: the restore of G+1 to step 300."""
    cfg = config(max_restore_attempts=attempts)
    sim = Sim(world_size=2)
    inputs: list[Input] = list(sim.start(T0))
    for step in range(321):
        at = T0 + (step + 1) * S
        inputs += [sim.heartbeat(r, step, at + r) for r in range(2)]
        if step and step % 100 == 0:
            inputs += [sim.checkpoint(r, step, at + 2 + r, offset=160 * step) for r in range(2)]
        inputs.append(Tick(at + S - 1))
    state, _ = run(inputs, cfg=cfg)
    state, decisions = run([sim.crash(0, T0 + 322 * S)], state, cfg)
    [restore] = issued(decisions, Restore)
    return sim, state, restore, cfg


def test_a_rank_acknowledging_offset_0_of_step_300_fails_the_job_after_the_attempts() -> None:
    """Step 300 committed at offset 48,000, max_restore_attempts = 2: rank 1 acknowledging step
    300 at offset 0 in G+1 and G+2 gives no resume, restore(G+2, 300), then ``failed``, each
    reason naming rank 1, expected 48000 and acknowledged 0. Cursors of another world size
    (rank 0's here) are right: the world size is informational."""
    sim, state, first, cfg = step_300_job(attempts=2)
    assert first.target is not None
    assert (first.generation, first.target.step, first.target.cursor.offset) == (1, 300, 48_000)
    resized = dataclasses.replace(first.target.cursor, world_size=2)
    bad = dataclasses.replace(first.target.cursor, offset=0)
    acks = {0: (300, resized), 1: (300, bad)}
    evidence = "rank 1 on host h0 acknowledged offset 0 (expected 48000)"
    state, decisions = run(rejoin(sim, first, T0 + 330 * S, acks), state, cfg)
    [retry] = issued(decisions, Restore)
    assert (retry.generation, retry.target) == (2, first.target)
    assert evidence in retry.reason
    state, decisions = run(rejoin(sim, retry, T0 + 340 * S, acks), state, cfg)
    assert commands(decisions) == issued(decisions, Abort)
    [abort] = issued(decisions, Abort)
    [failed] = of_type(decisions, JobFailed)
    assert evidence in failed.reason
    assert abort.reason == failed.reason
    assert state.phase == "failed"
    assert {rec.status for rec in state.ranks.values()} == {"alive"}  # wrong, not dead


def test_acknowledgements_of_the_initial_state_must_agree_with_one_another() -> None:
    """No step committed: the restore targets the initial state, for which the daemon has no
    position of its own; the ranks must agree, and the odd one is named against the others."""
    sim = Sim()
    state, _ = run([*sim.start(T0), *sim.train(range(6), start=T0 + S)])
    state, decisions = run([sim.kill(1, T0 + 7 * S)], state)
    [restore] = issued(decisions, Restore)
    assert restore.target is None
    acks = {r: (0, cursor_at(0, 4)) for r in range(4)}
    acks[3] = (7, cursor_at(7, 4))
    state, decisions = run(rejoin(sim, restore, T0 + 8 * S, acks), state)
    assert issued(decisions, Resume) == []
    [retry] = issued(decisions, Restore)
    assert (
        "rank 3 on host h1 acknowledged step 7 (ranks 0, 1, 2 acknowledged 0), offset 224 "
        "(ranks 0, 1, 2 acknowledged 0)" in retry.reason
    )
    agreed = {r: (0, cursor_at(0, 4)) for r in range(4)}
    state, decisions = run(rejoin(sim, retry, T0 + 20 * S, agreed), state)
    assert [r.generation for r in issued(decisions, Resume)] == [2]


def test_an_acknowledgement_without_a_cursor_does_not_match_a_target() -> None:
    sim, state, restore = killed_job()
    state, decisions = run(rejoin(sim, restore, T0 + 45 * S, {1: (30, None)}), state)
    assert issued(decisions, Resume) == []
    [retry] = issued(decisions, Restore)
    assert (
        "rank 1 on host h0 acknowledged no data cursor (expected offset 960 of epoch 0 "
        "(seed 7, data version 'v1'))" in retry.reason
    )


def test_a_restore_timeout_names_the_wrong_acknowledgements_received_too() -> None:
    sim, state, restore = killed_job()
    assert restore.target is not None
    acks = rejoin(sim, restore, T0 + 45 * S, {2: (29, restore.target.cursor)})
    # Rank 3 heartbeats but never acknowledges.
    state, decisions = run([i for i in acks if not _is_ack_of(i, 3)], state)
    assert state.incident is not None
    deadline = state.incident.issued_ns + CFG.restore_timeout_ns + 1
    waiting = [
        sim.heartbeat(r, 0, t, phase="init")
        for t in range(T0 + 55 * S, deadline, 5 * S)
        for r in ranks(sim)
    ]
    state, more = run(waiting, state)
    assert commands(decisions + more) == []
    state, decisions = run([Tick(deadline)], state)
    [retry] = issued(decisions, Restore)
    assert "not acknowledged within 120 s by rank 3" in retry.reason
    assert "rank 2 on host h1 acknowledged step 29 (expected 30)" in retry.reason


def _is_ack_of(item: Input, rank: int) -> bool:
    return (
        isinstance(item, Observed)
        and getattr(item.event, "kind", None) == "restored"
        and item.event.rank == rank
    )


def test_acknowledgements_round_trip_through_a_state_snapshot() -> None:
    sim, state, restore = killed_job()
    acks = rejoin(sim, restore, T0 + 45 * S, {2: (0, cursor_at(0, 4))})
    state, _ = run(acks[:-1], state)  # three acks in, one wrong
    assert state.incident is not None
    assert len(state.incident.acks) == 3
    back = decode_state(encode_state(state))
    assert back == state
    assert decide(back, acks[-1], CFG) == decide(state, acks[-1], CFG)


# -- 2. never a silent restart from scratch ----------------------------------------------------


def test_a_job_whose_every_snapshot_failed_verification_fails_naming_them() -> None:
    sim = Sim()
    state, _ = run([*sim.start(T0), *sim.train(range(38), start=T0 + S)])
    reports = [sim.corrupt(r, f"job/g0/s{s}", T0 + 39 * S) for r, s in ((0, 30), (1, 20), (2, 10))]
    state, decisions = run([*reports, sim.kill(3, T0 + 40 * S)], state)
    assert issued(decisions, Restore) == []
    [opened] = of_type(decisions, IncidentOpened)
    [failed] = of_type(decisions, JobFailed)
    assert state.phase == "failed"
    for rank, step in ((0, 30), (1, 20), (2, 10)):
        assert (
            f"job/g0/s{step}: rank {rank} on host h{rank // 2} reported that snapshot "
            f"job/g0/s{step} failed verification: digest mismatch" in failed.reason
        )
    assert failed.reason.startswith(f"incident {opened.incident_id}: no committed snapshot")
    assert "allow_restart_from_scratch" in failed.reason


def test_snapshots_failing_one_after_another_during_a_restore_end_the_job_naming_all() -> None:
    """The restore falls back from s30 to s20 to s10 as each fails verification; when s10
    fails too the job fails (it does not restore step 0), naming all three and why."""
    cfg = config(max_restore_attempts=5)
    sim = Sim()
    state, _ = run([*sim.start(T0), *sim.train(range(38), start=T0 + S)], cfg=cfg)
    state, decisions = run([sim.kill(1, T0 + 39 * S)], state, cfg)
    targets = [r.target.snapshot_id for r in issued(decisions, Restore) if r.target]
    for k, step in enumerate((30, 20, 10)):
        sim.generation = state.generation
        state, decisions = run([sim.corrupt(k, f"job/g0/s{step}", T0 + (40 + k) * S)], state, cfg)
        targets += [r.target.snapshot_id for r in issued(decisions, Restore) if r.target]
        assert all(r.target is not None for r in issued(decisions, Restore))
    assert targets == ["job/g0/s30", "job/g0/s20", "job/g0/s10"]
    [failed] = of_type(decisions, JobFailed)
    assert state.phase == "failed"
    reason = failed.reason
    assert reason.index("job/g0/s30:") < reason.index("job/g0/s20:") < reason.index("job/g0/s10:")


def test_the_operator_may_allow_a_loud_restart_from_scratch() -> None:
    cfg = config(allow_restart_from_scratch=True)
    sim = Sim()
    state, _ = run([*sim.start(T0), *sim.train(range(25), start=T0 + S)], cfg=cfg)
    reports = [sim.corrupt(r, f"job/g0/s{s}", T0 + 26 * S) for r, s in ((0, 20), (1, 10))]
    state, decisions = run([*reports, sim.kill(3, T0 + 27 * S)], state, cfg)
    [restore] = issued(decisions, Restore)
    assert restore.target is None
    issue = next(d for d in decisions if getattr(d, "command", None) is restore)
    assert "no committed snapshot can be restored (job/g0/s20: " in issue.reason
    assert "restarting from the job's initial state, discarding every step trained" in (
        issue.reason
    )


INIT_FROM = "nod/g0/s390"
"""The snapshot of another job the synthetic jobs below start from (``init_from``)."""


def init_from_corrupt(sim: Sim, rank: int, at: int) -> Input:
    """``rank`` found its shard of :data:`INIT_FROM` failing its digest check while loading it
    as the job's initial state (what the agent reports before ``load`` raises)."""
    return sim.lifecycle(
        rank,
        "error",
        at,
        step=0,
        snapshot_id=INIT_FROM,
        message=f"cannot start from init_from snapshot {INIT_FROM}: ShardCorrupt: digest mismatch",
    )


@pytest.mark.parametrize("allow", [False, True])
def test_a_new_job_whose_init_from_fails_verification_fails_at_once_naming_it(
    allow: bool,
) -> None:
    """No restore of the initial state (it would load the same snapshot again), with or
    without allow_restart_from_scratch; the failing rank's exit is part of the same failure."""
    cfg = config(allow_restart_from_scratch=allow)
    sim = Sim(world_size=2)
    state, _ = run(sim.start(T0), cfg=cfg)
    state, decisions = run([init_from_corrupt(sim, 0, T0 + S)], state, cfg)
    assert issued(decisions, Restore) == []
    [noted] = of_type(decisions, Anomaly)
    assert noted.kind == "snapshot_corrupt"
    [opened] = of_type(decisions, IncidentOpened)
    assert (opened.cause, opened.ranks) == ("snapshot_corrupt", (0,))
    [failed] = of_type(decisions, JobFailed)
    assert state.phase == "failed"
    assert failed.reason.startswith(
        "incident job/i1: the job has no committed snapshot of its own, and its initial state "
        f"cannot be restored: it is snapshot {INIT_FROM} of another job (init_from), and rank 0 "
        f"on host h0 reported that snapshot {INIT_FROM} failed verification: cannot start from "
        f"init_from snapshot {INIT_FROM}: ShardCorrupt: digest mismatch; nothing is left to "
        "restore"
    )
    assert ("allow_restart_from_scratch does not apply" in failed.reason) is allow
    [abort] = issued(decisions, Abort)
    assert abort.reason == failed.reason
    later: list[Input] = [sim.crash(0, T0 + 2 * S), sim.kill(1, T0 + 3 * S), Tick(T0 + 600 * S)]
    assert run(later, state, cfg) == (state, ())


def test_init_from_failing_in_a_restore_to_the_initial_state_ends_the_restores() -> None:
    """A job killed before its first commit restores its initial state; a rank then finds
    the init_from snapshot corrupt: no second attempt loads it again."""
    sim = Sim(world_size=2)
    state, _ = run([*sim.start(T0), *sim.train(range(6), start=T0 + S)])
    state, decisions = run([sim.kill(1, T0 + 7 * S)], state)
    [restore] = issued(decisions, Restore)
    assert restore.target is None
    sim.generation = restore.generation
    state, decisions = run([init_from_corrupt(sim, 0, T0 + 8 * S)], state)
    assert issued(decisions, Restore) == []
    [failed] = of_type(decisions, JobFailed)
    assert failed.reason.startswith(
        "incident job/i1: the job has no committed snapshot of its own, and its initial state "
        f"cannot be restored: it is snapshot {INIT_FROM} of another job (init_from), and rank 0"
    )
    assert state.phase == "failed"


def seeded(inputs: list[Input]) -> list[Input]:
    """``inputs`` with every checkpoint shard naming :data:`INIT_FROM` as its ``parent``."""
    return [
        item._replace(event=dataclasses.replace(item.event, parent=INIT_FROM))
        if isinstance(item, Observed) and isinstance(item.event, Checkpoint)
        else item
        for item in inputs
    ]


def test_a_job_with_snapshots_of_its_own_notes_its_init_from_and_never_restarts_from_it() -> None:
    """Once committed, the job restores its own snapshots; the bad initial state is kept across
    commits, so that when none of those can be restored, a restart from scratch (allowed) is
    refused too, naming both."""
    cfg = config(allow_restart_from_scratch=True)
    sim = Sim(world_size=2)
    state, _ = run(seeded([*sim.start(T0), *sim.train(range(15), start=T0 + S)]), cfg=cfg)
    state, decisions = run([init_from_corrupt(sim, 1, T0 + 16 * S)], state, cfg)
    assert [(type(d), d.kind) for d in decisions if isinstance(d, Anomaly)] == [
        (Anomaly, "snapshot_corrupt")
    ]
    assert len(decisions) == 1
    assert state.phase == "running"
    state, _ = run(seeded(sim.train(range(15, 25), start=T0 + 17 * S)), state, cfg)
    assert [m.step for m in state.committed] == [10, 20]
    assert [sid for sid, _ in state.bad_snapshots] == [INIT_FROM]
    reports = [sim.corrupt(r, f"job/g0/s{s}", T0 + 26 * S) for r, s in ((0, 20), (1, 10))]
    state, decisions = run([*reports, sim.kill(1, T0 + 27 * S)], state, cfg)
    assert issued(decisions, Restore) == []
    [failed] = of_type(decisions, JobFailed)
    assert "no committed snapshot can be restored (job/g0/s20: rank 0 " in failed.reason
    assert (
        f"and the job's initial state cannot be restored either: it is snapshot {INIT_FROM} of "
        "another job (init_from), and rank 1 on host h0 reported" in failed.reason
    )
    assert "allow_restart_from_scratch does not apply" in failed.reason


def test_another_jobs_snapshot_a_job_did_not_start_from_is_only_an_anomaly() -> None:
    sim = Sim()
    state, _ = run([*sim.start(T0), *sim.train(range(12), start=T0 + S)])
    assert state.committed
    report = init_from_corrupt(sim, 0, T0 + 13 * S)
    after, decisions = run([report], state)
    [anomaly] = decisions
    assert isinstance(anomaly, Anomaly)
    assert anomaly.kind == "unknown_snapshot"
    assert "neither a committed snapshot of this job nor the snapshot it started from" in (
        anomaly.reason
    )
    assert after.bad_snapshots == state.bad_snapshots
    assert after.phase == "running"


def test_an_onset_before_every_committed_step_fails_the_job() -> None:
    """A job reporting no loss has no step known sound but its first: a NaN at step 25 after
    commits at 10 and 20 has its onset before both, so neither may be restored, and step 0
    would discard them: the job fails, naming both."""
    sim = Sim(world_size=2)
    inputs: list[Input] = list(sim.start(T0))
    for step in range(25):
        at = T0 + (step + 1) * S
        inputs += [sim.heartbeat(r, step, at + r, loss=None) for r in range(2)]
        if step in (10, 20):
            inputs += [sim.checkpoint(r, step, at + 2 + r) for r in range(2)]
    state, _ = run(inputs)
    assert [m.step for m in state.committed] == [10, 20]
    state, decisions = run([sim.nan(1, 25, T0 + 27 * S)], state)
    assert issued(decisions, Restore) == []
    [failed] = of_type(decisions, JobFailed)
    for step in (20, 10):
        assert (
            f"job/g0/s{step}: written at step {step}, after the incident's onset (known "
            f"sound up to step 0)" in failed.reason
        )


# -- 3. crash-loop reasons that help -----------------------------------------------------------


def test_a_nan_on_the_first_step_after_every_restore_suspects_an_incomplete_restore() -> None:
    """2 ranks, commits 1000 and 1100, rank 0 exits after step 1150: restore(G+1, 1100); after
    every restore rank 1 reports a NaN loss at step 1101. The incidents say it is the first step
    after the restore; the crash loop's reason names rank 1 and step 1101 and suspects an
    incomplete restore."""
    sim = Sim(world_size=2)
    inputs: list[Input] = list(sim.start(T0))
    for first, last in ((0, 1000), (1001, 1100), (1101, 1150)):
        inputs += sim.train(range(first, last + 1), start=T0 + (first + 1) * S, checkpoint_every=0)
        if last in (1000, 1100):
            inputs += [sim.checkpoint(r, last, T0 + (last + 1) * S + 600 + r) for r in (0, 1)]
    state, decisions = run(inputs)
    assert [c.manifest.step for c in of_type(decisions, Committed)] == [1000, 1100]
    at = T0 + 1153 * S
    state, decisions = run([sim.crash(0, at)], state)
    restores = issued(decisions, Restore)
    opened = of_type(decisions, IncidentOpened)
    while state.phase == "restoring":
        restore = restores[-1]
        assert restore.target is not None
        assert restore.target.step == 1100
        at += 10 * S
        state, _ = run(rejoin(sim, restore, at, {}), state)
        at += 10 * S
        state, decisions = run([sim.heartbeat(0, 1101, at), sim.nan(1, 1101, at + 1)], state)
        restores += issued(decisions, Restore)
        opened += of_type(decisions, IncidentOpened)
    assert [o.cause for o in opened] == ["exited", "nan_loss", "nan_loss", "nan_loss"]
    for incident in opened[1:]:
        assert "step 1101 is the first step after the restore to step 1100" in incident.reason
    [failed] = of_type(decisions, JobFailed)
    for words in (
        "crash loop",
        "3 of the 4 incidents struck within 5 steps after a restore (rank 1 at step 1101",
        "steps the job had trained past before (it reached step 1150)",
        "suspect an incomplete restore",
        "gradient scaler",
    ):
        assert words in failed.reason, failed.reason


def test_a_failure_at_a_step_never_passed_before_may_also_be_the_batch() -> None:
    """Killed right after committing step 30, the job then fails at step 31 after every
    restore: it never trained step 31 before, so a batch that always fails is suspect too."""
    sim, state, restore = killed_job(steps=31)
    at = T0 + 40 * S
    while state.phase == "restoring":
        state, _ = run(rejoin(sim, restore, at, {}), state)
        state, decisions = run([sim.nan(2, 31, at + 10 * S)], state)
        restore = next(iter(issued(decisions, Restore)), restore)
        at += 20 * S
    [failed] = of_type(decisions, JobFailed)
    assert "(rank 2 at step 31 (job/i2, job/i3, job/i4)): suspect an incomplete restore" in (
        failed.reason
    )
    assert "or a batch that fails whenever it is trained." in failed.reason
    assert "trained past before" not in failed.reason


def test_an_exit_report_names_the_last_step_the_worker_completed() -> None:
    """The supervisor's exit report carries the worker's last completed step: it, not the last
    heartbeat's, is the step the reason names and the one judged against the restore."""
    sim, state, restore = killed_job()
    state, _ = run(sim.recover(restore, T0 + 45 * S), state)
    state, _ = run([sim.heartbeat(r, 31, T0 + 46 * S + r) for r in range(4)], state)
    state, decisions = run(
        [sim.supervisor((1,), "exited", T0 + 47 * S, exit_code=1, step=32)], state
    )
    [opened] = of_type(decisions, IncidentOpened)
    assert (
        "rank 1 on host h0 exited with exit code 1 in generation 1 after its last completed "
        "step 32 (reported by the supervisor" in opened.reason
    )
    assert "step 32 is 2 steps after the restore to step 30" in opened.reason


def test_an_incident_before_the_first_step_after_a_restore_says_so() -> None:
    sim, state, restore = killed_job()
    state, _ = run(sim.recover(restore, T0 + 45 * S), state)
    state, decisions = run([sim.kill(2, T0 + 46 * S)], state)
    [opened] = of_type(decisions, IncidentOpened)
    assert "it struck before the first step after the restore to step 30 completed" in (
        opened.reason
    )


def test_an_incident_long_after_a_restore_is_no_evidence_against_it() -> None:
    sim, state, restore = killed_job()
    state, _ = run(sim.recover(restore, T0 + 45 * S), state)
    state, _ = run(sim.train(range(31, 40), start=T0 + 46 * S), state)
    state, decisions = run([sim.kill(2, T0 + 56 * S)], state)
    [opened] = of_type(decisions, IncidentOpened)
    assert "after the restore" not in opened.reason
    assert state.loop.after_restore == ()


# -- 4. ranks that disagree on the data order --------------------------------------------------


def shard(sim: Sim, rank: int, step: int, at: int, **cursor: Any) -> Observed:
    """``rank``'s shard of ``step`` with its cursor's fields changed by ``cursor``."""
    item = sim.checkpoint(rank, step, at)
    assert isinstance(item.event, Checkpoint)
    changed = dataclasses.replace(item.event.cursor, **cursor)
    return item._replace(event=dataclasses.replace(item.event, cursor=changed))


def test_the_first_shard_on_another_seed_fails_the_job_naming_both_ranks() -> None:
    """A rank whose sampler seed differs (torch.initial_seed() of an unseeded process): the
    job fails at the first disagreeing shard, before the step could complete, naming both
    ranks and their values; no restore (none could reconcile them)."""
    sim = Sim()
    state, _ = run([*sim.start(T0), *sim.train(range(11), start=T0 + S, checkpoint_every=0)])
    state, decisions = run(
        [shard(sim, 0, 10, T0 + 12 * S), shard(sim, 3, 10, T0 + 12 * S + 1, seed=8)], state
    )
    [opened] = of_type(decisions, IncidentOpened)
    assert (opened.cause, opened.ranks, opened.hosts) == ("cursor_mismatch", (0, 3), ("h0", "h1"))
    assert (
        "rank 3 on host h1 reports seed 8, epoch 0, offset 320 (data version 'v1') in its "
        "checkpoint shard, rank 0 on host h0 seed 7, epoch 0, offset 320 (data version 'v1') "
        "in its checkpoint shard (they differ in the seed)" in opened.reason
    )
    [failed] = of_type(decisions, JobFailed)
    assert "torch.initial_seed()" in failed.reason
    assert issued(decisions, Restore) == []
    assert state.phase == "failed"


def data_cursor(sim: Sim, rank: int, step: int, at: int, **cursor: Any) -> Observed:
    item = sim.cursor(rank, step, at)
    assert isinstance(item.event, DataCursorEvent)
    changed = dataclasses.replace(item.event.cursor, **cursor)
    return item._replace(event=dataclasses.replace(item.event, cursor=changed))


def test_data_cursor_events_that_disagree_at_one_step_fail_the_job() -> None:
    sim = Sim()
    state, _ = run([*sim.start(T0), *sim.train(range(6), start=T0 + S)])
    agreeing = [data_cursor(sim, r, 5, T0 + 7 * S + r) for r in range(3)]
    state, decisions = run(agreeing, state)
    assert decisions == ()
    state, decisions = run([data_cursor(sim, 3, 5, T0 + 8 * S, epoch=1)], state)
    [opened] = of_type(decisions, IncidentOpened)
    assert opened.cause == "cursor_mismatch"
    assert "(they differ in the epoch)" in opened.reason
    assert "rank 0 on host h0 seed 7, epoch 0" in opened.reason


def test_a_shard_disagreeing_with_an_earlier_data_cursor_of_its_step_fails_the_job() -> None:
    sim = Sim()
    state, _ = run([*sim.start(T0), *sim.train(range(11), start=T0 + S, checkpoint_every=0)])
    state, _ = run([data_cursor(sim, 1, 10, T0 + 12 * S)], state)
    state, decisions = run([shard(sim, 2, 10, T0 + 13 * S, offset=7)], state)
    [opened] = of_type(decisions, IncidentOpened)
    assert "rank 1 on host h0 seed 7, epoch 0, offset 320" in opened.reason
    assert "(they differ in the offset)" in opened.reason


def test_agreeing_cursors_commit_and_their_references_stay_bounded() -> None:
    cfg = config(max_step_lag=10)
    sim = Sim(world_size=2)
    inputs: list[Input] = list(sim.start(T0))
    for step in range(60):
        at = T0 + (step + 1) * S
        inputs += [sim.heartbeat(r, step, at + r) for r in range(2)]
        inputs += [sim.cursor(r, step, at + 2 + r) for r in range(2)]
        if step and step % 10 == 0:
            inputs += [sim.checkpoint(r, step, at + 4 + r) for r in range(2)]
    state, decisions = run(inputs, cfg=cfg)
    assert of_type(decisions, IncidentOpened) == []
    assert of_type(decisions, Anomaly) == []
    assert [c.manifest.step for c in of_type(decisions, Committed)] == [10, 20, 30, 40, 50]
    assert len(state.watch.positions) <= cfg.max_step_lag + 1
    assert max(state.watch.positions) == 59
    assert decode_state(encode_state(state)) == state
