"""Helpers of the StatefulDataLoader tests: one rank's loader over a
``ResumableDistributedSampler`` with its :class:`LoaderState`, lockstep training over the ranks
of a world, and a job run as its own process (``python -m tests.support.stateful_loaders``)
that saves its loader state after ``k`` batches and kills itself, or resumes from such a state.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from tests.support.samplers import VERSION, Indices
from trainguard.agent.data._loader import LoaderState
from trainguard.agent.data._sampler import ResumableDistributedSampler
from trainguard.schemas import DataCursor


def rank_loader(
    n: int,
    *,
    rank: int,
    world_size: int,
    per_rank: int,
    seed: int,
    num_workers: int,
    start: DataCursor | None = None,
) -> LoaderState:
    """Rank ``rank``'s loader of the dataset :class:`Indices` ``(n)`` (``prefetch_factor=2``
    with workers), wrapped in its :class:`LoaderState`."""
    sampler = ResumableDistributedSampler(
        n,
        rank=rank,
        world_size=world_size,
        per_rank_batch_size=per_rank,
        seed=seed,
        data_version=VERSION,
        start=start,
    )
    loader = StatefulDataLoader(
        Indices(n),
        batch_size=per_rank,
        sampler=sampler,
        num_workers=num_workers,
        prefetch_factor=2 if num_workers else None,
        generator=torch.Generator().manual_seed(seed),
    )
    return LoaderState(loader, rank=rank, world_size=world_size)


def world(n: int, world_size: int, per_rank: int, seed: int, num_workers: int) -> list[LoaderState]:
    """One :func:`rank_loader` per rank of ``world_size``."""
    return [
        rank_loader(
            n,
            rank=rank,
            world_size=world_size,
            per_rank=per_rank,
            seed=seed,
            num_workers=num_workers,
        )
        for rank in range(world_size)
    ]


class Lockstep:
    """The ranks' loaders stepped together, as a training loop does (``for batch in loader``
    inside ``while step < total``): a new pass over every loader when the passes end."""

    def __init__(self, ranks: Sequence[LoaderState]) -> None:
        self.ranks = list(ranks)
        self._iterators: list[Any] | None = None

    def steps(self, count: int) -> list[list[int]]:
        """The next ``count`` global batches (ranks' batches concatenated in rank order)."""
        batches: list[list[int]] = []
        while len(batches) < count:
            if self._iterators is None:
                self._iterators = [iter(r.loader) for r in self.ranks]
            try:
                step = [next(it) for it in self._iterators]
            except StopIteration:
                self._iterators = None
                continue
            batches.append([i for batch in step for i in batch.tolist()])
        return batches

    def cursor(self) -> DataCursor:
        """The consumed cursor, checked to be the same on every rank."""
        cursors = {r.cursor for r in self.ranks}
        assert len(cursors) == 1, cursors
        return cursors.pop()


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--per-rank", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True, help="steps of the whole job")
    parser.add_argument("--kill-after", type=int, help="save after this step and SIGKILL")
    parser.add_argument("--state", type=Path, required=True, help="torch.save file of the state")
    parser.add_argument("--ids", type=Path, required=True, help="JSON file of the batches")
    args = parser.parse_args()
    position = rank_loader(
        args.n, rank=0, world_size=1, per_rank=args.per_rank, seed=args.seed, num_workers=2
    )
    run = Lockstep([position])
    if args.kill_after is None:
        saved = torch.load(args.state, weights_only=True)
        position.load_state_dict(saved["loader"])
        args.ids.write_text(json.dumps(run.steps(args.steps - saved["step"])))
        return
    batches = run.steps(args.kill_after)
    args.ids.write_text(json.dumps(batches))
    torch.save({"loader": position.state_dict(), "step": args.kill_after}, args.state)
    # Killed with its workers alive and batches prefetched: nothing gets to clean up.
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    _main()
