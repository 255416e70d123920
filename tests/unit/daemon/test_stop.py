"""Stopping a job on purpose and continuing it (``job-request`` inputs), on the pure state
machine: a stop ends the job ``stopped`` (never an incident, never a restore), a continue
restarts a stopped or failed job from its newest usable committed snapshot in a new generation,
fenced and idempotent (docs/operations.md, "Stopping and continuing a job")."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from msgspec import structs

from tests.support.machine_scenarios import (
    JOB,
    T0,
    S,
    Sim,
    acted,
    actions,
    config,
    issued,
    killed_job,
    of_type,
    play,
    pulses,
    request,
    run,
    running_job,
)
from trainguard.daemon.core._decisions import (
    IncidentClosed,
    IncidentOpened,
    Issue,
    Rejected,
    Transition,
)
from trainguard.daemon.core._inputs import Input, Observed, Tick
from trainguard.daemon.core._machine import next_deadline
from trainguard.daemon.core._state import JobState, new_job
from trainguard.daemon.core._state_codec import decode_state, encode_state
from trainguard.schemas import Abort, JobRequest, Restore, Resume

CFG = config()


def stopped_job(steps: int = 35) -> tuple[Sim, JobState]:
    """A 4-rank job that trained ``steps`` steps (commits at 10, 20, 30), then was stopped."""
    sim = Sim()
    state, _ = running_job(sim, steps)
    state, _ = run([request("stop", T0 + (steps + 1) * S, 0)], state)
    assert state.phase == "stopped"
    return sim, state


def recover(sim: Sim, state: JobState, restore: Restore, at: int) -> JobState:
    """Every rank restarts into ``restore``'s generation and acknowledges it."""
    state, decisions = run(sim.recover(restore, at), state)
    [resume] = issued(decisions, Resume)
    assert resume.generation == restore.generation
    return state


# -- stop ----------------------------------------------------------------------------------------


def test_a_stop_ends_a_running_job_stopped_with_an_abort_and_no_restore() -> None:
    sim = Sim()
    state, _ = running_job(sim, 35)
    at = T0 + 36 * S
    state, decisions = run([request("stop", at, 0, host="h0", pid=99, reason="maintenance")], state)
    [transition, issue] = decisions
    reason = "stopped on request from host h0 (pid 99) in generation 0: maintenance"
    assert transition == Transition(old="running", new="stopped", generation=0, reason=reason)
    assert isinstance(issue, Issue)
    assert issue.command == Abort(
        job_id=JOB,
        generation=0,
        ts=at,
        seq=1,
        daemon_id=CFG.daemon_id,
        reason=reason,
        outcome="stopped",
    )
    assert (state.phase, state.generation, state.failure) == ("stopped", 0, None)
    assert next_deadline(state, CFG) is None


def test_exits_after_a_stop_are_no_incident_and_time_decides_nothing() -> None:
    """What every supervisor does after its SIGTERM asked for the stop: stop its workers and
    report their exits; nothing of it is a failure, however long the job stays stopped."""
    sim, state = stopped_job()
    at = state.clock_ns
    later: list[Input] = [
        request("stop", at + 1, 0, host="h1", pid=8),  # the other node's supervisor asks too
        sim.kill(0, at + 2, signal=15),
        sim.kill(1, at + 3, signal=15),
        sim.kill(2, at + 4, signal=9),
        sim.heartbeat(3, 35, at + 5),
        Tick(at + 600 * S),
    ]
    assert run(later, state) == (state, ())


def test_a_stop_during_a_restore_closes_the_incident_as_stopped() -> None:
    _, state, restore = killed_job()
    assert state.incident is not None
    state, decisions = run([request("stop", state.clock_ns + S, restore.generation)], state)
    transition, issue, closed = decisions
    assert isinstance(transition, Transition)
    assert (transition.old, transition.new, transition.generation) == ("restoring", "stopped", 1)
    assert isinstance(issue, Issue)
    assert isinstance(issue.command, Abort)
    assert (issue.command.generation, issue.command.outcome) == (1, "stopped")
    assert closed == IncidentClosed(
        incident_id=restore.incident_id, outcome="stopped", attempts=1, reason=transition.reason
    )
    assert state.incident is None
    # The restore timeout that was running no longer fires.
    assert run([Tick(state.clock_ns + 3600 * S)], state) == (state, ())


def test_a_stop_of_an_older_generation_still_stops_the_job() -> None:
    """``trainguard stop`` read generation 0 from the bus just before the daemon restored."""
    _, state, _ = killed_job()
    state, decisions = run([request("stop", state.clock_ns + S, 0)], state)
    assert state.phase == "stopped"
    assert issued(decisions, Abort)[0].generation == 1


@pytest.mark.parametrize(
    ("generation", "code"),
    [(1, "future_generation")],
)
def test_a_stop_of_a_generation_the_daemon_never_created_is_rejected(
    generation: int, code: str
) -> None:
    sim = Sim()
    state, _ = running_job(sim, 5)
    new, decisions = run([request("stop", T0 + 6 * S, generation)], state)
    assert new == state
    [rejected] = decisions
    assert isinstance(rejected, Rejected)
    assert rejected.code == code


def test_a_stop_of_a_job_the_daemon_never_heard_of_is_rejected() -> None:
    state = new_job(JOB)
    new, decisions = run([request("stop", T0, 0)], state)
    assert new == state
    assert [d.code for d in of_type(decisions, Rejected)] == ["no_such_job"]


def test_a_duplicate_request_is_rejected_and_changes_nothing() -> None:
    sim = Sim()
    state, _ = running_job(sim, 5)
    copy = request("stop", T0 + 6 * S, 0, seq=3)
    state, decisions = run([copy, copy], state)
    assert state.phase == "stopped"
    assert len(issued(decisions, Abort)) == 1
    assert [d.code for d in of_type(decisions, Rejected)] == ["duplicate"]
    assert run([copy], state) == (state, decisions[-1:])


def test_a_request_from_the_future_is_rejected() -> None:
    sim = Sim()
    state, _ = running_job(sim, 5)
    at = T0 + 6 * S
    event = JobRequest(
        job_id=JOB, generation=0, ts=at + 3600 * S, seq=1, host="ops", pid=7, kind="stop"
    )
    new, decisions = run([Observed(at, None, event)], state)
    assert new == state
    assert [d.code for d in of_type(decisions, Rejected)] == ["future_timestamp"]


def test_a_request_for_another_job_is_rejected_in_every_phase() -> None:
    event = JobRequest(job_id="other", generation=0, ts=0, seq=1, host="ops", pid=7, kind="stop")
    _, stopped = stopped_job()
    for state in (running_job(Sim(), 5)[0], stopped):
        new, decisions = run([Observed(state.clock_ns + S, None, event)], state)
        assert new == state
        assert [d.code for d in of_type(decisions, Rejected)] == ["wrong_job"]


# -- continue ------------------------------------------------------------------------------------


def test_continue_restores_the_newest_committed_snapshot_in_a_new_generation() -> None:
    sim, state = stopped_job()
    at = state.clock_ns + 3600 * S
    state, decisions = run([request("continue", at, 0, host="h0", pid=5)], state)
    transition, opened, issue = decisions
    assert isinstance(transition, Transition)
    assert (transition.old, transition.new, transition.generation) == ("stopped", "restoring", 1)
    assert isinstance(opened, IncidentOpened)
    assert (opened.cause, opened.generation, opened.hosts) == ("continued", 0, ("h0",))
    assert "continued on request from host h0 (pid 5) after the job stopped in generation 0" in (
        opened.reason
    )
    assert isinstance(issue, Issue)
    restore = issue.command
    assert isinstance(restore, Restore)
    assert restore.target is not None
    assert (restore.generation, restore.target.snapshot_id, restore.mode) == (
        1,
        "job/g0/s30",
        "restart",
    )
    assert (restore.ts, restore.seq) == (at, 2)  # after the stop's abort (seq 1)
    assert (state.phase, state.continued_generation) == ("restoring", 1)
    # Coordinated as an incident's restore: once a tick shows it on the bus, it times out and
    # is retried if nobody acks ...
    assert next_deadline(state, CFG) is None
    state, _ = run([acted(state, at + 1)], state)
    assert next_deadline(state, CFG) == at + 1 + CFG.restore_timeout_ns + 1
    # ... and resumes once every rank acknowledged it.
    state = recover(sim, state, restore, at + S)
    assert (state.phase, state.generation, state.incident) == ("running", 1, None)


def test_the_continued_job_trains_and_recovers_as_usual() -> None:
    sim, state = stopped_job()
    state, decisions = run([request("continue", state.clock_ns + S, 0)], state)
    [restore] = issued(decisions, Restore)
    state = recover(sim, state, restore, state.clock_ns + S)
    start = state.clock_ns + S
    state, decisions = run(sim.train(range(31, 45), start=start), state)
    assert not of_type(decisions, IncidentOpened)
    state, decisions = run([sim.kill(2, state.clock_ns + S)], state)
    [again] = issued(decisions, Restore)
    assert again.target is not None
    assert (again.generation, again.target.snapshot_id) == (2, "job/g1/s40")


def test_continue_after_every_node_asked_issues_one_restore() -> None:
    """Each node's ``trainguard run --continue`` sends a continue: one restore for all."""
    _, state = stopped_job()
    at = state.clock_ns + S
    asks = [request("continue", at + i, 0, host=f"h{i}", pid=10 + i) for i in range(2)]
    state, decisions = run(asks, state)
    assert len(issued(decisions, Restore)) == 1
    assert not of_type(decisions, Rejected)


def test_a_stop_made_before_the_continuation_never_ends_the_continued_run() -> None:
    sim, state = stopped_job()
    state, decisions = run([request("continue", state.clock_ns + S, 0)], state)
    [restore] = issued(decisions, Restore)
    state = recover(sim, state, restore, state.clock_ns + S)
    late, decisions = run([request("stop", state.clock_ns + S, 0, host="h1", pid=8)], state)
    assert late == state
    [rejected] = decisions
    assert isinstance(rejected, Rejected)
    assert rejected.code == "stale_generation"
    assert "continued in generation 1" in rejected.reason
    # A stop of the continued run stops it again.
    state, decisions = run([request("stop", state.clock_ns + 2 * S, 1)], state)
    assert state.phase == "stopped"
    assert issued(decisions, Abort)[0].generation == 1


def test_continue_of_a_job_that_is_not_stopped_is_rejected() -> None:
    sim = Sim()
    state, _ = running_job(sim, 5)
    new, decisions = run([request("continue", T0 + 6 * S, 0)], state)
    assert new == state
    [rejected] = decisions
    assert isinstance(rejected, Rejected)
    assert rejected.code == "not_continuable"
    assert "the job is running in generation 0" in rejected.reason


def test_continue_naming_another_generation_than_the_stop_is_rejected() -> None:
    _, state, restore = killed_job()
    state, _ = run([request("stop", state.clock_ns + S, restore.generation)], state)
    new, decisions = run([request("continue", state.clock_ns + S, 0)], state)
    assert new == state
    assert [d.code for d in of_type(decisions, Rejected)] == ["stale_generation"]


def test_a_failed_job_can_be_continued_and_its_failure_is_cleared() -> None:
    _, state, _ = killed_job()
    for _ in range(3):
        assert state.incident is not None
        at = state.clock_ns
        state, _ = run(
            [acted(state, at), *pulses(state, at + 120 * S), Tick(at + 120 * S + 1)], state
        )
    assert (state.phase, state.generation) == ("failed", 3)
    assert state.loop.incidents
    state, decisions = run([request("continue", state.clock_ns + S, 3)], state)
    [restore] = issued(decisions, Restore)
    assert restore.target is not None
    assert (restore.generation, restore.target.snapshot_id) == (4, "job/g0/s30")
    assert (state.phase, state.failure) == ("restoring", None)
    assert state.loop.incidents == ()  # the crash-loop count starts afresh


def test_continue_is_refused_when_every_committed_snapshot_is_bad() -> None:
    _, state = stopped_job()
    bad = tuple((m.snapshot_id, "a shard's digest did not match") for m in state.committed)
    state = structs.replace(state, bad_snapshots=bad)
    at = state.clock_ns + S
    new, decisions = run([request("continue", at, 0, host="h0", pid=5)], state)
    [issue] = decisions
    assert isinstance(issue, Issue)
    abort = issue.command
    assert isinstance(abort, Abort)
    # A second abort of the stopped generation, newer than the first: the requester's answer.
    assert (abort.generation, abort.seq, abort.outcome) == (0, 2, "stopped")
    assert "continue request from host h0 (pid 5) refused" in abort.reason
    for step in (10, 20, 30):
        assert f"job/g0/s{step}: a shard's digest did not match" in abort.reason
    assert (new.phase, new.generation, new.command_seq) == ("stopped", 0, 2)


def test_continue_of_a_job_that_never_committed_restarts_it_from_its_initial_state() -> None:
    sim = Sim()
    state, _ = running_job(sim, 5)
    state, _ = run([request("stop", T0 + 6 * S, 0)], state)
    state, decisions = run([request("continue", T0 + 7 * S, 0)], state)
    [restore] = issued(decisions, Restore)
    assert restore.target is None


def test_a_redelivered_continue_is_answered_once() -> None:
    _, state = stopped_job()
    state = structs.replace(
        state, bad_snapshots=tuple((m.snapshot_id, "digest mismatch") for m in state.committed)
    )
    ask = request("continue", state.clock_ns + S, 0, seq=41)
    state, decisions = run([ask, ask], state)
    assert len(issued(decisions, Abort)) == 1
    assert [d.code for d in of_type(decisions, Rejected)] == ["duplicate"]


# -- state snapshots and replay ----------------------------------------------------------------


def test_the_stopped_and_continued_states_survive_a_state_snapshot() -> None:
    sim, state = stopped_job()
    assert decode_state(encode_state(state)) == state
    state, decisions = run([request("continue", state.clock_ns + S, 0)], state)
    assert state.continued_generation == 1
    decoded = decode_state(encode_state(state))
    assert decoded == state
    # A daemon restarted from the snapshot decides what it would have decided.
    [restore] = issued(decisions, Restore)
    acks = sim.recover(restore, state.clock_ns + S)
    assert run(acks, decoded) == run(acks, state)


@given(actions, st.sampled_from(["running", "restoring"]))
def test_after_a_stop_nothing_but_a_continue_changes_the_job(
    steps: list[tuple[str, int, int]], phase: str
) -> None:
    """Whatever the processes do after a stop (exits, heartbeats, acks, corrupt shards, time),
    the job stays stopped and nothing is decided."""
    if phase == "running":
        sim = Sim()
        state, _ = running_job(sim, 35)
    else:
        sim, state, _ = killed_job()
    state, _ = run([request("stop", state.clock_ns + 1, state.generation)], state)
    final, trace = play(sim, state, steps)
    assert final == state
    assert all(decisions == () for _, decisions in trace)
