"""The charlm example as a real two-rank torchrun job under trainguard's agent (no daemon):
two uninterrupted runs with other checkpoint intervals and modes are bitwise equal, the
precondition of every exactness check of a restored run (architecture invariants 4 and 5).
Restores of the two-rank job are the daemon scenarios' (``tests/scenarios``); a restore from a
hand-published command is ``test_charlm_parts.py``'s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.charlm.ledger import LedgerRecord, read_ledger
from examples.charlm.train import DEFAULT_JOB
from tests.support import jobbus as daemon
from trainguard.schemas import Checkpoint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 30
WORLD_SIZE = 2


def charlm(out: Path, *args: str, generation: int = 0) -> subprocess.CompletedProcess[str]:
    """Run the example as a 2-rank torchrun job of ``generation`` writing to ``out``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command = [*launcher, f"--nproc-per-node={WORLD_SIZE}", "-m", "examples.charlm.train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINGUARD_GENERATION": str(generation)}
    return subprocess.run(
        [*command, "--out", str(out), *args],
        cwd=REPO,
        env=env,
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


def bus(out: Path) -> str:
    """The example's default bus of a run writing to ``out``."""
    return f"sqlite://{out.resolve() / 'bus.db'}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-rank run of STEPS steps, checkpointing in the background."""
    out: Path = tmp_path_factory.mktemp("reference")
    succeed(charlm(out, f"--steps={STEPS}", "--checkpoint-every=10"))
    return out


def test_two_uninterrupted_runs_are_bitwise_equal(reference: Path, tmp_path: Path) -> None:
    # Another interval and blocking writes: saving state must not perturb the run.
    succeed(charlm(tmp_path, f"--steps={STEPS}", "--checkpoint-every=7", "--blocking-checkpoints"))
    assert digest(tmp_path) == digest(reference)
    assert sorted(ledger(tmp_path), key=repr) == sorted(ledger(reference), key=repr)
    events = daemon.read_events(bus(tmp_path), DEFAULT_JOB)
    steps = {(c.step, c.rank) for c in daemon.of_type(events, Checkpoint)}
    assert steps == {(s, r) for s in (7, 14, 21, 28, 30) for r in range(WORLD_SIZE)}
