"""Detection benchmark (issue 4): for each fault kind, the time from the fault to trainguard's
restore decision, on both buses, next to the time the same job takes to fail on its own
without trainguard.

Usage (from the repository root)::

    python bench/detection.py [--runs 10] [--kafka host:port | --no-kafka] [--parallel 2]
                              [--pg-timeout 60] [--markdown] [--json FILE]  # --help: the rest

The job is ``examples/charlm`` (2 ranks, DDP over gloo, CPU), 120 steps, a checkpoint every 10,
heartbeats every 0.25 s, faults injected through ``TRAINGUARD_FAULTS`` (one per job):

=================  ========================================================================
kind               injected (steps of generation 0)
=================  ========================================================================
kill               SIGKILL of rank 1 after step 25
exit               ``os._exit(3)`` of rank 1 after step 25
hang               rank 1's training thread blocks for ever after step 40 (heartbeats go on)
nan                the loss of step 30 on rank 1 becomes NaN
spike              the loss of every rank is multiplied by 10 from step 60 on
bitflip            one bit of a parameter of rank 1 flips after step 45 (checksums every 10
                   steps)
slow               rank 1's steps take 3 times as long for steps 50-74 (independent replicas,
                   ``--no-sync``, 50 ms steps; 100 steps): a straggler report, not a
                   restore. Step 50 comes after the detector's 10 samples of the rank
                   (``straggler_min_reports``; one per heartbeat), which a slowdown at step
                   10, as in the scenario test, would wait for.
stall-checkpoint   rank 1's blocking checkpoint of step 30 takes 8 s more (declared phase
                   ``checkpoint``): must give no incident (one run per bus: a false-positive
                   check)
=================  ========================================================================

As in ``tests/scenarios/test_detection.py``, the first generation is paced to about 0.1 s per
step (``slow@step=1,rank=0,factor=6``; DDP makes rank 1 wait for rank 0) for the kinds whose
detector learns the job's pace first: 8 step times for the adaptive progress timeout (hang; the
pace ends 4 steps before the hang), 16 loss samples for spikes, and the median step time the
in-process restore's lead needs (nan, spike, bitflip). kill and exit run at charlm's own pace
(about 17 ms a step).

* **trainguard**, once per bus (embedded SQLite, then Kafka: ``--kafka``, or a broker started
  with ``deploy/kafka/kafka-dev``): one ``trainguard daemon`` per bus serves every run, each run
  a job of its own (``<kind>-<i>``) under its own ``trainguard run --nproc-per-node 2``
  supervisor, ``--parallel`` jobs at a time, ``--runs`` runs per kind, the kinds interleaved.
  The daemon restores in process where every process is alive (``restore_mode =
  "in_process"``, ``in_process_lead_s = 2``, as the scenario tests), knows the agents'
  heartbeat interval (``heartbeat_interval_s = 0.25``) and otherwise runs its defaults.
* **without trainguard**, one run per kind that leads to a restore, in the same invocation: the
  same job and fault, the two ranks started by this script with torchrun's variables and no
  launcher (so nothing but the job itself decides when it fails), ``--pg-timeout`` seconds for
  gloo's collectives (charlm's option; an unconfigured job waits torch's default,
  ``torch.distributed.constants.default_pg_timeout``, 30 minutes for gloo in torch 2.13). The
  agent still runs, publishing to a bus file nobody reads: the faults are injected through it,
  and its ``error`` event says when training failed.

Timestamps (all on this machine's wall clock, seconds since the epoch):

* **fault**: the modification time of the fault's marker file (``<out>/checkpoints/<job>/
  .faults-fired/<kind>-s<step>-r<rank>``), which the injector creates just before the fault
  acts: before the SIGKILL, the ``_exit``, the blocking sleep or the bit flip, after the step
  was recorded; for nan and spike when the loss of the step is computed, before its backward
  pass (spike on every rank: the earlier rank's marker); for slow before the first slowed step's
  sleep. File times come from the kernel's coarse clock (a few ms).
* **incident**: the ``at_ms`` of the daemon's audit entry holding the ``incident_opened``
  decision (the straggler report: the ``anomaly`` decision): the bus append time of the input
  that made the decision, an event or the daemon's own tick.
* **restore command**: the bus append time of the daemon's first ``restore`` command for the
  job (a command's own ``ts`` is the daemon's input-driven clock, not when it was sent).
* without trainguard, **failed**: the ``ts`` of the first ``error`` lifecycle event of a rank
  (the agent publishes it when the exception leaves training), and **ended**: when this script
  saw the last rank that exits on its own exit (polled every 10 ms). A rank that is still
  running 10 s after the other failed (the hung one) is killed by the script.

The documented worst case of each detector (``docs/detection.md``) is computed from the run's
own settings and measures, without the delivery jitter *j* the document adds: exit: the
delivery of the exit event (no number); hang: ``hb + timeout + hb + tick`` with the incident's
``timeout_s``; nan: ``hb``; spike: ``loss_spike_persist x max(step time, hb)``; bitflip: the
steps to the next checksum step x step time (the checksum goes out at once); straggler:
``ceil(log((k - 2) / (k - 1)) / log(1 - alpha)) x max(k x step time, hb)`` for a slowdown by
``k``; *hb* is the heartbeat interval, *tick* the daemon's ``tick_interval_s``, the step time
the median reported by generation 0 before the fault.

Caveats: the machine is shared (2 cores), so load from other jobs stretches step times,
worker start-up and the daemon's reaction alike; each run reports the 1-minute load average at
its start. Runs of one bus share one daemon, so a decision for one job can wait behind another
job's; that is what a daemon serving many jobs does too. The nan/spike/bitflip fault marks
precede the step's end (the step itself, and the pace's sleep, about 0.1 s, lie between them
and the heartbeat that shows it). Figures are printed, never asserted; the exit status is 0
unless a run failed (no incident, a wrong cause, no restore, a job that did not finish, a
fault that did not fire, an incident where none belongs).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from torch.distributed.constants import default_pg_timeout
from torch.distributed.elastic.utils.distributed import get_free_port

from trainguard.daemon import DaemonConfig, load_daemon_config
from trainguard.daemon.demo._harness import (
    JobRecord,
    charlm_command,
    charlm_env,
    read_job_record,
    start_daemon,
    stop_process,
    supervise,
)
from trainguard.schemas import Heartbeat, Lifecycle, Restore

REPO = Path(__file__).resolve().parent.parent
WORLD_SIZE = 2
STEPS = 120
CHECKPOINT_EVERY = 10
SEED = 3
HEARTBEAT_S = 0.25
"""The agents' heartbeat interval, seconds (``TRAINGUARD_HEARTBEAT_INTERVAL``)."""
CHECKSUM_EVERY = 10
"""Steps between parameter checksums, every kind (the agent's default is 50)."""
RUN_TIMEOUT_S = 300.0
HUNG_GRACE_S = 10.0
"""Without trainguard: how long a rank may go on after the other failed before it is killed."""
PACE = "slow@step=1,rank=0,factor=6"
"""About 0.1 s per step (6 x charlm's ~17 ms) for all of generation 0."""
DAEMON_MACHINE = {"restore_mode": "in_process", "in_process_lead_s": 2.0}
"""``[machine]`` settings of the daemons beside ``heartbeat_interval_s`` (module docstring)."""

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # bench._broker and friends

from bench._broker import kafka_broker  # noqa: E402
from bench._report import Report, print_report  # noqa: E402
from bench._summary import format_quantiles, machine_notes, quantiles  # noqa: E402

# -- the faults ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One fault kind as the benchmark injects it.

    Attributes:
        kind: the fault kind, as named in the tables.
        faults: ``TRAINGUARD_FAULTS`` of the job.
        marker: glob of the marker file(s) of the measured fault (the earliest counts).
        fault_step: the step the measured fault strikes at.
        expect: the incident ``cause`` the daemon must open, ``"straggler"`` for a straggler
            report and no incident, or ``None`` for neither.
        steps: training steps of the job.
        extra: further options of ``examples/charlm/train.py``.
        without: also run it without trainguard.
        once: one run per bus whatever ``--runs`` says (the false-positive check).
    """

    kind: str
    faults: str
    marker: str
    fault_step: int
    expect: str | None
    steps: int = STEPS
    extra: tuple[str, ...] = ()
    without: bool = True
    once: bool = False


CASES = (
    Case("kill", "kill@step=25,rank=1", "kill-s25-r1", 25, "exited"),
    Case("exit", "exit@step=25,rank=1,code=3", "exit-s25-r1", 25, "exited"),
    Case(
        "hang",
        "slow@step=1,rank=0,factor=6,steps=36;hang@step=40,rank=1",
        "hang-s40-r1",
        40,
        "progress_timeout",
    ),
    Case("nan", f"{PACE};nan@step=30,rank=1", "nan-s30-r1", 30, "nan_loss"),
    Case("spike", f"{PACE};spike@step=60,factor=10", "spike-s60-r*", 60, "loss_spike"),
    Case("bitflip", f"{PACE};bitflip@step=45,rank=1", "bitflip-s45-r1", 45, "checksum_mismatch"),
    Case(
        "slow",
        "slow@step=50,rank=1,factor=3,steps=25",
        "slow-s50-r1",
        50,
        "straggler",
        steps=100,
        extra=("--no-sync", "--step-sleep", "0.05"),
        without=False,
    ),
    Case(
        "stall-checkpoint",
        "slow@step=1,rank=0,factor=6,steps=27;stall-checkpoint@step=30,seconds=8,rank=1",
        "stall-checkpoint-s30-r1",
        30,
        None,
        extra=("--blocking-checkpoints",),
        without=False,
        once=True,
    ),
)

SLOW_FACTOR = 3.0
"""The slowdown of the ``slow`` case (its ``factor``)."""

# -- results ---------------------------------------------------------------------------------


@dataclass
class Run:
    """One job with one fault.

    Attributes:
        kind: :attr:`Case.kind`.
        bus: ``"SQLite"``, ``"Kafka"`` or ``"without trainguard"``.
        job: the job id.
        logs: the run's folder.
        marks: named instants, seconds since the epoch (module docstring): ``fault``, and
            ``incident``, ``restore`` (trainguard) or ``failed``, ``ended`` (without).
        cause: the first incident's ``cause`` (``"straggler"`` for a straggler report).
        measures: the first incident's (or report's) ``measures``.
        restore_mode: the first restore's mode (``restart``, ``in_process``).
        bound_s: the detector's documented worst case for this run (module docstring), s.
        step_time_s: median step time generation 0 reported before the fault, s.
        exit_codes: the supervisor's exit status (trainguard), or each rank's (without;
            ``-9``: killed); ``None``: timed out.
        final_loss: each rank's loss at its last step (charlm's ``finished`` log line), in
            rank order; ``None`` for a rank that did not finish.
        replicas_agree: whether the ranks' last parameter checksums of one step agree
            (``None``: the job did not finish, or no checksums).
        load: the 1-minute load average at the run's start.
        problems: what makes the run a failure (empty: it did what it should).
    """

    kind: str
    bus: str
    job: str
    logs: str
    marks: dict[str, float] = field(default_factory=dict)
    cause: str | None = None
    measures: dict[str, Any] = field(default_factory=dict)
    restore_mode: str | None = None
    bound_s: float | None = None
    step_time_s: float | None = None
    exit_codes: list[int | None] = field(default_factory=list)
    final_loss: list[float | None] = field(default_factory=list)
    replicas_agree: bool | None = None
    load: float = 0.0
    problems: list[str] = field(default_factory=list)

    def span(self, end: str) -> float | None:
        """Seconds from the fault to mark ``end``, ``None`` when either is missing."""
        if "fault" in self.marks and end in self.marks:
            return self.marks[end] - self.marks["fault"]
        return None


def fault_time(out: Path, case: Case) -> float | None:
    """The measured fault's instant: the earliest mtime of its marker files (``None``: it
    did not fire)."""
    markers = (out / "checkpoints").glob(f"*/.faults-fired/{case.marker}")
    return min((p.stat().st_mtime_ns / 1e9 for p in markers), default=None)


def final_losses(logs: Sequence[Path]) -> list[float | None]:
    """The ``loss`` of the last ``finished`` line charlm wrote to ``logs`` for each rank, in
    rank order (``None``: no such line for the rank). Lines that do not decode are passed
    over: the ranks of a supervisor share its log file, and two of them writing at once can
    merge lines."""
    losses: dict[int, float] = {}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if not (line.startswith("{") and '"finished"' in line):
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if entry.get("event") == "finished" and "loss" in entry and "rank" in entry:
                losses[int(entry["rank"])] = float(entry["loss"])
    return [losses.get(rank) for rank in range(WORLD_SIZE)]


def replicas_agree(record: JobRecord) -> bool | None:
    """Whether every rank's parameter checksum of the highest step all ranks checksummed in
    the last generation is the same (``None``: no such step)."""
    beats = [e.message for e in record.events if isinstance(e.message, Heartbeat)]
    if not beats:
        return None
    last = max(b.generation for b in beats)
    sums: dict[int, dict[int, str]] = {}
    for b in beats:
        if b.generation == last and b.param_checksum is not None:
            sums.setdefault(b.step, {})[b.rank] = b.param_checksum
    full = [step for step, ranks in sums.items() if len(ranks) == WORLD_SIZE]
    if not full:
        return None
    return len(set(sums[max(full)].values())) == 1


def step_time_before(record: JobRecord, step: int) -> float | None:
    """Median step time (s) the heartbeats of generation 0 reported before ``step``, the
    first 5 steps (start-up) left out."""
    times = [
        e.message.step_time_s
        for e in record.events
        if isinstance(e.message, Heartbeat)
        and e.message.generation == 0
        and 5 < e.message.step < step
        and e.message.step_time_s is not None
    ]
    return statistics.median(times) if times else None


def documented_bound(case: Case, run: Run, config: DaemonConfig) -> float | None:
    """The detector's worst-case latency of ``docs/detection.md`` for ``run``, seconds,
    without the delivery jitter (module docstring); ``None`` where the document gives no
    number (a dead rank: "delivery of the exit event") or a figure is missing."""
    machine = config.machine
    hb = machine.heartbeat_interval_s
    step = run.step_time_s
    match case.expect:
        case "progress_timeout":
            timeout = run.measures.get("timeout_s")
            return None if timeout is None else 2 * hb + timeout + config.tick_interval_s
        case "nan_loss":
            return hb
        case "loss_spike":
            return None if step is None else machine.loss_spike_persist * max(step, hb)
        case "checksum_mismatch":
            if step is None:
                return None
            checked = math.ceil((case.fault_step + 1) / CHECKSUM_EVERY) * CHECKSUM_EVERY
            return (checked - case.fault_step) * step
        case "straggler":
            if step is None:
                return None
            k, alpha = SLOW_FACTOR, machine.straggler_alpha
            samples = math.ceil(math.log((k - 2) / (k - 1)) / math.log(1 - alpha))
            return samples * max(k * step, hb)
    return None


BOUND_FORMULAS = {
    "exited": "delivery of the exit event",
    "progress_timeout": "hb + timeout + hb + tick",
    "nan_loss": "hb",
    "loss_spike": "4 x max(step, hb)",
    "checksum_mismatch": "steps to next checksum x step",
    "straggler": "7 x max(3 step, hb)",
    None: "(no incident expected)",
}
"""How each detector's documented worst case reads (``docs/detection.md``; defaults)."""

# -- runs ------------------------------------------------------------------------------------


def _decisions(record: JobRecord, kind: str) -> list[tuple[int, dict[str, Any]]]:
    """``(audit at_ms, decision)`` of the job's decisions of ``kind`` (``incident_opened``,
    ``anomaly``)."""
    return [
        (entry["at_ms"], d)
        for entry in record.audit
        for d in entry["decisions"]
        if d["decision"] == kind
    ]


def judge_guarded(case: Case, run: Run, record: JobRecord, config: DaemonConfig) -> None:
    """Fill in ``run``'s marks and measures from the job's record, and its problems."""
    incidents = _decisions(record, "incident_opened")
    stragglers = [(t, d) for t, d in _decisions(record, "anomaly") if d["kind"] == "straggler"]
    restores = [c for c in record.commands if isinstance(c.message, Restore)]
    found = stragglers if case.expect == "straggler" else incidents
    if found:
        at_ms, decision = found[0]
        run.marks["incident"] = at_ms / 1e3
        run.cause = "straggler" if case.expect == "straggler" else decision["cause"]
        run.measures = decision.get("measures", {})
    if restores:
        run.marks["restore"] = restores[0].at_ms / 1e3
        run.restore_mode = restores[0].message.mode
    run.step_time_s = step_time_before(record, case.fault_step)
    run.bound_s = documented_bound(case, run, config)
    if run.exit_codes == [0]:
        run.replicas_agree = replicas_agree(record)
    if case.expect in (None, "straggler"):
        if incidents or restores:
            run.problems.append(f"{len(incidents)} incident(s), {len(restores)} restore(s)")
        if case.expect == "straggler" and not stragglers:
            run.problems.append("no straggler report")
    else:
        if run.cause != case.expect:
            run.problems.append(f"incident cause {run.cause}, expected {case.expect}")
        if not restores:
            run.problems.append("no restore command")
    if run.exit_codes != [0]:
        run.problems.append(f"supervisor exit status {run.exit_codes}")


def run_guarded(
    case: Case, index: int, bus: str, bus_url: str, prefix: str, workdir: Path, config: DaemonConfig
) -> Run:
    """The job with ``case``'s fault under its own supervisor, reported to the daemon that
    runs on ``bus_url`` (``prefix``); job id ``<kind>-<index>``."""
    job = f"{case.kind}-{index}"
    out = workdir / job
    out.mkdir(parents=True, exist_ok=True)
    run = Run(case.kind, bus, job, str(out), load=os.getloadavg()[0])
    sup = supervise(
        job,
        charlm_command(
            out, steps=case.steps, checkpoint_every=CHECKPOINT_EVERY, seed=SEED, extra=case.extra
        ),
        bus_url=bus_url,
        prefix=prefix,
        nproc_per_node=WORLD_SIZE,
        log_path=out / "supervisor.log",
        env=charlm_env(
            out,
            REPO,
            faults=case.faults,
            heartbeat_interval_s=HEARTBEAT_S,
            checksum_every=CHECKSUM_EVERY,
        ),
    )
    try:
        run.exit_codes = [sup.wait(RUN_TIMEOUT_S)]
    except subprocess.TimeoutExpired:
        # SIGINT: the supervisor stops its workers (their own process groups) first.
        stop_process(sup, signal.SIGINT, timeout_s=20)
        run.exit_codes = [None]
    _set_fault(case, run, out)
    record = asyncio.run(read_job_record(bus_url, prefix, job))
    judge_guarded(case, run, record, config)
    run.final_loss = final_losses([out / "supervisor.log"])
    _drop_shards(out)
    return run


def run_without(case: Case, workdir: Path, pg_timeout_s: float) -> Run:
    """The job with ``case``'s fault, its two ranks started with torchrun's variables and no
    launcher, gloo collectives timing out after ``pg_timeout_s``; a rank still running
    :data:`HUNG_GRACE_S` after another failed is killed."""
    job = f"{case.kind}-plain"
    out = workdir / job
    out.mkdir(parents=True, exist_ok=True)
    run = Run(case.kind, "without trainguard", job, str(out), load=os.getloadavg()[0])
    port = get_free_port()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    base = {
        **os.environ,
        **charlm_env(
            out,
            REPO,
            faults=case.faults,
            heartbeat_interval_s=HEARTBEAT_S,
            checksum_every=CHECKSUM_EVERY,
        ),
        "TRAINGUARD_JOB": job,
        "TRAINGUARD_BUS": f"sqlite:///{out / 'bus.db'}",
        "WORLD_SIZE": str(WORLD_SIZE),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    command = charlm_command(
        out,
        steps=case.steps,
        checkpoint_every=CHECKPOINT_EVERY,
        seed=SEED,
        extra=[*case.extra, "--pg-timeout", f"{pg_timeout_s:g}"],
    )
    procs = []
    for rank in range(WORLD_SIZE):
        with (out / f"rank-{rank}.log").open("wb") as log:
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs.append(
                subprocess.Popen(
                    command, stdout=log, stderr=log, env=env, cwd=REPO, start_new_session=True
                )
            )
    ended = _watch_ranks(procs)
    run.exit_codes = [p.returncode for p in procs]
    on_their_own = [t for t, p in zip(ended, procs, strict=True) if p.returncode != -9]
    if on_their_own:
        run.marks["ended"] = max(on_their_own)
    _set_fault(case, run, out)
    record = asyncio.run(read_job_record(f"sqlite:///{out / 'bus.db'}", "trainguard.", job))
    errors = [
        e.message.ts / 1e9
        for e in record.events
        if isinstance(e.message, Lifecycle) and e.message.kind == "error"
    ]
    if errors:
        run.marks["failed"] = min(errors)
    run.step_time_s = step_time_before(record, case.fault_step)
    if run.exit_codes == [0] * WORLD_SIZE:
        run.replicas_agree = replicas_agree(record)
    run.final_loss = final_losses([out / f"rank-{rank}.log" for rank in range(WORLD_SIZE)])
    judge_without(case, run)
    _drop_shards(out)
    return run


def _watch_ranks(procs: Sequence[subprocess.Popen[bytes]]) -> list[float]:
    """Wait for every process, polling every 10 ms; SIGKILL those still running
    :data:`HUNG_GRACE_S` after one failed, or :data:`RUN_TIMEOUT_S` after the start. Returns
    each process's exit instant (seconds since the epoch)."""
    ended: dict[int, float] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(ended) < len(procs):
        now = time.monotonic()
        for i, proc in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.time()
                if proc.returncode != 0:
                    deadline = min(deadline, now + HUNG_GRACE_S)
        if now > deadline:
            for i, proc in enumerate(procs):
                if i not in ended:
                    stop_process(proc, signal.SIGKILL)
        time.sleep(0.01)
    return [ended[i] for i in range(len(procs))]


def _set_fault(case: Case, run: Run, out: Path) -> None:
    fault = fault_time(out, case)
    if fault is None:
        run.problems.append(f"the fault {case.marker} did not fire")
    else:
        run.marks["fault"] = fault


def _drop_shards(out: Path) -> None:
    """Delete the run's checkpoint shards (about 40 MB a run); the fault markers stay."""
    for generation in (out / "checkpoints").glob("*/g*"):
        shutil.rmtree(generation, ignore_errors=True)


def judge_without(case: Case, run: Run) -> None:
    """What must have happened without trainguard: a fault that fired and, for a dead or hung
    rank, a rank that failed; else both ranks finished."""
    stops = case.expect in ("exited", "progress_timeout")
    if stops and "failed" not in run.marks:
        run.problems.append(f"no rank failed (exit codes {run.exit_codes})")
    if not stops and run.exit_codes != [0] * WORLD_SIZE:
        run.problems.append(f"did not finish (exit codes {run.exit_codes})")


# -- the daemons -----------------------------------------------------------------------------


def write_daemon_config(path: Path) -> DaemonConfig:
    """Write the daemons' TOML configuration (module docstring) to ``path``; return it as
    the daemon reads it (defaults filled in)."""
    machine = {**DAEMON_MACHINE, "heartbeat_interval_s": HEARTBEAT_S}
    lines = ["[machine]", *(f"{k} = {json.dumps(v)}" for k, v in machine.items())]
    path.write_text("\n".join(lines) + "\n")
    return load_daemon_config(path)


def run_bus(
    bus: str,
    bus_url: str,
    cases: Sequence[Case],
    runs: int,
    parallel: int,
    workdir: Path,
    say: Callable[[str], None],
    without: Sequence[Case] = (),
    pg_timeout_s: float = 60.0,
) -> list[Run]:
    """Every case ``runs`` times (``once`` cases once) on ``bus_url``, under one daemon,
    ``parallel`` jobs at a time, the kinds interleaved round by round; first, in the same
    pool, each case of ``without`` once without trainguard (:func:`run_without`, gloo
    timeout ``pg_timeout_s``, under ``workdir``'s sibling ``without``). A run whose analysis
    raised is returned with the exception as its problem."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = write_daemon_config(workdir / "daemon.toml")
    prefix = f"det-{uuid.uuid4().hex[:8]}."
    daemon = start_daemon(
        bus_url,
        prefix=prefix,
        log_path=workdir / "daemon.log",
        args=["--config", str(workdir / "daemon.toml")],
        # /metrics on any free port: another daemon on this machine may hold the default.
        env={"TRAINGUARD_METRICS_PORT": "0"},
    )
    futures: list[tuple[Run, Future[Run]]] = []
    try:
        with ThreadPoolExecutor(parallel) as pool:
            for case in without:
                label = Run(case.kind, "without trainguard", f"{case.kind}-plain", str(workdir))
                task = functools.partial(
                    run_without, case, workdir.parent / "without", pg_timeout_s
                )
                futures.append((label, pool.submit(task)))
            for index in range(runs):
                for case in cases:
                    if index == 0 or not case.once:
                        label = Run(case.kind, bus, f"{case.kind}-{index}", str(workdir))
                        task = functools.partial(
                            run_guarded, case, index, bus, bus_url, prefix, workdir, config
                        )
                        futures.append((label, pool.submit(task)))
            done: list[Run] = []
            for label, future in futures:
                try:
                    run = future.result()
                except Exception as exc:  # one broken run must not lose the others' figures
                    run = label
                    run.problems.append(f"the benchmark failed on it: {exc!r}")
                say(_describe(run))
                done.append(run)
    finally:
        stop_process(daemon)
    return done


def _describe(run: Run) -> str:
    spans = ", ".join(
        f"{name} +{span:.3f} s" for name in run.marks if (span := run.span(name)) is not None
    )
    verdict = "; ".join(run.problems) if run.problems else "ok"
    return f"{run.bus} {run.job}: {run.cause or '-'} {spans} [{verdict}]"


# -- report ----------------------------------------------------------------------------------


def _cell(values: Sequence[float]) -> str:
    """``p50 / p90 / max`` of ``values`` (seconds), 3 decimals."""
    return " / ".join(format_quantiles(values, digits=3)) if values else "-"


def _without_cell(run: Run | None) -> str:
    if run is None:
        return "-"
    failed = run.span("failed")
    if failed is not None:
        return f"fails after {failed:.3f} s"
    if run.exit_codes == [0] * WORLD_SIZE:
        return "never (finishes)"
    return "?"


def build_report(
    runs: list[Run], cases: Sequence[Case], pg_timeout_s: float, default_pg_timeout_s: float
) -> Report:
    """Table 1: per kind and bus, fault to incident and to restore command next to the
    documented bound and the job without trainguard; table 2: the runs without trainguard."""
    report = Report()
    plain = {r.kind: r for r in runs if r.bus == "without trainguard"}
    buses = list(dict.fromkeys(r.bus for r in runs if r.bus != "without trainguard"))
    rows = []
    for case in cases:
        for bus in buses:
            mine = [r for r in runs if r.kind == case.kind and r.bus == bus]
            if not mine:
                continue
            ok = [r for r in mine if not r.problems]
            incident = [s for r in ok if (s := r.span("incident")) is not None]
            restore = [s for r in ok if (s := r.span("restore")) is not None]
            bounds = [r.bound_s for r in ok if r.bound_s is not None]
            over = [
                r for r in ok if r.bound_s is not None and (r.span("incident") or 0) > r.bound_s
            ]
            bound = BOUND_FORMULAS[case.expect]
            if bounds:
                bound += f" = {statistics.median(bounds):.3f}"
            modes = sorted({r.restore_mode for r in ok if r.restore_mode})
            rows.append(
                [
                    case.kind,
                    case.expect or "none",
                    bus,
                    f"{len(ok)}/{len(mine)}",
                    bound,
                    _cell(incident) if case.expect else f"no incident in {len(ok)}",
                    _cell(restore),
                    f"{len(over)}/{len(bounds)}" if bounds else "-",
                    ", ".join(modes) or "-",
                    _without_cell(plain.get(case.kind)),
                ]
            )
    report.tables.append(
        (
            "Fault -> detection (s, p50 / p90 / max over the runs without problems; slow: "
            "the straggler report)",
            [
                "fault",
                "detector",
                "bus",
                "runs ok",
                "documented worst case, s (median)",
                "fault -> incident",
                "fault -> restore command",
                "incident over the bound",
                "restore mode",
                "without trainguard (1 run)",
            ],
            rows,
        )
    )
    rows = []
    for case in cases:
        if case.kind not in plain:
            continue
        run = plain[case.kind]
        guarded = [r for r in runs if r.kind == case.kind and r.bus != "without trainguard"]
        agree = [r.replicas_agree for r in guarded if r.replicas_agree is not None]
        rows.append(
            [
                case.kind,
                " ".join(str(c) for c in run.exit_codes),
                f"{run.span('failed'):.3f}" if run.span("failed") is not None else "never",
                f"{run.span('ended'):.3f}" if run.span("ended") is not None else "-",
                _losses(run.final_loss),
                _agree(run.replicas_agree),
                _losses(_median_losses(guarded)),
                f"{sum(agree)}/{len(agree)}" if agree else "-",
            ]
        )
    report.tables.append(
        (
            f"Without trainguard (one run per kind; gloo timeout {pg_timeout_s:g} s, torch's "
            f"default {default_pg_timeout_s:g} s)",
            [
                "fault",
                "exit codes (rank 0, 1)",
                "fault -> failed, s",
                "fault -> last rank ended, s",
                "final loss (per rank)",
                "replicas agree at the end",
                "with trainguard: final loss per rank (median)",
                "with trainguard: runs whose replicas agree",
            ],
            rows,
        )
    )
    quiet = [r for r in runs if r.kind in {c.kind for c in cases if c.expect is None}]
    if quiet:
        report.notes.append(
            "final loss per rank of the runs that must see no incident (uninterrupted "
            f"numbers; median): {_losses(_median_losses(quiet))}"
        )
    for run in runs:
        if run.problems:
            report.notes.append(f"{run.bus} {run.job}: {'; '.join(run.problems)} ({run.logs})")
    loads = [r.load for r in runs]
    if loads:
        q = quantiles(loads)
        assert q is not None
        report.notes.append(
            f"1-minute load average at the runs' start: p50 {q[0]:.2f}, p90 {q[1]:.2f}, "
            f"max {q[2]:.2f}"
        )
    return report


def _median_losses(runs: Sequence[Run]) -> list[float | None]:
    """Per rank, the median final loss of ``runs`` (``None``: no run reported it)."""
    out: list[float | None] = []
    for rank in range(WORLD_SIZE):
        values = [
            loss
            for r in runs
            if len(r.final_loss) > rank and (loss := r.final_loss[rank]) is not None
        ]
        out.append(statistics.median(values) if values else None)
    return out


def _losses(losses: Sequence[float | None]) -> str:
    if not any(loss is not None for loss in losses):
        return "-"
    return " / ".join("-" if loss is None else f"{loss:.3f}" for loss in losses)


def _agree(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


# -- main ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return the exit status (1 if a run had a problem)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=10, help="runs per fault kind and bus")
    parser.add_argument("--parallel", type=int, default=2, help="jobs at a time")
    parser.add_argument(
        "--kinds",
        default=",".join(c.kind for c in CASES),
        help="comma-separated fault kinds (default: all)",
    )
    parser.add_argument(
        "--pg-timeout",
        type=float,
        default=60.0,
        help="gloo collective timeout of the runs without trainguard, seconds",
    )
    parser.add_argument("--kafka", help="Kafka bootstrap host:port (default: start kafka-dev)")
    parser.add_argument("--no-kafka", action="store_true", help="skip the Kafka runs")
    parser.add_argument("--workdir", type=Path, help="keep runs here (default: a temp folder)")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--json", type=Path, help="write every run's marks here")
    args = parser.parse_args(argv)
    wanted = set(args.kinds.split(","))
    unknown = wanted - {c.kind for c in CASES}
    if unknown or args.runs < 1 or args.parallel < 1:
        parser.error(f"need --runs >= 1, --parallel >= 1, known kinds (not {sorted(unknown)})")
    cases = [c for c in CASES if c.kind in wanted]
    console = Console(width=200)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="trainguard-bench-detection-"))
    began = time.monotonic()
    notes = machine_notes()

    def say(text: str) -> None:
        console.print(text, style="dim", markup=False, highlight=False)

    say(f"work folder {workdir}; " + "; ".join(notes))
    runs: list[Run] = []
    brokers = nullcontext(None) if args.no_kafka else kafka_broker(args.kafka, workdir / "kafka")
    with brokers as broker:
        say("trainguard on the embedded SQLite bus, and the runs without trainguard…")
        sqlite_url = f"sqlite:///{workdir / 'sqlite' / 'bus.db'}"
        runs += run_bus(
            "SQLite",
            sqlite_url,
            cases,
            args.runs,
            args.parallel,
            workdir / "sqlite",
            say,
            [c for c in cases if c.without],
            args.pg_timeout,
        )
        if broker is None:
            say("Kafka runs skipped" + ("" if args.no_kafka else ": no broker"))
        else:
            say(f"trainguard on Kafka at {broker.address}…")
            runs += run_bus(
                "Kafka",
                f"kafka://{broker.address}",
                cases,
                args.runs,
                args.parallel,
                workdir / "kafka-runs",
                say,
            )
    report = build_report(runs, cases, args.pg_timeout, default_pg_timeout.total_seconds())
    end_load = os.getloadavg()
    report.notes[:0] = [
        *notes,
        f"{args.runs} runs per kind and bus, {args.parallel} jobs at a time; "
        f"took {(time.monotonic() - began) / 60:.1f} min; load average at the end "
        f"{end_load[0]:.2f} {end_load[1]:.2f} {end_load[2]:.2f}",
        f"runs in {workdir}",
    ]
    print_report(report, args.markdown, console)
    if args.json:
        settings = {
            "cases": [asdict(c) for c in cases],
            "heartbeat_interval_s": HEARTBEAT_S,
            "checksum_every": CHECKSUM_EVERY,
            "daemon_machine": DAEMON_MACHINE,
            "pg_timeout_s": args.pg_timeout,
            "parallel": args.parallel,
        }
        args.json.write_text(
            json.dumps({"settings": settings, "runs": [asdict(r) for r in runs]}, indent=1)
        )
    return 1 if any(r.problems for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
