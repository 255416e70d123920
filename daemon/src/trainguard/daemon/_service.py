"""The daemon service: the shell around the pure state machine.

One loop per daemon process:

1. consume ``events`` as a member of the daemon's consumer group (one owner per partition,
   hence per job);
2. take each record in (:mod:`trainguard.daemon._intake`, shared with replay: ``ClockTick``
   records become :class:`Tick` inputs, everything else an :class:`Observed` event whose time
   is the record's append timestamp), fold it into its job's state with :func:`decide`, and
   act on the decisions: publish commands on ``commands``, committed training snapshots on
   ``manifests``, the decisions with the input's position and identity on ``audit`` (after
   the machine configuration, once per job and process: :mod:`trainguard.daemon._audit`);
   rejected input goes to ``dead-letter`` with its reason (sender-controlled text bounded:
   :meth:`DaemonService._dead_letter`), except a routine late report of an ended job's final
   generation (a supervisor's ``exited`` after its ranks finished), which is counted
   (``trainguard_late_inputs_total``) and logged at debug level only;
3. when a job's :func:`next_deadline` has passed, or it has had nothing folded for ``pulse_s``
   (a pulse, :mod:`trainguard.daemon._pulse`), append a ``ClockTick`` to the job's event stream
   (so the timeout is decided when the tick is folded, and a replay of the log decides
   it at the same place); and as soon as a command of the job is on ``commands`` that the
   job's state does not yet know to be acted on (:func:`unacted_command`: just published, or
   published by a daemon that died before its tick), append a tick naming it. Every tick
   names the job's latest command on the bus (``command_seq``), so the timeouts a command
   starts count from when it was acted on, also when it was decided from an old input of a
   backlog. No tick is written while the bus cannot be reached, nor after an outage until the
   loop has folded what was appended meanwhile (:class:`~trainguard.daemon._buswatch.BusWatch`,
   which probes the bus from a task of its own and tells readiness, lag and outages);
4. commit the consumed positions after acting.

Restart without a second decision: when a partition is assigned, the loop reads it again from
offset 0 and folds the records before the group's committed position *silently* (rebuilding
state, acting on nothing), then acts on the rest. A crash between acting and committing makes
the loop derive the same decisions again; commands already on the bus are recognised (same or
newer generation in the job's latest command) and not sent twice.

Authentication (with keys, :mod:`trainguard.daemon._security`): every command and committed
manifest is signed, every tick MACed with its job's event key, and intake refuses events whose
MAC is missing or wrong (dead-lettered, counted, and recorded on ``audit`` so that a replay
refuses them too); the key directory is reloaded every ``key_reload_s``.

Snapshots (with keys, :mod:`trainguard.daemon._snapshots`): every ``snapshot_interval_s`` and
on a clean shutdown the jobs of each partition are written, signed and encrypted, at the
partition's committed position; on assignment the loop starts from them when they are all
valid and complete, reading from the oldest position they cover and skipping each job's records
below its own snapshot's, which gives the states (and decisions) of a fold from offset 0.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
import structlog

from trainguard.agent._keystore import DaemonKeys, KeyStoreError
from trainguard.agent.bus import Bus, BusError, Consumer, Record, TopicPartition, open_bus
from trainguard.agent.bus._sqlite_lock import serving_lock
from trainguard.daemon._audit import config_entry, config_id, decision_entry, refusal_entry
from trainguard.daemon._buswatch import BusWatch
from trainguard.daemon._decisions import (
    Anomaly,
    Committed,
    Decision,
    IncidentClosed,
    IncidentOpened,
    Issue,
    JobFailed,
    Rejected,
    Transition,
)
from trainguard.daemon._inputs import Observed
from trainguard.daemon._intake import Refused, take
from trainguard.daemon._machine import decide, next_deadline, unacted_command
from trainguard.daemon._metrics import DaemonMetrics
from trainguard.daemon._pulse import Pulse
from trainguard.daemon._security import EventAuth
from trainguard.daemon._settings import DaemonConfig
from trainguard.daemon._snapshots import Rebuild, SnapshotKeys, Snapshots
from trainguard.daemon._state import TERMINAL_PHASES, JobState, new_job
from trainguard.schemas import (
    Abort,
    ClockTick,
    Command,
    JobRequest,
    JSONValue,
    Manifest,
    Restore,
    Resume,
    SchemaError,
    add_mac,
    decode,
    encode,
    sign,
)

__all__ = ["DaemonService"]

_Signed = TypeVar("_Signed", bound=Restore | Resume | Abort | Manifest)

log = structlog.get_logger("trainguard.daemon")

_DEAD_LETTER_VALUE_BYTES = 32 * 1024
"""Most bytes of a rejected value kept in its dead-letter entry (base64 grows it by 4/3)."""

_ECHO_KEY_CHARS = 256
"""Most characters of a rejected record's key echoed in its dead-letter entry, as that
entry's record key, and in the log (a job id has at most 128)."""

_ECHO_REASON_CHARS = 2048
"""Most characters of a rejection's reason written to ``dead-letter`` and the log: reasons
may quote what the sender wrote (a record key, say), which nothing else bounds."""

_METRICS_INTERVAL_S = 2.0
"""Seconds between two updates of the gauges of jobs and partitions (a pass over every job)."""

# A command supersedes another of the same generation in this order (restore, then resume,
# then abort), and one of the same generation and type with a higher seq (the abort refusing a
# continue after the abort that stopped the job), which is how a re-derived command (same
# generation, type and seq) is recognised as already sent.
_COMMAND_ORDER = {Restore: 0, Resume: 1, Abort: 2}


def _command_rank(command: Command) -> tuple[int, int, int]:
    return command.generation, _COMMAND_ORDER[type(command)], command.seq


@dataclass
class _Partition:
    """What the loop knows of one assigned partition of ``events``."""

    replay_until: int  # records before this offset are folded silently (already acted on)
    position: int = 0  # next offset to process
    committed: int = 0  # last position committed
    jobs: set[str] = field(default_factory=set)
    # job -> position its snapshot covers: its records below are in its state already
    covered: dict[str, int] = field(default_factory=dict)


class DaemonService:
    """Runs the state machine for every job on the bus partitions this instance owns.

    Args:
        config: bus, machine and loop settings.
        clock: wall clock in ns (injected for tests); used only to decide *when* to write a
            tick, never as an input to the machine.
        metrics: where to count what the service does; a fresh :class:`DaemonMetrics` (with
            a registry of its own) by default. ``trainguard daemon`` serves it over HTTP.
        keys: the daemon's signing and data keys; without them (or with
            ``config.snapshot_interval_s == 0``) no state snapshot is written or read.
            Commands and manifests are signed with them; a
            :class:`~trainguard.agent._keystore.DaemonKeys` (``trainguard daemon`` loads one
            from the key directory) also holds the jobs' event keys, which intake checks
            events with. Without keys nothing is signed or verified (insecure).

    Raises:
        ValueError: ``config.security.require_auth`` without a ``DaemonKeys``.

    ``await service.run(stop)`` returns after ``stop`` is set (and the consumed positions are
    committed). Raises :class:`~trainguard.agent.bus.BusError` if the bus fails for longer
    than its configured timeouts.
    """

    def __init__(
        self,
        config: DaemonConfig,
        clock: Callable[[], int] = time.time_ns,
        metrics: DaemonMetrics | None = None,
        keys: SnapshotKeys | None = None,
    ) -> None:
        self._c = config
        self._clock = clock
        self.jobs: dict[str, JobState] = {}
        self._partitions: dict[int, _Partition] = {}
        self._job_partition: dict[str, int] = {}
        self._sent_commands: dict[str, Command] = {}
        self._last_tick_ns: dict[str, int] = {}
        self._acted_ticks: dict[str, int] = {}  # job -> command seq its last tick named
        self._tick_seq = itertools.count(1)
        self._config_id = config_id(config.machine)
        self._audited_jobs: set[str] = set()  # jobs whose config entry this process wrote
        self._acted_since_commit = False
        self._last_commit = 0.0
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
            Snapshots(config.machine, self.metrics) if config.snapshot_interval_s > 0 else None
        )
        self._snapshot_due = time.monotonic() + config.snapshot_interval_s
        self._watch = BusWatch(
            self.metrics,
            self._positions,
            interval_s=config.probe_interval_s,
            timeout_s=config.probe_timeout_s,
        )
        self._pulse = Pulse(config.pulse_s)
        self.metrics.follow_readiness(self.not_ready_reason)

    def not_ready_reason(self) -> str | None:
        """Why this instance is not ready, or ``None`` when it is: it reaches the bus, owns
        partitions of ``events``, has rebuilt their jobs up to the group's committed positions
        and is behind their end offsets by at most ``max_lag_records`` records.

        An instance that owns no partition (starting, or a standby in a group with more
        members than partitions) is not ready. Safe to call from another thread (``/healthz``).
        """
        unreachable = self._watch.outage_reason()
        if unreachable is not None:
            return unreachable
        if not self._partitions:
            return "no partition of events assigned to this instance"
        if not self.ready.is_set():
            return "rebuilding job states up to the committed positions"
        return self._watch.lag_reason(self._c.max_lag_records)

    def _positions(self) -> dict[int, int]:
        """Owned partition of ``events`` -> next offset to process."""
        return {p: part.position for p, part in self._partitions.items()}

    async def run(self, stop: asyncio.Event, *, standby: bool = False) -> None:
        """Consume, fold and act until ``stop`` is set.

        On the embedded bus the instance first takes the bus file's daemon lock and holds it
        until it returns: one daemon per file (:mod:`trainguard.agent.bus._sqlite_lock`).

        Args:
            stop: set to wind down (positions committed, snapshots written).
            standby: embedded bus: wait for the lock instead of refusing (returns at once when
                ``stop`` is set while waiting). Kafka: no effect.

        Raises:
            DaemonLockHeld: embedded bus, not ``standby``, and another daemon holds the lock;
                nothing was read or written.
            BusError: the bus cannot be opened or fails.
        """
        async with serving_lock(self._c.bus, standby=standby, stop=stop) as serving:
            if serving:
                await self._serve(stop)

    async def _serve(self, stop: asyncio.Event) -> None:
        """:meth:`run` once this instance may serve the bus."""
        async with open_bus(self._c.bus) as bus:
            consumer = await bus.subscribe(["events"], self._c.group)
            self._watch.start(bus)
            log.info("daemon started", group=self._c.group, bus=self._c.bus.url)
            if self._snapshots is None or self._keys is None:
                log.info(
                    "snapshots off: every start folds the events log from offset 0",
                    reason="no keys" if self._keys is None else "snapshot_interval_s = 0",
                )
            try:
                while not stop.is_set():
                    records = await consumer.getmany(timeout_s=self._c.poll_s, max_records=2000)
                    fresh = await self._sync_assignment(bus, consumer)
                    for record in records:
                        if record.partition not in fresh:
                            await self._process(bus, record)
                    await self._write_due_ticks(bus)
                    await self._commit(consumer)
                    await self._write_snapshots(bus, consumer)
                    self._update_gauges()
                    self._reload_keys()
            finally:
                await self._watch.close()
                await self._commit(consumer, force=True)
                if stop.is_set():  # a clean stop: the next start reads little of the log
                    await self._write_snapshots(bus, consumer, force=True)
                await consumer.close()
                log.info("daemon stopped", folded=self.counters["folded"])

    # -- partitions --------------------------------------------------------------------------

    async def _sync_assignment(self, bus: Bus, consumer: Consumer) -> set[int]:
        """Start rebuilding newly assigned partitions and forget revoked ones.

        Returns the newly assigned partitions: records already fetched for them are dropped,
        because they are read again from offset 0. The jobs' latest commands are read again
        from the bus first: the previous owner of a partition may have sent commands after
        this instance started (and died, or failed to commit, before its position covered
        them), and re-deriving one of them must not send it twice.
        """
        assigned = {tp.partition for tp in consumer.assignment() if tp.topic == "events"}
        for p in self._partitions.keys() - assigned:
            revoked = self._partitions.pop(p).jobs
            for job in revoked:
                self.jobs.pop(job, None)
                self._job_partition.pop(job, None)
            if self._snapshots is not None:
                self._snapshots.forget(revoked)
            log.info("partition revoked", partition=p)
        fresh = assigned - self._partitions.keys()
        if fresh:
            # Not ready from here on: /healthz reads readiness from another thread while the
            # fresh partitions are being added.
            self.ready.clear()
            await self._load_sent_commands(bus)
        committed = {p: await consumer.committed(TopicPartition("events", p)) or 0 for p in fresh}
        rebuilds: dict[int, Rebuild] = {}
        if self._snapshots is not None and self._keys is not None and fresh:
            rebuilds = await self._snapshots.load(bus, committed, self._keys)
        for p in fresh:
            part = _Partition(replay_until=committed[p], committed=committed[p])
            rebuild = rebuilds.get(p)
            if rebuild is not None:
                part.position = rebuild.start
                part.covered = dict(rebuild.covered)
                part.jobs = set(rebuild.states)
                self.jobs.update(rebuild.states)
                self._job_partition.update(dict.fromkeys(rebuild.states, p))
            await consumer.seek(TopicPartition("events", p), part.position)
            self._partitions[p] = part
            log.info(
                "partition assigned",
                partition=p,
                replay_until=part.replay_until,
                start=part.position,
            )
        if not self.ready.is_set() and self._caught_up():
            self.ready.set()
            log.info("daemon ready", partitions=sorted(self._partitions), jobs=len(self.jobs))
        return fresh

    def _caught_up(self) -> bool:
        return all(p.position >= p.replay_until for p in self._partitions.values())

    async def _load_sent_commands(self, bus: Bus) -> None:
        for job, record in (await bus.latest_per_key("commands")).items():
            if record.value is None:
                continue
            try:
                command = decode(record.value, expect=(Restore, Resume, Abort))
            except SchemaError:
                continue
            self._sent_commands[job] = command  # type: ignore[assignment]

    # -- folding -----------------------------------------------------------------------------

    async def _process(self, bus: Bus, record: Record) -> None:
        part = self._partitions[record.partition]
        if record.offset < part.position:
            return  # redelivered after a seek
        part.position = record.offset + 1
        if record.key is not None and record.offset < part.covered.get(record.key, 0):
            return  # folded into the job's snapshot already
        silent = record.offset < part.replay_until
        taken = take(record, self._rebuild_auth if silent else self._auth)
        if isinstance(taken, Refused):
            if not silent:
                self.metrics.refused(taken)
                if taken.auth is not None:
                    await self._audit_refusal(bus, record, taken)
                await self._dead_letter(bus, record, taken.reason)
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
                    bus,
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
            await self._act(bus, record, job, decisions, taken.input_id)
        if silent and part.position >= part.replay_until and self._caught_up():
            self.ready.set()
            log.info("daemon ready", partitions=sorted(self._partitions), jobs=len(self.jobs))

    # -- acting ------------------------------------------------------------------------------

    async def _act(
        self,
        bus: Bus,
        record: Record,
        job: str,
        decisions: tuple[Decision, ...],
        identity: dict[str, JSONValue],
    ) -> None:
        self._acted_since_commit = True
        for decision in decisions:
            match decision:
                case Issue(command=command):
                    await self._issue(bus, job, command)
                case Committed(manifest=manifest):
                    await bus.publish("manifests", job, encode(self._sign(manifest)))
                    log.info(
                        "committed", job_id=job, snapshot=manifest.snapshot_id, step=manifest.step
                    )
                case Rejected(reason=reason):
                    self.counters["rejected"] += 1
                    await self._dead_letter(bus, record, reason)
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
            await bus.publish("audit", job, orjson.dumps(config_entry(job, self._c.machine)))
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
        # Durable before the position is committed: a crash must not lose the record of a
        # decision that was acted on.
        await bus.publish("audit", job, orjson.dumps(audit))

    async def _issue(self, bus: Bus, job: str, command: Command) -> None:
        sent = self._sent_commands.get(job)
        if sent is not None and _command_rank(sent) >= _command_rank(command):
            log.info("command already sent", job_id=job, generation=command.generation)
            return
        await bus.publish("commands", job, encode(self._sign(command)))
        self._sent_commands[job] = command
        self.counters["commands"] += 1
        self.metrics.issued(command, self.jobs[job].incident)
        log.warning(
            f"{type(command).__name__.lower()} issued",
            job_id=job,
            generation=command.generation,
            **({"reason": command.reason} if isinstance(command, Restore | Abort) else {}),
        )

    async def _audit_refusal(self, bus: Bus, record: Record, refused: Refused) -> None:
        """Record on ``audit`` that ``record`` was refused as not authentic, durably before
        its position is committed: a replay (which holds no keys) refuses it from there."""
        assert refused.auth is not None  # an authentication refusal
        self._acted_since_commit = True
        entry = refusal_entry(
            record.key or "",
            partition=record.partition,
            offset=record.offset,
            at_ms=record.timestamp_ms,
            value=record.value or b"",
            code=refused.auth,
            reason=refused.reason,
        )
        await bus.publish("audit", record.key or "", orjson.dumps(entry))

    async def _dead_letter(self, bus: Bus, record: Record, reason: str) -> None:
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
        delivery = await bus.send("dead-letter", short_key, orjson.dumps(entry))
        delivery.add_done_callback(_log_failed_delivery)

    # -- snapshots ---------------------------------------------------------------------------

    async def _write_snapshots(self, bus: Bus, consumer: Consumer, *, force: bool = False) -> None:
        """Every ``snapshot_interval_s`` (or now, with ``force``): commit, then write a round of
        snapshots for each partition whose state is at its committed position and caught up
        (everything below it acted on); a partition whose commit failed waits for the next
        round."""
        keys = self._keys
        if self._snapshots is None or keys is None:
            return
        if not (force or time.monotonic() >= self._snapshot_due):
            return
        self._snapshot_due = time.monotonic() + self._c.snapshot_interval_s
        await self._commit(consumer, force=True)
        for p, part in self._partitions.items():
            if part.position != part.committed or part.position < part.replay_until:
                continue
            states = {job: self.jobs[job] for job in part.jobs}
            try:
                written = await self._snapshots.write(bus, p, part.position, states, keys)
            except BusError as exc:
                log.warning("snapshots not written", partition=p, error=str(exc))
                continue
            if written:
                log.info("snapshots written", partition=p, offset=part.position, jobs=written)

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
        quiet_clock = time.monotonic()
        min_gap = int(self._c.tick_interval_s * 1e9)
        self._pulse.keep(self.jobs)
        for job, state in self.jobs.items():
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
            await bus.send("events", job, encode(tick))
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

    async def _commit(self, consumer: Consumer, *, force: bool = False) -> None:
        now = time.monotonic()
        if not (
            force
            or self._acted_since_commit
            or now - self._last_commit >= self._c.commit_interval_s
        ):
            return
        positions = {
            TopicPartition("events", p): part.position
            for p, part in self._partitions.items()
            if part.position > part.committed and part.position >= part.replay_until
        }
        self._last_commit = now
        self._acted_since_commit = False
        if not positions:
            return
        try:
            await consumer.commit(positions)
        except BusError as exc:
            log.warning("commit failed", error=str(exc))
            return
        for tp, position in positions.items():
            self._partitions[tp.partition].committed = position


def _late_report(state: JobState, item: Observed) -> bool:
    """``item`` is a routine late report for the ended job ``state``: an event of its final
    generation from a sender (rank or supervisor, host, pid) that generation already heard
    from, e.g. the supervisor's ``exited`` after the ranks' ``finished``."""
    event = item.event
    return event.generation == state.generation and (
        (event.rank, event.host, event.pid) in state.senders
    )


def _cut(text: str, limit: int) -> str:
    """``text``, or its first ``limit`` characters and how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters cut)"


def _log_failed_delivery(delivery: asyncio.Future[Any]) -> None:
    if not delivery.cancelled() and (exc := delivery.exception()) is not None:
        log.error("dead-letter entry lost", error=str(exc))


def _log_fields(decision: Decision) -> dict[str, object]:
    out: dict[str, object] = dict(decision.to_dict())
    out.pop("decision", None)
    return out
