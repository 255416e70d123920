"""Every trainguard party on a Kafka broker that requires SASL/SCRAM-SHA-512.

The module starts its own broker (``kafka-dev start --scram``, its own port and directory) and
stops it at the end. With the right credentials, given only as ``TRAINGUARD_KAFKA_*``
variables, ``bus check``, the daemon, the supervisor (``trainguard run``) and the agent in the
worker it starts all work, and ``replay`` verifies what the daemon decided. A wrong password
ends ``bus check`` and the daemon with an error that says so, long before their connect
timeout; the agent keeps training and reports the refusal. No password ever shows in any
output of any of them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import pytest
from structlog.testing import capture_logs

from tests.support.kafka_dev import dev_broker
from trainguard.agent import Agent, AgentConfig
from trainguard.daemon.demo._harness import start_daemon, supervise

pytestmark = pytest.mark.kafka

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]
USER = "trainguard-test"
# Seconds for one run of the job.
JOB_TIMEOUT_S = 120.0
# The connect timeout the wrong-password runs are given; they must end well before it.
CONNECT_TIMEOUT_S = 30.0

WORKER = textwrap.dedent(
    """
    import time
    from trainguard.agent import Agent, AgentConfig

    with Agent(AgentConfig.resolve(heartbeat_interval_s=0.2)) as agent:
        agent.restore_target()
        agent.ready(0)
        for step in range(1, 21):
            agent.step(step, loss=1.0, samples=4)
            time.sleep(0.05)
    """
)


class ScramBroker(NamedTuple):
    """A running SCRAM broker: its ``kafka://`` URL, the user's password, and the run dir."""

    url: str
    password: str
    run_dir: Path


def _scram_client(password: str) -> dict[str, str]:
    """``AIOKafkaAdminClient`` options that authenticate as :data:`USER`."""
    return {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": USER,
        "sasl_plain_password": password,
    }


@pytest.fixture(scope="module")
def scram_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScramBroker]:
    """A KRaft broker whose only client listener requires SCRAM-SHA-512 as :data:`USER`."""
    run_dir = tmp_path_factory.mktemp("kafka-scram")
    # Characters that need escaping in Java properties, JAAS and kafka-storage's parser.
    password = f'pw-{uuid.uuid4().hex},=]"\\é'
    with dev_broker(
        run_dir,
        "--scram",
        f"{USER}:{password}",
        what="SCRAM broker",
        **_scram_client(password),
    ) as bootstrap:
        yield ScramBroker(f"kafka://{bootstrap}", password, run_dir)


def _environment(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without any ``TRAINGUARD_*`` variable, plus ``extra``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    return {**base, **extra}


def _sasl_variables(password_file: Path) -> dict[str, str]:
    return {
        "TRAINGUARD_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "TRAINGUARD_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "TRAINGUARD_KAFKA_SASL_USERNAME": USER,
        "TRAINGUARD_KAFKA_SASL_PASSWORD_FILE": str(password_file),
    }


def _cli(args: list[str], env: Mapping[str, str], timeout: float = 90.0) -> tuple[int, str, float]:
    """Run ``trainguard ARGS``; return its exit code, stdout+stderr and duration (seconds)."""
    began = time.monotonic()
    done = subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=dict(env), timeout=timeout, check=False
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - began


def _stop(process: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    """SIGTERM ``process`` (its whole session), SIGKILL after ``timeout`` seconds."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    return process.wait()


def test_every_party_works_with_the_right_credentials(
    scram_broker: ScramBroker, tmp_path: Path
) -> None:
    password_file = tmp_path / "kafka-password"
    password_file.write_text(scram_broker.password + "\n")
    prefix = f"t-{uuid.uuid4().hex[:8]}."
    job = "sasl-job"
    env = _environment(
        {**_sasl_variables(password_file), "TRAINGUARD_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    )
    outputs: dict[str, str] = {}

    code, outputs["bus check"], _ = _cli(["bus", "check", "--bus", scram_broker.url], env)
    assert code == 0, outputs["bus check"]
    assert "dead-letter" in outputs["bus check"]

    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    daemon_log, run_log = tmp_path / "daemon.log", tmp_path / "run.log"
    daemon = start_daemon(scram_broker.url, prefix=prefix, log_path=daemon_log, env=env)
    try:
        supervisor = supervise(
            job,
            [sys.executable, str(worker)],
            bus_url=scram_broker.url,
            prefix=prefix,
            nproc_per_node=1,
            log_path=run_log,
            env=env,
        )
        try:
            assert supervisor.wait(JOB_TIMEOUT_S) == 0, run_log.read_text()
        finally:
            _stop(supervisor)
        # The daemon audits the job's finish; replay checks every recorded decision.
        deadline = time.monotonic() + 60
        while True:
            code, outputs["replay"], _ = _cli(
                ["replay", job, "--bus", scram_broker.url, "--topic-prefix", prefix], env
            )
            if (code == 0 and "finished" in outputs["replay"]) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert code == 0, outputs["replay"] + daemon_log.read_text()
        assert "finished" in outputs["replay"]
    finally:
        assert _stop(daemon) == 0, daemon_log.read_text()
    outputs["daemon"], outputs["run"] = daemon_log.read_text(), run_log.read_text()
    assert '"daemon stopped"' in outputs["daemon"]
    for name, text in outputs.items():
        assert scram_broker.password not in text, f"the password appears in the {name} output"


def test_a_wrong_password_fails_at_once_and_says_why(
    scram_broker: ScramBroker, tmp_path: Path
) -> None:
    wrong = f"wrong-{uuid.uuid4().hex}"
    env = _environment(
        {
            **_sasl_variables(tmp_path / "unused"),
            "TRAINGUARD_KAFKA_SASL_PASSWORD_FILE": "",
            "TRAINGUARD_KAFKA_SASL_PASSWORD": wrong,
        }
    )
    refused = f"SASL authentication as '{USER}' (SCRAM-SHA-512) refused by the broker"

    code, output, took = _cli(
        ["bus", "check", "--bus", scram_broker.url, "--timeout", str(CONNECT_TIMEOUT_S)], env
    )
    assert code == 2, output
    assert refused in output
    assert took < CONNECT_TIMEOUT_S

    config = tmp_path / "daemon.toml"
    config.write_text(f"[bus]\nconnect_timeout_s = {CONNECT_TIMEOUT_S}\n")
    code, daemon_output, took = _cli(
        ["daemon", "--bus", scram_broker.url, "--config", str(config), "--metrics-port", "-1"], env
    )
    assert code == 2, daemon_output
    assert refused in daemon_output
    assert took < CONNECT_TIMEOUT_S

    # A supervisor waits out an outage, but not credentials the broker refuses (exit 2, as
    # for any bad setting: a Kubernetes Job ends instead of retrying a pod that cannot work).
    code, run_output, took = _cli(
        ["run", "--job", "refused-job", "--bus", scram_broker.url, "--daemon-timeout", "0",
         "--", sys.executable, "-c", "pass"],
        env,
    )  # fmt: skip
    assert code == 2, run_output
    assert refused in run_output

    for text in (output, daemon_output, run_output):
        assert wrong not in text
        assert scram_broker.password not in text


def test_an_agent_with_a_wrong_password_trains_on_and_reports_the_refusal(
    scram_broker: ScramBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = f"wrong-{uuid.uuid4().hex}"
    env = {
        **_sasl_variables(tmp_path / "unused"),
        "TRAINGUARD_KAFKA_SASL_PASSWORD_FILE": "",
        "TRAINGUARD_KAFKA_SASL_PASSWORD": wrong,
        "TRAINGUARD_BUS": scram_broker.url,
        "TRAINGUARD_JOB": "refused-job",
        "TRAINGUARD_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
    }
    with capture_logs() as logs:
        agent = Agent(AgentConfig.resolve(env=env, heartbeat_interval_s=0.05))
        began = time.monotonic()
        with agent:
            agent.ready(0)
            for step in range(1, 11):
                agent.step(step, loss=1.0)
            stepped = time.monotonic() - began
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            while agent.stats.last_error is None and time.monotonic() < deadline:
                time.sleep(0.05)
            stats = agent.stats
            agent.close(timeout_s=2.0)
    assert stepped < 1.0  # training never waits for the bus
    assert not stats.connected
    assert stats.last_error is not None
    assert "SASL authentication as 'trainguard-test' (SCRAM-SHA-512) refused" in stats.last_error
    troubles = [entry for entry in logs if entry["event"] == "bus_trouble"]
    assert troubles
    assert "refused by the broker" in troubles[0]["error"]
    captured = repr(logs) + caplog.text
    assert wrong not in captured
    assert scram_broker.password not in captured
