"""fastjsonschema (what the codec runs) and jsonschema's Draft202012Validator (the reference
implementation of the draft our files declare) accept and reject the same messages.

fastjsonschema implements drafts 4 to 7 only; this test is what makes it safe to compile our
2020-12 files with it. One known difference is left out on purpose: Python's ``re`` lets ``$``
match before a trailing newline, which jsonschema inherits and fastjsonschema corrects (it
rewrites ``$`` to ``\\Z``, the ECMA-262 meaning JSON Schema specifies). Generated strings
therefore never end in a newline here; ``test_codec_errors`` checks the codec rejects them.
"""

from __future__ import annotations

from typing import Any

import fastjsonschema
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.schemas import (
    BAD_CASES,
    BadCase,
    codec_validator,
    doc_examples,
    json_values,
    messages,
    reference_validator,
    schema_name_of,
)
from trainguard.schemas import encode

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def verdicts(wire: Any, schema_name: str) -> tuple[bool, bool]:
    """(fastjsonschema accepts, jsonschema accepts)."""
    try:
        codec_validator(schema_name)(wire)
        fast = True
    except fastjsonschema.JsonSchemaValueException:
        fast = False
    return fast, reference_validator(schema_name).is_valid(wire)


@pytest.mark.parametrize("wire", doc_examples(), ids=lambda w: w["schema"])
def test_both_accept_the_documented_examples(wire: dict[str, Any]) -> None:
    assert verdicts(wire, schema_name_of(wire)) == (True, True)


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c.id)
def test_both_reject_the_bad_cases(case: BadCase) -> None:
    assert verdicts(case.wire(), case.schema_name) == (False, False)


@SETTINGS
@given(messages)
def test_both_accept_every_encoded_message(msg: Any) -> None:
    wire = orjson.loads(encode(msg))
    assert verdicts(wire, schema_name_of(wire)) == (True, True)


def no_trailing_newline(value: Any) -> bool:
    if isinstance(value, str):
        return not value.endswith("\n")
    if isinstance(value, list):
        return all(no_trailing_newline(v) for v in value)
    if isinstance(value, dict):
        return all(no_trailing_newline(k) and no_trailing_newline(v) for k, v in value.items())
    return True


EDGE_VALUES = [
    -1, 0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1,
    -(2**63), 1.0, 1.5, -0.0, 1e300, 1.8446744073709552e19, True, False, None, "", "x",
    "nan", "inf", "-inf", "NaN", "init", "exited", "restart", "in_process",
    "sha256:" + "0" * 64, "file:///x", "j/g1/s2", "heartbeat/1.0", "h" * 256, [], {},
    [1, 1], [0, 1], [[0]], {"a": 1},
]  # fmt: skip
replacements = st.sampled_from(EDGE_VALUES) | json_values.filter(no_trailing_newline)


def locations(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of every value inside a wire object (keys and array indices)."""
    found = [path] if path else []
    if isinstance(node, dict):
        for key, child in node.items():
            found += locations(child, (*path, key))
    elif isinstance(node, list):
        for index, child in enumerate(node):
            found += locations(child, (*path, index))
    return found


@SETTINGS
@given(messages, st.data())
def test_both_judge_every_mutation_alike(msg: Any, data: st.DataObject) -> None:
    wire = orjson.loads(encode(msg))
    schema_name = schema_name_of(wire)
    path = data.draw(st.sampled_from(locations(wire)), label="path")
    parent: Any = wire
    for step in path[:-1]:
        parent = parent[step]
    action = data.draw(st.sampled_from(["replace", "delete", "add"]), label="action")
    if action == "replace":
        parent[path[-1]] = data.draw(replacements, label="value")
    elif action == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[data.draw(st.sampled_from(["extra", "rank", "schema"]))] = data.draw(replacements)
    fast, reference = verdicts(wire, schema_name)
    assert fast == reference, (path, action, wire)
