"""The daemon's configuration: built once at the edge from a TOML file and overrides.

Precedence, highest first: explicit overrides (command-line options), the TOML file
(``trainguard daemon --config daemon.toml``), defaults; the ``TRAINGUARD_KAFKA_*`` variables
beat ``[bus.security]`` key by key. The file has up to four tables,
``[bus]`` (``BusConfig`` fields, with ``[bus.security]`` for Kafka TLS/SASL), ``[machine]``
(``MachineConfig`` fields, seconds as floats), ``[service]`` (``DaemonConfig`` loop
settings) and ``[security]`` (:class:`SecurityConfig`: keys and authentication);
``deploy/daemon.example.toml`` lists every key with its default.
"""

from __future__ import annotations

import math
import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from trainguard.agent.bus import DEFAULT_BUS_URL, BusConfig, TopicSpec, load_kafka_security
from trainguard.daemon._config import MachineConfig

__all__ = ["DaemonConfig", "SecurityConfig", "load_daemon_config"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SecurityConfig:
    """Keys and authentication (``[security]``; ``docs/security.md``).

    Attributes:
        keys_dir: the key directory (``trainguard daemon --keys``, ``TRAINGUARD_KEYS``); it
            must hold a current signing and data key. ``None``: ``~/.config/trainguard/keys``
            if it holds them, else the daemon runs without keys: commands and manifests go
            out unsigned, events are taken unauthenticated, no state snapshot is written.
            That is insecure, and what ``trainguard demo`` and first runs do.
        require_auth: refuse to start without keys, and refuse every event that does not
            carry a valid MAC, also of jobs without an event key (``unknown_job``). Without
            it, the events of a job that has an event key must still carry a valid MAC;
            those of jobs without one are taken unauthenticated.
        key_reload_s: seconds between two reloads of the key directory (rotations and
            retirements take effect then), > 0.

    Raises:
        ValueError: ``key_reload_s`` is not a positive finite number.
    """

    keys_dir: Path | None = None
    require_auth: bool = False
    key_reload_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.key_reload_s < math.inf:
            raise ValueError(f"key_reload_s must be > 0 seconds, not {self.key_reload_s!r}")


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
        snapshot_interval_s: seconds between two rounds of job-state snapshots (signed and
            encrypted, on ``snapshots``; also written on a clean stop), from which a restarted
            daemon rebuilds instead of folding the whole log; 0 turns snapshots off. They are
            off without keys anyway.
        security: keys and authentication (:class:`SecurityConfig`).

    Raises:
        ValueError: ``metrics_port`` outside -1..65535, ``snapshot_interval_s`` negative or
            not finite.
    """

    bus: BusConfig
    machine: MachineConfig
    group_id: str | None = None
    poll_s: float = 0.05
    tick_interval_s: float = 0.25
    commit_interval_s: float = 1.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464
    snapshot_interval_s: float = 60.0
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.snapshot_interval_s < math.inf:
            raise ValueError(
                f"snapshot_interval_s must be a finite number of seconds >= 0 (0: off), "
                f"not {self.snapshot_interval_s!r}"
            )
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
    env: Mapping[str, str] | None = None,
    security_overrides: Mapping[str, Any] | None = None,
    **service: Any,
) -> DaemonConfig:
    """Build a :class:`DaemonConfig` from an optional TOML file and overrides.

    Args:
        path: TOML file with ``[bus]``, ``[machine]`` and ``[service]`` tables, or ``None``.
        bus_url: overrides ``[bus] url``.
        machine: overrides of ``[machine]`` keys (``MachineConfig`` field names).
        env: environment for the ``TRAINGUARD_KAFKA_*`` security variables, which beat
            ``[bus.security]`` key by key (:func:`~trainguard.agent.bus.load_kafka_security`);
            ``None`` reads ``os.environ``.
        security_overrides: overrides of ``[security]`` keys (``SecurityConfig`` field names;
            ``None`` values are ignored).
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
    unknown = data.keys() - {"bus", "machine", "service", "security"}
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {sorted(unknown)}")
    bus_table = dict(data.get("bus", {}))
    if bus_url is not None:
        bus_table["url"] = bus_url
    bus_table.setdefault("url", DEFAULT_BUS_URL)
    security = bus_table.get("security")
    if security is not None and not isinstance(security, Mapping):
        raise ValueError(f"{path}: [bus] security must be a table ([bus.security])")
    bus_table["security"] = load_kafka_security(security, env)
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
    # ``create`` says whether a command may create the embedded bus: the daemon always may.
    _check_keys("bus", bus_table, BusConfig, internal={"create"})
    _check_keys("machine", machine_table, MachineConfig)
    security_table = {
        **data.get("security", {}),
        **{k: v for k, v in (security_overrides or {}).items() if v is not None},
    }
    _check_keys("service", service_table, DaemonConfig)
    _check_keys("security", security_table, SecurityConfig)
    if security_table.get("keys_dir") is not None:
        security_table["keys_dir"] = Path(security_table["keys_dir"]).expanduser()
    return DaemonConfig(
        bus=BusConfig(**bus_table),
        machine=MachineConfig(**machine_table),
        security=SecurityConfig(**security_table),
        **service_table,
    )


def _check_keys(
    table: str,
    values: Mapping[str, Any],
    cls: type,
    internal: frozenset[str] | set[str] = frozenset(),
) -> None:
    known = {f.name for f in fields(cls) if f.init} - internal
    unknown = values.keys() - known
    if unknown:
        raise ValueError(f"[{table}]: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
