"""The supervisor's settings (``trainguard run``): bad ones fail before anything starts. The
supervisor with real workers is tested in ``tests/service/agent/test_supervisor.py``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent import ConfigError
from trainguard.agent.bus import DEFAULT_TOPICS, BusConfig
from trainguard.agent.supervisor._supervisor import SupervisorConfig

JOB = "sup-job"


def config(tmp_path: Path, **overrides: Any) -> SupervisorConfig:
    """Settings of a job whose worker would only exit, on an embedded bus in ``tmp_path`` (never
    opened: every case here is refused before anything starts)."""
    base: dict[str, Any] = {
        "job_id": JOB,
        "bus": BusConfig(url=f"sqlite://{tmp_path / 'bus.db'}", topics=DEFAULT_TOPICS),
        "command": [sys.executable, "-c", "pass"],
        "grace_s": 1.0,
        "host": "node-a",
        "daemon_timeout_s": 0.0,
        "state_dir": tmp_path / "state" / "trainguard",
    }
    return SupervisorConfig(**{**base, **overrides})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"job_id": "my job"}, "job_id"),
        ({"command": ["no-such-program-xyz"]}, "not found"),
        ({"nproc_per_node": 0}, "--nproc-per-node must be >= 1, got 0"),
        ({"warm": True}, "warm spares need --nproc-per-node"),
        ({"nproc_per_node": 2, "ranks": (0, 1)}, "--ranks names the ranks of a plain-mode"),
        ({"nnodes": 2}, "master-port"),
        ({"nnodes": 0}, "--nnodes must be >= 1"),
        ({"nnodes": 2, "node_rank": 2, "master_port": 29500}, "--node-rank 2 outside 0..1"),
        ({"master_port": 99999}, "--master-port must be 1..65535, got 99999"),
        ({"master_port": 0}, "--master-port must be 1..65535"),
        (
            {"nnodes": 2, "master_port": 65000},
            "--master-port must be 1..64536 with several nodes",
        ),
        ({"grace_s": -1.0}, "--grace must be a finite number of seconds >= 0, got -1.0"),
        ({"grace_s": float("nan")}, "--grace must be a finite number of seconds >= 0, got nan"),
        ({"stop_timeout_s": float("inf")}, "--stop-timeout must be a finite number of seconds"),
        ({"warn_every_s": 0.0}, "--warn-every must be a finite number of seconds > 0"),
        (
            {
                "command": [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--max-restarts=2",
                    "t.py",
                ]
            },
            "torchrun would restart the ranks itself, up to 2 times",
        ),
    ],
)
def test_bad_settings_fail_before_anything_starts(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, **overrides)
