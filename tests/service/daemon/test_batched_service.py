"""The daemon service on a real bus (SQLite and Kafka) with a job whose heartbeats come as
``heartbeat-batch`` records of its node's supervisor: a rank missing from its node's batches is
found silent and the job restored and resumed, a batch delivered twice is parked once, and a
replay from the bus reproduces every decision."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from typing import Any

import orjson
import pytest

from tests.support.buses import BusFactory
from tests.support.service_support import (
    JOB,
    acknowledgements,
    beat,
    commands,
    daemon_config,
    eventually,
    publish,
    read_all,
    running,
    shard,
    started,
)
from trainguard.agent.bus import DEFAULT_TOPICS, Bus
from trainguard.daemon import DaemonService, MachineConfig
from trainguard.daemon.forensics._job_log import read_bus
from trainguard.daemon.forensics._replay import replay, verify
from trainguard.schemas import Heartbeat, HeartbeatBatch, Restore, Resume, batched_beat, encode

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

SUPERVISOR_PID = 900


def batch(beats: list[Heartbeat], seq: int) -> bytes:
    """Host ``h0``'s supervisor's batch of ``beats``."""
    return encode(
        HeartbeatBatch(
            job_id=JOB,
            ts=time.time_ns(),
            seq=seq,
            host="h0",
            pid=SUPERVISOR_PID,
            beats=tuple(batched_beat(b) for b in beats),
        )
    )


async def of_type(bus: Bus, kind: type[Any]) -> list[Any]:
    return [c for c in await commands(bus) if isinstance(c, kind)]


async def test_a_rank_missing_from_its_nodes_batches_is_restored_and_replayed_exactly(
    bus_factory: BusFactory,
) -> None:
    config = daemon_config(
        bus_factory, heartbeat_timeout_s=1.0, heartbeat_interval_s=0.25, bus_gap_s=0.75
    )
    batch_seq = itertools.count(1)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, started(0), started(1))
        first = batch([beat(0, 1, 10), beat(1, 1, 10)], next(batch_seq))
        await bus.publish("events", JOB, first)
        await publish(bus, shard(0, 2, 10), shard(1, 2, 10))
        async with running(DaemonService(config)):

            async def rank_0_alone() -> None:
                """Rank 1 fell silent: its node's batches carry rank 0 only."""
                for seq in itertools.count(3):
                    await bus.publish("events", JOB, batch([beat(0, seq, 10)], next(batch_seq)))
                    await asyncio.sleep(0.2)

            beating = asyncio.ensure_future(rank_0_alone())
            try:
                [restore] = await eventually(lambda: of_type(bus, Restore))
            finally:
                beating.cancel()
            assert restore.generation == 1
            assert "no event from rank 1 on host h0" in restore.reason
            await publish(bus, *acknowledgements(restore))

            async def both_beating() -> None:
                """The restored ranks beat on until the daemon stopped: a silence of theirs
                (the test's waits under load) would open another incident, decided at a tick
                the stopping daemon may write and never fold (a pending difference)."""
                for seq in itertools.count(2):
                    new = [
                        dataclasses.replace(beat(r, seq, 10), generation=1, pid=200 + r)
                        for r in (0, 1)
                    ]
                    await bus.publish("events", JOB, batch(new, next(batch_seq)))
                    await asyncio.sleep(0.2)

            beating = asyncio.ensure_future(both_beating())
            try:
                [resume] = await eventually(lambda: of_type(bus, Resume))
                assert resume.generation == 1
                await bus.publish("events", JOB, first)  # the bus delivers it again

                async def parked_again() -> list[dict[str, Any]]:
                    # (Batches of rank 0 alone sent after the restore was issued are parked
                    # too, their heartbeats of a stale generation.)
                    parked = [orjson.loads(v) for v in await read_all(bus, "dead-letter")]
                    return [p for p in parked if p["reason"].startswith("duplicate: ")]

                [again] = await eventually(parked_again)
                assert again["reason"].startswith(
                    "duplicate: HeartbeatBatch from supervisor on host h0 (pid 900) has seq 1, "
                    "already accepted up to seq "
                )
            except BaseException:
                await _cancelled(beating)
                raise
        await _cancelled(beating)  # after the daemon stopped
    log = await read_bus(bus_factory.url, bus_factory.prefix, JOB)
    result = replay(JOB, log.events, log.trail(), MachineConfig(daemon_id="unused"))
    assert verify(result.replayed, result.recorded) is None
    assert any(row.kind == "heartbeat-batch" and row.decisions for row in result.rows)


async def _cancelled(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait until it ended."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
