"""Stopping and continuing a job through the real daemon service and ``trainguard stop``'s code,
on both buses: the answers on ``commands``, what is counted, what is not parked, and a stop
request that no daemon reads or that the daemon ignores."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tests.support.buses import BusFactory
from tests.support.service_support import (
    JobEvents,
    commands,
    daemon_config,
    eventually,
    publish,
    read_all,
    running,
)
from trainguard.agent.bus import DEFAULT_TOPICS, Bus
from trainguard.agent.keys._keystore import AgentKeys, EventKey, KeyStore
from trainguard.agent.supervisor._requests import encode_request
from trainguard.daemon import DaemonService
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.daemon.cli._stop import EXIT_NOT_STOPPED, EXIT_UNCONFIRMED, stop_job
from trainguard.schemas import Abort, Lifecycle, Restore, add_mac, encode

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

JOB = "stop-job"
EVENTS = JobEvents(JOB)


def supervisor(rank: int, kind: Any, **fields: Any) -> Lifecycle:
    """The supervisor's report about rank ``rank``'s process (pid 100 + rank)."""
    head = EVENTS.head(0 if kind == "started" else 1)
    return Lifecycle(**head, rank=None, pid=100 + rank, kind=kind, ranks=(rank,), **fields)


async def committed_job(bus: Bus) -> None:
    """A 2-rank job that committed step 2 and trains on at step 3."""
    await publish(
        bus,
        supervisor(0, "started"),
        supervisor(1, "started"),
        EVENTS.started(0),
        EVENTS.started(1),
        EVENTS.shard(0, 1, 2),
        EVENTS.shard(1, 1, 2),
        EVENTS.beat(0, 2, 3),
        EVENTS.beat(1, 2, 3),
    )


async def stop(factory: BusFactory, timeout_s: float = 60.0, keys: AgentKeys | None = None) -> Any:
    return await stop_job(
        factory.config(topics=DEFAULT_TOPICS),
        JOB,
        reason="maintenance",
        keys=keys or AgentKeys(),
        group=factory.group("daemon"),
        timeout_s=timeout_s,
    )


async def ask_to_continue(bus: Bus, generation: int) -> None:
    request = encode_request(
        JOB,
        "continue",
        generation=generation,
        host="node-b",  # another node's supervisor than the stop's sender
        pid=4242,
        seq=1,
        reason="test",
    )
    await bus.publish("events", JOB, request)


def sample(service: DaemonService, name: str, **labels: str) -> float | None:
    return service.metrics.registry.get_sample_value(name, labels)


async def test_a_stopped_job_takes_no_exit_for_a_failure_and_continues(
    bus_factory: BusFactory,
) -> None:
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await committed_job(bus)
        async with running(DaemonService(daemon_config(bus_factory))) as service:
            await eventually(lambda: _phase(service, "running"))
            outcome = await stop(bus_factory)
            assert (outcome.code, "stopped in generation 0" in outcome.message) == (0, True)
            [abort] = [c for c in await commands(bus) if isinstance(c, Abort)]
            assert (abort.outcome, abort.generation) == ("stopped", 0)
            assert "maintenance" in abort.reason
            # Every supervisor stops its workers and reports their exits: no failure, not parked.
            exits = [supervisor(r, "exited", signal=15) for r in (0, 1)]
            await publish(bus, *exits)
            await eventually(lambda: _folded(service, 11))
            assert service.jobs[JOB].phase == "stopped"
            assert [c for c in await commands(bus) if isinstance(c, Restore)] == []
            assert await read_all(bus, "dead-letter") == []
            assert sample(service, "trainguard_job_requests_total", kind="stop", result="stopped")
            assert sample(service, "trainguard_late_inputs_total", type="lifecycle") == 2.0
            # Continued: a restore of generation 1 to the committed step.
            await ask_to_continue(bus, 0)
            [restore] = await eventually(lambda: _restores(bus))
            assert restore.target is not None
            assert (restore.generation, restore.target.step) == (1, 2)
            assert sample(service, "trainguard_incidents_total", cause="continued") == 1.0
            assert sample(
                service, "trainguard_job_requests_total", kind="continue", result="continued"
            )


async def test_a_refused_continue_is_answered_by_a_second_abort(bus_factory: BusFactory) -> None:
    """The answer is an abort of the stopped generation again: the daemon must send it although
    an abort of that generation is its latest command already."""
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await committed_job(bus)
        corrupt = Lifecycle(
            **EVENTS.head(3),
            rank=0,
            pid=100,
            kind="error",
            snapshot_id=f"{JOB}/g0/s2",
            message="digest mismatch",
        )
        await publish(bus, corrupt)
        async with running(DaemonService(daemon_config(bus_factory))) as service:
            await eventually(lambda: _folded(service, 9))
            assert (await stop(bus_factory)).code == 0
            await ask_to_continue(bus, 0)
            aborts = await eventually(lambda: _aborts(bus, 2))
            assert [a.seq for a in aborts] == [1, 2]
            assert aborts[1].outcome == "stopped"
            assert "refused: no committed snapshot can be restored" in (aborts[1].reason)
            assert service.jobs[JOB].phase == "stopped"


async def test_a_stop_no_daemon_reads_is_unconfirmed(bus_factory: BusFactory) -> None:
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await committed_job(bus)
    outcome = await stop(bus_factory, timeout_s=2.0)
    assert outcome.code == EXIT_UNCONFIRMED
    assert "is `trainguard daemon` running on this bus?" in outcome.message


async def test_a_stop_of_a_finished_job_is_read_and_ignored(bus_factory: BusFactory) -> None:
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await committed_job(bus)
        finished = [
            Lifecycle(**EVENTS.head(4), rank=r, pid=100 + r, kind="finished", step=4)
            for r in (0, 1)
        ]
        await publish(bus, *finished)
        async with running(DaemonService(daemon_config(bus_factory))) as service:
            await eventually(lambda: _phase(service, "finished"))
            outcome = await stop(bus_factory)
    assert outcome.code == EXIT_NOT_STOPPED
    assert "did not stop it: the job has ended already" in outcome.message


async def _phase(service: DaemonService, phase: str) -> bool:
    return service.ready.is_set() and JOB in service.jobs and service.jobs[JOB].phase == phase


async def _folded(service: DaemonService, n: int) -> bool:
    return service.counters["folded"] >= n


async def _restores(bus: Bus) -> list[Restore]:
    return [c for c in await commands(bus) if isinstance(c, Restore)]


async def _aborts(bus: Bus, n: int) -> list[Abort] | None:
    found = [c for c in await commands(bus) if isinstance(c, Abort)]
    return found if len(found) >= n else None


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
async def test_with_keys_only_a_stop_under_the_jobs_event_key_stops_it(
    bus_factory: BusFactory, tmp_path: Path
) -> None:
    admin = KeyAdmin(tmp_path / "keys")
    admin.init([JOB])
    keys = KeyStore(admin.path).load_daemon_keys()
    current = keys.current_event_key(JOB)
    assert current is not None
    event_key = EventKey(*current)
    config = dataclasses.replace(daemon_config(bus_factory), snapshot_interval_s=0)
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        for event in (supervisor(0, "started"), EVENTS.started(0), EVENTS.started(1)):
            await bus.publish("events", JOB, encode(add_mac(event, *current)))
        async with running(DaemonService(config, keys=keys)) as service:
            await eventually(lambda: _phase(service, "running"))
            # Without the job's event key: refused as not authentic, the job runs on.
            forged = await stop(bus_factory, timeout_s=60.0)
            assert forged.code == EXIT_NOT_STOPPED
            assert service.jobs[JOB].phase == "running"
            assert sample(service, "trainguard_rejected_inputs_total", reason="missing_mac")
            # With it (and the daemon's public keys to check the answer): stopped.
            outcome = await stop(bus_factory, keys=AgentKeys(verify=keys.verify, event=event_key))
            assert outcome.code == 0, outcome.message
            assert service.jobs[JOB].phase == "stopped"
