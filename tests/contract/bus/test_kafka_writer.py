"""Kafka's partition writer says why it died: a transaction the coordinator aborted after
``transaction.timeout.ms`` is :class:`TransactionExpired`, not a fence by a newer owner (aiokafka
reports both as ``ProducerFenced``); a newer owner's writer gives a plain :class:`Fenced`."""

from __future__ import annotations

import pytest
from aiokafka.errors import ProducerFenced

from tests.support.buses import TEST_TOPICS, BusFactory
from tests.support.service_support import eventually
from trainguard.agent.bus import BusUnavailable, Fenced, TopicPartition, TransactionExpired
from trainguard.agent.bus import _kafka as kafka_adapter
from trainguard.agent.bus._partitioner import partition_for

pytestmark = [pytest.mark.anyio, pytest.mark.kafka, pytest.mark.timeout(180)]


async def test_a_transaction_aborted_by_the_coordinator_is_expired_not_fenced(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The broker looks for expired transactions every 10 s
    # (transaction.abort.timed.out.transaction.cleanup.interval.ms): a 1 s timeout expires
    # at the first look.
    monkeypatch.setattr(kafka_adapter, "_TRANSACTION_TIMEOUT_MS", 1000)
    factory = BusFactory("kafka", f"kafka://{kafka_bootstrap}", unique_prefix)
    group = factory.group("expiry")
    async with factory.open() as bus:
        consumer = await bus.subscribe(["events"], group)
        writer = await bus.partition_writer(group, 0)
        await writer.send("commands", "job-x", b"left open")
        [tp] = [tp for tp in await bus.end_offsets("commands") if tp.partition == _of("job-x")]

        # Aborted by the coordinator: its marker lets read_committed readers past the record.
        async def aborted() -> bool:
            return (await bus.end_offsets("commands"))[tp] == 2

        await eventually(aborted, 90)
        with pytest.raises(TransactionExpired) as expired:
            await writer.commit({TopicPartition("events", 0): 1})
        message = str(expired.value)
        assert f"transactional id '{unique_prefix}daemon-0'" in message
        assert "longer than transaction.timeout.ms (1 s)" in message
        assert writer.writer_id == f"{unique_prefix}daemon-0"
        with pytest.raises(TransactionExpired):
            await writer.send("commands", "job-x", b"more")
        await writer.close()
        await consumer.close()


async def test_a_writer_fenced_by_a_newer_owner_is_fenced_not_expired(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    factory = BusFactory("kafka", f"kafka://{kafka_bootstrap}", unique_prefix)
    group = factory.group("fence")
    async with factory.open() as bus_a, factory.open() as bus_b:
        consumer = await bus_a.subscribe(["events"], group)
        old = await bus_a.partition_writer(group, 1)
        await old.send("commands", "job-y", b"zombie")
        new = await bus_b.partition_writer(group, 1)
        with pytest.raises(Fenced) as fenced:
            await old.commit({TopicPartition("events", 1): 1})
        assert not isinstance(fenced.value, TransactionExpired)
        message = str(fenced.value)
        assert f"partition 1 (transactional id '{unique_prefix}daemon-1')" in message
        assert "a newer owner initialised the transactional id" in message
        await old.close()
        await new.close()
        await consumer.close()


async def test_a_fence_found_while_a_send_waits_for_metadata_is_fenced_not_a_crash(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender task of the old owner's producer finds the fence while ``send`` awaits the
    topic's metadata, after the writer's own check: aiokafka's ``send`` then raises
    ``IllegalOperation``, a plain ``Exception``, which once escaped the daemon's loop and ended
    the process (seen in the three-instance chaos test). The fence is simulated at that moment,
    as the sender task records it (``fatal_error``)."""
    factory = BusFactory("kafka", f"kafka://{kafka_bootstrap}", unique_prefix)
    group = factory.group("fence-in-send")
    async with factory.open() as bus_a, factory.open() as bus_b:
        consumer = await bus_a.subscribe(["events"], group)
        old = await bus_a.partition_writer(group, 2)
        await old.send("commands", "job-z", b"zombie")
        new = await bus_b.partition_writer(group, 2)
        producer = old._producer  # type: ignore[attr-defined]  # the writer's aiokafka client
        wait_on_metadata = producer.client._wait_on_metadata

        async def fenced_meanwhile(topic: str) -> object:
            result = await wait_on_metadata(topic)
            producer._txn_manager.fatal_error(ProducerFenced())
            return result

        monkeypatch.setattr(producer.client, "_wait_on_metadata", fenced_meanwhile)
        with pytest.raises(Fenced) as fenced:
            await old.send("commands", "job-z", b"zombie again")
        assert "a newer owner initialised the transactional id" in str(fenced.value)
        with pytest.raises(Fenced):  # and for good
            await old.commit({TopicPartition("events", 2): 1})
        await old.close()
        await new.close()
        await consumer.close()


def _of(key: str) -> int:
    [commands] = [t for t in TEST_TOPICS if t.name == "commands"]
    return partition_for(key, commands.partitions)


async def test_a_session_timeout_the_broker_refuses_is_a_bad_setting_not_an_outage(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """Above the broker's ``group.max.session.timeout.ms`` (30 min by default), joining the
    group fails with ``InvalidSessionTimeoutError`` every time: not retriable, so the daemon
    exits 2 naming it instead of reporting a bus outage for ever (issue 13's tester)."""
    factory = BusFactory("kafka", f"kafka://{kafka_bootstrap}", unique_prefix)
    async with factory.open(session_timeout_s=3600.0) as bus:
        with pytest.raises(BusUnavailable, match="refuses a setting") as refused:
            await bus.subscribe(["events"], factory.group("session"))
    assert not refused.value.retriable
    assert "InvalidSessionTimeoutError" in str(refused.value)
