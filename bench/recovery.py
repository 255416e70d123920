"""Recovery benchmark (issues 3 and 18): how fast a killed rank is detected and training
resumes, on both buses, with cold and warm restarts (``trainguard run --warm``), next to plain
``torchrun`` restarting the same job.

Usage (from the repository root)::

    python bench/recovery.py [--kills 10] [--kafka host:port | --no-kafka] [--torchrun-kills 3]
                             [--kill-every STEPS] [--no-warm] [--markdown] [--json FILE]
                             # --help lists the rest

The job is ``examples/charlm`` (2 ranks, DDP over gloo, CPU, deterministic), with
``--kills`` SIGKILLs injected through ``TRAINGUARD_FAULTS`` at spread-out steps (every
``2 * checkpoint_every`` steps plus a seeded offset of 3 or more, ranks alternating), each firing
once per job, so one run holds every incident.

* **trainguard**, once per bus (embedded SQLite, then Kafka: ``--kafka``, or a broker started
  with ``deploy/kafka/kafka-dev``): ``trainguard daemon`` and ``trainguard run
  --nproc-per-node 2`` (the supervisor) as separate processes, as in production; and again
  with ``trainguard run --warm`` (``docs/warm-restarts.md``), whose restores hand the ranks
  spares that waited at charlm's hand-off point. A restore whose spares were not ready yet
  starts cold: the "warm restores" column counts the restores that started every rank from a
  spare (from the supervisor's log), and the warm path's figures are those restores'.
* ``--kill-every`` spaces the kills further apart (default ``2 * checkpoint_every`` steps), so
  that the spares a restore used are ready again by the next kill (a spare's start-up takes
  seconds, more on a loaded machine). Pacing the job instead (charlm's ``--step-period``) would
  add a step period to every "resumed" below.

The runs go torchrun, trainguard on SQLite, torchrun + local resume, trainguard on Kafka (the
broker up throughout), so that a drift of the machine's load does not land on one side; each
run reports the 1-minute load average at its start and end. A restart's time is mostly the new
workers' Python start-up, which slows down with every other process on the machine; the last
table measures that start-up on its own.

Timestamps (all on this machine's wall clock): the **kill** is the fault's marker file (created
just before the rank SIGKILLs itself; kernel file-time granularity, a few ms); trainguard's
**exit report** is the supervisor's ``exited`` lifecycle event (its ``ts``, and the bus
append time of its record), the **restore command** and the **resume** command the bus append
times of the daemon's records (a command's own ``ts`` is the daemon's input-driven clock, not
when it was sent); workers **spawned** and **started** are the supervisor's and the agents'
``started`` events, **restored** the agents' ``restored`` acknowledgements (the last rank's);
**resumed** is the first heartbeat of the new generation (torchrun: of the new processes) past
the step it restarted from, and **back** the first at or past the step the kill happened at.
Heartbeats go every 0.1 s here, so those two are up to 0.1 s late. torchrun's own view (it
noticed the failure) comes from its log.

Per kill: steps lost = the last step reached before the kill (ledger) - the step restored
from. Per run: final parameters bitwise equal to an uninterrupted reference run (cached under
``~/.cache/trainguard/bench``), and the sample ledger exact (per step, the samples of the
latest attempt equal the reference's; for torchrun the attempts are told apart by the step going
back, as its restarts keep generation 0). The targets, checked on both buses: the restore
command within 1 s of the exit report, at the median (issue 3); kill to first step past the
restore within 1 s at the median for the warm path, and at least 3 times faster than torchrun's
in the same run (issue 18). Figures are printed, never asserted; the
exit status is 0 unless a run failed.

torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it, a restarted worker
sometimes reads the previous round's gloo address from the shared rendezvous store and fails
or hangs in ``init_process_group`` (pytorch/pytorch#135712); ``--torchrun-share-store`` leaves
it unset.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from rich.console import Console

from trainguard.daemon.demo._harness import (
    JobRecord,
    Stamped,
    charlm_command,
    charlm_env,
    handed_off_pids,
    read_job_record,
    reference_run,
    start_daemon,
    stop_process,
    supervise,
)
from trainguard.schemas import ClockTick, Heartbeat, Lifecycle, Restore, Resume

REPO = Path(__file__).resolve().parent.parent
VARIANTS_SCRIPT = REPO / "bench" / "charlm_variants.py"
CACHE = Path.home() / ".cache" / "trainguard" / "bench"
JOB = "charlm-bench"
WORLD_SIZE = 2
HEARTBEAT_S = 0.1
"""Heartbeat period of the workers, seconds: the resolution of "resumed" and "back"."""
TARGET_S = 1.0
"""Target: kill (exit report) to restore command, median, seconds."""
WARM_TARGET_S = 1.0
"""Target of the warm path: kill to first step past the restore, median, seconds."""
WARM_SPEEDUP = 3.0
"""Target of the warm path: at least this many times faster than torchrun (medians)."""
RUN_TIMEOUT_S = 900.0
TORCHRUN_RESTARTS = 3

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # bench._broker and examples.charlm

from bench._broker import kafka_broker  # noqa: E402
from bench._report import Report, print_report  # noqa: E402
from bench._summary import format_quantiles, machine_notes  # noqa: E402

from examples.charlm.ledger import LedgerRecord, compare_ledgers, ledger_path, read_ledger  # noqa: E402

# -- plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """The job and its kills.

    Attributes:
        steps: training steps of the job.
        checkpoint_every: steps between checkpoints.
        seed: training seed (also draws the kill offsets).
        kills: ``(step, rank)`` of every kill, in step order.
    """

    steps: int
    checkpoint_every: int
    seed: int
    kills: tuple[tuple[int, int], ...]

    def faults(self, count: int | None = None) -> str:
        """``TRAINGUARD_FAULTS`` for the first ``count`` kills (all when ``None``)."""
        return ";".join(f"kill@step={s},rank={r}" for s, r in self.kills[:count])

    def charlm_args(self, out: Path) -> list[str]:
        """charlm's arguments writing to ``out``."""
        return self.command(out)[3:]

    def command(self, out: Path) -> list[str]:
        """charlm's command line writing to ``out``."""
        return charlm_command(
            out, steps=self.steps, checkpoint_every=self.checkpoint_every, seed=self.seed
        )


def make_plan(kills: int, checkpoint_every: int, seed: int, kill_every: int | None = None) -> Plan:
    """Kill ``i`` (0-based) at step ``kill_every * (i + 1) + offset`` (``kill_every`` default
    ``2 * checkpoint_every``), ``offset`` drawn from ``3 .. checkpoint_every - 1``, on rank
    ``(i + 1) % 2``; the job runs ``2 * checkpoint_every`` steps past the last kill's window.

    Raises:
        ValueError: ``checkpoint_every`` < 4 (no room for an offset), ``kills`` < 1, or
            ``kill_every`` < ``checkpoint_every``.
    """
    spacing = 2 * checkpoint_every if kill_every is None else kill_every
    if checkpoint_every < 4 or kills < 1 or spacing < checkpoint_every:
        raise ValueError("need --checkpoint-every >= 4, --kills >= 1, --kill-every >= it")
    rng = random.Random(seed)
    schedule = tuple(
        (spacing * (i + 1) + rng.randrange(3, checkpoint_every), (i + 1) % WORLD_SIZE)
        for i in range(kills)
    )
    return Plan(spacing * (kills + 1) + 2 * checkpoint_every, checkpoint_every, seed, schedule)


# -- results ---------------------------------------------------------------------------------


@dataclass
class Incident:
    """One kill and the recovery from it.

    Attributes:
        step: the step the kill fired after.
        rank: the rank killed.
        marks: named instants, seconds since the Unix epoch (see the module docstring):
            ``killed``, and for trainguard ``exited``, ``exited_bus``, ``restore``,
            ``spawned``, ``started``, ``restored``, ``resume``; for torchrun ``noticed``,
            ``started``; for both ``resumed``, ``back``.
        reached: the highest step the ledger holds before the kill.
        restored_step: the step training restarted from.
        restores: restore commands issued for the kill (trainguard; more than one when a
            restored generation failed and the daemon retried).
        warm: every rank of the generation that trained after it came from a spare
            (``trainguard run --warm``).
    """

    step: int
    rank: int
    marks: dict[str, float] = field(default_factory=dict)
    reached: int = 0
    restored_step: int = 0
    restores: int = 0
    warm: bool = False

    def span(self, start: str, end: str) -> float | None:
        """Seconds from mark ``start`` to mark ``end``, ``None`` when either is missing."""
        if start in self.marks and end in self.marks:
            return self.marks[end] - self.marks[start]
        return None

    @property
    def steps_lost(self) -> int:
        """Steps computed before the kill that had to be computed again."""
        return self.reached - self.restored_step


@dataclass
class RunResult:
    """One run of the job with its kills.

    Attributes:
        name: the variant, as printed.
        incidents: one per kill that fired, in order.
        exit_code: the launcher's exit status (``None``: timed out).
        wall_s: launcher start to exit, seconds.
        params_equal: final parameters bitwise equal to the reference run's.
        ledger_exact: sample ledger equal to the reference run's (see the module docstring).
        steps_computed: steps trained in all, over every attempt (ledger lines / world size).
        restores: restore commands issued (trainguard).
        notes: anything odd about the run.
        logs: where its logs are.
        load: the machine's 1-minute load average at the run's start and end.
        warm: the run used ``trainguard run --warm``.
    """

    name: str
    incidents: list[Incident] = field(default_factory=list)
    exit_code: int | None = None
    wall_s: float = 0.0
    params_equal: bool = False
    ledger_exact: bool = False
    steps_computed: int = 0
    restores: int = 0
    notes: list[str] = field(default_factory=list)
    logs: str = ""
    load: tuple[float, float] = (0.0, 0.0)
    warm: bool = False


def kill_times(out: Path, plan: Plan, count: int) -> list[tuple[int, int, float | None]]:
    """``(step, rank, kill instant)`` of the first ``count`` planned kills, the instant from
    the fault's marker file (``None``: it did not fire)."""
    markers = out / "checkpoints" / JOB / ".faults-fired"
    rows = []
    for step, rank in plan.kills[:count]:
        path = markers / f"kill-s{step}-r{rank}"
        rows.append((step, rank, path.stat().st_mtime_ns / 1e9 if path.exists() else None))
    return rows


def _first_ts(items: Iterator[float]) -> float | None:
    return min(items, default=None)


def _last_ts(items: Iterator[float]) -> float | None:
    return max(items, default=None)


def _set(marks: dict[str, float], name: str, value: float | None) -> None:
    if value is not None:
        marks[name] = value


def trainguard_incidents(
    record: JobRecord,
    ledger: list[LedgerRecord],
    kills: list[tuple[int, int, float | None]],
    handed_off: frozenset[int] = frozenset(),
) -> list[Incident]:
    """The incidents of a trainguard run, one per kill.

    Kill ``i`` is the ``i``-th exit by a signal the supervisor reported (only the injected
    kills die of a signal), its restore the first restore command after that report. When the
    restored generation failed too and the daemon retried (more restores before the next
    kill), the workers' marks (spawned .. resumed) are those of the generation that trained,
    and :attr:`Incident.restores` counts the commands; :attr:`Incident.warm` says whether
    every worker the supervisor started in that generation was a spare (its pid among
    ``handed_off``).
    """
    exits = [
        e
        for e in record.events
        if isinstance(e.message, Lifecycle) and e.message.kind == "exited" and e.message.signal
    ]
    sent = command_times(record)
    restores = [Stamped(sent[c.seq], c) for c in record.restores() if c.seq in sent]
    resumes = {c.generation: Stamped(sent[c.seq], c) for c in record.resumes() if c.seq in sent}
    incidents = []
    for index, (step, rank, killed) in enumerate(kills):
        incident = Incident(step, rank)
        incidents.append(incident)
        marks = incident.marks
        _set(marks, "killed", killed)
        if index >= len(exits):
            continue
        exited = exits[index]
        marks["exited"] = exited.message.ts / 1e9
        marks["exited_bus"] = exited.at_ms / 1e3
        generation = exited.message.generation
        incident.reached = max((r.step for r in ledger if r.generation == generation), default=0)
        until = exits[index + 1].at_ms if index + 1 < len(exits) else float("inf")
        mine = [c for c in restores if exited.at_ms <= c.at_ms < until]
        if not mine:
            continue
        incident.restores = len(mine)
        marks["restore"] = mine[0].at_ms / 1e3
        final = mine[-1].message
        incident.restored_step = final.target.step if final.target is not None else 0
        lifecycles = [
            e.message
            for e in record.events
            if isinstance(e.message, Lifecycle) and e.message.generation == final.generation
        ]
        spawned = [m for m in lifecycles if m.kind == "started" and m.rank is None]
        incident.warm = bool(spawned) and all(m.pid in handed_off for m in spawned)
        _set(marks, "spawned", _last_ts(m.ts / 1e9 for m in spawned))
        _set(
            marks,
            "started",
            _last_ts(m.ts / 1e9 for m in lifecycles if m.kind == "started" and m.rank is not None),
        )
        _set(marks, "restored", _last_ts(m.ts / 1e9 for m in lifecycles if m.kind == "restored"))
        if final.generation in resumes:
            marks["resume"] = resumes[final.generation].at_ms / 1e3
        beats = [
            e.message
            for e in record.events
            if isinstance(e.message, Heartbeat) and e.message.generation == final.generation
        ]
        _set(
            marks,
            "resumed",
            _first_ts(b.ts / 1e9 for b in beats if b.step > incident.restored_step),
        )
        _set(marks, "back", _first_ts(b.ts / 1e9 for b in beats if b.step >= incident.reached))
    return incidents


def command_times(record: JobRecord) -> dict[int, int]:
    """When each command the daemon issued was on the bus, ms since the epoch, by its ``seq``:
    its record's append time while ``commands`` still holds it, else the append time of the
    first tick naming it (the daemon appends one right after it publishes a command). A run
    longer than a minute needs the ticks: the embedded bus compacts ``commands`` to each
    job's latest command once it is a minute old."""
    out = {
        c.message.seq: c.at_ms for c in record.commands if isinstance(c.message, Restore | Resume)
    }
    for e in record.events:
        if isinstance(e.message, ClockTick) and e.message.command_seq:
            out.setdefault(e.message.command_seq, e.at_ms)
    return out


def attempts_by_step(records: list[LedgerRecord]) -> list[LedgerRecord]:
    """``records`` of one rank file each, with ``generation`` replaced by the attempt number:
    a new attempt starts where the step goes back (torchrun's restarts keep generation 0)."""
    out: list[LedgerRecord] = []
    attempt: dict[int, int] = {}
    previous: dict[int, int] = {}
    for r in records:
        if r.step <= previous.get(r.rank, 0):
            attempt[r.rank] = attempt.get(r.rank, 0) + 1
        previous[r.rank] = r.step
        out.append(LedgerRecord(attempt.get(r.rank, 0), r.step, r.rank, r.samples))
    return out


_TORCHRUN_FAILURE = re.compile(
    r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+) .*(?:closing signal SIGTERM|failed \(exitcode)"
)


def torchrun_noticed(log: Path) -> list[float]:
    """Instants torchrun's log shows it handling a worker failure (stopping the group or
    reporting the exit), seconds since the epoch (glog time stamps, local time, this year)."""
    year = datetime.now().year
    out = []
    for line in log.read_text(errors="replace").splitlines():
        match = _TORCHRUN_FAILURE.match(line)
        if match:
            stamp = datetime.strptime(f"{year}{match[1]} {match[2]}", "%Y%m%d %H:%M:%S.%f")
            out.append(stamp.timestamp())
    return out


def torchrun_incidents(
    record: JobRecord,
    ledger: list[LedgerRecord],
    kills: list[tuple[int, int, float | None]],
    noticed: list[float],
) -> list[Incident]:
    """The incidents of a torchrun run: after kill ``i``, the processes that trained are the
    last ``WORLD_SIZE`` whose agents started before the next kill (a restarted worker that
    failed before its agent started leaves no trace there), and attempt ``i + 1`` of the
    ledger is theirs."""
    starts = sorted(
        (
            e.message
            for e in record.events
            if isinstance(e.message, Lifecycle)
            and e.message.kind == "started"
            and e.message.rank is not None
        ),
        key=lambda m: m.ts,
    )
    beats = [e.message for e in record.events if isinstance(e.message, Heartbeat)]
    incidents = []
    for index, (step, rank, killed) in enumerate(kills):
        incident = Incident(step, rank)
        incidents.append(incident)
        marks = incident.marks
        _set(marks, "killed", killed)
        before = [r.step for r in ledger if r.generation == index]
        after = [r.step for r in ledger if r.generation == index + 1]
        incident.reached = max(before, default=0)
        incident.restored_step = min(after, default=1) - 1
        if killed is None:
            continue
        _set(marks, "noticed", _first_ts(t for t in noticed if t >= killed - 0.01))
        until = kills[index + 1][2] if index + 1 < len(kills) else None
        window = [
            m for m in starts if m.ts / 1e9 > killed and (until is None or m.ts / 1e9 < until)
        ][-WORLD_SIZE:]
        if len(window) < WORLD_SIZE:
            continue
        pids = {m.pid for m in window}
        marks["started"] = max(m.ts for m in window) / 1e9
        mine = [b for b in beats if b.pid in pids]
        _set(
            marks,
            "resumed",
            _first_ts(b.ts / 1e9 for b in mine if b.step > incident.restored_step),
        )
        _set(marks, "back", _first_ts(b.ts / 1e9 for b in mine if b.step >= incident.reached))
    return incidents


def judge(result: RunResult, out: Path, reference: Path, ledger: list[LedgerRecord]) -> None:
    """Fill in parameter equality, ledger exactness and steps computed."""
    final, ref_final = out / "final.sha256", reference / "final.sha256"
    result.params_equal = final.is_file() and final.read_text() == ref_final.read_text()
    ref_ledger = read_ledger(ledger_path(reference, r) for r in range(WORLD_SIZE))
    result.ledger_exact = compare_ledgers(ledger, ref_ledger, WORLD_SIZE).exact
    result.steps_computed = len(ledger) // WORLD_SIZE


def drop_shards(out: Path) -> None:
    """Delete the run's checkpoint shards (about 100 MB a run); the fault markers stay."""
    for generation in (out / "checkpoints" / JOB).glob("g*"):
        shutil.rmtree(generation, ignore_errors=True)


def run_ledger(out: Path) -> list[LedgerRecord]:
    """The run's ledger records (empty when the run wrote none)."""
    paths = [ledger_path(out, r) for r in range(WORLD_SIZE)]
    return read_ledger(p for p in paths if p.is_file())


# -- runs ------------------------------------------------------------------------------------


def run_trainguard(
    name: str, bus_url: str, plan: Plan, workdir: Path, reference: Path, *, warm: bool = False
) -> RunResult:
    """The job under a daemon and a supervisor on ``bus_url`` (``--warm`` with ``warm``),
    with every kill of ``plan``."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "run"
    prefix = f"bench-{uuid.uuid4().hex[:8]}."
    result = RunResult(name, logs=str(workdir), load=(os.getloadavg()[0], 0.0), warm=warm)
    daemon = start_daemon(bus_url, prefix=prefix, log_path=workdir / "daemon.log")
    began = time.monotonic()
    try:
        sup = supervise(
            JOB,
            plan.command(out),
            bus_url=bus_url,
            prefix=prefix,
            nproc_per_node=WORLD_SIZE,
            log_path=workdir / "supervisor.log",
            env=charlm_env(out, REPO, faults=plan.faults(), heartbeat_interval_s=HEARTBEAT_S),
            args=["--warm"] if warm else [],
        )
        try:
            result.exit_code = sup.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop_process(sup, signal.SIGKILL)
            result.notes.append(f"timed out after {RUN_TIMEOUT_S:.0f} s")
        result.wall_s = time.monotonic() - began
        result.load = (result.load[0], os.getloadavg()[0])
    finally:
        stop_process(daemon)
    record = asyncio.run(read_job_record(bus_url, prefix, JOB))
    ledger = run_ledger(out)
    kills = kill_times(out, plan, len(plan.kills))
    result.incidents = trainguard_incidents(
        record, ledger, kills, handed_off_pids(workdir / "supervisor.log")
    )
    result.restores = len(record.restores())
    if result.restores != len(plan.kills):
        result.notes.append(f"{result.restores} restores for {len(plan.kills)} kills")
    judge(result, out, reference, ledger)
    drop_shards(out)
    return result


def run_torchrun(
    name: str,
    worker: Sequence[str],
    plan: Plan,
    kills: int,
    workdir: Path,
    reference: Path,
    share_store: bool,
) -> RunResult:
    """The job under ``torchrun --standalone --max-restarts 3`` with the first ``kills``
    kills; ``worker`` is what torchrun runs before charlm's arguments."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "run"
    bus_url = f"sqlite:///{out / 'bus.db'}"
    env = {
        **os.environ,
        **charlm_env(out, REPO, faults=plan.faults(kills), heartbeat_interval_s=HEARTBEAT_S),
        "TRAINGUARD_JOB": JOB,
        "TRAINGUARD_BUS": bus_url,
    }
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--max-restarts",
        str(TORCHRUN_RESTARTS),
        "--nproc-per-node",
        str(WORLD_SIZE),
        *worker,
        *plan.charlm_args(out),
    ]
    result = RunResult(name, logs=str(workdir), load=(os.getloadavg()[0], 0.0))
    log = workdir / "torchrun.log"
    began = time.monotonic()
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            command, stdout=sink, stderr=sink, env=env, cwd=REPO, start_new_session=True
        )
        try:
            result.exit_code = proc.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop_process(proc, signal.SIGKILL)
            result.notes.append(f"timed out after {RUN_TIMEOUT_S:.0f} s")
    result.wall_s = time.monotonic() - began
    result.load = (result.load[0], os.getloadavg()[0])
    record = asyncio.run(read_job_record(bus_url, "trainguard.", JOB))
    ledger = attempts_by_step(run_ledger(out))
    result.incidents = torchrun_incidents(
        record, ledger, kill_times(out, plan, kills), torchrun_noticed(log)
    )
    refused = log.read_text(errors="replace").count("Gloo connectFullMesh failed")
    if refused:
        result.notes.append(f"{refused} restarted worker(s) failed in the gloo rendezvous")
    judge(result, out, reference, ledger)
    drop_shards(out)
    return result


# -- worker start-up anatomy -----------------------------------------------------------------

_STARTUP_PROBE = """
import json, sys, time
t = {"interpreter": time.time()}
import torch
t["import torch"] = time.time()
import examples.charlm.train
t["import charlm + trainguard"] = time.time()
torch.use_deterministic_algorithms(True)
t["use_deterministic_algorithms"] = time.time()
print(json.dumps(t))
"""


def startup_anatomy() -> dict[str, float]:
    """Median seconds of each start-up stage of a charlm worker, measured in ``WORLD_SIZE``
    fresh interpreters started together (as a restart starts them): from ``Popen`` to the
    first line of Python, ``import torch``, importing charlm (and trainguard's agent), and
    ``torch.use_deterministic_algorithms(True)``, which imports ``torch._dynamo`` and
    ``torch._inductor``. The gloo rendezvous is not part of it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    began = time.time()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _STARTUP_PROBE], stdout=subprocess.PIPE, env=env, cwd=REPO
        )
        for _ in range(WORLD_SIZE)
    ]
    stages: dict[str, list[float]] = {}
    for proc in procs:
        output, _ = proc.communicate(timeout=120)
        stamps = json.loads(output)
        previous = began
        for name, at in stamps.items():
            stages.setdefault(name, []).append(at - previous)
            previous = at
    return {name: statistics.median(values) for name, values in stages.items()}


# -- report ----------------------------------------------------------------------------------


def _counted(result: RunResult) -> list[Incident]:
    """The incidents a run's figures are of: for a warm run those restored from spares only
    (the others were cold restarts, counted in the "warm restores" column)."""
    return [i for i in result.incidents if i.warm] if result.warm else result.incidents


def _spans(result: RunResult, start: str, end: str, *, every: bool = False) -> list[float]:
    """Seconds from ``start`` to ``end`` of each incident (:func:`_counted`, or all of them
    with ``every``) that has both."""
    incidents = result.incidents if every else _counted(result)
    return [s for i in incidents if (s := i.span(start, end)) is not None]


def _median(values: Sequence[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f}" if values else "-"


def build_report(
    plan: Plan, tg: list[RunResult], tr: list[RunResult], anatomy: dict[str, float]
) -> Report:
    """The three tables: kill to restore command (the target), kill to training resumed with
    the run's correctness, and where the time of a restart goes."""
    report = Report()
    rows = []
    for result in tg:
        reported = _spans(result, "exited_bus", "restore", every=True)
        p50 = statistics.median(reported) if reported else None
        verdict = "FAIL" if p50 is None or p50 > TARGET_S else "PASS"
        rows.append(
            [
                result.name,
                f"{result.restores}/{len(plan.kills)}",
                *format_quantiles(reported, 1e3, 0),
                _median([s * 1e3 for s in _spans(result, "killed", "restore", every=True)], 0),
                verdict,
            ]
        )
    report.tables.append(
        (
            f"Kill (exit report) -> restore command, bus time stamps (target: p50 <= "
            f"{TARGET_S * 1e3:.0f} ms)",
            [
                "bus",
                "restores/kills",
                "p50 ms",
                "p90 ms",
                "max ms",
                "p50 ms from the real kill",
                "verdict",
            ],
            rows,
        )
    )
    torchrun = _spans(tr[0], "killed", "resumed") if tr else []
    rows = []
    for result in tg:
        if not result.warm:
            continue
        warm = _spans(result, "killed", "resumed")
        cold = next(
            (
                _spans(r, "killed", "resumed")
                for r in tg
                if r.name == result.name.replace(" --warm", "")
            ),
            [],
        )
        p50 = statistics.median(warm) if warm else None
        speedup = statistics.median(torchrun) / p50 if p50 and torchrun else None
        passed = p50 is not None and p50 <= WARM_TARGET_S and (speedup or 0) >= WARM_SPEEDUP
        rows.append(
            [
                result.name,
                f"{sum(i.warm for i in result.incidents)}/{len(result.incidents)}",
                _median(warm),
                _median(_spans(result, "killed", "resumed", every=True)),
                _median(cold),
                _median(torchrun),
                "-" if speedup is None else f"{speedup:.1f}x",
                "PASS" if passed else "FAIL",
            ]
        )
    if rows:
        report.tables.append(
            (
                f"Warm restarts: kill -> first step past the restore, p50 s (target: <= "
                f"{WARM_TARGET_S:g} s and >= {WARM_SPEEDUP:g}x faster than torchrun)",
                [
                    "run",
                    "warm restores/kills",
                    "warm p50",
                    "p50 of every kill",
                    "cold run p50",
                    "torchrun p50",
                    "torchrun / warm",
                    "verdict",
                ],
                rows,
            )
        )
    rows = []
    for result in [*tg, *tr]:
        lost = [i.steps_lost for i in _counted(result) if "resumed" in i.marks]
        rows.append(
            [
                result.name,
                str(len(_counted(result))),
                *format_quantiles(_spans(result, "killed", "resumed")),
                _median(_spans(result, "killed", "back")),
                f"{statistics.fmean(lost):.1f} ({max(lost)})" if lost else "-",
                f"{result.steps_computed - plan.steps}",
                "yes" if result.params_equal else "NO",
                "yes" if result.ledger_exact else "NO",
                f"{result.wall_s:.0f}",
                f"{result.load[0]:.1f}-{result.load[1]:.1f}",
            ]
        )
    report.tables.append(
        (
            "Kill -> training resumed (s, from the real kill)",
            [
                "variant",
                "kills",
                "p50",
                "p90",
                "max",
                "back at kill step p50",
                "steps lost mean (max)",
                "steps recomputed",
                "params == reference",
                "ledger exact",
                "wall s",
                "load",
            ],
            rows,
        )
    )
    trainguard_segments = [
        ("kill -> exit reported (supervisor)", "killed", "exited"),
        ("exit -> restore command (daemon; bus times)", "exited_bus", "restore"),
        ("restore -> workers spawned (old ones stopped)", "restore", "spawned"),
        ("spawned -> agents started (imports, gloo)", "spawned", "started"),
        ("started -> all restored (command, shard load)", "started", "restored"),
        ("restored -> resume command (barrier)", "restored", "resume"),
        ("resume -> first step past restore", "resume", "resumed"),
    ]
    torchrun_segments = [
        ("kill -> failure noticed (torchrun)", "killed", "noticed"),
        ("noticed -> agents started (restart, imports, gloo)", "noticed", "started"),
        ("started -> first step past restart (shard load)", "started", "resumed"),
    ]
    runs = [*tg, *tr]
    rows = []
    for label, start, end in [*trainguard_segments, *torchrun_segments]:
        mine = tg if (label, start, end) in trainguard_segments else tr
        cells = [_median(_spans(r, start, end), 3) if r in mine else "" for r in runs]
        if any(c not in ("", "-") for c in cells):
            rows.append([label, *cells])
    rows.append(
        ["total: kill -> resumed", *[_median(_spans(r, "killed", "resumed"), 3) for r in runs]]
    )
    report.tables.append(
        (
            "Where a restart's time goes (median s per kill)",
            ["segment", *[r.name for r in runs]],
            rows,
        )
    )
    report.tables.append(
        (
            f"Worker start-up measured alone ({WORLD_SIZE} interpreters at once, median s)",
            ["stage", "s"],
            [[stage, f"{seconds:.3f}"] for stage, seconds in anatomy.items()],
        )
    )
    for result in runs:
        report.notes += [f"{result.name}: {note}" for note in result.notes]
        if result.exit_code != 0:
            report.notes.append(f"{result.name}: exit status {result.exit_code}")
        report.notes.append(f"{result.name}: logs in {result.logs}")
    return report


# -- main ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return the exit status (1 if a run did not finish)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--kills", type=int, default=10, help="kills per trainguard run")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps")
    parser.add_argument("--seed", type=int, default=7, help="training seed and kill offsets")
    parser.add_argument("--kafka", help="Kafka bootstrap host:port (default: start kafka-dev)")
    parser.add_argument("--no-kafka", action="store_true", help="skip the Kafka run")
    parser.add_argument(
        "--torchrun-kills",
        type=int,
        default=TORCHRUN_RESTARTS,
        help=f"kills of the torchrun runs (at most {TORCHRUN_RESTARTS}; 0 skips them)",
    )
    parser.add_argument(
        "--torchrun-share-store",
        action="store_true",
        help="leave TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset (see the module docstring)",
    )
    parser.add_argument(
        "--kill-every",
        type=int,
        help="steps between kills (default 2 x checkpoint-every): room for spares to warm up",
    )
    parser.add_argument("--no-warm", action="store_true", help="skip the --warm runs")
    parser.add_argument("--workdir", type=Path, help="keep runs here (default: a temp folder)")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--json", type=Path, help="write every incident's marks here")
    args = parser.parse_args(argv)
    if not 0 <= args.torchrun_kills <= min(TORCHRUN_RESTARTS, args.kills):
        parser.error(f"--torchrun-kills must be in 0..{min(TORCHRUN_RESTARTS, args.kills)}")
    console = Console(width=160)
    try:
        plan = make_plan(args.kills, args.checkpoint_every, args.seed, args.kill_every)
    except ValueError as exc:
        parser.error(str(exc))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="trainguard-bench-recovery-"))

    def say(text: str) -> None:
        console.print(f"[dim]{text}[/dim]")

    say(
        f"job: charlm, {WORLD_SIZE} ranks, {plan.steps} steps, checkpoint every "
        f"{plan.checkpoint_every}, seed {plan.seed}; kills (step, rank): {list(plan.kills)}"
    )
    say(f"work folder {workdir}; " + "; ".join(machine_notes()))
    say("reference run (uninterrupted; cached)…")
    reference = reference_run(
        REPO, CACHE, steps=plan.steps, checkpoint_every=plan.checkpoint_every, seed=plan.seed
    )
    tg: list[RunResult] = []
    tr: list[RunResult] = []

    def torchrun(name: str, worker: list[str], folder: str) -> None:
        say(f"{name}, {args.torchrun_kills} kills…")
        tr.append(
            run_torchrun(
                name,
                worker,
                plan,
                args.torchrun_kills,
                workdir / folder,
                reference,
                args.torchrun_share_store,
            )
        )

    # The order interleaves trainguard and torchrun, so that a drift of the machine's load
    # (other jobs) does not all land on one side; the broker runs throughout for the same
    # reason (its idle CPU weighs on every run alike).
    brokers = nullcontext(None) if args.no_kafka else kafka_broker(args.kafka, workdir / "kafka")
    with brokers as broker:
        if args.torchrun_kills:
            torchrun("torchrun", ["-m", "examples.charlm.train"], "torchrun")

        def trainguard(name: str, bus_url: str, folder: str) -> None:
            say(f"{name}…")
            tg.append(run_trainguard(name, bus_url, plan, workdir / folder, reference))
            if not args.no_warm:
                say(f"{name} --warm…")
                warm_url = bus_url.replace(folder, f"{folder}-warm")
                tg.append(
                    run_trainguard(
                        f"{name} --warm",
                        warm_url,
                        plan,
                        workdir / f"{folder}-warm",
                        reference,
                        warm=True,
                    )
                )

        trainguard(
            "trainguard, SQLite", f"sqlite:///{workdir / 'tg-sqlite' / 'bus.db'}", "tg-sqlite"
        )
        if args.torchrun_kills:
            torchrun(
                "torchrun + local resume",
                [str(VARIANTS_SCRIPT), "local-resume", "--"],
                "torchrun-resume",
            )
        if broker is None:
            say("Kafka run skipped" + ("" if args.no_kafka else ": no broker"))
        else:
            trainguard("trainguard, Kafka", f"kafka://{broker.address}", "tg-kafka")
    say("worker start-up anatomy…")
    anatomy = startup_anatomy()
    report = build_report(plan, tg, tr, anatomy)
    report.notes[:0] = machine_notes()
    print_report(report, args.markdown, console)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "plan": asdict(plan),
                    "runs": [asdict(r) for r in [*tg, *tr]],
                    "startup_anatomy_s": anatomy,
                },
                indent=1,
            )
        )
    return 0 if all(r.exit_code == 0 for r in [*tg, *tr]) else 1


if __name__ == "__main__":
    sys.exit(main())
