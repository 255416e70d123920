"""The daemon's event authentication on its own, without a bus: a rebuild accepts a retired key
that fresh input may not use; intake's MAC check on raw bytes gives the verdicts and messages
of the check after decoding; the ``[security]`` settings; where the keys are loaded from. The
daemon with keys on a real bus is tested in ``tests/service/daemon/test_auth_intake.py``."""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from collections.abc import Mapping
from pathlib import Path

import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.mac_mutations import maced_records
from tests.support.schemas import STRATEGIES
from tests.support.service_support import JobEvents
from trainguard.agent.keys._keystore import DaemonKeys, KeyStore, KeyStoreError, key_id
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.daemon.core._inputs import Observed
from trainguard.daemon.core._intake import INPUT_TYPES, AuthRefusal, RawRecord, Refused, Taken, take
from trainguard.daemon.service._security import EventAuth, load_keys
from trainguard.daemon.service._settings import SecurityConfig, load_daemon_config
from trainguard.schemas import ClockTick, Event, JobRequest, add_mac, canonical_bytes, encode

JOB = "auth-job"


@dataclasses.dataclass(frozen=True)
class Setup:
    """A key directory with an event key for ``JOB`` and one for ``other-job``, and the daemon's
    keys from it."""

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
    return Setup(admin, KeyStore(admin.path).load_daemon_keys())


beat = JobEvents(JOB).beat


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
    example = Path(__file__).resolve().parents[3] / "deploy" / "daemon.example.toml"
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
