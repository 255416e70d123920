"""The daemon's configuration: built once at the edge from a TOML file and overrides.

Precedence, highest first: explicit overrides (command-line options), the TOML file
(``trainguard daemon --config daemon.toml``), defaults; the ``TRAINGUARD_KAFKA_*`` variables
beat ``[bus.security]`` key by key. The file has up to five tables,
``[bus]`` (``BusConfig`` fields, with ``[bus.security]`` for Kafka TLS/SASL), ``[machine]``
(``MachineConfig`` fields, seconds as floats), ``[service]`` (``DaemonConfig`` loop
settings), ``[security]`` (:class:`SecurityConfig`: keys and authentication) and
``[retention]`` (:class:`RetentionConfig`: the daemon's own pruning of checkpoints);
``deploy/daemon.example.toml`` lists every key with its default. Every value is checked
against its field's type and range (:mod:`trainguard.schemas.settings`); errors name the
file, the table and the key.
"""

from __future__ import annotations

import math
import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trainguard.agent.bus import DEFAULT_BUS_URL, BusConfig, load_kafka_security, parse_bus_url
from trainguard.daemon.core import MachineConfig
from trainguard.schemas.settings import build, check, expand_user

__all__ = [
    "MAX_COMMIT_INTERVAL_S",
    "DaemonConfig",
    "RetentionConfig",
    "SecurityConfig",
    "load_daemon_config",
]

MAX_COMMIT_INTERVAL_S = 10.0
"""Longest ``[service] commit_interval_s``: a third of the daemon's Kafka transaction timeout
(30 s), leaving room for a slow poll and fold before the broker would abort the transaction."""


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
class RetentionConfig:
    """The daemon's own pruning of checkpoint step folders (``[retention]``;
    ``docs/catalog.md``, "Retention by the daemon"): what ``trainguard checkpoints prune``
    does, every ``interval_s``, for the jobs of the partitions this instance owns.

    Attributes:
        enabled: prune at all. Off by default: pruning deletes files, and a daemon upgraded
            in place must not start deleting checkpoints its operators meant to keep (a
            ``--keep-every`` they give the command by hand, say) without being told to.
        interval_s: seconds between the end of one prune and the start of the next (the
            first comes one interval after the daemon is ready), > 0.
        keep_last: snapshots kept per job, the newest of its timeline, >= 1; ``None``: the
            machine's ``keep_snapshots`` (a running job keeps those anyway, as its possible
            restore targets).
        keep_every_steps: also keep every snapshot whose step is a multiple of this, >= 1;
            ``None``: none.
        delete_parents: also delete a snapshot another job started from, once that job has
            finished.

    Raises:
        ValueError: ``interval_s`` not a positive finite number, or a count below 1.
    """

    enabled: bool = False
    interval_s: float = 600.0
    keep_last: int | None = None
    keep_every_steps: int | None = None
    delete_parents: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.interval_s < math.inf:
            raise ValueError(
                f"interval_s must be a finite number of seconds > 0, not {self.interval_s!r}"
            )
        for name in ("keep_last", "keep_every_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, not {value}")


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
        pulse_s: a job that is not finished, failed or stopped and has had nothing folded for
            this long (seconds, on the daemon's monotonic clock) gets a ``ClockTick``, a
            *pulse*: so, with the bus and the daemon working, a live job's inputs are at most
            about ``pulse_s + poll_s`` apart in bus time, and a longer gap in them (more than
            the machine's ``bus_gap_s``, 5 s by default) can only be an outage. A tick is
            visible on the bus only with its partition's next commit, up to
            ``commit_interval_s`` later, so this needs
            ``2 * pulse_s + poll_s + commit_interval_s < bus_gap_s``: one more pulse of margin
            over that spacing (a loaded daemon or bus), so that the rule never takes a quiet
            job for an outage.
        probe_interval_s: seconds between two probes of the bus (the end offsets of
            ``events``): how the daemon knows it reaches the bus and how far behind it is.
        probe_timeout_s: a probe not answered within this many seconds starts a bus outage
            (``/healthz`` not ready, ``trainguard_bus_connected`` 0, ``bus outage started``
            logged); no tick is written until the bus answers again and the daemon has folded
            what was appended meanwhile.
        warn_every_s: while the daemon cannot reach the bus (at its start, or after the bus
            failed under its loop), it waits for it and logs ``bus outage goes on`` this often,
            seconds.
        max_lag_records: ``/healthz`` is not ready while the owned partitions are behind
            their end offsets by more records than this, in total (as of the last probe).
        commit_interval_s: longest time, seconds, between two commits of a partition's
            transaction (its consumed position with everything written for its records:
            decisions become visible to agents then). Also committed every 2000 records. At
            most :data:`MAX_COMMIT_INTERVAL_S`: Kafka aborts a transaction left open longer
            than its transaction timeout (30 s), and nothing the daemon decided would ever
            reach the agents.
        metrics_host: address ``trainguard daemon`` serves ``/metrics`` and ``/healthz`` on
            (``0.0.0.0`` or ``::`` for every interface).
        metrics_port: TCP port of that server; 0 picks a free port (logged as ``metrics
            server listening``), -1 serves nothing. 9464 by default; change it where another
            exporter (OpenTelemetry's Prometheus exporter defaults to 9464 too) or a second
            daemon on the host already listens there.
        snapshot_interval_s: seconds between two rounds of job-state snapshots (signed and
            encrypted, on ``snapshots``; also written on a clean stop), from which a restarted
            daemon rebuilds instead of folding the whole log; 0 turns snapshots off. They are
            off without keys anyway. A due round starts when the daemon's poll finds no
            record waiting, or one interval (of either kind) late at the latest.
        snapshot_interval_records: a round is also due once this many records were folded
            since the last one (0: by time only). It bounds the log a restarted daemon folds
            after its snapshots, whatever the jobs' record rate: a 16,384-rank job sends about
            21,000 records a second, 1.3 million in a 60-s interval, which a restart would
            refold at 11,000-20,000 a second (``bench/RESULTS.md``); 250,000 takes 12-23 s
            on one core, and a round of that job's snapshot costs about 0.3 s of CPU,
            a few per cent of the fold's.
        security: keys and authentication (:class:`SecurityConfig`).
        retention: the daemon's own pruning of checkpoints (:class:`RetentionConfig`).

    Raises:
        ValueError: ``metrics_port`` outside -1..65535, ``poll_s``, ``pulse_s``,
            ``probe_interval_s``, ``probe_timeout_s`` or ``warn_every_s`` not > 0, ``tick_interval_s``,
            ``commit_interval_s`` or ``snapshot_interval_s`` negative,
            ``snapshot_interval_records`` negative, ``commit_interval_s``
            above :data:`MAX_COMMIT_INTERVAL_S`, a duration not finite,
            ``2 * pulse_s + poll_s + commit_interval_s`` not below the machine's
            ``bus_gap_s``, or
            ``max_lag_records`` below 1.
    """

    bus: BusConfig
    machine: MachineConfig
    group_id: str | None = None
    poll_s: float = 0.05
    tick_interval_s: float = 0.25
    pulse_s: float = 1.0
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0
    warn_every_s: float = 30.0
    max_lag_records: int = 10_000
    commit_interval_s: float = 0.1
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9464
    snapshot_interval_s: float = 60.0
    snapshot_interval_records: int = 250_000
    security: SecurityConfig = field(default_factory=SecurityConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)

    def __post_init__(self) -> None:
        for name in ("poll_s", "pulse_s", "probe_interval_s", "probe_timeout_s", "warn_every_s"):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, not {value!r}")
        if self.max_lag_records < 1:
            raise ValueError(f"max_lag_records must be >= 1, not {self.max_lag_records}")
        for name in ("tick_interval_s", "commit_interval_s"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, not {value!r}")
        if self.commit_interval_s > MAX_COMMIT_INTERVAL_S:
            raise ValueError(
                f"commit_interval_s must be at most {MAX_COMMIT_INTERVAL_S:g} s, not "
                f"{self.commit_interval_s!r}: Kafka aborts a transaction open longer than its "
                "transaction timeout (30 s), so no decision would reach the agents"
            )
        bus_gap_s = self.machine.bus_gap_s
        spacing = 2 * self.pulse_s + self.poll_s + self.commit_interval_s
        if not spacing < bus_gap_s:
            raise ValueError(
                f"2 * pulse_s + poll_s + commit_interval_s must be below bus_gap_s "
                f"({bus_gap_s:g} s), not {spacing:g} s (pulse_s {self.pulse_s:g}, poll_s "
                f"{self.poll_s:g}, commit_interval_s {self.commit_interval_s:g}): a quiet job "
                "would look like an outage"
            )
        if not 0 <= self.snapshot_interval_s < math.inf:
            raise ValueError(
                f"snapshot_interval_s must be a finite number of seconds >= 0 (0: off), "
                f"not {self.snapshot_interval_s!r}"
            )
        if self.snapshot_interval_records < 0:
            raise ValueError(
                f"snapshot_interval_records must be >= 0 (0: by time only), "
                f"not {self.snapshot_interval_records}"
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
        path: TOML file with ``[bus]``, ``[machine]``, ``[service]``, ``[security]`` and
            ``[retention]`` tables, or ``None``.
        bus_url: overrides ``[bus] url``.
        machine: overrides of ``[machine]`` keys (``MachineConfig`` field names).
        env: environment for the ``TRAINGUARD_KAFKA_*`` security variables, which beat
            ``[bus.security]`` key by key (:func:`~trainguard.agent.bus.load_kafka_security`);
            ``None`` reads ``os.environ``.
        security_overrides: overrides of ``[security]`` keys (``SecurityConfig`` field names;
            ``None`` values are ignored).
        **service: overrides of ``DaemonConfig`` fields (``group_id``, ``poll_s``, ...).

    Every value is checked against the annotation of its field (``float`` fields take
    integers too, never booleans or strings, and refuse ``inf`` and ``nan``; ``Literal``
    fields take one of their choices; paths are strings) by
    :func:`~trainguard.schemas.settings.build`, then against the ranges the dataclasses
    check.

    Raises:
        OSError: ``path`` cannot be read (``FileNotFoundError``: it does not exist).
        ValueError: an unknown table or key, a malformed file (``tomllib.TOMLDecodeError`` is
            a ``ValueError``), a value of the wrong type or out of range. Messages name the
            file, the table and the key, and say what was expected, e.g. ``daemon.toml:
            [machine] heartbeat_timeout_s: expected a number of seconds, got '10' (a string)``.
    """
    data: dict[str, Any] = {}
    if path is not None:
        with path.open("rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as exc:  # its message says where, not in which file
                raise ValueError(f"{path}: not valid TOML: {exc}") from None
    source = "" if path is None else f"{path}: "
    unknown = data.keys() - set(_TABLES)
    if unknown:
        raise ValueError(f"{source}unknown table(s) {sorted(unknown)}")
    tables = {name: _table(source, name, data.get(name, {})) for name in _TABLES}
    bus_table = tables["bus"]
    if bus_url is not None:
        bus_table["url"] = bus_url
    bus_table.setdefault("url", DEFAULT_BUS_URL)
    security = bus_table.pop("security", None)
    if security is not None and not isinstance(security, Mapping):
        raise ValueError(f"{source}[bus] security must be a table ([bus.security])")
    try:
        kafka_security = load_kafka_security(security, env)
    except ValueError as exc:
        raise ValueError(f"{source}{exc}") from None
    machine_table = {"daemon_id": _default_daemon_id(), **tables["machine"], **(machine or {})}
    service_table = {
        **tables["service"],
        **{k: v for k, v in service.items() if v is not None},
    }
    security_table = {
        **tables["security"],
        **{k: v for k, v in (security_overrides or {}).items() if v is not None},
    }
    # ``create`` says whether a command may create the embedded bus: the daemon always may.
    bus_config = build(f"{source}[bus]", BusConfig, bus_table, security=kafka_security, create=True)
    try:
        parse_bus_url(bus_config.url)  # now, not when the bus is opened after start-up
    except ValueError as exc:
        raise ValueError(f"{source}[bus] url: {exc}") from None
    security_config = build(f"{source}[security]", SecurityConfig, security_table)
    if security_config.keys_dir is not None:
        try:
            expanded = expand_user(security_config.keys_dir)
        except ValueError as exc:
            overridden = (security_overrides or {}).get("keys_dir") is not None
            where = "--keys or TRAINGUARD_KEYS" if overridden else f"{source}[security] keys_dir"
            raise ValueError(f"{where}: {exc}") from None
        security_config = replace(security_config, keys_dir=expanded)
    return build(
        f"{source}[service]",
        DaemonConfig,
        service_table,
        bus=bus_config,
        machine=build(f"{source}[machine]", MachineConfig, machine_table),
        security=security_config,
        retention=build(f"{source}[retention]", RetentionConfig, tables["retention"]),
    )


_TABLES = ("bus", "machine", "service", "security", "retention")


def _table(source: str, name: str, value: Any) -> dict[str, Any]:
    """The top-level table ``name`` of the file as a new dict.

    Raises:
        ValueError: ``name`` is not a table (``machine = 3``).
    """
    return dict(check(f"{source}{name}", Mapping[str, Any], value))
