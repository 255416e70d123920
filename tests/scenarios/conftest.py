"""Fixtures of the scenario tests: the shared reference run and one job run per test and bus."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.scenarios.harness import JobRun, Shape, shared_reference
from tests.support.buses import BusFactory

SHAPE = Shape()


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Output folder of the uninterrupted run of :data:`SHAPE` (run once per test run, no
    daemon needed), which every scenario's outcome is compared with."""
    return shared_reference(tmp_path_factory.getbasetemp(), SHAPE)


@pytest.fixture
def job_run(bus_factory: BusFactory, tmp_path: Path, reference: Path) -> Iterator[JobRun]:
    """A :class:`JobRun` of :data:`SHAPE` on a fresh bus of each kind (``bus_factory``: SQLite,
    and Kafka marked ``kafka``); every process it started is stopped afterwards."""
    run = JobRun(bus_factory, tmp_path, SHAPE, reference)
    try:
        yield run
    finally:
        run.close()
