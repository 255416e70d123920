"""Fixtures of the bus contract suite: ``bus_factory``, parametrized over every adapter."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent.bus import Bus, BusConfig, TopicSpec, open_bus

TEST_TOPICS = (
    TopicSpec("events", partitions=3),
    TopicSpec("commands", partitions=3, compacted=True),
)
"""Topics of every contract test: few partitions keep Kafka's topic creation quick."""


@dataclass(frozen=True)
class BusFactory:
    """Makes unstarted bus objects that all reach one fresh bus (same file or broker, same
    topic prefix), as separate processes of one deployment would.

    Attributes:
        kind: ``"sqlite"`` or ``"kafka"``.
        url: the bus URL.
        prefix: the topic prefix, unique per test.
    """

    kind: str
    url: str
    prefix: str

    def config(self, **overrides: Any) -> BusConfig:
        """The test's :class:`BusConfig`, with ``overrides`` of its fields."""
        base = BusConfig(
            url=self.url,
            prefix=self.prefix,
            topics=TEST_TOPICS,
            connect_timeout_s=30.0,
            send_timeout_s=30.0,
        )
        return dataclasses.replace(base, **overrides)

    def open(self, **overrides: Any) -> Bus:
        """A new unstarted bus object; ``overrides`` change :class:`BusConfig` fields."""
        return open_bus(self.config(**overrides))

    def group(self, name: str) -> str:
        """A consumer group id unique to this test (Kafka keeps groups across tests)."""
        return f"{self.prefix}{name}"


@pytest.fixture
def anyio_backend() -> str:
    """aiokafka runs on asyncio only, so the contract suite does too."""
    return "asyncio"


@pytest.fixture(
    params=[pytest.param("sqlite"), pytest.param("kafka", marks=pytest.mark.kafka)],
)
def bus_factory(request: pytest.FixtureRequest, tmp_path: Path) -> BusFactory:
    """A :class:`BusFactory` for a fresh bus of each adapter: a SQLite file in ``tmp_path``, or
    the session's Kafka broker with a topic prefix unique to the test."""
    if request.param == "sqlite":
        return BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "t.")
    bootstrap: str = request.getfixturevalue("kafka_bootstrap")
    prefix: str = request.getfixturevalue("unique_prefix")
    return BusFactory("kafka", f"kafka://{bootstrap}", prefix)
