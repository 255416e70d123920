"""Kafka adapter of the bus port, on aiokafka.

Choices, and the aiokafka traps they avoid (``kafka-notes.md`` section 2, aio-libs/aiokafka
issues cited inline):

* The producer is idempotent with ``acks=all`` (aiokafka defaults to ``acks=1`` without
  idempotence), so a retried batch is never written twice and an acknowledged record survives
  the loss of the partition leader.
* Every call that waits on the broker is bounded: ``start()`` by ``connect_timeout_s``, sends by
  ``send_timeout_s``, and ``close()`` as well, because ``send_and_wait()`` and ``stop()`` can hang
  forever while the broker is down (#1101) and ``send()`` hangs without a started producer (#759).
* Consumers never auto-commit; callers commit after they have acted on records. They read with
  ``isolation_level="read_committed"`` so records of aborted transactions are never seen.
  ``getmany`` is only ever called by short loops: a handler that blocks longer than
  ``max_poll_interval_ms`` makes the group evict the member and rebalance endlessly (#848).
* The partition of a record is computed by :func:`partition_for`, the same murmur2 function
  as Kafka's default partitioner, so the embedded bus and Kafka agree on it.
* A failed first connection names its cause (refused, TLS handshake, SASL credentials):
  aiokafka's bootstrap only logs it and raises "Unable to bootstrap", so the adapter connects
  once more by hand to find it (:meth:`KafkaBus._connect_failure`).
* Group consumers get a ``ConsumerRebalanceListener`` that only bumps an assignment epoch and
  records the assignment. aiokafka keeps ``assignment()`` unchanged through a rejoin (a member
  evicted while paused gets the same partitions back and never sees a difference), and keeps
  returning records from ``getmany`` while a listener callback is still awaited, so the
  callbacks do no work of their own: the caller compares the epoch after each poll.
* :meth:`KafkaBus.partition_writer` is one transactional producer per owned partition
  (``transactional_id = f"{prefix}daemon-{p}"``, the pre-KIP-447 pattern: aiokafka's
  transaction RPCs are v0), whose ``init_transactions`` fences the previous owner.
  :class:`_KafkaPartitionWriter` wraps aiokafka's transaction state machine, which checks its
  transitions with ``assert`` (an ``AssertionError``, or silent corruption under ``python
  -O``): no begin while a commit or abort is pending, and nothing at all after
  ``ProducerFenced``.
* aiokafka's own log lines are throttled (the first of each template, then one per 30 s) and
  the exceptions its orphaned tasks leave after a fence logged as warnings
  (:mod:`._kafka_logs`): during an outage it logs about 200 lines a second otherwise.
* Topics are created on start-up with ``message.timestamp.type=LogAppendTime``: a record's
  timestamp is the broker's append time, which is what the daemon's state machine uses as its
  clock (sender clocks may be skewed).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka import TopicPartition as KafkaTP
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.conn import create_conn
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    GroupCoordinatorNotAvailableError,
    IllegalOperation,
    InvalidProducerEpoch,
    InvalidSessionTimeoutError,
    InvalidTransactionTimeout,
    KafkaConnectionError,
    KafkaError,
    ProducerFenced,
    SaslAuthenticationFailed,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)
from aiokafka.helpers import create_ssl_context

from trainguard.agent.bus import _errors as errors
from trainguard.agent.bus._config import KAFKA_FRAMING_BYTES, BusConfig
from trainguard.agent.bus._kafka_logs import quiet_kafka_logs, quiet_kafka_orphans
from trainguard.agent.bus._partitioner import partition_for
from trainguard.agent.bus._port import (
    Bus,
    Consumer,
    Delivery,
    PartitionWriter,
    Record,
    TopicPartition,
    TopicSpec,
)

__all__ = ["KafkaBus"]

_T = TypeVar("_T")

# Kafka protocol error code for CreateTopics on an existing topic (another process won the race).
_TOPIC_ALREADY_EXISTS = 36
# ... and when the controller did not finish creating it within the request's timeout.
_REQUEST_TIMED_OUT = 7
# Kafka's transaction.timeout.ms for partition writers: a transaction open longer (its owner
# paused, say) is aborted by the coordinator. Also how long a stalled owner's open transaction
# can hold back read_committed readers of the topics it wrote to when no new owner fences it.
_TRANSACTION_TIMEOUT_MS = 30_000

_REFUSED_SETTINGS = (
    InvalidSessionTimeoutError,
    InvalidTransactionTimeout,
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
)
"""Broker errors that a setting causes (a session timeout outside the broker's
``group.min/max.session.timeout.ms``, a transaction timeout above its maximum) or a missing
permission (ACLs): not retriable."""


class KafkaBus(Bus):
    """The bus on an Apache Kafka cluster (``kafka://host:port[,host:port]``).

    Args:
        config: bus settings; ``config.security`` passes straight to aiokafka's clients,
            ``config.kafka_options`` to its producers.
        bootstrap_servers: ``host:port[,host:port]`` from the URL.
    """

    def __init__(self, config: BusConfig, bootstrap_servers: str) -> None:
        self._config = config
        self._servers = bootstrap_servers
        self._producer: AIOKafkaProducer | None = None
        self._meta: AIOKafkaConsumer | None = None
        self._partition_counts: dict[str, int] = {}
        self._consumers: set[_KafkaConsumer] = set()
        self._closed = False

    # -- configuration -------------------------------------------------------------------------

    def _full(self, topic: str) -> str:
        return self._config.prefix + topic

    def _logical(self, full: str) -> str:
        return full[len(self._config.prefix) :]

    def _client_kwargs(self, *, servers: bool = True) -> dict[str, Any]:
        """Connection settings common to producer, consumers and admin client (with
        ``servers=False``, those of one connection: no ``bootstrap_servers``)."""
        sec = self._config.security
        kwargs: dict[str, Any] = {"bootstrap_servers": self._servers} if servers else {}
        kwargs |= {
            "client_id": self._config.client_id,
            "security_protocol": sec.protocol,
            "request_timeout_ms": int(self._config.send_timeout_s * 1000),
        }
        if sec.protocol in ("SSL", "SASL_SSL"):
            kwargs["ssl_context"] = create_ssl_context(
                cafile=sec.ssl_cafile, certfile=sec.ssl_certfile, keyfile=sec.ssl_keyfile
            )
        if sec.protocol.startswith("SASL"):
            kwargs["sasl_mechanism"] = sec.sasl_mechanism or "PLAIN"
            kwargs["sasl_plain_username"] = sec.sasl_username
            kwargs["sasl_plain_password"] = sec.sasl_password
        return kwargs

    async def _bounded(self, what: str, aw: Awaitable[_T], timeout_s: float) -> _T:
        """Await ``aw`` for at most ``timeout_s``; broker trouble becomes ``BusUnavailable``."""
        try:
            return await asyncio.wait_for(aw, timeout_s)
        except TimeoutError as exc:
            raise errors.BusUnavailable(
                f"Kafka at {self._servers}: {what} took longer than {timeout_s:g} s"
            ) from exc
        except KafkaError as exc:
            err = errors.BusUnavailable(f"Kafka at {self._servers}: {what} failed: {exc!r}")
            if isinstance(exc, _REFUSED_SETTINGS):
                # A setting to fix, not an outage to wait out: retried, it fails the same way.
                err = errors.BusUnavailable(
                    f"Kafka at {self._servers}: {what} failed: the broker refuses a setting "
                    f"or permission: {exc!r}"
                )
                err.retriable = False
            raise err from exc

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, create missing topics and start the producer.

        Raises :class:`BusUnavailable` when the cluster does not answer within
        ``connect_timeout_s`` seconds.
        """
        if self._closed:
            raise errors.BusClosed("bus is closed")
        quiet_kafka_logs()
        quiet_kafka_orphans(asyncio.get_running_loop())
        timeout = self._config.connect_timeout_s
        # The admin's requests get the whole start-up deadline, not send_timeout_s: a broker
        # just started (or busy) can take seconds to create topics, and a create that timed
        # out client-side would fail start() though the broker goes on to create them.
        admin = AIOKafkaAdminClient(
            **self._client_kwargs() | {"request_timeout_ms": int(timeout * 1000)}
        )
        try:
            try:
                await self._bounded("connecting (admin)", admin.start(), timeout)
            except errors.BusUnavailable as exc:
                if not isinstance(exc.__cause__, KafkaConnectionError):
                    raise
                failure = await self._connect_failure(timeout)
                if failure is None:
                    raise
                reason, refused = failure
                err = errors.BusUnavailable(f"Kafka at {self._servers}: {reason}")
                # Credentials the broker refuses are a setting to fix, not an outage to wait
                # out (the supervisor exits 2 on them, as on a bad URL).
                err.retriable = not refused
                raise err from exc
            await self._bounded("creating topics", self._create_topics(admin), timeout)
        finally:
            await _close_quietly(admin.close(), timeout)
        opts = dict(self._config.kafka_options)
        producer = AIOKafkaProducer(
            **self._client_kwargs(),
            acks="all",
            enable_idempotence=True,
            max_request_size=self._config.max_message_bytes + KAFKA_FRAMING_BYTES,
            linger_ms=opts.pop("linger_ms", 0),
            **opts,
        )
        # read_committed: end_offsets() is then the last stable offset, not the high
        # watermark, which an open transaction of a daemon would hold readers behind.
        meta = AIOKafkaConsumer(
            **self._client_kwargs(),
            group_id=None,
            enable_auto_commit=False,
            isolation_level="read_committed",
        )
        try:
            await self._bounded("connecting (producer)", producer.start(), timeout)
            await self._bounded("connecting (metadata)", meta.start(), timeout)
        except BaseException:  # a cancelled start too: a client never stopped is left open
            await _stop_all([producer.stop(), meta.stop()], timeout)
            raise
        self._producer, self._meta = producer, meta

    async def _connect_failure(self, timeout_s: float) -> tuple[str, bool] | None:
        """Why a connection to the first bootstrap server fails, and whether the broker
        refused the credentials; ``None`` if it succeeds.

        One connection with the bus's settings, including the SASL handshake, bounded by
        ``timeout_s``. The reason names the user and mechanism for refused credentials, never
        the password.
        """
        first = self._servers.split(",")[0]
        host, _, port = first.rpartition(":")
        # The message is prefixed with every bootstrap server; name the one tried if several.
        to = f" to {first}" if first != self._servers else ""
        try:
            conn = await asyncio.wait_for(
                create_conn(host, int(port), **self._client_kwargs(servers=False)), timeout_s
            )
        except SaslAuthenticationFailed as exc:
            sec = self._config.security
            return (
                f"SASL authentication as {sec.sasl_username!r} ({sec.sasl_mechanism or 'PLAIN'}) "
                f"refused by the broker: {exc}"
            ), True
        except TimeoutError:
            return f"connecting{to} took longer than {timeout_s:g} s", False
        except (OSError, KafkaError) as exc:
            return f"connecting{to} failed: {type(exc).__name__}: {exc}", False
        conn.close()
        return None

    async def _create_topics(self, admin: AIOKafkaAdminClient) -> None:
        existing = set(await admin.list_topics())
        missing = [t for t in self._config.topics if self._full(t.name) not in existing]
        if not missing:
            return
        replication = self._config.replication_factor
        if replication is None:
            cluster = await admin.describe_cluster()
            replication = max(1, min(3, len(cluster.get("brokers", ()))))
        response = await admin.create_topics([self._new_topic(t, replication) for t in missing])
        for topic_result in response.topic_errors:
            name, code = topic_result[0], topic_result[1]
            if code == _REQUEST_TIMED_OUT:
                # The controller had not finished within the request's timeout; it goes on,
                # so a later start() finds the topic (or creates it): an outage, retriable.
                raise errors.BusUnavailable(
                    f"Kafka at {self._servers}: creating topic {name!r} timed out in the broker"
                )
            if code not in (0, _TOPIC_ALREADY_EXISTS):
                raise errors.BusError(f"Kafka refused to create topic {name!r}: {topic_result!r}")

    def _new_topic(self, spec: TopicSpec, replication: int) -> NewTopic:
        configs = {
            "cleanup.policy": "compact" if spec.compacted else "delete",
            "message.timestamp.type": "LogAppendTime",
            "max.message.bytes": str(self._config.max_message_bytes + KAFKA_FRAMING_BYTES),
        }
        if spec.retention_ms is not None and not spec.compacted:
            configs["retention.ms"] = str(spec.retention_ms)
        if spec.segment_ms is not None:
            configs["segment.ms"] = str(spec.segment_ms)
        return NewTopic(self._full(spec.name), spec.partitions, replication, topic_configs=configs)

    async def close(self) -> None:
        """Flush pending sends and disconnect every client at once (consumers, producer,
        metadata consumer), each bounded by ``send_timeout_s``.

        At once, not one after another: a close cut short (a caller's grace after a signal,
        with the broker away) has still begun to stop every client, so none is left open
        (aiokafka logs ``Unclosed AIOKafkaProducer`` for each at exit).
        """
        if self._closed:
            return
        self._closed = True
        clients = [c for c in (self._producer, self._meta) if c is not None]
        await asyncio.gather(
            *(consumer.close() for consumer in list(self._consumers)),
            _stop_all([c.stop() for c in clients], self._config.send_timeout_s),
        )

    def _started_producer(self) -> AIOKafkaProducer:
        if self._closed:
            raise errors.BusClosed("bus is closed")
        if self._producer is None:
            raise errors.BusError("bus not started: call start() first")
        return self._producer

    def _started_meta(self) -> AIOKafkaConsumer:
        self._started_producer()
        assert self._meta is not None
        return self._meta

    # -- producing ---------------------------------------------------------------------------

    async def partitions(self, topic: str) -> int:
        """Number of partitions of ``topic`` (cached after the first call)."""
        count = self._partition_counts.get(topic)
        if count is None:
            producer = self._started_producer()
            found = await self._bounded(
                f"metadata of {topic!r}",
                producer.partitions_for(self._full(topic)),
                self._config.send_timeout_s,
            )
            count = self._partition_counts[topic] = len(found)
        return count

    async def send(
        self, topic: str, key: str, value: bytes | None, *, partition: int | None = None
    ) -> asyncio.Future[Delivery]:
        """Queue one record; the returned future resolves when the cluster acknowledged it.

        The future raises :class:`DeliveryFailed` for a value over ``max_message_bytes``
        (not appended), or when the producer gives the record up (``in_doubt``: it may have
        been appended). While the broker is away the future simply stays pending: aiokafka
        retries the record for as long as the producer lives and never expires it (measured:
        a 60 s SIGSTOP of the broker, every record delivered once on SIGCONT), so a caller
        that must bound the wait does so itself, without cancelling this future if others
        await it too (:meth:`publish` shields it). Cancelling it is harmless: the record
        still goes out, and its acknowledgement is dropped.
        """
        producer = self._started_producer()
        delivery: asyncio.Future[Delivery] = asyncio.get_running_loop().create_future()
        if value is not None and len(value) > self._config.max_message_bytes:
            delivery.set_exception(
                errors.DeliveryFailed(
                    f"record of {len(value)} bytes exceeds max_message_bytes="
                    f"{self._config.max_message_bytes}"
                )
            )
            return delivery
        count = await self.partitions(topic)
        if partition is None:
            partition = partition_for(key, count)
        elif not 0 <= partition < count:
            raise errors.BusError(f"{topic} has no partition {partition} (it has {count})")
        try:
            sent = await producer.send(
                self._full(topic), value, key=key.encode(), partition=partition
            )
        except KafkaError as exc:
            delivery.set_exception(errors.DeliveryFailed(f"send to {topic!r} failed: {exc!r}"))
            return delivery

        def _done(fut: asyncio.Future[Any]) -> None:
            if delivery.done():
                return  # its waiter cancelled it: nobody is left to tell
            if fut.cancelled():
                delivery.cancel()
            elif (exc := fut.exception()) is not None:
                # The idempotent producer gave the batch up after its own retries: an
                # attempt may have been appended all the same.
                delivery.set_exception(
                    errors.DeliveryFailed(f"send to {topic!r} failed: {exc!r}", in_doubt=True)
                )
            else:
                meta = fut.result()
                delivery.set_result(Delivery(topic, meta.partition, meta.offset))

        sent.add_done_callback(_done)
        return delivery

    async def publish(
        self, topic: str, key: str, value: bytes | None, *, partition: int | None = None
    ) -> Delivery:
        """Send one record and wait for its acknowledgement, at most ``send_timeout_s + 5``
        seconds.

        Raises:
            DeliveryFailed: not acknowledged in time (``in_doubt``: the producer keeps the
                record and appends it once the broker answers, so sending it again while this
                bus lives can append it twice), or see :meth:`send`.
        """
        delivery = await self.send(topic, key, value, partition=partition)
        try:
            # aiokafka never expires a record while the broker is away (#1101: the producer
            # just waits), so the bound is ours. Shielded: a timeout must not cancel the
            # delivery, which aiokafka completes later.
            return await asyncio.wait_for(
                asyncio.shield(delivery), self._config.send_timeout_s + 5.0
            )
        except TimeoutError as exc:
            raise errors.DeliveryFailed(
                f"no acknowledgement from Kafka within {self._config.send_timeout_s + 5.0:g} s; "
                "the producer still holds the record and may append it later",
                in_doubt=True,
            ) from exc

    # -- consuming ---------------------------------------------------------------------------

    def _consumer_kwargs(self) -> dict[str, Any]:
        return {
            **self._client_kwargs(),
            "enable_auto_commit": False,
            "isolation_level": "read_committed",
            "session_timeout_ms": int(self._config.session_timeout_s * 1000),
            "heartbeat_interval_ms": max(100, int(self._config.session_timeout_s * 1000) // 3),
            "max_poll_interval_ms": int(self._config.max_poll_interval_s * 1000),
            "fetch_max_wait_ms": 100,
        }

    async def subscribe(
        self, topics: Sequence[str], group_id: str, *, from_beginning: bool = True
    ) -> Consumer:
        """Join consumer group ``group_id`` (Kafka group protocol, eager rebalancing)."""
        self._started_producer()
        inner = AIOKafkaConsumer(
            **self._consumer_kwargs(),
            group_id=group_id,
            auto_offset_reset="earliest" if from_beginning else "latest",
        )
        listener = _Rebalances()
        inner.subscribe([self._full(t) for t in topics], listener=listener)
        return await self._started_consumer(inner, group_id, listener)

    async def assign(self, positions: Mapping[TopicPartition, int | None]) -> Consumer:
        """Read partitions from explicit offsets, without a group (``None`` = end)."""
        self._started_producer()
        inner = AIOKafkaConsumer(**self._consumer_kwargs(), group_id=None)
        consumer = await self._started_consumer(inner, None)
        tps = {KafkaTP(self._full(tp.topic), tp.partition): off for tp, off in positions.items()}
        inner.assign(list(tps))
        to_end = [ktp for ktp, off in tps.items() if off is None]
        if to_end:
            await self._bounded("seek to end", inner.seek_to_end(*to_end), self._timeout)
        for ktp, off in tps.items():
            if off is not None:
                inner.seek(ktp, off)
        return consumer

    @property
    def _timeout(self) -> float:
        return self._config.send_timeout_s

    async def _started_consumer(
        self, inner: AIOKafkaConsumer, group_id: str | None, listener: _Rebalances | None = None
    ) -> _KafkaConsumer:
        try:
            await self._bounded("starting consumer", inner.start(), self._config.connect_timeout_s)
        except BaseException:  # a cancelled start too (see start())
            await _close_quietly(inner.stop(), self._timeout)
            raise
        consumer = _KafkaConsumer(self, inner, group_id, listener)
        self._consumers.add(consumer)
        return consumer

    async def partition_writer(self, group_id: str, partition: int) -> PartitionWriter:
        """See :meth:`Bus.partition_writer`: a started transactional producer with
        ``transactional_id = f"{prefix}daemon-{partition}"``; starting it runs
        ``InitProducerId``, which bumps the id's epoch (fencing the previous producer) and
        settles its open transaction. Raises :class:`BusUnavailable` after
        ``connect_timeout_s``."""
        self._started_producer()
        opts = dict(self._config.kafka_options)
        opts.pop("acks", None)  # a transactional producer always uses acks=all
        opts.pop("enable_idempotence", None)
        transactional_id = f"{self._config.prefix}daemon-{partition}"
        producer = AIOKafkaProducer(
            **self._client_kwargs(),
            transactional_id=transactional_id,
            transaction_timeout_ms=_TRANSACTION_TIMEOUT_MS,
            max_request_size=self._config.max_message_bytes + KAFKA_FRAMING_BYTES,
            linger_ms=opts.pop("linger_ms", 0),
            **opts,
        )
        try:
            await self._bounded(
                f"initialising the transactions of partition {partition}",
                producer.start(),
                self._config.connect_timeout_s,
            )
        except BaseException:  # a cancelled start too (see start())
            await _close_quietly(producer.stop(), self._timeout)
            raise
        return _KafkaPartitionWriter(self, producer, group_id, partition, transactional_id)

    async def end_offsets(self, topic: str) -> dict[TopicPartition, int]:
        """Next offset of every partition of ``topic`` as a ``read_committed`` reader sees it:
        the last stable offset, below the first record of a transaction still open (equal to
        the high watermark when none is). Raises :class:`BusUnavailable` when the cluster does
        not answer within ``send_timeout_s``."""
        meta = self._started_meta()
        tps = [KafkaTP(self._full(topic), p) for p in range(await self.partitions(topic))]
        ends = await self._bounded(
            f"end offsets of {topic!r}", meta.end_offsets(tps), self._timeout
        )
        return {TopicPartition(topic, ktp.partition): off for ktp, off in ends.items()}

    async def group_positions(self, group_id: str, topic: str) -> dict[TopicPartition, int]:
        """See :meth:`Bus.group_positions`: the group coordinator's committed offsets (an
        admin client's ``OffsetFetch``, which does not join the group); ``{}`` while the
        cluster has no coordinator for the group. Raises :class:`BusUnavailable` when the
        cluster does not answer in time or refuses (an authorisation error names the group)."""
        self._started_producer()
        full = self._full(topic)
        tps = [KafkaTP(full, p) for p in range(await self.partitions(topic))]
        admin = AIOKafkaAdminClient(**self._client_kwargs())
        try:
            await self._bounded("connecting (admin)", admin.start(), self._timeout)
            offsets = await self._bounded(
                f"committed offsets of group {group_id!r}",
                admin.list_consumer_group_offsets(group_id, partitions=tps),
                self._timeout,
            )
        except errors.BusUnavailable as exc:
            # No coordinator for the group: no group of the cluster has committed yet (the
            # offsets topic does not exist), or it is moving; either way nothing is known to
            # have been read.
            if isinstance(exc.__cause__, GroupCoordinatorNotAvailableError):
                return {}
            raise
        finally:
            await _close_quietly(admin.close(), self._timeout)
        # The coordinator answers -1 for a partition the group has not committed.
        return {
            TopicPartition(topic, ktp.partition): meta.offset
            for ktp, meta in sorted(offsets.items())
            if ktp.topic == full and meta.offset >= 0
        }

    async def latest_per_key(self, topic: str) -> dict[str, Record]:
        """Read ``topic`` from its first retained record to its end; keep each key's last.

        Progress is judged by the consumer's position, not by record offsets: compaction and
        transaction markers leave offsets that no record carries.
        """
        ends = await self.end_offsets(topic)
        latest: dict[str, Record] = {}
        if not any(ends.values()):
            return latest
        consumer = await self.assign(dict.fromkeys(ends, 0))
        assert isinstance(consumer, _KafkaConsumer)
        async with consumer:
            while not await consumer.reached(ends):
                for record in await consumer.getmany(timeout_s=0.5, max_records=10_000):
                    if record.key is not None:
                        latest[record.key] = record
        return {key: rec for key, rec in latest.items() if rec.value is not None}

    async def topic_names(self) -> frozenset[str]:
        """See :meth:`Bus.topic_names`: the cluster's topic listing (those this client may
        describe). Raises :class:`BusUnavailable` when the cluster does not answer."""
        meta = self._started_meta()
        return frozenset(await self._bounded("listing topics", meta.topics(), self._timeout))

    def _forget(self, consumer: _KafkaConsumer) -> None:
        self._consumers.discard(consumer)


class _Rebalances(ConsumerRebalanceListener):  # type: ignore[misc]
    """Counts a group member's rebalances and keeps its latest assignment; does nothing else
    (see the module docstring for why). Eager rebalancing revokes every partition first, so
    between the two callbacks the member owns nothing."""

    def __init__(self) -> None:
        self.epoch = 0
        self.assigned: frozenset[KafkaTP] = frozenset()

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.epoch += 1
        self.assigned = frozenset()

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.epoch += 1
        self.assigned = frozenset(assigned)


class _KafkaConsumer(Consumer):
    """A started aiokafka consumer behind the port's :class:`Consumer` interface."""

    def __init__(
        self,
        bus: KafkaBus,
        inner: AIOKafkaConsumer,
        group_id: str | None,
        listener: _Rebalances | None = None,
    ) -> None:
        self._bus = bus
        self._inner = inner
        self._group_id = group_id
        self._listener = listener
        self._closed = False

    async def getmany(self, timeout_s: float = 1.0, max_records: int = 1000) -> list[Record]:
        """Records fetched since the last call, by partition, offsets ascending."""
        if self._closed:
            raise errors.BusClosed("consumer is closed")
        batches = await self._inner.getmany(
            timeout_ms=max(0, int(timeout_s * 1000)), max_records=max_records
        )
        logical = self._bus._logical
        out: list[Record] = []
        for ktp, records in batches.items():
            topic = logical(ktp.topic)
            out.extend(
                Record(
                    topic,
                    ktp.partition,
                    r.offset,
                    r.key.decode(errors="replace") if r.key is not None else None,
                    r.value,
                    r.timestamp,
                )
                for r in records
            )
        return out

    async def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        """Commit positions to the group coordinator (synchronously, one round trip)."""
        if self._closed:
            raise errors.BusClosed("consumer is closed")
        if self._group_id is None:
            raise errors.BusError(
                "commit() needs a consumer group: this consumer was made by assign()"
            )
        kafka_offsets = (
            None
            if offsets is None
            else {KafkaTP(self._bus._full(tp.topic), tp.partition): o for tp, o in offsets.items()}
        )
        try:
            await asyncio.wait_for(self._inner.commit(kafka_offsets), self._bus._timeout)
        except (KafkaError, TimeoutError) as exc:
            raise errors.BusError(f"commit for group {self._group_id!r} failed: {exc!r}") from exc

    async def committed(self, tp: TopicPartition) -> int | None:
        """The group's committed position of ``tp`` (one round trip to the coordinator)."""
        if self._closed:
            raise errors.BusClosed("consumer is closed")
        if self._group_id is None:
            raise errors.BusError(
                "committed() needs a consumer group: this consumer was made by assign()"
            )
        ktp = KafkaTP(self._bus._full(tp.topic), tp.partition)
        try:
            position = await asyncio.wait_for(self._inner.committed(ktp), self._bus._timeout)
        except (KafkaError, TimeoutError) as exc:
            raise errors.BusError(
                f"committed() for group {self._group_id!r} failed: {exc!r}"
            ) from exc
        return None if position is None else int(position)

    async def seek(self, tp: TopicPartition, offset: int) -> None:
        """Next :meth:`getmany` for ``tp`` starts at ``offset``."""
        if self._closed:
            raise errors.BusClosed("consumer is closed")
        self._inner.seek(KafkaTP(self._bus._full(tp.topic), tp.partition), offset)

    async def position(self, tp: TopicPartition) -> int:
        """See :meth:`Consumer.position` (aiokafka's fetch position, which skips control
        records)."""
        if self._closed:
            raise errors.BusClosed("consumer is closed")
        ktp = KafkaTP(self._bus._full(tp.topic), tp.partition)
        try:
            return int(await asyncio.wait_for(self._inner.position(ktp), self._bus._timeout))
        except (KafkaError, TimeoutError, AssertionError) as exc:
            raise errors.BusError(f"position of {tp} unknown: {exc!r}") from exc

    async def reached(self, ends: Mapping[TopicPartition, int]) -> bool:
        """Whether this consumer's position is at or past ``ends`` for every partition."""
        for tp, end in ends.items():
            ktp = KafkaTP(self._bus._full(tp.topic), tp.partition)
            position = await asyncio.wait_for(self._inner.position(ktp), self._bus._timeout)
            if position < end:
                return False
        return True

    def assignment(self) -> frozenset[TopicPartition]:
        """Partitions currently assigned: for a group member, those of the group's latest
        assignment as the rebalance listener saw it (empty during a rebalance)."""
        logical = self._bus._logical
        tps = self._inner.assignment() if self._listener is None else self._listener.assigned
        return frozenset(TopicPartition(logical(k.topic), k.partition) for k in tps)

    def assignment_epoch(self) -> int:
        """See :meth:`Consumer.assignment_epoch`: the rebalance listener's callback count."""
        return 0 if self._listener is None else self._listener.epoch

    async def close(self) -> None:
        """Leave the group and disconnect, bounded by the bus's send timeout."""
        if self._closed:
            return
        self._closed = True
        self._bus._forget(self)
        await _close_quietly(self._inner.stop(), self._bus._timeout)


_TXN_ERRORS = (KafkaError, AssertionError, IllegalOperation)
"""What a transactional producer's calls raise when the transaction cannot go on. Besides
aiokafka's errors and its transition ``assert``: ``IllegalOperation`` (a plain ``Exception``),
which ``send`` raises when the sender task moved the transaction to an error state (a fence
found, say) while ``send`` awaited metadata, after this writer's own check."""


class _KafkaPartitionWriter(PartitionWriter):
    """A transactional producer for one owned partition (see :meth:`KafkaBus.partition_writer`).

    Keeps its own state so that aiokafka's asserted transitions are never tripped:
    ``ready`` (no transaction), ``open`` (begun, records or offsets added), ``ending`` (a
    commit or abort in flight, held as a shielded task: a caller's timeout never cancels it,
    and the next call awaits the same task), ``abortable`` (the transaction failed: only
    :meth:`abort` is allowed), ``fenced`` and ``closed``.

    Why a call failed, as the caller is told: :class:`Fenced` for ``ProducerFenced`` (aiokafka's
    name for ``INVALID_PRODUCER_EPOCH`` too) while the transaction had been open for less than
    ``transaction.timeout.ms`` (a newer owner initialised the transactional id), or for another
    fatal error; :class:`TransactionExpired` for ``ProducerFenced`` once it had been open for
    longer (the coordinator aborted it and bumped the epoch: the v0 protocol aiokafka speaks
    gives both causes one error code, and the open time is what tells them apart; a writer both
    expired and fenced is told expired, whose handling, a fresh assignment, is safe for both);
    :class:`TransactionInDoubt` for a commit or abort not answered within the send timeout; a
    retriable :class:`BusError` for the rest (the transaction is abortable). Every message
    names the partition and the transactional id.
    """

    def __init__(
        self,
        bus: KafkaBus,
        producer: AIOKafkaProducer,
        group_id: str,
        partition: int,
        transactional_id: str,
    ) -> None:
        self._bus = bus
        self._producer = producer
        self._group_id = group_id
        self._partition = partition
        self._transactional_id = transactional_id
        self._state = "ready"
        self._ending: asyncio.Task[None] | None = None
        self._committing = False  # whether _ending is a commit (else an abort)
        self._opened_at: float | None = None  # time.monotonic() of the open transaction's begin
        self._dead: errors.Fenced | None = None  # why the writer became unusable

    @property
    def writer_id(self) -> str:
        """See :attr:`PartitionWriter.writer_id`: the transactional id."""
        return self._transactional_id

    def _where(self) -> str:
        return f"partition {self._partition} (transactional id {self._transactional_id!r})"

    def _check(self) -> None:
        txn = self._producer._txn_manager
        if self._state != "closed" and txn is not None and txn.is_fatal_error():
            # The sender task hit ProducerFenced (or another fatal error) on its own: every
            # transition from here would trip an assert. (Each fatal error it hits stores a
            # new waiter: _lost retrieves them all.)
            waiter = txn.wait_for_transaction_end()
            cause = waiter.exception() if waiter.done() and not waiter.cancelled() else None
            self._lost("the transaction", cause)
        if self._state == "fenced":
            dead = self._dead
            assert dead is not None  # set with the state
            raise type(dead)(str(dead))
        if self._state == "closed":
            raise errors.BusClosed(f"writer of {self._where()} is closed")

    def _lost(self, what: str, exc: BaseException | None) -> errors.Fenced:
        """Mark the writer dead after a fatal ``exc`` and return the error that says why."""
        self._state = "fenced"
        self._retrieve_end()
        if self._dead is not None:
            return self._dead
        fence = (ProducerFenced, InvalidProducerEpoch)
        timeout_s = _TRANSACTION_TIMEOUT_MS / 1000
        age = None if self._opened_at is None else time.monotonic() - self._opened_at
        dead: errors.Fenced
        if isinstance(exc, fence) or isinstance(getattr(exc, "__cause__", None), fence):
            if age is not None and age >= timeout_s:
                dead = errors.TransactionExpired(
                    f"{self._where()}: {what} refused: the transaction was open for {age:.1f} s, "
                    f"longer than transaction.timeout.ms ({timeout_s:g} s), so the coordinator "
                    "aborted it and bumped the producer epoch; nothing of it is visible"
                )
            else:
                dead = errors.Fenced(
                    f"{self._where()}: {what} refused (ProducerFenced): a newer owner "
                    "initialised the transactional id; nothing since the last commit is visible"
                )
        else:
            # Unusable for another reason (say, authorisation): as good as fenced for the
            # caller, who must not open a writer again before a new assignment.
            dead = errors.Fenced(f"{self._where()}: {what} failed fatally: {exc!r}")
        self._dead = dead
        return dead

    def _failed(self, what: str, exc: BaseException) -> errors.BusError:
        """The error for a failed call; marks the writer fenced or abortable."""
        txn = self._producer._txn_manager
        if txn is not None and txn.is_fatal_error() and isinstance(exc, IllegalOperation):
            # The sender task's fatal error is the cause: say it (a fence or an expiry).
            waiter = txn.wait_for_transaction_end()
            if waiter.done() and not waiter.cancelled():
                exc = waiter.exception() or exc
        if (
            isinstance(exc, ProducerFenced | InvalidProducerEpoch)
            or isinstance(getattr(exc, "__cause__", None), ProducerFenced | InvalidProducerEpoch)
            or (txn is not None and txn.is_fatal_error())
        ):
            return self._lost(what, exc)
        self._state = "abortable"
        err = errors.BusError(f"{self._where()}: {what} failed: {exc!r}")
        err.retriable = True
        return err

    def _retrieve_end(self) -> None:
        """Mark the fatal error aiokafka stored in its transaction-end future as seen: nobody
        awaits it once the writer is fenced, and asyncio would log it as never retrieved."""
        txn = self._producer._txn_manager
        waiter = None if txn is None else txn.wait_for_transaction_end()
        if waiter is not None and waiter.done() and not waiter.cancelled():
            waiter.exception()

    async def _settle(self) -> None:
        """Await a commit or abort in flight (bounded); the writer is then ready again."""
        if self._ending is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._ending), self._bus._timeout)
        except TimeoutError as exc:
            what = "commit" if self._committing else "abort"
            raise errors.TransactionInDoubt(
                f"{self._where()}: {what} not confirmed within {self._bus._timeout:g} s: the "
                "transaction may yet commit or abort (in doubt)"
            ) from exc
        except _TXN_ERRORS as exc:
            self._ending = None
            what = "commit" if self._committing else "abort"
            raise self._failed(what, exc) from exc
        self._ending = None
        self._opened_at = None
        self._state = "ready"

    async def _begin(self) -> None:
        await self._settle()
        if self._state == "ready":
            try:
                await self._producer.begin_transaction()
            except _TXN_ERRORS as exc:
                raise self._failed("begin", exc) from exc
            self._state = "open"
            self._opened_at = time.monotonic()
        elif self._state == "abortable":
            err = errors.BusError(f"{self._where()}: the transaction failed: abort() first")
            err.retriable = True
            raise err

    async def send(
        self, topic: str, key: str, value: bytes | None, *, partition: int | None = None
    ) -> None:
        """See :meth:`PartitionWriter.send`."""
        self._check()
        if value is not None and len(value) > self._bus._config.max_message_bytes:
            raise errors.DeliveryFailed(
                f"{topic}: record of {len(value)} bytes exceeds max_message_bytes="
                f"{self._bus._config.max_message_bytes}"
            )
        count = await self._bus.partitions(topic)
        if partition is None:
            partition = partition_for(key, count)
        elif not 0 <= partition < count:
            raise errors.BusError(f"{topic} has no partition {partition} (it has {count})")
        await self._begin()
        try:
            sent = await self._producer.send(
                self._bus._full(topic), value, key=key.encode(), partition=partition
            )
        except _TXN_ERRORS as exc:
            raise self._failed(f"send to {topic!r}", exc) from exc
        # A failed delivery fails the transaction, which commit() reports; retrieve the
        # exception here so that asyncio does not log it as never retrieved.
        sent.add_done_callback(lambda fut: fut.cancelled() or fut.exception())

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """See :meth:`PartitionWriter.commit`: ``send_offsets_to_transaction`` then
        ``commit_transaction`` (a transaction is opened for offsets alone if none is)."""
        self._check()
        if self._ending is None:
            await self._begin()
            kafka_offsets = {
                KafkaTP(self._bus._full(tp.topic), tp.partition): off for tp, off in offsets.items()
            }
            self._ending = asyncio.ensure_future(self._end_commit(kafka_offsets))
            self._committing = True
            self._state = "ending"
        await self._settle()

    async def _end_commit(self, offsets: dict[KafkaTP, int]) -> None:
        if offsets:
            await self._producer.send_offsets_to_transaction(offsets, self._group_id)
        await self._producer.commit_transaction()

    async def abort(self) -> None:
        """See :meth:`PartitionWriter.abort`."""
        self._check_quiet()
        if self._state in ("fenced", "closed", "ready"):
            return
        if self._state == "ending" and self._committing:
            raise errors.TransactionInDoubt(
                f"{self._where()}: a commit is in doubt and cannot be aborted: close the writer "
                "and open a new one"
            )
        if self._state in ("open", "abortable"):
            try:
                self._ending = asyncio.ensure_future(self._producer.abort_transaction())
            except _TXN_ERRORS as exc:
                raise self._failed("abort", exc) from exc
            self._committing = False
            self._state = "ending"
        await self._settle()

    def _check_quiet(self) -> None:
        try:
            self._check()
        except errors.BusError:
            return

    async def close(self) -> None:
        """See :meth:`PartitionWriter.close`: stops the producer (bounded)."""
        if self._state == "closed":
            return
        self._state = "closed"
        if self._ending is not None:
            self._ending.cancel()
        await _close_quietly(self._producer.stop(), self._bus._timeout)
        self._retrieve_end()  # a fatal error the sender hit while stopping


async def _stop_all(stops: Sequence[Awaitable[Any]], timeout_s: float) -> None:
    """:func:`_close_quietly` for each of ``stops``, all at once: every one begins within the
    event loop's next turns, so a caller cut short after that has still begun them all."""
    await asyncio.gather(*(_close_quietly(stop, timeout_s) for stop in stops))


async def _close_quietly(aw: Awaitable[Any], timeout_s: float) -> None:
    """Await a stop/close coroutine for at most ``timeout_s``; a broken connection is not an
    error while shutting down (aiokafka #1101: ``stop()`` can hang with the broker gone).

    After an outage a consumer's ``stop()`` raises the ``CancelledError`` of its fetcher task,
    which it cancelled in its retry back-off: that is swallowed too; a cancellation of the
    calling task goes on."""
    with contextlib.suppress(TimeoutError, KafkaError, OSError):
        try:
            await asyncio.wait_for(aw, timeout_s)
        except asyncio.CancelledError:
            caller = asyncio.current_task()
            if caller is None or caller.cancelling():
                raise
