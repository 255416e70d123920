"""The simulator's pure job model, its fault draws and its wire encoding
(``trainguard.daemon.sim``; ``docs/sim.md``), and the Young-Daly goodput model.

The model is driven here by a scripted responder (restore to the last checkpoint ``D`` seconds
after each fault, resume ``R`` later): these tests check the model's accounting and its side of
the protocol; the real daemon's side is checked by ``tests/service/daemon/test_sim.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.daemon.forensics import model_goodput, young_interval_s
from trainguard.daemon.sim import (
    FAULT_KINDS,
    Fault,
    JobModel,
    SimParams,
    TraceError,
    draw_faults,
    parse_trace,
)
from trainguard.daemon.sim._model import Beats, ExitReport, Reports, Shards
from trainguard.daemon.sim._wire import Wire
from trainguard.schemas import (
    Checkpoint,
    Heartbeat,
    Lifecycle,
    Manifest,
    Restore,
    Resume,
    Shard,
    SnapshotRef,
    decode,
    snapshot_ref,
    verify_mac,
)

JOB = "sim-test"


def _restore(model: JobModel, generation: int, step: int | None, seq: int) -> Restore:
    target: SnapshotRef | None = None
    if step is not None:
        manifest = Manifest(
            job_id=JOB,
            snapshot_id=f"{JOB}/g0/s{step}",
            generation=0,
            ts=0,
            step=step,
            world_size=model.p.ranks,
            shards=tuple(
                Shard(rank=r, uri=f"file:///x/{r}", size_bytes=1, digest="sha256:" + "0" * 64)
                for r in range(model.p.ranks)
            ),
            cursor=Wire(JOB, model.p, model.host_of, None, Path("/ckpt")).cursor(step),
        )
        target = snapshot_ref(manifest)
    return Restore(
        job_id=JOB,
        generation=generation,
        ts=0,
        seq=seq,
        daemon_id="d",
        incident_id=f"{JOB}/i{generation}",
        reason="test",
        target=target,
    )


def _drive(model: JobModel, detect_s: float, end_ms: int) -> list[object]:
    """Run ``model`` to ``end_ms`` answering each fault like a daemon would: a restore to the
    last checkpoint ``detect_s`` after it, a resume once every rank acknowledged."""
    out: list[object] = []
    last_checkpoint: int | None = None
    seq = 0
    seen = 0
    while not model.ended:
        nxt = model.next_ms()
        if nxt is None or nxt > end_ms:
            out += model.finish(end_ms)
            break
        for e in model.advance(nxt):
            out.append(e)
            if isinstance(e, Shards):
                last_checkpoint = e.step
            if isinstance(e, Reports) and e.kind == "restored":
                seq += 1
                model.command(e.at_ms, Resume(
                    job_id=JOB, generation=e.generation, ts=0, seq=seq, daemon_id="d",
                    step=e.step,
                ))  # fmt: skip
        faults = model.accounting.faults
        if len(faults) > seen and model.phase == "stalled":
            seen = len(faults)
            at = faults[-1].at_ms + round(detect_s * 1000)
            out += model.advance(at)
            seq += 1
            model.command(at, _restore(model, model.generation + 1, last_checkpoint, seq))
    return out


@settings(max_examples=40, deadline=None)
@given(
    step_s=st.sampled_from([0.5, 1.0, 2.0]),
    every=st.integers(5, 60),
    cost_s=st.sampled_from([0.0, 0.25, 0.78, 3.0]),
    intervals=st.integers(3, 20),
)
def test_without_failures_goodput_is_the_checkpoint_overhead_only(
    step_s: float, every: int, cost_s: float, intervals: int
) -> None:
    params = SimParams(ranks=4, step_s=step_s, checkpoint_every=every, checkpoint_cost_s=cost_s)
    period = every * step_s + cost_s
    model = JobModel(params, (), horizon_s=intervals * period)
    _drive(model, 1.0, 10**12)
    acc = model.accounting
    assert acc.faults == []
    assert acc.checkpoints == intervals
    # tau / (tau + C) = 1 - C/tau to first order: the model's prediction for M -> infinity.
    expected = every * step_s / period
    assert acc.goodput(step_s) == pytest.approx(expected, abs=1e-3)
    if cost_s:
        assert model_goodput(cost_s, 1e12, 0.0, every * step_s) == pytest.approx(
            1 - cost_s / (every * step_s), abs=1e-4
        )


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), count=st.integers(1, 8))
def test_every_injected_fault_stops_the_job_once_and_is_restored_once(
    seed: int, count: int
) -> None:
    params = SimParams(ranks=16, checkpoint_every=10, restart_s=4.0)
    faults, horizon = draw_faults(count, 120.0, FAULT_KINDS, params.ranks, seed)
    model = JobModel(params, faults, horizon_s=horizon)
    out = _drive(model, 2.0, 10**12)
    acc = model.accounting
    assert [f.fault for f in acc.faults] == list(faults)
    assert all(f.restores == 1 and f.resumed_ms is not None for f in acc.faults)
    assert acc.stray_restores == 0
    assert model.phase == "done"
    # Only the supervisor of a killed rank reports an exit, once per kill.
    exits = [e for e in out if isinstance(e, ExitReport)]
    assert len(exits) == sum(f.kind == "kill" for f in faults)
    # The failure clock counts training time only: the run ends at the horizon.
    assert acc.training_ms == pytest.approx(horizon * 1000, abs=2)
    assert 0 < acc.goodput(params.step_s) < 1
    assert acc.productive_s(params.step_s) <= acc.wall_s()


def test_a_fault_is_seen_as_its_kind_shows_itself() -> None:
    params = SimParams(ranks=16, ranks_per_host=4, checkpoint_every=5, checksum_every=2)
    for kind in FAULT_KINDS:
        model = JobModel(params, (Fault(20.0, kind, 5),), horizon_s=100.0)
        out = _drive(model, 3.0, 10**12)
        struck = model.accounting.faults[0].at_ms
        after = [e for e in out if isinstance(e, Beats) and struck < e.at_ms < struck + 3000]
        assert after, kind
        if kind == "kill":
            assert all(5 not in b.ranks for b in after)
            assert any(isinstance(e, ExitReport) and e.ranks == (5,) for e in out)
        elif kind == "node":
            assert all(set(b.ranks).isdisjoint({4, 5, 6, 7}) for b in after)
            assert not any(isinstance(e, ExitReport) for e in out)
            assert model.host_of(5) == params.hosts  # a spare node took over
        elif kind == "hang":
            assert all(len(b.ranks) == 16 and b.step == after[0].step for b in after)
        elif kind == "nan":
            assert all(b.nan_ranks == {5} for b in after)
        else:
            assert any(b.odd_ranks == {5} and b.checksum is not None for b in after)


def test_a_job_whose_every_rank_is_gone_is_silent_until_its_restore() -> None:
    """A node fault on a job of one node: nothing is sent until the restore, so the driver
    must let the daemon pulse (it saw a bus gap and held the restore; the simulation stood
    still)."""
    params = SimParams(ranks=8, ranks_per_host=8, restart_s=10.0)
    model = JobModel(params, (Fault(10.0, "node", 0),), 60.0)
    silent = []
    model.advance(5_000)
    silent.append(model.silent)
    struck = model.advance(30_000)
    assert model.phase == "stalled"
    silent.append(model.silent)
    assert not [e for e in struck if isinstance(e, Beats) and e.ranks and e.at_ms > 15_000]
    model.command(30_000, _restore(model, 1, None, 1))
    silent.append(model.silent)  # restarting
    model.advance(35_001)  # half the restart: the processes are up
    silent.append(model.silent)
    assert silent == [False, True, True, False]


def test_draws_are_seeded_and_take_turns() -> None:
    first = draw_faults(10, 600.0, ("kill", "hang"), 64, 7)
    assert first == draw_faults(10, 600.0, ("kill", "hang"), 64, 7)
    assert first != draw_faults(10, 600.0, ("kill", "hang"), 64, 8)
    faults, horizon = first
    assert [f.kind for f in faults] == ["kill", "hang"] * 5
    assert all(0 <= f.rank < 64 for f in faults)
    assert [f.after_s for f in faults] == sorted(f.after_s for f in faults) < [horizon]


def test_trace_lines() -> None:
    text = ["# after_s,kind,rank", "10,kill,3", "", "20.5, nan", "30,node,7  # a node"]
    assert parse_trace(text, 8) == (
        Fault(10.0, "kill", 3),
        Fault(20.5, "nan", 0),
        Fault(30.0, "node", 7),
    )
    for bad in (["10,explode,1"], ["x,kill"], ["10,kill,8"], ["20,kill", "10,kill"], ["1"]):
        with pytest.raises(TraceError, match="line"):
            parse_trace(bad, 8)


def test_every_record_is_what_an_agent_would_send() -> None:
    """The fast encoding decodes with the real codec, its MAC verifies under the job's key,
    and every sender's seq grows along the records it sends."""
    key = ("0123456789abcdef", bytes(range(32)))
    params = SimParams(ranks=8, ranks_per_host=4, checkpoint_every=3, checksum_every=2)
    model = JobModel(params, (Fault(7.0, "sdc", 2), Fault(30.0, "kill", 5)), horizon_s=60.0)
    wire = Wire(JOB, params, model.host_of, key, Path("/ckpt"))
    seqs: dict[tuple[int | None, str, int], int] = {}
    kinds: set[type] = set()
    checksums: dict[tuple[int, int], dict[int, str]] = {}
    for emission in _drive(model, 2.0, 10**12):
        assert isinstance(emission, Beats | Shards | Reports | ExitReport)
        for value in wire.encode(emission):
            message = decode(value)
            assert verify_mac(value, {key[0]: key[1]}) == key[0]
            assert isinstance(message, Heartbeat | Checkpoint | Lifecycle)
            kinds.add(type(message))
            sender = (message.rank, message.host, message.pid)
            assert message.seq > seqs.get(sender, 0)
            seqs[sender] = message.seq
            if isinstance(message, Heartbeat) and message.param_checksum is not None:
                at = checksums.setdefault((message.generation, message.step), {})
                at[message.rank] = message.param_checksum
    assert kinds == {Heartbeat, Checkpoint, Lifecycle}
    # Replicas agree, but for the corrupted rank 2 after the fault struck (7 s: step 6).
    for (generation, step), by_rank in checksums.items():
        odd = {r for r, c in by_rank.items() if c != by_rank[0]}
        assert odd == ({2} if generation == 0 and step > 6 else set()), (generation, step)


def test_the_young_daly_model_at_llama_3_rates() -> None:
    """The issue's figures: 16,384 ranks at Llama 3's failure rate (M = 11,135 s), C = 0.78 s:
    about 98.3% with D + R = 60 s, about 82.7% with a 30-minute collective timeout instead."""
    assert young_interval_s(0.78, 11_135) == pytest.approx(131.8, abs=0.1)
    assert model_goodput(0.78, 11_135, 60.0) == pytest.approx(0.983, abs=5e-4)
    assert model_goodput(0.78, 11_135, 1800.0) == pytest.approx(0.827, abs=5e-4)
    # Young's interval is where the first-order model peaks.
    best = model_goodput(0.78, 11_135, 60.0)
    for tau in (60.0, 100.0, 170.0, 300.0):
        assert model_goodput(0.78, 11_135, 60.0, tau) < best
    with pytest.raises(ValueError, match="mean time between failures"):
        model_goodput(0.78, 0.0, 60.0)
    assert math.isclose(model_goodput(0.0, 100.0, 0.0), 1.0)
