"""The torch sampler with DataLoader worker processes: the cursor after a step is exact while
workers prefetch."""

from __future__ import annotations

import itertools

from torch.utils.data import DataLoader

from tests.support.samplers import Indices, expected_batches, samplers


def test_cursor_after_is_exact_while_workers_prefetch() -> None:
    n, per_rank = 64, 2
    (sampler,) = samplers(n, 1, per_rank, seed=1)
    loader = DataLoader(
        Indices(n), batch_size=per_rank, sampler=sampler, num_workers=1, prefetch_factor=4
    )
    consumed = list(itertools.islice(loader, 3))
    order = sampler.order
    assert sampler.cursor_after(3) == order.advance(order.start(), per_rank, 3)
    assert [b.tolist() for b in consumed] == expected_batches(order, order.start(), per_rank, 3)
    assert order.position(sampler.cursor) > 3 * per_rank  # handed out ahead of training
