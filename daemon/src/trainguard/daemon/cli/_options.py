"""Command-line options shared by the ``trainguard`` commands that read a bus, and the hint
they print when a topic prefix holds nothing."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer

from trainguard.agent.bus import DEFAULT_BUS_URL, BusConfig, BusError, open_bus, topic_prefixes

__all__ = ["ConfiguredBus", "ConfiguredPrefix", "other_prefixes"]

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
