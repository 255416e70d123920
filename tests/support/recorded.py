"""A short job recorded on a real bus by real daemon services, for the replay and export
tests: two daemons with different ``daemon_id`` s decide it one after the other, a timeout is
decided through ticks the daemon wrote into the log, and the job finishes.

Story: both ranks start, train to step 5 and checkpoint it (committed), then fall silent;
daemon A's ticks find them silent past the 1 s heartbeat timeout and it restores generation 1
to step 5. A stops; daemon B (same group, another id) rebuilds the job from the log, both ranks
acknowledge the restore, B resumes them, and they finish.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from tests.support.buses import BusFactory
from tests.support.service_support import eventually, running
from trainguard.agent.bus import DEFAULT_TOPICS, Bus, Record
from trainguard.daemon import DaemonService, MachineConfig
from trainguard.daemon.service._settings import DaemonConfig
from trainguard.schemas import (
    Checkpoint,
    DataCursor,
    Event,
    Heartbeat,
    Lifecycle,
    Restore,
    Resume,
    decode,
    encode,
)

JOB = "replay-job"
CURSOR = DataCursor(data_version="v1", seed=7, epoch=0, offset=80, world_size=2)
MACHINE = {"heartbeat_timeout_s": 1.0, "heartbeat_interval_s": 0.25, "bus_gap_s": 0.75}
"""Settings of both daemons besides their ids: ranks silent for 1 s are dead (and a gap in a
job's inputs is an outage from 0.75 s, below that timeout)."""


def daemon_config(factory: BusFactory, daemon_id: str) -> DaemonConfig:
    """A daemon of the test's group on ``factory``'s bus."""
    return DaemonConfig(
        bus=factory.config(topics=DEFAULT_TOPICS),
        machine=MachineConfig(daemon_id=daemon_id, **MACHINE),  # type: ignore[arg-type]
        group_id=factory.group("daemon"),
        poll_s=0.02,
        pulse_s=0.2,  # the short test timeouts need a dense stream (2 * pulse_s + poll_s < bus_gap_s)
    )


def _head(rank: int, seq: int, generation: int = 0) -> dict[str, Any]:
    return {
        "job_id": JOB,
        "generation": generation,
        "ts": time.time_ns(),
        "seq": seq,
        "rank": rank,
        "host": "h0",
        "pid": 100 + rank + 10 * generation,
    }


def _started(rank: int, generation: int = 0) -> Lifecycle:
    return Lifecycle(**_head(rank, 0, generation), kind="started", world_size=2)


def _beat(rank: int, seq: int, step: int, generation: int = 0) -> Heartbeat:
    return Heartbeat(**_head(rank, seq, generation), world_size=2, step=step, phase="train")


def _shard(rank: int, seq: int, step: int) -> Checkpoint:
    return Checkpoint(
        **_head(rank, seq),
        world_size=2,
        step=step,
        shard_uri=f"file:///ckpt/{step}/{rank}.pt",
        size_bytes=123,
        digest="sha256:" + "ab" * 32,
        cursor=CURSOR,
    )


async def _publish(bus: Bus, *events: Event) -> None:
    for event in events:
        await bus.publish("events", JOB, encode(event))


async def _commands(bus: Bus) -> list[Any]:
    ends = await bus.end_offsets("commands")
    out: list[Any] = []
    pending = {tp: end for tp, end in ends.items() if end > 0}
    if not pending:
        return out
    async with await bus.assign(dict.fromkeys(pending, 0)) as consumer:
        records: list[Record] = []
        seen = dict.fromkeys(pending, 0)
        while any(seen[tp] < end for tp, end in pending.items()):
            records.extend(
                r for r in await consumer.getmany(timeout_s=1.0) if r.offset < pending[r.tp]
            )
            for tp in pending:  # past transaction markers, which no record carries
                seen[tp] = await consumer.position(tp)
    return [decode(r.value) for r in records if r.value is not None]


def recorded_bus(folder: Path) -> BusFactory:
    """An embedded bus in ``folder`` holding the recorded job (topics under ``t.``)."""
    factory = BusFactory("sqlite", f"sqlite://{folder / 'bus.db'}", "t.")
    asyncio.run(record_job(factory))
    return factory


async def record_job(factory: BusFactory) -> None:
    """Record the module docstring's job on ``factory``'s bus (topics under its prefix)."""
    async with factory.open(topics=DEFAULT_TOPICS) as bus:
        await _publish(bus, _started(0), _started(1), _beat(0, 1, 5), _beat(1, 1, 5))
        await _publish(bus, _shard(0, 2, 5), _shard(1, 2, 5))
        async with running(DaemonService(daemon_config(factory, "daemon-a"))):

            async def restore() -> list[Restore]:
                return [c for c in await _commands(bus) if isinstance(c, Restore)]

            [order] = await eventually(restore)
        assert order.target is not None
        ack = {
            "step": order.target.step,
            "cursor": order.target.cursor,
            "snapshot_id": order.target.snapshot_id,
        }
        async with running(DaemonService(daemon_config(factory, "daemon-b"))) as second:
            await asyncio.wait_for(second.ready.wait(), 30)
            await _publish(
                bus,
                *(
                    Lifecycle(**_head(r, 1, 1), kind="restored", world_size=2, **ack)
                    for r in (0, 1)
                ),
            )

            async def resume() -> list[Resume]:
                return [c for c in await _commands(bus) if isinstance(c, Resume)]

            await eventually(resume)
            await _publish(bus, _beat(0, 2, 6, 1), _beat(1, 2, 6, 1))
            await _publish(
                bus,
                *(
                    Lifecycle(**_head(r, 3, 1), kind="finished", step=6, world_size=2)
                    for r in (0, 1)
                ),
            )

            async def finished() -> bool:
                return second.jobs[JOB].phase == "finished"

            await eventually(finished)
