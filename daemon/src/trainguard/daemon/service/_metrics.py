"""The daemon's Prometheus metrics (prometheus-client), kept in a registry of their own.

:class:`DaemonMetrics` is updated by the service where it folds, acts, dead-letters and writes
ticks, and exposed by :mod:`trainguard.daemon.service._http` on ``/metrics``. Every label takes values
from a fixed set (event types, phases, causes, restore modes, command types, reject classes,
partitions), so the number of series is bounded whatever the input; counters of a known label
set start at 0, so ``rate()`` sees their first increment. ``docs/operations.md`` tabulates the
metrics.

Two durations are measured in the daemon's clock (bus append times of the inputs it acted on,
never the local clock), so a replay of the log would measure the same:

* detection latency: time from the last evidence that the failing ranks were healthy to the
  input that opened the incident (:func:`detection_latency_s` says what counts as evidence for
  each detector);
* time to resume: from the incident's first ``restore`` (issued with the incident) to the
  ``resume`` that ended it, across retried attempts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Final, Literal, TypeAlias, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from trainguard.daemon.catalog import Pruned
from trainguard.daemon.core import (
    Anomaly,
    Decision,
    Incident,
    IncidentCause,
    IncidentOpened,
    Input,
    Issue,
    JobPhase,
    JobState,
    Observed,
    Refused,
    RejectCode,
    Rejected,
    Transition,
)
from trainguard.daemon.service._snapshot_envelope import FALLBACK_REASONS, FallbackReason
from trainguard.schemas import (
    Abort,
    Checkpoint,
    Command,
    DataCursorEvent,
    Heartbeat,
    HeartbeatBatch,
    JobRequest,
    Lifecycle,
    MessageTooLarge,
    NestingTooDeep,
    NotJSON,
    NotUTF8,
    Restore,
    Resume,
    SchemaError,
    UnexpectedMessage,
    UnknownSchema,
)

__all__ = [
    "DURATION_BUCKETS_S",
    "REJECT_CLASSES",
    "DaemonMetrics",
    "IntakeRejectClass",
    "RejectClass",
    "detection_latency_s",
    "schema_error_class",
]

IntakeRejectClass: TypeAlias = Literal[
    "tombstone",
    "oversized",
    "undecodable",
    "unknown_schema",
    "schema_violation",
    "unexpected_type",
    "key_mismatch",
    "missing_mac",
    "unknown_kid",
    "bad_mac",
    "unknown_job",
    "key_error",
]
"""Why a record of ``events`` never became an input: a tombstone, a value over the size limit
(:class:`~trainguard.schemas.MessageTooLarge`), not UTF-8 or JSON or nested too deep, an
unknown or missing ``schema``, a message breaking its JSON Schema, a message type that is not
an event (a command on ``events``), a ``job_id`` other than the record's key; not authentic
(:data:`~trainguard.daemon.core._intake.AuthRefusal`): no MAC, a MAC under a key id the job does not
have, a MAC that does not verify, a job without an event key while authentication is
required, a job whose key files cannot be used."""

RejectClass: TypeAlias = IntakeRejectClass | RejectCode | Literal["ended_job"]
"""The label of ``trainguard_rejected_inputs_total``: an intake class, the state machine's
:data:`~trainguard.daemon.RejectCode`, or ``ended_job`` (input for a finished or failed job
that is no late report of its final generation, dead-lettered by the service; late reports
count in ``trainguard_late_inputs_total``)."""

REJECT_CLASSES: Final[tuple[str, ...]] = (
    *get_args(IntakeRejectClass),
    *get_args(RejectCode),
    "ended_job",
)
"""Every value of :data:`RejectClass`."""

DURATION_BUCKETS_S: Final[tuple[float, ...]] = (
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)
"""Histogram buckets (seconds) of detection latency and time to resume: a hang found by a
5 s progress timeout and a restart that reloads a large snapshot both fit, and so does the
default 30-minute progress ceiling."""

_EVENT_TYPES: Final = (
    (Heartbeat, "heartbeat"),
    (Checkpoint, "checkpoint"),
    (DataCursorEvent, "data_cursor"),
    (Lifecycle, "lifecycle"),
    (JobRequest, "job_request"),
    (HeartbeatBatch, "heartbeat_batch"),
)
_PHASES: Final[tuple[JobPhase, ...]] = get_args(JobPhase)
_CAUSES: Final[tuple[IncidentCause, ...]] = get_args(IncidentCause)
_COMMANDS: Final = ("restore", "resume", "abort")
_PRUNE_RESULTS: Final = ("done", "failed")
"""A retention run that planned and deleted what it could, or failed as a whole."""
_PRUNED_KINDS: Final = ("snapshot", "leftover")
_PRUNE_ERRORS: Final = ("delete", "storage")
"""A step folder that could not be deleted, or a job whose storage could not be listed."""
_NOT_COMMITTED: Final = ("cursor_mismatch", "checkpoint_mismatch")
"""Why a step never commits: ranks disagreeing on the data order (an incident that fails the
job), or shards disagreeing otherwise (an anomaly: data version, origin)."""
_REQUEST_RESULTS: Final = (("stop", "stopped"), ("continue", "continued"), ("continue", "refused"))
_MODES: Final = ("restart", "in_process")

_ELAPSED_MEASURES: Final[Mapping[str, str]] = {
    "heartbeat_timeout": "silent_s",
    "progress_timeout": "stalled_s",
    "phase_timeout": "in_phase_s",
}
"""Detectors that measure the elapsed time themselves, and the measure that holds it."""

_NS_PER_S: Final = 1_000_000_000


def schema_error_class(error: SchemaError) -> IntakeRejectClass:
    """The reject class of a decoding error (a :class:`~trainguard.schemas.SchemaError`)."""
    match error:
        case MessageTooLarge():
            return "oversized"
        case NotUTF8() | NotJSON() | NestingTooDeep():
            return "undecodable"
        case UnknownSchema():
            return "unknown_schema"
        case UnexpectedMessage():
            return "unexpected_type"
        case _:
            return "schema_violation"


def detection_latency_s(before: JobState, opened: IncidentOpened, at_ns: int) -> float | None:
    """Seconds from the last evidence that the failing ranks were healthy to the incident.

    Args:
        before: the job's state before the input that opened the incident.
        opened: the incident.
        at_ns: the job's clock after that input (ns): the incident's time.

    Returns:
        * heartbeat, progress and phase timeouts: what the detector measured (``silent_s``:
          since the silent rank's last event; ``stalled_s``: since its step last advanced;
          ``in_phase_s``: since it entered the phase);
        * every other cause: ``at_ns`` minus the earliest time any rank the incident names (all
          ranks when it names none, as for a loss spike) was last heard before the input, i.e.
          for an exit, the time from the dead rank's last heartbeat to the supervisor's report;
          for a loss spike confirmed over several samples this is the last sample's share only;
        * with no rank ever heard (a start-up timeout): the time since the generation began;
        * ``None`` when none of these is known.
    """
    measure = _ELAPSED_MEASURES.get(opened.cause)
    if measure is not None:
        value = opened.measures.get(measure)
        if isinstance(value, int | float):
            return float(value)
    named = [before.ranks[r] for r in opened.ranks if r in before.ranks]
    heard = named or list(before.ranks.values())
    if heard:
        since = min(rec.last_heard_ns for rec in heard)
    elif before.generation_started_ns is not None:
        since = before.generation_started_ns
    else:
        return None
    return max(0, at_ns - since) / _NS_PER_S


class DaemonMetrics:
    """The daemon's metrics, registered in ``registry`` (a new one by default: several
    services, and tests, in one process never share series).

    Updated from the event loop's thread; prometheus-client's metrics are thread-safe, so the
    HTTP server may collect them from its own.

    Attributes:
        registry: the registry to expose (``prometheus_client.generate_latest(registry)``).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._folded = Counter(
            "trainguard_events_folded",
            "Inputs folded into job states (rebuilds after a restart included), by type.",
            ["type"],
            registry=r,
        )
        self._lag = Gauge(
            "trainguard_consumer_lag_records",
            "Records of an owned events partition not processed yet (end offset - position), "
            "as of the last successful probe of the bus.",
            ["partition"],
            registry=r,
        )
        self._bus_connected = Gauge(
            "trainguard_bus_connected",
            "1 while the bus answers the daemon's probes, 0 from the first probe without an "
            "answer until the next answered one.",
            registry=r,
        )
        self._bus_last_contact = Gauge(
            "trainguard_bus_last_contact_seconds",
            "Seconds since the bus last answered a probe (grows during an outage).",
            registry=r,
        )
        self._bus_outages = Counter(
            "trainguard_bus_outages",
            "Bus outages: probes of the bus going from answered to unanswered.",
            registry=r,
        )
        self._commits_failed = Counter(
            "trainguard_commits_failed",
            "Transactions of an owned partition that failed (a send, commit or abort), by "
            "reason: fenced (a newer owner has the partition), expired (aborted by the broker "
            "after transaction.timeout.ms), in_doubt (no answer within the send timeout: the "
            "partitions are taken on again), failed (aborted and rolled back).",
            ["reason"],
            registry=r,
        )
        self._commit_age = Gauge(
            "trainguard_commit_age_seconds",
            "Seconds since the last successful commit of the partition whose transactions "
            "have been failing longest; 0 while no partition's transactions fail.",
            registry=r,
        )
        self._jobs = Gauge(
            "trainguard_jobs", "Jobs this instance holds, by phase.", ["phase"], registry=r
        )
        self._partitions = Gauge(
            "trainguard_partitions_assigned",
            "Partitions of events this instance owns.",
            registry=r,
        )
        self._ready = Gauge(
            "trainguard_ready",
            "1 when /healthz answers ready (the instance reaches the bus, owns partitions and "
            "has caught up to their committed positions and end offsets), else 0.",
            registry=r,
        )
        self._incidents = Counter(
            "trainguard_incidents",
            "Incidents opened, by cause (the detector that fired).",
            ["cause"],
            registry=r,
        )
        self._restores = Counter(
            "trainguard_restores",
            "Restore commands issued, by the cause of their incident and restore mode.",
            ["cause", "mode"],
            registry=r,
        )
        self._commands = Counter(
            "trainguard_commands",
            "Commands published on the commands topic, by type.",
            ["type"],
            registry=r,
        )
        self._rejected = Counter(
            "trainguard_rejected_inputs",
            "Inputs rejected (dead-lettered), by reason class.",
            ["reason"],
            registry=r,
        )
        self._late = Counter(
            "trainguard_late_inputs",
            "Events for a finished or failed job from a sender of its final generation (a "
            "supervisor's exit after the ranks finished): ignored, not dead-lettered, by type.",
            ["type"],
            registry=r,
        )
        self._not_committed = Counter(
            "trainguard_steps_not_committed",
            "Steps that can never commit because their ranks' shards or data cursors "
            "disagree, by reason: cursor_mismatch (the data order; the job fails) or "
            "checkpoint_mismatch (data version or origin).",
            ["reason"],
            registry=r,
        )
        self._ticks = Counter(
            "trainguard_ticks_written",
            "Clock ticks written into the events topic.",
            registry=r,
        )
        self._snapshots_written = Counter(
            "trainguard_snapshots_written",
            "Job-state snapshots written on the snapshots topic.",
            registry=r,
        )
        self._manifests_stored = Counter(
            "trainguard_manifests_stored",
            "Committed snapshots' manifests written beside their checkpoints, by result: ok, or "
            "failed (storage refused, failed or did not answer in time; a restore to such a "
            "snapshot reads its manifest from the bus if it was small enough to be published "
            "whole, else it falls back to an older snapshot).",
            ["result"],
            registry=r,
        )
        self._snapshot_fallbacks = Counter(
            "trainguard_snapshot_fallbacks",
            "Partitions folded from offset 0 although snapshots of them exist, by reason (a "
            "snapshot refused: bad_signature, tag, unknown_kid, ...; or an incomplete round).",
            ["reason"],
            registry=r,
        )
        self._requests = Counter(
            "trainguard_job_requests",
            "Job requests acted on, by kind (stop, continue) and result: stopped (a live job "
            "ended stopped), continued (a restore issued), refused (a continue answered with "
            "an abort).",
            ["kind", "result"],
            registry=r,
        )
        self._detection = Histogram(
            "trainguard_detection_latency_seconds",
            "Seconds from the last evidence that the failing ranks were healthy to the "
            "incident, by cause (bus time).",
            ["cause"],
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self._resume = Histogram(
            "trainguard_time_to_resume_seconds",
            "Seconds from an incident's first restore to its resume, by the last attempt's "
            "restore mode (bus time).",
            ["mode"],
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self._prune_runs = Counter(
            "trainguard_retention_runs",
            "Runs of the daemon's own retention ([retention]), by result: done (planned, and "
            "deleted what it could), failed (nothing done: the bus or the catalog could not "
            "be read; logged as 'retention run failed').",
            ["result"],
            registry=r,
        )
        self._pruned = Counter(
            "trainguard_retention_deleted_folders",
            "Step folders the daemon's retention deleted, by kind: snapshot (a committed one "
            "no longer needed) or leftover (a checkpoint that never committed and never will).",
            ["kind"],
            registry=r,
        )
        self._prune_errors = Counter(
            "trainguard_retention_errors",
            "Failures within retention runs, by kind: delete (a step folder could not be "
            "deleted), storage (a job's checkpoint folder could not be listed: nothing of it "
            "was deleted).",
            ["kind"],
            registry=r,
        )
        self._freed = Counter(
            "trainguard_retention_freed_bytes",
            "Bytes of the step folders the daemon's retention deleted.",
            registry=r,
        )
        self._prune_duration = Gauge(
            "trainguard_retention_last_duration_seconds",
            "Seconds the last retention run took (reading the catalog, listing and deleting), "
            "failed or not.",
            registry=r,
        )
        self._prune_success = Gauge(
            "trainguard_retention_last_success_timestamp_seconds",
            "Unix time the last retention run that did not fail ended; 0 before the first.",
            registry=r,
        )
        self._lag_partitions: set[str] = set()
        # Children resolved once: folding is the hot path.
        self._folded_by_type = {t: self._folded.labels(name) for t, name in _EVENT_TYPES}
        self._folded_ticks = self._folded.labels("tick")
        self._late_by_type = {t: self._late.labels(name) for t, name in _EVENT_TYPES}
        for cause in _CAUSES:
            self._incidents.labels(cause)
            for mode in _MODES:
                self._restores.labels(cause, mode)
        for command in _COMMANDS:
            self._commands.labels(command)
        for reason in _NOT_COMMITTED:
            self._not_committed.labels(reason)
        for result in _PRUNE_RESULTS:
            self._prune_runs.labels(result)
        for kind in _PRUNED_KINDS:
            self._pruned.labels(kind)
        for kind in _PRUNE_ERRORS:
            self._prune_errors.labels(kind)
        for reason in REJECT_CLASSES:
            self._rejected.labels(reason)
        for phase in _PHASES:
            self._jobs.labels(phase)
        for kind, result in _REQUEST_RESULTS:
            self._requests.labels(kind, result)
        for fallback in FALLBACK_REASONS:
            self._snapshot_fallbacks.labels(fallback)

    # -- folding ------------------------------------------------------------------------------

    def folded(self, item: Input) -> None:
        """Count one input folded into its job's state."""
        if isinstance(item, Observed):
            self._folded_by_type[type(item.event)].inc()
        else:
            self._folded_ticks.inc()

    def decided(self, before: JobState, after: JobState, decisions: Iterable[Decision]) -> None:
        """Count the decisions of one input the service acts on (not those of a rebuild).

        Args:
            before: the job's state before the input.
            after: its state after it.
            decisions: what :func:`~trainguard.daemon.decide` returned for it.
        """
        for decision in decisions:
            match decision:
                case IncidentOpened(cause="continued"):
                    # An operator's request, not a detection: no latency.
                    self._incidents.labels("continued").inc()
                    self._requests.labels("continue", "continued").inc()
                case IncidentOpened(cause=cause):
                    self._incidents.labels(cause).inc()
                    if cause == "cursor_mismatch":
                        self._not_committed.labels(cause).inc()
                    latency = detection_latency_s(before, decision, after.clock_ns)
                    if latency is not None:
                        self._detection.labels(cause).observe(latency)
                case Transition(new="stopped"):
                    self._requests.labels("stop", "stopped").inc()
                case Issue(command=Abort()) if before.phase in ("stopped", "failed"):
                    self._requests.labels("continue", "refused").inc()
                case Rejected(code=code):
                    self._rejected.labels(code).inc()
                case Anomaly(kind="checkpoint_mismatch"):
                    self._not_committed.labels("checkpoint_mismatch").inc()
                case Issue(command=Resume()) if before.incident is not None:
                    took_ns = after.clock_ns - before.incident.opened_ns
                    self._resume.labels(before.incident.mode).observe(took_ns / _NS_PER_S)
                case _:
                    pass

    def late(self, item: Observed) -> None:
        """Count one late report for an ended job, ignored without dead-lettering it."""
        self._late_by_type[type(item.event)].inc()

    def rejected(self, reason: RejectClass) -> None:
        """Count one input rejected before it reached the state machine."""
        self._rejected.labels(reason).inc()

    def refused(self, refused: Refused) -> None:
        """Count one record of ``events`` that intake refused (no input)."""
        if refused.error is not None:
            self.rejected(schema_error_class(refused.error))
        elif refused.code == "schema":
            self.rejected("schema_violation")
        elif refused.code == "auth":
            self.rejected(refused.auth or "bad_mac")
        else:
            self.rejected(refused.code)

    # -- acting -------------------------------------------------------------------------------

    def issued(self, command: Command, incident: Incident | None) -> None:
        """Count one command published; ``incident``: the job's open incident after the
        decision (a restore's, whose cause labels the restore)."""
        kind = type(command).__name__.lower()
        self._commands.labels(kind).inc()
        if isinstance(command, Restore):
            cause = incident.cause if incident is not None else "unknown"
            self._restores.labels(cause, command.mode).inc()

    def tick_written(self) -> None:
        """Count one ``ClockTick`` appended to ``events``."""
        self._ticks.inc()

    def manifest_stored(self, ok: bool) -> None:
        """A committed manifest was (``ok``) or was not written beside its checkpoint."""
        self._manifests_stored.labels("ok" if ok else "failed").inc()

    def snapshots_written(self, count: int) -> None:
        """Count ``count`` job-state snapshots written."""
        self._snapshots_written.inc(count)

    def snapshot_fallback(self, reason: FallbackReason) -> None:
        """Count one partition folded from offset 0 because its snapshots were unusable."""
        self._snapshot_fallbacks.labels(reason).inc()

    # -- retention ----------------------------------------------------------------------------

    def pruned(self, pruned: Pruned, duration_s: float) -> None:
        """Count one retention run that was done: its deletions by kind, the bytes they freed,
        the deletions that failed and the jobs whose storage could not be listed.

        Args:
            pruned: what the run decided and did.
            duration_s: seconds it took.
        """
        self._prune_runs.labels("done").inc()
        for v in pruned.plan.deleted:
            if v.name in pruned.freed:
                self._pruned.labels("leftover" if v.manifest is None else "snapshot").inc()
        self._freed.inc(sum(pruned.freed.values()))
        self._prune_errors.labels("delete").inc(len(pruned.failures))
        self._prune_errors.labels("storage").inc(len(pruned.unreadable))
        self._prune_duration.set(duration_s)
        self._prune_success.set_to_current_time()

    def prune_failed(self, duration_s: float) -> None:
        """Count one retention run that failed as a whole, after ``duration_s`` seconds."""
        self._prune_runs.labels("failed").inc()
        self._prune_duration.set(duration_s)

    # -- gauges -------------------------------------------------------------------------------

    def observe_assignment(self, partitions: int, jobs: Iterable[JobState]) -> None:
        """Set the gauges of what the instance holds: partitions owned, jobs per phase.

        Args:
            partitions: partitions of ``events`` the instance owns.
            jobs: the job states the instance holds.
        """
        counts = dict.fromkeys(_PHASES, 0)
        for state in jobs:
            counts[state.phase] += 1
        for phase, n in counts.items():
            self._jobs.labels(phase).set(n)
        self._partitions.set(partitions)

    def observe_lag(self, lag: Mapping[int, int]) -> None:
        """Set the consumer lag per owned partition (partitions no longer owned are dropped).

        Args:
            lag: partition -> records behind its end offset, for every owned partition.
        """
        owned = {str(p) for p in lag}
        for gone in self._lag_partitions - owned:
            self._lag.remove(gone)
        self._lag_partitions = owned
        for partition, records in lag.items():
            self._lag.labels(str(partition)).set(records)

    def follow_readiness(self, readiness: Callable[[], str | None]) -> None:
        """Make ``trainguard_ready`` read ``readiness()`` at each scrape: 1 when it returns
        ``None`` (ready), else 0. ``readiness`` is called from the scraping thread and must
        only read (``DaemonService.not_ready_reason``)."""
        self._ready.set_function(lambda: 0.0 if readiness() is not None else 1.0)

    def follow_bus_contact(self, age_s: Callable[[], float]) -> None:
        """Make ``trainguard_bus_last_contact_seconds`` read ``age_s()`` (seconds since the bus
        last answered) at each scrape, so it grows while the bus is away whatever the event
        loop does. ``age_s`` is called from the scraping thread and must only read."""
        self._bus_last_contact.set_function(age_s)

    def commit_failed(self, reason: str) -> None:
        """Count one failed transaction of an owned partition, by ``reason`` (``fenced``,
        ``expired``, ``in_doubt``, ``failed``)."""
        self._commits_failed.labels(reason).inc()

    def follow_commit_age(self, age_s: Callable[[], float]) -> None:
        """Make ``trainguard_commit_age_seconds`` read ``age_s()`` at each scrape (called from
        the scraping thread; must only read)."""
        self._commit_age.set_function(age_s)

    def bus_connected(self, connected: bool) -> None:
        """Set ``trainguard_bus_connected``."""
        self._bus_connected.set(1 if connected else 0)

    def bus_outage(self) -> None:
        """Count one bus outage (at its start)."""
        self._bus_outages.inc()
