"""End-to-end recovery of a real 2-rank charlm job (DDP, gloo, CPU) under ``trainguard daemon``
and ``trainguard run``, on the embedded bus and on Kafka (issue 3, "Done when").

Every scenario ends with the same verdict (:func:`assert_exact`): the supervisor exits 0, the
final parameters are bitwise equal to an uninterrupted run's, and the sample ledger is exact.
On the way, the bus's record shows exactly the restores the failures call for, each targeting
the newest good snapshot committed when the daemon decided it (architecture invariants 2-5).
The random kill also checks live operations (issue 5, "Done when"): ``/healthz`` of
``trainguard daemon`` turns ready after start-up, and ``/metrics`` scraped before and after the
worker's death shows the incident and restore counters moving.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

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
from tests.support.http_get import http_get
from trainguard.agent.checkpoint._shards import uri_to_path
from trainguard.agent.supervisor._supervisor import EXIT_ABORTED
from trainguard.daemon.demo._harness import (
    charlm_command,
    charlm_env,
    read_job_record,
    stop_process,
    supervise,
)
from trainguard.schemas import Lifecycle, Manifest, Resume

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _kill_step(job_run: JobRun) -> tuple[int, int]:
    """A kill step drawn from a seed (``$TRAINGUARD_SCENARIO_SEED`` to replay one), anywhere
    from before the first commit to near the end; returns ``(seed, step)``."""
    seed = int(os.environ.get("TRAINGUARD_SCENARIO_SEED") or random.SystemRandom().randrange(10**6))
    shape = job_run.shape
    margin = shape.checkpoint_every // 2
    return seed, random.Random(seed).randrange(margin, shape.steps - margin)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(url: str) -> Samples:
    status, text = http_get(f"{url}/metrics")
    assert status == 200, text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _ready(job_run: JobRun) -> str:
    """Wait for ``/healthz`` of the daemon to answer ``200 ready`` (``503`` until then); the
    URL of its metrics server."""
    url = job_run.metrics_url()
    deadline = time.monotonic() + 60
    while (health := http_get(f"{url}/healthz"))[0] != 200:
        assert health[0] == 503, f"{health} {job_run.describe()}"
        assert time.monotonic() < deadline, f"never ready: {health} {job_run.describe()}"
        time.sleep(0.1)
    assert health == (200, "ready\n")
    return url


def _assert_counted_once(job_run: JobRun, url: str) -> None:
    """``/metrics`` shows one incident of cause ``exited``, its restart restore and resume."""
    # The daemon counts a command once the bus has acknowledged it, which a reader of the bus
    # (as wait_for is) can see a moment earlier: give the counter that moment.
    deadline = time.monotonic() + 10
    while _value(after := _scrape(url), "trainguard_commands_total", type="resume") < 1:
        assert time.monotonic() < deadline, f"resume never counted {job_run.describe()}"
        time.sleep(0.05)
    exited = {"cause": "exited"}
    assert _value(after, "trainguard_incidents_total", **exited) == 1, job_run.describe()
    assert _value(after, "trainguard_restores_total", **exited, mode="restart") == 1
    assert _value(after, "trainguard_commands_total", type="resume") == 1
    assert _value(after, "trainguard_detection_latency_seconds_count", **exited) == 1
    assert _value(after, "trainguard_time_to_resume_seconds_count", mode="restart") == 1
    assert _value(after, "trainguard_events_folded_total", type="heartbeat") > 0


def test_a_rank_killed_at_a_random_step_is_restored_once_from_the_latest_commit(
    job_run: JobRun,
) -> None:
    seed, step = _kill_step(job_run)
    job_run.context = f"TRAINGUARD_SCENARIO_SEED={seed}: kill@step={step},rank=1"
    job_run.start_daemon()
    url = _ready(job_run)
    before = _scrape(url)
    exited = {"cause": "exited"}
    assert _value(before, "trainguard_incidents_total", **exited) == 0
    assert _value(before, "trainguard_restores_total", **exited, mode="restart") == 0
    job_run.start_job(f"kill@step={step},rank=1")
    job_run.wait_for("the resume", lambda m: isinstance(m, Resume))
    _assert_counted_once(job_run, url)
    code = job_run.finish()
    record = job_run.record()

    killed = only(record.kills(), "worker killed", job_run)
    assert (killed.ranks, killed.signal) == ((1,), signal.SIGKILL), job_run.describe()
    restore = only(record.restores(), "restore", job_run)
    assert (restore.generation, restore.attempt) == (1, 1), job_run.describe()
    assert_targets_newest_good(job_run, record)
    assert restore.target is None or (
        restore.target.generation == 0 and restore.target.step <= step
    ), f"target {restore.target} {job_run.describe()}"
    assert [r.generation for r in record.resumes()] == [1], job_run.describe()
    assert_exact(job_run, code, record)


# Bus-independent (the restore rules are the pure machine's; the bus contract and the random
# kill above run on both buses): the embedded bus only, to keep the suite's time in bounds.
@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
def test_two_kills_in_a_row_make_two_incidents_and_two_restores(job_run: JobRun) -> None:
    faults = "kill@step=40,rank=1;kill@step=70,rank=0"
    job_run.context = faults
    job_run.start_daemon()
    job_run.start_job(faults)
    code = job_run.finish()
    record = job_run.record()

    assert [(k.generation, k.ranks) for k in record.kills()] == [(0, (1,)), (1, (0,))], (
        job_run.describe()
    )
    restores = record.restores()
    assert [(r.generation, r.attempt, r.incident_id) for r in restores] == [
        (1, 1, "charlm-scenario/i1"),
        (2, 1, "charlm-scenario/i2"),
    ], job_run.describe()
    assert_targets_newest_good(job_run, record)
    assert [r.generation for r in record.resumes()] == [1, 2], job_run.describe()
    assert_exact(job_run, code, record)


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)  # see above
def test_a_rank_killed_during_the_restore_is_retried_in_a_new_generation(
    job_run: JobRun,
) -> None:
    job_run.context = "kill@step=50,rank=1, then SIGKILL of rank 1's generation-1 process"
    job_run.start_daemon()
    job_run.start_job("kill@step=50,rank=1")
    # The supervisor reports the pid of each worker it starts for the restore of generation 1;
    # rank 1 is then still importing, rendezvousing or loading: it dies before it acknowledges.
    started = job_run.wait_for(
        "generation 1's rank 1 started",
        lambda m: (
            isinstance(m, Lifecycle)
            and m.kind == "started"
            and m.rank is None
            and m.generation == 1
            and m.ranks == (1,)
        ),
    )
    os.kill(started.message.pid, signal.SIGKILL)
    code = job_run.finish()
    record = job_run.record()

    assert [(k.generation, k.ranks) for k in record.kills()] == [(0, (1,)), (1, (1,))], (
        job_run.describe()
    )
    assert not any(
        isinstance(e.message, Lifecycle)
        and e.message.kind == "restored"
        and e.message.generation == 1
        and e.message.rank == 1
        for e in record.events
    ), f"rank 1 acknowledged generation 1 before it was killed {job_run.describe()}"
    restores = record.restores()
    assert [(r.generation, r.attempt, r.incident_id) for r in restores] == [
        (1, 1, "charlm-scenario/i1"),
        (2, 2, "charlm-scenario/i1"),
    ], job_run.describe()
    assert restores[0].target == restores[1].target, job_run.describe()
    assert_targets_newest_good(job_run, record)
    assert [r.generation for r in record.resumes()] == [2], job_run.describe()
    assert_exact(job_run, code, record)


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)  # see above
def test_a_shard_corrupted_after_its_commit_is_caught_and_the_previous_snapshot_used(
    job_run: JobRun,
) -> None:
    job_run.context = "rank 0's shard of step 60 corrupted once committed, kill@step=70,rank=1"
    job_run.start_daemon()
    job_run.start_job("kill@step=70,rank=1")
    committed = job_run.wait_for(
        "the commit of step 60",
        lambda m: isinstance(m, Manifest) and m.generation == 0 and m.step == 60,
    ).message
    [shard] = [s for s in committed.shards if s.rank == 0]
    _flip_bytes(uri_to_path(shard.uri))
    code = job_run.finish()
    record = job_run.record()

    # Rank 0 of generation 0 reports its own error too (its collective lost rank 1).
    verification = [
        (e.message.rank, e.message.generation, e.message.snapshot_id, e.message.message)
        for e in record.events
        if isinstance(e.message, Lifecycle) and e.message.kind == "error" and e.message.snapshot_id
    ]
    assert [v[:3] for v in verification] == [(0, 1, committed.snapshot_id)], job_run.describe()
    assert verification[0][3].startswith("ShardCorrupt: "), job_run.describe()
    restores = record.restores()
    assert [(r.generation, r.attempt) for r in restores] == [(1, 1), (2, 2)], job_run.describe()
    targets = [r.target.snapshot_id if r.target else None for r in restores]
    fallback = f"{committed.job_id}/g0/s40"
    assert targets == [committed.snapshot_id, fallback], job_run.describe()
    assert_targets_newest_good(job_run, record)
    assert_exact(job_run, code, record)


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)  # see above
def test_a_job_started_from_a_corrupt_init_from_snapshot_fails_at_once_naming_it(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    """Job ``if2`` starts (``trainguard run --init-from``) from the scenario job's commit of
    step 10, whose rank 0 shard was corrupted: the daemon fails it without a restore, and the
    supervisor exits 3 with the digest failure as the reason (docs/recovery.md)."""
    origin_run = JobRun(
        bus_factory, tmp_path, Shape(steps=10, checkpoint_every=10), reference=tmp_path
    )
    origin_run.context = "if2 --init-from the scenario job's step 10, rank 0's shard corrupted"
    seeded: subprocess.Popen[bytes] | None = None
    try:
        origin_run.start_daemon()
        origin_run.start_job()
        origin = origin_run.wait_for(
            "the commit of step 10", lambda m: isinstance(m, Manifest) and m.step == 10
        ).message
        assert origin_run.supervisor is not None
        assert origin_run.supervisor.wait(150) == 0, origin_run.describe()
        [shard] = [s for s in origin.shards if s.rank == 0]
        _flip_bytes(uri_to_path(shard.uri))

        out = tmp_path / "if2"
        seeded = supervise(
            "if2",
            charlm_command(out, steps=20, checkpoint_every=10, seed=origin_run.shape.seed),
            bus_url=bus_factory.url,
            prefix=bus_factory.prefix,
            nproc_per_node=origin_run.shape.world_size,
            log_path=tmp_path / "supervisor-if2.log",
            env=charlm_env(out, REPO),
            grace_s=GRACE_S,
            args=["--init-from", origin.snapshot_id],
        )
        assert seeded.wait(150) == EXIT_ABORTED, origin_run.describe()
        record = asyncio.run(read_job_record(bus_factory.url, bus_factory.prefix, "if2"))
        origin_run.assert_replays("if2")
    finally:
        if seeded is not None and seeded.poll() is None:
            stop_process(seeded, signal.SIGINT, timeout_s=GRACE_S + 10)
        origin_run.close()

    assert record.restores() == [], origin_run.describe()
    [failed] = [d for d in record.decisions() if d["decision"] == "job_failed"]
    reason = failed["reason"]
    [error] = [
        e.message
        for e in record.events
        if isinstance(e.message, Lifecycle) and e.message.kind == "error" and e.message.snapshot_id
    ]
    assert (error.rank, error.snapshot_id) == (0, origin.snapshot_id), origin_run.describe()
    assert error.message.startswith(
        f"cannot start from init_from snapshot {origin.snapshot_id}: ShardCorrupt: "
    ), error.message
    assert f"it is snapshot {origin.snapshot_id} of another job (init_from)" in reason, reason
    assert (
        f"rank 0 on host {error.host} reported that snapshot {origin.snapshot_id} failed "
        f"verification: {error.message}" in reason
    ), reason
    [abort] = record.aborts()
    assert abort.reason == reason, origin_run.describe()


def _flip_bytes(path: Path) -> None:
    """Invert 16 bytes in the middle of ``path`` (same size, so only the digest can tell)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    path.write_bytes(data)
