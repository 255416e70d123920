"""Agents and supervisors act only on commands the daemon signed, for their job, and not
replayed (trainguard.agent.keys._command_gate): forged, replayed, wrong-key and wrong-job commands
are ignored, counted by reason and logged; events leave with their MAC."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from tests.support import jobbus as daemon
from tests.support.jobbus import JOB, read_events
from trainguard.agent import Agent, RestoreRequested, RestoreTimeout
from trainguard.agent.bus import DEFAULT_TOPICS, BusConfig, open_bus
from trainguard.agent.keys._keystore import AgentKeys, EventKey, key_id, public_key_id
from trainguard.agent.supervisor._supervisor import EXIT_ABORTED, Supervisor, SupervisorConfig
from trainguard.schemas import (
    Command,
    Lifecycle,
    decode,
    encode,
    sign,
    verify_mac,
)

DAEMON = Ed25519PrivateKey.generate()
DAEMON_KID = public_key_id(DAEMON.public_key())
ROGUE = Ed25519PrivateKey.generate()
ROGUE_KID = public_key_id(ROGUE.public_key())
PUBLIC: dict[str, Ed25519PublicKey] = {DAEMON_KID: DAEMON.public_key()}


def signed(command: Command, key: Ed25519PrivateKey = DAEMON) -> bytes:
    return encode(sign(command, public_key_id(key.public_key()), key))


def event_key() -> EventKey:
    secret = os.urandom(32)
    return EventKey(key_id(secret), secret)


# -- the agent --------------------------------------------------------------------------------


def test_an_agent_with_keys_never_acts_on_forged_or_replayed_commands(
    make_agent: Callable[..., Agent], bus_url: str
) -> None:
    """An agent training in generation 0 that reloads in process: forged in-process restores
    (unsigned, another key, another job's) never stop it, nor does a replay of the daemon's
    restore with another ``at_step``; the daemon's signed restore does, at its step. Its
    events carry MACs of its event key."""
    key = event_key()
    with make_agent(keys=AgentKeys(verify=PUBLIC, event=key), in_process_restore=True) as agent:
        agent.ready(0)
        agent.step(1)
        wait(lambda: agent.stats.connected)  # following the commands from here on
        for data in (
            encode(daemon.restore(JOB, 1, None, at_step=5)),
            signed(daemon.restore(JOB, 1, None, at_step=5), ROGUE),
            signed(daemon.restore("other-job", 1, None, at_step=5)),
        ):
            publish_raw(bus_url, data)
        wait(lambda: agent.stats.commands_ignored >= 3)
        for step in range(2, 12):
            agent.step(step)  # no RestoreRequested
        assert agent.config.generation == 0
        genuine = daemon.restore(JOB, 1, None, at_step=20)
        publish_raw(bus_url, signed(genuine))
        wait(lambda: agent.config.generation == 1)
        publish_raw(bus_url, signed(genuine))
        publish_raw(bus_url, signed(dataclasses.replace(genuine, at_step=14)))
        publish_raw(bus_url, signed(daemon.restore(JOB, 0, None, at_step=16)))
        wait(lambda: agent.stats.commands_ignored >= 6)
        for step in range(12, 20):
            agent.step(step)
        with pytest.raises(RestoreRequested) as info:
            agent.step(20)
        assert info.value.restore.at_step == 20
        assert agent.stats.commands_ignored_by_reason == {
            "unsigned": 1,
            "unknown_kid": 1,
            "wrong_job": 1,
            "duplicate": 1,
            "replayed": 1,
            "stale_generation": 1,
        }
    events = read_events(bus_url, JOB)
    assert len(events) > 3
    for event in events:
        assert event.auth is not None
        assert verify_mac(encode(event), {key.kid: key.secret}) == key.kid


def test_a_restarted_agent_waits_for_the_genuine_restore(
    make_agent: Callable[..., Agent], bus_url: str
) -> None:
    with make_agent(keys=AgentKeys(verify=PUBLIC), generation=2) as agent:
        wait(lambda: agent.stats.connected)
        publish_raw(bus_url, encode(daemon.restore(JOB, 2, None)))  # unsigned
        with pytest.raises(RestoreTimeout):  # the forged restore was not taken
            agent.restore_target(timeout_s=1.5)
        assert agent.stats.commands_ignored_by_reason.get("unsigned") == 1
        publish_raw(bus_url, signed(daemon.restore(JOB, 2, None)))
        assert agent.restore_target(timeout_s=10.0) is None  # from scratch, as ordered


def publish_raw(url: str, data: bytes, key: str = JOB) -> None:
    async def _publish() -> None:
        async with open_bus(BusConfig(url=url)) as bus:
            await bus.publish("commands", key, data)

    asyncio.run(_publish())


def wait(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


# -- the supervisor -----------------------------------------------------------------------------


SLEEPER = "import time; time.sleep(600)"


def sleeper_supervisor(tmp_path: Path, keys: AgentKeys) -> tuple[BusConfig, SupervisorConfig]:
    """An embedded bus in ``tmp_path`` and a one-worker supervisor of :data:`SLEEPER` on it."""
    bus = BusConfig(url=f"sqlite://{tmp_path / 'bus.db'}", topics=DEFAULT_TOPICS)
    config = SupervisorConfig(
        job_id=JOB,
        bus=bus,
        command=[sys.executable, "-c", SLEEPER],
        nproc_per_node=1,
        grace_s=1.0,
        host="node-a",
        keys=keys,
    )
    return bus, config


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_supervisor_with_keys_restarts_only_on_the_daemons_signed_restore(
    tmp_path: Path,
) -> None:
    key = event_key()
    bus, config = sleeper_supervisor(tmp_path, AgentKeys(verify=PUBLIC, event=key))
    supervisor = Supervisor(config)
    async with open_bus(bus) as client:
        task = asyncio.ensure_future(supervisor.run())
        await started(client, generation=0)
        forged = daemon.restore(JOB, 1, None)
        for data, record_key in (
            (encode(forged), JOB),
            (signed(forged, ROGUE), JOB),
            (encode(sign(forged, DAEMON_KID, ROGUE)), JOB),
            (signed(dataclasses.replace(forged, job_id="other-job")), JOB),
            (signed(daemon.abort(JOB, 1, "forged abort"), ROGUE), JOB),
        ):
            await client.publish("commands", record_key, data)
        await until(lambda: supervisor.ignored.total() >= 5)
        await asyncio.sleep(0.5)
        assert [e.generation for e in await lifecycle_events(client) if e.kind == "started"] == [0]
        assert dict(supervisor.ignored) == {
            "unsigned": 1,
            "unknown_kid": 2,
            "bad_signature": 1,
            "wrong_job": 1,
        }
        genuine = signed(forged)
        await client.publish("commands", JOB, genuine)
        await started(client, generation=1)
        await client.publish("commands", JOB, genuine)  # replayed as is: a duplicate
        other = dataclasses.replace(forged, reason="replayed with another meaning")
        await client.publish("commands", JOB, signed(other))
        await client.publish("commands", JOB, signed(daemon.restore(JOB, 0, None)))
        await until(lambda: supervisor.ignored.total() >= 8)
        assert supervisor.ignored["replayed"] == 1
        assert supervisor.ignored["duplicate"] == 1
        assert supervisor.ignored["stale_generation"] == 1
        await client.publish("commands", JOB, signed(daemon.abort(JOB, 1, "done")))
        assert await asyncio.wait_for(task, 30) == EXIT_ABORTED
        events = await lifecycle_events(client)
    assert [e.generation for e in events if e.kind == "started"] == [0, 1]
    for event in events:
        assert verify_mac(encode(event), {key.kid: key.secret}) == key.kid


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_supervisor_without_keys_acts_once_on_a_command_sent_twice(
    tmp_path: Path,
) -> None:
    """Issue 13: the same restore re-sent as the same bytes restarts the workers once and is
    counted as a ``duplicate``; a new command of the generation is still taken."""
    bus, config = sleeper_supervisor(tmp_path, AgentKeys())
    supervisor = Supervisor(config)
    async with open_bus(bus) as client:
        task = asyncio.ensure_future(supervisor.run())
        await started(client, generation=0)
        restore = encode(daemon.restore(JOB, 1, None))
        await client.publish("commands", JOB, restore)
        await started(client, generation=1)
        await client.publish("commands", JOB, restore)  # re-sent: the same bytes
        await until(lambda: supervisor.ignored["duplicate"] == 1)
        await client.publish("commands", JOB, encode(daemon.abort(JOB, 1, "done")))
        assert await asyncio.wait_for(task, 30) == EXIT_ABORTED
        events = await lifecycle_events(client)
    assert [e.generation for e in events if e.kind == "started"] == [0, 1]
    assert dict(supervisor.ignored) == {"duplicate": 1}


async def lifecycle_events(client: Any) -> list[Lifecycle]:
    ends = await client.end_offsets("events")
    pending = {tp: end for tp, end in ends.items() if end}
    found: list[Lifecycle] = []
    if pending:
        async with await client.assign(dict.fromkeys(pending, 0)) as consumer:
            while len(found) < sum(pending.values()):
                for record in await consumer.getmany(timeout_s=1.0):
                    found.append(decode(record.value, expect=Lifecycle))
    return found


async def started(client: Any, generation: int) -> None:
    async def seen() -> bool:
        events = await lifecycle_events(client)
        return any(e.kind == "started" and e.generation == generation for e in events)

    deadline = time.monotonic() + 30
    while not await seen():
        assert time.monotonic() < deadline, f"generation {generation} never started"
        await asyncio.sleep(0.05)


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
