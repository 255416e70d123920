"""Running the framework examples (``examples/hf_trainer``, ``examples/accelerate``) under a
real daemon and supervisor, and their uninterrupted references: the scenario harness
(:mod:`tests.scenarios.harness`) with another worker command."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.scenarios.harness import GRACE_S, REPO, WORLD_SIZE, JobRun
from trainguard.agent.bus import sqlite_url
from trainguard.daemon.demo._harness import charlm_env, stop_process, supervise


def command(example: str, out: Path, *, steps: int, extra: Sequence[str] = ()) -> list[str]:
    """The worker command of ``examples/<example>/train.py`` writing to ``out``."""
    return [
        sys.executable,
        "-m",
        f"examples.{example}.train",
        "--steps",
        str(steps),
        "--out",
        str(out),
        *extra,
    ]


def reference(
    example: str, out: Path, *, steps: int, extra: Sequence[str] = (), timeout_s: float = 300
) -> Path:
    """Run ``example`` for ``steps`` steps on 2 ranks without faults nor daemon into ``out``,
    with the options ``extra``; return ``out`` (``final.sha256``, ``ledger-rank-*.jsonl``).

    Raises:
        AssertionError: the run failed or took longer than ``timeout_s`` seconds.
    """
    out.mkdir(parents=True)
    sup = supervise(
        "reference",
        command(example, out, steps=steps, extra=extra),
        bus_url=sqlite_url(out / "bus.db"),
        prefix="ref.",
        nproc_per_node=WORLD_SIZE,
        log_path=out / "supervisor.log",
        env=charlm_env(out, REPO),
        args=("--daemon-timeout", "0"),
    )
    try:
        code = sup.wait(timeout_s)
    except subprocess.TimeoutExpired:
        stop_process(sup, signal.SIGKILL)
        raise AssertionError(f"the reference run took over {timeout_s} s; see {out}") from None
    assert code == 0, f"the reference run failed ({code}); see {out / 'supervisor.log'}"
    return out


def start(
    run: JobRun, example: str, faults: str, *, extra: Sequence[str] = (), heartbeat_s: float = 0.25
) -> None:
    """Start the supervisor of ``run`` on ``example`` with ``faults`` (``TRAINGUARD_FAULTS``)."""
    run.supervisor = supervise(
        run.job,
        command(example, run.out, steps=run.shape.steps, extra=extra),
        bus_url=run.bus.url,
        prefix=run.bus.prefix,
        nproc_per_node=run.shape.world_size,
        log_path=run.workdir / "supervisor.log",
        env=charlm_env(run.out, REPO, faults=faults, heartbeat_interval_s=heartbeat_s),
        grace_s=GRACE_S,
    )


def corrupt(path: Path) -> None:
    """Flip the bits of one byte in the middle of ``path`` (same size, another digest)."""
    with path.open("r+b") as file:
        file.seek(path.stat().st_size // 2)
        byte = file.read(1)
        file.seek(-1, 1)
        file.write(bytes([byte[0] ^ 0xFF]))
