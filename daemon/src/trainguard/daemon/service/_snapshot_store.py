"""Job-state snapshots on the bus: the daemon's writer and loader, and the rule that decides
whether a partition may be rebuilt from its snapshots (:func:`plan_partition`).

The envelope (sign + encrypt) is :mod:`trainguard.daemon.service._snapshot_envelope`; this module reads and
writes the compacted ``snapshots`` topic (key: job id; co-partitioned with ``events``).

**Writing.** Every ``snapshot_interval_s`` and on a clean shutdown, for each owned partition
of ``events`` whose position ``P`` is caught up with the group's committed position, the
service hands every job it holds in the partition to :meth:`Snapshots.write`: one *round* at
``P``, sent in the partition's transaction that commits ``P`` (so everything below ``P`` has
been acted on exactly when the round is visible). Each snapshot's header
names ``P`` and the round's jobs (count and digest, :class:`~trainguard.daemon.service._snapshot_envelope.Round`).
A job whose state is the very object last written for it, under the current key ids, is not
written again: its latest snapshot, at an older position, still holds its current state (a
finished job's state never changes again).

**Loading** (:meth:`Snapshots.load`, then :func:`plan_partition` per partition). The latest
snapshot of each job on the partition is opened (verified and decrypted); ``P_max`` is the
highest position among them and ``R`` the round written there. The partition is rebuilt from
its snapshots when every one opens, they all name this partition, the jobs found are exactly
``R``'s jobs, and ``P_max`` is at most the group's committed position ``C``; else the reason is
logged, counted (``trainguard_snapshot_fallbacks_total``) and the partition is folded from
offset 0 as without snapshots. The rebuild reads from ``S`` = the least position among the
snapshots of jobs that are not finished or failed (``P_max`` if all are), skips each job's
records below its own snapshot's position, and folds everything else as usual (silently below
``C``).

**Why the result equals a full fold.** Write ``fold_j(P)`` for job ``j``'s state after
folding its records below position ``P`` from ``new_job(j)``, and ``J(P)`` for the jobs with a
record taken in below ``P`` (the jobs the daemon holds at ``P``; it grows with ``P``).

1. Every snapshot of ``j`` at position ``P_j`` holds ``fold_j(P_j)``: the writer's state at
   ``P_j`` is that fold (by induction, also for a writer that itself started from snapshots;
   folding is deterministic, and ``fold_config`` equality means the same thresholds; the
   ``daemon_id`` left out of it never enters a state).
2. The jobs found are exactly ``J(P_max)``: each found ``j`` was held by its writer at
   ``P_j <= P_max``, so ``j`` is in ``J(P_j)``, a subset of ``J(P_max)``; with the round's
   count and digest equal, nothing of ``J(P_max)`` is missing. A writer that died halfway
   through a round leaves either a job with an older snapshot (still ``fold_j(P_j)``, just
   older) or a job that never had one: that is the incomplete round, refused.
3. A job without a snapshot has no record below ``P_max >= S`` (it is not in ``J(P_max)``),
   so starting it from ``new_job`` at its first record read is its full fold.
4. A job with a snapshot skips exactly its records below ``P_j``, which ``fold_j(P_j)`` holds.
   A finished or failed job may have ``P_j < S``: its records in ``[P_j, S)`` are never read,
   which changes nothing, since :func:`~trainguard.daemon.decide` returns such a state as it is.

So after reading up to any position ``Q >= P_max`` every job's state is ``fold_j(Q)``, the
state a fold from offset 0 has. Decisions: the records skipped lie below ``P_max <= C``, where
a fold from offset 0 acts on nothing either; every record from ``C`` on is folded from the same
state and acted on the same way. A writer that keeps writing after it lost the partition (a
zombie after a rebalance), or an attacker who re-publishes older valid snapshots, only makes
``S`` smaller or a round incomplete: points 1-4 use nothing but each snapshot's own position.
Forging a newer one takes the signing key.

Snapshots are off without keys, and with ``snapshot_interval_s = 0`` (neither written nor
read).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import version as _dist_version
from typing import Protocol

import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from trainguard.agent.bus import Bus, BusError, DeliveryFailed, PartitionWriter
from trainguard.daemon.core import TERMINAL_PHASES, JobState, MachineConfig, StateFormatError
from trainguard.daemon.service._metrics import DaemonMetrics
from trainguard.daemon.service._snapshot_envelope import (
    NONCE_BYTES,
    FallbackReason,
    Round,
    SnapshotHeader,
    SnapshotRefused,
    fold_config_id,
    job_set_digest,
    open_snapshot,
    seal,
)

__all__ = ["Fallback", "Rebuild", "SnapshotKeys", "Snapshots", "plan_partition"]

log = structlog.get_logger("trainguard.daemon")

TOPIC = "snapshots"


class SnapshotKeys(Protocol):
    """The keys snapshots need (:class:`trainguard.agent.keys._keystore.DaemonKeys` has them).

    Attributes:
        signing_kid: id of the current Ed25519 signing key.
        signing: the current signing key.
        verify: Ed25519 public keys by id, the current one and rotated-out ones not retired.
        data_kid: id of the current AES-256 data key.
        data: AES-256 keys (32 bytes) by id, the current one and rotated-out ones.
    """

    @property
    def signing_kid(self) -> str: ...

    @property
    def signing(self) -> Ed25519PrivateKey: ...

    @property
    def verify(self) -> Mapping[str, Ed25519PublicKey]: ...

    @property
    def data_kid(self) -> str: ...

    @property
    def data(self) -> Mapping[str, bytes]: ...


@dataclass(frozen=True, slots=True)
class Rebuild:
    """How to rebuild a partition from its snapshots.

    Attributes:
        start: the first offset of ``events`` to read.
        states: job -> its state from its snapshot.
        covered: job -> its snapshot's position: its records below it are skipped.
        headers: job -> its snapshot's verified header.
        newest: the newest round (its position is the highest snapshot position).
    """

    start: int
    states: Mapping[str, JobState]
    covered: Mapping[str, int]
    headers: Mapping[str, SnapshotHeader]
    newest: Round


@dataclass(frozen=True, slots=True)
class Fallback:
    """Why a partition with snapshots is folded from offset 0 instead.

    Attributes:
        reason: the class (the metric's label).
        detail: a sentence for the log.
        job: the job whose snapshot was refused, or ``None`` for a problem of the round.
    """

    reason: FallbackReason
    detail: str
    job: str | None = None


def plan_partition(
    partition: int,
    values: Mapping[str, bytes],
    keys: SnapshotKeys,
    *,
    fold_config: str | None,
    committed: int | None,
) -> Rebuild | Fallback | None:
    """Decide how partition ``partition`` of ``events`` is rebuilt (module docstring).

    Args:
        partition: the partition.
        values: job id -> the value of that job's latest record on ``snapshots`` (the records
            on this partition of ``snapshots``).
        keys: the keys to verify and decrypt with.
        fold_config: this daemon's :func:`~trainguard.daemon.service._snapshot_envelope.fold_config_id`
            (``None``: not checked, for inspection tools).
        committed: the consumer group's committed position of the partition (0 if none;
            ``None``: not checked, for inspection tools).

    Returns:
        ``None`` when there is no snapshot (fold from offset 0), a :class:`Rebuild`, or a
        :class:`Fallback` naming why the snapshots cannot be used.
    """
    if not values:
        return None
    opened: dict[str, tuple[SnapshotHeader, JobState]] = {}
    for job, value in sorted(values.items()):
        try:
            header, state = open_snapshot(
                value, keys.verify, keys.data, job, fold_config=fold_config
            )
        except SnapshotRefused as exc:
            return Fallback(exc.code, f"snapshot of job {job!r} refused: {exc.reason}", job)
        if header.partition != partition:
            return Fallback(
                "partition",
                f"the snapshot of job {job!r} is of partition {header.partition}, read on "
                f"partition {partition} (do snapshots and events have one partition count?)",
                job,
            )
        opened[job] = header, state
    newest_at = max(header.offset for header, _ in opened.values())
    rounds = {header.round for header, _ in opened.values() if header.offset == newest_at}
    newest = min(rounds, key=lambda r: (r.jobs, r.digest))
    if len(rounds) > 1 or newest.jobs != len(opened) or newest.digest != job_set_digest(opened):
        return Fallback(
            "incomplete",
            f"the round at offset {newest_at} held {newest.jobs} job(s); the snapshots found "
            f"are of {len(opened)} job(s) and not the same ones (a round written halfway?)",
        )
    if committed is not None and newest_at > committed:
        return Fallback(
            "ahead",
            f"snapshots at offset {newest_at}, past the group's committed position "
            f"{committed}: the decisions between the two would not be derived again",
        )
    live = [
        header.offset for header, state in opened.values() if state.phase not in TERMINAL_PHASES
    ]
    return Rebuild(
        start=min(live, default=newest_at),
        states={job: state for job, (_, state) in opened.items()},
        covered={job: header.offset for job, (header, _) in opened.items()},
        headers={job: header for job, (header, _) in opened.items()},
        newest=newest,
    )


@dataclass(frozen=True, slots=True)
class _Written:
    """What the latest snapshot of a job holds, to skip writing the same again."""

    state: JobState
    kids: tuple[str, str]


class Snapshots:
    """The daemon's snapshot writer and loader. Keys are passed to each call, so a daemon
    that reloads its keys (a rotation) writes under the new ones from its next round.

    Args:
        config: the configuration this daemon folds under.
        metrics: counts written snapshots and fallbacks.
        nonce: source of fresh 12-byte GCM nonces (``os.urandom`` by default).
    """

    def __init__(
        self,
        config: MachineConfig,
        metrics: DaemonMetrics,
        *,
        nonce: Callable[[], bytes] = lambda: os.urandom(NONCE_BYTES),
    ) -> None:
        self._config = config
        self._fold_config = fold_config_id(config)
        self._metrics = metrics
        self._nonce = nonce
        self._version = _dist_version("trainguard")
        self._written: dict[str, _Written] = {}

    async def load(
        self, bus: Bus, committed: Mapping[int, int], keys: SnapshotKeys
    ) -> dict[int, Rebuild]:
        """Plan the rebuild of each partition in ``committed`` (partition -> the group's
        committed position) from the latest snapshots on the bus, opened with ``keys``; a
        partition missing from the
        result is folded from offset 0 (no snapshot; a fallback, logged and counted; or the
        ``snapshots`` topic could not be read, logged).
        """
        try:
            latest = await bus.latest_per_key(TOPIC)
        except BusError as exc:
            log.warning("snapshots unreadable: partitions rebuilt from the log", error=str(exc))
            return {}
        values: dict[int, dict[str, bytes]] = {p: {} for p in committed}
        for job, record in latest.items():
            if record.partition in values and record.value is not None:
                values[record.partition][job] = record.value
        plans: dict[int, Rebuild] = {}
        for partition, position in sorted(committed.items()):
            plan = plan_partition(
                partition,
                values[partition],
                keys,
                fold_config=self._fold_config,
                committed=position,
            )
            if isinstance(plan, Fallback):
                self._metrics.snapshot_fallback(plan.reason)
                log.error(
                    "snapshots unusable: partition rebuilt from the full log",
                    partition=partition,
                    reason=plan.reason,
                    job_id=plan.job,
                    detail=plan.detail,
                )
            elif isinstance(plan, Rebuild):
                plans[partition] = plan
                for job, header in plan.headers.items():
                    kids = (header.signing_kid, header.data_kid)
                    self._written[job] = _Written(plan.states[job], kids)
                log.info(
                    "partition restored from snapshots",
                    partition=partition,
                    jobs=len(plan.states),
                    newest=plan.newest.offset,
                    start=plan.start,
                )
        return plans

    async def write(
        self,
        out: PartitionWriter,
        partition: int,
        position: int,
        states: Mapping[str, JobState],
        keys: SnapshotKeys,
    ) -> int:
        """Write one round into ``partition``'s open transaction (``out``): the snapshots of
        ``states`` (every job held in ``partition``, each folded up to ``position``, the
        position the caller commits with them), sealed with ``keys``' current signing and
        data keys; a job whose state and key ids are those of its last written snapshot is
        left out. Returns the number of snapshots sent.

        A round whose transaction aborts leaves each job's previous snapshot as its latest:
        older, still its state at its own position (point 1 above), so a rebuild stays exact.

        A snapshot over the bus's ``max_message_bytes`` is left out (logged); the job's
        previous one, if any, stays its latest.

        Raises:
            Fenced: ``out`` was fenced.
            BusError: a record could not be sent (abort the transaction).
        """
        if not states:
            return 0
        kids = (keys.signing_kid, keys.data_kid)
        round = Round.of(partition, position, states)
        written = 0
        for job, state in sorted(states.items()):
            last = self._written.get(job)
            if last is not None and last.state is state and last.kids == kids:
                continue
            try:
                value = seal(
                    state,
                    round,
                    signing_kid=keys.signing_kid,
                    signing_key=keys.signing,
                    data_kid=keys.data_kid,
                    data_key=keys.data[keys.data_kid],
                    nonce=self._nonce(),
                    config=self._config,
                    version=self._version,
                )
            except StateFormatError as exc:  # a bug: the codec's tests cover reachable states
                log.error("snapshot not written: state not encodable", job_id=job, error=str(exc))
                continue
            try:
                await out.send(TOPIC, job, value)
            except DeliveryFailed as exc:  # too large: the transaction goes on without it
                log.warning("snapshot not written", job_id=job, partition=partition, error=str(exc))
                continue
            self._written[job] = _Written(state, kids)
            written += 1
        self._metrics.snapshots_written(written)
        return written

    def forget(self, jobs: Iterable[str]) -> None:
        """Drop what is known of ``jobs``' snapshots (their partition was revoked)."""
        for job in jobs:
            self._written.pop(job, None)
