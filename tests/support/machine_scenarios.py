"""Scenario helpers for the state-machine tests: a simulated job whose ranks and supervisors
emit bus inputs, with faults as data (``sim.kill(rank=1, at=...)``).

Times are nanoseconds; ``T0`` is an arbitrary epoch instant and ``S`` one second.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hypothesis import strategies as st

from trainguard.daemon.core._decisions import Decision, Issue
from trainguard.daemon.core._inputs import Input, Observed, Tick
from trainguard.daemon.core._machine import decide, fold, unacted_command
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import JobState, new_job
from trainguard.schemas import (
    Checkpoint,
    CheckpointMeta,
    Command,
    DataCursor,
    DataCursorEvent,
    Heartbeat,
    JobRequest,
    Lifecycle,
    Phase,
    RequestKind,
    Restore,
    SnapshotRef,
)

S = 1_000_000_000
T0 = 1_700_000_000 * S
JOB = "job"
DAEMON = "daemon-test"
RANKS_PER_HOST = 2

D = TypeVar("D", bound=Decision)
C = TypeVar("C", bound=Command)


def config(**overrides: Any) -> MachineConfig:
    """The tests' machine configuration: the defaults unless overridden."""
    return MachineConfig(daemon_id=DAEMON, **overrides)


def host_of(rank: int) -> str:
    """Ranks 0 and 1 run on ``h0``, 2 and 3 on ``h1``, ..."""
    return f"h{rank // RANKS_PER_HOST}"


def run(
    inputs: Iterable[Input], state: JobState | None = None, cfg: MachineConfig | None = None
) -> tuple[JobState, tuple[Decision, ...]]:
    """Fold ``inputs`` into ``state`` (a new job by default) with ``cfg`` (``config()``)."""
    return fold(new_job(JOB) if state is None else state, inputs, cfg or config())


def acted(state: JobState, at: int) -> Tick:
    """The tick the daemon's shell appends at ``at`` once it published ``state``'s commands:
    timeouts that start with a command count from it."""
    return Tick(at, state.command_seq)


def pulses(state: JobState, until: int, every: int = S) -> list[Tick]:
    """The ticks the daemon writes every ``every`` ns (its ``pulse_s``) for ``state``'s job
    while it is quiet, from its clock up to before ``until``: with them, the job's silence is
    no gap in its inputs, which would be a bus outage (``MachineConfig.bus_gap_s``)."""
    return [Tick(at) for at in range(state.clock_ns + every, until, every)]


def of_type(decisions: Iterable[Decision], kind: type[D]) -> list[D]:
    """The decisions of one class, in order."""
    return [d for d in decisions if isinstance(d, kind)]


def issued(decisions: Iterable[Decision], kind: type[C]) -> list[C]:
    """The commands of one class issued by ``decisions``, in order."""
    return [d.command for d in of_type(decisions, Issue) if isinstance(d.command, kind)]


def cursor_at(step: int, world_size: int, data_version: str = "v1") -> DataCursor:
    """The data cursor after ``step`` (8 samples per rank and step, one epoch)."""
    return DataCursor(
        data_version=data_version, seed=7, epoch=0, offset=step * world_size * 8, world_size=4
    )


@dataclass
class Sim:
    """A job's workers and supervisors. Each method returns the input the daemon would observe
    and advances the sender's ``seq``; ``generation`` is the one the processes run in (set it,
    or use :meth:`recover`, after a restore). Process ids change with the generation, as after
    a restart."""

    world_size: int = 4
    job_id: str = JOB
    generation: int = 0
    _seq: dict[tuple[int | None, str, int], int] = field(default_factory=dict)

    def pid(self, rank: int) -> int:
        return 1000 * (self.generation + 1) + rank

    def _next_seq(self, rank: int | None, host: str, pid: int) -> int:
        key = (rank, host, pid)
        self._seq[key] = self._seq.get(key, -1) + 1
        return self._seq[key]

    def _head(self, rank: int, generation: int | None, at: int) -> dict[str, Any]:
        """The fields every event of ``rank`` has, sent at ``at`` (``ts``: the sender's clock
        agrees with the bus's, and the bus takes it at once)."""
        host, pid = host_of(rank), self.pid(rank)
        return {
            "job_id": self.job_id,
            "generation": self.generation if generation is None else generation,
            "ts": at,
            "seq": self._next_seq(rank, host, pid),
            "rank": rank,
            "host": host,
            "pid": pid,
        }

    def heartbeat(
        self,
        rank: int,
        step: int,
        at: int,
        *,
        phase: Phase = "train",
        generation: int | None = None,
        world_size: int | None = None,
        loss: float | None = 2.5,
        step_time_s: float | None = 1.0,
        checksum: str | None = None,
        step_age_s: float | None = None,
    ) -> Observed:
        """A heartbeat appended at ``at``, sent at ``at`` too (``ts``: the sender's clock
        agrees with the bus's, and the bus took it at once)."""
        event = Heartbeat(
            **self._head(rank, generation, at),
            world_size=world_size or self.world_size,
            step=step,
            phase=phase,
            step_time_s=step_time_s,
            loss=loss,
            samples=step * 8,
            param_checksum=checksum,
            step_age_s=step_age_s,
        )
        return Observed(at, None, event)

    def checkpoint(
        self, rank: int, step: int, at: int, *, data_version: str = "v1", offset: int | None = None
    ) -> Observed:
        cursor = cursor_at(step, self.world_size, data_version)
        if offset is not None:
            cursor = DataCursor(
                data_version=data_version, seed=7, epoch=0, offset=offset, world_size=4
            )
        uri = f"file:///ckpt/{self.job_id}/g{self.generation}/s{step}/rank{rank}.pt"
        event = Checkpoint(
            **self._head(rank, None, at),
            world_size=self.world_size,
            step=step,
            shard_uri=uri,
            size_bytes=1024,
            digest="sha256:" + hashlib.sha256(uri.encode()).hexdigest(),
            cursor=cursor,
            metadata=CheckpointMeta(
                hyperparameters={"lr": 0.1}, topology={"world_size": self.world_size}
            ),
        )
        return Observed(at, None, event)

    def cursor(
        self,
        rank: int,
        step: int,
        at: int,
        *,
        generation: int | None = None,
        data_version: str = "v1",
    ) -> Observed:
        event = DataCursorEvent(
            **self._head(rank, generation, at),
            step=step,
            cursor=cursor_at(step, self.world_size, data_version),
        )
        return Observed(at, None, event)

    def lifecycle(self, rank: int, kind: Any, at: int, **fields: Any) -> Observed:
        generation = fields.pop("generation", None)
        return Observed(
            at, None, Lifecycle(**self._head(rank, generation, at), kind=kind, **fields)
        )

    def supervisor(self, ranks: tuple[int, ...], kind: Any, at: int, **fields: Any) -> Observed:
        """A supervisor's report for the process group hosting ``ranks`` (one host)."""
        host = host_of(ranks[0])
        pid = 50_000 + 1000 * self.generation + ranks[0]
        generation = fields.pop("generation", self.generation)
        event = Lifecycle(
            job_id=self.job_id,
            generation=generation,
            ts=0,
            seq=self._next_seq(None, host, pid),
            rank=None,
            host=host,
            pid=pid,
            kind=kind,
            ranks=ranks,
            **fields,
        )
        return Observed(at, None, event)

    # -- faults as data ----------------------------------------------------------------------

    def request(self, ranks: tuple[int, ...], kind: Any, at: int, reason: str = "") -> Observed:
        """A job request (``stop``, ``continue``) from the supervisor hosting ``ranks``, which
        numbers it with its reports (one ``seq`` per sender)."""
        host = host_of(ranks[0])
        pid = 50_000 + 1000 * self.generation + ranks[0]
        event = JobRequest(
            job_id=self.job_id, generation=self.generation, ts=at,
            seq=self._next_seq(None, host, pid), host=host, pid=pid, kind=kind, reason=reason,
        )  # fmt: skip
        return Observed(at, None, event)

    def kill(self, rank: int, at: int, *, signal: int = 9) -> Observed:
        """The supervisor reports that ``rank``'s process died of ``signal``."""
        return self.supervisor((rank,), "exited", at, signal=signal)

    def crash(self, rank: int, at: int, *, exit_code: int = 1) -> Observed:
        """The worker itself reports its exit with ``exit_code``."""
        return self.lifecycle(rank, "exited", at, exit_code=exit_code)

    def corrupt(self, rank: int, snapshot_id: str, at: int) -> Observed:
        """``rank`` found a shard of ``snapshot_id`` failing its digest check while loading."""
        return self.lifecycle(rank, "error", at, snapshot_id=snapshot_id, message="digest mismatch")

    def nan(self, rank: int, step: int, at: int) -> Observed:
        """``rank``'s loss at ``step`` is NaN."""
        return self.heartbeat(rank, step, at, loss=math.nan)

    def checksum(self, rank: int, step: int, at: int, *, odd: bool = False) -> Observed:
        """``rank``'s parameter checksum at ``step``; ``odd``: differing from its replicas'."""
        digest = hashlib.sha256(f"{step}{'odd' if odd else ''}".encode()).hexdigest()[:16]
        return self.heartbeat(rank, step, at, checksum=digest)

    def missed(self, rank: int, at_step: int, step: int, at: int) -> Observed:
        """``rank`` was at ``step``, past the in-process restore's ``at_step``, when it came."""
        return self.lifecycle(
            rank,
            "error",
            at,
            step=step,
            missed_at_step=at_step,
            message=f"in-process restore at step {at_step} missed: already at step {step}",
        )

    # -- healthy behaviour -------------------------------------------------------------------

    def start(self, at: int) -> list[Input]:
        """Every rank announces itself (``started`` with the world size)."""
        return [
            self.lifecycle(r, "started", at + r, world_size=self.world_size)
            for r in range(self.world_size)
        ]

    def train(
        self,
        steps: Iterable[int],
        *,
        start: int,
        step_ns: int = S,
        checkpoint_every: int = 10,
        ticks: bool = True,
        loss: Callable[[int], float] = lambda step: 2.5,
    ) -> list[Input]:
        """Every rank heartbeats each step (ranks 1 ms apart, loss ``loss(step)``, step time
        ``step_ns``) and writes a shard every ``checkpoint_every`` steps; a tick follows each
        step when ``ticks``."""
        out: list[Input] = []
        for i, step in enumerate(steps):
            at = start + i * step_ns
            for r in range(self.world_size):
                out.append(
                    self.heartbeat(
                        r, step, at + r * 1_000_000, loss=loss(step), step_time_s=step_ns / S
                    )
                )
            if checkpoint_every and step > 0 and step % checkpoint_every == 0:
                for r in range(self.world_size):
                    out.append(self.checkpoint(r, step, at + 500_000_000 + r))
            if ticks:
                out.append(Tick(at + step_ns - 1))
        return out

    def recover(
        self, restore: Restore, at: int, *, ranks: Iterable[int] | None = None
    ) -> list[Input]:
        """Restart into ``restore``'s generation: each rank starts, heartbeats and acks."""
        self.generation = restore.generation
        target = restore.target
        step = 0 if target is None else target.step
        out: list[Input] = []
        for r in range(self.world_size) if ranks is None else ranks:
            out.append(self.lifecycle(r, "started", at + r, world_size=self.world_size))
            out.append(self.heartbeat(r, step, at + r, phase="init"))
            out.append(
                self.lifecycle(
                    r,
                    "restored",
                    at + 100 + r,
                    step=step,
                    cursor=None if target is None else target.cursor,
                    snapshot_id=None if target is None else target.snapshot_id,
                )
            )
        return out


def running_job(
    sim: Sim, steps: int, *, start: int = T0, cfg: MachineConfig | None = None
) -> tuple[JobState, tuple[Decision, ...]]:
    """A job that started and trained ``steps`` steps (0..steps-1), one second each."""
    return run([*sim.start(start), *sim.train(range(steps), start=start + S)], cfg=cfg)


def killed_job(steps: int = 38) -> tuple[Sim, JobState, Restore]:
    """A 4-rank job trained ``steps`` steps (commits at 10, 20, 30), then rank 1 was killed:
    the simulation, the state (restoring, generation 1, the restore on the bus) and the
    restore issued."""
    sim = Sim()
    state, _ = running_job(sim, steps)
    at = T0 + (steps + 1) * S
    state, decisions = run([sim.kill(1, at)], state)
    [restore] = issued(decisions, Restore)
    state, _ = run([acted(state, at)], state)
    return sim, state, restore


_SEQ = itertools.count(1)


def request(
    kind: RequestKind,
    at: int,
    generation: int,
    *,
    host: str = "ops",
    pid: int = 7,
    seq: int | None = None,
    reason: str = "",
) -> Observed:
    """A ``job-request`` from ``host``/``pid`` (``trainguard stop`` or a supervisor)."""
    event = JobRequest(
        job_id=JOB,
        generation=generation,
        ts=0,
        seq=next(_SEQ) if seq is None else seq,
        host=host,
        pid=pid,
        kind=kind,
        reason=reason,
    )
    return Observed(at, None, event)


AWAY = (T0 + 40 * S, T0 + 100 * S)
"""A bus outage from 40 s to 100 s: 60 s, as in issue 13's broker SIGSTOP runs."""


def two_ranks_training(sim: Sim, last_step: int) -> list[Input]:
    """A 2-rank job (``sim``'s world size): started, then steps 0..``last_step`` of 1 s (step
    k ends at ``T0 + (k + 1) s``), a checkpoint every 10 steps half a second after its step, no
    ticks (the test's driver writes them)."""
    return [*sim.start(T0), *sim.train(range(last_step + 1), start=T0 + S, ticks=False)]


def killed_in_an_outage(sim: Sim) -> list[Input]:
    """A 2-rank job whose rank 1 is killed at 76.2 s, while the bus is away (:data:`AWAY`):
    both ranks wrote their shards of step 70 at 71.5 s; rank 0 then hangs in its collective at
    step 75 and heartbeats on. When the bus returns, the supervisor's exit report is the first
    record appended, then (0.1 s later, another producer) the ranks' queued records in order."""
    start, end = AWAY
    sent = [
        *two_ranks_training(sim, 75),
        *(sim.heartbeat(0, 75, T0 + k * S) for k in range(77, 115)),
    ]
    kill = sim.kill(1, T0 + 76_200_000_000)
    queued = [item._replace(at_ns=end + S // 10) for item in sent if start <= item.at_ns < end]
    before = [item for item in sent if item.at_ns < start]
    after = [item for item in sent if item.at_ns >= end]
    return [*before, kill._replace(at_ns=end), *queued, *after]


def restores_by_incident(restores: Iterable[Restore]) -> dict[str, list[Restore]]:
    """Group restores by incident id, in order of first appearance."""
    groups: dict[str, list[Restore]] = {}
    for restore in restores:
        groups.setdefault(restore.incident_id, []).append(restore)
    return groups


# -- generators for property tests ------------------------------------------------------------


@st.composite
def healthy_traces(draw: st.DrawFn) -> tuple[Sim, list[Input]]:
    """A job that starts and trains without a fault: 1-5 ranks, steps of 0.1-3 s, each rank's
    heartbeat up to 0.5 s late (so append times of different ranks interleave out of order),
    shards every few steps, ticks in between. Every rank is heard from at least every 3.5 s."""
    sim = Sim(world_size=draw(st.integers(1, 5)))
    every = draw(st.sampled_from([0, 2, 5]))
    at = T0
    inputs = sim.start(at)
    for step in range(draw(st.integers(1, 25))):
        at += draw(st.integers(S // 10, 3 * S))
        beats = [
            sim.heartbeat(r, step, at + draw(st.integers(0, S // 2))) for r in range(sim.world_size)
        ]
        inputs += draw(st.permutations(beats))
        if every and step and step % every == 0:
            inputs += [sim.checkpoint(r, step, at + S // 2 + r) for r in range(sim.world_size)]
        if draw(st.booleans()):
            inputs.append(Tick(at + draw(st.integers(0, S))))
    return sim, inputs


ACTIONS = ("ack", "beat", "exit", "stale_exit", "corrupt", "tick", "cursor", "finish", "recover")

actions = st.lists(
    st.tuples(st.sampled_from(ACTIONS), st.integers(0, 3), st.integers(0, 150)), max_size=40
)
"""Abstract process behaviour: ``(what, rank, tenths of a second since the previous one)``."""


def play(
    sim: Sim,
    state: JobState,
    steps: Iterable[tuple[str, int, int]],
    cfg: MachineConfig | None = None,
) -> tuple[JobState, list[tuple[Input, tuple[Decision, ...]]]]:
    """Turn abstract ``steps`` into inputs of processes that follow the daemon's current
    generation (as restarted processes do) and fold them one by one; return the last state
    and each input with its decisions. ``recover`` is every rank of the world size
    heartbeating and acknowledging the current restore at once. As the daemon's shell does,
    a tick naming the latest command follows every input that issued one, and every tick
    names it."""
    cfg = cfg or config()
    at = state.clock_ns
    trace: list[tuple[Input, tuple[Decision, ...]]] = []
    for what, rank, tenths in steps:
        at += tenths * S // 10
        sim.generation = state.generation
        incident = state.incident
        target = None if incident is None else incident.target
        item: Input
        if what == "recover":
            for r in range(sim.world_size):
                state, trace = _step(state, sim.heartbeat(r, 31, at + r), trace, cfg)
            for r in range(sim.world_size):
                state, trace = _step(state, _ack(sim, r, target, at + r), trace, cfg)
            continue
        if what == "ack":
            item = _ack(sim, rank, target, at)
        elif what == "beat":
            item = sim.heartbeat(rank, 31, at)
        elif what == "exit":
            item = sim.kill(rank, at)
        elif what == "stale_exit":
            item = sim.supervisor((rank,), "exited", at, generation=max(0, state.generation - 1))
        elif what == "corrupt":
            item = sim.corrupt(rank, "job/g0/s30" if target is None else target.snapshot_id, at)
        elif what == "cursor":
            item = sim.cursor(rank, 31, at)
        elif what == "finish":
            item = sim.lifecycle(rank, "finished", at, step=31)
        else:
            item = acted(state, at)
        state, trace = _step(state, item, trace, cfg)
    return state, trace


def _ack(sim: Sim, rank: int, target: SnapshotRef | None, at: int) -> Observed:
    return sim.lifecycle(
        rank,
        "restored",
        at,
        step=0 if target is None else target.step,
        cursor=None if target is None else target.cursor,
        snapshot_id=None if target is None else target.snapshot_id,
    )


def _step(
    state: JobState,
    item: Input,
    trace: list[tuple[Input, tuple[Decision, ...]]],
    cfg: MachineConfig,
) -> tuple[JobState, list[tuple[Input, tuple[Decision, ...]]]]:
    state, decisions = decide(state, item, cfg)
    trace.append((item, decisions))
    if unacted_command(state) is not None:
        tick = acted(state, state.clock_ns)
        state, decisions = decide(state, tick, cfg)
        trace.append((tick, decisions))
    return state, trace
