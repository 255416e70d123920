"""Command-line options shared by the ``trainguard`` commands that read a bus."""

from __future__ import annotations

from typing import Annotated

import typer

from trainguard.agent.bus import DEFAULT_BUS_URL

__all__ = ["ConfiguredBus", "ConfiguredPrefix"]

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
        envvar="TRAINGUARD_TOPIC_PREFIX",
        help="Bus topic prefix; default: the config file's, else trainguard.",
    ),
]
"""``--topic-prefix P`` (``TRAINGUARD_TOPIC_PREFIX``); ``None``: the ``--config`` file's."""
