"""A job recorded by an earlier build replays to the same decisions with this one.

``data/charlm-demo-5296f9b.tgjsonl.gz`` is ``trainguard export`` of a ``trainguard demo`` run
(``--seed 7 --steps 80``) made by commit 5296f9b, the last build before the daemon was split
into sub-packages: two ranks, checkpoints every 20 steps, rank 1 SIGKILLed at step 45, an
in-process restore of generation 1 to step 40, and the job finishing at step 80. The file holds
the daemon's audit trail, so a replay that decides anything differently from that build (a
moved rule, a changed threshold, a reordered fold) fails its verification.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RECORD = Path(__file__).parent / "data" / "charlm-demo-5296f9b.tgjsonl.gz"

pytestmark = pytest.mark.timeout(120)


def test_a_job_recorded_before_the_move_replays_and_verifies() -> None:
    command = ["replay", "charlm-demo", "--file", str(RECORD), "--format", "jsonl"]
    done = subprocess.run(
        [sys.executable, "-m", "trainguard.daemon.cli", *command],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    verdict = lines[-1]
    assert verdict["type"] == "verdict"
    assert verdict["ok"] is True, verdict["difference"]
    assert verdict["replayed"] == verdict["recorded"] == 9
    decided = [d for line in lines if line["type"] == "row" for d in line["decisions"]]
    kinds = [d["decision"] for d in decided]
    assert kinds.count("committed") == 4
    assert "incident_opened" in kinds
    assert decided[-1] == decided[-1] | {"decision": "transition", "new": "finished"}
