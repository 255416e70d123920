"""Consumer groups of the embedded bus: membership leases, assignment, committed positions.

A member is a row in ``group_members`` with the topics it subscribes to and a lease end
(``expires_ms``). Members renew their lease while they poll; a member whose lease ran out is
ignored by everyone (and its row deleted by the next member that renews). There is no
coordinator: every member computes the same assignment from the live rows
(:func:`round_robin`), so when membership changes each member drops or picks up partitions at
its next poll. A partition a member picks up starts at the group's committed position, and a
commit only stores positions of partitions the member owns at that moment, so a member that
lost a partition cannot move its position; records are never skipped, only possibly delivered
twice around a rebalance (at-least-once, as on Kafka). Leases are in wall-clock milliseconds,
which all processes of one machine share; a clock step shortens or lengthens them once.

Every function takes the connection first and runs on its worker thread. Partitions are named
by ``(topic_id, partition)`` pairs; topics in member rows by their stored (prefixed) names.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from itertools import cycle

from trainguard.agent.bus._sqlite_db import append_time_ms, now_ms, write_transaction
from trainguard.agent.bus._sqlite_log import Row, insert

__all__ = [
    "NotOwner",
    "commit",
    "heartbeat",
    "leave",
    "open_writer",
    "owned",
    "round_robin",
    "start_positions",
    "write_owned",
]


def round_robin(
    members: Mapping[str, frozenset[str]], partitions: Mapping[str, int]
) -> dict[str, set[tuple[str, int]]]:
    """Deal topic partitions to group members, as Kafka's ``RoundRobinAssignor``.

    ``members`` maps member id to its subscribed topics; ``partitions`` maps topic to its
    partition count. All ``(topic, partition)`` pairs, sorted, go in turn to the members sorted
    by id, skipping members not subscribed to the pair's topic. Deterministic: every member
    computes the same answer from the same rows. Returns every member's share.
    """
    shares: dict[str, set[tuple[str, int]]] = {member: set() for member in members}
    if not members:
        return shares
    ring = cycle(sorted(members))
    for topic in sorted(partitions):
        if not any(topic in topics for topics in members.values()):
            continue
        for partition in range(partitions[topic]):
            member = next(ring)
            while topic not in members[member]:
                member = next(ring)
            shares[member].add((topic, partition))
    return shares


def heartbeat(
    conn: sqlite3.Connection,
    group_id: str,
    member_id: str,
    topics: Sequence[str],
    expires_ms: int,
    now_ms: int,
    deadline: float,
    *,
    join: bool = True,
) -> bool:
    """Join ``group_id`` (with ``join``) or renew the lease of ``member_id`` until
    ``expires_ms``.

    ``topics`` are stored topic names. Also deletes the group's members whose lease ended
    before ``now_ms``. Without ``join``, a member whose lease has ended is not renewed: it
    must join again under a new member id, so that nothing done under the old one (a
    partition writer's commit, :func:`write_owned`) can pass for the new membership. Returns
    whether the member holds a lease now. Raises :class:`sqlite3.Error` (busy past
    ``deadline``, monotonic s).
    """
    with write_transaction(conn, deadline):
        live = conn.execute(
            "SELECT 1 FROM group_members WHERE group_id = ? AND member_id = ? AND expires_ms > ?",
            (group_id, member_id, now_ms),
        ).fetchone()
        conn.execute(
            "DELETE FROM group_members WHERE group_id = ? AND expires_ms <= ?", (group_id, now_ms)
        )
        if live is None and not join:
            return False
        conn.execute(
            "INSERT INTO group_members (group_id, member_id, topics, expires_ms)"
            " VALUES (?, ?, ?, ?) ON CONFLICT (group_id, member_id)"
            " DO UPDATE SET topics = excluded.topics, expires_ms = excluded.expires_ms",
            (group_id, member_id, json.dumps(sorted(topics)), expires_ms),
        )
    return True


class NotOwner(Exception):
    """:func:`write_owned` found that the member does not own the partition any more, or that
    a newer writer of it was opened."""


def _writer_key(group_id: str, partition: int) -> str:
    # In the meta table (schema version 1 has it): no new table, no schema version bump.
    return f"writer_epoch {partition} {group_id}"


def open_writer(conn: sqlite3.Connection, group_id: str, partition: int, deadline: float) -> int:
    """Bump and return the writer epoch of ``partition`` of ``group_id``: every writer opened
    earlier is fenced (:func:`write_owned` refuses it), as a Kafka producer is by a new one
    with its transactional id. Raises :class:`sqlite3.Error` (busy past ``deadline``)."""
    key = _writer_key(group_id, partition)
    with write_transaction(conn, deadline):
        conn.execute(
            "INSERT INTO meta (name, value) VALUES (?, 1)"
            " ON CONFLICT (name) DO UPDATE SET value = value + 1",
            (key,),
        )
        return int(conn.execute("SELECT value FROM meta WHERE name = ?", (key,)).fetchone()[0])


def write_owned(
    conn: sqlite3.Connection,
    group_id: str,
    member_id: str,
    partition: int,
    writer_epoch: int,
    rows: Sequence[Row],
    positions: Mapping[tuple[int, int], int],
    deadline: float,
) -> list[int]:
    """Append ``rows`` and store ``positions`` in one transaction, if no writer of
    ``partition`` was opened after the one of ``writer_epoch`` (:func:`open_writer`) and
    ``member_id`` still owns ``partition`` of every topic it subscribes to, both judged under
    the file's write lock at the time it is held (a member paused while waiting cannot slip
    past its lease end, nor past another member that owned the partition meanwhile).

    Returns the offsets of ``rows``. Raises :class:`NotOwner` (nothing written) when a newer
    writer was opened, the member's lease ended or the partition is another member's;
    :class:`sqlite3.Error` (busy past ``deadline``, monotonic seconds).
    """
    with write_transaction(conn, deadline):
        current = conn.execute(
            "SELECT value FROM meta WHERE name = ?", (_writer_key(group_id, partition),)
        ).fetchone()
        if current is None or int(current[0]) != writer_epoch:
            raise NotOwner(partition)
        now = now_ms()
        mine, _ = owned(conn, group_id, member_id, now)
        topics = {topic_id for topic_id, _ in mine}
        if not mine or any((t, partition) not in mine for t in topics):
            raise NotOwner(partition)
        if any(tp not in mine for tp in positions):
            raise NotOwner(partition)
        offsets = insert(conn, rows, append_time_ms(conn, now))
        conn.executemany(
            "INSERT INTO group_offsets (group_id, topic_id, partition, position)"
            " VALUES (?, ?, ?, ?) ON CONFLICT (group_id, topic_id, partition)"
            " DO UPDATE SET position = excluded.position",
            [(group_id, topic_id, p, position) for (topic_id, p), position in positions.items()],
        )
    return offsets


def leave(conn: sqlite3.Connection, group_id: str, member_id: str, deadline: float) -> None:
    """Remove ``member_id`` from ``group_id`` at once (its partitions go to the others)."""
    with write_transaction(conn, deadline):
        conn.execute(
            "DELETE FROM group_members WHERE group_id = ? AND member_id = ?", (group_id, member_id)
        )


def owned(
    conn: sqlite3.Connection, group_id: str, member_id: str, now_ms: int
) -> tuple[frozenset[tuple[int, int]], int | None]:
    """The partitions ``member_id`` owns among the members of ``group_id`` live at ``now_ms``,
    and when (ms since the epoch) the first of those members' leases ends unless renewed.

    The partitions are empty when the member's own lease has ended.
    """
    rows = conn.execute(
        "SELECT member_id, topics, expires_ms FROM group_members"
        " WHERE group_id = ? AND expires_ms > ?",
        (group_id, now_ms),
    ).fetchall()
    members = {member: frozenset(json.loads(topics)) for member, topics, _ in rows}
    first_expiry = min((expires for _, _, expires in rows), default=None)
    if member_id not in members:
        return frozenset(), first_expiry
    wanted = frozenset().union(*members.values())
    topics = {
        name: (topic_id, partitions)
        for topic_id, name, partitions in conn.execute(
            "SELECT topic_id, name, partitions FROM topics"
        )
        if name in wanted
    }
    share = round_robin(members, {name: count for name, (_, count) in topics.items()})
    mine = frozenset((topics[name][0], partition) for name, partition in share[member_id])
    return mine, first_expiry


def start_positions(
    conn: sqlite3.Connection,
    group_id: str,
    partitions: Iterable[tuple[int, int]],
    ends: Mapping[tuple[int, int], int],
    from_beginning: bool,
) -> dict[tuple[int, int], int]:
    """Where a member that just got ``partitions`` starts reading each of them.

    The group's committed position if there is one, else 0 (``from_beginning``) or the
    partition's end offset from ``ends``.
    """
    starts = {}
    for tp in partitions:
        position = committed(conn, group_id, tp)
        if position is not None:
            starts[tp] = position
        else:
            starts[tp] = 0 if from_beginning else ends[tp]
    return starts


def committed(conn: sqlite3.Connection, group_id: str, tp: tuple[int, int]) -> int | None:
    """The group's committed position of ``tp`` (``(topic_id, partition)``), or ``None``."""
    row = conn.execute(
        "SELECT position FROM group_offsets WHERE group_id = ? AND topic_id = ? AND partition = ?",
        (group_id, *tp),
    ).fetchone()
    return None if row is None else int(row[0])


def positions(conn: sqlite3.Connection, group_id: str, topic_id: int) -> dict[int, int]:
    """Partition -> the group's committed position, for the partitions of ``topic_id`` that
    have one."""
    rows = conn.execute(
        "SELECT partition, position FROM group_offsets WHERE group_id = ? AND topic_id = ?",
        (group_id, topic_id),
    ).fetchall()
    return {int(partition): int(position) for partition, position in rows}


def commit(
    conn: sqlite3.Connection,
    group_id: str,
    member_id: str,
    positions: Mapping[tuple[int, int], int],
    lease_ms: int,
    now_ms: int,
    deadline: float,
) -> frozenset[tuple[int, int]]:
    """Store ``positions`` (next offset to read) for the partitions ``member_id`` owns now.

    Positions of partitions the member does not own (lost in a rebalance, or its lease ended)
    are dropped, so a stale member can never move a position another member relies on; the
    records after the kept position are delivered again (at-least-once). A live member's lease
    is renewed to ``now_ms + lease_ms``. Returns the partitions stored. Raises
    :class:`sqlite3.Error` (busy past ``deadline``, monotonic seconds).
    """
    with write_transaction(conn, deadline):
        conn.execute(
            "UPDATE group_members SET expires_ms = ?"
            " WHERE group_id = ? AND member_id = ? AND expires_ms > ?",
            (now_ms + lease_ms, group_id, member_id, now_ms),
        )
        mine, _ = owned(conn, group_id, member_id, now_ms)
        stored = [(tp, position) for tp, position in positions.items() if tp in mine]
        conn.executemany(
            "INSERT INTO group_offsets (group_id, topic_id, partition, position)"
            " VALUES (?, ?, ?, ?) ON CONFLICT (group_id, topic_id, partition)"
            " DO UPDATE SET position = excluded.position",
            [
                (group_id, topic_id, partition, position)
                for (topic_id, partition), position in stored
            ],
        )
    return frozenset(tp for tp, _ in stored)
