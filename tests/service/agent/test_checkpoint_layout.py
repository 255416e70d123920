"""The shards' folder layout as retention reads and deletes it, on a real file system: job and
step folders are found only in the agent's layout, a committed snapshot is deleted only as its
own step folder (never a path its manifest names elsewhere, never through a link), and a
folder another prune already deleted is no error."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.agent.checkpoint import (
    files_present,
    job_folder,
    remove_step_folder,
    snapshot_folder,
    step_folders,
)
from trainguard.agent.checkpoint._shards import shard_path
from trainguard.schemas import Shard, StoredFile


def written(root: Path, generation: int, step: int) -> list[Path]:
    shards = [shard_path(root, "job", generation, step, rank) for rank in (0, 1)]
    for path in shards:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 10)
    return shards


def at(*paths: Path, dcp: bool = False) -> list[Shard]:
    """Shards of the files (or, ``dcp``, DCP folders) ``paths``."""
    files = (StoredFile(name=".metadata", size_bytes=0, digest=ZERO),) if dcp else None
    return [
        Shard(rank=r, uri=p.as_uri(), size_bytes=0, digest=ZERO, files=files)
        for r, p in enumerate(paths)
    ]


ZERO = "sha256:" + "0" * 64


def test_the_layout_is_found_and_deleted_step_by_step(tmp_path: Path) -> None:
    first, second = written(tmp_path, 0, 10), written(tmp_path, 1, 20)
    (second[0].parent / ".rank00000.pt.123.tmp").write_bytes(b"partial")
    (tmp_path / "job" / ".faults-fired").mkdir()
    job = (tmp_path / "job").as_uri()
    assert job_folder(at(first[0])[0], "job") == job
    assert job_folder(at(first[0].parent, dcp=True)[0], "job") == job
    assert job_folder(at(first[0])[0], "other") is None
    assert job_folder(at(tmp_path / "job" / "rank0.pt")[0], "job") is None
    in_s3 = Shard(
        rank=0, uri="s3://b/job/g000000/s0000000010/rank00000.pt", size_bytes=0, digest=ZERO
    )
    assert job_folder(in_s3, "job") == "s3://b/job"
    found = step_folders(job)
    assert [(f.generation, f.step) for f in found] == [(0, 10), (1, 20)]
    assert files_present(at(*first))
    folder = snapshot_folder(at(*first), "job", 0, 10)
    assert folder == first[0].parent.as_uri()
    assert remove_step_folder(folder) == 20
    assert not (tmp_path / "job" / "g000000").exists()  # the empty generation folder goes too
    assert not files_present(at(*first))
    assert remove_step_folder(folder) == 0  # another prune got there first
    with pytest.raises(ValueError, match="is not a step folder"):
        remove_step_folder(job)
    assert remove_step_folder(found[1].uri) == 27
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == [".faults-fired"]
    assert step_folders((tmp_path / "missing").as_uri()) == []


def test_a_manifest_naming_files_elsewhere_or_through_a_link_deletes_nothing(
    tmp_path: Path,
) -> None:
    shards = written(tmp_path, 0, 10)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    elsewhere = at(victim)
    with pytest.raises(ValueError, match="is not its step folder"):
        snapshot_folder(elsewhere, "job", 0, 10)
    with pytest.raises(ValueError, match="is not its step folder"):
        snapshot_folder(at(shards[0]), "job", 0, 11)
    with pytest.raises(ValueError, match="not in one step folder"):
        snapshot_folder(at(shards[0], victim), "job", 0, 10)
    outside = tmp_path / "outside" / "s0000000030"
    outside.mkdir(parents=True)
    (outside / "data").write_text("keep me too")
    (tmp_path / "job" / "g000003").symlink_to(outside.parent)
    linked = tmp_path / "job" / "g000003" / "s0000000030"
    assert [(f.generation, f.step) for f in step_folders((tmp_path / "job").as_uri())] == [(0, 10)]
    with pytest.raises(ValueError, match="symbolic link"):
        remove_step_folder(linked.as_uri())
    with pytest.raises(ValueError, match="symbolic link"):
        snapshot_folder(at(linked / "rank00000.pt"), "job", 3, 30)
    with pytest.raises(ValueError, match="symbolic link"):
        snapshot_folder(at(linked, dcp=True), "job", 3, 30)
    assert victim.read_text() == "keep me"
    assert (outside / "data").read_text() == "keep me too"


def test_a_dcp_snapshot_is_its_own_step_folder(tmp_path: Path) -> None:
    folder = written(tmp_path, 2, 40)[0].parent
    assert snapshot_folder(at(folder, folder, dcp=True), "job", 2, 40) == folder.as_uri()
    with pytest.raises(ValueError, match="is not its step folder"):
        # A DCP shard naming a file would make its parent look like the folder: not so.
        snapshot_folder(at(folder / "rank00000.pt", dcp=True), "job", 2, 40)


@pytest.mark.s3
def test_on_object_storage_a_step_folder_is_a_prefix(s3_bucket: str) -> None:
    """Listed and deleted through fsspec on a real S3-compatible server: the objects of the
    step's prefix go, its neighbours stay."""
    import fsspec

    fs = fsspec.filesystem("s3")
    base = f"s3://{s3_bucket}/ckpt/job"
    for step, names in ((10, (".metadata", "__0_0.distcp")), (20, (".metadata",))):
        for name in names:
            fs.pipe_file(f"{base}/g000001/s{step:010d}/{name}", b"y" * 7)
    fs.pipe_file(f"{base}/notes.txt", b"keep")
    found = step_folders(base)
    assert [(f.generation, f.step, f.uri) for f in found] == [
        (1, 10, f"{base}/g000001/s0000000010"),
        (1, 20, f"{base}/g000001/s0000000020"),
    ]
    files = (StoredFile(name=".metadata", size_bytes=7, digest=ZERO),)
    shard = Shard(rank=0, uri=found[0].uri, size_bytes=7, digest=ZERO, files=files)
    assert job_folder(shard, "job") == base
    assert files_present([shard])
    assert snapshot_folder([shard], "job", 1, 10) == found[0].uri
    assert remove_step_folder(found[0].uri) == 14
    assert not files_present([shard])
    assert [f.step for f in step_folders(base)] == [20]
    assert fs.cat_file(f"{base}/notes.txt") == b"keep"
    assert step_folders(f"s3://{s3_bucket}/nothing-here") == []


@pytest.mark.s3
def test_storage_without_credentials_fails_as_an_oserror(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """botocore's own errors (here ``NoCredentialsError``, not an ``OSError``) reach retention
    and restores as the ``OSError`` these functions promise, naming the error: a prune then
    skips the job and says why instead of ending in a traceback."""
    import s3fs

    from trainguard.agent.checkpoint._snapshot import _read

    base = f"s3://{s3_bucket}/ckpt/job"
    folder = f"{base}/g000001/s0000000010"
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup
    s3fs.S3FileSystem.clear_instance_cache()
    files = (StoredFile(name=".metadata", size_bytes=7, digest=ZERO),)
    shard = Shard(rank=0, uri=folder, size_bytes=7, digest=ZERO, files=files)
    for attempt in (
        lambda: step_folders(base),
        lambda: files_present([shard]),
        lambda: remove_step_folder(folder),
        lambda: _read(f"{folder}/.metadata", 100),
    ):
        with pytest.raises(OSError, match="NoCredentialsError"):
            attempt()
