"""A torch ``Sampler`` that hands this rank its share of the job's global order, resumably."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Sampler

from trainguard.agent.data._cursor import GlobalOrder
from trainguard.schemas import DataCursor, StepRange

__all__ = ["ResumableDistributedSampler"]


@dataclass(frozen=True, slots=True)
class _Skip:
    """Batches the stream leaves out: after ``after`` batches counted from the origin, the
    next ``batches`` global batches are skipped (a restore's ``skip``)."""

    after: int
    batches: int


@dataclass(slots=True)
class _Pass:
    """One iteration over the sampler, and the stream it draws from.

    Batches are counted from ``origin`` (a stream position: the sampler's start, or the last
    cursor loaded), with ``skip`` leaving some out; the pass yields the batches from number
    ``first`` on. ``length`` and ``yielded`` count this rank's indices.
    """

    origin: int
    skip: _Skip | None
    first: int
    length: int = 0
    yielded: int = 0

    def shift(self, batch: int, *, starting: bool) -> int:
        """Batches the skip puts before batch ``batch`` starts (``starting``), or into the
        position once ``batch`` batches are done (the skip comes with the next batch)."""
        skip = self.skip
        if skip is None:
            return 0
        reached = batch >= skip.after if starting else batch > skip.after
        return skip.batches if reached else 0

    def start(self, batch: int, size: int) -> int:
        """Stream position where batch ``batch`` (0-based) of ``size`` samples starts."""
        return self.origin + (batch + self.shift(batch, starting=True)) * size

    def after(self, batches: int, size: int) -> int:
        """Stream position after ``batches`` batches of ``size`` samples."""
        return self.origin + (batches + self.shift(batches, starting=False)) * size

    def batches_in_epoch(self, size: int, dataset_len: int) -> int:
        """Batches from ``first`` on that start in the epoch batch ``first`` starts in (>= 1;
        the last may reach into the next epoch)."""
        end = (self.start(self.first, size) // dataset_len + 1) * dataset_len
        # Batch j starts before ``end`` iff j < bound - shift (shift constant on each side
        # of the skip).
        bound = -(-(end - self.origin) // size)
        skip = self.skip
        if skip is None or self.first >= skip.after:
            last = bound - self.shift(self.first, starting=True)
        elif bound <= skip.after:  # the epoch ends before the skip
            last = bound
        else:
            last = max(skip.after, bound - skip.batches)
        return last - self.first


class ResumableDistributedSampler(Sampler[int]):
    """Yields this rank's sample indices of the job's global order, from a restorable cursor,
    and knows which batches it has handed out: its :meth:`state_dict` is the data cursor to
    checkpoint, across any number of epochs.

    The order and the split between ranks are :class:`~trainguard.agent.data._cursor.GlobalOrder`'s:
    each step the ranks together consume the next ``world_size * per_rank_batch_size`` samples
    of a per-epoch shuffled stream, rank ``r`` the ``r``-th contiguous slice. Use it with a
    plain loader without workers, one loader batch per training step (the loop of the
    repository's README)::

        sampler = ResumableDistributedSampler(
            len(dataset), rank=rank, world_size=world_size, per_rank_batch_size=b,
            seed=seed, data_version=version,
        )
        loader = DataLoader(dataset, batch_size=b, sampler=sampler, generator=g)
        step = 0
        if target is not None:                          # a restore
            sampler.load_state_dict(target.cursor)
            step = target.step
        if skip is not None:                            # the restore's agent.skip
            sampler.skip(skip, restored_step=step)
        while step < total_steps:                       # one pass per epoch
            for batch in loader:
                step += 1
                ...  # train on batch
                cursor = sampler.cursor                 # the checkpoint's data cursor

    A "step" here is one loader batch on every rank; with gradient accumulation, count loader
    batches (micro-batches), not optimizer steps, and checkpoint between whole optimizer steps.

    **Epochs are implicit.** The epoch is part of the cursor, so there is no ``set_epoch``:
    one pass over the loader yields the global batches that *start* in the current data epoch
    (the last one may reach into the next epoch, as batches never drop or wrap samples), and
    the next pass continues exactly where the previous one stopped. Each pass's length is
    ``len(loader)``; loops counting epochs keep working, loops counting steps simply iterate
    the loader again.

    **Which cursor to save.** :attr:`cursor` and :meth:`state_dict` name the position after
    every global batch whose indices this rank has *handed out*, counted across passes since
    the sampler's origin (its ``start``, or the last :meth:`load_state_dict`), skips included.
    A loader without workers asks for a batch's indices only when the loop asks for the batch,
    so that is exactly what was trained on. A loader with ``num_workers > 0`` fetches indices
    ahead of training (``prefetch_factor`` batches per worker): count the batches of each pass
    (``for n, batch in enumerate(loader, start=1)``) and save :meth:`cursor_after` ``(n)``,
    which counts from the start of the live pass and is exact with any loader. It refuses a
    count larger than the batches the pass has handed out (a count carried over from an earlier
    pass, which would name a later epoch). Starting a new pass (``iter(loader)``) begins at
    :attr:`cursor`, so a pass abandoned with prefetched batches skips them unless
    :meth:`load_state_dict` is called with the right cursor first. One pass is live at a time;
    an older iterator keeps yielding its own pass's indices.

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
        self._pass = self._new_pass(0, None, 0)
        if start is not None:
            self.load_state_dict(start, allow_data_version_change=allow_data_version_change)

    @property
    def global_batch_size(self) -> int:
        """Samples consumed by all ranks together per step."""
        return self.world_size * self.per_rank_batch_size

    @property
    def start_cursor(self) -> DataCursor:
        """The cursor the live (or last) pass started from: the position after the batches
        handed out before it (its first batch starts there, or after a skip scheduled there);
        before the first pass, the origin."""
        return self._cursor(self._pass.first)

    @property
    def cursor(self) -> DataCursor:
        """The cursor after every global batch whose indices this rank has fully yielded, in
        all passes since the origin: the data cursor to checkpoint with a loader without
        workers (``num_workers=0``); see the class docstring for loaders with workers."""
        return self._cursor(self._handed_out())

    def cursor_after(self, steps: int) -> DataCursor:
        """The cursor after ``steps`` global batches of the live pass (counted from
        :attr:`start_cursor`): exact whatever the loader prefetches.

        Raises:
            ValueError: ``steps < 0``, or more batches than the live pass has handed out: the
                count is not this pass's (e.g. steps since a restore, once the loop went over
                the loader again), and would name a later position than any trained.
        """
        handed = self._pass.yielded // self.per_rank_batch_size
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if steps > handed:
            began = self.start_cursor
            raise ValueError(
                f"cursor_after({steps}): the live pass over the loader, which started at epoch "
                f"{began.epoch} offset {began.offset}, has handed out {handed} batches, so "
                f"{steps} of its batches cannot have been trained: count the batches of the "
                "current pass (enumerate(loader, start=1) inside the epoch loop), or save "
                "sampler.cursor, which counts across passes"
            )
        return self._cursor(self._pass.first + steps)

    def skip(self, steps: StepRange, *, restored_step: int) -> None:
        """Leave out the batches of ``steps`` (a restore's :attr:`Agent.skip`): the batches of
        the steps after ``restored_step`` follow as usual until the one of ``steps.from_step``,
        which comes ``steps.to_step - steps.from_step + 1`` global batches later in the stream
        (the batches that made a loss spike are never trained again). Step numbers are the
        caller's and stay as they are.

        Call it right after :meth:`load_state_dict` (or on a fresh sampler, ``restored_step``
        0), before iterating the loader: ``restored_step`` is the step the origin stands for
        (the restore target's step). :attr:`cursor` and :meth:`state_dict` count the skipped
        batches once the loop has passed ``from_step - 1``, so an acknowledgement or a
        checkpoint before it names the position without them. A new pass starts from the next
        ``iter(loader)`` on. A skip replaces any earlier one.

        Raises:
            ValueError: ``steps.from_step <= restored_step``, or the batch of ``from_step``
                was handed out already.
        """
        after = steps.from_step - restored_step - 1
        if after < 0:
            raise ValueError(
                f"skip of steps {steps.from_step}-{steps.to_step} starts before step "
                f"{restored_step + 1}, the first step after the restored one"
            )
        handed = self._handed_out()
        if after < handed:
            raise ValueError(
                f"skip of steps {steps.from_step}-{steps.to_step}: the batch of step "
                f"{steps.from_step} was handed out already ({handed} batches since step "
                f"{restored_step})"
            )
        self._pass = self._new_pass(
            self._pass.origin, _Skip(after, steps.to_step - steps.from_step + 1), handed
        )

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
        """Resume at ``state`` (a cursor, or a :meth:`state_dict`) from the next pass on; it
        becomes the origin that :attr:`cursor` counts from, and any skip is dropped.

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
        self._pass = self._new_pass(self.order.position(adopted), None, 0)

    def __len__(self) -> int:
        """Indices this rank yields in the live pass, or in the next one once it is finished."""
        live = self._pass
        if live.yielded < live.length:
            return live.length
        return self._new_pass(live.origin, live.skip, self._handed_out()).length

    def __iter__(self) -> Iterator[int]:
        """Start a new pass at :attr:`cursor` and return its indices, in order."""
        live = self._pass
        run = self._new_pass(live.origin, live.skip, self._handed_out())
        self._pass = run
        return self._indices(run)

    def _handed_out(self) -> int:
        """Global batches whose indices this rank has fully yielded since the origin."""
        return self._pass.first + self._pass.yielded // self.per_rank_batch_size

    def _cursor(self, batches: int) -> DataCursor:
        """The cursor after ``batches`` global batches since the origin."""
        position = self._pass.after(batches, self.global_batch_size)
        return self.order.cursor_at(position, self.world_size)

    def _new_pass(self, origin: int, skip: _Skip | None, first: int) -> _Pass:
        run = _Pass(origin, skip, first)
        steps = run.batches_in_epoch(self.global_batch_size, self.order.dataset_len)
        run.length = steps * self.per_rank_batch_size
        return run

    def _indices(self, run: _Pass) -> Iterator[int]:
        order, size = self.order, self.global_batch_size
        for batch in range(run.first, run.first + run.length // self.per_rank_batch_size):
            cursor = order.cursor_at(run.start(batch, size), self.world_size)
            for index in order.rank_batch(cursor, size, self.world_size, self.rank):
                # Counted before the yield: once the consumer holds an index, it is counted.
                run.yielded += 1
                yield index
