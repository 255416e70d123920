"""The shards' folder layout in storage, for retention: which job folders hold shards, which
step folders they contain, and removing a step's files.

The agent writes rank ``r``'s shard of ``step`` in ``generation`` to
``<root>/<job_id>/g<generation:06>/s<step:010>/rank<r:05>.pt``
(:func:`trainguard.agent.checkpoint._shards.shard_path`): a step folder belongs to exactly one
generation's step, so deleting it touches nothing else. Local and shared file systems
(``file://``) only, as the shards themselves.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from trainguard.agent._errors import ShardError
from trainguard.agent.checkpoint._shards import uri_to_path
from trainguard.schemas import Shard

__all__ = [
    "StepFolder",
    "job_folder",
    "remove_step_folder",
    "snapshot_folder",
    "step_folders",
]

_GENERATION = re.compile(r"g(\d{6,})")
_STEP = re.compile(r"s(\d{10,})")


@dataclass(frozen=True, slots=True)
class StepFolder:
    """A step folder found under a job folder.

    Attributes:
        generation: the generation that wrote it.
        step: its step.
        path: the folder.
    """

    generation: int
    step: int
    path: Path


def job_folder(shard_uri: str, job_id: str) -> Path | None:
    """The job folder (``<root>/<job_id>``) of a shard laid out as the agent writes them, or
    ``None``: not a ``file://`` URI, or not in that layout (then retention leaves it alone)."""
    try:
        path = uri_to_path(shard_uri)
    except ShardError:
        return None
    step, generation, job = path.parent, path.parent.parent, path.parent.parent.parent
    if _STEP.fullmatch(step.name) and _GENERATION.fullmatch(generation.name) and job.name == job_id:
        return job
    return None


def step_folders(job: Path) -> list[StepFolder]:
    """Every ``g<generation>/s<step>`` folder under the job folder ``job``, in (generation,
    step) order; other entries, and symbolic links, are ignored. A missing job folder has
    none.

    Raises:
        OSError: the folder cannot be listed.
    """
    found: list[StepFolder] = []
    if not job.is_dir():
        return found
    for generation in job.iterdir():
        g = _GENERATION.fullmatch(generation.name)
        # The agent writes real folders: a link leads elsewhere and is not retention's.
        if g is None or generation.is_symlink() or not generation.is_dir():
            continue
        for step in generation.iterdir():
            s = _STEP.fullmatch(step.name)
            if s is not None and not step.is_symlink() and step.is_dir():
                found.append(StepFolder(int(g[1]), int(s[1]), step))
    return sorted(found, key=lambda f: (f.generation, f.step))


def snapshot_folder(shards: Iterable[Shard], job_id: str, generation: int, step: int) -> Path:
    """The step folder holding every shard of a committed snapshot, checked to be the one the
    agent's layout gives it: ``<root>/<job_id>/g<generation:06>/s<step:010>``, neither it nor
    its generation folder a symbolic link. Retention deletes that folder, never a path a
    manifest names elsewhere. A ``torch.save`` shard's URI names its file in the folder, a DCP
    shard's the folder itself.

    Raises:
        ValueError: a shard lies elsewhere (another folder, another layout, a link), or there
            is none.
        ShardError: a URI that is not ``file://``.
    """
    folders = {
        uri_to_path(s.uri) if s.files is not None else uri_to_path(s.uri).parent for s in shards
    }
    if len(folders) != 1:
        raise ValueError(f"its shards are not in one step folder: {sorted(map(str, folders))}")
    (folder,) = folders
    generation_folder = folder.parent
    expected = (f"s{step:010d}", f"g{generation:06d}", job_id)
    actual = (folder.name, generation_folder.name, generation_folder.parent.name)
    if actual != expected:
        raise ValueError(f"{folder} is not its step folder {'/'.join(reversed(expected))}")
    if folder.is_symlink() or generation_folder.is_symlink():
        raise ValueError(f"{folder} is reached through a symbolic link: not deleted")
    return folder


def remove_step_folder(folder: Path) -> int:
    """Delete a step folder with everything in it (shards, partial shards, temporary files),
    then its generation folder if left empty; return the bytes freed. A folder already gone
    (another prune got there first) frees 0 bytes.

    Raises:
        ValueError: ``folder`` is not a ``g<generation>/s<step>`` folder, or it or its
            generation folder is a symbolic link.
        OSError: it cannot be deleted.
    """
    if not (_STEP.fullmatch(folder.name) and _GENERATION.fullmatch(folder.parent.name)):
        raise ValueError(f"{folder} is not a step folder (g<generation>/s<step>)")
    if folder.is_symlink() or folder.parent.is_symlink():
        raise ValueError(f"{folder} is reached through a symbolic link: not deleted")
    try:
        freed = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        shutil.rmtree(folder)
    except FileNotFoundError:
        return 0
    _remove_if_empty(folder.parent)
    return freed


def _remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not empty (or already gone): keep it
        folder.rmdir()
