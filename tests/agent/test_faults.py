"""Fault injection: the spec grammar, once-per-job markers, and real kills and exits."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainguard.agent import ConfigError, Fault, parse_faults
from trainguard.agent._faults import FaultInjector


def test_spec_with_several_faults_flags_and_spaces():
    spec = (
        " kill@step=20,rank=1 ; exit @ step=5, rank=0, code=7 ;"
        "hang@step=9,rank=2,seconds=1.5,repeat;"
    )
    assert parse_faults(spec) == (
        Fault("kill", 20, 1),
        Fault("exit", 5, 0, code=7),
        Fault("hang", 9, 2, seconds=1.5, repeat=True),
    )
    assert parse_faults("") == ()
    assert parse_faults("hang@step=1,rank=0")[0].seconds == math.inf


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("boom@step=1,rank=0", "unknown kind 'boom'"),
        ("kill", "expected kill@step=N,rank=R"),
        ("kill@step=1", "missing rank"),
        ("kill@rank=1", "missing step"),
        ("kill@step=x,rank=0", "step='x' is not a number"),
        ("kill@step=1,rank=0,code=3", "unexpected 'code=3'"),
        ("kill@step=1,rank=0,often", "unexpected 'often'"),
        ("exit@step=1,rank=0,code=256", "must be in 0..255"),
        ("kill@step=-1,rank=0", "step='-1' must be >= 0"),
        ("hang@step=1,rank=0,seconds=nan", "seconds='nan' must be >= 0"),
        ("kill@step=3,rank=0;exit@step=3,rank=0", "already has a fault at step 3"),
    ],
)
def test_bad_specs_name_the_bad_part(spec, match):
    with pytest.raises(ConfigError, match=match):
        parse_faults(spec)


def _timed_step(injector: FaultInjector, step: int) -> float:
    began = time.monotonic()
    injector.at_step(step)
    return time.monotonic() - began


def test_a_fault_fires_once_per_job_and_a_repeating_one_every_time(tmp_path: Path):
    once = parse_faults("hang@step=2,rank=1,seconds=0.2")
    markers = tmp_path / "markers"
    first = FaultInjector(once, rank=1, marker_dir=markers)
    assert _timed_step(first, 1) < 0.1
    assert _timed_step(first, 2) >= 0.2
    assert _timed_step(first, 2) < 0.1  # the same process passing the step again
    # A later generation (a new process, a new injector) shares only the marker folder.
    assert _timed_step(FaultInjector(once, rank=1, marker_dir=markers), 2) < 0.1
    assert _timed_step(FaultInjector(once, rank=0, marker_dir=tmp_path / "m0"), 2) < 0.1

    repeating = parse_faults("hang@step=2,rank=1,seconds=0.2,repeat")
    for _ in range(2):
        assert _timed_step(FaultInjector(repeating, rank=1, marker_dir=markers), 2) >= 0.2


WORKER = textwrap.dedent(
    """
    from trainguard.agent import Agent

    with Agent(job_id="faulty", heartbeat_interval_s=0.05) as agent:
        for step in range(1, 6):
            agent.step(step)
    print("finished", flush=True)
    """
)


def _run_worker(tmp_path: Path, faults: str, generation: int) -> subprocess.CompletedProcess[str]:
    """One generation of a one-rank job whose agent carries ``faults``."""
    env = {
        **os.environ,
        "TRAINGUARD_FAULTS": faults,
        "TRAINGUARD_GENERATION": str(generation),
        "TRAINGUARD_BUS": f"sqlite://{tmp_path / 'bus.db'}",
        "TRAINGUARD_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
    }
    return subprocess.run(
        [sys.executable, "-c", WORKER],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_kill_fires_in_the_first_generation_only(tmp_path: Path):
    killed = _run_worker(tmp_path, "kill@step=3,rank=0", generation=0)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "finished" not in killed.stdout
    again = _run_worker(tmp_path, "kill@step=3,rank=0", generation=1)
    assert again.returncode == 0, again.stderr
    assert "finished" in again.stdout


@pytest.mark.parametrize(
    ("spec", "status"),
    [("kill@step=2,rank=0,repeat", -signal.SIGKILL), ("exit@step=2,rank=0,code=7,repeat", 7)],
)
def test_a_repeating_fault_fires_in_every_generation(tmp_path: Path, spec: str, status: int):
    for generation in (0, 1):
        result = _run_worker(tmp_path, spec, generation)
        assert result.returncode == status, result.stderr
        assert "finished" not in result.stdout
