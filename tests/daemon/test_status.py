"""``trainguard status``: jobs folded from the bus, the same states the daemon holds."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.buses import BusFactory
from tests.daemon.service_support import eventually, running
from tests.daemon.test_service import (
    JOB,
    beat,
    daemon_config,
    killed,
    publish,
    shard,
    started,
)
from trainguard.agent.bus import DEFAULT_TOPICS
from trainguard.daemon import DaemonService
from trainguard.daemon._status import read_status
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
            return {JOB, OTHER} <= service.jobs.keys() and service.jobs[JOB].generation == 1

        await eventually(both)
    jobs = await read_status(config.bus, config.machine)
    assert jobs.keys() == service.jobs.keys()
    for job, status in jobs.items():
        assert status.state == service.jobs[job], job
    [only] = (await read_status(config.bus, config.machine, OTHER)).values()
    assert only.state == service.jobs[OTHER]


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
