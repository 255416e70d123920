"""Fixtures of the scenario tests: the shared reference run and one job run per test and bus."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.scenarios.harness import REPO, WORLD_SIZE, JobRun, Shape
from tests.support.buses import BusFactory
from trainguard.daemon.demo._harness import reference_run

SHAPE = Shape()


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Output folder of the uninterrupted run of :data:`SHAPE` (run once per session, no
    daemon needed), which every scenario's outcome is compared with."""
    return reference_run(
        REPO,
        tmp_path_factory.mktemp("reference"),
        steps=SHAPE.steps,
        checkpoint_every=SHAPE.checkpoint_every,
        seed=SHAPE.seed,
        world_size=WORLD_SIZE,
    )


@pytest.fixture
def job_run(bus_factory: BusFactory, tmp_path: Path, reference: Path) -> Iterator[JobRun]:
    """A :class:`JobRun` of :data:`SHAPE` on a fresh bus of each kind (``bus_factory``: SQLite,
    and Kafka marked ``kafka``); every process it started is stopped afterwards."""
    run = JobRun(bus_factory, tmp_path, SHAPE, reference)
    try:
        yield run
    finally:
        run.close()
