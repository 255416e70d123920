"""The torch sampler with DataLoader worker processes: the cursor after a step is exact while
workers prefetch."""

from __future__ import annotations

import itertools

from torch.utils.data import DataLoader, Dataset

from trainguard.agent.data._cursor import GlobalOrder
from trainguard.agent.data._sampler import ResumableDistributedSampler
from trainguard.schemas._messages import DataCursor

VERSION = "sha256:" + "cd" * 32


class Indices(Dataset[int]):
    """A dataset whose sample ``i`` is ``i``, so batches show the indices the loader fetched."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def samplers(
    n: int, world_size: int, per_rank: int, seed: int, start: DataCursor | None = None
) -> list[ResumableDistributedSampler]:
    return [
        ResumableDistributedSampler(
            n,
            rank=rank,
            world_size=world_size,
            per_rank_batch_size=per_rank,
            seed=seed,
            data_version=VERSION,
            start=start,
        )
        for rank in range(world_size)
    ]


def expected_batches(
    order: GlobalOrder, start: DataCursor, global_batch: int, steps: int
) -> list[list[int]]:
    cursor, batches = start, []
    for _ in range(steps):
        batches.append(list(order.samples(cursor, global_batch)))
        cursor = order.advance(cursor, global_batch)
    return batches


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
