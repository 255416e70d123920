"""``trainguard keys init|job|rotate|show|retire`` and the key directory they manage: rotation
keeps old keys valid, retirement removes them from what verifies, and nothing but
``--export-agent`` prints a secret."""

from __future__ import annotations

import base64
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from trainguard.agent.keys._keystore import (
    KeyStore,
    KeyStoreError,
    load_event_key,
    load_public_keys,
)
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.daemon.cli import app


def keys_cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["keys", *args])
    return result.exit_code, result.stdout, result.stderr


def secrets_of(root: Path) -> list[str]:
    """Every secret in a key directory, in the forms output could show it."""
    out: list[str] = []
    for path in root.rglob("*"):
        if path.suffix == ".key":
            key = path.read_bytes()
            out += [key.hex(), base64.b64encode(key).decode()]
        elif path.suffix == ".pem" and ".pub." not in path.name:
            body = path.read_text().splitlines()[1]
            out.append(body)
    return out


def test_rotation_keeps_old_keys_and_retirement_drops_them(tmp_path: Path) -> None:
    admin = KeyAdmin(tmp_path / "k")
    first_signing, first_data = admin.init()
    store = KeyStore(admin.path)
    second = admin.rotate("signing")
    keys = store.load_daemon_keys()
    assert keys.signing_kid == second.kid
    assert set(keys.verify) == {first_signing.kid, second.kid}
    new_data = admin.rotate("data")
    keys = store.load_daemon_keys()
    assert (keys.data_kid, set(keys.data)) == (new_data.kid, {first_data.kid, new_data.kid})

    with pytest.raises(KeyStoreError, match="is current"):
        admin.retire(second.kid)
    retired = admin.retire(first_signing.kid)
    assert retired.retired_at is not None
    assert set(store.load_daemon_keys().verify) == {second.kid}
    assert set(store.public_keys(retired=True)) == {first_signing.kid}
    with pytest.raises(KeyStoreError, match="no live key"):
        admin.retire(first_signing.kid)

    listed = {(i.kind, i.kid): i for i in admin.all_keys()}
    assert listed["signing", first_signing.kid].retired_at == retired.retired_at
    assert listed["signing", second.kid].current
    assert not listed["data", first_data.kid].current


def test_init_refuses_an_initialised_directory_and_jobs_need_init(tmp_path: Path) -> None:
    admin = KeyAdmin(tmp_path / "k")
    with pytest.raises(KeyStoreError, match="not initialised"):
        admin.add_job("j")
    admin.init()
    with pytest.raises(KeyStoreError, match="initialised already"):
        admin.init()
    admin.add_job("j")
    with pytest.raises(KeyStoreError, match="has an event key already"):
        admin.add_job("j")
    with pytest.raises(KeyStoreError, match="no event key to rotate"):
        admin.rotate("event", "other")
    with pytest.raises(KeyStoreError, match="not a job id"):
        admin.add_job("../signing")


def test_the_agent_bundle_holds_every_live_public_key_and_the_current_event_key(
    tmp_path: Path,
) -> None:
    admin = KeyAdmin(tmp_path / "k")
    admin.init(["j"])
    admin.rotate("signing")
    bundle = admin.agent_bundle("j")
    keys = KeyStore(admin.path).load_daemon_keys()
    assert set(load_public_keys(bundle.public_keys)) == set(keys.verify)
    event = load_event_key(bundle.event_key)
    assert keys.current_event_key("j") == (event.kid, event.secret)
    manifest = bundle.secret_manifest()
    assert manifest["kind"] == "Secret"
    files = manifest["stringData"]
    assert isinstance(files, dict)
    assert set(files) == {"daemon-public-keys.pem", "event-key"}


def test_the_cli_creates_rotates_lists_and_retires(tmp_path: Path) -> None:
    keys = str(tmp_path / "k")
    code, out, err = keys_cli("init", "--keys", keys, "--job", "j1")
    assert code == 0, err
    assert "created signing key" in out
    assert "for job j1" in out
    code, out, err = keys_cli("job", "j2", "--keys", keys)
    assert code == 0, err
    code, out, err = keys_cli("rotate", "--keys", keys, "--job", "j1")
    assert code == 0, err
    new_kid = out.split()[3]
    code, _, err = keys_cli("rotate", "--keys", keys, "--signing", "--data")
    assert code == 2
    assert "exactly one" in err
    code, out, err = keys_cli("show", "--keys", keys, "--format", "json")
    assert code == 0, err
    shown = orjson.loads(out)
    events = [k for k in shown["keys"] if k["kind"] == "event" and k["job_id"] == "j1"]
    assert [k["current"] for k in events].count(True) == 1
    old = next(k["kid"] for k in events if not k["current"])
    assert next(k for k in events if k["current"])["kid"] == new_kid
    code, out, err = keys_cli("retire", old, "--keys", keys)
    assert code == 0, err
    code, out, err = keys_cli("retire", new_kid, "--keys", keys)
    assert code == 2
    assert "rotate --job j1 first" in err
    code, out, _ = keys_cli("show", "--keys", keys)
    assert code == 0
    assert "retired" in out
    assert "BEGIN PUBLIC KEY" in out


def test_show_never_prints_a_secret_but_export_agent_does_as_asked(tmp_path: Path) -> None:
    keys = tmp_path / "k"
    assert keys_cli("init", "--keys", str(keys), "--job", "j1")[0] == 0
    secrets = secrets_of(keys)
    assert len(secrets) == 5  # signing PEM body, data and event key in two forms each
    for fmt in ("text", "json"):
        code, out, _ = keys_cli("show", "--keys", str(keys), "--format", fmt)
        assert code == 0
        assert not [s for s in secrets if s in out]
    code, out, _ = keys_cli("show", "--keys", str(keys), "--export-agent", "j1")
    assert code == 0
    event_key = KeyStore(keys).secret_keys("event", "j1")
    assert base64.b64encode(next(iter(event_key.values()))).decode() in out
    data_key = KeyStore(keys).secret_keys("data")
    assert base64.b64encode(next(iter(data_key.values()))).decode() not in out
    mount = tmp_path / "mount"
    code, out, _ = keys_cli(
        "show", "--keys", str(keys), "--export-agent", "j1", "--out", str(mount)
    )
    assert code == 0
    assert (mount / "event-key").stat().st_mode & 0o777 == 0o600
    assert load_event_key(str(mount / "event-key")).secret in event_key.values()


def test_an_insecure_key_file_fails_the_cli_with_the_fix(tmp_path: Path) -> None:
    keys = tmp_path / "k"
    assert keys_cli("init", "--keys", str(keys), "--job", "j1")[0] == 0
    event = next((keys / "events" / "j1").glob("*.key"))
    event.chmod(0o644)
    code, out, err = keys_cli("show", "--keys", str(keys), "--export-agent", "j1")
    assert code == 2
    assert f"chmod 600 {event}" in err
    assert base64.b64encode(event.read_bytes()).decode() not in out + err
    code, _, err = keys_cli("show", "--keys", str(keys), "--export-agent", "nojob")
    assert code == 2
    assert "no event key" in err
