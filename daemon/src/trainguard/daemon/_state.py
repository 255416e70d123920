"""Immutable state of one job as the state machine sees it.

``JobState`` and ``RankState`` are named tuples: a new state differs from the old one in a few
fields, and ``_replace`` builds it several times faster than ``dataclasses.replace`` of a
frozen dataclass, whose ``__init__`` sets every field through ``object.__setattr__`` (measured
here: about 2 us against 9 us for 18 fields); this is paid on every heartbeat. Being tuples,
they compare equal to any tuple of the same values: compare states only with states.
Collections that change on the hot path (per-rank records, per-sender sequence numbers,
pending checkpoint shards, restore acknowledgements) are persistent hash tries from ``rpds``:
an update returns a new map sharing all but O(log32 n) nodes with the old one, so folding a
heartbeat does not copy the state of every rank, and an old state stays valid (and comparable)
after a new one is derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, TypeAlias

from rpds import HashTrieMap, HashTrieSet

from trainguard.schemas import Checkpoint, Manifest, Phase

JobPhase: TypeAlias = Literal["starting", "running", "restoring", "finished", "failed"]
"""``starting -> running <-> restoring -> ... -> finished | failed``."""

RankStatus: TypeAlias = Literal["alive", "dead", "finished"]

IncidentCause: TypeAlias = Literal[
    "exited", "heartbeat_timeout", "startup_timeout", "restore_timeout", "snapshot_corrupt"
]
"""What opened an incident or forced a restore to be retried."""

Sender: TypeAlias = tuple[int | None, str, int]
"""An event's sender: ``(rank, host, pid)``; ``rank`` is ``None`` for a supervisor."""

TERMINAL_PHASES: frozenset[JobPhase] = frozenset({"finished", "failed"})


class RankState(NamedTuple):
    """What the daemon knows about one rank in the current generation.

    Attributes:
        rank: the rank, ``0 <= rank < world_size``.
        host: host name of the rank's process, as last reported.
        pid: process id of the rank's process, as last reported.
        status: ``alive``, ``finished`` (sent ``lifecycle finished``) or ``dead`` (named by the
            failure that ended the job).
        phase: the phase its last heartbeat declared, or ``None`` before its first heartbeat.
        last_heard_ns: daemon clock (ns) at its last event of any kind; heartbeat timeouts
            count from here.
        step: last step it reported (heartbeat or restore acknowledgement), or ``None``.
        step_advanced_ns: daemon clock (ns) when ``step`` last increased, or ``None``.
    """

    rank: int
    host: str
    pid: int
    status: RankStatus
    phase: Phase | None
    last_heard_ns: int
    step: int | None
    step_advanced_ns: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Incident:
    """An open incident and the progress of its restore.

    Attributes:
        incident_id: ``<job_id>/i<n>``, ``n`` counting the job's incidents from 1.
        cause: what opened it.
        reason: the evidence that opened it.
        opened_ns: daemon clock (ns) when it opened.
        attempt: the current restore attempt, 1 for the first.
        target: the snapshot the current attempt restores, ``None`` for a start from scratch.
        issued_ns: daemon clock (ns) when the current attempt's ``restore`` was issued; the
            restore times out ``restore_timeout_s`` later.
        acks: ranks that acknowledged the current attempt (``lifecycle restored``).
    """

    incident_id: str
    cause: IncidentCause
    reason: str
    opened_ns: int
    attempt: int
    target: Manifest | None
    issued_ns: int
    acks: HashTrieSet[int] = field(default_factory=HashTrieSet)


class JobState(NamedTuple):
    """The state machine's whole knowledge of one job; derive new states, never mutate.

    Attributes:
        job_id: the job.
        phase: the job's phase.
        generation: the current fencing generation; events of other generations are rejected.
        generation_started_ns: daemon clock (ns) when the current generation began (the job's
            first input for generation 0, the ``restore`` for later ones); ``None`` before any
            input.
        clock_ns: the daemon's clock, the largest input time seen so far (ns); 0 before any
            input. Append times of different writers may be slightly out of order; the clock
            never goes back.
        world_size: ranks in the job, or ``None`` until some event states it. Carried into a
            new generation as the expectation until an event of that generation states it.
        world_size_generation: the generation in which ``world_size`` was last stated
            (-1: never). Within one generation a different world size is a conflict.
        ranks: rank -> record, for ranks heard from in the current generation only.
        finished_ranks: how many of ``ranks`` have status ``finished``.
        senders: ``(rank, host, pid)`` -> highest ``seq`` accepted from that sender in the
            current generation (older generations' events are rejected before this is read,
            so it is cleared on every new generation).
        pending: step -> rank -> checkpoint shard, for steps of the current generation not
            committed yet.
        committed: committed snapshots in commit order (newest last), at most
            ``keep_snapshots``.
        bad_snapshots: ids of committed snapshots whose shards failed verification.
        incident: the open incident, or ``None``.
        incidents_opened: incidents opened so far (numbers incident ids).
        command_seq: ``seq`` of the last command issued (0: none yet).
        silence_floor_ns: a lower bound of ``last_heard_ns`` over the alive ranks, or ``None``
            when no rank is alive. Heartbeat timeouts are looked for only once the clock
            passes this bound plus the timeout, which keeps folding a heartbeat O(1) in the
            number of ranks (amortised).
        failure: why the job failed, once ``phase`` is ``failed``.
    """

    job_id: str
    phase: JobPhase = "starting"
    generation: int = 0
    generation_started_ns: int | None = None
    clock_ns: int = 0
    world_size: int | None = None
    world_size_generation: int = -1
    # Persistent maps are immutable, so one empty map can be every state's default.
    ranks: HashTrieMap[int, RankState] = HashTrieMap()
    finished_ranks: int = 0
    senders: HashTrieMap[Sender, int] = HashTrieMap()
    pending: HashTrieMap[int, HashTrieMap[int, Checkpoint]] = HashTrieMap()
    committed: tuple[Manifest, ...] = ()
    bad_snapshots: frozenset[str] = frozenset()
    incident: Incident | None = None
    incidents_opened: int = 0
    command_seq: int = 0
    silence_floor_ns: int | None = None
    failure: str | None = None

    def latest_good_snapshot(self) -> Manifest | None:
        """The newest committed snapshot not known bad: the restore target, or ``None``."""
        for manifest in reversed(self.committed):
            if manifest.snapshot_id not in self.bad_snapshots:
                return manifest
        return None


def new_job(job_id: str) -> JobState:
    """The state of a job the daemon has not seen any input for: ``starting``, generation 0."""
    return JobState(job_id=job_id)
