"""Announce a checkpoint folder a framework wrote, with every rank's digests (shell of the
integrations: file I/O and one collective)."""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from trainguard.agent import Agent, Snapshot, digest_files
from trainguard.schemas import Checkpoint, DataCursor, StoredFile

__all__ = ["RANK_FILE", "announce_folder", "load_folder", "rank_of"]

RANK_FILE = re.compile(r"^(?:rng_state|random_states)_(\d+)\.(?:pth|pkl)$")
"""The per-rank RNG files: the ``Trainer``'s ``rng_state_<r>.pth``, Accelerate's
``random_states_<r>.pkl``; every other file of the folder is written by the main process."""


def rank_of(name: str) -> int | None:
    """The rank whose RNG file ``name`` is, or ``None`` for a file of the main process."""
    match = RANK_FILE.match(name)
    return None if match is None else int(match.group(1))


def announce_folder(
    agent: Agent,
    step: int,
    folder: str | Path,
    cursor: DataCursor,
    *,
    blocking: bool = False,
    broadcast: Callable[[tuple[StoredFile, ...] | None], tuple[StoredFile, ...]] | None = None,
) -> Future[Checkpoint]:
    """Digest the files of ``folder`` this rank reads back on a restore and announce them.

    The main process (rank 0) digests the files it wrote (every file but the other ranks' RNG
    files) and ``broadcast`` hands that list to every rank (``torch.distributed``'s
    ``broadcast_object_list`` by default, when a process group is up), so that the shared
    files are read once; every rank adds its own RNG file. All ranks call it at the same step.

    Raises:
        OSError: a file cannot be read.
    """
    root = Path(folder)
    rank = agent.config.rank
    shared: tuple[StoredFile, ...] | None = None
    if rank == 0:
        names = [p.name for p in root.iterdir() if p.is_file() and rank_of(p.name) is None]
        shared = digest_files(root, names)
    shared = (broadcast or _broadcast)(shared)
    own = [p.name for p in root.iterdir() if p.is_file() and rank_of(p.name) == rank]
    files = (*shared, *digest_files(root, own))
    return agent.checkpoint_files(step, root, files, cursor=cursor, blocking=blocking)


def _broadcast(shared: tuple[StoredFile, ...] | None) -> tuple[StoredFile, ...]:
    """Rank 0's ``shared`` on every rank (no collective without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box: list[tuple[StoredFile, ...] | None] = [shared]
        dist.broadcast_object_list(box, src=0)
        shared = box[0]
    if shared is None:
        raise RuntimeError("rank 0's file list did not arrive (no process group is up)")
    return shared


def load_folder(agent: Agent, target: Snapshot, data_version: str) -> Path:
    """The framework's folder of ``target``, once it is known to fit this run and this rank's
    shard and every file it lists are verified (:meth:`Agent.load_files`).

    Raises:
        ValueError: ``target`` was trained on another data version or world size.
        ShardError: as :meth:`Agent.load_files` (reported to the daemon first).
    """
    if target.cursor.data_version != data_version:
        raise ValueError(
            f"snapshot {target.snapshot_id} was trained on data {target.cursor.data_version}, "
            f"this run has {data_version}"
        )
    world_size = agent.config.world_size
    if target.world_size != world_size:
        raise ValueError(
            f"snapshot {target.snapshot_id} has world size {target.world_size}, this run "
            f"{world_size}"
        )
    return agent.load_files(target)
