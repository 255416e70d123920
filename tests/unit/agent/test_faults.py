"""Fault injection: the spec grammar, once-per-job markers, every kind's effect at its hook. Real
kills and exits of worker processes: ``tests/service/agent/test_faults_processes.py``."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from trainguard.agent import ConfigError, Fault, parse_faults
from trainguard.agent.checkpoint._checksum import parameter_checksum
from trainguard.agent.faults._injector import FaultInjector


def test_spec_with_several_faults_flags_and_spaces():
    spec = (
        " kill@step=20,rank=1 ; exit @ step=5, rank=0, code=7 ;"
        "hang@step=9,rank=2,seconds=1.5,repeat;"
        "slow@step=30,rank=1,factor=2.5,steps=10; nan@step=40,rank=0;"
        "spike@step=50,factor=8; spike@step=60,factor=0.5,rank=1,steps=3;"
        "bitflip@step=70,rank=1; bitflip@step=71,rank=0,bit=3;"
        "stall-checkpoint@step=80,seconds=20; stall-checkpoint@step=90,seconds=0.5,rank=1"
    )
    assert parse_faults(spec) == (
        Fault("kill", 20, 1),
        Fault("exit", 5, 0, code=7),
        Fault("hang", 9, 2, seconds=1.5, repeat=True),
        Fault("slow", 30, 1, factor=2.5, steps=10),
        Fault("nan", 40, 0),
        Fault("spike", 50, None, factor=8.0),
        Fault("spike", 60, 1, factor=0.5, steps=3),
        Fault("bitflip", 70, 1),
        Fault("bitflip", 71, 0, bit=3),
        Fault("stall-checkpoint", 80, None, seconds=20.0),
        Fault("stall-checkpoint", 90, 1, seconds=0.5),
    )
    assert parse_faults("") == ()
    assert parse_faults("hang@step=1,rank=0")[0].seconds == math.inf


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("boom@step=1,rank=0", "unknown kind 'boom'"),
        ("kill", "expected kill@rank=...,step=..."),
        ("kill@step=1", "missing rank"),
        ("kill@rank=1", "missing step"),
        ("slow@step=1,rank=0", "missing factor"),
        ("spike@step=1", "missing factor"),
        ("stall-checkpoint@step=1", "missing seconds"),
        ("kill@step=x,rank=0", "step='x' is not a number"),
        ("kill@step=1.5,rank=0", "step='1.5' is not a number"),
        ("kill@step=1,rank=0,code=3", "unexpected 'code=3'"),
        ("nan@step=1,rank=0,factor=2", "unexpected 'factor=2'"),
        ("kill@step=1,rank=0,often", "unexpected 'often'"),
        ("exit@step=1,rank=0,code=256", "must be in 0..255"),
        ("kill@step=-1,rank=0", "step='-1' must be >= 0"),
        ("hang@step=1,rank=0,seconds=nan", "seconds='nan' must be >= 0"),
        ("slow@step=1,rank=0,factor=0.5", "factor='0.5' must be >= 1"),
        ("slow@step=1,rank=0,factor=inf", "factor='inf' must be >= 1"),
        ("spike@step=1,factor=0", "factor='0' must be > 0"),
        ("spike@step=1,factor=2,steps=0", "steps='0' must be >= 1"),
        ("bitflip@step=1,rank=0,bit=64", "bit='64' must be in 0..63"),
        ("stall-checkpoint@step=1,seconds=0", "seconds='0' must be > 0"),
        ("stall-checkpoint@step=1,seconds=inf", "seconds='inf' must be > 0"),
        ("kill@step=3,rank=0;exit@step=3,rank=0", "rank 0 already has a fault at step 3"),
        ("kill@step=3,rank=0;spike@step=3,factor=2", "every rank already has a fault at step 3"),
    ],
)
def test_bad_specs_name_the_bad_part(spec, match):
    with pytest.raises(ConfigError, match=match):
        parse_faults(spec)


def _injector(spec: str, tmp_path: Path, rank: int = 1) -> FaultInjector:
    return FaultInjector(parse_faults(spec), rank=rank, marker_dir=tmp_path / "markers")


def _timed(call, *args) -> float:
    began = time.monotonic()
    call(*args)
    return time.monotonic() - began


def test_a_fault_fires_once_per_job_and_a_repeating_one_every_time(tmp_path: Path):
    once = parse_faults("hang@step=2,rank=1,seconds=0.2")
    markers = tmp_path / "markers"
    first = FaultInjector(once, rank=1, marker_dir=markers)
    assert _timed(first.after_step, 1) < 0.1
    assert _timed(first.after_step, 2) >= 0.2
    assert _timed(first.after_step, 2) < 0.1  # the same process passing the step again
    # A later generation (a new process, a new injector) shares only the marker folder.
    assert _timed(FaultInjector(once, rank=1, marker_dir=markers).after_step, 2) < 0.1
    assert _timed(FaultInjector(once, rank=0, marker_dir=tmp_path / "m0").after_step, 2) < 0.1

    repeating = parse_faults("hang@step=2,rank=1,seconds=0.2,repeat")
    for _ in range(2):
        injector = FaultInjector(repeating, rank=1, marker_dir=markers)
        assert _timed(injector.after_step, 2) >= 0.2


def test_slow_stretches_each_step_of_its_range_by_its_factor(tmp_path: Path):
    injector = _injector("slow@step=3,rank=1,factor=3,steps=2", tmp_path)
    assert not injector.pace(2, 0.05)
    assert _timed(injector.pace, 3, 0.05) >= 0.1  # (3 - 1) x 0.05 s
    assert _timed(injector.pace, 4, 0.05) >= 0.1
    assert _timed(injector.pace, 5, 0.05) < 0.05  # steps=2: over
    unbounded = _injector("slow@step=1,rank=1,factor=2", tmp_path / "u")
    for step in range(1, 5):
        assert unbounded.pace(step, 0.0)
    unbounded.end_generation()  # an in-process restore ends it
    assert not unbounded.pace(5, 0.0)


def test_nan_makes_one_loss_and_its_gradients_nan(tmp_path: Path):
    injector = _injector("nan@step=2,rank=1", tmp_path)
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()
    assert injector.loss(1, loss) is loss  # untouched, not even copied
    perturbed = injector.loss(2, (w * 2).sum())
    perturbed.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
    assert math.isnan(perturbed.item())
    assert w.grad is not None
    assert torch.isnan(w.grad).all()
    assert injector.loss(2, 1.0) == 1.0  # fired once per job


def test_a_spike_scales_the_loss_on_every_rank_for_its_steps(tmp_path: Path):
    for rank in (0, 1):
        injector = _injector("spike@step=2,factor=10,steps=2", tmp_path / str(rank), rank)
        assert [injector.loss(s, 1.5) for s in range(1, 6)] == [1.5, 15.0, 15.0, 1.5, 1.5]
    lasting = _injector("spike@step=1,factor=4", tmp_path / "lasting")
    assert [lasting.loss(s, 1.0) for s in (1, 50)] == [4.0, 4.0]
    lasting.end_generation()
    assert lasting.loss(51, 1.0) == 1.0


def test_only_a_loss_fault_of_the_rank_makes_it_perturb_losses(tmp_path: Path):
    # A loop may skip perturb_loss where this is False (the Lightning callback does).
    assert _injector("nan@step=2,rank=1", tmp_path / "a", rank=1).perturbs_loss
    assert not _injector("nan@step=2,rank=1", tmp_path / "b", rank=0).perturbs_loss
    assert _injector(
        "kill@step=3,rank=1; spike@step=5,factor=4", tmp_path / "c", rank=0
    ).perturbs_loss
    assert not _injector(
        "kill@step=3,rank=1; hang@step=4,rank=1,seconds=1", tmp_path / "d"
    ).perturbs_loss
    assert not _injector("", tmp_path / "e").perturbs_loss


def test_a_loss_fault_the_loop_never_passes_through_is_reported(tmp_path: Path):
    injector = _injector("nan@step=2,rank=1", tmp_path)
    with capture_logs() as logs:
        injector.after_step(2)
    assert [e["event"] for e in logs] == ["fault_not_applied"]
    assert "perturb_loss" in logs[0]["why"]


def test_bitflip_corrupts_one_bit_of_the_watched_model_once(tmp_path: Path):
    injector = _injector("bitflip@step=2,rank=1", tmp_path)
    with capture_logs() as logs:
        injector.after_step(2)
    assert logs[0]["event"] == "fault_not_applied"  # no model watched: nothing flipped
    model = torch.nn.Linear(2, 2)
    before = parameter_checksum(model)
    first = model.weight.detach().reshape(-1)[0].item()
    injector.watch(model)
    injector.after_step(2)
    after = model.weight.detach().reshape(-1)[0].item()
    # The highest mantissa bit is worth half the element's power of two, 2 ** (exponent - 1).
    assert abs(after - first) == 2.0 ** (math.frexp(first)[1] - 2)
    assert parameter_checksum(model) != before
    injector.after_step(2)  # once per job
    assert model.weight.detach().reshape(-1)[0].item() == after


def test_stall_checkpoint_delays_the_write_of_its_step(tmp_path: Path):
    injector = _injector("stall-checkpoint@step=4,seconds=0.2", tmp_path)
    assert _timed(injector.before_write, 3) < 0.1
    assert _timed(injector.before_write, 4) >= 0.2
