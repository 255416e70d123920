"""The torch sampler yields exactly what the cursor arithmetic says, through a real DataLoader."""

from __future__ import annotations

import io
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.samplers import VERSION, expected_batches, loaders, samplers, train
from trainguard.agent.data._cursor import CursorMismatch, DataVersionMismatch, GlobalOrder
from trainguard.agent.data._sampler import ResumableDistributedSampler
from trainguard.schemas._messages import DataCursor, StepRange


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 40),
    seed=st.integers(0, 2**64 - 1),
    world_size=st.integers(1, 4),
    per_rank=st.integers(1, 5),
    steps=st.integers(1, 25),
)
def test_dataloader_yields_what_the_arithmetic_says(
    n: int, seed: int, world_size: int, per_rank: int, steps: int
) -> None:
    order = GlobalOrder(n, seed, VERSION)
    global_batch = world_size * per_rank
    batches, cursor = train(samplers(n, world_size, per_rank, seed), n, steps)
    assert batches == expected_batches(order, order.start(), global_batch, steps)
    assert cursor == order.advance(order.start(world_size), global_batch, steps)


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 40),
    seed=st.integers(0, 2**64 - 1),
    w1=st.integers(1, 4),
    w2=st.integers(1, 4),
    scale=st.integers(1, 2),
    total=st.integers(1, 20),
    data=st.data(),
)
def test_samplers_restored_on_another_world_size_continue_exactly(
    n: int, seed: int, w1: int, w2: int, scale: int, total: int, data: st.DataObject
) -> None:
    kill = data.draw(st.integers(0, total))
    global_batch = math.lcm(w1, w2) * scale
    order = GlobalOrder(n, seed, VERSION)
    uninterrupted, _ = train(samplers(n, w1, global_batch // w1, seed), n, total)

    before, cursor = train(samplers(n, w1, global_batch // w1, seed), n, kill)
    saved = torch.load(_saved(samplers(n, w1, global_batch // w1, seed, cursor)[0]))
    after, _ = train(
        samplers(n, w2, global_batch // w2, seed, DataCursor(**saved)), n, total - kill
    )

    assert before + after == uninterrupted
    assert uninterrupted == expected_batches(order, order.start(), global_batch, total)


def _saved(sampler: ResumableDistributedSampler) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(sampler.state_dict(), buffer)
    buffer.seek(0)
    return buffer


def test_state_dict_survives_weights_only_loading() -> None:
    (sampler,) = samplers(10, 1, 3, seed=4)
    list(itertools.islice(sampler, 7))  # two full batches and one index of the third
    saved = torch.load(_saved(sampler), weights_only=True)
    assert saved == {"data_version": VERSION, "seed": 4, "epoch": 0, "offset": 6, "world_size": 1}
    (restored,) = samplers(10, 1, 3, seed=4)
    restored.load_state_dict(saved)
    assert restored.cursor == sampler.cursor


def test_passes_follow_data_epochs_and_continue_the_stream() -> None:
    n, per_rank = 10, 2
    ranks = samplers(n, 2, per_rank, seed=9)
    order = ranks[0].order
    first = [list(s) for s in ranks]
    assert [len(p) for p in first] == [6, 6]  # 3 global batches start in epoch 0 (0, 4, 8)
    assert ranks[0].cursor == order.cursor_at(12, 2)  # the last one reached into epoch 1
    assert len(ranks[0]) == 4  # the next pass: batches at 12 and 16 start in epoch 1
    second = [list(s) for s in ranks]
    assert ranks[0].start_cursor == order.cursor_at(12, 2)
    assert ranks[0].cursor == order.cursor_at(20, 2)
    stream = [
        i
        for step in range(5)
        for rank in (first, second)[step // 3]
        for i in rank[(step % 3) * per_rank : (step % 3 + 1) * per_rank]
    ]
    assert stream == list(order.samples(order.start(), 20))


def test_huge_dataset_resumes_at_its_last_samples() -> None:
    n = 10**12
    start = GlobalOrder(n, 2, VERSION).cursor_at(7 * n + n - 3, 8)
    ranks = samplers(n, 2, 2, seed=2, start=start)
    assert len(ranks[0]) == 2  # one global batch of 4 starts in epoch 7
    batch = [i for s in ranks for i in itertools.islice(s, 2)]
    assert batch == list(ranks[0].order.samples(start, 4))
    assert ranks[1].cursor == ranks[0].order.cursor_at(8 * n + 1, 2)


def test_load_state_dict_refuses_another_data_version_unless_allowed() -> None:
    other = GlobalOrder(10, 4, "sha256:" + "00" * 32).cursor_at(13, 2)
    (sampler,) = samplers(10, 1, 3, seed=4)
    with pytest.raises(DataVersionMismatch):
        sampler.load_state_dict(other)
    sampler.load_state_dict(other, allow_data_version_change=True)
    assert sampler.start_cursor == sampler.order.cursor_at(13, 1)
    with pytest.raises(CursorMismatch, match="seed"):
        samplers(10, 1, 3, seed=5, start=sampler.cursor)


@pytest.mark.parametrize(
    ("rank", "world_size", "per_rank", "message"),
    [(2, 2, 1, "outside world size"), (0, 0, 1, "outside world size"), (0, 1, 0, "per_rank")],
)
def test_sampler_rejects_inconsistent_arguments(
    rank: int, world_size: int, per_rank: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ResumableDistributedSampler(
            10,
            rank=rank,
            world_size=world_size,
            per_rank_batch_size=per_rank,
            seed=0,
            data_version=VERSION,
        )


# -- many epochs, restores and skips: what the README's loop relies on ----------------------------


def epochs_loop(
    ranks: list[ResumableDistributedSampler],
    n: int,
    start: int,
    total: int,
    *,
    checkpoints: list[tuple[int, DataCursor]] | None = None,
) -> dict[int, list[int]]:
    """The README's loop over the ranks in lockstep: ``while step < total: for batch in
    loader: step += 1 ...``, from step ``start``; each step's global batch, and (in
    ``checkpoints``) ``(step, sampler.cursor)`` after every step, the same on every rank."""
    out: dict[int, list[int]] = {}
    step = start
    while step < total:
        for batches in zip(*loaders(ranks, n), strict=True):
            step += 1
            out[step] = [i for batch in batches for i in batch.tolist()]
            cursors = {s.cursor for s in ranks}
            assert len(cursors) == 1
            if checkpoints is not None:
                checkpoints.append((step, cursors.pop()))
            if step == total:
                break
    return out


def stream_batch(order: GlobalOrder, position: int, size: int) -> list[int]:
    """The global batch of ``size`` samples at stream ``position``."""
    return list(order.samples(order.cursor_at(position, 1), size))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 30),
    seed=st.integers(0, 2**64 - 1),
    world_size=st.integers(1, 3),
    per_rank=st.integers(1, 4),
    total=st.integers(1, 40),
    data=st.data(),
)
def test_the_cursor_after_any_step_of_a_many_epoch_loop_resumes_exactly(
    n: int, seed: int, world_size: int, per_rank: int, total: int, data: st.DataObject
) -> None:
    """A kill after any step of a loop over several epochs, resumed from ``sampler.cursor``
    of the step checkpointed before it: every step trains the stream's next global batch."""
    size = world_size * per_rank
    order = GlobalOrder(n, seed, VERSION)
    checkpoints: list[tuple[int, DataCursor]] = []
    first = epochs_loop(
        samplers(n, world_size, per_rank, seed), n, 0, total, checkpoints=checkpoints
    )
    expected = {s: stream_batch(order, (s - 1) * size, size) for s in range(1, total + 1)}
    assert first == expected
    assert [c for _, c in checkpoints] == [order.cursor_at(s * size, world_size) for s in expected]
    step, cursor = data.draw(st.sampled_from(checkpoints))
    resumed = epochs_loop(samplers(n, world_size, per_rank, seed, start=cursor), n, step, total)
    assert resumed == {s: expected[s] for s in range(step + 1, total + 1)}


def test_cursor_after_refuses_a_step_count_carried_over_from_an_earlier_pass() -> None:
    """The README's old loop (``cursor_after(step - start)``) named the epoch after the right
    one once the loop went over the loader a second time: a kill at step 235 of a 2-epoch job
    resumed at epoch 2 instead of epoch 1, a whole epoch skipped."""
    n, per_rank = 100, 8
    (sampler,) = samplers(n, 1, per_rank, seed=3)
    loader = loaders([sampler], n)[0]
    step = start = 0
    for _ in range(2):  # two passes: epoch 0 (13 batches), then into epoch 1
        for _batch in loader:
            step += 1
            if step == 15:
                break
    assert sampler.cursor == sampler.order.cursor_at(15 * per_rank, 1)
    assert sampler.cursor_after(2) == sampler.cursor  # the live pass's own count is exact
    with pytest.raises(ValueError, match=r"cursor_after\(15\): the live pass .* handed out 2"):
        sampler.cursor_after(step - start)
    with pytest.raises(ValueError, match="must be >= 0"):
        sampler.cursor_after(-1)


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 30),
    seed=st.integers(0, 2**64 - 1),
    world_size=st.integers(1, 3),
    per_rank=st.integers(1, 4),
    restored=st.integers(0, 20),
    data=st.data(),
)
def test_a_skip_leaves_out_exactly_its_batches_and_the_cursor_counts_them(
    n: int, seed: int, world_size: int, per_rank: int, restored: int, data: st.DataObject
) -> None:
    """Restored at step ``restored`` with ``agent.skip`` = steps A..B: steps before A train the
    stream's next batches, step A trains the batch B - A + 1 batches later, and so on; the
    cursor after step A - 1 (an acknowledgement, a checkpoint) is the one without the skip, and
    a resume from any later checkpoint continues the skipped stream."""
    size = world_size * per_rank
    order = GlobalOrder(n, seed, VERSION)
    origin = order.cursor_at(restored * size + data.draw(st.integers(0, n - 1)), world_size)
    base = order.position(origin)
    first = data.draw(st.integers(restored + 1, restored + 12))
    last = data.draw(st.integers(first, first + 6))
    total = data.draw(st.integers(first, first + 15))
    ranks = samplers(n, world_size, per_rank, seed, start=origin)
    for s in ranks:
        s.skip(StepRange(from_step=first, to_step=last), restored_step=restored)
    assert {s.cursor for s in ranks} == {origin}  # what the acknowledgement carries
    skipped = last - first + 1

    def position(step: int) -> int:  # where the batch of ``step`` starts
        return base + (step - restored - 1 + (skipped if step >= first else 0)) * size

    checkpoints: list[tuple[int, DataCursor]] = []
    trained = epochs_loop(ranks, n, restored, total, checkpoints=checkpoints)
    assert trained == {
        s: stream_batch(order, position(s), size) for s in range(restored + 1, total + 1)
    }
    for step, cursor in checkpoints:
        done = position(step) + size if step != first - 1 else base + (step - restored) * size
        assert order.position(cursor) == done, step
    step, cursor = data.draw(st.sampled_from([c for c in checkpoints if c[0] >= first - 1]))
    again = samplers(n, world_size, per_rank, seed, start=cursor)
    if step == first - 1:  # checkpointed just before the skip: the restore skips again
        for s in again:
            s.skip(StepRange(from_step=first, to_step=last), restored_step=step)
    assert epochs_loop(again, n, step, total) == {s: trained[s] for s in range(step + 1, total + 1)}


def test_passes_with_a_skip_still_end_where_the_data_epoch_ends() -> None:
    """A pass yields the batches that start in its epoch, the skip included: 10 samples,
    global batch 2, restored at offset 0 of epoch 0 with the batches of steps 2-3 skipped: the
    first pass yields the batches at 0, 6 and 8 (2 and 4 skipped), the next starts at 10."""
    (sampler,) = samplers(10, 1, 2, seed=1)
    sampler.skip(StepRange(from_step=2, to_step=3), restored_step=0)
    assert len(sampler) == 6
    first = list(sampler)
    order = sampler.order
    assert first == [i for p in (0, 6, 8) for i in stream_batch(order, p, 2)]
    assert sampler.cursor == order.cursor_at(10, 1)
    assert len(sampler) == 10  # epoch 1: 5 batches
    assert list(sampler) == stream_batch(order, 10, 10)


def test_a_skip_that_is_behind_or_already_handed_out_is_refused() -> None:
    (sampler,) = samplers(10, 1, 2, seed=1, start=GlobalOrder(10, 1, VERSION).cursor_at(4, 1))
    with pytest.raises(ValueError, match="starts before step 6"):
        sampler.skip(StepRange(from_step=5, to_step=6), restored_step=5)
    list(itertools.islice(sampler, 4))  # the batches of steps 6 and 7
    with pytest.raises(ValueError, match="batch of step 7 was handed out already"):
        sampler.skip(StepRange(from_step=7, to_step=9), restored_step=5)
    sampler.skip(StepRange(from_step=8, to_step=9), restored_step=5)  # still ahead: fine
    assert sampler.cursor == sampler.order.cursor_at(8, 1)


def test_an_older_iterator_keeps_its_own_stream_after_a_load() -> None:
    (sampler,) = samplers(20, 1, 2, seed=5)
    order = sampler.order
    old = iter(sampler)
    assert [next(old), next(old)] == stream_batch(order, 0, 2)
    sampler.load_state_dict(order.cursor_at(10, 1))
    assert [next(old), next(old)] == stream_batch(order, 2, 2)
    assert list(itertools.islice(sampler, 2)) == stream_batch(order, 10, 2)
