"""The public surface of trainguard.schemas is exactly its __all__."""

from __future__ import annotations

import types

import trainguard.schemas as facade
from trainguard.schemas import MESSAGE_TYPES, SchemaError


def test_all_is_exactly_the_public_names() -> None:
    public = {
        name
        for name, value in vars(facade).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert set(facade.__all__) == public
    assert len(facade.__all__) == len(set(facade.__all__))


def test_every_message_class_and_error_class_is_exported() -> None:
    for cls in MESSAGE_TYPES:
        assert cls.__name__ in facade.__all__
    errors = {
        name
        for name in facade.__all__
        if isinstance(getattr(facade, name), type)
        and issubclass(getattr(facade, name), SchemaError)
    }
    assert errors == {
        "SchemaError",
        "MessageTooLarge",
        "NotUTF8",
        "NotJSON",
        "NestingTooDeep",
        "UnknownSchema",
        "UnexpectedMessage",
        "SchemaViolation",
        "Unauthenticated",
    }
