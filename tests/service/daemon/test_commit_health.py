"""Failed transactions of an owned partition: handled as what happened (a commit in doubt takes
the partitions on again, with no decision lost or made twice), counted by reason, and told by
``/healthz`` once they have gone on for longer than the bound."""

from __future__ import annotations

import asyncio
import dataclasses

import orjson
import pytest
import structlog
from aiokafka.admin import AIOKafkaAdminClient

from tests.support.buses import BusFactory
from tests.support.health import sample, scrape, serving, until_health
from tests.support.held_daemons import Pausable
from tests.support.service_support import (
    JobEvents,
    assert_once_each,
    daemon_config,
    eventually,
    publish,
    read_all,
    running,
)
from trainguard.agent.bus import DEFAULT_TOPICS, Bus, TopicPartition, TransactionInDoubt
from trainguard.agent.bus import _kafka as kafka_adapter
from trainguard.agent.bus._partitioner import partition_for
from trainguard.daemon import DaemonService
from trainguard.daemon.service._daemon import COMMIT_FAILING_MIN_S
from trainguard.daemon.service._partitions import Owned

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


class _DoubtfulCommit(DaemonService):
    """The first commit that carries a command is reported in doubt: after committing it
    (``landed``: the answer was lost) or without committing it (the transaction stays open,
    for the next writer of the partition to abort)."""

    landed = True
    doubted = 0

    def _start_commit(self, part: Owned) -> None:
        if self.doubted or not self.counters["commands"]:
            super()._start_commit(part)
            return
        self.doubted += 1
        if self.landed:
            super()._start_commit(part)
            real, position = _in_flight(part)
            part.committing = (asyncio.ensure_future(self._lost_answer(real)), position)
        else:
            part.committing = (asyncio.ensure_future(self._lost_answer(None)), part.position)

    async def _lost_answer(self, commit: asyncio.Future[None] | None) -> None:
        if commit is not None:
            await commit
        raise TransactionInDoubt("commit not confirmed within 0 s (test)")


def _in_flight(part: Owned) -> tuple[asyncio.Future[None], int]:
    assert part.committing is not None
    return part.committing


@pytest.mark.parametrize("landed", [True, False], ids=["committed", "not-committed"])
async def test_a_commit_in_doubt_takes_the_partitions_on_again_and_decides_once(
    bus_factory: BusFactory, landed: bool
) -> None:
    """Whichever way the transaction went, the partitions are taken on again from the
    committed positions read after a new writer settled it: the restore is on ``commands`` and
    in ``audit`` exactly once."""
    config = daemon_config(bus_factory)
    job = JobEvents("doubt-job")
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, job.started(0), job.started(1), job.shard(0, 1, 5), job.shard(1, 1, 5))
        await publish(bus, job.killed(1))
        service = _DoubtfulCommit(config)
        service.landed = landed
        with structlog.testing.capture_logs() as logs:
            async with serving(service) as server, running(service):
                await eventually(lambda: _phase(service, job.job_id, "restoring"), 60)
                await eventually(lambda: _once_on_commands(bus), 60)
                # After the doubt: taken on again, and ready.
                await until_health(server, lambda b: b == "ready\n", 60)
                scraped = await scrape(server)
                assert sample(scraped, "trainguard_commits_failed_total", reason="in_doubt") == 1
        assert service.doubted == 1
        await assert_once_each(bus, (job.job_id,))
    p = _partition_of(job.job_id)
    events = [e["event"] for e in logs]
    [doubt] = [e for e in logs if e["event"].startswith("commit in doubt")]
    assert doubt["partition"] == p
    assert doubt["writer"] == (
        f"{bus_factory.prefix}daemon-{p}"
        if bus_factory.kind == "kafka"
        else f"daemon-{p} (writer epoch 1)"
    )
    assert not [e for e in events if e.startswith(("partition lost", "transaction aborted"))]
    # Taken on twice: at the start, and after the doubt.
    assert [e["partition"] for e in logs if e["event"] == "partition assigned"].count(p) == 2


def _partition_of(job: str) -> int:
    return partition_for(job, DEFAULT_TOPICS[0].partitions)


async def _phase(service: DaemonService, job: str, phase: str) -> bool:
    state = service.jobs.get(job)
    return state is not None and state.phase == phase


async def _once_on_commands(bus: Bus) -> bool:
    return len(await read_all(bus, "commands")) >= 1


@pytest.mark.kafka
@pytest.mark.slow
async def test_a_transaction_the_broker_expired_is_said_so_and_decided_once(
    kafka_bootstrap: str, unique_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop is held (as a paused owner) after it sent a restore, until the coordinator
    aborts the open transaction on ``transaction.timeout.ms`` (1 s here): no newer owner
    exists, and the log says that the broker aborted it, not that the partition was lost;
    the daemon takes a fresh assignment and sends the restore once."""
    monkeypatch.setattr(kafka_adapter, "_TRANSACTION_TIMEOUT_MS", 1000)
    factory = BusFactory("kafka", f"kafka://{kafka_bootstrap}", unique_prefix)
    config = daemon_config(factory)
    job = JobEvents("expired-job")
    p = _partition_of(job.job_id)
    async with factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, job.started(0), job.started(1), job.shard(0, 1, 5), job.shard(1, 1, 5))
        service = Pausable(config)
        service.held = asyncio.Event()
        service.hold = release = asyncio.Event()
        with structlog.testing.capture_logs() as logs:
            async with serving(service) as server, running(service):
                await until_health(server, lambda b: b == "ready\n", 120)
                await publish(bus, job.killed(1))
                await asyncio.wait_for(service.held.wait(), 60)

                # The coordinator aborted the restore's transaction: its marker moves the end
                # a read_committed reader sees past the restore.
                async def aborted() -> bool:
                    ends = await bus.end_offsets("commands")
                    return ends[TopicPartition("commands", p)] == 2

                await eventually(aborted, 90)
                release.set()
                await eventually(lambda: _once_on_commands(bus), 60)
                scraped = await scrape(server)
                assert sample(scraped, "trainguard_commits_failed_total", reason="expired") == 1
        await assert_once_each(bus, (job.job_id,))
    [expired] = [e for e in logs if e["event"].startswith("transaction expired")]
    assert expired["partition"] == p
    assert expired["writer"] == f"{unique_prefix}daemon-{p}"
    assert "longer than transaction.timeout.ms" in expired["error"]
    assert "rejoining the group after an expired transaction" in [e["event"] for e in logs]
    assert not [e for e in logs if e["event"].startswith("partition lost")]


@pytest.mark.kafka
@pytest.mark.slow
async def test_healthz_is_not_ready_while_commits_keep_failing_and_ready_once_one_succeeds(
    kafka_bootstrap: str, unique_prefix: str
) -> None:
    """A real failure: the ``audit`` topic is deleted under the running daemon, so every
    transaction that carries a decision fails (its audit entry cannot be sent) and is rolled
    back, while the bus answers every probe. ``/healthz`` names the partition and the failure
    once that has gone on for longer than the bound; recreating the topic lets a commit
    through, and the daemon is ready again with every decision written once."""
    factory = BusFactory("kafka", f"kafka://{kafka_bootstrap}", unique_prefix)
    config = daemon_config(factory, heartbeat_timeout_s=600.0)
    # A send to the missing topic gives up after send_timeout_s: keep the cycles short.
    config = dataclasses.replace(
        config,
        bus=dataclasses.replace(config.bus, send_timeout_s=3.0),
        probe_interval_s=0.5,
        probe_timeout_s=2.0,
    )
    job = JobEvents("failing-commits")
    service = DaemonService(config)
    audit = f"{unique_prefix}audit"
    async with (
        factory.open(topics=DEFAULT_TOPICS) as bus,
        serving(service) as server,
        running(service),
    ):
        await until_health(server, lambda b: b == "ready\n", 120)
        await _delete_topic(kafka_bootstrap, audit)
        await publish(bus, job.started(0), job.started(1))

        body = await until_health(server, lambda b: "commits failing" in b, 120)
        p = _partition_of(job.job_id)
        assert body.startswith("not ready: commits failing for ")
        assert f"on partition(s) {p} (writer {unique_prefix}daemon-{p}: failed)" in body
        assert "'audit'" in body
        scraped = await scrape(server)
        failed = sample(scraped, "trainguard_commits_failed_total", reason="failed")
        assert failed is not None
        assert failed >= 1
        age = sample(scraped, "trainguard_commit_age_seconds")
        assert age is not None
        assert age > COMMIT_FAILING_MIN_S
        assert sample(scraped, "trainguard_ready") == 0
        assert sample(scraped, "trainguard_bus_connected") == 1, "the bus itself answers"

        # Back: the next commit succeeds, and the daemon is ready again.
        async with factory.open(topics=DEFAULT_TOPICS):
            pass  # creates the missing topic
        await until_health(server, lambda b: b == "ready\n", 120)
        assert sample(await scrape(server), "trainguard_commit_age_seconds") == 0
        assert service.jobs[job.job_id].phase == "running"
        entries = [orjson.loads(v) for v in await read_all(bus, "audit")]
        decided = [e["offset"] for e in entries if e["entry"] == "decisions"]
        # The decision (the job running, on the second start) written once: not lost with
        # the rolled-back transactions, nor written twice by their retries.
        assert decided == [1]


async def _delete_topic(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    async with asyncio.timeout(30):
        await admin.start()
        try:
            await admin.delete_topics([topic])
        finally:
            await admin.close()
