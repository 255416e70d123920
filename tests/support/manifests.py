"""Synthetic committed snapshots for the checkpoint catalog's tests: :func:`manifest` makes a
:class:`Manifest` of a job at a step, its shards, data cursor and metadata filled in, committed
some seconds after ``T0`` (``S`` is one second, in nanoseconds)."""

from __future__ import annotations

from trainguard.schemas import CheckpointMeta, DataCursor, JSONValue, Manifest, Shard

S = 1_000_000_000
T0 = 1_764_000_000 * S
HYPER: dict[str, JSONValue] = {"lr": 0.003, "seed": 3, "model": {"d_model": 64, "layers": 2}}


def manifest(
    job: str,
    step: int,
    *,
    generation: int = 0,
    parent: str | None = None,
    world_size: int = 2,
    data: str = "sha256:" + "d" * 64,
    code: str = "3f2c1e9a",
    at: int = 0,
    hyper: dict[str, JSONValue] | None = None,
    topology: dict[str, JSONValue] | None = None,
) -> Manifest:
    """A committed snapshot of ``job`` at ``step``, committed ``at`` seconds after ``T0``."""
    return Manifest(
        job_id=job,
        snapshot_id=f"{job}/g{generation}/s{step}",
        generation=generation,
        ts=T0 + at * S,
        step=step,
        world_size=world_size,
        shards=tuple(
            Shard(
                rank=r,
                uri=f"file:///ckpt/{job}/g{generation}/s{step}/rank{r}.pt",
                size_bytes=1000 + r,
                digest="sha256:" + f"{r}" * 64,
            )
            for r in range(world_size)
        ),
        cursor=DataCursor(data_version=data, seed=3, epoch=0, offset=step * 16, world_size=2),
        metadata=CheckpointMeta(
            hyperparameters=HYPER if hyper is None else hyper,
            topology={"world_size": world_size} if topology is None else topology,
            code_version=code,
        ),
        parent=parent,
    )
