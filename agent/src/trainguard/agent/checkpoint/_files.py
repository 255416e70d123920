"""A checkpoint folder written by a framework (the Hugging Face ``Trainer``, Accelerate's
``save_state``): its files' digests, and their check before the framework reads them.

Trainguard does not write these files; it records each one's name, size and SHA-256 in a small
index that the agent writes as the rank's ``torch.save`` shard (:meth:`Agent.checkpoint_files
<trainguard.agent.Agent.checkpoint_files>`). The shard's own digest is in the manifest, so the
chain manifest -> index -> file covers every byte the framework will deserialize
(``docs/integrations-hf.md``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trainguard.agent._errors import ShardCorrupt, ShardError, ShardMissing
from trainguard.schemas import StoredFile

__all__ = ["INDEX_KEY", "digest_files", "files_index", "index_files", "verify_files"]

INDEX_KEY = "checkpoint_files"
"""Key of the index in the rank's shard: ``{"folder": str, "files": [[name, size, digest]]}``."""

_CHUNK = 8 << 20
"""Bytes hashed at a time."""


def _digest(path: Path) -> tuple[int, str]:
    """``(size in bytes, "sha256:<hex>")`` of the file at ``path``, read in chunks."""
    sha = hashlib.sha256()
    size = 0
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return size, f"sha256:{sha.hexdigest()}"


def digest_files(folder: str | Path, names: Iterable[str]) -> tuple[StoredFile, ...]:
    """Size and SHA-256 of each named file of ``folder``, in name order.

    Args:
        folder: the checkpoint folder.
        names: file names inside it (not paths; the wire contract's ``StoredFile`` rule).

    Raises:
        OSError: a file cannot be read.
        SchemaViolation: a name is not a plain file name.
    """
    root = Path(folder)
    out = []
    for name in sorted(set(names)):
        size, digest = _digest(root / name)
        out.append(StoredFile(name=name, size_bytes=size, digest=digest))
    return tuple(out)


def files_index(folder: str | Path, files: Sequence[StoredFile]) -> dict[str, Any]:
    """The index of ``files`` in ``folder`` as the shard stores it (plain lists and strings,
    which ``torch.load(weights_only=True)`` reads back)."""
    return {
        "folder": str(Path(folder).resolve()),
        "files": [[f.name, f.size_bytes, f.digest] for f in files],
    }


def index_files(index: Any, what: str) -> tuple[Path, tuple[StoredFile, ...]]:
    """The folder and files of an index read back from a shard.

    Raises:
        ShardError: ``index`` is not one :func:`files_index` made (``what`` names the shard).
    """
    if not isinstance(index, Mapping):
        raise ShardError(f"{what} holds no index of checkpoint files")
    try:
        folder = Path(index["folder"])
        files = tuple(
            StoredFile(name=str(name), size_bytes=int(size), digest=str(digest))
            for name, size, digest in index["files"]
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ShardError(f"{what} holds no index of checkpoint files") from exc
    return folder, files


def verify_files(folder: Path, files: Sequence[StoredFile]) -> None:
    """Check every file against its recorded size and SHA-256, before anything reads it.

    Raises:
        ShardMissing: a file is gone.
        ShardCorrupt: a file has another size or digest (its first difference is named).
        ShardError: a file cannot be read.
    """
    for entry in files:
        path = folder / entry.name
        try:
            size, digest = _digest(path)
        except FileNotFoundError as exc:
            raise ShardMissing(f"checkpoint file {path} does not exist") from exc
        except OSError as exc:
            raise ShardError(f"checkpoint file {path} cannot be read: {exc}") from exc
        if (size, digest) != (entry.size_bytes, entry.digest):
            raise ShardCorrupt(
                f"checkpoint file {path} has {size} bytes and digest {digest}, the index says "
                f"{entry.size_bytes} bytes and {entry.digest}"
            )
