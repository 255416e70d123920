"""Where the daemon may store a committed manifest (``job_step_folder``): only a step folder of
the manifest's own job, in the agent's layout, on storage manifests go to; a worker that names
another job's folder, a relative path, a symbolic link out of the job, or storage the daemon
should not write or connect to (``memory://``, ``http://``, chained URLs) is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.agent.checkpoint._layout import job_step_folder

JOB = "job-a"
STEP = f"{JOB}/g000001/s0000000010"


@pytest.mark.parametrize(
    ("folder", "reason"),
    [
        (f"s3://bucket/ckpt/{STEP}", None),
        (f"gs://bucket/{STEP}/", None),
        ("s3://bucket/ckpt/job-b/g000001/s0000000010", "not a <root>/job-a/"),
        (f"s3://bucket/ckpt/{JOB}/g1/s10", "not a <root>/job-a/"),
        (f"memory://ckpt/{STEP}", "storage 'memory' is not one manifests go to"),
        (f"http://10.0.0.1/{STEP}", "storage 'http' is not one manifests go to"),
        (f"blockcache::file:///ckpt/{STEP}", "storage 'blockcache' is not one"),
        (f"/ckpt/{STEP}", "storage 'without a scheme' is not one"),
        (f"file:ckpt/{STEP}", "a relative path"),
    ],
)
def test_only_the_jobs_own_step_folders_on_known_storage(folder: str, reason: str | None) -> None:
    refused = job_step_folder(folder, JOB)
    assert refused == reason if reason is None else reason in (refused or "")


def test_a_local_step_folder_of_the_job_is_accepted(tmp_path: Path) -> None:
    step = tmp_path / STEP
    step.mkdir(parents=True)
    assert job_step_folder(step.as_uri(), JOB) is None


def test_symbolic_links_out_of_the_job_are_refused(tmp_path: Path) -> None:
    """A step folder of job A that is a link to job B's (planted by a worker of A), and a
    ``trainguard`` folder that is a link anywhere: the write would land elsewhere."""
    other = tmp_path / "job-b" / "g000001" / "s0000000010"
    other.mkdir(parents=True)
    linked = tmp_path / STEP
    linked.parent.mkdir(parents=True)
    linked.symlink_to(other, target_is_directory=True)
    assert "is not the job's" in (job_step_folder(linked.as_uri(), JOB) or "")

    real = tmp_path / "real" / STEP
    real.mkdir(parents=True)
    (real / "trainguard").symlink_to(other, target_is_directory=True)
    assert "trainguard folder is a symbolic link" in (job_step_folder(real.as_uri(), JOB) or "")
