"""Fixtures of the chaos tests: a Kafka broker per test module that the tests pause and restart
(never the session broker other tests share), a bus on it, and the reference runs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.buses import BusFactory
from tests.chaos.chaos import ChaosBroker
from tests.kafka_dev import dev_broker


@pytest.fixture(scope="module")
def chaos_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosBroker]:
    """A broker of this module's own, started by ``kafka-dev`` in a tmp folder and stopped
    at the module's end. A test that paused or stopped it leaves it running again
    (``broker_restored``). Without java/mvn it is skipped, under ``CI=true`` failed."""
    run_dir = tmp_path_factory.mktemp("chaos-kafka")
    with dev_broker(run_dir, what="chaos Kafka broker") as bootstrap:
        broker = ChaosBroker(run_dir, bootstrap)
        try:
            yield broker
        finally:
            if broker.paused:
                broker.resume()  # kafka-dev stop cannot stop a stopped JVM in time otherwise


@pytest.fixture
def chaos_bus(chaos_broker: ChaosBroker) -> BusFactory:
    """A fresh topic prefix on the module's broker."""
    return BusFactory("kafka", f"kafka://{chaos_broker.bootstrap}", f"c-{uuid.uuid4().hex[:8]}.")
