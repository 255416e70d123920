"""The daemon's event authentication on its own, without a bus: a rebuild accepts a retired key
that fresh input may not use; the ``[security]`` settings; where the keys are loaded from.
(Intake's MAC check on raw bytes is a property test:
``tests/properties/test_event_auth_raw_mac.py``.) The
daemon with keys on a real bus is tested in ``tests/service/daemon/test_auth_intake.py``."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tests.support.mac_mutations import RawBytes
from tests.support.service_support import JobEvents
from trainguard.agent.keys._keystore import DaemonKeys, KeyStore, KeyStoreError
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.daemon.service._security import EventAuth, load_keys
from trainguard.daemon.service._settings import SecurityConfig, load_daemon_config
from trainguard.schemas import add_mac, encode

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
    record = RawBytes(encode(event))
    live = EventAuth(keys, require=False)
    rebuild = EventAuth(keys, require=False, rebuilding=True)
    assert live.refuse(record, event) == ("unknown_kid", f"MAC under unknown event key {old[0]}")
    assert rebuild.refuse(record, event) is None


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
