"""Property: a heartbeat batch folds as its heartbeats one by one at the batch's append time,
over simulated jobs (healthy, hung, diverged, stuck, corrupted) batched per node as a
supervisor flushing every half second sends them, with the shell's ticks where they fall."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.batches import batched, one_by_one
from tests.support.machine_scenarios import JOB, S, config
from tests.support.schemas import same_message
from tests.support.traces import Faults, Job, drive, healthy_jobs, simulate
from trainguard.daemon.core._decisions import Rejected
from trainguard.daemon.core._inputs import Observed
from trainguard.daemon.core._machine import decide
from trainguard.daemon.core._state import new_job
from trainguard.schemas import Heartbeat, HeartbeatBatch

CFG = config()


def batches_fold_as_their_heartbeats(job: Job) -> None:
    """The invariant: a batch carries exactly the heartbeats batched; drive the batched
    trace; refold every input, a batch as its
    heartbeats one by one, and find after each input the same state, and the same decisions
    but for the batch's rejections, which it merges into one of the first one's code."""
    trace = simulate(job)
    inputs = batched(trace.inputs, window_ns=S // 2)
    sent = [
        i.event for i in trace.inputs if isinstance(i, Observed) and isinstance(i.event, Heartbeat)
    ]
    carried = [
        beat
        for i in inputs
        if isinstance(i, Observed) and isinstance(i.event, HeartbeatBatch)
        for beat in i.event.heartbeats()
    ]
    assert len(carried) == len(sent)
    assert all(map(same_message, carried, sent))
    final, folded = drive(inputs, until=trace.end_ns)
    state = new_job(JOB)
    for item, decisions in folded:
        if isinstance(item, Observed) and isinstance(item.event, HeartbeatBatch):
            state, expected, refused = one_by_one(state, item)
            got = [d for d in decisions if not isinstance(d, Rejected)]
            merged = [d for d in decisions if isinstance(d, Rejected)]
            assert got == expected
            assert [r.code for r in merged] == [r.code for r in refused[:1]]
        else:
            state, expected_decisions = decide(state, item, CFG)
            assert decisions == expected_decisions
    assert state == final


@settings(max_examples=25, deadline=None)
@given(job=healthy_jobs())
def test_batches_of_healthy_jobs_fold_as_their_heartbeats(job: Job) -> None:
    batches_fold_as_their_heartbeats(job)


@pytest.mark.parametrize(
    "faults",
    [
        Faults(hang_after=30),
        Faults(nan=(1, 25)),
        Faults(stuck_in=(2, 20, "data")),
        Faults(odd_checksum=(3, 20)),
        Faults(restart_from_zero=(0, 30)),
    ],
    ids=["hang", "nan", "stuck", "checksum", "restart"],
)
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_batches_of_faulty_jobs_fold_as_their_heartbeats(faults: Faults, seed: int) -> None:
    batches_fold_as_their_heartbeats(
        Job(world_size=4, steps=50, checksum_every=5, faults=faults, seed=seed)
    )
