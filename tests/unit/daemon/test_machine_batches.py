"""The state machine folds a node's heartbeat batch (``heartbeat-batch/1``) as the heartbeats
it carries: per-rank detection stays what it is without batching."""

from __future__ import annotations

import dataclasses

from tests.support.batches import batch, batched, one_by_one
from tests.support.machine_scenarios import (
    JOB,
    T0,
    S,
    Sim,
    config,
    issued,
    of_type,
    pulses,
    run,
    running_job,
)
from trainguard.daemon.core._audit_entry import input_id
from trainguard.daemon.core._decisions import IncidentOpened, Rejected
from trainguard.daemon.core._inputs import Observed, Tick
from trainguard.daemon.core._machine import decide
from trainguard.schemas import Heartbeat, HeartbeatBatch, Restore

CFG = config()


def _beats(
    sim: Sim, ranks: tuple[int, ...], step: int, at: int, **fields: object
) -> list[Heartbeat]:
    beats = []
    for rank in ranks:
        event = sim.heartbeat(rank, step, at, **fields).event  # type: ignore[arg-type]
        assert isinstance(event, Heartbeat)
        beats.append(event)
    return beats


def test_a_batch_folds_to_the_state_and_decisions_of_its_heartbeats_one_by_one() -> None:
    sim = Sim()
    state, _ = running_job(sim, 12)
    item = batch(_beats(sim, (0, 1), 12, T0 + 13 * S), T0 + 13 * S + 300_000_000, seq=1)
    after, decisions = decide(state, item, CFG)
    reference, expected, refused = one_by_one(state, item)
    assert (after, list(decisions), refused) == (reference, expected, [])
    assert after.ranks[0].step == 12


def test_a_rank_missing_from_its_nodes_batches_is_found_silent() -> None:
    """Rank 2 stops (paused, killed without a report): its node's batches carry rank 3 only,
    and the heartbeat timeout names rank 2 as it would without batching."""
    sim = Sim()
    state, _ = running_job(sim, 12)
    at = T0 + 13 * S
    quiet = [
        batch(_beats(sim, (0, 1), 12, at), at, seq=1),
        batch(_beats(sim, (3,), 12, at), at, seq=2),
    ]
    state, decisions = run(quiet, state)
    assert decisions == ()
    last_heard = T0 + 12 * S + 2_000_000  # rank 2's last heartbeat (step 11)
    state, decisions = run(
        [*pulses(state, last_heard + 10 * S), Tick(last_heard + 10 * S + 1)], state
    )
    [opened] = of_type(decisions, IncidentOpened)
    assert (opened.cause, opened.ranks, opened.hosts) == ("heartbeat_timeout", (2,), ("h1",))


def test_a_nan_in_a_batch_restores_the_job() -> None:
    sim = Sim()
    state, _ = running_job(sim, 12)
    at = T0 + 13 * S
    beats = [*_beats(sim, (0,), 12, at), *_beats(sim, (1,), 12, at, loss=float("nan"))]
    state, decisions = decide(state, batch(beats, at, seq=1), CFG)
    [opened] = of_type(decisions, IncidentOpened)
    assert opened.ranks == (1,)
    assert issued(decisions, Restore)


def test_a_batch_delivered_twice_is_rejected_once_and_changes_nothing() -> None:
    sim = Sim()
    state, _ = running_job(sim, 12)
    item = batch(_beats(sim, (0, 1), 12, T0 + 13 * S), T0 + 13 * S, seq=1)
    state, _ = decide(state, item, CFG)
    again, decisions = decide(state, item._replace(at_ns=T0 + 13 * S + 5), CFG)
    assert again is state
    [rejected] = decisions
    assert isinstance(rejected, Rejected)
    assert (rejected.code, rejected.reason) == (
        "duplicate",
        "duplicate: HeartbeatBatch from supervisor on host h0 (pid 7) has seq 1, already "
        "accepted up to seq 1",
    )


def test_a_beat_relayed_behind_its_ranks_newer_direct_event_is_stale_not_a_duplicate() -> None:
    """Rank 1's heartbeat of seq N waits in its supervisor's relay while the rank's checkpoint
    shard (seq N + 1, sent directly) reaches the bus first: the batch carrying that heartbeat
    is new (its own seq), so the heartbeat is an older observation of the rank, skipped
    without a rejection and without changing anything; rank 0's fresh heartbeat of the same
    batch is folded. The same batch delivered a second time is one duplicate."""
    sim = Sim()
    state, _ = running_job(sim, 12)
    at = T0 + 13 * S
    beats = _beats(sim, (0, 1), 12, at)
    shard = sim.checkpoint(1, 12, at + 1_000_000)
    state, decisions = decide(state, shard, CFG)
    assert not of_type(decisions, Rejected)
    item = batch(beats, at + 200_000_000, seq=1)
    after, decisions = decide(state, item, CFG)
    assert not of_type(decisions, Rejected)
    assert after.ranks[1] == state.ranks[1]
    assert after.senders[(1, "h0", sim.pid(1))] == state.senders[(1, "h0", sim.pid(1))]
    assert after.ranks[0].last_heard_ns == at + 200_000_000
    again, decisions = decide(after, item._replace(at_ns=at + 300_000_000), CFG)
    assert again is after
    assert [d.code for d in of_type(decisions, Rejected)] == ["duplicate"]


def test_a_batch_of_stale_beats_only_changes_nothing() -> None:
    """A batch whose every heartbeat is stale (a 1-rank node's, behind the rank's shard) is
    skipped whole: no decision, the very same state."""
    sim = Sim()
    state, _ = running_job(sim, 12)
    at = T0 + 13 * S
    beats = _beats(sim, (1,), 12, at)
    state, _ = decide(state, sim.checkpoint(1, 12, at + 1_000_000), CFG)
    after, decisions = decide(state, batch(beats, at + 200_000_000, seq=1), CFG)
    assert (after, decisions) == (state, ())
    assert after is state


def test_a_stale_entry_is_refused_and_the_others_folded() -> None:
    sim = Sim()
    state, _ = running_job(sim, 12)
    at = T0 + 13 * S
    beats = _beats(sim, (0, 1), 12, at)
    beats[1] = dataclasses.replace(beats[1], generation=state.generation + 5)
    after, decisions = decide(state, batch(beats, at, seq=1), CFG)
    [rejected] = of_type(decisions, Rejected)
    assert rejected.code == "future_generation"
    assert after.ranks[0].last_heard_ns == at
    assert after.ranks[1] == state.ranks[1]


def test_a_batch_for_another_job_is_rejected_whole() -> None:
    sim = Sim(job_id="other")
    state, _ = running_job(Sim(), 12)
    item = batch(_beats(sim, (0, 1), 12, T0 + 13 * S), T0 + 13 * S, seq=1)
    after, decisions = decide(state, item, CFG)
    assert after is state
    [rejected] = decisions
    assert isinstance(rejected, Rejected)
    assert (rejected.code, rejected.reason) == (
        "wrong_job",
        f"HeartbeatBatch from supervisor on host h0 (pid 7) is for job 'other', not {JOB!r}",
    )


def test_a_batch_is_one_input_in_the_audit_trail() -> None:
    sim = Sim()
    item = batch(_beats(sim, (0, 1), 3, T0), T0, seq=9)
    assert isinstance(item.event, HeartbeatBatch)
    assert input_id(item.event) == {
        "type": "heartbeat-batch",
        "rank": None,
        "host": "h0",
        "pid": 7,
        "seq": 9,
    }


def test_a_trace_batched_by_node_decides_as_its_heartbeats_did() -> None:
    """A 4-rank job killed and restored: batched per node (two ranks each) it opens the same
    incidents and issues the same commands as its heartbeats sent one by one."""
    sim = Sim()
    inputs = [*sim.start(T0), *sim.train(range(20), start=T0 + S)]
    inputs.append(sim.kill(1, T0 + 21 * S))
    grouped = batched(inputs, window_ns=S // 2)
    assert (
        sum(isinstance(i, Observed) and isinstance(i.event, HeartbeatBatch) for i in grouped) == 40
    )
    plain, plain_decisions = run(inputs)
    batched_state, batched_decisions = run(grouped)
    assert batched_decisions == plain_decisions
    assert batched_state.ranks.keys() == plain.ranks.keys()
    assert batched_state.phase == plain.phase == "restoring"
