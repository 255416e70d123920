"""The daemon's /metrics and /healthz: scraped over real HTTP from a running service on the
embedded bus while a (synthetic) job dies and is restored. The metric definitions on their own:
``tests/unit/daemon/test_metric_definitions.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.buses import BusFactory
from tests.support.health import sample, scrape, serving
from tests.support.http_get import http_get
from tests.support.service_support import (
    CURSOR,
    JOB,
    beat,
    daemon_config,
    eventually,
    killed,
    publish,
    running,
    shard,
    started,
)
from trainguard.agent.bus import DEFAULT_TOPICS, Bus
from trainguard.daemon import DaemonService
from trainguard.schemas import Lifecycle, Restore, decode

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture
def sqlite_bus(tmp_path: Path) -> BusFactory:
    return BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "t.")


def acknowledge(restore: Restore) -> list[Lifecycle]:
    """Both ranks restart into the restore's generation and acknowledge its target."""
    target = restore.target
    assert target is not None
    out = []
    for rank in (0, 1):
        back = Lifecycle(
            job_id=JOB,
            generation=restore.generation,
            ts=time.time_ns(),
            seq=0,
            host="h0",
            rank=rank,
            pid=200 + rank,
            kind="started",
            world_size=2,
        )
        ack = dataclasses.replace(
            back,
            seq=1,
            kind="restored",
            world_size=None,
            step=target.step,
            cursor=CURSOR,
            snapshot_id=target.snapshot_id,
        )
        out += [back, ack]
    return out


async def latest_restore(bus: Bus) -> Restore | None:
    record = (await bus.latest_per_key("commands")).get(JOB)
    if record is None or record.value is None:
        return None
    command = decode(record.value)
    return command if isinstance(command, Restore) else None


async def test_metrics_follow_an_incident_and_health_flips_to_ready(
    sqlite_bus: BusFactory,
) -> None:
    config = daemon_config(sqlite_bus)
    service = DaemonService(config)
    async with serving(service) as server, sqlite_bus.open(topics=DEFAULT_TOPICS) as bus:
        status, body = await asyncio.to_thread(http_get, f"{server.url}/healthz")
        assert (status, body) == (
            503,
            "not ready: no partition of events assigned to this instance\n",
        )
        assert (await asyncio.to_thread(http_get, f"{server.url}/nothing"))[0] == 404

        await publish(bus, started(0), started(1), beat(0, 1, 10), beat(1, 1, 10))
        await publish(bus, shard(0, 2, 10), shard(1, 2, 10))
        async with running(service):
            await asyncio.wait_for(service.ready.wait(), 30)
            assert await asyncio.to_thread(http_get, f"{server.url}/healthz") == (200, "ready\n")
            before = await scrape(server)
            assert sample(before, "trainguard_incidents_total", cause="exited") == 0
            assert sample(before, "trainguard_restores_total", cause="exited", mode="restart") == 0

            await publish(bus, killed(1))
            await bus.publish("events", JOB, b"\xff\xfe not json")
            await publish(bus, beat(0, 1, 10))  # a duplicate seq of generation 0: stale now
            restore = await eventually(lambda: latest_restore(bus))
            await publish(bus, *acknowledge(restore))

            async def resumed() -> dict[Any, float] | None:
                samples = await scrape(server)
                done = sample(samples, "trainguard_time_to_resume_seconds_count", mode="restart")
                lagged = sample(samples, "trainguard_jobs", phase="running") == 1
                return samples if done == 1 and lagged else None

            after = await eventually(resumed)

    assert sample(after, "trainguard_incidents_total", cause="exited") == 1
    assert sample(after, "trainguard_restores_total", cause="exited", mode="restart") == 1
    assert sample(after, "trainguard_commands_total", type="restore") == 1
    assert sample(after, "trainguard_commands_total", type="resume") == 1
    assert sample(after, "trainguard_detection_latency_seconds_count", cause="exited") == 1
    assert sample(after, "trainguard_rejected_inputs_total", reason="undecodable") == 1
    assert sample(after, "trainguard_rejected_inputs_total", reason="stale_generation") == 1
    assert sample(after, "trainguard_events_folded_total", type="lifecycle") == 7
    assert sample(after, "trainguard_events_folded_total", type="checkpoint") == 2
    assert sample(after, "trainguard_ready") == 1
    [events] = [t for t in DEFAULT_TOPICS if t.name == "events"]
    assert sample(after, "trainguard_partitions_assigned") == events.partitions
    lags = [v for (name, _), v in after.items() if name == "trainguard_consumer_lag_records"]
    assert lags
    assert all(v >= 0 for v in lags)


async def test_ticks_written_are_counted(sqlite_bus: BusFactory) -> None:
    config = daemon_config(
        sqlite_bus, heartbeat_timeout_s=1.0, heartbeat_interval_s=0.25, bus_gap_s=0.75
    )
    service = DaemonService(config)
    async with serving(service) as server, sqlite_bus.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, started(0), started(1), beat(0, 1, 3), beat(1, 1, 3))
        async with running(service):
            await eventually(lambda: latest_restore(bus))

            async def counted() -> dict[Any, float] | None:
                samples = await scrape(server)
                ticks = sample(samples, "trainguard_ticks_written_total") or 0
                return samples if ticks >= 1 else None

            samples = await eventually(counted)
    latency = sample(samples, "trainguard_detection_latency_seconds_sum", cause="heartbeat_timeout")
    assert latency is not None
    assert latency > 1.0  # at least the heartbeat timeout
