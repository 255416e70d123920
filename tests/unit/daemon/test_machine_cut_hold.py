"""A checkpoint in flight is waited for (``cut_settle_s``, ``docs/recovery.md``): a rank's exit
report can reach the daemon before the other ranks' shards of a step the dead rank completed.
The restore is held until that step commits (and becomes the target), can no longer commit, or
``cut_settle_s`` of bus time has passed; never otherwise."""

from __future__ import annotations

import pytest

from tests.support.machine_scenarios import (
    T0,
    S,
    Sim,
    config,
    issued,
    of_type,
    run,
    two_ranks_training,
)
from trainguard.daemon.core._decisions import Anomaly, Committed, Decision, IncidentOpened, Issue
from trainguard.daemon.core._inputs import Tick
from trainguard.daemon.core._machine import decide, next_deadline
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import JobState
from trainguard.daemon.core._state_codec import decode_state, encode_state
from trainguard.schemas import Restore

CFG = config()
TRAINED = 24  # steps 0..24: commits at 10 and 20
KILL = T0 + 26 * S


def half_written(
    wrote: int = 1, cfg: MachineConfig = CFG
) -> tuple[Sim, JobState, tuple[Decision, ...]]:
    """Two ranks trained to step 24; rank ``wrote`` reported its shard of step 25 (the other
    rank's is on its way), then rank 1 was killed: the exit report is folded."""
    sim = Sim(world_size=2)
    state, _ = run(two_ranks_training(sim, TRAINED), cfg=cfg)
    state, _ = decide(state, sim.checkpoint(wrote, 25, KILL - S // 2), cfg)
    state, decisions = decide(state, sim.kill(1, KILL), cfg)
    return sim, state, decisions


def held(decisions: tuple[Decision, ...]) -> list[Anomaly]:
    return [d for d in decisions if isinstance(d, Anomaly) and d.kind == "restore_held"]


def test_the_restore_waits_for_the_survivors_shard_and_targets_its_step() -> None:
    sim, state, decisions = half_written()
    assert of_type(decisions, IncidentOpened)
    assert not issued(decisions, Restore)
    [note] = held(decisions)
    assert "shard of step 25 before exiting, 1 of 2 ranks have" in note.reason
    assert state.held is not None
    assert state.held.awaits == 25
    assert next_deadline(state, CFG) == KILL + CFG.cut_settle_ns
    # The survivor's shard arrives 0.3 s later: the step commits, and the restore goes out at
    # once with it as the target.
    state, decisions = decide(state, sim.checkpoint(0, 25, KILL + 3 * S // 10), CFG)
    [committed] = of_type(decisions, Committed)
    assert committed.manifest.step == 25
    [restore] = issued(decisions, Restore)
    assert restore.target is not None
    assert restore.target.step == 25
    [issue] = of_type(decisions, Issue)
    assert issue.reason.endswith("; held for the checkpoint of step 25")
    assert state.held is None
    assert state.phase == "restoring"


def test_without_the_survivors_shard_the_restore_goes_out_at_the_deadline() -> None:
    sim, state, _ = half_written()
    before = state.clock_ns + CFG.cut_settle_ns - 1
    state, decisions = decide(state, Tick(before), CFG)
    assert not issued(decisions, Restore)
    state, decisions = decide(state, sim.heartbeat(0, 26, before + 1), CFG)
    [restore] = issued(decisions, Restore)
    assert restore.target is not None
    assert restore.target.step == 20


def test_a_survivor_that_exits_without_its_shard_ends_the_wait() -> None:
    """Rank 0's supervisor reports it exited too (a collective failed), its shard of step 25
    never reported (a supervisor forwards a dead worker's unsent events before its exit): the
    step can no longer commit, so the restore goes out at once."""
    sim, state, _ = half_written()
    state, decisions = decide(state, sim.kill(0, KILL + S // 10), CFG)
    [restore] = issued(decisions, Restore)
    assert restore.target is not None
    assert restore.target.step == 20
    assert len(of_type(decisions, IncidentOpened)) == 0  # it joined the held incident


def test_no_wait_when_the_dead_rank_has_no_shard_of_the_newer_step() -> None:
    """Rank 0 reported its shard of step 25, rank 1 (killed) did not: rank 1's will never come,
    so the restore goes out at once, to step 20."""
    _, state, decisions = half_written(wrote=0)
    [restore] = issued(decisions, Restore)
    assert restore.target is not None
    assert restore.target.step == 20
    assert state.held is None


def test_cut_settle_0_turns_the_wait_off() -> None:
    _, _, decisions = half_written(cfg=config(cut_settle_s=0))
    [restore] = issued(decisions, Restore)
    assert restore.target is not None
    assert restore.target.step == 20


def test_a_held_state_survives_a_snapshot() -> None:
    _, state, _ = half_written()
    assert decode_state(encode_state(state)) == state


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_config_refuses_a_bad_cut_settle(value: float) -> None:
    with pytest.raises(ValueError, match="cut_settle_s must be a number of seconds >= 0"):
        config(cut_settle_s=value)
