"""A committed snapshot's manifest split for storage, and put back together: the
world-size-independent pieces a restore command names (ARCHITECTURE.md, "Sizes that do not
grow with the job").

A :class:`~trainguard.schemas.Manifest` lists one shard per rank: about 190 bytes each, 3 MB at
16,384 ranks, more than a bus record or a command may hold. :func:`split_manifest` cuts it
into a :class:`~trainguard.schemas.ManifestHead` (everything but the shards, plus one
:class:`~trainguard.schemas.ManifestPartRef` per part) and :class:`~trainguard.schemas.ManifestPart`
records of :data:`~trainguard.schemas.MANIFEST_PART_RANKS` ranks each. The head's stored bytes
are its ``canonical_bytes`` (unsigned) and their SHA-256 is the ``manifest_digest`` of the
:class:`~trainguard.schemas.SnapshotRef`; each part is checked against the digest the head
gives it. So a signed ``restore`` authenticates the head by digest, the head every part, and a
rank reads the head and only the parts holding the shards it loads.

Everything here is pure (no I/O) and deterministic: the state machine derives a snapshot's
reference from its manifest, and the daemon writes the very bytes that reference names.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Final

from trainguard.schemas._codec import encode
from trainguard.schemas._messages import (
    MANIFEST_PART_RANKS,
    Manifest,
    ManifestHead,
    ManifestPart,
    ManifestPartRef,
    Shard,
    SnapshotRef,
)

__all__ = [
    "MANIFEST_DIR",
    "SplitManifest",
    "head_path",
    "join_manifest",
    "part_for_rank",
    "part_path",
    "sha256_digest",
    "snapshot_ref",
    "split_manifest",
]

MANIFEST_DIR: Final = "trainguard"
"""Sub-folder of a snapshot's step folder holding its manifest head and parts."""

_UNLIMITED: Final = 2**62
"""A part is as large as its ranks make it (the codec's default limit is for bus records)."""


def sha256_digest(data: bytes) -> str:
    """``sha256:<64 hex>`` of ``data``."""
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def head_path(folder: str) -> str:
    """URI of the manifest head of the snapshot whose step folder is ``folder``."""
    return f"{folder.rstrip('/')}/{MANIFEST_DIR}/manifest.json"


def part_path(folder: str, first_rank: int) -> str:
    """URI of the manifest part starting at ``first_rank`` in step folder ``folder``."""
    return f"{folder.rstrip('/')}/{MANIFEST_DIR}/part-{first_rank:05d}.json"


@dataclasses.dataclass(frozen=True, slots=True)
class SplitManifest:
    """A manifest as stored: its head, the head's bytes, the parts' bytes, the reference.

    Attributes:
        head: the head (unsigned).
        head_bytes: the head's canonical bytes (``canonical_bytes(head)``, without the
            codec's record limit): what is stored, and what ``ref`` digests.
        parts: each part's stored bytes, in the head's ``parts`` order.
        ref: the snapshot's reference, as a restore command carries it.
    """

    head: ManifestHead
    head_bytes: bytes
    parts: tuple[bytes, ...]
    ref: SnapshotRef


def split_manifest(manifest: Manifest, ranks_per_part: int = MANIFEST_PART_RANKS) -> SplitManifest:
    """Split ``manifest`` into its head and parts and derive its reference.

    Args:
        manifest: a committed snapshot's manifest (its ``auth`` is ignored).
        ranks_per_part: ranks per part, >= 1.

    Returns:
        The stored form; ``ref.folder`` is rank 0's shard's step folder.

    Raises:
        ValueError: ``ranks_per_part`` < 1.
        SchemaError: the manifest breaks the wire contract.

    Cost: one encoding of every shard (about 10 ms per 1,000 ranks), once per commit.
    """
    if ranks_per_part < 1:
        raise ValueError(f"ranks_per_part must be >= 1, not {ranks_per_part}")
    shards = manifest.shards
    parts: list[bytes] = []
    refs: list[ManifestPartRef] = []
    for first in range(0, len(shards), ranks_per_part):
        chunk = shards[first : first + ranks_per_part]
        part = ManifestPart(
            snapshot_id=manifest.snapshot_id, first_rank=chunk[0].rank, shards=chunk
        )
        data = encode(part, max_bytes=_UNLIMITED)
        parts.append(data)
        refs.append(
            ManifestPartRef(
                first_rank=chunk[0].rank,
                ranks=len(chunk),
                size_bytes=len(data),
                digest=sha256_digest(data),
            )
        )
    head = ManifestHead(
        job_id=manifest.job_id,
        snapshot_id=manifest.snapshot_id,
        generation=manifest.generation,
        ts=manifest.ts,
        step=manifest.step,
        world_size=manifest.world_size,
        cursor=manifest.cursor,
        metadata=manifest.metadata,
        parent=manifest.parent,
        folder=shards[0].folder,
        size_bytes=sum(s.size_bytes for s in shards),
        parts=tuple(refs),
    )
    # Stored, not sent: as large as rank 0's metadata and the part list make it. The codec's
    # record limit would make a checkpoint whose metadata nears it raise here, inside the
    # state machine's commit, on every fold of that record.
    head_bytes = encode(head, max_bytes=_UNLIMITED)
    ref = SnapshotRef(
        job_id=manifest.job_id,
        snapshot_id=manifest.snapshot_id,
        generation=manifest.generation,
        step=manifest.step,
        world_size=manifest.world_size,
        cursor=manifest.cursor,
        parent=manifest.parent,
        folder=head.folder,
        manifest_digest=sha256_digest(head_bytes),
    )
    return SplitManifest(head, head_bytes, tuple(parts), ref)


def snapshot_ref(manifest: Manifest) -> SnapshotRef:
    """The reference of ``manifest`` (:func:`split_manifest`'s ``ref``)."""
    return split_manifest(manifest).ref


def part_for_rank(head: ManifestHead, rank: int) -> ManifestPartRef | None:
    """The part of ``head`` that lists ``rank``'s shard, or ``None`` (no such rank)."""
    for part in head.parts:
        if part.first_rank <= rank < part.first_rank + part.ranks:
            return part
    return None


def join_manifest(head: ManifestHead, parts: Mapping[int, ManifestPart]) -> Manifest:
    """The whole manifest from its head and every part (first rank -> part), already checked
    against their digests.

    Raises:
        ValueError: a part is missing, or the parts do not list ranks ``0..world_size-1``
            once each in order, or belong to another snapshot.
    """
    shards: list[Shard] = []
    for ref in head.parts:
        part = parts.get(ref.first_rank)
        if part is None:
            raise ValueError(f"part of ranks from {ref.first_rank} is missing")
        if part.snapshot_id != head.snapshot_id or len(part.shards) != ref.ranks:
            raise ValueError(f"part of ranks from {ref.first_rank} is not the head's")
        shards.extend(part.shards)
    if [s.rank for s in shards] != list(range(head.world_size)):
        raise ValueError(f"the parts do not list ranks 0..{head.world_size - 1} once each")
    return Manifest(
        job_id=head.job_id,
        snapshot_id=head.snapshot_id,
        generation=head.generation,
        ts=head.ts,
        step=head.step,
        world_size=head.world_size,
        shards=tuple(shards),
        cursor=head.cursor,
        metadata=head.metadata,
        parent=head.parent,
    )
