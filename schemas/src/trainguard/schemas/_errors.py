"""Errors of the wire contract: one base, subclasses named for the condition.

Every error says *where* (``field``: a JSON path such as ``cursor.epoch`` or ``shards[3].digest``,
or ``None`` when the message as a whole is at fault) and *why* (``reason``: short text). All are
permanent: the same bytes fail the same way every time, so a receiver dead-letters them instead
of retrying.
"""

from __future__ import annotations

__all__ = [
    "MessageTooLarge",
    "NestingTooDeep",
    "NotJSON",
    "NotUTF8",
    "SchemaError",
    "SchemaViolation",
    "UnexpectedMessage",
    "UnknownSchema",
]


class SchemaError(ValueError):
    """Base of every error the codec raises for bytes or messages that break the wire contract.

    Attributes:
        field: JSON path of the offending value (``"cursor.epoch"``, ``"shards[3].digest"``), or
            ``None`` when the message as a whole is at fault (too large, not JSON, ...).
        reason: short human-readable explanation, without the offending value.
    """

    def __init__(self, field: str | None, reason: str) -> None:
        # Both go to ``args`` so the error pickles and compares like a plain ValueError.
        super().__init__(field, reason)
        self.field = field
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.field if self.field is not None else '<message>'}: {self.reason}"


class MessageTooLarge(SchemaError):
    """The encoded message is longer than the byte limit (checked before parsing)."""


class NotUTF8(SchemaError):
    """The bytes are not valid UTF-8 (RFC 8259 section 8.1 requires UTF-8)."""


class NotJSON(SchemaError):
    """The bytes are UTF-8 but not one JSON document (syntax error, empty, BOM, trailing data)."""


class NestingTooDeep(SchemaError):
    """Arrays/objects are nested deeper than the parser's limit (orjson: 1024 levels) or, inside
    a free-form object such as ``metadata.hyperparameters``, deeper than the codec allows."""


class UnknownSchema(SchemaError):
    """The ``schema`` field is missing or malformed, or names a message type or major version
    this build does not know."""


class UnexpectedMessage(SchemaError):
    """A valid message type arrived where the caller expected another (``decode(expect=...)``)."""


class SchemaViolation(SchemaError):
    """The message breaks its JSON Schema: a missing or unknown property, a wrong type, a value
    out of range or not matching its pattern, or a value that has no JSON form (encoding)."""
