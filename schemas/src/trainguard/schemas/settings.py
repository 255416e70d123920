"""trainguard's one settings mechanism: values checked against the dataclass they build.

Every party's settings are a frozen dataclass (the daemon's ``DaemonConfig`` and its tables,
the bus's ``BusConfig``, the agent's ``AgentConfig``); this module fills one from where its
values come, with the same checks and the same error messages:

* a TOML table or keyword overrides (:func:`build`): TOML values arrive untyped
  (``metrics_port = "abc"`` parses fine), and dataclasses do not check their annotations, so
  each value is checked against the field's annotation (read with
  :func:`typing.get_type_hints`) and converted where the file's type differs from the
  field's (a string to a ``Path``, an int to a float, an array of tables to a tuple of
  dataclasses, a table to a read-only mapping);
* environment variables (:func:`from_environment`): each variable's text is parsed by the
  annotation of the field it sets (a whole number, a finite number, ``true``/``false``, a
  path, one of a ``Literal``'s strings) and then checked the same way.

Errors name the table and key, or the variable, including the range errors the dataclass's
``__post_init__`` raises. Pure: no I/O (the caller passes the environment), except
:func:`expand_user`, which reads the home directory of the user a path names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import reprlib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

__all__ = ["build", "check", "expand_user", "from_environment", "parse_text"]

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


def expand_user(path: str | os.PathLike[str]) -> Path:
    """``path`` with a leading ``~`` or ``~user`` replaced by that home directory
    (:meth:`pathlib.Path.expanduser`); any other path unchanged.

    Raises:
        ValueError: ``~user`` names no user of this machine, or ``~`` stands first and no home
            directory is known (``HOME`` unset and no password entry): ``"cannot expand
            '<path>': no home directory for '<~part>'"``.
    """
    try:
        return Path(path).expanduser()
    except RuntimeError:  # pathlib's "Could not determine home directory."
        head = Path(path).parts[0]
        raise ValueError(
            f"cannot expand {os.fspath(path)!r}: no home directory for {head!r}"
        ) from None


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


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def from_environment(
    cls: type, env: Mapping[str, str], variables: Mapping[str, tuple[str, ...]]
) -> dict[str, Any]:
    """The values the environment sets for ``cls``'s fields, parsed by their annotations.

    Args:
        cls: the dataclass the values are for.
        env: the environment (``os.environ`` or a test's mapping).
        variables: field name -> the variables that set it, highest precedence first. An
            empty variable counts as unset.

    Returns:
        field name -> value (:func:`parse_text` of the first set variable), for the fields
        some variable sets; ready for :func:`build`.

    Raises:
        ValueError: ``"<VARIABLE> (<field>): expected <what>, got <text> (a string)"``.
    """
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, names in variables.items():
        variable = next((v for v in names if env.get(v)), None)
        if variable is not None:
            values[name] = parse_text(f"{variable} ({name})", hints[name], env[variable], name)
    return values


def parse_text(where: str, hint: Any, text: str, name: str = "") -> Any:
    """``text`` (an environment variable's value) as a value of the annotation ``hint``.

    A whole number for ``int``, a finite number for ``float``, ``1``/``true``/``yes``/``on``
    or ``0``/``false``/``no``/``off`` (any case) for ``bool``, the text itself for ``str``,
    ``Path`` and ``Literal`` strings; ``X | None`` parses as ``X``. The result is then checked
    as :func:`check` does.

    Raises:
        ValueError: ``"<where>: expected <what>, got <text> (a string)"``.
    """
    options = [a for a in typing.get_args(hint) if a is not type(None)]
    target = options[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
    value: Any = text
    if target is bool and text.strip().lower() in _TRUE | _FALSE:
        value = text.strip().lower() in _TRUE
    elif target is int:
        with contextlib.suppress(ValueError):
            value = int(text.strip())
    elif target is float:
        with contextlib.suppress(ValueError):
            value = float(text.strip())
    return check(where, hint, value, name)
