"""The simulated job: a discrete-event model of N data-parallel ranks, their supervisors and
the failures that strike them, in simulated milliseconds.

Pure (no I/O, no clock, no random draws): the failures come in as data (:class:`Fault`, drawn
by :mod:`._failures`), the daemon's commands come in through :meth:`JobModel.command`, and what
the ranks send comes out of :meth:`JobModel.advance` as :data:`Emission` values, one per kind
and instant for many ranks at once (the driver encodes them, one record per rank). So the same
model runs against the daemon on the embedded bus in simulated time and on Kafka in real time.

**The job.** All ranks train in lock step (synchronous data parallelism): a step takes
``step_s``; after every ``checkpoint_every``-th step every rank writes its shard, which stops
training for ``checkpoint_cost_s`` (a blocking save, declared as the ``checkpoint`` phase) and
then announces it (a ``checkpoint`` event, which carries the rank's data cursor, as an
agent's does; the daemon commits the step once every rank's shard is in). Every rank's agent
heartbeats every ``heartbeat_s`` (last step, its age, step time, a loss on a smooth decaying
trend) and, at every ``checksum_every``-th step, sends a heartbeat with the parameter checksum
the replicas share.

**Failures** strike after so many seconds of *training time* (the clock the MTBF counts, which
stands still while the job is down): ``kill`` (the rank dies; its node's supervisor reports
``exited`` with signal 9 ``exit_report_s`` later; the other ranks block in the next collective
and heartbeat their last step), ``hang`` (the rank blocks with its process alive: every rank
heartbeats the same step), ``nan`` (the rank's loss turns NaN and training goes on),
``sdc`` (silent data corruption: the rank's parameter checksum differs from its replicas' from
then on, and training goes on), ``node`` (every rank of the victim's node and its supervisor
vanish without a report; the others block).

**Recovery.** On a signed ``restore`` (``restart`` mode) every process stops at once (the old
generation sends nothing more); half of ``restart_s`` later the new processes start (a
``started`` report, then heartbeats in phase ``init``), on a replacement node where a node was
lost; at ``restart_s`` every rank acknowledges (``restored`` with the target's step, cursor and
snapshot id) and waits; on ``resume`` training continues from the target step. An ``abort``
ends the run as failed.

**Accounting** (:class:`Accounting`): productive time is the compute of the steps in the final
timeline (``step_s`` each: a restore to step T throws away every step after T trained so far);
wall time runs from the first step's start to the run's end.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, TypeAlias

from trainguard.schemas import Abort, Restore, Resume, SnapshotRef

__all__ = [
    "FAULT_KINDS",
    "Accounting",
    "Beats",
    "Emission",
    "ExitReport",
    "Fault",
    "FaultKind",
    "FaultRecord",
    "JobModel",
    "Reports",
    "Shards",
    "SimParams",
]

FaultKind: TypeAlias = Literal["kill", "hang", "nan", "sdc", "node"]
FAULT_KINDS: tuple[FaultKind, ...] = ("kill", "hang", "nan", "sdc", "node")
"""Every kind of fault the model injects (module docstring)."""

_MS = 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class SimParams:
    """The simulated job.

    Attributes:
        ranks: world size, >= 2 (a fault needs a rank to strike and others to notice).
        ranks_per_host: ranks per node (one supervisor each), >= 1.
        step_s: seconds per training step, > 0.
        heartbeat_s: seconds between two heartbeats of a rank (the agent's
            ``heartbeat_interval_s``), > 0.
        checkpoint_cost_s: ``C``, seconds training stands still for one checkpoint, >= 0.
        checkpoint_every: steps between checkpoints, >= 1.
        restart_s: ``R``, seconds from a restore command to every rank's acknowledgement (stop,
            start, load), > 0.
        checksum_every: steps between parameter checksums, >= 1.
        startup_s: seconds from the job's start (``started`` reports) to its first step, > 0.
        exit_report_s: seconds from a process's death to its supervisor's ``exited`` report,
            >= 0.
        samples_per_rank: samples each rank consumes per step, >= 1.
        dataset_samples: samples in one epoch, >= 1.
        batch_heartbeats: the ranks' heartbeats travel batched per node, one
            ``heartbeat-batch`` record of each node's ranks per heartbeat instant (as a node's
            supervisor sends them with ``heartbeat_batching``), instead of one record per rank.

    Raises:
        ValueError: a value out of its range.
    """

    ranks: int
    ranks_per_host: int = 8
    step_s: float = 1.0
    heartbeat_s: float = 1.0
    checkpoint_cost_s: float = 0.78
    checkpoint_every: int = 60
    restart_s: float = 30.0
    checksum_every: int = 10
    startup_s: float = 3.0
    exit_report_s: float = 0.05
    samples_per_rank: int = 8
    dataset_samples: int = 1 << 40
    batch_heartbeats: bool = False

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise ValueError(f"ranks must be >= 2, not {self.ranks}")
        for name in ("ranks_per_host", "checkpoint_every", "checksum_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.samples_per_rank < 1 or self.dataset_samples < 1:
            raise ValueError("samples_per_rank and dataset_samples must be >= 1")
        for name in ("step_s", "heartbeat_s", "restart_s", "startup_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0")
        for name in ("checkpoint_cost_s", "exit_report_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds >= 0")

    @property
    def hosts(self) -> int:
        """Nodes the job runs on."""
        return -(-self.ranks // self.ranks_per_host)

    @property
    def interval_s(self) -> float:
        """``tau``: seconds of compute between two checkpoints."""
        return self.checkpoint_every * self.step_s


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault to inject: ``kind`` strikes rank ``rank`` (``node``: its node) once the job has
    trained for ``after_s`` seconds in total (training time, module docstring)."""

    after_s: float
    kind: FaultKind
    rank: int


# -- what the ranks send ---------------------------------------------------------------------


class Beats(NamedTuple):
    """Heartbeats of ``ranks`` at ``at_ms``, all in ``generation``.

    ``step`` is the last completed step (or the step a restarted rank stands at), ``age_ms``
    how long ago it completed (``None``: no step completed in this process yet); ``nan_ranks`` report a NaN loss; ``checksum`` is the replicas'
    parameter checksum at ``step`` (``None``: not a checksum heartbeat) and ``odd_ranks``
    report another one (silent data corruption)."""

    at_ms: int
    generation: int
    ranks: tuple[int, ...]
    step: int
    phase: Literal["train", "checkpoint", "init"]
    age_ms: int | None
    loss: float | None
    nan_ranks: frozenset[int] = frozenset()
    checksum: str | None = None
    odd_ranks: frozenset[int] = frozenset()


class Shards(NamedTuple):
    """Every rank of ``ranks`` announces its shard of ``step`` (with its data cursor)."""

    at_ms: int
    generation: int
    ranks: tuple[int, ...]
    step: int


class Reports(NamedTuple):
    """Lifecycle reports of ``ranks`` (``started``, ``restored`` or ``finished``); for
    ``restored``, ``target`` is what they loaded (``None``: the initial state)."""

    at_ms: int
    generation: int
    ranks: tuple[int, ...]
    kind: Literal["started", "restored", "finished"]
    step: int
    target: SnapshotRef | None = None


class ExitReport(NamedTuple):
    """The supervisor of node ``host`` reports that the process of ``ranks`` died (signal 9)."""

    at_ms: int
    generation: int
    host: int
    ranks: tuple[int, ...]


Emission: TypeAlias = Beats | Shards | Reports | ExitReport


# -- accounting ------------------------------------------------------------------------------


@dataclass(slots=True)
class FaultRecord:
    """One injected fault and what became of it (times in simulated ms).

    Attributes:
        fault: the fault.
        at_ms: when it struck.
        generation: the generation it struck.
        restores: restore commands acted on for it (exactly one when all went well).
        restore_ms: when the first restore command arrived, ``None`` before.
        target_step: the step it restored to (``None``: not restored yet, or from scratch).
        resumed_ms: when the job was resumed after it, ``None`` before.
        reached_step: the highest step trained when it was restored.
    """

    fault: Fault
    at_ms: int
    generation: int
    restores: int = 0
    restore_ms: int | None = None
    target_step: int | None = None
    resumed_ms: int | None = None
    reached_step: int = 0

    @property
    def detection_s(self) -> float | None:
        """``D``: seconds from the fault to its restore command."""
        return None if self.restore_ms is None else (self.restore_ms - self.at_ms) / _MS

    @property
    def downtime_s(self) -> float | None:
        """``D + R``: seconds from the fault to training again."""
        return None if self.resumed_ms is None else (self.resumed_ms - self.at_ms) / _MS


@dataclass(slots=True)
class Accounting:
    """Where the simulated time went.

    Attributes:
        first_step_ms: when the first step started (``None`` before).
        end_ms: the end of the run (the latest time advanced to).
        final_step: the last step of the final timeline.
        trained_steps: steps trained, kept or not.
        training_ms: training time (the failure clock): steps and checkpoints of a running job.
        faults: every injected fault, in order.
        stray_restores: restore commands with no fault to answer (a false alarm, or a second
            restore for a fault already restored).
        checkpoints: checkpoints written (every rank's shard announced).
    """

    first_step_ms: int | None = None
    end_ms: int = 0
    final_step: int = 0
    trained_steps: int = 0
    training_ms: int = 0
    faults: list[FaultRecord] = field(default_factory=list)
    stray_restores: int = 0
    checkpoints: int = 0

    def wall_s(self) -> float:
        """Seconds from the first step's start to the end of the run."""
        return 0.0 if self.first_step_ms is None else (self.end_ms - self.first_step_ms) / _MS

    def productive_s(self, step_s: float) -> float:
        """Seconds of compute in the final timeline (``final_step`` steps of ``step_s``)."""
        return self.final_step * step_s

    def goodput(self, step_s: float) -> float:
        """Productive time / wall time (0 before the first step)."""
        wall = self.wall_s()
        return self.productive_s(step_s) / wall if wall > 0 else 0.0


# -- the model -------------------------------------------------------------------------------

_Phase: TypeAlias = Literal["starting", "training", "stalled", "restarting", "failed", "done"]


class JobModel:
    """The simulated job (module docstring).

    Args:
        params: the job.
        faults: the faults to inject, in order of ``after_s``.
        horizon_s: the run ends once the job has trained this many seconds (training time);
            ``None``: only :meth:`finish` ends it.

    Attributes:
        phase: ``starting``, ``training``, ``stalled`` (a fault struck: no progress or
            progress that will be thrown away), ``restarting`` (a restore is being carried
            out), ``failed`` (aborted) or ``done``.
        generation: the generation the ranks run in.
        step: the last step completed in this generation.
        accounting: where the time went.
    """

    def __init__(
        self, params: SimParams, faults: tuple[Fault, ...], horizon_s: float | None = None
    ) -> None:
        self.p = params
        self._faults = sorted(faults, key=lambda f: f.after_s)
        self._horizon_ms = None if horizon_s is None else round(horizon_s * _MS)
        self.phase: _Phase = "starting"
        self.generation = 0
        self.step = 0
        self.accounting = Accounting()
        self._queue: list[tuple[int, int, Callable[[int], list[Emission]]]] = []
        self._order = itertools.count()
        self._now = 0
        self._out: list[Emission] = []
        self._hosts = list(range(params.hosts))  # node index -> host id (ids of spares follow)
        self._spare = itertools.count(params.hosts)
        self._silent: frozenset[int] = frozenset()  # ranks whose processes are gone
        self._lost: set[int] = set()  # node indices that vanished
        self._started = False  # the current generation's processes are up
        self._nan: frozenset[int] = frozenset()
        self._odd: frozenset[int] = frozenset()
        self._step_done_ms: int | None = None  # this process generation's last step end
        self._in_checkpoint = False
        self._training_since: int | None = None
        self._epoch = 0  # bumped whenever the job's course changes: stale events are dropped
        self._open: FaultRecord | None = None
        self._waiting: Restore | None = None  # acknowledged, waiting for resume
        self._schedule(0, self._start)

    # -- the interface ---------------------------------------------------------------------

    def host_of(self, rank: int) -> int:
        """The id of the node ``rank`` runs on now (a lost node's replacement has a new id)."""
        return self._hosts[rank // self.p.ranks_per_host]

    def ranks_of_host(self, node: int) -> tuple[int, ...]:
        """The ranks of node index ``node`` (0-based position, not id)."""
        first = node * self.p.ranks_per_host
        return tuple(range(first, min(self.p.ranks, first + self.p.ranks_per_host)))

    @property
    def ended(self) -> bool:
        """Whether the run is over (failed, done)."""
        return self.phase in ("failed", "done")

    @property
    def disturbed(self) -> bool:
        """Whether a fault or its recovery is under way: the daemon may decide something any
        moment (the driver then steps instant by instant)."""
        return self.phase in ("starting", "stalled", "restarting") or self._waiting is not None

    @property
    def silent(self) -> bool:
        """Whether no rank sends anything until the next event: processes restarting, or
        every rank's process gone (a node fault on a job of one node)."""
        restarting = self.phase == "restarting" and self._waiting is None and not self._started
        return restarting or len(self._silent) == self.p.ranks

    def next_ms(self) -> int | None:
        """The time of the next event, or ``None`` when nothing more will happen by itself."""
        return self._queue[0][0] if self._queue else None

    def advance(self, until_ms: int) -> list[Emission]:
        """Run every event up to ``until_ms`` (inclusive); return what the ranks sent, in time
        order. Time never goes back: ``until_ms`` below the last one is taken as that."""
        out: list[Emission] = []
        while self._queue and self._queue[0][0] <= until_ms and not self.ended:
            at, _, action = heapq.heappop(self._queue)
            self._now = at
            out.extend(action(at))
        self._now = max(self._now, until_ms)
        self.accounting.end_ms = max(self.accounting.end_ms, self._now)
        return out

    def command(self, at_ms: int, command: Restore | Resume | Abort) -> None:
        """Act on a signed command the ranks admitted at ``at_ms`` (after :meth:`advance` to
        it)."""
        self._now = max(self._now, at_ms)
        if self.ended:
            return
        match command:
            case Restore():
                self._restore(at_ms, command)
            case Resume():
                self._resume(at_ms, command)
            case Abort():
                self._leave_training(at_ms)
                self.phase = "failed"
                self._queue.clear()

    def finish(self, at_ms: int) -> list[Emission]:
        """End the run at ``at_ms``: every rank reports ``finished`` at its last step.

        Returns the reports (none when the job is not training)."""
        out = self.advance(at_ms)
        if self.phase != "training":
            self.phase = "done" if not self.ended else self.phase
            return out
        self._leave_training(at_ms)
        self.phase = "done"
        self._queue.clear()
        self.accounting.final_step = self.step
        ranks = tuple(r for r in range(self.p.ranks) if r not in self._silent)
        out.append(Reports(at_ms, self.generation, ranks, "finished", self.step))
        return out

    # -- scheduling ------------------------------------------------------------------------

    def _schedule(self, at_ms: int, action: Callable[[int], list[Emission]]) -> None:
        heapq.heappush(self._queue, (at_ms, next(self._order), action))

    def _later(self, at_ms: int, action: Callable[[int], list[Emission]]) -> None:
        """Schedule ``action`` for ``at_ms`` unless the job's course changes before."""
        epoch = self._epoch

        def run(now: int) -> list[Emission]:
            return action(now) if epoch == self._epoch else []

        self._schedule(at_ms, run)

    def _ms(self, seconds: float) -> int:
        return round(seconds * _MS)

    # -- start -----------------------------------------------------------------------------

    def _start(self, at: int) -> list[Emission]:
        ranks = tuple(range(self.p.ranks))
        self._started = True
        self._later(at + self._ms(self.p.startup_s), self._begin_training)
        self._later(at + self._ms(self.p.heartbeat_s), self._beat)
        return [Reports(at, 0, ranks, "started", 0)]

    def _begin_training(self, at: int) -> list[Emission]:
        self.phase = "training"
        if self.accounting.first_step_ms is None:
            self.accounting.first_step_ms = at
        self._enter_training(at)
        self._later(at + self._ms(self.p.step_s), self._step_end)
        return []

    # -- training --------------------------------------------------------------------------

    def _enter_training(self, at: int) -> None:
        self._training_since = at
        self._arm_fault(at)
        self._arm_horizon(at)

    def _leave_training(self, at: int) -> None:
        if self._training_since is not None:
            self.accounting.training_ms += at - self._training_since
            self._training_since = None

    def _training_ms(self, at: int) -> int:
        running = 0 if self._training_since is None else at - self._training_since
        return self.accounting.training_ms + running

    def _arm_fault(self, at: int) -> None:
        if not self._faults:
            return
        due = at + max(0, self._ms(self._faults[0].after_s) - self._training_ms(at))
        self._later(due, self._strike)

    def _arm_horizon(self, at: int) -> None:
        if self._horizon_ms is None:
            return
        self._later(at + max(0, self._horizon_ms - self._training_ms(at)), self._end)

    def _end(self, at: int) -> list[Emission]:
        return self.finish(at)

    def _step_end(self, at: int) -> list[Emission]:
        self.step += 1
        self._step_done_ms = at
        self.accounting.trained_steps += 1
        out: list[Emission] = []
        if self.step % self.p.checksum_every == 0:
            out.append(self._beats(at, checksum=True))
        if self.step % self.p.checkpoint_every == 0:
            self._in_checkpoint = True
            out.append(self._beats(at))  # the agent declares the phase at once
            self._later(at + self._ms(self.p.checkpoint_cost_s), self._checkpoint_end)
        else:
            self._later(at + self._ms(self.p.step_s), self._step_end)
        return out

    def _checkpoint_end(self, at: int) -> list[Emission]:
        self._in_checkpoint = False
        self.accounting.checkpoints += 1
        self._later(at + self._ms(self.p.step_s), self._step_end)
        ranks = tuple(r for r in range(self.p.ranks) if r not in self._silent)
        return [Shards(at, self.generation, ranks, self.step)]

    def _beat(self, at: int) -> list[Emission]:
        """Every rank's agent heartbeats, whatever the job does (its own thread)."""
        self._schedule(at + self._ms(self.p.heartbeat_s), self._beat)
        if self.ended or not self._started:
            return []
        return [self._beats(at)]

    def _beats(self, at: int, *, checksum: bool = False) -> Beats:
        ranks = tuple(r for r in range(self.p.ranks) if r not in self._silent)
        if self.phase == "restarting" or (self.phase == "starting" and self.step == 0):
            return Beats(at, self.generation, ranks, self._restart_step(), "init", None, None)
        done = self._step_done_ms
        phase: Literal["train", "checkpoint"] = "checkpoint" if self._in_checkpoint else "train"
        return Beats(
            at,
            self.generation,
            ranks,
            self.step,
            phase,
            None if done is None else at - done,
            _loss(self.step),
            self._nan,
            _checksum(self.step) if checksum else None,
            self._odd if checksum else frozenset(),
        )

    def _restart_step(self) -> int:
        waiting = self._waiting
        return self.step if waiting is None or waiting.target is None else waiting.target.step

    # -- faults ----------------------------------------------------------------------------

    def _strike(self, at: int) -> list[Emission]:
        fault = self._faults.pop(0)
        record = FaultRecord(fault, at, self.generation, reached_step=self.step)
        self.accounting.faults.append(record)
        self._open = record
        # The pending step, checkpoint (never announced) and horizon are off, and the failure
        # clock stands still until the job runs again.
        self._epoch += 1
        self._leave_training(at)
        self.phase = "stalled"
        self._in_checkpoint = False
        node = fault.rank // self.p.ranks_per_host
        if fault.kind in ("nan", "sdc"):
            # The process lives and trains on: its steps are thrown away by the restore.
            if fault.kind == "nan":
                self._nan = self._nan | {fault.rank}
            else:
                self._odd = self._odd | {fault.rank}
            self._later(at + self._ms(self.p.step_s), self._step_end_disturbed)
        elif fault.kind == "kill":
            self._silent = self._silent | {fault.rank}
            report = ExitReport(
                at + self._ms(self.p.exit_report_s),
                self.generation,
                self.host_of(fault.rank),
                (fault.rank,),
            )
            self._later(report.at_ms, lambda _: [report])
        elif fault.kind == "node":
            self._lost.add(node)
            self._silent = self._silent | set(self.ranks_of_host(node))
        return []

    def _step_end_disturbed(self, at: int) -> list[Emission]:
        """A step of a job that trains on after a NaN or a silent corruption: it counts as
        trained (and is thrown away by the restore), checkpoints included."""
        self.step += 1
        self._step_done_ms = at
        self.accounting.trained_steps += 1
        self._record_reached()
        out: list[Emission] = []
        if self.step % self.p.checksum_every == 0:
            out.append(self._beats(at, checksum=True))
        if self.step % self.p.checkpoint_every == 0:
            self._in_checkpoint = True
            out.append(self._beats(at))

            def written(now: int) -> list[Emission]:
                self._in_checkpoint = False
                self.accounting.checkpoints += 1
                self._later(now + self._ms(self.p.step_s), self._step_end_disturbed)
                ranks = tuple(r for r in range(self.p.ranks) if r not in self._silent)
                return [Shards(now, self.generation, ranks, self.step)]

            self._later(at + self._ms(self.p.checkpoint_cost_s), written)
        else:
            self._later(at + self._ms(self.p.step_s), self._step_end_disturbed)
        return out

    def _record_reached(self) -> None:
        """Note the step reached in the open fault's record."""
        if self._open is not None:
            self._open.reached_step = max(self._open.reached_step, self.step)

    # -- recovery --------------------------------------------------------------------------

    def _restore(self, at: int, restore: Restore) -> None:
        record = self._open
        if record is not None and record.restore_ms is None:
            record.restore_ms = at
        if record is not None:
            record.restores += 1
            record.target_step = None if restore.target is None else restore.target.step
        else:
            self.accounting.stray_restores += 1
        self._leave_training(at)
        self._epoch += 1
        self.phase = "restarting"
        self._in_checkpoint = False
        self._waiting = None
        self._started = False
        self.generation = restore.generation
        # Lost nodes come back as spares with new ids; killed processes are simply restarted.
        for node in sorted(self._lost):
            self._hosts[node] = next(self._spare)
        self._lost.clear()
        self._silent = frozenset()
        self._nan = frozenset()
        self._odd = frozenset()
        self.step = 0 if restore.target is None else restore.target.step
        self._step_done_ms = None
        half = at + self._ms(self.p.restart_s / 2)
        self._later(half, lambda now: self._processes_started(now, restore))
        self._later(at + self._ms(self.p.restart_s), lambda now: self._acknowledge(now, restore))

    def _processes_started(self, at: int, restore: Restore) -> list[Emission]:
        self._started = True
        ranks = tuple(range(self.p.ranks))
        return [Reports(at, restore.generation, ranks, "started", self._step_of(restore))]

    def _acknowledge(self, at: int, restore: Restore) -> list[Emission]:
        self._waiting = restore
        ranks = tuple(range(self.p.ranks))
        step = self._step_of(restore)
        return [Reports(at, restore.generation, ranks, "restored", step, restore.target)]

    @staticmethod
    def _step_of(restore: Restore) -> int:
        return 0 if restore.target is None else restore.target.step

    def _resume(self, at: int, resume: Resume) -> None:
        if self._waiting is None or resume.generation != self.generation:
            return
        self._waiting = None
        self._epoch += 1
        self.phase = "training"
        self.step = resume.step
        record, self._open = self._open, None
        if record is not None:
            record.resumed_ms = at
        self._enter_training(at)
        self._later(at + self._ms(self.p.step_s), self._step_end)


def _loss(step: int) -> float:
    """A smooth, slowly decaying training loss (no noise: no spike detector fires on it)."""
    return round(2.0 + 4.0 * math.exp(-step / 4000.0), 6)


def _checksum(step: int) -> str:
    """The replicas' parameter checksum at ``step`` (hex); the odd ranks report its bitwise
    complement."""
    return f"{(step * 2654435761) & 0xFFFFFFFF:08x}"
