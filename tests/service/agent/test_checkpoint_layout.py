"""The shards' folder layout as retention reads and deletes it, on a real file system: job and
step folders are found only in the agent's layout, deletions stay inside a step folder, and
empty folders above go with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.agent.checkpoint import (
    job_folder,
    remove_files,
    remove_step_folder,
    step_folders,
)
from trainguard.agent.checkpoint._shards import shard_path


def test_the_layout_is_found_and_deleted_step_by_step(tmp_path: Path) -> None:
    shards = [shard_path(tmp_path, "job", g, s, r) for g, s in ((0, 10), (1, 20)) for r in (0, 1)]
    for path in shards:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 10)
    (shards[2].parent / ".rank00000.pt.123.tmp").write_bytes(b"partial")
    (tmp_path / "job" / ".faults-fired").mkdir()
    assert job_folder(shards[0].as_uri(), "job") == tmp_path / "job"
    assert job_folder(shards[0].as_uri(), "other") is None
    assert job_folder((tmp_path / "job" / "rank0.pt").as_uri(), "job") is None
    assert job_folder("s3://bucket/job/g000000/s0000000010/rank00000.pt", "job") is None
    found = step_folders(tmp_path / "job")
    assert [(f.generation, f.step) for f in found] == [(0, 10), (1, 20)]
    assert remove_files(p.as_uri() for p in shards[:2]) == 20
    assert not (tmp_path / "job" / "g000000").exists()  # empty step and generation folders go
    assert remove_files([shards[0].as_uri()]) == 0  # already gone: nothing to do
    with pytest.raises(ValueError, match="is not a step folder"):
        remove_step_folder(tmp_path / "job")
    assert remove_step_folder(found[1].path) == 27
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == [".faults-fired"]
    assert step_folders(tmp_path / "missing") == []
