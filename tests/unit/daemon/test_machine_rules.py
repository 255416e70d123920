"""Example tests of the state machine's rules, one scenario each (faults as data)."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from tests.support.machine_scenarios import (
    DAEMON,
    JOB,
    T0,
    S,
    Sim,
    acted,
    config,
    issued,
    killed_job,
    of_type,
    pulses,
    run,
    running_job,
)
from trainguard.daemon.core._decisions import (
    Anomaly,
    Committed,
    IncidentClosed,
    IncidentOpened,
    Issue,
    JobFailed,
    Rejected,
    Transition,
)
from trainguard.daemon.core._inputs import Input, Observed, Tick
from trainguard.daemon.core._machine import decide, next_deadline
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import new_job
from trainguard.schemas import (
    EXIT_CONFIG,
    Abort,
    Checkpoint,
    Lifecycle,
    Restore,
    Resume,
    StoredFile,
    files_digest,
    snapshot_ref,
)

CFG = config()


# -- starting, committing ---------------------------------------------------------------------


def test_job_runs_once_every_rank_was_heard() -> None:
    sim = Sim()
    state, decisions = run(sim.start(T0)[:3])
    assert state.phase == "starting"
    assert decisions == ()
    state, decisions = run(sim.start(T0)[3:], state)
    assert state.phase == "running"
    assert decisions == (
        Transition(
            old="starting",
            new="running",
            generation=0,
            reason="all 4 ranks reported in generation 0",
        ),
    )


def test_step_commits_when_every_rank_reported_its_shard() -> None:
    sim = Sim()
    state, _ = run(sim.start(T0))
    shards = [sim.checkpoint(r, 10, T0 + S + r) for r in (2, 0, 3, 1)]
    state, decisions = run(shards[:3], state)
    assert decisions == ()
    state, decisions = run(shards[3:], state)
    [committed] = of_type(decisions, Committed)
    manifest = committed.manifest
    assert manifest.snapshot_id == "job/g0/s10"
    assert [s.rank for s in manifest.shards] == [0, 1, 2, 3]
    assert manifest.shards[1].uri == "file:///ckpt/job/g0/s10/rank1.pt"
    assert manifest.cursor.offset == 10 * 4 * 8
    assert manifest.metadata.hyperparameters == {"lr": 0.1}
    assert manifest.ts == T0 + S + 3  # the daemon clock: the latest input time so far
    assert state.committed == (committed.snapshot,) == (snapshot_ref(manifest),)
    assert state.pending.get(10) is None


def test_shards_that_disagree_on_the_cursor_fail_the_job() -> None:
    sim = Sim()
    state, _ = run(sim.start(T0))
    shards = [sim.checkpoint(r, 10, T0 + S + r) for r in range(3)]
    shards.append(sim.checkpoint(3, 10, T0 + S + 3, offset=7))
    state, decisions = run(shards, state)
    [opened] = of_type(decisions, IncidentOpened)
    assert opened.cause == "cursor_mismatch"
    assert len(opened.ranks) == 2
    assert 3 in opened.ranks  # and one of the ranks it disagrees with
    assert of_type(decisions, Committed) == []
    assert state.phase == "failed"


def test_older_step_completing_after_a_newer_commit_is_not_kept() -> None:
    sim = Sim()
    state, _ = run(sim.start(T0))
    old = [sim.checkpoint(r, 10, T0 + S + r) for r in range(4)]
    new = [sim.checkpoint(r, 20, T0 + 2 * S + r) for r in range(4)]
    state, decisions = run([*old[:3], *new, old[3]], state)
    assert [c.manifest.step for c in of_type(decisions, Committed)] == [20]
    assert len(state.pending) == 0


def test_only_the_newest_snapshots_are_kept() -> None:
    sim = Sim()
    state, _ = running_job(sim, 60, cfg=config(keep_snapshots=2))
    assert [m.step for m in state.committed] == [40, 50]


def _from_origin(shard: Input, parent: str | None) -> Observed:
    """``shard`` (a checkpoint input) as a rank of a job started from ``parent`` sends it."""
    assert isinstance(shard, Observed)
    assert isinstance(shard.event, Checkpoint)
    return shard._replace(event=dataclasses.replace(shard.event, parent=parent))


def test_the_manifest_records_the_snapshot_the_job_started_from() -> None:
    sim = Sim()
    state, _ = run(sim.start(T0))
    origin = "pretrain/g2/s500"
    shards = [_from_origin(sim.checkpoint(r, 10, T0 + S + r), origin) for r in range(4)]
    state, decisions = run(shards, state)
    [committed] = of_type(decisions, Committed)
    assert committed.manifest.parent == origin
    assert state.committed[-1].parent == origin


def test_shards_that_disagree_on_the_origin_do_not_commit() -> None:
    sim = Sim()
    state, _ = run(sim.start(T0))
    shards = [_from_origin(sim.checkpoint(r, 10, T0 + S + r), "pretrain/g0/s5") for r in range(3)]
    shards.append(sim.checkpoint(3, 10, T0 + S + 3))
    state, decisions = run(shards, state)
    [anomaly] = decisions
    assert isinstance(anomaly, Anomaly)
    assert anomaly.kind == "checkpoint_mismatch"
    assert "rank 3: None" in anomaly.reason
    assert "started from" in anomaly.reason
    assert state.committed == ()


def _dcp(
    shard: Input, *names: str, folder: str = "file:///ckpt/job/g000000/s0000000010"
) -> Observed:
    """``shard`` (a checkpoint input) as a DCP shard listing files ``names`` in ``folder``."""
    assert isinstance(shard, Observed)
    assert isinstance(shard.event, Checkpoint)
    files = tuple(
        StoredFile(name=n, size_bytes=10 + i, digest="sha256:" + f"{i:x}" * 64)
        for i, n in enumerate(names)
    )
    event = dataclasses.replace(
        shard.event,
        shard_uri=folder,
        files=files,
        size_bytes=sum(f.size_bytes for f in files),
        digest=files_digest(files),
    )
    return shard._replace(event=event)


def _dcp_step(sim: Sim, **odd: Observed) -> list[Input]:
    """Step 10 of four ranks as DCP shards (rank 0 with ``.metadata``); ``odd`` replaces
    ranks' shards (keys ``r0`` .. ``r3``)."""
    shards: list[Input] = []
    for r in range(4):
        names = (".metadata", "__0_0.distcp") if r == 0 else (f"__{r}_0.distcp",)
        shards.append(odd.get(f"r{r}", _dcp(sim.checkpoint(r, 10, T0 + S + r), *names)))
    return shards


def test_a_dcp_step_commits_with_every_ranks_files() -> None:
    sim = Sim()
    state, _ = run(sim.start(T0))
    state, decisions = run(_dcp_step(sim), state)
    [committed] = of_type(decisions, Committed)
    shards = committed.manifest.shards
    assert {s.uri for s in shards} == {"file:///ckpt/job/g000000/s0000000010"}
    assert [f.name for s in shards for f in s.files or ()] == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
        "__3_0.distcp",
    ]
    assert all(s.format == "dcp" for s in shards)


@pytest.mark.parametrize(
    ("odd", "says"),
    [
        ({"r2": "torch"}, "mix formats (DCP: ranks 0, 1, 3; torch.save: ranks 2)"),
        ({"r1": "folder"}, "name different DCP folders"),
        ({"r3": "twice"}, "both list the file '__0_0.distcp' (ranks 0 and 3)"),
        ({"r0": "no metadata"}, "whose rank 0 does not list its .metadata file"),
        ({"r1": "metadata"}, "both list the file '.metadata' (ranks 0 and 1)"),
        ({"r2": "bad digest"}, "include rank 2's, whose digest or size does not sum up"),
    ],
)
def test_a_dcp_step_that_is_not_one_checkpoint_does_not_commit(
    odd: dict[str, str], says: str
) -> None:
    sim = Sim()
    state, _ = run(sim.start(T0))
    ((key, how),) = odd.items()
    rank = int(key[1])
    plain = sim.checkpoint(rank, 10, T0 + S + rank)
    own = (".metadata", "__0_0.distcp") if rank == 0 else (f"__{rank}_0.distcp",)
    replaced: Observed
    if how == "torch":
        assert isinstance(plain, Observed)
        replaced = plain
    elif how == "folder":
        replaced = _dcp(plain, *own, folder="file:///elsewhere/s0000000010")
    elif how == "twice":
        replaced = _dcp(plain, *own, "__0_0.distcp")
    elif how == "no metadata":
        replaced = _dcp(plain, "__0_0.distcp")
    elif how == "metadata":
        replaced = _dcp(plain, *own, ".metadata")
    else:
        good = _dcp(plain, *own)
        assert isinstance(good.event, Checkpoint)
        replaced = good._replace(event=dataclasses.replace(good.event, size_bytes=1))
    state, decisions = run(_dcp_step(sim, **{key: replaced}), state)
    [anomaly] = decisions
    assert isinstance(anomaly, Anomaly)
    assert anomaly.kind == "checkpoint_mismatch"
    assert says in anomaly.reason
    assert state.committed == ()


# -- incidents and restores ---------------------------------------------------------------------


def test_kill_restores_the_latest_committed_snapshot_once() -> None:
    sim = Sim()
    state, _ = running_job(sim, 38)
    state, decisions = run([sim.kill(1, T0 + 39 * S)], state)
    evidence = (
        "rank 1 on host h0 exited with signal 9 (SIGKILL) in generation 0 after its last reported step 37 "
        "(reported by the supervisor, pid 50001)"
    )
    transition, opened, issue = decisions
    assert transition == Transition(
        old="running", new="restoring", generation=1, reason=f"incident job/i1: {evidence}"
    )
    assert opened == IncidentOpened(
        incident_id="job/i1",
        cause="exited",
        generation=0,
        ranks=(1,),
        hosts=("h0",),
        reason=evidence,
    )
    assert isinstance(issue, Issue)
    restore = issue.command
    assert isinstance(restore, Restore)
    assert restore.target is not None
    assert restore.target.snapshot_id == "job/g0/s30"
    assert (restore.generation, restore.attempt, restore.seq) == (1, 1, 1)
    assert (restore.ts, restore.daemon_id, restore.incident_id) == (T0 + 39 * S, DAEMON, "job/i1")
    assert restore.reason == evidence
    assert state.phase == "restoring"
    assert state.generation == 1


def test_all_acknowledgements_resume_and_close_the_incident() -> None:
    sim, state, restore = killed_job()
    acks = sim.recover(restore, T0 + 43 * S)
    state, decisions = run(acks[:-1], state)
    assert decisions == ()
    state, decisions = run(acks[-1:], state)
    transition, issue, closed = decisions
    assert isinstance(transition, Transition)
    assert (transition.old, transition.new) == ("restoring", "running")
    assert isinstance(issue, Issue)
    assert issue.command == Resume(
        job_id=JOB, generation=1, ts=T0 + 43 * S + 103, seq=2, daemon_id=DAEMON, step=30
    )
    assert isinstance(closed, IncidentClosed)
    assert (closed.incident_id, closed.outcome, closed.attempts) == ("job/i1", "resumed", 1)
    assert state.phase == "running"
    assert state.incident is None


def test_a_supervisors_restored_report_is_no_acknowledgement() -> None:
    sim, state, restore = killed_job()
    acks = sim.recover(restore, T0 + 43 * S, ranks=range(3))
    state, decisions = run([*acks, sim.supervisor((2, 3), "restored", T0 + 46 * S)], state)
    assert issued(decisions, Resume) == []
    assert state.phase == "restoring"


def test_second_failure_after_recovery_opens_a_second_incident() -> None:
    sim, state, restore = killed_job()
    state, _ = run(sim.recover(restore, T0 + 43 * S), state)
    state, _ = run(sim.train(range(30, 45), start=T0 + 44 * S), state)
    assert state.committed[-1].snapshot_id == "job/g1/s40"
    state, decisions = run([sim.kill(2, T0 + 60 * S)], state)
    [opened] = of_type(decisions, IncidentOpened)
    [second] = issued(decisions, Restore)
    assert opened.incident_id == "job/i2"
    assert (second.generation, second.seq, second.attempt) == (2, 3, 1)
    assert second.target is not None
    assert second.target.snapshot_id == "job/g1/s40"


def test_failure_evidence_of_the_old_generation_is_fenced_during_restore() -> None:
    sim, state, _ = killed_job()
    late = [
        sim.kill(2, T0 + 40 * S),
        sim.crash(3, T0 + 40 * S),
        sim.heartbeat(0, 38, T0 + 40 * S),
    ]
    for item in late:
        new_state, decisions = decide(state, item, CFG)
        assert new_state is state
        [rejected] = decisions
        assert isinstance(rejected, Rejected)
        assert rejected.code == "stale_generation"
        assert rejected.reason.startswith("stale generation")


def test_rank_dying_during_restore_retries_with_a_new_generation() -> None:
    sim, state, restore = killed_job()
    acks = sim.recover(restore, T0 + 43 * S)
    state, _ = run(acks[:6], state)
    state, decisions = run([sim.crash(2, T0 + 46 * S)], state)
    [retry] = issued(decisions, Restore)
    assert of_type(decisions, IncidentOpened) == []
    assert (retry.incident_id, retry.attempt, retry.generation, retry.seq) == ("job/i1", 2, 2, 2)
    assert retry.target == restore.target
    assert retry.reason.startswith(
        "attempt 2: rank 2 on host h1 (pid 2002) exited with exit code 1"
    )
    assert state.generation == 2
    assert state.incident is not None
    assert len(state.incident.acks) == 0


def test_restore_timeout_retries() -> None:
    sim, state, restore = killed_job()
    state, _ = run(sim.recover(restore, T0 + 43 * S, ranks=range(3)), state)
    deadline = T0 + 39 * S + 120 * S + 1
    waiting = [
        sim.heartbeat(r, 30, t) for t in range(T0 + 48 * S, deadline, 5 * S) for r in (0, 1, 2)
    ]
    state, decisions = run([*waiting, Tick(deadline - 1)], state)
    assert decisions == ()
    assert next_deadline(state, CFG) == deadline
    state, decisions = run([Tick(deadline)], state)
    [retry] = issued(decisions, Restore)
    assert retry.attempt == 2
    assert "not acknowledged within 120 s by rank 3" in retry.reason


def test_corrupt_shard_restores_the_previous_committed_snapshot() -> None:
    sim, state, restore = killed_job()
    sim.generation = restore.generation
    state, decisions = run([sim.corrupt(2, "job/g0/s30", T0 + 43 * S)], state)
    anomaly, issue = decisions
    assert isinstance(anomaly, Anomaly)
    assert isinstance(issue, Issue)
    assert anomaly.kind == "snapshot_corrupt"
    retry = issue.command
    assert isinstance(retry, Restore)
    assert retry.target is not None
    assert retry.target.snapshot_id == "job/g0/s20"
    assert retry.attempt == 2
    # Restoring s20 abandons the timeline after it: s30 is no restore target any more, but why
    # it failed is kept until the next commit (a give-up names every snapshot tried).
    assert [m.snapshot_id for m in state.committed] == ["job/g0/s10", "job/g0/s20"]
    assert [sid for sid, _ in state.bad_snapshots] == ["job/g0/s30"]


def test_acknowledging_another_snapshot_is_a_failed_restore_of_that_rank() -> None:
    sim, state, restore = killed_job()
    assert restore.target is not None
    acks = sim.recover(restore, T0 + 45 * S, ranks=range(1, 4))
    wrong = sim.lifecycle(
        0, "restored", T0 + 46 * S, step=30, snapshot_id="job/g0/s20", cursor=restore.target.cursor
    )
    state, decisions = run([*acks, wrong], state)
    assert of_type(decisions, Rejected) == []
    assert issued(decisions, Resume) == []
    [retry] = issued(decisions, Restore)
    assert retry.generation == 2
    assert "rank 0 on host h0 acknowledged snapshot job/g0/s20 (expected job/g0/s30)" in (
        retry.reason
    )


def test_exhausted_restore_attempts_fail_the_job_loudly() -> None:
    sim, state, first = killed_job()
    restores = [first]
    for _ in range(3):
        # The tick the shell writes once the restore is out, then its timeout's.
        state, _ = run([acted(state, state.clock_ns)], state)
        timeout = state.watch.acted_ns + 120 * S + 1
        state, decisions = run([*pulses(state, timeout), Tick(timeout)], state)
        restores += issued(decisions, Restore)
    assert [r.attempt for r in restores] == [1, 2, 3]
    assert state.phase == "failed"
    transition, issue, closed, failed = decisions
    assert isinstance(transition, Transition)
    assert transition.new == "failed"
    assert isinstance(issue, Issue)
    abort = issue.command
    assert isinstance(abort, Abort)
    assert abort.generation == 3
    assert abort.seq == 4
    assert isinstance(closed, IncidentClosed)
    assert closed.outcome == "failed"
    assert isinstance(failed, JobFailed)
    assert "not recovered after 3 restore attempt(s)" in failed.reason
    assert abort.reason == failed.reason == state.failure
    assert next_deadline(state, CFG) is None
    # A failed job ignores further input.
    sim.generation = state.generation
    late: list[Input] = [sim.kill(0, state.clock_ns + S), Tick(state.clock_ns + 999 * S)]
    assert run(late, state) == (state, ())


def test_kill_before_any_commit_restores_from_scratch() -> None:
    sim = Sim()
    state, _ = running_job(sim, 5)
    state, decisions = run([sim.kill(0, T0 + 6 * S)], state)
    [restore] = issued(decisions, Restore)
    assert restore.target is None
    state, decisions = run(sim.recover(restore, T0 + 7 * S), state)
    [resume] = issued(decisions, Resume)
    assert resume.step == 0


def test_uncommitted_newer_step_is_never_the_target() -> None:
    sim = Sim()
    state, _ = running_job(sim, 38)
    partial = [sim.checkpoint(r, 37, T0 + 38 * S + r) for r in (0, 1, 3)]
    state, decisions = run([*partial, sim.kill(2, T0 + 39 * S)], state)
    [restore] = issued(decisions, Restore)
    assert restore.target is not None
    assert restore.target.step == 30


def test_world_size_may_change_with_a_new_generation() -> None:
    sim, state, restore = killed_job()
    sim.world_size = 2
    state, decisions = run(sim.recover(restore, T0 + 45 * S), state)
    assert [r.step for r in issued(decisions, Resume)] == [30]
    assert state.world_size == 2
    stray = sim.heartbeat(3, 31, T0 + 46 * S, world_size=4)
    _, decisions = decide(state, stray, CFG)
    assert [d.code for d in of_type(decisions, Rejected)] == ["world_size_conflict"]


# -- detectors ---------------------------------------------------------------------------------


def test_heartbeat_timeout_fires_on_a_tick() -> None:
    sim = Sim()
    state, _ = running_job(sim, 12)
    quiet = [sim.heartbeat(r, 12, T0 + 13 * S) for r in (0, 1, 3)]
    state, decisions = run(quiet, state)
    assert decisions == ()
    last_heard = T0 + 12 * S + 2_000_000  # rank 2's last heartbeat (step 11)
    for _ in range(3):  # the shell ticks at next_deadline; the bound only moves forward
        deadline = next_deadline(state, CFG)
        assert deadline is not None
        if deadline > last_heard + 10 * S:
            break
        state, decisions = run([*pulses(state, deadline), Tick(deadline)], state)
        assert decisions == ()
    state, decisions = run(
        [*pulses(state, last_heard + 10 * S), Tick(last_heard + 10 * S + 1)], state
    )
    [opened] = of_type(decisions, IncidentOpened)
    assert opened.cause == "heartbeat_timeout"
    assert (opened.ranks, opened.hosts) == ((2,), ("h1",))
    assert opened.reason == (
        "no event from rank 2 on host h1 for up to 10 s (heartbeat timeout 10 s) "
        "in generation 0 after its last reported step 11"
    )


def test_ticks_alone_notice_a_job_gone_quiet() -> None:
    sim = Sim()
    state, _ = running_job(sim, 3)
    for _ in range(2):
        deadline = next_deadline(state, CFG)
        assert deadline is not None
        state, _ = run([*pulses(state, deadline), Tick(deadline)], state)
        if state.phase != "running":
            break
    assert state.phase == "restoring"
    assert state.clock_ns <= T0 + 3 * S + 10 * S + 1


def test_startup_timeout_names_the_ranks_never_heard_from() -> None:
    sim = Sim()
    state, _ = run(sim.start(T0)[:3])
    state, decisions = run(
        [sim.heartbeat(r, 0, T0 + k * 5 * S) for k in range(1, 25) for r in range(3)], state
    )
    state, ticked = run([Tick(T0 + 120 * S)], state)
    assert decisions == ticked == ()
    state, decisions = run([Tick(T0 + 120 * S + 1)], state)
    [opened] = of_type(decisions, IncidentOpened)
    assert opened.cause == "startup_timeout"
    assert opened.ranks == (3,)


def test_finished_job_ignores_exits() -> None:
    sim = Sim()
    state, _ = running_job(sim, 20)
    finished = [sim.lifecycle(r, "finished", T0 + 21 * S, step=19) for r in range(4)]
    state, decisions = run(finished[:3], state)
    assert decisions == ()
    state, decisions = run([sim.kill(0, T0 + 21 * S + 1)], state)  # rank 0 finished: normal
    assert decisions == ()
    state, decisions = run(finished[3:], state)
    assert decisions == (
        Transition(
            old="running",
            new="finished",
            generation=0,
            reason="all 4 ranks finished in generation 0",
        ),
    )
    assert run([sim.kill(3, T0 + 22 * S), Tick(T0 + 999 * S)], state) == (state, ())
    assert state.phase == "finished"
    assert next_deadline(state, CFG) is None


# -- screening ---------------------------------------------------------------------------------


def test_duplicates_are_rejected_and_change_nothing() -> None:
    sim = Sim()
    state, _ = running_job(sim, 3)
    beat = sim.heartbeat(1, 3, T0 + 4 * S)
    state, _ = decide(state, beat, CFG)
    again, decisions = decide(state, Observed(T0 + 5 * S, 99, beat.event), CFG)
    assert again is state
    [rejected] = decisions
    assert isinstance(rejected, Rejected)
    assert rejected.code == "duplicate"


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"job_id": "other"}, "wrong_job"),
        ({"generation": 5}, "future_generation"),
        ({"world_size": 8}, "world_size_conflict"),
        ({"rank": 4}, "rank_out_of_range"),
    ],
)
def test_invalid_events_are_rejected(change: dict[str, object], code: str) -> None:
    sim = Sim()
    state, _ = running_job(sim, 3)
    beat = sim.heartbeat(1, 3, T0 + 4 * S)
    # The changes hold values of several types; mypy checks **kwargs against each field.
    forged = dataclasses.replace(beat.event, **change)  # type: ignore[arg-type]
    new_state, decisions = decide(state, Observed(beat.at_ns, None, forged), CFG)
    assert new_state is state
    assert [d.code for d in of_type(decisions, Rejected)] == [code]


def test_an_event_stamped_far_in_the_future_is_rejected() -> None:
    sim = Sim()
    state, _ = running_job(sim, 3)
    beat = sim.heartbeat(1, 3, T0 + 4 * S)
    within = dataclasses.replace(beat.event, ts=beat.at_ns + 300 * S)
    _, decisions = decide(state, Observed(beat.at_ns, None, within), CFG)
    assert of_type(decisions, Rejected) == []
    ahead = dataclasses.replace(beat.event, ts=beat.at_ns + 301 * S)
    new_state, decisions = decide(state, Observed(beat.at_ns, None, ahead), CFG)
    assert new_state is state
    [rejected] = of_type(decisions, Rejected)
    assert rejected.code == "future_timestamp"
    assert "max_clock_skew_s" in rejected.reason


def test_clock_never_goes_back() -> None:
    sim = Sim()
    state, _ = run(sim.start(T0 + 10 * S))
    state, _ = run([sim.heartbeat(0, 1, T0 + 5 * S)], state)
    assert state.clock_ns == T0 + 10 * S + 3
    assert state.ranks[0].last_heard_ns == T0 + 10 * S + 3


def test_supervisor_exit_without_ranks_is_reported() -> None:
    sim = Sim()
    state, _ = running_job(sim, 3)
    state, decisions = run([sim.supervisor((0,), "exited", T0 + 4 * S, exit_code=1)], state)
    assert of_type(decisions, IncidentOpened)
    bare = sim.supervisor((0,), "exited", T0 + 4 * S)
    assert isinstance(bare.event, Lifecycle)
    event = dataclasses.replace(bare.event, ranks=(), generation=1)
    _, decisions = decide(state, Observed(bare.at_ns, None, event), CFG)
    assert [d.kind for d in of_type(decisions, Anomaly)] == ["exit_without_ranks"]


def test_errors_without_consequence_are_reported_as_anomalies() -> None:
    sim = Sim()
    state, _ = running_job(sim, 12)
    reports = [
        sim.lifecycle(1, "error", T0 + 13 * S, message="CUDA error: out of memory"),
        sim.corrupt(2, "job/g0/s99", T0 + 13 * S),
        sim.corrupt(3, "job/g0/s10", T0 + 13 * S),
    ]
    state, decisions = run(reports, state)
    assert [(a.kind, a.reason) for a in of_type(decisions, Anomaly)] == [
        (
            "rank_error",
            "rank 1 on host h0 reported an error in generation 0: CUDA error: out of memory",
        ),
        (
            "unknown_snapshot",
            "rank 2 on host h1 reported that snapshot job/g0/s99 failed verification, but it "
            "is not a committed snapshot of this job: digest mismatch",
        ),
        (
            "snapshot_corrupt",
            "rank 3 on host h1 reported that snapshot job/g0/s10 failed verification: "
            "digest mismatch; no longer a restore target",
        ),
    ]
    assert len(decisions) == 3
    assert state.bad_snapshots == (
        (
            "job/g0/s10",
            "rank 3 on host h1 reported that snapshot job/g0/s10 failed verification: "
            "digest mismatch",
        ),
    )
    assert state.phase == "running"


def test_an_error_about_an_earlier_step_never_moves_a_ranks_step_back() -> None:
    """A background checkpoint write of step 5 that failed is reported after the rank went on
    to step 11: the rank stays at 11; an error naming a later step shows that step."""
    sim = Sim()
    state, _ = running_job(sim, 12)
    assert state.ranks[1].step == 11
    failed = sim.lifecycle(1, "error", T0 + 13 * S, step=5, message="checkpoint write failed")
    state, _ = run([failed], state)
    assert state.ranks[1].step == 11
    ahead = sim.lifecycle(1, "error", T0 + 13 * S, step=12, message="checkpoint write failed")
    state, _ = run([ahead], state)
    assert state.ranks[1].step == 12


def test_exit_before_every_rank_was_heard_is_an_incident() -> None:
    sim = Sim()
    state, _ = run(sim.start(T0)[:2])
    state, decisions = run([sim.supervisor((2, 3), "exited", T0 + S, exit_code=127)], state)
    [opened] = of_type(decisions, IncidentOpened)
    assert opened.ranks == (2, 3)
    assert opened.reason == (
        "ranks 2, 3 on host h1 exited with exit code 127 in generation 0 "
        "(reported by the supervisor, pid 50002)"
    )
    assert of_type(decisions, Transition)[0].old == "starting"


def test_an_exit_report_names_what_the_worker_said_last() -> None:
    sim = Sim()
    state, _ = running_job(sim, 12)
    said = "RuntimeError: CUDA error: an illegal memory access was encountered"
    exit_report = sim.supervisor((1,), "exited", T0 + 13 * S, exit_code=1, message=said)
    state, decisions = run([exit_report], state)
    [opened] = of_type(decisions, IncidentOpened)
    assert opened.reason.endswith(f"(reported by the supervisor, pid 50001): {said}")
    [restore] = issued(decisions, Restore)  # a crash: restored as ever
    assert restore.reason.endswith(said)


def test_a_worker_that_exited_with_a_configuration_error_fails_the_job_at_once() -> None:
    """Exit status 78 (EXIT_CONFIG): no restore, the job fails with the worker's last words,
    whether the job was starting (nothing heard yet), running or restoring."""
    said = "trainguard.agent._errors.ConfigError: checksum_every must be >= 0 steps, got -1"
    sim = Sim()
    state, _ = run([sim.supervisor((0, 1), "started", T0)])  # no rank spoke yet
    exit_report = sim.supervisor((0,), "exited", T0 + S, exit_code=EXIT_CONFIG, message=said)
    state, decisions = run([exit_report], state)
    assert issued(decisions, Restore) == []
    [opened] = of_type(decisions, IncidentOpened)
    [abort] = issued(decisions, Abort)
    [failed] = of_type(decisions, JobFailed)
    assert state.phase == "failed"
    assert (
        abort.reason
        == failed.reason
        == (
            "incident job/i1: rank 0 on host h0 exited with exit code 78 (a configuration error) "
            f"in generation 0 (reported by the supervisor, pid 50000): {said}; not restarted: a "
            "restarted worker would find the same configuration"
        )
    )
    [closed] = of_type(decisions, IncidentClosed)
    assert (closed.incident_id, closed.outcome) == (opened.incident_id, "failed")

    # While restoring, the open incident fails with it: no further attempt.
    sim, state, restore = killed_job()
    sim.generation = restore.generation
    exit_report = sim.supervisor((2,), "exited", T0 + 44 * S, exit_code=EXIT_CONFIG, message=said)
    state, decisions = run([exit_report], state)
    assert issued(decisions, Restore) == []
    assert of_type(decisions, IncidentOpened) == []
    [closed] = of_type(decisions, IncidentClosed)
    assert (closed.incident_id, closed.outcome) == ("job/i1", "failed")
    assert state.phase == "failed"
    assert state.failure is not None
    assert said in state.failure


# -- decisions, config, purity -----------------------------------------------------------------


def test_decisions_serialise_to_stable_json() -> None:
    sim, state, restore = killed_job()
    state, decisions = run(sim.recover(restore, T0 + 45 * S), state)
    _, kill = run([sim.kill(0, T0 + 50 * S)], state)
    every = (*decisions, *kill)
    dumped = [orjson.dumps(d.to_dict()) for d in every]
    assert dumped == [orjson.dumps(d.to_dict()) for d in every]
    restore_dict = kill[-1].to_dict()
    assert restore_dict["decision"] == "issue"
    command = restore_dict["command"]
    assert isinstance(command, dict)
    assert command["schema"] == Restore.SCHEMA
    target = command["target"]
    assert isinstance(target, dict)
    assert target["snapshot_id"] == "job/g0/s30"
    assert {d.to_dict()["decision"] for d in every} >= {"transition", "issue", "incident_closed"}


@pytest.mark.parametrize(
    "bad",
    [
        {"daemon_id": ""},
        {"heartbeat_timeout_s": 0.0},
        {"restore_timeout_s": float("inf")},
        {"startup_timeout_s": float("nan")},
        {"max_restore_attempts": 0},
        {"keep_snapshots": 0},
    ],
)
def test_config_rejects_nonsense(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case has its own message
        # Values of several types in one dict; mypy checks **kwargs against every field.
        MachineConfig(**{"daemon_id": "d", **bad})  # type: ignore[arg-type]


def test_config_converts_seconds_to_nanoseconds() -> None:
    cfg = MachineConfig(daemon_id="d", heartbeat_timeout_s=2.5, bus_gap_s=2.0)
    assert cfg.heartbeat_timeout_ns == 2_500_000_000
    assert cfg.startup_timeout_ns == 120 * S


def test_new_job_starts_in_generation_zero() -> None:
    state = new_job("j")
    assert (state.job_id, state.phase, state.generation, state.clock_ns) == ("j", "starting", 0, 0)
    assert next_deadline(state, CFG) is None
