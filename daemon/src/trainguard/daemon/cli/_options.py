"""Command-line options shared by the ``trainguard`` commands that read a bus, the hint they
print when a topic prefix holds nothing, and how they print: the console of their tables
(:func:`console`) and the line of an error of the file system (:func:`os_failure`).

Two families: the ``Configured*`` options of commands that read the daemon's config file
(``None``: the file's value), and :data:`BusOption` and :data:`PrefixOption` of commands that
take the bus from the command line alone (their defaults, :data:`DEFAULT_BUS_URL` and
:data:`DEFAULT_PREFIX`, stand in the signatures).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from trainguard.agent.bus import DEFAULT_BUS_URL, BusConfig, BusError, open_bus, topic_prefixes

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "DEFAULT_PREFIX",
    "BusOption",
    "ConfigFile",
    "ConfiguredBus",
    "ConfiguredPrefix",
    "ExportFile",
    "PrefixOption",
    "console",
    "given_path",
    "os_failure",
    "other_prefixes",
]


def given_path(text: str) -> Path:
    """The parser of the ``--keys`` and ``--config`` options: the path as given, where an empty
    one is a usage error (exit 2). ``Path("")`` is the working folder: ``--keys "$DIR"`` with
    ``DIR`` unset would otherwise read (or, for ``keys init``, fill) the folder the command runs
    in. An empty ``TRAINGUARD_KEYS`` counts as unset, as it does for the agents."""
    if not text.strip():
        raise typer.BadParameter("an empty path names no file or folder; leave the option out")
    return Path(text)


ConfiguredBus = Annotated[
    str | None,
    typer.Option(
        "--bus",
        envvar="TRAINGUARD_BUS",
        help=f"Bus URL; default: the config file's, else {DEFAULT_BUS_URL}.",
    ),
]
"""``--bus URL`` (``TRAINGUARD_BUS``); ``None``: the ``--config`` file's URL, else the default."""

ConfiguredPrefix = Annotated[
    str | None,
    typer.Option(
        "--topic-prefix",
        "--prefix",
        envvar="TRAINGUARD_TOPIC_PREFIX",
        help="Bus topic prefix, dot included (topics are named e.g. 'trainguard.events'); "
        "default: the config file's, else 'trainguard.'",
    ),
]
"""``--topic-prefix P`` or ``--prefix P`` (``TRAINGUARD_TOPIC_PREFIX``, as every command reading
the bus takes it); ``None``: the ``--config`` file's."""

DEFAULT_PREFIX = "trainguard."
"""The topic prefix of a command without a config file (as ``BusConfig``'s)."""

BusOption = Annotated[
    str,
    typer.Option(
        "--bus",
        envvar="TRAINGUARD_BUS",
        help="sqlite:///path/bus.db (embedded, one machine) or kafka://host:port[,host:port].",
    ),
]
"""``--bus URL`` (``TRAINGUARD_BUS``) of a command without a config file."""

PrefixOption = Annotated[
    str,
    typer.Option(
        "--topic-prefix", "--prefix", envvar="TRAINGUARD_TOPIC_PREFIX", help="Bus topic prefix."
    ),
]
"""``--topic-prefix P`` or ``--prefix P`` (``TRAINGUARD_TOPIC_PREFIX``) of a command without a
config file."""

ConfigFile = Annotated[
    Path | None,
    typer.Option(
        "--config",
        parser=given_path,
        help="The daemon's TOML file, for its \\[bus] table (URL, topic prefix, Kafka "
        "security; TRAINGUARD_KAFKA_* variables override it).",
    ),
]
"""``--config FILE`` of a command that reads only the file's bus settings (and, where it takes
keys, its ``[security]`` key directory)."""

ExportFile = Annotated[
    Path | None,
    typer.Option("--file", help="Read the job from an export file (trainguard export) instead."),
]
"""``--file FILE``: a job record written by ``trainguard export``, read instead of the bus."""


PIPE_WIDTH = 1000
"""Columns of a command's output when it is not a terminal and ``COLUMNS`` is unset: wide
enough that ids, digests and URIs are never folded or cropped for the tools and files reading
it (rich would assume 80)."""


def console() -> Console:
    """The console a command prints its tables to: the terminal's width, ``COLUMNS`` when set,
    else :data:`PIPE_WIDTH` columns; no highlighting of numbers and paths."""
    from rich.console import Console

    out = Console(highlight=False)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out.width = PIPE_WIDTH
    return out


def os_failure(exc: OSError, action: str, path: str | os.PathLike[str] | None = None) -> str:
    """One line for ``exc``, raised while doing ``action`` to ``path``, for a command's error
    message: ``cannot read the config file x.toml: No such file or directory``, not Python's
    ``[Errno 2] No such file or directory: 'x.toml'``.

    The path the system refused is added in parentheses when it is another one (a file inside
    the folder named, a temporary file beside it); without ``path`` it stands in its place. An
    ``OSError`` raised with a message of its own (no error number) is that message.
    """
    if exc.strerror is None:
        return str(exc)
    refused = None if exc.filename is None else os.fsdecode(exc.filename)
    named = refused if path is None else os.fspath(path)
    text = f"cannot {action}" + ("" if named is None else f" {named}") + f": {exc.strerror}"
    if refused is not None and refused != named:
        text += f" ({refused})"
    return text


async def other_prefixes(config: BusConfig) -> str:
    """Where else the bus of ``config`` holds trainguard topics, for a read that found nothing
    under ``config.prefix``: ``"found topics under 'a.', 'b.'"``, ``"no other topic prefix on
    this bus"``, or why the bus could not be listed. Opens the bus without creating anything
    (``create=False``); never raises :class:`~trainguard.agent.bus.BusError`."""
    try:
        async with open_bus(replace(config, create=False, client_id="trainguard-prefixes")) as bus:
            names = await bus.topic_names()
    except BusError as exc:
        return f"could not list the bus's topics ({exc})"
    found = [p for p in topic_prefixes(names) if p != config.prefix]
    if not found:
        return "no other topic prefix on this bus"
    return f"found topics under {', '.join(map(repr, found))} (--topic-prefix)"
