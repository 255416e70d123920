"""What trainguard.schemas exports: every message class and every error class (that the
façade exports exactly its public names is checked for every package in tests/meta)."""

from __future__ import annotations

import trainguard.schemas as facade
from trainguard.schemas import MESSAGE_TYPES, SchemaError


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
