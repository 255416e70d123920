"""Type checks of configuration-file tables against the dataclass they build.

TOML values arrive untyped (``metrics_port = "abc"`` parses fine), and dataclasses do not
check their annotations, so every table of the daemon's file goes through :func:`build`: it
checks each value against the field's annotation (read with :func:`typing.get_type_hints`),
converts where the file's type differs from the field's (a string to a ``Path``, an int to a
float, an array of tables to a tuple of dataclasses, a table to a read-only mapping), builds
the object and names the table and key in every error, including the range errors the
dataclass's ``__post_init__`` raises. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

__all__ = ["build", "check"]

_T = TypeVar("_T")

# What a TOML value of each Python type is called in messages (tomllib's types, plus None
# for overrides).
_TOML_KINDS = {
    bool: "a boolean",
    int: "an integer",
    float: "a float",
    str: "a string",
    list: "an array",
    dict: "a table",
    type(None): "nothing",
}

# Units by name suffix, as the configuration's fields are named (STYLE.md: units in names).
_UNITS = {"_s": "seconds", "_bytes": "bytes", "_steps": "steps", "_ms": "milliseconds"}

_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60


class _Mismatch(Exception):
    """A value does not fit an annotation; ``args[0]`` says what was expected."""


def build(where: str, cls: type[_T], values: Mapping[str, Any], **built: Any) -> _T:
    """Check ``values`` against ``cls``'s field annotations and build a ``cls``.

    Args:
        where: names the table in messages, e.g. ``"daemon.toml: [machine]"``.
        cls: a dataclass whose ``init`` fields ``values`` may set.
        values: field name -> value as read from TOML (or given as an override).
        **built: further fields passed through unchecked (objects built elsewhere, such as
            ``DaemonConfig.bus``).

    Returns:
        ``cls(**checked_values, **built)``.

    Raises:
        ValueError: a key that is not an ``init`` field of ``cls`` (or is one of ``built``),
            a value of the wrong type (``"<where> <key>: expected <what>, got <value> (<its
            type>)"``), or a value ``cls`` refuses (its message, prefixed with ``where``).
    """
    hints = typing.get_type_hints(cls)
    # ``type[_T]`` cannot say "a dataclass"; ``fields`` raises TypeError for any other class.
    init = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    known = set(init) - built.keys()
    unknown = values.keys() - known
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    checked = {
        key: check(f"{where} {key}", hints[key], value, key) for key, value in values.items()
    }
    try:
        return cls(**checked, **built)
    except ValueError as exc:
        raise ValueError(f"{where} {exc}") from None


def check(where: str, hint: Any, value: Any, name: str = "") -> Any:
    """``value`` checked against the annotation ``hint``, converted as :func:`build` does.

    Args:
        where: names the value in messages (``"daemon.toml: [machine] keep_snapshots"``).
        hint: a type annotation (evaluated, not a string).
        value: the value as read from TOML.
        name: the field's name, whose suffix (``_s``, ``_bytes``...) gives the unit named in
            messages.

    Raises:
        ValueError: ``"<where>: expected <what>, got <value> (<its TOML type>)"``.
        TypeError: ``hint`` is an annotation this module has no check for (a programming
            error, not a configuration one).
    """
    try:
        return _convert(where, hint, value, name)
    except _Mismatch as exc:
        kind = _TOML_KINDS.get(type(value), f"a {type(value).__name__}")
        raise ValueError(
            f"{where}: expected {exc.args[0]}, got {_repr.repr(value)} ({kind})"
        ) from None


def _convert(where: str, hint: Any, value: Any, name: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if value is None and len(options) < len(args):
            return None
        if len(options) != 1:
            raise TypeError(f"no configuration check for {hint}")  # a programming error
        return _convert(where, options[0], value, name)
    if origin is Literal:
        # ``type(...) is``: keeps ``1`` from matching ``True`` and the reverse.
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise _Mismatch("one of " + ", ".join(repr(a) for a in args))
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch("true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch(f"a whole number{_unit(name)}")
    if hint is float:
        return _float(value, name)
    if hint is str:
        if isinstance(value, str):
            return value
        raise _Mismatch("a string")
    if hint is Path:
        if isinstance(value, str | Path):
            return Path(value)
        raise _Mismatch("a path (a string)")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, list | tuple):
            raise _Mismatch("an array")
        return tuple(check(f"{where}[{i}]", args[0], item, name) for i, item in enumerate(value))
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise _Mismatch(f"a table of {hint.__name__} fields")
        return build(where, hint, value)
    if origin is Mapping or hint is Mapping:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise _Mismatch("a table")
        return types.MappingProxyType(dict(value))
    raise TypeError(f"no configuration check for {hint}")  # a programming error


def _float(value: Any, name: str) -> float:
    """``value`` as a finite float: an int or a float, never a bool (TOML's ``inf``/``nan``
    are refused here, so that no field needs to think of them)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int beyond the float range
            number = math.inf
        if math.isfinite(number):
            return number
        raise _Mismatch(f"a finite number{_unit(name)}")
    raise _Mismatch(f"a number{_unit(name)}")


def _unit(name: str) -> str:
    return next((f" of {unit}" for suffix, unit in _UNITS.items() if name.endswith(suffix)), "")
