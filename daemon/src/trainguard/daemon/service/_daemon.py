"""The daemon service: the shell around the pure state machine.

One loop per daemon process:

1. consume ``events`` as a member of the daemon's consumer group (one owner per partition,
   hence per job);
2. take each record in (:mod:`trainguard.daemon.core._intake`, shared with replay: ``ClockTick``
   records become :class:`Tick` inputs, everything else an :class:`Observed` event whose time
   is the record's append timestamp), fold it into its job's state with :func:`decide`, and
   act on the decisions: publish commands on ``commands``, committed training snapshots on
   ``manifests``, the decisions with the input's position and identity on ``audit`` (after
   the machine configuration, once per job and process: :mod:`trainguard.daemon.core._audit_entry`);
   rejected input goes to ``dead-letter`` with its reason (sender-controlled text bounded:
   :meth:`DaemonService._dead_letter`), except a routine late report of an ended job's final
   generation (a supervisor's ``exited`` after its ranks finished), which is counted
   (``trainguard_late_inputs_total``) and logged at debug level only;
3. when a job's :func:`next_deadline` has passed, or it has had nothing folded for ``pulse_s``
   (a pulse, :mod:`trainguard.daemon.service._pulse`), append a ``ClockTick`` to the job's event stream
   (so the timeout is decided when the tick is folded, and a replay of the log decides
   it at the same place); and as soon as a command of the job is on ``commands`` that the
   job's state does not yet know to be acted on (:func:`unacted_command`: just published, or
   published by a daemon that died before its tick), append a tick naming it. Every tick
   names the job's latest command on the bus (``command_seq``), so the timeouts a command
   starts count from when it was acted on, also when it was decided from an old input of a
   backlog. No tick is written while the bus cannot be reached, nor after an outage until the
   loop has folded what was appended meanwhile (:class:`~trainguard.daemon.service._bus_watch.BusWatch`,
   which probes the bus from a task of its own and tells readiness, lag and outages);
4. commit, per partition, everything written for the partition's records together with its
   consumed position, in one transaction (:mod:`trainguard.daemon.service._partitions`): every 2000 records
   or ``commit_interval_s``, whichever comes first, and when the loop ends.

Several instances, one owner per partition, exactly-once decisions: every write for a record
of partition ``p`` (commands, manifests, audit and dead-letter entries, ticks, snapshots) goes
through ``p``'s :class:`~trainguard.agent.bus.PartitionWriter` (on Kafka a transactional
producer with a transactional id per partition), so a decision becomes visible exactly when
the position past its input is committed. After every poll the loop compares the consumer's
assignment epoch; when it moved, it drops that poll's records and resyncs: closes every writer,
opens one per assigned partition (which fences the previous owner and settles its open
transaction), *then* reads the committed positions and rebuilds the jobs from there. A
transaction that fails is aborted and the partition rolled back to its last commit; a writer
that is fenced (a newer owner: this instance was paused or cut off) drops its partition's jobs
at once, logs it, and waits for the group to reassign; if no rebalance comes within a session
timeout, the loop rejoins the group.

Restart without a second decision: when a partition is assigned, the loop reads it again from
offset 0 (or its snapshots) and folds the records before the group's committed position
*silently* (rebuilding state, acting on nothing), then acts on the rest. Outputs of records
past the committed position were never committed (aborted by the new writer's opening), so
deriving them again sends nothing twice; a command already on the bus is still recognised
(same or newer generation in the job's latest command) and not sent again.

A bus that cannot be reached never ends the service: at the start, and when a call of the loop
fails for longer than the bus's timeouts (a retriable ``BusError``), it drops everything it
held and waits for the bus with the supervisor's helper
(:func:`~trainguard.agent.bus.patiently`; readiness says ``cannot reach the bus``), then serves
again from scratch, as a new instance: the restart rule above applies unchanged.

Authentication (with keys, :mod:`trainguard.daemon.service._security`): every command and committed
manifest is signed, every tick MACed with its job's event key, and intake refuses events whose
MAC is missing or wrong (dead-lettered, counted, and recorded on ``audit`` so that a replay
refuses them too); the key directory is reloaded every ``key_reload_s``.

Snapshots (with keys, :mod:`trainguard.daemon.service._snapshot_store`): every
``snapshot_interval_s`` (once a poll finds no record waiting) and on a clean shutdown the jobs
of each partition are written, signed and encrypted, at the partition's committed position; on
assignment the loop starts from them when they are all valid and complete, reading from the
oldest position they cover and skipping each job's records below its own snapshot's, which
gives the states (and decisions) of a fold from offset 0.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import orjson
import structlog

from trainguard.agent.bus import (
    Bus,
    BusError,
    Consumer,
    DeliveryFailed,
    Fenced,
    PartitionWriter,
    Record,
    Signalled,
    TopicPartition,
    TransactionExpired,
    TransactionInDoubt,
    close_soon,
    open_bus,
    patiently,
    serving_lock,
    started,
)
from trainguard.agent.checkpoint import store_manifest
from trainguard.agent.keys import DaemonKeys, KeyStoreError
from trainguard.daemon.core import (
    TERMINAL_PHASES,
    Anomaly,
    Committed,
    Decision,
    IncidentClosed,
    IncidentOpened,
    Issue,
    JobFailed,
    JobState,
    Observed,
    Refused,
    Rejected,
    Transition,
    config_entry,
    config_id,
    decide,
    decision_entry,
    new_job,
    next_deadline,
    refusal_entry,
    take,
    unacted_command,
)
from trainguard.daemon.service._bus_watch import BusWatch
from trainguard.daemon.service._metrics import DaemonMetrics
from trainguard.daemon.service._partitions import Books, CommitFailures, Owned
from trainguard.daemon.service._pruning import Pruning
from trainguard.daemon.service._pulse import Pulse
from trainguard.daemon.service._security import EventAuth
from trainguard.daemon.service._settings import DaemonConfig
from trainguard.daemon.service._snapshot_store import (
    Rebuild,
    SealedRound,
    SnapshotKeys,
    Snapshots,
)
from trainguard.schemas import (
    DEFAULT_MAX_BYTES,
    Abort,
    ClockTick,
    Command,
    HeartbeatBatch,
    JobRequest,
    JSONValue,
    Manifest,
    ManifestHead,
    MessageTooLarge,
    Restore,
    Resume,
    SchemaError,
    SplitManifest,
    add_mac,
    decode,
    encode,
    sign,
)

__all__ = ["DaemonService"]

_Signed = TypeVar("_Signed", bound=Restore | Resume | Abort | Manifest | ManifestHead)

log = structlog.get_logger("trainguard.daemon")

_STORE_TIMEOUT_S = 10.0
"""Longest wait for a committed manifest's write beside its checkpoint, seconds: a store that
does not answer must not hold the partition's fold for long (its commit stands without it)."""

_SIGNED_ROOM = 512
"""Bytes a signature and the record's framing add to a manifest, at most (an Ed25519
signature is 88 base64 characters with its key id and field names)."""

_DEAD_LETTER_VALUE_BYTES = 32 * 1024
"""Most bytes of a rejected value kept in its dead-letter entry (base64 grows it by 4/3)."""

_ECHO_KEY_CHARS = 256
"""Most characters of a rejected record's key echoed in its dead-letter entry, as that
entry's record key, and in the log (a job id has at most 128)."""

_ECHO_REASON_CHARS = 2048
"""Most characters of a rejection's reason written to ``dead-letter`` and the log: reasons
may quote what the sender wrote (a record key, say), which nothing else bounds."""

_WARNED_JOBS = 1000
"""Most record keys whose unauthentic events this process warns of (once each): the keys are
the senders', and nothing else bounds how many there are."""

_METRICS_INTERVAL_S = 2.0
"""Seconds between two updates of the gauges of jobs and partitions (a pass over every job)."""

COMMIT_FAILING_MIN_S = 10.0
"""``/healthz`` says not ready once a partition's transactions have failed for longer than
this many seconds (or three ``commit_interval_s``, whichever is longer) without a successful
commit: one failure is rolled back and retried at once, and a leader change settles within a
few seconds, but failures for longer mean the partition's decisions are not reaching the
agents."""

COMMIT_RECORDS = 2000
"""A partition's transaction is committed once it covers this many folded records (or
``commit_interval_s`` passed): a commit costs several round trips to the bus, so committing
less often keeps the fold's throughput with transactions near its throughput without."""

# A command supersedes another of the same generation in this order (restore, then resume,
# then abort), and one of the same generation and type with a higher seq (the abort refusing a
# continue after the abort that stopped the job), which is how a re-derived command (same
# generation, type and seq) is recognised as already sent.
_COMMAND_ORDER = {Restore: 0, Resume: 1, Abort: 2}


def _command_rank(command: Command) -> tuple[int, int, int]:
    return command.generation, _COMMAND_ORDER[type(command)], command.seq


class _Dropped(Exception):
    """The partition being written for was just rolled back or lost: stop working on it."""


def snapshot_round_starts(
    elapsed_s: float, folded: int, *, interval_s: float, interval_records: int, idle: bool
) -> bool:
    """Whether a round of state snapshots starts now, ``elapsed_s`` seconds and ``folded``
    records after the last one: when one is due (``interval_s`` elapsed, or
    ``interval_records`` folded; 0: by time only) and the loop is ``idle`` (its last poll found
    no record), or a whole interval of either kind late whatever the load
    (:meth:`DaemonService._write_snapshots` says why it waits for a pause)."""
    by_records = interval_records > 0
    due = elapsed_s >= interval_s or (by_records and folded >= interval_records)
    late = elapsed_s >= 2 * interval_s or (by_records and folded >= 2 * interval_records)
    return due and (idle or late)


class DaemonService:
    """Runs the state machine for every job on the bus partitions this instance owns.

    Args:
        config: bus, machine and loop settings.
        clock: wall clock in ns (injected for tests); used only to decide *when* to write a
            tick, never as an input to the machine.
        pulse_clock: the monotonic clock in seconds a job's quiet time is measured on for its
            pulse (:class:`~trainguard.daemon.service._pulse.Pulse`). ``trainguard sim`` passes
            its simulated time here and as ``clock``, so that on a bus whose append times it
            drives, pulses keep a silent job's inputs dense in simulated time.
        metrics: where to count what the service does; a fresh :class:`DaemonMetrics` (with
            a registry of its own) by default. ``trainguard daemon`` serves it over HTTP.
        keys: the daemon's signing and data keys; without them (or with
            ``config.snapshot_interval_s == 0``) no state snapshot is written or read.
            Commands and manifests are signed with them; a
            :class:`~trainguard.agent.keys._keystore.DaemonKeys` (``trainguard daemon`` loads one
            from the key directory) also holds the jobs' event keys, which intake checks
            events with. Without keys nothing is signed or verified (insecure).

    Raises:
        ValueError: ``config.security.require_auth`` without a ``DaemonKeys``.

    ``await service.run(stop)`` returns after ``stop`` is set (and the consumed positions are
    committed). A bus that cannot be reached, at the start or for longer than its timeouts
    later, is waited for (:meth:`run`); only a bus that cannot work raises
    :class:`~trainguard.agent.bus.BusError`.
    """

    def __init__(
        self,
        config: DaemonConfig,
        clock: Callable[[], int] = time.time_ns,
        metrics: DaemonMetrics | None = None,
        keys: SnapshotKeys | None = None,
        pulse_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._c = config
        self._clock = clock
        self._pulse_clock = pulse_clock
        # The dictionaries below are the books' (one object each, never rebound): rolling a
        # partition back (_partitions.Owned.rollback) updates them in place.
        self._books = Books()
        self.jobs: dict[str, JobState] = self._books.jobs
        self._partitions: dict[int, Owned] = {}
        self._job_partition: dict[str, int] = self._books.job_partition
        self._sent_commands: dict[str, Command] = self._books.sent_commands
        self._last_tick_ns: dict[str, int] = {}
        self._warned_unauthentic: set[str] = set()  # record keys (_warn_unauthentic)
        # job -> command seq its last tick named
        self._acted_ticks: dict[str, int] = self._books.acted_ticks
        self._tick_seq = itertools.count(1)
        self._config_id = config_id(config.machine)
        # jobs whose config entry this process wrote
        self._audited_jobs: set[str] = self._books.audited
        self._consumer: Consumer | None = None
        self._resync_needed = False  # a writer could not be opened, or a commit is in doubt
        self._rejoin_now = False  # a transaction expired: get a fresh assignment at once
        self._dropping: set[int] = set()  # partitions rolled back during the current poll
        self.ready = asyncio.Event()
        """Set once every assigned partition has been rebuilt up to its committed position."""
        self.counters: dict[str, int] = {"folded": 0, "rejected": 0, "commands": 0, "ticks": 0}
        self.metrics = metrics if metrics is not None else DaemonMetrics()
        self._metrics_due = 0.0
        self._keys = keys
        if config.security.require_auth and not isinstance(keys, DaemonKeys):
            raise ValueError("[security] require_auth = true needs the daemon's key directory")
        self._auth, self._rebuild_auth = self._event_auth()
        self._keys_due = time.monotonic() + config.security.key_reload_s
        self._snapshots = (
            Snapshots(config.machine, self.metrics, max_message_bytes=config.bus.max_message_bytes)
            if config.snapshot_interval_s > 0
            else None
        )
        self._snapshot_at = time.monotonic()  # the last round's start (none yet: the start)
        self._snapshot_folded = 0  # counters["folded"] at the last round
        # partition -> the round being sealed for it (in a worker thread), the partition as
        # owned when sealing began and its rollback count then
        self._sealing: dict[int, tuple[Owned, int, asyncio.Future[SealedRound]]] = {}
        # Manifests are stored on a thread of their own (:meth:`_store`).
        self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="trainguard-manifests")
        self._storing: Future[None] | None = None
        self._watch = BusWatch(
            self.metrics,
            self._positions,
            interval_s=config.probe_interval_s,
            timeout_s=config.probe_timeout_s,
        )
        self._pulse = Pulse(config.pulse_s)
        self._commit_failures = CommitFailures()
        self._pruning = Pruning(config, self.metrics) if config.retention.enabled else None
        self.metrics.follow_readiness(self.not_ready_reason)
        self.metrics.follow_commit_age(self._commit_failures.since_commit_s)

    def not_ready_reason(self) -> str | None:
        """Why this instance is not ready, or ``None`` when it is: it reaches the bus, owns
        partitions of ``events``, their transactions have not been failing for longer than
        :meth:`commit_failing_bound_s` without a successful commit, it has rebuilt their jobs
        up to the group's committed positions and is behind their end offsets by at most
        ``max_lag_records`` records.

        An instance that owns no partition (starting, or a standby in a group with more
        members than partitions) is not ready. Safe to call from another thread (``/healthz``).
        """
        unreachable = self._watch.outage_reason()
        if unreachable is not None:
            return unreachable
        if not self._partitions:
            return "no partition of events assigned to this instance"
        failing = self._commit_failures.not_ready_reason(self.commit_failing_bound_s())
        if failing is not None:
            return _cut(failing, _ECHO_REASON_CHARS)
        if not self.ready.is_set():
            return "rebuilding job states up to the committed positions"
        return self._watch.lag_reason(self._c.max_lag_records)

    def commit_failing_bound_s(self) -> float:
        """Seconds a partition's transactions may fail without a successful commit before the
        instance is not ready: :data:`COMMIT_FAILING_MIN_S`, or three ``commit_interval_s``
        if that is longer."""
        return max(COMMIT_FAILING_MIN_S, 3 * self._c.commit_interval_s)

    def _owned(self) -> frozenset[int]:
        """The partitions of ``events`` this instance owns now (a fenced one no longer)."""
        return frozenset(p for p, part in self._partitions.items() if part.writer is not None)

    def _positions(self) -> dict[int, int]:
        """Owned partition of ``events`` -> next offset to process."""
        return {p: part.position for p, part in self._partitions.items()}

    async def run(self, stop: asyncio.Event, *, standby: bool = False) -> None:
        """Consume, fold and act until ``stop`` is set.

        On the embedded bus the instance first takes the bus file's daemon lock and holds it
        until it returns: one daemon per file (:mod:`trainguard.agent.bus._sqlite_lock`).

        A bus that cannot be reached is waited for, at the start and whenever it fails under
        the loop for longer than its own timeouts (a retriable
        :class:`~trainguard.agent.bus.BusError`): :meth:`_serve_through_outages`.

        Args:
            stop: set to wind down (positions committed, snapshots written); while the
                instance waits for the bus it returns at once.
            standby: embedded bus: wait for the lock instead of refusing (returns at once when
                ``stop`` is set while waiting). Kafka: no effect.

        Raises:
            DaemonLockHeld: embedded bus, not ``standby``, and another daemon holds the lock;
                nothing was read or written.
            BusError: the bus cannot work (not retriable: a malformed URL, credentials the
                broker refuses, topics the cluster refuses to create).
        """
        async with serving_lock(self._c.bus, standby=standby, stop=stop) as serving:
            if serving:
                await self._serve_through_outages(stop)

    async def _serve_through_outages(self, stop: asyncio.Event) -> None:
        """:meth:`run` once this instance may serve the bus. Reach the bus (connect, join the
        consumer group), waiting out an outage
        (:func:`~trainguard.agent.bus.patiently`: back-off 0.1-2 s, ``bus outage: ...`` logged
        when it begins, every ``warn_every_s`` while it lasts, ``bus outage over`` when it
        ends; ``/healthz`` says ``cannot reach the bus``), then serve. When the bus fails under
        the loop (a retriable error), everything this instance held is dropped and it waits
        for the bus and serves again from scratch, as a new instance would: new consumer and
        writers, jobs rebuilt from the committed positions and snapshots.
        """
        failed: BusError | None = None
        while True:
            self._watch.connecting()
            try:
                bus, consumer = await patiently(
                    "reaching the bus",
                    self._connect,
                    stop,
                    warn_every_s=self._c.warn_every_s,
                    failed=failed,
                    bus=self._c.bus.url,
                    group=self._c.group,
                )
            except Signalled:
                log.info("daemon stopped while waiting for the bus", bus=self._c.bus.url)
                return
            try:
                await self._serve(bus, consumer, stop)
                return
            except BusError as exc:
                if not exc.retriable:
                    raise
                failed = exc
            self._drop_everything()
            if stop.is_set():  # the bus failed as the loop wound down: nothing to wait for
                log.error(
                    "daemon stopped: the bus failed as it wound down",
                    bus=self._c.bus.url,
                    error=str(failed),
                )
                return

    async def _connect(self) -> tuple[Bus, Consumer]:
        """One attempt to reach the bus: a started bus and a member of the daemon's consumer
        group on ``events``. A failed attempt closes what it opened; one the bus may answer
        later is an outage for :class:`BusWatch`.

        Raises:
            BusError: the bus cannot be reached (retriable) or cannot work.
        """
        try:
            bus = await started(open_bus(self._c.bus))
            try:
                return bus, await bus.subscribe(["events"], self._c.group)
            except BaseException:
                await close_soon(bus)
                raise
        except BusError as exc:
            if exc.retriable:
                self._watch.unreachable(f"{type(exc).__name__}: {exc}")
            raise

    def _drop_everything(self) -> None:
        """Forget every partition and job (their writers and consumer are closed): the
        instance holds nothing until it serves again."""
        if self._snapshots is not None:
            self._snapshots.forget(list(self.jobs))
        self._books.clear()
        self._partitions = {}
        self._drop_sealing()
        self._last_tick_ns.clear()
        self._consumer = None
        self._resync_needed = False
        self._rejoin_now = False
        self._dropping.clear()
        self._pulse = Pulse(self._c.pulse_s)
        self._commit_failures.keep(())
        self.ready.clear()
        self.metrics.observe_assignment(0, ())
        self.metrics.observe_lag({})

    async def _serve(self, bus: Bus, consumer: Consumer, stop: asyncio.Event) -> None:
        """Serve ``bus`` from ``consumer`` (a new member of the group) until ``stop`` is set;
        ``bus`` and ``consumer`` are closed on return.

        Raises:
            BusError: the bus failed under the loop.
        """
        try:
            self._consumer = consumer
            self._watch.start(bus)
            log.info("daemon started", group=self._c.group, bus=self._c.bus.url)
            pruning = self._start_pruning()
            if self._snapshots is None or self._keys is None:
                log.info(
                    "snapshots off: every start folds the events log from offset 0",
                    reason="no keys" if self._keys is None else "snapshot_interval_s = 0",
                )
            synced: int | None = None
            # A fault of the daemon's own (an exception that is no bus error) must not commit
            # the open transactions: their positions are past records whose decisions were
            # acted on only in part, which a restart would then never act on.
            crashed = False
            try:
                while not stop.is_set():
                    records = await consumer.getmany(timeout_s=self._c.poll_s, max_records=2000)
                    epoch = consumer.assignment_epoch()
                    if epoch != synced or self._resync_needed:
                        # The poll's records may predate the change: they are read again
                        # from the positions the resync seeks to.
                        synced = epoch
                        await self._resync(bus, consumer)
                    else:
                        self._dropping.clear()
                        await self._settle_done()
                        for record in records:
                            await self._process(record)
                        await self._advance(consumer)
                    if self._rejoin_due():
                        consumer = await self._rejoin(bus, consumer)
                        synced = None
                    await self._write_due_ticks(bus)
                    await self._commit()
                    await self._write_snapshots(idle=not records)
                    self._update_gauges()
                    self._reload_keys()
            except BusError as exc:
                if exc.retriable:  # readiness says so from now on, through the cleanup below
                    await self._watch.close()
                    self._watch.unreachable(f"{type(exc).__name__}: {exc}")
                raise
            except Exception:
                crashed = True
                raise
            finally:
                if pruning is not None:
                    pruning.cancel()
                    # A prune's worker thread runs on to its end; nothing waits for it here.
                    with contextlib.suppress(asyncio.CancelledError):
                        await pruning
                await self._watch.close()
                if not crashed:
                    await self._commit(force=True)
                if stop.is_set() and not crashed:  # a clean stop: the next start reads little
                    await self._write_snapshots(force=True)
                self._drop_sealing()
                await self._close_writers()
                if self._consumer is not None:
                    await self._consumer.close()
                if stop.is_set():
                    log.info("daemon stopped", folded=self.counters["folded"])
        finally:
            await bus.close()

    def _start_pruning(self) -> asyncio.Task[None] | None:
        """With ``[retention] enabled``: the task that prunes the checkpoints of the jobs this
        instance owns every ``interval_s`` (:class:`~trainguard.daemon.service._pruning.Pruning`),
        while the instance serves."""
        if self._pruning is None:
            return None
        log.info(
            "retention on: pruning the checkpoints of this instance's jobs",
            interval_s=self._c.retention.interval_s,
        )
        return asyncio.ensure_future(
            self._pruning.run(self.not_ready_reason, self._owned, lambda: self._keys)
        )

    # -- partitions --------------------------------------------------------------------------

    async def _resync(self, bus: Bus, consumer: Consumer) -> None:
        """Take on the consumer's current assignment from scratch (its epoch moved).

        Eager rebalancing revokes every partition before assigning, so every writer is closed
        and every job forgotten first. Then, for each assigned partition concurrently: open its
        writer (fencing the previous owner and settling its open transaction), and only then
        read the group's committed position, which is stable from that moment. The jobs are
        rebuilt from their snapshots and the log below that position, silently. The jobs'
        latest commands are read again from the bus, for the ticks that name them and so that
        a command already there is never sent twice.
        """
        self.ready.clear()
        self._resync_needed = False
        self._dropping.clear()
        if self._partitions:
            log.info("partitions revoked", partitions=sorted(self._partitions))
        # Commits in flight: whatever their outcome, the new writers settle it on the bus, and
        # the jobs are rebuilt from the committed positions read after that.
        flying = {p: part.committing[0] for p, part in self._partitions.items() if part.committing}
        outcomes = await asyncio.gather(*flying.values(), return_exceptions=True)
        for p, outcome in zip(flying, outcomes, strict=True):
            if isinstance(outcome, BusError):
                part = self._partitions[p]
                reason = self._note_failure(part, outcome)
                log.error(
                    f"{_FAILED_IN_RESYNC[reason]}; the partitions are taken on again",
                    reason=reason,
                    partition=p,
                    writer=_writer_id(part),
                    error=str(outcome),
                )
        await self._close_writers()
        for part in self._partitions.values():
            self._drop_jobs(part)
        self._partitions = {}
        self._drop_sealing()  # rounds of the partitions just dropped
        assigned = sorted(tp.partition for tp in consumer.assignment() if tp.topic == "events")
        # Failures of partitions still this instance's count on: taking them on again is no
        # commit.
        self._commit_failures.keep(assigned)
        if not assigned:
            return

        async def take_on(p: int) -> tuple[PartitionWriter, int]:
            writer = await bus.partition_writer(self._c.group, p)
            try:
                committed = await consumer.committed(TopicPartition("events", p))
            except BaseException:
                await writer.close()
                raise
            return writer, committed or 0

        results = await asyncio.gather(*(take_on(p) for p in assigned), return_exceptions=True)
        failed = [
            (p, r) for p, r in zip(assigned, results, strict=True) if isinstance(r, BaseException)
        ]
        if failed:
            for r in results:
                if isinstance(r, tuple):
                    await r[0].close()
            for p, exc in failed:
                if not isinstance(exc, Exception):
                    raise exc
                log.error("partition not taken on: retrying", partition=p, error=str(exc))
            self._resync_needed = True
            return
        taken = {p: r for p, r in zip(assigned, results, strict=True) if isinstance(r, tuple)}
        committed = {p: c for p, (_, c) in taken.items()}
        rebuilds: dict[int, Rebuild] = {}
        try:
            await self._load_sent_commands(bus)
            if self._snapshots is not None and self._keys is not None:
                rebuilds = await self._snapshots.load(bus, committed, self._keys)
        except BusError as exc:
            log.error("partitions not taken on: retrying", error=str(exc))
            await asyncio.gather(*(writer.close() for writer, _ in taken.values()))
            self._resync_needed = True
            return
        for p, (writer, position) in taken.items():
            part = Owned(p, writer, replay_until=position, committed=position)
            rebuild = rebuilds.get(p)
            if rebuild is not None:
                part.position = rebuild.start
                part.covered = dict(rebuild.covered)
                part.jobs = set(rebuild.states)
                self.jobs.update(rebuild.states)
                self._job_partition.update(dict.fromkeys(rebuild.states, p))
            if part.position >= part.replay_until:
                part.checkpoint(self._books)  # nothing to replay: the rollback point
            await consumer.seek(TopicPartition("events", p), part.position)
            self._partitions[p] = part
            log.info(
                "partition assigned",
                partition=p,
                replay_until=part.replay_until,
                start=part.position,
            )
        self._mark_ready()

    def _mark_ready(self) -> None:
        """Set :attr:`ready` once every owned partition is rebuilt up to its committed
        position."""
        if self.ready.is_set() or not self._caught_up():
            return
        self.ready.set()
        log.info("daemon ready", partitions=sorted(self._partitions), jobs=len(self.jobs))

    def _drop_jobs(self, part: Owned) -> None:
        self._books.forget(part.jobs)
        if self._snapshots is not None:
            self._snapshots.forget(part.jobs)
        part.jobs = set()

    async def _close_writers(self) -> None:
        writers = [part.writer for part in self._partitions.values() if part.writer is not None]
        for part in self._partitions.values():
            part.writer = None
        await asyncio.gather(*(writer.close() for writer in writers))

    def _note_failure(self, part: Owned, exc: BusError) -> str:
        """Count a failed transaction of ``part`` and record it for the health rule; returns
        its reason (:func:`_failure_reason`)."""
        reason = _failure_reason(exc)
        self.metrics.commit_failed(reason)
        self._commit_failures.failed(
            part.partition, reason, str(exc), _writer_id(part), part.committed_at
        )
        return reason

    async def _write_failed(self, part: Owned, exc: BusError) -> None:
        """A write, commit or abort of ``part``'s transaction failed: count it, and handle it
        by what happened. Fenced by a newer owner: drop the partition's jobs and wait for the
        rebalance (:meth:`_fenced`). Aborted by the broker after ``transaction.timeout.ms``:
        the same, and rejoin the group at once. In doubt: take every partition on again (a new
        writer settles the transaction, and the committed positions read after that say
        whether it committed). Anything else: abort and roll back (:meth:`_failed`)."""
        self._note_failure(part, exc)
        if isinstance(exc, TransactionInDoubt):
            self._in_doubt(part, exc)
        elif isinstance(exc, Fenced):
            await self._fenced(part, exc)
        else:
            await self._failed(part, exc)

    def _in_doubt(self, part: Owned, exc: TransactionInDoubt) -> None:
        """``part``'s commit is in doubt: stop working on the partition and take every
        partition on again at the next turn of the loop (:meth:`_resync`)."""
        log.error(
            "commit in doubt: taking every partition on again, a new writer settles it",
            partition=part.partition,
            writer=_writer_id(part),
            error=str(exc),
        )
        self._dropping.add(part.partition)
        self._resync_needed = True

    async def _fenced(self, part: Owned, exc: Fenced) -> None:
        """``part``'s writer is dead. Fenced: a newer owner has the partition (this instance
        was paused or cut off past the session timeout); expired: the broker aborted the
        transaction after ``transaction.timeout.ms`` (this instance or the broker was away
        that long), and the group may never reassign the partition on its own, so the loop
        rejoins it at once. Either way its jobs are dropped and its records skipped until the
        group assigns partitions again."""
        expired = isinstance(exc, TransactionExpired)
        log.error(
            "transaction expired: the broker aborted it after transaction.timeout.ms; "
            "the partition's jobs are dropped and the group rejoined"
            if expired
            else "partition lost: its writer was fenced; its jobs are dropped until the group "
            "assigns partitions again",
            partition=part.partition,
            writer=_writer_id(part),
            jobs=len(part.jobs),
            error=str(exc),
        )
        self._rejoin_now = self._rejoin_now or expired
        writer, part.writer = part.writer, None
        part.fenced_at = time.monotonic()
        self._drop_jobs(part)
        self._dropping.add(part.partition)
        # No longer believed owned: its failures say nothing of this instance's health.
        self._commit_failures.keep(q for q, o in self._partitions.items() if o.writer is not None)
        if writer is not None:
            await writer.close()

    async def _failed(self, part: Owned, exc: BusError) -> None:
        """A write or commit of ``part`` failed: abort its transaction and roll the partition
        back to its last commit, reading again from there. An abort that fails too is handled
        as what it says (fenced, expired, or in doubt: every partition is taken on again)."""
        self._dropping.add(part.partition)
        writer = part.writer
        assert writer is not None
        try:
            await writer.abort()
        except BusError as abort_failed:
            if not isinstance(abort_failed, Fenced | TransactionInDoubt):
                abort_failed = TransactionInDoubt(str(abort_failed))
            await self._write_failed(part, abort_failed)
            return
        part.rollback(self._books)
        log.warning(
            "transaction aborted: partition rolled back to its last commit",
            partition=part.partition,
            writer=writer.writer_id,
            position=part.position,
            error=str(exc),
        )
        assert self._consumer is not None
        await self._consumer.seek(TopicPartition("events", part.partition), part.position)

    async def _advance(self, consumer: Consumer) -> None:
        """Move each partition's position past offsets that carry no record (transaction
        markers, the daemon's own among them), so that the committed position of a caught-up
        partition is its end offset: lag reads 0, and agents watching the group's position
        see their records consumed. Every offset below the consumer's position was returned
        by a poll, hence folded (or was a marker)."""
        for p, part in self._partitions.items():
            if part.writer is None or p in self._dropping or part.committing is not None:
                continue
            try:
                position = await consumer.position(TopicPartition("events", p))
            except BusError:
                continue  # just rebalanced away: the next poll's epoch says so
            part.position = max(part.position, position)
            if part.at_commit is None and part.position >= part.replay_until:
                part.checkpoint(self._books)  # the rebuild is done: the rollback point
        self._mark_ready()

    def _rejoin_due(self) -> bool:
        """A transaction expired, or a writer was fenced and no rebalance followed within a
        session timeout."""
        if self._rejoin_now:
            return True
        timeout = self._c.bus.session_timeout_s
        now = time.monotonic()
        return any(
            part.fenced_at is not None and now - part.fenced_at > timeout
            for part in self._partitions.values()
        )

    async def _rejoin(self, bus: Bus, consumer: Consumer) -> Consumer:
        log.warning(
            "rejoining the group after an expired transaction"
            if self._rejoin_now
            else "no rebalance followed a fenced writer within the session timeout: rejoining",
            group=self._c.group,
        )
        self._rejoin_now = False
        await consumer.close()
        self._consumer = await bus.subscribe(["events"], self._c.group)
        self._resync_needed = True
        return self._consumer

    async def _out(self, partition: int, topic: str, key: str, value: bytes | None) -> None:
        """Send one record in ``partition``'s transaction.

        Raises:
            _Dropped: the partition is not (any more) this instance's, or its transaction
                failed and it was rolled back: whatever was being done for it stops.
        """
        part = self._partitions.get(partition)
        if part is not None and part.committing is not None:
            await self._settle(part)
        if part is None or part.writer is None or partition in self._dropping:
            raise _Dropped
        try:
            await part.writer.send(topic, key, value)
        except DeliveryFailed as exc:
            # Over max_message_bytes, refused before it joined the transaction, which goes on:
            # rolling back would only meet the same record again.
            log.error("record not written", topic=topic, key=key[:256], error=str(exc))
            return
        except BusError as exc:
            await self._write_failed(part, exc)
            raise _Dropped from exc
        part.wrote = True

    def _caught_up(self) -> bool:
        return all(p.position >= p.replay_until for p in self._partitions.values())

    async def _load_sent_commands(self, bus: Bus) -> None:
        self._books.loaded_commands.clear()
        for job, record in (await bus.latest_per_key("commands")).items():
            if record.value is None:
                continue
            try:
                command = decode(record.value, expect=(Restore, Resume, Abort))
            except SchemaError:
                continue
            self._sent_commands[job] = command  # type: ignore[assignment]
            self._books.loaded_commands[job] = command  # type: ignore[assignment]

    # -- folding -----------------------------------------------------------------------------

    async def _process(self, record: Record) -> None:
        part = self._partitions.get(record.partition)
        if part is not None and part.committing is not None:
            await self._settle(part)
        if part is None or part.writer is None or record.partition in self._dropping:
            return  # fenced, or rolled back during this poll: read again from the seek
        if record.offset < part.position:
            return  # redelivered after a seek
        silent = record.offset < part.replay_until
        if not silent and part.at_commit is None:
            part.checkpoint(self._books)  # the rebuild is done: the rollback point
        part.position = record.offset + 1
        part.folded += 1
        try:
            await self._fold(part, record, silent)
        except _Dropped:
            return

    async def _fold(self, part: Owned, record: Record, silent: bool) -> None:
        """Fold ``record`` into its job and act on the decisions (unless ``silent``).

        Raises:
            _Dropped: the partition was rolled back or lost while acting.
        """
        if record.key is not None and record.offset < part.covered.get(record.key, 0):
            return  # folded into the job's snapshot already
        taken = take(record, self._rebuild_auth if silent else self._auth)
        if isinstance(taken, Refused):
            if not silent:
                self.metrics.refused(taken)
                if taken.auth is not None:
                    self._warn_unauthentic(record, taken)
                    await self._audit_refusal(record, taken)
                await self._dead_letter(record, taken.reason)
            return
        item, job = taken.input, taken.job_id
        state = self.jobs.get(job)
        if state is None:
            state = new_job(job)
            part.jobs.add(job)
            self._job_partition[job] = record.partition
        if (
            state.phase in TERMINAL_PHASES
            and isinstance(item, Observed)
            and not isinstance(item.event, JobRequest)  # the machine judges requests itself
            and not silent
        ):
            # The machine ignores input for an ended job. Late reports of the job's own final
            # generation (a supervisor's exit after its ranks finished, or its workers' exits
            # after a stop) are routine: counted. Anything else is parked and said, since the
            # usual cause is a new run started under an old job id (or a supervisor started
            # without --continue).
            if _late_report(state, item):
                self.metrics.late(item)
                log.debug(
                    "late input for an ended job ignored",
                    job_id=job,
                    phase=state.phase,
                    generation=state.generation,
                    rank=item.event.rank,
                    offset=record.offset,
                )
            else:
                self.metrics.rejected("ended_job")
                await self._dead_letter(
                    record,
                    f"job {job!r} has {state.phase} (generation {state.generation}): input for "
                    "it is ignored; a new run needs a new job id"
                    + (
                        " (or: trainguard run --continue)"
                        if state.phase in ("stopped", "failed")
                        else ""
                    ),
                )
        new_state, decisions = decide(state, item, self._c.machine)
        self.jobs[job] = new_state
        self.counters["folded"] += 1
        self.metrics.folded(item)
        if not silent and decisions:
            self.metrics.decided(state, new_state, decisions)
            await self._act(record, job, decisions, taken.input_id)
        if silent and part.position >= part.replay_until:
            self._mark_ready()

    # -- acting ------------------------------------------------------------------------------

    async def _act(
        self,
        record: Record,
        job: str,
        decisions: tuple[Decision, ...],
        identity: dict[str, JSONValue],
    ) -> None:
        p = record.partition
        for decision in decisions:
            match decision:
                case Issue(command=command):
                    await self._issue(p, job, command)
                case Committed(manifest=manifest, split=split):
                    await self._publish_commit(p, job, manifest, split)
                case Rejected(reason=reason):
                    self.counters["rejected"] += 1
                    await self._dead_letter(record, reason)
                case JobFailed(reason=reason):
                    log.error("job failed", job_id=job, reason=reason)
                case Anomaly(kind="checkpoint_mismatch", reason=reason):
                    # Every shard of a step is in and the step still cannot commit: the job
                    # runs unprotected until one does.
                    log.error("step not committed", job_id=job, reason=reason)
                case IncidentOpened() | Anomaly():
                    # What an operator should look at: a stall, a divergence, a straggler, a
                    # suspect host.
                    log.warning(decision.KIND, job_id=job, **_log_fields(decision))
                case IncidentClosed() | Transition():
                    log.info(decision.KIND, job_id=job, **_log_fields(decision))
        if job not in self._audited_jobs:
            # The configuration the job's decisions are made under, before the first of them.
            await self._out(p, "audit", job, orjson.dumps(config_entry(job, self._c.machine)))
            self._audited_jobs.add(job)
        audit = decision_entry(
            job,
            partition=record.partition,
            offset=record.offset,
            at_ms=record.timestamp_ms,
            identity=identity,
            config=self._config_id,
            decisions=decisions,
        )
        # In the transaction of the position past its input: a decision acted on is never
        # without its record, nor recorded without having been acted on.
        await self._out(p, "audit", job, orjson.dumps(audit))

    async def _publish_commit(
        self, partition: int, job: str, manifest: Manifest, split: SplitManifest
    ) -> None:
        """Store a committed snapshot's manifest beside its checkpoint (``split``: head and
        parts, what a restore command's reference names), then publish it signed on
        ``manifests``: whole when it fits both a record and the codec's default limit its
        readers decode with (:data:`~trainguard.schemas.DEFAULT_MAX_BYTES`, 64 KiB: about 350
        ranks), else its head (``docs/checkpoints.md``, "Manifests").

        The write comes before the record joins the partition's transaction, so a committed
        record on ``manifests`` means the manifest was stored, unless storing failed or was
        refused: that is counted and logged (a warning when the whole manifest is on the bus
        for restores to read, an error when only its head is), never fatal: the commit
        stands. Storing runs on a thread of its own and is given :data:`_STORE_TIMEOUT_S`;
        one that has not answered by then is left to finish, and until it has, later
        manifests are not stored (storage that hangs stalls the fold once, not per commit,
        and ties up no other thread). A head too large for a record is stored only.
        """
        # Readers decode ``manifests`` with the codec's default limit, so a whole manifest
        # goes on the bus only within it (and within the bus's record size). Its size,
        # about: its parts and head (the parts' framing aside); exactly: its encoding.
        limit = min(self._c.bus.max_message_bytes, DEFAULT_MAX_BYTES)
        whole = len(split.head_bytes) + sum(len(p) for p in split.parts) + _SIGNED_ROOM
        value: bytes | None = None
        if whole <= limit:
            with contextlib.suppress(MessageTooLarge):
                value = encode(self._sign(manifest), max_bytes=limit)
        fits = value is not None
        if value is None:
            with contextlib.suppress(MessageTooLarge):
                value = encode(self._sign(split.head), max_bytes=limit)
        stored = await self._store(split)
        if stored is not None:
            self.metrics.manifest_stored(False)
            # Published whole, the manifest still serves restores from the bus; as a head
            # only, a restore to this snapshot fails over to an older one.
            (log.warning if fits else log.error)(
                "manifest not stored beside the checkpoint",
                job_id=job,
                snapshot=manifest.snapshot_id,
                folder=split.ref.folder,
                error=stored,
                restores_read="the bus" if fits else "nothing: an older snapshot is used",
            )
        else:
            self.metrics.manifest_stored(True)
        if value is None:
            log.error(
                "manifest head larger than a record: not published on manifests",
                job_id=job,
                snapshot=manifest.snapshot_id,
                head_bytes=len(split.head_bytes),
                limit=limit,
            )
        else:
            await self._out(partition, "manifests", job, value)
        log.info("committed", job_id=job, snapshot=manifest.snapshot_id, step=manifest.step)

    async def _store(self, split: SplitManifest) -> str | None:
        """Store ``split`` beside its checkpoint (:meth:`_publish_commit`); ``None`` when it
        was, else why not. Never raises: a storage library may raise anything."""
        if self._storing is not None and not self._storing.done():
            return f"an earlier manifest's store has not returned for over {_STORE_TIMEOUT_S:g} s"
        self._storing = self._store_thread.submit(store_manifest, split)
        try:
            await asyncio.wait_for(asyncio.wrap_future(self._storing), _STORE_TIMEOUT_S)
        except TimeoutError:
            return f"storage did not answer within {_STORE_TIMEOUT_S:g} s"
        except Exception as exc:  # fsspec back-ends raise what they like
            return f"{type(exc).__name__}: {exc}"
        return None

    async def _issue(self, partition: int, job: str, command: Command) -> None:
        sent = self._sent_commands.get(job)
        if sent is not None and _command_rank(sent) >= _command_rank(command):
            log.info("command already sent", job_id=job, generation=command.generation)
            return
        await self._out(partition, "commands", job, encode(self._sign(command)))
        self._sent_commands[job] = command
        self.counters["commands"] += 1
        self.metrics.issued(command, self.jobs[job].incident)
        log.warning(
            f"{type(command).__name__.lower()} issued",
            job_id=job,
            generation=command.generation,
            **({"reason": command.reason} if isinstance(command, Restore | Abort) else {}),
        )

    async def _audit_refusal(self, record: Record, refused: Refused) -> None:
        """Record on ``audit`` that ``record`` was refused as not authentic, in the
        transaction of its position: a replay (which holds no keys) refuses it from there."""
        assert refused.auth is not None  # an authentication refusal
        entry = refusal_entry(
            record.key or "",
            partition=record.partition,
            offset=record.offset,
            at_ms=record.timestamp_ms,
            value=record.value or b"",
            code=refused.auth,
            reason=refused.reason,
        )
        await self._out(record.partition, "audit", record.key or "", orjson.dumps(entry))

    def _warn_unauthentic(self, record: Record, refused: Refused) -> None:
        """Warn once per record key (at most :data:`_WARNED_JOBS` of them) that its events
        are refused as not authentic: a job whose every event is refused trains unwatched, and
        each refusal alone is only an ``input rejected`` line of many."""
        key = (record.key or "")[:_ECHO_KEY_CHARS]
        if key in self._warned_unauthentic or len(self._warned_unauthentic) >= _WARNED_JOBS:
            return
        self._warned_unauthentic.add(key)
        log.warning(
            "events of a job refused as not authentic: the job is not watched until its "
            "agents send them with its event key (TRAINGUARD_EVENT_KEY; docs/security.md); "
            "said once per job, each refusal is dead-lettered",
            key=key,
            reason=_cut(refused.reason, _ECHO_REASON_CHARS),
        )

    async def _dead_letter(self, record: Record, reason: str) -> None:
        """Park ``record`` on ``dead-letter`` with ``reason``.

        Everything the sender controls is bounded, so that an oversized input cannot make its
        own dead-letter entry undeliverable (over the bus's ``max_message_bytes``) nor flood
        the log: a value over :data:`_DEAD_LETTER_VALUE_BYTES` is cut, its record key over
        :data:`_ECHO_KEY_CHARS` likewise (both with their full size and SHA-256 kept, so the
        original stays identifiable), and the reason over :data:`_ECHO_REASON_CHARS`. An entry
        is then at most about 60 KiB.
        """
        value = record.value or b""
        key = record.key or ""
        short_key = key[:_ECHO_KEY_CHARS]
        said = _cut(reason, _ECHO_REASON_CHARS)
        entry = {
            "reason": said,
            "topic": record.topic,
            "partition": record.partition,
            "offset": record.offset,
            "key": None if record.key is None else short_key,
            "key_chars": len(key),
            "key_sha256": hashlib.sha256(key.encode(errors="surrogatepass")).hexdigest(),
            "key_truncated": len(key) > _ECHO_KEY_CHARS,
            "value_bytes": len(value),
            "value_sha256": hashlib.sha256(value).hexdigest(),
            "value_b64": base64.b64encode(value[:_DEAD_LETTER_VALUE_BYTES]).decode(),
            "truncated": len(value) > _DEAD_LETTER_VALUE_BYTES,
        }
        log.info(
            "input rejected",
            reason=said,
            key=short_key,
            key_chars=len(key),
            partition=record.partition,
            offset=record.offset,
        )
        await self._out(record.partition, "dead-letter", short_key, orjson.dumps(entry))

    # -- snapshots ---------------------------------------------------------------------------

    async def _write_snapshots(self, *, force: bool = False, idle: bool = True) -> None:
        """Every ``snapshot_interval_s`` or ``snapshot_interval_records`` folded records,
        whichever comes first, once the loop is ``idle`` (its last poll found no record) or a
        whole interval (of either kind) late (or now, with ``force``): for each partition
        caught up with its committed position, seal a round of snapshots of its jobs at its
        position ``P`` in a worker thread while the loop folds on (at 16,384 ranks a round is
        about 0.3 s of CPU, which would otherwise hold back every record behind it). The
        thread still takes the interpreter's lock from the fold, and each of the loop's awaits
        then waits out a switch interval to get it back: a seal begun inside a burst of
        records made the burst last up to twice as long (``bench/RESULTS.md``), so a due
        round waits for a pause. A sealed round is sent in the partition's open transaction,
        which is then committed: its position is ``P`` or later, so a round is visible only
        once everything below ``P`` has been acted on (``_snapshot_store``, "Writing"). A
        round whose partition was lost, taken on again or rolled back meanwhile is dropped; a
        partition whose commit fails waits for the next round. With ``force`` (a clean stop)
        the rounds are sealed, sent and committed before this returns."""
        keys = self._keys
        if self._snapshots is None or keys is None:
            return
        await self._send_sealed(wait=force)
        every = self._c.snapshot_interval_records
        folded = self.counters["folded"]
        now = time.monotonic()
        if not force and not snapshot_round_starts(
            now - self._snapshot_at,
            folded - self._snapshot_folded,
            interval_s=self._c.snapshot_interval_s,
            interval_records=every,
            idle=idle,
        ):
            return
        self._snapshot_at = now
        self._snapshot_folded = folded
        for part in self._partitions.values():
            p = part.partition
            if (
                not part.jobs
                or part.writer is None
                or part.position < part.replay_until
                or p in self._dropping
                or p in self._sealing
            ):
                continue
            states = {job: self.jobs[job] for job in part.jobs}
            sealing = self._snapshots.seal(p, part.position, states, keys)
            self._sealing[p] = (part, part.rollbacks, asyncio.ensure_future(sealing))
        if force:
            await self._send_sealed(wait=True)

    async def _send_sealed(self, *, wait: bool = False) -> None:
        """Send each round sealed by now (every round being sealed, with ``wait``) and commit
        its partition (:meth:`_write_snapshots`)."""
        snapshots = self._snapshots
        if snapshots is None or not self._sealing:
            return
        if wait:
            await asyncio.wait([task for _, _, task in self._sealing.values()])

        async def one(p: int) -> None:
            part, rollbacks, task = self._sealing.pop(p)
            sealed = task.result()
            if self._partitions.get(p) is not part:
                return  # taken on again since: the old partition object is done with
            await self._settle(part)
            writer = part.writer
            # After a rollback the partition is below the round's position, or folded past
            # it again perhaps under other keys (a reload): the round is the old fold's.
            if writer is None or p in self._dropping or part.rollbacks != rollbacks:
                return
            try:
                written = await snapshots.send(writer, sealed)
            except BusError as exc:
                await self._write_failed(part, exc)
                return
            part.wrote = part.wrote or written > 0
            self._start_commit(part)
            if await self._settle(part):
                snapshots.committed(p)
                if written:
                    log.info("snapshots written", partition=p, offset=sealed.position, jobs=written)

        done = [p for p, (_, _, task) in self._sealing.items() if task.done()]
        await asyncio.gather(*(one(p) for p in done))

    def _drop_sealing(self) -> None:
        """Forget the rounds being sealed (the loop ends): their threads run to their end,
        nothing is sent."""
        for _, _, task in self._sealing.values():
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: asyncio would log it as never retrieved
            task.cancel()
        self._sealing.clear()

    # -- keys --------------------------------------------------------------------------------

    def _event_keys(self) -> DaemonKeys | None:
        """The keys when they include the jobs' event keys (a key directory's), else ``None``."""
        return self._keys if isinstance(self._keys, DaemonKeys) else None

    def _event_auth(self) -> tuple[EventAuth, EventAuth]:
        """Intake's authenticators for fresh records and for a rebuild (retired keys too)."""
        keys, required = self._event_keys(), self._c.security.require_auth
        return (
            EventAuth(keys, require=required),
            EventAuth(keys, require=required, rebuilding=True),
        )

    def _sign(self, message: _Signed) -> _Signed:
        """``message`` signed with the current signing key, or as it is without keys."""
        if self._keys is None:
            return message
        return sign(message, self._keys.signing_kid, self._keys.signing)

    def _reload_keys(self) -> None:
        """Every ``key_reload_s``: read the key directory again, so that rotations (a new
        signing key, a job's new event key) and retirements take effect without a restart. A
        directory that fails to load keeps the keys in use (logged)."""
        keys = self._event_keys()
        if keys is None or keys.store is None or time.monotonic() < self._keys_due:
            return
        self._keys_due = time.monotonic() + self._c.security.key_reload_s
        try:
            fresh = keys.store.load_daemon_keys()
        except KeyStoreError as exc:
            log.error("keys not reloaded: keeping the keys in use", error=str(exc))
            return
        if fresh.signing_kid != keys.signing_kid:
            log.info("signing key rotated", kid=fresh.signing_kid, previous=keys.signing_kid)
        self._keys = fresh
        self._auth, self._rebuild_auth = self._event_auth()

    # -- time --------------------------------------------------------------------------------

    async def _write_due_ticks(self, bus: Bus) -> None:
        """Append a ``ClockTick`` to each job whose next deadline has passed, to each job
        whose latest command is on the bus but not yet known acted on in its state (at once:
        the command's timeouts wait for it), and to each job due a pulse (:class:`Pulse`).
        Each tick names the job's latest command on the bus. None while :class:`BusWatch` holds
        ticks back (the bus away, or its backlog not folded yet)."""
        if self._watch.holding():
            return  # the log of the outage comes first
        if not self.ready.is_set():
            return  # deadlines of a half-rebuilt state mean nothing
        now = self._clock()
        quiet_clock = self._pulse_clock()
        min_gap = int(self._c.tick_interval_s * 1e9)
        self._pulse.keep(self.jobs)
        # A copy: a failed write rolls its partition's jobs back (or drops them) meanwhile.
        for job, state in list(self.jobs.items()):
            pulse = self._pulse.due(job, state, quiet_clock)
            if state.phase in TERMINAL_PHASES:
                continue
            sent = self._sent_commands.get(job)
            on_bus = 0 if sent is None else sent.seq
            unacted = unacted_command(state)
            acting = (
                unacted is not None
                and on_bus >= unacted
                and self._acted_ticks.get(job, 0) < unacted
            )
            due = next_deadline(state, self._c.machine)
            if not (acting or pulse) and (
                due is None or now < due or now - self._last_tick_ns.get(job, 0) < min_gap
            ):
                continue
            self._last_tick_ns[job] = now
            self._pulse.ticked(job, state, quiet_clock)
            tick = ClockTick(
                job_id=job,
                generation=state.generation,
                ts=now,
                seq=next(self._tick_seq),
                daemon_id=self._c.machine.daemon_id,
                command_seq=on_bus,
            )
            keys = self._event_keys()
            try:
                event_key = keys.current_event_key(job) if keys is not None else None
            except KeyStoreError as exc:
                # Unusable key files: every input of the job is refused (key_error) until the
                # operator fixes them; a tick could not be judged either.
                log.error(
                    "tick not written: the job's event keys cannot be used",
                    job_id=job,
                    error=str(exc),
                )
                continue
            if event_key is not None:
                tick = add_mac(tick, *event_key)
            try:
                await self._out(self._job_partition[job], "events", job, encode(tick))
            except _Dropped:
                continue
            self._acted_ticks[job] = on_bus
            self.counters["ticks"] += 1
            self.metrics.tick_written()

    def _update_gauges(self) -> None:
        """Every :data:`_METRICS_INTERVAL_S`: partitions owned, jobs per phase. (Consumer lag
        and the bus gauges come from the :class:`BusWatch` probes, readiness from
        :meth:`not_ready_reason` at each scrape: nothing here waits for the bus.)"""
        now = time.monotonic()
        if now < self._metrics_due:
            return
        self._metrics_due = now + _METRICS_INTERVAL_S
        self.metrics.observe_assignment(len(self._partitions), self.jobs.values())

    async def _commit(self, *, force: bool = False) -> None:
        """Start committing the transaction of each partition that is due
        (:meth:`Owned.commit_due`: :data:`COMMIT_RECORDS` folded or ``commit_interval_s``
        passed), partitions concurrently, without waiting: the loop polls and folds the other
        partitions meanwhile (a commit is several round trips to the bus). With ``force``
        (the loop's end), commit every partition and wait for the outcomes."""
        now = time.monotonic()
        interval = 0.0 if force else self._c.commit_interval_s
        if force:
            await self._settle_all()
        for part in self._partitions.values():
            if part.commit_due(now, COMMIT_RECORDS, interval):
                self._start_commit(part)
        if force:
            await self._settle_all()

    def _start_commit(self, part: Owned) -> None:
        """Start committing everything sent for ``part`` and its position (once past the
        committed one); :meth:`_settle` takes the outcome in."""
        writer = part.writer
        if writer is None or part.committing is not None:
            return
        offsets = (
            {TopicPartition("events", part.partition): part.position}
            if part.position > part.committed and part.position >= part.replay_until
            else {}
        )
        if not offsets and not part.wrote:
            return  # nothing to commit
        part.committing = (asyncio.ensure_future(writer.commit(offsets)), part.position)

    async def _settle(self, part: Owned) -> bool:
        """Wait for ``part``'s commit in flight, if any, and take its outcome in: the new
        rollback point, or the partition rolled back (failure) or dropped (fenced). Returns
        whether a commit succeeded."""
        if part.committing is None:
            return False
        commit, position = part.committing
        part.committing = None
        try:
            await commit
        except BusError as exc:
            await self._write_failed(part, exc)
            return False
        if position >= part.replay_until:
            part.committed_now(self._books, position)
        self._commit_failures.succeeded(part.partition)
        return True

    async def _settle_done(self) -> None:
        """Take in the outcome of every commit that finished (right after a poll, before its
        records are folded: a partition rolled back now drops its records of that poll)."""
        for part in list(self._partitions.values()):
            if part.committing is not None and part.committing[0].done():
                await self._settle(part)

    async def _settle_all(self) -> None:
        for part in list(self._partitions.values()):
            await self._settle(part)


def _late_report(state: JobState, item: Observed) -> bool:
    """``item`` is a routine late report for the ended job ``state``: an event of its final
    generation from a sender (rank or supervisor, host, pid) that generation already heard
    from, e.g. the supervisor's ``exited`` after the ranks' ``finished``; a batch of
    heartbeats when every heartbeat in it is one."""
    event = item.event
    reports = event.heartbeats() if isinstance(event, HeartbeatBatch) else (event,)
    return all(
        r.generation == state.generation and (r.rank, r.host, r.pid) in state.senders
        for r in reports
    )


_FAILED_IN_RESYNC = {
    "fenced": "partition lost: its writer was fenced",
    "expired": "transaction expired: the broker aborted it after transaction.timeout.ms",
    "in_doubt": "commit in doubt",
    "failed": "transaction failed",
}
"""How a commit that fails while the partitions are taken on again is logged, by reason."""


def _failure_reason(exc: BusError) -> str:
    """The ``reason`` label of a failed transaction: ``expired``, ``fenced``, ``in_doubt`` or
    ``failed``."""
    if isinstance(exc, TransactionExpired):
        return "expired"
    if isinstance(exc, Fenced):
        return "fenced"
    if isinstance(exc, TransactionInDoubt):
        return "in_doubt"
    return "failed"


def _writer_id(part: Owned) -> str:
    """How the bus names ``part``'s writer, for logs (``-`` once it is gone)."""
    return "-" if part.writer is None else part.writer.writer_id


def _cut(text: str, limit: int) -> str:
    """``text``, or its first ``limit`` characters and how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters cut)"


def _log_fields(decision: Decision) -> dict[str, object]:
    out: dict[str, object] = dict(decision.to_dict())
    out.pop("decision", None)
    return out
