"""On Kafka, ``end_offsets`` is the last stable offset: the end a ``read_committed`` reader (the
daemon) can reach, not the high watermark, which counts the records of open transactions."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaProducer

from tests.support.service_support import eventually
from trainguard.agent.bus import BusConfig, TopicPartition, TopicSpec, open_bus

pytestmark = [pytest.mark.anyio, pytest.mark.kafka, pytest.mark.timeout(120)]


async def test_end_offsets_stop_before_an_open_transaction(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    config = BusConfig(
        url=f"kafka://{kafka_bootstrap}",
        prefix=unique_prefix,
        topics=(TopicSpec("events", partitions=1),),
    )
    events = TopicPartition("events", 0)
    async with open_bus(config) as bus:
        await bus.publish("events", "a-job", b"before")
        producer = AIOKafkaProducer(
            bootstrap_servers=kafka_bootstrap, transactional_id=f"{unique_prefix}txn"
        )
        await asyncio.wait_for(producer.start(), 30)
        try:
            await asyncio.wait_for(producer.begin_transaction(), 30)
            for _ in range(3):
                await asyncio.wait_for(
                    producer.send_and_wait(f"{unique_prefix}events", b"open", partition=0), 30
                )
            # The transaction's records are appended, not committed: not the end yet.
            assert await bus.end_offsets("events") == {events: 1}
            await asyncio.wait_for(producer.commit_transaction(), 30)
        finally:
            await asyncio.wait_for(producer.stop(), 30)

        # Committed (the coordinator writes the markers just after the commit returns): its 3
        # records and its commit marker.
        async def stable() -> bool:
            return await bus.end_offsets("events") == {events: 5}

        await eventually(stable)
