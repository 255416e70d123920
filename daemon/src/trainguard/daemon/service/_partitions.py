"""What the daemon keeps per owned partition of ``events``: its transactional writer, positions,
and the jobs' bookkeeping as of the last commit, to roll back to when a transaction aborts.

Every write the daemon makes for a record of partition ``p`` (commands, manifests, audit and
dead-letter entries, ticks, snapshots) goes through ``p``'s
:class:`~trainguard.agent.bus.PartitionWriter`, and becomes visible together with ``p``'s
consumed position, or not at all. So the state the daemon holds for ``p``'s jobs must be the
fold of exactly the records below the committed position plus those folded since: when a
transaction aborts, :meth:`Owned.rollback` puts back the jobs' states (and what the service
knows of their commands, ticks and audit entries) as they were at the last commit, and the
consumer re-reads from there. Job states are immutable values, so a checkpoint is a shallow
copy of a few dictionaries per commit.

:class:`CommitFailures` keeps, per owned partition, since when its transactions have been
failing (the health rule of ``/healthz``: :meth:`CommitFailures.not_ready_reason`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from trainguard.agent.bus import PartitionWriter
from trainguard.daemon.core import JobState
from trainguard.schemas import Command

__all__ = ["Books", "Checkpoint", "CommitFailures", "Failing", "Owned"]


@dataclass
class Books:
    """The service's per-job dictionaries, shared by every owned partition (each job lives
    in one partition: its key's).

    Attributes:
        jobs: job -> its folded state.
        job_partition: job -> its partition of ``events``.
        sent_commands: job -> its latest command known on ``commands``.
        acted_ticks: job -> the command seq its latest tick named.
        audited: jobs whose configuration entry this process wrote to ``audit``.
        loaded_commands: job -> its latest command on ``commands`` when the partitions were
            last taken on (what a rollback falls back to for a job first seen since).
    """

    jobs: dict[str, JobState] = field(default_factory=dict)
    job_partition: dict[str, int] = field(default_factory=dict)
    sent_commands: dict[str, Command] = field(default_factory=dict)
    acted_ticks: dict[str, int] = field(default_factory=dict)
    audited: set[str] = field(default_factory=set)
    loaded_commands: dict[str, Command] = field(default_factory=dict)

    def forget(self, jobs: set[str]) -> None:
        """Drop everything known of ``jobs``."""
        for job in jobs:
            self.jobs.pop(job, None)
            self.job_partition.pop(job, None)
            self.sent_commands.pop(job, None)
            self.acted_ticks.pop(job, None)
            self.audited.discard(job)

    def clear(self) -> None:
        """Drop everything, :attr:`loaded_commands` too (the service serves again from
        scratch)."""
        self.forget(set(self.jobs))
        for book in (self.job_partition, self.sent_commands, self.acted_ticks, self.audited):
            book.clear()
        self.loaded_commands.clear()


@dataclass(frozen=True)
class Checkpoint:
    """A partition's bookkeeping at its last commit (see :meth:`Owned.rollback`)."""

    position: int
    jobs: dict[str, JobState]
    covered: dict[str, int]
    sent_commands: dict[str, Command]
    acted_ticks: dict[str, int]
    audited: frozenset[str]


@dataclass
class Owned:
    """One owned partition of ``events``.

    Attributes:
        partition: the partition number.
        writer: its transactional writer; ``None`` once fenced (its records are skipped until
            the group assigns partitions again).
        replay_until: records below this offset are folded silently (acted on already: their
            outputs were committed with this position).
        position: next offset to fold.
        committed: the position last committed.
        jobs: the partition's jobs.
        covered: job -> the position its snapshot covers (its records below are in its state).
        folded: records folded since the last commit.
        wrote: whether anything was sent since the last commit.
        last_commit: ``time.monotonic()`` of the last commit (or of the assignment).
        fenced_at: ``time.monotonic()`` when the writer was fenced, else ``None``.
        committed_at: ``time.monotonic()`` of the last successful commit (or of the
            assignment); unlike :attr:`last_commit`, a rollback leaves it.
        at_commit: the bookkeeping at the last commit.
        committing: the commit in flight, if any, and the position it commits. Nothing is
            folded into, sent for or advanced on the partition until it is settled, so the
            bookkeeping at its end is the one at its start.
        rollbacks: how many times :meth:`rollback` ran (a snapshot round sealed before one is
            not sent after it).
    """

    partition: int
    writer: PartitionWriter | None
    replay_until: int
    position: int = 0
    committed: int = 0
    jobs: set[str] = field(default_factory=set)
    covered: dict[str, int] = field(default_factory=dict)
    folded: int = 0
    wrote: bool = False
    last_commit: float = field(default_factory=time.monotonic)
    fenced_at: float | None = None
    committed_at: float = field(default_factory=time.monotonic)
    at_commit: Checkpoint | None = None
    committing: tuple[asyncio.Future[None], int] | None = None
    rollbacks: int = 0

    def commit_due(self, now: float, max_records: int, interval_s: float) -> bool:
        """Whether to commit now: something to commit, and ``max_records`` folded or
        ``interval_s`` passed since the last commit."""
        if self.writer is None or self.committing is not None:
            return False
        if not (self.wrote or self.position > self.committed):
            return False
        return self.folded >= max_records or now - self.last_commit >= interval_s

    def checkpoint(self, books: Books) -> None:
        """Remember the bookkeeping of this partition's jobs as of now: a commit, or the
        moment the rebuild reached the committed position (before the first record acted on).
        """
        jobs = self.jobs
        self.at_commit = Checkpoint(
            position=self.committed,
            jobs={job: books.jobs[job] for job in jobs if job in books.jobs},
            covered=dict(self.covered),
            sent_commands={j: c for j, c in books.sent_commands.items() if j in jobs},
            acted_ticks={j: s for j, s in books.acted_ticks.items() if j in jobs},
            audited=frozenset(books.audited & jobs),
        )

    def committed_now(self, books: Books, position: int) -> None:
        """Record a successful commit of ``position`` and everything sent."""
        self.position = max(self.position, position)
        self.committed = position
        self.folded = 0
        self.wrote = False
        self.last_commit = self.committed_at = time.monotonic()
        self.checkpoint(books)

    def rollback(self, books: Books) -> None:
        """Put this partition's jobs back as they were at the last commit (after an abort):
        the fold resumes at :attr:`position`, the last committed one."""
        at = self.at_commit
        assert at is not None  # set when the partition was taken on
        books.forget(self.jobs)
        for job in self.jobs - at.jobs.keys():
            if job in books.loaded_commands:
                books.sent_commands[job] = books.loaded_commands[job]
        self.jobs = set(at.jobs)
        self.covered = dict(at.covered)
        self.position = at.position
        books.jobs.update(at.jobs)
        books.job_partition.update(dict.fromkeys(at.jobs, self.partition))
        books.sent_commands.update(at.sent_commands)
        books.acted_ticks.update(at.acted_ticks)
        books.audited |= at.audited
        self.folded = 0
        self.wrote = False
        self.last_commit = time.monotonic()
        self.rollbacks += 1


@dataclass(frozen=True, slots=True)
class Failing:
    """A partition whose transactions fail: since when, and the latest failure.

    Attributes:
        since: ``time.monotonic()`` of the first failure since the last successful commit.
        reason: the latest failure's class (``fenced``, ``expired``, ``in_doubt``,
            ``failed``).
        error: the latest failure's message (names the partition and the writer).
        writer_id: the writer that failed (on Kafka its transactional id).
        last_ok: ``time.monotonic()`` of the partition's last successful commit (or of its
            assignment).
    """

    since: float
    reason: str
    error: str
    writer_id: str
    last_ok: float


class CommitFailures:
    """Since when each partition's transactions have been failing without a successful commit.

    A failure of any write of a partition's transaction (a send, the commit, the abort) counts:
    all of them leave the decisions of the partition's records unpublished. A successful commit
    of the partition clears it, and so does losing the partition (:meth:`keep`).

    Args:
        clock: monotonic clock in seconds (injected for tests).

    Readers (:meth:`not_ready_reason`, :meth:`since_commit_s`) may be called from another thread
    (``/healthz``, a scrape): the map is replaced whole on every change, never mutated.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._failing: dict[int, Failing] = {}

    def failed(
        self, partition: int, reason: str, error: str, writer_id: str, last_ok: float
    ) -> None:
        """Record a failure of ``partition``'s transaction (the first one starts the clock);
        ``last_ok`` is the ``time.monotonic()`` of its last successful commit."""
        now = self._clock()
        prior = self._failing.get(partition)
        since, last_ok = (now, last_ok) if prior is None else (prior.since, prior.last_ok)
        failing = Failing(since, reason, error, writer_id, last_ok)
        self._failing = {**self._failing, partition: failing}

    def succeeded(self, partition: int) -> None:
        """``partition`` committed: its failures are over."""
        if partition in self._failing:
            self._failing = {p: f for p, f in self._failing.items() if p != partition}

    def keep(self, partitions: Iterable[int]) -> None:
        """Forget the partitions not in ``partitions`` (no longer this instance's)."""
        owned = set(partitions)
        if not self._failing.keys() <= owned:
            self._failing = {p: f for p, f in self._failing.items() if p in owned}

    def since_commit_s(self) -> float:
        """Seconds since the last successful commit of the partition whose transactions have
        been failing longest, 0 while none is failing."""
        failing = self._failing
        if not failing:
            return 0.0
        return max(0.0, self._clock() - min(f.last_ok for f in failing.values()))

    def not_ready_reason(self, bound_s: float) -> str | None:
        """``commits failing for N s on partition(s) P (writer W: reason): error`` when some
        partition's transactions have failed for longer than ``bound_s`` seconds without a
        successful commit (the partitions so long failing named, the latest failure of the
        first told), else ``None``."""
        now = self._clock()
        over = sorted(p for p, f in self._failing.items() if now - f.since > bound_s)
        if not over:
            return None
        first = self._failing[over[0]]
        names = ", ".join(map(str, over))
        return (
            f"commits failing for {int(now - first.since)} s on partition(s) {names} "
            f"(writer {first.writer_id}: {first.reason}): {first.error}"
        )
