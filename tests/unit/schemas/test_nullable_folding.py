"""The compiled validators admit ``null`` by a subschema's ``type`` instead of an ``anyOf``
branch where that keeps the meaning (``_schema_files._nullable``); that they accept exactly
what the reference validator accepts is ``tests/contract/schemas/test_validators_agree.py``."""

from __future__ import annotations

from trainguard.schemas._schema_files import _nullable

SNAPSHOT_ID = {"type": "string", "pattern": "^[a-z]+/g[0-9]+$"}


def test_a_nullable_subschema_with_a_type_admits_null_by_its_type() -> None:
    node = {"description": "lineage", "anyOf": [SNAPSHOT_ID, {"type": "null"}], "default": None}
    assert _nullable(node) == {
        "description": "lineage",
        "default": None,
        "type": ["string", "null"],
        "pattern": "^[a-z]+/g[0-9]+$",
    }
    # Either order, nested anywhere, a type list extended once.
    nested = {"properties": {"p": {"anyOf": [{"type": "null"}, {"type": ["integer", "string"]}]}}}
    assert _nullable(nested) == {"properties": {"p": {"type": ["integer", "string", "null"]}}}


def test_a_subschema_that_constrains_every_type_is_left_as_an_any_of() -> None:
    """``enum``, ``const`` and combinators apply to ``null`` too: folding would reject it."""
    for other in (
        {"type": "string", "enum": ["a", "b"]},
        {"type": "integer", "const": 1},
        {"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
        {"enum": ["a"]},  # no type to extend
    ):
        node = {"anyOf": [other, {"type": "null"}]}
        assert _nullable(node) == node
    three = {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}
    assert _nullable(three) == three
