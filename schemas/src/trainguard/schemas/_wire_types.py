"""What the wire says about a value beyond its Python type: descriptions, bounds and shared types.

The message dataclasses (:mod:`trainguard.schemas._messages`) are the one definition of the
wire contract. Their fields' Python types give each property's JSON type, whether it is
required (no default), its default and its nesting; what only the wire states rides along as
``Annotated`` metadata:

* :class:`Wire`: a property's ``description`` and further JSON Schema keywords (bounds,
  patterns, a ``$comment``), e.g. ``Annotated[int | None, Wire("Process exit status.",
  minimum=0, maximum=255)]``.
* :class:`Shared`: a named type of ``common.v1.json``'s ``$defs`` (``job_id``, ``rank``, ...);
  a property of that type refers to it (``$ref``). The aliases below (``JobId``, ``Rank``, ...)
  are those types; the dataclasses of shared objects (``DataCursor``, ``Shard``, ...) carry
  theirs as ``WIRE``.

:mod:`trainguard.schemas._schema_build` turns the classes into the JSON Schema files, and a
test checks that the files shipped in ``json/`` are exactly what it builds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final, TypeAlias

__all__ = [
    "Count",
    "DaemonId",
    "Digest",
    "Generation",
    "Host",
    "JSONValue",
    "JobId",
    "JsonObject",
    "Kid",
    "Loss",
    "MessageText",
    "Pid",
    "Rank",
    "Reason",
    "Seed",
    "Seq",
    "Shared",
    "ShortText",
    "SnapshotId",
    "Step",
    "Timestamp",
    "Uri",
    "Wire",
    "WorldSize",
]

JSONValue: TypeAlias = "bool | int | float | str | list[JSONValue] | dict[str, JSONValue] | None"

_I63: Final = 2**63 - 1


class Wire:
    """``Annotated`` metadata: a property's JSON Schema facts that its Python type does not say.

    Args:
        doc: the property's ``description`` (``None``: the shared type's, or none).
        comment: the property's ``$comment`` (why the schema is written as it is).
        **keywords: further JSON Schema keywords of the property's value when it is not null
            (``minimum``, ``maxLength``, ``pattern``, ``maxItems``, ...), written as given.

    Several ``Wire`` of one field (an alias's and the field's own) merge, later ones winning.
    """

    __slots__ = ("comment", "doc", "keywords")

    def __init__(
        self, doc: str | None = None, /, *, comment: str | None = None, **keywords: Any
    ) -> None:
        self.doc = doc
        self.comment = comment
        self.keywords: Mapping[str, JSONValue] = keywords

    def __repr__(self) -> str:
        return f"Wire({self.doc!r}, comment={self.comment!r}, **{dict(self.keywords)!r})"


class Shared:
    """``Annotated`` metadata: the type is ``common.v1.json#/$defs/<name>``, described there.

    Args:
        name: the definition's name in ``$defs``.
        doc: its ``description``.
        **keywords: its JSON Schema keywords beyond the JSON type of the Python type
            (``minimum``, ``pattern``, ...; ``anyOf`` replaces the type).
    """

    __slots__ = ("doc", "keywords", "name")

    def __init__(self, name: str, doc: str, /, **keywords: Any) -> None:
        self.name = name
        self.doc = doc
        self.keywords: Mapping[str, JSONValue] = keywords

    def __repr__(self) -> str:
        return f"Shared({self.name!r})"


def _int63(name: str, doc: str) -> Shared:
    """A shared type of integers 0 .. 2**63 - 1 (a signed 64-bit count that cannot be negative:
    what Kafka, torch and most JSON readers hold exactly)."""
    return Shared(name, doc, minimum=0, maximum=_I63)


JobId: TypeAlias = Annotated[
    str, Shared("job_id", "The job's name; also the bus key.", pattern=r"^[A-Za-z0-9._-]{1,128}$")
]
Generation: TypeAlias = Annotated[
    int, _int63("generation", "Fencing generation, bumped by the daemon on every restore.")
]
Timestamp: TypeAlias = Annotated[
    int, _int63("ts", "Sender wall clock, nanoseconds since the Unix epoch.")
]
Seq: TypeAlias = Annotated[
    int, _int63("seq", "Per-sender counter, strictly increasing, for duplicate detection.")
]
Step: TypeAlias = Annotated[
    int, _int63("step", "Training step (count of completed optimizer steps).")
]
Count: TypeAlias = Annotated[int, _int63("count", "A non-negative count (samples, bytes, epochs).")]
Seed: TypeAlias = Annotated[
    int,
    Shared(
        "seed",
        "Seed of the epoch permutation: an unsigned 64-bit integer, as torch seeds are.",
        minimum=0,
        maximum=2**64 - 1,
    ),
]
Rank: TypeAlias = Annotated[
    int, Shared("rank", "Global rank of a worker.", minimum=0, maximum=65535)
]
WorldSize: TypeAlias = Annotated[
    int, Shared("world_size", "Number of ranks in the job.", minimum=1, maximum=65536)
]
Pid: TypeAlias = Annotated[
    int,
    Shared("pid", "Operating-system process id of the sender.", minimum=1, maximum=2**31 - 1),
]
Host: TypeAlias = Annotated[
    str, Shared("host", "Host name of the sender.", minLength=1, maxLength=255)
]
DaemonId: TypeAlias = Annotated[
    str,
    Shared(
        "daemon_id",
        "Identity of the daemon instance that issued a command.",
        minLength=1,
        maxLength=255,
    ),
]
Digest: TypeAlias = Annotated[
    str,
    Shared("digest", "SHA-256 of a file's bytes, lowercase hex.", pattern="^sha256:[0-9a-f]{64}$"),
]
Uri: TypeAlias = Annotated[
    str,
    Shared(
        "uri",
        "Where a file lives: an absolute URI with a scheme (file:///..., s3://...).",
        minLength=1,
        maxLength=4096,
        pattern="^[A-Za-z][A-Za-z0-9+.-]*:",
    ),
]
Reason: TypeAlias = Annotated[
    str,
    Shared(
        "reason", "Human-readable explanation naming the evidence.", minLength=1, maxLength=4096
    ),
]
MessageText: TypeAlias = Annotated[
    str, Shared("message", "Human-readable detail, possibly empty.", maxLength=4096)
]
ShortText: TypeAlias = Annotated[
    str, Shared("short_text", "A short identifier or version string.", maxLength=255)
]
Loss: Final = Shared(
    "loss",
    "A loss value: a JSON number, or one of the strings nan, inf, -inf for non-finite values"
    " (JSON has no literal for them).",
    anyOf=[{"type": "number"}, {"enum": ["nan", "inf", "-inf"]}],
)
"""The definition a non-finite-capable float (``MaybeNonFinite``) follows on the wire."""
SnapshotId: TypeAlias = Annotated[
    str,
    Shared(
        "snapshot_id",
        "<job_id>/g<generation>/s<step>.",
        pattern="^[A-Za-z0-9._-]{1,128}/g[0-9]{1,19}/s[0-9]{1,19}$",
    ),
]
JsonObject: TypeAlias = Annotated[
    Mapping[str, JSONValue],
    Shared("json_object", "A free-form JSON object.", maxProperties=1024),
]
Kid: TypeAlias = Annotated[
    str,
    Shared(
        "kid",
        "Key id: the first 8 bytes of the SHA-256 of the key (of the raw 32-byte public key"
        " for Ed25519, of the key bytes for HMAC), as 16 lowercase hex digits.",
        pattern="^[0-9a-f]{16}$",
    ),
]
