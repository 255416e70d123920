"""Reading keys (trainguard.agent.keys._keystore): the key directory's files and modes, and what
agents and supervisors are given through the environment or a secret mount."""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from trainguard.agent import AgentConfig, ConfigError
from trainguard.agent.keys._keystore import (
    InsecureKeyFile,
    KeyStore,
    KeyStoreError,
    agent_keys_from_env,
    key_id,
    load_event_key,
    load_public_keys,
    public_key_id,
    public_pem,
)
from trainguard.daemon.admin._keys import KeyAdmin


@pytest.fixture
def admin(tmp_path: Path) -> KeyAdmin:
    admin = KeyAdmin(tmp_path / "keys")
    admin.init(["j1"])
    return admin


def secret_files(root: Path) -> list[Path]:
    return [
        p
        for p in root.rglob("*")
        if p.is_file()
        and (p.suffix == ".key" or (p.name.endswith(".pem") and ".pub." not in p.name))
    ]


def test_every_secret_file_is_0600_and_every_directory_0700(admin: KeyAdmin) -> None:
    files = secret_files(admin.path)
    assert len(files) == 3  # signing, data, j1's event key
    for path in files:
        assert path.stat().st_mode & 0o777 == 0o600, path
    for path in [admin.path, *(p for p in admin.path.rglob("*") if p.is_dir())]:
        assert path.stat().st_mode & 0o777 == 0o700, path


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_secret_file_others_can_read_is_refused_with_the_fix(admin: KeyAdmin, mode: int) -> None:
    store = KeyStore(admin.path)
    for path in secret_files(admin.path):
        path.chmod(mode)
        load = (
            (lambda: store.secret_keys("event", "j1"))
            if "events" in path.parts
            else store.load_daemon_keys
        )
        with pytest.raises(InsecureKeyFile) as info:
            load()
        assert f"chmod 600 {path}" in str(info.value)
        assert f"{mode:04o}" in str(info.value)
        assert path.read_bytes().hex() not in str(info.value)
        path.chmod(0o600)
    store.load_daemon_keys()


def test_a_key_file_holding_another_key_than_its_name_is_refused(admin: KeyAdmin) -> None:
    store = KeyStore(admin.path)
    kid = store.current("data")
    assert kid is not None
    (admin.path / "data" / f"{kid}.key").write_bytes(os.urandom(32))
    with pytest.raises(KeyStoreError, match="is not the 32-byte key"):
        store.load_daemon_keys()


def test_an_uninitialised_directory_says_how_to_initialise_it(tmp_path: Path) -> None:
    with pytest.raises(KeyStoreError, match="trainguard keys init"):
        KeyStore(tmp_path).load_daemon_keys()


def test_daemon_keys_hold_the_current_keys_and_read_event_keys_per_job(admin: KeyAdmin) -> None:
    keys = KeyStore(admin.path).load_daemon_keys()
    assert public_key_id(keys.signing.public_key()) == keys.signing_kid
    assert set(keys.verify) == {keys.signing_kid}
    assert key_id(keys.data[keys.data_kid]) == keys.data_kid
    current = keys.current_event_key("j1")
    assert current is not None
    assert keys.event_keys("j1") == {current[0]: current[1]}
    assert keys.event_keys("unknown") is None
    assert keys.event_keys("..") is None  # never a path outside events/
    assert "signing=" not in repr(keys)


def test_a_rotation_is_seen_after_a_refresh_and_old_keys_stay(admin: KeyAdmin) -> None:
    keys = KeyStore(admin.path).load_daemon_keys()
    first = keys.current_event_key("j1")
    assert first is not None
    second = admin.rotate("event", "j1")
    assert keys.current_event_key("j1") == first  # cached
    keys.refresh("j1")
    now = keys.current_event_key("j1")
    assert now is not None
    assert now[0] == second.kid
    assert set(keys.event_keys("j1") or {}) == {first[0], second.kid}
    admin.retire(first[0])
    keys.refresh("j1")
    assert set(keys.event_keys("j1") or {}) == {second.kid}
    assert set(keys.retired_event_keys("j1")) == {first[0]}


# -- what agents are given ----------------------------------------------------------------------


def pem_of(key: Ed25519PrivateKey) -> str:
    return public_pem(key.public_key())


def test_public_keys_come_as_pem_text_or_a_file_with_several(tmp_path: Path) -> None:
    a, b = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    ids = {public_key_id(a.public_key()), public_key_id(b.public_key())}
    assert set(load_public_keys(pem_of(a) + pem_of(b))) == ids
    path = tmp_path / "daemon.pem"
    path.write_text(pem_of(a) + "\n" + pem_of(b))
    assert set(load_public_keys(str(path))) == ids


def test_public_keys_refuse_a_private_key_and_nonsense(tmp_path: Path) -> None:
    private = (
        Ed25519PrivateKey.generate()
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        .decode()
    )
    with pytest.raises(ConfigError, match="private key"):
        load_public_keys(private)
    with pytest.raises(ConfigError, match="no PEM public key"):
        load_public_keys("-----BEGIN nothing")
    with pytest.raises(ConfigError, match="cannot read"):
        load_public_keys(str(tmp_path / "missing.pem"))


def test_an_event_key_comes_inline_or_from_a_file_checked_like_a_secret(tmp_path: Path) -> None:
    key = os.urandom(32)
    kid = hashlib.sha256(key).digest()[:8].hex()
    inline = f"{kid}:{base64.b64encode(key).decode()}"
    assert load_event_key(inline).secret == key
    raw = tmp_path / "raw"
    text = tmp_path / "text"
    for path, content in ((raw, key), (text, (inline + "\n").encode())):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, content)
        os.close(fd)
        event = load_event_key(str(path))
        assert (event.kid, event.secret) == (kid, key)
    raw.chmod(0o644)
    with pytest.raises(InsecureKeyFile):
        load_event_key(str(raw))
    assert key.hex() not in repr(load_event_key(inline))


def test_a_wrong_event_key_never_appears_in_the_error() -> None:
    key = os.urandom(32)
    wrong_kid = f"{'0' * 16}:{base64.b64encode(key).decode()}"
    for value in (
        wrong_kid,
        f"{'0' * 16}:not-base64!",
        f"{'0' * 16}:{base64.b64encode(key[:5]).decode()}",
    ):
        with pytest.raises(ConfigError) as info:
            AgentConfig.resolve({"TRAINGUARD_JOB": "j", "TRAINGUARD_EVENT_KEY": value})
        assert value not in str(info.value)
        assert value.partition(":")[2] not in str(info.value)


def test_the_agent_reads_its_keys_from_the_environment(admin: KeyAdmin, tmp_path: Path) -> None:
    public, event = admin.agent_bundle("j1").write(tmp_path / "mount")
    env = {
        "TRAINGUARD_JOB": "j1",
        "TRAINGUARD_DAEMON_PUBLIC_KEYS": str(public),
        "TRAINGUARD_EVENT_KEY": str(event),
    }
    config = AgentConfig.resolve(env)
    keys = KeyStore(admin.path).load_daemon_keys()
    assert config.keys.verify is not None
    assert set(config.keys.verify) == set(keys.verify)
    assert config.keys.event is not None
    assert keys.current_event_key("j1") == (config.keys.event.kid, config.keys.event.secret)
    assert agent_keys_from_env({"TRAINGUARD_EVENT_KEY": ""}).event is None
    assert AgentConfig.resolve({"TRAINGUARD_JOB": "j1"}).keys.verify is None
