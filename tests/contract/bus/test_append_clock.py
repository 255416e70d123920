"""The embedded bus file's simulated append clock (``trainguard sim``): once set, every
record any writer appends (sends, a group member's partition writer, imports) carries its time,
and the file's readers see it; removed, appends take the wall clock again."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from trainguard.agent.bus import AppendClock, BusConfig, TopicPartition, TopicSpec
from trainguard.agent.bus._sqlite import SQLiteBus

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOPICS = (TopicSpec("events", partitions=1),)
T = 1_900_000_000_000  # ms since the epoch: far from the wall clock


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _read_all(bus: SQLiteBus) -> list[int]:
    consumer = await bus.assign({TopicPartition("events", 0): 0})
    try:
        return [r.timestamp_ms for r in await consumer.getmany(timeout_s=1.0, max_records=100)]
    finally:
        await consumer.close()


async def test_every_writer_stamps_the_simulated_time(tmp_path: Path) -> None:
    path = tmp_path / "bus.db"
    config = BusConfig(url=f"sqlite://{path}", topics=TOPICS)
    async with SQLiteBus(config, str(path)) as bus, SQLiteBus(config, str(path)) as other:
        assert await bus.append_clock() is None
        await bus.set_append_clock(T)
        clock = AppendClock(str(path))
        try:
            assert clock.ns() == T * 1_000_000
            await (await other.send("events", "k", b"sent"))
            member = await other.subscribe(["events"], "g")
            await member.getmany(timeout_s=0.5)
            writer = await other.partition_writer("g", 0)
            await writer.send("events", "k", b"written")
            await writer.commit({})
            await writer.close()
            await member.close()
            # Records of an import keep their own times; the clock moves in the same
            # transaction.
            await bus.import_records("events", [("k", b"imported", T + 5)], clock_ms=T + 7)
            assert clock.ns() == (T + 7) * 1_000_000
            await bus.set_append_clock(None)
            before = time.time_ns() // 1_000_000
            await (await bus.send("events", "k", b"wall"))
            assert clock.ns() >= before * 1_000_000
        finally:
            clock.close()
        stamps = await _read_all(bus)
    assert stamps[:3] == [T, T, T + 5]
    assert before <= stamps[3] < T
