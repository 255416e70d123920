"""The packaged JSON Schema files and their compiled validators.

The files live in ``json/`` next to this module (package data): ``<type>.v<major>.json`` per
message type and major version, and ``common.v1.json`` with the shared ``$defs``. They are
draft 2020-12 documents; fastjsonschema (which implements drafts 4 to 7) compiles them because
they only use keywords both drafts define alike (``tests/contract/schemas`` checks it against
jsonschema's 2020-12 validator).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any, Final

import fastjsonschema
import orjson

from trainguard.schemas._errors import UnknownSchema

__all__ = ["SCHEMA_BASE_URI", "load_schema", "schema_path", "subschema_validator", "validator"]

SCHEMA_BASE_URI: Final = "https://trainguard.dev/schemas/"
"""Base of every schema file's ``$id``; ``$ref`` between the files resolve against it."""

_SCHEMA_NAME = re.compile(r"[a-z][a-z0-9-]*\.v[0-9]+")


def schema_path(name: str) -> Traversable:
    """Return the packaged JSON Schema file called ``name``.

    Args:
        name: file name without ``.json``: ``"<type>.v<major>"`` (``"heartbeat.v1"``) or
            ``"common.v1"`` for the shared definitions.

    Returns:
        The file inside the installed package (a :class:`pathlib.Path` for ordinary installs).

    Raises:
        UnknownSchema: no such schema file is packaged.
    """
    if _SCHEMA_NAME.fullmatch(name):
        path = resources.files("trainguard.schemas") / "json" / f"{name}.json"
        if path.is_file():
            return path
    raise UnknownSchema(None, f"no schema file named {name[:80]!r}")


def load_schema(name: str) -> dict[str, Any]:
    """Return the JSON Schema called ``name`` (see :func:`schema_path`) as a fresh dict.

    Raises:
        UnknownSchema: no such schema file is packaged.
    """
    schema: dict[str, Any] = orjson.loads(schema_path(name).read_bytes())
    return schema


def _bundle(node: Any, document: dict[str, Any], files: dict[str, dict[str, Any]]) -> Any:
    """Copy schema ``node`` (part of ``document``) with every ``$ref`` replaced by its target.

    A ``$ref`` is ``[<file>.json]#<JSON pointer>`` relative to our own files (all of which
    share one directory); siblings of a ``$ref`` are annotations only (checked by the tests),
    so dropping them keeps the meaning. Our schemas are not recursive, so this terminates.
    Inlining saves a Python call per referenced property in the compiled validator (about
    15% of validation time for a heartbeat). ``files`` caches parsed files by name.

    Raises:
        UnknownSchema: a ``$ref`` names a file that is not packaged (never fetched).
    """
    if isinstance(node, list):
        return [_bundle(item, document, files) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" not in node:
        return {key: _bundle(value, document, files) for key, value in node.items()}
    file, _, pointer = node["$ref"].partition("#")
    if file:
        name = file.removesuffix(".json")
        if name not in files:
            files[name] = load_schema(name)
        document = files[name]
    target: Any = document
    for token in pointer.split("/")[1:]:
        target = target[token.replace("~1", "/").replace("~0", "~")]  # RFC 6901 escapes
    return _bundle(target, document, files)


_APPLY_TO_ANY_TYPE: Final = frozenset({"enum", "const", "anyOf", "allOf", "oneOf", "not", "$ref"})
"""Keywords that constrain every instance whatever its type: a subschema holding one cannot
simply admit ``null`` by its ``type``."""


def _nullable(node: Any) -> Any:
    """Copy schema ``node`` with each ``{"anyOf": [X, {"type": "null"}]}`` (either order)
    written as ``X`` whose ``type`` admits ``"null"``, where ``X`` states a ``type`` and holds
    only keywords that apply to instances of their own type (``pattern``, ``required``, ...):
    the same instances validate. fastjsonschema tries ``anyOf`` branches in order and raises
    and catches an exception, building its definition dict, for each failed one: about a
    third of a checkpoint record's validation went to its null ``parent``. The annotations
    of the ``anyOf`` node (description, default) are kept."""
    if isinstance(node, list):
        return [_nullable(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable(value) for key, value in node.items()}
    branches = node.get("anyOf")
    if not (isinstance(branches, list) and len(branches) == 2 and {"type": "null"} in branches):
        return node
    [other] = [b for b in branches if b != {"type": "null"}] or [None]
    if not isinstance(other, dict) or "type" not in other or other.keys() & _APPLY_TO_ANY_TYPE:
        return node
    types = other["type"] if isinstance(other["type"], list) else [other["type"]]
    merged = {key: value for key, value in node.items() if key != "anyOf"}
    merged.update({key: value for key, value in other.items() if key not in merged})
    merged["type"] = [*types, "null"] if "null" not in types else types
    return merged


@functools.cache
def validator(name: str) -> Callable[[Any], Any]:
    """Compile (once) the fastjsonschema validator of schema file ``name``, refs inlined and
    nullable subschemas folded into their type (:func:`_nullable`)."""
    schema = load_schema(name)
    return fastjsonschema.compile(
        _nullable(_bundle(schema, schema, {})),
        use_default=False,  # defaults live in the dataclasses; validation must not mutate
        use_formats=False,
    )


@functools.cache
def subschema_validator(definition: bytes) -> Callable[[Any], Any]:
    """Compile (once) a validator for one subschema of a compiled schema, given as canonical
    JSON bytes (it has no ``$ref`` left). Used on error paths only; our schemas hold few."""
    return fastjsonschema.compile(orjson.loads(definition), use_default=False, use_formats=False)
