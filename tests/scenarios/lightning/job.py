"""The ``examples/lightning`` job under a real daemon and supervisor on the embedded bus, for
the Lightning and launcher scenarios, and its uninterrupted reference run."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.scenarios.harness import REPO, JobRun, Shape
from trainguard.agent.bus import sqlite_url
from trainguard.daemon.demo._harness import charlm_env, stop_process, supervise

SHAPE = Shape(steps=140, checkpoint_every=10, seed=5)
"""Every Lightning scenario's run: 140 steps of 2 x 16 samples (about 1.1 epochs of the
example's 2,048 samples, so restores land in both data epochs), a checkpoint every 10."""

JOB = "lit-scenario"

GRACE_S = 2.0
"""Seconds between SIGTERM and SIGKILL of a worker. Lightning's SIGTERM handler broadcasts
over the process group, which blocks while a rank is dead or stuck, so such workers end by the
SIGKILL: a short grace keeps the scenarios short (``docs/integrations-lightning.md``)."""

FINISH_S = 600.0
"""Seconds a scenario's job may take: a few seconds of training, but every generation starts
Lightning's processes again, which took over two minutes each on this 2-core machine at a load
average of 21 (other suites beside it); a test fails on its assertions, not on the clock."""

HEARTBEAT_S = 0.25
"""Heartbeat interval of the workers, seconds: the progress timeout has its 8 step times
within 2 s of training."""


def lightning_args(out: Path, shape: Shape = SHAPE) -> list[str]:
    """The options of ``examples/lightning/train.py`` for a run of ``shape`` into ``out``."""
    return [
        "--steps",
        str(shape.steps),
        "--checkpoint-every",
        str(shape.checkpoint_every),
        "--seed",
        str(shape.seed),
        "--out",
        str(out),
    ]


def lightning_command(out: Path, shape: Shape = SHAPE) -> list[str]:
    """The worker command of ``examples/lightning`` of ``shape``, writing to ``out``."""
    return [sys.executable, "-m", "examples.lightning.train", *lightning_args(out, shape)]


def worker_env(out: Path, faults: str = "") -> dict[str, str]:
    """The workers' environment: shards under ``out``, ``faults`` as ``TRAINGUARD_FAULTS``,
    heartbeats every :data:`HEARTBEAT_S`, the repository on ``PYTHONPATH``."""
    return charlm_env(out, REPO, faults=faults, heartbeat_interval_s=HEARTBEAT_S)


def start_lightning(run: JobRun, faults: str = "") -> None:
    """Start ``trainguard run --nproc-per-node 2`` of ``run``'s job with ``examples/lightning``
    and ``faults`` as ``TRAINGUARD_FAULTS``."""
    run.supervisor = supervise(
        run.job,
        lightning_command(run.out, run.shape),
        bus_url=run.bus.url,
        prefix=run.bus.prefix,
        nproc_per_node=run.shape.world_size,
        log_path=run.workdir / "supervisor.log",
        env=worker_env(run.out, faults),
        grace_s=GRACE_S,
    )


def reference(basetemp: Path) -> Path:
    """The output folder of the uninterrupted run of :data:`SHAPE` (no daemon: the agents only
    publish), ``basetemp/lightning-reference``: run once per session, reused after (the
    Lightning and the launcher scenarios compare with it).

    Raises:
        AssertionError: the run failed.
    """
    out = basetemp / "lightning-reference"
    if (out / "final.sha256").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    sup = supervise(
        "reference",
        lightning_command(out),
        bus_url=sqlite_url(out / "bus.db"),
        prefix="ref.",
        nproc_per_node=SHAPE.world_size,
        log_path=out / "supervisor.log",
        env=worker_env(out),
        args=("--daemon-timeout", "0"),  # no daemon on purpose
    )
    try:
        code = sup.wait(FINISH_S)
    finally:
        stop_process(sup)
    assert code == 0, f"the reference run failed ({code}); see {out / 'supervisor.log'}"
    return out
