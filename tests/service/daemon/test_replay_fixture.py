"""A job recorded by an earlier build replays to the same decisions with this one.

``data/charlm-demo-5296f9b.tgjsonl.gz`` is ``trainguard export`` of a ``trainguard demo`` run
(``--seed 7 --steps 80``) made by commit 5296f9b, the last build before the daemon was split
into sub-packages: two ranks, checkpoints every 20 steps, rank 1 SIGKILLed at step 45, an
in-process restore of generation 1 to step 40, and the job finishing at step 80. The file holds
the daemon's audit trail, so a replay that decides anything differently from that build (a
moved rule, a changed threshold, a reordered fold) fails its verification.
"""

from __future__ import annotations

import base64
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

RECORD = Path(__file__).parent / "data" / "charlm-demo-5296f9b.tgjsonl.gz"

pytestmark = pytest.mark.timeout(120)


def replayed(record: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``trainguard replay charlm-demo --file record *args`` in a process of its own."""
    command = ["replay", "charlm-demo", "--file", str(record), *args]
    return subprocess.run(
        [sys.executable, "-m", "trainguard.daemon.cli", *command],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def test_a_job_recorded_before_the_move_replays_and_verifies() -> None:
    done = replayed(RECORD, "--format", "jsonl")
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


def test_a_difference_in_a_trail_of_a_build_before_rules_versions_says_so(tmp_path: Path) -> None:
    """A decision recorded otherwise than this build decides (here: edited, as a rule that
    changed since would show) in a trail that records no rules version: the difference is
    printed with the reason it may be the rules', and the exit status stays 1."""
    with gzip.open(RECORD, "rt") as recorded:
        lines = recorded.read().splitlines()
    for n, line in enumerate(lines):
        record = json.loads(line)
        if record.get("topic") == "audit":
            entry = json.loads(base64.b64decode(record["value_b64"]))
            if entry["entry"] == "decisions":
                entry["decisions"][0]["reason"] = "decided under older rules"
                record["value_b64"] = base64.b64encode(json.dumps(entry).encode()).decode()
                lines[n] = json.dumps(record)
                break
    edited = tmp_path / "edited.tgjsonl.gz"
    with gzip.open(edited, "wt") as out:
        out.write("\n".join(lines) + "\n")
    done = replayed(edited)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "✗ the replay differs from the audit trail" in done.stdout
    said = " ".join(done.stdout.split())
    assert "by a build that recorded no rules version" in said
    assert "no rules version recorded; this build's: 1" in said  # the header's run line
    verdict = json.loads(replayed(edited, "--format", "jsonl").stdout.splitlines()[-1])
    assert (verdict["ok"], verdict["recorded_rules"], verdict["rules"]) == (False, None, 1)
