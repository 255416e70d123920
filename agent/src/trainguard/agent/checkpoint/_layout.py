"""The shards' folder layout in storage, for retention: which job folders hold shards, which
step folders they contain, whether a snapshot's files are all there, and removing a step.

The agent writes rank ``r``'s ``torch.save`` shard of ``step`` in ``generation`` to
``<root>/<job_id>/g<generation:06>/s<step:010>/rank<r:05>.pt``
(:func:`trainguard.agent.checkpoint._shards.shard_path`), and a DCP checkpoint of that step
into that folder itself (:func:`trainguard.agent.checkpoint._dcp.step_folder_uri`): a step
folder belongs to exactly one generation's step, so deleting it touches nothing else.

Folders are named by URI. ``file://`` folders are handled on the local file system, where a
symbolic link is never followed (it leads out of the layout); other URIs (``s3://``, ...)
through fsspec, where a "folder" is a key prefix.
"""

from __future__ import annotations

import contextlib
import posixpath
import re
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from trainguard.agent.checkpoint._shards import uri_to_path
from trainguard.schemas import Shard

__all__ = [
    "MANIFEST_SCHEMES",
    "StepFolder",
    "files_present",
    "job_folder",
    "job_step_folder",
    "remove_step_folder",
    "snapshot_folder",
    "step_folders",
]

_GENERATION = re.compile(r"g(\d{6,})")
_STEP = re.compile(r"s(\d{10,})")

MANIFEST_SCHEMES = frozenset({"file", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
"""Storage the daemon writes committed manifests to: local and shared file systems and the
object stores fsspec serves. Not chained URLs (``blockcache::...``), ``memory://``, ``http://``
and the like, which a worker could name to make the daemon grow, or connect out."""


@dataclass(frozen=True, slots=True)
class StepFolder:
    """A step folder found under a job folder.

    Attributes:
        generation: the generation that wrote it.
        step: its step.
        uri: the folder.
    """

    generation: int
    step: int
    uri: str


def _local(uri: str) -> bool:
    return urlsplit(uri).scheme == "file"


def _parent(uri: str) -> str:
    """The URI of the folder holding ``uri`` (the last path segment removed)."""
    return uri.rstrip("/").rsplit("/", 1)[0]


def _name(uri: str) -> str:
    return posixpath.basename(urlsplit(uri).path.rstrip("/"))


def _folder(shard: Shard) -> str:
    """The step folder a shard lies in: its file's folder, or (DCP) the URI itself."""
    return shard.uri.rstrip("/") if shard.files is not None else _parent(shard.uri)


def fs_of(uri: str) -> tuple[Any, str]:
    """fsspec's file system and path of a non-local URI.

    Raises:
        OSError: no fsspec implementation for its scheme (or it is not installed).
    """
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as exc:
        raise OSError(f"{uri}: {exc}") from exc
    return fs, str(path)


@contextlib.contextmanager
def storage_errors(uri: str) -> Iterator[None]:
    """Within the block, what an fsspec back-end raises reaches the caller as an
    :class:`OSError` naming ``uri`` and the back-end's error type.

    Back-ends raise what they like: s3fs turns most S3 answers into ``OSError`` subclasses,
    but botocore's own (``NoCredentialsError``, a bad endpoint's ``EndpointConnectionError``)
    come through as they are. Every caller of this module promises ``OSError`` for storage
    that fails, and handles it (retention skips the job and says why); anything else would
    end a prune in a traceback, or the daemon's retention run for every job."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:
        raise OSError(f"{uri}: {type(exc).__name__}: {exc}") from exc


def job_folder(shard: Shard, job_id: str) -> str | None:
    """The job folder (``<root>/<job_id>``) of a shard laid out as the agent writes them, or
    ``None``: not a URI, or not in that layout (then retention leaves it alone)."""
    if not urlsplit(shard.uri).scheme:
        return None
    step = _folder(shard)
    generation = _parent(step)
    job = _parent(generation)
    if (
        _STEP.fullmatch(_name(step))
        and _GENERATION.fullmatch(_name(generation))
        and _name(job) == job_id
    ):
        return job
    return None


def job_step_folder(folder: str, job_id: str) -> str | None:
    """Why ``folder`` is no step folder of job ``job_id`` the daemon may write a manifest
    into, or ``None`` when it is one: ``<root>/<job_id>/g<generation>/s<step>`` on storage of
    :data:`MANIFEST_SCHEMES`, an absolute path if local, whose real path (symbolic links
    resolved) still ends in those three names and whose ``trainguard`` sub-folder, if there,
    is no symbolic link. The daemon can write wherever it prunes: this keeps a worker of one
    job from naming another job's folder (or any other place) as its checkpoint's, and so
    from making the daemon overwrite that job's manifests (``docs/threat-model.md``).

    Raises:
        OSError: a local path could not be resolved.
    """
    parts = urlsplit(folder)
    if parts.scheme not in MANIFEST_SCHEMES:
        return f"storage {parts.scheme or 'without a scheme'!r} is not one manifests go to"
    step = folder.rstrip("/")
    generation = _parent(step)
    if not (
        _STEP.fullmatch(_name(step))
        and _GENERATION.fullmatch(_name(generation))
        and _name(_parent(generation)) == job_id
    ):
        return f"not a <root>/{job_id}/g<generation>/s<step> folder"
    if parts.scheme != "file":
        return None
    path = Path(uri_to_path(step))
    if not path.is_absolute():
        return "a relative path"
    real = path.resolve()
    if (real.parent.parent.name, real.parent.name, real.name) != (
        job_id,
        _name(generation),
        _name(step),
    ):
        return f"its real path {real} is not the job's"
    if (real / "trainguard").is_symlink():
        return "its trainguard folder is a symbolic link"
    return None


def step_folders(job: str) -> list[StepFolder]:
    """Every ``g<generation>/s<step>`` folder under the job folder ``job``, in (generation,
    step) order; other entries, and (locally) symbolic links, are ignored. A missing job
    folder has none.

    Raises:
        OSError: the folder cannot be listed.
    """
    found: list[StepFolder] = []
    for generation_name, generation in _subfolders(job):
        g = _GENERATION.fullmatch(generation_name)
        if g is None:
            continue
        for step_name, step in _subfolders(generation):
            s = _STEP.fullmatch(step_name)
            if s is not None:
                found.append(StepFolder(int(g[1]), int(s[1]), step))
    return sorted(found, key=lambda f: (f.generation, f.step))


def _subfolders(uri: str) -> list[tuple[str, str]]:
    """``(name, uri)`` of the folders directly in folder ``uri`` (none when it is missing)."""
    if _local(uri):
        path = uri_to_path(uri)
        if not path.is_dir():
            return []
        # The agent writes real folders: a link leads elsewhere and is not retention's.
        return [(p.name, p.as_uri()) for p in path.iterdir() if p.is_dir() and not p.is_symlink()]
    fs, root = fs_of(uri)
    try:
        with storage_errors(uri):
            entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return []
    base = uri.rstrip("/")
    return [
        (name, f"{base}/{name}")
        for entry in entries
        if entry.get("type") == "directory"
        and (name := posixpath.basename(entry["name"].rstrip("/")))
    ]


def snapshot_folder(shards: Iterable[Shard], job_id: str, generation: int, step: int) -> str:
    """The step folder holding every shard of a committed snapshot, checked to be the one the
    agent's layout gives it: ``<root>/<job_id>/g<generation:06>/s<step:010>``, (locally)
    neither it nor its generation folder a symbolic link. Retention deletes that folder, never
    a path a manifest names elsewhere. A ``torch.save`` shard's URI names its file in the
    folder, a DCP shard's the folder itself.

    Raises:
        ValueError: a shard lies elsewhere (another folder, another layout, a link), or there
            is none.
    """
    folders = {_folder(s) for s in shards}
    if len(folders) != 1:
        raise ValueError(f"its shards are not in one step folder: {sorted(folders)}")
    (folder,) = folders
    generation_folder = _parent(folder)
    expected = (f"s{step:010d}", f"g{generation:06d}", job_id)
    actual = (_name(folder), _name(generation_folder), _name(_parent(generation_folder)))
    if actual != expected:
        raise ValueError(f"{folder} is not its step folder {'/'.join(reversed(expected))}")
    if _local(folder):
        path = uri_to_path(folder)
        if path.is_symlink() or path.parent.is_symlink():
            raise ValueError(f"{path} is reached through a symbolic link: not deleted")
    return folder


def files_present(shards: Iterable[Shard]) -> bool:
    """Whether every file of a snapshot's shards is in storage (each ``torch.save`` file, each
    file a DCP shard lists).

    Raises:
        OSError: storage cannot be asked.
    """
    uris = [f"{s.uri.rstrip('/')}/{f.name}" for s in shards for f in (s.files or ())] + [
        s.uri for s in shards if s.files is None
    ]
    for uri in uris:
        if _local(uri):
            if not uri_to_path(uri).is_file():
                return False
            continue
        fs, path = fs_of(uri)
        with storage_errors(uri):
            there = fs.exists(path)
        if not there:
            return False
    return True


def remove_step_folder(folder: str) -> int:
    """Delete a step folder with everything in it (shards, partial shards, temporary files),
    then (locally) its generation folder if left empty; return the bytes freed. A folder
    already gone (another prune got there first) frees 0 bytes. On object storage every object
    under the folder's prefix is deleted.

    Raises:
        ValueError: ``folder`` is not a ``g<generation>/s<step>`` folder, or (locally) it or
            its generation folder is a symbolic link.
        OSError: it cannot be deleted.
    """
    if not (_STEP.fullmatch(_name(folder)) and _GENERATION.fullmatch(_name(_parent(folder)))):
        raise ValueError(f"{folder} is not a step folder (g<generation>/s<step>)")
    if not _local(folder):
        fs, root = fs_of(folder)
        with storage_errors(folder):
            objects = fs.find(root, detail=True)
            # The objects themselves, not the prefix: stores that model folders may retry a
            # "folder" delete at length (S3Proxy's filesystem backend: 10 s).
            files = [name for name, entry in objects.items() if entry.get("type") == "file"]
            if files:
                fs.rm(files)
        return sum(int(objects[name].get("size") or 0) for name in files)
    path = uri_to_path(folder)
    if path.is_symlink() or path.parent.is_symlink():
        raise ValueError(f"{path} is reached through a symbolic link: not deleted")
    try:
        freed = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        shutil.rmtree(path)
    except FileNotFoundError:
        return 0
    _remove_if_empty(path.parent)
    return freed


def _remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not empty (or already gone): keep it
        folder.rmdir()
