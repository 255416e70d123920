"""``BusFactory``: fresh buses of each adapter for tests (the ``bus_factory`` fixture in
``tests/conftest.py`` makes one per adapter)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

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
