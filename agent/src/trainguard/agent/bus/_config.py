"""Bus configuration: a frozen object built once at the edge, plus URL parsing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from trainguard.agent.bus._errors import BusURLError
from trainguard.agent.bus._port import TopicSpec

__all__ = ["DEFAULT_BUS_URL", "DEFAULT_TOPICS", "BusConfig", "KafkaSecurity", "parse_bus_url"]

DEFAULT_BUS_URL = "sqlite:trainguard-bus.db"
"""The bus every party uses when none is configured: an embedded bus in the working folder."""

DEFAULT_TOPICS: tuple[TopicSpec, ...] = (
    TopicSpec("events", partitions=6),
    TopicSpec("commands", partitions=6, compacted=True),
    TopicSpec("snapshots", partitions=6, compacted=True),
    TopicSpec("manifests", partitions=6),
    TopicSpec("audit", partitions=6),
    TopicSpec("dead-letter", partitions=1),
)
"""trainguard's topics (ARCHITECTURE.md section 3). ``events``, ``commands``, ``snapshots``,
``manifests`` and ``audit`` are keyed by job id and share one partition count so that one
job's records of every kind sit on the same partition number (co-partitioning)."""


@dataclass(frozen=True, slots=True)
class KafkaSecurity:
    """Kafka transport security, passed straight to aiokafka (see its ``AIOKafkaClient`` docs).

    Attributes:
        protocol: ``PLAINTEXT``, ``SSL``, ``SASL_PLAINTEXT`` or ``SASL_SSL``.
        sasl_mechanism: ``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512`` (with a SASL protocol).
        sasl_username, sasl_password: SASL credentials; never logged (``repr`` hides them).
        ssl_cafile, ssl_certfile, ssl_keyfile: PEM files for TLS (server CA, client cert/key).
    """

    protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None


@dataclass(frozen=True, slots=True)
class BusConfig:
    """How to reach and shape the bus.

    Attributes:
        url: ``sqlite:///path/to/bus.db`` (embedded) or ``kafka://host:port[,host:port]``.
        prefix: prepended to every logical topic name (``trainguard.events``); lets several
            deployments or test runs share one broker.
        topics: topics created on start-up when missing.
        connect_timeout_s: seconds ``start()`` may take before raising ``BusUnavailable``.
        send_timeout_s: seconds a send may stay undelivered before its future raises
            ``DeliveryFailed``; also bounds the flush in ``close()``.
        max_message_bytes: largest record value accepted, bytes.
        client_id: identifies this process to the bus (logs, broker metrics).
        replication_factor: Kafka replicas per partition of the topics created on start-up;
            ``None`` takes ``min(3, brokers in the cluster)``.
        session_timeout_s: a consumer-group member silent for this long loses its partitions
            (Kafka's ``session.timeout.ms``; the embedded bus applies the same rule).
        idle_poll_s: embedded bus only: longest sleep, in seconds, of an idle consumer between
            looks at the file (it starts at 2 ms after each delivery and doubles up to this).
            The worst-case delivery latency of an idle consumer; Kafka long-polls instead.
        security: Kafka TLS/SASL settings; ignored by the embedded bus.
        kafka_options: extra keyword arguments for aiokafka producers/consumers (expert use).
    """

    url: str
    prefix: str = "trainguard."
    topics: tuple[TopicSpec, ...] = DEFAULT_TOPICS
    connect_timeout_s: float = 15.0
    send_timeout_s: float = 30.0
    max_message_bytes: int = 1 << 20
    client_id: str = "trainguard"
    replication_factor: int | None = None
    session_timeout_s: float = 10.0
    idle_poll_s: float = 0.02
    security: KafkaSecurity = KafkaSecurity()
    kafka_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


def parse_bus_url(url: str) -> tuple[Literal["sqlite", "kafka"], str]:
    """Split a bus URL into its kind and location.

    Returns ``("sqlite", "/abs/or/relative/path.db")`` for ``sqlite:///path`` (three slashes
    and an absolute path, or ``sqlite:relative.db``), and ``("kafka", "h1:p1,h2:p2")`` for
    ``kafka://h1:p1,h2:p2``. Raises :class:`BusURLError` for anything else.
    """
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        path = unquote(parts.path if not parts.netloc else parts.netloc + parts.path)
        if not path:
            raise BusURLError(f"bus URL {url!r}: missing the database path (sqlite:///path/bus.db)")
        return "sqlite", path
    if parts.scheme == "kafka":
        servers = parts.netloc
        if not servers or parts.path not in ("", "/"):
            raise BusURLError(f"bus URL {url!r}: expected kafka://host:port[,host:port...]")
        for server in servers.split(","):
            host, sep, port = server.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise BusURLError(f"bus URL {url!r}: {server!r} is not host:port")
        return "kafka", servers
    raise BusURLError(f"bus URL {url!r}: scheme must be sqlite or kafka")
