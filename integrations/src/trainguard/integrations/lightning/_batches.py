"""The training data as Lightning sees it: one endless stream of batches whose position is
trainguard's data cursor."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from trainguard.agent import ResumableDistributedSampler
from trainguard.schemas import DataCursor, StepRange

__all__ = ["ResumableBatches"]


class ResumableBatches:
    """A ``DataLoader`` over a :class:`~trainguard.agent.ResumableDistributedSampler`, passed
    over again and again: the ``train_dataloaders`` of a Lightning ``fit`` that trainguard
    restores at the exact data position.

    Each pass over ``loader`` yields the batches of one data epoch, and the next pass goes on
    from the sampler's cursor, so the stream never ends and Lightning sees a loader without a
    length: one Lightning epoch, ended by the trainer's ``max_steps``. Lightning's own epoch
    and batch counters therefore play no part in where the data stands, and a restore in the
    middle of a data epoch resumes with the batch that follows the snapshot's, where
    Lightning, for a loader that is not stateful, would start the epoch over (it has had no
    mid-epoch resume since 2.0).

    Lightning fetches a batch ahead of the one it trains, so the sampler's own ``cursor`` is
    one batch ahead of training; :meth:`cursor_after` names the position after a number of
    *trained* batches instead, which is what a checkpoint must hold.

    Args:
        loader: a loader whose ``sampler`` is a ``ResumableDistributedSampler`` and whose
            ``batch_size`` is the sampler's ``per_rank_batch_size``, without workers or with
            (``cursor_after`` is exact either way). Give it a ``generator`` of its own: every
            pass draws a seed from it, which must not come from torch's global generator that
            a restore puts back.

    Raises:
        TypeError: the loader's sampler is not a ``ResumableDistributedSampler``.
        ValueError: its batch size is not the sampler's ``per_rank_batch_size``.
    """

    def __init__(self, loader: DataLoader[Any]) -> None:
        sampler = loader.sampler
        if not isinstance(sampler, ResumableDistributedSampler):
            raise TypeError(
                "ResumableBatches needs a DataLoader whose sampler is a "
                f"trainguard.agent.ResumableDistributedSampler, got {type(sampler).__name__}"
            )
        if loader.batch_size != sampler.per_rank_batch_size:
            raise ValueError(
                f"the loader's batch_size {loader.batch_size} is not the sampler's "
                f"per_rank_batch_size {sampler.per_rank_batch_size}"
            )
        self.loader = loader
        self.sampler: ResumableDistributedSampler = sampler
        self._before_pass = 0  # batches of the finished passes since the origin
        self._in_pass = 0  # batches handed out by the live pass

    @property
    def batch_size(self) -> int:
        """Samples per rank per batch."""
        return self.sampler.per_rank_batch_size

    def __iter__(self) -> Iterator[Any]:
        """The batches from the sampler's position on, for ever (one live iteration at a time:
        a new one continues where the sampler stands)."""
        while True:
            self._before_pass += self._in_pass
            self._in_pass = 0
            for batch in self.loader:
                self._in_pass += 1
                yield batch

    def load(self, cursor: DataCursor, *, step: int, skip: StepRange | None = None) -> None:
        """Continue from ``cursor`` (a restore target's), the position after step ``step``,
        leaving out the batches of ``skip`` (the restore's :attr:`Agent.skip
        <trainguard.agent.Agent.skip>`) if given. Call it before the first iteration.

        Raises:
            DataVersionMismatch, CursorMismatch: as the sampler's ``load_state_dict``.
            ValueError: as the sampler's ``skip``.
        """
        self.sampler.load_state_dict(cursor)
        self._before_pass = self._in_pass = 0
        if skip is not None and skip.from_step > step:
            self.sampler.skip(skip, restored_step=step)

    def cursor_after(self, trained: int) -> DataCursor:
        """The data cursor after ``trained`` batches since the origin (the start, or the last
        :meth:`load`), whatever was fetched ahead.

        Raises:
            ValueError: ``trained`` is more batches than were handed out, or fewer than the
                finished passes hold (a count that is not this stream's).
        """
        if trained < self._before_pass:
            raise ValueError(
                f"{trained} batches trained, but {self._before_pass} were handed out before "
                "the live pass began: the count is not this stream's"
            )
        return self.sampler.cursor_after(trained - self._before_pass)
