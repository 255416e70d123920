"""Every way bytes or messages can break the contract raises its documented error class, naming
the field and the reason."""

from __future__ import annotations

import dataclasses
import math
import pickle
from typing import Any

import orjson
import pytest

from tests.support.schemas import BAD_CASES, BadCase, doc_examples, example
from trainguard.schemas import (
    DEFAULT_MAX_BYTES,
    MAX_FREEFORM_DEPTH,
    Abort,
    Checkpoint,
    CheckpointMeta,
    DataCursor,
    Heartbeat,
    Manifest,
    MessageTooLarge,
    NestingTooDeep,
    NotJSON,
    NotUTF8,
    Restore,
    SchemaError,
    SchemaViolation,
    StepRange,
    UnexpectedMessage,
    UnknownSchema,
    decode,
    encode,
)


def raw(wire: dict[str, Any]) -> bytes:
    return orjson.dumps(wire)


def message(type_name: str, cls: type[Any], **match: Any) -> Any:
    return decode(raw(example(type_name, **match)), expect=cls)


def nested(depth: int, opening: bytes = b"[", closing: bytes = b"]") -> bytes:
    return opening * depth + closing * depth


def deep_object(depth: int) -> dict[str, Any]:
    """A free-form object nested ``depth`` levels (the object itself is level 1)."""
    obj: dict[str, Any] = {}
    for _ in range(depth - 1):
        obj = {"a": obj}
    return obj


# -- decode --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c.id)
def test_each_bad_case_raises_its_class_naming_the_field(case: BadCase) -> None:
    with pytest.raises(case.error) as info:
        decode(raw(case.wire()))
    assert info.value.field == case.field
    assert info.value.reason
    assert str(info.value) == f"{case.field or '<message>'}: {info.value.reason}"


def test_size_is_checked_before_parsing() -> None:
    with pytest.raises(MessageTooLarge) as info:
        decode(b"\xff" * (DEFAULT_MAX_BYTES + 1))  # would be NotUTF8 if parsed
    assert info.value.field is None
    assert str(DEFAULT_MAX_BYTES) in info.value.reason
    data = raw(example("heartbeat"))
    assert decode(data, max_bytes=len(data))
    with pytest.raises(MessageTooLarge):
        decode(data, max_bytes=len(data) - 1)


@pytest.mark.parametrize(
    "data", [b"\xff", b'{"job_id": "\xc3"}', b'{"host": "\xed\xa0\x80"}'], ids=["ff", "cut", "cesu"]
)
def test_invalid_utf8_is_not_utf8(data: bytes) -> None:
    with pytest.raises(NotUTF8):
        decode(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b'{"schema": "heartbeat/1.0"} trailing',
        b"\xef\xbb\xbf{}",
        b'{"loss": NaN}',
        b'{"loss": Infinity}',
        b'{"ts": 1e400}',
        b'{"host": "\\ud800"}',
        b"{'single': 'quotes'}",
    ],
    ids=[
        "empty",
        "truncated",
        "trailing",
        "bom",
        "nan",
        "infinity",
        "overflow",
        "surrogate",
        "quotes",
    ],
)
def test_malformed_json_is_not_json(data: bytes) -> None:
    with pytest.raises(NotJSON) as info:
        decode(data)
    assert info.value.field is None


def test_nesting_beyond_the_parser_limit_is_too_deep() -> None:
    with pytest.raises(NestingTooDeep):
        decode(nested(1100))
    with pytest.raises(NestingTooDeep):
        decode(b'{"schema": "heartbeat/1.0", "x": ' + nested(1100, b'{"a":', b"}") + b"}")


@pytest.mark.parametrize("data", [b"[]", b"1", b'"heartbeat/1.0"', b"null", b"true"])
def test_json_that_is_not_an_object_violates_the_schema(data: bytes) -> None:
    with pytest.raises(SchemaViolation) as info:
        decode(data)
    assert info.value.field is None


@pytest.mark.parametrize(
    "tag",
    [None, 1, ["heartbeat/1.0"], "heartbeat", "heartbeat/1", "heartbeat/1.x", "Heartbeat/1.0",
     "heartbeat/1." + "9" * 5000, "unknown/1.0", "heartbeat/0.9", "heartbeat/2.0"],
)  # fmt: skip
def test_an_unknown_or_malformed_schema_tag_is_unknown_schema(tag: Any) -> None:
    wire = example("heartbeat")
    if tag is None:
        del wire["schema"]
    else:
        wire["schema"] = tag
    with pytest.raises(UnknownSchema) as info:
        decode(raw(wire))
    assert info.value.field == "schema"


def test_a_type_the_caller_did_not_expect_is_unexpected() -> None:
    data = raw(example("restore"))
    with pytest.raises(UnexpectedMessage) as info:
        decode(data, expect=Heartbeat)
    assert info.value.field == "schema"
    assert "Heartbeat" in info.value.reason
    assert Restore.SCHEMA in info.value.reason
    with pytest.raises(UnexpectedMessage):
        decode(data, expect=(Abort, Manifest))


@pytest.mark.parametrize(
    ("field", "value"), [("job_id", "run-1\n"), ("digest", "sha256:" + "a" * 64 + "\n")]
)
def test_a_trailing_newline_does_not_match_a_pattern(field: str, value: str) -> None:
    # Patterns mean ECMA-262 "$" (end of string), not Python's (also before a final newline).
    with pytest.raises(SchemaViolation) as info:
        decode(raw(example("checkpoint") | {field: value}))
    assert info.value.field == field


def test_free_form_objects_nest_at_most_the_documented_depth() -> None:
    wire = example("manifest")
    wire["metadata"]["hyperparameters"] = deep_object(MAX_FREEFORM_DEPTH)
    assert decode(raw(wire))
    wire["metadata"]["hyperparameters"] = deep_object(MAX_FREEFORM_DEPTH + 1)
    with pytest.raises(NestingTooDeep) as info:
        decode(raw(wire))
    assert info.value.field == "metadata.hyperparameters"


@pytest.mark.parametrize("wire", doc_examples(), ids=lambda w: w["schema"])
def test_deeply_nested_values_in_any_field_are_rejected_not_crashing(wire: dict[str, Any]) -> None:
    # Validators and converters must not recurse into attacker-controlled depth (a
    # RecursionError here would crash the daemon on one malformed record).
    for name in wire:
        if name == "schema":
            continue
        for opening, closing in ((b"[", b"]"), (b'{"a":', b"}")):
            data = raw(wire | {name: "@@"}).replace(b'"@@"', nested(1000, opening, closing))
            with pytest.raises(SchemaError):
                decode(data)


def test_duplicate_keys_are_not_detected_and_the_last_wins() -> None:
    # Documented behaviour of the parser (orjson), pinned here so a change is noticed.
    data = raw(example("heartbeat")).replace(b'"step":12000', b'"step":1,"step":12000')
    assert b'"step":1,' in data
    assert decode(data, expect=Heartbeat).step == 12000


def test_a_reversed_skip_range_is_refused_naming_the_field() -> None:
    """from_step <= to_step is the one rule the schema cannot state; the class checks it."""
    wire = example("restore") | {"skip": {"from_step": 5, "to_step": 2}}
    with pytest.raises(SchemaViolation) as info:
        decode(orjson.dumps(wire))
    assert info.value.field == "skip"
    assert "from_step 5 is after to_step 2" in info.value.reason
    with pytest.raises(ValueError, match="from_step 5 is after to_step 2"):
        StepRange(from_step=5, to_step=2)
    assert StepRange(from_step=5, to_step=5).to_step == 5


# -- encode --------------------------------------------------------------------------------------


def test_encode_validates_and_names_the_field() -> None:
    hb = message("heartbeat", Heartbeat)
    with pytest.raises(SchemaViolation) as info:
        encode(dataclasses.replace(hb, step=-1))
    assert info.value.field == "step"
    with pytest.raises(SchemaViolation) as info:
        encode(dataclasses.replace(hb, step_time_s=math.nan))
    assert info.value.field == "step_time_s"
    with pytest.raises(SchemaViolation) as info:
        encode(dataclasses.replace(hb, host="gpu-\ud800"))  # not encodable as UTF-8
    assert info.value.field == "host"


def test_encode_rejects_free_form_values_json_cannot_carry() -> None:
    ck = message("checkpoint", Checkpoint)
    cases: list[tuple[dict[str, Any], str, type[SchemaError]]] = [
        ({"sched": [1.0, math.inf]}, "metadata.hyperparameters.sched[1]", SchemaViolation),
        ({"big": 2**70}, "metadata.hyperparameters.big", SchemaViolation),
        ({"ok": {1: "non-string key"}}, "metadata.hyperparameters.ok", SchemaViolation),
        (deep_object(MAX_FREEFORM_DEPTH + 1), "metadata.hyperparameters" + ".a" * MAX_FREEFORM_DEPTH, NestingTooDeep),
    ]  # fmt: skip
    for hyperparameters, field, error in cases:
        bad = dataclasses.replace(ck, metadata=CheckpointMeta(hyperparameters=hyperparameters))
        with pytest.raises(error) as info:
            encode(bad)
        assert info.value.field == field


def test_encode_rejects_wrongly_typed_nested_objects() -> None:
    ck = message("checkpoint", Checkpoint)
    bad = dataclasses.replace(ck, cursor=dataclasses.asdict(ck.cursor))
    with pytest.raises(SchemaViolation) as info:
        encode(bad)
    assert info.value.field == "cursor"


def test_encode_refuses_messages_larger_than_the_limit() -> None:
    restore = message("restore", Restore)
    with pytest.raises(MessageTooLarge):
        encode(restore, max_bytes=100)
    assert len(encode(restore, max_bytes=4096)) <= 4096


def test_encode_accepts_only_message_classes() -> None:
    cursor = message("checkpoint", Checkpoint).cursor
    assert isinstance(cursor, DataCursor)
    with pytest.raises(TypeError):
        encode(cursor)  # type: ignore[arg-type]  # the wrong type is the point


# -- the error objects ---------------------------------------------------------------------------


def test_errors_are_value_errors_that_pickle_with_field_and_reason() -> None:
    for cls in (MessageTooLarge, NotUTF8, NotJSON, NestingTooDeep, UnknownSchema, UnexpectedMessage, SchemaViolation):  # fmt: skip
        err = cls("cursor.epoch", "must be >= 0")
        assert isinstance(err, SchemaError)
        assert isinstance(err, ValueError)
        assert str(err) == "cursor.epoch: must be >= 0"
        copy = pickle.loads(pickle.dumps(err))
        assert (type(copy), copy.field, copy.reason) == (cls, "cursor.epoch", "must be >= 0")
    assert str(NotJSON(None, "unexpected end of data")) == "<message>: unexpected end of data"
