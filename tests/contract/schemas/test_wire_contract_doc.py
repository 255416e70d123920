"""docs/wire-contract.md shows one valid JSON example (at least) for every message type."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.support.schemas import doc_examples, same_message
from trainguard.schemas import MESSAGE_TYPES, decode, encode


@pytest.mark.parametrize("wire", doc_examples(), ids=lambda w: w["schema"])
def test_every_documented_example_decodes_and_survives_a_round_trip(wire: dict[str, Any]) -> None:
    msg = decode(orjson.dumps(wire))
    assert wire["schema"] == msg.SCHEMA
    assert same_message(decode(encode(msg)), msg)


def test_every_message_type_is_documented_with_an_example() -> None:
    documented = {type(decode(orjson.dumps(wire))) for wire in doc_examples()}
    assert documented == set(MESSAGE_TYPES)
