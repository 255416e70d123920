"""No secret appears in any output: settings and key holders print redacted, and the daemon,
the supervisor, the agent and the command line, configured with a Kafka SASL password and a key
directory (or an agent's event key), keep them out of every log line and error message,
tracebacks included. A secret is looked for in every form a leak would take: as text, and for
key bytes as hex, base64 (padded or not, standard or URL-safe), Python's ``bytes`` repr and
the PEM lines of a private key.

The Kafka runs here need no broker: they point at a closed port, so every client takes its
error path (the one most likely to print what it was configured with). The same checks
against a broker that refuses the password are in ``tests/contract/bus/test_kafka_sasl.py``.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from structlog.testing import capture_logs

from tests.support.machine_scenarios import Sim
from trainguard.agent import Agent, AgentConfig
from trainguard.agent.bus import BusConfig, load_kafka_security, open_bus
from trainguard.agent.keys._keystore import KeyStore, agent_keys_from_env
from trainguard.agent.supervisor._supervisor import SupervisorConfig
from trainguard.daemon.demo._harness import start_daemon
from trainguard.daemon.service._settings import load_daemon_config
from trainguard.schemas import add_mac, encode

PASSWORD = "Sekr1t-7f3a9c-pw"
CLI = [sys.executable, "-m", "trainguard.daemon.cli"]


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _sasl_env(password_file: Path | None = None) -> dict[str, str]:
    secret = (
        {"TRAINGUARD_KAFKA_SASL_PASSWORD": PASSWORD}
        if password_file is None
        else {"TRAINGUARD_KAFKA_SASL_PASSWORD_FILE": str(password_file)}
    )
    return {
        "TRAINGUARD_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "TRAINGUARD_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "TRAINGUARD_KAFKA_SASL_USERNAME": "trainguard",
        **secret,
    }


def _run(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run ``trainguard ARGS`` with only ``env``'s ``TRAINGUARD_*`` variables; exit code and
    everything it printed."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    done = subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=120,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def test_settings_objects_print_the_password_redacted(tmp_path: Path) -> None:
    security = load_kafka_security(None, _sasl_env())
    bus = BusConfig(url="kafka://127.0.0.1:9092", security=security)
    daemon = load_daemon_config(None, bus_url=bus.url, env=_sasl_env())
    agent = AgentConfig.resolve(env={**_sasl_env(), "TRAINGUARD_JOB": "j"})
    supervisor = SupervisorConfig(job_id="j", bus=bus, command=["true"])
    for shown in (security, bus, daemon, agent, supervisor, replace(security)):
        for text in (repr(shown), str(shown), f"{shown}", f"{shown!r}"):
            assert PASSWORD not in text
    assert "sasl_password='***'" in repr(security)
    assert "sasl_username='trainguard'" in str(bus)  # the rest stays visible


@pytest.mark.parametrize("console", [False, True], ids=["json", "console"])
def test_the_daemon_keeps_the_password_out_of_its_failure(tmp_path: Path, console: bool) -> None:
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD)
    url = f"kafka://127.0.0.1:{_closed_port()}"
    args = ["daemon", "--bus", url, "--metrics-port", "-1", *(["--console"] if console else [])]
    # The daemon waits for the bus (an outage, logged with its cause) until signalled.
    code, output = _run_until_outage(args, _sasl_env(password_file))
    assert code == 0, output
    assert "ConnectionRefusedError" in output
    assert PASSWORD not in output


def _run_until_outage(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run ``trainguard ARGS`` (a supervisor or a daemon, which wait out a bus they cannot
    reach) until it logs the outage, then SIGTERM it; exit code and everything it printed."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    proc = subprocess.Popen(
        [*CLI, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**base, **env},
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # ends at EOF if it exits instead of waiting
        lines.append(line)
        if "bus outage" in line:
            proc.send_signal(signal.SIGTERM)
            break
    lines.extend(proc.stdout)
    return proc.wait(60), "".join(lines)


def test_the_supervisor_and_the_command_line_keep_the_password_out(tmp_path: Path) -> None:
    url = f"kafka://127.0.0.1:{_closed_port()}"
    # The supervisor waits for the bus (an outage, logged with its cause) until signalled.
    code, output = _run_until_outage(["run", "--job", "j", "--bus", url, "--", "true"], _sasl_env())
    assert code == 128 + signal.SIGTERM, output
    assert "ConnectionRefusedError" in output
    assert PASSWORD not in output
    bad = {**_sasl_env(), "TRAINGUARD_KAFKA_SASL_MECHANISM": "GSSAPI"}
    for args in (["bus", "check", "--bus", url], ["status", "--bus", url]):
        code, output = _run(args, bad)
        assert code == 2, output
        assert "SASL mechanism 'GSSAPI'" in output
        assert PASSWORD not in output


LOGGED_TRACEBACK = textwrap.dedent(
    """
    import sys
    import structlog
    from trainguard.daemon.service._logging import configure_logging

    configure_logging(json=sys.argv[1] == "json")

    def connect(password: str) -> None:
        options = {"sasl_plain_password": password}
        raise ConnectionError(f"refused ({len(options)} options)")

    try:
        connect(sys.argv[2])
    except ConnectionError:
        structlog.get_logger().exception("connect failed")
    """
)


@pytest.mark.parametrize("renderer", ["json", "console"])
def test_logged_tracebacks_show_no_local_variables(renderer: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", LOGGED_TRACEBACK, renderer, PASSWORD],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "ConnectionError" in done.stderr  # the traceback itself is there
    assert PASSWORD not in done.stderr + done.stdout


def test_an_agent_that_cannot_connect_logs_no_password(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env = {
        **_sasl_env(),
        "TRAINGUARD_JOB": "j",
        "TRAINGUARD_BUS": f"kafka://127.0.0.1:{_closed_port()}",
        "TRAINGUARD_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
    }
    agent = Agent(AgentConfig.resolve(env=env, heartbeat_interval_s=0.05))
    with capture_logs() as logs, agent:
        agent.ready(0)
        agent.step(1, loss=1.0)
        deadline = time.monotonic() + 30
        while agent.stats.last_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = agent.stats
        agent.close(timeout_s=1.0)
    assert stats.last_error is not None
    assert "ConnectionRefusedError" in stats.last_error
    assert any(entry["event"] == "bus_trouble" for entry in logs)
    assert PASSWORD not in repr(logs) + caplog.text + repr(stats)


# -- keys ------------------------------------------------------------------------------------


def _forms(raw: bytes) -> list[str]:
    """The textual forms a leak of ``raw`` would take."""
    b64 = base64.b64encode(raw).decode()
    url = base64.urlsafe_b64encode(raw).decode()
    return [raw.hex(), b64, b64.rstrip("="), url, url.rstrip("="), repr(raw)[2:-1]]


def _secrets(key_dir: Path) -> list[str]:
    """Every secret of ``key_dir`` (data, event and signing keys) in every form of
    :func:`_forms`, plus the body lines of the private keys' PEM files."""
    found: list[str] = []
    for path in sorted(key_dir.rglob("*")):
        if path.suffix == ".key":
            found += _forms(path.read_bytes())
        elif path.suffix == ".pem" and not path.name.endswith(".pub.pem"):
            key = serialization.load_pem_private_key(path.read_bytes(), None)
            assert isinstance(key, Ed25519PrivateKey)
            raw = key.private_bytes(
                serialization.Encoding.Raw,
                serialization.PrivateFormat.Raw,
                serialization.NoEncryption(),
            )
            found += _forms(raw)
            found += [line for line in path.read_text().splitlines() if "-----" not in line]
    assert len(found) >= 3 * 6  # a signing, a data and an event key at least
    return found


def _leaks(texts: Iterable[str], secrets: Iterable[str]) -> list[str]:
    joined = "\n".join(texts)
    return [secret for secret in secrets if secret in joined]


async def _publish(url: str, prefix: str, values: list[tuple[str, bytes]]) -> None:
    async with open_bus(BusConfig(url=url, prefix=prefix)) as bus:
        for key, value in values:
            await bus.publish("events", key, value)


def _wait_for(path: Path, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text():
        assert time.monotonic() < deadline, f"{text!r} not in {path}:\n{path.read_text()}"
        time.sleep(0.1)


def test_keys_and_passwords_stay_out_of_every_output(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys_dir = tmp_path / "keys"
    outputs: dict[str, str] = {}
    code, outputs["keys init"] = _run(["keys", "init", "--keys", str(keys_dir), "--job", "j"], {})
    assert code == 0, outputs["keys init"]
    code, outputs["keys show"] = _run(["keys", "show", "--keys", str(keys_dir)], {})
    assert code == 0, outputs["keys show"]
    secrets = [*_secrets(keys_dir), PASSWORD]
    store = KeyStore(keys_dir)
    daemon_keys = store.load_daemon_keys()
    current = daemon_keys.current_event_key("j")
    assert current is not None
    kid, event_key = current
    assert _leaks([repr(event_key)], secrets)  # the search finds a key where one is shown

    # The daemon, with keys and a SASL password, refusing a forged and taking a valid event.
    url, prefix = f"sqlite://{tmp_path / 'bus.db'}", "nosecret."
    log = tmp_path / "daemon.log"
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env = {**base, **_sasl_env(), "TRAINGUARD_KEYS": str(keys_dir)}
    daemon = start_daemon(url, prefix=prefix, log_path=log, args=["--require-auth"], env=env)
    try:
        _wait_for(log, '"daemon ready"')
        event = Sim(world_size=1, job_id="j").lifecycle(0, "started", 0, world_size=1).event
        forged = encode(add_mac(event, kid, b"\x00" * 32))
        asyncio.run(
            _publish(url, prefix, [("j", forged), ("j", encode(add_mac(event, kid, event_key)))])
        )
        _wait_for(log, '"input rejected"')
        _wait_for(log, '"transition"')
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        assert daemon.wait(30) == 0, log.read_text()
    outputs["daemon"] = log.read_text()

    # An agent holding the job's event key and the daemon's public keys.
    public = tmp_path / "daemon-public.pem"
    public.write_text(outputs["keys show"][outputs["keys show"].index("-----BEGIN") :])
    agent_env = {
        **_sasl_env(),
        "TRAINGUARD_JOB": "j",
        "TRAINGUARD_BUS": url,
        "TRAINGUARD_TOPIC_PREFIX": prefix,
        "TRAINGUARD_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "TRAINGUARD_EVENT_KEY": f"{kid}:{base64.b64encode(event_key).decode()}",
        "TRAINGUARD_DAEMON_PUBLIC_KEYS": str(public),
    }
    config = AgentConfig.resolve(env=agent_env, heartbeat_interval_s=0.05)
    agent = Agent(config)
    with capture_logs() as logs, agent:
        agent.ready(0)
        agent.step(1, loss=1.0)
        stats = agent.stats
    outputs["agent"] = repr(logs) + caplog.text + repr(stats)
    outputs["reprs"] = "\n".join(
        f"{shown!r} {shown}"
        for shown in (daemon_keys, agent_keys_from_env(agent_env), config, config.keys, store)
    )
    for name, text in outputs.items():
        assert _leaks([text], secrets) == [], f"a secret appears in the {name} output"
