"""Committed snapshots' manifests in storage: the daemon stores them beside the checkpoint, a
rank reads the head and only the parts holding the shards it loads, each checked before use.

Layout (:mod:`trainguard.schemas`, ``split_manifest``): in a snapshot's step folder,
``trainguard/manifest.json`` is the manifest's head (everything but the shards, and the
digest of every part) and ``trainguard/part-<first rank:05>.json`` the parts, 1,024 ranks'
shards each. The daemon writes the parts first and the head last (:func:`store_manifest`), so a
head found names parts that are there.

Chain of trust: a restore command is signed by the daemon and names the snapshot's
``manifest_digest``, the SHA-256 of the head's stored bytes; the head gives each part's
SHA-256. :meth:`Snapshot.open` refuses a head whose bytes do not hash to the command's digest
(a forged manifest, or a stale one left at that path), and :meth:`Snapshot.shard` a part whose
bytes do not hash to the head's (a part swapped in from another snapshot), before either is
decoded. A head the storage does not have (a daemon that could not write there, a store that
was cleaned) is looked for on the bus instead: small manifests are published whole on
``manifests``, and must hash to the same digest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from trainguard.agent._errors import ShardCorrupt, ShardError, ShardMissing
from trainguard.agent.checkpoint._durable import write_durably
from trainguard.agent.checkpoint._layout import fs_of, job_step_folder, storage_errors
from trainguard.schemas import (
    CheckpointMeta,
    DataCursor,
    Manifest,
    ManifestHead,
    ManifestPart,
    SchemaError,
    Shard,
    SnapshotRef,
    SplitManifest,
    decode,
    head_path,
    join_manifest,
    part_for_rank,
    part_path,
    sha256_digest,
    split_manifest,
)

__all__ = ["Snapshot", "store_manifest"]

_UNLIMITED = 2**62


def _local_path(uri: str) -> Path | None:
    parts = urlsplit(uri)
    return Path(unquote(parts.path)) if parts.scheme == "file" else None


_HEAD_MAX_BYTES = 4 << 20
"""A head holds rank 0's metadata and cursor (a checkpoint event's, under 64 KiB) and about 150
bytes per part of 1,024 ranks: far below this at any world size. Larger is not a head."""


def _read(uri: str, limit: int) -> bytes:
    """The bytes at ``uri`` (``file://`` locally, else through fsspec), at most ``limit + 1``
    of them: a file replaced by a huge one costs no more memory than that before the caller
    refuses it.

    Raises:
        FileNotFoundError: nothing there.
        OSError: the storage failed, or no fsspec implementation for the scheme.
    """
    path = _local_path(uri)
    if path is not None:
        with path.open("rb") as f:
            return f.read(limit + 1)
    fs, where = fs_of(uri)
    with storage_errors(uri), fs.open(where, "rb") as f:
        return bytes(f.read(limit + 1))


def _write(uri: str, data: bytes) -> None:
    """Write ``data`` at ``uri`` whole: locally through :func:`._durable.write_durably` (a
    reader never sees half a file), else as one object upload. Locally the file's
    folder is created, but not its parent: a manifest goes only beside a checkpoint that is
    there.

    Raises:
        OSError: the storage refused or failed (``FileNotFoundError``: no such step folder).
    """
    path = _local_path(uri)
    if path is None:
        fs, where = fs_of(uri)
        with storage_errors(uri):
            fs.pipe_file(where, data)
        return
    path.parent.mkdir(exist_ok=True)
    write_durably(path, data)


def store_manifest(split: SplitManifest) -> None:
    """Store a committed snapshot's manifest in its step folder: every part, then the head.

    Only into a step folder of the manifest's own job (:func:`._layout.job_step_folder`):
    the folder comes from rank 0's checkpoint event, which a worker writes.

    Args:
        split: ``split_manifest`` of the manifest; ``split.ref.folder`` is where it goes.

    Raises:
        ValueError: the folder is not a step folder of the job; nothing is written.
        OSError: the storage refused or failed; what was written is harmless (a head is
            written last, and a part without its head is never read).
    """
    folder = split.ref.folder
    refused = job_step_folder(folder, split.ref.job_id)
    if refused is not None:
        raise ValueError(f"{folder}: {refused}")
    for ref, data in zip(split.head.parts, split.parts, strict=True):
        _write(part_path(folder, ref.first_rank), data)
    _write(head_path(folder), split.head_bytes)


def _verified(uri: str, digest: str, size: int | None, what: str) -> bytes:
    """The bytes at ``uri`` once they hash to ``digest`` (and have ``size`` bytes, if given;
    else at most :data:`_HEAD_MAX_BYTES`).

    Raises:
        ShardMissing: nothing at ``uri``.
        ShardCorrupt: other bytes than ``digest`` names.
        ShardError: the storage failed.
    """
    try:
        data = _read(uri, _HEAD_MAX_BYTES if size is None else size)
    except FileNotFoundError as exc:
        raise ShardMissing(f"{what} {uri} does not exist") from exc
    except OSError as exc:
        raise ShardError(f"{what} {uri} cannot be read: {exc}") from exc
    actual = sha256_digest(data)
    if (size is not None and len(data) != size) or actual != digest:
        raise ShardCorrupt(f"{what} {uri} has digest {actual}, expected {digest}")
    return data


class Snapshot:
    """A committed snapshot as a rank restores it: the manifest's head, and its shards read
    from storage part by part, on demand, each part verified before it is decoded.

    What :meth:`trainguard.agent.Agent.restore_target` returns and
    :meth:`~trainguard.agent.Agent.load` takes. It has the fields of a manifest a training
    script reads (``snapshot_id``, ``job_id``, ``generation``, ``step``, ``world_size``,
    ``cursor``, ``metadata``, ``parent``, ``data_version``); the shards come from
    :meth:`shard` and :meth:`shards`. Not thread-safe.

    Build it with :meth:`open` (from a restore command's reference) or :meth:`of` (from a
    whole manifest already verified, such as a signed one read from the bus).
    """

    def __init__(self, head: ManifestHead, parts: dict[int, ManifestPart] | None = None) -> None:
        """A snapshot of ``head`` (verified, or signed), with the ``parts`` already read and
        verified (first rank -> part)."""
        self.head = head
        self._parts = {} if parts is None else parts

    @classmethod
    def of(cls, manifest: Manifest) -> Snapshot:
        """The snapshot of a whole manifest (every shard known; nothing is read later)."""
        split = split_manifest(manifest)
        parts = {
            ref.first_rank: ManifestPart(
                snapshot_id=manifest.snapshot_id,
                first_rank=ref.first_rank,
                shards=manifest.shards[ref.first_rank : ref.first_rank + ref.ranks],
            )
            for ref in split.head.parts
        }
        return cls(split.head, parts)

    @classmethod
    def open(cls, ref: SnapshotRef, on_bus: Callable[[], Iterable[Manifest]]) -> Snapshot:
        """The snapshot ``ref`` names: its head read from storage and checked against
        ``ref.manifest_digest``; where storage has no head, the whole manifest among those
        ``on_bus`` gives (the snapshot's on the bus's ``manifests`` topic) whose head has that
        digest.

        Raises:
            ShardMissing: neither storage nor the bus has the manifest.
            ShardCorrupt: the head (or the bus's manifest) is not the one ``ref`` names.
            ShardError: storage failed, or the head does not decode.
        """
        uri = head_path(ref.folder)
        try:
            data = _verified(uri, ref.manifest_digest, None, "manifest of " + ref.snapshot_id)
        except ShardMissing:
            found = list(on_bus())
            if not found:
                raise
            named = next((m for m in found if split_manifest(m).ref == ref), None)
            if named is None:
                raise ShardCorrupt(
                    f"the manifest of {ref.snapshot_id} on the bus is not the one the restore "
                    f"command names (digest {ref.manifest_digest})"
                ) from None
            return cls.of(named)
        try:
            head = decode(data, expect=ManifestHead, max_bytes=_UNLIMITED)
        except SchemaError as exc:
            raise ShardError(f"manifest {uri} does not decode: {exc}") from exc
        if (head.snapshot_id, head.world_size, head.folder) != (
            ref.snapshot_id,
            ref.world_size,
            ref.folder,
        ):
            raise ShardCorrupt(f"manifest {uri} is not the manifest of {ref.snapshot_id}")
        return cls(head)

    # -- the manifest's fields ------------------------------------------------------------

    @property
    def snapshot_id(self) -> str:
        """``<job_id>/g<generation>/s<step>``."""
        return self.head.snapshot_id

    @property
    def job_id(self) -> str:
        """The job that wrote it."""
        return self.head.job_id

    @property
    def generation(self) -> int:
        """Generation in which the shards were written."""
        return self.head.generation

    @property
    def step(self) -> int:
        """Training step captured."""
        return self.head.step

    @property
    def world_size(self) -> int:
        """World size the snapshot was written with."""
        return self.head.world_size

    @property
    def cursor(self) -> DataCursor:
        """Data cursor at ``step`` (world-size independent)."""
        return self.head.cursor

    @property
    def metadata(self) -> CheckpointMeta:
        """Hyperparameters, topology and code version."""
        return self.head.metadata

    @property
    def parent(self) -> str | None:
        """The snapshot the job started from (lineage), or ``None``."""
        return self.head.parent

    @property
    def data_version(self) -> str:
        """The dataset version every shard was trained on."""
        return self.head.cursor.data_version

    # -- shards ---------------------------------------------------------------------------

    def shard(self, rank: int) -> Shard | None:
        """Rank ``rank``'s shard, or ``None`` when the snapshot has no such rank; reads and
        verifies the part that lists it the first time.

        Raises:
            ShardMissing, ShardCorrupt, ShardError: the part is missing, is not the one the
                head names, or cannot be read or decoded.
        """
        ref = part_for_rank(self.head, rank)
        if ref is None:
            return None
        part = self._parts.get(ref.first_rank)
        if part is None:
            uri = part_path(self.head.folder, ref.first_rank)
            data = _verified(uri, ref.digest, ref.size_bytes, "manifest part")
            try:
                part = decode(data, expect=ManifestPart, max_bytes=_UNLIMITED)
            except SchemaError as exc:
                raise ShardError(f"manifest part {uri} does not decode: {exc}") from exc
            if part.snapshot_id != self.snapshot_id or [s.rank for s in part.shards] != list(
                range(ref.first_rank, ref.first_rank + ref.ranks)
            ):
                raise ShardCorrupt(f"manifest part {uri} is not the one its head names")
            self._parts[ref.first_rank] = part
        return part.shards[rank - ref.first_rank]

    def shards(self) -> tuple[Shard, ...]:
        """Every rank's shard, in rank order (reads every part not read yet; raises as
        :meth:`shard`)."""
        return self.manifest().shards

    def manifest(self) -> Manifest:
        """The whole manifest (reads every part not read yet; raises as :meth:`shard`)."""
        for ref in self.head.parts:
            self.shard(ref.first_rank)
        try:
            return join_manifest(self.head, self._parts)
        except ValueError as exc:
            raise ShardCorrupt(f"the manifest of {self.snapshot_id}: {exc}") from exc

    def __repr__(self) -> str:
        return f"Snapshot({self.snapshot_id!r}, step={self.step}, world_size={self.world_size})"
