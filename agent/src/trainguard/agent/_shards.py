"""Checkpoint shards on disk: durable atomic writes with a digest, verified safe loads.

A shard is one rank's part of a training snapshot, serialized with ``torch.save``. Writing
follows the usual crash-safe recipe: write to a temporary name in the target directory,
``fsync`` the file, ``rename`` it into place, ``fsync`` the directory; the SHA-256 digest is
computed from the bytes as they are written, so the shard is read once (at load) rather than
twice. Loading checks the digest *before* deserializing and deserializes with
``torch.load(weights_only=True)``, which refuses arbitrary pickled objects (PyTorch
serialization docs, "weights_only").
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast
from urllib.parse import unquote, urlsplit

from trainguard.agent._errors import ShardCorrupt, ShardMissing

__all__ = [
    "WrittenShard",
    "capture_rng",
    "load_shard",
    "restore_rng",
    "shard_path",
    "to_host",
    "uri_to_path",
    "write_shard",
]

_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class WrittenShard:
    """A shard that is durably on disk.

    Attributes:
        uri: ``file://`` URI of the shard.
        size_bytes: its size in bytes.
        digest: ``sha256:<64 hex>`` of its bytes.
    """

    uri: str
    size_bytes: int
    digest: str


class _HashingWriter:
    """File-like sink for ``torch.save`` that hashes and counts what passes through."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        written: int = self._raw.write(data)
        return written

    def flush(self) -> None:
        self._raw.flush()


def shard_path(root: Path, job_id: str, generation: int, step: int, rank: int) -> Path:
    """Where rank ``rank``'s shard of ``step`` written in ``generation`` lives under ``root``.

    Generations get their own folders so a step re-written after a restore never overwrites
    the committed shard of an earlier generation.
    """
    return root / job_id / f"g{generation:06d}" / f"s{step:010d}" / f"rank{rank:05d}.pt"


def write_shard(path: Path, state: Mapping[str, Any]) -> WrittenShard:
    """Serialize ``state`` to ``path`` atomically and durably; return its URI, size and digest.

    Raises ``OSError`` when the file cannot be written; a failed write leaves no file at
    ``path`` (only the temporary file is removed).
    """
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as raw:
            sink = _HashingWriter(raw)
            # torch.save only calls write() and flush() on a file-like object.
            torch.save(dict(state), cast(IO[bytes], sink))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return WrittenShard(path.resolve().as_uri(), sink.size, f"sha256:{sink.sha.hexdigest()}")


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX: the directory entry lives in the directory)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def uri_to_path(uri: str) -> Path:
    """Local path of a ``file://`` shard URI. Raises ``ValueError`` for other schemes."""
    parts = urlsplit(uri)
    if parts.scheme != "file":
        raise ValueError(f"shard URI {uri!r}: only file:// URIs are supported")
    return Path(unquote(parts.path))


def load_shard(uri: str, digest: str) -> dict[str, Any]:
    """Verify the shard at ``uri`` against ``digest``, then deserialize it safely.

    The whole file is hashed before ``torch.load(weights_only=True)`` sees a byte of it.

    Raises:
        ShardMissing: no file at ``uri``.
        ShardCorrupt: the bytes do not hash to ``digest`` (tampered or damaged shard).
    """
    import torch

    path = uri_to_path(uri)
    sha = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
    except FileNotFoundError as exc:
        raise ShardMissing(f"shard {uri} does not exist") from exc
    actual = f"sha256:{sha.hexdigest()}"
    if actual != digest:
        raise ShardCorrupt(f"shard {uri} has digest {actual}, expected {digest}")
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state


def to_host(state: Any) -> Any:
    """Copy every tensor in a nested dict/list/tuple to fresh CPU memory (the async-save copy).

    After this returns the training thread may change its tensors freely; the copy is what a
    background write serializes.
    """
    import torch
    from torch.utils._pytree import tree_map

    def _copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", copy=True)
        return x

    return tree_map(_copy, state)


def capture_rng() -> dict[str, Any]:
    """The RNG states a bitwise-exact resume needs: torch (CPU), Python ``random``, NumPy.

    Stored in forms ``torch.load(weights_only=True)`` accepts (tensors, tuples, ints).
    """
    import torch

    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np
    except ImportError:
        return rng
    # legacy=True returns the MT19937 tuple (name, keys, pos, has_gauss, cached_gaussian).
    name, keys, pos, has_gauss, cached = cast(tuple[Any, ...], np.random.get_state(legacy=True))
    rng["numpy"] = (
        str(name),
        torch.from_numpy(keys.copy()),
        int(pos),
        int(has_gauss),
        float(cached),
    )
    return rng


def restore_rng(rng: Mapping[str, Any]) -> None:
    """Set the RNG states captured by :func:`capture_rng`."""
    import torch

    torch.set_rng_state(rng["torch"])
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in rng:
        import numpy as np

        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, keys.numpy(), pos, has_gauss, cached))
