"""The JSON Schema files: valid 2020-12, consistent with the dataclasses, bounded, and written
only with keywords that fastjsonschema and jsonschema implement alike."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # no types-jsonschema in the dev env
import orjson
import pytest
from referencing.exceptions import Unresolvable

from tests.support.schemas import registry, schema_files
from trainguard.schemas import (
    MESSAGE_TYPES,
    SCHEMA_BASE_URI,
    CheckpointMeta,
    DataCursor,
    Shard,
    StepRange,
    UnknownSchema,
    load_schema,
    schema_path,
)

DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"

# Keywords both fastjsonschema (draft 7 code generator) and jsonschema (2020-12) implement with
# the same meaning for the way we use them; "$defs" is only ever reached through JSON pointers.
ALLOWED_KEYWORDS = {
    "$schema", "$id", "$ref", "$defs", "$comment", "title", "description", "default",
    "type", "enum", "const", "properties", "required", "additionalProperties", "maxProperties",
    "items", "minItems", "maxItems", "uniqueItems", "minimum", "maximum", "minLength",
    "maxLength", "pattern", "anyOf", "allOf", "not", "if", "then", "else",
}  # fmt: skip
ANNOTATIONS = {"$ref", "$comment", "title", "description", "default"}
NESTED_CLASSES = {
    "cursor": DataCursor,
    "metadata": CheckpointMeta,
    "shard": Shard,
    "step_range": StepRange,
}


def subschemas(node: Any, path: str = "#") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object inside ``node`` (itself included), with its JSON pointer."""
    yield path, node
    for key in ("properties", "$defs"):
        for name, child in node.get(key, {}).items():
            yield from subschemas(child, f"{path}/{key}/{name}")
    for key in ("items", "not", "if", "then", "else"):
        if key in node:
            yield from subschemas(node[key], f"{path}/{key}")
    for key in ("anyOf", "allOf"):
        for index, child in enumerate(node.get(key, [])):
            yield from subschemas(child, f"{path}/{key}/{index}")


def all_subschemas() -> Iterator[tuple[str, dict[str, Any]]]:
    for file in schema_files():
        for pointer, node in subschemas(json.loads(file.read_text())):
            yield f"{file.name}{pointer}", node


def wire_default(value: Any) -> Any:
    """The wire form of a dataclass field's default value."""
    return orjson.loads(orjson.dumps(value))


def test_the_package_ships_one_file_per_message_type_and_the_common_definitions() -> None:
    names = {f.name for f in schema_files()}
    expected = {
        "{}.v{}.json".format(*cls.SCHEMA.replace(".", "/").split("/")[:2]) for cls in MESSAGE_TYPES
    }
    assert names == expected | {"common.v1.json"}


@pytest.mark.parametrize("file", schema_files(), ids=lambda f: f.name)
def test_each_file_is_a_valid_2020_12_schema_with_its_own_id(file: Any) -> None:
    schema = json.loads(file.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == DRAFT_2020_12
    assert schema["$id"] == SCHEMA_BASE_URI + file.name


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_each_message_schema_matches_its_dataclass(cls: Any) -> None:
    type_name, _, version = cls.SCHEMA.partition("/")
    major = version.partition(".")[0]
    schema = load_schema(f"{type_name}.v{major}")
    assert schema["title"] == cls.SCHEMA, "bump SCHEMA and the file's title together"
    fields = dataclasses.fields(cls)
    assert set(schema["properties"]) == {f.name for f in fields} | {"schema"}
    assert set(schema["required"]) == {"schema"} | {
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    pattern = re.compile(schema["properties"]["schema"]["pattern"])
    assert pattern.search(cls.SCHEMA)
    assert pattern.search(f"{type_name}/{major}.17")
    assert not pattern.search(f"{type_name}/{int(major) + 1}.0")
    assert not pattern.search(f"x{type_name}/{major}.0")


@pytest.mark.parametrize("name", sorted(NESTED_CLASSES))
def test_each_nested_definition_matches_its_dataclass(name: str) -> None:
    definition = load_schema("common.v1")["$defs"][name]
    fields = dataclasses.fields(NESTED_CLASSES[name])
    assert set(definition["properties"]) == {f.name for f in fields}
    assert set(definition.get("required", [])) == {
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }


@pytest.mark.parametrize(
    "cls", [*MESSAGE_TYPES, *NESTED_CLASSES.values()], ids=lambda c: c.__name__
)
def test_schema_defaults_are_the_dataclass_defaults(cls: Any) -> None:
    if cls in NESTED_CLASSES.values():
        name = next(n for n, c in NESTED_CLASSES.items() if c is cls)
        properties = load_schema("common.v1")["$defs"][name]["properties"]
    else:
        type_name, _, version = cls.SCHEMA.partition("/")
        properties = load_schema(f"{type_name}.v{version.partition('.')[0]}")["properties"]
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            expected = wire_default(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            expected = wire_default(field.default_factory())
        else:
            assert "default" not in properties[field.name], field.name
            continue
        assert properties[field.name].get("default", "<none>") == expected, field.name


def test_only_keywords_both_validators_share_are_used() -> None:
    for where, node in all_subschemas():
        assert set(node) <= ALLOWED_KEYWORDS, (where, set(node) - ALLOWED_KEYWORDS)
        if "$ref" in node:
            # fastjsonschema ignores a $ref's siblings (draft 7 rule), 2020-12 applies them.
            assert set(node) <= ANNOTATIONS, (where, set(node) - ANNOTATIONS)
        if "pattern" in node:
            # fastjsonschema rewrites every unescaped "$" to "\Z", also inside [...].
            assert "$" not in re.sub(r"\$$", "", node["pattern"]), where


def test_every_object_is_closed_except_free_form_ones() -> None:
    for where, node in all_subschemas():
        if node.get("type") == "object" and not where.endswith("/$defs/json_object"):
            assert node.get("additionalProperties") is False, where
            assert "properties" in node, where


def test_every_value_is_bounded() -> None:
    """Integers fit 64 bits, strings and arrays have a maximum length."""
    for where, node in all_subschemas():
        types = node.get("type", [])
        types = [types] if isinstance(types, str) else types
        if "integer" in types:
            assert node["minimum"] >= -(2**63), where
            assert node["maximum"] <= 2**64 - 1, where
        if "string" in types:
            bounded_pattern = "pattern" in node and not re.search(r"[*+]", node["pattern"])
            assert "maxLength" in node or bounded_pattern, where
        if "array" in types:
            assert node["maxItems"] <= 65536, where


def test_every_ref_resolves_inside_the_package() -> None:
    resources = registry()
    for file in schema_files():
        resolver = resources.resolver(base_uri=SCHEMA_BASE_URI + file.name)
        for where, node in subschemas(json.loads(file.read_text())):
            if "$ref" in node:
                assert not node["$ref"].startswith(("http:", "https:", "/")), where
                try:
                    resolver.lookup(node["$ref"])
                except Unresolvable:  # pragma: no cover - the assertion explains
                    pytest.fail(f"{file.name}{where}: {node['$ref']} does not resolve")


def test_schema_files_are_found_by_name_and_nothing_else_is() -> None:
    assert json.loads(schema_path("heartbeat.v1").read_text())["title"].startswith("heartbeat/")
    assert load_schema("common.v1")["$id"] == SCHEMA_BASE_URI + "common.v1.json"
    for bad in ("heartbeat.v9", "../common.v1", "heartbeat", "Heartbeat.v1", ""):
        with pytest.raises(UnknownSchema):
            schema_path(bad)
