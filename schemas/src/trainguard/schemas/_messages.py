"""Typed message objects of the wire contract (ARCHITECTURE.md section 3).

Every message is an immutable dataclass, and the dataclasses are the wire contract's one
definition: :mod:`trainguard.schemas._schema_build` generates from them the JSON Schema file
named by each class's ``SCHEMA`` attribute (``<type>/<major>.<minor>``, file
``json/<type>.v<major>.json``) and ``common.v1.json``. A field's Python type gives its JSON type,
whether it is required (no default) and its default; its ``Annotated`` metadata
(:class:`~trainguard.schemas._wire_types.Wire`, and the
:class:`~trainguard.schemas._wire_types.Shared` aliases such as ``JobId`` and ``Rank``) says
what only the wire states; a class's ``WIRE`` gives its description and rules across fields.
:mod:`trainguard.schemas._codec` converts between the dataclasses and their wire form.

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
* Bounds (ranks < 65536, string lengths, ...) are stated by the fields' metadata and checked
  against the schema files they generate; see ``docs/wire-contract.md``.
* ``auth``: events (and ticks) may carry a :class:`Mac`, commands and manifests a
  :class:`Signature`, over the message's canonical bytes (:mod:`trainguard.schemas._auth`);
  ``None`` (left out on the wire) when the sender holds no key.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Annotated, ClassVar, Final, Literal, TypeAlias

from trainguard.schemas._wire_types import (
    Count,
    DaemonId,
    Digest,
    Generation,
    Host,
    JobId,
    JsonObject,
    JSONValue,
    Kid,
    Loss,
    MessageText,
    Pid,
    Rank,
    Reason,
    Seed,
    Seq,
    Shared,
    ShortText,
    SnapshotId,
    Step,
    Timestamp,
    Uri,
    Wire,
    WorldSize,
)

Phase: TypeAlias = Literal["init", "train", "checkpoint", "eval", "data"]
"""What a rank is doing. ``checkpoint``, ``eval``, ``data`` and ``init`` are declared long phases
that extend the progress timeout."""

LifecycleKind: TypeAlias = Literal["started", "restored", "finished", "exited", "error"]
CheckpointFormat: TypeAlias = Literal["torch", "dcp"]
"""How a rank's part of a snapshot is stored: one ``torch.save`` file, or its files of a
``torch.distributed.checkpoint`` folder (``docs/checkpoints.md``)."""
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


MaybeNonFinite: TypeAlias = Annotated[float, NonFiniteAsString, Loss]
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

    WIRE: ClassVar[Shared] = Shared(
        "mac",
        "An event's authentication: HMAC-SHA256 under the job's event key kid over the"
        " message's canonical bytes (docs/wire-contract.md, Authentication).",
    )
    kid: Kid
    mac: Annotated[
        str,
        Wire(
            "The 32-byte HMAC-SHA256, standard base64 with padding.",
            minLength=44,
            maxLength=44,
            pattern="^[A-Za-z0-9+/]{43}=$",
        ),
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class Signature:
    """The daemon's signature (``auth`` of commands and manifests, since their 1.x bump).

    Attributes:
        kid: id of the daemon's signing key (16 lowercase hex digits: the first 8 bytes of the
            SHA-256 of the raw 32-byte public key).
        sig: Ed25519 signature (RFC 8032) over the message's canonical bytes, 64 bytes in
            standard base64 (padded: 88 characters).
    """

    WIRE: ClassVar[Shared] = Shared(
        "signature",
        "The daemon's signature: Ed25519 under its signing key kid over the message's"
        " canonical bytes (docs/wire-contract.md, Authentication).",
    )
    kid: Kid
    sig: Annotated[
        str,
        Wire(
            "The 64-byte Ed25519 signature, standard base64 with padding.",
            minLength=88,
            maxLength=88,
            pattern="^[A-Za-z0-9+/]{86}==$",
        ),
    ]


def _present(name: str) -> dict[str, JSONValue]:
    """JSON Schema: property ``name`` is present and not null."""
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


def _when(
    name: str,
    value: str,
    doc: str,
    then: dict[str, JSONValue],
    *,
    otherwise: tuple[str, dict[str, JSONValue]] | None = None,
) -> dict[str, JSONValue]:
    """JSON Schema rule across fields: when property ``name`` is ``value``, ``then`` holds
    (described by ``doc``); else the ``otherwise`` properties (``(doc, properties)``) hold."""
    rule: dict[str, JSONValue] = {
        "if": {"properties": {name: {"const": value}}, "required": [name]},
        "then": {"description": doc, **then},
    }
    if otherwise is not None:
        rule["else"] = {"description": otherwise[0], "properties": otherwise[1]}
    return rule


def _auth(kind: Literal["HMAC", "signature"], *, since: str | None) -> Wire:
    """The description of an ``auth`` property: an event's HMAC or the daemon's signature,
    added in minor version ``since`` of its message (``None``: in its first)."""
    what = {
        "HMAC": "HMAC-SHA256 of the sender under its job's event key",
        "signature": "the daemon's Ed25519 signature",
    }[kind]
    prefix = f"Since {since}: " if since else ""
    return Wire(f"{prefix}{what} over the canonical bytes; absent or null when unauthenticated.")


class OmittedWhenNone:
    """``Annotated`` marker for a field the codec leaves out of the wire form when its value is
    ``None`` (``auth``: an unauthenticated message looks exactly as before authentication
    existed)."""


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

    WIRE: ClassVar[Shared] = Shared("cursor", "Exact, world-size independent data-loader position.")
    data_version: Annotated[
        str,
        Wire(
            "Digest of the dataset manifest or an id from the user's data versioning tool.",
            minLength=1,
            maxLength=255,
        ),
    ]
    seed: Seed
    epoch: Annotated[Count, Wire("Epoch number.")]
    offset: Annotated[
        Count, Wire("Global sample offset within the epoch's permutation, in samples.")
    ]
    world_size: Annotated[WorldSize, Wire("World size when the cursor was taken (informational).")]


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointMeta:
    """What a training snapshot is bound to besides its tensors.

    Attributes:
        hyperparameters: free-form JSON object (learning rate, batch size, ...).
        topology: free-form JSON object; by convention holds ``world_size`` and any parallelism
            degrees (``dp``, ``tp``, ``pp``).
        code_version: e.g. a git commit id of the training code.
    """

    WIRE: ClassVar[Shared] = Shared(
        "metadata", "What a training snapshot is bound to besides its tensors."
    )
    hyperparameters: Annotated[JsonObject, Wire("Free-form: learning rate, batch size, ...")] = (
        field(default_factory=dict)
    )
    topology: Annotated[
        JsonObject,
        Wire("Free-form: world_size and parallelism degrees (dp, tp, pp) by convention."),
    ] = field(default_factory=dict)
    code_version: Annotated[ShortText, Wire("E.g. the git commit id of the training code.")] = ""


# A heartbeat's own fields, shared by :class:`Heartbeat` and the entries of a
# :class:`HeartbeatBatch` (:class:`BatchedBeat`), so that both say the same on the wire.
_BeatWorldSize: TypeAlias = Annotated[WorldSize, Wire("World size the rank runs in.")]
_BeatStep: TypeAlias = Annotated[Step, Wire("Last completed training step.")]
_BeatPhase: TypeAlias = Annotated[
    Phase, Wire("What the rank is doing; checkpoint, eval, data and init are long phases.")
]
_BeatStepTime: TypeAlias = Annotated[
    float | None,
    Wire("Duration of the last step in seconds, or null before the first step.", minimum=0),
]
_BeatLoss: TypeAlias = Annotated[
    MaybeNonFinite | None,
    Wire(
        "Last loss (non-finite as nan/inf/-inf), or null when not reported.",
        comment="A number or null matches the first branch: validators that try the"
        " branches in order (fastjsonschema raises and catches an exception per failed"
        " branch) then pass the common cases without trying another.",
    ),
]
_BeatSamples: TypeAlias = Annotated[Count, Wire("Samples this rank has consumed in total.")]
_BeatChecksum: TypeAlias = Annotated[
    str | None,
    Wire(
        "Cheap deterministic checksum of the parameters at step (lowercase hex), or null.",
        pattern="^[0-9a-f]{1,128}$",
    ),
]
_BeatStepAge: TypeAlias = Annotated[
    float | None,
    Wire(
        "Since 1.2: seconds from the completion of step to the building of this"
        " heartbeat (the sender's monotonic clock), or null when no step has completed"
        " in this process.",
        minimum=0,
    ),
]


@dataclass(frozen=True, slots=True, kw_only=True)
class _RankEvent:
    """The fields every event a rank sends starts with: job, generation, time, sequence number
    and sender (the module docstring's conventions). A base of such messages, not one itself:
    its fields come first in theirs, in this order."""

    job_id: JobId
    generation: Annotated[Generation, Wire("Generation the sender runs in.")]
    ts: Timestamp
    seq: Seq
    rank: Rank
    host: Host
    pid: Pid


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(_RankEvent):
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
    WIRE: ClassVar[Wire] = Wire("Periodic liveness and progress report of one rank.")
    world_size: _BeatWorldSize
    step: _BeatStep
    phase: _BeatPhase
    step_time_s: _BeatStepTime = None
    loss: _BeatLoss = None
    samples: _BeatSamples = 0
    param_checksum: _BeatChecksum = None
    step_age_s: _BeatStepAge = None
    auth: Annotated[Mac | None, _auth("HMAC", since="1.1"), OmittedWhenNone] = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint(_RankEvent):
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
        files: for a DCP checkpoint (since 1.3), the files the rank wrote in the folder
            ``shard_uri``, each with size and digest (rank 0's include ``.metadata``);
            ``size_bytes`` is then their sum and ``digest`` their :func:`files_digest`.
            ``None`` for a ``torch.save`` shard.
    """

    SCHEMA: ClassVar[str] = "checkpoint/1.3"
    WIRE: ClassVar[Wire] = Wire(
        "One rank's shard of a checkpoint, sent after the shard is fsynced and atomically"
        " renamed into place."
    )
    world_size: Annotated[WorldSize, Wire("World size the rank runs in.")]
    step: Annotated[Step, Wire("Training step the shard captures.")]
    shard_uri: Annotated[Uri, Wire("Where the shard lives.")]
    size_bytes: Annotated[Count, Wire("Shard size in bytes.")]
    digest: Annotated[
        Digest, Wire("SHA-256 of the shard's bytes; for a DCP shard, of its file list (files).")
    ]
    cursor: Annotated[DataCursor, Wire("Data cursor matching step.")]
    metadata: Annotated[CheckpointMeta, Wire("Hyperparameters, topology and code version.")] = (
        field(default_factory=CheckpointMeta)
    )
    parent: Annotated[
        SnapshotId | None,
        Wire(
            "Since 1.1: snapshot_id of another job's committed snapshot this job started from"
            " (fine-tune lineage), or null."
        ),
    ] = None
    auth: Annotated[Mac | None, _auth("HMAC", since="1.2"), OmittedWhenNone] = None
    files: Annotated[StoredFiles, Wire("Since 1.3: " + _FILES_DOC)] = None

    @property
    def data_version(self) -> str:
        """The dataset version the shard was trained on (the cursor's)."""
        return self.cursor.data_version

    @property
    def format(self) -> CheckpointFormat:
        """``"dcp"`` when the shard lists DCP files, else ``"torch"``."""
        return "torch" if self.files is None else "dcp"


@dataclass(frozen=True, slots=True, kw_only=True)
class DataCursorEvent(_RankEvent):
    """A rank's data cursor after ``step`` (``data-cursor/1``)."""

    SCHEMA: ClassVar[str] = "data-cursor/1.1"
    WIRE: ClassVar[Wire] = Wire("A rank's data cursor after step.")
    step: Annotated[Step, Wire("Training step after which the cursor was taken.")]
    cursor: DataCursor
    auth: Annotated[Mac | None, _auth("HMAC", since="1.1"), OmittedWhenNone] = None


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
    WIRE: ClassVar[Wire] = Wire(
        "A process lifecycle report from a worker or a supervisor.",
        allOf=[
            _when("kind", "restored", "kind restored needs step", _present("step")),
            _when(
                "kind",
                "exited",
                "kind exited needs exit_code or signal",
                {"anyOf": [_present("exit_code"), _present("signal")]},
                otherwise=(
                    "only kind exited carries exit_code or signal",
                    {"exit_code": {"type": "null"}, "signal": {"type": "null"}},
                ),
            ),
            _when(
                "kind",
                "error",
                "kind error needs a non-empty message",
                {"required": ["message"], "properties": {"message": {"minLength": 1}}},
            ),
        ],
    )
    job_id: JobId
    generation: Annotated[Generation, Wire("Generation the sender runs in.")]
    ts: Timestamp
    seq: Seq
    rank: Annotated[
        Rank | None,
        Wire("The worker's rank, or null when a supervisor reports for its whole process group."),
    ]
    host: Host
    pid: Pid
    kind: Annotated[
        LifecycleKind,
        Wire("started, restored (ack of a restore), finished, exited, error."),
    ]
    ranks: Annotated[
        tuple[Rank, ...],
        Wire(
            "Ranks the reporting process group hosts (supervisors), else empty.",
            comment="items and uniqueItems sit in allOf, which validators apply in order, so"
            " uniqueness is only computed once every item is known to be an integer:"
            " fastjsonschema checks uniqueItems before items and would otherwise recurse into"
            " a deeply nested array.",
            maxItems=65536,
            unique_items_after=True,
        ),
    ] = ()
    exit_code: Annotated[
        int | None, Wire("Process exit status for exited, else null.", minimum=0, maximum=255)
    ] = None
    signal: Annotated[
        int | None,
        Wire(
            "Number of the signal that ended the process for exited, else null.",
            minimum=1,
            maximum=127,
        ),
    ] = None
    step: Annotated[Step | None, Wire("The step the rank stands at, when known.")] = None
    cursor: Annotated[
        DataCursor | None,
        Wire("The data cursor at step (restored: where the rank now stands, when it tracks one)."),
    ] = None
    world_size: Annotated[
        WorldSize | None, Wire("The world size the sender runs in, when known (started).")
    ] = None
    snapshot_id: Annotated[
        SnapshotId | None,
        Wire("For restored, the snapshot loaded; for error, a snapshot that failed verification."),
    ] = None
    message: Annotated[MessageText, Wire("Human-readable detail (required for error).")] = ""
    missed_at_step: Annotated[
        Step | None,
        Wire(
            "For error: the rank had already completed the at_step of this generation's"
            " in_process restore when it arrived, so the daemon falls back to a restart; else"
            " null."
        ),
    ] = None
    auth: Annotated[Mac | None, _auth("HMAC", since="1.2"), OmittedWhenNone] = None


EXIT_CONFIG: Final = 78
"""The exit status of a worker that cannot start because of its configuration (``EX_CONFIG``
of BSD's ``sysexits.h``): a setting is missing or invalid, or names storage that refuses it, so
starting it again cannot help. A ``lifecycle exited`` with this ``exit_code`` makes the daemon
fail the job at once, with the report's ``message`` (the worker's last words) in the reason,
instead of restoring (``docs/recovery.md``, "A configuration error is not restarted")."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredFile:
    """One file of a rank's DCP checkpoint, as written.

    Attributes:
        name: file name inside the checkpoint folder (``__0_0.distcp``, ``.metadata``, ...);
            never a path.
        size_bytes: its size in bytes.
        digest: ``sha256:<64 hex>`` of its bytes, computed while they were written.
    """

    WIRE: ClassVar[Shared] = Shared(
        "stored_file", "One file of a DCP checkpoint folder, with its size and SHA-256."
    )
    name: Annotated[
        str,
        Wire(
            "File name inside the checkpoint folder, never a path (nor . or ..).",
            pattern=r"^\.?[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}$",
        ),
    ]
    size_bytes: Annotated[Count, Wire("File size in bytes.")]
    digest: Digest


_FILES_DOC: Final = (
    "for a DCP checkpoint (torch.distributed.checkpoint), the files this rank wrote in the"
    " folder named by the URI (rank 0's include the coordinator's .metadata); absent for a"
    " per-rank torch.save file."
)
StoredFiles: TypeAlias = Annotated[
    tuple[StoredFile, ...] | None, Wire(minItems=1, maxItems=4096), OmittedWhenNone
]


def files_digest(files: Sequence[StoredFile]) -> str:
    """The digest of a DCP shard: SHA-256 over its file list, one ``name NUL size NUL digest
    LF`` line per file in name order, so the ``digest`` a shard always carries covers the
    digest of every file it lists."""
    sha = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.name):
        sha.update(f"{f.name}\0{f.size_bytes}\0{f.digest}\n".encode())
    return f"sha256:{sha.hexdigest()}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Shard:
    """One rank's part of a training snapshot: a ``torch.save`` file, or (``files`` set) the
    rank's files of a DCP checkpoint folder.

    Attributes:
        rank: the rank that wrote it.
        uri: the file (``torch.save``), or the checkpoint folder (DCP; the same for every rank).
        size_bytes: bytes of the file, or of all the rank's ``files``.
        digest: SHA-256 of the file, or :func:`files_digest` of ``files``.
        files: DCP only (since manifest 1.2): the files the rank wrote in ``uri``.
    """

    WIRE: ClassVar[Shared] = Shared(
        "shard", "One rank's part of a training snapshot: a file, or its files of a DCP folder."
    )
    rank: Rank
    uri: Uri
    size_bytes: Annotated[Count, Wire("Bytes of the file, or of all the rank's files.")]
    digest: Annotated[
        str,
        Wire(
            "SHA-256 of the file's bytes; for a DCP shard, of its file list (name, size and"
            " digest of each file in name order).",
            pattern="^sha256:[0-9a-f]{64}$",
        ),
    ]
    files: Annotated[StoredFiles, Wire("Since manifest 1.2: " + _FILES_DOC)] = None

    @property
    def format(self) -> CheckpointFormat:
        """``"dcp"`` when the shard lists DCP files, else ``"torch"``."""
        return "torch" if self.files is None else "dcp"

    @property
    def folder(self) -> str:
        """The step folder the shard lies in: the DCP folder itself, or the ``torch.save``
        file's folder (its URI without the last path segment)."""
        return self.uri.rstrip("/") if self.files is not None else self.uri.rsplit("/", 1)[0]


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

    SCHEMA: ClassVar[str] = "manifest/1.2"
    WIRE: ClassVar[Wire] = Wire("A committed training snapshot: what a restore resumes from.")
    job_id: JobId
    snapshot_id: SnapshotId
    generation: Annotated[Generation, Wire("Generation in which the shards were written.")]
    ts: Annotated[Timestamp, Wire("When the step was committed, nanoseconds since the Unix epoch.")]
    step: Annotated[Step, Wire("Training step captured.")]
    world_size: Annotated[WorldSize, Wire("World size the snapshot was written with.")]
    shards: Annotated[
        tuple[Shard, ...],
        Wire("One shard per rank of world_size, ordered by rank.", minItems=1, maxItems=65536),
    ]
    cursor: Annotated[DataCursor, Wire("Data cursor at step.")]
    metadata: Annotated[CheckpointMeta, Wire("Hyperparameters, topology and code version.")] = (
        field(default_factory=CheckpointMeta)
    )
    parent: Annotated[
        SnapshotId | None,
        Wire("snapshot_id this job started from (fine-tune lineage), or null."),
    ] = None
    auth: Annotated[Signature | None, _auth("signature", since="1.1"), OmittedWhenNone] = None

    @property
    def data_version(self) -> str:
        """The dataset version every shard was trained on."""
        return self.cursor.data_version


MANIFEST_PART_RANKS: Final = 1024
"""Ranks per :class:`ManifestPart`: at about 190 bytes per ``torch.save`` shard a part is
about 190 KiB, so a 16,384-rank manifest is 16 parts and a rank reads one of them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ManifestPartRef:
    """Where one :class:`ManifestPart` of a snapshot's manifest is, and what its bytes are.

    Attributes:
        first_rank: the first rank whose shard the part lists.
        ranks: how many consecutive ranks it lists (>= 1).
        size_bytes: length of the part's stored bytes (its ``encode``).
        digest: SHA-256 of those bytes.
    """

    WIRE: ClassVar[Shared] = Shared(
        "manifest_part_ref",
        "One part of a manifest too large for a message: its ranks and the SHA-256 of its bytes.",
    )
    first_rank: Rank
    ranks: Annotated[WorldSize, Wire("How many consecutive ranks the part lists.")]
    size_bytes: Annotated[Count, Wire("Length of the part's stored bytes.")]
    digest: Digest


@dataclass(frozen=True, slots=True, kw_only=True)
class ManifestHead:
    """A committed snapshot's manifest without its shards (``manifest-head/1``): everything a
    :class:`Manifest` says except the shard list, which lies in :class:`ManifestPart` files
    beside the checkpoint, each named with its digest here.

    The daemon writes it (unsigned, ``canonical_bytes``) to ``<step folder>/trainguard/
    manifest.json``, and publishes it signed on ``manifests`` when the whole manifest would not
    fit a record. A :class:`SnapshotRef`'s ``manifest_digest`` is the SHA-256 of those stored
    bytes, so a signed restore command authenticates the head, and the head every part.

    Attributes:
        job_id, snapshot_id, generation, ts, step, world_size, cursor, metadata, parent: as in
            the :class:`Manifest`.
        folder: the step folder the head and parts lie in (rank 0's shard's).
        size_bytes: bytes of all shards together.
        parts: the parts, in rank order, covering ranks ``0..world_size-1`` once each.
    """

    SCHEMA: ClassVar[str] = "manifest-head/1.0"
    WIRE: ClassVar[Wire] = Wire(
        "A committed snapshot's manifest without its shard list, which lies in parts beside the"
        " checkpoint, each named with its SHA-256."
    )
    job_id: JobId
    snapshot_id: SnapshotId
    generation: Annotated[Generation, Wire("Generation in which the shards were written.")]
    ts: Annotated[Timestamp, Wire("When the step was committed, nanoseconds since the Unix epoch.")]
    step: Annotated[Step, Wire("Training step captured.")]
    world_size: Annotated[WorldSize, Wire("World size the snapshot was written with.")]
    cursor: Annotated[DataCursor, Wire("Data cursor at step.")]
    metadata: Annotated[CheckpointMeta, Wire("Hyperparameters, topology and code version.")] = (
        field(default_factory=CheckpointMeta)
    )
    parent: Annotated[
        SnapshotId | None,
        Wire("snapshot_id this job started from (fine-tune lineage), or null."),
    ] = None
    folder: Annotated[Uri, Wire("The step folder the head and its parts lie in.")]
    size_bytes: Annotated[Count, Wire("Bytes of all shards together.")]
    parts: Annotated[
        tuple[ManifestPartRef, ...],
        Wire("The parts in rank order, covering every rank once.", minItems=1, maxItems=65536),
    ]
    auth: Annotated[Signature | None, _auth("signature", since=None), OmittedWhenNone] = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ManifestPart:
    """The shards of ranks ``first_rank`` .. ``first_rank + len(shards) - 1`` of a snapshot
    (``manifest-part/1``), stored beside the checkpoint as ``trainguard/part-<first_rank>.json``
    and checked against its :class:`ManifestPartRef` before use.

    Attributes:
        snapshot_id: the snapshot it belongs to.
        first_rank: the rank of its first shard.
        shards: consecutive ranks' shards, ordered by rank.
    """

    SCHEMA: ClassVar[str] = "manifest-part/1.0"
    WIRE: ClassVar[Wire] = Wire("Consecutive ranks' shards of a committed snapshot's manifest.")
    snapshot_id: SnapshotId
    first_rank: Rank
    shards: Annotated[
        tuple[Shard, ...],
        Wire("Consecutive ranks' shards, ordered by rank.", minItems=1, maxItems=65536),
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotRef:
    """A committed snapshot named by id and by the digest of its manifest: what a restore
    command carries, whatever the number of ranks.

    Attributes:
        job_id: the job whose snapshot it is.
        snapshot_id: ``<job_id>/g<generation>/s<step>``.
        generation: generation in which the shards were written.
        step: training step captured.
        world_size: world size the snapshot was written with.
        cursor: data cursor at ``step``.
        parent: ``snapshot_id`` the job started from (lineage), or ``None``.
        folder: the step folder; its manifest is ``<folder>/trainguard/manifest.json``.
        manifest_digest: SHA-256 of that file's bytes (:class:`ManifestHead`'s
            ``canonical_bytes``).
    """

    WIRE: ClassVar[Shared] = Shared(
        "snapshot_ref", "A committed snapshot, named by id and by the SHA-256 of its manifest."
    )
    job_id: JobId
    snapshot_id: SnapshotId
    generation: Annotated[Generation, Wire("Generation in which the shards were written.")]
    step: Annotated[Step, Wire("Training step captured.")]
    world_size: Annotated[WorldSize, Wire("World size the snapshot was written with.")]
    cursor: Annotated[DataCursor, Wire("Data cursor at step.")]
    parent: Annotated[
        SnapshotId | None,
        Wire("snapshot_id this job started from (fine-tune lineage), or null."),
    ]
    folder: Annotated[Uri, Wire("The step folder; its manifest is trainguard/manifest.json in it.")]
    manifest_digest: Annotated[
        Digest, Wire("SHA-256 of the manifest head's stored bytes (its canonical form, unsigned).")
    ]

    @property
    def data_version(self) -> str:
        """The dataset version every shard was trained on."""
        return self.cursor.data_version


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRange:
    """Training steps ``from_step`` to ``to_step``, both included.

    Raises:
        ValueError: ``from_step > to_step`` (also from ``decode``, as a ``SchemaViolation``).

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

    WIRE: ClassVar[Shared] = Shared(
        "step_range",
        "Training steps from_step to to_step, both included (from_step <= to_step, which the"
        " schema cannot state).",
    )
    from_step: Annotated[Step, Wire("First step of the range.")]
    to_step: Annotated[Step, Wire("Last step of the range.")]

    def __post_init__(self) -> None:
        # The one rule across fields the schema cannot state: a reversed range would make a
        # restored rank train the batches between the two steps again.
        if self.from_step > self.to_step:
            raise ValueError(f"from_step {self.from_step} is after to_step {self.to_step}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Restore:
    """Command: roll every rank back to a committed snapshot (``restore/2``).

    Attributes:
        generation: the new fencing generation the ranks run in after the restore.
        incident_id: identifies the incident that caused the restore (one restore per incident).
        reason: human-readable evidence, e.g. ``"rank 1 exited (signal 9)"``.
        target: the snapshot to load, named by id and manifest digest (since 2.0; 1.x
            carried the whole manifest, one shard per rank, which outgrew a record at a few
            thousand ranks), or ``None`` to start from the job's initial state (no step
            committed yet): from scratch, or from the snapshot of another job the job started
            from (``Checkpoint.parent``), which the agent loads again.
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

    SCHEMA: ClassVar[str] = "restore/2.0"
    WIRE: ClassVar[Wire] = Wire(
        "Command: roll every rank back to a committed snapshot.",
        allOf=[_when("mode", "in_process", "mode in_process needs at_step", _present("at_step"))],
    )
    job_id: JobId
    generation: Annotated[
        Generation, Wire("The new fencing generation the ranks run in after the restore.")
    ]
    ts: Timestamp
    seq: Seq
    daemon_id: DaemonId
    incident_id: Annotated[
        str,
        Wire("Identifies the incident that caused the restore.", minLength=1, maxLength=255),
    ]
    reason: Reason
    target: Annotated[
        SnapshotRef | None,
        Wire(
            "The snapshot to load, by id and manifest digest, or null to start from the job's"
            " initial state."
        ),
    ]
    mode: Annotated[
        RestoreMode,
        Wire(
            "restart: supervisors restart the processes; in_process: agents reload at a step"
            " boundary."
        ),
    ] = "restart"
    attempt: Annotated[
        int,
        Wire(
            "1 for the first try of this incident's restore, 2 for the first retry, ...",
            minimum=1,
            maximum=2**63 - 1,
        ),
    ] = 1
    at_step: Annotated[
        Step | None,
        Wire(
            "in_process (required then): the step boundary at which every rank stops, reloads"
            " and acknowledges; null for restart."
        ),
    ] = None
    skip: Annotated[
        StepRange | None,
        Wire(
            "Steps whose batches the restored ranks skip (the data cursor jumps past them when"
            " it reaches from_step), or null to replay the data exactly."
        ),
    ] = None
    auth: Annotated[Signature | None, _auth("signature", since=None), OmittedWhenNone] = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Resume:
    """Command: every rank acknowledged the restore of ``generation``; continue training."""

    SCHEMA: ClassVar[str] = "resume/1.1"
    WIRE: ClassVar[Wire] = Wire(
        "Command: every rank acknowledged the restore of generation; continue training."
    )
    job_id: JobId
    generation: Annotated[Generation, Wire("Generation the command establishes or acts in.")]
    ts: Timestamp
    seq: Seq
    daemon_id: DaemonId
    step: Annotated[Step, Wire("The step the ranks resume from.")]
    auth: Annotated[Signature | None, _auth("signature", since="1.1"), OmittedWhenNone] = None


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
    WIRE: ClassVar[Wire] = Wire(
        "Command: end the job: failed, or stopped on request (then it may be continued)."
    )
    job_id: JobId
    generation: Annotated[Generation, Wire("Generation the command establishes or acts in.")]
    ts: Timestamp
    seq: Seq
    daemon_id: DaemonId
    reason: Reason
    outcome: Annotated[
        AbortOutcome,
        Wire(
            "Since 1.2: failed (the daemon gave up on the job) or stopped (on request; a"
            " continue request restarts it from its latest committed snapshot). A second abort"
            " of the same generation with a higher seq answers a continue the daemon refused."
        ),
    ] = "failed"
    auth: Annotated[Signature | None, _auth("signature", since="1.1"), OmittedWhenNone] = None


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
    WIRE: ClassVar[Wire] = Wire(
        "The daemon's clock, written into a job's event stream so that replaying the stream"
        " replays its timeouts. The time that counts is the bus record's append timestamp,"
        " not ts."
    )
    job_id: JobId
    generation: Annotated[
        Generation,
        Wire("The job's generation as the daemon knew it when it wrote the tick (informational)."),
    ]
    ts: Timestamp
    seq: Seq
    daemon_id: DaemonId
    command_seq: Annotated[
        Seq | None,
        Wire(
            "Since 1.2: seq of the job's latest command that was on the bus when the daemon"
            " appended this tick (0: none yet); timeouts that start with a command count from"
            " the first tick naming it. Absent or null in older ticks."
        ),
    ] = None
    auth: Annotated[Mac | None, _auth("HMAC", since="1.1"), OmittedWhenNone] = None


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
    WIRE: ClassVar[Wire] = Wire(
        "An operator's request about a whole job (trainguard stop, a signalled supervisor,"
        " trainguard run --continue), on the events topic. The daemon folds it and answers on"
        " commands: an abort with outcome stopped for stop, a restore of the next generation"
        " (or an abort refusing it) for continue."
    )
    job_id: JobId
    generation: Annotated[
        Generation,
        Wire(
            "The job's generation as the sender knew it from the job's latest command (0 when"
            " there is none). A stop older than the job's latest continuation is stale; a"
            " continue names the generation the job was stopped or failed in."
        ),
    ]
    ts: Timestamp
    seq: Seq
    host: Host
    pid: Pid
    kind: Annotated[
        RequestKind,
        Wire(
            "stop: end the job stopped; continue: restart a stopped or failed job from its"
            " latest committed snapshot."
        ),
    ]
    reason: Annotated[MessageText, Wire("Why, in words (the operator's text), possibly empty.")] = (
        ""
    )
    auth: Annotated[Mac | None, _auth("HMAC", since=None), OmittedWhenNone] = None

    @property
    def rank(self) -> None:
        """Always ``None``: a request speaks for the whole job, like a supervisor's event (so
        that a sender is ``(rank, host, pid)`` for every message of ``events``)."""
        return None


MAX_BATCHED_BEATS: Final = 256
"""Most heartbeats one :class:`HeartbeatBatch` carries (a node's ranks; a heartbeat entry is
about 250 bytes, so a full batch stays well inside the codec's 64 KiB)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchedBeat:
    """One rank's heartbeat inside a :class:`HeartbeatBatch`: a :class:`Heartbeat` without
    ``job_id``, ``host`` and ``auth``, which the batch states once for all of its entries.

    Attributes:
        generation, ts, seq, rank, pid: the rank's, exactly as its own heartbeat would carry
            them (``seq`` is the rank's own counter, shared with its other events).
        world_size, step, phase, step_time_s, loss, samples, param_checksum, step_age_s: as
            in :class:`Heartbeat`, as the rank built it (the time it then waited for its
            batch is delivery delay to the daemon, like the bus's own).
    """

    WIRE: ClassVar[Shared] = Shared(
        "batched_beat",
        "One rank's heartbeat inside a heartbeat batch: a heartbeat/1 without job_id, host and"
        " auth, which the batch states once.",
    )
    generation: Annotated[Generation, Wire("Generation the rank runs in.")]
    ts: Annotated[Timestamp, Wire("The rank's wall clock when it built the heartbeat.")]
    seq: Annotated[Seq, Wire("The rank's own counter (shared with its other events).")]
    rank: Rank
    pid: Annotated[Pid, Wire("The rank's worker process.")]
    world_size: _BeatWorldSize
    step: _BeatStep
    phase: _BeatPhase
    step_time_s: _BeatStepTime = None
    loss: _BeatLoss = None
    samples: _BeatSamples = 0
    param_checksum: _BeatChecksum = None
    step_age_s: _BeatStepAge = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatBatch:
    """The heartbeats of one node's ranks in one record (``heartbeat-batch/1``), sent by the
    node's supervisor instead of one record per rank (``docs/wire-contract.md``, "Heartbeat
    batches").

    The daemon folds it as the heartbeats it carries, in order, each as if it had come alone at
    the batch's bus append time (:meth:`heartbeats`). It speaks only for ranks of its own
    ``host``, and only with heartbeats those ranks built: its sender adds a rank's latest
    heartbeat only when the rank sent one since the previous batch, so a silent rank is
    missing from it and is detected as before. It is MACed under the job's event key like any
    event (the supervisor holds it), so only a holder of that key can speak for a rank.

    Attributes:
        ts, seq, host, pid: the sender's (the supervisor's) clock, counter, host and process.
        beats: one entry per rank heard from since the previous batch, ranks unique.
    """

    SCHEMA: ClassVar[str] = "heartbeat-batch/1.0"
    WIRE: ClassVar[Wire] = Wire(
        "The heartbeats of one node's ranks in one record, sent by the node's supervisor; the"
        " daemon folds each entry as the heartbeat of its rank on host."
    )
    job_id: JobId
    ts: Timestamp
    seq: Seq
    host: Annotated[Host, Wire("The node all the batch's ranks run on.")]
    pid: Annotated[Pid, Wire("The sender's (the supervisor's) process.")]
    beats: Annotated[
        tuple[BatchedBeat, ...],
        Wire(
            "The ranks' latest heartbeats since the previous batch, one per rank.",
            minItems=1,
            maxItems=MAX_BATCHED_BEATS,
        ),
    ]
    auth: Annotated[Mac | None, _auth("HMAC", since=None), OmittedWhenNone] = None

    @property
    def rank(self) -> None:
        """Always ``None``: a batch is its supervisor's message (its sender is ``(None, host,
        pid)``, as for every message of ``events``); its entries name their ranks."""
        return None

    def heartbeats(self) -> tuple[Heartbeat, ...]:
        """The batch's entries as the heartbeats their ranks built, in order (no ``auth``:
        the batch's MAC vouches for them)."""
        return tuple(self.heartbeat(b) for b in self.beats)

    def heartbeat(self, beat: BatchedBeat) -> Heartbeat:
        """Entry ``beat`` as the heartbeat its rank built (job and host the batch's)."""
        return Heartbeat(
            job_id=self.job_id,
            host=self.host,
            **dict(zip(_BEAT_FIELDS, _beat_values(beat), strict=True)),
        )


_BEAT_FIELDS: Final = tuple(f.name for f in fields(BatchedBeat))
"""A batch entry's fields: a heartbeat's but ``job_id``, ``host`` and ``auth``."""
_beat_values: Final = operator.attrgetter(*_BEAT_FIELDS)


def batched_beat(beat: Heartbeat) -> BatchedBeat:
    """``beat`` as an entry of a :class:`HeartbeatBatch`: every field as its rank built it
    (``ts`` and ``step_age_s`` date its building, so the time it waited for its batch counts
    as delivery delay, as the bus's own does)."""
    return BatchedBeat(**dict(zip(_BEAT_FIELDS, _beat_values(beat), strict=True)))


Event: TypeAlias = Heartbeat | Checkpoint | DataCursorEvent | Lifecycle
"""Reports sent by workers and supervisors on the ``events`` topic (the ``events`` topic also
carries :class:`JobRequest` and the daemon's :class:`ClockTick`)."""

Command: TypeAlias = Restore | Resume | Abort
"""Messages sent by the daemon on the ``commands`` topic."""

Message: TypeAlias = (
    Event
    | Command
    | Manifest
    | ManifestHead
    | ManifestPart
    | ClockTick
    | JobRequest
    | HeartbeatBatch
)

MESSAGE_TYPES: tuple[type[Message], ...] = (
    Heartbeat,
    Checkpoint,
    DataCursorEvent,
    Lifecycle,
    Restore,
    Resume,
    Abort,
    Manifest,
    ManifestHead,
    ManifestPart,
    ClockTick,
    JobRequest,
    HeartbeatBatch,
)
"""Every top-level message class, one per schema file."""

EVENTS_TOPIC_TYPES: tuple[type[Message], ...] = (
    Heartbeat,
    Checkpoint,
    DataCursorEvent,
    Lifecycle,
    ClockTick,
    JobRequest,
    HeartbeatBatch,
)
"""The message classes the ``events`` topic carries, every one with a MAC as its ``auth``
(``docs/security.md``): what the daemon's intake decodes and authenticates."""

SHARED_TYPES: tuple[object, ...] = (
    JobId,
    Generation,
    Timestamp,
    Seq,
    Step,
    Count,
    Seed,
    Rank,
    WorldSize,
    Pid,
    Host,
    DaemonId,
    Digest,
    Uri,
    Reason,
    MessageText,
    ShortText,
    Loss,
    SnapshotId,
    JsonObject,
    DataCursor,
    CheckpointMeta,
    StoredFile,
    Shard,
    ManifestPartRef,
    SnapshotRef,
    StepRange,
    Kid,
    Mac,
    Signature,
    BatchedBeat,
)
"""The types every message may share, in the order of ``common.v1.json``'s ``$defs``: the
:class:`~trainguard.schemas._wire_types.Shared` aliases and the dataclasses whose ``WIRE`` is
one."""
