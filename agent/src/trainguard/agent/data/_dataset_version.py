"""Dataset versions: a manifest of the dataset's files and a digest over it.

A checkpoint is bound to the data it was trained on by a *data version* string. Either the user's
data versioning tool already names the version (a DVC or lakeFS commit, a dataset registry id):
then that id is the version, passed as is (:func:`dataset_version` accepts it and returns it);
or trainguard derives one from the files: :func:`dataset_manifest` lists every file with its
size and SHA-256, and :func:`dataset_version` digests that list. The digest depends only on the
files' relative paths and contents, not on the machine, the root's location, the order in which
the file system lists entries, or modification times.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple, TypeAlias

__all__ = ["ManifestEntry", "dataset_manifest", "dataset_version"]

StrPath: TypeAlias = str | os.PathLike[str]

_FORMAT = "trainguard-dataset-manifest/1"  # first line of the digested text; bump on change
_MAX_VERSION_CHARS = 255  # the wire schema's limit for DataCursor.data_version


class ManifestEntry(NamedTuple):
    """One file of a dataset.

    Attributes:
        path: path relative to the dataset root, ``/``-separated (POSIX form on every system).
        size_bytes: file size in bytes.
        sha256: SHA-256 of the file's bytes, lowercase hex (64 characters).
    """

    path: str
    size_bytes: int
    sha256: str


def dataset_manifest(
    source: StrPath | Iterable[StrPath],
    pattern: str | None = None,
    *,
    root: StrPath | None = None,
) -> list[ManifestEntry]:
    """List a dataset's files with sizes and SHA-256 digests, sorted by relative path.

    Files are hashed in a stream (``hashlib.file_digest``), so memory stays bounded whatever the
    file sizes; time is one read of every byte.

    Args:
        source: the dataset's root directory, or an iterable of file paths.
        pattern: with a directory ``source``, a ``Path.glob`` pattern selecting the files
            (default ``"**/*"``: every file below the root, hidden ones included; directories
            are skipped, symbolic links followed as ``Path.glob`` follows them). Not allowed
            with a file list.
        root: with a file list, the directory the entries' paths are relative to (default: the
            deepest directory containing every file). Not allowed with a directory ``source``.

    Returns:
        One entry per file, sorted by ``path``.

    Raises:
        ValueError: ``pattern`` with a file list, ``root`` with a directory, a listed path that
            is not a file, a file outside ``root``, or two files with one relative path.
        FileNotFoundError: ``source`` or a listed file does not exist, or no file matches.
        OSError: a file cannot be read.
    """
    if isinstance(source, str | os.PathLike):
        if root is not None:
            raise ValueError("root is only for a list of files; the directory is the root")
        base = Path(source)
        if not base.is_dir():
            raise FileNotFoundError(f"dataset root {base} is not a directory")
        files = [p for p in base.glob(pattern or "**/*") if p.is_file()]
        named = [(p, p.relative_to(base)) for p in files]
    else:
        if pattern is not None:
            raise ValueError("pattern is only for a directory source")
        # Lexically absolute (no symlink resolution): entries keep the names they were given.
        files = [Path(os.path.abspath(p)) for p in source]
        for path in files:
            if not path.is_file():
                kind = ValueError if path.exists() else FileNotFoundError
                raise kind(f"dataset file {path} is not a regular file")
        base = Path(os.path.abspath(root)) if root is not None else _common_parent(files)
        named = [(p, _relative(p, base)) for p in files]
    if not named:
        raise FileNotFoundError(f"no dataset file matches {pattern or '**/*'!r} under {base}")
    seen: set[str] = set()
    for _, relative in named:
        if relative.as_posix() in seen:
            raise ValueError(f"two dataset files have the relative path {relative.as_posix()!r}")
        seen.add(relative.as_posix())
    return sorted(_entry(path, relative) for path, relative in named)


def _common_parent(files: Sequence[Path]) -> Path:
    return Path(os.path.commonpath([p.parent for p in files])) if files else Path.cwd()


def _relative(path: Path, base: Path) -> Path:
    try:
        return path.relative_to(base)
    except ValueError:
        raise ValueError(f"dataset file {path} is outside the root {base}") from None


def _entry(path: Path, relative: Path) -> ManifestEntry:
    with path.open("rb") as stream:
        digest = hashlib.file_digest(stream, "sha256")
        size = stream.tell()
    return ManifestEntry(relative.as_posix(), size, digest.hexdigest())


def dataset_version(manifest_or_id: Sequence[ManifestEntry] | str) -> str:
    """The data version: ``"sha256:<64 hex>"`` of a manifest, or a user's own version id.

    The manifest digest is SHA-256 over a canonical text: the line
    ``trainguard-dataset-manifest/1``, then one line per entry, sorted by path, holding the JSON
    array ``[path, size_bytes, sha256]`` (``json.dumps`` with ``ensure_ascii=True`` and no
    spaces). Any change of a file's content, size or relative path, or a file added or removed,
    changes the version; the entries' order in ``manifest_or_id`` does not.

    Args:
        manifest_or_id: entries from :func:`dataset_manifest`, or the id a data versioning tool
            gave this dataset (any non-empty string of at most 255 characters without surrounding
            whitespace), which is returned unchanged.

    Raises:
        ValueError: an empty manifest, or an id that is empty, too long or padded.
    """
    if isinstance(manifest_or_id, str):
        version = manifest_or_id
        if not version or len(version) > _MAX_VERSION_CHARS or version != version.strip():
            raise ValueError(
                f"a data version id must be 1-{_MAX_VERSION_CHARS} characters without "
                f"surrounding whitespace, got {version!r}"
            )
        return version
    if not manifest_or_id:
        raise ValueError("an empty manifest has no data version")
    lines = [_FORMAT]
    for entry in sorted(manifest_or_id):
        lines.append(
            json.dumps([entry.path, entry.size_bytes, entry.sha256], separators=(",", ":"))
        )
    return "sha256:" + hashlib.sha256("\n".join(lines).encode("ascii")).hexdigest()
