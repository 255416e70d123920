"""``trainguard demo``'s reference runs and options, without running anything: a cached
reference run is reused only for the run it stands for (its world size and arguments), the
demo's does not depend on the printed seed, runs beyond ``keep`` are pruned least recently used
first; used work folders and files given as folders are refused."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent import ConfigError
from trainguard.daemon.demo import _demo
from trainguard.daemon.demo import _harness as _rehearsal
from trainguard.daemon.demo._demo import DemoOptions, run_demo
from trainguard.daemon.demo._harness import reference_run

REPO = Path(__file__).resolve().parents[3]


class _Finished:
    """A finished supervisor process (what ``supervise`` returns), exit status 0."""

    def wait(self, timeout: float | None = None) -> int:
        return 0


def test_a_cached_reference_run_is_reused_only_for_its_world_size_and_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo compared a 3-rank job with a cached 2-rank reference: the world size decides
    the batches and the gradient sums, so it is part of the key (as are the skipped steps)."""
    runs: list[dict[str, Any]] = []

    def fake_supervise(job_id: str, command: Sequence[str], **kwargs: Any) -> _Finished:
        out = Path(command[command.index("--out") + 1])
        (out / "final.sha256").write_text(f"run {len(runs)}\n")
        runs.append({"out": out, "world_size": kwargs["nproc_per_node"], "command": command})
        return _Finished()

    monkeypatch.setattr(_rehearsal, "supervise", fake_supervise)

    def reference(world_size: int, extra: Sequence[str] = ()) -> Path:
        return reference_run(
            REPO, tmp_path, steps=40, checkpoint_every=10, seed=0, world_size=world_size,
            extra=extra,
        )  # fmt: skip

    two = reference(2)
    three = reference(3)
    assert three != two
    assert [r["world_size"] for r in runs] == [2, 3]
    skipping = reference(2, ["--skip-steps", "20-22"])
    assert skipping not in (two, three)
    assert reference(2) == two  # reused: no new run
    assert reference(3) == three
    assert len(runs) == 3


class _Stop(Exception):
    """Ends :func:`run_demo` at its first reference run."""


def test_the_demos_reference_run_does_not_depend_on_the_printed_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each demo draws a new seed: were it the training's, each would cache a new 30 MB run."""
    calls: list[dict[str, object]] = []

    def fake_reference_run(repo: Path, cache: Path, **kwargs: object) -> Path:
        calls.append(kwargs)
        raise _Stop

    monkeypatch.setattr(_demo, "reference_run", fake_reference_run)
    for seed in (1, 2):
        with pytest.raises(_Stop):
            run_demo(DemoOptions(seed=seed, cache=tmp_path))
    assert calls[0] == calls[1]
    assert calls[0]["keep"] == _demo.CACHE_KEEP


def test_reference_runs_beyond_keep_are_pruned_least_recently_used_first(
    tmp_path: Path,
) -> None:
    args = {"steps": 40, "checkpoint_every": 10, "seed": 0, "extra": ()}
    key = _rehearsal._reference_key(REPO, 40, 10, 0, 2, ())
    cached = tmp_path / f"reference-{key}"
    cached.mkdir()
    (cached / "final.sha256").write_text("x")
    old = time.time() - 3600
    os.utime(cached, (old, old))  # the least recently used, until it is reused
    for i in range(3):
        other = tmp_path / f"reference-other{i}"
        other.mkdir()
        os.utime(other, (old + i + 1, old + i + 1))

    assert reference_run(REPO, tmp_path, keep=2, **args) == cached  # type: ignore[arg-type]

    assert sorted(p.name for p in tmp_path.iterdir()) == [cached.name, "reference-other2"]


def test_the_demo_refuses_a_used_work_folder_and_files_for_folders(tmp_path: Path) -> None:
    """A used work folder holds the last run's bus and fault markers (its kill would not fire
    again): refused before anything runs, as are files given as folders."""
    used = tmp_path / "used"
    (used / "run").mkdir(parents=True)
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ConfigError, match="is not empty"):
        DemoOptions(workdir=used)
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        DemoOptions(workdir=a_file)
    with pytest.raises(ConfigError, match=r"--cache-dir .* is a file, not a folder"):
        DemoOptions(cache=a_file)
    DemoOptions(workdir=tmp_path / "new", cache=tmp_path / "cache")  # fine: created on use
    (tmp_path / "empty").mkdir()
    DemoOptions(workdir=tmp_path / "empty")


def test_the_cache_follows_xdg_cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert DemoOptions().cache == tmp_path / "trainguard" / "demo"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert DemoOptions().cache == Path.home() / ".cache" / "trainguard" / "demo"
