"""The bus contract: what every adapter (embedded SQLite, Kafka) guarantees, tested through the
port only (``trainguard.agent.bus``), so each test runs unchanged on both adapters."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from trainguard.agent.bus import (
    BusClosed,
    BusError,
    Consumer,
    Delivery,
    DeliveryFailed,
    Fenced,
    Record,
    TopicPartition,
    topic_prefixes,
)
from trainguard.agent.bus._partitioner import partition_for

if TYPE_CHECKING:
    # Only for annotations: pytest imports conftest modules itself, under a name of its own.
    from tests.support.buses import BusFactory

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

PARTITIONS = 3
EVENTS = [TopicPartition("events", p) for p in range(PARTITIONS)]
WAIT_S = 30.0
"""Longest wait for records that must arrive (Kafka group joins take seconds)."""
QUIET_S = 1.0
"""How long a consumer is polled to show that nothing more arrives."""
PRODUCER_SCRIPT = Path(__file__).with_name("_producer.py")


async def read_until(
    consumer: Consumer, done: Callable[[list[Record]], bool], timeout_s: float = WAIT_S
) -> list[Record]:
    """Poll ``consumer`` until ``done(records so far)``; fail the test after ``timeout_s``."""
    records: list[Record] = []
    deadline = time.monotonic() + timeout_s
    while not done(records):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s with {len(records)} records")
        records.extend(await consumer.getmany(timeout_s=0.2))
    return records


async def read_n(consumer: Consumer, n: int) -> list[Record]:
    """Exactly the next ``n`` records (fails on a timeout or if more arrive in the batch)."""
    records = await read_until(consumer, lambda got: len(got) >= n)
    assert len(records) == n
    return records


async def assert_quiet(consumer: Consumer) -> None:
    """Nothing more arrives within :data:`QUIET_S`."""
    deadline = time.monotonic() + QUIET_S
    while time.monotonic() < deadline:
        assert await consumer.getmany(timeout_s=0.1) == []


async def publish_all(factory: BusFactory, items: list[tuple[str, bytes | None]]) -> list[Delivery]:
    """Send ``(key, value)`` pairs to ``events`` in one pipelined burst; their deliveries."""
    async with factory.open() as bus:
        futures = [await bus.send("events", key, value) for key, value in items]
        return list(await asyncio.gather(*futures))


def where(records: list[Record] | list[Delivery]) -> set[tuple[int, int]]:
    """The ``(partition, offset)`` of each record or delivery."""
    return {(r.partition, r.offset) for r in records}


async def test_records_of_one_key_keep_their_order(bus_factory: BusFactory) -> None:
    values = [b"%d" % i for i in range(200)]
    deliveries = await publish_all(bus_factory, [("job-1", v) for v in values])

    partition = partition_for("job-1", PARTITIONS)
    assert {d.partition for d in deliveries} == {partition}
    assert [d.offset for d in deliveries] == list(range(200))
    async with bus_factory.open() as bus:
        consumer = await bus.assign({TopicPartition("events", partition): 0})
        records = await read_n(consumer, 200)
    assert [r.value for r in records] == values
    assert [r.offset for r in records] == list(range(200))
    assert {(r.topic, r.partition, r.key) for r in records} == {("events", partition, "job-1")}
    now_ms = time.time() * 1000
    assert all(abs(r.timestamp_ms - now_ms) < 60_000 for r in records)


async def test_keys_spread_over_partitions_as_kafka_does(bus_factory: BusFactory) -> None:
    keys = [f"job-{i}" for i in range(60)]
    deliveries = await publish_all(bus_factory, [(key, b"x") for key in keys])

    assert [d.partition for d in deliveries] == [partition_for(k, PARTITIONS) for k in keys]
    assert len({d.partition for d in deliveries}) == PARTITIONS
    async with bus_factory.open() as bus:
        assert await bus.partitions("events") == PARTITIONS
        counts = {tp: 0 for tp in EVENTS}
        for d in deliveries:
            counts[TopicPartition("events", d.partition)] += 1
        assert await bus.end_offsets("events") == counts


async def test_end_offsets_count_the_records_of_each_partition(bus_factory: BusFactory) -> None:
    async with bus_factory.open() as bus:
        assert await bus.end_offsets("events") == {tp: 0 for tp in EVENTS}
        first = await bus.publish("events", "job-a", b"1")
        await bus.publish("events", "job-a", b"2")
        ends = await bus.end_offsets("events")
    assert ends[TopicPartition("events", first.partition)] == 2
    assert sum(ends.values()) == 2


async def test_explicit_offsets_and_seek(bus_factory: BusFactory) -> None:
    deliveries = await publish_all(bus_factory, [("job-x", b"%d" % i) for i in range(10)])
    tp = TopicPartition("events", deliveries[0].partition)
    async with bus_factory.open() as bus:
        from_four = await bus.assign({tp: 4})
        assert from_four.assignment() == {tp}
        assert [r.offset for r in await read_n(from_four, 6)] == list(range(4, 10))
        await from_four.seek(tp, 2)
        assert [r.value for r in await read_n(from_four, 8)] == [b"%d" % i for i in range(2, 10)]

        at_end = await bus.assign({tp: None})
        await assert_quiet(at_end)
        await bus.publish("events", "job-x", b"late")
        [late] = await read_n(at_end, 1)
        assert (late.offset, late.value) == (10, b"late")
        await from_four.close()
        await at_end.close()


async def test_a_group_without_commits_has_no_committed_position(bus_factory: BusFactory) -> None:
    async with bus_factory.open() as bus:
        consumer = await bus.subscribe(["events"], bus_factory.group("fresh"))
        assert await consumer.committed(TopicPartition("events", 0)) is None
        await consumer.close()


async def test_group_positions_are_read_without_joining_the_group(
    bus_factory: BusFactory,
) -> None:
    """What a supervisor sees of the daemon: its group's committed positions, read from outside
    the group (the member keeps its partitions: no rebalance)."""
    group = bus_factory.group("watched")
    await publish_all(bus_factory, [(f"job-{i}", b"x") for i in range(12)])
    async with bus_factory.open() as bus:
        assert await bus.group_positions(group, "events") == {}  # no such group yet
        consumer = await bus.subscribe(["events"], group)
        records = await read_n(consumer, 12)
        last = {tp: max(r.offset for r in records if r.tp == tp) + 1 for tp in EVENTS}
        read = {tp: n for tp, n in last.items() if tp != EVENTS[0]}
        await consumer.commit(read)
        async with bus_factory.open() as other:
            assert await other.group_positions(group, "events") == read
        assert consumer.assignment() == frozenset(EVENTS)
        await consumer.close()


async def test_commit_without_a_group_is_an_error(bus_factory: BusFactory) -> None:
    async with bus_factory.open() as bus, await bus.assign({EVENTS[0]: 0}) as consumer:
        with pytest.raises(BusError):
            await consumer.commit()


async def test_latest_per_key_drops_older_records_and_tombstones(
    bus_factory: BusFactory,
) -> None:
    async with bus_factory.open() as bus:
        for key, value in [("a", b"a1"), ("b", b"b1"), ("a", b"a2"), ("c", b"c1")]:
            await bus.publish("commands", key, value)
        last_a = await bus.publish("commands", "a", b"a3")
        gone = await bus.publish("commands", "c", None)
        latest = await bus.latest_per_key("commands")

    assert {k: r.value for k, r in latest.items()} == {"a": b"a3", "b": b"b1"}
    assert (latest["a"].partition, latest["a"].offset) == (last_a.partition, last_a.offset)
    assert latest["a"].topic == "commands"
    assert latest["a"].key == "a"
    assert gone.partition == partition_for("c", PARTITIONS)


async def test_a_record_sent_to_a_named_partition_lands_there(bus_factory: BusFactory) -> None:
    home = partition_for("job-a", PARTITIONS)
    async with bus_factory.open() as bus:
        placed = await bus.publish("commands", "job-a/part/0", b"x", partition=home)
        assert (placed.partition, placed.offset) == (home, 0)
        with pytest.raises(BusError):
            await bus.publish("commands", "job-a/part/1", b"x", partition=-1)
        latest = await bus.latest_per_key("commands")
    assert {k: r.partition for k, r in latest.items()} == {"job-a/part/0": home}


async def test_committed_positions_survive_a_consumer_restart(bus_factory: BusFactory) -> None:
    group = bus_factory.group("restart")
    before = await publish_all(bus_factory, [(f"job-{i % 10}", b"old") for i in range(30)])
    async with bus_factory.open() as bus:
        consumer = await bus.subscribe(["events"], group)
        assert where(await read_n(consumer, 30)) == where(before)
        await consumer.commit()
        await consumer.close()

    after = await publish_all(bus_factory, [(f"job-{i % 10}", b"new") for i in range(20)])
    async with bus_factory.open() as bus:
        consumer = await bus.subscribe(["events"], group)
        records = await read_n(consumer, 20)
        assert where(records) == where(after)
        assert {r.value for r in records} == {b"new"}
        await assert_quiet(consumer)
        await consumer.close()


async def test_consumer_restarted_mid_stream_resumes_at_its_commit(
    bus_factory: BusFactory,
) -> None:
    group = bus_factory.group("mid-stream")
    first = await publish_all(bus_factory, [("job-1", b"%d" % i) for i in range(40)])
    tp = TopicPartition("events", first[0].partition)
    async with bus_factory.open() as bus:
        consumer = await bus.subscribe(["events"], group)
        await read_n(consumer, 40)
        # The process dies after handling 15 records: only those are committed.
        await consumer.commit({tp: 15})
        await consumer.close()

    await publish_all(bus_factory, [("job-1", b"%d" % i) for i in range(40, 50)])
    async with bus_factory.open() as bus:
        consumer = await bus.subscribe(["events"], group)
        assert await consumer.committed(tp) == 15
        records = await read_n(consumer, 35)
        await consumer.close()
    assert [r.offset for r in records] == list(range(15, 50))
    assert [r.value for r in records] == [b"%d" % i for i in range(15, 50)]


async def test_group_members_share_partitions_and_hand_them_over(
    bus_factory: BusFactory,
) -> None:
    group = bus_factory.group("share")
    everything = set(EVENTS)
    async with bus_factory.open() as bus_a, bus_factory.open() as bus_b:
        a = await bus_a.subscribe(["events"], group)
        b = await bus_b.subscribe(["events"], group)
        deadline = time.monotonic() + WAIT_S
        while not (
            a.assignment()
            and b.assignment()
            and a.assignment().isdisjoint(b.assignment())
            and a.assignment() | b.assignment() == everything
        ):
            assert time.monotonic() < deadline, (a.assignment(), b.assignment())
            assert await a.getmany(timeout_s=0.1) == []
            assert await b.getmany(timeout_s=0.1) == []

        first = await publish_all(bus_factory, [(f"job-{i}", b"1") for i in range(60)])
        got: dict[str, list[Record]] = {"a": [], "b": []}
        deadline = time.monotonic() + WAIT_S
        while where(got["a"]) | where(got["b"]) != where(first):
            assert time.monotonic() < deadline
            for name, consumer in (("a", a), ("b", b)):
                records = await consumer.getmany(timeout_s=0.1)
                assert {r.tp for r in records} <= consumer.assignment()
                got[name].extend(records)
        assert got["a"]
        assert got["b"]
        await a.commit()
        await b.commit()
        await b.close()

        second = await publish_all(bus_factory, [(f"job-{i}", b"2") for i in range(30)])
        records = await read_until(
            a, lambda got: a.assignment() == everything and where(got) >= where(second)
        )
        # A took over B's partitions at B's committed positions: nothing lost, none repeated.
        assert where(records) == where(second)
        await a.close()


async def test_concurrent_producer_processes(bus_factory: BusFactory) -> None:
    producers, count, keys = 3, 400, 6
    specs = bus_factory.config().topics
    topics = json.dumps([[t.name, t.partitions, t.compacted] for t in specs])
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(PRODUCER_SCRIPT),
            bus_factory.url,
            bus_factory.prefix,
            topics,
            str(producer),
            str(count),
            str(keys),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for producer in range(producers)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"ready\n"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
        for proc in procs:
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert (proc.returncode, out) == (0, b"done\n"), err.decode()
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    async with bus_factory.open() as bus:
        ends = await bus.end_offsets("events")
        assert sum(ends.values()) == producers * count
        consumer = await bus.assign(dict.fromkeys(EVENTS, 0))
        records = await read_n(consumer, producers * count)
        await consumer.close()

    by_partition: dict[int, list[int]] = defaultdict(list)
    sequences: dict[tuple[int, str], list[int]] = defaultdict(list)
    for r in records:
        by_partition[r.partition].append(r.offset)
        assert r.value is not None
        producer, seq = map(int, r.value.split(b":"))
        assert r.key == f"k{seq % keys}"
        sequences[(producer, r.key)].append(seq)
    for tp, end in ends.items():
        assert by_partition[tp.partition] == list(range(end))
    assert sorted(s for seqs in sequences.values() for s in seqs) == sorted(
        list(range(count)) * producers
    )
    for seqs in sequences.values():
        assert seqs == sorted(seqs)


async def test_too_large_value_fails_its_delivery(bus_factory: BusFactory) -> None:
    async with bus_factory.open(max_message_bytes=4096) as bus:
        future = await bus.send("events", "job-1", b"x" * 4097)
        with pytest.raises(DeliveryFailed):
            await future
        delivered = await bus.publish("events", "job-1", b"x" * 1000)
        assert delivered.offset == 0


async def test_close_flushes_queued_sends(bus_factory: BusFactory) -> None:
    bus = bus_factory.open()
    await bus.start()
    futures = [await bus.send("events", f"job-{i % 5}", b"v") for i in range(100)]
    await bus.close()
    assert all(f.done() and f.exception() is None for f in futures)
    async with bus_factory.open() as bus:
        assert sum((await bus.end_offsets("events")).values()) == 100


async def test_closed_bus_and_consumers_raise_bus_closed(bus_factory: BusFactory) -> None:
    bus = bus_factory.open()
    await bus.start()
    assigned = await bus.assign({EVENTS[0]: 0})
    member = await bus.subscribe(["events"], bus_factory.group("closed"))
    await member.close()
    with pytest.raises(BusClosed):
        await member.getmany(timeout_s=0.1)
    with pytest.raises(BusClosed):
        await member.commit()
    await bus.close()
    with pytest.raises(BusClosed):
        await assigned.getmany(timeout_s=0.1)
    with pytest.raises(BusClosed):
        await bus.send("events", "job-1", b"x")
    with pytest.raises(BusClosed):
        await bus.publish("events", "job-1", b"x")
    with pytest.raises(BusClosed):
        await bus.subscribe(["events"], bus_factory.group("closed"))
    with pytest.raises(BusClosed):
        await bus.assign({EVENTS[0]: 0})
    with pytest.raises(BusClosed):
        await bus.end_offsets("events")
    with pytest.raises(BusClosed):
        await bus.latest_per_key("commands")
    await bus.close()


async def test_topic_names_list_every_prefix(bus_factory: BusFactory) -> None:
    """Topics of every prefix, full names; a bus of another prefix lists them too."""
    other = bus_factory.prefix + "b."
    wanted = {bus_factory.prefix + "events", other + "commands"}
    async with bus_factory.open(), bus_factory.open(prefix=other) as bus:
        # A broker's metadata learns of a topic another client just created a moment after
        # the creation returns, so the listing converges rather than being exact at once.
        deadline = time.monotonic() + WAIT_S
        while not wanted <= (names := await bus.topic_names()):
            assert time.monotonic() < deadline, sorted(wanted - names)
            await asyncio.sleep(0.1)
    assert {bus_factory.prefix, other} <= set(topic_prefixes(names))


# -- several owners: assignment epochs and partition writers ---------------------------------


async def assigned_everything(consumer: Consumer) -> None:
    """Poll ``consumer`` until the group assigned it every partition of ``events``."""
    deadline = time.monotonic() + WAIT_S
    while consumer.assignment() != frozenset(EVENTS):
        assert time.monotonic() < deadline, consumer.assignment()
        assert await consumer.getmany(timeout_s=0.1) == []


async def values_of(bus_factory: BusFactory, topic: str) -> list[bytes | None]:
    """Every record value of ``topic`` a reader sees, up to the end offsets (by position:
    transaction markers carry no record)."""
    async with bus_factory.open() as bus:
        ends = {tp: end for tp, end in (await bus.end_offsets(topic)).items() if end > 0}
        if not ends:
            return []
        values: list[bytes | None] = []
        async with await bus.assign(dict.fromkeys(ends, 0)) as reader:
            deadline = time.monotonic() + WAIT_S
            while any([await reader.position(tp) < end for tp, end in ends.items()]):
                assert time.monotonic() < deadline
                values += [r.value for r in await reader.getmany(timeout_s=0.2)]
        return values


async def committed_becomes(consumer: Consumer, tp: TopicPartition, position: int) -> None:
    """Wait until the group's committed position of ``tp`` reads ``position``: Kafka writes a
    transaction's markers after the commit returns, and serves the position before until
    then (a new owner reads it only after opening its writer, which waits for them)."""
    deadline = time.monotonic() + WAIT_S
    while (got := await consumer.committed(tp)) != position:
        assert time.monotonic() < deadline, got
        await asyncio.sleep(0.05)


async def test_assignment_epoch_moves_with_every_rebalance(bus_factory: BusFactory) -> None:
    group = bus_factory.group("epochs")
    async with bus_factory.open() as bus_a, bus_factory.open() as bus_b:
        a = await bus_a.subscribe(["events"], group)
        await assigned_everything(a)
        first = a.assignment_epoch()
        assert first > 0
        b = await bus_b.subscribe(["events"], group)
        deadline = time.monotonic() + WAIT_S
        while not (a.assignment() and b.assignment() and a.assignment() != frozenset(EVENTS)):
            assert time.monotonic() < deadline
            await a.getmany(timeout_s=0.1)
            await b.getmany(timeout_s=0.1)
        shared = a.assignment_epoch()
        assert shared > first
        await b.close()
        await assigned_everything(a)
        assert a.assignment_epoch() > shared
        async with await bus_a.assign({EVENTS[0]: 0}) as plain:
            assert plain.assignment_epoch() == 0
        await a.close()


async def test_a_partition_writer_shows_its_records_and_position_together_or_not_at_all(
    bus_factory: BusFactory,
) -> None:
    group = bus_factory.group("txn")
    await publish_all(bus_factory, [(f"job-{i}", b"in") for i in range(9)])
    async with bus_factory.open() as bus:
        consumer = await bus.subscribe(["events"], group)
        await assigned_everything(consumer)
        tp = EVENTS[1]
        writer = await bus.partition_writer(group, tp.partition)
        await writer.send("commands", "job-a", b"dropped")
        await writer.abort()
        await writer.send("commands", "job-a", b"kept-1")
        await writer.send("commands", "job-b", b"kept-2")
        assert await values_of(bus_factory, "commands") == []  # not committed yet
        assert await consumer.committed(tp) is None
        await writer.commit({tp: 2})
        assert sorted(v or b"" for v in await values_of(bus_factory, "commands")) == [
            b"kept-1",
            b"kept-2",
        ]
        await committed_becomes(consumer, tp, 2)
        await writer.commit({tp: 3})  # offsets alone
        await committed_becomes(consumer, tp, 3)
        await writer.close()
        with pytest.raises(BusError):
            await writer.send("commands", "job-a", b"closed")
        await consumer.close()


async def test_a_partition_writer_puts_a_record_on_the_partition_it_names(
    bus_factory: BusFactory,
) -> None:
    """Records under keys of their own that must sit with another key's (a job's snapshot
    chunks) name that key's partition; their tombstones too, which hide them from
    ``latest_per_key``. A partition the topic does not have is refused."""
    group = bus_factory.group("placed")
    await publish_all(bus_factory, [("job-a", b"in")])
    home = partition_for("job-a", PARTITIONS)
    keys = [f"job-a/part/{i}" for i in range(12)]
    assert {partition_for(k, PARTITIONS) for k in keys} != {home}  # they would hash elsewhere
    async with bus_factory.open() as bus:
        consumer = await bus.subscribe(["events"], group)
        await assigned_everything(consumer)
        tp = EVENTS[home]
        writer = await bus.partition_writer(group, home)
        for key in keys:
            await writer.send("commands", key, key.encode(), partition=home)
        await writer.send("commands", "job-a", b"head")
        with pytest.raises(BusError):
            await writer.send("commands", "job-a/part/x", b"x", partition=PARTITIONS)
        await writer.commit({tp: 1})
        latest = await bus.latest_per_key("commands")
        assert {k: r.partition for k, r in latest.items()} == dict.fromkeys([*keys, "job-a"], home)
        for key in keys[1:]:
            await writer.send("commands", key, None, partition=home)
        await writer.commit({})
        latest = await bus.latest_per_key("commands")
        assert {k: r.value for k, r in latest.items()} == {
            keys[0]: keys[0].encode(),
            "job-a": b"head",
        }
        await writer.close()
        await consumer.close()


async def test_a_new_owner_fences_the_writer_of_the_old_one(bus_factory: BusFactory) -> None:
    """The old owner (its consumer gone from the group, as a paused member evicted) can
    neither commit what it had sent nor send more: the new owner's writer fenced it."""
    group = bus_factory.group("fence")
    tp = EVENTS[2]
    async with bus_factory.open() as bus_a, bus_factory.open() as bus_b:
        a = await bus_a.subscribe(["events"], group)
        await assigned_everything(a)
        old = await bus_a.partition_writer(group, tp.partition)
        await old.send("commands", "job-z", b"zombie")
        await a.close()
        b = await bus_b.subscribe(["events"], group)
        await assigned_everything(b)
        new = await bus_b.partition_writer(group, tp.partition)
        await new.send("commands", "job-z", b"owner")
        await new.commit({tp: 5})
        with pytest.raises(Fenced):
            await old.commit({tp: 7})
        with pytest.raises(Fenced):
            await old.send("commands", "job-z", b"zombie-2")
        await old.abort()  # a no-op once fenced
        await old.close()
        assert await values_of(bus_factory, "commands") == [b"owner"]
        await committed_becomes(b, tp, 5)
        await new.close()
        await b.close()
