"""The topics the Kafka adapter creates carry the configuration trainguard relies on:
``LogAppendTime`` everywhere, compaction where the spec asks for it, ``audit`` kept forever,
and ``snapshots`` rolling a segment every hour.
"""

from __future__ import annotations

import anyio
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from trainguard.agent.bus import DEFAULT_TOPICS, BusConfig, BusUnavailable, open_bus

pytestmark = [pytest.mark.anyio, pytest.mark.kafka]


async def _topic_configs(bootstrap: str, topics: list[str]) -> dict[str, dict[str, str]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name) for name in topics]
        )
    finally:
        await admin.close()
    configs: dict[str, dict[str, str]] = {}
    for response in responses:
        # DescribeConfigsResponse: resources = [(error_code, error_message, type, name,
        # [(config_name, value, ...), ...])]
        for _code, _message, _type, name, entries in response.resources:
            configs[name] = {entry[0]: entry[1] for entry in entries}
    return configs


async def test_default_topics_are_created_as_specified(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    config = BusConfig(url=f"kafka://{kafka_bootstrap}", prefix=unique_prefix)
    assert config.topics == DEFAULT_TOPICS
    with anyio.fail_after(60):
        async with open_bus(config):
            pass
        names = [f"{unique_prefix}{spec.name}" for spec in DEFAULT_TOPICS]
        configs = await _topic_configs(kafka_bootstrap, names)

    for spec in DEFAULT_TOPICS:
        topic = configs[f"{unique_prefix}{spec.name}"]
        assert topic["message.timestamp.type"] == "LogAppendTime", spec.name
        assert topic["cleanup.policy"] == ("compact" if spec.compacted else "delete"), spec.name
    assert configs[f"{unique_prefix}audit"]["retention.ms"] == "-1"
    # The others keep the broker's default retention (7 days unless the operator changed it).
    assert configs[f"{unique_prefix}events"]["retention.ms"] == "604800000"
    # snapshots rolls a segment every hour, so that compaction reaches replaced snapshots.
    assert configs[f"{unique_prefix}snapshots"]["segment.ms"] == "3600000"
    assert configs[f"{unique_prefix}events"]["segment.ms"] == "604800000"


async def test_topic_creation_is_bounded_by_the_start_deadline_not_the_send_timeout(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """Creating topics takes the KRaft controller from milliseconds to seconds (a broker just
    started, a busy machine); it is part of ``start()``, so the admin client's requests have
    the start-up deadline. With a send timeout shorter than any round trip (1 ms), the topics
    are still created: before, the admin's requests had ``send_timeout_s`` and start() failed
    ("creating topics failed: RequestTimedOutError" whenever creation outlasted it)."""
    config = BusConfig(
        url=f"kafka://{kafka_bootstrap}",
        prefix=unique_prefix,
        connect_timeout_s=60.0,
        send_timeout_s=0.001,
    )
    names = [f"{unique_prefix}{spec.name}" for spec in DEFAULT_TOPICS]
    # Without the topics (the old code: the admin could not even connect in 1 ms) the wait
    # below fails here.
    with anyio.fail_after(90):
        error = ""
        try:
            async with open_bus(config):
                pass
        except BusUnavailable as exc:
            # The producer's own requests have 1 ms: it may well fail to start after the
            # topics exist. Only the admin's part (connecting, creating topics) is under test.
            error = str(exc)
        assert "admin" not in error
        assert "topics" not in error
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            # The broker's metadata cache lists a created topic a moment after CreateTopics
            # answered (tests/contract/bus/test_kafka_broker.py); polling: no event to wait on.
            while not set(names) <= set(await admin.list_topics()):  # noqa: ASYNC110
                await anyio.sleep(0.05)
        finally:
            await admin.close()
