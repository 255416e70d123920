"""Helpers of the deployment tests: the repository's deploy/ folder and what the code says."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import typer
import typer.main

from trainguard.daemon.cli import app

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
SOURCES = (REPO / "agent" / "src", REPO / "daemon" / "src", REPO / "schemas" / "src")


def parse_cli(command: str, args: Sequence[str]) -> dict[str, Any]:
    """The parameters of ``trainguard COMMAND ARGS`` as the command line parses them, without
    running the command.

    Raises:
        UsageError (typer's click): an option the command does not take, a bad value, a
            missing one.
    """
    group = typer.main.get_command(app)
    sub = group.commands[command]  # type: ignore[attr-defined]
    params: dict[str, Any] = sub.make_context(command, list(args)).params
    return params


def trainguard_variables(text: str) -> set[str]:
    """Every ``TRAINGUARD_*`` variable named in ``text``."""
    return set(re.findall(r"\bTRAINGUARD_[A-Z_]+\b", text))


def variables_read_by_the_code() -> set[str]:
    """Every ``TRAINGUARD_*`` name the code spells out (the Kafka ones from their table)."""
    from trainguard.agent.bus._config import SECURITY_ENVIRONMENT

    names = set(SECURITY_ENVIRONMENT.values())
    for root in SOURCES:
        for path in root.rglob("*.py"):
            names |= {m for m in re.findall(r"\"(TRAINGUARD_[A-Z_]+)\"", path.read_text())}
    return names
