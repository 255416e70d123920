"""Bus configuration: a frozen object built once at the edge, plus URL parsing."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from trainguard.agent.bus._errors import BusURLError
from trainguard.agent.bus._port import TopicSpec
from trainguard.schemas.settings import check, expand_user

__all__ = [
    "DEFAULT_BUS_URL",
    "DEFAULT_TOPICS",
    "KAFKA_FRAMING_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_TIMEOUT_S",
    "SECURITY_ENVIRONMENT",
    "BusConfig",
    "KafkaSecurity",
    "default_bus_url",
    "default_state_dir",
    "load_kafka_security",
    "parse_bus_url",
    "topic_prefixes",
]


def default_bus_url(env: Mapping[str, str] | None = None) -> str:
    """The bus every party uses when none is configured: one embedded bus per user, at an
    absolute place, whatever the working folder.

    ``sqlite://$XDG_STATE_HOME/trainguard/bus.db``, or ``~/.local/state/trainguard/bus.db``
    when ``XDG_STATE_HOME`` is unset, empty or relative (the XDG Base Directory rule: such a
    value is ignored). The folder is created by the first party that opens the bus for
    writing (the daemon, ``trainguard run``). An explicit ``--bus`` or ``TRAINGUARD_BUS``
    always wins; processes of different users, or on different machines, share a bus only
    through one.

    Args:
        env: the environment; ``None`` reads ``os.environ``.
    """
    return f"sqlite://{default_state_dir(env) / 'bus.db'}"


def default_state_dir(env: Mapping[str, str] | None = None) -> Path:
    """trainguard's per-user state folder: ``$XDG_STATE_HOME/trainguard``, or
    ``~/.local/state/trainguard`` when ``XDG_STATE_HOME`` is unset, empty or relative; the
    folder of the default bus (:func:`default_bus_url`) and of the supervisors' node locks.
    Not created here.

    Args:
        env: the environment; ``None`` reads ``os.environ``.
    """
    env = os.environ if env is None else env
    state = env.get("XDG_STATE_HOME", "")
    base = Path(state) if state and Path(state).is_absolute() else _home(env) / ".local" / "state"
    return base / "trainguard"


def _home(env: Mapping[str, str]) -> Path:
    """``$HOME`` when it is absolute, else the user's home from the password database."""
    home = env.get("HOME", "")
    return Path(home) if home and Path(home).is_absolute() else Path.home()


DEFAULT_BUS_URL = default_bus_url()
""":func:`default_bus_url` of this process's environment at import: the default of every
``--bus`` option and of :class:`~trainguard.agent.AgentConfig`."""

DEFAULT_TOPICS: tuple[TopicSpec, ...] = (
    TopicSpec("events", partitions=6),
    TopicSpec("commands", partitions=6, compacted=True),
    TopicSpec("snapshots", partitions=6, compacted=True, segment_ms=3_600_000),
    TopicSpec("manifests", partitions=6),
    TopicSpec("audit", partitions=6, retention_ms=-1),
    TopicSpec("dead-letter", partitions=1),
)
"""trainguard's topics (ARCHITECTURE.md section 3). ``events``, ``commands``, ``snapshots``,
``manifests`` and ``audit`` are keyed by job id and share one partition count so that one
job's records of every kind sit on the same partition number (co-partitioning). ``audit`` is
kept forever (``retention.ms=-1``): it is the record a replay verifies against; the others keep
the broker's retention. ``snapshots`` closes a segment every hour (``segment.ms``), so Kafka
compacts the snapshots (and chunks) that newer ones replaced within about an hour, and a
starting daemon, which reads the whole topic, does not read a week of them."""


_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


@dataclass(frozen=True, slots=True)
class KafkaSecurity:
    """Kafka transport security, passed straight to aiokafka (see its ``AIOKafkaClient`` docs).

    Build it with :func:`load_kafka_security` (a ``[bus.security]`` table and the
    ``TRAINGUARD_KAFKA_*`` variables); ``KafkaSecurity()`` is plaintext without authentication.

    Attributes:
        protocol: ``PLAINTEXT``, ``SSL``, ``SASL_PLAINTEXT`` or ``SASL_SSL``.
        sasl_mechanism: ``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512`` (SASL protocols only;
            ``None`` there means ``PLAIN``). ``PLAIN`` sends the password itself: use it over
            ``SASL_SSL`` only.
        sasl_username, sasl_password: SASL credentials, both required by the SASL protocols.
            The password never appears in ``repr``/``str`` (shown as ``'***'``) nor in any error
            message of this package.
        ssl_cafile: PEM file of the CA(s) that signed the brokers' certificates; ``None`` trusts
            the system's CAs. Broker host names are always checked.
        ssl_certfile, ssl_keyfile: PEM client certificate (chain) and its private key, for
            brokers that authenticate clients by TLS certificate; ``None`` sends none.

    Raises:
        ValueError: an unknown protocol or mechanism, a SASL protocol without username and
            password, or SASL/TLS settings given with a protocol that would ignore them (a
            ``sasl_username`` under ``PLAINTEXT`` would otherwise connect unauthenticated
            without a word).
    """

    protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    def __post_init__(self) -> None:
        if self.protocol not in _PROTOCOLS:
            raise ValueError(
                f"Kafka security protocol {self.protocol!r}: expected one of {_PROTOCOLS}"
            )
        sasl = self.protocol.startswith("SASL")
        tls = self.protocol in ("SSL", "SASL_SSL")
        if sasl:
            if self.sasl_mechanism is not None and self.sasl_mechanism not in _MECHANISMS:
                raise ValueError(
                    f"SASL mechanism {self.sasl_mechanism!r}: expected one of {_MECHANISMS}"
                )
            if not self.sasl_username or not self.sasl_password:
                raise ValueError(
                    f"Kafka security protocol {self.protocol} needs sasl_username and "
                    "sasl_password (or a password file)"
                )
        else:
            given = [
                name
                for name in ("sasl_mechanism", "sasl_username", "sasl_password")
                if getattr(self, name) is not None
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)} set, but protocol {self.protocol} does not authenticate "
                    "with SASL; use SASL_SSL (or SASL_PLAINTEXT on a trusted network)"
                )
        if not tls:
            given = [
                name
                for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile")
                if getattr(self, name) is not None
            ]
            if given:
                raise ValueError(
                    f"{', '.join(given)} set, but protocol {self.protocol} does not use TLS; "
                    "use SSL or SASL_SSL"
                )

    def __repr__(self) -> str:
        password = None if self.sasl_password is None else "***"
        return (
            f"KafkaSecurity(protocol={self.protocol!r}, sasl_mechanism={self.sasl_mechanism!r}, "
            f"sasl_username={self.sasl_username!r}, sasl_password={password!r}, "
            f"ssl_cafile={self.ssl_cafile!r}, ssl_certfile={self.ssl_certfile!r}, "
            f"ssl_keyfile={self.ssl_keyfile!r})"
        )

    __str__ = __repr__


SECURITY_ENVIRONMENT: Mapping[str, str] = MappingProxyType(
    {
        "protocol": "TRAINGUARD_KAFKA_SECURITY_PROTOCOL",
        "sasl_mechanism": "TRAINGUARD_KAFKA_SASL_MECHANISM",
        "sasl_username": "TRAINGUARD_KAFKA_SASL_USERNAME",
        "sasl_password": "TRAINGUARD_KAFKA_SASL_PASSWORD",
        "sasl_password_file": "TRAINGUARD_KAFKA_SASL_PASSWORD_FILE",
        "ssl_cafile": "TRAINGUARD_KAFKA_SSL_CAFILE",
        "ssl_certfile": "TRAINGUARD_KAFKA_SSL_CERTFILE",
        "ssl_keyfile": "TRAINGUARD_KAFKA_SSL_KEYFILE",
    }
)
"""``[bus.security]`` key -> the environment variable that sets it."""


def load_kafka_security(
    table: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> KafkaSecurity:
    """Kafka security from a ``[bus.security]`` table and the ``TRAINGUARD_KAFKA_*`` variables.

    The one loader every party uses (daemon, supervisor, agent, command line), so that they all
    read the same settings the same way.

    Keys and variables (:data:`SECURITY_ENVIRONMENT`): ``protocol``, ``sasl_mechanism``,
    ``sasl_username``, ``sasl_password`` or ``sasl_password_file`` (a file holding the
    password, as a Kubernetes secret mount provides; one trailing line break is dropped),
    ``ssl_cafile``, ``ssl_certfile``, ``ssl_keyfile``. Per setting, a non-empty variable beats
    the table; the password and its file are one setting, so a password file in the
    environment replaces a password in the table. Protocol and mechanism are case-insensitive.

    Args:
        table: the TOML table, or ``None``.
        env: the environment; ``None`` reads ``os.environ``.

    Raises:
        ValueError: an unknown key, a value that is not a string, both forms of the password
            in one source, an unreadable or empty password file, or a combination
            :class:`KafkaSecurity` refuses. Messages name keys, variables and files, never a
            password.
    """
    env = os.environ if env is None else env
    values = dict(table or {})
    unknown = values.keys() - SECURITY_ENVIRONMENT.keys()
    if unknown:
        raise ValueError(
            f"[bus.security]: unknown key(s) {sorted(unknown)}; known: "
            f"{sorted(SECURITY_ENVIRONMENT)}"
        )
    values = {key: check(f"[bus.security] {key}", str, value) for key, value in values.items()}
    _one_password_form(values, "[bus.security] sasl_password and sasl_password_file")
    from_env = {key: env[var] for key, var in SECURITY_ENVIRONMENT.items() if env.get(var)}
    _one_password_form(
        from_env,
        f"{SECURITY_ENVIRONMENT['sasl_password']} and {SECURITY_ENVIRONMENT['sasl_password_file']}",
    )
    if from_env.keys() & {"sasl_password", "sasl_password_file"}:
        values.pop("sasl_password", None)
        values.pop("sasl_password_file", None)
    values.update(from_env)
    password_file = values.pop("sasl_password_file", None)
    if password_file is not None:
        try:
            path = expand_user(password_file)
        except ValueError as exc:
            where = (
                SECURITY_ENVIRONMENT["sasl_password_file"]
                if "sasl_password_file" in from_env
                else "[bus.security] sasl_password_file"
            )
            raise ValueError(f"{where}: {exc}") from None
        values["sasl_password"] = _read_password(path)
    for key in ("protocol", "sasl_mechanism"):
        if key in values:
            values[key] = values[key].strip().upper()
    return KafkaSecurity(**values)


def _one_password_form(values: Mapping[str, str], what: str) -> None:
    if "sasl_password" in values and "sasl_password_file" in values:
        raise ValueError(f"{what} are both set; give one")


def _read_password(path: Path) -> str:
    """The password in ``path`` without one trailing line break (``\\n`` or ``\\r\\n``).

    Raises:
        ValueError: the file cannot be read (names the path and the OS error) or is empty.
    """
    try:
        text = path.read_bytes().decode("utf-8")  # bytes as they are: no newline translation
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        # Not chained: a UnicodeDecodeError carries the file's bytes, the secret itself.
        raise ValueError(f"Kafka SASL password file {path}: {reason}") from None
    password = text.removesuffix("\n").removesuffix("\r")
    if not password:
        raise ValueError(f"Kafka SASL password file {path} is empty")
    return password


MAX_TIMEOUT_S = 2_147_483
"""Longest bus timeout, seconds: Kafka carries timeouts as signed 32-bit milliseconds (a
longer one fails inside aiokafka's request encoding, after the bus was half opened)."""

KAFKA_FRAMING_BYTES = 64 * 1024
"""Room the Kafka adapter adds to ``max_message_bytes`` for record and batch headers."""

MAX_MESSAGE_BYTES = 2**31 - 1 - KAFKA_FRAMING_BYTES
"""Largest ``max_message_bytes``: Kafka's ``max.message.bytes`` is a signed 32-bit size."""


@dataclass(frozen=True, slots=True)
class BusConfig:
    """How to reach and shape the bus.

    Attributes:
        url: ``sqlite:///path/to/bus.db`` (embedded) or ``kafka://host:port[,host:port]``.
        prefix: prepended to every logical topic name (``trainguard.events``); lets several
            deployments or test runs share one broker.
        topics: topics created on start-up when missing.
        connect_timeout_s: seconds ``start()`` may take before raising ``BusUnavailable``.
        send_timeout_s: seconds a send may stay undelivered before its future raises
            ``DeliveryFailed``; also bounds the flush in ``close()``.
        max_message_bytes: largest record value accepted, bytes.
        client_id: identifies this process to the bus (logs, broker metrics).
        replication_factor: Kafka replicas per partition of the topics created on start-up;
            ``None`` takes ``min(3, brokers in the cluster)``.
        session_timeout_s: a consumer-group member silent for this long loses its partitions
            (Kafka's ``session.timeout.ms``; the embedded bus applies the same rule). Members
            renew it in the background, every third of it, while their process runs: a paused
            or dead process loses its partitions, a busy one does not.
        max_poll_interval_s: a member whose process runs but that has not polled for this long
            leaves the group (Kafka's ``max.poll.interval.ms``; the embedded bus applies the
            same rule): its partitions go to the others, and its next poll joins again. It
            bounds how long a wedged consumer holds partitions; keep it well above the longest
            pause between polls of a healthy one (a daemon sealing a large state snapshot).
        idle_poll_s: embedded bus only: longest sleep, in seconds, of an idle consumer between
            looks at the file (it starts at 2 ms after each delivery and doubles up to this;
            a look costs about 4 us while the file is unchanged). The worst-case delivery
            latency of an idle consumer; Kafka long-polls instead.
        security: Kafka TLS/SASL settings (built by :func:`load_kafka_security`); ignored by
            the embedded bus.
        kafka_options: extra keyword arguments for aiokafka's producers (expert use); the
            consumers' settings are fixed by the adapter (``read_committed``, no auto-commit).
        create: embedded bus only: whether ``start()`` may create what is missing (the file,
            its folder, its tables, this prefix's topics). Writers (daemon, agents,
            supervisors, ``import``, the demo) keep ``True``; read-only commands pass
            ``False``, so that a mistyped path or prefix creates nothing and fails with an
            error naming it. Kafka ignores it: its topics are created on start either way.

    Raises:
        ValueError: a timeout or ``idle_poll_s`` not a number > 0 and at most
            :data:`MAX_TIMEOUT_S`, ``max_message_bytes`` outside 1..:data:`MAX_MESSAGE_BYTES`,
            ``replication_factor`` outside 1..32767, a topic's partitions outside
            1..2**31-1 (Kafka's 32-bit count), a
            ``retention_ms`` below -1, a ``segment_ms`` below 1, or two topics of one name.
    """

    url: str
    prefix: str = "trainguard."
    topics: tuple[TopicSpec, ...] = DEFAULT_TOPICS
    connect_timeout_s: float = 15.0
    send_timeout_s: float = 30.0
    max_message_bytes: int = 1 << 20
    client_id: str = "trainguard"
    replication_factor: int | None = None
    session_timeout_s: float = 10.0
    max_poll_interval_s: float = 60.0
    idle_poll_s: float = 0.02
    security: KafkaSecurity = KafkaSecurity()
    kafka_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    create: bool = True

    def __post_init__(self) -> None:
        for name in (
            "connect_timeout_s",
            "send_timeout_s",
            "session_timeout_s",
            "max_poll_interval_s",
            "idle_poll_s",
        ):
            value = getattr(self, name)
            if not 0 < value <= MAX_TIMEOUT_S:
                raise ValueError(
                    f"{name} must be a number of seconds > 0 and at most {MAX_TIMEOUT_S} "
                    f"(Kafka's 32-bit milliseconds), got {value!r}"
                )
        if not 1 <= self.max_message_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(
                f"max_message_bytes must be 1..{MAX_MESSAGE_BYTES} (a 32-bit size with room "
                f"for Kafka's framing), got {self.max_message_bytes}"
            )
        if self.replication_factor is not None and not 1 <= self.replication_factor <= 32767:
            raise ValueError(
                f"replication_factor must be 1..32767 (Kafka's 16-bit count), "
                f"got {self.replication_factor}"
            )
        names = [spec.name for spec in self.topics]
        if len(set(names)) < len(names):
            raise ValueError(f"topics: a name is given twice in {names}")
        for spec in self.topics:
            if not 1 <= spec.partitions <= 2**31 - 1:
                raise ValueError(f"topic {spec.name!r}: partitions must be 1..{2**31 - 1}")
            if spec.retention_ms is not None and spec.retention_ms < -1:
                raise ValueError(f"topic {spec.name!r}: retention_ms must be >= -1 (-1: forever)")
            if spec.segment_ms is not None and spec.segment_ms < 1:
                raise ValueError(f"topic {spec.name!r}: segment_ms must be >= 1")


def topic_prefixes(names: Iterable[str]) -> list[str]:
    """The topic prefixes under which ``names`` (full topic names, e.g. from
    :meth:`~trainguard.agent.bus.Bus.topic_names`) hold a trainguard bus: those with both an
    ``events`` and a ``commands`` topic, sorted. Other topics (Kafka's internal ones, other
    applications') are ignored."""
    present = set(names)
    return sorted(
        name.removesuffix("events")
        for name in present
        if name.endswith("events") and name.removesuffix("events") + "commands" in present
    )


def sqlite_url(path: Path) -> str:
    """The embedded-bus URL of the database file ``path``, made absolute (``sqlite:///`` and a
    relative path would name a file under the root: see :func:`parse_bus_url`)."""
    return f"sqlite://{path.resolve()}"


def parse_bus_url(url: str) -> tuple[Literal["sqlite", "kafka"], str]:
    """Split a bus URL into its kind and location.

    Returns ``("sqlite", "/abs/or/relative/path.db")`` for ``sqlite:///path`` (three slashes
    and an absolute path; four, as SQLAlchemy writes one, are read the same), or
    ``sqlite:relative.db``, and ``("kafka", "h1:p1,h2:p2")`` for
    ``kafka://h1:p1,h2:p2``. Raises :class:`BusURLError` for anything else.
    """
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        path = unquote(parts.path if not parts.netloc else parts.netloc + parts.path)
        if not path:
            raise BusURLError(f"bus URL {url!r}: missing the database path (sqlite:///path/bus.db)")
        if path.startswith("//"):
            # sqlite:////abs/bus.db (SQLAlchemy's spelling of an absolute path): /abs/bus.db.
            path = "/" + path.lstrip("/")
        return "sqlite", path
    if parts.scheme == "kafka":
        servers = parts.netloc
        if not servers or parts.path not in ("", "/"):
            raise BusURLError(f"bus URL {url!r}: expected kafka://host:port[,host:port...]")
        for server in servers.split(","):
            host, sep, port = server.rpartition(":")
            if not sep or not host or not (port.isascii() and port.isdigit()):
                raise BusURLError(f"bus URL {url!r}: {server!r} is not host:port")
            if not 1 <= int(port) <= 65535:
                raise BusURLError(f"bus URL {url!r}: port {port} of {server!r} is not 1..65535")
        return "kafka", servers
    raise BusURLError(f"bus URL {url!r}: scheme must be sqlite or kafka")
