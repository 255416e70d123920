"""Helpers of the sampler tests (unit and worker-process ones): a dataset of indices, one
sampler per rank, and the batches the cursor arithmetic says a loader yields."""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset

from trainguard.agent.data._cursor import GlobalOrder
from trainguard.agent.data._sampler import ResumableDistributedSampler
from trainguard.schemas import DataCursor

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


def loaders(ranks: list[ResumableDistributedSampler], n: int) -> list[DataLoader[int]]:
    return [
        DataLoader(Indices(n), batch_size=s.per_rank_batch_size, sampler=s, shuffle=False)
        for s in ranks
    ]


def train(
    ranks: list[ResumableDistributedSampler], n: int, steps: int
) -> tuple[list[list[int]], DataCursor]:
    """Run ``steps`` lockstep steps over the ranks' loaders, starting new passes as needed.

    Returns each step's global batch (ranks' batches concatenated in rank order) and the
    cursor after the last step, checked to be the same on every rank.
    """
    batches: list[list[int]] = []
    iterators = [iter(loader) for loader in loaders(ranks, n)]
    done_in_pass = 0
    while len(batches) < steps:
        try:
            step = [next(it) for it in iterators]
        except StopIteration:
            iterators, done_in_pass = [iter(loader) for loader in loaders(ranks, n)], 0
            continue
        done_in_pass += 1
        batches.append([i for batch in step for i in batch.tolist()])
    cursors = {s.cursor_after(done_in_pass) for s in ranks}
    assert len(cursors) == 1
    cursor = cursors.pop()
    assert all(s.cursor == cursor for s in ranks)  # no prefetch with num_workers=0
    return batches, cursor


def expected_batches(
    order: GlobalOrder, start: DataCursor, global_batch: int, steps: int
) -> list[list[int]]:
    cursor, batches = start, []
    for _ in range(steps):
        batches.append(list(order.samples(cursor, global_batch)))
        cursor = order.advance(cursor, global_batch)
    return batches
