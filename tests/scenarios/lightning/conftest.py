"""Fixtures of the Lightning scenarios (:mod:`tests.scenarios.lightning.job`); the launcher
scenarios import them too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.scenarios.harness import JobRun
from tests.scenarios.lightning.job import JOB, SHAPE, reference
from tests.support.buses import BusFactory


@pytest.fixture(scope="session")
def lightning_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Output folder of the uninterrupted run of :data:`SHAPE`, which every Lightning
    scenario's outcome is compared with."""
    return reference(tmp_path_factory.getbasetemp())


@pytest.fixture
def lit_run(bus_factory: BusFactory, tmp_path: Path, lightning_reference: Path) -> Iterator[JobRun]:
    """A :class:`JobRun` of :data:`SHAPE` (job ``lit-scenario``) on a fresh bus; every process
    it started is stopped afterwards."""
    run = JobRun(bus_factory, tmp_path, SHAPE, lightning_reference, job=JOB)
    try:
        yield run
    finally:
        run.close()
