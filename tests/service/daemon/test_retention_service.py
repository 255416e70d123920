"""The daemon's own retention (``[retention]``, ``docs/catalog.md``): a real daemon on a real
bus commits a job's steps from shards written as the agent lays them out, and prunes the step
folders no longer needed every interval, keeping the newest and every possible restore target
and a leftover that may still commit; a job whose storage cannot be listed, and a run that
cannot read the catalog, are logged and counted while the daemon goes on; only the jobs of
the partitions an instance owns are pruned."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tests.support.buses import BusFactory
from tests.support.service_support import JOB, JobEvents, daemon_config, eventually, publish
from tests.support.service_support import running as run_daemon
from trainguard.agent.bus import DEFAULT_TOPICS, partition_for
from trainguard.daemon import DaemonService
from trainguard.daemon.service import RetentionConfig
from trainguard.daemon.service._metrics import DaemonMetrics
from trainguard.daemon.service._pruning import Pruning
from trainguard.daemon.service._settings import DaemonConfig
from trainguard.schemas import Checkpoint

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]


def step_folder(root: Path, job: str, step: int) -> Path:
    """Where the agent writes ``job``'s shards of ``step`` in generation 0."""
    return root / job / "g000000" / f"s{step:010d}"


def written(events: JobEvents, root: Path, rank: int, seq: int, step: int) -> Checkpoint:
    """Rank ``rank``'s shard of ``step``, written to a real file in the agent's layout."""
    path = step_folder(root, events.job_id, step) / f"rank{rank:05d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = f"{events.job_id} step {step} rank {rank}".encode() * 40
    path.write_bytes(data)
    return dataclasses.replace(
        events.shard(rank, seq, step),
        shard_uri=path.as_uri(),
        size_bytes=len(data),
        digest=f"sha256:{hashlib.sha256(data).hexdigest()}",
    )


def pruning(factory: BusFactory, *, keep_last: int, interval_s: float = 0.3) -> DaemonConfig:
    """The service tests' daemon, restore targets 2, pruning every ``interval_s`` and keeping
    ``keep_last`` per job."""
    config = daemon_config(factory, keep_snapshots=2)
    retention = RetentionConfig(enabled=True, interval_s=interval_s, keep_last=keep_last)
    return dataclasses.replace(config, retention=retention)


def sample(service: DaemonService, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


STEPS = (10, 20, 30, 40, 50, 60)


async def test_the_daemon_prunes_old_steps_and_keeps_the_newest_and_its_restore_targets(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    """``keep_last = 1`` with ``keep_snapshots = 2``: of the running job's six committed steps
    the newest (60) stays, and 50 too as a possible restore target; steps 10-40 are deleted,
    each logged with its reason; step 70, which only rank 0 wrote, may still commit and
    stays."""
    root = tmp_path / "ckpt"
    events = JobEvents(JOB)
    shards = [
        written(events, root, rank, seq, step)
        for seq, step in enumerate(STEPS, start=1)
        for rank in (0, 1)
    ]
    in_flight = written(events, root, 0, 7, 70)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, events.started(0), events.started(1), *shards, in_flight)
        with capture_logs() as logs:
            async with run_daemon(DaemonService(pruning(bus_factory, keep_last=1))) as service:

                async def pruned() -> bool:
                    return sample(service, "trainguard_retention_deleted_folders_total",
                                  kind="snapshot") >= 4  # fmt: skip

                await eventually(pruned, timeout_s=60)
                assert sample(service, "trainguard_retention_runs_total", result="failed") == 0
                assert sample(service, "trainguard_retention_errors_total", kind="delete") == 0
                assert sample(service, "trainguard_retention_freed_bytes_total") > 0
                assert service.ready.is_set()
    left = sorted(p.name for p in (root / JOB / "g000000").iterdir())
    assert left == [f"s{step:010d}" for step in (50, 60, 70)]
    deleted = [e for e in logs if e["event"] == "checkpoint folder pruned"]
    assert [(e["job_id"], e["step"]) for e in deleted] == [(JOB, s) for s in (10, 20, 30, 40)]
    assert all(e["reasons"] == ["older than the job's newest 1"] for e in deleted)
    assert any(e["event"] == "retention run done" and e["deleted"] == 4 for e in logs)


async def test_unreadable_storage_and_an_unreadable_catalog_are_logged_counted_and_survived(
    tmp_path: Path,
) -> None:
    """A job whose shards name storage no implementation can list is left alone (logged,
    counted) while the other job is pruned; then an audit record that is no JSON object makes
    whole runs fail (logged with their reason, counted), and the daemon keeps folding."""
    factory = BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "r.")
    root = tmp_path / "ckpt"
    good, bad = JobEvents(JOB), JobEvents("far-job")
    shards = [
        written(good, root, rank, seq, step)
        for seq, step in enumerate(STEPS[:4], start=1)
        for rank in (0, 1)
    ]
    elsewhere = [
        dataclasses.replace(
            bad.shard(rank, seq, step),
            shard_uri=f"nosuchfs://bucket/far-job/g000000/s{step:010d}/rank{rank:05d}.pt",
        )
        for seq, step in enumerate(STEPS[:4], start=1)
        for rank in (0, 1)
    ]
    async with factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, good.started(0), good.started(1), *shards)
        await publish(bus, bad.started(0), bad.started(1), *elsewhere)
        with capture_logs() as logs:
            async with run_daemon(DaemonService(pruning(factory, keep_last=1))) as service:

                async def storage_failed() -> bool:
                    return sample(service, "trainguard_retention_errors_total",
                                  kind="storage") >= 1  # fmt: skip

                await eventually(storage_failed, timeout_s=60)
                assert sample(service, "trainguard_retention_deleted_folders_total",
                              kind="snapshot") == 2  # fmt: skip
                # The command does the same: the unreadable job named and left, the other
                # pruned (here planned), exit status 1.
                dry = _cli(factory.url, factory.prefix, "prune", "--keep-last", "1",
                           "--dry-run", status=1)  # fmt: skip
                assert {v["job_id"] for v in dry["verdicts"]} == {JOB}
                assert (
                    "cannot list the checkpoints of job 'far-job'" in dry["unreadable"]["far-job"]
                )
                await bus.publish("audit", JOB, b"[]")

                async def run_failed() -> bool:
                    return sample(service, "trainguard_retention_runs_total",
                                  result="failed") >= 2  # fmt: skip

                await eventually(run_failed, timeout_s=60)
                folded = service.counters["folded"]
                await publish(bus, good.beat(0, 9, 41))
                await eventually(lambda: _more(service, folded))
                assert service.not_ready_reason() is None
    unreadable = [e for e in logs if e["event"] == "checkpoints not pruned: storage unreadable"]
    assert unreadable[0]["job_id"] == "far-job"
    assert "cannot list the checkpoints of job 'far-job'" in unreadable[0]["error"]
    failed = [e for e in logs if e["event"] == "retention run failed: trying again next interval"]
    assert failed[0]["reason"] == "MalformedAudit"
    assert sorted(p.name for p in (root / JOB / "g000000").iterdir()) == [
        f"s{step:010d}" for step in (30, 40)
    ]


async def _more(service: DaemonService, folded: int) -> bool:
    return service.counters["folded"] > folded


async def test_only_the_jobs_of_the_owned_partitions_are_pruned_as_the_command_would(
    tmp_path: Path,
) -> None:
    """Two running jobs on different partitions of ``events``: a prune for one partition
    deletes only its job's old folders, with the verdicts ``trainguard checkpoints prune``
    prints for that job; a prune for no partition deletes nothing."""
    factory = BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "o.")
    root = tmp_path / "ckpt"
    partitions = dict(DEFAULT_TOPICS_PARTITIONS)
    jobs = _jobs_on_two_partitions(partitions["events"])
    async with factory.open(topics=DEFAULT_TOPICS) as bus:
        for job in jobs:
            events = JobEvents(job)
            shards = [
                written(events, root, rank, seq, step)
                for seq, step in enumerate(STEPS[:4], start=1)
                for rank in (0, 1)
            ]
            await publish(bus, events.started(0), events.started(1), *shards)
        async with run_daemon(DaemonService(daemon_config(factory, keep_snapshots=2))) as service:

            async def committed() -> bool:
                return all(j in service.jobs and len(service.jobs[j].committed) == 2 for j in jobs)

            await eventually(committed)
    # The daemon stopped: everything it wrote is committed, manifests included.
    config = pruning(factory, keep_last=2)
    mine, other = jobs
    settings = tmp_path / "daemon.toml"
    settings.write_text("[machine]\nkeep_snapshots = 2\n")  # the daemon's restore targets
    dry = _cli(factory.url, factory.prefix, "prune", "--job", mine, "--keep-last", "2",
               "--dry-run", "--config", str(settings))  # fmt: skip
    done = await Pruning(config, DaemonMetrics()).prune_once(
        frozenset({partition_for(mine, partitions["events"])}), None
    )
    assert done is not None
    assert {v.job_id for v in done.plan.verdicts} == {mine}
    assert {v.name: ("keep" if v.keep else "would delete") for v in done.plan.verdicts} == {
        v["name"]: v["action"] for v in dry["verdicts"]
    }
    assert sorted(done.freed) == [f"{mine}/g0/s10", f"{mine}/g0/s20"]
    assert sorted(p.name for p in (root / mine / "g000000").iterdir()) == [
        f"s{s:010d}" for s in (30, 40)
    ]
    assert len(list((root / other / "g000000").iterdir())) == 4
    nothing = await Pruning(config, DaemonMetrics()).prune_once(frozenset(), None)
    assert nothing is not None
    assert nothing.plan.verdicts == ()


DEFAULT_TOPICS_PARTITIONS = {t.name: t.partitions for t in DEFAULT_TOPICS}


def _jobs_on_two_partitions(count: int) -> tuple[str, str]:
    """Two job ids whose records go to different partitions of a topic of ``count``."""
    first = "own-a"
    other = next(
        f"own-{i}"
        for i in range(100)
        if partition_for(f"own-{i}", count) != partition_for(first, count)
    )
    return first, other


def _cli(url: str, prefix: str, *args: str, status: int = 0) -> dict[str, Any]:
    """``trainguard checkpoints ARGS --format json`` on the bus, as JSON (exit ``status``
    expected)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    done = subprocess.run(
        [*CLI, "checkpoints", *args, "--bus", url, "--topic-prefix", prefix, "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "HOME": str(Path(url.removeprefix("sqlite://")).parent / "home")},
    )
    assert done.returncode == status, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result
