"""How each message dataclass maps to its wire object, derived once per class from type hints.

A :class:`Plan` holds, for one dataclass, a converter per field in each direction:

* ``int``: written as is; read back as ``int`` even when sent as an integral float (``12.0``
  is a valid JSON Schema integer).
* ``float``: must be finite; an ``int`` value is written as a float so equal messages encode
  equally. :data:`~trainguard.schemas._messages.MaybeNonFinite` (``loss``) writes NaN and
  +-infinity as ``"nan"``, ``"inf"``, ``"-inf"`` and reads them back.
* ``str`` and ``Literal``: as is. ``X | None``: ``null`` for ``None``.
* ``tuple[X, ...]``: a JSON array of X; read back as a tuple.
* ``Mapping[str, JSONValue]`` (free-form): copied to a dict; floats must be finite, keys
  strings, nesting at most :data:`MAX_FREEFORM_DEPTH` levels (checked both ways).
* a dataclass: a nested JSON object (with its own ``schema`` property if the class has a
  ``SCHEMA``, like a manifest inside a restore).

A field marked :class:`~trainguard.schemas._messages.OmittedWhenNone` (``auth``) is left out
of the wire object when it is ``None``; reading, a missing property takes the field's
default as for every optional field.

Plans also know the property names of each object, for the tolerant reader (``prune``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

from trainguard.schemas._errors import NestingTooDeep, SchemaViolation
from trainguard.schemas._messages import MESSAGE_TYPES, NonFiniteAsString, OmittedWhenNone

__all__ = [
    "MAX_FREEFORM_DEPTH",
    "PLANS",
    "PLAN_BY_TAG",
    "PLAN_BY_TYPE",
    "TAG",
    "Plan",
    "join",
    "plan_of",
]

MAX_FREEFORM_DEPTH: Final = 32
"""Deepest nesting allowed inside a free-form object, counting the object itself as level 1."""

# Digit runs are bounded: int() refuses strings of more than 4300 digits (CVE-2020-10735).
TAG: Final = re.compile(r"([a-z][a-z0-9-]{0,63})/([0-9]{1,9})\.([0-9]{1,9})")
"""A ``schema`` property: ``<type>/<major>.<minor>`` (use with ``fullmatch``)."""

_Encoder = Callable[[Any, str], Any]
"""(value, JSON path of the value) -> wire value; raises SchemaError naming the path."""
_Decoder = Callable[[Any], Any]
"""validated, non-null wire value -> Python value."""


def join(path: str, key: str) -> str:
    """JSON path of property ``key`` of the object at ``path`` (long keys are shortened)."""
    key = key if len(key) <= 64 else key[:61] + "..."
    return f"{path}.{key}" if path else key


def _int_from_wire(value: Any) -> Any:
    # JSON Schema counts 12.0 as an integer; the dataclass field is an int.
    return value if type(value) is int else int(value)


def _as_float(value: Any, path: str) -> Any:
    """An int given for a float field becomes a float, so equal messages encode equally."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise SchemaViolation(path, "integer too large for a float") from None
    return value  # a float, or a wrong type the validator names


def _float_to_wire(value: Any, path: str) -> Any:
    value = _as_float(value, path)
    if isinstance(value, float) and not math.isfinite(value):
        raise SchemaViolation(path, "must be finite (only loss fields may be nan/inf)")
    return value


def _nonfinite_to_wire(value: Any, path: str) -> Any:
    value = _as_float(value, path)
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    return value


def _float_from_wire(value: Any) -> Any:
    # Also reads the strings "nan", "inf" and "-inf", the only ones a float field's schema admits.
    return value if type(value) is float else float(value)


def _check_freeform(value: Any, path: str, depth: int) -> None:
    """Check a free-form JSON value on its way out: str keys, finite floats, bounded depth.

    ``depth`` is the nesting level of ``value`` (the free-form object itself is level 1).
    """
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SchemaViolation(path, "must be finite: JSON has no literal for nan/inf")
        return
    if not isinstance(value, Mapping | list | tuple):
        return  # scalars; anything orjson cannot write is located by _unencodable
    if depth > MAX_FREEFORM_DEPTH:
        raise NestingTooDeep(path, f"nested deeper than {MAX_FREEFORM_DEPTH} levels")
    if isinstance(value, Mapping):
        for key, child in value.items():
            if not isinstance(key, str):
                raise SchemaViolation(path, f"keys must be strings, not {type(key).__name__}")
            _check_freeform(child, join(path, key), depth + 1)
    else:
        for index, child in enumerate(value):
            _check_freeform(child, f"{path}[{index}]", depth + 1)


def _freeform_to_wire(value: Any, path: str) -> Any:
    if not isinstance(value, Mapping):
        return value  # the validator names the wrong type
    _check_freeform(value, path, 1)
    return dict(value)  # orjson serialises dict, not arbitrary Mappings


def _check_depth(value: Any, depth: int) -> None:
    """Check the nesting of a parsed free-form value (levels counted as in _check_freeform)."""
    if type(value) is dict:
        children: Any = value.values()
    elif type(value) is list:
        children = value
    else:
        return
    if depth > MAX_FREEFORM_DEPTH:
        raise NestingTooDeep(None, f"nested deeper than {MAX_FREEFORM_DEPTH} levels")
    for child in children:
        _check_depth(child, depth + 1)


def _freeform_from_wire(value: Any) -> Any:
    _check_depth(value, 1)
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class _FieldCodec:
    """How one field travels: converters (``None`` = value is its own wire form) and, for
    fields holding message dataclasses, the nested plan (for tolerant-reader pruning)."""

    to_wire: _Encoder | None = None
    from_wire: _Decoder | None = None
    nested: Plan | None = None


def _optional(inner: _FieldCodec) -> _FieldCodec:
    to_wire = inner.to_wire
    if to_wire is None:
        return inner

    def opt_to_wire(value: Any, path: str) -> Any:
        return None if value is None else to_wire(value, path)

    # Decoders never see null: Plan.from_wire skips it.
    return _FieldCodec(opt_to_wire, inner.from_wire, inner.nested)


def _tuple_of(item: _FieldCodec) -> _FieldCodec:
    item_to, item_from = item.to_wire, item.from_wire

    def tuple_from_wire(value: Any) -> Any:
        return tuple(value) if item_from is None else tuple(map(item_from, value))

    if item_to is None:
        return _FieldCodec(None, tuple_from_wire, item.nested)  # orjson writes tuples itself

    def tuple_to_wire(value: Any, path: str) -> Any:
        if not isinstance(value, tuple | list):
            return value  # the validator names the wrong type
        return [item_to(v, f"{path}[{i}]") for i, v in enumerate(value)]

    return _FieldCodec(tuple_to_wire, tuple_from_wire, item.nested)


def _field_codec(hint: Any) -> _FieldCodec:
    """Derive a field's converters from its type hint (resolved, with ``Annotated`` extras)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union) and type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        return _optional(_field_codec(inner))
    if origin is typing.Annotated:
        if args[0] is float and NonFiniteAsString in hint.__metadata__:
            return _FieldCodec(_nonfinite_to_wire, _float_from_wire)
        # Other metadata (Wire, Shared) describes the schema, which validates the value.
        return _field_codec(args[0])
    if hint is int:
        return _FieldCodec(None, _int_from_wire)
    if hint is float:
        return _FieldCodec(_float_to_wire, _float_from_wire)
    if hint is str or origin is Literal:
        return _FieldCodec()
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _tuple_of(_field_codec(args[0]))
    if origin is Mapping and args[0] is str:
        return _FieldCodec(_freeform_to_wire, _freeform_from_wire)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        plan = plan_of(hint)
        return _FieldCodec(plan.to_wire, plan.from_wire, plan)
    raise TypeError(f"no wire form for type {hint!r}")


class Plan:
    """Everything the codec needs about one dataclass, derived once from its fields.

    Attributes:
        cls: the dataclass.
        tag: its ``SCHEMA`` (``"heartbeat/1.0"``) for message classes, else ``None``.
        type_name, major, minor: ``tag`` split up (``""``, 0, 0 without a tag).
        schema_name: the schema file (``"heartbeat.v1"``), ``""`` without a tag.
        known: property names a wire object of this class may have.
        encoders: ``(field name, encoder or None)`` for every field, in declaration order.
        omit_none: fields left out of the wire object when ``None`` (``auth``).
        int_names: fields holding an int (or an optional int): integral floats become ints.
        decoders: ``(field name, decoder)`` for the other fields that need converting.
        nested: ``(field name, plan)`` for fields holding dataclasses (or tuples of them).
        has_tagged_nested: whether some nested object, at any depth, carries its own tag.
    """

    cls: type[Any]
    tag: str | None
    type_name: str
    major: int
    minor: int
    schema_name: str
    known: frozenset[str]
    encoders: tuple[tuple[str, _Encoder | None], ...]
    omit_none: tuple[str, ...]
    int_names: tuple[str, ...]
    decoders: tuple[tuple[str, _Decoder], ...]
    compiled: Callable[[Any], Any] | None
    nested: tuple[tuple[str, Plan], ...]
    has_tagged_nested: bool

    __slots__ = (
        "cls",
        "compiled",
        "decoders",
        "encoders",
        "has_tagged_nested",
        "int_names",
        "known",
        "major",
        "minor",
        "nested",
        "omit_none",
        "schema_name",
        "tag",
        "type_name",
    )

    def __init__(self, cls: type[Any]) -> None:
        self.cls = cls
        self.tag = getattr(cls, "SCHEMA", None)
        self.type_name, self.major, self.minor = "", 0, 0
        self.schema_name = ""
        if self.tag is not None:
            match = TAG.fullmatch(self.tag)
            if match is None:
                raise TypeError(f"{cls.__name__}.SCHEMA {self.tag!r} is not <type>/<major>.<minor>")
            self.type_name, self.major, self.minor = match[1], int(match[2]), int(match[3])
            self.schema_name = f"{self.type_name}.v{self.major}"
        hints = typing.get_type_hints(cls, include_extras=True)
        codecs = {f.name: _field_codec(hints[f.name]) for f in dataclasses.fields(cls)}
        self.known = frozenset(codecs) | ({"schema"} if self.tag else set())
        self.encoders = tuple((name, c.to_wire) for name, c in codecs.items())
        self.omit_none = tuple(
            name for name in codecs if OmittedWhenNone in getattr(hints[name], "__metadata__", ())
        )
        # Ints are the bulk of most messages: test them inline instead of calling a decoder.
        self.int_names = tuple(n for n, c in codecs.items() if c.from_wire is _int_from_wire)
        self.decoders = tuple(
            (n, c.from_wire)
            for n, c in codecs.items()
            if c.from_wire is not None and c.from_wire is not _int_from_wire
        )
        self.compiled = None
        self.nested = tuple((name, c.nested) for name, c in codecs.items() if c.nested is not None)
        self.has_tagged_nested = any(p.tag or p.has_tagged_nested for _, p in self.nested)

    def to_wire(self, value: Any, path: str) -> dict[str, Any]:
        """The wire object of dataclass instance ``value`` (found at JSON path ``path``)."""
        if type(value) is not self.cls:
            raise SchemaViolation(
                path or None, f"must be a {self.cls.__name__}, not {type(value).__name__}"
            )
        wire: dict[str, Any] = {"schema": self.tag} if self.tag else {}
        for name, encode_field in self.encoders:
            field_value = getattr(value, name)
            wire[name] = (
                field_value if encode_field is None else encode_field(field_value, join(path, name))
            )
        for name in self.omit_none:
            if wire[name] is None:
                del wire[name]
        for name in self.int_names:
            # 3.0 is a JSON Schema integer; written as 3 so that equal messages encode equally.
            if type(wire[name]) is float and wire[name].is_integer():
                wire[name] = int(wire[name])
        return wire

    def from_wire(self, wire: dict[str, Any]) -> Any:
        """The dataclass instance of validated wire object ``wire`` (consumed in place).

        Raises:
            NestingTooDeep: a free-form field nests too deep (a check left to decoding).
            SchemaViolation: the class refuses the values (a rule across fields the schema
                cannot state, such as a reversed ``StepRange``), naming the nested field.
        """
        if self.tag is not None:
            del wire["schema"]  # required by every tagged schema, so validation ensured it
        for name in self.int_names:
            if type(wire.get(name)) is float:
                wire[name] = int(wire[name])
        name = ""
        try:
            for name, decode_field in self.decoders:
                value = wire.get(name)
                if value is not None:
                    wire[name] = decode_field(value)
        except (NestingTooDeep, SchemaViolation) as exc:
            # Each level of nesting prefixes its field name, building the full path.
            inner = exc.field or ""
            field = f"{name}.{inner}" if inner and not inner.startswith("[") else name + inner
            raise type(exc)(field, exc.reason) from None
        try:
            return self.cls(**wire)
        except ValueError as exc:  # a rule across fields, checked by the class (StepRange)
            raise SchemaViolation(None, str(exc)) from None

    def prune(self, wire: dict[str, Any]) -> None:
        """Tolerant reader: drop properties this build does not know, here and in nested
        objects, except in nested objects with their own tag (those follow their own minor)."""
        for key in [k for k in wire if k not in self.known]:
            del wire[key]
        for name, plan in self.nested:
            if plan.tag is None:
                for child in _objects(wire.get(name)):
                    plan.prune(child)

    def admit_nested(self, wire: dict[str, Any]) -> None:
        """Apply the version rule to nested objects that carry their own tag."""
        for name, plan in self.nested:
            for child in _objects(wire.get(name)):
                if plan.tag is not None:
                    tag = child.get("schema")
                    match = TAG.fullmatch(tag) if type(tag) is str else None
                    # Anything but a newer minor of the expected type is left to validation.
                    if (
                        match is not None
                        and match[1] == plan.type_name
                        and int(match[2]) == plan.major
                        and int(match[3]) > plan.minor
                    ):
                        plan.prune(child)
                if plan.has_tagged_nested:
                    plan.admit_nested(child)


def _objects(value: Any) -> list[dict[str, Any]]:
    """The JSON objects a nested field holds: itself, or the objects in its array."""
    if type(value) is dict:
        return [value]
    if type(value) is list:
        return [v for v in value if type(v) is dict]
    return []


PLANS: Final[dict[type[Any], Plan]] = {}


def plan_of(cls: type[Any]) -> Plan:
    """The plan of ``cls``, built on first use (at import, for every message class)."""
    plan = PLANS.get(cls)
    if plan is None:
        plan = PLANS[cls] = Plan(cls)
    return plan


# Built at import (a few milliseconds); validators are still compiled on first use.
PLAN_BY_TAG: Final[dict[str, Plan]] = {cls.SCHEMA: plan_of(cls) for cls in MESSAGE_TYPES}
PLAN_BY_TYPE: Final[dict[str, Plan]] = {p.type_name: p for p in PLAN_BY_TAG.values()}
