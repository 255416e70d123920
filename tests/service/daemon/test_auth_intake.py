"""The daemon with keys on a real embedded bus: it signs its commands and manifests, MACs its
ticks, and refuses events whose MAC is missing, wrong, under another job's key, or (with
``require_auth``) of a job without a key: dead-lettered with the reason, counted, recorded on
``audit``, job state unchanged; and a replay, which holds no key, folds what the daemon folded.
The event authentication on its own (intake's MAC check on raw bytes among it):
``tests/unit/daemon/test_event_auth.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import Any

import orjson
import pytest
from structlog.testing import capture_logs

from tests.support.buses import BusFactory
from tests.support.service_support import JobEvents, eventually, read_all, running
from trainguard.agent.bus import DEFAULT_TOPICS, Bus
from trainguard.agent.keys._command_gate import CommandGate, Ignored
from trainguard.agent.keys._keystore import DaemonKeys, KeyStore, key_id, load_public_keys
from trainguard.daemon import DaemonService, MachineConfig
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.daemon.forensics._job_log import read_bus
from trainguard.daemon.forensics._replay import replay, verify
from trainguard.daemon.service._settings import DaemonConfig, SecurityConfig
from trainguard.schemas import (
    ClockTick,
    Event,
    Manifest,
    Restore,
    add_mac,
    decode,
    encode,
    verify_mac,
    verify_signature,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

JOB = "auth-job"


@dataclasses.dataclass(frozen=True)
class Setup:
    bus: BusFactory
    admin: KeyAdmin
    keys: DaemonKeys

    def key(self, job: str = JOB) -> tuple[str, bytes]:
        current = self.keys.current_event_key(job)
        assert current is not None
        return current


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    admin = KeyAdmin(tmp_path / "keys")
    admin.init([JOB, "other-job"])
    return Setup(
        BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "t."),
        admin,
        KeyStore(admin.path).load_daemon_keys(),
    )


def config(setup: Setup, *, require_auth: bool = False, **machine: Any) -> DaemonConfig:
    return DaemonConfig(
        bus=setup.bus.config(topics=DEFAULT_TOPICS),
        machine=MachineConfig(daemon_id="auth-daemon", **machine),
        group_id=setup.bus.group("daemon"),
        poll_s=0.02,
        pulse_s=0.2,  # short timeouts need a dense stream (2*pulse_s + poll_s + commit_interval_s < bus_gap_s)
        snapshot_interval_s=0,
        security=SecurityConfig(require_auth=require_auth),
    )


EVENTS = JobEvents(JOB)
started, beat, shard, killed = EVENTS.started, EVENTS.beat, EVENTS.shard, EVENTS.killed


async def send(bus: Bus, key: tuple[str, bytes] | None, *events: Event) -> None:
    for event in events:
        maced = add_mac(event, *key) if key is not None else event
        await bus.publish("events", event.job_id, encode(maced))


def rejected(service: DaemonService, reason: str) -> float:
    value = service.metrics.registry.get_sample_value(
        "trainguard_rejected_inputs_total", {"reason": reason}
    )
    return value or 0.0


async def test_forged_heartbeats_are_refused_and_a_replay_refuses_them_too(setup: Setup) -> None:
    key = setup.key()
    random_key = os.urandom(32)
    forgeries = {
        "missing_mac": encode(beat(0, 2, 50)),
        "bad_mac": encode(add_mac(beat(0, 3, 51), key[0], random_key)),
        "unknown_kid": encode(add_mac(beat(0, 4, 52), *setup.key("other-job"))),
    }
    async with setup.bus.open(topics=DEFAULT_TOPICS) as bus:
        await send(bus, key, started(0), started(1), beat(0, 1, 10), beat(1, 1, 10))
        for data in forgeries.values():
            await bus.publish("events", JOB, data)
        await send(bus, key, beat(1, 2, 11))
        # A job without an event key is taken unauthenticated (require_auth is off).
        await send(bus, None, started(0, "open-job"), beat(0, 1, 3, "open-job"))
        # A MAC this daemon cannot check (no key for the job) is refused: a misconfiguration.
        await send(bus, (key_id(random_key), random_key), beat(1, 1, 3, "open-job"))
        async with running(DaemonService(config(setup), keys=setup.keys)) as service:

            async def parked() -> list[dict[str, Any]]:
                entries = [orjson.loads(v) for v in await read_all(bus, "dead-letter")]
                return entries if len(entries) >= 4 else []

            entries = await eventually(parked)
            await eventually(lambda: _folded(service, 7))
            state, open_state = service.jobs[JOB], service.jobs["open-job"]
            counts = {r: rejected(service, r) for r in ("missing_mac", "bad_mac", "unknown_kid")}
            counts["unknown_job"] = rejected(service, "unknown_job")
        audit = [orjson.loads(v) for v in await read_all(bus, "audit")]
    assert [e["reason"] for e in entries][:3] == [
        "no MAC: the message carries no auth.mac",
        f"MAC under event key {key[0]} does not verify",
        f"MAC under unknown event key {setup.key('other-job')[0]}",
    ]
    assert "has no event key here" in entries[3]["reason"]
    assert counts == {"missing_mac": 1, "bad_mac": 1, "unknown_kid": 1, "unknown_job": 1}
    assert (state.ranks[0].step, state.ranks[1].step) == (10, 11)  # no forged step folded
    assert open_state.ranks[0].step == 3
    assert 1 not in open_state.ranks
    refused = [e for e in audit if e["entry"] == "refused"]
    assert sorted(e["code"] for e in refused) == [
        "bad_mac",
        "missing_mac",
        "unknown_job",
        "unknown_kid",
    ]
    # A replay holds no keys: it refuses what the audit trail says the daemon refused.
    log = await read_bus(setup.bus.url, setup.bus.prefix, JOB)
    result = replay(JOB, log.events, log.trail(), MachineConfig(daemon_id="replay"))
    assert verify(result.replayed, result.recorded) is None
    assert [row.kind for row in result.rows].count("refused") == 3
    assert (result.state.ranks[0].step, result.state.ranks[1].step) == (10, 11)


async def _folded(service: DaemonService, n: int) -> bool:
    return service.counters["folded"] >= n


async def test_require_auth_refuses_jobs_without_a_key_and_needs_keys(setup: Setup) -> None:
    with pytest.raises(ValueError, match="require_auth"):
        DaemonService(config(setup, require_auth=True))
    async with setup.bus.open(topics=DEFAULT_TOPICS) as bus:
        await send(bus, None, started(0, "open-job"))
        await send(bus, setup.key(), started(0), started(1))
        service = DaemonService(config(setup, require_auth=True), keys=setup.keys)
        async with running(service):
            await eventually(lambda: _folded(service, 2))
            entries = await eventually(lambda: read_all(bus, "dead-letter"))
            assert "open-job" not in service.jobs
            assert rejected(service, "unknown_job") == 1
    assert "has no event key (authentication required)" in orjson.loads(entries[0])["reason"]


async def test_a_job_whose_events_are_refused_as_not_authentic_is_warned_of_once(
    setup: Setup,
) -> None:
    """Found by a tester: a job started without its event key trained 400 steps unwatched,
    its 231 refusals logged at info level among the rest."""
    async with setup.bus.open(topics=DEFAULT_TOPICS) as bus:
        await send(bus, None, started(0), started(1), started(0, "other-job"))
        service = DaemonService(config(setup, require_auth=True), keys=setup.keys)
        with capture_logs() as logs:
            async with running(service):

                async def all_parked() -> bool:
                    return len(await read_all(bus, "dead-letter")) == 3

                await eventually(all_parked)
    warned = [e for e in logs if e["log_level"] == "warning" and "not authentic" in e["event"]]
    assert sorted(e["key"] for e in warned) == [JOB, "other-job"]
    assert all("no auth" in e["reason"] or "MAC" in e["reason"] for e in warned), warned


async def test_commands_manifests_and_ticks_carry_the_daemons_authentication(
    setup: Setup,
) -> None:
    key = setup.key()
    public = setup.keys.verify
    async with setup.bus.open(topics=DEFAULT_TOPICS) as bus:
        await send(bus, key, started(0), started(1), beat(0, 1, 10), beat(1, 1, 10))
        await send(bus, key, shard(0, 2, 10), shard(1, 2, 10), killed(1))
        service = DaemonService(
            config(setup, restore_timeout_s=1.0, bus_gap_s=0.6), keys=setup.keys
        )
        async with running(service):

            async def restores() -> list[bytes]:
                return [
                    v for v in await read_all(bus, "commands") if isinstance(decode(v), Restore)
                ]

            await eventually(restores)

            async def ticks() -> list[bytes]:  # the restore times out: ticks decide it
                return [
                    v for v in await read_all(bus, "events") if isinstance(decode(v), ClockTick)
                ]

            tick_values = await eventually(ticks)
        commands = await read_all(bus, "commands")
        manifests = await read_all(bus, "manifests")
    assert commands
    assert manifests
    for value in [*commands, *manifests]:
        assert verify_signature(value, public) == setup.keys.signing_kid
    assert isinstance(decode(manifests[0]), Manifest)
    for value in tick_values:
        assert verify_mac(value, {key[0]: key[1]}) == key[0]


async def test_a_rotated_event_key_is_read_when_an_event_names_it(setup: Setup) -> None:
    async with setup.bus.open(topics=DEFAULT_TOPICS) as bus:
        await send(bus, setup.key(), started(0), started(1))
        service = DaemonService(config(setup), keys=setup.keys)
        async with running(service):
            await eventually(lambda: _folded(service, 2))
            rotated = setup.admin.rotate("event", JOB)
            new_key = KeyStore(setup.admin.path).secret_key("event", rotated.kid, JOB)
            await send(bus, (rotated.kid, new_key), beat(0, 1, 5))
            await eventually(lambda: _folded(service, 3))
            assert service.jobs[JOB].ranks[0].step == 5
            assert rejected(service, "unknown_kid") == 0


async def test_a_signing_key_rotated_while_a_job_runs_signs_the_next_command(
    setup: Setup,
) -> None:
    """The running daemon picks the new signing key up at its next reload; an agent given both
    public keys (the rotation's agent bundle) takes the command, one with only the old does
    not."""
    key = setup.key()
    old_public = dict(setup.keys.verify)
    async with setup.bus.open(topics=DEFAULT_TOPICS) as bus:
        await send(bus, key, started(0), started(1), beat(0, 1, 10), beat(1, 1, 10))
        cfg = dataclasses.replace(config(setup), security=SecurityConfig(key_reload_s=0.1))
        service = DaemonService(cfg, keys=setup.keys)
        async with running(service):
            await eventually(lambda: _folded(service, 4))
            rotated = setup.admin.rotate("signing")
            await asyncio.sleep(0.5)  # a reload or more
            await send(bus, key, killed(1))

            async def restore() -> list[bytes]:
                values = await read_all(bus, "commands")
                return [v for v in values if isinstance(decode(v), Restore)]

            [command] = await eventually(restore)
    both = load_public_keys(setup.admin.agent_bundle(JOB).public_keys)
    assert set(both) == {*old_public, rotated.kid}
    assert verify_signature(command, both) == rotated.kid
    assert CommandGate(JOB, 0, both).admit(command) == decode(command)
    refused = CommandGate(JOB, 0, old_public).admit(command)
    assert isinstance(refused, Ignored)
    assert refused.reason == "unknown_kid"


async def test_unusable_key_files_refuse_that_jobs_records_and_nothing_else(setup: Setup) -> None:
    """A job whose event key file is readable by others is no crash: its records are refused
    (``key_error``, naming the file), every other job goes on, and once the file is fixed the
    job's next records are judged again."""
    other_key = setup.key("other-job")
    [key_file] = (setup.admin.path / "events" / "other-job").glob("*.key")
    key_file.chmod(0o644)
    keys = KeyStore(setup.admin.path).load_daemon_keys()  # reads job keys on first use
    async with setup.bus.open(topics=DEFAULT_TOPICS) as bus:
        await send(bus, setup.key(), started(0), started(1), beat(0, 1, 10))
        await send(bus, other_key, started(0, "other-job"), beat(0, 1, 3, "other-job"))
        await send(bus, None, beat(1, 1, 4, "other-job"))  # unsigned: refused all the same
        await send(bus, setup.key(), beat(1, 1, 10))
        async with running(DaemonService(config(setup), keys=keys)) as service:

            async def parked() -> list[dict[str, Any]]:
                entries = [orjson.loads(v) for v in await read_all(bus, "dead-letter")]
                return entries if len(entries) >= 3 else []

            entries = await eventually(parked)
            await eventually(lambda: _folded(service, 4))
            assert rejected(service, "key_error") == 3
            assert "other-job" not in service.jobs
            assert (service.jobs[JOB].ranks[0].step, service.jobs[JOB].ranks[1].step) == (10, 10)
            key_file.chmod(0o600)
            await send(bus, other_key, started(0, "other-job"))
            await eventually(lambda: _folded(service, 5))
            assert "other-job" in service.jobs
    assert all(str(key_file) in e["reason"] for e in entries)
    assert all("cannot be used" in e["reason"] for e in entries)
