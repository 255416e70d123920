"""Issue 17, PyTorch Lightning: ``examples/lightning`` (2 ranks, DDP over gloo on CPU) under
``trainguard daemon`` and ``trainguard run`` on the embedded bus, with
:class:`~trainguard.integrations.lightning.TrainguardCallback`.

A hang, a SIGKILL of a rank at a random step and a NaN loss, one after the other in one job,
are each detected and restored (in three generations: one job keeps the test short, as every
Lightning process takes seconds to start); the job ends with final parameters bitwise equal to
the uninterrupted run's and an exact sample ledger. A shard corrupted after its commit is
caught before it is deserialized, and the snapshot before it is used.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.scenarios.harness import JobRun, assert_exact, assert_targets_newest_good, only
from tests.scenarios.lightning.job import start_lightning
from trainguard.agent.checkpoint._shards import uri_to_path
from trainguard.schemas import Lifecycle, Manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PACE = "slow@step=1,rank=0,factor=12,steps=37"
"""Steps 1-37 of generation 0 twelve times as long (about 0.2 s) (DDP makes rank 1 wait for rank 0): the
daemon's progress timeout applies once it has sampled 8 step times from heartbeats that show a
new step, and unpaced, the first 40 steps take about as many heartbeats. It ends before the
hang at step 40 (``slow`` stretches a step by its own duration, and rank 1's step 41 waits for
the hung rank 0)."""


def _incidents(run: JobRun) -> list[dict[str, object]]:
    """The incidents the daemon opened, in order (audit decisions)."""
    return [d for d in run.record().decisions() if d["decision"] == "incident_opened"]


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
def test_a_hang_a_kill_and_a_nan_loss_are_each_restored_and_the_run_ends_exact(
    lit_run: JobRun,
) -> None:
    seed = int(os.environ.get("TRAINGUARD_SCENARIO_SEED") or random.SystemRandom().randrange(10**6))
    kill = random.Random(seed).randrange(55, 96)  # in generation 1, before the NaN's step
    faults = f"{PACE};hang@step=40,rank=0;kill@step={kill},rank=1;nan@step=110,rank=1"
    lit_run.context = f"seed {seed}: {faults}"
    lit_run.start_daemon()
    start_lightning(lit_run, faults)
    code = lit_run.finish()
    record = lit_run.record()

    causes = [(d["cause"], d["ranks"]) for d in _incidents(lit_run)]
    assert [c for c, _ in causes] == ["progress_timeout", "exited", "nan_loss"], lit_run.describe()
    assert [r for _, r in causes[1:]] == [[1], [1]], lit_run.describe()
    restores = record.restores()
    assert [(r.generation, r.mode) for r in restores] == [
        (1, "restart"),
        (2, "restart"),
        (3, "restart"),
    ], lit_run.describe()
    steps = [r.target.step if r.target else None for r in restores]
    # The hang struck in step 40 before its checkpoint; the kill after step `kill`, whose
    # newest checkpoint (or, when a write was still in flight on the killed rank, the one
    # before) is the target; the NaN's restore goes back before its onset, since the
    # snapshot of step 110 holds parameters the NaN gradients already reached.
    newest = (kill - 1) // 10 * 10
    assert steps[0] == 30, lit_run.describe()
    assert steps[1] in (newest, newest - 10), lit_run.describe()
    assert steps[2] == 100, lit_run.describe()
    assert [(k.generation, k.ranks) for k in record.kills()] == [(1, (1,))], lit_run.describe()
    assert [r.generation for r in record.resumes()] == [1, 2, 3], lit_run.describe()
    assert_exact(lit_run, code, record)


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
def test_a_corrupted_lightning_checkpoint_is_caught_before_load_and_the_previous_one_used(
    lit_run: JobRun,
) -> None:
    lit_run.context = "rank 0's shard of step 40 corrupted once committed, kill@step=50,rank=1"
    lit_run.start_daemon()
    start_lightning(lit_run, "kill@step=50,rank=1")
    committed = lit_run.wait_for(
        "the commit of step 40",
        lambda m: isinstance(m, Manifest) and m.generation == 0 and m.step == 40,
    ).message
    [shard] = [s for s in committed.shards if s.rank == 0]
    path = uri_to_path(shard.uri)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte inside the tensors' data: still a zip, wrong digest
    path.write_bytes(bytes(data))
    code = lit_run.finish()
    record = lit_run.record()

    reports = [
        e.message
        for e in record.events
        if isinstance(e.message, Lifecycle) and e.message.kind == "error" and e.message.snapshot_id
    ]
    report = only(reports, "report of a snapshot that cannot be loaded", lit_run)
    assert (report.rank, report.generation, report.snapshot_id) == (
        0,
        1,
        committed.snapshot_id,
    ), lit_run.describe()
    assert (report.message or "").startswith("ShardCorrupt: "), lit_run.describe()
    targets = [r.target.snapshot_id if r.target else None for r in record.restores()]
    assert targets == [committed.snapshot_id, f"{committed.job_id}/g0/s30"], lit_run.describe()
    assert_targets_newest_good(lit_run, record)
    assert_exact(lit_run, code, record)
