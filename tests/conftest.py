"""Shared pytest fixtures: one Kafka broker per session, unique topic prefixes, a Kafka tally.

Kafka tests carry ``@pytest.mark.kafka`` and take the ``kafka_bootstrap`` fixture. The broker is
``$TRAINGUARD_KAFKA`` (``host:port``) when set, else a real broker started for the session by
``deploy/kafka/kafka-dev`` in a session tmp dir. Without java/mvn, or when the start fails, Kafka
tests are skipped, except under ``CI=true``, where they fail: in CI a Kafka test never silently
skips. The terminal summary counts the kafka-marked outcomes so CI logs show they ran.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.buses import BusFactory
from tests.support.kafka_dev import CLUSTER_READY_TIMEOUT_S, dev_broker, wait_for_cluster

_BROKER_LABEL = pytest.StashKey[str]()


@pytest.fixture(scope="session", autouse=True)
def _state_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Per-user state (the default embedded bus, supervisors' node locks) in a session tmp dir,
    not the home folder of whoever runs the suite; a test may point ``XDG_STATE_HOME``
    elsewhere for itself."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
        yield


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
            wait_for_cluster(given, CLUSTER_READY_TIMEOUT_S)
        except TimeoutError as exc:
            pytest.fail(f"TRAINGUARD_KAFKA={given}: {exc}", pytrace=False)
        pytestconfig.stash[_BROKER_LABEL] = f"{given} (TRAINGUARD_KAFKA)"
        yield given
        return

    run_dir = tmp_path_factory.mktemp("kafka")
    with dev_broker(run_dir) as bootstrap:
        pytestconfig.stash[_BROKER_LABEL] = f"{bootstrap} (kafka-dev, log {run_dir / 'kafka.log'})"
        yield bootstrap


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
