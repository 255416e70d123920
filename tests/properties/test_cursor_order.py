"""Properties of the cursor arithmetic: permutations, the global order, exact resumption."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.agent.data._cursor import (
    MAX_DATASET_LEN,
    CursorMismatch,
    DataVersionMismatch,
    GlobalOrder,
    KeyedPermutation,
    epoch_permutation,
)
from trainguard.schemas._messages import DataCursor

VERSION = "sha256:" + "ab" * 32
seeds = st.integers(0, 2**64 - 1)
epochs = st.integers(0, 2**63 - 1)
world_sizes = st.integers(1, 6)

# 1, primes, powers of two and their neighbours: the edges of the cycle-walking domain.
SIZES = sorted(
    {1, 2, 3, 5, 7, 11, 13, 31, 97, 101, 127, 257, 1009, 4093, 7919}
    | {2**k + d for k in range(1, 13) for d in (-1, 0, 1)}
)


def is_bijection_on_range(permutation: KeyedPermutation) -> bool:
    n = len(permutation)
    values = list(permutation)
    return sorted(values) == list(range(n)) and all(
        permutation.index(v) == i for i, v in enumerate(values)
    )


@pytest.mark.parametrize("n", SIZES)
def test_permutation_is_a_bijection_for_edge_sizes(n: int) -> None:
    for seed, epoch in [(0, 0), (1, 0), (0, 1), (2**64 - 1, 2**63 - 1)]:
        assert is_bijection_on_range(epoch_permutation(n, seed, epoch))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), seed=seeds, epoch=epochs)
def test_permutation_is_a_bijection(n: int, seed: int, epoch: int) -> None:
    assert is_bijection_on_range(epoch_permutation(n, seed, epoch))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, MAX_DATASET_LEN), seed=seeds, data=st.data())
def test_permutation_inverts_at_any_size(n: int, seed: int, data: st.DataObject) -> None:
    permutation = epoch_permutation(n, seed, 0)
    index = data.draw(st.integers(0, n - 1))
    value = permutation[index]
    assert 0 <= value < n
    assert permutation.index(value) == index


def test_permutation_order_is_pinned() -> None:
    """The order is part of the checkpoint format: changing it breaks resuming old cursors."""
    assert list(epoch_permutation(10, 0, 0)) == [0, 5, 2, 7, 1, 4, 3, 8, 9, 6]
    assert list(epoch_permutation(10, 0, 1)) == [7, 0, 6, 9, 5, 3, 1, 4, 8, 2]
    assert list(epoch_permutation(10, 1, 0)) == [1, 4, 6, 0, 7, 8, 2, 9, 3, 5]
    assert epoch_permutation(10**12, 7, 4)[10**12 - 1] == 491335678688
    assert epoch_permutation(MAX_DATASET_LEN, 2**64 - 1, 12345)[2**62] == 747136560832021162


def test_first_sample_is_uniform_over_seeds() -> None:
    # Chi-squared over 2000 seeds, 9 degrees of freedom: 27.88 is the 0.001 critical value.
    n, trials = 10, 2000
    counts = Counter(epoch_permutation(n, seed, 0)[0] for seed in range(trials))
    expected = trials / n
    assert sum((counts[v] - expected) ** 2 / expected for v in range(n)) < 27.88


def test_permutation_is_far_from_the_identity_and_differs_per_epoch() -> None:
    n = 4096
    first, second = epoch_permutation(n, 3, 0), epoch_permutation(n, 3, 1)
    fixed_points = sum(first[i] == i for i in range(n))
    in_place_neighbours = sum(first[i + 1] == first[i] + 1 for i in range(n - 1))
    agreements = sum(first[i] == second[i] for i in range(n))
    # A random permutation has about 1 of each; allow generous slack, still far from structure.
    assert fixed_points < 10
    assert in_place_neighbours < 10
    assert agreements < 10


def test_permutation_indexing_behaves_like_a_sequence() -> None:
    permutation = epoch_permutation(100, 5, 0)
    assert permutation[-1] == permutation[99]
    assert permutation[10:13] == [permutation[10], permutation[11], permutation[12]]
    assert 99 in permutation
    assert 100 not in permutation
    not_an_int: object = "x"
    assert not_an_int not in permutation
    with pytest.raises(IndexError):
        permutation[100]
    with pytest.raises(ValueError, match="not in the permutation"):
        permutation.index(100)
    with pytest.raises(ValueError, match="outside"):
        permutation.index(permutation[50], 0, 50)


@pytest.mark.parametrize(
    ("n", "seed", "epoch"), [(0, 0, 0), (MAX_DATASET_LEN + 1, 0, 0), (5, -1, 0), (5, 0, -1)]
)
def test_permutation_rejects_out_of_range_arguments(n: int, seed: int, epoch: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        epoch_permutation(n, seed, epoch)


def consume(
    order: GlobalOrder, cursor: DataCursor, steps: int, global_batch: int, world_size: int
) -> tuple[list[int], DataCursor]:
    """Run ``steps`` steps on ``world_size`` ranks; return the samples consumed and the cursor."""
    consumed: list[int] = []
    for _ in range(steps):
        for rank in range(world_size):
            consumed += order.rank_batch(cursor, global_batch, world_size, rank)
        cursor = order.advance(cursor, global_batch)
    return consumed, cursor


def each_epoch_is_a_permutation(consumed: list[int], n: int) -> bool:
    """No sample skipped or repeated: every complete epoch-long window holds each sample once."""
    return all(
        sorted(consumed[start : start + n]) == list(range(n))
        for start in range(0, len(consumed) - n + 1, n)
    )


@st.composite
def resumed_runs(draw: st.DrawFn) -> tuple[GlobalOrder, int, int, int, int, int]:
    order = GlobalOrder(draw(st.integers(1, 60)), draw(seeds), VERSION)
    w1, w2 = draw(world_sizes), draw(world_sizes)
    global_batch = math.lcm(w1, w2) * draw(st.integers(1, 3))
    total = draw(st.integers(0, 30))
    return order, w1, w2, global_batch, total, draw(st.integers(0, total))


@settings(max_examples=150, deadline=None)
@given(resumed_runs())
def test_restore_on_another_world_size_skips_and_repeats_nothing(
    run: tuple[GlobalOrder, int, int, int, int, int],
) -> None:
    order, w1, w2, global_batch, total, kill_step = run
    uninterrupted, _ = consume(order, order.start(w1), total, global_batch, w1)

    before, cursor = consume(order, order.start(w1), kill_step, global_batch, w1)
    restored = order.adopt(cursor, world_size=w2)  # as a restore on w2 ranks would
    after, _ = consume(order, restored, total - kill_step, global_batch, w2)

    assert before + after == uninterrupted
    assert uninterrupted == list(order.samples(order.start(), total * global_batch))
    assert each_epoch_is_a_permutation(uninterrupted, order.dataset_len)


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 60),
    seed=seeds,
    batches=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 12)), max_size=6),
)
def test_changing_the_global_batch_size_keeps_the_stream_exact(
    n: int, seed: int, batches: list[tuple[int, int]]
) -> None:
    """Runs of (world size w, steps) with global batch w * 3 each: the stream stays one prefix."""
    order = GlobalOrder(n, seed, VERSION)
    cursor, consumed = order.start(), []
    for world_size, steps in batches:
        more, cursor = consume(order, cursor, steps, world_size * 3, world_size)
        consumed += more
    assert consumed == list(order.samples(order.start(), len(consumed)))
    assert order.position(cursor) == len(consumed)
    assert each_epoch_is_a_permutation(consumed, n)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 50), seed=seeds, first=st.integers(0, 200), skipped=st.integers(0, 200))
def test_skip_leaves_out_exactly_the_skipped_samples(
    n: int, seed: int, first: int, skipped: int
) -> None:
    order = GlobalOrder(n, seed, VERSION)
    stream = list(order.samples(order.start(), first + skipped + n))
    cursor = order.skip(order.skip(order.start(), first), skipped)
    assert list(order.samples(cursor, n)) == stream[first + skipped :]


def test_a_global_batch_spans_the_epoch_boundary() -> None:
    order = GlobalOrder(10, 1, VERSION)
    cursor = order.cursor_at(8, 2)
    batch = order.rank_batch(cursor, 4, 2, 0) + order.rank_batch(cursor, 4, 2, 1)
    assert batch == [*epoch_permutation(10, 1, 0)[8:], *epoch_permutation(10, 1, 1)[:2]]
    assert order.advance(cursor, 4) == DataCursor(
        data_version=VERSION, seed=1, epoch=1, offset=2, world_size=2
    )
    assert order.batches_left_in_epoch(cursor, 4) == 1
    assert order.batches_left_in_epoch(order.start(), 4) == 3


def test_resuming_deep_into_a_huge_dataset_needs_no_materialisation() -> None:
    """10**12 samples, cursor 5 samples before the end of epoch 10**6: just offset arithmetic."""
    n = 10**12
    order = GlobalOrder(n, 11, VERSION)
    cursor = order.cursor_at(10**6 * n + n - 5, 4)
    batch = [i for rank in range(4) for i in order.rank_batch(cursor, 8, 4, rank)]
    old, new = epoch_permutation(n, 11, 10**6), epoch_permutation(n, 11, 10**6 + 1)
    assert batch == [old[n - 5 + i] for i in range(5)] + [new[i] for i in range(3)]
    assert [old.index(v) for v in batch[:5]] == list(range(n - 5, n))
    assert order.advance(cursor, 8, steps=10**9) == order.cursor_at(
        10**6 * n + n + 8 * 10**9 - 5, 4
    )


def test_adopt_checks_the_cursor_identity() -> None:
    order = GlobalOrder(10, 1, VERSION)
    cursor = order.cursor_at(27, 4)
    assert order.adopt(cursor, world_size=2) == order.cursor_at(27, 2)
    with pytest.raises(DataVersionMismatch, match="data version"):
        GlobalOrder(10, 1, "other").adopt(cursor)
    with pytest.raises(CursorMismatch, match="seed"):
        GlobalOrder(10, 2, VERSION).adopt(cursor)
    with pytest.raises(CursorMismatch, match="outside"):
        GlobalOrder(5, 1, VERSION).adopt(cursor)


def test_adopt_may_allow_a_data_version_change() -> None:
    cursor = GlobalOrder(10, 1, VERSION).cursor_at(27, 4)  # epoch 2, offset 7
    larger, smaller = GlobalOrder(20, 1, "v2"), GlobalOrder(5, 1, "v2")
    assert larger.adopt(cursor, allow_data_version_change=True) == larger.cursor_at(47, 4)
    assert smaller.adopt(cursor, allow_data_version_change=True) == smaller.cursor_at(15, 4)


@pytest.mark.parametrize(
    ("global_batch", "world_size", "rank", "message"),
    [(0, 1, 0, "global_batch_size"), (6, 4, 0, "does not divide"), (4, 2, 2, "outside")],
)
def test_rank_batch_rejects_inconsistent_shapes(
    global_batch: int, world_size: int, rank: int, message: str
) -> None:
    order = GlobalOrder(10, 1, VERSION)
    with pytest.raises(ValueError, match=message):
        order.rank_batch(order.start(), global_batch, world_size, rank)


def test_order_rejects_out_of_range_arguments() -> None:
    with pytest.raises(ValueError, match="dataset_len"):
        GlobalOrder(0, 1, VERSION)
    with pytest.raises(ValueError, match="seed"):
        GlobalOrder(1, 2**64, VERSION)
    with pytest.raises(ValueError, match="data_version"):
        GlobalOrder(1, 1, "")
    order = GlobalOrder(10, 1, VERSION)
    with pytest.raises(ValueError, match="n_samples"):
        order.skip(order.start(), -1)
    with pytest.raises(ValueError, match="count"):
        order.samples(order.start(), -1)
