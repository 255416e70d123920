"""Behaviour of the embedded SQLite bus beyond the port contract: leases, fencing of stale
commits, compaction, lock waits, file handling, cross-process latency."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.outage import written_busily
from trainguard.agent.bus import (
    BusConfig,
    BusError,
    BusUnavailable,
    Consumer,
    DeliveryFailed,
    Fenced,
    Record,
    TopicPartition,
    TopicSpec,
)
from trainguard.agent.bus._partitioner import partition_for
from trainguard.agent.bus._sqlite import PROBE_LOCK_SHARE, SQLiteBus
from trainguard.agent.bus._sqlite_consumer import SQLiteConsumer
from trainguard.agent.bus._sqlite_db import ChangeWatch, connect, take_write_lock

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOPICS = (TopicSpec("events", partitions=3), TopicSpec("commands", partitions=2, compacted=True))
EVENTS = frozenset(TopicPartition("events", p) for p in range(3))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_bus(
    path: Path,
    session_timeout_s: float = 10.0,
    max_poll_interval_s: float = 60.0,
    **options: float,
) -> SQLiteBus:
    config = BusConfig(
        url=f"sqlite://{path}",
        topics=TOPICS,
        send_timeout_s=5.0,
        session_timeout_s=session_timeout_s,
        max_poll_interval_s=max_poll_interval_s,
    )
    return SQLiteBus(config, str(path), **options)


async def poll_until(
    consumer: Consumer, done: Callable[[list[Record]], bool], timeout_s: float = 10.0
) -> list[Record]:
    """Poll until ``done(records seen so far)``; those records."""
    records: list[Record] = []
    deadline = time.monotonic() + timeout_s
    while not done(records):
        assert time.monotonic() < deadline, "timed out"
        records.extend(await consumer.getmany(timeout_s=0.05))
    return records


async def test_member_that_stops_polling_loses_its_partitions(tmp_path: Path) -> None:
    """Its process runs, so its lease is renewed, but only until ``max_poll_interval_s``
    passed since its last poll (Kafka's ``max.poll.interval.ms``); then its lease runs out."""
    path = tmp_path / "bus.db"
    async with (
        make_bus(path, session_timeout_s=0.3, max_poll_interval_s=0.6) as bus_a,
        make_bus(path) as bus_b,
    ):
        a = await bus_a.subscribe(["events"], "g")
        b = await bus_b.subscribe(["events"], "g")
        assert b.assignment()
        assert b.assignment() < EVENTS
        started = time.monotonic()
        # A never polls again: B owns everything once A's keeper gave up (0.6 s after A's
        # last poll) and the lease it renewed last has run out (0.3 s more at most).
        await poll_until(b, lambda _: b.assignment() == EVENTS)
        assert time.monotonic() - started > 0.6
        # A's next poll rejoins the group and takes its share back.
        assert await a.getmany(timeout_s=0.05) == []
        assert a.assignment()
        await poll_until(b, lambda _: b.assignment() == EVENTS - a.assignment())


async def test_a_busy_member_keeps_its_partitions_past_its_session(tmp_path: Path) -> None:
    """A's owner does not poll for several sessions (a daemon sealing a large snapshot on a
    loaded machine) but its event loop runs: its keeper renews the lease, so a member joining
    then shares the partitions with A instead of taking them all, and A's next poll is no
    rejoin (same member id)."""
    path = tmp_path / "bus.db"
    async with make_bus(path, session_timeout_s=1.0) as bus_a, make_bus(path) as bus_b:
        a = await bus_a.subscribe(["events"], "g")
        assert isinstance(a, SQLiteConsumer)
        assert a.assignment() == EVENTS
        assert a.membership is not None
        member = a.membership.member_id
        await asyncio.sleep(3.0)  # three sessions without a poll
        b = await bus_b.subscribe(["events"], "g")
        assert b.assignment()
        assert b.assignment() < EVENTS
        assert await a.getmany(timeout_s=0.05) == []
        assert a.membership.member_id == member
        assert a.assignment() == EVENTS - b.assignment()


async def test_a_member_back_from_a_pause_gets_a_new_epoch_and_its_writer_is_fenced(
    tmp_path: Path,
) -> None:
    """A member that stopped polling past its lease (a paused daemon) and comes back to the
    very same partitions (no other member now): its assignment epoch moves although its
    assignment is the same, and its writer of before is fenced, nothing of it written."""
    path = tmp_path / "bus.db"
    async with (
        make_bus(path, session_timeout_s=0.3, max_poll_interval_s=0.3) as bus_a,
        make_bus(path) as bus_b,
    ):
        a = await bus_a.subscribe(["events"], "g")
        assert a.assignment() == EVENTS
        before = a.assignment_epoch()
        stale = await bus_a.partition_writer("g", 0)
        await stale.send("commands", "job-1", b"stale")
        b = await bus_b.subscribe(["events"], "g")
        await poll_until(b, lambda _: b.assignment() == EVENTS)  # A's lease ran out
        owner = await bus_b.partition_writer("g", 0)
        await owner.send("commands", "job-1", b"owner")
        await owner.commit({TopicPartition("events", 0): 1})
        await b.close()
        # The stale commit is queued behind A's first heartbeat since: that heartbeat must not
        # revive the old membership under which the writer was made.
        commit = asyncio.ensure_future(stale.commit({TopicPartition("events", 0): 2}))
        assert await a.getmany(timeout_s=0.05) == []
        with pytest.raises(Fenced):
            await commit
        assert a.assignment() == EVENTS
        assert a.assignment_epoch() > before
        with pytest.raises(Fenced):
            await stale.send("commands", "job-1", b"stale-2")
        latest = await bus_a.latest_per_key("commands")
        assert {k: r.value for k, r in latest.items()} == {"job-1": b"owner"}
        assert await a.committed(TopicPartition("events", 0)) == 1


async def test_a_writer_is_fenced_by_a_member_that_owned_its_partition_meanwhile(
    tmp_path: Path,
) -> None:
    """A holds its lease but does not poll; B joins, takes partition 0 over, commits, and
    leaves: partition 0 is A's again, and A never saw a change. A's writer of before must
    still be refused, as a Kafka producer is once another opened its transactional id."""
    path = tmp_path / "bus.db"
    async with make_bus(path) as bus_a, make_bus(path) as bus_b:
        a = await bus_a.subscribe(["events"], "g")
        # A owns every partition now; which of them B gets depends on the members' random ids.
        stale = {p: await bus_a.partition_writer("g", p) for p in range(3)}
        for writer in stale.values():
            await writer.send("commands", "job-1", b"stale")
        b = await bus_b.subscribe(["events"], "g")
        p = min(tp.partition for tp in b.assignment())
        tp = TopicPartition("events", p)
        owner = await bus_b.partition_writer("g", p)
        await owner.send("commands", "job-1", b"owner")
        await owner.commit({tp: 1})
        await b.close()
        with pytest.raises(Fenced):
            await stale[p].commit({tp: 2})
        latest = await bus_a.latest_per_key("commands")
        assert {k: r.value for k, r in latest.items()} == {"job-1": b"owner"}
        assert await a.committed(tp) == 1


async def test_closed_member_hands_over_at_once(tmp_path: Path) -> None:
    path = tmp_path / "bus.db"
    async with make_bus(path) as bus_a, make_bus(path) as bus_b:
        a = await bus_a.subscribe(["events"], "g")
        b = await bus_b.subscribe(["events"], "g")
        await poll_until(a, lambda _: a.assignment() == EVENTS - b.assignment())
        await b.close()
        started = time.monotonic()
        await poll_until(a, lambda _: a.assignment() == EVENTS)
        # Well within the 10 s session timeout: leaving does not wait for the lease to end.
        assert time.monotonic() - started < 0.5


async def test_commit_of_a_partition_lost_in_a_rebalance_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "bus.db"
    async with make_bus(path) as bus_a, make_bus(path) as bus_b:
        deliveries = [await bus_a.publish("events", f"job-{i}", b"x") for i in range(30)]
        a = await bus_a.subscribe(["events"], "g")
        assert len(await a.getmany(max_records=100)) == 30
        b = await bus_b.subscribe(["events"], "g")
        taken = b.assignment()
        # A has not polled since B joined: its commit must not move B's positions.
        await a.commit()
        await a.close()
        await b.close()
        lost = {
            (d.partition, d.offset)
            for d in deliveries
            if TopicPartition("events", d.partition) in taken
        }
        c = await bus_a.subscribe(["events"], "g")
        again = await poll_until(c, lambda got: len(got) >= len(lost))
        assert {(r.partition, r.offset) for r in again} == lost
        assert await c.getmany(timeout_s=0.3) == []


async def test_compaction_keeps_the_latest_record_per_key(tmp_path: Path) -> None:
    path = tmp_path / "bus.db"
    options = {"compaction_lag_s": 0.0, "compaction_interval_s": 0.0}
    async with make_bus(path, **options, tombstone_retention_s=0.0) as bus:
        for value in (b"1", b"2", b"3"):
            await bus.publish("commands", "job", value)
        await bus.publish("commands", "gone", b"1")
        await bus.publish("commands", "gone", None)
        await asyncio.sleep(0.01)  # so that the records above are older than the 0 ms lag
        await bus.publish("commands", "other", b"1")
        # The writer compacts after it confirms a batch and before it takes the next: once a
        # later write is confirmed, the pass that followed "other" is done.
        await bus.publish("events", "after", b"1")

        assert sum((await bus.end_offsets("commands")).values()) == 6
        latest = await bus.latest_per_key("commands")
        assert {k: r.value for k, r in latest.items()} == {"job": b"3", "other": b"1"}
        everything = {TopicPartition("commands", p): 0 for p in range(2)}
        async with await bus.assign(everything) as consumer:
            records = await consumer.getmany(timeout_s=1.0)
    # Superseded records and the old tombstone are gone; offsets keep their gaps and order.
    assert sorted((r.key, r.value) for r in records) == [("job", b"3"), ("other", b"1")]
    assert [r.offset for r in records if r.key == "job"] == [2]


async def test_send_fails_when_the_file_stays_locked(tmp_path: Path) -> None:
    path = tmp_path / "bus.db"
    config = BusConfig(url=f"sqlite://{path}", topics=TOPICS, send_timeout_s=0.3)
    async with SQLiteBus(config, str(path)) as bus:
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        future = await bus.send("events", "job", b"x")
        with pytest.raises(DeliveryFailed):
            await future
        assert time.monotonic() - started < 3.0
        blocker.execute("ROLLBACK")
        blocker.close()
        assert (await bus.publish("events", "job", b"y")).offset == 0


async def test_a_probe_calls_a_lock_held_with_no_commit_stuck_and_busy_writers_not(
    tmp_path: Path,
) -> None:
    path = tmp_path / "bus.db"
    async with make_bus(path) as bus:
        with written_busily(path):
            for _ in range(3):
                assert set(await bus.probe("events", 0.5)) == EVENTS
        locker = sqlite3.connect(path, isolation_level=None)
        locker.execute("BEGIN EXCLUSIVE")
        try:
            with pytest.raises(BusUnavailable):
                await bus.probe("events", 0.5)
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        assert set(await bus.probe("events", 0.5)) == EVENTS


async def test_a_lock_that_moves_answers_at_once_not_at_the_deadline(tmp_path: Path) -> None:
    """Under a steady stream of writers SQLite's busy handler rarely catches the lock free: the
    old probe then waited out most of its time (0.8 of it) on every look, and a loaded
    machine's delays in the rest made it miss its bound (a false outage in CI). The first
    commit seen answers now, however far the deadline."""
    path = tmp_path / "bus.db"

    def look() -> None:
        conn = connect(str(path), create=False)
        try:
            take_write_lock(conn, time.monotonic() + 120, 1.0)
        finally:
            conn.close()

    async with make_bus(path):
        with written_busily(path):
            await asyncio.wait_for(asyncio.to_thread(look), 10)


async def test_a_probe_whose_read_was_slow_does_not_call_a_busy_lock_stuck(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a loaded machine the probe's read may take most of its time; the few milliseconds
    left for watching the lock, shorter than one transaction of a busy writer, see no commit,
    and that proves nothing: the probe answers (a false outage, seen once in CI)."""
    path = tmp_path / "bus.db"
    timeout_s = 0.5
    async with make_bus(path) as bus:
        real_end_offsets = bus.end_offsets

        async def slow_end_offsets(topic: str) -> dict[TopicPartition, int]:
            ends = await real_end_offsets(topic)
            await asyncio.sleep(PROBE_LOCK_SHARE * timeout_s - 0.01)
            return ends

        monkeypatch.setattr(bus, "end_offsets", slow_end_offsets)
        with written_busily(path):
            for _ in range(5):
                assert set(await bus.probe("events", timeout_s)) == EVENTS


async def test_start_creates_the_directory(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "bus.db"
    async with make_bus(path) as bus:
        assert await bus.partitions("commands") == 2
    assert path.exists()


async def test_start_refuses_a_file_that_is_not_a_bus(tmp_path: Path) -> None:
    path = tmp_path / "bus.db"
    path.write_bytes(b"not a database" * 100)
    with pytest.raises(BusError) as raised:
        await make_bus(path).start()
    assert not raised.value.retriable
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("PRAGMA user_version = 99")
    with pytest.raises(BusError, match="schema version 99"):
        await make_bus(other).start()


async def test_a_bus_file_with_two_hard_links_is_refused_by_every_name(tmp_path: Path) -> None:
    """SQLite keeps a database's WAL beside the name it was opened by: two names of one file
    would corrupt it (a second daemon also got past the daemon lock through one, issue 13's
    tester). A symbolic link is one name spelt twice, and is fine."""
    path = tmp_path / "bus.db"
    async with make_bus(path):
        pass
    symbolic = tmp_path / "symbolic.db"
    symbolic.symlink_to(path)
    async with make_bus(symbolic) as bus:
        assert await bus.partitions("commands") == 2
    hard = tmp_path / "hard.db"
    hard.hardlink_to(path)
    for name in (path, hard, symbolic):
        with pytest.raises(BusError, match="has 2 hard links") as raised:
            await make_bus(name).start()
        assert not raised.value.retriable


async def test_start_gives_up_on_a_locked_file(tmp_path: Path) -> None:
    path = tmp_path / "bus.db"
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("PRAGMA journal_mode=WAL")
    blocker.execute("BEGIN IMMEDIATE")
    config = BusConfig(url=f"sqlite://{path}", topics=TOPICS, connect_timeout_s=0.3)
    with pytest.raises(BusUnavailable):
        await SQLiteBus(config, str(path)).start()
    blocker.close()


def test_memory_database_is_refused() -> None:
    with pytest.raises(BusError):
        SQLiteBus(BusConfig(url="sqlite://:memory:"), ":memory:")


async def test_record_from_another_connection_arrives_quickly(tmp_path: Path) -> None:
    path = tmp_path / "bus.db"
    async with make_bus(path) as producer, make_bus(path) as consumer_bus:
        consumer = await consumer_bus.assign(dict.fromkeys(EVENTS))
        await consumer.getmany(timeout_s=0.3)  # idle: the poll interval is at its longest
        sent = time.monotonic()
        await producer.publish("events", "job", b"restore")
        [record] = await consumer.getmany(timeout_s=5.0)
        assert record.value == b"restore"
        assert time.monotonic() - sent < 0.2


async def test_an_idle_consumer_polls_the_reader_only_when_the_file_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle consumer asks the change watch (``PRAGMA data_version`` on the loop's thread)
    and hops to its reader thread only when another connection committed meanwhile; what was
    committed still arrives, here after long idling and from another bus object."""
    path = tmp_path / "bus.db"
    async with make_bus(path) as producer, make_bus(path) as consumer_bus:
        consumer = await consumer_bus.assign(dict.fromkeys(EVENTS))
        await consumer.getmany(timeout_s=0.3)  # idle: the cadence at its longest
        hops = 0
        real_run = consumer_bus._reader.run

        async def counted(*args: object, **kwargs: object) -> object:
            nonlocal hops
            hops += 1
            return await real_run(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(consumer_bus._reader, "run", counted)
        assert await consumer.getmany(timeout_s=0.5) == []
        assert hops == 0, "an idle consumer of an unchanged file went to its reader thread"
        await producer.publish("events", "job", b"late")
        [record] = await poll_until(consumer, lambda got: len(got) >= 1)
        assert record.value == b"late"
        assert hops >= 1


async def test_the_change_watch_moves_with_other_connections_commits(tmp_path: Path) -> None:
    path = tmp_path / "bus.db"
    async with make_bus(path) as producer:
        watch = await ChangeWatch.open(str(path))
        before = watch.version()
        assert before is not None
        assert watch.version() == before  # nothing committed
        await producer.publish("events", "job", b"x")
        assert watch.version() != before
        watch.close()
        assert watch.version() is None  # closed: "look", never an error


async def test_a_reader_refuses_a_missing_file_and_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "typo" / "bus.db"
    config = BusConfig(url=f"sqlite://{path}", topics=TOPICS, create=False)
    with pytest.raises(BusError, match=re.escape(f"no embedded bus at {path}: start a daemon")):
        await SQLiteBus(config, str(path)).start()
    assert not (tmp_path / "typo").exists()


async def test_a_reader_refuses_an_empty_file_and_leaves_it_empty(tmp_path: Path) -> None:
    path = tmp_path / "bus.db"
    path.touch()  # what a read through an older trainguard left behind
    config = BusConfig(url=f"sqlite://{path}", topics=TOPICS, create=False)
    with pytest.raises(BusError, match="holds no embedded bus"):
        await SQLiteBus(config, str(path)).start()
    assert path.stat().st_size == 0


async def test_a_reader_creates_no_topic_and_names_the_prefixes_that_exist(
    tmp_path: Path,
) -> None:
    path = tmp_path / "bus.db"
    async with make_bus(path) as writer:
        await writer.publish("events", "job", b"x")
        assert await writer.topic_names() == {"trainguard.events", "trainguard.commands"}
    reader = BusConfig(url=f"sqlite://{path}", topics=TOPICS, create=False)
    async with SQLiteBus(reader, str(path)) as bus:
        assert await bus.end_offsets("events") == {
            TopicPartition("events", p): int(p == partition_for("job", 3)) for p in range(3)
        }
    mistyped = BusConfig(url=f"sqlite://{path}", prefix="x.", topics=TOPICS, create=False)
    async with SQLiteBus(mistyped, str(path)) as bus:
        with pytest.raises(BusError, match=re.escape("found topics under 'trainguard.'")):
            await bus.end_offsets("events")
        assert await bus.topic_names() == {"trainguard.events", "trainguard.commands"}
