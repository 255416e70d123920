"""The bus port: the one small async interface every party of trainguard talks through.

Two adapters implement it: :mod:`._kafka` (Apache Kafka through aiokafka) and :mod:`._sqlite`
(the embedded bus, one SQLite file). Both give Kafka's model: named topics split into
partitions, each partition an append-only log of records with offsets 0, 1, 2, ...; the
partition of a record is chosen from its key (murmur2, as Kafka's default partitioner), so all
records with one key (one job) are totally ordered. Consumers either join a consumer group,
which assigns each partition to one member and stores the group's committed positions, or read
from explicit offsets without a group.

Semantics shared by both adapters (tested by ``tests/contract/bus/test_contract.py``):

* ``send``/``publish`` are at-least-once; a record is durable once its delivery resolved.
* Order is kept per partition, hence per key.
* A committed position is the offset of the *next* record to read (Kafka's convention).
* A consumer group member that restarts resumes at the committed positions; records after
  them are delivered again (at-least-once), none before them is lost.
* A :class:`PartitionWriter` makes a group member's writes and its consumed position of one
  partition visible together or not at all (exactly-once processing), and is fenced
  (:class:`~trainguard.agent.bus.Fenced`) once the partition has a newer owner. Readers see
  only committed writes (Kafka consumers read with ``isolation_level="read_committed"``).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import NamedTuple, Self

__all__ = [
    "Bus",
    "Consumer",
    "Delivery",
    "PartitionWriter",
    "Record",
    "TopicPartition",
    "TopicSpec",
]


@dataclass(frozen=True, slots=True, order=True)
class TopicPartition:
    """A (topic, partition) pair; ``topic`` is the logical name (``"events"``)."""

    topic: str
    partition: int


class Record(NamedTuple):
    """One record read from the bus.

    A named tuple rather than a frozen dataclass: a consumer builds one per record, and a
    named tuple costs a third of a frozen dataclass to build (0.17 against 0.49 us, six
    fields, CPython 3.11); a replay reads a million of them.

    Attributes:
        topic: logical topic name (``"events"``), without the bus's prefix.
        partition: partition number, >= 0.
        offset: position in the partition, >= 0, strictly increasing.
        key: the record key (a job id for trainguard's topics), or ``None``.
        value: the payload bytes, or ``None`` for a tombstone on a compacted topic.
        timestamp_ms: time the bus appended the record, milliseconds since the Unix epoch.
    """

    topic: str
    partition: int
    offset: int
    key: str | None
    value: bytes | None
    timestamp_ms: int

    @property
    def tp(self) -> TopicPartition:
        """The record's topic partition."""
        return TopicPartition(self.topic, self.partition)


@dataclass(frozen=True, slots=True)
class Delivery:
    """Where a published record landed."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """A topic the bus creates on start-up if it does not exist.

    Attributes:
        name: logical name (``events``, ``commands``, ...); the bus adds its prefix.
        partitions: number of partitions, >= 1. Never changed for a live topic: it would move
            keys to other partitions and break per-job order.
        compacted: ``cleanup.policy=compact`` (keep at least the latest record per key) instead
            of time-based deletion.
        retention_ms: Kafka's ``retention.ms`` for a topic that is not compacted: ``None``
            leaves the broker's default (``log.retention.hours``, 7 days unless configured),
            ``-1`` keeps every record forever. Set when the topic is created only (change a
            live topic with ``kafka-configs.sh --alter``). The embedded bus keeps the records of
            every topic that is not compacted forever.
        segment_ms: Kafka's ``segment.ms`` (a segment is closed after this long), set when the
            topic is created: ``None`` leaves the broker's default (7 days). Kafka compacts
            only closed segments, so a compacted topic read whole at every start (``snapshots``,
            whose large jobs write megabytes of chunks per round) keeps every superseded record
            until its segment closes. The embedded bus compacts by age alone and ignores it.
    """

    name: str
    partitions: int = 1
    compacted: bool = False
    retention_ms: int | None = None
    segment_ms: int | None = None


class Consumer(abc.ABC):
    """Reads records from the bus; get one from :meth:`Bus.subscribe` or :meth:`Bus.assign`.

    Use as an async context manager, or call :meth:`close`.
    """

    @abc.abstractmethod
    async def getmany(self, timeout_s: float = 1.0, max_records: int = 1000) -> list[Record]:
        """Return the next records, waiting up to ``timeout_s`` seconds for at least one.

        Records of one partition come in offset order; an empty list means nothing arrived in
        time. Raises :class:`~trainguard.agent.bus.BusClosed` after :meth:`close`.
        """

    @abc.abstractmethod
    async def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        """Store the group's committed positions (offset of the next record to read).

        With ``offsets=None`` commits the position after the last record returned by
        :meth:`getmany` for every assigned partition. Raises
        :class:`~trainguard.agent.bus.BusError` for a consumer without a group.
        """

    @abc.abstractmethod
    async def committed(self, tp: TopicPartition) -> int | None:
        """The group's committed position for ``tp``, or ``None`` when it has none.

        Raises :class:`~trainguard.agent.bus.BusError` for a consumer without a group.
        """

    @abc.abstractmethod
    async def seek(self, tp: TopicPartition, offset: int) -> None:
        """Make the next :meth:`getmany` for ``tp`` start at ``offset``."""

    @abc.abstractmethod
    async def position(self, tp: TopicPartition) -> int:
        """The offset of the next record :meth:`getmany` may return for assigned ``tp``.

        Past every offset that no record carries (Kafka's transaction markers, records
        removed by compaction), so a reader that wants everything up to an end offset from
        :meth:`Bus.end_offsets` compares this, not the last record's offset + 1: the offsets
        just before the end of a partition written in transactions are markers. Raises
        :class:`~trainguard.agent.bus.BusError` for a partition not assigned.
        """

    @abc.abstractmethod
    def assignment(self) -> frozenset[TopicPartition]:
        """The partitions this consumer currently reads (for a group member: those of the
        group's latest assignment to it, empty while a rebalance is under way)."""

    @abc.abstractmethod
    def assignment_epoch(self) -> int:
        """A counter that grows whenever this member's partitions may have changed hands.

        Bumped by every revocation and every assignment the group makes (Kafka: each
        ``ConsumerRebalanceListener`` callback; embedded bus: a change of the member's share,
        or a rejoin after its lease ended), even when the member gets the very partitions back
        that it had: another member may have owned and written them meanwhile. A caller that
        keeps state per partition compares it after each :meth:`getmany` and, when it moved,
        drops that poll's records and rebuilds from the committed positions. Always 0 for a
        consumer made by :meth:`Bus.assign`.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Leave the group (if any) and release resources. Does not commit."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class PartitionWriter(abc.ABC):
    """Writes of one consumer-group member for one partition it owns, made visible together
    with the member's consumed position of that partition (get one from
    :meth:`Bus.partition_writer`).

    Records sent are invisible to every reader (Kafka: to ``read_committed`` readers) until
    :meth:`commit`, which makes them and the given positions durable atomically; after
    :meth:`abort`, or when the writer is fenced or the process dies, they never appear. Not
    safe for concurrent use by several tasks.
    """

    @property
    @abc.abstractmethod
    def writer_id(self) -> str:
        """How the bus names this writer, for logs: on Kafka its transactional id
        (``{prefix}daemon-{partition}``), on the embedded bus ``daemon-{partition}`` and its
        writer epoch."""

    @abc.abstractmethod
    async def send(
        self, topic: str, key: str, value: bytes | None, *, partition: int | None = None
    ) -> None:
        """Add one record to the open transaction, opening one if none is; returns without
        waiting for the bus. ``value=None`` writes a tombstone.

        The record goes to ``key``'s partition of logical ``topic``, or to ``partition`` when
        given: records under keys of their own that must sit with another key's records (a
        job's snapshot chunks, whose keys would hash elsewhere) name that key's partition.

        Raises:
            DeliveryFailed: the value is over ``max_message_bytes``: nothing was added, the
                transaction goes on.
            Fenced: the writer was fenced; it is unusable.
            BusError: an unknown topic, a ``partition`` the topic does not have, the writer
                closed, or (retriable) the bus refused the record: :meth:`abort`, then go on.
        """

    @abc.abstractmethod
    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Make every record sent since the last commit or abort visible, together with
        ``offsets`` (the group's committed positions: offset of the next record to read), or
        nothing of them. Bounded by the bus's send timeout.

        Raises:
            Fenced: the partition has a newer owner; nothing of this transaction is visible,
                and the writer is unusable.
            TransactionExpired: (a :class:`Fenced`; Kafka) the transaction outlived
                ``transaction.timeout.ms`` and the coordinator aborted it: nothing of it is
                visible, and the writer is unusable.
            TransactionInDoubt: no answer within the send timeout: the transaction may yet
                commit or abort. The caller must close the writer and open a new one (whose
                opening settles it) before reading the committed positions again.
            BusError: anything else (retriable): nothing of this transaction became visible if
                :meth:`abort` then succeeds; if :meth:`abort` raises too, the outcome is in
                doubt (as above).
        """

    @abc.abstractmethod
    async def abort(self) -> None:
        """Drop every record sent since the last commit; a no-op on a fenced writer.

        Raises:
            BusError: the abort could not be completed (see :meth:`commit`).
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the writer; an open transaction is aborted (by the bus, at the latest when
        a new writer for the partition opens). Never raises. Idempotent."""


class Bus(abc.ABC):
    """A connection to the message bus. Use as an async context manager.

    ``start()`` connects and creates the configured topics; every other method needs a
    started bus. Topic names everywhere (arguments, :class:`Record`, :class:`TopicPartition`)
    are logical names (``"events"``); the adapter adds and strips its configured prefix.
    """

    @abc.abstractmethod
    async def start(self) -> None:
        """Connect and create missing topics.

        Raises :class:`~trainguard.agent.bus.BusUnavailable` when the bus cannot be reached
        within the configured connect timeout.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush pending sends (bounded by the configured timeout) and disconnect."""

    @abc.abstractmethod
    async def partitions(self, topic: str) -> int:
        """Number of partitions of logical topic ``topic``."""

    @abc.abstractmethod
    async def send(
        self, topic: str, key: str, value: bytes | None, *, partition: int | None = None
    ) -> asyncio.Future[Delivery]:
        """Queue one record and return a future that resolves once it is durable.

        Returning before delivery lets callers pipeline many sends; the future raises
        :class:`~trainguard.agent.bus.BusError` if the record could not be delivered.
        ``value=None`` writes a tombstone. The record goes to ``key``'s partition, or to
        ``partition`` when given (as :meth:`PartitionWriter.send`); a partition the topic
        does not have raises :class:`~trainguard.agent.bus.BusError`.
        """

    async def publish(
        self, topic: str, key: str, value: bytes | None, *, partition: int | None = None
    ) -> Delivery:
        """Send one record and wait until it is durable (bounded by the send timeout)."""
        return await (await self.send(topic, key, value, partition=partition))

    @abc.abstractmethod
    async def subscribe(
        self,
        topics: Sequence[str],
        group_id: str,
        *,
        from_beginning: bool = True,
    ) -> Consumer:
        """Join consumer group ``group_id`` on ``topics``.

        The group shares the partitions among its members and keeps their committed positions.
        A partition without a committed position starts at its first record when
        ``from_beginning`` is true, else at its end.
        """

    @abc.abstractmethod
    async def assign(self, positions: Mapping[TopicPartition, int | None]) -> Consumer:
        """Read the given partitions without a group, each from an explicit offset.

        ``None`` means the partition's end (only records appended later are read).
        """

    @abc.abstractmethod
    async def partition_writer(self, group_id: str, partition: int) -> PartitionWriter:
        """Open the transactional writer of this bus's member of ``group_id`` for
        ``partition`` of the topic the group consumes, fencing every earlier writer of it.

        Call it only for a partition the group assigned to this member (after the assignment
        epoch moved), and read the group's committed position of the partition only after it
        returned: opening settles the previous owner's open transaction (aborted, or completed
        if it was committing), so the position read then is stable. Kafka: one transactional
        producer with ``transactional_id = f"{prefix}daemon-{partition}"``; embedded bus: the
        records are buffered and written in the commit's SQLite transaction, which checks that
        the member still owns the partition.

        Raises:
            BusUnavailable: the bus did not answer within the connect timeout.
            BusError: (embedded bus) this bus has no member of ``group_id``.
        """

    @abc.abstractmethod
    async def end_offsets(self, topic: str) -> dict[TopicPartition, int]:
        """Offset the next record appended to each partition of ``topic`` will get."""

    async def probe(self, topic: str, timeout_s: float) -> dict[TopicPartition, int]:
        """:meth:`end_offsets` of ``topic``, asked to learn whether the bus can be used now:
        the daemon's bus watch takes no answer within ``timeout_s`` seconds (it bounds the
        call), or an error, for an outage. An adapter for which reading tells too little
        checks more, within ``timeout_s`` (the embedded bus: that its file can be written).

        Raises:
            BusUnavailable: the bus cannot be used now.
            BusError: the bus failed otherwise.
        """
        return await self.end_offsets(topic)

    @abc.abstractmethod
    async def group_positions(self, group_id: str, topic: str) -> dict[TopicPartition, int]:
        """The committed positions of consumer group ``group_id`` on ``topic``, read without
        joining the group: partition -> offset of the next record the group will read.
        Partitions the group has committed nothing for are left out (a group that never
        committed, e.g. because no such group exists, gives ``{}``).

        Lets a process that writes records see whether the group's members (the daemon) have
        consumed them, without disturbing the group. Raises
        :class:`~trainguard.agent.bus.BusError` when the bus cannot answer (on Kafka, also
        when this client may not describe the group).
        """

    @abc.abstractmethod
    async def latest_per_key(self, topic: str) -> dict[str, Record]:
        """The latest record of every key of ``topic`` (a compacted topic's view).

        Keys whose latest record is a tombstone are left out.
        """

    @abc.abstractmethod
    async def topic_names(self) -> frozenset[str]:
        """Every topic on the bus, as full names (prefix included), whatever its prefix:
        lets a reader that found nothing say which prefixes do hold topics
        (:func:`~trainguard.agent.bus.topic_prefixes`)."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
