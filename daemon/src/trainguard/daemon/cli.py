"""The ``trainguard`` command line (typer).

Each command imports what it needs when it runs, so ``trainguard --help`` stays fast and a
node that only supervises workers never imports the daemon's service code.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import version as _dist_version
from typing import Annotated

import typer

from trainguard.agent.bus import BusError

__all__ = ["app", "main"]

app = typer.Typer(
    name="trainguard",
    help="Fault recovery for distributed PyTorch training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bus_app = typer.Typer(help="Inspect the message bus.", no_args_is_help=True)
app.add_typer(bus_app, name="bus")

BusURL = Annotated[
    str,
    typer.Option(
        "--bus",
        envvar="TRAINGUARD_BUS",
        help="sqlite:///path/bus.db (embedded, one machine) or kafka://host:port[,host:port].",
    ),
]


@app.command()
def version() -> None:
    """Print trainguard's version."""
    typer.echo(_dist_version("trainguard"))


@bus_app.command("check")
def bus_check(
    bus: BusURL = "sqlite:///trainguard-bus.db",
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the bus.")] = 15.0,
) -> None:
    """Connect to the bus, create missing topics, and print each topic's end offsets."""
    from trainguard.agent.bus import BusConfig, open_bus

    async def _check() -> None:
        config = BusConfig(url=bus, connect_timeout_s=timeout)
        async with open_bus(config) as b:
            for spec in config.topics:
                ends = await b.end_offsets(spec.name)
                total = sum(ends.values())
                policy = "compact" if spec.compacted else "delete"
                typer.echo(f"{spec.name:12} {len(ends):3} partitions  {policy:7}  {total} records")

    try:
        asyncio.run(_check())
    except BusError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


def main() -> None:
    """Entry point of the ``trainguard`` console script."""
    app()
