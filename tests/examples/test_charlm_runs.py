"""Scenario tests of the charlm example as real torchrun jobs: determinism, resume, kill+restart.

Invariants 4 and 5 of the architecture: a deterministic CPU job stopped or killed and restored
from its last complete checkpoint ends bitwise equal to the uninterrupted run, and consumes
exactly the same samples at the same steps and ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.charlm.checkpoint import latest_complete_step
from examples.charlm.ledger import LedgerRecord, compare_ledgers, read_ledger

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 30
WORLD_SIZE = 2


def charlm(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the example as a 2-rank torchrun job writing to ``out``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command = [*launcher, f"--nproc-per-node={WORLD_SIZE}", "-m", "examples.charlm.train"]
    return subprocess.run(
        [*command, "--out", str(out), *args],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def succeed(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


def digest(out: Path) -> str:
    return (out / "final.sha256").read_text().strip()


def ledger(out: Path) -> list[LedgerRecord]:
    return read_ledger(sorted(out.glob("ledger-rank-*.jsonl")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-rank run of STEPS steps."""
    out: Path = tmp_path_factory.mktemp("reference")
    succeed(charlm(out, f"--steps={STEPS}", "--checkpoint-every=10"))
    return out


def test_two_uninterrupted_runs_are_bitwise_equal(reference: Path, tmp_path: Path) -> None:
    # Another checkpoint interval too: saving state must not perturb the run.
    succeed(charlm(tmp_path, f"--steps={STEPS}", "--checkpoint-every=7"))
    assert digest(tmp_path) == digest(reference)
    assert sorted(ledger(tmp_path), key=repr) == sorted(ledger(reference), key=repr)


def test_stop_and_resume_equals_the_uninterrupted_run(reference: Path, tmp_path: Path) -> None:
    succeed(charlm(tmp_path, "--steps=12", "--checkpoint-every=5"))  # checkpoints 5, 10, 12
    assert digest(tmp_path) != digest(reference)  # control: the digest tracks training
    resume = ["--resume-from", str(tmp_path / "checkpoints"), "--generation=1"]
    succeed(charlm(tmp_path, f"--steps={STEPS}", "--checkpoint-every=5", *resume))
    assert digest(tmp_path) == digest(reference)
    records = ledger(tmp_path)
    assert min(r.step for r in records if r.generation == 1) == 13
    assert compare_ledgers(records, ledger(reference), WORLD_SIZE).exact


def test_killed_rank_restarts_from_last_complete_checkpoint(
    reference: Path, tmp_path: Path
) -> None:
    # Rank 1 dies after the backward pass of step 20: rank 0 may finish step 20 (and save its
    # step-20 shard) but step 20 is never complete, so the restart goes back to step 10.
    killed = charlm(tmp_path, f"--steps={STEPS}", "--checkpoint-every=10", "--kill-at=1:20")
    assert killed.returncode != 0
    assert "SIGKILL" in killed.stderr
    assert latest_complete_step(tmp_path / "checkpoints", WORLD_SIZE) == 10
    assert max(r.step for r in ledger(tmp_path) if r.rank == 1) == 19
    resume = ["--resume-from", str(tmp_path / "checkpoints"), "--generation=1"]
    succeed(charlm(tmp_path, f"--steps={STEPS}", "--checkpoint-every=10", *resume))
    assert digest(tmp_path) == digest(reference)
    records = ledger(tmp_path)
    assert min(r.step for r in records if r.generation == 1) == 11
    comparison = compare_ledgers(records, ledger(reference), WORLD_SIZE)
    assert comparison.exact, comparison
