"""The audit trail's format: what the daemon writes on ``audit``, and what a replay reads back.

Every entry is a JSON object keyed by job id on the ``audit`` topic (co-partitioned with the
job's ``events``; the topic is never compacted). Two kinds, told apart by ``entry``; both carry
``decisions`` (empty in a config entry), so a reader that wants only the decisions can flatten
every entry's list:

* **config entry**, written when a daemon process first acts for a job: the machine
  configuration its decisions are made under, and its id::

      {"entry": "config", "job_id": "j1", "config_id": "3f0c9e1a52b7d4e8",
       "config": {"daemon_id": "host-4242", "heartbeat_timeout_s": 10.0, ...}, "rules": 1,
       "decisions": []}

  ``rules`` is the version of the machine's rules that decided
  (:data:`~trainguard.daemon.core._machine_config.RULES_VERSION`); entries written before it
  was recorded have none.

* **decision entry**, one per input that produced decisions: where the input sat on the bus,
  what it was independently of offsets (so a log imported elsewhere, with other offsets, still
  matches), the configuration, and the decisions in the order the daemon acted on them::

      {"entry": "decisions", "job_id": "j1", "partition": 2, "offset": 118, "at_ms": 1767225600123,
       "input": {"type": "heartbeat", "rank": 1, "host": "n1", "pid": 311, "seq": 40,
                 "generation": 0},
       "config_id": "3f0c9e1a52b7d4e8", "decisions": [{"decision": "transition", ...}]}

* **refused entry**, one per record the daemon refused as not authentic (a forged or
  mis-keyed event: its MAC is missing, under an unknown key, wrong, or its job has no key while
  authentication is required). A replay cannot judge MACs without the keys, which the daemon
  may since have rotated or retired, so the daemon records the verdict; the record is named by
  the SHA-256 of its value and its append time (offsets differ in an imported log)::

      {"entry": "refused", "job_id": "j1", "partition": 2, "offset": 119, "at_ms": 1767225600125,
       "value_sha256": "9f86d0...", "code": "bad_mac",
       "reason": "MAC under event key 2f46896b5109e1e0 does not verify", "decisions": []}

An input's identity is ``input`` together with ``at_ms`` (the bus append time of the input's
record): events are named by their sender (``rank``, ``host``, ``pid``), ``seq`` and
``generation``; ticks (``{"type": "tick", "daemon_id", "seq"}``) by the daemon that wrote them.

``config_id`` is the first 16 hex digits of the SHA-256 of the configuration's JSON with sorted
keys (:func:`config_id`). Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, cast

import orjson

from trainguard.daemon.core._decisions import Decision
from trainguard.daemon.core._machine_config import RULES_VERSION, MachineConfig
from trainguard.schemas import ClockTick, Event, HeartbeatBatch, JobRequest, JSONValue

if TYPE_CHECKING:  # _intake imports this module
    from trainguard.daemon.core._intake import AuthRefusal, RawRecord

__all__ = [
    "AuditRecord",
    "AuditTrail",
    "Group",
    "InputKey",
    "MalformedAudit",
    "config_entry",
    "config_fields",
    "config_id",
    "decision_entry",
    "entries_by_job",
    "input_id",
    "input_key",
    "machine_config",
    "plain_decisions",
    "read_trail",
    "refusal_entry",
]

InputKey: TypeAlias = tuple[str, int]
"""An input's identity as a hashable value: ``(canonical JSON of input_id, at_ms)``."""


class MalformedAudit(ValueError):
    """An audit entry is not in the format this module writes (named by its position)."""


def input_id(message: Event | JobRequest | HeartbeatBatch | ClockTick) -> dict[str, JSONValue]:
    """The identity of an input independent of its bus position.

    ``{"type": "tick", "daemon_id", "seq"}`` for a tick; ``{"type", "rank", "host", "pid",
    "seq", "generation"}`` for an event, ``type`` being its schema's type (``heartbeat``,
    ``checkpoint``, ``data-cursor``, ``lifecycle``) and ``rank`` ``None`` for a supervisor.
    A sender's ``seq`` grows per message, so with the record's append time this names one
    record (a record the bus holds twice, e.g. an agent's retried send, has one identity, and
    the machine rejects the second copy as a duplicate).
    """
    kind = message.SCHEMA.partition("/")[0]
    if isinstance(message, ClockTick):
        return {"type": kind, "daemon_id": message.daemon_id, "seq": message.seq}
    if isinstance(message, HeartbeatBatch):
        return {
            "type": kind,
            "rank": None,
            "host": message.host,
            "pid": message.pid,
            "seq": message.seq,
        }
    return {
        "type": kind,
        "rank": message.rank,
        "host": message.host,
        "pid": message.pid,
        "seq": message.seq,
        "generation": message.generation,
    }


def input_key(identity: Mapping[str, JSONValue], at_ms: int) -> InputKey:
    """The hashable form of an input's identity and append time (ms since the epoch)."""
    return orjson.dumps(identity, option=orjson.OPT_SORT_KEYS).decode(), at_ms


def config_fields(config: MachineConfig) -> dict[str, JSONValue]:
    """The configuration's init fields (seconds, counts, factors as set), JSON-ready."""
    return {f.name: getattr(config, f.name) for f in fields(config) if f.init}


def config_id(config: MachineConfig) -> str:
    """First 16 hex digits of the SHA-256 of :func:`config_fields` as JSON with sorted keys."""
    canonical = orjson.dumps(config_fields(config), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(canonical).hexdigest()[:16]


def machine_config(values: Mapping[str, Any]) -> MachineConfig:
    """Rebuild the configuration a config entry recorded.

    Raises:
        MalformedAudit: a key this version does not know (written by another trainguard
            version), or a value :class:`MachineConfig` refuses.
    """
    known = {f.name for f in fields(MachineConfig) if f.init}
    unknown = values.keys() - known
    if unknown:
        raise MalformedAudit(
            f"recorded configuration has key(s) {sorted(unknown)} this trainguard does not know"
        )
    try:
        return MachineConfig(**values)
    except (TypeError, ValueError) as exc:
        raise MalformedAudit(f"recorded configuration is invalid: {exc}") from exc


def plain_decisions(decisions: Iterable[Decision]) -> tuple[dict[str, JSONValue], ...]:
    """The decisions as an audit entry holds them after a JSON round trip (what a replay
    compares with the recorded entries)."""
    return tuple(orjson.loads(orjson.dumps([d.to_dict() for d in decisions])))


def config_entry(job_id: str, config: MachineConfig) -> dict[str, JSONValue]:
    """The config entry of ``job_id`` for ``config`` (module docstring)."""
    return {
        "entry": "config",
        "job_id": job_id,
        "config_id": config_id(config),
        "config": config_fields(config),
        "rules": RULES_VERSION,
        "decisions": [],
    }


def decision_entry(
    job_id: str,
    *,
    partition: int,
    offset: int,
    at_ms: int,
    identity: Mapping[str, JSONValue],
    config: str,
    decisions: Sequence[Decision],
) -> dict[str, JSONValue]:
    """The decision entry for the input at ``partition``/``offset`` appended at ``at_ms`` (ms
    since the epoch) with identity ``identity`` (:func:`input_id`), decided under the
    configuration with id ``config`` (module docstring)."""
    return {
        "entry": "decisions",
        "job_id": job_id,
        "partition": partition,
        "offset": offset,
        "at_ms": at_ms,
        "input": dict(identity),
        "config_id": config,
        "decisions": [d.to_dict() for d in decisions],
    }


def refusal_entry(
    job_id: str,
    *,
    partition: int,
    offset: int,
    at_ms: int,
    value: bytes,
    code: AuthRefusal,
    reason: str,
) -> dict[str, JSONValue]:
    """The refused entry for the record at ``partition``/``offset`` appended at ``at_ms`` (ms
    since the epoch) with value ``value``, refused as not authentic (module docstring)."""
    return {
        "entry": "refused",
        "job_id": job_id,
        "partition": partition,
        "offset": offset,
        "at_ms": at_ms,
        "value_sha256": hashlib.sha256(value).hexdigest(),
        "code": code,
        "reason": reason,
        "decisions": [],
    }


@dataclass(frozen=True, slots=True)
class Group:
    """The decisions one input produced: recorded (a decision entry) or derived by a replay.

    Attributes:
        input_id: the input's identity (:func:`input_id`).
        at_ms: the input record's bus append time, ms since the Unix epoch.
        offset: the input record's offset where it was read (shown, never compared: an
            imported log has other offsets), ``None`` for a tick a what-if run synthesised.
        config_id: the configuration the decisions were made under.
        decisions: the decisions in JSON form (:func:`plain_decisions`), in order.
    """

    input_id: Mapping[str, JSONValue]
    at_ms: int
    offset: int | None
    config_id: str
    decisions: tuple[Mapping[str, JSONValue], ...]

    @property
    def key(self) -> InputKey:
        """The input's identity with its append time (:func:`input_key`)."""
        return input_key(self.input_id, self.at_ms)

    def same(self, other: Group) -> bool:
        """Same input, configuration and decisions (offsets aside)."""
        return (self.key, self.config_id, self.decisions) == (
            other.key,
            other.config_id,
            other.decisions,
        )


@dataclass(frozen=True, slots=True)
class AuditTrail:
    """A job's audit entries, parsed.

    Also the :class:`~trainguard.daemon.core._intake.Authenticator` of a replay: it refuses the
    records the daemon refused as not authentic, and only those.

    Attributes:
        configs: config id -> the recorded configuration's fields, in order of first record.
        groups: the decision entries in audit order (re-derived duplicates included).
        refused: ``(value SHA-256 hex, at_ms)`` -> ``(code, reason)`` of every refused entry.
        rules: config id -> the rules version its first config entry recorded (``None``: it
            recorded none, a trail of a build before rules versions).
    """

    configs: Mapping[str, Mapping[str, JSONValue]]
    groups: tuple[Group, ...]
    refused: Mapping[tuple[str, int], tuple[AuthRefusal, str]] = field(default_factory=dict)
    rules: Mapping[str, int | None] = field(default_factory=dict)

    def refuse(self, record: RawRecord, message: object) -> tuple[AuthRefusal, str] | None:
        """The daemon's recorded verdict on ``record``: ``(code, reason)`` if it refused it
        as not authentic, else ``None``."""
        if not self.refused or record.value is None:
            return None
        return self.refused.get((hashlib.sha256(record.value).hexdigest(), record.timestamp_ms))

    def mac_keys(self, record: RawRecord) -> None:
        """``None``: a replay holds no keys, so :meth:`refuse` judges every record (after
        decoding it whole)."""
        return None

    def machine(self, config: str) -> MachineConfig:
        """The recorded configuration with id ``config``.

        Raises:
            MalformedAudit: no config entry has that id, or it does not rebuild.
        """
        values = self.configs.get(config)
        if values is None:
            raise MalformedAudit(f"no config entry records configuration {config}")
        return machine_config(values)


def read_trail(entries: Iterable[Mapping[str, Any]]) -> AuditTrail:
    """Parse a job's audit entries (dicts, in audit order) into an :class:`AuditTrail`.

    Raises:
        MalformedAudit: an entry of unknown kind, or one missing a field or holding a field of
            the wrong type; the message names the entry's position (0-based).
    """
    configs: dict[str, Mapping[str, JSONValue]] = {}
    groups: list[Group] = []
    refused: dict[tuple[str, int], tuple[AuthRefusal, str]] = {}
    rules: dict[str, int | None] = {}
    for n, entry in enumerate(entries):
        try:
            kind = entry["entry"]
            if kind == "config":
                config = entry["config"]
                if not isinstance(config, Mapping):
                    raise TypeError("config is not an object")
                recorded_id = _text(entry["config_id"])
                version = entry.get("rules")
                if version is not None and (type(version) is not int or version < 1):
                    raise ValueError(f"rules must be a positive integer, not {version!r}")
                configs.setdefault(recorded_id, config)
                rules.setdefault(recorded_id, version)
            elif kind == "decisions":
                decisions = entry["decisions"]
                identity = entry["input"]
                if not (isinstance(decisions, list) and isinstance(identity, Mapping)):
                    raise TypeError("decisions is not a list or input not an object")
                groups.append(
                    Group(
                        input_id=identity,
                        at_ms=_integer(entry["at_ms"]),
                        offset=_integer(entry["offset"]),
                        config_id=_text(entry["config_id"]),
                        decisions=tuple(decisions),
                    )
                )
            elif kind == "refused":
                code = cast("AuthRefusal", _text(entry["code"]))
                where = (_text(entry["value_sha256"]), _integer(entry["at_ms"]))
                refused[where] = (code, _text(entry["reason"]))
            else:
                raise ValueError(f"unknown entry kind {kind!r}")
        except (KeyError, TypeError, ValueError) as exc:
            what = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
            raise MalformedAudit(f"audit entry {n}: {what}") from exc
    return AuditTrail(configs=configs, groups=tuple(groups), refused=refused, rules=rules)


class AuditRecord(Protocol):
    """What :func:`entries_by_job` reads of a record of ``audit``
    (:class:`~trainguard.agent.bus.Record` has it)."""

    @property
    def key(self) -> str | None:
        """The record key (the job id)."""

    @property
    def value(self) -> bytes | None:
        """The entry as JSON, ``None`` for a tombstone."""

    @property
    def partition(self) -> int:
        """The partition it sits on."""

    @property
    def offset(self) -> int:
        """Its position in the partition."""


def entries_by_job(records: Iterable[AuditRecord]) -> dict[str, list[dict[str, Any]]]:
    """The entries of ``audit`` records (in bus order) as dicts, by job (the record key), each
    job's in the order read: what :func:`read_trail` parses, and every reader of the audit
    trail (replay, status, report, the checkpoint catalog) starts from. Tombstones and
    records without a key are skipped.

    Raises:
        MalformedAudit: a value that is not a JSON object (named by partition and offset).
    """
    out: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if record.value is None or record.key is None:
            continue
        try:
            entry = orjson.loads(record.value)
        except orjson.JSONDecodeError as exc:
            raise MalformedAudit(
                f"audit record at partition {record.partition}, offset {record.offset}: {exc}"
            ) from exc
        if not isinstance(entry, dict):
            raise MalformedAudit(
                f"audit record at partition {record.partition}, offset {record.offset}: not a "
                "JSON object"
            )
        out.setdefault(record.key, []).append(entry)
    return out


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _integer(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {value!r}")
    return value
