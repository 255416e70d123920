"""Bitwise restores beyond two ranks (issue 12, item 10): the charlm job on 3 and 4 ranks, a
rank SIGKILLed after a commit, the job restarted from the committed step, ends with parameters
bitwise equal to an uninterrupted run's and an exact sample ledger.

With DDP's own all-reduce it did not: a restarted process runs its first step with DDP's
construction-time bucket layout, where the uninterrupted run had rebuilt its buckets after its
first step, so every gradient element was summed in another order; with 3 or more ranks
floating-point sums depend on the order (``docs/bitwise.md``). charlm averages with
``trainguard.agent.ordered_allreduce``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.scenarios.harness import JobRun, Shape, assert_exact, only, shared_reference
from tests.support.buses import BusFactory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SHAPES = {size: Shape(steps=80, checkpoint_every=20, seed=5, world_size=size) for size in (3, 4)}
KILL_STEP = 50
"""After the commit of step 40, before the next: the restart restores step 40 and replays 10
steps, the first of them with the construction-time bucket layout."""


@pytest.fixture
def sized_run(
    size: int, bus_factory: BusFactory, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[JobRun]:
    # The uninterrupted run of the size's shape, once per test run (the sizes' tests may run
    # on different xdist workers).
    reference = shared_reference(tmp_path_factory.getbasetemp(), SHAPES[size])
    run = JobRun(bus_factory, tmp_path, SHAPES[size], reference)
    try:
        yield run
    finally:
        run.close()


# The bus plays no part in the summation order: each world size runs on one of them.
@pytest.mark.parametrize(
    ("size", "bus_factory"),
    [
        pytest.param(3, "sqlite", id="3-ranks-sqlite"),
        pytest.param(4, "kafka", id="4-ranks-kafka", marks=pytest.mark.kafka),
    ],
    indirect=["bus_factory"],
)
def test_a_kill_restored_by_a_restart_is_bitwise_exact_on_more_than_two_ranks(
    sized_run: JobRun,
) -> None:
    last = sized_run.shape.world_size - 1
    faults = f"kill@step={KILL_STEP},rank={last}"
    sized_run.context = f"{sized_run.shape.world_size} ranks, {faults}"
    sized_run.start_daemon()
    sized_run.start_job(faults)
    code = sized_run.finish(timeout_s=600)
    record = sized_run.record()

    restore = only(record.restores(), "restore", sized_run)
    assert (restore.mode, restore.generation) == ("restart", 1), sized_run.describe()
    target = restore.target
    assert target is not None, sized_run.describe()
    assert target.step == 40, f"target {target} {sized_run.describe()}"
    assert_exact(sized_run, code, record)
