"""One daemon per embedded bus file (``agent/bus/_sqlite_lock.py``): a second daemon is refused
before it reads or writes anything, a standby waits for the lock and takes over when the holder
dies, and a paused holder keeps the lock, so there are never two deciders."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pytest
import structlog.testing

from tests.support.buses import BusFactory
from tests.support.service_support import JobEvents, acknowledgements, eventually, read_all, running
from trainguard.agent.bus import DEFAULT_TOPICS, Bus
from trainguard.agent.bus._sqlite_lock import DaemonLock, DaemonLockHeld, daemon_lock_path
from trainguard.daemon import DaemonService, MachineConfig
from trainguard.daemon.demo._harness import start_daemon, stop_process
from trainguard.daemon.service._settings import DaemonConfig
from trainguard.schemas import Event, Restore, Resume, decode, encode

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]
JOB = "lock-job"
EVENTS = JobEvents(JOB)
SESSION_TIMEOUT_S = 2.0
_T = TypeVar("_T")


def daemon_config(factory: BusFactory, group: str = "daemon") -> DaemonConfig:
    return DaemonConfig(
        bus=factory.config(topics=DEFAULT_TOPICS),
        machine=MachineConfig(daemon_id=f"test-{group}"),
        group_id=factory.group(group),
        poll_s=0.02,
        metrics_port=-1,
    )


@pytest.fixture
def sqlite_bus(tmp_path: Path) -> BusFactory:
    return BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "t.")


# -- in-process -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_daemon_refused_by_the_lock_opens_no_bus(sqlite_bus: BusFactory) -> None:
    """The lock is taken before the bus is opened: the refused daemon creates no file."""
    holder = DaemonLock.take(bus_file(sqlite_bus))
    try:
        with pytest.raises(DaemonLockHeld) as refused:
            await DaemonService(daemon_config(sqlite_bus)).run(asyncio.Event())
    finally:
        holder.release()
    assert f"pid {os.getpid()} since " in str(refused.value)
    assert "one daemon per embedded bus; use Kafka for several" in str(refused.value)
    assert not bus_created(sqlite_bus)


@pytest.mark.anyio
async def test_every_group_and_prefix_of_one_file_shares_the_lock(
    sqlite_bus: BusFactory,
) -> None:
    other_prefix = BusFactory("sqlite", sqlite_bus.url, "u.")
    async with running(DaemonService(daemon_config(sqlite_bus))) as first:
        await asyncio.wait_for(first.ready.wait(), 30)
        for config in (daemon_config(sqlite_bus, "other"), daemon_config(other_prefix)):
            with pytest.raises(DaemonLockHeld, match=f"pid {os.getpid()} since "):
                await DaemonService(config).run(asyncio.Event())


@pytest.mark.anyio
async def test_a_standby_serves_once_the_holder_stops_and_not_before(
    sqlite_bus: BusFactory,
) -> None:
    async with sqlite_bus.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, EVENTS.started(0), EVENTS.started(1))
    standby = DaemonService(daemon_config(sqlite_bus))
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        async with running(DaemonService(daemon_config(sqlite_bus))) as holder:
            await eventually(lambda: _folded(holder, 2))
            task = asyncio.ensure_future(standby.run(stop, standby=True))
            await eventually(lambda: _logged_in(logs, "standby: another daemon serves"))
            async with sqlite_bus.open(topics=DEFAULT_TOPICS) as bus:
                await publish(bus, EVENTS.beat(0, 1, 1), EVENTS.beat(1, 1, 1))
                partitions = await bus.partitions("events")
            await eventually(lambda: _folded(holder, 4))
            # A second member of the group would have taken half of the partitions by now.
            assert set(holder._partitions) == set(range(partitions))
            assert not task.done()
            assert standby.counters["folded"] == 0
            assert standby.not_ready_reason() is not None
        await asyncio.wait_for(standby.ready.wait(), 30)
        await eventually(lambda: _folded(standby, 2))
        assert standby.jobs[JOB].phase == "running"
        stop.set()
        await asyncio.wait_for(task, 60)
    assert await _logged_in(logs, "standby: took over the embedded bus")


@pytest.mark.anyio
async def test_a_standby_stopped_while_waiting_returns_without_serving(
    sqlite_bus: BusFactory,
) -> None:
    holder = DaemonLock.take(bus_file(sqlite_bus))
    try:
        stop = asyncio.Event()
        standby = DaemonService(daemon_config(sqlite_bus))
        with structlog.testing.capture_logs() as logs:
            task = asyncio.ensure_future(standby.run(stop, standby=True))
            await eventually(lambda: _logged_in(logs, "standby: another daemon serves"))
            stop.set()
            await asyncio.wait_for(task, 30)
    finally:
        holder.release()
    assert standby.counters["folded"] == 0
    assert not bus_created(sqlite_bus)


async def _folded(service: DaemonService, n: int) -> bool:
    return service.counters["folded"] >= n


async def _logged_in(logs: list[MutableMapping[str, Any]], prefix: str) -> bool:
    return any(str(entry.get("event", "")).startswith(prefix) for entry in logs)


# -- real daemon processes --------------------------------------------------------------------

WAITING = "standby: another daemon serves this embedded bus"
TOOK_OVER = "standby: took over the embedded bus"


@pytest.mark.slow
def test_a_second_daemon_exits_2_naming_the_first(daemons: Daemons) -> None:
    first = daemons.start()
    wait_logged(daemons.log(first), "daemon ready")
    second = subprocess.run(
        [
            *CLI,
            "daemon",
            "--bus",
            daemons.bus.url,
            "--topic-prefix",
            daemons.bus.prefix,
            "--config",
            str(daemons.config),
            "--metrics-port",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 2, second.stderr
    assert f"pid {first.pid} since " in second.stderr
    assert "one daemon per embedded bus; use Kafka for several" in second.stderr
    assert "daemon started" not in second.stdout + second.stderr


@pytest.mark.slow
def test_a_standby_takes_over_from_a_killed_holder_and_decides_once(daemons: Daemons) -> None:
    """The holder restores a killed rank and is SIGKILLed; the standby takes over, rebuilds,
    does not restore again, and resumes the job when the ranks acknowledge."""
    holder = daemons.start()
    wait_logged(daemons.log(holder), "daemon ready")
    standby = daemons.start("--standby")
    wait_logged(daemons.log(standby), WAITING)
    asyncio.run(publish_on(daemons.bus, *incident()))
    [restore] = asyncio.run(wait_commands(daemons.bus, Restore))
    stop_process(holder, signal.SIGKILL)
    wait_logged(daemons.log(standby), TOOK_OVER)
    asyncio.run(publish_on(daemons.bus, *acknowledgements(restore)))
    asyncio.run(wait_commands(daemons.bus, Resume))
    commands = asyncio.run(all_commands(daemons.bus))
    assert [type(c) for c in commands] == [Restore, Resume]
    assert commands[0].daemon_id == f"{socket.gethostname()}-{holder.pid}"
    assert commands[1].daemon_id == f"{socket.gethostname()}-{standby.pid}"


@pytest.mark.slow
def test_a_paused_holder_keeps_the_lock_and_decides_when_it_resumes(daemons: Daemons) -> None:
    """SIGSTOP of the holder for longer than its consumer-group lease: the standby stays out
    (a second daemon of the group owns the partitions one poll after the lease ran out, and
    restores); after SIGCONT the holder decides the incident, once."""
    holder = daemons.start()
    wait_logged(daemons.log(holder), "daemon ready")
    standby = daemons.start("--standby")
    wait_logged(daemons.log(standby), WAITING)
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        asyncio.run(publish_on(daemons.bus, *incident()))
        wait_lease_expired(daemons.bus, holder.pid)
        # A negative claim needs a window: 2 s after the lease ran out is 40 polls of a second
        # daemon of the group and 20 lock tries of the standby.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert not asyncio.run(all_commands(daemons.bus))
            time.sleep(0.1)
        assert standby.poll() is None
        assert not logged(daemons.log(standby), TOOK_OVER)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    [restore] = asyncio.run(wait_commands(daemons.bus, Restore))
    assert restore.daemon_id == f"{socket.gethostname()}-{holder.pid}"
    assert not logged(daemons.log(standby), TOOK_OVER)
    assert orjson.loads(daemon_lock_path(bus_file(daemons.bus)).read_bytes())["pid"] == holder.pid


# -- helpers ----------------------------------------------------------------------------------


class Daemons:
    """``trainguard daemon`` processes on one embedded bus, with a short consumer-group lease
    (:data:`SESSION_TIMEOUT_S`); :meth:`close` SIGKILLs every one still running."""

    def __init__(self, bus: BusFactory, folder: Path) -> None:
        self.bus = bus
        self.folder = folder
        self.config = folder / "daemon.toml"
        self.config.write_text(f"[bus]\nsession_timeout_s = {SESSION_TIMEOUT_S}\n")
        self._logs: dict[int, Path] = {}
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        """Start one with ``args`` added (its log: :meth:`log`)."""
        log = self.folder / f"daemon-{len(self._procs) + 1}.log"
        proc = start_daemon(
            self.bus.url,
            prefix=self.bus.prefix,
            log_path=log,
            args=["--config", str(self.config), *args],
        )
        self._procs.append(proc)
        self._logs[proc.pid] = log
        return proc

    def log(self, proc: subprocess.Popen[bytes]) -> Path:
        """The JSON log of ``proc``."""
        return self._logs[proc.pid]

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # a paused one could not die of SIGKILL later
                stop_process(proc, signal.SIGKILL)


@pytest.fixture
def daemons(sqlite_bus: BusFactory, tmp_path: Path) -> Iterator[Daemons]:
    started = Daemons(sqlite_bus, tmp_path)
    try:
        yield started
    finally:
        started.close()


def bus_file(factory: BusFactory) -> str:
    return factory.url.removeprefix("sqlite://")


def logged(log: Path, prefix: str) -> bool:
    """Whether the JSON log has a line whose event starts with ``prefix``."""
    for line in log.read_bytes().splitlines():
        try:
            if str(orjson.loads(line).get("event", "")).startswith(prefix):
                return True
        except orjson.JSONDecodeError:
            continue
    return False


def wait_logged(log: Path, prefix: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not logged(log, prefix):
        assert time.monotonic() < deadline, f"{prefix!r} not logged in {log} within {timeout_s} s"
        time.sleep(0.05)


def wait_lease_expired(factory: BusFactory, pid: int, timeout_s: float = 60.0) -> None:
    """Until the consumer-group lease of the daemon process ``pid`` has run out."""
    deadline = time.monotonic() + timeout_s
    with contextlib.closing(sqlite3.connect(f"file:{bus_file(factory)}?mode=ro", uri=True)) as db:
        db.execute("PRAGMA busy_timeout = 5000")
        while True:
            [(latest,)] = db.execute(
                "SELECT max(expires_ms) FROM group_members WHERE group_id = ? AND member_id LIKE ?",
                (f"{factory.prefix}daemon", f"%-{pid}-%"),
            ).fetchall()
            if latest is not None and latest < time.time() * 1000:
                return
            assert time.monotonic() < deadline, f"the lease of pid {pid} did not run out"
            time.sleep(0.05)


async def publish(bus: Bus, *events: Event) -> None:
    for event in events:
        await bus.publish("events", event.job_id, encode(event))


async def publish_on(factory: BusFactory, *events: Event) -> None:
    async with factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, *events)


def incident() -> tuple[Event, ...]:
    """A 2-rank job with a committed step 5 whose rank 1 is then killed."""
    return (
        EVENTS.started(0),
        EVENTS.started(1),
        EVENTS.shard(0, 1, 5),
        EVENTS.shard(1, 1, 5),
        EVENTS.killed(1),
    )


async def all_commands(factory: BusFactory) -> list[Any]:
    async with factory.open(topics=DEFAULT_TOPICS) as bus:
        return [decode(v) for v in await read_all(bus, "commands")]


async def wait_commands(factory: BusFactory, kind: type[_T]) -> list[_T]:
    """The commands of type ``kind``, once there is one."""

    async def found() -> list[_T]:
        return [c for c in await all_commands(factory) if isinstance(c, kind)]

    result: list[_T] = await eventually(found, 60.0)
    return result


def bus_created(factory: BusFactory) -> bool:
    """Whether the bus file exists (a refused daemon creates none)."""
    return Path(bus_file(factory)).exists()
