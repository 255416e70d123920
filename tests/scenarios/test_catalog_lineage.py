"""Issue 5's catalog "Done when", on the real ``examples/charlm`` job: job A runs under the daemon;
job B starts from A's step-40 snapshot (``trainguard run --init-from``) and trains on to step
60; ``trainguard checkpoints lineage`` of B's snapshot shows A's as its parent, and ``compat``
refuses A's snapshot for another data version, saying why.

B continues A's run exactly (same seed and hyperparameters, RNG streams and data cursor from
the snapshot), so its final parameters equal A's bitwise: the snapshot really was loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from examples.charlm.ledger import ledger_path, read_ledger
from trainguard.daemon.demo._harness import (
    charlm_command,
    charlm_env,
    start_daemon,
    stop_process,
    supervise,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]
REPO = Path(__file__).resolve().parents[2]
PREFIX = "lineage."
STEPS, EVERY, SEED = 60, 20, 3


def checkpoints(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "checkpoints", *args, "--bus", url, "--topic-prefix", PREFIX],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "250"},  # rich wraps at the width it is given
    )


def wait_committed(url: str, snapshot: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """The catalog row of ``snapshot`` once the daemon has committed it."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = checkpoints(url, "list", "--format", "json")
        assert done.returncode == 0, done.stderr
        rows: dict[str, dict[str, Any]] = {r["snapshot_id"]: r for r in json.loads(done.stdout)}
        if snapshot in rows:
            return rows[snapshot]
        assert time.monotonic() < deadline, f"{snapshot} not committed; catalog: {sorted(rows)}"
        time.sleep(0.5)


def test_a_job_started_from_a_snapshot_records_it_as_parent(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'bus.db'}"
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    command_a = charlm_command(out_a, steps=STEPS, checkpoint_every=EVERY, seed=SEED)
    command_b = charlm_command(out_b, steps=STEPS, checkpoint_every=EVERY, seed=SEED)
    daemon = start_daemon(url, prefix=PREFIX, log_path=tmp_path / "daemon.log")
    job_b: subprocess.Popen[bytes] | None = None
    job_a = supervise(
        "lineage-a",
        command_a,
        bus_url=url,
        prefix=PREFIX,
        nproc_per_node=2,
        log_path=tmp_path / "a.log",
        env=charlm_env(out_a, REPO),
    )
    try:
        assert job_a.wait(150) == 0, (tmp_path / "a.log").read_text()[-3000:]
        origin = wait_committed(url, "lineage-a/g0/s40")
        with (tmp_path / "b.log").open("ab") as log:
            job_b = subprocess.Popen(
                [
                    *CLI,
                    "run",
                    "--job",
                    "lineage-b",
                    "--bus",
                    url,
                    "--topic-prefix",
                    PREFIX,
                    "--nproc-per-node",
                    "2",
                    "--init-from",
                    "lineage-a/g0/s40",
                    "--",
                    *command_b,
                ],
                stdout=log,
                stderr=log,
                env={**os.environ, **charlm_env(out_b, REPO)},
                start_new_session=True,
            )
        assert job_b.wait(150) == 0, (tmp_path / "b.log").read_text()[-3000:]
        child = wait_committed(url, "lineage-b/g0/s60")
    finally:
        for proc in (job_a, job_b, daemon):
            if proc is not None:
                stop_process(proc)

    # B trained steps 41..60 only, on the batches A trained them on, and ended with A's final
    # parameters: it continued A's run from the snapshot of step 40, exactly.
    ledgers = [read_ledger(ledger_path(out, r) for r in range(2)) for out in (out_a, out_b)]
    assert sorted({r.step for r in ledgers[1]}) == list(range(41, STEPS + 1))
    consumed = [sorted((r.step, r.rank, r.samples) for r in ledger) for ledger in ledgers]
    assert consumed[1] == [c for c in consumed[0] if c[0] > 40]
    assert (out_b / "final.sha256").read_text() == (out_a / "final.sha256").read_text()
    assert child["parent"] == "lineage-a/g0/s40"

    shown = checkpoints(url, "lineage", "lineage-b/g0/s60")
    assert shown.returncode == 0, shown.stderr
    assert "started from lineage-a/g0/s40" in shown.stdout, shown.stdout
    assert "job lineage-a started from scratch" in shown.stdout, shown.stdout
    found = json.loads(checkpoints(url, "lineage", "lineage-b/g0/s60", "--format", "json").stdout)
    assert [a["snapshot_id"] for a in found["ancestors"]] == [
        "lineage-b/g0/s60",
        "lineage-a/g0/s40",
    ]
    descendants = json.loads(
        checkpoints(url, "lineage", "lineage-a/g0/s40", "--format", "json").stdout
    )["descendants"]
    assert [(d["job_id"], d["snapshots"]) for d in descendants] == [
        ("lineage-b", ["lineage-b/g0/s60"])
    ]

    refused = checkpoints(url, "compat", "lineage-a/g0/s40", "--data-version", "other")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "incompatible" in refused.stdout
    assert f"data version 'other' differs from the snapshot's {origin['data_version']!r}" in (
        " ".join(refused.stdout.split())
    )
    same = checkpoints(
        url,
        "compat",
        "lineage-a/g0/s40",
        "--world-size",
        "2",
        "--data-version",
        str(origin["data_version"]),
        "--hyperparameter",
        f"seed={SEED}",
        "--exact",
        "--verify",
    )
    assert same.returncode == 0, same.stdout + same.stderr
