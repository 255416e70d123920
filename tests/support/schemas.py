"""Shared helpers of the wire-contract tests: hypothesis strategies for every message, the
JSON examples of docs/wire-contract.md, and the two validators the tests compare."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no types-jsonschema in the dev env
from hypothesis import strategies as st
from referencing import Registry, Resource

from trainguard.schemas import (
    SCHEMA_BASE_URI,
    Abort,
    AbortOutcome,
    Checkpoint,
    CheckpointMeta,
    ClockTick,
    DataCursor,
    DataCursorEvent,
    Heartbeat,
    HeartbeatBatch,
    JobRequest,
    Lifecycle,
    LifecycleKind,
    Manifest,
    ManifestHead,
    ManifestPart,
    ManifestPartRef,
    Message,
    Phase,
    RequestKind,
    Restore,
    RestoreMode,
    Resume,
    SchemaError,
    SchemaViolation,
    Shard,
    SnapshotRef,
    StepRange,
    UnknownSchema,
    _schema_files,
    batched_beat,
    load_schema,
    schema_path,
)

REPO = Path(__file__).resolve().parents[2]
SCHEMA_DIR = Path(str(schema_path("common.v1"))).parent
INT64_MAX = 2**63 - 1

# -- strategies ----------------------------------------------------------------------------------

# Any Unicode but lone surrogates, which no UTF-8 text can carry.
_chars = st.characters(exclude_categories=["Cs"])


def text(min_size: int = 0, max_size: int = 40) -> st.SearchStrategy[str]:
    return st.text(_chars, min_size=min_size, max_size=max_size)


job_ids = st.from_regex(r"[A-Za-z0-9._-]{1,128}", fullmatch=True)
counts = st.integers(0, INT64_MAX)
ranks = st.integers(0, 65535)
world_sizes = st.integers(1, 65536)
pids = st.integers(1, 2**31 - 1)
digests = st.binary(min_size=32, max_size=32).map(lambda b: "sha256:" + b.hex())
uris = st.builds(
    lambda scheme, rest: f"{scheme}:{rest}",
    st.from_regex(r"[A-Za-z][A-Za-z0-9+.-]{0,10}", fullmatch=True),
    text(0, 60),
)
snapshot_ids = st.builds(lambda j, g, s: f"{j}/g{g}/s{s}", job_ids, counts, counts)
# Free-form JSON: ints within what JSON parsers keep exact in 64 bits, finite floats.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | text(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(text(), children, max_size=3),
    max_leaves=8,
)
json_objects = st.dictionaries(text(), json_values, max_size=4)

cursors = st.builds(
    DataCursor,
    data_version=text(1, 80),
    seed=st.integers(0, 2**64 - 1),
    epoch=counts,
    offset=counts,
    world_size=world_sizes,
)
metadatas = st.builds(
    CheckpointMeta, hyperparameters=json_objects, topology=json_objects, code_version=text(0, 60)
)
shards = st.builds(Shard, rank=ranks, uri=uris, size_bytes=counts, digest=digests)

_event: dict[str, st.SearchStrategy[Any]] = {
    "job_id": job_ids,
    "generation": counts,
    "ts": counts,
    "seq": counts,
    "rank": ranks,
    "host": text(1, 60),
    "pid": pids,
}
_command: dict[str, st.SearchStrategy[Any]] = {
    "job_id": job_ids,
    "generation": counts,
    "ts": counts,
    "seq": counts,
    "daemon_id": text(1, 60),
}

heartbeats = st.builds(
    Heartbeat,
    **_event,
    world_size=world_sizes,
    step=counts,
    phase=st.sampled_from(typing.get_args(Phase)),
    step_time_s=st.none() | st.floats(min_value=0, allow_nan=False, allow_infinity=False),
    loss=st.none() | st.floats(),  # NaN and +-inf included
    samples=counts,
    param_checksum=st.none() | st.from_regex(r"[0-9a-f]{1,128}", fullmatch=True),
    step_age_s=st.none() | st.floats(min_value=0, allow_nan=False, allow_infinity=False),
)
heartbeat_batches = st.builds(
    HeartbeatBatch,
    job_id=job_ids,
    ts=counts,
    seq=counts,
    host=text(1, 60),
    pid=pids,
    beats=st.lists(heartbeats.map(batched_beat), min_size=1, max_size=4).map(tuple),
)
"""Batches whose entries are arbitrary heartbeats (the schema asks no unique ranks)."""
checkpoints = st.builds(
    Checkpoint,
    **_event,
    world_size=world_sizes,
    step=counts,
    shard_uri=uris,
    size_bytes=counts,
    digest=digests,
    cursor=cursors,
    metadata=metadatas,
    parent=st.none() | snapshot_ids,
)
data_cursor_events = st.builds(DataCursorEvent, **_event, step=counts, cursor=cursors)
manifests = st.builds(
    Manifest,
    job_id=job_ids,
    snapshot_id=snapshot_ids,
    generation=counts,
    ts=counts,
    step=counts,
    world_size=world_sizes,
    shards=st.lists(shards, min_size=1, max_size=3).map(tuple),
    cursor=cursors,
    metadata=metadatas,
    parent=st.none() | snapshot_ids,
)

part_refs = st.builds(
    ManifestPartRef, first_rank=ranks, ranks=world_sizes, size_bytes=counts, digest=digests
)
manifest_heads = st.builds(
    ManifestHead,
    job_id=job_ids,
    snapshot_id=snapshot_ids,
    generation=counts,
    ts=counts,
    step=counts,
    world_size=world_sizes,
    cursor=cursors,
    metadata=metadatas,
    parent=st.none() | snapshot_ids,
    folder=uris,
    size_bytes=counts,
    parts=st.lists(part_refs, min_size=1, max_size=3).map(tuple),
)
manifest_parts = st.builds(
    ManifestPart,
    snapshot_id=snapshot_ids,
    first_rank=ranks,
    shards=st.lists(shards, min_size=1, max_size=3).map(tuple),
)
snapshot_refs = st.builds(
    SnapshotRef,
    job_id=job_ids,
    snapshot_id=snapshot_ids,
    generation=counts,
    step=counts,
    world_size=world_sizes,
    cursor=cursors,
    parent=st.none() | snapshot_ids,
    folder=uris,
    manifest_digest=digests,
)


@st.composite
def lifecycles(draw: st.DrawFn) -> Lifecycle:
    """Lifecycle events that satisfy the per-kind conditions of the schema."""
    kind = draw(st.sampled_from(typing.get_args(LifecycleKind)))
    exit_code = signal = None
    if kind == "exited":
        exit_code, signal = draw(
            st.one_of(
                st.tuples(st.integers(0, 255), st.none()),
                st.tuples(st.none(), st.integers(1, 127)),
                st.tuples(st.integers(0, 255), st.integers(1, 127)),
            )
        )
    restored = kind == "restored"
    return Lifecycle(
        **{name: draw(strategy) for name, strategy in _event.items() if name != "rank"},
        rank=draw(st.none() | ranks),
        kind=kind,
        ranks=tuple(draw(st.lists(ranks, unique=True, max_size=4))),
        exit_code=exit_code,
        signal=signal,
        step=draw(counts if restored else st.none() | counts),
        cursor=draw(st.none() | cursors),
        world_size=draw(st.none() | world_sizes),
        snapshot_id=draw(st.none() | snapshot_ids),
        message=draw(text(1 if kind == "error" else 0, 60)),
        missed_at_step=draw(st.none() | counts),
    )


step_ranges = st.builds(
    lambda a, b: StepRange(from_step=min(a, b), to_step=max(a, b)), counts, counts
)


@st.composite
def restores(draw: st.DrawFn) -> Restore:
    """Restore commands; ``in_process`` ones name their ``at_step`` (a schema condition)."""
    mode = draw(st.sampled_from(typing.get_args(RestoreMode)))
    return Restore(
        **{name: draw(strategy) for name, strategy in _command.items()},
        incident_id=draw(text(1, 60)),
        reason=draw(text(1, 60)),
        target=draw(st.none() | snapshot_refs),
        mode=mode,
        attempt=draw(st.integers(1, INT64_MAX)),
        at_step=draw(counts if mode == "in_process" else st.none() | counts),
        skip=draw(st.none() | step_ranges),
    )


resumes = st.builds(Resume, **_command, step=counts)
aborts = st.builds(
    Abort, **_command, reason=text(1, 60), outcome=st.sampled_from(typing.get_args(AbortOutcome))
)
ticks = st.builds(ClockTick, **_command, command_seq=st.none() | counts)
job_requests = st.builds(
    JobRequest,
    **{name: strategy for name, strategy in _event.items() if name != "rank"},
    kind=st.sampled_from(typing.get_args(RequestKind)),
    reason=text(0, 60),
)

STRATEGIES: dict[type[Message], st.SearchStrategy[Any]] = {
    Heartbeat: heartbeats,
    Checkpoint: checkpoints,
    DataCursorEvent: data_cursor_events,
    Lifecycle: lifecycles(),
    Restore: restores(),
    Resume: resumes,
    Abort: aborts,
    Manifest: manifests,
    ManifestHead: manifest_heads,
    ManifestPart: manifest_parts,
    ClockTick: ticks,
    JobRequest: job_requests,
    HeartbeatBatch: heartbeat_batches,
}
messages = st.one_of(*STRATEGIES.values())


def same_message(a: Message, b: Message) -> bool:
    """Equality of messages, with a NaN loss equal to a NaN loss."""
    if isinstance(a, HeartbeatBatch) and isinstance(b, HeartbeatBatch):
        return (
            len(a.beats) == len(b.beats)
            and all(same_message(x, y) for x, y in zip(a.heartbeats(), b.heartbeats(), strict=True))
            and dataclasses.replace(a, beats=()) == dataclasses.replace(b, beats=())
        )
    if (
        isinstance(a, Heartbeat)
        and isinstance(b, Heartbeat)
        and a.loss is not None
        and b.loss is not None
        and math.isnan(a.loss)
        and math.isnan(b.loss)
    ):
        a, b = dataclasses.replace(a, loss=None), dataclasses.replace(b, loss=None)
    return a == b


# -- documentation examples ----------------------------------------------------------------------

_JSON_BLOCK = re.compile(r"```json\n(.*?)```", re.DOTALL)


def doc_examples() -> list[dict[str, Any]]:
    """The JSON examples of docs/wire-contract.md, parsed."""
    text_ = (REPO / "docs" / "wire-contract.md").read_text(encoding="utf-8")
    return [json.loads(block) for block in _JSON_BLOCK.findall(text_)]


def example(type_name: str, **match: Any) -> dict[str, Any]:
    """A fresh copy of the first documented example of type ``type_name`` whose properties
    equal ``match``."""
    for wire in doc_examples():
        if wire["schema"].partition("/")[0] == type_name and all(
            wire.get(k) == v for k, v in match.items()
        ):
            return wire
    raise LookupError(type_name, match)


# -- invalid messages ----------------------------------------------------------------------------

Mutation = Callable[[dict[str, Any]], None]


def put(*path: str | int, value: Any) -> Mutation:
    """Mutation setting the value at ``path`` (keys and array indices)."""

    def mutate(wire: dict[str, Any]) -> None:
        node: Any = wire
        for step in path[:-1]:
            node = node[step]
        node[path[-1]] = value

    return mutate


def drop(*path: str) -> Mutation:
    """Mutation deleting the property at ``path``."""

    def mutate(wire: dict[str, Any]) -> None:
        node: Any = wire
        for step in path[:-1]:
            node = node[step]
        del node[path[-1]]

    return mutate


def several(*mutations: Mutation) -> Mutation:
    def mutate(wire: dict[str, Any]) -> None:
        for mutation in mutations:
            mutation(wire)

    return mutate


@dataclasses.dataclass(frozen=True)
class BadCase:
    """A documented example made invalid by ``mutation``; ``field`` is the path the codec names."""

    id: str
    base: tuple[str, dict[str, Any]]
    mutation: Mutation
    field: str | None
    error: type[SchemaError] = SchemaViolation

    @property
    def schema_name(self) -> str:
        """The schema file the case is judged by (its base's, whatever the mutation did)."""
        return schema_name_of(example(self.base[0], **self.base[1]))

    def wire(self) -> dict[str, Any]:
        wire = example(self.base[0], **self.base[1])
        self.mutation(wire)
        return wire


Base = tuple[str, dict[str, Any]]
HB: Base = ("heartbeat", {})
CK: Base = ("checkpoint", {})
EXITED: Base = ("lifecycle", {"kind": "exited"})
RESTORED: Base = ("lifecycle", {"kind": "restored"})
MAN: Base = ("manifest", {})
RES: Base = ("restore", {})
BAD_CASES = [
    BadCase("missing required property", HB, drop("step"), "step"),
    BadCase("integer as string", HB, put("step", value="12"), "step"),
    BadCase("integer as boolean", HB, put("step", value=True), "step"),
    BadCase("negative integer", HB, put("step", value=-1), "step"),
    BadCase("integer beyond int64", HB, put("step", value=2**63), "step"),
    BadCase("huge number read as float", HB, put("ts", value=1.8446744073709552e19), "ts"),
    BadCase("fractional integer", HB, put("seq", value=1.5), "seq"),
    BadCase("rank beyond 65535", HB, put("rank", value=65536), "rank"),
    BadCase("world size zero", HB, put("world_size", value=0), "world_size"),
    BadCase("pid zero", HB, put("pid", value=0), "pid"),
    BadCase("unknown enum value", HB, put("phase", value="sleep"), "phase"),
    BadCase("loss spelled NaN", HB, put("loss", value="NaN"), "loss"),
    BadCase("loss as object", HB, put("loss", value={}), "loss"),
    BadCase("negative step time", HB, put("step_time_s", value=-0.5), "step_time_s"),
    BadCase("checksum in upper case", HB, put("param_checksum", value="ABC"), "param_checksum"),
    BadCase("empty host", HB, put("host", value=""), "host"),
    BadCase("host of 256 characters", HB, put("host", value="h" * 256), "host"),
    BadCase("job id with a slash", HB, put("job_id", value="a/b"), "job_id"),
    BadCase("job id of 129 characters", HB, put("job_id", value="j" * 129), "job_id"),
    BadCase("unknown property", HB, put("extra", value=1), "extra"),
    BadCase(
        "schema of another major",
        HB,
        put("schema", value="heartbeat/12.0"),
        "schema",
        UnknownSchema,
    ),
    BadCase("digest in upper case", CK, put("digest", value="sha256:" + "A" * 64), "digest"),
    BadCase("digest too short", CK, put("digest", value="sha256:abc"), "digest"),
    BadCase("uri without a scheme", CK, put("shard_uri", value="/ckpt/x"), "shard_uri"),
    BadCase("uri of 4097 characters", CK, put("shard_uri", value="s3:" + "x" * 4094), "shard_uri"),
    BadCase("nested property missing", CK, drop("cursor", "epoch"), "cursor.epoch"),
    BadCase("nested unknown property", CK, put("cursor", "x", value=1), "cursor.x"),
    BadCase("seed beyond uint64", CK, put("cursor", "seed", value=3.7e19), "cursor.seed"),
    BadCase(
        "empty data version", CK, put("cursor", "data_version", value=""), "cursor.data_version"
    ),
    BadCase("metadata null", CK, put("metadata", value=None), "metadata"),
    BadCase("metadata unknown property", CK, put("metadata", "x", value=1), "metadata.x"),
    BadCase("checkpoint parent malformed", CK, put("parent", value="j/g1"), "parent"),
    BadCase(
        "hyperparameters not an object",
        CK,
        put("metadata", "hyperparameters", value=[]),
        "metadata.hyperparameters",
    ),
    BadCase("restored without step", RESTORED, drop("step"), "step"),
    BadCase("restored with null step", RESTORED, put("step", value=None), "step"),
    BadCase("exited without code or signal", EXITED, put("signal", value=None), None),
    BadCase("started with a signal", EXITED, put("kind", value="started"), "signal"),
    BadCase(
        "error without message",
        EXITED,
        several(put("kind", value="error"), put("signal", value=None)),
        "message",
    ),
    BadCase("repeated ranks", EXITED, put("ranks", value=[1, 1]), "ranks"),
    BadCase("rank list of lists", EXITED, put("ranks", value=[[1], [1]]), "ranks[0]"),
    BadCase("message of 4097 characters", EXITED, put("message", value="m" * 4097), "message"),
    BadCase("signal zero", EXITED, put("signal", value=0), "signal"),
    BadCase("supervisor rank out of range", EXITED, put("rank", value=70000), "rank"),
    BadCase("no shards", MAN, put("shards", value=[]), "shards"),
    BadCase("bad shard digest", MAN, put("shards", 1, "digest", value="x"), "shards[1].digest"),
    BadCase("shard not an object", MAN, put("shards", 0, value=7), "shards[0]"),
    BadCase("malformed snapshot id", MAN, put("snapshot_id", value="j/3/12"), "snapshot_id"),
    BadCase("malformed parent", MAN, put("parent", value="p"), "parent"),
    BadCase("manifest without schema", MAN, drop("schema"), "schema", UnknownSchema),
    BadCase("target missing", RES, drop("target"), "target"),
    BadCase("target step negative", RES, put("target", "step", value=-1), "target.step"),
    BadCase(
        "target with a manifest's schema",
        RES,
        put("target", "schema", value="manifest/1.2"),
        "target.schema",
    ),
    BadCase(
        "target bad manifest digest",
        RES,
        put("target", "manifest_digest", value="sha256:00"),
        "target.manifest_digest",
    ),
    BadCase(
        "target cursor unknown property",
        RES,
        put("target", "cursor", "x", value=1),
        "target.cursor.x",
    ),
    BadCase("unknown mode", RES, put("mode", value="reboot"), "mode"),
    BadCase("in_process without at_step", RES, put("mode", value="in_process"), "at_step"),
    BadCase(
        "in_process with null at_step",
        RES,
        several(put("mode", value="in_process"), put("at_step", value=None)),
        "at_step",
    ),
    BadCase("skip without to_step", RES, put("skip", value={"from_step": 3}), "skip.to_step"),
    BadCase(
        "missed_at_step negative",
        EXITED,
        several(
            put("kind", value="error"),
            put("signal", value=None),
            put("message", value="m"),
            put("missed_at_step", value=-1),
        ),
        "missed_at_step",
    ),
    BadCase("attempt zero", RES, put("attempt", value=0), "attempt"),
    BadCase("empty reason", RES, put("reason", value=""), "reason"),
]


# -- validators ----------------------------------------------------------------------------------


def schema_files() -> list[Path]:
    return sorted(SCHEMA_DIR.glob("*.json"))


def registry() -> Registry[Any]:
    """All packaged schema files, by their $id, for jsonschema's $ref resolution."""
    return Registry().with_resources(
        (SCHEMA_BASE_URI + f.name, Resource.from_contents(json.loads(f.read_text())))
        for f in schema_files()
    )


def reference_validator(schema_name: str) -> jsonschema.Draft202012Validator:
    """jsonschema's 2020-12 validator for a packaged schema file (the reference semantics)."""
    return jsonschema.Draft202012Validator(load_schema(schema_name), registry=registry())


def codec_validator(schema_name: str) -> Callable[[Any], Any]:
    """The compiled fastjsonschema validator the codec uses."""
    return _schema_files.validator(schema_name)


def schema_name_of(wire: dict[str, Any]) -> str:
    type_name, _, version = wire["schema"].partition("/")
    return f"{type_name}.v{version.partition('.')[0]}"
