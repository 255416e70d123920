"""A development Kafka broker for tests: started by the project's own ``deploy/kafka/kafka-dev``
(fetched from Maven Central), waited for until it serves requests, stopped afterwards.

Used by the session broker of ``tests/conftest.py`` and by the SASL/SCRAM broker of
``tests/contract/bus/test_kafka_sasl.py``. A broker that cannot start skips the test that needs it,
except under ``CI=true``, where it fails it: in CI a Kafka test never silently skips.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from tests.support.dev_servers import unavailable

KAFKA_DEV = Path(__file__).resolve().parents[2] / "deploy" / "kafka" / "kafka-dev"
# Seconds for kafka-dev to see the broker ready once its JVM runs (measured: about 4-7 s here).
BROKER_START_TIMEOUT_S = 120.0
# Seconds for the whole `kafka-dev start`, a cold Maven fetch included (measured: 7-9 s).
KAFKA_DEV_TIMEOUT_S = 600.0
# Seconds for a request to succeed against the started or given broker.
CLUSTER_READY_TIMEOUT_S = 60.0
# Seconds for the controlled shutdown before kafka-dev sends SIGKILL (measured: under 1 s).
KAFKA_DEV_STOP_TIMEOUT_S = 30.0


def kafka_dev(*args: str | Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``kafka-dev ARGS`` with this interpreter (the script needs only the standard
    library; no dependence on a ``python3`` on PATH), at most ``timeout`` seconds."""
    command = [sys.executable, str(KAFKA_DEV), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


async def _describe_cluster(bootstrap: str, client: Mapping[str, Any]) -> None:
    """One bounded ``describe_cluster()`` round trip to ``bootstrap``.

    Raises:
        KafkaError, OSError, TimeoutError: the broker did not answer within 10 s.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000, **client)
    # aiokafka can hang on a dead broker (aio-libs/aiokafka#1101): bound start and close.
    try:
        async with asyncio.timeout(10):
            await admin.start()
            await admin.describe_cluster()
    finally:
        async with asyncio.timeout(10):
            await admin.close()


def wait_for_cluster(bootstrap: str, timeout: float, **client: Any) -> None:
    """Retry ``describe_cluster()`` on ``bootstrap`` every 0.5 s until it answers.

    An open port alone does not mean the broker serves requests (kafka-notes.md 1.4).

    Args:
        bootstrap: ``host:port``.
        timeout: seconds.
        client: further ``AIOKafkaAdminClient`` options (SASL credentials).

    Raises:
        TimeoutError: no successful answer within ``timeout`` seconds; names the last error.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            asyncio.run(_describe_cluster(bootstrap, client))
            return
        except (KafkaError, OSError, TimeoutError) as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{bootstrap} did not answer in {timeout:g} s: {exc!r}") from exc
        time.sleep(0.5)


@contextmanager
def dev_broker(
    run_dir: Path, *options: str, what: str = "Kafka broker", **client: Any
) -> Iterator[str]:
    """A KRaft broker started by ``kafka-dev start --port 0 --dir RUN_DIR OPTIONS``, yielding
    its ``host:port`` once a ``describe_cluster()`` with ``client`` options succeeds, and
    stopped on exit (also after a failed start, which may leave a JVM behind). Its log is
    ``RUN_DIR/kafka.log``. A start that fails or times out: :func:`unavailable`."""
    try:
        try:
            started = kafka_dev(
                "start",
                "--port",
                "0",
                "--dir",
                run_dir,
                "--timeout",
                str(BROKER_START_TIMEOUT_S),
                *options,
                timeout=KAFKA_DEV_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            unavailable(what, f"kafka-dev start took more than {KAFKA_DEV_TIMEOUT_S:g} s")
        if started.returncode != 0:
            unavailable(
                what, started.stderr.strip() or f"kafka-dev start exited {started.returncode}"
            )
        bootstrap = started.stdout.strip()
        try:
            wait_for_cluster(bootstrap, CLUSTER_READY_TIMEOUT_S, **client)
        except TimeoutError as exc:
            unavailable(what, f"{exc} (log: {run_dir / 'kafka.log'})")
        yield bootstrap
    finally:
        stop_s = str(KAFKA_DEV_STOP_TIMEOUT_S)
        kafka_dev(
            "stop", "--dir", run_dir, "--timeout", stop_s, timeout=KAFKA_DEV_STOP_TIMEOUT_S + 30
        )
