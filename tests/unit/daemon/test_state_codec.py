"""Tests of the job-state codec (``jobstate/1``): every reachable state round-trips exactly, a
fold continued from a decoded state decides exactly as the original, and malformed documents
raise :class:`StateFormatError` naming the value's path."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import structs
from rpds import HashTrieMap, HashTrieSet

from tests.support.machine_scenarios import (
    AWAY,
    JOB,
    T0,
    S,
    Sim,
    actions,
    config,
    healthy_traces,
    issued,
    killed_in_an_outage,
    killed_job,
    play,
    run,
    two_ranks_training,
)
from tests.support.traces import Faults, Job, PhaseSpec, drive, paces, simulate
from trainguard.daemon.core._decisions import Decision
from trainguard.daemon.core._inputs import Input, Tick
from trainguard.daemon.core._machine import decide
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import (
    Incident,
    JobState,
    Left,
    RankState,
    Spike,
    Trend,
    Watch,
    new_job,
)
from trainguard.daemon.core._state_codec import (
    FORMAT,
    LAYOUT,
    READABLE_LAYOUTS,
    StateFormatError,
    _form,
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


# -- strict decoding ---------------------------------------------------------------------------


def recovering_state() -> JobState:
    """A 4-rank job killed after 38 steps, three of whose ranks restarted and acknowledged the
    restore: committed manifests, an incident with a target and acknowledgements, ranks and
    senders of the new generation."""
    sim, state, restore = killed_job()
    state, _ = run(sim.recover(restore, state.clock_ns + S, ranks=[0, 1, 2]), state)
    return state


def recovering_document() -> dict[str, Any]:
    document: dict[str, Any] = orjson.loads(encode_state(recovering_state()))
    return document


def put(document: dict[str, Any], path: Sequence[str | int], value: Any) -> dict[str, Any]:
    """A copy of ``document`` with the value at ``path`` replaced (a new key if absent)."""
    changed = copy.deepcopy(document)
    node: Any = changed
    for token in path[:-1]:
        node = node[token]
    node[path[-1]] = value
    return changed


def drop(document: dict[str, Any], path: Sequence[str | int]) -> dict[str, Any]:
    changed = copy.deepcopy(document)
    node: Any = changed
    for token in path[:-1]:
        node = node[token]
    del node[path[-1]]
    return changed


def refused(document: object) -> StateFormatError:
    with pytest.raises(StateFormatError) as caught:
        state_from_dict(document)
    # The same through the bytes, when the document has a JSON form.
    with pytest.raises(StateFormatError) as via_bytes:
        decode_state(orjson.dumps(document))
    assert via_bytes.value.path == caught.value.path
    return caught.value


@pytest.mark.parametrize(
    ("path", "value", "where"),
    [
        (["state", "generation"], "1", "state.generation"),
        (["state", "generation"], True, "state.generation"),
        (["state", "generation"], 1.0, "state.generation"),
        (["state", "clock_ns"], 1.8e19, "state.clock_ns"),
        (["state", "phase"], "paused", "state.phase"),
        (["state", "phase"], ["running"], "state.phase"),
        (["state", "ranks", 0, 1, "status"], "zombie", "state.ranks[0][1].status"),
        (["state", "ranks", 2, 1, "step_time_s"], "NaN", "state.ranks[2][1].step_time_s"),
        (["state", "ranks", 0], [0], "state.ranks[0]"),
        (["state", "ranks", 1, 0], 0, "state.ranks[1][0]"),  # the key of entry 0 again
        (["state", "ranks", 2, 1], [], "state.ranks[2][1]"),
        (["state", "senders", 0, 0], [0, "h0"], "state.senders[0][0]"),
        (["state", "senders", 0, 0, 1], 7, "state.senders[0][0][1]"),
        (["state", "committed", 0, "step"], -1, "state.committed[0].step"),
        (
            ["state", "committed", 1, "shards", 2, "digest"],
            "md5:00",
            "state.committed[1].shards[2]*",
        ),
        (["state", "committed", 0, "schema"], "manifest/9.0", "state.committed[0].schema"),
        (["state", "committed", 0, "cursor"], None, "state.committed[0].cursor"),
        (["state", "committed"], {"0": None}, "state.committed"),
        (["state", "incident", "acks", 1, 0], 0, "state.incident.acks[1][0]"),
        (["state", "incident", "acks"], [1.0], "state.incident.acks[0]"),
        (
            ["state", "incident", "acks", 0, 1, "cursor", "seed"],
            "7",
            "state.incident.acks[0][1].cursor.seed",
        ),
        (["state", "incident", "skip"], {"from_step": 1}, "state.incident.skip.to_step"),
        (["state", "incident", "cause"], "boredom", "state.incident.cause"),
        (["state", "trend", "step_times", "recent"], ["fast"], "state.trend.step_times.recent[0]"),
        (["state", "loop", "incidents"], [["job/i1"]], "state.loop.incidents[0]"),
        (["state", "bad_snapshots"], "job/g0/s10", "state.bad_snapshots"),
        (["state", "bad_snapshots"], [["a", "why"], "a"], "state.bad_snapshots[1]"),
        (["state", "watch", "extra"], 1, "state.watch.extra"),
        (["state", "watch", "spike"], {}, "state.watch.spike.onset_after_step"),
        (["state"], [], "state"),
        (["format"], "jobstate/2", "format"),
        (["layout"], "0" * 16, "layout"),
        (["signature"], "", "signature"),
    ],
)
def test_a_malformed_value_is_refused_with_its_path(
    path: list[str | int], value: Any, where: str
) -> None:
    """``where`` is the path named, or its beginning when it ends with ``*`` (the schemas codec
    names the field inside a message)."""
    error = refused(put(recovering_document(), path, value))
    assert isinstance(error, ValueError)
    assert error.reason
    if where.endswith("*"):
        assert (error.path or "").startswith(where[:-1])
    else:
        assert error.path == where


@pytest.mark.parametrize(
    ("path", "where"),
    [
        (["state", "watch", "agreed"], "state.watch.agreed"),
        (["state", "incident", "acks"], "state.incident.acks"),
        (["state", "committed", 0, "schema"], "state.committed[0].schema"),
        (["state"], "state"),
        (["format"], "format"),
        (["layout"], "layout"),
    ],
)
def test_a_missing_field_is_refused_with_its_path(path: list[str | int], where: str) -> None:
    assert refused(drop(recovering_document(), path)).path == where


@pytest.mark.parametrize(
    "data", [b"", b"not json", b"[]", b'"jobstate/1"', b"\xff\xfe", b'{"format": "jobstate/1"']
)
def test_bytes_that_are_no_document_are_refused(data: bytes) -> None:
    with pytest.raises(StateFormatError) as caught:
        decode_state(data)
    assert caught.value.path in (None, "format")


def test_an_integer_beyond_64_bits_is_refused_both_ways() -> None:
    document = put(recovering_document(), ["state", "clock_ns"], 2**64)
    assert refused_python(document) == "state.clock_ns"
    with pytest.raises(StateFormatError) as caught:
        encode_state(structs.replace(recovering_state(), command_seq=2**64))
    assert caught.value.path == "state.command_seq"


def refused_python(document: dict[str, Any]) -> str | None:
    """The path of the error for a document with no JSON form (a Python dict only)."""
    with pytest.raises(StateFormatError) as caught:
        state_from_dict(document)
    return caught.value.path


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda s: structs.replace(s, committed=list(s.committed)), "state.committed"),
        (lambda s: structs.replace(s, generation=True), "state.generation"),
        (lambda s: structs.replace(s, bad_snapshots={"x"}), "state.bad_snapshots"),
        (lambda s: structs.replace(s, ranks=dict(s.ranks)), "state.ranks"),
        (lambda s: structs.replace(s, phase="paused"), "state.phase"),
        (
            lambda s: structs.replace(s, senders=s.senders.insert((0, 1, 2), 0)),
            "state.senders[0][0][1]",
        ),
        (
            lambda s: structs.replace(s, committed=(replace(s.committed[0], step=-1),)),
            "state.committed[0].step",
        ),
        (lambda s: structs.replace(s, failure="\ud800"), "state"),
    ],
)
def test_a_state_with_a_value_its_types_forbid_is_not_encoded(
    change: Callable[[JobState], JobState], where: str
) -> None:
    """The encoder checks what it writes (the schemas codec checks the messages), so whatever
    it writes decodes to the same state."""
    with pytest.raises(StateFormatError) as caught:
        encode_state(change(recovering_state()))
    assert caught.value.path == where


# A JSON value of any shape, to put anywhere in a valid document.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["nan", "inf", "alive", "running", "manifest/1.0"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


def node_paths(value: Any, path: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Paths of every value in a parsed JSON document (the document itself excluded)."""
    found: list[tuple[str | int, ...]] = [path] if path else []
    items: Iterable[tuple[str | int, Any]] = ()
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    for key, child in items:
        found += node_paths(child, (*path, key))
    return found


DOCUMENT = recovering_document()
DOCUMENT_PATHS = node_paths(DOCUMENT)


@settings(max_examples=150, deadline=None)
@given(index=st.integers(0, len(DOCUMENT_PATHS) - 1), value=json_values)
def test_any_change_decodes_or_raises_the_format_error(index: int, value: Any) -> None:
    """Whatever value replaces whatever part of a valid document, decoding either gives a
    state that encodes again or raises :class:`StateFormatError`; no other error escapes."""
    data = orjson.dumps(put(DOCUMENT, DOCUMENT_PATHS[index], value))
    try:
        state = decode_state(data)
    except StateFormatError:
        return
    assert decode_state(encode_state(state)) == state


# -- the type dispatch -------------------------------------------------------------------------


class Counts(NamedTuple):
    by_host: dict[str, int]


class Mixed(NamedTuple):
    either: int | str


class Listed(NamedTuple):
    ranks: HashTrieSet[int]
    steps: list[int]


@pytest.mark.parametrize(
    ("cls", "field"),
    [(Counts, "Counts.by_host"), (Mixed, "Mixed.either"), (Listed, "Listed.steps")],
)
def test_a_field_type_without_a_form_is_refused_when_the_codec_is_built(
    cls: type[Any], field: str
) -> None:
    """A state field of a type the codec has no form for fails loudly, naming the field: since
    the codec is built from ``JobState`` at import, such a field added to the state makes this
    module (and the daemon) fail to import rather than write snapshots that lose it."""
    with pytest.raises(TypeError, match=field):
        _form(cls)


OLD_LAYOUT = Path(__file__).with_name("data") / "jobstate-c35900be070fb0d2.json"
"""``encode_state`` of the build before the bus-outage rule (layout c35900be070fb0d2, without
``JobState.settle_until_ns``, ``held`` and ``left``) for a 2-rank job killed after step 11."""

BEFORE_LEFT = Path(__file__).with_name("data") / "jobstate-ef5317866765d48d.json"
"""The same state written by the build before the late-finish rule (layout ef5317866765d48d,
without ``JobState.left``)."""


BEFORE_CUTS = Path(__file__).with_name("data") / "jobstate-0c4b9a05468dc2f8.json"
"""The same state written by the build before the late-cut rule (layout 0c4b9a05468dc2f8,
without ``Left.pending`` and ``Left.cuts``): its ``left`` is set (the restore left generation 0)."""


def old_layout_inputs() -> list[Input]:
    """The inputs the states of :data:`OLD_LAYOUT`, :data:`BEFORE_LEFT` and :data:`BEFORE_CUTS`
    were folded from."""
    sim = Sim(world_size=2)
    return [*sim.start(T0), *sim.train(range(12), start=T0 + S), sim.kill(1, T0 + 13 * S)]


@pytest.mark.parametrize("path", [OLD_LAYOUT, BEFORE_LEFT], ids=lambda p: p.stem)
def test_a_document_of_an_earlier_layout_decodes_with_the_new_fields_at_their_defaults(
    path: Path,
) -> None:
    """A snapshot written before this build added ``settle_until_ns``, ``held`` or ``left``
    reads back as the state this build folds from the same inputs, those fields at their
    defaults: a restore issued by an older build recorded no generation it left (its late
    ``finished`` reports stay stale, as that build judged them)."""
    data = path.read_bytes()
    layout = orjson.loads(data)["layout"]
    assert layout != LAYOUT
    assert layout in READABLE_LAYOUTS
    state = decode_state(data)
    assert (state.settle_until_ns, state.held, state.left) == (None, None, None)
    folded, _ = run(old_layout_inputs())
    assert folded.left is not None
    folded = structs.replace(folded, left=None)
    assert state == folded
    assert encode_state(state) == encode_state(folded)


def test_a_document_of_the_layout_before_late_cuts_decodes_with_an_empty_left_record() -> None:
    """A snapshot written before ``Left`` gained ``pending`` and ``cuts`` reads back as the
    state this build folds from the same inputs (which pend no shard when the restore leaves
    generation 0): the generation left, no shard of it pending, no cut; a ``left`` that
    already has one of the new fields is not of that layout."""
    data = BEFORE_CUTS.read_bytes()
    document = orjson.loads(data)
    assert document["layout"] != LAYOUT
    assert document["layout"] in READABLE_LAYOUTS
    assert set(document["state"]["left"]) == {"generation", "finished"}
    state = decode_state(data)
    assert state.left == Left(generation=0, finished=(), pending=HashTrieMap(), cuts=())
    folded, _ = run(old_layout_inputs())
    assert state == folded
    assert encode_state(state) == encode_state(folded)
    document["state"]["left"]["cuts"] = []
    assert refused(document).path == "state.left.cuts"


BEFORE_DONE = Path(__file__).with_name("data") / "jobstate-7418d36e93a15e6c.json"
"""``encode_state`` of the build before the ranks' own dating of their steps (layout
7418d36e93a15e6c, without ``JobState.last_gap`` and ``RankState.step_done_ns``) for a 2-rank
job training through step 30 (``two_ranks_training``)."""


def test_a_document_before_step_done_decodes_with_each_rank_s_deadline_date() -> None:
    """A snapshot of a running job written before ``RankState.step_done_ns`` reads back with
    each rank's step completion dated as its deadline (``step_advanced_ns``) and no gap: here
    the state this build folds from the same inputs (heartbeats on time, nothing in the agents'
    queues). A rank that already has the new field is not of that layout."""
    data = BEFORE_DONE.read_bytes()
    document = orjson.loads(data)
    assert document["layout"] != LAYOUT
    assert document["layout"] in READABLE_LAYOUTS
    state = decode_state(data)
    assert state.last_gap is None
    assert [r.step_done_ns for r in state.ranks.values()] == [
        r.step_advanced_ns for r in state.ranks.values()
    ]
    assert all(r.step_done_ns is not None for r in state.ranks.values())
    folded, _ = run(two_ranks_training(Sim(world_size=2), 30), cfg=config())
    assert state == folded
    assert encode_state(state) == encode_state(folded)
    document["state"]["ranks"][1][1]["step_done_ns"] = None
    assert refused(document).path == "state.ranks[1][1].step_done_ns"


BEFORE_LATE = Path(__file__).with_name("data") / "jobstate-6fb9639cf1123afa.json"
"""``encode_state`` of the build before the ranks' lateness (layout 6fb9639cf1123afa, without
``RankState.late_ns``) for a 2-rank job training through step 30 (``two_ranks_training``)."""


def test_a_document_before_late_decodes_with_every_rank_on_time() -> None:
    """A snapshot of a running job written before ``RankState.late_ns`` reads back with every
    rank on time: here the state this build folds from the same inputs (every event on time).
    A rank that already has the new field is not of that layout; the earlier layouts get it
    too."""
    data = BEFORE_LATE.read_bytes()
    document = orjson.loads(data)
    assert document["layout"] != LAYOUT
    assert document["layout"] in READABLE_LAYOUTS
    state = decode_state(data)
    assert [r.late_ns for r in state.ranks.values()] == [0, 0]
    folded, _ = run(two_ranks_training(Sim(world_size=2), 30), cfg=config())
    assert state == folded
    assert encode_state(state) == encode_state(folded)
    assert decode_state(BEFORE_DONE.read_bytes()) == folded
    document["state"]["ranks"][0][1]["late_ns"] = 0
    assert refused(document).path == "state.ranks[0][1].late_ns"


BEFORE_AWAITS = Path(__file__).with_name("data") / "jobstate-229cdba23e078b61.json"
"""``encode_state`` of the build before the hold for a checkpoint in flight (layout
229cdba23e078b61, without ``Held.awaits``) for a 2-rank job whose rank 1 was killed in an
outage (``killed_in_an_outage``), up to the exit report: its restore held while the bus
settles."""


def test_a_document_before_awaits_decodes_with_its_hold_waiting_for_the_bus() -> None:
    data = BEFORE_AWAITS.read_bytes()
    document = orjson.loads(data)
    assert document["layout"] != LAYOUT
    assert document["layout"] in READABLE_LAYOUTS
    state = decode_state(data)
    sim = Sim(world_size=2)
    inputs = killed_in_an_outage(sim)
    cut = next(n for n, i in enumerate(inputs) if i.at_ns >= AWAY[1]) + 1
    folded, _ = run(inputs[:cut], cfg=config())
    assert folded.held is not None
    assert folded.held.awaits is None
    assert state == folded
    document["state"]["held"]["awaits"] = None
    assert refused(document).path == "state.held.awaits"


def test_a_document_of_the_old_layout_with_the_new_fields_is_refused() -> None:
    document = orjson.loads(OLD_LAYOUT.read_bytes())
    document["state"]["held"] = None
    with pytest.raises(StateFormatError) as caught:
        state_from_dict(document)
    assert caught.value.path == "state.held"
    document = orjson.loads(OLD_LAYOUT.read_bytes())
    document["layout"] = "1" * 16
    assert refused(document).path == "layout"


def test_the_layout_changes_with_the_state_classes() -> None:
    """Two classes that differ in one field's type or name have different shapes."""

    class A(NamedTuple):
        step: int

    class B(NamedTuple):
        step: float

    class C(NamedTuple):
        steps: int

    shapes = {_form(cls).shape.partition("(")[2] for cls in (A, B, C)}
    assert len(shapes) == 3
