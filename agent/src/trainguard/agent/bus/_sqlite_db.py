"""The embedded bus's SQLite file: schema, connection set-up, transactions, and the worker
thread that owns a connection.

Schema (``PRAGMA user_version`` = :data:`SCHEMA_VERSION`)::

    topics(topic_id PK, name UNIQUE, partitions, compacted)   -- name carries the bus prefix
    partitions(topic_id, partition, next_offset)              -- PK (topic_id, partition)
    records(topic_id, partition, offset, ts_ms, key, value)   -- PK (topic_id, partition, offset)
    group_members(group_id, member_id, topics, expires_ms)    -- PK (group_id, member_id)
    group_offsets(group_id, topic_id, partition, position)    -- PK (group_id, topic_id, partition)
    meta(name PK, value)                                      -- last_compaction_ms, append_clock_ms

``meta.append_clock_ms``, when a simulator has set it (:func:`set_append_clock`), is the append
time of every record written from then on, by every process, instead of the wall clock: the
file's own simulated time (``trainguard sim``). A bus in production never holds it.

``partitions.next_offset`` is the offset the next appended record gets; it is the only source
of offsets (never ``max(offset) + 1``), so it never goes back when compaction deletes records.

Durability: WAL mode with ``synchronous=NORMAL``. A committed transaction is in the WAL file,
so it survives the crash of any process; an operating-system crash or power loss may roll back
the last transactions, but never an earlier one while keeping a later one (WAL frames carry
cumulative checksums and recovery stops at the first bad frame,
https://sqlite.org/fileformat2.html#the_write_ahead_log),
so the file is always a consistent prefix of its history: a committed group position never
outlives the records it covers. That is the durability of a single Kafka broker, which also
acknowledges from the page cache (``flush.messages`` is unbounded by default). ``FULL`` would
fsync every commit: measured here at about 2.6 ms, i.e. under 400 commits/s for the whole
machine, which an agent that awaits each publish would feel directly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from trainguard.agent.bus._errors import BusError, BusUnavailable
from trainguard.agent.bus._port import TopicSpec

__all__ = [
    "APPEND_CLOCK",
    "SCHEMA_VERSION",
    "ChangeWatch",
    "ConnectionThread",
    "TopicMeta",
    "append_clock",
    "append_time_ms",
    "connect",
    "is_busy",
    "load_topics",
    "now_ms",
    "prepare",
    "read_transaction",
    "set_append_clock",
    "take_write_lock",
    "topic_names",
    "translate",
    "write_transaction",
]

P = ParamSpec("P")
T = TypeVar("T")

SCHEMA_VERSION = 1

MIN_SQLITE_VERSION = (3, 24, 0)
"""UPSERT (``ON CONFLICT DO UPDATE``) appeared in SQLite 3.24."""

BUSY_TIMEOUT_S = 1.0
"""How long one SQLite call waits for another process's lock before the caller's retry loop
checks its own deadline again."""

_SCHEMA = """
CREATE TABLE topics (
    topic_id   INTEGER PRIMARY KEY,
    name       TEXT NOT NULL UNIQUE,
    partitions INTEGER NOT NULL CHECK (partitions >= 1),
    compacted  INTEGER NOT NULL CHECK (compacted IN (0, 1))
);
CREATE TABLE partitions (
    topic_id    INTEGER NOT NULL REFERENCES topics (topic_id),
    partition   INTEGER NOT NULL,
    next_offset INTEGER NOT NULL,
    PRIMARY KEY (topic_id, partition)
) WITHOUT ROWID;
CREATE TABLE records (
    topic_id  INTEGER NOT NULL,
    partition INTEGER NOT NULL,
    offset    INTEGER NOT NULL,
    ts_ms     INTEGER NOT NULL,
    key       TEXT,
    value     BLOB,
    PRIMARY KEY (topic_id, partition, offset)
) WITHOUT ROWID;
CREATE TABLE group_members (
    group_id   TEXT NOT NULL,
    member_id  TEXT NOT NULL,
    topics     TEXT NOT NULL,
    expires_ms INTEGER NOT NULL,
    PRIMARY KEY (group_id, member_id)
) WITHOUT ROWID;
CREATE TABLE group_offsets (
    group_id  TEXT NOT NULL,
    topic_id  INTEGER NOT NULL,
    partition INTEGER NOT NULL,
    position  INTEGER NOT NULL,
    PRIMARY KEY (group_id, topic_id, partition)
) WITHOUT ROWID;
CREATE TABLE meta (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
) WITHOUT ROWID;
"""


@dataclass(frozen=True, slots=True)
class TopicMeta:
    """A topic as stored in the file.

    Attributes:
        topic_id: row id used by every other table.
        name: logical name (without the bus prefix).
        partitions: partition count, >= 1.
        compacted: whether the compaction pass keeps only the latest record per key.
    """

    topic_id: int
    name: str
    partitions: int
    compacted: bool


def now_ms() -> int:
    """Wall-clock time in milliseconds since the Unix epoch (shared by every process)."""
    return time.time_ns() // 1_000_000


APPEND_CLOCK = "append_clock_ms"
"""The ``meta`` row that, when present, holds the file's simulated append time (ms since the
Unix epoch)."""


def append_clock(conn: sqlite3.Connection) -> int | None:
    """The file's simulated append time (ms since the epoch), or ``None`` when none is set."""
    row = conn.execute("SELECT value FROM meta WHERE name = ?", (APPEND_CLOCK,)).fetchone()
    return None if row is None else int(row[0])


def append_time_ms(conn: sqlite3.Connection, wall_ms: int) -> int:
    """The append time of records written in the caller's write transaction: the file's
    simulated clock when one is set, else ``wall_ms``. Read inside that transaction, so a
    clock set by another process orders with the records exactly as the file lock does."""
    simulated = append_clock(conn)
    return wall_ms if simulated is None else simulated


def set_append_clock(conn: sqlite3.Connection, at_ms: int | None) -> None:
    """Set the file's simulated append time to ``at_ms`` (ms since the epoch), or remove it
    (``None``: appends take the wall clock again), inside the caller's write transaction."""
    if at_ms is None:
        conn.execute("DELETE FROM meta WHERE name = ?", (APPEND_CLOCK,))
        return
    conn.execute(
        "INSERT INTO meta (name, value) VALUES (?, ?)"
        " ON CONFLICT (name) DO UPDATE SET value = excluded.value",
        (APPEND_CLOCK, at_ms),
    )


def is_busy(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` means another connection holds the lock (``SQLITE_BUSY``/``LOCKED``)."""
    return isinstance(exc, sqlite3.OperationalError) and (exc.sqlite_errorcode & 0xFF) in (
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
    )


def translate(exc: sqlite3.Error, what: str) -> BusError:
    """The bus error for a failed SQLite call: :class:`BusUnavailable` (retriable) when the
    file stayed locked too long, :class:`BusError` otherwise."""
    if is_busy(exc):
        return BusUnavailable(f"{what}: the bus file stayed locked by another process ({exc})")
    return BusError(f"{what}: {exc}")


def connect(path: str, *, create: bool = True) -> sqlite3.Connection:
    """Open ``path`` in WAL mode with ``synchronous=NORMAL`` (see the module docstring).

    The connection is in autocommit mode: transactions are explicit (``BEGIN IMMEDIATE`` for
    writes, see :func:`write_transaction`). With ``create=False`` a missing file is not
    created (SQLite's ``mode=rw`` URI) and a file without this schema version is refused
    before anything is written to it. Raises :class:`sqlite3.Error` (busy while another
    process switches the journal mode, not a database, unreadable, missing with
    ``create=False``) and :class:`BusError` when the file has several hard links
    (:func:`_check_one_name`), WAL cannot be enabled (e.g. a network file system) or, with
    ``create=False``, the file holds no bus of this schema version.
    """
    _check_one_name(path)
    if create:
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    else:
        uri = f"{Path(path).absolute().as_uri()}?mode=rw"
        conn = sqlite3.connect(uri, timeout=BUSY_TIMEOUT_S, isolation_level=None, uri=True)
    try:
        if not create:
            _check_schema(conn, path)
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise BusError(f"{path}: SQLite refused WAL mode (journal_mode={mode})")
        conn.execute("PRAGMA synchronous=NORMAL")
    except BaseException:
        conn.close()
        raise
    return conn


def _check_one_name(path: str) -> None:
    """Refuse a database file with more than one hard link: SQLite keeps the WAL and shared
    memory files beside the name it was opened by, so processes opening one database by two
    names do not see each other's writes and corrupt it (sqlite.org/howtocorrupt.html, section
    "Multiple links to the same file"); the daemon lock, kept beside the name too, would not
    hold either. Two spellings of one name (relative, through a symbolic link) are no problem.

    Raises:
        BusError: the file has several hard links.
    """
    try:
        links = os.stat(path).st_nlink
    except OSError:
        return  # missing (created next) or unreadable: connecting says why
    if links > 1:
        raise BusError(
            f"{path}: the bus file has {links} hard links; SQLite corrupts a database opened "
            "by several names (its WAL is kept beside each name): remove the other links and "
            "give every process one path (a symbolic link is fine)"
        )


@contextmanager
def write_transaction(conn: sqlite3.Connection, deadline: float) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``; rolls back if the body raises.

    ``BEGIN IMMEDIATE`` takes the file's single write lock up front, so offset allocation
    (read ``next_offset``, insert, update) is serialised across every process. While another
    process holds the lock, waits (SQLite's busy handler, :data:`BUSY_TIMEOUT_S` per try) until
    ``deadline`` (``time.monotonic()`` seconds), then raises the busy :class:`sqlite3.Error`.
    """
    while True:
        try:
            conn.execute("BEGIN IMMEDIATE")
            break
        except sqlite3.Error as exc:
            if not is_busy(exc) or time.monotonic() >= deadline:
                raise
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


LOCK_LOOK_S = 0.05
"""Longest single wait of :func:`take_write_lock` for the write lock before it looks again
whether another connection committed meanwhile (seconds)."""


def take_write_lock(conn: sqlite3.Connection, deadline: float, min_watch_s: float) -> None:
    """Take the file's write lock (``BEGIN IMMEDIATE``) and give it back at once (``ROLLBACK``:
    nothing written, nothing synced), or see it move; waiting for another process's lock until
    ``deadline`` (``time.monotonic()`` seconds).

    SQLite's busy handler is not fair: under a steady stream of short writes it may never catch
    the lock free, yet the lock moves and every writer gets its turn. So the lock is waited for
    in looks of at most :data:`LOCK_LOOK_S`, and after each look that finds it busy, a commit
    by another connection since the first (``PRAGMA data_version``) answers at once: the lock
    moves. A lock held through the deadline with no commit is a file stuck locked only if it
    was watched for at least ``min_watch_s`` seconds; a shorter watch (a caller whose own work
    took most of its time, on a loaded machine) proves nothing and counts as an answer: the
    next watch long enough decides.

    Raises:
        sqlite3.Error: busy, when the lock was held for the whole watch with no commit by
            anyone (a ``sqlite3`` shell in ``BEGIN EXCLUSIVE``, a process stopped inside a
            write transaction); any other error of the file as it comes.
    """
    before = conn.execute("PRAGMA data_version").fetchone()[0]
    began = time.monotonic()
    try:
        while True:
            wait_s = min(LOCK_LOOK_S, deadline - time.monotonic())
            conn.execute(f"PRAGMA busy_timeout = {max(0, int(wait_s * 1000))}")
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                if not is_busy(exc):
                    raise
                if conn.execute("PRAGMA data_version").fetchone()[0] != before:
                    return  # another connection committed: the lock moves
                now = time.monotonic()
                if now < deadline:
                    continue
                if now - began < min_watch_s:
                    return  # too short a watch to tell
                raise
            conn.execute("ROLLBACK")
            return
    finally:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")


@contextmanager
def read_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """A deferred read transaction: every query inside sees one snapshot of the file."""
    conn.execute("BEGIN")
    try:
        yield
    finally:
        conn.execute("COMMIT")


def prepare(
    conn: sqlite3.Connection, prefix: str, topics: tuple[TopicSpec, ...], deadline: float
) -> None:
    """Create the schema if the file is new and the missing ``topics`` (named ``prefix+name``).

    A topic that exists keeps its partition count and cleanup policy, as on Kafka, where
    creating an existing topic is a no-op. Raises :class:`BusError` when the file holds another
    schema version, :class:`sqlite3.Error` when it cannot be written before ``deadline``.
    """
    with write_transaction(conn, deadline):
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            # One statement at a time: executescript() would COMMIT the open transaction.
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        elif version != SCHEMA_VERSION:
            raise BusError(
                f"bus file has schema version {version}, this trainguard reads {SCHEMA_VERSION}"
            )
        for spec in topics:
            if spec.partitions < 1:
                raise BusError(f"topic {spec.name!r}: partitions must be >= 1")
            conn.execute(
                "INSERT INTO topics (name, partitions, compacted) VALUES (?, ?, ?)"
                " ON CONFLICT (name) DO NOTHING",
                (prefix + spec.name, spec.partitions, int(spec.compacted)),
            )
            topic_id, partitions = conn.execute(
                "SELECT topic_id, partitions FROM topics WHERE name = ?", (prefix + spec.name,)
            ).fetchone()
            conn.executemany(
                "INSERT INTO partitions (topic_id, partition, next_offset) VALUES (?, ?, 0)"
                " ON CONFLICT DO NOTHING",
                [(topic_id, p) for p in range(partitions)],
            )


def _check_schema(conn: sqlite3.Connection, path: str) -> None:
    """Raise :class:`BusError` unless ``conn``'s file holds the tables of
    :data:`SCHEMA_VERSION` (an empty file, e.g. one an older trainguard created on a
    mistyped read, holds none)."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version == 0:
        raise BusError(
            f"{path} holds no embedded bus (no tables): start a daemon or run the demo on it "
            "first, or check --bus"
        )
    if version != SCHEMA_VERSION:
        raise BusError(
            f"bus file has schema version {version}, this trainguard reads {SCHEMA_VERSION}"
        )


def topic_names(conn: sqlite3.Connection) -> frozenset[str]:
    """Every topic's stored name (prefix included)."""
    return frozenset(name for (name,) in conn.execute("SELECT name FROM topics"))


def load_topics(conn: sqlite3.Connection, prefix: str) -> dict[str, TopicMeta]:
    """Every topic whose stored name starts with ``prefix``, by logical name."""
    rows = conn.execute("SELECT topic_id, name, partitions, compacted FROM topics").fetchall()
    return {
        name[len(prefix) :]: TopicMeta(topic_id, name[len(prefix) :], partitions, bool(compacted))
        for topic_id, name, partitions, compacted in rows
        if name.startswith(prefix)
    }


def _open(path: str, deadline: float, create: bool) -> sqlite3.Connection:
    if sqlite3.sqlite_version_info < MIN_SQLITE_VERSION:
        raise BusError(f"the embedded bus needs SQLite >= 3.24, found {sqlite3.sqlite_version}")
    if not create and not os.path.exists(path):
        raise BusError(
            f"no embedded bus at {os.path.abspath(path)}: start a daemon or run the demo "
            "first, or check --bus"
        )
    directory = os.path.dirname(path)
    if directory and create:
        os.makedirs(directory, exist_ok=True)
    while True:
        # Switching a new file to WAL needs a moment of exclusive access; another process
        # creating the same file at the same time makes that busy.
        try:
            return connect(path, create=create)
        except sqlite3.Error as exc:
            if not is_busy(exc) or time.monotonic() >= deadline:
                raise


class ChangeWatch:
    """Tells, on the event loop's thread and without waiting, whether the file may have
    changed: ``PRAGMA data_version`` of a connection of its own.

    An idle consumer asks it before each poll and hops to its reader thread only when the
    answer moved (https://sqlite.org/pragma.html#pragma_data_version: the value changes when
    any other connection, of this process or another, commits to the file). The hop is what an
    idle poll costs (the thread's queue, its wake-up, the result back through the loop's
    self-pipe: about 0.3 ms of CPU against 4 us for the pragma, measured here), and every agent
    thread, supervisor and daemon has idle consumers. This is the one SQLite call made on the
    event loop, against :class:`ConnectionThread`'s rule, because it cannot block: in WAL mode
    it reads the shared-memory WAL index, and its busy timeout is 0, so a file busy at that
    moment (WAL recovery) answers ``None``, "look", rather than waiting.

    Args:
        conn: a connection to the bus file made with ``check_same_thread=False`` and a busy
            timeout of 0 (:meth:`open`), used by the event loop's thread only.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn: sqlite3.Connection | None = conn

    @classmethod
    async def open(cls, path: str) -> ChangeWatch:
        """Connect to the existing bus file at ``path`` (read and write mode, never writing),
        in a worker thread. Raises :class:`sqlite3.Error` when it cannot be opened."""

        def _connect() -> sqlite3.Connection:
            uri = f"{Path(path).absolute().as_uri()}?mode=rw"
            return sqlite3.connect(
                uri, timeout=0.0, isolation_level=None, uri=True, check_same_thread=False
            )

        return cls(await asyncio.to_thread(_connect))

    def version(self) -> int | None:
        """The file's ``data_version`` as this connection sees it, or ``None`` when it cannot
        tell (busy, closed, any error): the caller then polls."""
        conn = self._conn
        if conn is None:
            return None
        try:
            value: int = conn.execute("PRAGMA data_version").fetchone()[0]
        except sqlite3.Error:
            return None
        return value

    def close(self) -> None:
        """Close the connection; :meth:`version` answers ``None`` from then on."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class ConnectionThread:
    """One worker thread that owns one SQLite connection and runs calls on it in order.

    SQLite calls block (disk I/O, waiting for another process's lock), so they never run on
    the event loop; a single thread per connection also satisfies ``sqlite3``'s rule that a
    connection stays on the thread that made it. The GIL is released inside SQLite calls.

    The thread is a daemon thread, started by the first call: a call still waiting for
    another process's lock when the process exits (its awaiter gone, say a worker that
    finished while the bus file is locked) does not hold the exit up until its deadline. A
    transaction it had begun is rolled back by SQLite, as after any crash; what the caller
    awaited was not confirmed, so nothing is lost that was promised.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[
            tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._conn: sqlite3.Connection | None = None

    async def open(self, path: str, deadline: float, *, create: bool = True) -> None:
        """Open the database at ``path``, creating it and its directory if missing (unless
        ``create`` is false: see :func:`connect`).

        Raises :class:`sqlite3.Error` (e.g. still busy at ``deadline``, monotonic seconds),
        :class:`OSError` (directory cannot be created) or :class:`BusError` (SQLite too old,
        WAL refused, no bus in the file with ``create=False``).
        """
        self._conn = await self._submit(_open, path, deadline, create)

    async def run(
        self,
        fn: Callable[Concatenate[sqlite3.Connection, P], T],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        """Run ``fn(connection, *args, **kwargs)`` on the thread and return its result.

        If the awaiting task is cancelled, the call still runs to completion on the thread.
        """
        conn = self._conn
        if conn is None:
            raise BusError("the bus connection is not open")
        return await self._submit(functools.partial(fn, conn, *args, **kwargs))

    async def close(self) -> None:
        """Close the connection (after the calls already queued) and stop the thread."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await self._submit(conn.close)
        if self._thread is not None:
            self._calls.put(None)

    def _submit(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """Queue ``fn(*args)`` for the thread; as ``run_in_executor``: a call whose awaiter was
        cancelled before it started is skipped."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        outcome: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._calls.put((functools.partial(fn, *args), outcome))
        return asyncio.wrap_future(outcome)

    def _serve(self) -> None:
        """The thread: run each call in order, unless its awaiter gave it up first."""
        while (call := self._calls.get()) is not None:
            fn, outcome = call
            if not outcome.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # the awaiter gets it, whatever it is
                outcome.set_exception(exc)
            else:
                outcome.set_result(result)
