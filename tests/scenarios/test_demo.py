"""``trainguard demo`` as users run it, a real training job end to end: one restore after a kill,
and a NaN loss restored in process, each ending bitwise equal to the uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One reference-run cache for the demo tests of this module: they train the same job
    uninterrupted (seed 3, 120 steps), which is worth doing once."""
    return tmp_path_factory.mktemp("demo-cache")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_recovers_exactly(tmp_path: Path, demo_cache: Path) -> None:
    """The README's first command: one restore, bitwise-equal parameters, exact ledger."""
    done = subprocess.run(
        [
            *CLI,
            "demo",
            "--seed",
            "3",
            "--steps",
            "120",
            "--workdir",
            str(tmp_path / "work"),
            "--cache-dir",
            str(demo_cache),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200"},
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "bitwise equal" in done.stdout
    assert "exact: nothing skipped, nothing repeated" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_rehearses_a_nan_restored_in_process(tmp_path: Path, demo_cache: Path) -> None:
    """``trainguard demo --fault``: a NaN loss on rank 1 is detected and restored in process,
    and the job still ends bitwise equal to the uninterrupted run."""
    done = subprocess.run(
        [
            *CLI,
            "demo",
            "--seed",
            "3",
            "--steps",
            "120",
            "--fault",
            "nan@step=50,rank=1",
            "--step-sleep",
            "0.1",
            "--workdir",
            str(tmp_path / "work"),
            "--cache-dir",
            str(demo_cache),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200"},
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "nan_loss" in done.stdout
    assert "in process at step" in done.stdout
    assert "bitwise equal" in done.stdout
