"""The embedded bus's consumer: polls the SQLite file from its reader thread.

Idle consumers poll. Between polls a consumer sleeps from 2 ms, doubling up to
``BusConfig.idle_poll_s`` (default 20 ms) while idle, and wakes at once when its own bus
appended records. So a record from another process arrives within about ``idle_poll_s``, one
from the same bus without delay. The cadence belongs to the consumer, not to one
:meth:`~SQLiteConsumer.getmany`: a caller polling in a loop with a short timeout (the daemon's
50 ms) does not restart it at 2 ms each time (an idle daemon polled about 110 times a second
that way). A poll is a hop to the reader thread and back, most of an idle poll's cost (about
0.3 ms of CPU here), so it is made only when the file's ``PRAGMA data_version``, read on the
event loop's thread (:class:`~._sqlite_db.ChangeWatch`, 4 us), moved since the previous poll:
it changes whenever another connection (any process, or this bus's own writer) committed to
the file. The reader thread checks it again before its queries.

Group members renew their lease from a task of their own (the keeper), as Kafka's consumer
heartbeats from a thread of its own, so that a consumer whose owner is busy between polls (a
daemon sealing a large state snapshot on a loaded machine) keeps its partitions; a paused or
dead process does not renew, and one that stopped polling stops renewing after
``max_poll_interval_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from trainguard.agent.bus import _sqlite_groups as groups
from trainguard.agent.bus import _sqlite_log as log
from trainguard.agent.bus._errors import BusClosed, BusError
from trainguard.agent.bus._port import Consumer, Record, TopicPartition
from trainguard.agent.bus._sqlite_db import (
    ConnectionThread,
    now_ms,
    read_transaction,
    translate,
)

__all__ = ["ConsumerContext", "Membership", "SQLiteConsumer", "new_member_id"]

_POLL_MIN_S = 0.002

_TP = tuple[int, int]


@dataclass(frozen=True, slots=True)
class ConsumerContext:
    """What a consumer shares with the bus that made it.

    Attributes:
        reader, writer: the bus's connection threads (reads; group writes).
        names: topic id -> logical topic name, for the bus's topics.
        resolve: logical :class:`TopicPartition` -> ``(topic_id, partition)``; raises
            :class:`BusError` for an unknown topic or partition.
        wait_for_append: sleeps up to the given seconds or until the bus appends records;
            returns whether an append woke it.
        data_version: the file's ``data_version`` read on the event loop's thread without
            waiting (:class:`~._sqlite_db.ChangeWatch`), ``None`` when it cannot tell.
        bus_closed: whether the bus was closed.
        forget: called with the consumer when it closes.
        write_timeout_s: how long group writes may wait for the file's lock, seconds.
        session_timeout_s: group lease length, seconds.
        max_poll_interval_s: the keeper stops renewing a member that has not polled for this
            long, seconds.
        idle_poll_s: longest sleep between polls of an idle consumer, seconds.
    """

    reader: ConnectionThread
    writer: ConnectionThread
    names: Mapping[int, str]
    resolve: Callable[[TopicPartition], _TP]
    wait_for_append: Callable[[float], Awaitable[bool]]
    data_version: Callable[[], int | None]
    bus_closed: Callable[[], bool]
    forget: Callable[[SQLiteConsumer], None]
    write_timeout_s: float
    session_timeout_s: float
    max_poll_interval_s: float
    idle_poll_s: float


@dataclass(frozen=True, slots=True)
class Membership:
    """A consumer's group membership.

    Attributes:
        group_id: the consumer group.
        member_id: this member, unique per consumer object.
        topics: subscribed topics, stored (prefixed) names.
        from_beginning: where partitions without a committed position start (0 or the end).
    """

    group_id: str
    member_id: str
    topics: tuple[str, ...]
    from_beginning: bool


def new_member_id(member_id: str) -> str:
    """A fresh member id like ``member_id`` (``<client>-<pid>-<12 hex>``): a new random tail."""
    return f"{member_id.rpartition('-')[0]}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, slots=True)
class _Polled:
    version: int
    positions: dict[_TP, int]
    records: list[Record]
    more: bool
    first_expiry_ms: int | None


def _poll(
    conn: sqlite3.Connection,
    seen_version: int | None,
    force: bool,
    membership: Membership | None,
    positions: dict[_TP, int],
    names: Mapping[int, str],
    max_records: int,
    first: int,
    now: int,
) -> _Polled | None:
    """One poll on the reader thread: ``None`` when the file did not change since
    ``seen_version`` (and not ``force``), else the new assignment's positions after the
    records read. ``positions`` is the caller's copy and is updated in place."""
    version: int = conn.execute("PRAGMA data_version").fetchone()[0]
    if version == seen_version and not force:
        return None
    with read_transaction(conn):
        gained: frozenset[_TP] = frozenset()
        first_expiry = None
        if membership is not None:
            mine, first_expiry = groups.owned(conn, membership.group_id, membership.member_id, now)
            for tp in positions.keys() - mine:
                del positions[tp]
            gained = mine - positions.keys()
        ends = log.end_offsets(conn, positions.keys() | gained)
        if membership is not None and gained:
            positions.update(
                groups.start_positions(
                    conn, membership.group_id, gained, ends, membership.from_beginning
                )
            )
        records, more = log.read(conn, positions, ends, names, max_records, first)
    return _Polled(version, positions, records, more, first_expiry)


class SQLiteConsumer(Consumer):
    """A consumer of the embedded bus; made by :meth:`SQLiteBus.subscribe` or ``assign``.

    Group members renew their lease (``session_timeout_s``) every third of it from a task of
    their own while their event loop runs, as long as :meth:`getmany` was called within
    ``max_poll_interval_s``: a member whose process is paused or dead for a whole session, or
    that stopped polling for longer than ``max_poll_interval_s``, loses its partitions to the
    others (it rejoins at its next poll), as with Kafka's ``session.timeout.ms`` and
    ``max.poll.interval.ms``. Not safe for concurrent use by several tasks, like aiokafka's.
    """

    def __init__(
        self,
        context: ConsumerContext,
        membership: Membership | None,
        positions: dict[_TP, int],
    ) -> None:
        self._ctx = context
        self._membership = membership
        self._positions = positions
        self._seen_version: int | None = None
        self._dirty = True
        self._refresh_at_ms: int | None = None
        self._epoch = 0
        self._assignment_epoch = 0
        self._joined = False
        self._first = 0
        self._heartbeat_due = 0.0
        self._polled_at = 0.0
        self._idle_delay = _POLL_MIN_S  # the next sleep of the idle cadence, seconds
        self._next_poll_at = 0.0  # event loop time when the idle cadence polls again
        self._watched: int | None = None  # the change watch's answer before the last poll
        self._keeper: asyncio.Task[None] | None = None
        self._renewing = asyncio.Lock()
        self._closed = False

    async def join(self) -> None:
        """Register the group membership and compute the first assignment.

        Raises :class:`BusError` (e.g. :class:`~trainguard.agent.bus.BusUnavailable`).
        """
        if self._membership is not None:
            await self._heartbeat(self._membership)
        await self._poll(0)
        self._polled_at = asyncio.get_running_loop().time()
        self._keep_lease()

    async def getmany(self, timeout_s: float = 1.0, max_records: int = 1000) -> list[Record]:
        """See :meth:`Consumer.getmany`. Also renews the group lease when due."""
        self._check_open()
        loop = asyncio.get_running_loop()
        self._polled_at = loop.time()
        self._keep_lease()
        deadline = loop.time() + timeout_s
        woken = False
        while True:
            membership = self._membership  # a rejoin replaces it
            if membership is not None and loop.time() >= self._heartbeat_due:
                await self._heartbeat(membership)
            # A seek, a commit or records left over (dirty), or an append of this bus: at once;
            # else on the idle cadence, which goes on from the previous call, and only if the
            # file changed since the last poll or a member's lease ran out meanwhile.
            if woken or self._dirty or loop.time() >= self._next_poll_at:
                records = await self._poll_if_changed(max_records, force=woken)
                if records:
                    self._idle_delay = _POLL_MIN_S
                    self._next_poll_at = 0.0
                    return records
                self._next_poll_at = loop.time() + self._idle_delay
                self._idle_delay = min(2 * self._idle_delay, self._ctx.idle_poll_s)
            remaining = deadline - loop.time()
            if remaining <= 0:
                return []
            woken = await self._ctx.wait_for_append(
                min(max(0.0, self._next_poll_at - loop.time()), remaining)
            )
            self._check_open()

    async def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        """See :meth:`Consumer.commit`.

        Positions of partitions this member does not own at the moment of the commit (lost in
        a rebalance) are ignored: their records will be delivered again to their new owner.
        Raises :class:`BusError` without a group or for a negative offset,
        :class:`~trainguard.agent.bus.BusUnavailable` when the file stays locked longer than
        the bus's send timeout.
        """
        self._check_open()
        membership = self._membership
        if membership is None:
            raise BusError("commit() needs a consumer group; this consumer was made by assign()")
        if offsets is None:
            positions = dict(self._positions)
        else:
            positions = {self._ctx.resolve(tp): offset for tp, offset in offsets.items()}
        if any(offset < 0 for offset in positions.values()):
            raise BusError(f"commit(): offsets must be >= 0, got {offsets}")
        try:
            await self._ctx.writer.run(
                groups.commit,
                membership.group_id,
                membership.member_id,
                positions,
                int(self._ctx.session_timeout_s * 1000),
                now_ms(),
                time.monotonic() + self._ctx.write_timeout_s,
            )
        except sqlite3.Error as exc:
            raise translate(exc, "commit") from exc
        self._dirty = True

    async def committed(self, tp: TopicPartition) -> int | None:
        """See :meth:`Consumer.committed`."""
        self._check_open()
        membership = self._membership
        if membership is None:
            raise BusError("committed() needs a consumer group; this consumer was made by assign()")
        try:
            return await self._ctx.reader.run(
                groups.committed, membership.group_id, self._ctx.resolve(tp)
            )
        except sqlite3.Error as exc:
            raise translate(exc, "committed") from exc

    async def seek(self, tp: TopicPartition, offset: int) -> None:
        """See :meth:`Consumer.seek`. Raises :class:`BusError` if ``tp`` is not assigned."""
        self._check_open()
        key = self._ctx.resolve(tp)
        if key not in self._positions:
            raise BusError(f"seek(): {tp} is not assigned to this consumer")
        if offset < 0:
            raise BusError(f"seek(): offset must be >= 0, got {offset}")
        self._positions[key] = offset
        self._epoch += 1
        self._dirty = True

    async def position(self, tp: TopicPartition) -> int:
        """See :meth:`Consumer.position`. Raises :class:`BusError` if ``tp`` is not
        assigned."""
        self._check_open()
        key = self._ctx.resolve(tp)
        if key not in self._positions:
            raise BusError(f"position(): {tp} is not assigned to this consumer")
        return self._positions[key]

    def assignment(self) -> frozenset[TopicPartition]:
        """See :meth:`Consumer.assignment`; for a group member, as of its last poll."""
        self._check_open()
        return frozenset(TopicPartition(self._ctx.names[t], p) for t, p in self._positions)

    def assignment_epoch(self) -> int:
        """See :meth:`Consumer.assignment_epoch`: bumped when a poll finds the member's share
        changed and when a heartbeat finds that its lease had ended (a rejoin)."""
        return self._assignment_epoch

    @property
    def membership(self) -> Membership | None:
        """The group membership, or ``None`` for a consumer made by ``assign``."""
        return self._membership

    def owns(self, partition: int, epoch: int) -> bool:
        """Whether this open member still holds ``partition`` (of its subscribed topics) in
        the assignment of ``epoch``, as far as this process knows (the file decides at
        commit time: :func:`._sqlite_groups.write_owned`)."""
        return (
            not self._closed
            and epoch == self._assignment_epoch
            and any(p == partition for _, p in self._positions)
        )

    async def close(self) -> None:
        """See :meth:`Consumer.close`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._ctx.forget(self)
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        membership = self._membership
        if membership is None:
            return
        try:
            await self._ctx.writer.run(
                groups.leave,
                membership.group_id,
                membership.member_id,
                time.monotonic() + self._ctx.write_timeout_s,
            )
        except sqlite3.Error:
            # The lease still ends within the session timeout; the others take over then.
            return

    def _check_open(self) -> None:
        if self._closed or self._ctx.bus_closed():
            raise BusClosed("the consumer is closed")

    def _keep_lease(self) -> None:
        """Start the keeper task unless it runs (it ends when it stops renewing)."""
        if self._membership is not None and (self._keeper is None or self._keeper.done()):
            self._keeper = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        """Renew the lease when due, while the member polls within ``max_poll_interval_s``.

        Only renews: a lease found ended is left for the next :meth:`getmany`, which joins
        again under a new member id, and so is a renewal that failed (the file locked past the
        write timeout): the poll renews it again and raises the error to its caller.
        """
        loop = asyncio.get_running_loop()
        while not self._closed:
            await asyncio.sleep(max(0.0, self._heartbeat_due - loop.time()))
            if self._closed or loop.time() - self._polled_at > self._ctx.max_poll_interval_s:
                return
            if loop.time() < self._heartbeat_due:
                continue  # a poll renewed it meanwhile
            try:
                async with self._renewing:
                    if not await self._renew(self._membership_now(), now_ms(), join=False):
                        return
                    self._renewed()
            except (sqlite3.Error, BusError):  # the file locked, the bus closed under it
                return

    def _membership_now(self) -> Membership:
        membership = self._membership
        assert membership is not None  # only group members renew
        return membership

    async def _renew(self, membership: Membership, now: int, *, join: bool) -> bool:
        """Extend (or, with ``join``, register) the lease of ``membership`` from ``now``
        (ms); whether the member holds a lease now. Raises :class:`sqlite3.Error`."""
        return bool(
            await self._ctx.writer.run(
                groups.heartbeat,
                membership.group_id,
                membership.member_id,
                membership.topics,
                now + int(self._ctx.session_timeout_s * 1000),
                now,
                time.monotonic() + self._ctx.write_timeout_s,
                join=join,
            )
        )

    def _renewed(self) -> None:
        self._heartbeat_due = asyncio.get_running_loop().time() + self._ctx.session_timeout_s / 3
        # Renewing is also when expired members are noticed: recompute the assignment.
        self._dirty = True

    async def _heartbeat(self, membership: Membership) -> None:
        """Renew the lease, or join (again, under a new member id, if it had ended).
        Raises :class:`BusError`."""
        async with self._renewing:
            now = now_ms()
            try:
                if not await self._renew(membership, now, join=not self._joined):
                    # Back after its lease ended (paused, say): whatever it held may have been
                    # another member's meanwhile, even if the same partitions come back to it.
                    # It joins again under a new member id, so that a partition writer of the
                    # old membership can commit nothing (Kafka, likewise, gives a new member id).
                    membership = self._membership = dataclasses.replace(
                        membership, member_id=new_member_id(membership.member_id)
                    )
                    self._positions = {}
                    self._assignment_epoch += 1
                    await self._renew(membership, now, join=True)
            except sqlite3.Error as exc:
                raise translate(exc, "consumer group heartbeat") from exc
            self._joined = True
            self._renewed()

    async def _poll_if_changed(self, max_records: int, *, force: bool) -> list[Record]:
        """:meth:`_poll`, unless nothing can have changed since the last one: the file's
        ``data_version`` (read here without a hop to the reader thread) is the one read before
        it, no lease of the group ran out since, and neither ``force`` nor a seek, a commit or
        records left over ask for one."""
        # Read before the poll: a commit between the two is then seen again next time.
        version = self._ctx.data_version()
        expired = self._refresh_at_ms is not None and now_ms() >= self._refresh_at_ms
        unchanged = version is not None and version == self._watched
        if unchanged and not (force or self._dirty or expired):
            return []
        records = await self._poll(max_records)
        self._watched = version  # only once a poll went through: a failed one is redone
        return records

    async def _poll(self, max_records: int) -> list[Record]:
        epoch = self._epoch
        now = now_ms()
        # A member whose lease ends changes nothing in the file: look again at that time.
        expired = self._refresh_at_ms is not None and now >= self._refresh_at_ms
        try:
            polled = await self._ctx.reader.run(
                _poll,
                self._seen_version,
                self._dirty or expired,
                self._membership,
                dict(self._positions),
                self._ctx.names,
                max_records,
                self._first,
                now,
            )
        except sqlite3.Error as exc:
            raise translate(exc, "poll") from exc
        self._check_open()
        if polled is None or epoch != self._epoch:
            # Unchanged file, or a seek() raced this poll: its records are stale.
            return []
        self._first += 1
        if polled.positions.keys() != self._positions.keys():
            self._assignment_epoch += 1
        self._seen_version = polled.version
        self._dirty = polled.more
        self._refresh_at_ms = polled.first_expiry_ms
        self._positions = polled.positions
        return polled.records
