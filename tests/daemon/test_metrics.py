"""The daemon's /metrics and /healthz: scraped over real HTTP from a running service on the
embedded bus while a (synthetic) job dies and is restored; the metric definitions on their own."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.buses import BusFactory
from tests.daemon.service_support import CURSOR, eventually, running
from tests.daemon.test_service import (
    JOB,
    beat,
    daemon_config,
    killed,
    publish,
    shard,
    started,
)
from tests.http_get import http_get
from trainguard.agent.bus import DEFAULT_TOPICS, Bus
from trainguard.daemon import DaemonService, IncidentOpened, Observed, Tick, decide, new_job
from trainguard.daemon.service._http import HealthServer
from trainguard.daemon.service._metrics import (
    DaemonMetrics,
    detection_latency_s,
    schema_error_class,
)
from trainguard.daemon.service._settings import load_daemon_config
from trainguard.schemas import (
    Event,
    Lifecycle,
    MessageTooLarge,
    NotJSON,
    Restore,
    SchemaViolation,
    UnexpectedMessage,
    decode,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture
def sqlite_bus(tmp_path: Path) -> BusFactory:
    return BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "t.")


async def scrape(server: HealthServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    status, text = await asyncio.to_thread(http_get, f"{server.url}/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict[Any, float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@asynccontextmanager
async def serving(service: DaemonService) -> AsyncIterator[HealthServer]:
    server = HealthServer(service.metrics, service.not_ready_reason, host="127.0.0.1", port=0)
    server.start()
    try:
        yield server
    finally:
        await asyncio.to_thread(server.close)


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


def test_detection_latency_is_the_detectors_measure_or_the_silence_before_the_evidence() -> None:
    config = load_daemon_config(None).machine
    state = new_job(JOB)
    t0 = time.time_ns()  # the events carry the sender clock of now
    events: list[Event] = [started(0), started(1), beat(0, 1, 5), beat(1, 1, 5)]
    for i, event in enumerate(events):
        state, _ = decide(state, Observed(t0 + i * 10**8, i, event), config)
    kill_at = t0 + 3 * 10**9
    after, decisions = decide(state, Observed(kill_at, 9, killed(1)), config)
    [opened] = [d for d in decisions if isinstance(d, IncidentOpened)]
    # Rank 1 was last heard at t0 + 0.3 s, the supervisor reported its death at t0 + 3 s.
    assert detection_latency_s(state, opened, after.clock_ns) == pytest.approx(2.7)

    silent_at = t0 + 11 * 10**9  # beyond the 10 s heartbeat timeout
    for at in range(t0 + 10**9, silent_at, 10**9):  # the daemon's pulse: the job is quiet
        state, _ = decide(state, Tick(at), config)
    after, decisions = decide(state, Tick(silent_at), config)
    [opened] = [d for d in decisions if isinstance(d, IncidentOpened)]
    assert opened.cause == "heartbeat_timeout"
    assert detection_latency_s(state, opened, after.clock_ns) == opened.measures["silent_s"]


def test_decoding_errors_map_to_a_bounded_set_of_classes() -> None:
    assert schema_error_class(MessageTooLarge(None, "x")) == "oversized"
    assert schema_error_class(NotJSON(None, "x")) == "undecodable"
    assert schema_error_class(UnexpectedMessage("schema", "x")) == "unexpected_type"
    assert schema_error_class(SchemaViolation("step", "x")) == "schema_violation"


def test_revoked_partitions_leave_the_lag_gauge_and_registries_are_separate() -> None:
    first, second = DaemonMetrics(), DaemonMetrics()
    first.observe_lag({0: 5, 1: 0})
    first.observe_assignment(2, [new_job("a")])
    first.observe_lag({1: 2})
    first.observe_assignment(1, [])
    first.follow_readiness(lambda: "rebuilding")
    values = {
        (s.name, tuple(s.labels.items())): s.value
        for family in first.registry.collect()
        for s in family.samples
    }
    assert values[("trainguard_consumer_lag_records", (("partition", "1"),))] == 2
    assert ("trainguard_consumer_lag_records", (("partition", "0"),)) not in values
    assert values[("trainguard_jobs", (("phase", "starting"),))] == 0
    assert values[("trainguard_partitions_assigned", ())] == 1
    assert values[("trainguard_ready", ())] == 0
    assert second.registry.get_sample_value("trainguard_ready") == 0
    assert (
        second.registry.get_sample_value("trainguard_consumer_lag_records", {"partition": "1"})
        is None
    )


def test_the_metrics_port_is_checked() -> None:
    with pytest.raises(ValueError, match="metrics_port"):
        dataclasses.replace(load_daemon_config(None), metrics_port=70000)
    assert load_daemon_config(None, metrics_port=0).metrics_port == 0
