"""Typed message objects of the wire contract (ARCHITECTURE.md section 3).

Every message is an immutable dataclass. The wire form of each class is described by the JSON
Schema file named in its ``SCHEMA`` class attribute (``<type>/<major>.<minor>``, file
``json/<type>.v<major>.json``); :mod:`trainguard.schemas._codec` converts between the two.

Conventions shared by every message:

* ``job_id``: the job's name, 1-128 characters of ``[A-Za-z0-9._-]``; it is also the bus key.
* ``generation``: the fencing generation (>= 0). The daemon bumps it on every restore; events
  carry the generation their sender runs in, commands the generation they establish.
* ``ts``: the sender's wall clock in nanoseconds since the Unix epoch.
* ``seq``: per-sender counter, strictly increasing, for duplicate detection.
* Events (sent by workers and supervisors) name their sender with ``rank`` (``None`` for a
  supervisor), ``host`` and ``pid``; commands (sent by the daemon) with ``daemon_id``.
* Floats that may be non-finite (``loss``) travel as JSON numbers, or as the strings ``"nan"``,
  ``"inf"`` and ``"-inf"``, because JSON has no literal for them.
* Bounds (ranks < 65536, string lengths, ...) are those of the schema files; see
  ``docs/wire-contract.md``.
* ``auth``: events (and ticks) may carry a :class:`Mac`, commands and manifests a
  :class:`Signature`, over the message's canonical bytes (:mod:`trainguard.schemas._auth`);
  ``None`` (left out on the wire) when the sender holds no key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal, TypeAlias

JSONValue: TypeAlias = "bool | int | float | str | list[JSONValue] | dict[str, JSONValue] | None"

Phase: TypeAlias = Literal["init", "train", "checkpoint", "eval", "data"]
"""What a rank is doing. ``checkpoint``, ``eval``, ``data`` and ``init`` are declared long phases
that extend the progress timeout."""

LifecycleKind: TypeAlias = Literal["started", "restored", "finished", "exited", "error"]
RestoreMode: TypeAlias = Literal["restart", "in_process"]
RequestKind: TypeAlias = Literal["stop", "continue"]
"""What a :class:`JobRequest` asks of the daemon."""
AbortOutcome: TypeAlias = Literal["failed", "stopped"]
"""How an :class:`Abort` ends the job: ``failed``, or ``stopped`` on request."""


class NonFiniteAsString:
    """``Annotated`` marker for a float that may be NaN or +-inf.

    JSON has no literal for non-finite numbers, so the codec writes them as the strings
    ``"nan"``, ``"inf"`` and ``"-inf"`` and reads those back as floats.
    """


MaybeNonFinite: TypeAlias = Annotated[float, NonFiniteAsString]
"""A float that may be non-finite on the wire (see :class:`NonFiniteAsString`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Mac:
    """An event's authentication (``auth`` of events and ticks, since their 1.x bump).

    Attributes:
        kid: id of the job's event key used (16 lowercase hex digits: the first 8 bytes of the
            key's SHA-256).
        mac: HMAC-SHA256 (RFC 2104, FIPS 180-4) under that key over the message's canonical
            bytes, 32 bytes in standard base64 (RFC 4648 section 4, padded: 44 characters).
    """

    kid: str
    mac: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Signature:
    """The daemon's signature (``auth`` of commands and manifests, since their 1.x bump).

    Attributes:
        kid: id of the daemon's signing key (16 lowercase hex digits: the first 8 bytes of the
            SHA-256 of the raw 32-byte public key).
        sig: Ed25519 signature (RFC 8032) over the message's canonical bytes, 64 bytes in
            standard base64 (padded: 88 characters).
    """

    kid: str
    sig: str


WIRE_OMIT_NONE = "trainguard.wire_omit_none"
"""Field metadata key: the codec leaves the property out of the wire form when the value is
``None`` (``auth``: an unauthenticated message looks exactly as before authentication existed)."""

_OMIT_NONE = {WIRE_OMIT_NONE: True}


@dataclass(frozen=True, slots=True, kw_only=True)
class DataCursor:
    """Exact data-loader position, independent of the world size.

    Attributes:
        data_version: digest of the dataset manifest (or an id from the user's versioning tool).
        seed: seed of the epoch permutation, 0 <= seed < 2**64 (unsigned 64-bit, as torch seeds).
        epoch: epoch number, >= 0.
        offset: global sample offset within the epoch's permutation, >= 0 (samples, not batches).
        world_size: world size at the moment the cursor was taken (informational: resuming on
            another world size re-partitions the remaining samples).
    """

    data_version: str
    seed: int
    epoch: int
    offset: int
    world_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointMeta:
    """What a training snapshot is bound to besides its tensors.

    Attributes:
        hyperparameters: free-form JSON object (learning rate, batch size, ...).
        topology: free-form JSON object; by convention holds ``world_size`` and any parallelism
            degrees (``dp``, ``tp``, ``pp``).
        code_version: e.g. a git commit id of the training code.
    """

    hyperparameters: Mapping[str, JSONValue] = field(default_factory=dict)
    topology: Mapping[str, JSONValue] = field(default_factory=dict)
    code_version: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """Periodic liveness and progress report of one rank (``heartbeat/1``).

    Attributes:
        step: last completed training step, >= 0.
        phase: what the rank is doing now.
        step_time_s: duration of the last step in seconds, or ``None`` before the first step.
        loss: last loss, possibly non-finite, or ``None`` when not reported.
        samples: samples this rank has consumed in total, >= 0.
        param_checksum: cheap deterministic checksum of the parameters at ``step`` (hex), or
            ``None`` when not computed for this step.
        world_size: world size the rank runs in, >= 1.
        step_age_s: seconds from the completion of ``step`` to the building of this heartbeat,
            measured on the sender's monotonic clock (>= 0), or ``None`` when no step has
            completed in this process (since 1.2). The daemon dates the step's completion by
            it (its bus append time minus this age), independently of the sender's wall clock.
    """

    SCHEMA: ClassVar[str] = "heartbeat/1.2"
    job_id: str
    generation: int
    ts: int
    seq: int
    rank: int
    host: str
    pid: int
    world_size: int
    step: int
    phase: Phase
    step_time_s: float | None = None
    loss: MaybeNonFinite | None = None
    samples: int = 0
    param_checksum: str | None = None
    step_age_s: float | None = None
    auth: Mac | None = field(default=None, metadata=_OMIT_NONE)


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """One rank's shard of a checkpoint, durably written (``checkpoint/1``).

    Sent only after the shard is fsynced and atomically renamed into place.

    Attributes:
        step: training step the shard captures.
        shard_uri: where the shard lives (``file:///...`` or an object-store URI).
        size_bytes: shard size in bytes.
        digest: ``sha256:<64 hex>`` of the shard's bytes.
        cursor: data cursor matching ``step``.
        metadata: hyperparameters, topology and code version.
        parent: ``snapshot_id`` of another job's committed snapshot this job started from (the
            agent's ``init_from``), or ``None`` (since 1.1). Every shard of a job carries it,
            also after restores, and the daemon copies it into the manifests it commits.
    """

    SCHEMA: ClassVar[str] = "checkpoint/1.2"
    job_id: str
    generation: int
    ts: int
    seq: int
    rank: int
    host: str
    pid: int
    world_size: int
    step: int
    shard_uri: str
    size_bytes: int
    digest: str
    cursor: DataCursor
    metadata: CheckpointMeta = field(default_factory=CheckpointMeta)
    parent: str | None = None
    auth: Mac | None = field(default=None, metadata=_OMIT_NONE)

    @property
    def data_version(self) -> str:
        """The dataset version the shard was trained on (the cursor's)."""
        return self.cursor.data_version


@dataclass(frozen=True, slots=True, kw_only=True)
class DataCursorEvent:
    """A rank's data cursor after ``step`` (``data-cursor/1``)."""

    SCHEMA: ClassVar[str] = "data-cursor/1.1"
    job_id: str
    generation: int
    ts: int
    seq: int
    rank: int
    host: str
    pid: int
    step: int
    cursor: DataCursor
    auth: Mac | None = field(default=None, metadata=_OMIT_NONE)


@dataclass(frozen=True, slots=True, kw_only=True)
class Lifecycle:
    """A process lifecycle report from a worker or a supervisor (``lifecycle/1``).

    Attributes:
        rank: the worker's rank, or ``None`` when a supervisor reports for its whole process group.
        kind: ``started``, ``restored`` (ack of a restore: ``step`` and ``cursor`` say where the
            rank now stands, ``generation`` is the restore's), ``finished``, ``exited`` (with
            ``exit_code`` or ``signal``), ``error`` (with ``message``).
        ranks: ranks the reporting process group hosts (supervisors), else empty.
        exit_code: process exit code for ``exited``, else ``None``.
        signal: number of the signal that ended the process for ``exited``, else ``None``.
        step: the step the rank stands at, when known.
        cursor: the data cursor at ``step`` (``restored``, when the rank tracks one).
        world_size: the world size the sender runs in, when known (``started``).
        snapshot_id: for ``restored``, the snapshot loaded; for ``error``, a snapshot that
            failed verification (a shard's digest did not match) and must not be used again.
        message: human-readable detail (``error``), at most 4096 characters.
        missed_at_step: for ``error`` (since 1.1): the rank received an ``in_process`` restore
            of this ``generation`` whose ``at_step`` it had already completed (``step`` says
            where it stands), so it cannot stop there; the daemon falls back to a ``restart``
            restore. ``None`` otherwise.
    """

    SCHEMA: ClassVar[str] = "lifecycle/1.2"
    job_id: str
    generation: int
    ts: int
    seq: int
    rank: int | None
    host: str
    pid: int
    kind: LifecycleKind
    ranks: tuple[int, ...] = ()
    exit_code: int | None = None
    signal: int | None = None
    step: int | None = None
    cursor: DataCursor | None = None
    world_size: int | None = None
    snapshot_id: str | None = None
    message: str = ""
    missed_at_step: int | None = None
    auth: Mac | None = field(default=None, metadata=_OMIT_NONE)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shard:
    """One rank's file of a training snapshot."""

    rank: int
    uri: str
    size_bytes: int
    digest: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """A committed training snapshot (``manifest/1``): what a restore resumes from.

    Attributes:
        snapshot_id: ``<job_id>/g<generation>/s<step>``; a step re-committed in a later
            generation is a different snapshot.
        generation: generation in which the shards were written.
        step: training step captured.
        shards: one per rank of ``world_size``, ordered by rank.
        cursor: data cursor at ``step`` (world-size independent).
        metadata: hyperparameters, topology and code version.
        parent: ``snapshot_id`` this job started from (fine-tune lineage), or ``None``: the
            snapshot of another job that the job's generation 0 loaded. Every snapshot of the
            job carries the same parent (the job's origin, not the job's previous snapshot).
    """

    SCHEMA: ClassVar[str] = "manifest/1.1"
    job_id: str
    snapshot_id: str
    generation: int
    ts: int
    step: int
    world_size: int
    shards: tuple[Shard, ...]
    cursor: DataCursor
    metadata: CheckpointMeta = field(default_factory=CheckpointMeta)
    parent: str | None = None
    auth: Signature | None = field(default=None, metadata=_OMIT_NONE)

    @property
    def data_version(self) -> str:
        """The dataset version every shard was trained on."""
        return self.cursor.data_version


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRange:
    """Training steps ``from_step`` to ``to_step``, both included (``from_step <= to_step``).

    In a :class:`Restore` it names the steps whose batches are skipped: after loading the
    target (step T, cursor at global sample offset O), a rank trains steps T+1, T+2, ... as
    usual until it is about to train ``from_step``; there it advances its data cursor past the
    samples steps ``from_step..to_step`` consumed in the abandoned run,
    ``(to_step - from_step + 1) * global_batch_size`` samples, and trains ``from_step`` on the
    batch the old run used for ``to_step + 1``. Step numbers (and so learning-rate schedules)
    are unchanged. Steps rather than sample offsets because the daemon knows steps exactly
    (from heartbeats) and the agent knows its global batch size; the skip is exact when the
    global batch size is constant over the range.
    """

    from_step: int
    to_step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Restore:
    """Command: roll every rank back to a committed snapshot (``restore/1``).

    Attributes:
        generation: the new fencing generation the ranks run in after the restore.
        incident_id: identifies the incident that caused the restore (one restore per incident).
        reason: human-readable evidence, e.g. ``"rank 1 exited (signal 9)"``.
        target: the snapshot to load, or ``None`` to start from the job's initial state (no
            step committed yet): from scratch, or from the snapshot of another job the job
            started from (``Checkpoint.parent``), which the agent loads again.
        mode: ``restart`` (supervisors restart the processes) or ``in_process`` (agents reload
            at a step boundary without exiting).
        attempt: 1 for the first try of this incident's restore, 2 for the first retry, ...
        at_step: for ``in_process`` (required then, since 1.1): the step boundary at which
            every rank stops. A rank adopts ``generation`` for its events when the command
            arrives, trains on until it completes step ``at_step``, then ``agent.step()``
            raises ``RestoreRequested``; the rank loads ``target``, acknowledges with
            ``lifecycle restored`` and waits for ``resume`` like a restarted one. A rank that
            had already completed ``at_step`` when the command arrived reports ``lifecycle
            error`` with ``missed_at_step`` instead, and the daemon falls back to a restart.
            ``None`` for ``restart``.
        skip: steps whose batches the restored ranks skip (see :class:`StepRange`), or
            ``None`` to replay the data exactly (since 1.1).
    """

    SCHEMA: ClassVar[str] = "restore/1.2"
    job_id: str
    generation: int
    ts: int
    seq: int
    daemon_id: str
    incident_id: str
    reason: str
    target: Manifest | None
    mode: RestoreMode = "restart"
    attempt: int = 1
    at_step: int | None = None
    skip: StepRange | None = None
    auth: Signature | None = field(default=None, metadata=_OMIT_NONE)


@dataclass(frozen=True, slots=True, kw_only=True)
class Resume:
    """Command: every rank acknowledged the restore of ``generation``; continue training."""

    SCHEMA: ClassVar[str] = "resume/1.1"
    job_id: str
    generation: int
    ts: int
    seq: int
    daemon_id: str
    step: int
    auth: Signature | None = field(default=None, metadata=_OMIT_NONE)


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort:
    """Command: end the job (``abort/1``); ``reason`` says why.

    Attributes:
        outcome: ``failed`` (the daemon gave up on the job), or ``stopped`` (since 1.2): the
            job was stopped on request (:class:`JobRequest` ``stop``) and may be continued
            from its latest committed snapshot (``continue``). A reader of an older minor
            drops the property and takes every abort as a failure. A second abort of the same
            generation with a higher ``seq`` answers a ``continue`` the daemon refused; the
            job keeps its outcome.
    """

    SCHEMA: ClassVar[str] = "abort/1.2"
    job_id: str
    generation: int
    ts: int
    seq: int
    daemon_id: str
    reason: str
    outcome: AbortOutcome = "failed"
    auth: Signature | None = field(default=None, metadata=_OMIT_NONE)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClockTick:
    """The daemon's clock in a job's event stream (``tick/1``).

    The daemon appends one to a job's partition of ``events`` when a timeout of that job may
    have expired. Folding it lets the state machine see time pass, and because it sits in the
    log, a replay of the log sees the same time pass at the same place. The time the machine
    uses is the record's append timestamp on the bus; ``ts`` is informational.

    Attributes:
        command_seq: ``seq`` of the job's latest command that was on the bus when the daemon
            appended this tick (0: none yet), or ``None`` in ticks written before 1.2. Folding
            the tick tells the state machine that its commands up to that ``seq`` were acted
            on by then: timeouts that start with a command (the restore timeout) count from
            here, never from the (possibly much older) input that decided it.
    """

    SCHEMA: ClassVar[str] = "tick/1.2"
    job_id: str
    generation: int
    ts: int
    seq: int
    daemon_id: str
    command_seq: int | None = None
    auth: Mac | None = field(default=None, metadata=_OMIT_NONE)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRequest:
    """An operator's request about a whole job, on the ``events`` topic (``job-request/1``).

    Sent by ``trainguard stop`` and by a supervisor (``trainguard run``) that was signalled
    (``stop``) or started with ``--continue`` (``continue``); like an event it names its sender
    with ``host`` and ``pid`` and carries the job's event MAC where keys are in use. The daemon
    folds it in the job's state machine and answers on ``commands``.

    Attributes:
        generation: the job's generation as the sender knew it from the job's latest command
            (0 when there is none). A ``stop`` of a generation older than the job's latest
            continuation is stale (it was meant for the run before it); a ``continue`` must
            name the generation the job was stopped or failed in.
        kind: ``stop``: end the job ``stopped`` (an ``abort`` with ``outcome`` ``stopped``);
            ``continue``: restart a ``stopped`` or ``failed`` job from its latest committed
            snapshot (a ``restore`` of the next generation).
        reason: why, in words (operator's text), at most 4096 characters.
    """

    SCHEMA: ClassVar[str] = "job-request/1.0"
    job_id: str
    generation: int
    ts: int
    seq: int
    host: str
    pid: int
    kind: RequestKind
    reason: str = ""
    auth: Mac | None = field(default=None, metadata=_OMIT_NONE)

    @property
    def rank(self) -> None:
        """Always ``None``: a request speaks for the whole job, like a supervisor's event (so
        that a sender is ``(rank, host, pid)`` for every message of ``events``)."""
        return None


Event: TypeAlias = Heartbeat | Checkpoint | DataCursorEvent | Lifecycle
"""Reports sent by workers and supervisors on the ``events`` topic (the ``events`` topic also
carries :class:`JobRequest` and the daemon's :class:`ClockTick`)."""

Command: TypeAlias = Restore | Resume | Abort
"""Messages sent by the daemon on the ``commands`` topic."""

Message: TypeAlias = Event | Command | Manifest | ClockTick | JobRequest

MESSAGE_TYPES: tuple[type[Message], ...] = (
    Heartbeat,
    Checkpoint,
    DataCursorEvent,
    Lifecycle,
    Restore,
    Resume,
    Abort,
    Manifest,
    ClockTick,
    JobRequest,
)
"""Every top-level message class, one per schema file."""
