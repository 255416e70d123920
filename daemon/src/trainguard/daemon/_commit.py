"""The commit rule: when a step's checkpoint shards form a training snapshot.

ARCHITECTURE.md section 4: step S of generation G is committed when every rank of the world size
has reported a shard for (G, S), all with one data version and one world size; the data cursor
is world-size independent, so every rank's must be the same too, and so must the snapshot the
job started from (``parent``: shards of different origins are not one model). Only committed
steps are restore targets.
"""

from __future__ import annotations

from collections.abc import Mapping

from trainguard.schemas import Checkpoint, Manifest, Shard


def snapshot_id(job_id: str, generation: int, step: int) -> str:
    """``<job_id>/g<generation>/s<step>``: a step re-committed in a later generation differs."""
    return f"{job_id}/g{generation}/s{step}"


def commit(
    job_id: str,
    generation: int,
    step: int,
    world_size: int,
    shards: Mapping[int, Checkpoint],
    now_ns: int,
) -> Manifest | str:
    """Build the manifest of ``step`` from one shard per rank, or say why it cannot commit.

    Args:
        job_id: the job.
        generation: the generation every shard was written in.
        step: the step every shard captures.
        world_size: ranks in the job; ``shards`` must hold exactly ranks ``0..world_size-1``
            (the caller has checked every shard's rank and world size against it).
        shards: rank -> that rank's checkpoint event.
        now_ns: the manifest's ``ts`` (the daemon's clock, ns).

    Returns:
        The manifest (shards ordered by rank; cursor, metadata and ``parent`` are rank 0's),
        or a reason naming the disagreeing ranks when data versions, cursors or parents differ.

    Raises:
        ValueError: ``shards`` does not hold exactly the ranks ``0..world_size-1``.
    """
    if sorted(shards) != list(range(world_size)):
        raise ValueError(f"shards of ranks {sorted(shards)} for world size {world_size}")
    ordered = [shards[r] for r in range(world_size)]
    first = ordered[0]
    versions = [c for c in ordered if c.data_version != first.data_version]
    if versions:
        odd = ", ".join(f"rank {c.rank}: {c.data_version!r}" for c in versions[:8])
        return (
            f"shards of step {step} in generation {generation} disagree on the data version "
            f"(rank 0: {first.data_version!r}; {odd}); step not committed"
        )
    cursors = [c for c in ordered if c.cursor != first.cursor]
    if cursors:
        odd = ", ".join(f"rank {c.rank}: {c.cursor}" for c in cursors[:8])
        return (
            f"shards of step {step} in generation {generation} disagree on the data cursor "
            f"(rank 0: {first.cursor}; {odd}); step not committed"
        )
    parents = [c for c in ordered if c.parent != first.parent]
    if parents:
        odd = ", ".join(f"rank {c.rank}: {c.parent!r}" for c in parents[:8])
        return (
            f"shards of step {step} in generation {generation} disagree on the snapshot the job "
            f"started from (rank 0: {first.parent!r}; {odd}); step not committed"
        )
    return Manifest(
        job_id=job_id,
        snapshot_id=snapshot_id(job_id, generation, step),
        generation=generation,
        ts=now_ns,
        step=step,
        world_size=world_size,
        shards=tuple(
            Shard(rank=c.rank, uri=c.shard_uri, size_bytes=c.size_bytes, digest=c.digest)
            for c in ordered
        ),
        cursor=first.cursor,
        metadata=first.metadata,
        parent=first.parent,
    )
