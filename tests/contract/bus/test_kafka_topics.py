"""The topics the Kafka adapter creates carry the configuration trainguard relies on:
``LogAppendTime`` everywhere, compaction where the spec asks for it, ``audit`` kept forever,
and ``snapshots`` rolling a segment every hour.
"""

from __future__ import annotations

import anyio
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from trainguard.agent.bus import DEFAULT_TOPICS, BusConfig, open_bus

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
