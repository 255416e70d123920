"""The embedded bus's partition writer: a group member's writes for one partition, buffered
in memory and written with the member's consumed positions in one SQLite transaction.

Opening a writer bumps the partition's writer epoch in the file
(:func:`._sqlite_groups.open_writer`), as a Kafka producer's ``init_transactions`` does. The
commit's transaction checks, under the file's write lock, that no newer writer was opened and
that the member still owns the partition (:func:`._sqlite_groups.write_owned`); the writer
also refuses once its consumer's assignment epoch moved (a rejoin). Either way it is fenced
and nothing it buffered is ever written, so two daemons on one file never both act on one
record: a member that stopped polling while another owned its partition for a while (and left
again) is fenced by that other's writer even though the partition is its own again.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Mapping

from trainguard.agent.bus import _sqlite_groups as groups
from trainguard.agent.bus._errors import BusClosed, BusError, DeliveryFailed, Fenced
from trainguard.agent.bus._partitioner import partition_for
from trainguard.agent.bus._port import PartitionWriter, TopicPartition
from trainguard.agent.bus._sqlite_consumer import Membership, SQLiteConsumer
from trainguard.agent.bus._sqlite_db import ConnectionThread, TopicMeta, translate
from trainguard.agent.bus._sqlite_log import Row

__all__ = ["SQLitePartitionWriter"]


class SQLitePartitionWriter(PartitionWriter):
    """See :meth:`trainguard.agent.bus.Bus.partition_writer` and the module docstring.

    Args:
        consumer: the bus's member of the group; the writer is bound to its current
            assignment epoch.
        membership: that consumer's membership.
        writer_epoch: this writer's epoch (:func:`._sqlite_groups.open_writer`); a writer
            opened later for the partition fences this one.
        partition: the owned partition of the group's topics.
        writer: the bus's writer connection thread.
        topic: logical topic name -> its metadata (raises :class:`BusError` if unknown).
        resolve: logical :class:`TopicPartition` -> ``(topic_id, partition)``.
        appended: called after a commit wrote records (wakes this bus's consumers).
        max_message_bytes: largest value accepted.
        timeout_s: how long a commit may wait for the file's lock, seconds.
    """

    def __init__(
        self,
        consumer: SQLiteConsumer,
        membership: Membership,
        partition: int,
        writer_epoch: int,
        *,
        writer: ConnectionThread,
        topic: Callable[[str], TopicMeta | None],
        resolve: Callable[[TopicPartition], tuple[int, int]],
        appended: Callable[[], None],
        max_message_bytes: int,
        timeout_s: float,
    ) -> None:
        self._consumer = consumer
        self._membership = membership
        self._epoch = consumer.assignment_epoch()
        self._partition = partition
        self._writer_epoch = writer_epoch
        self._writer = writer
        self._topic = topic
        self._resolve = resolve
        self._appended = appended
        self._max = max_message_bytes
        self._timeout_s = timeout_s
        self._rows: list[Row] = []
        self._state = "open"

    @property
    def writer_id(self) -> str:
        """See :attr:`PartitionWriter.writer_id`."""
        return f"daemon-{self._partition} (writer epoch {self._writer_epoch})"

    def _check(self) -> None:
        if self._state == "closed":
            raise BusClosed(f"writer of partition {self._partition} is closed")
        if self._state == "fenced" or not self._consumer.owns(self._partition, self._epoch):
            self._state = "fenced"
            self._rows.clear()
            raise Fenced(
                f"partition {self._partition} is no longer this member's "
                "(its assignment changed or its lease ended)"
            )

    async def send(
        self, topic: str, key: str, value: bytes | None, *, partition: int | None = None
    ) -> None:
        """See :meth:`PartitionWriter.send`: buffered until :meth:`commit`."""
        self._check()
        meta = self._topic(topic)
        if meta is None:
            raise BusError(f"unknown topic {topic!r}")
        if partition is None:
            partition = partition_for(key, meta.partitions)
        elif not 0 <= partition < meta.partitions:
            raise BusError(f"{topic} has no partition {partition} (it has {meta.partitions})")
        if value is not None and len(value) > self._max:
            raise DeliveryFailed(
                f"{topic}: value of {len(value)} bytes exceeds max_message_bytes={self._max}"
            )
        self._rows.append((meta.topic_id, partition, key, value))

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """See :meth:`PartitionWriter.commit`: one write transaction that checks ownership,
        appends the buffered records and stores ``offsets``."""
        self._check()
        positions = {self._resolve(tp): offset for tp, offset in offsets.items()}
        if any(offset < 0 for offset in positions.values()):
            raise BusError(f"commit(): offsets must be >= 0, got {dict(offsets)}")
        rows, self._rows = self._rows, []
        try:
            await self._writer.run(
                groups.write_owned,
                self._membership.group_id,
                self._membership.member_id,
                self._partition,
                self._writer_epoch,
                rows,
                positions,
                time.monotonic() + self._timeout_s,
            )
        except groups.NotOwner as exc:
            self._state = "fenced"
            raise Fenced(
                f"partition {self._partition}: a newer writer was opened, it is another "
                "member's now, or this member's lease ended: nothing written"
            ) from exc
        except sqlite3.Error as exc:
            # Nothing was written (the transaction rolled back); the caller aborts and goes on.
            raise translate(exc, "partition commit") from exc
        if rows:
            self._appended()

    async def abort(self) -> None:
        """See :meth:`PartitionWriter.abort`: drops the buffered records."""
        self._rows.clear()

    async def close(self) -> None:
        """See :meth:`PartitionWriter.close`."""
        self._rows.clear()
        self._state = "closed"
