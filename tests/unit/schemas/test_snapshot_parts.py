"""A manifest split for storage and put back together (``trainguard.schemas``,
``split_manifest``): the pieces a restore names, whose size does not grow with the job."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.schemas import (
    DEFAULT_MAX_BYTES,
    DataCursor,
    Manifest,
    ManifestHead,
    ManifestPart,
    Restore,
    Shard,
    decode,
    encode,
    join_manifest,
    part_for_rank,
    sha256_digest,
    sign,
    split_manifest,
)

CURSOR = DataCursor(data_version="sha256:" + "a" * 64, seed=1, epoch=0, offset=5, world_size=1)


def manifest(world_size: int, *, dcp: bool = False) -> Manifest:
    """A committed manifest of ``world_size`` ranks in the agent's layout (``torch.save`` files
    or one DCP folder)."""
    folder = "s3://ckpt/llama-405b.pretrain/g000003/s0000012000"
    shards = tuple(
        Shard(
            rank=r,
            uri=folder if dcp else f"{folder}/rank{r:05d}.pt",
            size_bytes=1 << 30,
            digest=sha256_digest(r.to_bytes(4, "big")),
        )
        for r in range(world_size)
    )
    return Manifest(
        job_id="llama-405b.pretrain",
        snapshot_id="llama-405b.pretrain/g3/s12000",
        generation=3,
        ts=1,
        step=12000,
        world_size=world_size,
        shards=shards,
        cursor=dataclasses.replace(CURSOR, world_size=world_size),
    )


@settings(max_examples=60, deadline=None)
@given(world_size=st.integers(1, 70), per_part=st.integers(1, 80))
def test_the_parts_put_back_together_are_the_manifest(world_size: int, per_part: int) -> None:
    whole = manifest(world_size)
    split = split_manifest(whole, per_part)
    assert split.head_bytes == encode(split.head)
    assert split.ref.manifest_digest == sha256_digest(split.head_bytes)
    parts = {}
    for ref, data in zip(split.head.parts, split.parts, strict=True):
        assert (ref.size_bytes, ref.digest) == (len(data), sha256_digest(data))
        parts[ref.first_rank] = decode(data, expect=ManifestPart)
    assert join_manifest(decode(split.head_bytes, expect=ManifestHead), parts) == whole
    for rank in range(world_size):
        found = part_for_rank(split.head, rank)
        assert found is not None
        assert found.first_rank <= rank < found.first_rank + found.ranks
    assert part_for_rank(split.head, world_size) is None


def test_any_change_to_a_shard_changes_the_digest_a_restore_names() -> None:
    whole = manifest(3000)
    digest = split_manifest(whole).ref.manifest_digest
    shards = list(whole.shards)
    shards[2047] = dataclasses.replace(shards[2047], size_bytes=1)
    changed = dataclasses.replace(whole, shards=tuple(shards))
    assert split_manifest(changed).ref.manifest_digest != digest
    assert split_manifest(dataclasses.replace(whole, ts=2)).ref.manifest_digest != digest


def test_a_part_missing_or_of_another_snapshot_does_not_join() -> None:
    split = split_manifest(manifest(5), 2)
    parts = {
        r.first_rank: decode(d, expect=ManifestPart)
        for r, d in zip(split.head.parts, split.parts, strict=True)
    }
    with pytest.raises(ValueError, match="from 2 is missing"):
        join_manifest(split.head, {k: v for k, v in parts.items() if k != 2})
    other = dataclasses.replace(parts[2], snapshot_id="x/g0/s1")
    with pytest.raises(ValueError, match="not the head's"):
        join_manifest(split.head, parts | {2: other})


@pytest.mark.parametrize("dcp", [False, True], ids=["torch", "dcp"])
def test_at_16384_ranks_a_restore_and_a_head_each_fit_64_kib(dcp: bool) -> None:
    """The issue's bound: what goes on the bus for one snapshot does not grow with the job;
    the whole manifest (3 MB) lives in parts of about 200 KB, a rank reads one."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    whole = manifest(16384, dcp=dcp)
    split = split_manifest(whole)
    restore = Restore(
        job_id=whole.job_id,
        generation=4,
        ts=2,
        seq=9,
        daemon_id="trainguard-daemon-0",
        incident_id=f"{whole.job_id}/i1",
        reason="rank 9000 exited (signal 9)",
        target=split.ref,
    )
    command = encode(sign(restore, "0123456789abcdef", key))
    head = encode(sign(split.head, "0123456789abcdef", key))
    assert len(command) < 1024
    assert len(head) < 4 * 1024 < DEFAULT_MAX_BYTES
    assert len(split.parts) == 16
    assert max(len(p) for p in split.parts) < 256 * 1024
    assert len(encode(whole, max_bytes=1 << 30)) > 2_000_000


def test_a_head_larger_than_a_record_still_splits_and_names_its_bytes() -> None:
    """Rank 0's metadata near the 64 KiB a checkpoint event may hold, at 16,384 ranks (16 part
    references): the head is over 64 KiB. Splitting (which the state machine does on every
    commit) raised then, and the daemon crashed on that record at every restart; the head
    is stored, not sent, so it has no record limit."""
    from trainguard.schemas import CheckpointMeta

    whole = dataclasses.replace(
        manifest(16384), metadata=CheckpointMeta(hyperparameters={"pad": "x" * 64_000})
    )
    split = split_manifest(whole)
    assert len(split.head_bytes) > DEFAULT_MAX_BYTES
    assert split.ref.manifest_digest == sha256_digest(split.head_bytes)
    assert decode(split.head_bytes, expect=ManifestHead, max_bytes=1 << 20) == split.head
