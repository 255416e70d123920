"""The daemon service on a real bus (SQLite and Kafka): it acts on the machine's decisions,
writes ticks into the log, parks bad input in the dead-letter topic, and rebuilds after a
restart without deciding anything twice."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import math
from typing import Any

import orjson
import pytest
import structlog

from tests.support.buses import BusFactory
from tests.support.service_support import (
    EVENTS,
    JOB,
    beat,
    commands,
    daemon_config,
    eventually,
    killed,
    publish,
    read_all,
    running,
    shard,
    started,
)
from trainguard.agent.bus import DEFAULT_TOPICS, Bus, Record, TopicPartition
from trainguard.agent.bus._partitioner import partition_for
from trainguard.daemon import DaemonService
from trainguard.daemon.catalog._catalog import Catalog
from trainguard.daemon.forensics._report_record import read_audit
from trainguard.schemas import (
    Abort,
    ClockTick,
    Lifecycle,
    Manifest,
    Restore,
    Resume,
    decode,
    encode,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


async def test_an_exit_leads_to_one_restore_also_across_a_restart(bus_factory: BusFactory) -> None:
    config = daemon_config(bus_factory)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, started(0), started(1), beat(0, 1, 10), beat(1, 1, 10))
        await publish(bus, shard(0, 2, 10), shard(1, 2, 10), killed(1))
        async with running(DaemonService(config)):
            restores = await eventually(lambda: _restores(bus))
        [restore] = restores
        assert restore.generation == 1
        assert restore.target is not None
        assert restore.target.step == 10
        assert "signal 9" in restore.reason
        manifests = [decode(v, expect=Manifest) for v in await read_all(bus, "manifests")]
        assert [m.snapshot_id for m in manifests] == [f"{JOB}/g0/s10"]

        # A new daemon instance (same group) rebuilds from the log and decides nothing new.
        async with running(DaemonService(config)) as second:
            await asyncio.wait_for(second.ready.wait(), 30)
            await eventually(lambda: _folded(second))
            assert second.jobs[JOB].phase == "restoring"
        assert len(await _restores(bus)) == 1


class _NeverCommits(DaemonService):
    """A daemon whose transactions never commit (as one that dies before its commit)."""

    def _start_commit(self, part: Any) -> None:
        return None


async def test_decisions_acted_on_but_not_committed_are_never_seen_and_decided_once(
    bus_factory: BusFactory,
) -> None:
    """A daemon that sends a restore but dies before committing its position: the restore and
    its audit entry are never visible, and the next daemon decides and sends it exactly once."""
    config = daemon_config(bus_factory)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, started(0), started(1), shard(0, 1, 5), shard(1, 1, 5), killed(0))
        async with running(_NeverCommits(config)) as first:
            await eventually(lambda: _sent(first))
        assert await _restores(bus) == []
        assert await read_all(bus, "audit") == []
        async with running(DaemonService(config)) as second:
            await eventually(lambda: _restores(bus))
            assert second.counters["commands"] == 1
        assert len(await _restores(bus)) == 1
        assert len(_decided_restores(await read_all(bus, "audit"))) == 1


class _FailsToIssue(DaemonService):
    """A daemon with a fault of its own: acting on a restore raises (a bug, not a bus error)."""

    async def _issue(self, partition: int, job: str, command: Any) -> None:
        raise RuntimeError("a fault of the daemon's own")


async def test_a_daemon_that_fails_in_the_middle_of_acting_commits_nothing_of_it(
    bus_factory: BusFactory,
) -> None:
    """The daemon raises while acting on a kill's decisions: the loop ends with the error, and
    the partition's open transaction is not committed (it was, on the way out, with the
    position past the kill: a restarted daemon then refolded the kill silently and never
    issued its restore). The next daemon decides and sends the restore once."""
    config = daemon_config(bus_factory)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, started(0), started(1), shard(0, 1, 5), shard(1, 1, 5), killed(0))
        with pytest.raises(RuntimeError, match="a fault of the daemon's own"):
            await asyncio.wait_for(_FailsToIssue(config).run(asyncio.Event()), 60)
        assert await _restores(bus) == []
        async with running(DaemonService(config)) as second:
            await eventually(lambda: _restores(bus))
            assert second.counters["commands"] == 1
        assert len(await _restores(bus)) == 1


# Kafka only: a second daemon on an embedded bus file waits for the first one's lock instead
# of sharing the partitions (tests/service/daemon/test_embedded_lock.py).
@pytest.mark.parametrize(
    "bus_factory", [pytest.param("kafka", marks=pytest.mark.kafka)], indirect=True
)
async def test_a_standby_taking_a_job_over_decides_the_owners_uncommitted_restore_once(
    bus_factory: BusFactory,
) -> None:
    """Failover between two instances of one group: the owner sends a restore but its
    commits fail, and it leaves. The standby folds the input live again; the owner's restore
    was never visible, the standby's is, once."""

    class CommitsCanFail(DaemonService):
        fail_commits = False

        def _start_commit(self, part: Any) -> None:
            if not self.fail_commits:
                super()._start_commit(part)

    config = daemon_config(bus_factory)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        partition = partition_for(JOB, await bus.partitions("events"))
        daemons = (CommitsCanFail(config), CommitsCanFail(config))
        stops = (asyncio.Event(), asyncio.Event())
        tasks = [asyncio.ensure_future(d.run(s)) for d, s in zip(daemons, stops, strict=True)]
        try:

            async def split() -> bool:
                owned = [set(d._partitions) for d in daemons if d.ready.is_set()]
                return len(owned) == 2 and all(owned) and not owned[0] & owned[1]

            await eventually(split, 60)
            owner = 0 if partition in daemons[0]._partitions else 1
            daemons[owner].fail_commits = True
            await publish(bus, started(0), started(1), shard(0, 1, 5), shard(1, 1, 5), killed(0))
            await eventually(lambda: _sent(daemons[owner]))
            assert await _restores(bus) == []
            stops[owner].set()
            await asyncio.wait_for(tasks[owner], 60)
            await eventually(lambda: _phase(daemons[1 - owner], "restoring"), 60)
        finally:
            for stop in stops:
                stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
        # A commit returns once the coordinator has logged it; the markers that make it
        # visible to read_committed readers follow (KIP-98), so the restore may show a little
        # after the standby stopped.
        await eventually(lambda: _restores(bus))
        assert len(await _restores(bus)) == 1
        assert len(_decided_restores(await eventually(lambda: read_all(bus, "audit")))) == 1


async def test_silence_is_detected_through_ticks_written_into_the_log(
    bus_factory: BusFactory,
) -> None:
    config = daemon_config(
        bus_factory, heartbeat_timeout_s=1.0, heartbeat_interval_s=0.25, bus_gap_s=0.75
    )
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, started(0), started(1))
        # Both beats queued before either is awaited, so that they are appended together: the
        # incident names every rank due within one heartbeat interval (0.25 s) of the first,
        # and one awaited send at a time on a loaded broker can take longer than that.
        deliveries = [
            await bus.send("events", JOB, encode(b)) for b in (beat(0, 1, 3), beat(1, 1, 3))
        ]
        await asyncio.gather(*deliveries)
        async with running(DaemonService(config)):
            [restore] = await eventually(lambda: _restores(bus))
        assert "no event from ranks 0, 1" in restore.reason
        values = await read_all(bus, "events")
        assert any(isinstance(decode(v), ClockTick) for v in values if v is not None)


async def test_a_daemon_back_from_an_outage_times_its_restore_from_when_it_published_it(
    bus_factory: BusFactory,
) -> None:
    """The daemon is stopped while the job goes on: a NaN loss at step 12, then more training
    and checkpoints for longer than the restore timeout. Back, it catches up on that backlog
    and restores; nobody acknowledges, so it retries, but a restore timeout after it
    published the restore, not at once (the old code retried as soon as it caught up: its
    timeout ran from the NaN)."""
    config = daemon_config(bus_factory, restore_timeout_s=2.0, bus_gap_s=1.5)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, started(0), started(1), beat(0, 1, 10), beat(1, 1, 10))
        await publish(bus, shard(0, 2, 10), shard(1, 2, 10))
        async with running(DaemonService(config)):
            await eventually(lambda: read_all(bus, "manifests"))
        nan = dataclasses.replace(beat(0, 3, 12), loss=math.nan)
        await publish(bus, nan, beat(1, 3, 12))
        seq = 4
        away = asyncio.get_running_loop().time() + 3.0
        while asyncio.get_running_loop().time() < away:  # the outage: the job trains on
            step = seq + 9
            await publish(bus, beat(0, seq, step), beat(1, seq, step))
            if step % 5 == 0:
                seq += 1
                await publish(bus, shard(0, seq, step), shard(1, seq, step))
            seq += 1
            await asyncio.sleep(0.2)
        async with running(DaemonService(config)):
            [first, retry] = await eventually(lambda: _restores_at_least(bus, 2))
        [published] = [r for r in await _records(bus, "commands") if _seq(r) == first.seq]
    assert (first.generation, first.attempt, retry.attempt) == (1, 1, 2)
    assert first.target is not None
    assert first.target.step == 10
    assert "non-finite loss" in first.reason
    assert "not acknowledged within 2 s" in retry.reason
    # The retry was decided at a tick at least a restore timeout after the restore went out.
    assert retry.ts >= published.timestamp_ms * 1_000_000 + 2_000_000_000


async def test_a_restore_published_by_a_daemon_that_died_before_its_tick_is_timed_from_the_restart(
    bus_factory: BusFactory,
) -> None:
    """A daemon publishes a restore and dies before it appends the tick naming it. The next
    one appends that tick when it starts, and the restore times out a restore timeout after
    that tick, not after the (older) decision."""

    class DiesBeforeItsTick(DaemonService):
        async def _write_due_ticks(self, bus: Bus) -> None:
            return None

    config = daemon_config(bus_factory, restore_timeout_s=2.0, bus_gap_s=1.5)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, started(0), started(1), shard(0, 1, 5), shard(1, 1, 5), killed(0))
        async with running(DiesBeforeItsTick(config)):
            [first] = await eventually(lambda: _restores(bus))
        assert not [t for t in await _ticks(bus) if t[1].command_seq]
        await asyncio.sleep(2.5)  # longer than the restore timeout: the daemon is away
        async with running(DaemonService(config)):
            [_, retry] = await eventually(lambda: _restores_at_least(bus, 2))
        ticks = [at for at, tick in await _ticks(bus) if tick.command_seq == first.seq]
    assert ticks, "the restarted daemon appends the tick naming the restore"
    assert retry.ts >= min(ticks) + 2_000_000_000


async def test_bad_input_is_parked_with_its_reason_and_changes_nothing(
    bus_factory: BusFactory,
) -> None:
    good = (started(0), started(1), beat(0, 1, 4), beat(1, 1, 4))
    reference_config = daemon_config(bus_factory)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await bus.publish("events", JOB, b"\xff\xfe not json")
        await publish(bus, *good[:2])
        forged = encode(dataclasses.replace(beat(0, 2, 99), job_id="other-job"))
        await bus.publish("events", JOB, forged)  # key says one job, body another
        await publish(bus, *good[2:])
        await publish(bus, beat(0, 1, 4))  # duplicate seq
        await bus.publish("events", JOB, b"x" * 200_000)  # oversized: kept cut, with its digest
        async with running(DaemonService(reference_config)) as service:

            async def all_parked() -> list[Any]:
                return [orjson.loads(v) for v in await read_all(bus, "dead-letter")][3:]

            await eventually(all_parked)
            state = service.jobs[JOB]
        parked = [orjson.loads(v) for v in await read_all(bus, "dead-letter")]
    reasons = [p["reason"] for p in parked]
    assert len(parked) == 4, reasons
    [big] = [p for p in parked if p["value_bytes"] == 200_000]
    assert big["truncated"]
    assert "too large" in big["reason"] or "exceed" in big["reason"]
    assert any("UTF-8" in r or "JSON" in r for r in reasons)
    assert any("does not match record key" in r for r in reasons)
    assert any("duplicate" in r for r in reasons)
    assert state.ranks[0].step == 4
    assert state.ranks[1].step == 4


async def test_a_huge_record_key_is_echoed_bounded_and_its_entry_lands(
    bus_factory: BusFactory,
) -> None:
    huge = "k" * 600_000
    config = daemon_config(bus_factory)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await bus.publish("events", huge, encode(beat(0, 1, 4)))  # key says another job
        await publish(bus, started(0), started(1), beat(0, 1, 4), beat(1, 1, 4))
        with structlog.testing.capture_logs() as logs:
            async with running(DaemonService(config)) as service:
                [entry] = await eventually(lambda: _parked(bus))
                await eventually(lambda: _folded(service, 4))
                assert service.jobs[JOB].ranks[1].step == 4  # the daemon folds on
    assert entry["key"] == huge[:256]
    assert (entry["key_chars"], entry["key_truncated"]) == (600_000, True)
    assert entry["key_sha256"] == hashlib.sha256(huge.encode()).hexdigest()
    assert entry["reason"].startswith(f"job_id {JOB!r} does not match record key 'kkk")
    assert entry["reason"].endswith("more characters cut)")
    assert len(entry["reason"]) < 2_100
    assert orjson.loads(base64.b64decode(entry["value_b64"]))["step"] == 4
    [said] = [e for e in logs if e["event"] == "input rejected"]
    assert len(said["key"]) == 256
    assert len(said["reason"]) < 2_100


async def test_late_reports_of_a_finished_job_are_counted_not_parked(
    bus_factory: BusFactory,
) -> None:
    supervisor: dict[str, Any] = {"rank": None, "pid": 500, "ranks": (0, 1)}
    finished = [
        Lifecycle(**EVENTS.head(2), rank=r, pid=100 + r, kind="finished", step=4) for r in (0, 1)
    ]
    config = daemon_config(bus_factory)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(
            bus,
            Lifecycle(**EVENTS.head(0), **supervisor, kind="started"),
            started(0),
            started(1),
            beat(0, 1, 4),
            beat(1, 1, 4),
            *finished,
            # The supervisor reports its ranks' exit after they finished: routine.
            Lifecycle(**EVENTS.head(1), **supervisor, kind="exited", exit_code=0),
            # A process the job never had, under its id: a new run, worth a look.
            Lifecycle(**EVENTS.head(0), rank=0, pid=900, kind="started", world_size=2),
        )
        async with running(DaemonService(config)) as service:
            [entry] = await eventually(lambda: _parked(bus))
            late = service.metrics.registry.get_sample_value(
                "trainguard_late_inputs_total", {"type": "lifecycle"}
            )
            ended = service.metrics.registry.get_sample_value(
                "trainguard_rejected_inputs_total", {"reason": "ended_job"}
            )
            assert service.jobs[JOB].phase == "finished"
    assert "has finished (generation 0)" in entry["reason"]
    assert orjson.loads(base64.b64decode(entry["value_b64"]))["pid"] == 900
    assert (late, ended) == (1.0, 1.0)


async def test_the_last_shards_of_a_job_finished_before_its_restore_was_joined_commit(
    bus_factory: BusFactory,
) -> None:
    """Issue 13, T3, on a real bus: the job is restored to s10 after rank 1's exit report;
    then its ranks' shards of step 20 and their ``finished`` reports of generation 0 come
    (forwarded late, as after an outage), before any process joined the restore. The job is
    finished, the restore void, and s20 is committed: its manifest is on the bus, the
    catalog's newest snapshot of the job, not abandoned. The old daemon rejected the shards as
    stale: the job's last snapshot was s10."""
    finished = [
        Lifecycle(**EVENTS.head(4), rank=r, pid=100 + r, kind="finished", step=20) for r in (0, 1)
    ]
    config = daemon_config(bus_factory)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, started(0), started(1), beat(0, 1, 10), beat(1, 1, 10))
        await publish(bus, shard(0, 2, 10), shard(1, 2, 10), killed(1))
        async with running(DaemonService(config)) as service:
            [restore] = await eventually(lambda: _restores(bus))
            await publish(bus, shard(0, 3, 20), shard(1, 3, 20), *finished)
            await eventually(lambda: _phase(service, "finished"))
        manifests = [decode(v, expect=Manifest) for v in await read_all(bus, "manifests")]
        entries = [orjson.loads(v) for v in await read_all(bus, "audit")]
    assert restore.target is not None
    assert restore.target.snapshot_id == f"{JOB}/g0/s10"
    assert [m.snapshot_id for m in manifests] == [f"{JOB}/g0/s10", f"{JOB}/g0/s20"]
    catalog = Catalog.of(manifests, {JOB: read_audit(entries)})
    assert catalog.abandoned == {}
    assert [m.snapshot_id for m in catalog.select(job=JOB)][-1] == f"{JOB}/g0/s20"


async def _parked(bus: Bus) -> list[dict[str, Any]]:
    return [orjson.loads(v) for v in await read_all(bus, "dead-letter")]


async def _restores(bus: Bus) -> list[Restore]:
    return [c for c in await commands(bus) if isinstance(c, Restore)]


async def _restores_at_least(bus: Bus, n: int) -> list[Restore] | None:
    restores = await _restores(bus)
    return restores if len(restores) >= n else None


async def _records(bus: Bus, topic: str) -> list[Record]:
    """Every record of ``topic`` from offset 0, with its bus append time."""
    ends = {tp: end for tp, end in (await bus.end_offsets(topic)).items() if end > 0}
    records: list[Record] = []
    if not ends:
        return records
    async with await bus.assign(dict.fromkeys(ends, 0)) as consumer:
        seen: dict[TopicPartition, int] = dict.fromkeys(ends, 0)
        while any(seen[tp] < end for tp, end in ends.items()):
            for record in await consumer.getmany(timeout_s=1.0):
                if record.offset < ends[record.tp]:
                    records.append(record)
            for tp in ends:  # past transaction markers, which no record carries
                seen[tp] = await consumer.position(tp)
    return records


def _seq(record: Record) -> int:
    command = decode(record.value or b"")
    assert isinstance(command, Restore | Resume | Abort)
    return command.seq


async def _ticks(bus: Bus) -> list[tuple[int, ClockTick]]:
    """The ticks on ``events`` with their bus append times (ns)."""
    ticks = []
    for record in await _records(bus, "events"):
        message = decode(record.value or b"")
        if isinstance(message, ClockTick):
            ticks.append((record.timestamp_ms * 1_000_000, message))
    return ticks


async def _sent(service: DaemonService) -> bool:
    """The daemon has sent a command (into its open transaction)."""
    return service.counters["commands"] >= 1


def _decided_restores(audit: list[bytes]) -> list[tuple[str, int]]:
    """``(job, generation)`` of every restore issued in the ``decisions`` entries of ``audit``."""
    issued = []
    for value in audit:
        entry = orjson.loads(value)
        if entry.get("entry") != "decisions":
            continue
        for decision in entry["decisions"]:
            command = decision.get("command")
            if decision["decision"] == "issue" and command["schema"].startswith("restore/"):
                issued.append((entry["job_id"], command["generation"]))
    return issued


async def _folded(service: DaemonService, n: int = 1) -> bool:
    return service.counters["folded"] >= n


async def _phase(service: DaemonService, phase: str) -> bool:
    return service.ready.is_set() and JOB in service.jobs and service.jobs[JOB].phase == phase
