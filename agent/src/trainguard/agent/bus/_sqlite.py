"""The embedded bus: Kafka's model (topics, partitions, offsets, consumer groups) on one SQLite
file that several processes on one machine share.

Design (schema and durability: :mod:`._sqlite_db`; groups: :mod:`._sqlite_groups`):

* Each bus object owns two connections, each on its own worker thread: a writer (appends,
  group writes, compaction) and a reader (consumer polls, queries), so polls never wait behind
  a commit. The event loop only queues calls and awaits their results.
* ``send`` queues the record and returns a future; one flusher task writes everything queued
  in one ``BEGIN IMMEDIATE`` transaction (group commit, at most :data:`MAX_BATCH` records)
  and resolves each future after its transaction committed. Records queued meanwhile form
  the next batch, so batches grow with the load and a lone record is not delayed.
* Offsets are allocated inside that transaction from the ``partitions`` table, so they are
  dense and ordered per partition however many processes write.
* Compacted topics: after a batch, a bus may run the compaction pass
  (:func:`._sqlite_log.compact`), at most once per ``compaction_interval_s`` over the whole
  file. Like Kafka's cleaner it keeps at least the latest record of every key and deletes
  only records older than ``compaction_lag_s``, so a consumer that keeps up still sees every
  command; readers skip the offsets it removed and never see records out of order.
* Records of topics that are not compacted are kept forever (no time-based retention).
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Concatenate, ParamSpec, TypeVar

import structlog

from trainguard.agent.bus import _sqlite_groups as groups
from trainguard.agent.bus import _sqlite_log as log
from trainguard.agent.bus._config import BusConfig, topic_prefixes
from trainguard.agent.bus._errors import BusClosed, BusError, DeliveryFailed
from trainguard.agent.bus._partitioner import partition_for
from trainguard.agent.bus._port import (
    Bus,
    Consumer,
    Delivery,
    PartitionWriter,
    Record,
    TopicPartition,
)
from trainguard.agent.bus._sqlite_consumer import ConsumerContext, Membership, SQLiteConsumer
from trainguard.agent.bus._sqlite_db import (
    ChangeWatch,
    ConnectionThread,
    TopicMeta,
    append_clock,
    load_topics,
    prepare,
    set_append_clock,
    take_write_lock,
    topic_names,
    translate,
    write_transaction,
)
from trainguard.agent.bus._sqlite_writer import SQLitePartitionWriter

__all__ = ["MAX_BATCH", "PROBE_LOCK_MIN_WATCH", "PROBE_LOCK_SHARE", "SQLiteBus"]

MAX_BATCH = 5000
"""Most records written in one transaction; bounds how long one process holds the lock."""

PROBE_LOCK_SHARE = 0.8
"""Share of a :meth:`SQLiteBus.probe`'s time given to waiting for the write lock: the probe
ends naming the lock before its caller's bound expires with no reason."""

PROBE_LOCK_MIN_WATCH = 0.25
"""Least share of a :meth:`SQLiteBus.probe`'s time the write lock must be watched, held with no
commit, to be called stuck (many of an agent's writes, each milliseconds); a shorter watch, left
when the probe's read was slow, answers and leaves the verdict to the next probe."""

_log = structlog.get_logger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

_Pending = tuple[int, int, str, bytes | None, asyncio.Future[Delivery], float]
"""A queued send: ``(topic_id, partition, key, value, future, deadline)``."""


class SQLiteBus(Bus):
    """The embedded bus on the SQLite file at ``path`` (see the module docstring).

    Args:
        config: bus settings; ``url``, ``replication_factor``, ``security`` and
            ``kafka_options`` are not used here. ``connect_timeout_s`` bounds ``start()``,
            ``send_timeout_s`` bounds each send and every group write (waiting for another
            process's lock), ``session_timeout_s`` is the consumer-group lease: a member that
            has not polled for this long loses its partitions (see :mod:`._sqlite_groups`).
        path: the database file; :meth:`start` creates it and its directory when missing,
            unless ``config.create`` is false.
            ``":memory:"`` is refused: the reader and writer would see two databases.
        compaction_lag_s: compacted topics keep every record at least this long, seconds
            (``min.compaction.lag.ms``).
        compaction_interval_s: at most one compaction pass per this many seconds per file.
        tombstone_retention_s: a tombstone that is the latest record of its key is deleted
            after this many seconds (``delete.retention.ms``, Kafka's default 1 day).

    Raises:
        BusError: for ``path=":memory:"``.
    """

    def __init__(
        self,
        config: BusConfig,
        path: str,
        *,
        compaction_lag_s: float = 60.0,
        compaction_interval_s: float = 30.0,
        tombstone_retention_s: float = 86_400.0,
    ) -> None:
        if path == ":memory:":
            raise BusError("the embedded bus needs a file; ':memory:' cannot be shared")
        self._config = config
        self._path = path
        self._compaction_lag_ms = int(compaction_lag_s * 1000)
        self._compaction_interval_s = compaction_interval_s
        self._tombstone_retention_ms = int(tombstone_retention_s * 1000)
        self._writer = ConnectionThread("trainguard-bus-writer")
        self._reader = ConnectionThread("trainguard-bus-reader")
        self._watch: ChangeWatch | None = None  # what idle consumers ask before polling
        # The probe's connection, opened by the first probe() (only the daemon probes); a task,
        # so that a probe cancelled by its caller's bound leaves the opening to finish.
        self._prober: asyncio.Task[ConnectionThread] | None = None
        self._state = "new"
        self._topics: dict[str, TopicMeta] = {}
        self._names: dict[int, str] = {}
        self._pending: list[_Pending] = []
        self._flusher: asyncio.Task[None] | None = None
        self._appended = asyncio.Event()
        self._consumers: set[SQLiteConsumer] = set()
        self._next_compaction = 0.0

    async def start(self) -> None:
        """Open the file, and with ``config.create`` (the default) create it, its directory
        and the missing topics first; without it, open an existing bus as it is.

        Raises :class:`~trainguard.agent.bus.BusUnavailable` when the file stays locked by
        other processes for ``connect_timeout_s``, :class:`BusError` when it cannot be created
        or opened (permissions, not a bus file, another schema version; without
        ``config.create``, a missing file or one holding no bus), :class:`BusClosed` after
        :meth:`close`.
        """
        if self._state == "closed":
            raise BusClosed("the bus is closed")
        if self._state == "open":
            raise BusError("start() was already called")
        create = self._config.create
        deadline = time.monotonic() + self._config.connect_timeout_s
        try:
            await self._writer.open(self._path, deadline, create=create)
            if create:
                await self._writer.run(prepare, self._config.prefix, self._config.topics, deadline)
            await self._reader.open(self._path, deadline, create=create)
            self._set_topics(await self._reader.run(load_topics, self._config.prefix))
            self._watch = await ChangeWatch.open(self._path)
        except BaseException as exc:
            await self._writer.close()
            await self._reader.close()
            # Fresh threads, so that start() may be tried again.
            self._writer = ConnectionThread("trainguard-bus-writer")
            self._reader = ConnectionThread("trainguard-bus-reader")
            if isinstance(exc, OSError):
                raise BusError(f"cannot create the bus file {self._path}: {exc}") from exc
            if isinstance(exc, sqlite3.Error):
                raise translate(exc, f"opening the bus file {self._path}") from exc
            raise
        self._state = "open"

    async def close(self) -> None:
        """Flush queued sends (up to ``send_timeout_s``), close consumers (leaving their
        groups) and the connections. Sends still not durable then fail with
        :class:`DeliveryFailed`. Idempotent."""
        if self._state == "closed":
            return
        was_open, self._state = self._state == "open", "closed"
        if self._flusher is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._flusher), self._config.send_timeout_s)
            except TimeoutError:
                self._flusher.cancel()
                self._fail(self._pending, "the bus closed before the record was written")
                self._pending.clear()
        for consumer in list(self._consumers):
            await consumer.close()
        if was_open:
            await self._writer.close()
            await self._reader.close()
        if self._watch is not None:
            self._watch.close()
        prober, self._prober = self._prober, None
        if prober is not None:
            if not prober.done():
                prober.cancel()  # an opening still under way closes its thread itself
            elif not prober.cancelled() and prober.exception() is None:
                await prober.result().close()

    async def partitions(self, topic: str) -> int:
        """See :meth:`Bus.partitions`. Raises :class:`BusError` for an unknown topic."""
        self._check_open()
        return (await self._topic(topic)).partitions

    async def send(
        self, topic: str, key: str, value: bytes | None, *, partition: int | None = None
    ) -> asyncio.Future[Delivery]:
        """See :meth:`Bus.send`.

        The future fails with :class:`DeliveryFailed` when ``value`` is longer than
        ``max_message_bytes`` or the record was not committed within ``send_timeout_s``
        (file locked by other processes, disk full). Raises :class:`BusError` for an unknown
        topic and :class:`BusClosed` after :meth:`close`.
        """
        self._check_open()
        meta = await self._topic(topic)
        self._check_open()  # close() may have run while the topic was looked up
        if partition is None:
            partition = partition_for(key, meta.partitions)
        elif not 0 <= partition < meta.partitions:
            raise BusError(f"{topic} has no partition {partition} (it has {meta.partitions})")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Delivery] = loop.create_future()
        if value is not None and len(value) > self._config.max_message_bytes:
            future.set_exception(
                DeliveryFailed(
                    f"{topic}: value of {len(value)} bytes exceeds max_message_bytes="
                    f"{self._config.max_message_bytes}"
                )
            )
            return future
        deadline = time.monotonic() + self._config.send_timeout_s
        self._pending.append((meta.topic_id, partition, key, value, future, deadline))
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush(), name="trainguard-bus-flush")
        return future

    async def subscribe(
        self,
        topics: Sequence[str],
        group_id: str,
        *,
        from_beginning: bool = True,
    ) -> Consumer:
        """See :meth:`Bus.subscribe`; the consumer's assignment is known on return.

        Raises :class:`BusError` for no or unknown topics,
        :class:`~trainguard.agent.bus.BusUnavailable` when the file stays locked.
        """
        self._check_open()
        if not topics:
            raise BusError("subscribe() needs at least one topic")
        for topic in topics:
            await self._topic(topic)
        membership = Membership(
            group_id=group_id,
            member_id=f"{self._config.client_id}-{os.getpid()}-{uuid.uuid4().hex[:12]}",
            topics=tuple(sorted({self._config.prefix + t for t in topics})),
            from_beginning=from_beginning,
        )
        consumer = SQLiteConsumer(self._consumer_context(), membership, {})
        self._consumers.add(consumer)
        try:
            await consumer.join()
        except BaseException:
            await consumer.close()
            raise
        return consumer

    async def assign(self, positions: Mapping[TopicPartition, int | None]) -> Consumer:
        """See :meth:`Bus.assign`. Raises :class:`BusError` for an unknown topic or partition
        or a negative offset."""
        self._check_open()
        for tp in positions:
            await self._topic(tp.topic)
        start: dict[tuple[int, int], int] = {}
        at_end: list[tuple[int, int]] = []
        for tp, offset in positions.items():
            key = self._resolve(tp)
            if offset is None:
                at_end.append(key)
            elif offset < 0:
                raise BusError(f"assign(): offset of {tp} must be >= 0, got {offset}")
            else:
                start[key] = offset
        if at_end:
            start.update(await self._read(log.end_offsets, at_end))
        consumer = SQLiteConsumer(self._consumer_context(), None, start)
        self._consumers.add(consumer)
        return consumer

    async def partition_writer(self, group_id: str, partition: int) -> PartitionWriter:
        """See :meth:`Bus.partition_writer` and :mod:`._sqlite_writer`. Raises
        :class:`BusError` when no consumer of this bus is a member of ``group_id``."""
        self._check_open()
        for consumer in self._consumers:
            membership = consumer.membership
            if membership is not None and membership.group_id == group_id:
                deadline = time.monotonic() + self._config.connect_timeout_s
                try:
                    epoch = await self._writer.run(
                        groups.open_writer, group_id, partition, deadline
                    )
                except sqlite3.Error as exc:
                    raise translate(exc, "opening a partition writer") from exc
                return SQLitePartitionWriter(
                    consumer,
                    membership,
                    partition,
                    epoch,
                    writer=self._writer,
                    topic=self._topics.get,
                    resolve=self._resolve,
                    appended=self._wake_consumers,
                    max_message_bytes=self._config.max_message_bytes,
                    timeout_s=self._config.send_timeout_s,
                )
        raise BusError(f"partition_writer(): this bus has no member of group {group_id!r}")

    def _wake_consumers(self) -> None:
        appended, self._appended = self._appended, asyncio.Event()
        appended.set()

    async def end_offsets(self, topic: str) -> dict[TopicPartition, int]:
        """See :meth:`Bus.end_offsets`. Raises :class:`BusError` for an unknown topic."""
        self._check_open()
        meta = await self._topic(topic)
        ends = await self._read(
            log.end_offsets, [(meta.topic_id, p) for p in range(meta.partitions)]
        )
        return {TopicPartition(topic, p): end for (_, p), end in sorted(ends.items())}

    async def probe(self, topic: str, timeout_s: float) -> dict[TopicPartition, int]:
        """See :meth:`Bus.probe`: the end offsets, then the file's write lock taken and given
        back at once (:func:`._sqlite_db.take_write_lock`) on a connection of the probe's own,
        opened by the first probe, so that it neither waits behind this bus's writes (a commit
        waiting for the same lock) nor delays its reads.

        Reads of a WAL file never wait for its write lock, so the end offsets alone answer
        while another process holds the lock (a ``sqlite3`` shell in ``BEGIN EXCLUSIVE``, a
        process stopped inside a write transaction) and nothing can be written. The lock is
        waited for up to :data:`PROBE_LOCK_SHARE` of ``timeout_s``, which a write
        transaction of an agent or of this bus (milliseconds, at most :data:`MAX_BATCH`
        records) never holds it for; a commit by another connection seen meanwhile answers at
        once (the lock moves): normal contention is no outage, and costs the probe about one
        look (:data:`._sqlite_db.LOCK_LOOK_S`), not its whole share. A lock is called stuck
        only after a watch of at least :data:`PROBE_LOCK_MIN_WATCH` of ``timeout_s``: when
        the read took so long that less is left (a loaded machine), the probe answers.

        Raises:
            BusUnavailable: the lock stayed held that long, and nobody committed meanwhile.
            BusError: for an unknown topic, or the file failed otherwise.
            BusClosed: after :meth:`close`.
        """
        deadline = time.monotonic() + PROBE_LOCK_SHARE * timeout_s
        ends = await self.end_offsets(topic)
        opening = self._prober
        if opening is None or (opening.done() and (opening.cancelled() or opening.exception())):
            opening = self._prober = asyncio.get_running_loop().create_task(
                self._open_prober(deadline), name="trainguard-bus-probe-open"
            )
        try:
            prober = await asyncio.shield(opening)
            await prober.run(take_write_lock, deadline, PROBE_LOCK_MIN_WATCH * timeout_s)
        except sqlite3.Error as exc:
            raise translate(exc, "taking the write lock") from exc
        return ends

    async def _open_prober(self, deadline: float) -> ConnectionThread:
        """The probe's connection to the file, opened before ``deadline`` (monotonic seconds).

        Raises :class:`sqlite3.Error` or :class:`BusError` as :meth:`ConnectionThread.open`.
        """
        prober = ConnectionThread("trainguard-bus-probe")
        try:
            await prober.open(self._path, deadline, create=False)
        except BaseException:
            await prober.close()
            raise
        return prober

    async def group_positions(self, group_id: str, topic: str) -> dict[TopicPartition, int]:
        """See :meth:`Bus.group_positions`: the group's stored offsets (``group_offsets``).
        Raises :class:`BusError` for an unknown topic."""
        self._check_open()
        meta = await self._topic(topic)
        positions = await self._read(groups.positions, group_id, meta.topic_id)
        return {TopicPartition(topic, p): offset for p, offset in sorted(positions.items())}

    async def latest_per_key(self, topic: str) -> dict[str, Record]:
        """See :meth:`Bus.latest_per_key`; proportional to the stored records of ``topic``
        (near one per key for a compacted topic). Raises :class:`BusError` for an unknown
        topic."""
        self._check_open()
        meta = await self._topic(topic)
        return await self._read(log.latest_per_key, meta.topic_id, topic)

    async def topic_names(self) -> frozenset[str]:
        """See :meth:`Bus.topic_names`: the names in the file's ``topics`` table."""
        self._check_open()
        return await self._read(topic_names)

    async def import_records(
        self,
        topic: str,
        records: Sequence[tuple[str, bytes | None, int]],
        *,
        clock_ms: int | None = None,
    ) -> list[Delivery]:
        """Append ``records`` (``(key, value, timestamp_ms)``) with the given append times.

        The one way to write a record with an append time other than now, for
        ``trainguard import`` (an exported job log must keep the bus times the daemon
        decided on, or a replay of it would decide differently) and ``trainguard sim`` (the
        simulated ranks' records, at simulated times). Kafka has no counterpart
        (trainguard's topics use ``LogAppendTime``, so the broker stamps every record itself).
        Each record goes to its key's partition; records are written in order, in
        transactions of at most :data:`MAX_BATCH`, bypassing the send queue; keep the times
        non-decreasing per partition, as the bus's own appends are. With ``clock_ms``, the
        file's simulated append clock (:meth:`set_append_clock`) moves to it in the
        transaction of the last batch (also when ``records`` is empty).

        Raises:
            BusError: an unknown topic or a value longer than ``max_message_bytes`` (nothing
                is written then), or the file could not be written
                (:class:`~trainguard.agent.bus.BusUnavailable` when it stayed locked for
                ``send_timeout_s``; the batches before the failed one were written).
            BusClosed: after :meth:`close`.
        """
        self._check_open()
        meta = await self._topic(topic)
        for _, value, _ in records:
            if value is not None and len(value) > self._config.max_message_bytes:
                raise BusError(
                    f"{topic}: value of {len(value)} bytes exceeds max_message_bytes="
                    f"{self._config.max_message_bytes}"
                )
        deliveries: list[Delivery] = []
        starts = range(0, max(len(records), 1), MAX_BATCH)
        for first in starts:
            rows = [
                (meta.topic_id, partition_for(key, meta.partitions), key, value, ts)
                for key, value, ts in records[first : first + MAX_BATCH]
            ]
            deadline = time.monotonic() + self._config.send_timeout_s
            clock = clock_ms if first == starts[-1] else None
            try:
                offsets = await self._writer.run(log.append_stamped, rows, deadline, clock)
            except sqlite3.Error as exc:
                raise translate(exc, f"importing records into {topic}") from exc
            deliveries.extend(
                Delivery(topic, row[1], offset) for row, offset in zip(rows, offsets, strict=True)
            )
        if deliveries:
            appended, self._appended = self._appended, asyncio.Event()
            appended.set()
        return deliveries

    async def set_append_clock(self, at_ms: int | None) -> None:
        """Set the file's simulated append clock: from now on every record any process
        appends to this file is stamped ``at_ms`` (ms since the Unix epoch) instead of the wall
        clock's time, until it is set again; ``None`` removes it (wall clock again).

        For ``trainguard sim`` only, which drives simulated time on the embedded bus; keep it
        non-decreasing, as append times are. Consumer-group leases and compaction keep the wall
        clock.

        Raises:
            BusError: the file could not be written (:class:`~trainguard.agent.bus.BusUnavailable`
                when it stayed locked for ``send_timeout_s``).
            BusClosed: after :meth:`close`.
        """
        self._check_open()
        deadline = time.monotonic() + self._config.send_timeout_s
        try:
            await self._writer.run(_write_append_clock, at_ms, deadline)
        except sqlite3.Error as exc:
            raise translate(exc, "setting the append clock") from exc

    async def append_clock(self) -> int | None:
        """The file's simulated append clock (ms since the Unix epoch), or ``None`` when
        appends take the wall clock (:meth:`set_append_clock`).

        Raises:
            BusError: the file could not be read. BusClosed: after :meth:`close`.
        """
        self._check_open()
        return await self._read(append_clock)

    def _check_open(self) -> None:
        if self._state == "closed":
            raise BusClosed("the bus is closed")
        if self._state == "new":
            raise BusError("the bus is not started: call start() or use 'async with'")

    def _set_topics(self, topics: dict[str, TopicMeta]) -> None:
        self._topics = topics
        self._names = {meta.topic_id: name for name, meta in topics.items()}

    async def _topic(self, name: str) -> TopicMeta:
        meta = self._topics.get(name)
        if meta is None:
            # Another process may have created it since start().
            self._set_topics(await self._read(load_topics, self._config.prefix))
            meta = self._topics.get(name)
            if meta is None:
                raise BusError(await self._unknown_topic(name))
        return meta

    async def _unknown_topic(self, name: str) -> str:
        """Why ``name`` is unknown, naming the prefixes the file does hold topics under (a
        reader given a mistyped ``--topic-prefix`` learns the right one)."""
        others = [
            p for p in topic_prefixes(await self._read(topic_names)) if p != self._config.prefix
        ]
        found = (
            f"found topics under {', '.join(map(repr, others))}"
            if others
            else "it holds no other topic prefix"
        )
        return (
            f"unknown topic {name!r} (prefix {self._config.prefix!r}) on the embedded bus "
            f"{self._path}; {found}"
        )

    def _resolve(self, tp: TopicPartition) -> tuple[int, int]:
        meta = self._topics.get(tp.topic)
        if meta is None:
            raise BusError(f"unknown topic {tp.topic!r} (prefix {self._config.prefix!r})")
        if not 0 <= tp.partition < meta.partitions:
            raise BusError(f"{tp}: topic {tp.topic!r} has {meta.partitions} partitions")
        return meta.topic_id, tp.partition

    async def _read(
        self,
        fn: Callable[Concatenate[sqlite3.Connection, P], T],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        try:
            return await self._reader.run(fn, *args, **kwargs)
        except sqlite3.Error as exc:
            raise translate(exc, fn.__name__) from exc

    def _consumer_context(self) -> ConsumerContext:
        return ConsumerContext(
            reader=self._reader,
            writer=self._writer,
            names=self._names,
            resolve=self._resolve,
            wait_for_append=self._wait_for_append,
            data_version=self._data_version,
            bus_closed=lambda: self._state == "closed",
            forget=self._consumers.discard,
            write_timeout_s=self._config.send_timeout_s,
            session_timeout_s=self._config.session_timeout_s,
            max_poll_interval_s=self._config.max_poll_interval_s,
            idle_poll_s=self._config.idle_poll_s,
        )

    def _data_version(self) -> int | None:
        return None if self._watch is None else self._watch.version()

    async def _wait_for_append(self, timeout_s: float) -> bool:
        appended = self._appended
        try:
            async with asyncio.timeout(timeout_s):
                await appended.wait()
        except TimeoutError:
            return False
        return True

    async def _flush(self) -> None:
        """Write queued records batch by batch until the queue is empty (group commit)."""
        while self._pending:
            batch = self._pending[:MAX_BATCH]
            del self._pending[:MAX_BATCH]
            rows = [(topic_id, p, key, value) for topic_id, p, key, value, _, _ in batch]
            try:
                offsets, _ = await self._writer.run(
                    log.append, rows, min(entry[5] for entry in batch)
                )
            except asyncio.CancelledError:
                self._fail(batch, "the bus closed before the record was confirmed")
                raise
            except Exception as exc:
                self._fail(batch, f"record not written: {exc}")
                continue
            for (topic_id, partition, _, _, future, _), offset in zip(batch, offsets, strict=True):
                if not future.done():
                    future.set_result(Delivery(self._names[topic_id], partition, offset))
            appended, self._appended = self._appended, asyncio.Event()
            appended.set()
            await self._maybe_compact()

    async def _maybe_compact(self) -> None:
        now = time.monotonic()
        if now < self._next_compaction:
            return
        self._next_compaction = now + self._compaction_interval_s
        try:
            await self._writer.run(
                log.compact,
                self._compaction_lag_ms,
                self._tombstone_retention_ms,
                int(self._compaction_interval_s * 1000),
                now + 1.0,
            )
        except sqlite3.Error as exc:
            # Compaction only saves space; the next interval tries again.
            _log.warning("bus_compaction_failed", path=self._path, error=str(exc))

    def _fail(self, batch: Sequence[_Pending], reason: str) -> None:
        for topic_id, _, _, _, future, _ in batch:
            if not future.done():
                future.set_exception(DeliveryFailed(f"{self._names[topic_id]}: {reason}"))


def _write_append_clock(conn: sqlite3.Connection, at_ms: int | None, deadline: float) -> None:
    """Set (or with ``None`` remove) the file's simulated append clock in a transaction of its
    own (runs on the writer thread)."""
    with write_transaction(conn, deadline):
        set_append_clock(conn, at_ms)
