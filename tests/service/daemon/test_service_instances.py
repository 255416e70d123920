"""Several daemon instances in one group: one owner per partition, exactly-once decisions, and
an owner that was paused past the session timeout is fenced when it comes back (it cannot
write anything, and it notices that it lost its partitions). Checked on ``commands`` (read
committed) and on ``audit``: one restore per (job, generation)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from tests.support.buses import BusFactory
from tests.support.held_daemons import Pausable
from tests.support.service_support import JobEvents, assert_once_each, eventually, read_all
from trainguard.agent.bus import (
    DEFAULT_TOPICS,
    Bus,
    BusConfig,
    Consumer,
    Record,
    TopicPartition,
    open_bus,
)
from trainguard.agent.bus._partitioner import partition_for
from trainguard.agent.bus._sqlite import SQLiteBus
from trainguard.daemon import DaemonService, MachineConfig
from trainguard.daemon.service._settings import DaemonConfig
from trainguard.schemas import Event, Restore, decode, encode

pytestmark = [pytest.mark.anyio]

OWNER_SCRIPT = Path(__file__).with_name("_owner_process.py")
SESSION_S = 6.0
"""Kafka's smallest session timeout (group.min.session.timeout.ms): the pause outlasts it."""


def machine(daemon_id: str) -> MachineConfig:
    """The jobs send nothing after their set-up: only their kills may start incidents, and
    no restore is retried."""
    return MachineConfig(daemon_id=daemon_id, restore_timeout_s=600.0, heartbeat_timeout_s=600.0)


async def publish(bus: Bus, *events: Event) -> None:
    for event in events:
        await bus.publish("events", event.job_id, encode(event))


async def set_up(bus: Bus, *jobs: str) -> None:
    """Each job: both ranks started and a checkpoint at step 5 committed."""
    for job in jobs:
        e = JobEvents(job)
        await publish(bus, e.started(0), e.started(1), e.shard(0, 1, 5), e.shard(1, 1, 5))


async def restores(bus: Bus) -> list[Restore]:
    return [c for c in map(decode, await read_all(bus, "commands")) if isinstance(c, Restore)]


async def restored(bus: Bus, job: str) -> bool:
    return any(r.job_id == job for r in await restores(bus))


@contextlib.asynccontextmanager
async def _no_daemon_lock(*args: object, **kwargs: object) -> AsyncIterator[bool]:
    yield True


async def test_an_owner_back_from_a_pause_to_the_same_partitions_decides_nothing_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Embedded bus, in one process: owner A is held past its lease right after it decided a
    restore (not committed); B takes over, decides that restore and a second job's, and
    leaves. A comes back to the very same partitions (its assignment never looks different):
    its commit is refused, it notices the new assignment epoch, drops the poll and rebuilds,
    so it decides nothing again (the old loop restored the second job a second time).

    The daemon lock (one daemon per bus file) would keep B out: it is lifted here to check the
    layer beneath it, which holds where the lock does not (a file system without working
    ``flock``)."""
    monkeypatch.setattr("trainguard.daemon.service._daemon.serving_lock", _no_daemon_lock)
    factory = BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "t.")
    config = DaemonConfig(
        # held means not polling: its lease ends a session after the keeper stops renewing
        bus=factory.config(topics=DEFAULT_TOPICS, session_timeout_s=1.0, max_poll_interval_s=1.0),
        machine=machine("test-daemon"),
        group_id=factory.group("daemon"),
        poll_s=0.02,
    )
    jobs = ("job-a", "job-b")
    async with factory.open(topics=DEFAULT_TOPICS) as bus:
        await set_up(bus, *jobs)
        a = Pausable(config)
        a.held = asyncio.Event()
        stop_a = asyncio.Event()
        task_a = asyncio.ensure_future(a.run(stop_a))
        try:
            await eventually(lambda: _folded(a, 8))
            a.hold = resume = asyncio.Event()
            await publish(bus, JobEvents(jobs[0]).killed(0))
            await asyncio.wait_for(a.held.wait(), 30)
            b = DaemonService(config)
            stop_b = asyncio.Event()
            task_b = asyncio.ensure_future(b.run(stop_b))
            try:
                await eventually(lambda: restored(bus, jobs[0]))
                await publish(bus, JobEvents(jobs[1]).killed(0))
                await eventually(lambda: restored(bus, jobs[1]))
            finally:
                stop_b.set()
                await asyncio.wait_for(task_b, 60)
            with structlog.testing.capture_logs() as logs:
                resume.set()
                await eventually(lambda: _phase(a, jobs[1], "restoring"))
            events = [entry["event"] for entry in logs]
            assert any(e.startswith("partition lost") for e in events), events
        finally:
            stop_a.set()
            await asyncio.wait_for(task_a, 60)
        await assert_once_each(bus, jobs)


class _EpochFlip(Consumer):
    """A group consumer that, when told to, reports a new assignment epoch together with a
    poll holding one extra record (one the log does not hold: a record fetched under the old
    assignment)."""

    def __init__(self, inner: Consumer) -> None:
        self.inner = inner
        self.forged: Record | None = None
        self.flips = 0
        self.polls_since_flip = 0

    async def getmany(self, timeout_s: float = 1.0, max_records: int = 1000) -> list[Record]:
        records = await self.inner.getmany(timeout_s, max_records)
        self.polls_since_flip += 1
        if self.forged is not None:
            records, self.forged = [*records, self.forged], None
            self.flips += 1
            self.polls_since_flip = 0
        return records

    def assignment_epoch(self) -> int:
        return self.inner.assignment_epoch() + self.flips + (self.forged is not None)

    def assignment(self) -> frozenset[TopicPartition]:
        return self.inner.assignment()

    async def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        await self.inner.commit(offsets)

    async def committed(self, tp: TopicPartition) -> int | None:
        return await self.inner.committed(tp)

    async def seek(self, tp: TopicPartition, offset: int) -> None:
        await self.inner.seek(tp, offset)

    async def position(self, tp: TopicPartition) -> int:
        return await self.inner.position(tp)

    async def close(self) -> None:
        await self.inner.close()


async def test_the_loop_drops_a_poll_whose_assignment_epoch_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll that comes with a new assignment epoch is dropped whole: its records may predate
    the change (another owner may have acted on them); the resync reads the partitions again
    from their committed positions. Here the poll holds a kill the log does not: folding it
    would restore the job."""
    factory = BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "t.")
    config = DaemonConfig(
        bus=factory.config(topics=DEFAULT_TOPICS),
        machine=machine("test-daemon"),
        group_id=factory.group("daemon"),
        poll_s=0.02,
    )
    subscribe = SQLiteBus.subscribe
    wrapped: list[_EpochFlip] = []

    async def flipping(self: SQLiteBus, *args: Any, **kwargs: Any) -> Consumer:
        wrapped.append(_EpochFlip(await subscribe(self, *args, **kwargs)))
        return wrapped[-1]

    monkeypatch.setattr(SQLiteBus, "subscribe", flipping)
    job = "job-a"
    async with factory.open(topics=DEFAULT_TOPICS) as bus:
        await set_up(bus, job)
        service = DaemonService(config)
        stop = asyncio.Event()
        task = asyncio.ensure_future(service.run(stop))
        try:
            await eventually(lambda: _phase(service, job, "running"))
            [consumer] = wrapped
            kill = JobEvents(job).killed(0)
            partition = partition_for(job, await bus.partitions("events"))
            now_ms = time.time_ns() // 1_000_000
            consumer.forged = Record("events", partition, 10**6, job, encode(kill), now_ms)
            await eventually(lambda: _polled_after_flip(service, consumer))
        finally:
            stop.set()
            await asyncio.wait_for(task, 60)
        assert service.counters["commands"] == 0
        assert service.jobs[job].phase == "running"
        assert await restores(bus) == []


async def _polled_after_flip(service: DaemonService, consumer: _EpochFlip) -> bool:
    return consumer.flips == 1 and consumer.polls_since_flip >= 3 and service.ready.is_set()


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.timeout(300)
async def test_a_paused_owner_is_fenced_and_no_decision_is_made_twice(
    kafka_bootstrap: str, unique_prefix: str, tmp_path: Path
) -> None:
    """Kafka, owner A in its own process stops itself (SIGSTOP) right after sending a restore
    into its open transaction, for longer than the session timeout. B takes over: its
    writers fence A's, A's restore is never visible, B decides it and a second job's. On
    SIGCONT A's commit is refused (fenced, logged), A rejoins and shares the partitions with
    B; a third job's restore is decided once by whichever owns it."""
    url = f"kafka://{kafka_bootstrap}"
    group = f"{unique_prefix}daemon"
    bus_config = BusConfig(
        url=url,
        prefix=unique_prefix,
        topics=DEFAULT_TOPICS,
        session_timeout_s=SESSION_S,
        connect_timeout_s=30.0,
        send_timeout_s=30.0,
    )
    config = DaemonConfig(
        bus=bus_config,
        machine=machine("standby"),
        group_id=group,
        poll_s=0.02,
    )
    jobs = ("job-a", "job-b", "job-c")
    flag = tmp_path / "stop-now"
    log_path = tmp_path / "owner.log"
    async with open_bus(bus_config) as bus:
        await set_up(bus, *jobs)
        with log_path.open("wb") as log_file:
            owner = await asyncio.create_subprocess_exec(
                sys.executable,
                *(str(OWNER_SCRIPT), url, unique_prefix, group, str(SESSION_S), str(flag)),
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        try:
            # A has folded the set-up (its committed positions reached the end offsets).
            await eventually(lambda: _consumed(bus, group), 90)
            flag.touch()
            await publish(bus, JobEvents(jobs[0]).killed(0))
            await eventually(lambda: _stopped(owner), 60)
            standby = DaemonService(config)
            stop = asyncio.Event()
            task = asyncio.ensure_future(standby.run(stop))
            try:
                await eventually(lambda: restored(bus, jobs[0]), 90)
                await publish(bus, JobEvents(jobs[1]).killed(0))
                await eventually(lambda: restored(bus, jobs[1]), 60)
                owner.send_signal(signal.SIGCONT)
                await eventually(lambda: _logged(log_path, "partition lost"), 60)
                # A rejoined: the group shares the partitions between A and B again.
                await eventually(lambda: _split(standby), 90)
                await publish(bus, JobEvents(jobs[2]).killed(0))
                await eventually(lambda: restored(bus, jobs[2]), 60)
            finally:
                stop.set()
                await asyncio.wait_for(task, 60)
        finally:
            owner.send_signal(signal.SIGCONT)
            owner.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(owner.wait(), 60)
            except TimeoutError:
                owner.kill()
                await asyncio.wait_for(owner.wait(), 10)
        assert await _latest_restores_not_from(bus, "paused", jobs[:2])
        await assert_once_each(bus, jobs)


async def _folded(service: DaemonService, n: int) -> bool:
    return service.ready.is_set() and service.counters["folded"] >= n


async def _phase(service: DaemonService, job: str, phase: str) -> bool:
    return service.ready.is_set() and job in service.jobs and service.jobs[job].phase == phase


async def _consumed(bus: Bus, group: str) -> bool:
    ends = {tp: end for tp, end in (await bus.end_offsets("events")).items() if end > 0}
    positions = await bus.group_positions(group, "events")
    return all(positions.get(tp, 0) >= end for tp, end in ends.items())


async def _stopped(process: asyncio.subprocess.Process) -> bool:
    return _state(process.pid) == "T"


def _state(pid: int) -> str:
    """The process's state letter (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().split()[2]


async def _logged(path: Path, text: str) -> bool:
    return _contains(path, text)


def _contains(path: Path, text: str) -> bool:
    return text in path.read_text(errors="replace")


async def _split(service: DaemonService) -> bool:
    return service.ready.is_set() and 0 < len(service._partitions) < 6


async def _latest_restores_not_from(bus: Bus, daemon_id: str, jobs: tuple[str, ...]) -> bool:
    """The restores of ``jobs`` were all decided by another daemon than ``daemon_id`` (the
    paused one's were never committed)."""
    return all(r.daemon_id != daemon_id for r in await restores(bus) if r.job_id in jobs)
