"""Issue 17 end to end for the Hugging Face ``Trainer`` (``examples/hf_trainer``) and an
Accelerate loop (``examples/accelerate_loop``): 2 ranks, DDP over gloo on CPU, ``trainguard
run`` under a real daemon on the embedded bus.

For each, one job lives through every fault in turn, each in another generation, so that the
processes' start-up (seconds: importing torch, accelerate, transformers) is paid as few times
as possible:

1. a hang of rank 1 after step 27 (every step paced by :data:`STEP_PERIOD_S` so that the
   daemon has learnt the pace; not a step that saves: the other rank would wait for it in the
   save's collective, in the declared phase ``checkpoint``, whose limit is long): the daemon's
   progress timeout restores the newest committed snapshot, step 20;
2. the test corrupts a byte of that snapshot's optimizer state (``optimizer.pt`` written by
   the ``Trainer``, ``optimizer.bin`` by ``save_state``) as soon as step 20 commits: the
   restored ranks find it before the framework reads it, the daemon is told and restores
   step 10;
3. a NaN loss on rank 0 at step 33: restored from the newest snapshot before its onset;
4. a SIGKILL of a random rank at a random step in 41-49: restored.

The job then finishes, bitwise equal to an uninterrupted run, every sample trained exactly
once per step (the ledgers), and every committed snapshot's data cursor where the data stood
at its step. The ``Trainer`` accumulates 2 batches per optimizer step
(``gradient_accumulation_steps``), over an epoch whose batches are not a multiple of 2.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from examples.charlm.ledger import ledger_path, read_ledger
from tests.scenarios.harness import (
    WORLD_SIZE,
    JobRun,
    Shape,
    assert_exact,
    assert_targets_newest_good,
)
from tests.scenarios.hf import jobs
from tests.support.buses import BusFactory
from trainguard.daemon.demo._harness import JobRecord
from trainguard.schemas import Lifecycle, Manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 60
JOB = "hf-scenario"

STEP_PERIOD_S = 0.3
"""Every step lasts at least this long (``--step-period``, numbers unchanged), more than the
agents' heartbeat interval (``jobs.start``: 0.25 s), so that the daemon has learnt the pace
before the hang: it samples a step time only from a heartbeat that shows a new highest step,
and keeps the 600 s start-up allowance until it has 8 samples (``docs/detection.md``). A
slowdown relative to a step's own time is not enough: the Accelerate loop's steps take 15 ms
on a quiet machine, and 6 x that still let several steps end between two heartbeats (the
hang after step 27 then met the 600 s allowance)."""

NAN_PACE = "slow@step=34,rank=0,factor=4,steps=8"
"""The steps after the NaN last about 4 x their own time (1.2 s or more), so that the daemon
reads the NaN (on the next heartbeat) and restores before step 41: at full speed the ranks
reached the kill's step first, and the kill was overtaken by the NaN's restore (one restore,
not two)."""

SAMPLES = 200
"""The examples' dataset (``--samples``): 25 batches of 4 samples per rank on 2 ranks, so that
an epoch trains every sample once and the data stands at epoch ``n // SAMPLES``, offset ``n %
SAMPLES`` after ``n`` samples. With 2 accumulated batches a ``Trainer`` epoch is 12 optimizer
steps of 2 batches and a 13th of the one left, and the restores resume in the middle of
epochs 1, 2 and 3."""

FRAMEWORKS = {
    "hf_trainer": ("hf/g000000/checkpoint-20/optimizer.pt", ("--grad-accum", "2")),
    "accelerate_loop": ("accelerate/g000000/step-20/optimizer.bin", ()),
}
"""Example -> the file of step 20's snapshot the test corrupts (under ``checkpoints/<job>/``),
and the example's own options."""


@pytest.mark.parametrize("example", list(FRAMEWORKS))
def test_hang_corrupt_file_nan_and_kill_are_each_restored_exactly(
    tmp_path: Path, example: str
) -> None:
    seed = random.randrange(1 << 30)
    pick = random.Random(seed)
    kill_step, kill_rank = pick.randint(41, 49), pick.randrange(2)
    faults = (
        f"hang@step=27,rank=1;nan@step=33,rank=0;{NAN_PACE};kill@step={kill_step},rank={kill_rank}"
    )
    corrupted, options = FRAMEWORKS[example]
    options = (*options, "--samples", str(SAMPLES))
    reference = jobs.reference(example, tmp_path / "reference", steps=STEPS, extra=options)
    workdir = tmp_path / "job"
    workdir.mkdir()
    bus = BusFactory("sqlite", f"sqlite://{workdir / 'bus.db'}", "t.")
    shape = Shape(steps=STEPS, checkpoint_every=10)
    context = f"{example}, seed {seed}: {faults}"
    run = JobRun(bus, workdir, shape, reference, context=context, job=JOB)
    try:
        run.start_daemon()
        jobs.start(run, example, faults, extra=(*options, "--step-period", str(STEP_PERIOD_S)))
        run.wait_for("step 20's commit", lambda m: isinstance(m, Manifest) and m.step == 20)
        jobs.corrupt(run.out / "checkpoints" / JOB / corrupted)
        code = run.finish(timeout_s=300)
        record = run.record()
    finally:
        run.close()

    restores = sorted(record.restores(), key=lambda r: r.generation)
    targets = [(r.generation, r.target.snapshot_id if r.target else None) for r in restores]
    assert [g for g, _ in targets] == [1, 2, 3, 4], f"{targets} {run.describe()}"
    assert targets[0][1] == f"{JOB}/g0/s20", f"{targets} {run.describe()}"
    assert targets[1][1] == f"{JOB}/g0/s10", f"{targets} {run.describe()}"
    rejected = {
        (e.message.generation, e.message.snapshot_id)
        for e in record.events
        if isinstance(e.message, Lifecycle) and e.message.kind == "error" and e.message.snapshot_id
    }
    assert rejected == {(1, f"{JOB}/g0/s20")}, f"{rejected} {run.describe()}"
    causes = [d["cause"] for d in record.decisions() if d["decision"] == "incident_opened"]
    assert "progress_timeout" in causes, f"{causes} {run.describe()}"
    assert "nan_loss" in causes, f"{causes} {run.describe()}"
    assert_targets_newest_good(run, record)
    assert_exact(run, code, record)
    assert_cursors_where_the_data_stood(run, record)


def assert_cursors_where_the_data_stood(run: JobRun, record: JobRecord) -> None:
    """Every committed snapshot's data cursor stands after the samples the uninterrupted run
    trained up to the snapshot's step (its ledger): the position a restore starts from, which
    the daemon only checks the ranks agree on."""
    trained = Counter[int]()
    for line in read_ledger(ledger_path(run.reference, r) for r in range(WORLD_SIZE)):
        trained[line.step] += len(line.samples)
    manifests = [m.message for m in record.manifests if isinstance(m.message, Manifest)]
    assert manifests, run.describe()
    for manifest in manifests:
        done = sum(n for step, n in trained.items() if step <= manifest.step)
        cursor = manifest.cursor
        assert (cursor.epoch, cursor.offset) == divmod(done, SAMPLES), (
            f"step {manifest.step}'s cursor (epoch {cursor.epoch}, offset {cursor.offset}) is "
            f"not after the {done} samples trained by then {run.describe()}"
        )
