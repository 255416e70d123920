"""What the state machine decides: data for the shell to act on, log and audit.

Every decision is an immutable, comparable dataclass with a ``reason`` naming its evidence, and
a :meth:`~Transition.to_dict` giving a JSON-ready form whose content depends only on the
decision (a replay compares decisions, or these dicts, for equality).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import ClassVar, Literal, TypeAlias

from trainguard.daemon.core._evidence import NO_MEASURES, Measures
from trainguard.daemon.core._state import IncidentCause, JobPhase
from trainguard.schemas import (
    Command,
    JSONValue,
    Manifest,
    SnapshotRef,
    SplitManifest,
    split_manifest,
)

RejectCode: TypeAlias = Literal[
    "wrong_job",
    "stale_generation",
    "future_generation",
    "future_timestamp",
    "duplicate",
    "world_size_conflict",
    "rank_out_of_range",
    "not_continuable",
    "no_such_job",
]
"""Why an input was rejected (left the state unchanged); ``not_continuable``: a ``continue``
request for a job that is neither ``stopped`` nor ``failed``; ``no_such_job``: a ``stop``
request for a job the daemon has no input of."""

AnomalyKind: TypeAlias = Literal[
    "checkpoint_mismatch",
    "snapshot_corrupt",
    "unknown_snapshot",
    "rank_error",
    "exit_without_ranks",
    "straggler",
    "loss_blip",
    "suspect_host",
    "data_version_changed",
    "checkpoint_ignored",
    "bus_gap",
    "restore_held",
    "late_finish",
    "late_checkpoint",
]
"""Something reported and recorded but not by itself acted on (``checkpoint_mismatch``, a
step that can never commit, is also logged at error level and counted). ``bus_gap``: the job's
inputs stopped for longer than ``bus_gap_s`` (the bus or the daemon was away), and time stopped
across the gap; ``restore_held``: a failure while the bus settles after a gap, whose restore
waits for the settle deadline (``docs/recovery.md``); ``late_finish``: a rank's ``finished`` of
the generation a restore left, arriving before anyone joined the restore (``docs/recovery.md``,
"A job that finished is never restored"); ``late_checkpoint``: a rank's checkpoint shard of that
generation, arriving then, held until the job finishes there (it then commits) or someone joins
the restore (it never does)."""

IncidentOutcome: TypeAlias = Literal["resumed", "failed", "finished", "stopped"]


def plain_value(value: object) -> JSONValue:
    """JSON-ready form of a decision field: dataclasses (messages get their ``schema``) become
    dicts, sequences lists, and non-finite floats the strings ``"nan"``, ``"inf"``, ``"-inf"``
    as on the wire (see :mod:`trainguard.schemas._messages`).

    Raises:
        TypeError: a value of a type no decision holds.
    """
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if is_dataclass(value) and not isinstance(value, type):
        out: dict[str, JSONValue] = {}
        schema = getattr(value, "SCHEMA", None)
        if isinstance(schema, str):
            out["schema"] = schema
        for f in fields(value):
            out[f.name] = plain_value(getattr(value, f.name))
        return out
    if isinstance(value, Mapping):
        return {str(k): plain_value(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [plain_value(v) for v in value]
    raise TypeError(f"cannot convert {type(value).__name__} to JSON")


@dataclass(frozen=True, slots=True)
class _Decision:
    """Base of all decisions: the ``to_dict`` form."""

    KIND: ClassVar[str]

    def to_dict(self) -> dict[str, JSONValue]:
        """``{"decision": <kind>, <field>: <value>, ...}``, JSON-ready, fields in declaration
        order; commands and manifests nested as dicts with their ``schema``."""
        out: dict[str, JSONValue] = {"decision": self.KIND}
        for f in fields(self):
            out[f.name] = plain_value(getattr(self, f.name))
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Transition(_Decision):
    """The job's phase changed.

    Attributes:
        old: the phase before the change.
        new: the phase after it.
        generation: the job's generation after the change (a new one when the job goes to
            ``restoring``).
        reason: the evidence.
    """

    KIND: ClassVar[str] = "transition"
    old: JobPhase
    new: JobPhase
    generation: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Committed(_Decision):
    """Every rank's shard of a step arrived and agrees: the step is a restore target now.

    Build it with :meth:`of`.

    Attributes:
        manifest: the committed snapshot (unsigned: the shell signs what it publishes when
            keys are in use, and stores the manifest beside the checkpoint).
        split: its stored form (head, parts) and reference, derived once: splitting encodes
            every shard (about 10 ms per 1,000 ranks), and both the state and the shell need
            it.
        reason: the evidence.
    """

    KIND: ClassVar[str] = "committed"
    manifest: Manifest
    split: SplitManifest
    reason: str

    @classmethod
    def of(cls, manifest: Manifest, reason: str) -> Committed:
        """The decision committing ``manifest``, with its stored form derived from it."""
        return cls(manifest=manifest, split=split_manifest(manifest), reason=reason)

    @property
    def snapshot(self) -> SnapshotRef:
        """The snapshot's reference (id and manifest digest), what the job's state keeps and
        a restore names."""
        return self.split.ref

    def to_dict(self) -> dict[str, JSONValue]:
        """As :meth:`_Decision.to_dict`, with the reference only: the manifest (one shard per
        rank) is on ``manifests`` and in storage, and an audit entry must fit a record."""
        return {
            "decision": self.KIND,
            "snapshot": plain_value(self.snapshot),
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class IncidentOpened(_Decision):
    """A failure was detected in ``generation``.

    Attributes:
        incident_id: ``<job_id>/i<n>``.
        cause: the detector that fired.
        generation: the generation the failure happened in.
        ranks: the ranks named by the evidence, ascending.
        hosts: their hosts, sorted, without repeats (may be empty when unknown).
        reason: the evidence.
        onset_after_step: the last step known good: the incident began after it, and its
            restore targets a committed step ``<=`` it. ``None`` when the onset is the incident
            time (dead or stalled ranks).
        measures: the numbers the detector compared (observed values, thresholds, window
            sizes), named with their units.
    """

    KIND: ClassVar[str] = "incident_opened"
    incident_id: str
    cause: IncidentCause
    generation: int
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    reason: str
    onset_after_step: int | None = None
    measures: Measures = NO_MEASURES


@dataclass(frozen=True, slots=True, kw_only=True)
class IncidentClosed(_Decision):
    """The incident ended.

    Attributes:
        incident_id: the incident's ``<job_id>/i<n>`` (as its :class:`IncidentOpened`).
        outcome: ``resumed`` (all ranks acknowledged a restore), ``failed`` (restore attempts
            exhausted, job aborted), ``finished`` (the ranks finished meanwhile) or
            ``stopped`` (the job was stopped on request meanwhile).
        attempts: restore attempts made for it, 1 for the first; 0 when its restore never
            started (held while the bus settled).
        reason: the evidence.
    """

    KIND: ClassVar[str] = "incident_closed"
    incident_id: str
    outcome: IncidentOutcome
    attempts: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Issue(_Decision):
    """Publish a command on the ``commands`` topic.

    Attributes:
        command: the command, already numbered (``seq``) and stamped (``ts``: the state
            machine's clock, ns); unsigned: the shell signs it when keys are in use.
        reason: the evidence.
    """

    KIND: ClassVar[str] = "issue"
    command: Command
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejected(_Decision):
    """The input was not applied (the state is unchanged); for the dead-letter topic.

    Attributes:
        code: why, as a :data:`RejectCode`.
        reason: the evidence.
    """

    KIND: ClassVar[str] = "rejected"
    code: RejectCode
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Anomaly(_Decision):
    """Reported evidence that is recorded but not by itself acted on (a straggler, a loss blip,
    a suspect host, ...).

    Attributes:
        kind: what was seen, as an :data:`AnomalyKind`.
        reason: the evidence.
        ranks: the ranks it names (may be empty).
        hosts: the hosts it names (may be empty).
        measures: the numbers behind it (observed values, thresholds, window sizes), named
            with their units.
    """

    KIND: ClassVar[str] = "anomaly"
    kind: AnomalyKind
    reason: str
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    measures: Measures = NO_MEASURES


@dataclass(frozen=True, slots=True, kw_only=True)
class JobFailed(_Decision):
    """The job is ``failed`` for good; the shell reports this loudly.

    Attributes:
        reason: why the daemon gave up on the job.
    """

    KIND: ClassVar[str] = "job_failed"
    reason: str


Decision: TypeAlias = (
    Transition
    | Committed
    | IncidentOpened
    | IncidentClosed
    | Issue
    | Rejected
    | Anomaly
    | JobFailed
)
