"""``trainguard keys init|job|rotate|show|retire`` and the key directory they manage: rotation
keeps old keys valid, retirement removes them from what verifies, and nothing but
``--export-agent`` prints a secret."""

from __future__ import annotations

import base64
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from trainguard.agent.keys._keystore import KeyStore, load_event_key
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


def test_a_key_directory_under_an_unknown_user_is_an_error_not_a_traceback() -> None:
    """Every keys command, and the catalog commands that read daemon public keys, end with
    exit status 2 and one line naming the option when ``--keys`` starts with a ``~user`` of
    no user."""
    for args in (["init"], ["show"], ["job", "j"], ["rotate", "--signing"], ["retire", "k"]):
        code, _, err = keys_cli(*args, "--keys", "~no-such-user-tg/keys")
        assert code == 2, (args, err)
        assert "the key directory (--keys, TRAINGUARD_KEYS): cannot expand" in err, args
    result = CliRunner().invoke(
        app,
        ["checkpoints", "list", "--bus", "sqlite:///nowhere/bus.db", "--keys", "~no-such-user-tg"],
    )
    assert result.exit_code == 2, result.output
    assert "cannot expand '~no-such-user-tg'" in result.stderr


def test_an_empty_key_directory_is_a_usage_error_on_every_command_that_takes_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--keys ''`` (say ``--keys "$DIR"`` with ``DIR`` unset) named the working folder: ``keys
    init`` filled it with keys. Every command taking ``--keys`` (and ``--config``) refuses it
    with exit status 2 before it reads or writes anything."""
    monkeypatch.chdir(tmp_path)
    bus = ["--bus", f"sqlite://{tmp_path / 'bus.db'}"]
    for args in (
        ["keys", "init"], ["keys", "show"], ["keys", "job", "j"], ["keys", "rotate", "--signing"],
        ["keys", "retire", "k"], ["checkpoints", "list", *bus], ["snapshots", "verify", *bus],
        ["snapshots", "show", "j", *bus], ["daemon", *bus],
    ):  # fmt: skip
        for option in ("--keys", "--config"):
            if args[0] == "keys" and option == "--config":
                continue
            result = CliRunner().invoke(app, [*args, option, ""], env={"COLUMNS": "200"})
            assert result.exit_code == 2, (args, option, result.output)
            assert f"Invalid value for '{option}'" in result.output, (args, option)
            assert "an empty path" in result.output, (args, option)
    assert list(tmp_path.iterdir()) == []


def test_out_without_export_agent_is_a_usage_error_not_ignored(tmp_path: Path) -> None:
    keys = tmp_path / "k"
    assert keys_cli("init", "--keys", str(keys), "--job", "j1")[0] == 0
    code, out, err = keys_cli("show", "--keys", str(keys), "--out", str(tmp_path / "mount"))
    assert code == 2
    assert "--out writes a job's agent files: give it with --export-agent JOB" in err
    assert out == ""
    assert not (tmp_path / "mount").exists()
