"""A generated job record for the replay benchmark: a long data-parallel training job as its
agents, supervisors and daemon would have left it on the bus, with the daemon's audit trail.

The job (:class:`Plan`; defaults: 64 ranks on 8 hosts, 8 ranks each) starts, trains steps of
about a second (lognormal, sigma 0.05) and every rank sends one heartbeat per step (loss on a
decaying trend with 1 % noise per rank, a parameter checksum every ``checksum_every`` steps),
a data-cursor event every ``cursor_every`` steps and a checkpoint shard ``checkpoint_every``
steps (written asynchronously: announced 0.2-0.8 s after the step), so every checkpoint step
is committed. Incidents, at fixed fractions of the run:

* ``kill``: a rank's process dies; its supervisor reports ``exited`` (signal 9); the other
  ranks hang in the next collective, heartbeating the same step, until their supervisors stop
  them 0.4 s after the restore command (heartbeats sent before that and appended after the
  restore are stale: rejected);
* ``host_lost``: a node and its supervisor vanish without a report; the other ranks hang and
  keep heartbeating; the daemon finds the stall; the restarted generation runs on a
  replacement host;
* ``rack_lost``: every node vanishes at once (power); nothing is sent, so only the daemon's
  ticks find the ranks past the heartbeat timeout; the job restarts on replacement hosts.

After every restore, each rank of the new generation starts (new process ids) 15-25 s later,
heartbeats in phase ``init`` every second, acknowledges the restore with ``restored`` after
loading (5-8 s) and trains on from the target step once the daemon resumes the job. When the
record holds ``Plan.events`` events (give or take one step's worth), every rank reports
``finished``.

The daemon's side is produced by folding the records as :class:`DaemonService` does: each
record goes through :func:`~trainguard.daemon.core._intake.take` and
:func:`~trainguard.daemon.core._machine.decide` as it is appended; decisions are acted on in the
service's order (commands on ``commands``, committed manifests on ``manifests``, the config
entry once and a decision entry per deciding input on ``audit``, built by
:mod:`trainguard.daemon.core._audit_entry`); its ticks are written where the service's loop would write
them, modelled as ``_replay.what_if`` models them, plus the service's pulse: at ``max(min(next_deadline,
last input + pulse_s), last tick + tick_interval_s) + poll_s``, whenever that comes before the
next record (without the pulse, a wait for a deadline would read as a bus outage, whose rule
stops the job's clock). Append times are
whole milliseconds (bus times are) and never decrease.

Deterministic: the same :class:`Plan` gives the same record, byte for byte.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Literal, TypedDict

import orjson

from trainguard.agent.bus import Record
from trainguard.agent.bus._partitioner import partition_for
from trainguard.daemon.core._audit_entry import config_entry, config_id, decision_entry
from trainguard.daemon.core._decisions import Committed, Decision, IncidentOpened, Issue, Rejected
from trainguard.daemon.core._intake import Taken, take
from trainguard.daemon.core._machine import decide, next_deadline
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import TERMINAL_PHASES, JobState, new_job
from trainguard.daemon.service import DaemonConfig
from trainguard.schemas import (
    Abort,
    Checkpoint,
    CheckpointMeta,
    ClockTick,
    DataCursor,
    DataCursorEvent,
    Event,
    Heartbeat,
    JSONValue,
    Lifecycle,
    Restore,
    Resume,
    encode,
)

__all__ = [
    "INCIDENTS",
    "PARTITIONS",
    "T0_MS",
    "GeneratedJob",
    "Plan",
    "RunningJob",
    "generate",
    "running_state",
]

T0_MS = 1_767_225_600_000
"""The job's first record: 2026-01-01T00:00:00Z, ms since the Unix epoch."""

PARTITIONS = 6
"""Partitions of ``events`` (trainguard's default topics)."""

_NS_PER_MS = 1_000_000

# The recording daemon runs its loop as a default daemon does. Read from the fields: a slotted
# dataclass keeps no defaults on the class.
_DAEMON_DEFAULTS = {f.name: f.default for f in fields(DaemonConfig)}

Fault = Literal["kill", "host_lost", "rack_lost"]

INCIDENTS: tuple[tuple[float, Fault], ...] = (
    (0.2, "kill"),
    (0.45, "host_lost"),
    (0.7, "kill"),
    (0.88, "rack_lost"),
)
"""``(fraction of the planned events, fault)`` of every incident, in order: the fault strikes
at the end of the first step after the record holds that fraction of ``Plan.events``."""


@dataclass(frozen=True)
class Plan:
    """The job to generate; the recording daemon's loop settings (``tick_interval_s``,
    ``poll_s``, ``pulse_s``) default to ``DaemonConfig``'s.

    Attributes:
        events: records on ``events`` to aim for (ticks included); the record ends with the
            first step that reaches it, so it holds up to about one step's worth more.
        seed: seeds every random draw (step times, delays, losses, restart times).
        job_id: the job id (record key).
        world_size: ranks.
        ranks_per_host: ranks per node (one supervisor each).
        step_s: median step time, seconds.
        checkpoint_every: steps between checkpoints, >= 1.
        cursor_every: steps between data-cursor events, >= 1.
        checksum_every: steps between parameter checksums, >= 1.
        samples_per_rank: samples each rank consumes per step.
        dataset_samples: samples in one epoch of the dataset.
        daemon_id: the recording daemon's id (its ``MachineConfig``; defaults otherwise).
        tick_interval_s: the daemon's least time between two ticks of the job, seconds.
        poll_s: the daemon's longest wait between two looks at the clock, seconds.
        pulse_s: the daemon's pulse: a job with nothing folded for this long gets a tick
            (``DaemonConfig.pulse_s``), seconds.
    """

    events: int = 1_000_000
    seed: int = 0
    job_id: str = "replay-bench"
    world_size: int = 64
    ranks_per_host: int = 8
    step_s: float = 1.0
    checkpoint_every: int = 200
    cursor_every: int = 100
    checksum_every: int = 500
    samples_per_rank: int = 8
    dataset_samples: int = 2_000_000
    daemon_id: str = "daemon-bench"
    tick_interval_s: float = _DAEMON_DEFAULTS["tick_interval_s"]
    poll_s: float = _DAEMON_DEFAULTS["poll_s"]
    pulse_s: float = _DAEMON_DEFAULTS["pulse_s"]

    @property
    def machine(self) -> MachineConfig:
        """The recording daemon's machine configuration."""
        return MachineConfig(daemon_id=self.daemon_id)


@dataclass
class GeneratedJob:
    """A generated job record.

    Attributes:
        plan: what was generated.
        partition: the job's partition of every job-keyed topic (of :data:`PARTITIONS`).
        records: records by topic (``events``, ``commands``, ``manifests``, ``audit``), offsets
            from 0, as the bus would hold them.
        decisions: the daemon's decisions by kind (``rejected:stale_generation`` for rejects).
        incidents: ``(cause, step)`` of each incident opened, in order.
        steps: the highest step trained (in any generation).
    """

    plan: Plan
    partition: int
    records: dict[str, list[Record]]
    decisions: Counter[str] = field(default_factory=Counter)
    incidents: list[tuple[str, int]] = field(default_factory=list)
    steps: int = 0


class _Daemon:
    """The recording daemon: folds each appended record like ``DaemonService._process`` and
    writes what ``DaemonService._act`` writes."""

    def __init__(
        self, plan: Plan, partition: int, *, keep_events: bool = True, act: bool = True
    ) -> None:
        self.keep_events = keep_events  # False: records of events folded, not kept
        self.act = act  # False: nothing written for decisions
        self.appended = 0
        self.job_id = plan.job_id
        self.machine = plan.machine
        self.config_id = config_id(self.machine)
        self.partition = partition
        self.state: JobState = new_job(plan.job_id)
        self.records: dict[str, list[Record]] = {
            t: [] for t in ("events", "commands", "manifests", "audit")
        }
        self.audited = False
        self.decisions: Counter[str] = Counter()

    def _write(self, topic: str, value: bytes, at_ms: int) -> Record:
        out = self.records[topic]
        record = Record(topic, self.partition, len(out), self.job_id, value, at_ms)
        out.append(record)
        return record

    def append(self, message: Event | ClockTick, at_ms: int) -> tuple[Decision, ...]:
        """Append ``message`` to ``events`` at ``at_ms``, fold it, act; return its decisions.

        Raises:
            RuntimeError: the record is refused by intake (the generator is wrong).
        """
        if self.keep_events:
            record = self._write("events", encode(message), at_ms)
        else:
            offset = self.appended
            record = Record("events", self.partition, offset, self.job_id, encode(message), at_ms)
        self.appended += 1
        taken = take(record)
        if not isinstance(taken, Taken):
            raise RuntimeError(f"generated record refused: {taken.reason}")
        self.state, decisions = decide(self.state, taken.input, self.machine)
        if decisions and self.act:
            self._act(record, taken.input_id, decisions)
        return decisions

    def _act(
        self, record: Record, identity: dict[str, JSONValue], decisions: tuple[Decision, ...]
    ) -> None:
        at_ms = record.timestamp_ms
        for d in decisions:
            self.decisions[f"rejected:{d.code}" if isinstance(d, Rejected) else d.KIND] += 1
            if isinstance(d, Issue):
                self._write("commands", encode(d.command), at_ms)
            elif isinstance(d, Committed):
                self._write("manifests", encode(d.manifest), at_ms)
        if not self.audited:
            self._write("audit", orjson.dumps(config_entry(self.job_id, self.machine)), at_ms)
            self.audited = True
        entry = decision_entry(
            self.job_id,
            partition=record.partition,
            offset=record.offset,
            at_ms=at_ms,
            identity=identity,
            config=self.config_id,
            decisions=decisions,
        )
        self._write("audit", orjson.dumps(entry), at_ms)


class _Head(TypedDict):
    """The envelope every event of a rank carries."""

    job_id: str
    generation: int
    ts: int
    seq: int
    rank: int
    host: str
    pid: int


class _Simulation:
    """The job's processes as a discrete-event simulation in bus time (ms); see the module
    docstring."""

    def __init__(self, plan: Plan, *, keep_events: bool = True, act: bool = True) -> None:
        self.plan = plan
        self.rng = random.Random(plan.seed)
        partition = partition_for(plan.job_id, PARTITIONS)
        self.daemon = _Daemon(plan, partition, keep_events=keep_events, act=act)
        self.queue: list[tuple[int, int, Callable[[int], None]]] = []
        self.order = itertools.count()
        self.seqs: dict[tuple[int | None, str, int], int] = {}
        self.tick_seq = itertools.count(1)
        self.last_tick_ns = 0
        self.last_sent_ns = 0
        self.now_ms = T0_MS
        hosts = -(-plan.world_size // plan.ranks_per_host)
        self.hosts = [f"gpu-{h:03d}" for h in range(hosts)]
        self.spare = itertools.count(hosts)  # replacement nodes
        self.generation = 0
        self.training = False  # the current generation's steps advance
        self.silent: set[int] = set()  # ranks that send nothing (dead, or their node is gone)
        self.stopped_at: dict[int, int] = {}  # generation -> when its processes were stopped
        self.incidents = [(round(f * plan.events), fault) for f, fault in INCIDENTS]
        self.opened: list[tuple[str, int]] = []
        self.step = 0  # the current generation's last step
        self.highest = 0
        digest = hashlib.sha256(f"{plan.job_id}/dataset".encode()).hexdigest()
        self.data_version = f"sha256:{digest[:16]}"
        self.meta = CheckpointMeta(
            hyperparameters={"lr": 3e-4, "global_batch": plan.world_size * plan.samples_per_rank},
            topology={"world_size": plan.world_size, "dp": plan.world_size},
            code_version="9f3c2a1",
        )

    # -- plumbing --------------------------------------------------------------------------

    def at(self, at_ms: int, action: Callable[[int], None]) -> None:
        heapq.heappush(self.queue, (at_ms, next(self.order), action))

    def host(self, rank: int) -> str:
        return self.hosts[rank // self.plan.ranks_per_host]

    def pid(self, rank: int, generation: int) -> int:
        return 20_000 + 577 * generation + rank

    def next_seq(self, rank: int | None, host: str, pid: int) -> int:
        key = (rank, host, pid)
        seq = self.seqs[key] = self.seqs.get(key, -1) + 1
        return seq

    def sent_ns(self, at_ms: int) -> int:
        """The sender's clock: a few ms before the bus appended the record."""
        return at_ms * _NS_PER_MS - self.rng.randrange(1_000_000, 6_000_000)

    def head(self, rank: int, at_ms: int, generation: int | None = None) -> _Head:
        generation = self.generation if generation is None else generation
        host, pid = self.host(rank), self.pid(rank, generation)
        return _Head(
            job_id=self.plan.job_id,
            generation=generation,
            ts=self.sent_ns(at_ms),
            seq=self.next_seq(rank, host, pid),
            rank=rank,
            host=host,
            pid=pid,
        )

    def send(self, message: Event | ClockTick, at_ms: int) -> None:
        self.last_sent_ns = at_ms * _NS_PER_MS
        for d in self.daemon.append(message, at_ms):
            if isinstance(d, IncidentOpened):
                self.opened.append((d.cause, self.step))
            elif isinstance(d, Issue):
                self.command(d.command, at_ms)

    def advance(self) -> bool:
        """Write the next tick or run the next action; ``False`` when nothing is left."""
        tick = self.next_tick_ms()
        if tick is not None and (not self.queue or tick <= self.queue[0][0]):
            self.write_tick(tick)
            return True
        if not self.queue:
            return False
        at_ms, _, action = heapq.heappop(self.queue)
        self.now_ms = at_ms
        action(at_ms)
        return True

    def run(self) -> GeneratedJob:
        self.start()
        while self.advance():
            pass
        if self.daemon.state.phase != "finished":
            raise RuntimeError(f"the generated job ended {self.daemon.state.phase}")
        if self.incidents or len(self.opened) != len(INCIDENTS):
            planned = [fault for _, fault in INCIDENTS]
            raise RuntimeError(f"planned incidents {planned}, the daemon opened {self.opened}")
        return GeneratedJob(
            plan=self.plan,
            partition=self.daemon.partition,
            records=self.daemon.records,
            decisions=self.daemon.decisions,
            incidents=self.opened,
            steps=self.highest,
        )

    # -- the daemon's ticks ----------------------------------------------------------------

    def next_tick_ms(self) -> int | None:
        state = self.daemon.state
        if state.phase in TERMINAL_PHASES:
            return None
        due = next_deadline(state, self.daemon.machine)
        if due is None and not self.queue:
            return None
        # The daemon's pulse keeps a quiet job's inputs dense (service/_pulse.py): without it a
        # wait for a deadline would look like a bus outage, which stops the job's clock.
        pulse = self.last_sent_ns + round(self.plan.pulse_s * 1e9)
        at_ns = pulse if due is None else min(due, pulse)
        at_ns = max(at_ns, self.last_tick_ns + round(self.plan.tick_interval_s * 1e9))
        at_ns += round(self.plan.poll_s * 1e9)
        return max(self.now_ms, -(-at_ns // _NS_PER_MS))

    def write_tick(self, at_ms: int) -> None:
        self.now_ms = at_ms
        self.last_tick_ns = at_ms * _NS_PER_MS
        tick = ClockTick(
            job_id=self.plan.job_id,
            generation=self.daemon.state.generation,
            ts=at_ms * _NS_PER_MS,
            seq=next(self.tick_seq),
            daemon_id=self.plan.daemon_id,
        )
        self.send(tick, at_ms)

    # -- the job ---------------------------------------------------------------------------

    def start(self) -> None:
        for rank in range(self.plan.world_size):
            self.at(T0_MS + self.rng.randrange(0, 3000), self.starter(rank, 0, 0))
        self.at(T0_MS + 30_000, lambda at: self.train(1, 0, at))

    def starter(self, rank: int, generation: int, step: int) -> Callable[[int], None]:
        """A rank's process starting in ``generation``: ``started``, then ``init`` heartbeats
        every second until its generation trains."""

        def started(at_ms: int) -> None:
            if generation == self.generation:
                head = self.head(rank, at_ms)
                world_size = self.plan.world_size
                self.send(Lifecycle(**head, kind="started", world_size=world_size), at_ms)
                self.at(at_ms + 1000, self.initialising(rank, generation, step))

        return started

    def initialising(self, rank: int, generation: int, step: int) -> Callable[[int], None]:
        def beat(at_ms: int) -> None:
            if generation == self.generation and not self.training:
                self.heartbeat(rank, step, at_ms, phase="init")
                self.at(at_ms + 1000, beat)

        return beat

    def heartbeat(
        self,
        rank: int,
        step: int,
        at_ms: int,
        *,
        phase: Literal["init", "train"] = "train",
        step_time_s: float | None = None,
        loss: float | None = None,
        checksum: str | None = None,
        generation: int | None = None,
    ) -> None:
        beat = Heartbeat(
            **self.head(rank, at_ms, generation),
            world_size=self.plan.world_size,
            step=step,
            phase=phase,
            step_time_s=step_time_s,
            loss=loss,
            samples=step * self.plan.samples_per_rank,
            param_checksum=checksum,
        )
        self.send(beat, at_ms)

    def cursor(self, step: int) -> DataCursor:
        consumed = step * self.plan.world_size * self.plan.samples_per_rank
        epoch, offset = divmod(consumed, self.plan.dataset_samples)
        return DataCursor(
            data_version=self.data_version,
            seed=1234,
            epoch=epoch,
            offset=offset,
            world_size=self.plan.world_size,
        )

    def train(self, step: int, generation: int, at_ms: int) -> None:
        """Step ``step`` of ``generation`` ends now on every rank: each reports it, and the
        next step, the end of the job or the next incident is scheduled."""
        if generation != self.generation:
            return
        plan, rng = self.plan, self.rng
        self.training = True
        self.step = step
        self.highest = max(self.highest, step)
        step_s = plan.step_s * math.exp(0.05 * max(-3.0, min(3.0, rng.gauss(0.0, 1.0))))
        trend = 2.0 + 4.0 * math.exp(-step / 4000)
        checksum = None
        if step % plan.checksum_every == 0:
            checksum = hashlib.sha256(f"{generation}/{step}".encode()).hexdigest()[:16]
        written = self.daemon.appended
        finishing = written + 2 * plan.world_size >= plan.events
        for rank in range(plan.world_size):
            delay = rng.randrange(2, 40)
            seconds = round(step_s + rng.uniform(-0.004, 0.004), 4)
            loss = round(trend * (1 + 0.01 * rng.gauss(0.0, 1.0)), 6)

            def beat(
                at: int, rank: int = rank, seconds: float = seconds, loss: float = loss
            ) -> None:
                if generation == self.generation:
                    self.heartbeat(
                        rank, step, at, step_time_s=seconds, loss=loss, checksum=checksum
                    )

            self.at(at_ms + delay, beat)
            if step % plan.cursor_every == 0:
                self.at(at_ms + delay + 1, self.cursor_event(rank, step, generation))
            if step % plan.checkpoint_every == 0:
                self.at(at_ms + rng.randrange(200, 800), self.shard(rank, step, generation))
            if finishing:
                self.at(at_ms + 900 + delay, self.finished(rank, step, generation))
        if finishing:
            return
        if self.incidents and written >= self.incidents[0][0]:
            _, fault = self.incidents.pop(0)
            self.at(at_ms + 300, lambda at: self.fault(fault, at))
            return
        self.at(at_ms + round(step_s * 1000), lambda at: self.train(step + 1, generation, at))

    def cursor_event(self, rank: int, step: int, generation: int) -> Callable[[int], None]:
        def send(at_ms: int) -> None:
            if generation == self.generation:
                event = DataCursorEvent(
                    **self.head(rank, at_ms), step=step, cursor=self.cursor(step)
                )
                self.send(event, at_ms)

        return send

    def shard(self, rank: int, step: int, generation: int) -> Callable[[int], None]:
        def send(at_ms: int) -> None:
            if generation != self.generation or rank in self.silent:
                return
            uri = f"s3://ckpt/{self.plan.job_id}/g{generation}/step-{step:07d}/rank-{rank:03d}.pt"
            shard = Checkpoint(
                **self.head(rank, at_ms),
                world_size=self.plan.world_size,
                step=step,
                shard_uri=uri,
                size_bytes=187_000_000 + 4096 * rank,
                digest="sha256:" + hashlib.sha256(uri.encode()).hexdigest(),
                cursor=self.cursor(step),
                metadata=self.meta,
            )
            self.send(shard, at_ms)

        return send

    def finished(self, rank: int, step: int, generation: int) -> Callable[[int], None]:
        def send(at_ms: int) -> None:
            if generation == self.generation:
                self.send(Lifecycle(**self.head(rank, at_ms), kind="finished", step=step), at_ms)

        return send

    # -- incidents -------------------------------------------------------------------------

    def fault(self, fault: Fault, at_ms: int) -> None:
        plan, generation = self.plan, self.generation
        self.training = False
        if fault == "kill":
            victim = self.rng.randrange(plan.world_size)
            self.silent = {victim}
            host = self.host(victim)
            pid = 9000 + self.hosts.index(host)  # the node's supervisor
            exited = Lifecycle(
                job_id=plan.job_id,
                generation=generation,
                ts=self.sent_ns(at_ms + 150),
                seq=self.next_seq(None, host, pid),
                rank=None,
                host=host,
                pid=pid,
                kind="exited",
                ranks=(victim,),
                signal=9,
            )
            self.at(at_ms + 150, lambda at: self.send(exited, at))
        elif fault == "host_lost":
            first = self.rng.randrange(len(self.hosts)) * plan.ranks_per_host
            self.silent = set(range(first, min(plan.world_size, first + plan.ranks_per_host)))
        else:
            self.silent = set(range(plan.world_size))
        for rank in range(plan.world_size):
            if rank not in self.silent:
                self.at(at_ms + self.rng.randrange(500, 1000), self.hanging(rank, generation))

    def hanging(self, rank: int, generation: int) -> Callable[[int], None]:
        """A rank blocked in a collective: its agent heartbeats the last step every second
        until its process is stopped."""
        step = self.step

        def beat(at_ms: int) -> None:
            stopped = self.stopped_at.get(generation)
            if stopped is None or at_ms <= stopped:
                self.heartbeat(rank, step, at_ms, generation=generation)
                self.at(at_ms + 1000, beat)

        return beat

    def command(self, command: Restore | Resume | Abort, at_ms: int) -> None:
        if isinstance(command, Abort):
            raise RuntimeError(f"the daemon aborted the generated job: {command.reason}")
        if isinstance(command, Resume):
            first = command.step + 1
            self.at(at_ms + 3000, lambda at: self.train(first, command.generation, at))
            return
        # Supervisors stop the old processes 0.4 s after the command; vanished nodes are
        # replaced by spare ones.
        self.stopped_at[self.generation] = at_ms + 400
        if len(self.silent) > 1:
            lost = {self.host(r) for r in self.silent}
            self.hosts = [f"gpu-{next(self.spare):03d}" if h in lost else h for h in self.hosts]
        self.generation = command.generation
        self.silent = set()
        self.training = False
        step = 0 if command.target is None else command.target.step
        for host in range(len(self.hosts)):
            boot = at_ms + self.rng.randrange(15_000, 25_000)
            first = host * self.plan.ranks_per_host
            for rank in range(first, min(self.plan.world_size, first + self.plan.ranks_per_host)):
                started = boot + self.rng.randrange(0, 500)
                self.at(started, self.starter(rank, command.generation, step))
                self.at(started + self.rng.randrange(5_000, 8_000), self.acknowledge(rank, command))

    def acknowledge(self, rank: int, restore: Restore) -> Callable[[int], None]:
        def send(at_ms: int) -> None:
            if restore.generation == self.generation:
                target = restore.target
                ack = Lifecycle(
                    **self.head(rank, at_ms),
                    kind="restored",
                    step=0 if target is None else target.step,
                    cursor=None if target is None else target.cursor,
                    snapshot_id=None if target is None else target.snapshot_id,
                )
                self.send(ack, at_ms)

        return send


def generate(plan: Plan) -> GeneratedJob:
    """Generate ``plan``'s job record (module docstring).

    Raises:
        RuntimeError: the daemon did not decide the story as planned (the job did not finish,
            an incident is missing or extra, it aborted the job, or a record was refused):
            a generator bug or a state-machine change the plan no longer fits.
    """
    return _Simulation(plan).run()


@dataclass
class RunningJob:
    """A job folded up to its ``commits``-th commit (:func:`running_state`).

    Attributes:
        state: the daemon's state of the job.
        folded: records of ``events`` folded into it (ticks included).
        events: those records, offsets from 0, when kept (else empty).
    """

    state: JobState
    folded: int
    events: list[Record]


def running_state(
    plan: Plan, commits: int, *, steps: int = 0, keep_events: bool = False
) -> RunningJob:
    """``plan``'s job folded as :func:`generate` folds it, up to the moment ``commits``
    checkpoints are committed, no shard is pending and ``steps`` steps are trained (before any
    incident when ``plan.events`` is large). Nothing is written for the daemon's decisions (a
    manifest of thousands of ranks exceeds a message, and only the state is wanted); the
    records of ``events`` are kept with ``keep_events``.

    Raises:
        RuntimeError: the job ended first, or the daemon refused a record.
    """
    simulation = _Simulation(plan, keep_events=keep_events, act=False)
    simulation.start()
    daemon = simulation.daemon
    while len(daemon.state.committed) < commits or daemon.state.pending or simulation.step < steps:
        if not simulation.advance():
            raise RuntimeError(f"the job ended with {len(daemon.state.committed)} commits")
    return RunningJob(daemon.state, daemon.appended, daemon.records["events"])
