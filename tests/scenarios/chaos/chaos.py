"""Chaos helpers: a Kafka broker of the test module's own that can be paused and restarted, the
workers of a running job found by their environment, checkpoints seen on disk, and a poller
of a daemon's ``/healthz``.

The broker is started by ``deploy/kafka/kafka-dev`` in a run folder of its own, so pausing it
(SIGSTOP of the JVM whose pid ``kafka-dev`` writes to ``kafka.pid``) or stopping it
(``kafka-dev stop``, then ``kafka-dev start`` on the same folder: same port, same data) never
touches the session broker other tests share.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
import urllib.error
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from tests.scenarios.harness import JobRun
from tests.support.buses import BusFactory
from tests.support.http_get import http_get
from tests.support.kafka_dev import (
    BROKER_START_TIMEOUT_S,
    CLUSTER_READY_TIMEOUT_S,
    KAFKA_DEV_STOP_TIMEOUT_S,
    KAFKA_DEV_TIMEOUT_S,
    kafka_dev,
    wait_for_cluster,
)
from trainguard.agent.bus import BusUnavailable
from trainguard.daemon.demo._harness import Stamped

#: Seconds every wait for a condition may take at most: it only bounds a hang (2 loaded cores).
DEADLINE_S = 120.0

#: Options of ``examples/charlm/train.py`` for a smaller model than its default: the chaos
#: tests run six or more jobs on 2 cores, and what they check does not depend on its size.
SMALL_MODEL = ("--d-model", "32", "--layers", "1", "--heads", "2")


def wait_until(what: str, condition: Callable[[], bool], timeout_s: float = DEADLINE_S) -> None:
    """Poll ``condition`` every 0.1 s until it holds.

    Raises:
        AssertionError: it did not hold within ``timeout_s`` seconds; names ``what``.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.1)


def wait_on_bus(
    run: JobRun, what: str, match: Callable[[Any], bool], timeout_s: float = DEADLINE_S
) -> Stamped:
    """:meth:`JobRun.wait_for`, opened again while the bus is unavailable: a broker that has
    just come back can refuse a new client's first requests (``NodeNotReadyError``) for a
    moment after it answers ``describe_cluster``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return run.wait_for(what, match, max(1.0, deadline - time.monotonic()))
        except BusUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


async def _find_coordinators(bootstrap: str) -> None:
    """One ``FindCoordinator`` request for a group and one for a transactional id.

    Raises:
        KafkaError, OSError, TimeoutError: not answered, or not yet available.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    try:
        async with asyncio.timeout(10):  # aiokafka can hang on a dead broker (#1101)
            await admin.start()
            await admin.find_coordinator("chaos-warmup", 0)
            await admin.find_coordinator("chaos-warmup", 1)
    finally:
        async with asyncio.timeout(10):
            await admin.close()


def wait_for_coordinators(bootstrap: str, timeout_s: float = DEADLINE_S) -> None:
    """Wait until a new broker has its group and transaction coordinators (its first
    ``FindCoordinator`` requests create ``__consumer_offsets`` and ``__transaction_state``,
    which takes seconds on a loaded machine), so that a daemon started next finds them.

    Raises:
        AssertionError: not within ``timeout_s`` seconds; names the last error.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            asyncio.run(_find_coordinators(bootstrap))
            return
        except (KafkaError, OSError, TimeoutError) as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"{bootstrap}: no coordinator: {exc!r}") from exc
        time.sleep(0.5)


@dataclass
class ChaosBroker:
    """A ``kafka-dev`` broker in ``run_dir`` that a test may pause, stop and start again.

    Attributes:
        run_dir: the broker's run folder (``kafka.log``, ``kafka.pid``, ``data/``).
        bootstrap: ``host:port``; kept across :meth:`stop` and :meth:`start` (kafka-dev
            reuses the port recorded for the folder).
    """

    run_dir: Path
    bootstrap: str
    paused: bool = field(default=False, init=False)

    def pid(self) -> int:
        """The broker JVM's pid (``kafka.pid``)."""
        return int((self.run_dir / "kafka.pid").read_text().strip())

    def pause(self) -> None:
        """SIGSTOP the broker: its sockets stay open, nothing answers (a GC or VM pause)."""
        os.kill(self.pid(), signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT the paused broker; return once it serves requests again."""
        os.kill(self.pid(), signal.SIGCONT)
        self.paused = False
        wait_for_cluster(self.bootstrap, CLUSTER_READY_TIMEOUT_S)

    def stop(self) -> None:
        """``kafka-dev stop``: a controlled shutdown; the data folder stays.

        Raises:
            AssertionError: kafka-dev failed.
        """
        stopped = kafka_dev(
            "stop",
            "--dir",
            self.run_dir,
            "--timeout",
            str(KAFKA_DEV_STOP_TIMEOUT_S),
            timeout=KAFKA_DEV_STOP_TIMEOUT_S + 30,
        )
        assert stopped.returncode == 0, f"kafka-dev stop: {stopped.stderr}"

    def start(self) -> None:
        """``kafka-dev start`` on the same folder (same port and data), once it serves.

        Raises:
            AssertionError: it did not start, or came back on another address.
        """
        started = kafka_dev(
            "start",
            "--port",
            "0",
            "--dir",
            self.run_dir,
            "--timeout",
            str(BROKER_START_TIMEOUT_S),
            timeout=KAFKA_DEV_TIMEOUT_S,
        )
        assert started.returncode == 0, f"kafka-dev start: {started.stderr}"
        assert started.stdout.strip() == self.bootstrap, started.stdout
        wait_for_cluster(self.bootstrap, CLUSTER_READY_TIMEOUT_S)

    def ensure_running(self) -> None:
        """Undo what a failed test left: SIGCONT a paused broker, start a stopped one."""
        if self.paused:
            with contextlib.suppress(OSError, ValueError):
                self.resume()
        if kafka_dev("status", "--dir", self.run_dir, timeout=60).returncode != 0:
            self.start()


def bus_on(broker: ChaosBroker) -> BusFactory:
    """A fresh topic prefix on ``broker``."""
    return BusFactory("kafka", f"kafka://{broker.bootstrap}", f"c-{uuid.uuid4().hex[:8]}.")


def workers(job: str) -> dict[tuple[int, int], int]:
    """``(rank, generation) -> pid`` of ``job``'s workers running on this machine, found by the
    ``TRAINGUARD_JOB``, ``RANK`` and ``TRAINGUARD_GENERATION`` variables their supervisor gave
    them: the bus may be unreachable, so their ``started`` reports cannot say."""
    found: dict[tuple[int, int], int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue  # ended meanwhile, or not ours
        environ = dict(
            v.split("=", 1) for v in raw.decode(errors="replace").split("\0") if "=" in v
        )
        if environ.get("TRAINGUARD_JOB") == job and "RANK" in environ:
            try:
                key = (int(environ["RANK"]), int(environ["TRAINGUARD_GENERATION"]))
            except (KeyError, ValueError):
                continue
            found[key] = int(entry.name)
    return found


def worker_pid(job: str, rank: int, generation: int) -> int | None:
    """The pid of ``job``'s worker of ``rank`` in ``generation`` (:func:`workers`), or ``None``."""
    return workers(job).get((rank, generation))


def running_generation(job: str, world_size: int) -> int | None:
    """The newest generation of ``job`` whose workers of every rank run here, or ``None``."""
    running = workers(job)
    complete = [g for _, g in running if all((r, g) in running for r in range(world_size))]
    return max(complete, default=None)


def kill_worker(job: str, rank: int, generation: int) -> int:
    """SIGKILL ``job``'s worker of ``rank`` in ``generation``; return its pid.

    Raises:
        AssertionError: no such worker runs.
    """
    pid = worker_pid(job, rank, generation)
    assert pid is not None, f"no worker of {job} rank {rank} generation {generation} runs"
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_running_rank(job: str, rank: int, world_size: int) -> int:
    """SIGKILL ``job``'s worker of ``rank`` in the newest generation whose ranks all run (a
    restore may replace the workers at any moment: then the next generation's); return that
    generation.

    Raises:
        AssertionError: no such generation ran within :data:`DEADLINE_S`.
    """
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        generation = running_generation(job, world_size)
        pid = None if generation is None else workers(job).get((rank, generation))
        if generation is not None and pid is not None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile: look again
                os.kill(pid, signal.SIGKILL)
                return generation
        time.sleep(0.1)
    raise AssertionError(f"no generation of {job} ran all its ranks for {DEADLINE_S:g} s")


def checkpoints_on_disk(out: Path, job: str, generation: int, world_size: int) -> list[int]:
    """Steps of ``generation`` whose shards of every rank are on disk under ``out/checkpoints``
    (a shard is renamed into place once written: present means complete), ascending."""
    root = out / "checkpoints" / job / f"g{generation:06d}"
    if not root.is_dir():
        return []
    return sorted(
        int(step.name[1:])
        for step in root.glob("s*")
        if all((step / f"rank{r:05d}.pt").is_file() for r in range(world_size))
    )


class HealthPoller:
    """Polls ``url`` (a daemon's ``/healthz``) every ``interval_s`` seconds in a thread and
    keeps ``(time.monotonic(), status)`` of every answer; a poll nothing answered is status 0.

    Use as a context manager; :attr:`answers` is safe to read meanwhile (appends only).
    """

    def __init__(self, url: str, interval_s: float = 0.25) -> None:
        self.url = url
        self.interval_s = interval_s
        self.answers: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="healthz-poller", daemon=True)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                status, _ = http_get(self.url, timeout_s=5.0)
            except (urllib.error.URLError, OSError):
                status = 0
            self.answers.append((time.monotonic(), status))
            self._stop.wait(self.interval_s)

    def between(self, start: float, end: float) -> list[int]:
        """Statuses of the answers polled between monotonic times ``start`` and ``end``."""
        return [status for at, status in list(self.answers) if start <= at <= end]

    def latest(self) -> int | None:
        """The last status, or ``None`` before the first answer."""
        return self.answers[-1][1] if self.answers else None


@contextlib.contextmanager
def broker_restored(broker: ChaosBroker) -> Iterator[ChaosBroker]:
    """Yield ``broker``; afterwards, also after a failure, make sure it runs unpaused."""
    try:
        yield broker
    finally:
        broker.ensure_running()
