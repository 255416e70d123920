"""Durable local files: written whole or not at all, and still there after a power loss.

The POSIX recipe (``rename(2)`` is atomic within a file system; ``fsync(2)`` of the file makes
its bytes durable, of its folder the rename): write a temporary file beside the target (mode
0600, as :func:`tempfile.mkstemp` creates it), ``fsync`` it, ``os.replace`` it over the target,
then ``fsync`` the folder. A reader sees the old file or the new one, never half of either.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["sync_folder", "write_durably"]


def write_durably(path: Path, data: bytes) -> None:
    """Replace ``path`` by a file holding ``data`` (mode 0600; a new file, not the old one
    rewritten), atomically and durably. ``path``'s folder must exist.

    Raises:
        OSError: the file cannot be written (no folder, disk full, permissions); ``path`` then
            keeps its previous content (or stays absent) and the temporary file is removed.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    """``fsync`` ``folder`` so that the renames and new entries in it are durable (POSIX: a
    directory entry lives in its directory, not in the file).

    Raises:
        OSError: ``folder`` cannot be opened.
    """
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
