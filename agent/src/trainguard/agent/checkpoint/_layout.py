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

__all__ = ["StepFolder", "job_folder", "remove_files", "remove_step_folder", "step_folders"]

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
    step) order; other entries are ignored. A missing job folder has none.

    Raises:
        OSError: the folder cannot be listed.
    """
    found: list[StepFolder] = []
    if not job.is_dir():
        return found
    for generation in job.iterdir():
        g = _GENERATION.fullmatch(generation.name)
        if g is None or not generation.is_dir():
            continue
        for step in generation.iterdir():
            s = _STEP.fullmatch(step.name)
            if s is not None and step.is_dir():
                found.append(StepFolder(int(g[1]), int(s[1]), step))
    return sorted(found, key=lambda f: (f.generation, f.step))


def remove_files(uris: Iterable[str]) -> int:
    """Delete the ``file://`` files of ``uris`` (a committed snapshot's shards), then their
    folders and the generation folders above them where left empty; return the bytes freed.
    A file already gone is skipped.

    Raises:
        ShardError: a URI that is not ``file://``.
        OSError: a file cannot be deleted.
    """
    freed = 0
    folders: set[Path] = set()
    for uri in uris:
        path = uri_to_path(uri)
        try:
            freed += path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            pass
        folders.add(path.parent)
    for folder in sorted(folders):
        _remove_if_empty(folder)
        _remove_if_empty(folder.parent)
    return freed


def remove_step_folder(folder: Path) -> int:
    """Delete an uncommitted step folder with everything in it (partial shards, temporary
    files), then its generation folder if left empty; return the bytes freed.

    Raises:
        ValueError: ``folder`` is not a ``g<generation>/s<step>`` folder.
        OSError: it cannot be deleted.
    """
    if not (_STEP.fullmatch(folder.name) and _GENERATION.fullmatch(folder.parent.name)):
        raise ValueError(f"{folder} is not a step folder (g<generation>/s<step>)")
    freed = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    shutil.rmtree(folder)
    _remove_if_empty(folder.parent)
    return freed


def _remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not empty (or already gone): keep it
        folder.rmdir()
