"""From a record of the ``events`` topic to a state-machine input: the one conversion the daemon
and a replay share, so that a replay folds exactly what the daemon folded.

A record becomes an input when its value decodes as an event, a ``JobRequest`` or a
``ClockTick``, the
message's ``job_id`` equals the record key, and the :class:`Authenticator` (if any) finds it
authentic; its time is the record's bus append time (never the sender's ``ts``). A
``ClockTick`` becomes a :class:`~trainguard.daemon.Tick` (with the command ``seq`` it names),
any other message an :class:`~trainguard.daemon.Observed`. Anything else is refused with a reason
(the daemon parks it on ``dead-letter``; a replay shows it). Pure: no I/O, no clock.

Authentication is the one verdict that depends on more than the record: the daemon judges MACs
with the keys it holds (:mod:`trainguard.daemon.service._security`) and records every refusal in the
audit trail; a replay takes the verdicts from there (:class:`~trainguard.daemon.core._audit_entry.AuditTrail`
is an :class:`Authenticator`), so it folds exactly what the daemon folded, without any key.

A MACed record laid out as ``encode`` writes it (``auth`` first) is checked before it is
decoded: when its MAC verifies on the raw bytes under one of the keys the authenticator holds
for the record key's job (:meth:`Authenticator.mac_keys`;
:func:`~trainguard.schemas.split_mac`, :func:`~trainguard.schemas.verify_raw_mac`), only its
canonical bytes are decoded (:func:`~trainguard.schemas.decode_maced`), and the ``job_id``
check follows. That gives the verdict and the message the full path gives (decode, then
:meth:`Authenticator.refuse`), without validating the ``auth`` member or parsing the record a
second time to rebuild its canonical bytes; every other record, and every record that fails
there, takes the full path, which gives the verdict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol, TypeAlias

from trainguard.daemon.core._audit_entry import input_id
from trainguard.daemon.core._inputs import Input, Observed, Tick
from trainguard.daemon.core._state import new_tuple
from trainguard.schemas import (
    EVENTS_TOPIC_TYPES,
    ClockTick,
    Event,
    HeartbeatBatch,
    JobRequest,
    JSONValue,
    SchemaError,
    decode,
    decode_maced,
    split_mac,
    verify_raw_mac,
)

__all__ = ["AuthRefusal", "Authenticator", "RawRecord", "Refused", "Taken", "take"]


_NS_PER_MS = 1_000_000

RefusedCode: TypeAlias = Literal["tombstone", "schema", "key_mismatch", "auth"]

AuthRefusal: TypeAlias = Literal[
    "missing_mac", "unknown_kid", "bad_mac", "unknown_job", "key_error"
]
"""Why a record is not authentic: it carries no MAC, a MAC under a key id the job does not
have, a MAC that does not verify, it belongs to a job without an event key while the daemon
requires authentication, or its job's key files cannot be used (readable by others, malformed:
the record cannot be judged, so it is not taken)."""


class RawRecord(Protocol):
    """What intake reads of a bus record (:class:`~trainguard.agent.bus.Record` has it)."""

    @property
    def key(self) -> str | None:
        """The record key (the job id)."""

    @property
    def value(self) -> bytes | None:
        """The encoded message, ``None`` for a tombstone."""

    @property
    def offset(self) -> int:
        """Position in the partition."""

    @property
    def timestamp_ms(self) -> int:
        """Bus append time, ms since the Unix epoch."""


class Authenticator(Protocol):
    """Judges whether a decoded record of ``events`` is authentic."""

    def refuse(
        self, record: RawRecord, message: Event | JobRequest | HeartbeatBatch | ClockTick
    ) -> tuple[AuthRefusal, str] | None:
        """``None`` for an authentic record, else why not: a code and a reason for people
        (naming key ids, never keys). ``message`` is the record's decoded value."""

    def mac_keys(self, record: RawRecord) -> Mapping[str, bytes] | None:
        """The event keys under which a MAC on ``record``'s raw bytes is the verdict
        :meth:`refuse` would give (authentic), before the record is decoded; ``None`` or none
        when only :meth:`refuse` can judge it. Asked for every record with a value, before
        anything else (so it must be cheap: a cached lookup by the record key)."""


class Taken(NamedTuple):
    """A record taken in (a named tuple, as the inputs: one is built per record).

    Attributes:
        job_id: the job it belongs to (message ``job_id`` = record key).
        input: what the state machine folds.
        message: the decoded message (the event, or the ``ClockTick``).
    """

    job_id: str
    input: Input
    message: Event | JobRequest | HeartbeatBatch | ClockTick

    @property
    def input_id(self) -> dict[str, JSONValue]:
        """Its identity for the audit trail (:func:`trainguard.daemon.core._audit_entry.input_id`), built
        on demand: only inputs that decide something (or that a replay matches) need one."""
        return input_id(self.message)


@dataclass(frozen=True, slots=True)
class Refused:
    """A record that is no input.

    Attributes:
        reason: why, for ``dead-letter`` and people.
        code: ``tombstone`` (no value), ``schema`` (did not decode: ``error`` says how),
            ``key_mismatch`` (message ``job_id`` differs from the record key) or ``auth`` (not
            authentic: ``auth`` says how).
        error: the decoding error for ``schema``, else ``None``.
        auth: the :data:`AuthRefusal` for ``auth``, else ``None``.
    """

    reason: str
    code: RefusedCode
    error: SchemaError | None = None
    auth: AuthRefusal | None = None


def take(record: RawRecord, auth: Authenticator | None = None) -> Taken | Refused:
    """Convert one record of ``events`` into an input, or say why it is none (module
    docstring). Never raises for a malformed value.

    Args:
        record: the record.
        auth: judges authenticity after decoding; ``None`` takes every record as authentic
            (a daemon without keys).
    """
    value = record.value
    if value is None:
        return Refused("tombstone on the events topic", "tombstone")
    # Keys first: a replay's authenticator (the audit trail) and a job without keys have none,
    # and then cutting the record would be wasted.
    keys = None if auth is None else auth.mac_keys(record)
    message: Event | JobRequest | HeartbeatBatch | ClockTick | None = (
        _verified(record, value, keys) if keys else None
    )
    if message is None:
        try:
            # ``expect`` admits only these types (an annotation costs nothing, a cast a call).
            decoded: Event | JobRequest | HeartbeatBatch | ClockTick = decode(
                value, expect=EVENTS_TOPIC_TYPES
            )  # type: ignore[assignment]
        except SchemaError as exc:
            return Refused(str(exc), "schema", exc)
        message = decoded
        if message.job_id != record.key:
            return Refused(
                f"job_id {message.job_id!r} does not match record key {record.key!r}",
                "key_mismatch",
            )
        if auth is not None and (refusal := auth.refuse(record, message)) is not None:
            code, reason = refusal
            return Refused(reason, "auth", auth=code)
    at_ns = record.timestamp_ms * _NS_PER_MS
    if isinstance(message, ClockTick):
        return Taken(message.job_id, Tick(at_ns, message.command_seq), message)
    # Named tuples built in C (``new_tuple``): one of each per record.
    item = new_tuple(Observed, (at_ns, record.offset, message))
    return new_tuple(Taken, (message.job_id, item, message))


def _verified(
    record: RawRecord, value: bytes, keys: Mapping[str, bytes]
) -> Event | JobRequest | HeartbeatBatch | ClockTick | None:
    """The message of a record whose MAC verifies on its raw bytes under one of ``keys``,
    decoded from its canonical bytes (module docstring); ``None`` when the full path must judge
    the record."""
    raw = split_mac(value)
    if raw is None or not verify_raw_mac(raw, keys):
        return None
    try:
        message = decode_maced(raw)  # an event or a tick, as EVENTS_TOPIC_TYPES
    except SchemaError:
        return None  # decoding the whole record fails too, and says how
    return message if message.job_id == record.key else None
