"""The message bus every trainguard party talks through: a port and two adapters.

``open_bus(BusConfig(url))`` (or ``open_bus("sqlite:///bus.db")``) returns an unstarted
:class:`Bus`; use it as ``async with open_bus(...) as bus:``. A process that must outlive an
outage of the bus waits for it with :func:`patiently` (``await patiently("connecting to the
bus", lambda: started(open_bus(config)), stop, warn_every_s=30.0)``), which a signal ends
(:class:`Signalled`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

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
from trainguard.agent.bus._wait import (
    ABANDON_GRACE_S,
    Signalled,
    abandon,
    close_soon,
    or_stop,
    patiently,
    started,
)

if TYPE_CHECKING:
    from trainguard.agent.bus._append_clock import AppendClock as AppendClock
    from trainguard.agent.bus._kafka_logs import quiet_kafka_logs as quiet_kafka_logs
    from trainguard.agent.bus._partitioner import partition_for as partition_for
    from trainguard.agent.bus._sqlite import SQLiteBus as SQLiteBus
    from trainguard.agent.bus._sqlite_lock import serving_lock as serving_lock

# Imported on first use (PEP 562): the partitioner imports aiokafka (for murmur2, 0.2 s), the
# others one adapter's machinery, which a process that uses the other adapter does not need.
__getattr__, _, _ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "_kafka_logs": ["quiet_kafka_logs"],
        "_partitioner": ["partition_for"],
        "_sqlite": ["SQLiteBus"],
        "_append_clock": ["AppendClock"],
        "_sqlite_lock": ["serving_lock"],
    },
)

__all__ = [
    "ABANDON_GRACE_S",
    "DEFAULT_BUS_URL",
    "DEFAULT_TOPICS",
    "SECURITY_ENVIRONMENT",
    "AppendClock",
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
    "SQLiteBus",
    "Signalled",
    "TopicPartition",
    "TopicSpec",
    "TransactionExpired",
    "TransactionInDoubt",
    "abandon",
    "close_soon",
    "default_bus_url",
    "default_state_dir",
    "load_kafka_security",
    "open_bus",
    "or_stop",
    "parse_bus_url",
    "partition_for",
    "patiently",
    "quiet_kafka_logs",
    "serving_lock",
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
