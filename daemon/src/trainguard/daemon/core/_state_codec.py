"""Exact, versioned serialization of a job's state (:class:`JobState`) for state snapshots.

A snapshot lets the daemon restore a job from its latest state plus the events after it
instead of folding the whole log again, so decoding must give back *exactly* the state that was
encoded: ``decode_state(encode_state(s)) == s``, with the same Python types (``int`` stays
``int``, ``float`` stays ``float``, ``tuple`` stays ``tuple``), and continuing the fold from
the decoded state gives the same decisions as from the original. Pure: no I/O, no clock.

Document (``jobstate/1``), one JSON object::

    {"format": "jobstate/1", "layout": "<16 hex digits>", "state": <JobState>}

The form of each value follows its type hint, derived from the state's class definitions
(``msgspec`` struct fields, ``NamedTuple`` fields and ``dataclasses.fields``), never from a
hand-written field list:

* ``msgspec.Struct``, ``NamedTuple`` and (non-message) dataclass records, e.g. ``JobState``,
  ``RankState``, ``Watch``, ``Incident``: a JSON object with exactly the class's fields.
* ``int``: a JSON integer, within ``-2**63 .. 2**64 - 1`` (what orjson writes exactly; ns
  timestamps are about 1.7e18 and never pass through a float).
* ``float``: a JSON number (orjson writes the shortest form that reads back bit for bit), or
  the string ``"nan"``, ``"inf"`` or ``"-inf"`` for a non-finite value (``Spike.z`` is ``inf``
  against a zero MAD), as the wire contract writes ``loss``. An ``int`` held by a ``float``
  field stays a JSON integer and reads back as an ``int``.
* ``str``, ``bool``, ``Literal[...]`` (checked against its values), ``X | None`` (``null``).
* ``tuple[X, ...]`` and fixed ``tuple[X, Y, Z]`` (``Sender``): a JSON array, read back as a
  tuple.
* ``frozenset[X]`` and ``HashTrieSet[X]``: a JSON array of the elements, sorted.
* ``HashTrieMap[K, V]``: a JSON array of ``[key, value]`` pairs sorted by key (keys may be
  ints, strings or tuples, which JSON object keys cannot hold).
* a wire message (``Manifest``, ``Checkpoint``): the object the schemas codec writes
  (:func:`trainguard.schemas.encode`, with its ``schema`` tag), read back with
  :func:`trainguard.schemas.decode_parsed` from the object parsed with the whole document
  (validated, the message version rule applied): the document is parsed once, not each message
  again (the manifests kept in a large job's state are most of its bytes: at 16,384 ranks
  serialising and parsing them a second time cost 150 ms of a 950 ms decode,
  ``bench/state_snapshot.py``).

Maps and sets are written in sorted order and object keys sorted, so a state always encodes to
the same bytes, in any process. ``layout`` is a digest of the description of every type above
as this build defines them: a snapshot written by a build whose state classes differ (a field
added, removed, renamed or retyped, a ``Literal`` value added) is refused as a whole rather
than read into the wrong fields; the caller then folds the log instead. The exception are the
earlier layouts in :data:`READABLE_LAYOUTS`: this build differs from them only by fields it
added to ``JobState`` or to the ``Left`` and ``RankState`` records it holds, and a document of
such a layout is read with those fields at their defaults (a rank's ``step_done_ns`` at its
``step_advanced_ns``, its ``late_ns`` 0): an *upcaster* per layout adds them to the ``state`` object before it is
decoded. Any other change of the document's form needs a new ``format``.

Decoding is strict: a missing or unknown field, a value of the wrong JSON type, an integer
outside the 64-bit range, a string that is not one of a ``Literal``'s values, a malformed map
entry or a repeated map key or set element raises :class:`StateFormatError` naming the JSON
path of the value (``state.ranks[2][1].step``: the value of the third ``[key, value]`` pair of
``ranks``, its ``step``); nothing is returned half built. Duplicate keys inside one JSON object
cannot be detected (orjson keeps the last); snapshots are signed, so only their writer could
have put any there.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import operator
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, Final, Generic, Literal, NamedTuple, TypeVar

import msgspec
import orjson
from rpds import HashTrieMap, HashTrieSet

from trainguard.daemon.core._state import JobState
from trainguard.schemas import (
    MESSAGE_TYPES,
    JSONValue,
    Manifest,
    SchemaError,
    SnapshotRef,
    decode_parsed,
    snapshot_ref,
)
from trainguard.schemas import encode as encode_message

__all__ = [
    "FORMAT",
    "LAYOUT",
    "READABLE_LAYOUTS",
    "StateFormatError",
    "decode_state",
    "encode_state",
    "state_from_dict",
    "state_to_dict",
]

FORMAT: Final = "jobstate/1"
"""The document's ``format``: the form described in this module's docstring."""


class StateFormatError(ValueError):
    """A job-state document is malformed, of another format or layout, or a state holds a value
    the format cannot represent (when encoding).

    Attributes:
        path: JSON path of the offending value (``"state.ranks[2][1].step"``), or ``None`` when
            the document as a whole is at fault (not JSON, not an object).
        reason: short explanation.
    """

    def __init__(self, path: str | None, reason: str) -> None:
        # Both go to ``args`` so the error pickles and compares like a plain ValueError.
        super().__init__(path, reason)
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path if self.path is not None else '<document>'}: {self.reason}"


def _under(segment: str, exc: StateFormatError) -> StateFormatError:
    """``exc`` located inside ``segment`` (a field name, ``"[3]"``); paths are built on the way
    out of the recursion, so a value that converts costs no path string."""
    inner = exc.path
    if inner is None:
        path = segment
    elif inner.startswith("["):
        path = segment + inner
    else:
        path = f"{segment}.{inner}"
    return StateFormatError(path, exc.reason)


_Encoder = Callable[[Any], JSONValue]
"""Python value -> JSON-ready value; raises StateFormatError (path relative to the value)."""
_Decoder = Callable[[Any], Any]
"""parsed JSON value -> Python value; raises StateFormatError (path relative to the value)."""


class _Form(NamedTuple):
    """How values of one type hint are written and read, and ``shape``, the hint's description
    for :data:`LAYOUT`."""

    encode: _Encoder
    decode: _Decoder
    shape: str


_K = TypeVar("_K")
_V = TypeVar("_V")


class _TrieMap(Generic[_K, _V]):
    """Stands for ``HashTrieMap`` when the state's annotations are evaluated: rpds classes
    cannot be subscripted at run time, so ``HashTrieMap[int, RankState]`` only evaluates
    against a subscriptable stand-in."""


class _TrieSet(Generic[_K]):
    """Stands for ``HashTrieSet`` when the state's annotations are evaluated."""


_STAND_INS: Final[dict[str, Any]] = {"HashTrieMap": _TrieMap, "HashTrieSet": _TrieSet}


def _kind(value: object) -> str:
    """The JSON kind of a parsed value, for error reasons."""
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    return names.get(type(value), "an array" if type(value) is list else "an object")


def _bad(value: object, expected: str) -> StateFormatError:
    return StateFormatError(None, f"must be {expected}, not {_kind(value)}")


# -- scalars ----------------------------------------------------------------------------------

_INT_LOW: Final = -(2**63)
_INT_HIGH: Final = 2**64 - 1
"""orjson writes and reads integers exactly in this range (it reads larger ones as floats)."""


def _int(value: Any) -> JSONValue:
    if type(value) is not int:
        raise _bad(value, "an integer")
    if not _INT_LOW <= value <= _INT_HIGH:
        raise StateFormatError(None, "integer outside -2**63 .. 2**64 - 1")
    return value


_NON_FINITE: Final = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _encode_float(value: Any) -> JSONValue:
    if type(value) is float:
        if math.isfinite(value):
            return value
        # orjson would write null: JSON has no literal for these.
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if type(value) is int:
        return _int(value)  # an int in a float field stays an int (int is a float's subtype)
    raise _bad(value, "a number")


def _decode_float(wire: Any) -> Any:
    if type(wire) is float:
        return wire
    if type(wire) is int:
        return _int(wire)
    if type(wire) is str and wire in _NON_FINITE:
        return _NON_FINITE[wire]
    raise _bad(wire, 'a number, "nan", "inf" or "-inf"')


def _exact(cls: type[Any], expected: str) -> _Form:
    """A type written as itself (``str``, ``bool``), checked exactly (a bool is no int)."""

    def check(value: Any) -> Any:
        if type(value) is not cls:
            raise _bad(value, expected)
        return value

    return _Form(check, check, cls.__name__)


def _literal(values: tuple[Any, ...]) -> _Form:
    allowed = frozenset((type(v), v) for v in values)
    listed = ", ".join(repr(v) for v in values)

    def check(value: Any) -> Any:
        try:
            known = (type(value), value) in allowed
        except TypeError:  # unhashable: a list or an object
            known = False
        if not known:
            raise StateFormatError(None, f"must be one of {listed}")
        return value

    return _Form(check, check, f"Literal[{listed}]")


def _optional(inner: _Form) -> _Form:
    encode, decode = inner.encode, inner.decode

    def encode_optional(value: Any) -> JSONValue:
        return None if value is None else encode(value)

    def decode_optional(wire: Any) -> Any:
        return None if wire is None else decode(wire)

    return _Form(encode_optional, decode_optional, f"{inner.shape} | None")


# -- containers -------------------------------------------------------------------------------


def _order(key: Any) -> tuple[Any, ...]:
    """A total order of keys and set elements (ints, strings, tuples holding ``None``), the
    same for a Python value and its JSON form (tuples are arrays there)."""
    if key is None:
        return (0,)
    if type(key) is str:
        return (2, key)
    if type(key) is tuple or type(key) is list:
        return (3, tuple(_order(k) for k in key))
    return (1, key)


def _encode_items(items: Iterable[Any], encode: _Encoder) -> list[JSONValue]:
    out: list[JSONValue] = []
    for index, item in enumerate(items):
        try:
            out.append(encode(item))
        except StateFormatError as exc:
            raise _under(f"[{index}]", exc) from None
    return out


def _decode_items(wire: Any, decode: _Decoder) -> list[Any]:
    if type(wire) is not list:
        raise _bad(wire, "an array")
    out: list[Any] = []
    for index, item in enumerate(wire):
        try:
            out.append(decode(item))
        except StateFormatError as exc:
            raise _under(f"[{index}]", exc) from None
    return out


def _tuple_of(item: _Form) -> _Form:
    """``tuple[X, ...]``."""

    def encode(value: Any) -> JSONValue:
        if type(value) is not tuple:
            raise StateFormatError(None, f"must be a tuple, not {type(value).__name__}")
        return _encode_items(value, item.encode)

    def decode(wire: Any) -> Any:
        return tuple(_decode_items(wire, item.decode))

    return _Form(encode, decode, f"tuple[{item.shape}, ...]")


def _fixed_tuple(items: tuple[_Form, ...]) -> _Form:
    """``tuple[X, Y, Z]``: exactly one value of each type."""
    size = len(items)

    def encode(value: Any) -> JSONValue:
        if type(value) is not tuple or len(value) != size:
            raise StateFormatError(None, f"must be a tuple of {size}")
        out: list[JSONValue] = []
        for index, (form, part) in enumerate(zip(items, value, strict=True)):
            try:
                out.append(form.encode(part))
            except StateFormatError as exc:
                raise _under(f"[{index}]", exc) from None
        return out

    def decode(wire: Any) -> Any:
        if type(wire) is not list or len(wire) != size:
            raise StateFormatError(None, f"must be an array of {size}")
        out: list[Any] = []
        for index, (form, part) in enumerate(zip(items, wire, strict=True)):
            try:
                out.append(form.decode(part))
            except StateFormatError as exc:
                raise _under(f"[{index}]", exc) from None
        return tuple(out)

    return _Form(encode, decode, f"tuple[{', '.join(f.shape for f in items)}]")


def _first_repeat(keys: Iterable[Any]) -> int | None:
    """Index of the first key equal to an earlier one, or ``None``."""
    seen: set[Any] = set()
    for index, key in enumerate(keys):
        if key in seen:
            return index
        seen.add(key)
    return None


def _set_of(cls: type[frozenset[Any]] | type[HashTrieSet[Any]], item: _Form) -> _Form:
    """``frozenset[X]`` or ``HashTrieSet[X]``: sorted elements."""
    order = None if item.shape in _PLAIN_ORDER else _order

    def encode(value: Any) -> JSONValue:
        if type(value) is not cls:
            raise StateFormatError(None, f"must be a {cls.__name__}, not {type(value).__name__}")
        return _encode_items(_sorted(value, order), item.encode)

    def decode(wire: Any) -> Any:
        elements = _decode_items(wire, item.decode)
        repeat = _first_repeat(elements)
        if repeat is not None:
            raise StateFormatError(f"[{repeat}]", "repeated set element")
        return cls(elements)

    return _Form(encode, decode, f"{cls.__name__}[{item.shape}]")


def _by_key(pair: tuple[Any, Any]) -> tuple[Any, ...]:
    return _order(pair[0])


_PLAIN_ORDER: Final = frozenset({"int", "str"})
"""Shapes of keys that :func:`_order` orders as Python does (one type, no tuples): their maps
and sets are sorted without it, in the same order (a 16,384-rank state: a third of its
encoding time went to ``_order``)."""


def _sorted(
    items: Iterable[Any],
    key: Callable[[Any], Any] | None,
    fallback: Callable[[Any], Any] | None = _order,
) -> list[Any]:
    """``items`` sorted by ``key`` (``None``: as they are); by ``fallback`` when they do not
    compare that way (a value of another type than the hint's, which encoding then names)."""
    items = list(items)
    try:
        return sorted(items, key=key)
    except TypeError:
        if fallback is None:
            raise
        return sorted(items, key=fallback)


def _map_of(key: _Form, value: _Form) -> _Form:
    """``HashTrieMap[K, V]``: ``[key, value]`` pairs sorted by key."""
    encode_key, encode_value = key.encode, value.encode
    decode_key, decode_value = key.decode, value.decode
    by_key = operator.itemgetter(0) if key.shape in _PLAIN_ORDER else _by_key
    fallback = None if by_key is _by_key else _by_key

    def encode(mapping: Any) -> JSONValue:
        if type(mapping) is not HashTrieMap:
            raise StateFormatError(None, f"must be a HashTrieMap, not {type(mapping).__name__}")
        out: list[JSONValue] = []
        where = "[0]"
        try:
            for index, (k, v) in enumerate(_sorted(mapping.items(), by_key, fallback)):
                where = f"[{index}][0]"
                wire_key = encode_key(k)
                where = f"[{index}][1]"
                out.append([wire_key, encode_value(v)])
        except StateFormatError as exc:
            raise _under(where, exc) from None
        return out

    def decode(wire: Any) -> Any:
        if type(wire) is not list:
            raise _bad(wire, "an array of [key, value] pairs")
        pairs: list[tuple[Any, Any]] = []
        where = "[0]"
        try:
            for index, pair in enumerate(wire):
                where = f"[{index}]"
                if type(pair) is not list or len(pair) != 2:
                    raise _bad(pair, "a [key, value] pair")
                where = f"[{index}][0]"
                k = decode_key(pair[0])
                where = f"[{index}][1]"
                pairs.append((k, decode_value(pair[1])))
        except StateFormatError as exc:
            raise _under(where, exc) from None
        repeat = _first_repeat(k for k, _ in pairs)
        if repeat is not None:
            raise StateFormatError(f"[{repeat}][0]", "repeated map key")
        return HashTrieMap(pairs)

    return _Form(encode, decode, f"HashTrieMap[{key.shape}, {value.shape}]")


# -- records and messages ---------------------------------------------------------------------


def _record(cls: type[Any]) -> _Form:
    """A ``NamedTuple``, ``msgspec.Struct`` or dataclass: an object with exactly its fields.

    Raises:
        TypeError: a field's type has no form (naming ``Class.field``), or a dataclass field
            is not an ``__init__`` parameter (it could not be restored).
    """
    hints = typing.get_type_hints(cls, localns=_STAND_INS)
    if dataclasses.is_dataclass(cls):
        fields = dataclasses.fields(cls)
        derived = [f.name for f in fields if not f.init]
        if derived:
            raise TypeError(f"{cls.__name__}.{derived[0]} is not an __init__ field")
        names: tuple[str, ...] = tuple(f.name for f in fields)
    elif issubclass(cls, msgspec.Struct):
        names = cls.__struct_fields__
    else:
        names = cls._fields
    forms: list[_Form] = []
    for name in names:
        try:
            forms.append(_form(hints[name]))
        except TypeError as exc:
            raise TypeError(f"{cls.__name__}.{name}: {exc}") from None
    plan = tuple(zip(names, forms, strict=True))
    known = frozenset(names)
    positional = not dataclasses.is_dataclass(cls)

    def encode(value: Any) -> JSONValue:
        if type(value) is not cls:
            raise StateFormatError(None, f"must be a {cls.__name__}, not {type(value).__name__}")
        out: dict[str, JSONValue] = {}
        name = ""
        try:
            for name, form in plan:
                out[name] = form.encode(getattr(value, name))
        except StateFormatError as exc:
            raise _under(name, exc) from None
        return out

    def decode(wire: Any) -> Any:
        if type(wire) is not dict:
            raise _bad(wire, f"an object ({cls.__name__})")
        if wire.keys() != known:
            missing = [n for n in names if n not in wire]
            if missing:
                raise StateFormatError(missing[0], "missing field")
            unknown = next(k for k in wire if k not in known)
            raise StateFormatError(str(unknown), f"unknown field of {cls.__name__}")
        values: list[Any] = []
        name = ""
        try:
            for name, form in plan:
                values.append(form.decode(wire[name]))
        except StateFormatError as exc:
            raise _under(name, exc) from None
        if positional:
            return cls(*values)
        try:
            return cls(**dict(zip(names, values, strict=True)))
        except (TypeError, ValueError) as exc:  # a dataclass that checks its fields
            raise StateFormatError(None, f"not a valid {cls.__name__}: {exc}") from None

    shape = ", ".join(f"{n}: {f.shape}" for n, f in plan)
    return _Form(encode, decode, f"{cls.__name__}({shape})")


_NO_LIMIT: Final = 2**62
"""Byte limit passed to the schemas codec: a message inside a state is as large as it is (a
manifest of many ranks may exceed the wire default); sizes are the snapshot writer's concern."""


def _message(cls: type[Any]) -> _Form:
    """A wire message: the schemas codec's object (validated both ways, version rule on read)."""

    def encode(value: Any) -> JSONValue:
        if type(value) is not cls:
            raise StateFormatError(None, f"must be a {cls.__name__}, not {type(value).__name__}")
        try:
            wire: JSONValue = orjson.loads(encode_message(value, max_bytes=_NO_LIMIT))
        except SchemaError as exc:
            raise StateFormatError(exc.field, exc.reason) from None
        return wire

    def decode(wire: Any) -> Any:
        # Consumes ``wire`` (decode_parsed converts it in place): the decoders run on a
        # document of their own (decode_state's parse, state_from_dict's copy).
        if type(wire) is not dict:
            raise _bad(wire, f"an object ({cls.__name__})")
        try:
            return decode_parsed(wire, expect=cls)
        except SchemaError as exc:
            raise StateFormatError(exc.field, exc.reason) from None

    tag: str = cls.SCHEMA
    return _Form(encode, decode, f"message {tag.partition('.')[0]}")


# -- dispatch ---------------------------------------------------------------------------------

_FORMS: Final[dict[Any, _Form]] = {}


def _form(hint: Any) -> _Form:
    """The form of type hint ``hint`` (built once per hint).

    Raises:
        TypeError: ``hint`` (or a type inside it) has no form in ``jobstate/1``; add one here
            before such a type enters the state (a test folds every kind of trace through
            this codec, and this module fails to import while the state holds such a type).
    """
    form = _FORMS.get(hint)
    if form is None:
        form = _FORMS[hint] = _build(hint)
    return form


def _build(hint: Any) -> _Form:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        others = [a for a in args if a is not type(None)]
        if len(args) == 2 and len(others) == 1:
            return _optional(_form(others[0]))
    elif hint is int:
        return _Form(_int, _int, "int")
    elif hint is float:
        return _Form(_encode_float, _decode_float, "float")
    elif hint is str:
        return _exact(str, "a string")
    elif hint is bool:
        return _exact(bool, "a boolean")
    elif origin is Literal:
        return _literal(args)
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _tuple_of(_form(args[0]))
    elif origin is tuple and args and Ellipsis not in args:
        return _fixed_tuple(tuple(_form(a) for a in args))
    elif origin is frozenset:
        return _set_of(frozenset, _form(args[0]))
    elif origin is _TrieSet:
        return _set_of(HashTrieSet, _form(args[0]))
    elif origin is _TrieMap:
        return _map_of(_form(args[0]), _form(args[1]))
    elif hint in MESSAGE_TYPES:
        return _message(hint)
    elif isinstance(hint, type) and (
        dataclasses.is_dataclass(hint)
        or issubclass(hint, msgspec.Struct)
        or (issubclass(hint, tuple) and hasattr(hint, "_fields"))
    ):
        return _record(hint)
    raise TypeError(f"no {FORMAT} form for {hint!r}")


_STATE: Final = _form(JobState)

LAYOUT: Final = hashlib.sha256(_STATE.shape.encode()).hexdigest()[:16]
"""Digest (16 hex digits) of the state's type description as this build defines it; a
document of another layout is refused, unless it is one of :data:`READABLE_LAYOUTS`."""

_Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
"""The ``state`` object of an earlier layout -> one of this build's layout (a new object)."""


def _added(**defaults: JSONValue) -> _Upcaster:
    """An upcaster for a layout that lacked the ``JobState`` fields ``defaults`` (their JSON
    values here); a document that has any of them is not of that layout, and is refused."""

    def upcast(body: dict[str, Any]) -> dict[str, Any]:
        present = next((name for name in defaults if name in body), None)
        if present is not None:
            raise StateFormatError(present, "unknown field of JobState in this layout")
        return {**body, **defaults}

    return upcast


def _record_added(attribute: str, record: str, **defaults: JSONValue) -> _Upcaster:
    """An upcaster for a layout whose ``record`` (``JobState.<attribute>``: ``Left``,
    ``Held``) lacked the fields ``defaults`` (their JSON values here); one that has any of
    them is not of that layout, and is refused. A value that is not an object (``None``) is
    left to the decoder."""

    def upcast(body: dict[str, Any]) -> dict[str, Any]:
        value = body.get(attribute)
        if type(value) is not dict:
            return body
        present = next((name for name in defaults if name in value), None)
        if present is not None:
            raise StateFormatError(
                f"{attribute}.{present}", f"unknown field of {record} in this layout"
            )
        return {**body, attribute: {**value, **defaults}}

    return upcast


def _ranks_added(**values: Callable[[dict[str, Any]], JSONValue]) -> _Upcaster:
    """An upcaster for a layout whose ``RankState`` records lacked the fields ``values``, each
    set to its function of the rank's JSON object; a rank that has any of them is not of that
    layout, and is refused. A ``ranks`` value that is not a list of ``[key, object]`` pairs is
    left to the decoder."""

    def upcast(body: dict[str, Any]) -> dict[str, Any]:
        ranks = body.get("ranks")
        if type(ranks) is not list:
            return body
        upcast: list[Any] = []
        for n, pair in enumerate(ranks):
            if type(pair) is not list or len(pair) != 2 or type(pair[1]) is not dict:
                upcast.append(pair)
                continue
            rank = pair[1]
            present = next((name for name in values if name in rank), None)
            if present is not None:
                raise StateFormatError(
                    f"ranks[{n}][1].{present}", "unknown field of RankState in this layout"
                )
            upcast.append([pair[0], {**rank, **{k: f(rank) for k, f in values.items()}}])
        return {**body, "ranks": upcast}

    return upcast


def _step_done_ns(rank: dict[str, Any]) -> JSONValue:
    """A rank's step completion where the layout had none: dated as its deadline
    (``step_advanced_ns``), as that build named the ranks that stopped together."""
    return rank.get("step_advanced_ns")


def _on_time(rank: dict[str, Any]) -> JSONValue:
    """A rank's lateness where the layout had none: on time (that build did not extend its
    deadline)."""
    return 0


def _as_ref(wire: Any, path: str) -> Any:
    """A manifest's wire object (``None`` and anything malformed left to the decoder, which
    refuses it) as the wire object of its :class:`~trainguard.schemas.SnapshotRef`."""
    if type(wire) is not dict:
        return wire
    try:
        manifest = _form(Manifest).decode(wire)
    except StateFormatError as exc:
        raise _under(path, exc) from None
    return _form(SnapshotRef).encode(snapshot_ref(manifest))


def _refs_from_manifests(body: dict[str, Any]) -> dict[str, Any]:
    """Upcast a layout that kept whole manifests (one shard per rank) as the committed
    snapshots and a restore's target: each becomes its reference (id, manifest digest), what
    the state keeps since restores name snapshots by reference."""
    out = dict(body)
    committed = body.get("committed")
    if type(committed) is list:
        out["committed"] = [_as_ref(m, f"committed[{i}]") for i, m in enumerate(committed)]
    incident = body.get("incident")
    if type(incident) is dict and "target" in incident:
        out["incident"] = {**incident, "target": _as_ref(incident["target"], "incident.target")}
    return out


def _then(*upcasters: _Upcaster) -> _Upcaster:
    """The upcasters applied in order (a layout that lacked the fields of each)."""

    def upcast(body: dict[str, Any]) -> dict[str, Any]:
        for each in upcasters:
            body = each(body)
        return body

    return upcast


# Before the ranks' own dating of their steps (naming the ranks that stopped together): no
# gap recorded, each rank's step completion dated as its deadline.
_done_added: Final = _then(_added(last_gap=None), _ranks_added(step_done_ns=_step_done_ns))
# Before the hold for a checkpoint in flight: every held restore waited for the bus.
_awaits_added: Final = _record_added("held", "Held", awaits=None)
# Before the ranks' lateness (a backlog extends their progress deadlines): each on time; and
# before the fields added since.
_late_added: Final = _then(_ranks_added(late_ns=_on_time), _awaits_added)

_OLD_UPCASTERS: Final[dict[str, _Upcaster]] = {
    # Before the bus-outage rule (settle window, held restore).
    "c35900be070fb0d2": _then(
        _added(settle_until_ns=None, held=None, left=None), _done_added, _late_added
    ),
    # Before the late-finish rule (the generation a restore left).
    "ef5317866765d48d": _then(_added(left=None), _done_added, _late_added),
    # Before the late-cut rule (the left generation's shards and cuts).
    "0c4b9a05468dc2f8": _then(
        _record_added("left", "Left", pending=[], cuts=[]), _done_added, _late_added
    ),
    # Before the ranks' own dating of their steps (naming the ranks that stopped together).
    "7418d36e93a15e6c": _then(_done_added, _late_added),
    # Before the ranks' lateness (a backlog extends their progress deadlines).
    "6fb9639cf1123afa": _late_added,
    # Before the hold for a checkpoint in flight (Held.awaits).
    "229cdba23e078b61": _awaits_added,
    # Before references to snapshots (whole manifests kept).
    "4249f0793ee82f05": _then(),
}

# Before the batches' own seq (JobState.relays): no batch noted, so a batch the bus delivers
# again after such a snapshot counts as stale (skipped), not as a duplicate.
_relays_added: Final = _added(relays=[])

_UPCASTERS: Final[dict[str, _Upcaster]] = {
    **{
        layout: _then(upcast, _refs_from_manifests, _relays_added)
        for layout, upcast in _OLD_UPCASTERS.items()
    },
    # Before the batches' own seq (JobState.relays).
    "d0c702ce91cc15cb": _relays_added,
}

READABLE_LAYOUTS: Final = frozenset({LAYOUT, *_UPCASTERS})
"""The layouts this build reads: its own, and earlier ones it only added fields to (read with
those fields at their defaults)."""


# -- public API -------------------------------------------------------------------------------

_TOP_LEVEL: Final = frozenset({"format", "layout", "state"})


def state_to_dict(state: JobState) -> dict[str, JSONValue]:
    """The ``jobstate/1`` document of ``state``, JSON-ready (see the module docstring).

    Returns:
        ``{"format": "jobstate/1", "layout": LAYOUT, "state": {...}}``.

    Raises:
        StateFormatError: ``state`` holds a value its type hints do not allow (a list for a
            tuple, a bool for an int, ...), an integer outside the 64-bit range, or a message
            its schema refuses; ``path`` names it.
    """
    try:
        body = _STATE.encode(state)
    except StateFormatError as exc:
        raise _under("state", exc) from None
    return {"format": FORMAT, "layout": LAYOUT, "state": body}


def state_from_dict(document: object) -> JobState:
    """The state a ``jobstate/1`` document (as parsed from JSON) describes.

    Args:
        document: the parsed document; it is not modified (a copy is decoded). One of an
            earlier layout in :data:`READABLE_LAYOUTS` gives the fields added since their
            defaults.

    Raises:
        StateFormatError: the document is not an object with exactly ``format``, ``layout``
            and ``state``, names another format or a layout not in :data:`READABLE_LAYOUTS`,
            or any value in it breaks the form (``path`` names it).
    """
    return _from_document(copy.deepcopy(document))


def _from_document(document: object) -> JobState:
    """:func:`state_from_dict` of a document it may consume (its messages are converted in
    place)."""
    if type(document) is not dict:
        raise _bad(document, "a jobstate document (an object)")
    stated = document.get("format")
    if stated != FORMAT:
        shown = f", got {stated!r}" if type(stated) is str and len(stated) <= 64 else ""
        raise StateFormatError("format", f"expected {FORMAT!r}{shown}")
    layout = document.get("layout")
    upcast = None if layout == LAYOUT or type(layout) is not str else _UPCASTERS.get(layout)
    if layout != LAYOUT and upcast is None:
        raise StateFormatError(
            "layout", f"written for another state layout than this build's ({LAYOUT})"
        )
    if "state" not in document:
        raise StateFormatError("state", "missing field")
    unknown = [k for k in document if k not in _TOP_LEVEL]
    if unknown:
        raise StateFormatError(str(unknown[0]), "unknown field")
    body = document["state"]
    try:
        if upcast is not None and type(body) is dict:
            body = upcast(body)
        state: JobState = _STATE.decode(body)
    except StateFormatError as exc:
        raise _under("state", exc) from None
    return state


def encode_state(state: JobState) -> bytes:
    """``state`` as a ``jobstate/1`` JSON document: UTF-8, keys sorted, no whitespace.

    The same state gives the same bytes in every process (maps and sets sorted).

    Raises:
        StateFormatError: as :func:`state_to_dict`, or a string that is not valid Unicode
            (a lone surrogate).
    """
    try:
        return orjson.dumps(state_to_dict(state), option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError as exc:
        raise StateFormatError("state", f"not encodable as JSON: {exc}") from None


def decode_state(data: bytes | bytearray | memoryview) -> JobState:
    """The state encoded by :func:`encode_state`.

    Args:
        data: the document's bytes (after the snapshot's signature and encryption were
            checked and removed).

    Raises:
        StateFormatError: not UTF-8 JSON (``path`` ``None``), or as :func:`state_from_dict`.
    """
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise StateFormatError(None, f"not JSON: {exc}") from None
    return _from_document(document)
