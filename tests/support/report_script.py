"""The scripted job of the job report's tests: a :class:`Script` is a 2-rank job's events,
folded one by one by the real state machine as the daemon folds them (so its audit entries and
commands are the ones the daemon would write), and :func:`killed_once` is the script of a job
that loses rank 1 once. A script's times are milliseconds after :data:`T0`; a step takes 1 s,
and each rank announces its shard :data:`WRITE_MS` after the step."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from trainguard.daemon.core._decisions import Decision, Issue
from trainguard.daemon.core._inputs import Input, Observed, Tick
from trainguard.daemon.core._machine import decide, next_deadline
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import JobState, new_job
from trainguard.daemon.demo._harness import Stamped
from trainguard.daemon.forensics._report import JobReport, build_report
from trainguard.schemas import (
    Checkpoint,
    CheckpointMeta,
    DataCursor,
    Event,
    Heartbeat,
    JobRequest,
    Lifecycle,
    Phase,
    RequestKind,
    Restore,
)

JOB = "report-job"
T0 = 1_700_000_000_000
"""The job's first event, ms since the epoch."""
HOST = "h0"
WRITE_MS = (200, 210)
"""How long after its step each rank's shard is announced."""


@dataclass
class Script:
    """A 2-rank job's events, folded one by one by the real machine (ticking at its deadlines
    like the daemon's shell); keeps what the bus would hold: the events with their append
    times, the audit entries and the commands."""

    world_size: int = 2
    cfg: MachineConfig = field(default_factory=lambda: MachineConfig(daemon_id="d"))
    state: JobState = field(default_factory=lambda: new_job(JOB))
    events: list[Stamped] = field(default_factory=list)
    audit: list[dict[str, Any]] = field(default_factory=list)
    commands: list[Stamped] = field(default_factory=list)
    generation: int = 0
    _seq: dict[tuple[int | None, int], int] = field(default_factory=dict)

    def report(self) -> JobReport:
        return build_report(JOB, self.events, self.audit, self.commands)

    # -- folding ---------------------------------------------------------------------------

    def _fold(self, item: Input) -> None:
        self.state, decisions = decide(self.state, item, self.cfg)
        at_ms = item.at_ns // 1_000_000
        if decisions:
            self.audit.append({"at_ms": at_ms, "decisions": [d.to_dict() for d in decisions]})
        self.commands += [Stamped(at_ms, d.command) for d in decisions if isinstance(d, Issue)]
        self._last = decisions

    def send(self, event: Event | JobRequest, at: int) -> tuple[Decision, ...]:
        """Tick up to ``at`` (ms after T0), then fold ``event`` appended at ``at``."""
        at_ns = (T0 + at) * 1_000_000
        while (due := next_deadline(self.state, self.cfg)) is not None and due <= at_ns:
            self._fold(Tick(due))
        self._fold(Observed(at_ns, len(self.events), event))
        self.events.append(Stamped(T0 + at, event))
        return self._last

    def head(self, rank: int | None, at: int, pid: int) -> dict[str, Any]:
        key = (rank, pid)
        self._seq[key] = self._seq.get(key, -1) + 1
        return {
            "job_id": JOB,
            "generation": self.generation,
            "ts": (T0 + at) * 1_000_000,
            "seq": self._seq[key],
            "host": HOST,
            "pid": pid,
        }

    def pid(self, rank: int) -> int:
        return 100 * (self.generation + 1) + rank

    # -- what the processes send ----------------------------------------------------------------

    def beat(
        self, rank: int, step: int, at: int, phase: Phase = "train", loss: float = 2.0
    ) -> None:
        self.send(
            Heartbeat(
                **self.head(rank, at, self.pid(rank)),
                rank=rank,
                world_size=self.world_size,
                step=step,
                phase=phase,
                step_time_s=None if phase == "init" else 1.0,
                loss=None if phase == "init" else loss,
                samples=step * 8,
            ),
            at,
        )

    def shard(self, rank: int, step: int, at: int) -> None:
        uri = f"file:///ckpt/g{self.generation}/s{step}/rank{rank}.pt"
        self.send(
            Checkpoint(
                **self.head(rank, at, self.pid(rank)),
                rank=rank,
                world_size=self.world_size,
                step=step,
                shard_uri=uri,
                size_bytes=1024,
                digest="sha256:" + hashlib.sha256(uri.encode()).hexdigest(),
                cursor=cursor(step),
                metadata=CheckpointMeta(),
            ),
            at,
        )

    def lifecycle(self, rank: int, kind: Any, at: int, **fields: Any) -> tuple[Decision, ...]:
        return self.send(
            Lifecycle(**self.head(rank, at, self.pid(rank)), rank=rank, kind=kind, **fields), at
        )

    def supervisor_exit(self, rank: int, at: int, *, died: int, signal: int = 9) -> None:
        """The supervisor saw ``rank`` die at ``died`` and its report was appended at ``at``."""
        self.send(
            Lifecycle(
                **self.head(None, died, 9000 + rank),
                rank=None,
                kind="exited",
                ranks=(rank,),
                signal=signal,
            ),
            at,
        )

    # -- behaviour ---------------------------------------------------------------------------

    def start(self, at: int, until: int) -> None:
        """Every rank starts at ``at`` and heartbeats ``init`` each second until ``until``."""
        for r in range(self.world_size):
            self.lifecycle(r, "started", at, world_size=self.world_size)
        for t in range(at, until + 1, 1000):
            for r in range(self.world_size):
                self.beat(r, 0, t, phase="init")

    def train(
        self,
        steps: range,
        first_at: int,
        *,
        every: int = 10,
        stuck_at: int | None = None,
        declared: int = 0,
    ) -> int:
        """Train ``steps``, the first ending at ``first_at``, one per second; shards every
        ``every`` steps (declared as the ``checkpoint`` phase for ``declared`` ms first, from
        1 ms after the step); from step ``stuck_at`` on the ranks hang, heartbeating that
        step each second. Returns the time the last step ended."""
        at = first_at
        for i, step in enumerate(steps):
            at = first_at + 1000 * i
            shown = step if stuck_at is None else min(step, stuck_at)
            for r in range(self.world_size):
                self.beat(r, shown, at)
            if step % every == 0 and (stuck_at is None or step <= stuck_at):
                if declared:
                    for r in range(self.world_size):
                        self.beat(r, step, at + 1, phase="checkpoint")
                for r in range(self.world_size):
                    self.shard(r, step, at + declared + WRITE_MS[r])
        return at

    def restart(self, started: int, acks: tuple[int, ...]) -> None:
        """The processes of the restore just issued start at ``started`` (heartbeating
        ``init``) and acknowledge at ``acks`` (one time per rank)."""
        restore = self.last_restore()
        self.generation = restore.generation
        target = restore.target
        for r in range(self.world_size):
            self.lifecycle(r, "started", started, world_size=self.world_size)
        for t in range(started, max(acks) + 1, 1000):
            for r in range(self.world_size):
                self.beat(r, 0, t, phase="init")
        for r, at in enumerate(acks):
            self.lifecycle(
                r,
                "restored",
                at,
                step=0 if target is None else target.step,
                cursor=None if target is None else target.cursor,
                snapshot_id=None if target is None else target.snapshot_id,
            )

    def request(self, kind: RequestKind, at: int) -> None:
        """An operator's ``kind`` request for the job (``trainguard stop``, ``--continue``)."""
        head = self.head(None, at, 7000)
        self.send(JobRequest(**head, kind=kind), at)

    def finish(self, step: int, at: int) -> None:
        for r in range(self.world_size):
            self.lifecycle(r, "finished", at, step=step)

    def last_restore(self) -> Restore:
        return next(c.message for c in reversed(self.commands) if isinstance(c.message, Restore))


def cursor(step: int) -> DataCursor:
    return DataCursor(data_version="v1", seed=7, epoch=0, offset=step * 16, world_size=2)


def killed_once() -> Script:
    """Start-up 10 s; steps 1-25 end at 11..35 s (commits at 10 and 20); rank 1 dies at
    35.5 s, its exit appended 10 ms later; the new processes start at 40 s and acknowledge at
    45 and 45.5 s; steps 21-40 end at 46.5..65.5 s; both finish at 65.6 s."""
    job = Script()
    job.start(0, 10_000)
    job.train(range(1, 26), 11_000)
    job.supervisor_exit(1, 35_510, died=35_500)
    job.restart(40_000, (45_000, 45_500))
    job.train(range(21, 41), 46_500)
    job.finish(40, 65_600)
    return job
