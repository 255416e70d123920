"""Shared pytest fixtures: one Kafka broker and one S3 server per test run, unique topic
prefixes and buckets, a Kafka and an S3 tally.

Kafka tests carry ``@pytest.mark.kafka`` and take the ``kafka_bootstrap`` fixture. The broker is
``$TRAINGUARD_KAFKA`` (``host:port``) when set, else a real broker started for the session by
``deploy/kafka/kafka-dev`` in a session tmp dir. S3 tests carry ``@pytest.mark.s3`` and take
``s3_endpoint``, ``s3_env`` or ``s3_bucket``: the server is ``$TRAINGUARD_S3``
(``http://host:port``, with s3-dev's credentials) when set, else a real S3Proxy started for the
session by ``deploy/s3/s3-dev``. Without java/mvn, or when a start fails, those tests are
skipped, except under ``CI=true``, where they fail: in CI they never silently skip. The terminal
summary counts the kafka- and s3-marked outcomes so CI logs show they ran.

Under pytest-xdist the controller starts the broker and the server once, before the workers,
and hands them to every worker through those two variables (:func:`pytest_configure`): each
worker is a session of its own and would otherwise start two JVMs of its own, about a minute of
CPU per run that a 2-core machine takes from the tests. If the controller's start fails, each
worker starts its own as above.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.buses import BusFactory
from tests.support.kafka_dev import CLUSTER_READY_TIMEOUT_S, dev_broker, wait_for_cluster
from tests.support.s3_dev import (
    SERVER_READY_TIMEOUT_S,
    S3Endpoint,
    dev_server,
    s3_environment,
    wait_for_server,
)

_BROKER_LABEL = pytest.StashKey[str]()
_S3_LABEL = pytest.StashKey[str]()
_SHARED_SERVERS = pytest.StashKey[contextlib.ExitStack]()


def pytest_configure(config: pytest.Config) -> None:
    """In the controller of a pytest-xdist run: start the Kafka broker and the S3 server for
    all workers, side by side, unless ``$TRAINGUARD_KAFKA`` / ``$TRAINGUARD_S3`` name them,
    and export their addresses in those variables, which the workers inherit."""
    if not config.getoption("numprocesses", None) or hasattr(config, "workerinput"):
        return
    folder = Path(tempfile.mkdtemp(prefix="trainguard-test-servers-"))
    stack = contextlib.ExitStack()
    stack.callback(shutil.rmtree, folder, ignore_errors=True)
    config.stash[_SHARED_SERVERS] = stack
    servers: list[tuple[str, str, pytest.StashKey[str], Callable[[], Any]]] = []
    if not os.environ.get("TRAINGUARD_KAFKA"):
        servers.append(
            ("TRAINGUARD_KAFKA", "kafka", _BROKER_LABEL, lambda: dev_broker(folder / "kafka"))
        )
    if not os.environ.get("TRAINGUARD_S3"):
        servers.append(("TRAINGUARD_S3", "s3", _S3_LABEL, lambda: dev_server(folder / "s3")))

    def start(make: Callable[[], Any]) -> tuple[Any, Any]:
        manager = make()  # the run folders are made by kafka-dev and s3-dev
        return manager, manager.__enter__()

    with ThreadPoolExecutor(len(servers) or 1) as pool:
        started = [(server, pool.submit(start, server[3])) for server in servers]
    for (variable, name, label, _), future in started:
        try:
            manager, value = future.result()
        except (Exception, pytest.skip.Exception, pytest.fail.Exception) as exc:
            # Each worker starts its own, and skips or fails its tests as it would alone.
            print(f"conftest: the shared {name} server did not start ({exc}); one per worker")
            continue
        stack.push(manager.__exit__)
        address = value if isinstance(value, str) else value.endpoint_url
        os.environ[variable] = address
        stack.callback(os.environ.pop, variable, None)
        config.stash[label] = f"{address} (started once for all xdist workers, in {folder / name})"


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop what :func:`pytest_configure` started."""
    stack = config.stash.get(_SHARED_SERVERS, None)
    if stack is not None:
        stack.close()


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


@pytest.fixture(scope="session")
def s3_endpoint(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[S3Endpoint]:
    """The S3 server shared by the whole session, with its credentials.

    ``$TRAINGUARD_S3`` (``http://host:port``) wins and is used as is with s3-dev's dev
    credentials (nothing is started; a server that does not answer fails the tests). Otherwise
    ``s3-dev start --port 0`` starts S3Proxy in a session tmp dir and ``s3-dev stop`` ends it at
    session end; its log is ``s3proxy.log`` there. Share it between tests through ``s3_bucket``.
    """
    given = os.environ.get("TRAINGUARD_S3")
    if given:
        endpoint = S3Endpoint(given.rstrip("/"))
        try:
            wait_for_server(endpoint, SERVER_READY_TIMEOUT_S)
        except TimeoutError as exc:
            pytest.fail(f"TRAINGUARD_S3={given}: {exc}", pytrace=False)
        pytestconfig.stash[_S3_LABEL] = f"{endpoint.endpoint_url} (TRAINGUARD_S3)"
        yield endpoint
        return

    run_dir = tmp_path_factory.mktemp("s3")
    with dev_server(run_dir) as endpoint:
        label = f"{endpoint.endpoint_url} (s3-dev, log {run_dir / 's3proxy.log'})"
        pytestconfig.stash[_S3_LABEL] = label
        yield endpoint


@pytest.fixture
def s3_env(s3_endpoint: S3Endpoint) -> Iterator[S3Endpoint]:
    """The session's S3 server, with its AWS variables in ``os.environ`` for the test, so
    ``fsspec.filesystem("s3")`` and any botocore client use it (:func:`s3_environment`)."""
    with s3_environment(s3_endpoint):
        yield s3_endpoint


@pytest.fixture
def s3_bucket(s3_env: S3Endpoint) -> str:
    """A bucket of its own on the session's S3 server (``"t-1a2b3c4d5e6f"``), with ``s3_env``
    in effect; it is not deleted afterwards."""
    return s3_env.create_bucket()


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
    """Print how many ``kafka``- and ``s3``-marked tests passed, failed, were skipped or
    errored, and which broker and server they used."""
    servers = (("kafka", "kafka broker", _BROKER_LABEL), ("s3", "s3 server", _S3_LABEL))
    for marker, server, label in servers:
        outcomes: Counter[str] = Counter()
        for outcome in ("passed", "failed", "skipped", "error"):
            for report in terminalreporter.stats.get(outcome, []):
                if isinstance(report, pytest.TestReport) and marker in report.keywords:
                    outcomes[outcome] += 1
        if not outcomes:
            continue
        terminalreporter.write_sep("-", marker)
        terminalreporter.write_line(
            f"{marker}-marked tests: {outcomes['passed']} passed, {outcomes['failed']} failed, "
            f"{outcomes['skipped']} skipped, {outcomes['error']} errors"
        )
        # Under xdist each worker started its own, in its own session tmp dir.
        started = "one per xdist worker" if config.getoption("numprocesses", None) else "none"
        terminalreporter.write_line(f"{server}: {config.stash.get(label, started)}")
