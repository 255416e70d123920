"""Issue 13, D1, the supervisor's side of the late-finish rule (``docs/recovery.md``, "A job
that finished is never restored"): before it starts workers in a restart restore's generation,
a supervisor reads the job's events and finds whether every rank of the generation the ranks
last ran in finished before anyone joined the restore, exactly as the daemon folds them."""

from __future__ import annotations

import itertools
from pathlib import Path

import orjson
import pytest

from trainguard.agent.bus import DEFAULT_TOPICS, BusConfig, open_bus
from trainguard.agent.supervisor._supervisor import _diverged, _finished_before
from trainguard.daemon.core._audit_entry import decision_entry
from trainguard.daemon.core._decisions import IncidentOpened
from trainguard.schemas import ClockTick, Heartbeat, Lifecycle, Message, encode

pytestmark = pytest.mark.anyio

JOB = "late-job"
SEQ = itertools.count()


def started(rank: int, generation: int, world_size: int = 2) -> Lifecycle:
    return Lifecycle(
        job_id=JOB, generation=generation, ts=1, seq=next(SEQ), rank=rank, host="h", pid=10,
        kind="started", world_size=world_size,
    )  # fmt: skip


def finished(rank: int, generation: int) -> Lifecycle:
    return Lifecycle(
        job_id=JOB, generation=generation, ts=1, seq=next(SEQ), rank=rank, host="h", pid=10,
        kind="finished", step=9,
    )  # fmt: skip


def beat(rank: int, generation: int, world_size: int = 2) -> Heartbeat:
    return Heartbeat(
        job_id=JOB, generation=generation, ts=1, seq=next(SEQ), rank=rank, host="h", pid=10,
        world_size=world_size, step=3, phase="train",
    )  # fmt: skip


def supervisor_exit(generation: int) -> Lifecycle:
    return Lifecycle(
        job_id=JOB, generation=generation, ts=1, seq=next(SEQ), rank=None, host="h", pid=99,
        kind="exited", ranks=(0, 1), signal=9,
    )  # fmt: skip


def tick(generation: int) -> ClockTick:
    return ClockTick(job_id=JOB, generation=generation, ts=1, seq=next(SEQ), daemon_id="d")


async def judged(tmp_path: Path, events: list[Message], restore_generation: int) -> int | None:
    config = BusConfig(url=f"sqlite://{tmp_path / 'bus.db'}", topics=DEFAULT_TOPICS)
    async with open_bus(config) as bus:
        for event in events:
            await bus.publish("events", JOB, encode(event))
        return await _finished_before(bus, JOB, restore_generation)


GEN0 = [started(0, 0), started(1, 0), beat(0, 0), beat(1, 0)]


@pytest.mark.parametrize(
    ("events", "restore", "expected"),
    [
        # Both ranks finished in generation 0 (one before the restore, one after it).
        ([*GEN0, finished(0, 0), tick(1), finished(1, 0)], 1, 0),
        # A process of generation 1 was heard first: the restore stands.
        ([*GEN0, finished(0, 0), supervisor_exit(1), finished(1, 0)], 1, None),
        # Only rank 0 finished.
        ([*GEN0, finished(0, 0), finished(0, 0)], 1, None),
        # A retried restore (generation 2) nobody joined; generation 1 was an in-process
        # restore (no started reports: its world size from a heartbeat).
        ([*GEN0, beat(0, 1), beat(1, 1), finished(1, 1), tick(2), finished(0, 1)], 3, 1),
        # The ranks last ran in generation 1, and their finished reports are of generation 0.
        ([*GEN0, beat(0, 1), finished(0, 0), finished(1, 0)], 2, None),
        # No event of the job at all.
        ([], 1, None),
    ],
    ids=["finished", "joined-first", "one-rank", "in-process-then-retried", "older", "empty"],
)
async def test_a_supervisor_finds_a_job_that_finished_before_its_restore_was_joined(
    tmp_path: Path, events: list[Message], restore: int, expected: int | None
) -> None:
    assert await judged(tmp_path, events, restore) == expected


async def test_a_divergences_restore_is_never_voided_by_a_finish(tmp_path: Path) -> None:
    """A tester's finding: the supervisor's copy of the late-finish rule voided a restore the
    daemon keeps (a finish after a NaN: ``_outage.late_finish``) and said so. It reads
    the incident's onset step from the job's audit now."""
    config = BusConfig(url=f"sqlite://{tmp_path / 'bus.db'}", topics=DEFAULT_TOPICS)
    async with open_bus(config) as bus:
        for incident, onset in ((1, None), (2, 57)):
            opened = IncidentOpened(
                incident_id=f"{JOB}/i{incident}", cause="exited" if onset is None else "nan_loss",
                generation=incident, ranks=(1,), hosts=("h",), reason="r", onset_after_step=onset,
            )  # fmt: skip
            entry = decision_entry(
                JOB, partition=0, offset=incident, at_ms=0, identity={"type": "heartbeat"},
                config="c", decisions=[opened],
            )  # fmt: skip
            await bus.publish("audit", JOB, orjson.dumps(entry))
        assert not await _diverged(bus, JOB, f"{JOB}/i1")
        assert await _diverged(bus, JOB, f"{JOB}/i2")
        assert not await _diverged(bus, JOB, f"{JOB}/i3")  # not in the audit
