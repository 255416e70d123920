"""Fault injection in real worker processes: a kill fires in the first generation only, a
repeating fault in every generation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
