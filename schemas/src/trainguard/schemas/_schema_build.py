"""Build the JSON Schema files of the wire contract from the message dataclasses.

The dataclasses of :mod:`trainguard.schemas._messages` are the contract's one definition; this
module derives from them every file of ``json/`` (draft 2020-12):

* a message class (one with ``SCHEMA = "<type>/<major>.<minor>"``) gives
  ``<type>.v<major>.json``: an object with exactly the class's fields (``additionalProperties``
  false), its ``schema`` property first, the fields without a default ``required``, each
  property's default the wire form of the field's;
* the shared types (:class:`~trainguard.schemas._wire_types.Shared` aliases and the dataclasses
  whose ``WIRE`` is a ``Shared``) give ``common.v1.json``'s ``$defs``, in the order of
  :data:`~trainguard.schemas._messages.SHARED_TYPES`;
  a property of a shared type refers to it (``$ref``), a property holding another message
  (a restore's manifest) to that message's file.

A property's JSON type follows its Python type (``int``: integer, ``float``: number, ``str``:
string, ``Literal``: enum, ``tuple[X, ...]``: array of X, ``X | None``: X or null); its
description and further keywords come from the field's
:class:`~trainguard.schemas._wire_types.Wire` metadata, the class's description and cross-field
rules (``allOf``) from the class's ``WIRE``.

Run ``python -m trainguard.schemas._schema_build`` to rewrite the files after changing a
message, ``--check`` to compare only (exit 1 naming the files that differ);
``tests/contract/schemas/test_schema_build.py`` fails while a shipped file differs from what
this builds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Final, Literal

from trainguard.schemas._messages import MESSAGE_TYPES, SHARED_TYPES, NonFiniteAsString
from trainguard.schemas._schema_files import SCHEMA_BASE_URI
from trainguard.schemas._wire_form import plan_of
from trainguard.schemas._wire_types import JSONValue, Shared, Wire

__all__ = ["build_documents", "document_bytes", "main"]

_DRAFT: Final = "https://json-schema.org/draft/2020-12/schema"
_COMMON_FILE: Final = "common.v1"


_JSON_TYPES: Final[Mapping[type, str]] = {int: "integer", float: "number", str: "string"}

_UNIQUE_AFTER: Final = "unique_items_after"
"""A :class:`Wire` keyword of array fields: put ``items`` and ``uniqueItems`` in an ``allOf``,
in that order, so uniqueness is computed only over items already validated."""


def _shared_of(item: Any) -> Shared:
    """The :class:`Shared` definition of an entry of ``SHARED_TYPES``."""
    if isinstance(item, Shared):
        return item
    wire = getattr(item, "WIRE", None)
    if isinstance(wire, Shared):
        return wire
    shared = [m for m in getattr(item, "__metadata__", ()) if isinstance(m, Shared)]
    if len(shared) != 1:
        raise TypeError(f"{item!r} is not a shared type")
    return shared[0]


def _peel(hint: Any) -> tuple[Any, list[Any]]:
    """``hint`` without its ``Annotated`` layer (nested ones are flattened into one) and the
    layer's metadata, in order."""
    if typing.get_origin(hint) is typing.Annotated:
        return hint.__origin__, list(hint.__metadata__)
    return hint, []


class _Builder:
    """Builds schema nodes; ``common`` is the ``$ref`` prefix of shared definitions."""

    def __init__(self, common: str) -> None:
        self.common = common
        self.shared_names = {_shared_of(item).name for item in SHARED_TYPES}

    def ref(self, shared: Shared) -> dict[str, JSONValue]:
        if shared.name not in self.shared_names:
            raise TypeError(f"shared type {shared.name!r} is not listed in SHARED_TYPES")
        return {"$ref": f"{self.common}#/$defs/{shared.name}"}

    def value(self, hint: Any, metadata: list[Any]) -> dict[str, JSONValue]:
        """The schema of a non-null value of type ``hint`` (``Annotated`` layers removed)."""
        shared = [m for m in metadata if isinstance(m, Shared)]
        if shared:
            return self.ref(shared[-1])
        wire = getattr(hint, "WIRE", None)
        if isinstance(wire, Shared):
            return self.ref(wire)
        if isinstance(getattr(hint, "SCHEMA", None), str):
            return {"$ref": f"{plan_of(hint).schema_name}.json"}
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is Literal:
            return {"enum": list(args)}
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            item, item_metadata = _peel(args[0])
            return {"type": "array", "items": self.value(item, item_metadata)}
        if hint in _JSON_TYPES:
            return {"type": _JSON_TYPES[hint]}
        raise TypeError(f"no JSON Schema for {hint!r}")

    def property(self, hint: Any, field: dataclasses.Field[Any]) -> dict[str, JSONValue]:
        """The schema of a dataclass field's property (description, value, default)."""
        hint, metadata = _peel(hint)
        optional = False
        if typing.get_origin(hint) in (types.UnionType, typing.Union):
            args = typing.get_args(hint)
            if type(None) not in args or len(args) != 2:
                raise TypeError(f"{field.name}: only X | None unions have a JSON Schema")
            hint, inner = _peel(next(a for a in args if a is not type(None)))
            metadata = [*inner, *metadata]
            optional = True
        wires = [m for m in metadata if isinstance(m, Wire)]
        doc = next((w.doc for w in reversed(wires) if w.doc is not None), None)
        comment = next((w.comment for w in reversed(wires) if w.comment is not None), None)
        keywords: dict[str, JSONValue] = {}
        for wire in wires:
            keywords.update(wire.keywords)
        body = self.value(hint, metadata)
        unique_after = keywords.pop(_UNIQUE_AFTER, False)
        if unique_after:
            body = {"type": "array", "allOf": [{"items": body.pop("items")}, {"uniqueItems": True}]}
        if keywords and "type" not in body:
            raise TypeError(f"{field.name}: keywords {sorted(keywords)} need an inline type")
        body = {**body, **keywords}
        prop: dict[str, JSONValue] = {}
        if doc is not None:
            prop["description"] = doc
        if comment is not None:
            prop["$comment"] = comment
        if optional and NonFiniteAsString in metadata:
            # A number or null first: the common cases pass the first branch (see $comment).
            prop["anyOf"] = [{"type": ["number", "null"]}, body]
        elif optional and "type" in body:
            prop.update(body)
            prop["type"] = [body["type"], "null"]
        elif optional:
            prop["anyOf"] = [body, {"type": "null"}]
        else:
            prop.update(body)
        default = _default(field)
        if default is not dataclasses.MISSING:
            prop["default"] = default
        return prop

    def object(self, cls: type[Any], description: str) -> dict[str, JSONValue]:
        """An object with exactly ``cls``'s fields (its ``schema`` property first, if any)."""
        hints = typing.get_type_hints(cls, include_extras=True)
        properties: dict[str, JSONValue] = {}
        required: list[JSONValue] = []
        if isinstance(getattr(cls, "SCHEMA", None), str):
            plan = plan_of(cls)
            kind, major = plan.type_name, plan.major
            properties["schema"] = {
                "description": f"Message type and version: {kind}/{major}.<minor>.",
                "type": "string",
                "maxLength": 64,
                "pattern": f"^{kind}/{major}\\.[0-9]+$",
            }
            required.append("schema")
        for field in dataclasses.fields(cls):
            properties[field.name] = self.property(hints[field.name], field)
            if _default(field) is dataclasses.MISSING:
                required.append(field.name)
        node: dict[str, JSONValue] = {
            "description": description,
            "type": "object",
            "additionalProperties": False,
        }
        if required:
            node["required"] = required
        node["properties"] = properties
        return node


def _default(field: dataclasses.Field[Any]) -> Any:
    """The wire form of a field's default, or ``dataclasses.MISSING`` when it has none."""
    if field.default is not dataclasses.MISSING:
        return _plain(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return _plain(field.default_factory())
    return dataclasses.MISSING


def _plain(value: Any) -> Any:
    """A default value as JSON: dataclasses become objects, tuples arrays."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _common_document() -> dict[str, JSONValue]:
    builder = _Builder("")
    defs: dict[str, JSONValue] = {}
    for item in SHARED_TYPES:
        shared = _shared_of(item)
        if isinstance(item, type) and dataclasses.is_dataclass(item):
            defs[shared.name] = builder.object(item, shared.doc)
            continue
        node: dict[str, JSONValue] = {"description": shared.doc}
        if "anyOf" not in shared.keywords:
            hint, _ = _peel(item)
            if typing.get_origin(hint) is not None:  # Mapping[str, JSONValue]
                node["type"] = "object"
            else:
                node["type"] = _JSON_TYPES[hint]
        node.update(shared.keywords)
        defs[shared.name] = node
    return {
        "$schema": _DRAFT,
        "$id": f"{SCHEMA_BASE_URI}{_COMMON_FILE}.json",
        "title": "trainguard common definitions, version 1",
        "description": "Shared definitions referenced by every trainguard message schema of"
        " major version 1.",
        "$defs": defs,
    }


def _message_document(cls: type[Any]) -> tuple[str, dict[str, JSONValue]]:
    wire = cls.WIRE
    name = plan_of(cls).schema_name
    body = _Builder(f"{_COMMON_FILE}.json").object(cls, wire.doc)
    document: dict[str, JSONValue] = {
        "$schema": _DRAFT,
        "$id": f"{SCHEMA_BASE_URI}{name}.json",
        "title": cls.SCHEMA,
        **body,
    }
    document.update(wire.keywords)  # cross-field rules (allOf)
    return name, document


def build_documents() -> dict[str, dict[str, JSONValue]]:
    """Every schema file's document, by file name without ``.json`` (``"heartbeat.v1"``).

    Raises:
        TypeError: a field's type has no JSON Schema form, or names a shared type missing
            from ``SHARED_TYPES`` (naming the field or type).
    """
    documents = {_COMMON_FILE: _common_document()}
    for cls in MESSAGE_TYPES:
        name, document = _message_document(cls)
        documents[name] = document
    return documents


def document_bytes(document: Mapping[str, JSONValue]) -> bytes:
    """A schema document as its file holds it: JSON indented by 2, UTF-8, one final newline."""
    return (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode()


def _differing(folder: Path, documents: Mapping[str, Mapping[str, JSONValue]]) -> Iterable[str]:
    names = {p.stem for p in folder.glob("*.json")} | set(documents)
    for name in sorted(names):
        path = folder / f"{name}.json"
        if (
            name not in documents
            or not path.is_file()
            or path.read_bytes() != document_bytes(documents[name])
        ):
            yield name


def main(argv: list[str] | None = None) -> int:
    """``python -m trainguard.schemas._schema_build [--check] [--folder DIR]``: write (or with
    ``--check`` only compare) the schema files; returns the exit status (1: files differ)."""
    parser = argparse.ArgumentParser(prog="python -m trainguard.schemas._schema_build")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    parser.add_argument(
        "--folder",
        type=Path,
        default=Path(str(resources.files("trainguard.schemas") / "json")),
        help="the schema folder (default: the package's json/)",
    )
    args = parser.parse_args(argv)
    documents = build_documents()
    differing = list(_differing(args.folder, documents))
    if args.check:
        for name in differing:
            print(f"{args.folder / name}.json differs from the message classes", file=sys.stderr)
        return 1 if differing else 0
    for name in differing:
        path = args.folder / f"{name}.json"
        if name in documents:
            path.write_bytes(document_bytes(documents[name]))
            print(f"wrote {path}")
        else:
            path.unlink()
            print(f"removed {path} (no message class defines it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
