"""The shards' folder layout as retention reads and deletes it, on a real file system: job and
step folders are found only in the agent's layout, a committed snapshot is deleted only as its
own step folder (never a path its manifest names elsewhere, never through a link), and a
folder another prune already deleted is no error."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.agent.checkpoint import (
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
    assert job_folder(first[0].as_uri(), "job") == tmp_path / "job"
    assert job_folder(first[0].as_uri(), "other") is None
    assert job_folder((tmp_path / "job" / "rank0.pt").as_uri(), "job") is None
    assert job_folder("s3://bucket/job/g000000/s0000000010/rank00000.pt", "job") is None
    found = step_folders(tmp_path / "job")
    assert [(f.generation, f.step) for f in found] == [(0, 10), (1, 20)]
    folder = snapshot_folder(at(*first), "job", 0, 10)
    assert folder == first[0].parent
    assert remove_step_folder(folder) == 20
    assert not (tmp_path / "job" / "g000000").exists()  # the empty generation folder goes too
    assert remove_step_folder(folder) == 0  # another prune got there first
    with pytest.raises(ValueError, match="is not a step folder"):
        remove_step_folder(tmp_path / "job")
    assert remove_step_folder(found[1].path) == 27
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == [".faults-fired"]
    assert step_folders(tmp_path / "missing") == []


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
    assert [(f.generation, f.step) for f in step_folders(tmp_path / "job")] == [(0, 10)]
    with pytest.raises(ValueError, match="symbolic link"):
        remove_step_folder(linked)
    with pytest.raises(ValueError, match="symbolic link"):
        snapshot_folder(at(linked / "rank00000.pt"), "job", 3, 30)
    with pytest.raises(ValueError, match="symbolic link"):
        snapshot_folder(at(linked, dcp=True), "job", 3, 30)
    assert victim.read_text() == "keep me"
    assert (outside / "data").read_text() == "keep me too"


def test_a_dcp_snapshot_is_its_own_step_folder(tmp_path: Path) -> None:
    folder = written(tmp_path, 2, 40)[0].parent
    assert snapshot_folder(at(folder, folder, dcp=True), "job", 2, 40) == folder
    with pytest.raises(ValueError, match="is not its step folder"):
        # A DCP shard naming a file would make its parent look like the folder: not so.
        snapshot_folder(at(folder / "rank00000.pt", dcp=True), "job", 2, 40)
