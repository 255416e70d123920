"""The daemon with keys on a real embedded bus: it signs its commands and manifests, MACs its
ticks, and refuses events whose MAC is missing, wrong, under another job's key, or (with
``require_auth``) of a job without a key: dead-lettered with the reason, counted, recorded on
``audit``, job state unchanged; and a replay, which holds no key, folds what the daemon folded.
Intake's MAC check on raw bytes gives the verdicts and messages of the check after decoding."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hypothesis
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.buses import BusFactory
from tests.daemon.service_support import JobEvents, eventually, read_all, running
from tests.schemas.mac_mutations import maced_records
from tests.schemas.support import STRATEGIES
from trainguard.agent.bus import DEFAULT_TOPICS, Bus
from trainguard.agent.keys._command_gate import CommandGate, Ignored
from trainguard.agent.keys._keystore import (
    DaemonKeys,
    KeyStore,
    KeyStoreError,
    key_id,
    load_public_keys,
)
from trainguard.daemon import DaemonService, MachineConfig
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.daemon.core._inputs import Observed
from trainguard.daemon.core._intake import INPUT_TYPES, AuthRefusal, RawRecord, Refused, Taken, take
from trainguard.daemon.forensics._job_log import read_bus
from trainguard.daemon.forensics._replay import replay, verify
from trainguard.daemon.service._security import EventAuth, load_keys
from trainguard.daemon.service._settings import DaemonConfig, SecurityConfig, load_daemon_config
from trainguard.schemas import (
    ClockTick,
    Event,
    JobRequest,
    Manifest,
    Restore,
    add_mac,
    canonical_bytes,
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


def test_a_rebuild_accepts_a_retired_key_that_fresh_input_may_not_use(setup: Setup) -> None:
    old = setup.key()
    setup.admin.rotate("event", JOB)
    setup.admin.retire(old[0])
    keys = KeyStore(setup.admin.path).load_daemon_keys()
    event = add_mac(beat(0, 1, 5), *old)
    record = _Record(encode(event))
    live = EventAuth(keys, require=False)
    rebuild = EventAuth(keys, require=False, rebuilding=True)
    assert live.refuse(record, event) == ("unknown_kid", f"MAC under unknown event key {old[0]}")
    assert rebuild.refuse(record, event) is None


@dataclasses.dataclass(frozen=True)
class _Record:
    value: bytes
    key: str | None = JOB
    offset: int = 0
    timestamp_ms: int = 0


@dataclasses.dataclass(frozen=True, repr=False)
class Ring:
    """A key directory: ``JOB`` with a live and a retired event key, ``other-job`` with one,
    ``open-job`` with none; ``signers`` are ``(kid, key)`` pairs to MAC with (those three and
    a key nobody holds)."""

    keys: DaemonKeys
    signers: tuple[tuple[str, bytes], ...]

    def __repr__(self) -> str:  # Hypothesis prints a failing example's arguments: no keys
        return f"Ring({self.keys.store.path if self.keys.store else None})"


@pytest.fixture(scope="module")
def ring(tmp_path_factory: pytest.TempPathFactory) -> Ring:
    admin = KeyAdmin(tmp_path_factory.mktemp("ring") / "keys")
    admin.init([JOB, "other-job"])
    store = KeyStore(admin.path)
    old = store.load_daemon_keys().current_event_key(JOB)
    assert old is not None
    admin.rotate("event", JOB)
    admin.retire(old[0])
    keys = store.load_daemon_keys()
    live, other = keys.current_event_key(JOB), keys.current_event_key("other-job")
    assert live is not None
    assert other is not None
    nobody = os.urandom(32)
    return Ring(keys, (live, live, old, other, (key_id(nobody), nobody)))


class _Spy:
    """``auth``, with (``raw``) or without the MAC check on raw bytes (without it, intake
    decodes every record whole), counting the records that reach :meth:`refuse`."""

    def __init__(self, auth: EventAuth, *, raw: bool) -> None:
        self.auth, self.raw, self.judged = auth, raw, 0

    def refuse(
        self, record: RawRecord, message: Event | JobRequest | ClockTick
    ) -> tuple[AuthRefusal, str] | None:
        self.judged += 1
        return self.auth.refuse(record, message)

    def mac_keys(self, record: RawRecord) -> Mapping[str, bytes] | None:
        return self.auth.mac_keys(record) if self.raw else None


def _outcome(taken: Taken | Refused) -> tuple[object, ...]:
    """What intake decided, messages by their encoding (a NaN loss equals a NaN loss)."""
    if isinstance(taken, Refused):
        return (taken.code, taken.auth, taken.reason)
    item = taken.input
    folded = (item.at_ns, item.offset, encode(item.event)) if isinstance(item, Observed) else item
    return (taken.job_id, folded, encode(taken.message), taken.input_id)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_mac_checked_on_raw_bytes_gives_the_verdicts_of_the_full_check(
    ring: Ring, data: st.DataObject
) -> None:
    """Live and rebuilding, with and without require_auth: intake takes and refuses the same
    records, with the same reasons and messages, as when it decodes every record before
    judging it; what an agent sends is taken on its raw bytes."""
    cls = data.draw(st.sampled_from(INPUT_TYPES))
    job = data.draw(st.sampled_from((JOB, JOB, "other-job", "open-job")))
    message = dataclasses.replace(data.draw(STRATEGIES[cls]), job_id=job, auth=None)
    kid, key = data.draw(st.sampled_from(ring.signers))
    other = next(s for s in ring.signers if s[0] != kid)
    how, value = data.draw(maced_records(canonical_bytes(message), kid, key, other))
    record = _Record(value, key=data.draw(st.sampled_from((job, job, job, "other-job", None))))
    for rebuilding, require in itertools.product((False, True), repeat=2):
        one, two = (
            EventAuth(ring.keys, require=require, rebuilding=rebuilding, clock=lambda: 0.0)
            for _ in range(2)
        )
        raw = _Spy(one, raw=True)
        fast, full = take(record, raw), take(record, _Spy(two, raw=False))
        assert _outcome(fast) == _outcome(full)
        if how == "same/sent" and record.key == job == JOB and key == ring.signers[0][1]:
            assert isinstance(fast, Taken)
            assert raw.judged == 0  # taken on the raw bytes
    hypothesis.event(f"{how}: {'taken' if isinstance(fast, Taken) else fast.code}")


def test_the_security_table_its_overrides_and_the_example(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "deploy" / "daemon.example.toml"
    named = set(re.findall(r"^#?\s*([a-z_]+)\s*=", example.read_text(), re.MULTILINE))
    assert {f.name for f in dataclasses.fields(SecurityConfig)} <= named
    assert load_daemon_config(example).security == SecurityConfig()
    path = tmp_path / "d.toml"
    path.write_text('[security]\nkeys_dir = "~/k"\nrequire_auth = true\nkey_reload_s = 2.5\n')
    loaded = load_daemon_config(path, security_overrides={"require_auth": None}).security
    assert loaded == SecurityConfig(
        keys_dir=Path("~/k").expanduser(), require_auth=True, key_reload_s=2.5
    )
    overridden = load_daemon_config(path, security_overrides={"require_auth": False})
    assert not overridden.security.require_auth
    path.write_text("[security]\nrequire = true\n")
    with pytest.raises(ValueError, match="require"):
        load_daemon_config(path)
    with pytest.raises(ValueError, match="key_reload_s"):
        SecurityConfig(key_reload_s=0)


def test_load_keys_uses_the_directory_given_and_require_auth_needs_one(
    setup: Setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no default key directory
    assert load_keys(SecurityConfig()) is None
    with pytest.raises(KeyStoreError, match="require_auth"):
        load_keys(SecurityConfig(require_auth=True))
    keys = load_keys(SecurityConfig(keys_dir=setup.admin.path, require_auth=True))
    assert keys is not None
    assert keys.signing_kid == setup.keys.signing_kid
    with pytest.raises(KeyStoreError, match="trainguard keys init"):
        load_keys(SecurityConfig(keys_dir=tmp_path / "empty"))
    default = tmp_path / "home" / ".config" / "trainguard" / "keys"
    KeyAdmin(default).init()
    found = load_keys(SecurityConfig())
    assert found is not None
    assert found.store is not None
    assert found.store.path == default


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
