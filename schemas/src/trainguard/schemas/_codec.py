"""Canonical JSON encoding and validating decoding of the wire messages.

``encode(msg)`` turns a message dataclass into canonical JSON bytes; ``decode(data)`` turns bytes
into the message dataclass. Both validate against the message's JSON Schema (compiled once per
schema, see :mod:`._schema_files`) and convert with the class's plan (derived once per class
from its type hints, see :mod:`._wire_form`), so adding a field to a message means adding it to
the dataclass and to its schema file, nothing else. ``docs/wire-contract.md`` is the reference
for people.

Canonical bytes: one UTF-8 JSON object, keys sorted at every level, no whitespace, floats in
their shortest round-trip form (orjson). The same message always encodes to the same bytes.

Version rule, applied by ``decode`` to the ``schema`` property:

* an unknown type or a major version other than this build's raises :class:`UnknownSchema`;
* the same or an older minor version is validated strictly: unknown properties are an error;
* a newer minor version is read tolerantly: properties this build does not know are dropped
  (recursively, in nested objects that are part of the message) before validation, so a newer
  sender's optional additions pass through an older reader. A minor version may therefore only
  add optional properties; anything else needs a new major version.
* a nested object with its own ``schema`` (the manifest inside a restore) follows the rule by
  its own version, whatever the enclosing message's.

Rules the codec enforces beyond the JSON Schema files:

* ``decode`` checks the size before parsing, and maps parser failures to :class:`NotUTF8`,
  :class:`NotJSON` or :class:`NestingTooDeep` (orjson refuses documents nested deeper than 1024).
* Free-form objects (``metadata.hyperparameters``, ``metadata.topology``) may nest at most
  :data:`MAX_FREEFORM_DEPTH` levels, so every decoded message can be encoded again.
* Integer fields written as integral floats (``12.0``, valid JSON Schema integers) are
  returned as ``int``; integers in float fields are returned as ``float``.
* Duplicate keys in an object are not detected: the last one wins (orjson's behaviour, also
  that of Python's ``json``). Anything that signs messages must sign the canonical re-encoding,
  never the received bytes.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Final, TypeVar, overload

import fastjsonschema
import orjson

from trainguard.schemas._errors import (
    MessageTooLarge,
    NestingTooDeep,
    NotJSON,
    NotUTF8,
    SchemaViolation,
    UnexpectedMessage,
    UnknownSchema,
)
from trainguard.schemas._messages import Message
from trainguard.schemas._schema_files import subschema_validator, validator
from trainguard.schemas._wire_form import PLAN_BY_TAG, PLAN_BY_TYPE, PLANS, TAG, Plan, join

__all__ = ["DEFAULT_MAX_BYTES", "decode", "decode_parsed", "encode"]

DEFAULT_MAX_BYTES: Final = 65536
"""Default limit on an encoded message, in bytes (``encode`` and ``decode``)."""

_M = TypeVar("_M", bound=Message)
_ORJSON_DEPTH_LIMIT: Final = 1024


def encode(msg: Message, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Encode ``msg`` as canonical JSON bytes, after validating it against its schema.

    Args:
        msg: any message of :data:`~trainguard.schemas.MESSAGE_TYPES`.
        max_bytes: largest acceptable encoding, in bytes (receivers apply the same default).

    Returns:
        UTF-8 JSON, keys sorted at every level, no whitespace. Equal messages give equal bytes.

    Raises:
        SchemaViolation: a field breaks the schema (names the field), e.g. a negative step, a
            non-finite float other than ``loss``, a string that is not valid Unicode.
        NestingTooDeep: a free-form object nests deeper than :data:`MAX_FREEFORM_DEPTH`.
        MessageTooLarge: the encoding is longer than ``max_bytes``.
        TypeError: ``msg`` is not a message class.
    """
    plan = PLANS.get(type(msg))
    if plan is None or plan.tag is None:
        raise TypeError(f"not a trainguard message: {type(msg).__name__}")
    wire = plan.to_wire(msg, "")
    _validate(plan, wire)
    try:
        data = orjson.dumps(wire, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError as exc:
        raise SchemaViolation(_unencodable(wire, ""), str(exc)) from None
    if len(data) > max_bytes:
        raise MessageTooLarge(None, f"{len(data)} bytes exceed the limit of {max_bytes}")
    # orjson (3.12+) hands back its whole write buffer, at least 4 KiB, whatever the message's
    # size; a right-sized copy costs ~0.1 us and keeps queued messages (agent, embedded bus)
    # ~15x smaller.
    return bytes(memoryview(data))


def _unencodable(value: Any, path: str) -> str | None:
    """JSON path of the innermost value orjson refuses to serialise (error path only)."""
    if isinstance(value, dict):
        items: Any = ((join(path, str(k)), v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return path or None
    for child_path, child in items:
        try:
            orjson.dumps(child)
        except orjson.JSONEncodeError:
            return _unencodable(child, child_path)
    return path or None


@overload
def decode(
    data: bytes | bytearray | memoryview,
    *,
    expect: type[_M],
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> _M: ...


@overload
def decode(
    data: bytes | bytearray | memoryview,
    *,
    expect: tuple[type[Message], ...] | types.UnionType | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Message: ...


def decode(
    data: bytes | bytearray | memoryview,
    *,
    expect: type[Any] | tuple[type[Any], ...] | types.UnionType | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Message:
    """Decode and validate one message.

    Args:
        data: the encoded message (UTF-8 JSON).
        expect: accept only these message classes: one class, a tuple of classes, or a union
            alias such as :data:`~trainguard.schemas.Command`; ``None`` accepts any message.
        max_bytes: largest acceptable input, in bytes; checked before parsing.

    Returns:
        The message dataclass; with ``expect=SomeClass``, typed as that class.

    Raises:
        MessageTooLarge: ``len(data) > max_bytes``.
        NotUTF8: the bytes are not UTF-8.
        NotJSON: not one JSON document.
        NestingTooDeep: nested deeper than orjson's 1024 levels, or a free-form object deeper
            than :data:`MAX_FREEFORM_DEPTH`.
        UnknownSchema: the ``schema`` property is missing or malformed, or names an unknown
            type or major version.
        UnexpectedMessage: a valid type that is not in ``expect``.
        SchemaViolation: the message breaks its schema (missing, unknown, mistyped or
            out-of-range property), or is not a JSON object.
    """
    if len(data) > max_bytes:
        raise MessageTooLarge(None, f"{len(data)} bytes exceed the limit of {max_bytes}")
    try:
        wire = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise _parse_error(data, exc) from None
    return decode_parsed(wire, expect=expect)


def decode_parsed(
    wire: Any,
    *,
    expect: type[Any] | tuple[type[Any], ...] | types.UnionType | None = None,
) -> Message:
    """:func:`decode` of a message already parsed by ``orjson.loads`` (for a caller that had
    to parse the bytes anyway: :func:`~trainguard.schemas.split_mac`); the size check on the
    bytes is the caller's. ``wire`` may be changed (properties of a newer minor version are
    dropped from it). Raises as :func:`decode`, parse errors apart."""
    if type(wire) is not dict:
        raise SchemaViolation(None, f"a message is a JSON object, not {_json_kind(wire)}")
    tag = wire.get("schema")
    plan = PLAN_BY_TAG.get(tag) if type(tag) is str else None
    if plan is None:
        plan = _admit(wire)
    if expect is not None and not issubclass(plan.cls, expect):
        raise UnexpectedMessage("schema", f"expected {_names(expect)}, got {plan.tag}")
    if plan.has_tagged_nested:
        plan.admit_nested(wire)
    _validate(plan, wire)
    message: Message = plan.from_wire(wire)
    return message


def _admit(wire: dict[str, Any]) -> Plan:
    """Apply the version rule to a tag that is not exactly one of ours."""
    if "schema" not in wire:
        raise UnknownSchema("schema", "missing: every message names its type and version")
    tag = wire["schema"]
    match = TAG.fullmatch(tag) if type(tag) is str else None
    if match is None:
        raise UnknownSchema("schema", "must be a string '<type>/<major>.<minor>'")
    plan = PLAN_BY_TYPE.get(match[1])
    if plan is None:
        raise UnknownSchema("schema", f"unknown message type {match[1]!r}")
    if int(match[2]) != plan.major:
        raise UnknownSchema(
            "schema", f"{match[1]} major version {int(match[2])} is not {plan.major}"
        )
    if int(match[3]) > plan.minor:
        plan.prune(wire)
    return plan


def _validate(plan: Plan, wire: dict[str, Any]) -> None:
    validate = plan.compiled
    if validate is None:
        validate = plan.compiled = validator(plan.schema_name)
    try:
        validate(wire)
    except fastjsonschema.JsonSchemaValueException as exc:
        raise _violation(exc) from None


def _violation(exc: fastjsonschema.JsonSchemaValueException, base: str = "") -> SchemaViolation:
    """Translate fastjsonschema's error into a SchemaViolation naming the field.

    ``base`` is the JSON path of the value ``exc`` is about, when that value was validated on
    its own (see the nullable case below).
    """
    name = exc.name or "data"
    relative = name[len("data") :].lstrip(".") if name.startswith("data") else name
    path = base + relative if relative[:1] in ("", "[") else join(base, relative)
    value, definition = exc.value, exc.definition if isinstance(exc.definition, dict) else {}
    if exc.rule == "required" and isinstance(value, dict):
        missing = sorted(set(definition.get("required", ())) - value.keys())
        if missing:
            return SchemaViolation(join(path, missing[0]), "required property is missing")
    if exc.rule == "additionalProperties" and isinstance(value, dict):
        extra = sorted(value.keys() - definition.get("properties", {}).keys())
        if extra:
            return SchemaViolation(join(path, extra[0]), "unknown property")
    if exc.rule == "anyOf":
        branches = [b for b in definition.get("anyOf", ()) if b != {"type": "null"}]
        if value is not None and len(branches) == 1:
            # A nullable value ({"anyOf": [X, null]}) that is not null failed X: say why,
            # e.g. "target.step" rather than just "target".
            try:
                subschema_validator(orjson.dumps(branches[0]))(value)
            except fastjsonschema.JsonSchemaValueException as inner:
                return _violation(inner, path)
        reason = "matches none of the allowed forms"
        if "description" in definition:
            reason = f"{reason}: {definition['description']}"
    else:
        reason = exc.message[len(name) :].strip() if exc.message.startswith(name) else exc.message
    return SchemaViolation(path or None, reason)


def _parse_error(
    data: bytes | bytearray | memoryview, exc: orjson.JSONDecodeError
) -> NotUTF8 | NotJSON | NestingTooDeep:
    """Classify an orjson parse failure (error path only, so the extra UTF-8 pass is free)."""
    try:
        bytes(data).decode("utf-8")
    except UnicodeDecodeError as bad:
        return NotUTF8(None, f"invalid UTF-8 at byte {bad.start}")
    if "depth limit" in exc.msg:
        return NestingTooDeep(None, f"nested deeper than {_ORJSON_DEPTH_LIMIT} levels")
    return NotJSON(None, f"{exc.msg} (line {exc.lineno}, column {exc.colno})")


def _json_kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _names(expect: type[Any] | tuple[type[Any], ...] | types.UnionType) -> str:
    classes = typing.get_args(expect) if isinstance(expect, types.UnionType) else expect
    if isinstance(classes, tuple):
        return " or ".join(c.__name__ for c in classes)
    return classes.__name__
