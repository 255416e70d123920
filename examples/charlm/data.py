"""Training text every machine has: the Python standard library's own source files.

The corpus is the concatenated bytes of the top-level ``*.py`` files of the running interpreter's
``Lib`` folder (``sysconfig.get_paths()["stdlib"]``), in manifest (sorted path) order. Sample
``i`` is the fixed-length window of bytes ``[i * context, (i + 1) * context]`` (``context + 1``
bytes: the inputs and, shifted by one, the next-byte targets).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from trainguard.agent import ManifestEntry, dataset_manifest, dataset_version


def stdlib_root() -> Path:
    """Return the running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


class ByteWindows(Dataset[tuple[int, torch.Tensor]]):
    """Fixed-length byte windows over a concatenated corpus; a window's index is its sample id.

    Args:
        corpus: uint8 tensor of shape ``(n_bytes,)``.
        context: window length in bytes, not counting the extra target byte.
        manifest: the files the corpus was built from, in order.

    ``dataset[i]`` is ``(i, window)`` with ``window`` an int64 tensor of shape ``(context + 1,)``,
    so a default-collated batch carries its sample ids. ``version`` is the manifest's
    ``dataset_version`` (``"sha256:<hex>"``).

    Raises:
        ValueError: if the corpus holds less than one window.
    """

    def __init__(
        self, corpus: torch.Tensor, context: int, manifest: Sequence[ManifestEntry]
    ) -> None:
        if corpus.numel() < context + 1:
            raise ValueError(f"{corpus.numel()} bytes hold no window of {context + 1} bytes")
        self.corpus = corpus
        self.context = context
        self.manifest = tuple(manifest)
        self.version = dataset_version(self.manifest)

    @classmethod
    def from_files(cls, root: Path, files: Sequence[Path], context: int) -> ByteWindows:
        """Build the corpus from ``files`` (each inside ``root``), in their manifest's order.

        Raises:
            OSError: if a file cannot be read.
            ValueError: as the constructor, or a file outside ``root`` (``dataset_manifest``).
        """
        manifest = dataset_manifest(files, root=root)
        blob = b"".join((root / entry.path).read_bytes() for entry in manifest)
        return cls(torch.frombuffer(bytearray(blob), dtype=torch.uint8), context, manifest)

    @classmethod
    def from_stdlib(cls, context: int) -> ByteWindows:
        """Build the windows over the top-level ``*.py`` files of :func:`stdlib_root`."""
        root = stdlib_root()
        return cls.from_files(root, list(root.glob("*.py")), context)

    def __len__(self) -> int:
        """Number of whole windows (sample ids ``0 .. len - 1``)."""
        return (self.corpus.numel() - 1) // self.context

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        """Return ``(index, window)``; ``window`` holds bytes ``[index * context, + context]``.

        Raises:
            IndexError: if ``index`` is not in ``range(len(self))``.
        """
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside 0..{len(self) - 1}")
        start = index * self.context
        return index, self.corpus[start : start + self.context + 1].long()
