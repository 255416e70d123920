"""Round trips of the job-state codec (``jobstate/1``) over simulated jobs: every state that
generated fault and restore traces and the scenarios reach encodes and decodes exactly, and a
fold continued from a decoded state decides exactly as the original did."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import structs
from rpds import HashTrieMap

from tests.support.machine_scenarios import (
    JOB,
    T0,
    S,
    Sim,
    actions,
    config,
    healthy_traces,
    issued,
    killed_job,
    play,
    run,
)
from tests.support.traces import Faults, Job, PhaseSpec, drive, paces, simulate
from trainguard.daemon.core._decisions import Decision
from trainguard.daemon.core._inputs import Input, Tick
from trainguard.daemon.core._machine import decide
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import (
    Incident,
    JobState,
    RankState,
    Spike,
    Trend,
    Watch,
    new_job,
)
from trainguard.daemon.core._state_codec import (
    FORMAT,
    LAYOUT,
    decode_state,
    encode_state,
    state_from_dict,
    state_to_dict,
)
from trainguard.daemon.core._window import Window
from trainguard.schemas import Restore

CFG = config()
IN_PROCESS = config(restore_mode="in_process")


class Folding(NamedTuple):
    """A fold recorded input by input: ``states[i]`` is the state before ``inputs[i]`` (and
    ``states[-1]`` the last one), ``decisions[i]`` what ``inputs[i]`` decided."""

    inputs: list[Input]
    states: list[JobState]
    decisions: list[tuple[Decision, ...]]
    cfg: MachineConfig


def record(inputs: Iterable[Input], cfg: MachineConfig, state: JobState | None = None) -> Folding:
    state = new_job(JOB) if state is None else state
    folding = Folding([], [state], [], cfg)
    for item in inputs:
        state, decisions = decide(state, item, cfg)
        folding.inputs.append(item)
        folding.states.append(state)
        folding.decisions.append(decisions)
    return folding


def exact_copy(state: JobState) -> JobState:
    """Encode and decode ``state``, checking the copy is equal and of the same types: its
    encoding is the same bytes (an int where a float was, -0.0 for 0.0 or a list for a tuple
    would change them)."""
    data = encode_state(state)
    back = decode_state(data)
    assert back == state
    assert encode_state(back) == data
    assert state_from_dict(state_to_dict(state)) == state
    return back


def plain(decisions: Iterable[Decision]) -> list[dict[str, Any]]:
    """Decisions in their JSON form (equal even when a measure is NaN)."""
    return [d.to_dict() for d in decisions]


def resumes_exactly(folding: Folding, cut: int) -> None:
    """Invariant: restoring the state at ``cut`` from its encoding and folding the rest of the
    inputs gives the original fold's decisions, input by input, and its last state."""
    state = exact_copy(folding.states[cut])
    for item, expected in zip(folding.inputs[cut:], folding.decisions[cut:], strict=True):
        state, decisions = decide(state, item, folding.cfg)
        assert plain(decisions) == plain(expected)
    assert state == folding.states[-1]
    assert encode_state(state) == encode_state(folding.states[-1])


# -- generated traces -------------------------------------------------------------------------


FAULT_KINDS = ("none", "hang", "stuck", "nan", "spike", "checksum", "version", "restart")


@st.composite
def fault_jobs(draw: st.DrawFn) -> Job:
    """Short simulated jobs (20-60 steps of up to 2 s, 1-4 ranks) with at most one fault of
    any kind, and a tail of up to 400 s after the last step, long enough for restores that
    nobody acknowledges to time out, be retried and fail the job."""
    world_size = draw(st.integers(1, 4))
    steps = draw(st.integers(20, 60))
    at = draw(st.integers(10, steps))
    rank = draw(st.integers(0, world_size - 1))
    kind = draw(st.sampled_from(FAULT_KINDS))
    faults = Faults()
    if kind == "hang":
        faults = Faults(hang_after=at)
    elif kind == "stuck":
        faults = Faults(stuck_in=(rank, at, draw(st.sampled_from(["checkpoint", "eval", "data"]))))
    elif kind == "nan":
        faults = Faults(nan=(rank, at))
    elif kind == "spike":
        faults = Faults(spike=(at, draw(st.floats(5.0, 50.0)), draw(st.integers(1, 8))))
    elif kind == "checksum":
        faults = Faults(odd_checksum=(rank, at))
    elif kind == "version":
        faults = Faults(odd_version=(rank, at))
    elif kind == "restart":
        faults = Faults(restart_from_zero=(rank, at))
    phase_at = draw(st.none() | st.integers(6, steps))
    phases = (
        ()
        if phase_at is None
        else (PhaseSpec(phase_at, draw(st.sampled_from(["checkpoint", "eval"])), 5.0),)
    )
    pace = draw(paces(low_s=0.05, high_s=2.0))
    heartbeat = draw(st.floats(0.5, 1.0))
    return Job(
        world_size=world_size,
        steps=steps,
        pace=pace,
        heartbeat_s=heartbeat,
        jitter_s=draw(st.floats(0.0, heartbeat / 2 - 0.01)),
        delay_s=draw(st.floats(0.0, 0.2)),
        init_s=draw(st.floats(1.0, 10.0)),
        first_step_s=pace.base_s * draw(st.floats(1.0, 5.0)),
        checkpoint_every=5 if kind == "version" else draw(st.sampled_from([0, 5, 10])),
        checksum_every=5 if kind == "checksum" else draw(st.sampled_from([0, 5])),
        loss_noise=draw(st.floats(0.0, 0.05)),
        phases=phases,
        faults=faults,
        tail_s=draw(st.sampled_from([2.0, 60.0, 400.0])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def shell_inputs(job: Job, cfg: MachineConfig) -> list[Input]:
    """``job``'s inputs with the ticks the daemon's shell adds at every deadline."""
    trace = simulate(job)
    _, folded = drive(trace.inputs, cfg=cfg, until=trace.end_ns)
    return [item for item, _ in folded]


def cut_points(folding: Folding, picks: Sequence[int]) -> list[int]:
    return sorted({p % len(folding.states) for p in picks} | {len(folding.states) - 1})


@settings(max_examples=20, deadline=None)
@given(
    job=fault_jobs(),
    cfg=st.sampled_from([CFG, IN_PROCESS]),
    picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=2),
)
def test_fault_traces_resume_exactly_from_decoded_states(
    job: Job, cfg: MachineConfig, picks: list[int]
) -> None:
    """Healthy jobs, hangs, ranks stuck in a phase, NaN losses, loss spikes, checksum and data
    version mismatches, ranks restarting behind the daemon's back, each with restart or
    in-process restores: any state along the fold round-trips exactly and resumes exactly."""
    folding = record(shell_inputs(job, cfg), cfg)
    for cut in cut_points(folding, picks):
        resumes_exactly(folding, cut)


@settings(max_examples=40, deadline=None)
@given(
    trace=healthy_traces(),
    steps=actions,
    picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=3),
)
def test_restore_traces_resume_exactly_from_decoded_states(
    trace: tuple[Sim, list[Input]], steps: list[tuple[str, int, int]], picks: list[int]
) -> None:
    """A healthy start, a kill, then any interleaving of acknowledgements, heartbeats, exits,
    stale exits, corrupt snapshots, cursors, finishes, full recoveries and ticks: any state
    along the fold round-trips exactly and resumes exactly."""
    sim, healthy = trace
    state, _ = run(healthy)
    _, played = play(sim, state, [("exit", 0, 1), *steps])
    folding = record([*healthy, *(item for item, _ in played)], CFG)
    for cut in cut_points(folding, picks):
        resumes_exactly(folding, cut)


# -- coverage: every kind of value the state holds ---------------------------------------------


def features(state: JobState) -> set[str]:
    """The kinds of value ``state`` holds beyond the defaults."""
    found = {f"phase:{state.phase}"}
    incident = state.incident
    if incident is not None:
        found |= {"incident", f"mode:{incident.mode}"}
        found |= {"target"} if incident.target is not None else set()
        found |= {"acks"} if incident.acks else set()
        found |= {"ack cursor"} if any(a.cursor for a in incident.acks.values()) else set()
        found |= {"skip"} if incident.skip is not None else set()
    spike = state.watch.spike
    if spike is not None:
        found |= {"spike", "infinite z"} if math.isinf(spike.z) else {"spike"}
    checks = {
        "checksums": bool(state.watch.checksums),
        "agreed": bool(state.watch.agreed),
        "versions": bool(state.watch.versions),
        "pending": bool(state.pending),
        "committed": bool(state.committed),
        "bad snapshots": bool(state.bad_snapshots),
        "crash loop": bool(state.loop.incidents),
        "after restore": bool(state.loop.after_restore),
        "positions": bool(state.watch.positions),
        "progress timeout": state.trend.progress_timeout_ns is not None,
        "loss level": state.trend.loss_mad is not None,
        "straggling": any(r.straggling for r in state.ranks.values()),
        "dead rank": any(r.status == "dead" for r in state.ranks.values()),
        "long phase": state.watch.long_phases > 0,
        "acted": state.watch.acted_ns > 0,
        "held": state.watch.held,
        "settle window": state.settle_until_ns is not None,
        "restore held": state.held is not None,
        "held evidence": state.held is not None and state.held.evidence is not None,
        "held restart": state.held is not None and state.held.restart,
        "held awaits": state.held is not None and state.held.awaits is not None,
        "supervisor sender": any(rank is None for rank, _, _ in state.senders),
        "left": state.left is not None,
        "left finished": state.left is not None and bool(state.left.finished),
        "left pending": state.left is not None and bool(state.left.pending),
        "left cuts": state.left is not None and bool(state.left.cuts),
    }
    return found | {name for name, present in checks.items() if present}


def spike_then_in_process_restore() -> Folding:
    """A 4-rank job with checksums, checkpoints and an eval phase whose loss spikes: the
    in-process restore skips the spiking steps."""
    job = Job(
        checksum_every=5,
        checkpoint_every=5,
        phases=(PhaseSpec(20, "eval", 5.0),),
        faults=Faults(spike=(40, 20.0, 10)),
    )
    return record(shell_inputs(job, IN_PROCESS), IN_PROCESS)


def spike_on_a_flat_loss() -> Folding:
    """A constant loss (zero MAD) that jumps: the spike's robust z-score is infinite."""
    sim = Sim()
    return record(
        [*sim.start(T0), *sim.train(range(40), start=T0 + S, loss=lambda k: 2.5 + 20 * (k >= 30))],
        CFG,
    )


def straggler() -> Folding:
    """Rank 3's steps take three times as long as the others'."""
    sim = Sim()
    inputs: list[Input] = [*sim.start(T0)]
    for step in range(30):
        at = T0 + (step + 1) * S
        inputs += [
            sim.heartbeat(r, step, at + r, step_time_s=3.0 if r == 3 else 1.0) for r in range(4)
        ]
    return record(inputs, CFG)


def failed_restores() -> Folding:
    """A kill, then a partial acknowledgement, a corrupt target and exits of restarted ranks
    until the restore attempts run out and the job fails with rank 2 dead."""
    sim, state, _ = killed_job()
    steps = [("ack", 0, 5), ("corrupt", 1, 3), ("beat", 2, 1), ("exit", 2, 3)]
    steps += [("beat", 2, 1), ("exit", 2, 3), ("tick", 0, 1300)]
    _, played = play(sim, state, steps)
    return record((item for item, _ in played), CFG, state)


def finished_job() -> Folding:
    """A job that trains with checkpoints, recovers from a kill, learns that an older snapshot
    is corrupt and finishes."""
    sim = Sim()
    inputs = [*sim.start(T0), *sim.train(range(25), start=T0 + S)]
    _, decisions = run([*inputs, sim.kill(1, T0 + 30 * S)])
    [restore] = issued(decisions, Restore)
    inputs += [sim.kill(1, T0 + 30 * S), *sim.recover(restore, T0 + 31 * S)]
    inputs += sim.train(range(20, 25), start=T0 + 32 * S)
    inputs.append(sim.corrupt(0, "job/g0/s10", T0 + 38 * S))
    inputs += [sim.lifecycle(r, "finished", T0 + 40 * S + r, step=24) for r in range(4)]
    return record(inputs, CFG)


def early_exit_after_a_restore() -> Folding:
    """A job reporting its data cursors is killed, restored, and killed again before its first
    step after the restore: the crash-loop guard keeps that incident as evidence."""
    sim = Sim()
    inputs = [*sim.start(T0), *sim.train(range(25), start=T0 + S)]
    inputs += [sim.cursor(r, 24, T0 + 26 * S + r) for r in range(4)]
    _, decisions = run([*inputs, sim.kill(1, T0 + 30 * S)])
    [restore] = issued(decisions, Restore)
    inputs += [sim.kill(1, T0 + 30 * S), *sim.recover(restore, T0 + 31 * S)]
    inputs.append(sim.kill(2, T0 + 33 * S))
    return record(inputs, CFG)


def held_after_an_outage() -> Folding:
    """A job restored to step 20 after a kill, whose loss is NaN at once (evidence against the
    restore), reported after a gap: its restore is held while the bus settles, a kill joins it
    (so it restarts), and it is issued at the settle deadline."""
    sim = Sim()
    inputs = [*sim.start(T0), *sim.train(range(25), start=T0 + S)]
    _, decisions = run([*inputs, sim.kill(1, T0 + 27 * S)])
    [restore] = issued(decisions, Restore)
    inputs += [sim.kill(1, T0 + 27 * S), *sim.recover(restore, T0 + 28 * S)]
    inputs += [sim.nan(0, 21, T0 + 60 * S), sim.kill(2, T0 + 61 * S), Tick(T0 + 65 * S)]
    return record(inputs, CFG)


def finished_before_its_restore() -> Folding:
    """A job restored after its rank 1 was killed, whose rank 0's ``finished`` of the
    generation the restore left arrives before anyone joined the restore, after both ranks'
    shards of step 22 (a late cut) and rank 0's of step 25; rank 0's shard of step 24 came
    before the restore (both steps pending in the generation left)."""
    sim = Sim(world_size=2)
    inputs = [*sim.start(T0), *sim.train(range(20), start=T0 + S)]
    inputs += [sim.checkpoint(0, 24, T0 + 21 * S), sim.kill(1, T0 + 21 * S)]
    inputs += [sim.checkpoint(r, 22, T0 + 22 * S) for r in range(2)]
    inputs += [sim.checkpoint(0, 25, T0 + 22 * S)]
    inputs.append(sim.lifecycle(0, "finished", T0 + 22 * S, step=19))
    return record(inputs, CFG)


def held_for_a_checkpoint_in_flight() -> Folding:
    """Rank 1 reported its shard of step 25 and was killed before rank 0's shard of it
    arrived: the restore waits for it (``cut_settle_s``) and goes out once it commits."""
    sim = Sim(world_size=2)
    inputs = [*sim.start(T0), *sim.train(range(25), start=T0 + S)]
    inputs += [sim.checkpoint(1, 25, T0 + 26 * S), sim.kill(1, T0 + 26 * S + 1)]
    inputs += [sim.checkpoint(0, 25, T0 + 26 * S + S // 2)]
    return record(inputs, CFG)


SCENARIOS: list[Callable[[], Folding]] = [
    spike_then_in_process_restore,
    spike_on_a_flat_loss,
    straggler,
    failed_restores,
    finished_job,
    early_exit_after_a_restore,
    held_after_an_outage,
    finished_before_its_restore,
    held_for_a_checkpoint_in_flight,
]


def test_every_kind_of_value_round_trips() -> None:
    """Scenarios reach every kind of value the state holds (so the round trips above are not
    vacuous), and every state along them round-trips exactly."""
    seen: set[str] = set()
    for scenario in SCENARIOS:
        folding = scenario()
        for state in folding.states:
            seen |= features(state)
            exact_copy(state)
        resumes_exactly(folding, len(folding.states) // 2)
    phases = {"starting", "running", "restoring", "finished", "failed"}
    expected = {f"phase:{p}" for p in phases} | {"mode:restart", "mode:in_process"}
    expected |= {"incident", "target", "acks", "skip", "spike", "infinite z", "checksums"}
    expected |= {"agreed", "versions", "pending", "committed", "bad snapshots", "crash loop"}
    expected |= {"progress timeout", "loss level", "straggling", "dead rank", "long phase"}
    expected |= {"supervisor sender", "ack cursor", "after restore", "positions", "acted", "held"}
    expected |= {"settle window", "restore held", "held evidence", "held restart", "held awaits"}
    expected |= {"left", "left finished", "left pending", "left cuts"}
    assert expected - seen == set()


def test_floats_and_integers_keep_their_exact_values_and_types() -> None:
    """NaN and infinities (written as strings, as the wire contract writes a loss), -0.0,
    subnormal and extreme floats, an int held by a float field, and ns timestamps above 2**53
    come back bit for bit and with their types."""
    state = structs.replace(
        new_job(JOB),
        clock_ns=T0 + 1,  # 1.7e18 + 1: not representable as a float
        command_seq=2**64 - 1,
        generation_started_ns=-(2**63),
        ranks=HashTrieMap(
            {0: RankState(0, "h0", 1000, "alive", "train", T0 + 3, 5, T0 + 3, step_time_s=-0.0)}
        ),
        trend=Trend(
            step_times=Window(recent=(0.1, 5e-324, 1.7976931348623157e308, 1)),
            loss_median=1e-300,
        ),
        watch=Watch(spike=Spike(None, 3, 3, math.nan, math.inf, -math.inf, 1, 2.0, 0.0)),
    )
    data = encode_state(state)
    back = decode_state(data)
    assert encode_state(back) == data
    for written in (b'"nan"', b'"inf"', b'"-inf"', b"1700000000000000001"):
        assert written in data
    assert back.clock_ns == T0 + 1
    assert back.command_seq == 2**64 - 1
    assert back.generation_started_ns == -(2**63)
    step_time = back.ranks[0].step_time_s
    assert step_time is not None
    assert math.copysign(1.0, step_time) == -1.0
    # repr tells the int 1 from the float 1.0, and writes every float exactly.
    assert [repr(v) for v in back.trend.step_times.recent] == [
        "0.1",
        "5e-324",
        "1.7976931348623157e+308",
        "1",
    ]
    spike = back.watch.spike
    assert spike is not None
    assert math.isnan(spike.first_loss)
    assert (spike.z, spike.peak_loss) == (math.inf, -math.inf)


def test_fields_are_derived_from_the_classes() -> None:
    """The document holds exactly the classes' fields, whatever they are."""
    _, state, _ = killed_job()
    document = state_to_dict(state)
    assert (document["format"], document["layout"]) == (FORMAT, LAYOUT)
    body = document["state"]
    assert isinstance(body, dict)
    assert list(body) == list(JobState.__struct_fields__)
    incident = body["incident"]
    assert isinstance(incident, dict)
    assert set(incident) == set(Incident.__dataclass_fields__)
