"""The ``examples/llm_fsdp`` job (FSDP2 over gloo, AdamW, asynchronous DCP checkpoints,
torchdata's ``StatefulDataLoader`` with a worker process) under a real ``trainguard daemon``
and ``trainguard run``, on the embedded bus and on Kafka (issue 15, item 6 and the first
"Done when" bullet), with checkpoints on a local path and on a real S3 server
(``deploy/s3/s3-dev``'s S3Proxy, the ``s3_bucket`` fixture).

Every scenario ends with the verdict of the charlm scenarios (:func:`assert_exact`): the
supervisor exits 0, the final (gathered, unsharded) parameters are bitwise equal to an
uninterrupted run's, and the sample ledger is exact.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

import trainguard.agent
import trainguard.daemon
import trainguard.schemas
from tests.scenarios.harness import (
    GRACE_S,
    REPO,
    JobRun,
    Shape,
    assert_exact,
    assert_targets_newest_good,
    only,
)
from tests.support.buses import BusFactory
from trainguard.agent import Snapshot
from trainguard.agent.bus import sqlite_url
from trainguard.agent.checkpoint._shards import uri_to_path
from trainguard.daemon.demo._harness import charlm_env, stop_process, supervise
from trainguard.schemas import Lifecycle, Manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SHAPE = Shape(steps=40, checkpoint_every=10, seed=11)
JOB = "llm-scenario"


def _pythonpath() -> str:
    """The repository (for ``examples``) and the folders this test process imports trainguard
    from, so that the supervisor and its workers run the same code as the test (a worktree's,
    not an installed copy's)."""
    sources = [
        Path(next(iter(package.__path__))).parents[1]
        for package in (trainguard.schemas, trainguard.agent, trainguard.daemon)
    ]
    return os.pathsep.join(dict.fromkeys(str(p) for p in [REPO, *sources]))


def llm_command(out: Path, shape: Shape, extra: Sequence[str] = ()) -> list[str]:
    """The worker command of the ``examples/llm_fsdp`` job writing to ``out``."""
    return [
        sys.executable,
        "-m",
        "examples.llm_fsdp.train",
        f"--steps={shape.steps}",
        f"--checkpoint-every={shape.checkpoint_every}",
        f"--seed={shape.seed}",
        f"--out={out}",
        *extra,
    ]


def llm_env(out: Path, faults: str = "", checkpoint_uri: str | None = None) -> dict[str, str]:
    """Worker environment: charlm's (checkpoints and fault markers under ``out/checkpoints``,
    heartbeats every 0.5 s, ``faults``), this test's ``PYTHONPATH``, the example's own default
    checkpoint format (``dcp``) said out loud, and ``checkpoint_uri`` as
    ``TRAINGUARD_CHECKPOINT_URI`` when given (the AWS variables of an ``s3://`` one come from
    the ``s3_env`` fixture, in ``os.environ``, which the processes inherit)."""
    env = charlm_env(out, REPO, faults=faults)
    env["PYTHONPATH"] = _pythonpath()
    env["TRAINGUARD_CHECKPOINT_FORMAT"] = "dcp"
    env["OMP_NUM_THREADS"] = "1"
    if checkpoint_uri is not None:
        env["TRAINGUARD_CHECKPOINT_URI"] = checkpoint_uri
    return env


class LLMRun(JobRun):
    """A :class:`JobRun` of the ``examples/llm_fsdp`` job instead of charlm's, its DCP
    checkpoints under :attr:`checkpoint_uri` (``None``: ``run/checkpoints``)."""

    checkpoint_uri: str | None = None

    def start_job(
        self,
        faults: str = "",
        *,
        extra: Sequence[str] = (),
        heartbeat_interval_s: float = 0.5,
        checksum_every: int | None = None,
        run_args: Sequence[str] = (),
    ) -> None:
        self.supervisor = supervise(
            self.job,
            llm_command(self.out, self.shape, extra),
            bus_url=self.bus.url,
            prefix=self.bus.prefix,
            nproc_per_node=self.shape.world_size,
            log_path=self.workdir / "supervisor.log",
            env=llm_env(self.out, faults, self.checkpoint_uri),
            grace_s=GRACE_S,
            args=run_args,
        )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Output folder of the uninterrupted run of :data:`SHAPE` (no daemon: the agents only
    publish), with blocking checkpoints at other steps than the scenarios': saving must not
    change a bit of the training."""
    out = tmp_path_factory.mktemp("llm-reference")
    sup = supervise(
        "reference",
        llm_command(out, Shape(SHAPE.steps, 7, SHAPE.seed), ["--blocking-checkpoints"]),
        bus_url=sqlite_url(out / "bus.db"),
        prefix="ref.",
        nproc_per_node=SHAPE.world_size,
        log_path=out / "supervisor.log",
        env=llm_env(out),
        args=("--daemon-timeout", "0"),
    )
    try:
        code = sup.wait(240)
    except subprocess.TimeoutExpired:
        stop_process(sup, signal.SIGKILL)
        raise
    assert code == 0, f"the reference run failed ({code}); see {out / 'supervisor.log'}"
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return out


@pytest.fixture
def llm_run(bus_factory: BusFactory, tmp_path: Path, reference: Path) -> Iterator[LLMRun]:
    run = LLMRun(bus_factory, tmp_path, SHAPE, reference, job=JOB)
    try:
        yield run
    finally:
        run.close()


def _kill_step(first: int) -> tuple[int, int]:
    """A kill step drawn from a seed (``$TRAINGUARD_SCENARIO_SEED`` to replay one), from
    ``first`` to the step before the last; returns ``(seed, step)``."""
    seed = int(os.environ.get("TRAINGUARD_SCENARIO_SEED") or random.SystemRandom().randrange(10**6))
    return seed, random.Random(seed).randrange(first, SHAPE.steps - 1)


def test_an_fsdp_rank_killed_at_a_random_step_is_restored_once_and_bitwise_exact(
    llm_run: LLMRun,
) -> None:
    _kill_at_a_random_step(llm_run)


@pytest.mark.s3
@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)  # storage is bus-blind
def test_the_random_kill_with_dcp_checkpoints_on_s3_is_restored_once_and_bitwise_exact(
    llm_run: LLMRun, s3_bucket: str
) -> None:
    llm_run.checkpoint_uri = f"s3://{s3_bucket}/checkpoints"
    # A process's first save to S3 takes seconds more than the next ones (measured ~2.5 s
    # here: s3fs, aiobotocore and the first connection, on the agent's writer thread), during
    # which training goes on: the kill comes after the second checkpoint, at 0.3 s a step.
    target = _kill_at_a_random_step(
        llm_run, first=2 * SHAPE.checkpoint_every + 2, extra=["--step-period=0.3"]
    )
    folder = target.shards[0].uri
    assert folder.startswith(f"{llm_run.checkpoint_uri}/"), f"{folder} {llm_run.describe()}"


def _kill_at_a_random_step(
    llm_run: LLMRun, first: int = SHAPE.checkpoint_every + 5, extra: Sequence[str] = ()
) -> Manifest:
    """SIGKILL rank 1 at a random step from ``first`` on (by default a few steps after the
    first checkpoint, for its asynchronous write to commit), with ``extra`` options of the
    example; check the restore and the outcome; return the restore's target."""
    seed, step = _kill_step(first)
    faults = f"kill@step={step},rank=1"
    llm_run.context = f"TRAINGUARD_SCENARIO_SEED={seed}: {faults}"
    llm_run.start_daemon()
    llm_run.start_job(faults, extra=extra)
    code = llm_run.finish()
    record = llm_run.record()

    killed = only(record.kills(), "worker killed", llm_run)
    assert (killed.ranks, killed.signal) == ((1,), signal.SIGKILL), llm_run.describe()
    restore = only(record.restores(), "restore", llm_run)
    assert (restore.mode, restore.generation, restore.attempt) == ("restart", 1, 1)
    assert_targets_newest_good(llm_run, record)
    target = restore.target
    assert target is not None, f"restored from scratch {llm_run.describe()}"
    assert target.generation == 0, f"{target} {llm_run.describe()}"
    assert target.step <= step, f"{target} {llm_run.describe()}"
    # A DCP snapshot: one folder, each rank's .distcp file, the coordinator's .metadata; its
    # manifest stored beside it, as the restore command's reference names it.
    manifest = Snapshot.open(target, lambda: ()).manifest()
    names = {f.name for s in manifest.shards for f in s.files or ()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= names, llm_run.describe()
    assert [r.generation for r in record.resumes()] == [1], llm_run.describe()
    assert_exact(llm_run, code, record)
    return manifest


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)  # the rule is bus-blind
def test_a_flipped_byte_in_a_distcp_file_falls_back_to_the_previous_snapshot(
    llm_run: LLMRun,
) -> None:
    """Rank 1 is killed at step 27; once step 20 is committed (the newest snapshot then) a
    ``.distcp`` file of it, chosen at random, gets 16 bytes inverted. The restore to step 20
    fails its digest check before DCP reads the file, the rank reports it, and the daemon
    restores step 10: the job still ends bitwise exact."""
    seed = int(os.environ.get("TRAINGUARD_SCENARIO_SEED") or random.SystemRandom().randrange(10**6))
    victim = f"__{random.Random(seed).randrange(SHAPE.world_size)}_0.distcp"
    faults = "kill@step=27,rank=1"
    llm_run.context = f"TRAINGUARD_SCENARIO_SEED={seed}: {victim} of step 20 flipped, {faults}"
    llm_run.start_daemon()
    llm_run.start_job(faults)
    committed = llm_run.wait_for(
        "the commit of step 20",
        lambda m: isinstance(m, Manifest) and m.generation == 0 and m.step == 20,
    ).message
    folder = uri_to_path(committed.shards[0].uri)
    _flip_bytes(folder / victim)
    code = llm_run.finish()
    record = llm_run.record()

    reports = [
        (e.message.generation, e.message.snapshot_id, e.message.message)
        for e in record.events
        if isinstance(e.message, Lifecycle) and e.message.kind == "error" and e.message.snapshot_id
    ]
    assert reports, f"no rank reported the corrupt snapshot {llm_run.describe()}"
    assert {r[:2] for r in reports} == {(1, committed.snapshot_id)}, llm_run.describe()
    assert all(r[2].startswith("ShardCorrupt: ") and victim in r[2] for r in reports), reports
    restores = record.restores()
    assert [(r.generation, r.attempt) for r in restores] == [(1, 1), (2, 2)], llm_run.describe()
    targets = [r.target.snapshot_id if r.target else None for r in restores]
    assert targets == [committed.snapshot_id, f"{JOB}/g0/s10"], llm_run.describe()
    assert_targets_newest_good(llm_run, record)
    assert_exact(llm_run, code, record)


def _flip_bytes(path: Path) -> None:
    """Invert 16 bytes in the middle of ``path`` (same size, so only the digest can tell)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    path.write_bytes(data)
