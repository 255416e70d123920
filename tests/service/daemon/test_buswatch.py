""":class:`BusWatch` on the embedded bus, its probe made to go unanswered or fail: connected and
last-contact gauges, outage log lines once each, ticks held until the backlog is folded, lag
from each probe; and the service's readiness reasons that come from it."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import structlog

from tests.support.buses import BusFactory
from tests.support.held_daemons import Stalls
from tests.support.outage import written_busily
from tests.support.service_support import JobEvents, daemon_config, eventually, publish, running
from trainguard.agent.bus import DEFAULT_TOPICS, Bus, BusUnavailable, TopicPartition
from trainguard.daemon import DaemonService
from trainguard.daemon.service._bus_watch import BusWatch
from trainguard.daemon.service._metrics import DaemonMetrics

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

TIMEOUT_S = 1.0
"""Probe timeout: long enough that a probe of the embedded bus on a loaded machine is answered."""


class Cut:
    """A started bus whose probe can be made to go unanswered, as with a broker stopped by
    SIGSTOP, or to fail, as with a broker that refuses connections."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.mode = "up"  # "up", "silent" or "failing"
        self._back = asyncio.Event()

    def cut(self, mode: str) -> None:
        self.mode = mode
        self._back.clear()

    def restore(self) -> None:
        self.mode = "up"
        self._back.set()

    async def probe(self, topic: str, timeout_s: float) -> dict[TopicPartition, int]:
        if self.mode == "silent":
            await self._back.wait()
        if self.mode == "failing":
            raise BusUnavailable("Kafka at 127.0.0.1:9: connection refused")
        return await self.bus.probe(topic, timeout_s)


def value(metrics: DaemonMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


@asynccontextmanager
async def watching(
    tmp_path: Path, positions: dict[int, int], clock: Callable[[], float] = time.monotonic
) -> AsyncIterator[tuple[BusWatch, Cut, DaemonMetrics, Bus]]:
    factory = BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "t.")
    metrics = DaemonMetrics()
    watch = BusWatch(
        metrics, lambda: dict(positions), interval_s=0.02, timeout_s=TIMEOUT_S, clock=clock
    )
    async with factory.open(topics=DEFAULT_TOPICS) as bus:
        cut = Cut(bus)
        watch.start(cast(Bus, cut))
        try:
            yield watch, cut, metrics, bus
        finally:
            cut.restore()
            await watch.close()


async def until(condition: Callable[[], bool]) -> None:
    """Wait (at most 30 s) until ``condition()`` holds."""

    async def check() -> bool:
        return condition()

    await eventually(check)


def events_of(logs: list[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == name]


async def test_a_broker_flapping_as_it_comes_back_is_one_outage(tmp_path: Path) -> None:
    """A probe failing right after an outage ended (a broker answering once, then not, while
    it comes back) resumes that outage: readiness follows it, the count and the alert do not;
    a failure once the flap window (``2 * (interval_s + timeout_s)``, 2.04 s here) has passed
    is a new outage. The watch's clock is shifted forward to pass the window without waiting."""
    shift = [0.0]
    with structlog.testing.capture_logs() as logs:
        async with watching(tmp_path, {0: 0}, lambda: time.monotonic() + shift[0]) as (
            watch,
            cut,
            metrics,
            _,
        ):
            cut.cut("failing")
            await until(lambda: not watch.connected)
            cut.restore()
            await until(lambda: watch.connected)
            cut.cut("failing")  # at once: within the window
            await until(lambda: not watch.connected)
            assert watch.outage_reason() is not None
            assert value(metrics, "trainguard_bus_connected") == 0
            assert value(metrics, "trainguard_bus_outages_total") == 1
            assert len(events_of(logs, "bus outage resumed")) == 1
            cut.restore()
            await until(lambda: watch.connected)
            shift[0] += 10.0  # past the window
            cut.cut("failing")
            await until(lambda: not watch.connected)
            assert value(metrics, "trainguard_bus_outages_total") == 2
    assert len(events_of(logs, "bus outage started")) == 2
    assert len(events_of(logs, "bus outage resumed")) == 1


@pytest.mark.parametrize("mode", ["silent", "failing"])
async def test_an_outage_is_reported_once_and_ticks_wait_for_the_backlog(
    tmp_path: Path, mode: str
) -> None:
    positions = {0: 0, 1: 0}
    with structlog.testing.capture_logs() as logs:
        async with watching(tmp_path, positions) as (watch, cut, metrics, bus):
            for _ in range(3):
                await bus.publish("events", "a-job", b"{}")
            [p] = [tp.partition for tp, end in (await bus.end_offsets("events")).items() if end]
            positions[p] = 3

            async def probed() -> bool:
                return value(metrics, "trainguard_consumer_lag_records", partition=str(p)) == 0

            await eventually(probed)
            assert watch.connected
            assert not watch.holding()
            assert value(metrics, "trainguard_bus_connected") == 1
            assert watch.outage_reason() is None

            cut.cut(mode)
            await until(lambda: not watch.connected)
            assert value(metrics, "trainguard_bus_connected") == 0
            assert watch.holding()
            first = value(metrics, "trainguard_bus_last_contact_seconds")
            assert first is not None

            async def grown() -> bool:
                age = value(metrics, "trainguard_bus_last_contact_seconds")
                return age is not None and age >= first + 0.5

            await eventually(grown)
            reason = watch.outage_reason()
            assert reason is not None
            assert reason.startswith("cannot reach the bus for ")
            # Many probes went unanswered: still one outage.
            assert value(metrics, "trainguard_bus_outages_total") == 1
            # The lag is unknown meanwhile: it keeps its last value.
            assert value(metrics, "trainguard_consumer_lag_records", partition=str(p)) == 0
            for _ in range(4):  # appended while the daemon could not see the bus
                await bus.publish("events", "a-job", b"{}")

            cut.restore()
            await until(lambda: watch.connected)
            assert value(metrics, "trainguard_bus_connected") == 1
            assert value(metrics, "trainguard_consumer_lag_records", partition=str(p)) == 4
            assert watch.outage_reason() is None
            assert watch.holding(), "ticks wait until the records of the outage are folded"
            positions[p] = 7
            assert not watch.holding()
            assert not watch.holding()
    [started] = events_of(logs, "bus outage started")
    assert started["log_level"] == "error"
    assert started["error"] == (
        f"no answer to a probe within {TIMEOUT_S:g} s"
        if mode == "silent"
        else "BusUnavailable: Kafka at 127.0.0.1:9: connection refused"
    )
    [ended] = events_of(logs, "bus outage ended")
    assert ended["log_level"] == "warning"
    assert ended["duration_s"] >= 0.5
    [caught_up] = events_of(logs, "caught up after outage")
    assert caught_up["records"] == 4


async def test_lag_over_the_limit_is_a_reason_not_to_be_ready(tmp_path: Path) -> None:
    positions = {0: 0}
    async with watching(tmp_path, positions) as (watch, _, metrics, bus):
        for _ in range(5):
            await bus.publish("events", "a-job", b"{}")
        [p] = [tp.partition for tp, end in (await bus.end_offsets("events")).items() if end]
        positions.clear()
        positions[p] = 1

        async def lagging() -> bool:
            return value(metrics, "trainguard_consumer_lag_records", partition=str(p)) == 4

        await eventually(lagging)
        assert watch.lag_reason(3) == "behind by 4 records (max_lag_records 3)"
        assert watch.lag_reason(4) is None


async def test_a_bus_file_held_locked_is_an_outage_and_busy_writers_are_not(
    tmp_path: Path,
) -> None:
    """Reads of the embedded bus's WAL file never wait for its write lock: the old probe (the
    end offsets alone) answered while another process held the lock and nothing could be
    written (``/healthz`` ready, no alert). Writers that keep taking the lock and committing
    are contention, not an outage."""
    path = tmp_path / "bus.db"
    factory = BusFactory("sqlite", f"sqlite://{path}", "t.")
    config = dataclasses.replace(
        daemon_config(factory), probe_interval_s=0.05, probe_timeout_s=TIMEOUT_S
    )
    service = DaemonService(config)
    with structlog.testing.capture_logs() as logs:
        async with running(service):
            await asyncio.wait_for(service.ready.wait(), 60)
            await until(lambda: service.not_ready_reason() is None)
            with written_busily(path):
                busy_until = time.monotonic() + 4 * TIMEOUT_S
                while time.monotonic() < busy_until:
                    assert service.not_ready_reason() is None
                    await asyncio.sleep(0.05)
            assert not events_of(logs, "bus outage started")

            locker = sqlite3.connect(path, isolation_level=None)
            locker.execute("BEGIN EXCLUSIVE")
            try:
                await until(lambda: not service._watch.connected)
                assert (service.not_ready_reason() or "").startswith("cannot reach the bus")
            finally:
                locker.execute("ROLLBACK")
                locker.close()
            await until(lambda: service.not_ready_reason() is None)
    [started] = events_of(logs, "bus outage started")
    assert "the bus file stayed locked by another process" in started["error"]
    assert events_of(logs, "bus outage ended")


async def test_a_daemon_too_far_behind_is_not_ready_until_it_catches_up(
    bus_factory: BusFactory,
) -> None:
    job = JobEvents("lag-job")
    config = dataclasses.replace(daemon_config(bus_factory), max_lag_records=3)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, job.started(0), job.started(1))
        service = Stalls(config)
        async with running(service):
            await asyncio.wait_for(service.ready.wait(), 60)
            await until(lambda: service.not_ready_reason() is None)
            service.stall = True
            await publish(bus, *(job.beat(0, seq, seq) for seq in range(1, 11)))

            async def behind() -> str | None:
                reason = service.not_ready_reason()
                return reason if reason is not None and reason.startswith("behind") else None

            reason = await eventually(behind, 60)
            assert reason.endswith("records (max_lag_records 3)")
            assert int(reason.split()[2]) >= 9
            assert service.metrics.registry.get_sample_value("trainguard_ready") == 0
            lag = _lag(service.metrics)
            assert sum(lag.values()) >= 9

            service.go.set()
            service.stall = False

            async def caught_up() -> bool:
                return (
                    service.not_ready_reason() is None and sum(_lag(service.metrics).values()) == 0
                )

            await eventually(caught_up, 60)
            assert service.metrics.registry.get_sample_value("trainguard_ready") == 1


def _lag(metrics: DaemonMetrics) -> Mapping[str, float]:
    return {
        sample.labels["partition"]: sample.value
        for family in metrics.registry.collect()
        if family.name == "trainguard_consumer_lag_records"
        for sample in family.samples
    }


async def test_reaching_the_bus_is_told_before_the_first_probe(tmp_path: Path) -> None:
    """The service tells the watch while it reaches the bus (issue 13, T7: a daemon started
    during a broker pause said ``no partition of events assigned``): ``connecting to the bus``
    for ``timeout_s``, then ``cannot reach the bus for N s`` (N counted from the first attempt
    when the bus never answered), at once after a failed attempt, which is an outage like an
    unanswered probe (counted and logged once); connecting ends it."""
    now = [100.0]
    metrics = DaemonMetrics()
    watch = BusWatch(metrics, dict, interval_s=0.02, timeout_s=TIMEOUT_S, clock=lambda: now[0])
    assert watch.outage_reason() is None  # not serving yet (a standby waiting for its lock)
    with structlog.testing.capture_logs() as logs:
        watch.connecting()
        assert watch.outage_reason() == "connecting to the bus"
        assert value(metrics, "trainguard_bus_connected") == 0
        now[0] += TIMEOUT_S
        assert watch.outage_reason() == "cannot reach the bus for 1 s"
        now[0] += 2.0
        watch.unreachable("BusUnavailable: Kafka at 127.0.0.1:9: connecting failed")
        watch.connecting()  # the next attempt: the outage goes on
        watch.unreachable("BusUnavailable: Kafka at 127.0.0.1:9: connecting failed")
        assert watch.outage_reason() == "cannot reach the bus for 3 s"
        assert value(metrics, "trainguard_bus_connected") == 0
        assert value(metrics, "trainguard_bus_outages_total") == 1
        assert value(metrics, "trainguard_bus_last_contact_seconds") == 3.0
        now[0] += 4.0
        factory = BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "t.")
        async with factory.open(topics=DEFAULT_TOPICS) as bus:
            watch.start(bus)
            try:
                assert watch.connected
                assert watch.outage_reason() is None
                assert value(metrics, "trainguard_bus_connected") == 1
            finally:
                await watch.close()
    [started] = events_of(logs, "bus outage started")
    assert started["probe"] == "reaching the bus"
    assert started["error"].startswith("BusUnavailable")
    [ended] = events_of(logs, "bus outage ended")
    assert ended["duration_s"] == 7.0  # from the first attempt: the bus never answered before
