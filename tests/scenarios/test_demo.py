"""``trainguard demo`` as users run it, a real training job end to end: one restore after a kill,
and NaN losses restored (one in process, one in the last heartbeat interval), each ending
bitwise equal to the uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]
REPO = Path(__file__).resolve().parents[2]


def run_demo(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``trainguard demo`` of the tests' job (seed 3, 120 steps) with ``args``, reference runs
    cached in ``cache``: its output."""
    return subprocess.run(
        [*CLI, "demo", "--seed", "3", "--steps", "120", "--cache-dir", str(cache), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200"},
        timeout=280,
    )


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One reference-run cache for the demo tests of this module: they train the same job
    uninterrupted (seed 3, 120 steps), which is worth doing once."""
    return tmp_path_factory.mktemp("demo-cache")


@pytest.fixture(scope="module")
def recovered(
    tmp_path_factory: pytest.TempPathFactory, demo_cache: Path
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The README's first command, run once: its output and its work folder."""
    work = tmp_path_factory.mktemp("demo") / "work"
    done = run_demo(demo_cache, "--workdir", str(work))
    return done, work


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_recovers_exactly(
    recovered: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """The README's first command: one restore, bitwise-equal parameters, exact ledger."""
    done, _ = recovered
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "bitwise equal" in done.stdout
    assert "exact: nothing skipped, nothing repeated" in done.stdout
    # The supervisor keeps warm spares; whether the restart came from them is said.
    assert re.search(r"restart +(│ +)?(warm: every rank|cold: the spares)", done.stdout), (
        done.stdout
    )
    assert "time to resume" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pruning_the_demo_keeps_what_it_promises(
    recovered: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """After the demo's job (a kill, a restore, commits in two generations) finished, ``prune
    --keep-last 2`` deletes every other snapshot's files and nothing else: the two newest still
    verify byte for byte, a deleted one is refused by ``compat`` for its missing files, and a
    second prune finds nothing left to delete."""
    done, work = recovered
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    prefix = re.search(r"\(topics (demo-[0-9a-f]+\.)\*\)", done.stdout)
    assert prefix is not None, done.stdout
    where = ["--bus", f"sqlite://{work / 'bus.db'}", "--prefix", prefix[1]]

    def checkpoints(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, "checkpoints", *args, *where],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "200"},
            timeout=120,
        )

    listed = checkpoints("list", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    snapshots = [row["snapshot_id"] for row in json.loads(listed.stdout)]
    assert len(snapshots) >= 3, snapshots
    dry = checkpoints("prune", "--keep-last", "2", "--dry-run", "--format", "json")
    assert dry.returncode == 0, dry.stderr
    planned = {v["name"]: v["action"] for v in json.loads(dry.stdout)["verdicts"]}
    assert [s for s in snapshots if planned[s] == "keep"] == snapshots[-2:]
    files_before = sorted(p for p in (work / "run").rglob("*") if p.is_file())
    pruned = checkpoints("prune", "--keep-last", "2", "--format", "json")
    assert pruned.returncode == 0, pruned.stderr
    verdicts = json.loads(pruned.stdout)["verdicts"]
    deleted = {v["name"] for v in verdicts if v["action"] == "deleted"}
    assert set(snapshots[:-2]) <= deleted
    leftovers = deleted - set(snapshots)
    assert all(name.startswith("leftover ") for name in leftovers)
    files_after = sorted(p for p in (work / "run").rglob("*") if p.is_file())
    removed = set(files_before) - set(files_after)
    assert removed
    assert all("checkpoints" in p.parts for p in removed)
    for newest in snapshots[-2:]:
        verified = checkpoints("compat", newest, "--verify")
        assert verified.returncode == 0, verified.stdout + verified.stderr
    refused = checkpoints("compat", snapshots[0])
    assert refused.returncode == 1
    assert "is missing" in refused.stdout
    again = checkpoints("prune", "--keep-last", "2", "--format", "json")
    actions = {v["name"]: v["action"] for v in json.loads(again.stdout)["verdicts"]}
    assert {actions[s] for s in snapshots[:-2]} == {"gone"}
    assert "deleted" not in actions.values()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_rehearses_a_nan_restored_in_process(tmp_path: Path, demo_cache: Path) -> None:
    """``trainguard demo --fault``: a NaN loss on rank 1 is detected and restored in process;
    a second one two steps before the end (defect F1) strikes, most likely, after the ranks'
    last periodic heartbeat: their last heartbeats, sent before their finish, show it, the
    restore stands though they finished, and their supervisor obeys it. The job still ends
    bitwise equal to the uninterrupted run."""
    done = run_demo(
        demo_cache,
        *("--fault", "nan@step=50,rank=1;nan@step=118,rank=1", "--step-sleep", "0.1"),
        *("--workdir", str(tmp_path / "work")),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "nan_loss" in done.stdout
    assert "in process at step" in done.stdout
    assert done.stdout.count("⚑ incident") == 2, done.stdout
    assert "bitwise equal" in done.stdout
    assert "exact: nothing skipped, nothing repeated" in done.stdout
