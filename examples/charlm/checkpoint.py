"""Local checkpoint shards: one file per rank and step, written atomically.

Layout: ``<root>/step-<step:08d>/rank-<rank>.pt``. A step is restorable once every rank's shard
exists; a shard exists only complete, because it is written to a temporary name, fsynced and
renamed (then the folder is fsynced so the rename itself is durable).

:func:`save_checkpoint` / :func:`load_checkpoint` are the one place the trainguard agent's
checkpoint API replaces; like the agent's ``checkpoint`` / ``load``, they add the RNG states
to the shard and put them back on load.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_STEP_DIR = re.compile(r"step-(\d{8})")


@dataclass(frozen=True)
class SavedShard:
    """A durably written file: where, how many bytes and their sha256 (hex)."""

    path: Path
    size: int
    sha256: str


def shard_path(root: Path, step: int, rank: int) -> Path:
    """Return the shard file of ``rank`` at ``step`` under the checkpoint root ``root``."""
    return root / f"step-{step:08d}" / f"rank-{rank}.pt"


def atomic_write(path: Path, data: bytes) -> SavedShard:
    """Write ``data`` to ``path`` via a temporary file, fsync and rename; create parent folders.

    Raises:
        OSError: if writing fails; ``path`` then holds its previous content or does not exist.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    tmp.replace(path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return SavedShard(path, len(data), hashlib.sha256(data).hexdigest())


def save_checkpoint(root: Path, step: int, rank: int, state: dict[str, Any]) -> SavedShard:
    """Serialize ``state`` (tensors, containers of them, plain values) plus the RNG states.

    The shard holds ``state`` and ``"rng"``: torch's CPU generator and Python's ``random``
    (the example draws from no other generator).

    Raises:
        OSError: as :func:`atomic_write`.
    """
    buffer = io.BytesIO()
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    torch.save({**state, "rng": rng}, buffer)
    return atomic_write(shard_path(root, step, rank), buffer.getvalue())


def load_checkpoint(root: Path, step: int, rank: int) -> dict[str, Any]:
    """Load ``rank``'s shard at ``step`` safely (``weights_only=True``); restore its RNG states.

    Call it last before the training loop: anything drawing random numbers after it changes
    the stream the resumed run sees. Returns the ``state`` given to :func:`save_checkpoint`
    (plus ``"rng"``).

    Raises:
        FileNotFoundError: if the shard does not exist.
        pickle.UnpicklingError: if the file holds anything but tensors and plain values.
    """
    state: dict[str, Any] = torch.load(shard_path(root, step, rank), weights_only=True)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state


def latest_complete_step(root: Path, world_size: int) -> int | None:
    """Return the newest step under ``root`` with a shard for every rank, or None if there is none."""
    steps = sorted(
        (
            int(match[1])
            for entry in root.glob("step-*")
            if (match := _STEP_DIR.fullmatch(entry.name))
        ),
        reverse=True,
    )
    for step in steps:
        if all(shard_path(root, step, rank).is_file() for rank in range(world_size)):
            return step
    return None
