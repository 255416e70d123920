"""The message bus every trainguard party talks through: a port and two adapters.

``open_bus(BusConfig(url))`` (or ``open_bus("sqlite:///bus.db")``) returns an unstarted
:class:`Bus`; use it as ``async with open_bus(...) as bus:``. A process that must outlive an
outage of the bus waits for it with :func:`patiently` (``await patiently("connecting to the
bus", lambda: started(open_bus(config)), stop, warn_every_s=30.0)``), which a signal ends
(:class:`Signalled`).
"""

from __future__ import annotations

from trainguard.agent.bus._config import (
    DEFAULT_BUS_URL,
    DEFAULT_TOPICS,
    SECURITY_ENVIRONMENT,
    BusConfig,
    KafkaSecurity,
    default_bus_url,
    default_state_dir,
    load_kafka_security,
    parse_bus_url,
    sqlite_url,
    topic_prefixes,
)
from trainguard.agent.bus._errors import (
    BusClosed,
    BusError,
    BusUnavailable,
    BusURLError,
    DeliveryFailed,
    Fenced,
    TransactionExpired,
    TransactionInDoubt,
)
from trainguard.agent.bus._port import (
    Bus,
    Consumer,
    Delivery,
    PartitionWriter,
    Record,
    TopicPartition,
    TopicSpec,
)
from trainguard.agent.bus._wait import Signalled, close_soon, patiently, started

__all__ = [
    "DEFAULT_BUS_URL",
    "DEFAULT_TOPICS",
    "SECURITY_ENVIRONMENT",
    "Bus",
    "BusClosed",
    "BusConfig",
    "BusError",
    "BusURLError",
    "BusUnavailable",
    "Consumer",
    "Delivery",
    "DeliveryFailed",
    "Fenced",
    "KafkaSecurity",
    "PartitionWriter",
    "Record",
    "Signalled",
    "TopicPartition",
    "TopicSpec",
    "TransactionExpired",
    "TransactionInDoubt",
    "close_soon",
    "default_bus_url",
    "default_state_dir",
    "load_kafka_security",
    "open_bus",
    "parse_bus_url",
    "patiently",
    "sqlite_url",
    "started",
    "topic_prefixes",
]


def open_bus(config: BusConfig | str) -> Bus:
    """Return an unstarted bus for ``config`` (a :class:`BusConfig` or just a bus URL).

    Raises :class:`BusURLError` for an unknown URL scheme. Adapters are imported lazily so an
    embedded-bus process never loads aiokafka's network stack.
    """
    if isinstance(config, str):
        config = BusConfig(url=config)
    kind, location = parse_bus_url(config.url)
    if kind == "sqlite":
        from trainguard.agent.bus._sqlite import SQLiteBus

        return SQLiteBus(config, location)
    from trainguard.agent.bus._kafka import KafkaBus

    return KafkaBus(config, location)
