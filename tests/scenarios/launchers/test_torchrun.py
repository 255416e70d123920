"""Issue 17, launchers: ``trainguard run`` in front of an existing torchrun command line
(``docs/launchers.md``). torchrun starts and watches the ranks (``--max-restarts 0``: it never
restarts them itself); ``trainguard run`` in plain mode (``--ranks``) runs torchrun as one
worker, reports its exit for the ranks it hosts with the failed rank's error, and starts it
again in the generation of the daemon's restore.

One job, ``examples/lightning`` on 2 ranks, three failures:

1. rank 1 is SIGKILLed after step 50: torchrun's own summary names it (a signal leaves no error
   file), and the exit report says so;
2. the shard of step 40 that this restore targets was corrupted after its commit: rank 0 of
   generation 1 finds its digest wrong before deserializing it (``TrainguardCheckpointIO``,
   ``ShardCorrupt``), tells the daemon, which restores step 30 instead (the Lightning
   integration's verified load, run here to spare the suite a job of its own);
3. in generation 2 rank 0 raises after step 80 (the ``error`` fault), which its ``@record``
   entry point writes to its error file, and torchrun copies into the
   ``TORCHELASTIC_ERROR_FILE`` the supervisor gave it: the exit report names the rank and the
   exception.

Every failure is restored, and the job ends bitwise equal to the uninterrupted run with an
exact sample ledger.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.scenarios.harness import JobRun, assert_exact, assert_targets_newest_good
from tests.scenarios.lightning.job import (
    FINISH_S,
    GRACE_S,
    JOB,
    SHAPE,
    lightning_args,
    worker_env,
)
from tests.support.buses import BusFactory
from trainguard.agent.checkpoint._shards import uri_to_path
from trainguard.schemas import Lifecycle, Manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


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
    """A :class:`JobRun` of the Lightning job whose daemon waits at least 60 s for progress and
    120 s for a silent rank: after rank 0 raises, its agent falls silent while the process
    winds down, and rank 1 waits in its all-reduce until that process is gone, which on a
    loaded machine took over 10 s (the default heartbeat timeout; the progress floor is 5 s).
    The test is about torchrun's exit report, which must come first."""
    run = JobRun(
        bus_factory,
        tmp_path,
        SHAPE,
        lightning_reference,
        job=JOB,
        machine={"progress_floor_s": 60.0, "heartbeat_timeout_s": 120.0},
    )
    try:
        yield run
    finally:
        run.close()


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
def test_torchrun_failures_are_reported_with_their_rank_and_a_corrupted_checkpoint_is_skipped(
    torchrun_run: JobRun,
) -> None:
    run = torchrun_run
    faults = "kill@step=50,rank=1;error@step=80,rank=0"
    run.context = f"torchrun, {faults}, rank 0's shard of step 40 corrupted once committed"
    run.start_daemon()
    run.supervisor = _torchrun(run, faults)
    committed = run.wait_for(
        "the commit of step 40",
        lambda m: isinstance(m, Manifest) and m.generation == 0 and m.step == 40,
    ).message
    [shard] = [s for s in committed.shards if s.rank == 0]
    path = uri_to_path(shard.uri)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a byte of the tensors' data: still a zip, another digest
    path.write_bytes(bytes(data))
    code = run.finish(FINISH_S)
    record = run.record()

    lifecycles = [e.message for e in record.events if isinstance(e.message, Lifecycle)]
    # Generation 1's torchrun is stopped by the restore its rank 0's report caused: no exit.
    failed = [e for e in lifecycles if e.kind == "exited" and e.exit_code]
    assert [(e.generation, e.ranks, e.exit_code) for e in failed] == [
        (0, (0, 1), 1),
        (2, (0, 1), 1),
    ], run.describe()
    # torchrun's "first observed failure": rank 1's SIGKILL, or, when rank 0's collective
    # failed and wrote its error file before torchrun saw rank 1 die, rank 0's peer error.
    assert failed[0].message.startswith(
        "torchrun: rank 1 (local rank 1) failed: exit code -9: Signal 9 (SIGKILL)"
    ) or ("by peer" in failed[0].message and failed[0].message.startswith("torchrun: ")), (
        run.describe()
    )
    assert failed[1].message == (
        "torchrun: rank 0 (local rank 0) failed: InjectedError: injected fault error-s80-r0"
    ), run.describe()
    corrupt = [e for e in lifecycles if e.kind == "error" and e.snapshot_id]
    assert [(e.rank, e.generation, e.snapshot_id) for e in corrupt] == [
        (0, 1, committed.snapshot_id)
    ], run.describe()
    assert corrupt[0].message.startswith("ShardCorrupt: "), run.describe()
    restores = record.restores()
    targets = [r.target.snapshot_id if r.target else None for r in restores]
    assert targets[:2] == [committed.snapshot_id, f"{committed.job_id}/g0/s30"], run.describe()
    assert len(restores) == 3, run.describe()
    assert failed[1].message in restores[2].reason, run.describe()
    assert_targets_newest_good(run, record)
    assert_exact(run, code, record)
