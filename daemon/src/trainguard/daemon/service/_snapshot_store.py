"""Job-state snapshots on the bus: the daemon's writer and loader, and the rule that decides
whether a partition may be rebuilt from its snapshots (:func:`plan_partition`).

The envelope (compress + encrypt + sign) is :mod:`trainguard.daemon.service._snapshot_envelope`,
the chunks of one larger than a record :mod:`trainguard.daemon.service._snapshot_chunks`; this
module reads and writes the compacted ``snapshots`` topic (co-partitioned with ``events``). A
job's *snapshot* is the latest record of its key (the job id): the envelope when it fits one
record (``max_message_bytes``), else the signed head of its chunks, whose records sit on the
same partition under keys of their own (``<job>/chunk/<offset>/<index>``).

**Writing.** Every ``snapshot_interval_s`` and on a clean shutdown, for each owned partition
of ``events`` whose position ``P`` is caught up with the group's committed position, the
service hands every job it holds in the partition to :meth:`Snapshots.seal`: one *round* at
``P``, sealed in a worker thread while the service folds on (the states are immutable values),
then sent (:meth:`Snapshots.send`) in a transaction of the partition that commits ``P`` or a
later position (so everything below ``P`` has been acted on when the round is visible; a round
whose partition was rolled back, lost or taken on again in the meantime is dropped). Each
snapshot's header names ``P`` and the round's jobs (count and digest, :class:`~trainguard.daemon.service._snapshot_envelope.Round`).
A job whose state is the very object last written for it (in a committed round), under the
current key ids, is not written again: its latest snapshot, at an older position, still holds
its current state (a finished job's state never changes again). For a job written in chunks,
the transaction holds, in this order, the chunks, the head, and a tombstone (a null value) for
every chunk key of the job's earlier snapshots that the new one does not reuse, so compaction
deletes them; the chunk records name the partition explicitly (their keys would hash
elsewhere). Sealing (encoding, compressing, encrypting, signing, hashing chunks) runs in a
worker thread, so a large state stalls neither the event loop nor the fold; the records are
sent from the loop, in the transaction.

**Loading** (:meth:`Snapshots.load`, then :func:`plan_partition` per partition). The latest
snapshot of each job on the partition is opened (verified, chunks joined and checked against
their head, decrypted, decompressed, decoded; in a worker thread); ``P_max`` is the
highest position among them and ``R`` the round written there. The partition is rebuilt from
its snapshots when every one opens, they all name this partition, the jobs found are exactly
``R``'s jobs, and ``P_max`` is at most the group's committed position ``C``; else the reason is
logged, counted (``trainguard_snapshot_fallbacks_total``) and the partition is folded from
offset 0 as without snapshots. A chunk missing, of another size or digest than its head lists
(altered, truncated, swapped in from another snapshot) or a stale head whose chunks were
tombstoned refuses the job's snapshot like a bad signature does (``chunk_missing``,
``chunk_corrupt``): a fallback, never a wrong state. The rebuild reads from ``S`` = the least
position among the
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

Chunks change none of this: a head and its chunks are written in one transaction, so a reader
(read committed) sees all of a job's new snapshot or none of it, with the tombstones of the old
chunks; a job's snapshot is whatever its key's latest record and the chunks that record lists
make up, and :func:`~trainguard.daemon.service._snapshot_chunks.join` accepts nothing else
(each chunk's size and SHA-256 are in the signed head). So point 1 holds of every snapshot that
opens, and points 2-4 only ever read snapshots that open.

Snapshots are off without keys, and with ``snapshot_interval_s = 0`` (neither written nor
read).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import version as _dist_version
from typing import Protocol

import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from trainguard.agent.bus import Bus, BusError, DeliveryFailed, PartitionWriter
from trainguard.daemon.core import TERMINAL_PHASES, JobState, MachineConfig, StateFormatError
from trainguard.daemon.service._metrics import DaemonMetrics
from trainguard.daemon.service._snapshot_chunks import chunk_job, open_record, split
from trainguard.daemon.service._snapshot_envelope import (
    NONCE_BYTES,
    FallbackReason,
    Round,
    SnapshotHeader,
    SnapshotRefused,
    fold_config_id,
    job_set_digest,
    seal,
)

__all__ = ["Fallback", "Rebuild", "SealedRound", "SnapshotKeys", "Snapshots", "plan_partition"]

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
        values: key -> the value of that key's latest record on this partition of
            ``snapshots`` (tombstoned keys left out): each job's snapshot under its job id, and
            the chunks of those written in chunks under their chunk keys (a chunk no head lists
            is ignored).
        keys: the keys to verify and decrypt with.
        fold_config: this daemon's :func:`~trainguard.daemon.service._snapshot_envelope.fold_config_id`
            (``None``: not checked, for inspection tools).
        committed: the consumer group's committed position of the partition (0 if none;
            ``None``: not checked, for inspection tools).

    Returns:
        ``None`` when there is no snapshot (fold from offset 0), a :class:`Rebuild`, or a
        :class:`Fallback` naming why the snapshots cannot be used.
    """
    chunks = {key: value for key, value in values.items() if chunk_job(key) is not None}
    jobs = {key: value for key, value in values.items() if key not in chunks}
    if not jobs:
        return None
    opened: dict[str, tuple[SnapshotHeader, JobState]] = {}
    for job, value in sorted(jobs.items()):
        try:
            header, state = open_record(
                value, chunks, keys.verify, keys.data, job, fold_config=fold_config
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


@dataclass(frozen=True, slots=True)
class _Sealed:
    """One job's snapshot as records: ``(key, value)`` in the order they are sent (the chunks,
    then the job's own key), and the chunk keys among them."""

    records: tuple[tuple[str, bytes], ...]
    chunk_keys: frozenset[str]


@dataclass(frozen=True, slots=True)
class SealedRound:
    """A round of snapshots sealed and not sent yet (:meth:`Snapshots.seal`).

    Attributes:
        partition: the partition of ``events`` it is for.
        position: the position every state in it is folded up to.
        kids: the signing and data key ids it was sealed with.
        states: job -> the state sealed (the jobs left out as unchanged are not in it).
        sealed: job -> its records, or why it could not be sealed.
    """

    partition: int
    position: int
    kids: tuple[str, str]
    states: Mapping[str, JobState]
    sealed: Mapping[str, _Sealed | str]


@dataclass(slots=True)
class _Pending:
    """What a round sent for one partition, taken in when its transaction commits."""

    written: dict[str, _Written] = field(default_factory=dict)
    chunks: dict[str, frozenset[str]] = field(default_factory=dict)


class Snapshots:
    """The daemon's snapshot writer and loader. Keys are passed to each call, so a daemon
    that reloads its keys (a rotation) writes under the new ones from its next round.

    Args:
        config: the configuration this daemon folds under.
        metrics: counts written snapshots and fallbacks.
        max_message_bytes: the bus's largest record value, bytes: a snapshot larger than this
            is written in chunks of at most this size.
        nonce: source of fresh 12-byte GCM nonces (``os.urandom`` by default); called from a
            worker thread.
    """

    def __init__(
        self,
        config: MachineConfig,
        metrics: DaemonMetrics,
        *,
        max_message_bytes: int,
        nonce: Callable[[], bytes] = lambda: os.urandom(NONCE_BYTES),
    ) -> None:
        self._config = config
        self._fold_config = fold_config_id(config)
        self._metrics = metrics
        self._limit = max_message_bytes
        self._nonce = nonce
        self._version = _dist_version("trainguard")
        self._written: dict[str, _Written] = {}
        # Chunk keys of each job that may hold a value on the bus: those found at load, and
        # those sent since, until a committed round replaced them by tombstones.
        self._chunks: dict[str, frozenset[str]] = {}
        self._pending: dict[int, _Pending] = {}

    async def load(
        self, bus: Bus, committed: Mapping[int, int], keys: SnapshotKeys
    ) -> dict[int, Rebuild]:
        """Plan the rebuild of each partition in ``committed`` (partition -> the group's
        committed position) from the latest snapshots on the bus, opened with ``keys`` in a
        worker thread; a partition missing from the result is folded from offset 0 (no
        snapshot; a fallback, logged and counted; or the ``snapshots`` topic could not be
        read, logged). The chunk keys found on those partitions are remembered, so the next
        snapshot of their job replaces them with tombstones.
        """
        try:
            latest = await bus.latest_per_key(TOPIC)
        except BusError as exc:
            log.warning("snapshots unreadable: partitions rebuilt from the log", error=str(exc))
            return {}
        values: dict[int, dict[str, bytes]] = {p: {} for p in committed}
        found: dict[str, set[str]] = {}
        for key, record in latest.items():
            if record.partition in values and record.value is not None:
                values[record.partition][key] = record.value
                job = chunk_job(key)
                if job is not None:
                    found.setdefault(job, set()).add(key)
        self._chunks.update({job: frozenset(keys_) for job, keys_ in found.items()})
        plans: dict[int, Rebuild] = {}
        for partition, position in sorted(committed.items()):
            plan = await asyncio.to_thread(
                plan_partition,
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
        """:meth:`seal` the round of ``states`` at ``position``, then :meth:`send` it into
        ``partition``'s open transaction (``out``). Returns the number of snapshots sent; call
        :meth:`committed` once the transaction committed.

        Raises:
            Fenced: ``out`` was fenced.
            BusError: a record could not be sent (abort the transaction).
        """
        return await self.send(out, await self.seal(partition, position, states, keys))

    async def seal(
        self,
        partition: int,
        position: int,
        states: Mapping[str, JobState],
        keys: SnapshotKeys,
    ) -> SealedRound:
        """Seal one round of ``partition``: the snapshots of ``states`` (every job held in
        ``partition``, each folded up to ``position``), with ``keys``' current signing and
        data keys, in a worker thread (encoding, compressing, encrypting, signing, hashing
        chunks: about 0.3 s of CPU for a 16,384-rank job). A job whose state and key ids
        are those of its last snapshot written in a committed round is left out. Nothing is
        sent: :meth:`send` the result in a transaction that commits ``position`` or a later
        position of ``partition`` (the states are immutable values, so the caller may fold on
        meanwhile).
        """
        kids = (keys.signing_kid, keys.data_kid)
        if not states:
            return SealedRound(partition, position, kids, {}, {})
        round = Round.of(partition, position, states)
        todo = {
            job: state
            for job, state in sorted(states.items())
            if not (
                (last := self._written.get(job)) is not None
                and last.state is state
                and last.kids == kids
            )
        }
        sealed = await asyncio.to_thread(self._seal_round, todo, round, keys) if todo else {}
        return SealedRound(partition, position, kids, todo, sealed)

    async def send(self, out: PartitionWriter, sealed: SealedRound) -> int:
        """Send a round :meth:`seal` made into its partition's open transaction (``out``), which
        must commit the round's position or a later one: a snapshot over the bus's
        ``max_message_bytes`` as its chunks and head, followed by tombstones for the job's
        older chunk keys (module docstring). A job that could not be sealed, or whose records
        the bus refuses as too large, is logged and left out (its previous snapshot, if any,
        stays its latest). Returns the number of snapshots sent; call :meth:`committed` once
        the transaction committed.

        A round whose transaction aborts leaves each job's previous snapshot as its latest:
        older, still its state at its own position (point 1 above), so a rebuild stays exact;
        its jobs are written again in the next round.

        Raises:
            Fenced: ``out`` was fenced.
            BusError: a record could not be sent (abort the transaction).
        """
        partition = sealed.partition
        self._pending.pop(partition, None)
        pending = _Pending()
        for job, result in sealed.sealed.items():
            if isinstance(result, str):
                log.warning("snapshot not written", job_id=job, partition=partition, error=result)
                continue
            if result.chunk_keys:
                # May hold values from here on (the transaction may commit): tombstoned by a
                # later round if this one aborts.
                self._chunks[job] = self._chunks.get(job, frozenset()) | result.chunk_keys
            try:
                for key, value in result.records:
                    # Chunks name the partition: their keys would hash elsewhere.
                    await out.send(TOPIC, key, value, partition=partition if key != job else None)
            except DeliveryFailed as exc:  # too large: the transaction goes on without it
                log.warning("snapshot not written", job_id=job, partition=partition, error=str(exc))
                continue
            for key in sorted(self._chunks.get(job, frozenset()) - result.chunk_keys):
                await out.send(TOPIC, key, None, partition=partition)
            pending.written[job] = _Written(sealed.states[job], sealed.kids)
            pending.chunks[job] = result.chunk_keys
        self._pending[partition] = pending
        self._metrics.snapshots_written(len(pending.written))
        return len(pending.written)

    def _seal_round(
        self, states: Mapping[str, JobState], round: Round, keys: SnapshotKeys
    ) -> dict[str, _Sealed | str]:
        """Each job's snapshot as records, or why it cannot be written (runs in a worker
        thread: reads only its arguments and this object's fixed settings)."""
        out: dict[str, _Sealed | str] = {}
        for job, state in states.items():
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
                out[job] = f"state not encodable: {exc}"
                continue
            if len(value) <= self._limit:
                out[job] = _Sealed(((job, value),), frozenset())
                continue
            head, chunks = split(value, self._limit, keys.signing)
            if len(head) > self._limit:
                out[job] = (
                    f"snapshot of {len(value)} bytes: the head of its {len(chunks)} chunks is "
                    f"{len(head)} bytes, over max_message_bytes={self._limit}"
                )
                continue
            out[job] = _Sealed((*chunks, (job, head)), frozenset(key for key, _ in chunks))
        return out

    def committed(self, partition: int) -> None:
        """The transaction that holds ``partition``'s last round (:meth:`write`) committed:
        its jobs are written, and the chunk keys it replaced by tombstones hold no value any
        more."""
        pending = self._pending.pop(partition, None)
        if pending is None:
            return
        self._written.update(pending.written)
        self._chunks.update(pending.chunks)

    def forget(self, jobs: Iterable[str]) -> None:
        """Drop what is known of ``jobs``' snapshots (their partition was revoked)."""
        dropped = set(jobs)
        for job in dropped:
            self._written.pop(job, None)
            self._chunks.pop(job, None)
        for pending in self._pending.values():
            for job in dropped & pending.written.keys():
                del pending.written[job]
                pending.chunks.pop(job, None)
