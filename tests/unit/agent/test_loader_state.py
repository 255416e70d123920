"""LoaderState over a StatefulDataLoader without workers (process-free): the consumed cursor,
the state's weights_only form, restores on the same and on other world sizes, the refusal of
an opaque loader state, and the loader settings it checks."""

from __future__ import annotations

import collections
import io
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from tests.support.samplers import VERSION, Indices
from tests.support.stateful_loaders import Lockstep, rank_loader, world
from trainguard.agent import LoaderState, LoaderStateNotReshardable
from trainguard.agent.data._cursor import GlobalOrder
from trainguard.agent.data._loader import _plain
from trainguard.schemas import DataCursor, StepRange


def _weights_only_round_trip(state: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _restored(
    states: list[dict[str, Any]], n: int, world_size: int, per_rank: int, seed: int
) -> list[LoaderState]:
    """A new world's loaders, each loading the saved state of its rank, or the cursor where
    the snapshot has no rank of that number (as after ``agent.load`` / ``target.cursor``)."""
    ranks = world(n, world_size, per_rank, seed, num_workers=0)
    cursor = DataCursor(**states[0]["cursor"])
    for position in ranks:
        saved = states[position.rank] if position.rank < len(states) else cursor
        position.load_state_dict(saved)
    return ranks


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 30),
    seed=st.integers(0, 2**64 - 1),
    per_rank=st.integers(1, 3),
    before=st.integers(1, 4),
    after=st.integers(1, 4),
    k=st.integers(0, 25),
)
def test_a_restore_onto_any_world_size_continues_the_global_order(
    n: int, seed: int, per_rank: int, before: int, after: int, k: int
) -> None:
    order = GlobalOrder(n, seed, VERSION)
    first = Lockstep(world(n, before, per_rank, seed, num_workers=0))
    consumed = first.steps(k)
    assert first.cursor() == order.advance(order.start(before), before * per_rank, k)
    states = [_weights_only_round_trip(r.state_dict()) for r in first.ranks]
    rest = Lockstep(_restored(states, n, after, per_rank, seed)).steps(12)
    samples = [i for batch in consumed + rest for i in batch]
    assert samples == list(order.samples(order.start(), len(samples)))


def test_the_state_survives_weights_only_and_names_the_consumed_cursor() -> None:
    (position,) = world(20, 1, 2, seed=3, num_workers=0)
    Lockstep([position]).steps(4)
    state = position.state_dict()
    assert state["cursor"] == {
        "data_version": VERSION,
        "seed": 3,
        "epoch": 0,
        "offset": 8,
        "world_size": 1,
    }
    assert (state["rank"], state["world_size"]) == (0, 1)
    assert _weights_only_round_trip(state) == state


def test_a_skip_after_the_restore_is_honoured() -> None:
    n, per_rank, seed = 40, 2, 9
    order = GlobalOrder(n, seed, VERSION)
    (first,) = world(n, 1, per_rank, seed, num_workers=0)
    Lockstep([first]).steps(3)
    (again,) = world(n, 1, per_rank, seed, num_workers=0)
    again.load_state_dict(first.state_dict())
    again.loader.sampler.skip(StepRange(from_step=5, to_step=6), restored_step=3)
    assert again.cursor == order.advance(order.start(1), per_rank, 3)
    got = Lockstep([again]).steps(4)
    kept = [*range(3, 4), *range(6, 9)]  # step 4, then steps 5-6 skipped: 7, 8, 9 follow
    expected = list(order.samples(order.start(), 9 * per_rank))
    assert got == [expected[b * per_rank : (b + 1) * per_rank] for b in kept]


def _opaque(rank: int, world_size: int) -> LoaderState:
    """A loader whose position is torchdata's own per-rank sampler state."""
    sampler = StatefulDistributedSampler(
        Indices(20), num_replicas=world_size, rank=rank, shuffle=True, seed=1
    )
    loader = StatefulDataLoader(Indices(20), batch_size=2, sampler=sampler)
    return LoaderState(loader, rank=rank, world_size=world_size)


def test_an_opaque_state_loads_on_its_own_rank_and_world_size() -> None:
    first = _opaque(1, 2)
    iterator = iter(first.loader)
    for _ in range(2):
        next(iterator)
    state = _weights_only_round_trip(first.state_dict())
    rest = [b.tolist() for b in iterator]
    assert state["cursor"] is None
    assert rest
    again = _opaque(1, 2)
    again.load_state_dict(state)
    assert [b.tolist() for b in again.loader] == rest


@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (0, 2), (1, 4)])
def test_an_opaque_state_refuses_another_rank_or_world_size(rank: int, world_size: int) -> None:
    state = _opaque(1, 2).state_dict()
    with pytest.raises(LoaderStateNotReshardable, match="StatefulDistributedSampler") as caught:
        _opaque(rank, world_size).load_state_dict(state)
    message = str(caught.value)
    assert f"rank {rank} of world size {world_size}" in message
    assert "ResumableDistributedSampler" in message
    assert "world size the snapshot was taken with" in message


def test_an_opaque_loader_refuses_a_cursor_and_has_none() -> None:
    cursor = world(20, 1, 2, seed=1, num_workers=0)[0].cursor
    opaque = _opaque(0, 1)
    with pytest.raises(LoaderStateNotReshardable, match="a data cursor alone"):
        opaque.load_state_dict(cursor)
    with pytest.raises(TypeError, match="no data cursor"):
        _ = opaque.cursor


def test_a_state_of_the_other_kind_of_sampler_is_refused() -> None:
    resumable = world(20, 1, 2, seed=1, num_workers=0)[0]
    with pytest.raises(ValueError, match="over another sampler"):
        resumable.load_state_dict(_opaque(0, 1).state_dict())
    with pytest.raises(ValueError, match="over a ResumableDistributedSampler"):
        _opaque(0, 1).load_state_dict(resumable.state_dict())
    with pytest.raises(TypeError, match=r"not a LoaderState\.state_dict"):
        resumable.load_state_dict(resumable.loader.state_dict())


def test_the_loader_settings_are_checked() -> None:
    position = rank_loader(20, rank=1, world_size=2, per_rank=2, seed=1, num_workers=0)
    loader, sampler = position.loader, position.loader.sampler
    with pytest.raises(TypeError, match="StatefulDataLoader"):
        LoaderState(DataLoader(Indices(20), batch_size=2, sampler=sampler), rank=1, world_size=2)
    with pytest.raises(ValueError, match="not rank 0 of 2"):
        LoaderState(loader, rank=0, world_size=2)
    with pytest.raises(ValueError, match="outside world size"):
        LoaderState(loader, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size 4"):
        LoaderState(
            StatefulDataLoader(Indices(20), batch_size=4, sampler=sampler), rank=1, world_size=2
        )
    for settings_ in ({"snapshot_every_n_steps": 2}, {"in_order": False}):
        workers = StatefulDataLoader(
            Indices(20), batch_size=2, sampler=sampler, num_workers=1, **settings_
        )
        with pytest.raises(ValueError, match="snapshot_every_n_steps=1"):
            LoaderState(workers, rank=1, world_size=2)


def test_plain_copies_what_weights_only_loads_and_names_what_it_does_not() -> None:
    tensor = torch.arange(3)
    source = collections.OrderedDict(a=[1, (2.0, "x")], b={"t": tensor, "n": None, "y": b"z"})
    copy = _plain(source, "state")
    assert type(copy) is dict
    assert copy == {"a": [1, (2.0, "x")], "b": {"t": copy["b"]["t"], "n": None, "y": b"z"}}
    assert torch.equal(copy["b"]["t"], tensor)
    assert copy["b"]["t"].data_ptr() != tensor.data_ptr()
    with pytest.raises(TypeError, match=r"state\['b'\]\['s'\] is a set"):
        _plain({"b": {"s": {1}}}, "state")
