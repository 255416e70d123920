"""Scenario harness: the ``examples/charlm`` job under a real daemon and supervisor on one bus,
watched live on the bus, and judged against an uninterrupted reference run.

Built on :mod:`trainguard.daemon.demo._harness` (processes, live following, the job's record); this
module adds what the scenario tests need on top: one object per run that owns its processes
(and kills whatever is left at teardown), waiting for a message on the bus with a deadline, and
the checks of issue 3's invariants (exactly one restore per incident attempt, restore targets
that are the newest good committed snapshot at the moment of the restore, final parameters and
sample ledger equal to the reference). Every :meth:`JobRun.record` also replays the job from the
bus and checks that the replay reproduces the recorded decisions exactly (issue 5).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson
from filelock import FileLock

from examples.charlm.ledger import compare_ledgers, ledger_path, read_ledger
from tests.support.buses import BusFactory
from trainguard.daemon import MachineConfig
from trainguard.daemon.demo._harness import (
    JobRecord,
    Stamped,
    charlm_command,
    charlm_env,
    follow_job,
    read_job_record,
    reference_run,
    start_daemon,
    stop_process,
    supervise,
)
from trainguard.daemon.forensics._job_log import read_bus
from trainguard.daemon.forensics._replay import replay, verify
from trainguard.daemon.forensics._timeline import difference_json
from trainguard.schemas import Lifecycle, Restore

REPO = Path(__file__).resolve().parents[2]
WORLD_SIZE = 2
JOB = "charlm-scenario"

#: Seconds a daemon's consumer-group membership outlives the daemon (``session_timeout_s``):
#: a daemon started after a SIGKILLed one owns the job's partition only once the dead member's
#: session has expired. 6 s is Kafka's default lower bound (``group.min.session.timeout.ms``).
DAEMON_SESSION_TIMEOUT_S = 6.0

#: Seconds the supervisor waits between SIGTERM and SIGKILL when it stops workers.
GRACE_S = 5.0

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Shape:
    """The training run every scenario shares (one reference run per shape).

    Attributes:
        steps: training steps.
        checkpoint_every: steps between checkpoints.
        seed: the training seed.
        world_size: ranks, all on this machine (``--nproc-per-node``).
    """

    steps: int = 120
    checkpoint_every: int = 20
    seed: int = 3
    world_size: int = WORLD_SIZE


class JobRun:
    """One scenario: daemons and a supervisor running the charlm job on one bus.

    Args:
        bus: the bus (URL and a topic prefix of its own).
        workdir: folder for the job's outputs (``run/``), logs and the daemon's config.
        shape: the job's steps, checkpoint interval and seed.
        reference: output folder of the uninterrupted reference run of ``shape``.
        context: what the test randomised or chose (a seed, a fault spec), quoted in every
            failure message so that a failure can be reproduced.
        machine: ``[machine]`` settings of the daemons (``MachineConfig`` fields), e.g.
            ``{"restore_mode": "in_process"}``.
        job: the job's id (several runs with different ids can share one bus and daemon).

    Call :meth:`close` at the end (the ``job_run`` fixture does): it stops every process the
    run started, workers included, also after a failed assertion.
    """

    def __init__(
        self,
        bus: BusFactory,
        workdir: Path,
        shape: Shape,
        reference: Path,
        context: str = "",
        machine: Mapping[str, str | int | float | bool] | None = None,
        job: str = JOB,
    ) -> None:
        self.bus = bus
        self.job = job
        self.workdir = workdir
        self.shape = shape
        self.reference = reference
        self.context = context
        self.out = workdir / "run"
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.supervisor: subprocess.Popen[bytes] | None = None
        self._config = workdir / "daemon.toml"
        # A consumer group of its own, so that runs sharing a Kafka broker never share daemons;
        # /metrics and /healthz on a free port each (see metrics_url).
        settings = "".join(f"{k} = {_toml(v)}\n" for k, v in (machine or {}).items())
        self._config.write_text(
            f"[bus]\nsession_timeout_s = {DAEMON_SESSION_TIMEOUT_S}\n\n"
            f'[service]\ngroup_id = "{bus.prefix}daemon"\nmetrics_port = 0\n\n'
            f"[machine]\n{settings}"
        )

    def describe(self) -> str:
        """The run's context, bus and log folder, for failure messages."""
        return (
            f"[{self.context}; job {self.job}; bus {self.bus.kind} {self.bus.prefix}; "
            f"logs in {self.workdir}]"
        )

    # -- processes -----------------------------------------------------------------------------

    def start_daemon(self) -> subprocess.Popen[bytes]:
        """Start another ``trainguard daemon`` (log ``daemon-<n>.log``)."""
        proc = start_daemon(
            self.bus.url,
            prefix=self.bus.prefix,
            log_path=self.workdir / f"daemon-{len(self.daemons) + 1}.log",
            args=["--config", str(self._config)],
        )
        self.daemons.append(proc)
        return proc

    def metrics_url(self, daemon: int = -1, timeout_s: float = 30.0) -> str:
        """``http://host:port`` of the ``/metrics`` and ``/healthz`` server of
        ``self.daemons[daemon]``, from its log (``metrics server listening``).

        Raises:
            AssertionError: not logged within ``timeout_s`` seconds.
        """
        index = range(len(self.daemons))[daemon]
        log = self.workdir / f"daemon-{index + 1}.log"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in log.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue  # a line being written, or not a log entry
                if entry.get("event") == "metrics server listening":
                    return str(entry["url"])
            time.sleep(0.1)
        raise AssertionError(f"daemon {index + 1} never served metrics {self.describe()}")

    def kill_daemon(self) -> int:
        """SIGKILL the newest daemon's process group (a crash); return the time, ms since the
        epoch, after which the daemon can no longer have written anything."""
        stop_process(self.daemons[-1], signal.SIGKILL)
        return time.time_ns() // 1_000_000

    def start_job(
        self,
        faults: str = "",
        *,
        extra: Sequence[str] = (),
        heartbeat_interval_s: float = 0.5,
        checksum_every: int | None = None,
        run_args: Sequence[str] = (),
    ) -> None:
        """Start the supervisor (``trainguard run --nproc-per-node 2 [run_args]``) with
        ``faults`` as ``TRAINGUARD_FAULTS`` in its workers, ``extra`` options of
        ``examples/charlm/train.py``, heartbeats every ``heartbeat_interval_s`` seconds, and
        parameter checksums every ``checksum_every`` steps (``None``: the agent's default).
        A supervisor started before is replaced as :attr:`supervisor` (it must have ended)."""
        s = self.shape
        self.supervisor = supervise(
            self.job,
            charlm_command(
                self.out,
                steps=s.steps,
                checkpoint_every=s.checkpoint_every,
                seed=s.seed,
                extra=extra,
            ),
            bus_url=self.bus.url,
            prefix=self.bus.prefix,
            nproc_per_node=s.world_size,
            log_path=self.workdir / "supervisor.log",
            env=charlm_env(
                self.out,
                REPO,
                faults=faults,
                heartbeat_interval_s=heartbeat_interval_s,
                checksum_every=checksum_every,
            ),
            grace_s=GRACE_S,
            args=run_args,
        )

    def finish(self, timeout_s: float = 150.0) -> int:
        """Wait for the supervisor to exit; then stop the daemons (SIGTERM); return its code.

        Raises:
            AssertionError: it ran longer than ``timeout_s`` seconds.
        """
        assert self.supervisor is not None, "start_job() first"
        try:
            code = self.supervisor.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the job did not end within {timeout_s:g} s {self.describe()}"
            ) from None
        for daemon in self.daemons:
            stop_process(daemon)
        return code

    def close(self) -> None:
        """Stop everything this run started that still runs: the supervisor with SIGINT (it
        stops its workers), the daemons, and any worker a supervisor that had to be killed
        left behind (by pid, from the supervisor's ``started`` reports)."""
        running = self.supervisor is not None and self.supervisor.poll() is None
        if self.supervisor is not None and running:
            stop_process(self.supervisor, signal.SIGINT, timeout_s=GRACE_S + 10)
        for daemon in self.daemons:
            stop_process(daemon, signal.SIGKILL)
        if not running:
            return
        with contextlib.suppress(Exception):  # teardown of a run whose bus may be unreadable
            record = asyncio.run(read_job_record(self.bus.url, self.bus.prefix, self.job))
            for stamped in record.events:
                msg = stamped.message
                if isinstance(msg, Lifecycle) and msg.rank is None and msg.kind == "started":
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(msg.pid, signal.SIGKILL)

    # -- the bus -------------------------------------------------------------------------------

    def wait_for(self, what: str, match: Callable[[Any], bool], timeout_s: float = 90.0) -> Stamped:
        """Follow the job's records from the start until ``match(message)`` holds for one
        (events and commands decoded, :class:`~trainguard.schemas.Manifest` for manifests, a
        dict for audit entries); return it.

        Raises:
            AssertionError: none within ``timeout_s`` seconds, or the supervisor exited before
                one appeared; names ``what``.
        """
        return asyncio.run(self._wait_for(what, match, timeout_s))

    async def _wait_for(self, what: str, match: Callable[[Any], bool], timeout_s: float) -> Stamped:
        deadline = time.monotonic() + timeout_s
        follow = follow_job(self.bus.url, self.bus.prefix, self.job)
        async with contextlib.aclosing(follow):
            async for batch in follow:
                for stamped in batch:
                    if match(stamped.message):
                        return stamped
                ended = self.supervisor is not None and self.supervisor.poll() is not None
                if (not batch and ended) or time.monotonic() > deadline:
                    why = "the job ended" if ended else f"{timeout_s:g} s passed"
                    raise AssertionError(f"{why} before {what} {self.describe()}")
        raise AssertionError("follow_job() ended")  # it yields for ever

    def record(self) -> JobRecord:
        """Everything the bus holds about the job now, once :meth:`assert_replays` held.

        Raises:
            AssertionError: replaying the job does not reproduce its recorded decisions.
        """
        record = asyncio.run(read_job_record(self.bus.url, self.bus.prefix, self.job))
        self.assert_replays()
        return record

    def assert_replays(self, job: str | None = None) -> None:
        """Replay ``job`` (the run's job by default; another job on the run's bus) from
        the bus as ``trainguard replay`` does and check that the replayed decisions equal the
        audit trail's exactly (architecture invariant 1).

        Raises:
            AssertionError: they differ; names the first difference.
        """
        job = self.job if job is None else job
        log = asyncio.run(read_bus(self.bus.url, self.bus.prefix, job))
        result = replay(
            job, log.events, log.trail(), MachineConfig(daemon_id="replay"), timeline=False
        )
        difference = verify(result.replayed, result.recorded)
        assert difference is None, (
            "replaying the job does not reproduce its recorded decisions: "
            f"{orjson.dumps(difference_json(difference), option=orjson.OPT_INDENT_2).decode()} "
            f"{self.describe()}"
        )


def shared_reference(basetemp: Path, shape: Shape) -> Path:
    """The uninterrupted run of ``shape`` (:func:`~trainguard.daemon.demo._harness.
    reference_run`, no daemon needed), computed once per test run: its cache sits beside the
    session's base temp dir under pytest-xdist (``basetemp`` is then ``.../popen-gwN``, one
    per worker, with a parent they share) and in it otherwise. A lock per shape makes a
    worker that needs the run while another computes it wait for that one instead of
    computing it again.

    Raises:
        RuntimeError, TimeoutError: as ``reference_run``.
    """
    root = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
    cache = root / "references"
    cache.mkdir(exist_ok=True)
    with FileLock(
        cache / f"{shape.steps}-{shape.checkpoint_every}-{shape.seed}-{shape.world_size}.lock"
    ):
        return reference_run(
            REPO,
            cache,
            steps=shape.steps,
            checkpoint_every=shape.checkpoint_every,
            seed=shape.seed,
            world_size=shape.world_size,
        )


def _toml(value: str | int | float | bool) -> str:
    """``value`` as a TOML literal (strings without quotes or backslashes)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


# -- checks --------------------------------------------------------------------------------------


def restore_decisions(record: JobRecord) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each restore the audit trail shows the daemon deciding, once per generation, with the
    snapshots committed before it (oldest first), both as the audit's dicts.

    A daemon that crashed between acting and committing its position decides again what it
    decided last (the command is not sent twice, but the audit entry is written again): only
    the first decision of a generation counts.
    """
    committed: list[dict[str, Any]] = []
    seen: set[int] = set()
    out: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    for decision in record.decisions():
        if decision["decision"] == "committed":
            committed.append(decision["snapshot"])
        elif decision["decision"] == "issue" and decision["command"]["schema"].startswith(
            "restore/"
        ):
            command = decision["command"]
            if command["generation"] not in seen:
                seen.add(command["generation"])
                out.append((command, list(committed)))
    return out


def assert_targets_newest_good(run: JobRun, record: JobRecord) -> None:
    """Every restore the daemon issued (``record.restores()``, from the audit trail: the
    commands topic is compacted) targets the newest snapshot committed before the daemon
    decided it and not reported corrupt before it: a rank's lifecycle
    ``error`` naming a snapshot in generation g rules it out for restores of generation > g."""
    reported: dict[str, int] = {}
    for stamped in record.events:
        msg = stamped.message
        if isinstance(msg, Lifecycle) and msg.kind == "error" and msg.snapshot_id is not None:
            reported.setdefault(msg.snapshot_id, msg.generation)
    decided = {cmd["generation"]: committed for cmd, committed in restore_decisions(record)}
    for restore in record.restores():
        assert restore.generation in decided, (
            f"restore of generation {restore.generation} is not in the audit trail {run.describe()}"
        )
        good = [
            m
            for m in decided[restore.generation]
            if reported.get(m["snapshot_id"], restore.generation) >= restore.generation
        ]
        # A divergence (NaN, spike) goes back to parameters known sound: the reason says to
        # which step, the last one a finite loss was reported for before the onset (how far
        # back depends on the job's pace against the heartbeat interval).
        sound = re.search(r"parameters known sound up to step (\d+)", restore.reason)
        if sound is not None:
            good = [m for m in good if _step_of(m["snapshot_id"]) <= int(sound[1])]
        expected = good[-1]["snapshot_id"] if good else None
        actual = restore.target.snapshot_id if restore.target else None
        assert actual == expected, (
            f"restore of generation {restore.generation} targets {actual}, but the newest good "
            f"committed snapshot then was {expected} {run.describe()}"
        )


def _step_of(snapshot_id: str) -> int:
    """The step of a snapshot id ``<job>/g<generation>/s<step>``."""
    return int(snapshot_id.rsplit("/s", 1)[1])


def assert_exact(run: JobRun, code: int, record: JobRecord) -> None:
    """The job finished (supervisor exit 0, the daemon saw every rank finish) with final
    parameters bitwise equal to the reference run's, and its sample ledger is exact: for every
    step, the samples of the latest generation that completed it equal the reference's
    ``(step, rank, sample id)`` multiset."""
    assert code == 0, f"supervisor exit status {code} {run.describe()}"
    finished = [
        d for d in record.decisions() if d["decision"] == "transition" and d["new"] == "finished"
    ]
    assert finished, f"the daemon never saw the job finish {run.describe()}"
    final, reference = run.out / "final.sha256", run.reference / "final.sha256"
    assert final.is_file(), f"no {final} {run.describe()}"
    assert final.read_text() == reference.read_text(), (
        f"final parameters differ from the uninterrupted run {run.describe()}"
    )
    ranks = run.shape.world_size
    ledgers = [
        read_ledger(ledger_path(d, r) for r in range(ranks)) for d in (run.out, run.reference)
    ]
    comparison = compare_ledgers(ledgers[0], ledgers[1], ranks)
    assert comparison.exact, (
        f"ledger not exact: {sum(comparison.missing.values())} samples skipped "
        f"(e.g. {sorted(comparison.missing)[:3]}), {sum(comparison.extra.values())} repeated "
        f"or foreign (e.g. {sorted(comparison.extra)[:3]}) {run.describe()}"
    )


def only(items: Sequence[_T], what: str, run: JobRun) -> _T:
    """The one element of ``items``; ``AssertionError`` naming ``what`` and listing them if
    there are more or none."""
    assert len(items) == 1, f"expected exactly one {what}, got {list(items)} {run.describe()}"
    return items[0]


def is_restore(generation: int) -> Callable[[Any], bool]:
    """Matches the restore command of ``generation``."""
    return lambda m: isinstance(m, Restore) and m.generation == generation
