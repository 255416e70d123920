"""``trainguard status``: jobs folded from the bus, the same states the daemon holds, leaving
out what the daemon refused as not authentic."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from tests.support.buses import BusFactory
from tests.support.service_support import (
    CURSOR,
    JOB,
    beat,
    daemon_config,
    eventually,
    folded,
    killed,
    publish,
    record_forgery,
    running,
    shard,
    started,
)
from trainguard.agent.bus import DEFAULT_TOPICS
from trainguard.daemon import DaemonService
from trainguard.daemon.core._machine import unacted_command
from trainguard.daemon.forensics._status import read_status
from trainguard.schemas import Event

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]
OTHER = "other-job"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def sqlite_bus(tmp_path: Path) -> BusFactory:
    return BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "t.")


def other(event: Event) -> Event:
    return dataclasses.replace(event, job_id=OTHER)


async def record_two_jobs(factory: BusFactory) -> None:
    """``JOB`` loses rank 1 after committing step 10; ``OTHER`` trains on at step 7."""
    async with factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, started(0), started(1), beat(0, 1, 10), beat(1, 1, 10))
        await publish(bus, shard(0, 2, 10), shard(1, 2, 10), killed(1))
        running_job: list[Event] = [started(0), started(1), beat(0, 1, 7), beat(1, 1, 7)]
        await publish(bus, *map(other, running_job))


@pytest.mark.anyio
async def test_status_folds_to_the_states_the_daemon_holds(sqlite_bus: BusFactory) -> None:
    await record_two_jobs(sqlite_bus)
    config = daemon_config(sqlite_bus)
    service = DaemonService(config)
    async with running(service):

        async def both() -> bool:
            # The restore's tick is in the log once the daemon's transaction committed: wait
            # until the daemon folded it too.
            return (
                {JOB, OTHER} <= service.jobs.keys()
                and service.jobs[JOB].generation == 1
                and unacted_command(service.jobs[JOB]) is None
            )

        await eventually(both)
    jobs = await read_status(config.bus, config.machine)
    assert jobs.keys() == service.jobs.keys()
    for job, status in jobs.items():
        assert status.state == service.jobs[job], job
    [only] = (await read_status(config.bus, config.machine, OTHER)).values()
    assert only.state == service.jobs[OTHER]


@pytest.mark.anyio
async def test_status_folds_under_the_daemons_settings_not_its_own(
    sqlite_bus: BusFactory,
) -> None:
    """The daemon runs with a 6 s restore timeout (given to it alone, say ``--restore-timeout``):
    JOB's unacknowledged restore is retried in generation 2. Status, with the default settings
    (120 s), folds under the configuration the daemon recorded and says the same; folded under
    its own, it said generation 1, restoring, for minutes after the daemon had moved on."""
    await record_two_jobs(sqlite_bus)
    config = daemon_config(sqlite_bus, restore_timeout_s=6.0)
    service = DaemonService(config)
    async with running(service):

        async def retried() -> bool:
            # ... and the retry's tick folded too (the daemon's transaction committed it)
            return (
                JOB in service.jobs
                and service.jobs[JOB].generation == 2
                and unacted_command(service.jobs[JOB]) is None
            )

        await eventually(retried, 60)
    defaults = daemon_config(sqlite_bus).machine
    assert defaults.restore_timeout_s != config.machine.restore_timeout_s
    [job] = (await read_status(config.bus, defaults, JOB)).values()
    assert job.state == service.jobs[JOB]


def status(factory: BusFactory, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "status", "--bus", factory.url, "--topic-prefix", factory.prefix, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_the_status_command_shows_jobs_and_one_jobs_ranks(sqlite_bus: BusFactory) -> None:
    asyncio.run(record_two_jobs(sqlite_bus))

    table = status(sqlite_bus)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    [job_line] = [line for line in lines if JOB in line]
    assert "restoring" in job_line
    assert "exited" in job_line
    [other_line] = [line for line in lines if OTHER in line]
    assert "running" in other_line
    assert "2/2" in other_line

    rows = json.loads(status(sqlite_bus, "--format", "json").stdout)
    by_job = {row["job_id"]: row for row in rows}
    died = by_job[JOB]
    assert (died["phase"], died["generation"], died["committed_step"]) == ("restoring", 1, 10)
    assert died["last_incident"]["cause"] == "exited"
    assert died["last_incident"]["open"] is True
    assert (by_job[OTHER]["step"], by_job[OTHER]["ranks_alive"]) == (7, 2)

    one = json.loads(status(sqlite_bus, OTHER, "--format", "json").stdout)
    assert [(r["rank"], r["status"], r["step"], r["phase"]) for r in one["ranks"]] == [
        (0, "alive", 7, "train"),
        (1, "alive", 7, "train"),
    ]
    ranks = status(sqlite_bus, OTHER)
    assert ranks.returncode == 0, ranks.stderr
    assert "ranks of generation 0" in ranks.stdout

    unknown = status(sqlite_bus, "no-such-job")
    assert unknown.returncode == 2
    assert "no events of job 'no-such-job'" in unknown.stderr


@pytest.mark.anyio
async def test_status_leaves_out_what_the_daemon_refused(tmp_path: Path) -> None:
    factory, held = await record_forgery(tmp_path)
    config = daemon_config(factory)
    for only in (None, JOB):
        [found] = (await read_status(config.bus, config.machine, only)).values()
        assert found.state == held
        assert found.refused == 1
        assert found.last_incident is None  # the forged step would be a step_lag incident
    shown = json.loads(status(factory, JOB, "--format", "json").stdout)
    assert (shown["step"], shown["refused"], shown["last_incident"]) == (4, 1, None)
    text = status(factory, JOB)
    assert "1 record(s) left out: the daemon refused them as not authentic" in text.stdout


async def record_jobs_that_cannot_commit(factory: BusFactory) -> None:
    """``JOB``'s ranks disagree on the sampler seed of step 10; ``OTHER``'s on the snapshot
    their job started from (step 10 complete, never committed)."""
    odd_seed = dataclasses.replace(shard(1, 2, 10), cursor=dataclasses.replace(CURSOR, seed=8))
    other_origin = dataclasses.replace(shard(1, 2, 10), parent="base/g0/s5")
    async with factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, started(0), started(1), beat(0, 1, 10), beat(1, 1, 10))
        await publish(bus, shard(0, 2, 10), odd_seed)
        running_job: list[Event] = [started(0), started(1), beat(0, 1, 10), beat(1, 1, 10)]
        await publish(bus, *map(other, [*running_job, shard(0, 2, 10), other_origin]))


@pytest.mark.anyio
async def test_a_job_that_cannot_commit_says_so_in_status_metrics_and_logs(
    sqlite_bus: BusFactory,
) -> None:
    await record_jobs_that_cannot_commit(sqlite_bus)
    config = daemon_config(sqlite_bus)
    service = DaemonService(config)
    with structlog.testing.capture_logs() as logs:
        async with running(service):
            await eventually(lambda: folded(service, 12))
    assert service.jobs[JOB].phase == "failed"
    errors = {(e["event"], e["job_id"]) for e in logs if e["log_level"] == "error"}
    assert {("job failed", JOB), ("step not committed", OTHER)} <= errors
    registry = service.metrics.registry
    counted = {
        reason: registry.get_sample_value(
            "trainguard_steps_not_committed_total", {"reason": reason}
        )
        for reason in ("cursor_mismatch", "checkpoint_mismatch")
    }
    assert counted == {"cursor_mismatch": 1.0, "checkpoint_mismatch": 1.0}

    jobs = await read_status(config.bus, config.machine)
    seed_reason, origin_reason = jobs[JOB].not_committed, jobs[OTHER].not_committed
    assert seed_reason is not None
    assert "disagree on the data order after step 10" in seed_reason
    assert origin_reason is not None
    assert "disagree on the snapshot the job started from" in origin_reason
    rows = {row["job_id"]: row for row in json.loads(status(sqlite_bus, "--format", "json").stdout)}
    assert rows[OTHER]["not_committed"] == origin_reason
    [line] = [line for line in status(sqlite_bus).stdout.splitlines() if OTHER in line]
    assert "blocked" in line
    assert "not committing: shards of step 10" in status(sqlite_bus, OTHER).stdout
    # A failed job would fail again as it is: the hint to continue it says so.
    assert "once the cause is fixed, continue it from committed step" in " ".join(
        status(sqlite_bus, JOB).stdout.split()
    )


@pytest.mark.parametrize("columns", ["60", None])
def test_a_ranks_state_and_phase_are_never_cropped(
    sqlite_bus: BusFactory, columns: str | None
) -> None:
    """A rank last seen in phase ``checkpoint`` on a long host name showed ``checkpo…`` in an
    80-column terminal, and status piped to a file (rich assumed 80 columns) did the same. The
    short columns keep their width; the host name folds in a narrow terminal."""
    host = "ip-10-0-12-34.eu-west-1.compute.internal"
    ranks = [dataclasses.replace(beat(r, 1, 10), phase="checkpoint", host=host) for r in (0, 1)]

    async def record() -> None:
        async with sqlite_bus.open(topics=DEFAULT_TOPICS) as bus:
            await publish(bus, started(0), started(1), *ranks)

    asyncio.run(record())
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = subprocess.run(
        [*CLI, "status", JOB, "--bus", sqlite_bus.url, "--topic-prefix", sqlite_bus.prefix],
        capture_output=True,
        text=True,
        timeout=60,
        env=env if columns is None else {**env, "COLUMNS": columns},
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if "checkpoint" in line]
    assert len(rows) == 2, done.stdout
    for row in rows:
        assert " alive " in row, row
        assert "…" not in row, row
    assert (host in done.stdout) is (columns is None), done.stdout
