"""One rank's torchdata ``StatefulDataLoader`` in trainguard checkpoints: the loader state to
save, the data cursor of what the training loop consumed, and a restore that reshards what can
be resharded and refuses what cannot.

**What the loader's state holds** (torchdata 0.11, ``stateful_dataloader.py``). Without
workers, ``state_dict()`` is taken live: the sampler's state when asked, so exactly what the
loop consumed. With ``num_workers > 0`` the main process hands indices to the workers ahead of
the loop (``prefetch_factor`` batches per worker), so the sampler itself stands ahead of
training. torchdata therefore records the sampler's state (``_main_snapshot``) each time it
hands out a batch's indices, and when the loop receives batch ``k`` it keeps the record of
batch ``k`` as its snapshot, with the workers' states that came with it; ``state_dict()``
returns that snapshot plus ``_steps_since_snapshot``, the batches yielded since. With
``snapshot_every_n_steps=1`` (the default) that count is 0 and the snapshot's sampler state is
the position after the batches the loop received; prefetched batches are not in it. Loading
the state restarts the workers, loads the sampler state when the next pass begins, and
prefetches anew from there.

With :class:`~trainguard.agent.data._sampler.ResumableDistributedSampler` as the loader's
``sampler`` the sampler state is a :class:`DataCursor`, world-size independent: that is the
cursor :attr:`LoaderState.cursor` reports and the position a restore onto any world size
starts from. Any other sampler's state (and an ``IterableDataset``'s) is per rank and opaque.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from trainguard.agent._errors import AgentError
from trainguard.agent.data._sampler import ResumableDistributedSampler
from trainguard.schemas import DataCursor

__all__ = ["LoaderState", "LoaderStateNotReshardable"]

# Keys of torchdata's state dict (stateful_dataloader.py and sampler.py, torchdata 0.11).
_SNAPSHOT = "_snapshot"
_MAIN_SNAPSHOT = "_main_snapshot"
_SAMPLER_ITER_STATE = "_sampler_iter_state"
_NUM_WORKERS = "_num_workers"
_SAMPLER_STATE = "sampler_state"  # the BatchSampler iterator's copy of its sampler's state
_ITERATOR_FINISHED = "_iterator_finished"

_FIELDS = frozenset({"rank", "world_size", "cursor", "loader"})


class LoaderStateNotReshardable(AgentError, ValueError):
    """A loader state saved on another rank or world size cannot be loaded here: the loader's
    position is per-rank, opaque state (its sampler is not a ``ResumableDistributedSampler``,
    or its dataset is an ``IterableDataset``), which no rule maps onto other ranks."""


def _plain(value: Any, where: str) -> Any:
    """A detached copy of ``value`` made of what ``torch.load(weights_only=True)`` loads:
    ``dict`` (any mapping becomes one), ``list``, ``tuple``, ``str``, ``bytes``, ``int``,
    ``float``, ``bool``, ``None`` and tensors (copied to the CPU).

    Raises:
        TypeError: a value of another type, named by its path from ``where``.
    """
    if value is None or isinstance(value, str | bytes | int | float):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {_plain(k, f"{where} key"): _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise TypeError(
        f"{where} is a {type(value).__qualname__}, which torch.load(weights_only=True) does "
        "not load: the dataset's or sampler's state_dict must hold only dicts, lists, tuples, "
        "str, bytes, int, float, bool, None and tensors"
    )


def _main_state(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """The part of a loader state that holds the sampler's: the snapshot's main-process state
    with workers, the state itself without."""
    return state[_SNAPSHOT][_MAIN_SNAPSHOT] if _SNAPSHOT in state else state


def _workers(state: Mapping[str, Any]) -> int:
    """The number of worker processes of the loader that saved ``state``."""
    return int(state[_SNAPSHOT][_MAIN_SNAPSHOT][_NUM_WORKERS]) if _SNAPSHOT in state else 0


def _without_sampler(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` without the sampler's state (a copy; the rest shared)."""
    main = dict(_main_state(state))
    main[_SAMPLER_ITER_STATE] = {
        k: v for k, v in main[_SAMPLER_ITER_STATE].items() if k != _SAMPLER_STATE
    }
    if _SNAPSHOT not in state:
        return main
    return {**state, _SNAPSHOT: {**state[_SNAPSHOT], _MAIN_SNAPSHOT: main}}


class LoaderState:
    """Checkpoints one rank's ``torchdata.stateful_dataloader.StatefulDataLoader``, with
    worker processes and prefetching, and reports the data cursor of what the loop consumed.

    Save :meth:`state_dict` in the ``state`` given to ``agent.checkpoint`` and :attr:`cursor`
    as its ``cursor=``; on a restore pass the saved state (from ``agent.load``) to
    :meth:`load_state_dict` before iterating the loader::

        sampler = ResumableDistributedSampler(len(dataset), rank=rank, world_size=world_size,
                                              per_rank_batch_size=8, seed=0,
                                              data_version=version)
        loader = StatefulDataLoader(dataset, batch_size=8, sampler=sampler, num_workers=2,
                                    generator=torch.Generator())
        position = LoaderState(loader, rank=rank, world_size=world_size)
        if target is not None:                        # a restore
            state = agent.load(target)  # ranks beyond the snapshot's world size: target.cursor
            position.load_state_dict(state["loader"])
            step = target.step
        if agent.skip is not None:
            sampler.skip(agent.skip, restored_step=step)
        agent.ready(step, cursor=position.cursor)
        ...
            agent.checkpoint(step, {"model": ..., "loader": position.state_dict()},
                             cursor=position.cursor)

    **Resharding.** With a ``ResumableDistributedSampler`` the state carries the consumed
    :class:`DataCursor`, a global sample offset; a state saved on another rank or world size
    (or the snapshot's cursor itself) positions the sampler there and the loader starts afresh,
    the remaining global order split over the new ranks: nothing skipped or repeated. Any other
    loader's state loads only on the rank and world size that saved it
    (:class:`LoaderStateNotReshardable` otherwise).

    Args:
        loader: this rank's loader. With a ``ResumableDistributedSampler`` as its ``sampler``
            its ``batch_size`` must be the sampler's ``per_rank_batch_size``, and with workers
            it must keep ``snapshot_every_n_steps=1`` and ``in_order=True`` (the defaults), the
            settings under which its state is the consumed position.
        rank: this process's data-parallel rank in ``[0, world_size)``.
        world_size: number of data-parallel ranks, >= 1.

    Raises:
        TypeError: ``loader`` is not a ``StatefulDataLoader``.
        ValueError: ``rank``/``world_size`` out of range or not the sampler's, or a loader
            setting above is not met.
    """

    def __init__(self, loader: StatefulDataLoader, *, rank: int, world_size: int) -> None:
        if not isinstance(loader, StatefulDataLoader):
            raise TypeError(
                f"expected a torchdata StatefulDataLoader, got {type(loader).__qualname__}"
            )
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        sampler = loader.sampler
        if isinstance(sampler, ResumableDistributedSampler):
            if (sampler.rank, sampler.world_size) != (rank, world_size):
                raise ValueError(
                    f"the loader's sampler is rank {sampler.rank} of world size "
                    f"{sampler.world_size}, not rank {rank} of {world_size}"
                )
            if loader.batch_size != sampler.per_rank_batch_size:
                raise ValueError(
                    f"the loader's batch_size {loader.batch_size} is not the sampler's "
                    f"per_rank_batch_size {sampler.per_rank_batch_size}"
                )
            if loader.num_workers > 0 and (
                loader.snapshot_every_n_steps != 1 or not loader.in_order
            ):
                raise ValueError(
                    "with workers the loader must keep snapshot_every_n_steps=1 and "
                    "in_order=True: otherwise its state is a position before the batches it "
                    "yielded (replayed on load), not the consumed position a cursor names"
                )
        self.loader = loader
        self.rank = rank
        self.world_size = world_size
        self._sampler = sampler if isinstance(sampler, ResumableDistributedSampler) else None
        # The cursor last loaded: the consumed position until the loader yields a batch (its
        # restored snapshot carries no sampler state, see load_state_dict).
        self._loaded: DataCursor | None = None

    @property
    def cursor(self) -> DataCursor:
        """The data cursor after the batches the loop has received from the loader, prefetched
        ones not counted: the ``cursor=`` for ``agent.checkpoint`` and ``agent.ready``. Reading it before the first pass starts the loader's workers, which
        the next ``iter(loader)`` then uses.

        Raises:
            TypeError: the loader's sampler is not a ``ResumableDistributedSampler``.
        """
        self._require_sampler()
        return self._consumed(self.loader.state_dict())

    def state_dict(self) -> dict[str, Any]:
        """This rank's state to checkpoint: ``{"rank", "world_size", "cursor", "loader"}``,
        the loader's ``state_dict()`` copied (detached from the live loader, so a background
        checkpoint write may serialize it while training goes on) and :attr:`cursor` as a
        plain dict (``None`` with another sampler). It survives
        ``torch.load(weights_only=True)``.

        Raises:
            TypeError: the loader state holds a value ``weights_only`` does not load (from a
                dataset's or sampler's own ``state_dict``); the message names where.
        """
        loader = _plain(self.loader.state_dict(), "loader state")
        cursor = None if self._sampler is None else dataclasses.asdict(self._consumed(loader))
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "cursor": cursor,
            "loader": loader,
        }

    def load_state_dict(self, state: Mapping[str, Any] | DataCursor) -> None:
        """Resume the loader at ``state``: a :meth:`state_dict` saved by any rank of a
        snapshot, or the snapshot's :class:`DataCursor` (for a rank the snapshot has no shard
        of). Call it before the loader's next pass.

        With a ``ResumableDistributedSampler`` the sampler is positioned at the saved cursor
        at once (so ``sampler.skip`` may follow); a state of this rank and world size also
        restores the rest of the loader's state (workers' dataset states, seeds), unless its
        pass had ended or it had another number of workers; otherwise the loader starts
        afresh from the cursor. Any other loader loads its state as it is. Use one
        ``LoaderState`` per loader: it remembers the cursor it loaded.

        Raises:
            LoaderStateNotReshardable: the loader's sampler is not a
                ``ResumableDistributedSampler`` and ``state`` comes from another rank or world
                size, or is a cursor.
            TypeError: ``state`` is not a :meth:`state_dict`.
            ValueError: ``state`` was saved over a ``ResumableDistributedSampler`` and this
                loader's sampler is another one, or the other way round.
            DataVersionMismatch, CursorMismatch: the cursor does not fit the sampler (see
                ``ResumableDistributedSampler.load_state_dict``).
        """
        if isinstance(state, DataCursor):
            if self._sampler is None:
                raise self._refusal("a data cursor alone")
            self._load_cursor(state, None)
            return
        if set(state) != _FIELDS:
            raise TypeError(
                f"not a LoaderState.state_dict(): expected the keys {sorted(_FIELDS)}, got "
                f"{sorted(state)}"
            )
        same = (state["rank"], state["world_size"]) == (self.rank, self.world_size)
        if (state["cursor"] is None) != (self._sampler is None):
            saved = (
                "another sampler" if state["cursor"] is None else "a ResumableDistributedSampler"
            )
            raise ValueError(
                f"the state was saved from a loader over {saved}, this loader's sampler is a "
                f"{type(self.loader.sampler).__qualname__}"
            )
        if self._sampler is None:
            if not same:
                raise self._refusal(
                    f"the state of rank {state['rank']} of world size {state['world_size']}"
                )
            self.loader.load_state_dict(dict(state["loader"]))
            return
        loader = state["loader"]
        resume = (
            same and not loader[_ITERATOR_FINISHED] and _workers(loader) == self.loader.num_workers
        )
        self._load_cursor(DataCursor(**state["cursor"]), loader if resume else None)

    def _load_cursor(self, cursor: DataCursor, loader: Mapping[str, Any] | None) -> None:
        sampler = self._require_sampler()
        sampler.load_state_dict(cursor)
        # torchdata would load the sampler's state once more when the restored pass starts,
        # which drops a skip scheduled in between: the sampler is positioned already. A state
        # whose pass had ended is not loaded either: torchdata would prefetch from the cursor,
        # drop that iterator and start a new pass after the prefetched batches.
        self.loader.load_state_dict({} if loader is None else _without_sampler(loader))
        self._loaded = sampler.cursor

    def _consumed(self, state: Mapping[str, Any]) -> DataCursor:
        saved = _main_state(state)[_SAMPLER_ITER_STATE].get(_SAMPLER_STATE)
        if saved is None:  # restored by _load_cursor, nothing yielded since
            assert self._loaded is not None
            return self._loaded
        return DataCursor(**saved)

    def _require_sampler(self) -> ResumableDistributedSampler:
        if self._sampler is None:
            raise TypeError(
                f"the loader's sampler is a {type(self.loader.sampler).__qualname__}, not a "
                "ResumableDistributedSampler: it has no data cursor of what it consumed"
            )
        return self._sampler

    def _refusal(self, what: str) -> LoaderStateNotReshardable:
        return LoaderStateNotReshardable(
            f"{what} cannot be loaded into rank {self.rank} of world size {self.world_size}: "
            f"the loader's sampler is a {type(self.loader.sampler).__qualname__}, whose state "
            "is per rank and opaque, so there is no rule to reshard it. Restore onto the world "
            "size the snapshot was taken with, or give the loader a "
            "ResumableDistributedSampler, whose cursor is a global sample offset that any "
            "world size resumes from"
        )
