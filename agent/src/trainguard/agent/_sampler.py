"""A torch ``Sampler`` that hands this rank its share of the job's global order, resumably."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Sampler

from trainguard.agent._cursor import GlobalOrder
from trainguard.schemas._messages import DataCursor

__all__ = ["ResumableDistributedSampler"]


@dataclass(slots=True)
class _Pass:
    """One iteration over the sampler: where it started, its length and what it has yielded.

    ``length`` and ``yielded`` count this rank's indices.
    """

    start: DataCursor
    length: int
    yielded: int = 0


class ResumableDistributedSampler(Sampler[int]):
    """Yields this rank's sample indices of the job's global order, from a restorable cursor.

    The order and the split between ranks are :class:`~trainguard.agent._cursor.GlobalOrder`'s:
    each step the ranks together consume the next ``world_size * per_rank_batch_size`` samples
    of a per-epoch shuffled stream, rank ``r`` the ``r``-th contiguous slice. Use it with a
    plain loader, one loader batch per training step::

        sampler = ResumableDistributedSampler(
            len(dataset), rank=rank, world_size=world_size, per_rank_batch_size=b,
            seed=seed, data_version=version, start=restored_cursor_or_None,
        )
        loader = DataLoader(dataset, batch_size=b, sampler=sampler, shuffle=False)
        while not done:
            for steps, batch in enumerate(loader, start=1):
                ...  # train on batch
                cursor = sampler.cursor_after(steps)  # the checkpoint's data cursor

    A "step" here is one loader batch on every rank; with gradient accumulation, count loader
    batches (micro-batches), not optimizer steps, and checkpoint between whole optimizer steps.

    **Epochs are implicit.** The epoch is part of the cursor, so there is no ``set_epoch``:
    one pass over the loader yields the global batches that *start* in the current data epoch
    (the last one may reach into the next epoch, as batches never drop or wrap samples), and
    the next pass continues exactly where the previous one stopped. Each pass's length is
    ``len(loader)``; loops counting epochs keep working, loops counting steps simply iterate
    the loader again.

    **Which cursor to save.** :meth:`cursor_after` counts steps from :attr:`start_cursor`, the
    cursor the current pass started at, and is exact with any loader. :attr:`cursor` and
    :meth:`state_dict` report the global batches whose indices this rank has *handed out*; a
    loader with ``num_workers > 0`` fetches indices ahead of training (``prefetch_factor``
    batches per worker), so with workers only :meth:`cursor_after` names what was trained on.
    Starting a new pass (``iter(loader)``) begins at :attr:`cursor`, so a pass abandoned with
    prefetched batches skips them unless :meth:`load_state_dict` is called with the right cursor
    first. One pass is live at a time; an older iterator keeps yielding its own pass's indices.

    Args:
        dataset_len: number of samples in the dataset, >= 1.
        rank: this process's rank in ``[0, world_size)``.
        world_size: number of data-parallel ranks, >= 1.
        per_rank_batch_size: samples per rank per step (the loader's ``batch_size``), >= 1.
        seed: unsigned 64-bit seed of the epoch permutations; the same on every rank (never
            ``torch.initial_seed()``, which differs by rank in a process that did not seed
            torch: the daemon fails a job whose ranks' cursors disagree, docs/recovery.md).
        data_version: the dataset's version (``dataset_version``), the same on every rank.
        start: cursor to resume from (e.g. from a checkpoint), taken on any world size and
            global batch size; ``None`` starts at epoch 0, offset 0.
        allow_data_version_change: accept a ``start`` of another data version (see
            :meth:`GlobalOrder.adopt`).

    Raises:
        ValueError: an argument is out of range.
        DataVersionMismatch: ``start`` has another data version.
        CursorMismatch: ``start`` has another seed or lies outside the dataset.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        rank: int,
        world_size: int,
        per_rank_batch_size: int,
        seed: int,
        data_version: str,
        start: DataCursor | None = None,
        allow_data_version_change: bool = False,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if per_rank_batch_size < 1:
            raise ValueError(f"per_rank_batch_size must be >= 1, got {per_rank_batch_size}")
        self.order = GlobalOrder(dataset_len, seed, data_version)
        self.rank = rank
        self.world_size = world_size
        self.per_rank_batch_size = per_rank_batch_size
        self._pass = self._new_pass(self.order.start(world_size))
        if start is not None:
            self.load_state_dict(start, allow_data_version_change=allow_data_version_change)

    @property
    def global_batch_size(self) -> int:
        """Samples consumed by all ranks together per step."""
        return self.world_size * self.per_rank_batch_size

    @property
    def start_cursor(self) -> DataCursor:
        """The cursor the live (or last) pass started at; before the first pass, the start."""
        return self._pass.start

    @property
    def cursor(self) -> DataCursor:
        """The cursor after every global batch whose indices this rank has fully yielded.

        Equals the training position only if the loader does not prefetch (``num_workers=0``);
        see the class docstring.
        """
        steps = self._pass.yielded // self.per_rank_batch_size
        return self.order.advance(self._pass.start, self.global_batch_size, steps)

    def cursor_after(self, steps: int) -> DataCursor:
        """The cursor after ``steps`` (>= 0) global batches counted from :attr:`start_cursor`.

        Raises:
            ValueError: ``steps < 0``.
        """
        return self.order.advance(self._pass.start, self.global_batch_size, steps)

    def state_dict(self) -> dict[str, Any]:
        """:attr:`cursor` as a plain dict of the :class:`DataCursor` fields.

        Plain ``str``/``int`` values, so it survives ``torch.load(weights_only=True)``.
        """
        return dataclasses.asdict(self.cursor)

    def load_state_dict(
        self,
        state: DataCursor | Mapping[str, Any],
        *,
        allow_data_version_change: bool = False,
    ) -> None:
        """Resume at ``state`` (a cursor, or a :meth:`state_dict`) from the next pass on.

        The cursor may come from a run with another world size or global batch size; the
        remaining global order is re-partitioned over this sampler's ranks.

        Raises:
            TypeError: ``state`` lacks a cursor field or has an unknown one.
            DataVersionMismatch: other data version and not ``allow_data_version_change``.
            CursorMismatch: other seed, or outside the dataset.
        """
        cursor = state if isinstance(state, DataCursor) else DataCursor(**state)
        adopted = self.order.adopt(
            cursor,
            world_size=self.world_size,
            allow_data_version_change=allow_data_version_change,
        )
        self._pass = self._new_pass(adopted)

    def __len__(self) -> int:
        """Indices this rank yields in the live pass, or in the next one once it is finished."""
        if self._pass.yielded < self._pass.length:
            return self._pass.length
        return self._new_pass(self.cursor).length

    def __iter__(self) -> Iterator[int]:
        """Start a new pass at :attr:`cursor` and return its indices, in order."""
        run = self._new_pass(self.cursor)
        self._pass = run
        return self._indices(run)

    def _new_pass(self, start: DataCursor) -> _Pass:
        steps = self.order.batches_left_in_epoch(start, self.global_batch_size)
        return _Pass(start, steps * self.per_rank_batch_size)

    def _indices(self, run: _Pass) -> Iterator[int]:
        order, batch = self.order, self.global_batch_size
        cursor = run.start
        for _ in range(run.length // self.per_rank_batch_size):
            for index in order.rank_batch(cursor, batch, self.world_size, self.rank):
                # Counted before the yield: once the consumer holds an index, it is counted.
                run.yielded += 1
                yield index
            cursor = order.advance(cursor, batch)
