"""The ``examples/charlm`` job with its agent swapped, for the benchmarks.

Usage (the repository root on ``PYTHONPATH``; charlm's arguments after ``--``)::

    python bench/charlm_variants.py VARIANT [--report DIR] [--compare-save] -- --steps 200 --out OUT
    torchrun --standalone --max-restarts 3 --nproc-per-node 2 \\
        bench/charlm_variants.py local-resume -- --steps 200 --out OUT

charlm's code is not changed: the variant only replaces the class that
``examples.charlm.train`` instantiates as ``Agent`` (and for ``plain-ddp`` the function it wraps
DDP with), then calls its ``main``.

* ``local-resume``: the real agent, plus what a user of plain ``torchrun`` writes so that a
  restart does not start from scratch: after a restart (``TORCHELASTIC_RESTART_COUNT`` > 0) it
  resumes from the newest step whose shards of every rank are on local disk, as the agent wrote
  them (the shard's own data cursor, model, optimizer and RNG states). No daemon, no bus
  reads: torchrun's generation stays 0, and the newest complete step folder is the target.
* ``no-agent``: a null agent with the methods charlm calls, doing nothing: charlm without
  trainguard (no heartbeats, no events, no background thread; checkpoints are not written).
* ``plain-ddp``: as ``no-agent``, and DDP averages the gradients with its own all-reduce
  instead of ``trainguard.agent.ordered_allreduce`` (``bench/ordered_allreduce.py``).
* ``timed``: the real agent with its cost measured on every rank, written to
  ``DIR/rank-<r>.json`` (see :class:`TimedAgent`).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, wait
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from trainguard.agent import RESERVED_KEY, Agent, AgentConfig, Snapshot
from trainguard.schemas import Checkpoint, CheckpointMeta, DataCursor, Manifest, Shard

__all__ = [
    "VARIANTS",
    "LocalResumeAgent",
    "NullAgent",
    "TimedAgent",
    "latest_local_snapshot",
    "main",
]

VARIANTS = ("local-resume", "no-agent", "plain-ddp", "timed")
"""The variants, as named on the command line."""


# -- local-resume ----------------------------------------------------------------------------


def latest_local_snapshot(config: AgentConfig) -> Manifest | None:
    """The newest step of ``config``'s job and generation with a shard file for every rank
    under ``config.checkpoint_dir``, as a manifest charlm's ``restore`` accepts; ``None`` when
    there is none.

    A shard file exists only once it is complete (the agent renames it into place after fsync),
    so "every rank's file is there" is the local equivalent of trainguard's commit rule. The
    digests are those of the files as they are now (this is a user's resume logic, not a
    verification); the data cursor is the one this rank's shard holds.
    """
    c = config
    folder = c.checkpoint_dir.resolve() / c.job_id / f"g{c.generation:06d}"
    for step_dir in sorted(folder.glob("s*"), reverse=True):
        paths = [step_dir / f"rank{rank:05d}.pt" for rank in range(c.world_size)]
        if not all(p.is_file() for p in paths):
            continue
        step = int(step_dir.name[1:])
        own = torch.load(paths[c.rank], weights_only=True)[RESERVED_KEY]
        shards = tuple(
            Shard(
                rank=rank,
                uri=path.as_uri(),
                size_bytes=path.stat().st_size,
                digest="sha256:" + hashlib.sha256(path.read_bytes()).hexdigest(),
            )
            for rank, path in enumerate(paths)
        )
        return Manifest(
            job_id=c.job_id,
            snapshot_id=f"{c.job_id}/g{c.generation}/s{step}",
            generation=c.generation,
            ts=time.time_ns(),
            step=step,
            world_size=c.world_size,
            shards=shards,
            cursor=DataCursor(**own["cursor"]),
            metadata=CheckpointMeta(
                hyperparameters=dict(c.hyperparameters),
                topology={"world_size": c.world_size},
                code_version=c.code_version,
            ),
        )
    return None


class LocalResumeAgent(Agent):
    """The real agent whose restore target, after a torchrun restart, is the newest complete
    local checkpoint (:func:`latest_local_snapshot`) instead of a daemon's restore command."""

    def restore_target(self, timeout_s: float | None = None) -> Snapshot | None:
        """``None`` in torchrun's first run, else the newest complete local checkpoint."""
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
            return None
        manifest = latest_local_snapshot(self.config)
        return None if manifest is None else Snapshot.of(manifest)


# -- no-agent --------------------------------------------------------------------------------


class NullAgent:
    """The part of :class:`Agent`'s interface charlm uses, doing nothing.

    ``checkpoint`` writes nothing and returns a done future of the checkpoint event the agent
    would have announced, with an empty shard (``file:///``, 0 bytes): charlm logs it as a
    0-byte checkpoint.
    """

    def __init__(self, config: AgentConfig) -> None:
        self.config = config

    def __enter__(self) -> NullAgent:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def restore_target(self, timeout_s: float | None = None) -> Snapshot | None:
        """Always a fresh start."""
        return None

    def ready(self, step: int, cursor: DataCursor | None = None) -> None:
        """Nothing to acknowledge."""

    @property
    def skip(self) -> None:
        """No restore, so nothing to skip."""
        return None

    def watch(self, model: Any) -> None:
        """No checksums."""

    def perturb_loss(self, step: int, loss: Any) -> Any:
        """No faults: ``loss`` itself."""
        return loss

    def phase(self, phase: str) -> None:
        """Nothing to declare."""

    def step(self, step: int, *, loss: float | None = None, samples: int = 0) -> None:
        """Nothing to record."""

    def checkpoint(
        self, step: int, state: Mapping[str, Any], *, cursor: DataCursor, blocking: bool = True
    ) -> Future[Checkpoint]:
        """Write nothing; see the class docstring."""
        done: Future[Checkpoint] = Future()
        done.set_result(self.config.checkpoint_template(step=step, cursor=cursor, pid=os.getpid()))
        return done


# -- timed -----------------------------------------------------------------------------------


def _thread_cpu_s(threads: Sequence[threading.Thread]) -> dict[str, float]:
    """CPU time (user + system, seconds) of each live thread in ``threads``, by thread name,
    from the thread's POSIX CPU-time clock (``pthread_getcpuclockid``)."""
    out: dict[str, float] = {}
    for thread in threads:
        if thread.ident is None or not thread.is_alive():
            continue
        try:
            clock = time.pthread_getcpuclockid(thread.ident)
            out[thread.name] = out.get(thread.name, 0.0) + time.clock_gettime(clock)
        except (OSError, ProcessLookupError):
            continue  # ended in between
    return out


def _summary_ns(values: Sequence[int]) -> dict[str, float]:
    """Median, mean, 99th percentile and maximum of ``values`` (ns), in microseconds."""
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "median_us": statistics.median(ordered) / 1e3,
        "mean_us": statistics.fmean(ordered) / 1e3,
        "p99_us": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] / 1e3,
        "max_us": ordered[-1] / 1e3,
    }


class TimedAgent(Agent):
    """The real agent, measuring what it costs the training process.

    Measured on this rank, and written as JSON to ``report_dir/rank-<rank>.json`` when the
    agent exits:

    * ``step_call``: wall time of each :meth:`Agent.step` call on the training thread
      (``time.perf_counter_ns`` around it), summarized in microseconds;
    * ``background_cpu_s``: CPU time of the Python threads that started after the agent was
      entered (its event-loop thread, the SQLite bus's connection threads, the checkpoint
      writer), by thread name, between :meth:`ready` (the training loop's start) and the
      agent's exit, with ``loop_wall_s`` the wall time in between; threads that ended before
      the exit are missing (none do in a normal run);
    * with ``compare_save``, per checkpoint: ``stall_s``, the training thread's time inside
      :meth:`Agent.checkpoint` (non-blocking), ``write_s`` from its call until the background
      write was announced, and ``plain_save_s`` / ``plain_fsync_s``, a plain ``torch.save`` of
      the same state into the same folder and the ``fsync`` that makes it durable. The plain
      save runs after the background write has finished, so the two never compete; every other
      checkpoint it runs first instead, so that neither side always finds the state warm in
      the CPU caches. It makes every checkpoint effectively blocking: use it for the stall
      figures, not for step times.
    """

    def __init__(self, config: AgentConfig, *, report_dir: Path, compare_save: bool) -> None:
        super().__init__(config)
        self._report_dir = report_dir
        self._compare_save = compare_save
        self._step_ns: list[int] = []
        self._checkpoints: list[dict[str, Any]] = []
        self._before: set[threading.Thread] = set()
        self._loop_start: tuple[float, dict[str, float]] | None = None

    def __enter__(self) -> TimedAgent:
        self._before = set(threading.enumerate())
        super().__enter__()
        return self

    def _agent_threads(self) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in self._before]

    def ready(self, step: int, cursor: DataCursor | None = None) -> None:
        """As :meth:`Agent.ready`; starts the background-CPU window."""
        super().ready(step, cursor)
        self._loop_start = (time.perf_counter(), _thread_cpu_s(self._agent_threads()))

    def step(self, step: int, *, loss: float | None = None, samples: int = 0) -> None:
        """As :meth:`Agent.step`, timed."""
        began = time.perf_counter_ns()
        super().step(step, loss=loss, samples=samples)
        self._step_ns.append(time.perf_counter_ns() - began)

    def checkpoint(
        self, step: int, state: Mapping[str, Any], *, cursor: DataCursor, blocking: bool = True
    ) -> Future[Checkpoint]:
        """As :meth:`Agent.checkpoint`, timed, with the plain-save comparison when asked."""
        if not self._compare_save:
            return super().checkpoint(step, state, cursor=cursor, blocking=blocking)
        plain_first = len(self._checkpoints) % 2 == 1
        row: dict[str, Any] = {"step": step, "plain_first": plain_first}
        if plain_first:
            row.update(self._plain_save(state))
        began = time.perf_counter()
        done = super().checkpoint(step, state, cursor=cursor, blocking=blocking)
        row["stall_s"] = time.perf_counter() - began
        wait([done])
        row["write_s"] = time.perf_counter() - began
        if done.exception() is None:
            row["bytes"] = done.result().size_bytes
        if not plain_first:
            row.update(self._plain_save(state))
        self._checkpoints.append(row)
        return done

    def _plain_save(self, state: Mapping[str, Any]) -> dict[str, float]:
        """``torch.save(state, file)`` then ``fsync``, timed, into the checkpoint folder."""
        path = self.config.checkpoint_dir / "plain-save" / f"rank{self.config.rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as file:
            began = time.perf_counter()
            torch.save(dict(state), file)
            saved = time.perf_counter()
            file.flush()
            os.fsync(file.fileno())
            synced = time.perf_counter()
        path.unlink()
        return {"plain_save_s": saved - began, "plain_fsync_s": synced - saved}

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Write the report, then exit as :meth:`Agent.__exit__`."""
        if exc is None:
            self._write_report()
        super().__exit__(exc_type, exc, tb)

    def _write_report(self) -> None:
        ended = time.perf_counter()
        cpu_end = _thread_cpu_s(self._agent_threads())
        started, cpu_start = self._loop_start or (ended, {})
        report = {
            "rank": self.config.rank,
            "steps": len(self._step_ns),
            "step_call": _summary_ns(self._step_ns),
            "loop_wall_s": ended - started,
            "background_cpu_s": {
                name: cpu - cpu_start.get(name, 0.0) for name, cpu in sorted(cpu_end.items())
            },
            "heartbeat_interval_s": self.config.heartbeat_interval_s,
            "checkpoints": self._checkpoints,
        }
        self._report_dir.mkdir(parents=True, exist_ok=True)
        path = self._report_dir / f"rank-{self.config.rank}.json"
        path.write_text(json.dumps(report, indent=1))


def _plain_ddp(model: Any) -> Any:
    """``ordered_allreduce``'s stand-in for ``plain-ddp``: DDP as constructed, its own hook."""
    return model


# -- entry point -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    """Parse ``VARIANT [options] -- CHARLM_ARGS``, install the variant's agent, run charlm."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0] if __doc__ else None,
        epilog="charlm's own arguments follow after --",
    )
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("--report", type=Path, help="timed: folder of the per-rank reports")
    parser.add_argument(
        "--compare-save", action="store_true", help="timed: time a plain torch.save per checkpoint"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    charlm_args = argv[split + 1 :]
    if args.variant == "timed" and args.report is None:
        parser.error("timed needs --report DIR")

    from examples.charlm import train

    factory: Any
    match args.variant:
        case "local-resume":
            factory = LocalResumeAgent
        case "no-agent":
            factory = NullAgent
        case "plain-ddp":
            factory = NullAgent
            train.ordered_allreduce = _plain_ddp  # type: ignore[attr-defined]  # as train.Agent
        case _:
            factory = functools.partial(
                TimedAgent, report_dir=args.report, compare_save=args.compare_save
            )
    # charlm instantiates the name ``Agent`` of its module: replacing it swaps the agent (mypy
    # sees the name as an import that the module does not re-export).
    train.Agent = factory  # type: ignore[attr-defined]
    train.main(charlm_args)


if __name__ == "__main__":
    main()
