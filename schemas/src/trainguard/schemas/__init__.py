"""The wire contract of trainguard: typed messages, their JSON Schema files and the codec.

Every message is a frozen dataclass (``Heartbeat``, ``Checkpoint``, ... ``Manifest``) with a
``SCHEMA`` class attribute ``"<type>/<major>.<minor>"`` naming its JSON Schema file
(``json/<type>.v<major>.json``, draft 2020-12). ``encode(msg)`` gives canonical JSON bytes;
``decode(data, expect=...)`` validates bytes against the schema and returns the dataclass, or
raises a :class:`SchemaError` subclass naming the field and the reason. ``add_mac``/``sign``
authenticate a message (events carry an HMAC-SHA256, commands and manifests the daemon's
Ed25519 signature, in ``auth``); ``verify_mac``/``verify_signature`` check received bytes and
raise :class:`Unauthenticated`; ``split_mac``/``verify_raw_mac``/``decode_maced`` check the MAC
of an event laid out as ``encode`` writes it before decoding it. ``docs/wire-contract.md``
describes the messages, the version rule, authentication and the errors. Beside the messages,
:mod:`trainguard.schemas.settings` is the contract of settings: every party's configuration
(TOML tables, overrides, environment variables) is checked by it against its dataclass.

Example::

    from trainguard.schemas import Heartbeat, decode, encode

    data = encode(Heartbeat(job_id="j", generation=0, ts=0, seq=1, rank=0, host="h", pid=1,
                            world_size=1, step=0, phase="init"))
    hb = decode(data, expect=Heartbeat)
"""

from trainguard.schemas._auth import (
    AuthFailure,
    RawMac,
    Unauthenticated,
    add_mac,
    canonical_bytes,
    decode_maced,
    sign,
    split_mac,
    verify_mac,
    verify_raw_mac,
    verify_signature,
)
from trainguard.schemas._codec import DEFAULT_MAX_BYTES, decode, decode_parsed, encode
from trainguard.schemas._errors import (
    MessageTooLarge,
    NestingTooDeep,
    NotJSON,
    NotUTF8,
    SchemaError,
    SchemaViolation,
    UnexpectedMessage,
    UnknownSchema,
)
from trainguard.schemas._messages import (
    EVENTS_TOPIC_TYPES,
    EXIT_CONFIG,
    MANIFEST_PART_RANKS,
    MAX_BATCHED_BEATS,
    MESSAGE_TYPES,
    Abort,
    AbortOutcome,
    BatchedBeat,
    Checkpoint,
    CheckpointFormat,
    CheckpointMeta,
    ClockTick,
    Command,
    DataCursor,
    DataCursorEvent,
    Event,
    Heartbeat,
    HeartbeatBatch,
    JobRequest,
    Lifecycle,
    LifecycleKind,
    Mac,
    Manifest,
    ManifestHead,
    ManifestPart,
    ManifestPartRef,
    MaybeNonFinite,
    Message,
    NonFiniteAsString,
    Phase,
    RequestKind,
    Restore,
    RestoreMode,
    Resume,
    Shard,
    Signature,
    SnapshotRef,
    StepRange,
    StoredFile,
    batched_beat,
    files_digest,
)
from trainguard.schemas._schema_files import SCHEMA_BASE_URI, load_schema, schema_path
from trainguard.schemas._snapshot_parts import (
    MANIFEST_DIR,
    SplitManifest,
    head_path,
    join_manifest,
    part_for_rank,
    part_path,
    sha256_digest,
    snapshot_ref,
    split_manifest,
)
from trainguard.schemas._wire_form import MAX_FREEFORM_DEPTH
from trainguard.schemas._wire_types import JSONValue

__all__ = [
    "DEFAULT_MAX_BYTES",
    "EVENTS_TOPIC_TYPES",
    "EXIT_CONFIG",
    "MANIFEST_DIR",
    "MANIFEST_PART_RANKS",
    "MAX_BATCHED_BEATS",
    "MAX_FREEFORM_DEPTH",
    "MESSAGE_TYPES",
    "SCHEMA_BASE_URI",
    "Abort",
    "AbortOutcome",
    "AuthFailure",
    "BatchedBeat",
    "Checkpoint",
    "CheckpointFormat",
    "CheckpointMeta",
    "ClockTick",
    "Command",
    "DataCursor",
    "DataCursorEvent",
    "Event",
    "Heartbeat",
    "HeartbeatBatch",
    "JSONValue",
    "JobRequest",
    "Lifecycle",
    "LifecycleKind",
    "Mac",
    "Manifest",
    "ManifestHead",
    "ManifestPart",
    "ManifestPartRef",
    "MaybeNonFinite",
    "Message",
    "MessageTooLarge",
    "NestingTooDeep",
    "NonFiniteAsString",
    "NotJSON",
    "NotUTF8",
    "Phase",
    "RawMac",
    "RequestKind",
    "Restore",
    "RestoreMode",
    "Resume",
    "SchemaError",
    "SchemaViolation",
    "Shard",
    "Signature",
    "SnapshotRef",
    "SplitManifest",
    "StepRange",
    "StoredFile",
    "Unauthenticated",
    "UnexpectedMessage",
    "UnknownSchema",
    "add_mac",
    "batched_beat",
    "canonical_bytes",
    "decode",
    "decode_maced",
    "decode_parsed",
    "encode",
    "files_digest",
    "head_path",
    "join_manifest",
    "load_schema",
    "part_for_rank",
    "part_path",
    "schema_path",
    "sha256_digest",
    "sign",
    "snapshot_ref",
    "split_mac",
    "split_manifest",
    "verify_mac",
    "verify_raw_mac",
    "verify_signature",
]
