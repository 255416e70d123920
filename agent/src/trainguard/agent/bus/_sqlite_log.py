"""The partition logs of the embedded bus: append, read, end offsets, latest per key, compaction.

Every function takes the connection first and runs on the connection's worker thread
(:class:`~trainguard.agent.bus._sqlite_db.ConnectionThread`); none touches the event loop.
Partitions are named by ``(topic_id, partition)`` pairs.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Mapping, Sequence

from trainguard.agent.bus._port import Record
from trainguard.agent.bus._sqlite_db import (
    append_time_ms,
    now_ms,
    set_append_clock,
    write_transaction,
)

__all__ = [
    "Row",
    "StampedRow",
    "append",
    "append_stamped",
    "compact",
    "end_offsets",
    "insert",
    "latest_per_key",
    "read",
]

Row = tuple[int, int, str, bytes | None]
"""A record to append: ``(topic_id, partition, key, value)``."""

StampedRow = tuple[int, int, str | None, bytes | None, int]
"""A record to append with its own append time: ``(topic_id, partition, key, value, ts_ms)``."""

_LAST_COMPACTION = "last_compaction_ms"


def append(conn: sqlite3.Connection, rows: Sequence[Row], deadline: float) -> tuple[list[int], int]:
    """Append ``rows`` in one transaction (group commit) and return their offsets and timestamp.

    Offsets are allocated from ``partitions.next_offset`` inside ``BEGIN IMMEDIATE``, so they
    run 0, 1, 2, ... per partition with no gap and no duplicate across every process writing
    the file; rows of one partition keep their order in ``rows``. All rows get the same append
    timestamp (ms since the epoch: the wall clock, or the file's simulated clock when one is
    set, :func:`~trainguard.agent.bus._sqlite_db.append_time_ms`). Raises :class:`sqlite3.Error` (busy past ``deadline``,
    ``time.monotonic()`` seconds; disk full; I/O error), in which case nothing was appended.
    """
    with write_transaction(conn, deadline):
        ts = append_time_ms(conn, now_ms())
        offsets = insert(conn, rows, ts)
    return offsets, ts


def insert(conn: sqlite3.Connection, rows: Sequence[Row], ts_ms: int) -> list[int]:
    """Insert ``rows`` appended at ``ts_ms`` (inside the caller's write transaction); their
    offsets, allocated as by :func:`append`."""
    return _insert(conn, [(t, p, key, value, ts_ms) for t, p, key, value in rows])


def append_stamped(
    conn: sqlite3.Connection,
    rows: Sequence[StampedRow],
    deadline: float,
    clock_ms: int | None = None,
) -> list[int]:
    """Append ``rows`` in one transaction, each with its own append time; return their offsets.

    For importing an exported log (``trainguard import``), whose records must keep the append
    times the state machine decided on, and for a simulator's records (``trainguard sim``).
    Offsets are allocated as by :func:`append`; the times are taken as given, so the caller
    keeps them non-decreasing per partition. With ``clock_ms``, the file's simulated append
    clock is set to it in the same transaction, so no other process appends a record between
    these and the clock's move. Raises :class:`sqlite3.Error` as :func:`append` does, in which
    case nothing was appended.
    """
    with write_transaction(conn, deadline):
        offsets = _insert(conn, rows)
        if clock_ms is not None:
            set_append_clock(conn, clock_ms)
        return offsets


def _insert(conn: sqlite3.Connection, rows: Sequence[StampedRow]) -> list[int]:
    """Insert ``rows`` at the next offsets of their partitions (inside a write transaction)."""
    next_offset: dict[tuple[int, int], int] = {}
    params = []
    offsets = []
    for topic_id, partition, key, value, ts in rows:
        tp = (topic_id, partition)
        offset = next_offset.get(tp)
        if offset is None:
            offset = conn.execute(
                "SELECT next_offset FROM partitions WHERE topic_id = ? AND partition = ?", tp
            ).fetchone()[0]
        next_offset[tp] = offset + 1
        offsets.append(offset)
        params.append((topic_id, partition, offset, ts, key, value))
    conn.executemany(
        "INSERT INTO records (topic_id, partition, offset, ts_ms, key, value)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        params,
    )
    conn.executemany(
        "UPDATE partitions SET next_offset = ? WHERE topic_id = ? AND partition = ?",
        [(end, topic_id, partition) for (topic_id, partition), end in next_offset.items()],
    )
    return offsets


def end_offsets(
    conn: sqlite3.Connection, partitions: Collection[tuple[int, int]]
) -> dict[tuple[int, int], int]:
    """The offset the next record appended to each of ``partitions`` will get."""
    topic_ids = {topic_id for topic_id, _ in partitions}
    ends: dict[tuple[int, int], int] = {}
    for topic_id in topic_ids:
        for partition, end in conn.execute(
            "SELECT partition, next_offset FROM partitions WHERE topic_id = ?", (topic_id,)
        ):
            if (topic_id, partition) in partitions:
                ends[(topic_id, partition)] = end
    return ends


def read(
    conn: sqlite3.Connection,
    positions: dict[tuple[int, int], int],
    ends: Mapping[tuple[int, int], int],
    names: Mapping[int, str],
    max_records: int,
    first: int,
) -> tuple[list[Record], bool]:
    """Read up to ``max_records`` records at ``positions`` and advance ``positions`` in place.

    Call inside one read transaction with ``ends`` from :func:`end_offsets` of the same
    snapshot. Partitions are visited in sorted order starting at index ``first`` (callers
    rotate it so one busy partition cannot starve the others). A partition read to its end
    moves to its end offset, which skips offsets removed by compaction; offsets are never
    reordered. ``names`` maps topic ids to logical names. Returns the records and whether
    some partition still has records after the new positions.
    """
    order = sorted(positions)
    if order:
        first %= len(order)
        order = order[first:] + order[:first]
    records: list[Record] = []
    more = False
    for tp in order:
        position, end = positions[tp], ends[tp]
        if position >= end:
            continue
        limit = max_records - len(records)
        if limit <= 0:
            more = True
            continue
        topic_id, partition = tp
        topic = names[topic_id]
        rows = conn.execute(
            "SELECT offset, ts_ms, key, value FROM records"
            " WHERE topic_id = ? AND partition = ? AND offset >= ? ORDER BY offset LIMIT ?",
            (topic_id, partition, position, limit),
        ).fetchall()
        records.extend(
            Record(topic, partition, offset, key, value, ts) for offset, ts, key, value in rows
        )
        if len(rows) == limit:
            positions[tp] = rows[-1][0] + 1
            more = more or positions[tp] < end
        else:
            positions[tp] = end
    return records, more


def latest_per_key(conn: sqlite3.Connection, topic_id: int, topic: str) -> dict[str, Record]:
    """The latest record of every key of ``topic_id``, tombstoned keys left out.

    Scans the topic once: cheap for compacted topics, which the compaction pass keeps near
    one record per key; proportional to the topic's size otherwise. Uses SQLite's rule that
    the bare columns of a ``max()`` aggregate come from the row holding the maximum
    (https://sqlite.org/lang_select.html#bareagg); a key always maps to one partition.
    """
    rows = conn.execute(
        "SELECT key, partition, max(offset), ts_ms, value FROM records"
        " WHERE topic_id = ? GROUP BY key",
        (topic_id,),
    ).fetchall()
    return {
        key: Record(topic, partition, offset, key, value, ts)
        for key, partition, offset, ts, value in rows
        if value is not None
    }


def compact(
    conn: sqlite3.Connection,
    lag_ms: int,
    tombstone_retention_ms: int,
    interval_ms: int,
    deadline: float,
) -> bool:
    """Delete superseded records of every compacted topic in the file; return whether it ran.

    Kafka's log cleaner semantics: a record is deleted when a later record with its key exists
    and the record is older than ``lag_ms`` (``min.compaction.lag.ms``); a tombstone that is
    the latest of its key is deleted once older than ``tombstone_retention_ms``
    (``delete.retention.ms``). ``next_offset`` is untouched, so offsets are never reused;
    readers skip the gaps (see :func:`read`). The pass runs at most once per ``interval_ms``
    across all processes (the time of the last pass is stored in ``meta``), so every bus
    object may call it on its own schedule (buses sharing a file should share the settings).
    Raises :class:`sqlite3.Error` when the file stays
    locked past ``deadline``.
    """
    with write_transaction(conn, deadline):
        now = now_ms()
        row = conn.execute("SELECT value FROM meta WHERE name = ?", (_LAST_COMPACTION,)).fetchone()
        if row is not None and now - row[0] < interval_ms:
            return False
        compacted = conn.execute("SELECT topic_id FROM topics WHERE compacted = 1").fetchall()
        for (topic_id,) in compacted:
            conn.execute(
                "DELETE FROM records WHERE topic_id = :t AND ts_ms < :lag AND ("
                " (partition, offset) NOT IN (SELECT partition, max(offset) FROM records"
                "                             WHERE topic_id = :t GROUP BY key)"
                " OR (value IS NULL AND ts_ms < :tombstone))",
                {"t": topic_id, "lag": now - lag_ms, "tombstone": now - tombstone_retention_ms},
            )
        conn.execute(
            "INSERT INTO meta (name, value) VALUES (?, ?)"
            " ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            (_LAST_COMPACTION, now),
        )
    return True
