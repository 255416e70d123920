"""Issue 17, launchers: ``trainguard run`` in front of an existing torchrun command line
(``docs/launchers.md``). torchrun starts and watches the ranks (``--max-restarts 0``: it never
restarts them itself); ``trainguard run`` in plain mode (``--ranks``) runs torchrun as one
worker, reports its exit for the ranks it hosts with the failed rank's error, and starts it
again in the generation of the daemon's restore.

One job, ``examples/lightning`` on 2 ranks: rank 1 is SIGKILLed after step 50 (torchrun's own
report names it: a signal leaves no error file), and in generation 1 rank 0 raises after step
80 (the ``error`` fault), which its ``@record`` entry point writes to its error file and
torchrun copies into the ``TORCHELASTIC_ERROR_FILE`` the supervisor gave it. Both exits are
reported with the failed rank and its error, both are restored, and the job ends exact.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.scenarios.harness import JobRun, assert_exact, assert_targets_newest_good
from tests.scenarios.lightning.job import GRACE_S, JOB, SHAPE, lightning_args, worker_env
from tests.support.buses import BusFactory
from trainguard.schemas import Lifecycle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _torchrun(run: JobRun, faults: str) -> subprocess.Popen[bytes]:
    """``trainguard run --ranks 0-1 -- torchrun --standalone --nproc-per-node 2
    --max-restarts 0 -m examples.lightning.train ...`` (log ``supervisor.log``)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    log = (run.workdir / "supervisor.log").open("ab")
    return subprocess.Popen(
        [
            *(sys.executable, "-P", "-m", "trainguard.daemon.cli", "run"),
            *("--job", run.job, "--bus", run.bus.url, "--topic-prefix", run.bus.prefix),
            *("--ranks", "0-1", "--grace", str(GRACE_S), "--"),
            *(*torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "0"),
            *("-m", "examples.lightning.train", *lightning_args(run.out, run.shape)),
        ],
        stdout=log,
        stderr=log,
        env={**worker_env(run.out, faults)},
        start_new_session=True,
    )


@pytest.fixture
def torchrun_run(
    bus_factory: BusFactory, tmp_path: Path, lightning_reference: Path
) -> Iterator[JobRun]:
    """A :class:`JobRun` of the Lightning job whose daemon's progress timeout is at least
    60 s: after rank 0 raises, rank 1 waits in its all-reduce until rank 0's process is gone,
    which on a loaded machine can outlast the 5 s floor; the test is about the exit report,
    which must come first."""
    run = JobRun(
        bus_factory,
        tmp_path,
        SHAPE,
        lightning_reference,
        job=JOB,
        machine={"progress_floor_s": 60.0},
    )
    try:
        yield run
    finally:
        run.close()


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
def test_torchrun_behind_trainguard_run_is_restored_and_its_failed_rank_reported(
    torchrun_run: JobRun,
) -> None:
    lit_run = torchrun_run
    faults = "kill@step=50,rank=1;error@step=80,rank=0"
    lit_run.context = f"torchrun, {faults}"
    lit_run.start_daemon()
    lit_run.supervisor = _torchrun(lit_run, faults)
    code = lit_run.finish()
    record = lit_run.record()

    failed = [
        e.message
        for e in record.events
        if isinstance(e.message, Lifecycle) and e.message.kind == "exited" and e.message.exit_code
    ]
    assert [(e.generation, e.ranks, e.exit_code) for e in failed] == [
        (0, (0, 1), 1),
        (1, (0, 1), 1),
    ], lit_run.describe()
    assert failed[0].message.startswith(
        "torchrun: rank 1 (local rank 1) failed: exit code -9: Signal 9 (SIGKILL)"
    ), lit_run.describe()
    assert failed[1].message == (
        "torchrun: rank 0 (local rank 0) failed: InjectedError: injected fault error-s80-r0"
    ), lit_run.describe()
    restores = record.restores()
    assert [r.generation for r in restores] == [1, 2], lit_run.describe()
    assert failed[1].message in restores[1].reason, lit_run.describe()
    assert_targets_newest_good(lit_run, record)
    assert_exact(lit_run, code, record)
