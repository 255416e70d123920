"""Realistic training traces for the detector tests: a synchronous data-parallel job simulated
the way its agents report it, with faults as data.

:func:`simulate` turns a :class:`Job` (pace, phases, faults) into the bus inputs the daemon
would fold: every rank heartbeats every ``heartbeat_s`` with jitter (reporting its last
completed step, how long ago it completed, that step's time as the agent measures it, loss,
phase; step 0 in phase ``init`` until its ``ready()``), sends an immediate heartbeat when it
calls ``ready()``, declares a phase or computes a parameter checksum, and announces checkpoint
shards; records reach the bus after a delivery delay, in order per sender. With a bus outage
(:class:`Away`) they reach it as the agents' links deliver them: each rank's outbox is the
agent's own (:class:`~trainguard.agent._outbox.Outbox`, its heartbeat ring included), sent one
event per round trip when the bus returns. :func:`drive` folds them like the daemon's shell,
ticking at :func:`next_deadline`.

Times are nanoseconds (``S`` is a second); ``T0`` is the job's start.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Literal, TypedDict

from hypothesis import strategies as st

from tests.support.machine_scenarios import JOB, T0, S, config, host_of
from trainguard.agent._config import AgentConfig
from trainguard.agent._outbox import Kind, Outbox, Queued
from trainguard.daemon.core._decisions import Decision, IncidentOpened
from trainguard.daemon.core._inputs import Input, Observed, Tick
from trainguard.daemon.core._machine import decide, next_deadline, unacted_command
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import TERMINAL_PHASES, JobState, new_job
from trainguard.schemas import (
    Checkpoint,
    DataCursor,
    Heartbeat,
    Lifecycle,
    Phase,
)

PaceKind = Literal["constant", "uniform", "lognormal", "bimodal", "drift"]


@dataclass(frozen=True)
class Pace:
    """How long steps take (seconds): ``base_s`` shaped by ``kind``.

    ``uniform``: uniform in ``base * [1 - spread, 1 + spread]``; ``lognormal``: ``base *
    exp(spread * Z)`` with ``Z`` standard normal clipped to +-3; ``bimodal``: ``base``, or
    ``base * ratio`` with probability ``p``; ``drift``: ``base`` growing linearly to ``base *
    (1 + spread)`` over the job, with 5 % uniform noise.
    """

    kind: PaceKind = "constant"
    base_s: float = 1.0
    spread: float = 0.0
    ratio: float = 1.0
    p: float = 0.0

    def sample(self, rng: random.Random, k: int, steps: int) -> float:
        if self.kind == "uniform":
            return self.base_s * rng.uniform(1 - self.spread, 1 + self.spread)
        if self.kind == "lognormal":
            z = min(3.0, max(-3.0, rng.gauss(0.0, 1.0)))
            return self.base_s * math.exp(self.spread * z)
        if self.kind == "bimodal":
            return self.base_s * (self.ratio if rng.random() < self.p else 1.0)
        if self.kind == "drift":
            return self.base_s * (1 + self.spread * k / max(1, steps)) * rng.uniform(0.95, 1.05)
        return self.base_s

    @property
    def longest_s(self) -> float:
        """An upper bound of every step time this pace produces."""
        if self.kind == "uniform":
            return self.base_s * (1 + self.spread)
        if self.kind == "lognormal":
            return self.base_s * math.exp(3 * self.spread)
        if self.kind == "bimodal":
            return self.base_s * max(1.0, self.ratio)
        if self.kind == "drift":
            return self.base_s * (1 + max(0.0, self.spread)) * 1.05
        return self.base_s


@dataclass(frozen=True)
class PhaseSpec:
    """After step ``after_step`` completes, ``ranks`` (all when ``None``) declare ``phase`` for
    ``duration_s`` while the others wait for them; a ``checkpoint`` phase ends with shards.
    ``silent``: the ranks in the phase send no heartbeat after declaring it (a save holding
    the GIL)."""

    after_step: int
    phase: Phase
    duration_s: float
    ranks: tuple[int, ...] | None = None
    silent: bool = False


@dataclass(frozen=True)
class Faults:
    """Faults as data (``None``: absent).

    Attributes:
        hang_after: every rank completes this step and no further one (a collective that never
            returns); the agents keep heartbeating.
        stuck_in: ``(rank, step, phase)``: after ``step`` the rank declares ``phase`` and never
            leaves it (the others wait for it).
        nan: ``(rank, step)``: the rank's loss is NaN at ``step``, every rank's after it (the
            all-reduced gradient carries the NaN into every replica).
        spike: ``(step, factor, steps)``: every rank's loss is multiplied by ``factor`` for
            ``steps`` steps from ``step`` on.
        blip: ``(step, factor)``: every rank's loss is multiplied by ``factor`` at ``step``,
            and the excess decays by 60 % per step after it (a spike that heals itself).
        odd_checksum: ``(rank, step)``: the rank's parameter checksums differ from ``step`` on.
        odd_version: ``(rank, step)``: the rank's checkpoint cursors name another data version
            from ``step`` on.
        restart_from_zero: ``(rank, step)``: after ``step`` the rank silently counts its steps
            from 0 again (a process restarted behind the daemon's back).
    """

    hang_after: int | None = None
    stuck_in: tuple[int, int, Phase] | None = None
    nan: tuple[int, int] | None = None
    spike: tuple[int, float, int] | None = None
    blip: tuple[int, float] | None = None
    odd_checksum: tuple[int, int] | None = None
    odd_version: tuple[int, int] | None = None
    restart_from_zero: tuple[int, int] | None = None


def _agent_default(name: str) -> int:
    default = next(f.default for f in fields(AgentConfig) if f.name == name)
    assert isinstance(default, int)
    return default


RING = _agent_default("heartbeat_queue")
"""The agent's heartbeat ring by default (``AgentConfig.heartbeat_queue``): the newest
heartbeats kept while the bus is away."""


@dataclass(frozen=True)
class Away:
    """The bus away from ``start_s`` to ``start_s + length_s`` (seconds after ``T0``), and slow
    for ``catch_up_s`` after its return: every send's round trip takes ``round_trip_s`` then
    (a broker catching up under load), else up to the job's ``delay_s``.

    The ranks' links deliver as the agent's does (:mod:`trainguard.agent._link`): events
    leave in ``seq`` order, checkpoint and lifecycle events one per round trip, a run of
    heartbeats together in one; while the bus is away only the newest ``ring`` heartbeats
    wait (the others are dropped), every other event is kept; a send under way when the bus
    left is appended when it returns.
    """

    start_s: float
    length_s: float
    round_trip_s: float = 0.0
    catch_up_s: float = 0.0
    ring: int = RING

    @property
    def window(self) -> tuple[int, int]:
        """The outage's ``(start, end)``, bus times (ns), for :func:`drive`'s ``outages``."""
        start = T0 + _ns(self.start_s)
        return start, start + _ns(self.length_s)


@dataclass(frozen=True)
class Job:
    """A simulated job. Durations in seconds.

    Attributes:
        world_size: ranks.
        steps: steps trained (1..steps).
        pace: step times.
        heartbeat_s: agent heartbeat interval.
        jitter_s: each heartbeat is sent up to this late (< heartbeat_s / 2).
        delay_s: bus delivery delay, at most this much (records of one sender stay in order).
        init_s: time from start to the first step's beginning (phase ``init``); the ranks call
            ``ready()`` then.
        start_step: the step the job starts from (a snapshot of another job, ``--init-from``):
            step ``k`` of the simulation is reported as ``start_step + k``; heartbeats before
            ``ready()`` report step 0.
        first_step_s: duration of step 1 (compilation).
        checkpoint_every: steps between checkpoints (0: none); a checkpoint is an async write
            announced ``checkpoint_write_s`` after the step, unless a ``checkpoint`` phase
            follows the step.
        checksum_every: steps between parameter checksums (0: none).
        loss_noise: relative standard deviation of each rank's loss around the trend.
        phases: declared phases.
        faults: injected faults.
        tail_s: how long the simulation runs after the last step; a job that completed
            every step reports ``finished`` 1 s after it, a hung one heartbeats on.
        seed: randomness of step times, jitter, delays and noise.
        away: a bus outage, delivered as the agents' links deliver (``None``: none).
    """

    world_size: int = 4
    steps: int = 60
    pace: Pace = field(default_factory=Pace)
    heartbeat_s: float = 1.0
    jitter_s: float = 0.2
    delay_s: float = 0.05
    init_s: float = 5.0
    start_step: int = 0
    first_step_s: float = 3.0
    checkpoint_every: int = 10
    checkpoint_write_s: float = 0.3
    checksum_every: int = 0
    loss_noise: float = 0.02
    phases: tuple[PhaseSpec, ...] = ()
    faults: Faults = field(default_factory=Faults)
    tail_s: float = 30.0
    seed: int = 0
    away: Away | None = None


@dataclass
class Trace:
    """A simulated job's inputs (in bus order) and its ground truth.

    Attributes:
        inputs: what the daemon folds, by append time.
        ends: ``ends[k]``: daemon-clock time (ns) at which step k completed on every rank
            (``ends[0]``: training began); steps never completed are absent.
        step_times: ``step_times[k]``: duration of step k as the agents measure it (s).
        phase_starts: ``(rank, phase, start_ns)`` of every declared phase.
        end_ns: when the simulation stops.
    """

    inputs: list[Input]
    ends: dict[int, int]
    step_times: dict[int, float]
    phase_starts: list[tuple[int, Phase, int]]
    end_ns: int


def _loss(k: int) -> float:
    """The healthy loss trend at step ``k``: from 6 down to 2."""
    return 2.0 + 4.0 * math.exp(-k / 200)


def _ns(seconds: float) -> int:
    return round(seconds * S)


def simulate(job: Job) -> Trace:
    """The inputs of ``job``'s ranks, as the daemon consumes them."""
    return _Simulation(job).run()


_Event = Heartbeat | Checkpoint | Lifecycle


class _HeadFields(TypedDict):
    job_id: str
    generation: int
    seq: int
    rank: int
    host: str
    pid: int


@dataclass(frozen=True)
class _Head:
    """The sender fields of one rank's events (``seq`` is numbered at delivery)."""

    rank: int
    host: str
    pid: int

    def fields(self) -> _HeadFields:
        return {
            "job_id": JOB,
            "generation": 0,
            "seq": 0,
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
        }


class _Simulation:
    """One :func:`simulate` run: the step timeline first, then each rank's events."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.rng = random.Random(job.seed)
        self.ends: dict[int, int] = {}
        self.step_times: dict[int, float] = {}
        # Declared phases: (start, end, after step, phase, ranks, silent).
        self.windows: list[tuple[int, int, int, Phase, tuple[int, ...], bool]] = []
        self.end_ns = 0
        self.finished_ns = 2**62
        self.events: list[tuple[int, int, _Event]] = []  # (send time, rank, event)

    def run(self) -> Trace:
        self._timeline()
        self.completed = sorted(self.ends)
        self.times = [self.ends[k] for k in self.completed]
        for rank in range(self.job.world_size):
            self._rank(rank)
        inputs = self._deliver()
        starts = [(r, phase, start) for start, _, _, phase, ranks, _ in self.windows for r in ranks]
        return Trace(inputs, self.ends, self.step_times, starts, self.end_ns)

    def _timeline(self) -> None:
        """When each step completes (all ranks in lockstep; a phase delays the next step)."""
        job, faults = self.job, self.job.faults
        phases = {p.after_step: p for p in job.phases}
        t = T0 + _ns(job.init_s)
        self.ends[0] = t
        last = job.steps if faults.hang_after is None else min(job.steps, faults.hang_after)
        previous = t
        for k in range(1, last + 1):
            t += _ns(job.first_step_s if k == 1 else job.pace.sample(self.rng, k, job.steps))
            self.ends[k] = t
            # What the agent measures: the time between two step() calls, phases included.
            self.step_times[k] = (t - previous) / S
            previous = t
            stuck = faults.stuck_in
            if stuck is not None and stuck[1] == k:
                self.windows.append((t, 2**62, k, stuck[2], (stuck[0],), False))
                break
            spec = phases.get(k)
            if spec is not None:
                ranks = tuple(range(job.world_size)) if spec.ranks is None else spec.ranks
                self.windows.append(
                    (t, t + _ns(spec.duration_s), k, spec.phase, ranks, spec.silent)
                )
                t += _ns(spec.duration_s)
        self.end_ns = t + _ns(job.tail_s)
        complete = faults.hang_after is None and faults.stuck_in is None
        # A job that trained every step finishes (every rank reports ``finished``).
        self.finished_ns = t + _ns(1.0) if complete and last == job.steps else 2**62

    def _completed_at(self, at: int) -> int:
        """The last step completed by ``at`` (0 before the first)."""
        index = bisect.bisect_right(self.times, at) - 1
        return self.completed[index] if index >= 0 else 0

    def _phase_at(self, rank: int, at: int) -> Phase:
        for start, end, _, phase, ranks, _ in self.windows:
            if rank in ranks and start <= at < end:
                return phase
        return "init" if at < self.ends.get(1, 2**62) else "train"

    def _silent_at(self, rank: int, at: int) -> bool:
        """Whether ``rank`` is in a silent declared phase at ``at``."""
        return any(
            silent and rank in ranks and start < at < end
            for start, end, _, _, ranks, silent in self.windows
        )

    def _loss(self, rank: int, k: int, noise: random.Random) -> float | None:
        faults = self.job.faults
        if k == 0:
            return None
        nan = faults.nan
        # The NaN gradient of that rank's step reaches every rank's parameters (all-reduce).
        if nan is not None and (k > nan[1] or (k == nan[1] and rank == nan[0])):
            return math.nan
        value = _loss(k) * (1 + self.job.loss_noise * noise.gauss(0.0, 1.0))
        spike = faults.spike
        if spike is not None and spike[0] <= k < spike[0] + spike[2]:
            value *= spike[1]
        blip = faults.blip
        if blip is not None and k >= blip[0]:
            value *= 1 + (blip[1] - 1) * 0.4 ** (k - blip[0])
        return value

    def _rank(self, rank: int) -> None:
        job, faults, rng = self.job, self.job.faults, self.rng
        noise = random.Random(job.seed * 1000 + rank)
        host, pid = host_of(rank), 1000 + rank
        head = _Head(rank=rank, host=host, pid=pid)

        def beat(at: int, *, checksum: str | None = None, phase: Phase | None = None) -> None:
            k = self._completed_at(at)
            reported = job.start_step + k if at >= self.ends[0] else 0  # 0 before ready()
            restart = faults.restart_from_zero
            if restart is not None and restart[0] == rank and k > restart[1]:
                reported = k - restart[1]
            hb = Heartbeat(
                job_id=JOB,
                generation=0,
                seq=0,
                rank=rank,
                host=host,
                pid=pid,
                ts=at,
                world_size=job.world_size,
                step=reported,
                phase=phase or self._phase_at(rank, at),
                step_time_s=self.step_times.get(k) if k >= 2 else None,
                loss=self._loss(rank, k, noise),
                samples=reported * 8,
                param_checksum=checksum,
                step_age_s=(at - self.ends[k]) / S if k >= 1 else None,
            )
            self.events.append((at, rank, hb))

        started = Lifecycle(**head.fields(), ts=T0, kind="started", world_size=job.world_size)
        self.events.append((T0 + rank * 1_000_000, rank, started))
        offset = rng.uniform(0, job.heartbeat_s)
        done = self.finished_ns
        for i in itertools.count():
            at = T0 + _ns(offset + i * job.heartbeat_s + rng.uniform(0, job.jitter_s))
            if at >= min(self.end_ns, done):
                break
            if not self._silent_at(rank, at):
                beat(at)
        if done < self.end_ns:
            finished = Lifecycle(**head.fields(), ts=done, kind="finished", step=job.steps)
            self.events.append((done + rank, rank, finished))
        skew = _ns(rng.uniform(0, 0.005))
        beat(self.ends[0] + skew)  # ready() heartbeats at once
        for start, _, _, phase, ranks, _ in self.windows:
            if rank in ranks:
                beat(start + skew + 1, phase=phase)  # agent.phase() heartbeats at once
        for k in self.completed[1:]:
            if job.checksum_every and k % job.checksum_every == 0:
                odd = faults.odd_checksum
                salt = "odd" if odd is not None and odd[0] == rank and k >= odd[1] else ""
                beat(
                    self.ends[k] + skew,
                    checksum=hashlib.sha256(f"{k}{salt}".encode()).hexdigest()[:16],
                )
            if job.checkpoint_every and k % job.checkpoint_every == 0:
                self._shard(rank, k, head, skew)

    def _shard(self, rank: int, k: int, head: _Head, skew: int) -> None:
        """Rank ``rank``'s shard of step ``k``: at the end of a ``checkpoint`` phase after
        ``k``, else an async write."""
        job = self.job
        window = next((w for w in self.windows if w[2] == k and w[3] == "checkpoint"), None)
        step = job.start_step + k
        if window is not None and rank not in window[4]:
            return
        at = window[1] if window is not None else self.ends[k] + _ns(job.checkpoint_write_s)
        if at >= self.end_ns:
            return
        odd = job.faults.odd_version
        version = "v2" if odd is not None and odd[0] == rank and k >= odd[1] else "v1"
        uri = f"file:///ckpt/{JOB}/g0/s{step}/rank{rank}.pt"
        shard = Checkpoint(
            **head.fields(),
            ts=at,
            world_size=job.world_size,
            step=step,
            shard_uri=uri,
            size_bytes=1024,
            digest="sha256:" + hashlib.sha256(uri.encode()).hexdigest(),
            cursor=DataCursor(
                data_version=version,
                seed=7,
                epoch=0,
                offset=step * 8 * job.world_size,
                world_size=job.world_size,
            ),
        )
        self.events.append((at + skew, rank, shard))

    def _deliver(self) -> list[Input]:
        """Number each sender's events in send order and deliver them in that order."""
        self.events.sort(key=lambda e: (e[0], e[1]))
        if self.job.away is not None:
            return self._deliver_through(self.job.away)
        numbered: dict[int, int] = {}
        delivered: dict[int, int] = {}
        arrivals: list[tuple[int, int, Input]] = []
        for order, (at, rank, event) in enumerate(self.events):
            seq = numbered[rank] = numbered.get(rank, -1) + 1
            arrive = max(delivered.get(rank, 0), at + _ns(self.rng.uniform(0, self.job.delay_s)))
            delivered[rank] = arrive
            arrivals.append((arrive, order, Observed(arrive, None, replace(event, seq=seq))))
        arrivals.sort(key=lambda e: (e[0], e[1]))
        return [item for _, _, item in arrivals]

    def _deliver_through(self, away: Away) -> list[Input]:
        """Each rank's events, sent in order by its link across the outage ``away``."""
        start, end = away.window
        slow_until = end + _ns(away.catch_up_s)
        arrivals: list[tuple[int, int, Input]] = []
        for rank in range(self.job.world_size):
            own = [(at, e) for at, r, e in self.events if r == rank]
            sent = [replace(e, seq=n) for n, (_, e) in enumerate(own)]
            submitted = [at for at, _ in own]
            outbox = Outbox(100_000, away.ring)
            t, i = 0, 0
            while i < len(sent) or len(outbox):
                if not len(outbox):
                    t = max(t, submitted[i])
                while i < len(sent) and submitted[i] <= t:
                    kind: Kind = "heartbeat" if isinstance(sent[i], Heartbeat) else "event"
                    outbox.add(Queued(i, b"", kind))
                    i += 1
                if start <= t < end:
                    t = end  # the link waits for the bus; the ring drops old heartbeats
                    continue
                batch = outbox.take_heartbeats()
                if not batch:
                    outbox.take()
                    batch = [outbox.done()]
                trip = (
                    _ns(away.round_trip_s)
                    if end <= t < slow_until
                    else _ns(self.rng.uniform(0, self.job.delay_s))
                )
                t += trip
                if start <= t < end:
                    t = end  # under way when the bus left: appended when it returns
                for item in batch:
                    arrivals.append((t, len(arrivals), Observed(t, None, sent[item.seq])))
        arrivals.sort(key=lambda e: (e[0], e[1]))
        return [item for _, _, item in arrivals]


Folded = list[tuple[Input, tuple[Decision, ...]]]
"""Each input folded (ticks included), with its decisions."""


PULSE_NS = S
"""The daemon's pulse (``DaemonConfig.pulse_s``, 1 s): it ticks a job that has had no input
for this long."""


def drive(
    inputs: Iterable[Input],
    state: JobState | None = None,
    cfg: MachineConfig | None = None,
    *,
    until: int | None = None,
    first_incident: bool = False,
    pulse_ns: int | None = PULSE_NS,
    outages: Sequence[tuple[int, int]] = (),
) -> tuple[JobState, Folded]:
    """Fold ``inputs`` like the daemon's shell: before each input, and after the last one up
    to ``until``, tick at every :func:`next_deadline` that has passed, and (its pulse) once the
    job, not finished, failed or stopped, has had no input for ``pulse_ns``; right after an
    input that issued a command, tick to say it is on the bus (every tick names the latest
    command).

    Args:
        first_incident: stop after the first input that opened an incident.
        pulse_ns: the daemon's pulse, ns; ``None``: no pulse (only deadline ticks).
        outages: ``(start, end)`` bus times (ns) when the bus was away: a tick due then
            reaches the bus at ``end`` (the inputs are expected to say the same, see
            :func:`outage`).

    Returns:
        The last state and every folded input (ticks included) with its decisions.

    Raises:
        AssertionError: a tick at the deadline left the deadline where it was (the shell
            would tick forever).
    """
    cfg = cfg or config()
    current = new_job(JOB) if state is None else state
    folded: Folded = []

    def fold_one(item: Input) -> bool:
        nonlocal current
        current, decisions = decide(current, item, cfg)
        folded.append((item, decisions))
        found = first_incident and any(isinstance(d, IncidentOpened) for d in decisions)
        if not found and unacted_command(current) is not None:
            return fold_one(Tick(current.clock_ns, current.command_seq))
        return found

    def next_tick() -> int | None:
        due = next_deadline(current, cfg)
        live = current.phase not in TERMINAL_PHASES and current.generation_started_ns is not None
        if pulse_ns is not None and live:
            quiet = current.clock_ns + pulse_ns
            due = quiet if due is None else min(due, quiet)
        for start, end in outages:
            if due is not None and start <= due < end:
                due = end
        return due

    def tick_until(limit: int) -> bool:
        while True:
            due = next_tick()
            if due is None or due > limit:
                return False
            if fold_one(Tick(due, current.command_seq)):
                return True
            after = next_deadline(current, cfg)
            assert after is None or after > due, "a tick at the deadline must move it"

    for item in inputs:
        if tick_until(item.at_ns) or fold_one(item):
            return current, folded
    if until is not None:
        tick_until(until)
    return current, folded


def outage(inputs: Iterable[Input], start: int, end: int) -> list[Input]:
    """``inputs`` (in bus order) with the bus away from ``start`` to ``end`` (ns): every input
    appended in between is appended at ``end`` instead, in the same order (each sender's
    records queued, then delivered in a burst), before those appended at ``end`` or later."""
    moved = [item._replace(at_ns=end) if start <= item.at_ns < end else item for item in inputs]
    return sorted(moved, key=lambda item: item.at_ns)  # stable: the burst keeps its order


def opened(folded: Folded) -> list[tuple[int, IncidentOpened]]:
    """The incidents opened, with the daemon time of the input that opened each."""
    return [(i.at_ns, d) for i, ds in folded for d in ds if isinstance(d, IncidentOpened)]


def every(folded: Folded) -> list[Decision]:
    """All decisions, in order."""
    return [d for _, ds in folded for d in ds]


def progress_bound_ns(job: Job, cfg: MachineConfig) -> int:
    """Worst-case time from a hang (the last step completing) to its incident, once the
    adaptive timeout applies: the heartbeat that shows the last step (interval, jitter, bus
    delay) plus the timeout, at most ``progress_factor`` times the longest step, plus the
    heartbeat interval the daemon allows for a step's end to be reported."""
    longest = max(job.pace.longest_s, job.pace.base_s)
    timeout = min(max(cfg.progress_factor * longest, cfg.progress_floor_s), cfg.progress_ceiling_s)
    return (
        _ns(job.heartbeat_s + job.jitter_s + job.delay_s + timeout + cfg.heartbeat_interval_s) + 1
    )


# -- strategies -----------------------------------------------------------------------------


@st.composite
def paces(draw: st.DrawFn, low_s: float = 0.05, high_s: float = 120.0) -> Pace:
    """Healthy step-time models: every step within ``progress_factor`` (3) times the usual
    high quantile, the detector's documented tolerance."""
    base = math.exp(draw(st.floats(math.log(low_s), math.log(high_s))))
    kind: PaceKind = draw(st.sampled_from(["constant", "uniform", "lognormal", "bimodal", "drift"]))
    return Pace(
        kind=kind,
        base_s=base,
        spread=draw(st.floats(0.0, 0.5 if kind != "drift" else 1.0)),
        ratio=draw(st.floats(1.0, 2.5)),
        p=draw(st.floats(0.0, 0.3)),
    )


def steps_for(pace: Pace, budget_s: float, least: int, most: int) -> int:
    """Steps that fit ``budget_s`` of simulated time at ``pace`` (within ``least..most``)."""
    return max(least, min(most, int(budget_s / max(pace.base_s, 1e-3))))


@st.composite
def healthy_jobs(draw: st.DrawFn) -> Job:
    """Healthy jobs over a wide family of paces (0.05 to 120 s per step), heartbeats every
    0.5 to 1 s with jitter, phases within their limits, checkpoints and checksums."""
    pace = draw(paces())
    world_size = draw(st.integers(1, 4))
    budget = 2400.0 / world_size
    steps = steps_for(pace, budget, least=20, most=120)
    heartbeat = draw(st.floats(0.5, 1.0))
    phase_steps = draw(st.lists(st.integers(6, steps), max_size=3, unique=True))
    phases = tuple(
        PhaseSpec(
            after_step=k,
            phase=draw(st.sampled_from(["checkpoint", "eval", "data"])),
            duration_s=draw(st.floats(1.0, 60.0)),
            ranks=draw(st.none() | st.just((0,))),
            silent=draw(st.booleans()),
        )
        for k in sorted(phase_steps)
    )
    return Job(
        world_size=world_size,
        steps=steps,
        pace=pace,
        heartbeat_s=heartbeat,
        jitter_s=draw(st.floats(0.0, heartbeat / 2 - 0.01)),
        delay_s=draw(st.floats(0.0, 0.2)),
        init_s=draw(st.floats(1.0, 60.0)),
        start_step=draw(st.sampled_from([0, 0, 147, 5000])),
        # Start-up (init phase) stays within the init limit: 60 s + 900 s < 1200 s.
        first_step_s=min(900.0, pace.base_s * draw(st.floats(1.0, 20.0))),
        checkpoint_every=draw(st.sampled_from([0, 5, 10])),
        checksum_every=draw(st.sampled_from([0, 5])),
        loss_noise=draw(st.floats(0.0, 0.05)),
        phases=phases,
        tail_s=2.0,
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@st.composite
def fast_jobs(draw: st.DrawFn) -> Job:
    """Healthy jobs of 50 to 500 steps/s on 2 to 4 ranks (more steps between two heartbeats
    than ``max_step_lag``), heartbeats every 0.5 to 1 s with jitter and bus delays, some
    started from another job's snapshot."""
    pace = draw(paces(low_s=0.002, high_s=0.02))
    heartbeat = draw(st.floats(0.5, 1.0))
    return Job(
        world_size=draw(st.integers(2, 4)),
        steps=min(20_000, int(draw(st.floats(20.0, 60.0)) / pace.base_s)),
        pace=pace,
        heartbeat_s=heartbeat,
        jitter_s=draw(st.floats(0.0, heartbeat / 2 - 0.01)),
        delay_s=draw(st.floats(0.0, 0.2)),
        init_s=draw(st.floats(1.0, 10.0)),
        start_step=draw(st.sampled_from([0, 147, 5000])),
        first_step_s=pace.base_s * draw(st.floats(1.0, 50.0)),
        checkpoint_every=draw(st.sampled_from([0, 500])),
        loss_noise=draw(st.floats(0.0, 0.05)),
        tail_s=2.0,
        seed=draw(st.integers(0, 2**32 - 1)),
    )
