"""A real 2-rank charlm job (DDP, gloo, CPU) under ``trainguard run --batch-heartbeats`` on the
embedded bus: its heartbeats reach the bus only as ``heartbeat-batch`` records of the node's
supervisor, and a worker paused with SIGSTOP (alive, silent) is found by the heartbeat timeout
and restored as without batching: a batch never keeps a silent rank alive. No input is rejected
as a duplicate, although a relayed heartbeat often reaches the bus behind its rank's checkpoint
shard (stale, skipped).

The daemon's heartbeat timeout is 8 s and its progress floor 60 s, so that the paused rank's
silence, not the other rank's stall in the collective it waits in, is what is detected.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.scenarios.conftest import SHAPE
from tests.scenarios.harness import JobRun, assert_exact, only
from tests.support.buses import BusFactory
from trainguard.schemas import Heartbeat, HeartbeatBatch, Lifecycle, Resume

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PACE = "slow@step=1,rank=0,factor=6"
"""About 0.1 s per step for generation 0, so that it runs long enough to be paused."""


@pytest.fixture
def job_run(bus_factory: BusFactory, tmp_path: Path, reference: Path) -> Iterator[JobRun]:
    """A :class:`JobRun` of :data:`SHAPE` whose daemon has the settings of the module
    docstring; every process it started is stopped afterwards."""
    run = JobRun(
        bus_factory,
        tmp_path,
        SHAPE,
        reference,
        context="--batch-heartbeats 0.2",
        machine={"heartbeat_timeout_s": 8.0, "progress_floor_s": 60.0},
    )
    try:
        yield run
    finally:
        run.close()


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
def test_a_paused_worker_on_a_batched_node_is_found_silent_and_restored(job_run: JobRun) -> None:
    job_run.start_daemon()
    job_run.start_job(PACE, run_args=["--batch-heartbeats", "0.2"])
    started = job_run.wait_for(
        "rank 1 started",
        lambda m: isinstance(m, Lifecycle) and m.kind == "started" and m.ranks == (1,),
    )
    job_run.wait_for(
        "a batch showing both ranks past step 30",
        lambda m: (
            isinstance(m, HeartbeatBatch)
            and sorted(b.rank for b in m.beats if b.step >= 30) == [0, 1]
        ),
    )
    os.kill(started.message.pid, signal.SIGSTOP)
    job_run.wait_for("the resume", lambda m: isinstance(m, Resume))
    code = job_run.finish()
    record = job_run.record()

    opened: list[dict[str, Any]] = [
        d for d in record.decisions() if d["decision"] == "incident_opened"
    ]
    incident = only(opened, "incident", job_run)
    assert (incident["cause"], incident["ranks"]) == ("heartbeat_timeout", [1]), (
        f"{incident} {job_run.describe()}"
    )
    restore = only(record.restores(), "restore", job_run)
    assert (restore.generation, restore.attempt) == (1, 1), job_run.describe()
    # Unbatched go only the heartbeats the daemon must not miss, as reliably as a checkpoint
    # event: each rank's last progress right before its finished (docs/recovery.md, "A
    # finish the daemon has not judged") and those with a parameter checksum
    # (docs/operations.md, "Heartbeat batching").
    direct = [e.message for e in record.events if isinstance(e.message, Heartbeat)]
    finishes = {
        (m.rank, m.pid): m
        for e in record.events
        if isinstance(m := e.message, Lifecycle) and m.kind == "finished"
    }
    last = {(b.rank, b.pid): b for b in direct if (b.rank, b.pid) in finishes}
    assert sorted((b.generation, b.rank) for b in last.values()) == [(1, 0), (1, 1)], (
        job_run.describe()
    )
    others = [b for b in direct if last.get((b.rank, b.pid)) is not b]
    assert all(b.param_checksum is not None for b in others), (
        f"a heartbeat without a checksum went to the bus unbatched {job_run.describe()}"
    )
    for beat in last.values():
        finished = finishes[(beat.rank, beat.pid)]
        assert (finished.step, finished.seq > beat.seq) == (beat.step, True), job_run.describe()
    batches = [e.message for e in record.events if isinstance(e.message, HeartbeatBatch)]
    assert {b.host for b in batches} == {started.message.host}, job_run.describe()
    assert {(b.generation, b.rank) for m in batches for b in m.beats} == {
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    }, job_run.describe()
    # A relayed heartbeat often reaches the bus behind its rank's checkpoint shard, sent
    # directly: stale, skipped, never a rejected duplicate (the daemon's alert metric).
    duplicates = [
        d for d in record.decisions() if d["decision"] == "rejected" and d["code"] == "duplicate"
    ]
    assert duplicates == [], job_run.describe()
    assert_exact(job_run, code, record)
