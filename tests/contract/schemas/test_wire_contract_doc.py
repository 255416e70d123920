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


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_each_message_section_documents_its_fields_as_the_schema_defines_them(
    cls: type[Any],
) -> None:
    """Every row of a message's field table names a property of its schema, says "required"
    exactly for the required ones and otherwise their default, and "null" exactly for the
    nullable ones; every property is in the table or the shared conventions (a section
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
    if not documented:  # no table: "all fields required", shown by the section's example
        optional = set(properties) - required - _shared_names()
        assert not optional, f"{cls.__name__}: {sorted(optional)} are optional: add a table"
        documented = set().union(*(w.keys() for w in doc_examples() if w["schema"] == cls.SCHEMA))
    undocumented = set(properties) - documented - _shared_names() - {"schema"}
    assert not undocumented, f"{cls.__name__}: {sorted(undocumented)} are not documented"


def _common_object(prop: dict[str, Any]) -> dict[str, Any]:
    """The properties of the shared object a property refers to (``$ref`` into common.v1)."""
    name = prop["$ref"].rpartition("/")[2]
    return build_documents()["common.v1"]["$defs"][name]["properties"]


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
    definition = build_documents()["common.v1"]["$defs"][name]["properties"]
    assert [r[0].strip("`") for r in rows] == list(definition)
    for row in rows:
        if header.endswith("| default |"):
            assert orjson.loads(row[2].strip("`")) == definition[row[0].strip("`")]["default"]
