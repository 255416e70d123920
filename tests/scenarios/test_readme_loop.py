"""The README's training loop, as printed, over many data epochs (issue 12, item 12).

Its former loop saved ``cursor=sampler.cursor_after(step - start)``: once the loop went over
the loader a second time that named a later epoch, and a restore skipped a whole epoch without
a word. Here the block of README.md runs unchanged (:mod:`tests.scenarios.readme_job`) on 2
ranks of a 100-sample dataset (16 samples a step: about 6 steps an epoch, batches spanning
epoch boundaries): killed under a real daemon and supervisor, and restored by hand with a loss
spike's batches to skip; every step must train exactly the global order's next batch.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from examples.charlm.ledger import compare_ledgers, ledger_path, read_ledger
from tests.scenarios.readme_job import JOB, REPO, expected_ledger, write_worker
from tests.support import jobbus as daemon
from tests.support.buses import BusFactory
from trainguard.daemon.demo._harness import read_job_record, start_daemon, stop_process, supervise
from trainguard.schemas import Checkpoint, StepRange

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORLD_SIZE = 2


def worker_env(out: Path, total: int, **extra: str) -> dict[str, str]:
    """The README worker's environment: ledgers in ``out``, ``total`` steps, shards under
    ``out/checkpoints``, heartbeats every 0.5 s, no parameter checksums (the toy replicas'
    weights differ: no gradient all-reduce), 10 ms a step."""
    return {
        "README_OUT": str(out),
        "README_TOTAL_STEPS": str(total),
        "README_PACE_S": "0.01",
        "TRAINGUARD_CHECKPOINT_DIR": str(out / "checkpoints"),
        "TRAINGUARD_HEARTBEAT_INTERVAL": "0.5",
        "TRAINGUARD_CHECKSUM_EVERY": "0",
        "TRAINGUARD_FAULTS": "",
        "PYTHONPATH": str(REPO),
        "PYTHONSAFEPATH": "1",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def assert_ledger_exact(out: Path, total: int, skip: StepRange | None = None) -> None:
    trained = read_ledger(ledger_path(out, r) for r in range(WORLD_SIZE))
    comparison = compare_ledgers(trained, expected_ledger(WORLD_SIZE, total, skip), WORLD_SIZE)
    assert comparison.exact, (
        f"{sum(comparison.missing.values())} samples skipped (e.g. "
        f"{sorted(comparison.missing)[:4]}), {sum(comparison.extra.values())} repeated or "
        f"foreign (e.g. {sorted(comparison.extra)[:4]}); logs in {out}"
    )


# The loop's data position does not depend on the bus: the embedded one is enough.
@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
def test_the_readme_loop_killed_in_a_late_epoch_resumes_exactly(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    out, total = tmp_path / "run", 200
    out.mkdir()
    worker = write_worker(tmp_path / "worker.py")
    faults = "kill@step=130,rank=1"  # epoch 20; the commit before it is step 100's
    daemon_proc = start_daemon(
        bus_factory.url, prefix=bus_factory.prefix, log_path=tmp_path / "daemon.log"
    )
    sup = supervise(
        JOB,
        [sys.executable, str(worker)],
        bus_url=bus_factory.url,
        prefix=bus_factory.prefix,
        nproc_per_node=WORLD_SIZE,
        log_path=tmp_path / "supervisor.log",
        env=worker_env(out, total, TRAINGUARD_FAULTS=faults),
    )
    try:
        code = sup.wait(480)
    finally:
        stop_process(sup, signal.SIGINT)
        stop_process(daemon_proc)
    record = asyncio.run(read_job_record(bus_factory.url, bus_factory.prefix, JOB))
    assert code == 0, f"supervisor exit {code}; logs in {tmp_path}"
    assert [(k.ranks, k.signal) for k in record.kills()] == [((1,), signal.SIGKILL)]
    restores = record.restores()
    assert any(r.target is not None and r.target.step == 100 for r in restores), restores
    trained = read_ledger(ledger_path(out, r) for r in range(WORLD_SIZE))
    assert max(r.generation for r in trained) >= 1, "no restored process trained"
    assert_ledger_exact(out, total)


def run_ranks(worker: Path, env: Mapping[str, str], cwd: Path) -> None:
    """Run the worker as ranks 0 and 1 (no launcher, no process group: the toy job has no
    DDP) and wait for both; fail with their output if one fails."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker)],
            env={**os.environ, **env, "RANK": str(r), "WORLD_SIZE": str(WORLD_SIZE)},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(WORLD_SIZE)
    ]
    for proc in procs:
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, output.decode(errors="replace")[-4000:]


def test_the_readme_loop_restored_with_a_skip_leaves_out_exactly_those_batches(
    tmp_path: Path,
) -> None:
    """Generation 0 trains to step 150 (checkpoints at 50, 100, 150); generation 1 is restored
    to step 100 with the batches of steps 103-109 to skip, as after a loss spike at 103: steps
    103 on train the batches 7 steps further, and the acknowledgement names step 100's cursor.
    The daemon's side is played by hand."""
    out, total = tmp_path / "run", 180
    out.mkdir()
    url = f"sqlite://{tmp_path / 'bus.db'}"
    worker = write_worker(tmp_path / "worker.py")
    env = worker_env(out, 150, TRAINGUARD_BUS=url, TRAINGUARD_GENERATION="0")
    run_ranks(worker, env, tmp_path)
    events = daemon.read_events(url, JOB)
    up_to_100 = [e for e in events if not isinstance(e, Checkpoint) or e.step <= 100]
    target = daemon.committed_manifest(up_to_100, JOB, WORLD_SIZE)
    assert target is not None
    assert target.step == 100
    skip = StepRange(from_step=103, to_step=109)
    daemon.publish(url, daemon.restore(JOB, 1, target, skip=skip))
    helper = daemon.after_acks(url, 1, range(WORLD_SIZE), daemon.resume(JOB, 1, step=100))
    run_ranks(
        worker, {**env, "TRAINGUARD_GENERATION": "1", "README_TOTAL_STEPS": str(total)}, tmp_path
    )
    helper.join()
    acks = daemon.lifecycles(daemon.read_events(url, JOB), "restored")
    assert sorted((a.rank, a.step, a.cursor) for a in acks) == [
        (r, 100, target.cursor) for r in range(WORLD_SIZE)
    ]
    assert_ledger_exact(out, total, skip)
