"""Smoke tests of the session Kafka broker (``kafka_bootstrap``) with aiokafka.

They pin what the Kafka adapter relies on and what the Tansu fallback lacks: topic creation with
``cleanup.policy=compact``, idempotent ``acks=all`` producers (InitProducerId), consumer groups,
and compaction that a test can observe within seconds (kafka-notes.md 1.4, 1.7).
"""

from __future__ import annotations

from collections import defaultdict

import anyio
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

pytestmark = [pytest.mark.kafka, pytest.mark.anyio]

# Seconds; generous for a loaded 2-core CI machine, far below pytest-timeout's 300 s.
DEADLINE_S = 60.0


async def _create_topics(bootstrap: str, topics: list[NewTopic]) -> None:
    """Create ``topics``, check that each was accepted, and wait until the broker lists them.

    aiokafka returns per-topic errors instead of raising them. CreateTopics answers once the KRaft
    controller committed the topics; the broker's metadata cache catches up a moment later, so an
    immediate ``list_topics()`` often misses them (seen here in 39 of 60 tries).
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        response = await admin.create_topics(topics)
        errors = [e for e in response.to_object()["topic_errors"] if e["error_code"] != 0]
        assert errors == []
        # Polling broker state: there is no event to wait on.
        while not {t.name for t in topics} <= set(await admin.list_topics()):  # noqa: ASYNC110
            await anyio.sleep(0.05)
    finally:
        await admin.close()


async def _read_all(bootstrap: str, tp: TopicPartition) -> list[tuple[bytes, bytes]]:
    """Every (key, value) in ``tp`` from its first retained offset up to its end offset."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        records: list[tuple[bytes, bytes]] = []
        while await consumer.position(tp) < end:
            batch = await consumer.getmany(tp, timeout_ms=1000)
            records += [(r.key, r.value) for r in batch.get(tp, [])]
        return records
    finally:
        await consumer.stop()


async def test_topics_idempotent_produce_and_group_consume(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    plain, compacted = f"{unique_prefix}plain", f"{unique_prefix}compacted"
    group = f"{unique_prefix}group"
    sent = [(f"job-{i % 3}".encode(), f"event-{i}".encode()) for i in range(12)]

    with anyio.fail_after(DEADLINE_S):
        await _create_topics(
            kafka_bootstrap,
            [
                NewTopic(plain, num_partitions=2, replication_factor=1),
                NewTopic(
                    compacted,
                    num_partitions=1,
                    replication_factor=1,
                    topic_configs={"cleanup.policy": "compact"},
                ),
            ],
        )

        # start() sends InitProducerId: it raises on a broker without idempotence support.
        producer = AIOKafkaProducer(
            bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True
        )
        await producer.start()
        try:
            for key, value in sent:
                await producer.send_and_wait(plain, value, key=key)
            await producer.send_and_wait(compacted, b"latest", key=b"job-0")
        finally:
            await producer.stop()

        consumer = AIOKafkaConsumer(
            plain,
            bootstrap_servers=kafka_bootstrap,
            group_id=group,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        await consumer.start()
        try:
            received: list[tuple[bytes, bytes]] = []
            while len(received) < len(sent):
                batches = await consumer.getmany(timeout_ms=1000)
                received += [(r.key, r.value) for rs in batches.values() for r in rs]
            await consumer.commit()
        finally:
            await consumer.stop()

    assert sorted(received) == sorted(sent)
    # Same key, same partition: each job's events arrive in the order they were sent.
    by_key: defaultdict[bytes, list[bytes]] = defaultdict(list)
    for key, value in received:
        by_key[key].append(value)
    for key, values in by_key.items():
        assert values == [v for k, v in sent if k == key]


async def test_compaction_is_observable(kafka_bootstrap: str, unique_prefix: str) -> None:
    topic = f"{unique_prefix}snapshots"
    tp = TopicPartition(topic, 0)
    # The active segment is never compacted: roll segments after 100 ms and clean at once.
    configs = {
        "cleanup.policy": "compact",
        "segment.ms": "100",
        "min.cleanable.dirty.ratio": "0.01",
    }

    with anyio.fail_after(DEADLINE_S):
        await _create_topics(kafka_bootstrap, [NewTopic(topic, 1, 1, topic_configs=configs)])
        producer = AIOKafkaProducer(
            bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True
        )
        await producer.start()
        try:
            for version in range(5):
                await producer.send_and_wait(topic, f"v{version}".encode(), key=b"job-a")
            await producer.send_and_wait(topic, b"v0", key=b"job-b")
            await anyio.sleep(0.3)
            # A record appended after segment.ms rolls the segment holding the ones above.
            await producer.send_and_wait(topic, b"v0", key=b"job-c")
        finally:
            await producer.stop()

        # Polling until the cleaner has run: there is no event to wait on.
        while (records := await _read_all(kafka_bootstrap, tp)).count((b"job-a", b"v0")):  # noqa: ASYNC110
            await anyio.sleep(0.5)

    assert records == [(b"job-a", b"v4"), (b"job-b", b"v0"), (b"job-c", b"v0")]
