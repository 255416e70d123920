"""Shared pytest fixtures: one Kafka broker per session, unique topic prefixes, a Kafka tally.

Kafka tests carry ``@pytest.mark.kafka`` and take the ``kafka_bootstrap`` fixture. The broker is
``$TRAINGUARD_KAFKA`` (``host:port``) when set, else a real broker started for the session by
``deploy/kafka/kafka-dev`` in a session tmp dir. Without java/mvn, or when the start fails, Kafka
tests are skipped, except under ``CI=true``, where they fail: in CI a Kafka test never silently
skips. The terminal summary counts the kafka-marked outcomes so CI logs show they ran.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from tests.buses import BusFactory

KAFKA_DEV = Path(__file__).resolve().parent.parent / "deploy" / "kafka" / "kafka-dev"
# Seconds for kafka-dev to see the broker ready once its JVM runs (measured: about 4-7 s here).
BROKER_START_TIMEOUT_S = 120.0
# Seconds for the whole `kafka-dev start`, a cold Maven fetch included (measured: 7-9 s).
KAFKA_DEV_TIMEOUT_S = 600.0
# Seconds for describe_cluster() to succeed against the started or given broker.
CLUSTER_READY_TIMEOUT_S = 60.0
# Seconds for the controlled shutdown before kafka-dev sends SIGKILL (measured: under 1 s).
KAFKA_DEV_STOP_TIMEOUT_S = 30.0

_BROKER_LABEL = pytest.StashKey[str]()


def _unavailable(reason: str) -> NoReturn:
    """Skip the requesting test, or fail it under ``CI=true``."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"Kafka broker unavailable (CI=true, so not skipping): {reason}", pytrace=False)
    pytest.skip(f"Kafka broker unavailable: {reason}")


async def _describe_cluster(bootstrap: str) -> None:
    """One bounded ``describe_cluster()`` round trip to ``bootstrap``.

    Raises:
        KafkaError, OSError, TimeoutError: the broker did not answer within 10 s.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    # aiokafka can hang on a dead broker (aio-libs/aiokafka#1101): bound start and close.
    try:
        async with asyncio.timeout(10):
            await admin.start()
            await admin.describe_cluster()
    finally:
        async with asyncio.timeout(10):
            await admin.close()


def _wait_for_cluster(bootstrap: str, timeout: float) -> None:
    """Retry ``describe_cluster()`` on ``bootstrap`` every 0.5 s until it answers.

    An open port alone does not mean the broker serves requests (kafka-notes.md 1.4).

    Raises:
        TimeoutError: no successful answer within ``timeout`` seconds; names the last error.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            asyncio.run(_describe_cluster(bootstrap))
            return
        except (KafkaError, OSError, TimeoutError) as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{bootstrap} did not answer in {timeout:g} s: {exc!r}") from exc
        time.sleep(0.5)


def _kafka_dev(*args: str | Path, timeout: float) -> subprocess.CompletedProcess[str]:
    # The venv's interpreter runs the stdlib-only script; no dependence on a `python3` on PATH.
    command = [sys.executable, str(KAFKA_DEV), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="session")
def kafka_bootstrap(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[str]:
    """Bootstrap address (``"host:port"``) of a Kafka broker shared by the whole session.

    ``$TRAINGUARD_KAFKA`` wins and is used as is (nothing is started; a broker that does not
    answer fails the tests). Otherwise ``kafka-dev start --port 0`` starts a KRaft broker in a
    session tmp dir and ``kafka-dev stop`` ends it at session end; its log is ``kafka.log`` there.
    Share it between tests through ``unique_prefix`` topic and group names.
    """
    given = os.environ.get("TRAINGUARD_KAFKA")
    if given:
        try:
            _wait_for_cluster(given, CLUSTER_READY_TIMEOUT_S)
        except TimeoutError as exc:
            pytest.fail(f"TRAINGUARD_KAFKA={given}: {exc}", pytrace=False)
        pytestconfig.stash[_BROKER_LABEL] = f"{given} (TRAINGUARD_KAFKA)"
        yield given
        return

    run_dir = tmp_path_factory.mktemp("kafka")
    try:
        try:
            started = _kafka_dev(
                "start",
                "--port",
                "0",
                "--dir",
                run_dir,
                "--timeout",
                str(BROKER_START_TIMEOUT_S),
                timeout=KAFKA_DEV_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            _unavailable(f"kafka-dev start took more than {KAFKA_DEV_TIMEOUT_S:g} s")
        if started.returncode != 0:
            _unavailable(started.stderr.strip() or f"kafka-dev start exited {started.returncode}")
        bootstrap = started.stdout.strip()
        try:
            _wait_for_cluster(bootstrap, CLUSTER_READY_TIMEOUT_S)
        except TimeoutError as exc:
            _unavailable(f"{exc} (log: {run_dir / 'kafka.log'})")
        pytestconfig.stash[_BROKER_LABEL] = f"{bootstrap} (kafka-dev, log {run_dir / 'kafka.log'})"
        yield bootstrap
    finally:
        # Also after a failed or timed-out start, which may leave a JVM behind.
        stop_s = str(KAFKA_DEV_STOP_TIMEOUT_S)
        _kafka_dev(
            "stop", "--dir", run_dir, "--timeout", stop_s, timeout=KAFKA_DEV_STOP_TIMEOUT_S + 30
        )


@pytest.fixture
def anyio_backend() -> str:
    """aiokafka runs on asyncio only, so async tests do too."""
    return "asyncio"


@pytest.fixture(
    params=[pytest.param("sqlite"), pytest.param("kafka", marks=pytest.mark.kafka)],
)
def bus_factory(request: pytest.FixtureRequest, tmp_path: Path) -> BusFactory:
    """A :class:`BusFactory` for a fresh bus of each adapter: a SQLite file in ``tmp_path``, or
    the session's Kafka broker with a topic prefix unique to the test."""
    if request.param == "sqlite":
        return BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "t.")
    bootstrap: str = request.getfixturevalue("kafka_bootstrap")
    prefix: str = request.getfixturevalue("unique_prefix")
    return BusFactory("kafka", f"kafka://{bootstrap}", prefix)


@pytest.fixture
def unique_prefix() -> str:
    """A fresh topic/group name prefix such as ``"t-1a2b3c4d."``, so tests share one broker."""
    return f"t-{uuid.uuid4().hex[:8]}."


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    """Print how many ``kafka``-marked tests passed, failed, were skipped or errored, and where."""
    outcomes: Counter[str] = Counter()
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if isinstance(report, pytest.TestReport) and "kafka" in report.keywords:
                outcomes[outcome] += 1
    if not outcomes:
        return
    terminalreporter.write_sep("-", "kafka")
    terminalreporter.write_line(
        f"kafka-marked tests: {outcomes['passed']} passed, {outcomes['failed']} failed, "
        f"{outcomes['skipped']} skipped, {outcomes['error']} errors"
    )
    terminalreporter.write_line(
        f"kafka broker: {config.stash.get(_BROKER_LABEL, 'none (not started)')}"
    )
