"""Issue 17, PyTorch Lightning: ``examples/lightning`` (2 ranks, DDP over gloo on CPU) under
``trainguard daemon`` and ``trainguard run`` on the embedded bus, with
:class:`~trainguard.integrations.lightning.TrainguardCallback`.

A hang, a SIGKILL of a rank at a random step and a NaN loss, one after the other in one job,
are each detected and restored (in three generations: one job keeps the test short, as every
Lightning process takes seconds to start); the job ends with final parameters bitwise equal to
the uninterrupted run's and an exact sample ledger. A shard corrupted after its commit, caught
by ``TrainguardCheckpointIO`` before it is deserialized, is in the launcher scenario
(``tests/scenarios/launchers/test_torchrun.py``), whose job is the same.
"""

from __future__ import annotations

import os
import random
import re

import pytest

from tests.scenarios.harness import JobRun, assert_exact
from tests.scenarios.lightning.job import FINISH_S, start_lightning

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PACE = "slow@step=1,rank=0,factor=12,steps=37"
NAN_PACE = "slow@step=111,rank=1,factor=60,steps=10"
"""The steps after the NaN last about 60 x their own time, so that the daemon reads the NaN (on
the next heartbeat, up to a second later) before the job's last step: at full speed on a quiet
machine the job finished first, its NaN never seen."""
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
    faults = f"{PACE};hang@step=40,rank=0;kill@step={kill},rank=1;nan@step=110,rank=1;{NAN_PACE}"
    lit_run.context = f"seed {seed}: {faults}"
    lit_run.start_daemon()
    start_lightning(lit_run, faults)
    code = lit_run.finish(FINISH_S)
    record = lit_run.record()

    causes = [(d["cause"], d["ranks"]) for d in _incidents(lit_run)]
    assert [c for c, _ in causes] == ["progress_timeout", "exited", "nan_loss"], lit_run.describe()
    # The kill's rank; the NaN's: whichever rank reported a non-finite loss first (DDP's
    # all-reduce carries rank 1's NaN gradients to rank 0 within a step).
    assert causes[1][1] == [1], lit_run.describe()
    assert causes[2][1] in ([0], [1], [0, 1]), lit_run.describe()
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
    # ... to the newest snapshot whose parameters are known sound (the reason names the step:
    # how close to the onset depends on the pace against the heartbeat interval) among those
    # committed when the restore was issued (a loaded machine may still be writing step 100's
    # checkpoint then).
    sound = re.search(r"parameters known sound up to step (\d+)", restores[2].reason)
    assert sound is not None, lit_run.describe()
    assert steps[1] is not None
    decided = record.decisions()
    issued = next(
        i
        for i, d in enumerate(decided)
        if d["decision"] == "issue" and d["command"].get("generation") == 3
    )
    bound = min(100, int(sound[1]) // 10 * 10)
    committed = [d["snapshot"]["step"] for d in decided[:issued] if d["decision"] == "committed"]
    expected = max([steps[1], *(step for step in committed if step <= bound)])
    assert steps[2] == expected, lit_run.describe()
    assert [(k.generation, k.ranks) for k in record.kills()] == [(1, (1,))], lit_run.describe()
    assert [r.generation for r in record.resumes()] == [1, 2, 3], lit_run.describe()
    assert_exact(lit_run, code, record)
