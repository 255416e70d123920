"""Property tests of the state machine, one per invariant (ARCHITECTURE.md section 4)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.machine_scenarios import (
    ACTIONS,
    JOB,
    T0,
    S,
    Sim,
    actions,
    config,
    healthy_traces,
    issued,
    killed_job,
    of_type,
    play,
    pulses,
    restores_by_incident,
    run,
)
from trainguard.daemon.core._decisions import (
    Anomaly,
    Committed,
    IncidentClosed,
    IncidentOpened,
    JobFailed,
    Rejected,
)
from trainguard.daemon.core._inputs import Input, Observed
from trainguard.daemon.core._machine import decide, fold
from trainguard.daemon.core._state import TERMINAL_PHASES, new_job
from trainguard.schemas import Abort, Checkpoint, HeartbeatBatch, Restore

CFG = config()
MAX_ATTEMPTS = CFG.max_restore_attempts


@settings(max_examples=60, deadline=None)
@given(
    world_size=st.integers(1, 5),
    reports=st.data(),
)
def test_commit_rule_safety(world_size: int, reports: st.DataObject) -> None:
    """A step missing one rank's shard is never committed nor a restore target; the target
    is the newest step every rank reported, whatever order the shards arrive in."""
    sim = Sim(world_size=world_size)
    state, _ = run(sim.start(T0))
    steps = (5, 10, 15, 20)
    reporting = {
        step: reports.draw(st.sets(st.integers(0, world_size - 1)), label=f"ranks at {step}")
        for step in steps
    }
    # Shards of different ranks and steps arrive in any order; each sender's seq still
    # increases along its own events, as one producer's records do on one partition.
    pairs = [(step, r) for step in steps for r in sorted(reporting[step])]
    order = reports.draw(st.permutations(pairs), label="arrival order")
    shards = [sim.checkpoint(r, step, T0 + S + i) for i, (step, r) in enumerate(order)]
    state, decisions = run([*shards, sim.kill(0, T0 + 2 * S)], state)
    # The restore may wait (cut_settle_s) for the missing shards of a step rank 0 completed.
    state, waited = run(pulses(state, state.clock_ns + CFG.cut_settle_ns + 2 * S), state)
    decisions += waited
    complete = [step for step in steps if len(reporting[step]) == world_size]
    for committed in of_type(decisions, Committed):
        assert committed.manifest.step in complete
        assert [s.rank for s in committed.manifest.shards] == list(range(world_size))
    [restore] = issued(decisions, Restore)
    if complete:
        assert restore.target is not None
        assert restore.target.step == max(complete)
    else:
        assert restore.target is None


@settings(max_examples=60, deadline=None)
@given(
    steps=actions,
    stale=st.tuples(
        st.sampled_from(("heartbeat", "cursor", "checkpoint", "exited", "error", "restored")),
        st.integers(0, 3),
        st.integers(0, 10**12),
    ),
    redeliver=st.integers(0, 10**6),
)
def test_generation_fencing(
    steps: list[tuple[str, int, int]], stale: tuple[str, int, int], redeliver: int
) -> None:
    """An event of an older generation, or one delivered again, leaves the state unchanged
    (the very same object) and is rejected, wherever the job stands. (The stale events drawn
    here are none the late-finish and late-cut rules take in, a ``finished`` or a shard after
    the restore's target: ``test_late_cuts_commit_only_with_a_void_restore_and_are_never_targets``
    has those.)"""
    sim, state, _ = killed_job()
    state, trace = play(sim, state, steps)
    kind, rank, offset = stale
    at = state.clock_ns + offset
    old = Sim(generation=state.generation - 1)
    late = {
        "heartbeat": lambda: old.heartbeat(rank, 5, at),
        "cursor": lambda: old.cursor(rank, 5, at),
        "checkpoint": lambda: old.checkpoint(rank, 5, at),
        "exited": lambda: old.kill(rank, at),
        "error": lambda: old.corrupt(rank, "job/g0/s30", at),
        "restored": lambda: old.lifecycle(rank, "restored", at, snapshot_id="job/g0/s30"),
    }[kind]()
    candidates: list[Input] = [late]
    accepted = [
        item
        for item, decisions in trace
        if isinstance(item, Observed)
        and not isinstance(item.event, HeartbeatBatch)
        and item.event.generation == state.generation
        and not of_type(decisions, Rejected)
    ]
    if accepted:
        candidates.append(accepted[redeliver % len(accepted)])
    for item in candidates:
        after, decisions = decide(state, item, CFG)
        assert after is state
        if state.phase in TERMINAL_PHASES:
            assert decisions == ()
        else:
            [rejected] = decisions
            assert isinstance(rejected, Rejected)
            assert rejected.code in ("stale_generation", "duplicate")


@settings(max_examples=150, deadline=None)
@given(steps=actions)
def test_at_most_one_restore_per_incident(steps: list[tuple[str, int, int]]) -> None:
    """For any interleaving of exits, heartbeats, acknowledgements, corrupt-shard reports and
    ticks during a restore, each incident has one restore per attempt, numbered 1, 2, ... up to
    ``max_restore_attempts``; a job that runs out of attempts is aborted exactly once. The only
    incident without a restore is one the crash-loop guard stops, which fails the job."""
    sim, state, first = killed_job()
    state, trace = play(sim, state, steps)
    everything = [d for _, ds in trace for d in ds]
    for _, ds in trace:
        assert len(issued(ds, Restore)) <= 1
    groups = restores_by_incident([first, *issued(everything, Restore)])
    opened = [o.incident_id for o in of_type(everything, IncidentOpened)]
    closed = [c for c in of_type(everything, IncidentClosed) if c.attempts == 0]
    stopped = [c.incident_id for c in closed if c.outcome == "failed"]
    assert stopped in ([], opened[-1:])
    if stopped:
        assert state.phase == "failed"
        assert "crash loop" in (state.failure or "")
    # An incident opened while the bus settled after a gap holds its restore until then: the
    # job may finish meanwhile, or the trace end before it.
    unrestored = {c.incident_id for c in closed if c.outcome == "finished"}
    unrestored |= set() if state.held is None else {state.held.incident_id}
    assert list(groups) == [
        "job/i1",
        *(i for i in opened if i not in stopped and i not in unrestored),
    ]
    for restores in groups.values():
        assert [r.attempt for r in restores] == list(range(1, len(restores) + 1))
        assert len(restores) <= MAX_ATTEMPTS
        assert len({r.generation for r in restores}) == len(restores)
    aborts = issued(everything, Abort)
    assert len(aborts) == len(of_type(everything, JobFailed)) == (state.phase == "failed")
    if aborts:
        assert isinstance(everything[-1], JobFailed)


LATE = ("late_shard", "late_finish")


@st.composite
def late_bursts(draw: st.DrawFn) -> list[tuple[str, int, int, int]]:
    """What generation 0's ranks sent after the restore, in any order: some ranks' shards of
    steps 25 (before the target), 33, 35 and 36, some ranks' ``finished``. Each report is
    ``(what, rank, step, tenths of a second since the previous input)``."""
    reports = [
        ("late_shard", r, step)
        for step in (25, 33, 35, 36)
        for r in sorted(draw(st.sets(st.integers(0, 3)), label=f"shards of {step}"))
    ]
    reports += [("late_finish", r, 36) for r in sorted(draw(st.sets(st.integers(0, 3))))]
    order = draw(st.permutations(reports), label="arrival order")
    return [(*report, draw(st.integers(0, 30))) for report in order]


late_reports = st.tuples(
    st.sampled_from(LATE), st.integers(0, 3), st.sampled_from((33, 36)), st.integers(0, 150)
)


@settings(max_examples=150, deadline=None)
@given(
    burst=late_bursts(),
    then=st.lists(
        st.one_of(
            st.tuples(st.sampled_from(ACTIONS), st.integers(0, 3), st.integers(0, 150)),
            late_reports,
        ),
        max_size=30,
    ),
)
def test_late_cuts_commit_only_with_a_void_restore_and_are_never_targets(
    burst: list[tuple[str, int, int, int]], then: list[tuple[Any, ...]]
) -> None:
    """Shards and ``finished`` reports of generation 0 after its restore (to s30), before and
    among any behaviour of the restore's processes: no restore ever targets a step after s30;
    a step of generation 0 commits after the restore only in the input whose late finish
    voids it (the job is finished), and then the job's newest snapshot is at least as new as
    every step after s30 whose shards every rank had reported while nobody had joined the
    restore; once an event of a newer generation was accepted, every late report is stale and
    changes nothing."""
    sim, state, first = killed_job()
    assert first.target is not None
    assert first.target.step == 30
    old = Sim(world_size=sim.world_size)  # generation 0's processes, their pids as before
    restores = [first]
    joined = False
    sent: dict[int, set[int]] = {}
    for what, rank, *rest in [*burst, *then]:
        if what not in LATE:
            state, trace = play(sim, state, [(what, rank, *rest)])
            for item, decisions in trace:
                restores += issued(decisions, Restore)
                assert of_type(decisions, Committed) == []
                accepted = isinstance(item, Observed) and not of_type(decisions, Rejected)
                joined |= accepted and item.event.generation >= 1  # type: ignore[union-attr]
            continue
        step, tenths = rest
        at = state.clock_ns + tenths * S // 10
        if what == "late_shard":
            item = old.checkpoint(rank, step, at)
        else:
            item = old.lifecycle(rank, "finished", at, step=step)
        before = state
        state, decisions = decide(state, item, CFG)
        if joined or before.phase != "restoring":
            assert state is before
            assert all(isinstance(d, Rejected) for d in decisions)
            continue
        if what == "late_shard" and step > 30:
            sent.setdefault(step, set()).add(rank)
        committed = of_type(decisions, Committed)
        if state.phase == "finished":
            assert what == "late_finish"
            complete = [s for s, ranks in sent.items() if len(ranks) == sim.world_size]
            assert state.committed[-1].step >= max(complete, default=30)
            assert all(c.manifest.generation == 0 and c.manifest.step > 30 for c in committed)
        else:
            assert committed == []
    assert all(r.target is None or r.target.step <= 30 for r in restores)


@settings(max_examples=40, deadline=None)
@given(trace=healthy_traces(), steps=actions, split=st.integers(0, 10**6))
def test_fold_determinism(
    trace: tuple[Sim, list[Input]], steps: list[tuple[str, int, int]], split: int
) -> None:
    """Folding the same inputs gives the same decisions and state, in one go or in two parts,
    and the decisions' JSON forms are equal too."""
    sim, healthy = trace
    state, _ = run(healthy)
    _, played = play(sim, state, [("exit", 0, 1), *steps])
    inputs = [*healthy, *(item for item, _ in played)]
    first = fold(new_job(JOB), inputs, CFG)
    second = fold(new_job(JOB), inputs, CFG)
    assert first == second
    cut = split % (len(inputs) + 1)
    middle, head = fold(new_job(JOB), inputs[:cut], CFG)
    last, tail = fold(middle, inputs[cut:], CFG)
    assert (last, head + tail) == first
    assert [d.to_dict() for d in first[1]] == [d.to_dict() for d in second[1]]


@settings(max_examples=60, deadline=None)
@given(trace=healthy_traces())
def test_no_incident_on_a_healthy_trace(trace: tuple[Sim, list[Input]]) -> None:
    """Ranks that heartbeat within the timeout and progress never trigger a detector, and
    every checkpointed step commits."""
    _, inputs = trace
    state, decisions = run(inputs)
    assert of_type(decisions, IncidentOpened) == []
    assert of_type(decisions, Rejected) == []
    assert of_type(decisions, Anomaly) == []
    assert state.phase == "running"
    assert state.generation == 0
    written = {
        i.event.step for i in inputs if isinstance(i, Observed) and isinstance(i.event, Checkpoint)
    }
    assert {c.manifest.step for c in of_type(decisions, Committed)} == written
