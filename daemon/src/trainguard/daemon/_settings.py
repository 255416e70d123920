"""The daemon's configuration: built once at the edge from a TOML file and overrides.

Precedence, highest first: explicit overrides (command-line options), the TOML file
(``trainguard daemon --config daemon.toml``), defaults. The file has up to three tables,
``[bus]`` (``BusConfig`` fields, with ``[bus.security]`` for Kafka TLS/SASL), ``[machine]``
(``MachineConfig`` fields, seconds as floats) and ``[service]`` (``DaemonConfig`` loop
settings); ``deploy/daemon.example.toml`` lists every key with its default.
"""

from __future__ import annotations

import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from trainguard.agent.bus import DEFAULT_BUS_URL, BusConfig, KafkaSecurity, TopicSpec
from trainguard.daemon._config import MachineConfig

__all__ = ["DaemonConfig", "load_daemon_config"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonConfig:
    """Everything the daemon service needs.

    Attributes:
        bus: how to reach the bus.
        machine: thresholds of the state machine (and ``daemon_id``).
        group_id: consumer group of the daemon instances on ``events``; every partition
            (hence every job) has exactly one owner in the group. ``None``: the bus's topic
            prefix followed by ``daemon`` (``trainguard.daemon``), so deployments that share
            a broker under different prefixes never share a group.
        poll_s: longest wait for new events before checking the clock for due ticks, seconds.
        tick_interval_s: least time between two ticks the daemon writes for one job, seconds.
        commit_interval_s: longest time between commits of consumed positions, seconds.
            Positions are also committed right after decisions were acted on.
        metrics_host: address ``trainguard daemon`` serves ``/metrics`` and ``/healthz`` on
            (``0.0.0.0`` or ``::`` for every interface).
        metrics_port: TCP port of that server; 0 picks a free port (logged as ``metrics
            server listening``), -1 serves nothing. 9464 by default; change it where another
            exporter (OpenTelemetry's Prometheus exporter defaults to 9464 too) or a second
            daemon on the host already listens there.

    Raises:
        ValueError: ``metrics_port`` outside -1..65535.
    """

    bus: BusConfig
    machine: MachineConfig
    group_id: str | None = None
    poll_s: float = 0.05
    tick_interval_s: float = 0.25
    commit_interval_s: float = 1.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464

    def __post_init__(self) -> None:
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(
                f"metrics_port must be a TCP port, 0 (any free port) or -1 (off), "
                f"not {self.metrics_port}"
            )

    @property
    def group(self) -> str:
        """The consumer group id in effect (``group_id`` or the prefix-derived default)."""
        return self.group_id or f"{self.bus.prefix}daemon"


def _default_daemon_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def load_daemon_config(
    path: Path | None = None,
    *,
    bus_url: str | None = None,
    machine: Mapping[str, Any] | None = None,
    **service: Any,
) -> DaemonConfig:
    """Build a :class:`DaemonConfig` from an optional TOML file and overrides.

    Args:
        path: TOML file with ``[bus]``, ``[machine]`` and ``[service]`` tables, or ``None``.
        bus_url: overrides ``[bus] url``.
        machine: overrides of ``[machine]`` keys (``MachineConfig`` field names).
        **service: overrides of ``DaemonConfig`` fields (``group_id``, ``poll_s``, ...).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: an unknown key, a malformed file (``tomllib.TOMLDecodeError`` is a
            ``ValueError``), or a value ``MachineConfig`` refuses.
    """
    data: dict[str, Any] = {}
    if path is not None:
        with path.open("rb") as f:
            data = tomllib.load(f)
    unknown = data.keys() - {"bus", "machine", "service"}
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {sorted(unknown)}")
    bus_table = dict(data.get("bus", {}))
    if bus_url is not None:
        bus_table["url"] = bus_url
    bus_table.setdefault("url", DEFAULT_BUS_URL)
    if isinstance(bus_table.get("security"), Mapping):
        bus_table["security"] = KafkaSecurity(**bus_table["security"])
    if isinstance(bus_table.get("topics"), list):
        bus_table["topics"] = tuple(TopicSpec(**t) for t in bus_table["topics"])
    machine_table = {
        "daemon_id": _default_daemon_id(),
        **data.get("machine", {}),
        **(machine or {}),
    }
    service_table = {
        **data.get("service", {}),
        **{k: v for k, v in service.items() if v is not None},
    }
    _check_keys("bus", bus_table, BusConfig)
    _check_keys("machine", machine_table, MachineConfig)
    _check_keys("service", service_table, DaemonConfig)
    return DaemonConfig(
        bus=BusConfig(**bus_table),
        machine=MachineConfig(**machine_table),
        **service_table,
    )


def _check_keys(table: str, values: Mapping[str, Any], cls: type) -> None:
    known = {f.name for f in fields(cls) if f.init}
    unknown = values.keys() - known
    if unknown:
        raise ValueError(f"[{table}]: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
