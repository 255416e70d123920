"""Issue 5's what-if on a real hang: the charlm job of ``test_detection.py``'s hang scenario
(rank 1's training thread blocks for 20 s after step 30 while its heartbeats go on) runs under
a real daemon on the embedded bus; ``JobRun.record`` checks that the replay reproduces the
recorded decisions; then ``trainguard replay --what-if`` with a progress floor above the hang
shows the hang's incident and its restore disappearing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.scenarios.harness import JOB, JobRun, Shape, only
from tests.support.buses import BusFactory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HANG = "slow@step=1,rank=0,factor=15,steps=27;hang@step=30,rank=1,seconds=20"
"""``test_detection.py``'s hang: about 0.3 s per step up to step 27 (so that the adaptive
progress timeout has samples), then rank 1 blocks for 20 s after step 30."""


def test_a_hang_restore_disappears_under_a_progress_floor_above_the_hang(
    tmp_path: Path, reference: Path
) -> None:
    bus = BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "t.")
    run = JobRun(bus, tmp_path, Shape(checkpoint_every=10), reference, context=HANG)
    try:
        run.start_daemon()
        run.start_job(HANG)
        code = run.finish()
        record = run.record()  # also: the replay reproduces the recorded decisions
    finally:
        run.close()
    assert code == 0, run.describe()
    restore = only(record.restores(), "restore", run)
    assert "kept heartbeating without completing a step" in restore.reason, run.describe()

    patient = tmp_path / "patient.toml"
    patient.write_text("[machine]\nprogress_floor_s = 60.0\n")
    args = ["replay", JOB, "--bus", bus.url, "--prefix", bus.prefix, "--what-if", str(patient)]
    text = _trainguard(*args)
    print(text.stdout)  # the what-if as people read it (pytest -s)
    assert text.returncode == 0, text.stdout + text.stderr
    assert "progress_floor_s" in text.stdout

    done = _trainguard(*args, "--format", "jsonl")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines[-1]["type"] == "verdict"
    assert lines[-1]["ok"] is True
    findings = [c for c in (x for x in lines if x["type"] == "change") if not c["beyond_horizon"]]
    gone = [c["before"] for c in findings if c["change"] == "disappears"]
    assert [d["cause"] for d in gone if d["decision"] == "incident_opened"] == [
        "progress_timeout"
    ], run.describe()
    assert [_restore_generation(d) for d in gone if _restore_generation(d)] == [1]
    came = [c["after"] for c in findings if c["change"] != "disappears"]
    assert not [d for d in came if _restore_generation(d)], f"a restore instead: {came}"


def _trainguard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainguard.daemon.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _restore_generation(decision: dict[str, Any]) -> int | None:
    """The generation of a restore issued by ``decision``, else ``None``."""
    command = decision.get("command")
    if isinstance(command, dict) and command["schema"].startswith("restore/"):
        return int(command["generation"])
    return None
