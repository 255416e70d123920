"""State snapshots larger than one bus record, on real buses: written as chunks behind a signed
head on the job's partition, read back by a restarted daemon (no fold from offset 0, the states
of a full fold); the chunks a newer snapshot replaced get tombstones, which compaction reclaims;
a swapped, missing, flipped or truncated chunk and a stale head are refused with their reason
and the partition is folded from the log to the same states. A realistic large state (4,096
ranks, over the default 1 MiB) round-trips through the store in chunks."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
from structlog.testing import capture_logs

from tests.support.buses import BusFactory
from tests.support.machine_scenarios import JOB, config
from tests.support.service_support import (
    acknowledgements,
    eventually,
    issued,
    read_all,
    running,
)
from tests.support.snapshot_jobs import (
    HERE,
    MACHINE,
    A,
    B,
    C,
    E,
    daemon_config,
    fallbacks,
    first_daemon,
    folded,
    killed,
    publish,
    started,
    total_records,
    training,
)
from tests.support.snapshot_keys import make_keys
from tests.support.traces import Job, drive, simulate
from trainguard.agent.bus import DEFAULT_TOPICS, Bus, Record, TopicPartition
from trainguard.agent.bus import _sqlite_log as sqlite_log
from trainguard.agent.bus._partitioner import partition_for
from trainguard.daemon import DaemonService
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.daemon.core._state import JobState
from trainguard.daemon.core._state_codec import encode_state
from trainguard.daemon.demo._harness import start_daemon, stop_process
from trainguard.daemon.service._metrics import DaemonMetrics
from trainguard.daemon.service._snapshot_chunks import Chunk, Head, chunk_job, head_of
from trainguard.daemon.service._snapshot_store import Rebuild, Snapshots
from trainguard.schemas import Abort, Event, Restore, Resume, decode

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

SMALL = 1200
"""``max_message_bytes`` of these daemons: events and audit entries (up to 1.15 kB) fit, every
job's snapshot (1.25-1.6 kB compressed) is written in two chunks."""


async def heads(bus: Bus) -> dict[str, tuple[Record, Head | None]]:
    """Each job's latest record on ``snapshots`` and its head (``None``: a whole envelope)."""
    latest = await bus.latest_per_key("snapshots")
    return {
        key: (record, head_of(record.value or b""))
        for key, record in latest.items()
        if chunk_job(key) is None
    }


async def last_records(bus: Bus, topic: str) -> dict[str, Record]:
    """The last record of every key of ``topic``, tombstones included (``latest_per_key``
    leaves those out)."""
    ends = {tp: end for tp, end in (await bus.end_offsets(topic)).items() if end > 0}
    last: dict[str, Record] = {}
    if not ends:
        return last
    async with await bus.assign(dict.fromkeys(ends, 0)) as consumer:
        pending = set(ends)
        while pending:
            for record in await consumer.getmany(timeout_s=0.5):
                if record.key is not None:
                    last[record.key] = record
            # Past transaction markers, which no record carries.
            pending = {tp for tp in pending if await consumer.position(tp) < ends[tp]}
    return last


async def test_a_snapshot_larger_than_a_record_is_read_back_from_its_chunks(
    bus_factory: BusFactory,
) -> None:
    keys = make_keys(1)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await first_daemon(bus_factory, bus, keys, max_message_bytes=SMALL)
        latest = await bus.latest_per_key("snapshots")
        found = await heads(bus)
        assert set(found) == {A, B, C, E}
        for job, (record, head) in found.items():
            assert head is not None, f"{job}'s snapshot is not in chunks"
            assert len(head.chunks) >= 2
            assert len(record.value or b"") <= SMALL
            for chunk in head.chunks:
                assert chunk_job(chunk.key) == job
                assert latest[chunk.key].partition == record.partition, "on the job's partition"
                assert len(latest[chunk.key].value or b"") == chunk.size <= SMALL
        covered = await total_records(bus)
        later = [*training(A, range(12, 14)), *training(C, range(6, 8))]
        await publish(bus, later)

        b = DaemonService(
            daemon_config(bus_factory, "daemon-b", max_message_bytes=SMALL), keys=keys
        )
        with capture_logs() as logs:
            async with running(b):
                await eventually(lambda: folded(b, len(later)), timeout_s=60.0)
                states = dict(b.jobs)
        restored = [e for e in logs if e["event"] == "partition restored from snapshots"]
        assert HERE in {e["partition"] for e in restored}
        assert not [e for e in logs if e["event"].startswith("snapshots unusable")]
        assert b.counters["folded"] - b.counters["ticks"] == len(later)
        assert b.counters["folded"] < await total_records(bus) - covered + len(later)

        full = DaemonService(daemon_config(bus_factory, "daemon-c"))  # no keys: from offset 0
        async with running(full):
            await asyncio.wait_for(full.ready.wait(), 60)
            assert full.jobs == states


async def test_the_chunks_a_newer_snapshot_replaced_are_tombstoned_and_compacted(
    bus_factory: BusFactory,
) -> None:
    keys = make_keys(1)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await first_daemon(bus_factory, bus, keys, max_message_bytes=SMALL)
        first = {job: head for job, (_, head) in (await heads(bus)).items()}
        later = [*training(A, range(12, 14)), *training(C, range(6, 8))]
        await publish(bus, later)
        config_b = daemon_config(bus_factory, "daemon-b", max_message_bytes=SMALL)
        async with running(DaemonService(config_b, keys=keys)) as b:
            await eventually(lambda: folded(b, len(later)), timeout_s=60.0)
        second = {job: head for job, (_, head) in (await heads(bus)).items()}
        changed = {A, C}
        for job in changed:
            old, new = first[job], second[job]
            assert old is not None
            assert new is not None
            assert new.header.offset > old.header.offset
        # Unchanged jobs (B finished, E on another partition) keep their snapshot and chunks.
        assert {j: h for j, h in second.items() if j not in changed} == {
            j: h for j, h in first.items() if j not in changed
        }
        last = await last_records(bus, "snapshots")
        replaced = {c.key for job in changed for c in chunks_of(first[job])}
        current = {c.key for head in second.values() for c in chunks_of(head)}
        assert replaced
        assert not replaced & current
        assert {key for key in replaced if last[key].value is None} == replaced, "tombstoned"
        assert {k for k in last if chunk_job(k) and last[k].value is not None} == current
        for key in replaced:
            assert last[key].partition == HERE

        if bus_factory.kind == "sqlite":
            # A compaction pass (its lags at 0) deletes the replaced chunks and their
            # tombstones; a daemon still starts from the snapshots left.
            path = bus_factory.url.removeprefix("sqlite://")
            with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
                assert sqlite_log.compact(conn, 0, 0, 0, time.monotonic() + 30)
                keys_left = {k for (k,) in conn.execute("SELECT key FROM records")}
            assert not replaced & keys_left
            assert current <= keys_left
            config_c = daemon_config(bus_factory, "daemon-c", max_message_bytes=SMALL)
            c = DaemonService(config_c, keys=keys)
            async with running(c):
                await asyncio.wait_for(c.ready.wait(), 60)
            assert c.counters["folded"] == c.counters["ticks"]
            assert c.jobs == b.jobs


def chunks_of(head: Head | None) -> tuple[Chunk, ...]:
    assert head is not None, "a job's snapshot is not in chunks"
    return head.chunks


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        ("swap", "chunk_corrupt"),
        ("missing", "chunk_missing"),
        ("flip", "chunk_corrupt"),
        ("truncate", "chunk_corrupt"),
        ("stale_head", "chunk_missing"),
    ],
)
async def test_a_bad_chunk_or_a_stale_head_is_refused_and_the_state_recovered_from_the_log(
    bus_factory: BusFactory, tamper: str, reason: str
) -> None:
    keys = make_keys(1)
    small = daemon_config(bus_factory, "daemon-b", max_message_bytes=SMALL)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        expected = await first_daemon(bus_factory, bus, keys, max_message_bytes=SMALL)
        found = await heads(bus)
        latest = await bus.latest_per_key("snapshots")
        (_, head_a), (_, head_c) = found[A], found[C]
        assert head_a is not None
        assert head_c is not None
        first, second = head_a.chunks[0].key, head_a.chunks[1].key
        value = latest[first].value or b""
        if tamper == "swap":  # the first chunk of C's snapshot in place of A's
            await bus.publish(
                "snapshots", first, latest[head_c.chunks[0].key].value, partition=HERE
            )
        elif tamper == "missing":
            await bus.publish("snapshots", second, None, partition=HERE)
        elif tamper == "flip":
            flipped = value[:99] + bytes([value[99] ^ 1]) + value[100:]
            await bus.publish("snapshots", first, flipped, partition=HERE)
        elif tamper == "truncate":
            await bus.publish("snapshots", first, value[:-10], partition=HERE)
        else:  # A's head of the first round, put back after a second round replaced its chunks
            later = training(A, range(12, 14))
            await publish(bus, later)
            async with running(DaemonService(small, keys=keys)) as writer:
                await eventually(lambda: folded(writer, len(later)), timeout_s=60.0)
                expected = dict(writer.jobs)
            await bus.publish("snapshots", A, found[A][0].value)
        ends = await bus.end_offsets("events")
        records_here = sum(end for tp, end in ends.items() if tp.partition == HERE)

        b = DaemonService(
            daemon_config(bus_factory, "daemon-c", max_message_bytes=SMALL), keys=keys
        )
        with capture_logs() as logs:
            async with running(b):
                await asyncio.wait_for(b.ready.wait(), 60)
                assert b.jobs == expected
    refusals = [e for e in logs if e["event"].startswith("snapshots unusable")]
    assert [(e["partition"], e["reason"], e["job_id"]) for e in refusals] == [(HERE, reason, A)]
    assert fallbacks(b, reason) == 1
    # Only the bad partition from offset 0; the others from their snapshots.
    assert b.counters["folded"] - b.counters["ticks"] == records_here


# -- the store alone, with a realistic large state ---------------------------------------------

RANKS = 4096


@pytest.fixture(scope="module")
def large() -> JobState:
    """A running 4,096-rank job with 6 committed checkpoints, folded through the pure core
    from a simulated trace (heartbeats every second, a checkpoint every 2 steps)."""
    job = Job(
        world_size=RANKS, steps=13, checkpoint_every=2, init_s=1.0, first_step_s=1.0, tail_s=0.5
    )
    trace = simulate(job)
    state, _ = drive([i for i in trace.inputs if i.at_ns < trace.ends[job.steps]], cfg=config())
    assert state.phase == "running"
    assert len(state.ranks) == RANKS
    assert len(state.committed) == 6
    return state


async def test_a_large_state_round_trips_through_the_store_in_chunks(
    bus_factory: BusFactory, large: JobState
) -> None:
    """Over the default ``max_message_bytes`` (1 MiB) uncompressed; compressed (the state
    keeps references, not manifests) it is written in chunks of at most 64 KiB inside a
    partition writer's transaction, loaded back equal."""
    keys = make_keys(1)
    cfg = config()
    limit = 1 << 16
    assert len(encode_state(large)) > 16 * limit
    partition = partition_for(JOB, 6)
    group = bus_factory.group("daemon")
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        consumer = await bus.subscribe(["events"], group)
        await eventually(_assigned(consumer), timeout_s=60.0)
        writer = await bus.partition_writer(group, partition)
        store = Snapshots(cfg, DaemonMetrics(), max_message_bytes=limit)
        assert await store.write(writer, partition, 500, {JOB: large}, keys) == 1
        await writer.commit({TopicPartition("events", partition): 500})
        store.committed(partition)
        found = await heads(bus)
        [(_, head)] = found.values()
        assert head is not None
        assert len(head.chunks) >= 2
        assert head.size > limit
        plans = await Snapshots(cfg, DaemonMetrics(), max_message_bytes=limit).load(
            bus, {partition: 500}, keys
        )
        plan = plans[partition]
        assert isinstance(plan, Rebuild)
        assert plan.states == {JOB: large}
        # Written again unchanged under the same keys: nothing sent.
        assert await store.write(writer, partition, 500, {JOB: large}, keys) == 0
        await writer.close()
        await consumer.close()


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
async def test_a_snapshot_whose_head_does_not_fit_a_record_is_not_written_and_said_so(
    bus_factory: BusFactory, large: JobState
) -> None:
    keys = make_keys(1)
    partition = partition_for(JOB, 6)
    group = bus_factory.group("daemon")
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        consumer = await bus.subscribe(["events"], group)
        await eventually(_assigned(consumer), timeout_s=60.0)
        writer = await bus.partition_writer(group, partition)
        store = Snapshots(config(), DaemonMetrics(), max_message_bytes=4096)
        with capture_logs() as logs:
            assert await store.write(writer, partition, 500, {JOB: large}, keys) == 0
        await writer.commit({})
        assert await bus.latest_per_key("snapshots") == {}
        await writer.close()
        await consumer.close()
    [warning] = [e for e in logs if e["event"] == "snapshot not written"]
    assert "head" in warning["error"]
    assert "max_message_bytes=4096" in warning["error"]


def _assigned(consumer: Any) -> Any:
    async def check() -> bool:
        await consumer.getmany(timeout_s=0.1)
        return bool(consumer.assignment())

    return check


# -- a daemon process killed and started again ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
async def test_a_daemon_killed_after_writing_chunks_starts_from_them_and_decides_nothing_twice(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    """``trainguard daemon`` writes its rounds every 0.3 s (a job's pulse ticks move its
    position on), A's in chunks (32 committed checkpoints kept make its state larger than a
    record, ``max_message_bytes`` 2 kB, which its restore's audit entry still fits), restores a killed rank of A and is SIGKILLed once the
    round after the restore is on the bus; the next daemon rebuilds the partition from those
    chunks (no fold from offset 0, no fallback) and, when the ranks acknowledge, resumes the
    job: one restore and one resume, on ``commands`` and in the audit trail."""
    admin = KeyAdmin(tmp_path / "keys")
    admin.init()
    machine = "\n".join(f"{name} = {value!r}" for name, value in MACHINE.items())
    machine += "\nkeep_snapshots = 32"
    settings = tmp_path / "daemon.toml"
    settings.write_text(
        f"[bus]\nmax_message_bytes = 2048\n[machine]\n{machine}\n"
        f'[service]\nsnapshot_interval_s = 0.3\n[security]\nkeys_dir = "{admin.path}"\n'
    )
    logs: list[Path] = []
    daemons: list[subprocess.Popen[bytes]] = []

    def start() -> Path:
        logs.append(tmp_path / f"daemon-{len(logs) + 1}.log")
        daemons.append(
            start_daemon(
                bus_factory.url,
                prefix=bus_factory.prefix,
                log_path=logs[-1],
                args=["--config", str(settings)],
            )
        )
        return logs[-1]

    try:
        async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
            events: list[Event] = [started(A, 0), started(A, 1)]  # seq grows from here
            for k in range(1, 33):
                events += training(A, range(10 * k - 9, 10 * k + 1), commit_at=10 * k)
            await publish(bus, events)
            first = start()
            await publish(bus, [killed(A, 1)])
            [restore] = await eventually(lambda: restores_of(bus, A), timeout_s=60.0)
            # The restore and its tick are on the bus below this offset.
            after = (await bus.end_offsets("events"))[TopicPartition("events", HERE)]

            async def round_after_restore() -> bool:
                _, head = (await heads(bus)).get(A, (None, None))
                return head is not None and head.header.offset >= after and len(head.chunks) > 1

            await eventually(round_after_restore, timeout_s=60.0)
            assert stop_process(daemons[0], signal.SIGKILL) == -signal.SIGKILL

            second = start()
            await eventually(lambda: logged(second, "daemon ready"), timeout_s=60.0)
            rebuilt = [
                e for e in entries(second) if e["event"] == "partition restored from snapshots"
            ]
            assert HERE in {e["partition"] for e in rebuilt}
            assert not [e for e in entries(second) if e["event"].startswith("snapshots unusable")]
            [assigned] = [
                e
                for e in entries(second)
                if e["event"] == "partition assigned" and e["partition"] == HERE
            ]
            assert 0 < assigned["start"] <= assigned["replay_until"], "not folded from offset 0"
            assert await logged(first, "snapshots written")

            await publish(bus, list(acknowledgements(restore)))
            await eventually(lambda: resumed(bus, A), timeout_s=60.0)
            kinds = Counter(
                (type(c).__name__, c.job_id, c.generation)
                for c in map(decode, await read_all(bus, "commands"))
                if isinstance(c, Restore | Resume | Abort)
            )
            assert kinds == Counter({("Restore", A, 1): 1, ("Resume", A, 1): 1})
            assert issued(await read_all(bus, "audit")) == Counter({(A, 1): 2})
    finally:
        for proc in daemons:
            stop_process(proc, signal.SIGKILL)


async def restores_of(bus: Bus, job: str) -> list[Restore]:
    commands = map(decode, await read_all(bus, "commands"))
    return [c for c in commands if isinstance(c, Restore) and c.job_id == job]


async def resumed(bus: Bus, job: str) -> bool:
    return any(
        isinstance(c, Resume) and c.job_id == job
        for c in map(decode, await read_all(bus, "commands"))
    )


def entries(log: Path) -> list[dict[str, Any]]:
    """The JSON log's entries (lines that are no JSON object left out)."""
    found: list[dict[str, Any]] = []
    for line in log.read_bytes().splitlines():
        with contextlib.suppress(orjson.JSONDecodeError):
            entry = orjson.loads(line)
            if isinstance(entry, dict):
                found.append(entry)
    return found


async def logged(log: Path, event: str) -> bool:
    return any(e.get("event") == event for e in entries(log))
