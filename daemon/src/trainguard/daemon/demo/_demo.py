"""``trainguard demo``: a real 2-rank training job survives a SIGKILLed rank, or any other
fault.

It starts a daemon and a supervisor running the ``examples/charlm`` job (DDP, gloo, CPU), has
rank 1 SIGKILL itself at a step drawn from the printed seed (or injects the faults of
``--fault``, a ``TRAINGUARD_FAULTS`` spec: :mod:`trainguard.agent.faults._plan`), shows detection,
restore and resume as they happen, and ends with a summary: detection latency, time to resume,
steps lost, and whether the final parameters and the sample ledger equal an uninterrupted
reference run (one that skips the same batches when a restore skipped some). The restores
counted and the batches they skipped are read from the daemon's audit trail: the ``commands``
topic is compacted (the embedded bus keeps only the job's latest command once it is a minute
old). Reference runs are cached in ``~/.cache/trainguard/demo`` (``$XDG_CACHE_HOME`` in place
of ``~/.cache`` when set, as the XDG base directory spec says; ``--cache-dir``), one folder per
distinct run (sources, training data, steps, checkpoint interval, world size, skipped
steps, torch version and CPU kernels: ``_harness._reference_key``; the training seed is
fixed, so the default demo reuses one), at most :data:`CACHE_KEEP` of them. The daemon
restores in process where it can (``restore_mode = "in_process"``: non-finite loss, loss
spike, checksum mismatch), as charlm reloads in process; the supervisor keeps warm spares
(``trainguard run --warm``, ``docs/warm-restarts.md``), and the summary says whether the
restart came from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trainguard.agent import ConfigError, parse_faults
from trainguard.agent.bus import sqlite_url
from trainguard.daemon.demo._harness import (
    JobRecord,
    charlm_command,
    charlm_env,
    follow_job,
    handed_off_pids,
    read_job_record,
    reference_run,
    start_daemon,
    stop_process,
    supervise,
)
from trainguard.schemas import Heartbeat, Lifecycle, Restore, Resume

__all__ = ["DemoOptions", "find_example", "run_demo"]

JOB = "charlm-demo"
WORLD_SIZE = 2

TRAIN_SEED = 0
"""charlm's ``--seed`` in every demo: the printed seed draws the fault, not the training, so
that the reference run does not depend on it and is computed once."""

CACHE_KEEP = 4
"""Most reference runs the demo's cache keeps (the most recently used; tens of MB each)."""


def _cache_home() -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache`` (the XDG base directory specification)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What ``trainguard demo`` runs.

    Attributes:
        bus: bus URL, or ``None`` for an embedded bus in the work folder.
        seed: seeds the kill step; ``None`` draws one. The training always uses
            :data:`TRAIN_SEED`.
        steps: training steps of the job.
        checkpoint_every: steps between checkpoints.
        workdir: where checkpoints, ledgers and logs go; ``None`` for a fresh temp folder.
        cache: folder of cached reference runs (at most :data:`CACHE_KEEP`).
        fault: a ``TRAINGUARD_FAULTS`` spec injected instead of the SIGKILL of rank 1, or
            ``None``.
        step_sleep: seconds each training step sleeps (charlm's ``--step-sleep``), so that the
            detectors that learn the job's pace (hangs, loss spikes) have samples before the
            fault; the numbers are unchanged.

    Raises:
        ConfigError: ``fault`` is not a valid spec.
    """

    bus: str | None = None
    seed: int | None = None
    steps: int = 240
    checkpoint_every: int = 20
    workdir: Path | None = None
    cache: Path = field(default_factory=lambda: _cache_home() / "trainguard" / "demo")
    fault: str | None = None
    step_sleep: float = 0.0

    def __post_init__(self) -> None:
        if self.step_sleep < 0:
            raise ConfigError(f"--step-sleep must be >= 0 seconds, got {self.step_sleep}")
        least = self.checkpoint_every + 26  # room for the random kill step and what follows
        if self.steps < least:
            raise ConfigError(f"--steps must be at least {least}, got {self.steps}")
        # A used work folder holds the last run's bus, checkpoints and fault markers (a fault
        # fires once per job): a second run there would not be the demo it says it is.
        if self.workdir is not None and self.workdir.exists():
            if not self.workdir.is_dir():
                raise ConfigError(f"--workdir {self.workdir} is a file, not a folder")
            if any(self.workdir.iterdir()):
                raise ConfigError(
                    f"--workdir {self.workdir} is not empty (a previous run?): give a new or "
                    "empty folder"
                )
        if self.cache.exists() and not self.cache.is_dir():
            raise ConfigError(f"--cache-dir {self.cache} is a file, not a folder")
        if self.fault is None:
            return
        faults = parse_faults(self.fault)
        if not faults:
            raise ConfigError(
                "--fault is empty: give at least one fault, e.g. 'nan@step=50,rank=1'"
            )
        for fault in faults:
            if fault.rank is not None and fault.rank >= WORLD_SIZE:
                raise ConfigError(
                    f"--fault {fault.kind}@step={fault.step}: rank {fault.rank} does not exist "
                    f"(the demo runs ranks 0-{WORLD_SIZE - 1})"
                )
            if fault.step > self.steps:
                raise ConfigError(
                    f"--fault {fault.kind}@step={fault.step}: the job ends at step {self.steps}"
                )


def find_example() -> Path:
    """The repository folder holding ``examples/charlm`` (the demo runs it from there).

    Raises ``FileNotFoundError`` with a hint when trainguard was installed from a wheel
    rather than from a clone (``pip install -e .``), or run outside the clone.
    """
    # The clone this trainguard is installed from first: a working folder that happens to
    # hold another examples/charlm (and modules next to it) must not be run instead.
    candidates = [*Path(__file__).resolve().parents, Path.cwd()]
    for root in candidates:
        if (root / "examples" / "charlm" / "train.py").is_file():
            return root
    raise FileNotFoundError(
        "examples/charlm not found: run `trainguard demo` from a clone of the trainguard "
        "repository (pip install -e '.[torch]')"
    )


def run_demo(options: DemoOptions, console: Console | None = None) -> bool:
    """Run the demo; return whether the recovery was exact (params and ledger equal)."""
    console = console or Console()
    repo = find_example()
    # The summary reads the example's ledgers with the example's own reader.
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    if options.fault is None:
        seed = options.seed if options.seed is not None else random.SystemRandom().randrange(10_000)
        kill_step = random.Random(seed).randrange(options.checkpoint_every + 5, options.steps - 20)
        faults, what = (
            f"kill@step={kill_step},rank=1",
            f"rank 1 will be SIGKILLed at step {kill_step} (seed {seed}: --seed {seed} repeats it)",
        )
    else:
        # The seed draws only the kill step: with --fault it decides nothing, so say nothing.
        faults, what = options.fault, f"faults injected: {options.fault}"
    console.rule("[bold]trainguard demo")
    console.print(
        f"a 2-rank charlm job (DDP, gloo, CPU) for {options.steps} steps, "
        f"checkpoint every {options.checkpoint_every}; {what}"
    )
    console.print(
        "[dim]reference run: the same job without faults (cached after the first run)…[/dim]"
    )
    began = time.monotonic()
    reference = reference_run(
        repo,
        options.cache,
        steps=options.steps,
        checkpoint_every=options.checkpoint_every,
        seed=TRAIN_SEED,
        keep=CACHE_KEEP,
    )
    console.print(f"[dim]reference run: {reference} ({time.monotonic() - began:.0f} s)[/dim]")
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="trainguard-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "run"
    bus_url = options.bus or sqlite_url(workdir / "bus.db")
    prefix = f"demo-{uuid.uuid4().hex[:8]}."
    console.print(f"bus {bus_url} (topics {prefix}*), work folder {workdir}")
    config = workdir / "daemon.toml"
    config.write_text('[machine]\nrestore_mode = "in_process"\n')
    daemon = start_daemon(
        bus_url, prefix=prefix, log_path=workdir / "daemon.log", args=["--config", str(config)]
    )
    extra = ["--step-sleep", str(options.step_sleep)] if options.step_sleep else []
    try:
        sup = supervise(
            JOB,
            charlm_command(
                out,
                steps=options.steps,
                checkpoint_every=options.checkpoint_every,
                seed=TRAIN_SEED,
                extra=extra,
            ),
            bus_url=bus_url,
            prefix=prefix,
            nproc_per_node=WORLD_SIZE,
            log_path=workdir / "supervisor.log",
            env=charlm_env(out, repo, faults=faults),
            args=["--warm"],
        )
        try:
            sent = asyncio.run(_watch(bus_url, prefix, options.steps, sup, daemon, console))
        except DaemonDied as died:
            stop_process(sup)
            console.print(f"[bold red]✖ {died}: the demo stops[/] (log: {workdir}/daemon.log)")
            return False
        code = sup.wait()
    finally:
        stop_process(daemon)
    record = asyncio.run(read_job_record(bus_url, prefix, JOB))
    # Restores and their skips from the audit trail: the compacted commands topic keeps only
    # the job's latest command once it is a minute old.
    # A retry of an incident's restore (an in-process one failed over to a restart) skips the
    # same batches again: one skip.
    skips = list(
        {(r.skip.from_step, r.skip.to_step): r.skip for r in record.restores() if r.skip}.values()
    )
    if len(skips) == 1:
        # The restored run rightly never trained those batches: compare it with a run that
        # skipped them too (data moved on by as many batches from the same step).
        skipped = f"{skips[0].from_step}-{skips[0].to_step}"
        console.print(f"[dim]reference run skipping the batches of steps {skipped}…[/dim]")
        reference = reference_run(
            repo,
            options.cache,
            steps=options.steps,
            checkpoint_every=options.checkpoint_every,
            seed=TRAIN_SEED,
            extra=["--skip-steps", skipped],
            keep=CACHE_KEEP,
        )
    elif skips:
        console.print("[yellow]several restores skipped batches: no reference run to compare")
    ok = _summary(
        record, code, out, reference, console, sent, handed_off_pids(workdir / "supervisor.log")
    )
    if options.fault is None:
        ok = ok and len(record.restores()) == 1
    console.print(f"[dim]logs: {workdir}/daemon.log, {workdir}/supervisor.log[/dim]")
    # Quoted for the shell, escaped for rich: the command is meant to be pasted (a --workdir
    # may hold a space or a bracket).
    source = escape(shlex.join(["--bus", bus_url, "--topic-prefix", prefix]))
    console.print(
        f"[dim]look back: trainguard replay {JOB} {source}   (or report, status, export -o "
        f"{JOB}.tgjsonl.gz; docs/forensics.md)[/dim]",
        soft_wrap=True,
    )
    return ok


class DaemonDied(RuntimeError):
    """The demo's daemon exited while the job ran: nothing would detect or restore it."""

    def __init__(self, code: int) -> None:
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        super().__init__(f"the demo's daemon exited ({how}) while the job ran")


async def _watch(
    bus_url: str,
    prefix: str,
    steps: int,
    sup: subprocess.Popen[bytes],
    daemon: subprocess.Popen[bytes],
    console: Console,
) -> dict[int, int]:
    """Print the job's story from the bus while the supervisor runs; return the append time
    (ms) of each restore command seen, by generation (the compacted ``commands`` topic may
    have dropped them by the end).

    Raises:
        DaemonDied: the daemon exited before the supervisor (checked whenever the bus has no
            news, at least every poll of :func:`follow_job`).
    """
    progress = Progress(
        TextColumn("[bold]step {task.completed:>4}/{task.total}"),
        BarColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
    )
    task = progress.add_task("generation 0", total=steps)
    kill_at: float | None = None
    sent: dict[int, int] = {}
    with progress:
        async with contextlib.aclosing(follow_job(bus_url, prefix, JOB)) as batches:
            async for batch in batches:
                # The daemon audits a decision right after sending its command: tell the
                # incident before the restore it caused.
                for item in sorted(batch, key=lambda i: not isinstance(i.message, dict)):
                    kill_at = _story(item.message, item.at_ms / 1000, kill_at, progress, task)
                    if isinstance(item.message, Restore):
                        sent.setdefault(item.message.generation, item.at_ms)
                if not batch and sup.poll() is not None:
                    return sent
                if not batch and daemon.poll() is not None:
                    raise DaemonDied(daemon.returncode)
    return sent


def _story(
    msg: Any, at: float, kill_at: float | None, progress: Progress, task: Any
) -> float | None:
    say = progress.console.print
    since = f" (+{(at - kill_at) * 1000:.0f} ms after the kill)" if kill_at is not None else ""
    match msg:
        case {"decisions": decisions}:
            for d in decisions:
                if d["decision"] == "incident_opened":
                    say(
                        f"[yellow]⚑ incident {d['incident_id']}: {d['cause']} on "
                        f"{'ranks ' + ', '.join(map(str, d['ranks'])) if d['ranks'] else 'every rank'}"
                    )
                elif d["decision"] == "transition" and d["new"] == "finished":
                    # The daemon's verdict, not the ranks' reports: it may still find a
                    # divergence in their last heartbeats and restore.
                    say(f"[bold green]✔ finished (generation {d['generation']}): {d['reason']}")
        case Heartbeat(step=step, generation=g):
            progress.update(task, completed=step, description=f"generation {g}")
        case Lifecycle(kind="exited", signal=sig, ranks=ranks) if sig is not None:
            say(
                f"[red]✖ rank {', '.join(map(str, ranks))} died of signal {sig} (reported by its supervisor)"
            )
            return at
        case Restore(generation=g, target=target, reason=reason):
            where = target.snapshot_id if target else "scratch (nothing committed yet)"
            say(f"[cyan]↺ restore: generation {g}, target {where}{since}\n   because: {reason}")
        case Lifecycle(kind="restored", rank=rank, step=step, generation=g):
            say(
                f"[green]  rank {rank} loaded and verified its shard, at step {step} (generation {g})"
            )
        case Resume(generation=g):
            say(f"[green]▶ resume: every rank restored, generation {g} trains on{since}")
        case Lifecycle(kind="finished", rank=0, step=step):
            progress.update(task, completed=step)
    return kill_at


def _summary(
    record: JobRecord,
    code: int,
    out: Path,
    reference: Path,
    console: Console,
    sent: dict[int, int],
    handed_off: frozenset[int],
) -> bool:
    """Print the summary table; return whether the run recovered exactly. ``sent``: restore
    command append times by generation, as :func:`_watch` saw them; ``handed_off``: the pids
    of the warm spares the supervisor handed off."""
    from examples.charlm.ledger import compare_ledgers, ledger_path, read_ledger

    paths = [ledger_path(out, r) for r in range(WORLD_SIZE)]
    ledger = read_ledger(paths)
    table = Table(title="summary", show_header=False)
    died = next(
        (
            e
            for e in record.events
            if isinstance(e.message, Lifecycle)
            and e.message.kind == "exited"
            and (e.message.signal or e.message.exit_code)
        ),
        None,
    )
    restores = record.restores()
    restore_at = sent.get(restores[0].generation) if restores else None
    table.add_row("supervisor exit", str(code))
    table.add_row("restores issued", str(len(restores)))
    for d in record.decisions():
        if d["decision"] in ("incident_opened", "job_failed") or (
            d["decision"] == "anomaly" and d["kind"] in ("straggler", "suspect_host")
        ):
            table.add_row(d.get("cause") or d.get("kind") or d["decision"], d["reason"])
    first = restores[0] if restores else None
    if first is not None and first.mode == "in_process":
        modes = [
            f"in process at step {r.at_step}" if r.mode == "in_process" else "then a restart"
            for r in restores
        ]
        table.add_row("restore mode", ", ".join(modes))
    elif first is not None:
        spawned = {
            e.message.pid
            for e in record.events
            if isinstance(e.message, Lifecycle)
            and e.message.kind == "started"
            and e.message.rank is None
            and e.message.generation == first.generation
        }
        table.add_row(
            "restart",
            "warm: every rank from its spare (docs/warm-restarts.md)"
            if spawned and spawned <= handed_off
            else "cold: the spares were not ready yet (they start with the job and take seconds)",
        )
    if died is not None and restore_at is not None and first is not None:
        target_step = first.target.step if first.target else 0
        table.add_row(
            "detection latency (death -> restore command)", f"{restore_at - died.at_ms} ms"
        )
        resumed = next(
            (
                e.at_ms
                for e in record.events
                if isinstance(e.message, Heartbeat)
                and e.message.generation == first.generation
                and e.message.step > target_step
            ),
            None,
        )
        if resumed is not None:
            table.add_row(
                "time to resume (death -> first new step)",
                f"{(resumed - died.at_ms) / 1000:.1f} s",
            )
        reached = max((r.step for r in ledger if r.generation == 0), default=0)
        table.add_row(
            "steps lost (recomputed)",
            f"{reached - target_step} (reached {reached}, restored {target_step})",
        )
    same = (out / "final.sha256").is_file() and (out / "final.sha256").read_text() == (
        reference / "final.sha256"
    ).read_text()
    table.add_row(
        "final parameters == uninterrupted run",
        "[green]bitwise equal" if same else "[red]DIFFERENT",
    )
    ref_paths = [ledger_path(reference, r) for r in range(WORLD_SIZE)]
    comparison = compare_ledgers(ledger, read_ledger(ref_paths), WORLD_SIZE)
    exact = comparison.exact
    verdict = (
        "[green]exact: nothing skipped, nothing repeated"
        if exact
        else f"[red]{sum(comparison.missing.values())} skipped, "
        f"{sum(comparison.extra.values())} repeated or foreign"
    )
    table.add_row("sample ledger", verdict)
    console.print(table)
    return same and exact and code == 0
