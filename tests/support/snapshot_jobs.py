"""Jobs, events and daemons of the snapshot service tests
(``tests/service/daemon/test_snapshot*.py``): jobs ``A``-``D`` on one partition and ``E`` on
another, their events, a daemon configuration whose deadlines never pass during a test, and the
first daemon whose clean stop writes a round of snapshots."""

from __future__ import annotations

import hashlib
import itertools
import time
from typing import Any

from tests.support.buses import BusFactory
from tests.support.service_support import eventually, read_all, running
from tests.support.snapshot_keys import Keys
from trainguard.agent.bus import DEFAULT_TOPICS, Bus
from trainguard.agent.bus._partitioner import partition_for
from trainguard.agent.keys._keystore import DaemonKeys
from trainguard.daemon import DaemonService, MachineConfig
from trainguard.daemon.service._settings import DaemonConfig
from trainguard.daemon.service._snapshot_chunks import chunk_job, read_record_header
from trainguard.daemon.service._snapshot_envelope import SnapshotHeader
from trainguard.schemas import (
    Checkpoint,
    DataCursor,
    Event,
    Heartbeat,
    Lifecycle,
    encode,
)

PARTITIONS = next(t.partitions for t in DEFAULT_TOPICS if t.name == "events")
_NAMES = [f"snap-{i}" for i in range(200)]
HERE = partition_for("snap-0", PARTITIONS)
A, B, C, D = [n for n in _NAMES if partition_for(n, PARTITIONS) == HERE][:4]
"""Jobs on one partition: A trains and is killed after the restart, B finishes, C trains, D
first appears after the restart."""
E = next(n for n in _NAMES if partition_for(n, PARTITIONS) != HERE)
"""A job on another partition."""
CURSOR = DataCursor(data_version="v1", seed=7, epoch=0, offset=80, world_size=2)
MACHINE: dict[str, Any] = {
    "heartbeat_timeout_s": 600.0,
    "startup_timeout_s": 600.0,
    "restore_timeout_s": 600.0,
    "progress_floor_s": 600.0,
}
"""No deadline passes during a test: no daemon writes a tick, so states depend on the
published events alone and two daemons can be compared at any time."""


def daemon_config(
    factory: BusFactory,
    daemon_id: str,
    interval_s: float = 3600.0,
    max_message_bytes: int = 1 << 20,
) -> DaemonConfig:
    """A daemon of the test's bus; ``max_message_bytes`` small writes its snapshots in
    chunks."""
    return DaemonConfig(
        bus=factory.config(topics=DEFAULT_TOPICS, max_message_bytes=max_message_bytes),
        machine=MachineConfig(daemon_id=daemon_id, **MACHINE),
        group_id=factory.group("daemon"),
        poll_s=0.02,
        snapshot_interval_s=interval_s,
    )


_SEQ = itertools.count(1)
"""One counter for every sender: each sender's ``seq`` grows with the order of publication."""


def _head(job: str) -> dict[str, Any]:
    return {"job_id": job, "generation": 0, "ts": time.time_ns(), "seq": next(_SEQ), "host": "h0"}


def started(job: str, rank: int) -> Lifecycle:
    return Lifecycle(**_head(job), rank=rank, pid=100 + rank, kind="started", world_size=2)


def beat(job: str, rank: int, step: int) -> Heartbeat:
    return Heartbeat(
        **_head(job), rank=rank, pid=100 + rank, world_size=2, step=step,
        phase="train", loss=2.0 - step / 100,
    )  # fmt: skip


def shard(job: str, rank: int, step: int) -> Checkpoint:
    """Rank ``rank``'s checkpoint shard of ``step``; its digest, as a real one, differs from
    every other shard's (which makes a state of many checkpoints compress as a real one)."""
    uri = f"file:///ckpt/{job}/{step}/{rank}.pt"
    return Checkpoint(
        **_head(job), rank=rank, pid=100 + rank, world_size=2, step=step,
        shard_uri=uri, size_bytes=123,
        digest="sha256:" + hashlib.sha256(uri.encode()).hexdigest(), cursor=CURSOR,
    )  # fmt: skip


def finished(job: str, rank: int) -> Lifecycle:
    return Lifecycle(**_head(job), rank=rank, pid=100 + rank, kind="finished", world_size=2, step=9)


def killed(job: str, rank: int) -> Lifecycle:
    return Lifecycle(**_head(job), rank=None, pid=900, kind="exited", ranks=(rank,), signal=9)


def training(job: str, steps: range, *, commit_at: int | None = None) -> list[Event]:
    events: list[Event] = []
    for step in steps:
        events += [beat(job, 0, step), beat(job, 1, step)]
        if step == commit_at:
            events += [shard(job, 0, step), shard(job, 1, step)]
    return events


async def publish(bus: Bus, events: list[Event]) -> None:
    for event in events:
        await bus.publish("events", event.job_id, encode(event))


async def total_records(bus: Bus) -> int:
    """Records on ``events`` (not offsets: on Kafka the daemon's transaction markers take
    offsets too)."""
    return len(await read_all(bus, "events"))


async def latest_headers(bus: Bus) -> dict[str, SnapshotHeader]:
    """Each job's latest snapshot header (of its envelope or its chunks' head), unverified."""
    latest = await bus.latest_per_key("snapshots")
    return {
        j: read_record_header(r.value or b"")[0] for j, r in latest.items() if chunk_job(j) is None
    }


def first_phase() -> list[Event]:
    return [
        *(started(job, r) for job in (A, B, C, E) for r in (0, 1)),
        *training(A, range(12), commit_at=10),
        *training(B, range(10)),
        finished(B, 0),
        finished(B, 1),
        *training(C, range(6)),
        *training(E, range(6)),
    ]


async def first_daemon(
    factory: BusFactory, bus: Bus, keys: Keys | DaemonKeys, max_message_bytes: int = 1 << 20
) -> dict[str, Any]:
    """Publish the first phase and let daemon ``a`` fold it; its clean stop writes a round.
    Returns its job states."""
    events = first_phase()
    await publish(bus, events)
    config = daemon_config(factory, "daemon-a", max_message_bytes=max_message_bytes)
    async with running(DaemonService(config, keys=keys)) as a:
        await eventually(lambda: folded(a, len(events)), timeout_s=60.0)
        states = dict(a.jobs)
    headers = await latest_headers(bus)
    assert set(headers) == {A, B, C, E}
    assert {(h.partition, h.round_jobs) for j, h in headers.items() if j != E} == {(HERE, 3)}
    return states


def fallbacks(service: DaemonService, reason: str) -> float:
    value = service.metrics.registry.get_sample_value(
        "trainguard_snapshot_fallbacks_total", {"reason": reason}
    )
    assert value is not None
    return value


async def folded(service: DaemonService, n: int) -> bool:
    """Whether ``service`` is ready and has folded ``n`` inputs or more."""
    return service.ready.is_set() and service.counters["folded"] >= n
