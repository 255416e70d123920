"""Scenario tests of the charlm example as real two-rank torchrun jobs under trainguard's agent:
determinism, and a rank killed by an injected fault, then restored from the committed snapshot.

Invariants 4 and 5 of the architecture: a deterministic CPU job killed and restored from its
last committed checkpoint ends bitwise equal to the uninterrupted run, and consumes exactly the
same samples at the same steps and ranks. The daemon is not part of these runs: the test reads
the checkpoint events from the job's bus, builds the manifest and publishes the ``restore`` and
``resume`` commands itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.charlm.ledger import LedgerRecord, compare_ledgers, read_ledger
from examples.charlm.train import DEFAULT_JOB
from tests.agent import _jobbus as daemon
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


def test_a_killed_rank_is_restored_from_the_committed_snapshot(
    reference: Path, tmp_path: Path
) -> None:
    # Rank 1 dies at the end of step 20, before its step-20 checkpoint: rank 0 may still save
    # its own shard of step 20, but only step 10 has every rank's shard.
    faults = "--faults=kill@step=20,rank=1"
    killed = charlm(tmp_path, f"--steps={STEPS}", "--checkpoint-every=10", faults)
    assert killed.returncode != 0
    assert "SIGKILL" in killed.stderr
    assert max(r.step for r in ledger(tmp_path) if r.rank == 1) == 20
    manifest = daemon.committed_manifest(
        daemon.read_events(bus(tmp_path), DEFAULT_JOB), DEFAULT_JOB, WORLD_SIZE
    )
    assert manifest is not None
    assert manifest.step == 10

    daemon.publish(bus(tmp_path), daemon.restore(DEFAULT_JOB, 1, manifest))
    resume = daemon.resume(DEFAULT_JOB, 1, step=10)
    helper = daemon.after_acks(bus(tmp_path), 1, range(WORLD_SIZE), resume)
    # The same command line: the fault fired once in this job and does not fire again.
    restored = charlm(tmp_path, f"--steps={STEPS}", "--checkpoint-every=10", faults, generation=1)
    helper.join()
    succeed(restored)
    assert digest(tmp_path) == digest(reference)
    records = ledger(tmp_path)
    assert min(r.step for r in records if r.generation == 1) == 11
    comparison = compare_ledgers(records, ledger(reference), WORLD_SIZE)
    assert comparison.exact, comparison
    acks = daemon.lifecycles(daemon.read_events(bus(tmp_path), DEFAULT_JOB), "restored")
    assert {(a.rank, a.step, a.snapshot_id) for a in acks} == {
        (r, 10, f"{DEFAULT_JOB}/g0/s10") for r in range(WORLD_SIZE)
    }
