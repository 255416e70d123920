"""Helpers for tests that run a real :class:`DaemonService` on a real bus: running it, waiting
for a condition, reading a topic; the service tests' daemon configuration, their job ``JOB``'s
events, the exactly-once check on ``commands`` and ``audit``, and a recorded forgery."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import orjson

from tests.support.buses import BusFactory
from trainguard.agent.bus import DEFAULT_TOPICS, Bus
from trainguard.agent.keys._keystore import KeyStore
from trainguard.daemon import DaemonService, MachineConfig
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.daemon.core._state import JobState
from trainguard.daemon.service._settings import DaemonConfig
from trainguard.schemas import (
    Checkpoint,
    Command,
    DataCursor,
    Event,
    Heartbeat,
    Lifecycle,
    Restore,
    add_mac,
    decode,
    encode,
)

CURSOR = DataCursor(data_version="v1", seed=7, epoch=0, offset=80, world_size=2)
"""The data cursor of every shard :class:`JobEvents` makes."""


@asynccontextmanager
async def running(service: DaemonService) -> AsyncIterator[DaemonService]:
    """Run ``service`` in the background; stop it gracefully on exit (waiting up to 60 s)."""
    stop = asyncio.Event()
    task = asyncio.ensure_future(service.run(stop))
    try:
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def eventually(check: Callable[[], Awaitable[Any]], timeout_s: float = 30.0) -> Any:
    """Await ``check()`` every 50 ms until it returns something truthy, and return that.

    Raises:
        AssertionError: not within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = await check()
        if result:
            return result
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout_s} s")


async def read_all(bus: Bus, topic: str) -> list[bytes]:
    """Every record value of ``topic`` from offset 0, in partition order (a tombstone as
    ``b""``)."""
    ends = await bus.end_offsets(topic)
    pending = {tp for tp, end in ends.items() if end > 0}
    values: list[bytes] = []
    if not pending:
        return values
    async with await bus.assign(dict.fromkeys(pending, 0)) as consumer:
        seen = dict.fromkeys(pending, 0)
        while any(seen[tp] < ends[tp] for tp in pending):
            for record in await consumer.getmany(timeout_s=1.0):
                if record.offset < ends[record.tp]:
                    values.append(record.value or b"")
            for tp in pending:  # past transaction markers, which no record carries
                seen[tp] = await consumer.position(tp)
    return values


@dataclass(frozen=True)
class JobEvents:
    """Events of a 2-rank job of generation 0 on host ``h0``, as service tests publish them:
    rank r is pid 100 + r, its supervisor pid 900; ``seq`` as the test gives it (the
    supervisor's is 0). ``job`` overrides :attr:`job_id` for one event."""

    job_id: str

    def head(self, seq: int, job: str | None = None) -> dict[str, Any]:
        """The sender fields every event carries (rank, pid and the rest are the caller's)."""
        return {
            "job_id": job or self.job_id,
            "generation": 0,
            "ts": time.time_ns(),
            "seq": seq,
            "host": "h0",
        }

    def started(self, rank: int, job: str | None = None) -> Lifecycle:
        """Rank ``rank``'s ``started`` report (seq 0), world size 2."""
        return Lifecycle(
            **self.head(0, job), rank=rank, pid=100 + rank, kind="started", world_size=2
        )

    def beat(self, rank: int, seq: int, step: int, job: str | None = None) -> Heartbeat:
        """A training heartbeat of rank ``rank`` at ``step``."""
        return Heartbeat(
            **self.head(seq, job),
            rank=rank,
            pid=100 + rank,
            world_size=2,
            step=step,
            phase="train",
        )

    def shard(self, rank: int, seq: int, step: int) -> Checkpoint:
        """Rank ``rank``'s checkpoint shard of ``step`` (123 bytes, a fixed digest,
        :data:`CURSOR`)."""
        return Checkpoint(
            **self.head(seq, None),
            rank=rank,
            pid=100 + rank,
            world_size=2,
            step=step,
            shard_uri=f"file:///ckpt/{step}/{rank}.pt",
            size_bytes=123,
            digest="sha256:" + "ab" * 32,
            cursor=CURSOR,
        )

    def killed(self, rank: int) -> Lifecycle:
        """The supervisor's report that rank ``rank`` died of SIGKILL."""
        return Lifecycle(
            **self.head(0, None), rank=None, pid=900, kind="exited", ranks=(rank,), signal=9
        )


JOB = "svc-job"
"""The job of :data:`EVENTS` (and of :func:`started`, :func:`beat`, :func:`shard`,
:func:`killed`)."""


def daemon_config(factory: BusFactory, **machine: Any) -> DaemonConfig:
    return DaemonConfig(
        bus=factory.config(topics=DEFAULT_TOPICS),
        machine=MachineConfig(daemon_id="test-daemon", **machine),
        group_id=factory.group("daemon"),
        poll_s=0.02,
        pulse_s=0.2,  # the short test timeouts need a dense stream (2 * pulse_s + poll_s < bus_gap_s)
    )


async def publish(bus: Bus, *events: Event) -> None:
    for event in events:
        await bus.publish("events", event.job_id, encode(event))


EVENTS = JobEvents(JOB)
started, beat, shard, killed = EVENTS.started, EVENTS.beat, EVENTS.shard, EVENTS.killed


def acknowledgements(restore: Restore) -> tuple[Lifecycle, ...]:
    """Both ranks' ``restored`` of ``restore``'s 2-rank job and generation, from their new
    processes (pids 200 and 201 on host ``h0``)."""
    assert restore.target is not None
    return tuple(
        Lifecycle(
            job_id=restore.job_id,
            generation=restore.generation,
            ts=time.time_ns(),
            seq=1,
            rank=rank,
            host="h0",
            pid=200 + rank,
            kind="restored",
            world_size=2,
            step=restore.target.step,
            cursor=restore.target.cursor,
            snapshot_id=restore.target.snapshot_id,
        )
        for rank in (0, 1)
    )


async def commands(bus: Bus) -> list[Any]:
    return [decode(v) for v in await read_all(bus, "commands")]


def issued(audit: list[bytes]) -> Counter[tuple[str, int]]:
    """Commands issued per ``(job, generation)`` in the ``decisions`` entries of ``audit``."""
    counts: Counter[tuple[str, int]] = Counter()
    for value in audit:
        entry = orjson.loads(value)
        if entry.get("entry") == "decisions":
            for decision in entry["decisions"]:
                if decision["decision"] == "issue":
                    counts[(entry["job_id"], decision["command"]["generation"])] += 1
    return counts


async def assert_once_each(bus: Bus, jobs: tuple[str, ...]) -> None:
    """Exactly one command per job, a generation-1 restore, on ``commands`` and in ``audit``."""
    commands = Counter(
        (c.job_id, c.generation)
        for c in (cast(Command, decode(v, expect=Command)) for v in await read_all(bus, "commands"))
    )
    expected = Counter({(job, 1): 1 for job in jobs})
    assert commands == expected
    assert issued(await read_all(bus, "audit")) == expected


FORGED_STEP = 10_000


async def record_forgery(folder: Path) -> tuple[BusFactory, JobState]:
    """A daemon with keys folds ``JOB``'s MACed events (both ranks at step 4) and refuses a
    heartbeat of rank 0 at step :data:`FORGED_STEP` whose MAC is made with another key; return
    the bus and the job's state as the daemon holds it."""
    admin = KeyAdmin(folder / "keys")
    admin.init([JOB])
    keys = KeyStore(admin.path).load_daemon_keys()
    event_key = keys.current_event_key(JOB)
    assert event_key is not None
    factory = BusFactory("sqlite", f"sqlite://{folder / 'bus.db'}", "f.")
    config = dataclasses.replace(daemon_config(factory), snapshot_interval_s=0)
    async with factory.open(topics=DEFAULT_TOPICS) as bus:
        for event in (started(0), started(1), beat(0, 1, 4), beat(1, 1, 4)):
            await bus.publish("events", JOB, encode(add_mac(event, *event_key)))
        forged = add_mac(beat(0, 2, FORGED_STEP), event_key[0], os.urandom(32))
        await bus.publish("events", JOB, encode(forged))
        async with running(DaemonService(config, keys=keys)) as service:

            async def refused() -> bool:
                entries = [orjson.loads(v) for v in await read_all(bus, "audit")]
                return any(e["entry"] == "refused" for e in entries)

            await eventually(refused)
            await eventually(lambda: folded(service, 4))
            held = service.jobs[JOB]
    return factory, held


async def folded(service: DaemonService, n: int) -> bool:
    """Whether ``service`` has folded ``n`` inputs or more (a condition for :func:`eventually`)."""
    return service.counters["folded"] >= n
