"""docs/wire-contract.md shows a valid JSON example (at least) for every message type, and its
field tables say what the schemas built from the message classes define."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest

from tests.support.schemas import REPO, doc_examples, same_message
from trainguard.schemas import MESSAGE_TYPES, decode, encode
from trainguard.schemas._schema_build import build_documents


@pytest.mark.parametrize("wire", doc_examples(), ids=lambda w: w["schema"])
def test_every_documented_example_decodes_and_survives_a_round_trip(wire: dict[str, Any]) -> None:
    msg = decode(orjson.dumps(wire))
    assert wire["schema"] == msg.SCHEMA
    assert same_message(decode(encode(msg)), msg)


def test_every_message_type_is_documented_with_an_example() -> None:
    documented = {type(decode(orjson.dumps(wire))) for wire in doc_examples()}
    assert documented == set(MESSAGE_TYPES)


# -- the field tables, checked against the built schemas -------------------------------------

_DOC = REPO / "docs" / "wire-contract.md"
_HEADING = re.compile(r"^### [a-z-]+ \(`(\w+)`", re.M)
_NAMES = re.compile(r"`([a-z_]+)`")


def _table(section: str, header: str) -> list[list[str]]:
    """The rows (cells, stripped) of the first table of ``section`` whose header row starts
    with ``header``; [] when there is none."""
    lines = section.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(header):
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append([cell.strip() for cell in row.strip("|").split("|")])
            return rows
    return []


def _sections() -> dict[str, str]:
    """Message class name -> its section of docs/wire-contract.md (heading to next heading)."""
    text = _DOC.read_text(encoding="utf-8")
    text = text[text.index("## Messages") : text.index("## Versions")]
    heads = list(_HEADING.finditer(text))
    ends = [h.start() for h in heads[1:]] + [len(text)]
    return {h.group(1): text[h.start() : end] for h, end in zip(heads, ends, strict=True)}


def _shared_names() -> set[str]:
    """Properties the doc's "Shared conventions" table describes for every message."""
    text = _DOC.read_text(encoding="utf-8")
    section = text[text.index("## Shared conventions") : text.index("## Nested objects")]
    return {n for row in _table(section, "| property |") for n in _NAMES.findall(row[0])}


def _nullable(prop: dict[str, Any]) -> bool:
    types = prop.get("type")
    return (isinstance(types, list) and "null" in types) or any(
        branch.get("type") == "null" or "null" in (branch.get("type") or [])
        for branch in prop.get("anyOf", [])
    )


def _schema_of(cls: type[Any]) -> dict[str, Any]:
    kind, _, version = cls.SCHEMA.partition("/")
    return build_documents()[f"{kind}.v{version.partition('.')[0]}"]


_NUMBER = r"(\d+(?:\^\d+(?:-1)?)?)"
_RANGE = re.compile(_NUMBER + r" \.\. " + _NUMBER)
_AT_LEAST = re.compile(r">= " + _NUMBER)
_AT_MOST = re.compile(r"at most " + _NUMBER)
_BOUND_KEYWORDS = {
    "integer": ("minimum", "maximum"),
    "number": ("minimum", "maximum"),
    "string": ("minLength", "maxLength"),
    "array": ("minItems", "maxItems"),
}


def _number(text: str) -> int:
    """A bound as the doc writes it: ``255``, ``2^63-1``, ``2^64``."""
    base, _, rest = text.partition("^")
    if not rest:
        return int(base)
    power: int = int(base) ** int(rest.removesuffix("-1"))
    return power - rest.endswith("-1")


def _documented_bounds(cell: str) -> tuple[int | None, int | None]:
    """(least, greatest) a table cell states: ``a .. b``, ``>= a``, ``at most b``."""
    if match := _RANGE.search(cell):
        return _number(match[1]), _number(match[2])
    least = _AT_LEAST.search(cell)
    most = _AT_MOST.search(cell)
    return (_number(least[1]) if least else None), (_number(most[1]) if most else None)


def _shared_definition(name: str) -> dict[str, Any]:
    """The ``$defs`` entry ``name`` of the generated common.v1 schema."""
    common: dict[str, Any] = build_documents()["common.v1"]
    definition: dict[str, Any] = common["$defs"][name]
    return definition


def _value_schema(prop: dict[str, Any]) -> dict[str, Any]:
    """The schema of a property's non-null values, ``$ref`` into common.v1 followed."""
    branches = [b for b in prop.get("anyOf", []) if b.get("type") != "null"]
    node = branches[0] if branches else prop
    if "$ref" in node:
        return _shared_definition(node["$ref"].rpartition("/")[2])
    return node


def _check_bounds(where: str, cell: str, prop: dict[str, Any]) -> None:
    """The bounds ``cell`` states are the schema's (strings and arrays have 0 as least)."""
    least, most = _documented_bounds(cell)
    if least is None and most is None:
        return
    value = _value_schema(prop)
    kind = value["type"] if isinstance(value["type"], str) else value["type"][0]
    low, high = _BOUND_KEYWORDS[kind]
    floor = 0 if kind in ("string", "array") else None
    if least is not None:
        assert value.get(low, floor) == least, f"{where}: doc says >= {least}, schema {value}"
    if most is not None:
        assert value.get(high) == most, f"{where}: doc says <= {most}, schema {value}"


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_each_message_section_documents_its_fields_as_the_schema_defines_them(
    cls: type[Any],
) -> None:
    """Every row of a message's field table names a property of its schema, says "required"
    exactly for the required ones and otherwise their default, "null" exactly for the nullable
    ones, and the schema's bounds where it states any; every property is in the table or the shared conventions (a section
    without a table: in its example, all of them required)."""
    section = _sections()[cls.__name__]
    schema = _schema_of(cls)
    properties, required = schema["properties"], set(schema["required"])
    documented: set[str] = set()
    for row in _table(section, "| field | type | required / default |"):
        for name in _NAMES.findall(row[0]):
            assert name in properties, f"{cls.__name__}: the doc lists {name}, no such property"
            documented.add(name)
            prop, kind, default = properties[name], row[1], row[2]
            if name in required:
                assert default == "required", f"{cls.__name__}.{name} is required"
            elif default == "all defaults":
                assert all("default" in p for p in _common_object(prop).values()), name
            else:
                assert orjson.loads(default.strip("`")) == prop["default"], (
                    f"{cls.__name__}.{name}: doc default {default}, schema {prop['default']!r}"
                )
            assert ("null" in kind) == _nullable(prop), (
                f"{cls.__name__}.{name}: type {kind!r}, schema nullable: {_nullable(prop)}"
            )
            _check_bounds(f"{cls.__name__}.{name}", kind, prop)
    if not documented:  # no table: "all fields required", shown by the section's example
        optional = set(properties) - required - _shared_names()
        assert not optional, f"{cls.__name__}: {sorted(optional)} are optional: add a table"
        documented = set().union(*(w.keys() for w in doc_examples() if w["schema"] == cls.SCHEMA))
    undocumented = set(properties) - documented - _shared_names() - {"schema"}
    assert not undocumented, f"{cls.__name__}: {sorted(undocumented)} are not documented"


def _common_object(prop: dict[str, Any]) -> dict[str, Any]:
    """The properties of the shared object a property refers to (``$ref`` into common.v1)."""
    name = prop["$ref"].rpartition("/")[2]
    properties: dict[str, Any] = _shared_definition(name)["properties"]
    return properties


@pytest.mark.parametrize(
    ("title", "name", "header"),
    [
        ("**cursor**", "cursor", "| field | type | meaning |"),
        ("**metadata**", "metadata", "| field | type | default |"),
    ],
)
def test_the_nested_object_tables_list_exactly_their_fields(
    title: str, name: str, header: str
) -> None:
    text = _DOC.read_text(encoding="utf-8")
    section = text[text.index(title) :]
    rows = _table(section, header)
    definition: dict[str, Any] = _shared_definition(name)["properties"]
    assert [r[0].strip("`") for r in rows] == list(definition)
    for row in rows:
        prop = definition[row[0].strip("`")]
        _check_bounds(f"{name}.{row[0]}", row[1], prop)
        if header.endswith("| default |"):
            assert orjson.loads(row[2].strip("`")) == prop["default"]


def test_the_shared_conventions_state_the_bounds_of_every_message_using_them() -> None:
    """A row of "Shared conventions" holds for the property in every message that has it,
    unless the message's own table describes it (a job request's ``reason`` may be empty)."""
    text = _DOC.read_text(encoding="utf-8")
    section = text[text.index("## Shared conventions") : text.index("## Nested objects")]
    checked = 0
    for row in _table(section, "| property |"):
        for name in _NAMES.findall(row[0]):
            for cls in MESSAGE_TYPES:
                prop = _schema_of(cls)["properties"].get(name)
                own = _table(_sections()[cls.__name__], "| field | type | required / default |")
                if prop is not None and name not in {n for r in own for n in _NAMES.findall(r[0])}:
                    _check_bounds(f"{cls.__name__}.{name}", f"{row[1]} {row[2]}", prop)
                    checked += 1
    assert checked > 40  # job_id, generation, ts, seq in every message, ...
