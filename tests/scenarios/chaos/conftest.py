"""Fixtures of the chaos tests: a Kafka broker of this folder's own that the tests pause and
restart (never the session broker other tests share), started once for both modules, and a bus
on it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.scenarios.chaos.chaos import ChaosBroker, bus_on, wait_for_coordinators
from tests.support.buses import BusFactory
from tests.support.kafka_dev import dev_broker

#: Brokers of the chaos tests (started together): the tests use the first.
BROKERS = 1


@pytest.fixture(scope="package")
def chaos_brokers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ChaosBroker]]:
    """:data:`BROKERS` brokers, each started by ``kafka-dev`` in a tmp folder of its own, all
    at once (a broker's start is mostly its JVM waiting), and stopped after the last chaos
    test, each with its coordinators ready (:func:`wait_for_coordinators`). A test that paused or stopped one leaves it running again (``broker_restored``).
    Without java/mvn they are skipped, under ``CI=true`` failed."""
    dirs = [tmp_path_factory.mktemp("chaos-kafka") for _ in range(BROKERS)]
    starts = [dev_broker(d, what="chaos Kafka broker") for d in dirs]
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(BROKERS) as pool:
        started = [pool.submit(start.__enter__) for start in starts]
        for start, future in zip(starts, started, strict=True):
            if future.exception() is None:  # waits; a started broker is stopped at the end
                stack.push(start.__exit__)
        brokers = [ChaosBroker(d, f.result()) for d, f in zip(dirs, started, strict=True)]
        for broker in brokers:
            wait_for_coordinators(broker.bootstrap)
        try:
            yield brokers
        finally:
            for broker in brokers:
                if broker.paused:
                    broker.resume()  # kafka-dev stop cannot stop a stopped JVM in time otherwise


@pytest.fixture
def chaos_broker(chaos_brokers: list[ChaosBroker]) -> ChaosBroker:
    """The first chaos broker."""
    return chaos_brokers[0]


@pytest.fixture
def chaos_bus(chaos_broker: ChaosBroker) -> BusFactory:
    """A fresh topic prefix on the first chaos broker."""
    return bus_on(chaos_broker)
