"""LoaderState over real StatefulDataLoaders with worker processes (``num_workers=2``,
``prefetch_factor=2``): a restore at any batch, in a fresh loader or a fresh process after a
SIGKILL, continues the sample sequence exactly; restores onto 1 and 4 ranks from 2 continue
the global order; an opaque loader state refuses a world-size change; the state goes through
the agent's shard format (``torch.load(weights_only=True)``)."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from tests.support.samplers import VERSION, Indices
from tests.support.stateful_loaders import Lockstep, world
from trainguard.agent import Agent, LoaderState, LoaderStateNotReshardable
from trainguard.agent.checkpoint._shards import load_shard
from trainguard.agent.data._cursor import GlobalOrder

REPO = Path(__file__).resolve().parents[3]
N, PER_RANK, SEED = 24, 2, 7  # 12 batches per epoch on one rank
ORDER = GlobalOrder(N, SEED, VERSION)


def _stream(count: int) -> list[int]:
    """The first ``count`` samples of the job's global order."""
    return list(ORDER.samples(ORDER.start(), count))


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def _weights_only(state: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(k=st.integers(0, 30))
def test_a_restore_at_any_batch_continues_exactly(k: int) -> None:
    (position,) = world(N, 1, PER_RANK, SEED, num_workers=2)
    first = Lockstep([position])
    consumed = first.steps(k)
    sampler = position.loader.sampler
    assert position.cursor == ORDER.advance(ORDER.start(1), PER_RANK, k)
    if k % 12:  # mid-pass the workers hold prefetched batches: handed out, not trained
        assert ORDER.position(sampler.cursor) > ORDER.position(position.cursor)
    state = _weights_only(position.state_dict())
    (again,) = world(N, 1, PER_RANK, SEED, num_workers=2)
    again.load_state_dict(state)
    assert again.cursor == position.cursor
    rest = Lockstep([again]).steps(30 - k)
    assert _flat(consumed + rest) == _stream(30 * PER_RANK)


@pytest.mark.parametrize("k", [1, 5, 11, 12, 17])
def test_the_loaders_own_protocol_restores_the_sampler_exactly(k: int) -> None:
    """Without LoaderState: ``StatefulDataLoader.load_state_dict`` of its ``state_dict``
    drives the sampler's ``state_dict``/``load_state_dict``, mid-pass."""
    (position,) = world(N, 1, PER_RANK, SEED, num_workers=2)
    consumed = Lockstep([position]).steps(k)
    state = _weights_only(position.loader.state_dict())
    (again,) = world(N, 1, PER_RANK, SEED, num_workers=2)
    again.loader.load_state_dict(state)
    rest = Lockstep([again]).steps(24 - k)
    assert _flat(consumed + rest) == _stream(24 * PER_RANK)


def test_a_state_saved_after_the_pass_ended_resumes_with_the_next_pass() -> None:
    (position,) = world(N, 1, PER_RANK, SEED, num_workers=2)
    consumed = [b.tolist() for b in position.loader]  # one whole pass: the iterator finished
    state = _weights_only(position.state_dict())
    assert state["loader"]["_iterator_finished"]
    assert position.cursor == ORDER.advance(ORDER.start(1), PER_RANK, 12)
    (again,) = world(N, 1, PER_RANK, SEED, num_workers=2)
    again.load_state_dict(state)
    rest = Lockstep([again]).steps(12)
    assert _flat(consumed + rest) == _stream(24 * PER_RANK)


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 5, 12, 17])
def test_a_killed_job_resumes_in_a_fresh_process_exactly(tmp_path: Path, k: int) -> None:
    steps, state = 30, tmp_path / "state.pt"

    def job(*flags: str, ids: Path) -> subprocess.CompletedProcess[str]:
        settings_ = {"n": N, "per-rank": PER_RANK, "seed": SEED, "steps": steps, "state": state}
        options = [f"--{name}={value}" for name, value in settings_.items()]
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.support.stateful_loaders",
                *options,
                f"--ids={ids}",
                *flags,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    killed = job("--kill-after", str(k), ids=tmp_path / "before.json")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = job(ids=tmp_path / "after.json")
    assert resumed.returncode == 0, resumed.stderr
    before = json.loads((tmp_path / "before.json").read_text())
    after = json.loads((tmp_path / "after.json").read_text())
    assert (len(before), len(after)) == (k, steps - k)
    assert _flat(before + after) == _stream(steps * PER_RANK)


@pytest.mark.parametrize("after", [1, 4])
@pytest.mark.parametrize("k", [3, 6, 9])
def test_a_restore_from_two_ranks_onto_another_world_size_continues_the_global_order(
    after: int, k: int
) -> None:
    first = Lockstep(world(N, 2, PER_RANK, SEED, num_workers=2))
    consumed = first.steps(k)
    cursor = first.cursor()
    assert cursor == ORDER.advance(ORDER.start(2), 2 * PER_RANK, k)
    states = [_weights_only(r.state_dict()) for r in first.ranks]
    ranks = world(N, after, PER_RANK, SEED, num_workers=2)
    for position in ranks:  # a rank the snapshot has no shard of starts from its cursor
        position.load_state_dict(states[position.rank] if position.rank < 2 else cursor)
    rest = Lockstep(ranks).steps(24 // after)
    samples = _flat(consumed + rest)
    assert len(set(samples[:N])) == N  # one epoch: every sample once
    assert samples == _stream(len(samples))


def _opaque(rank: int, world_size: int) -> LoaderState:
    sampler = StatefulDistributedSampler(
        Indices(N), num_replicas=world_size, rank=rank, shuffle=True, seed=SEED
    )
    loader = StatefulDataLoader(
        Indices(N), batch_size=PER_RANK, sampler=sampler, num_workers=2, prefetch_factor=2
    )
    return LoaderState(loader, rank=rank, world_size=world_size)


def test_an_opaque_loader_state_with_workers_refuses_a_world_size_change() -> None:
    first = _opaque(0, 2)
    iterator = iter(first.loader)
    for _ in range(2):
        next(iterator)
    state = _weights_only(first.state_dict())
    rest = [b.tolist() for b in iterator]
    again = _opaque(0, 2)
    again.load_state_dict(state)
    assert [b.tolist() for b in again.loader] == rest
    with pytest.raises(LoaderStateNotReshardable, match="no rule to reshard"):
        _opaque(0, 1).load_state_dict(state)


@pytest.mark.parametrize("blocking", [True, False])
def test_the_state_goes_through_the_agents_shard_format(
    make_agent: Callable[..., Agent], blocking: bool
) -> None:
    (position,) = world(N, 1, PER_RANK, SEED, num_workers=2)
    run = Lockstep([position])
    consumed = run.steps(5)
    with make_agent() as agent:
        agent.ready(0)
        agent.step(5)
        saved = agent.checkpoint(
            5, {"loader": position.state_dict()}, cursor=position.cursor, blocking=blocking
        )
        run.steps(3)  # training goes on while the shard of step 5 is written
        written = saved.result()
    assert written.cursor == ORDER.advance(ORDER.start(1), PER_RANK, 5)
    state = load_shard(written.shard_uri, written.digest)  # torch.load(weights_only=True)
    (again,) = world(N, 1, PER_RANK, SEED, num_workers=2)
    again.load_state_dict(state["loader"])
    rest = Lockstep([again]).steps(19)
    assert _flat(consumed + rest) == _stream(24 * PER_RANK)
