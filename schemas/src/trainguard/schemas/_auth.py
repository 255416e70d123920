"""Authentication of wire messages: HMAC-SHA256 on events, Ed25519 signatures on commands and
manifests, both over the message's canonical bytes (``docs/wire-contract.md``,
Authentication; ARCHITECTURE.md section 6).

**Canonical bytes** of a message: its wire object without the top-level ``auth`` property,
serialised as orjson does with sorted keys (no whitespace, keys sorted by code point at every
level, shortest round-trip floats). The ``schema`` tag is part of it, so a MAC or signature
cannot be moved to a message of another type or version. A sender computes them from the
message it encodes (:func:`canonical_bytes`: ``encode`` of the message without ``auth``); a
receiver from the bytes it received: parsed, ``auth`` removed, serialised again. So a receiver
verifies exactly what it decodes (duplicate keys included: the last one wins in both), also
properties that its tolerant reader drops from a newer minor version.

**Verifying before decoding.** ``encode`` writes a MACed message as its canonical bytes with
the ``auth`` member first (it sorts first: ``{"auth":{"kid":K,"mac":M},`` + rest), so the
canonical bytes are ``{`` + rest. :func:`split_mac` cuts a received event or tick of exactly
that layout into kid, MAC and canonical bytes without decoding it, and only when those bytes
are the ones :func:`received_canonical_bytes` would compute (they are canonical themselves and
hold no other top-level ``auth``); :func:`verify_raw_mac` checks the MAC on them, and
:func:`decode_maced` decodes the canonical bytes alone into the message ``decode`` gives for the
whole. That saves validating the ``auth`` member and parsing the message a second time to
rebuild its canonical bytes. For anything else :func:`split_mac` says nothing, and
:func:`verify_mac` after ``decode`` gives the verdict, which the three never contradict.

**Keys** are passed in by the caller (``trainguard.agent.keys._keystore`` loads them): an event key
is 32 random bytes, a signing key an Ed25519 key pair (``cryptography``). A key id (``kid``)
names the key a MAC or signature was made with, so that keys can rotate.

Every failure is an :class:`Unauthenticated` (a :class:`~trainguard.schemas.SchemaError` on
the field ``auth``) whose ``code`` says why; its text names the key id, never a key.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import hashlib
import hmac
import re
from collections.abc import Mapping
from typing import Any, Final, Literal, NamedTuple, TypeAlias, TypeVar, cast

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from trainguard.schemas._codec import DEFAULT_MAX_BYTES, decode_parsed, encode
from trainguard.schemas._errors import NestingTooDeep, NotJSON, SchemaError
from trainguard.schemas._messages import (
    EVENTS_TOPIC_TYPES,
    Abort,
    Checkpoint,
    ClockTick,
    DataCursorEvent,
    Heartbeat,
    HeartbeatBatch,
    JobRequest,
    Lifecycle,
    Mac,
    Manifest,
    ManifestHead,
    Restore,
    Resume,
    Signature,
)

__all__ = [
    "AuthFailure",
    "RawMac",
    "Unauthenticated",
    "add_mac",
    "canonical_bytes",
    "decode_maced",
    "received_canonical_bytes",
    "sign",
    "split_mac",
    "verify_mac",
    "verify_raw_mac",
    "verify_signature",
]

AuthFailure: TypeAlias = Literal["missing", "unknown_kid", "bad_mac", "bad_signature"]
"""Why a message is not authentic: no ``auth`` (or not the kind expected), a key id the
verifier does not hold, a MAC or a signature that does not verify."""

_MAC_LAYOUT: Final = re.compile(
    rb'\{"auth":\{"kid":"([0-9a-f]{16})","mac":"([A-Za-z0-9+/]{43}=)"\},'
)
"""The ``auth`` member as ``encode`` writes it first, kid and MAC as the schema allows them
(``common.v1.json``: 16 lowercase hex digits; 44 characters of standard base64)."""

_Maced: TypeAlias = (
    Heartbeat | Checkpoint | DataCursorEvent | Lifecycle | ClockTick | JobRequest | HeartbeatBatch
)

_Mac = TypeVar("_Mac", bound=_Maced)
_Authenticated: TypeAlias = (
    Heartbeat
    | Checkpoint
    | DataCursorEvent
    | Lifecycle
    | Restore
    | Resume
    | Abort
    | Manifest
    | ManifestHead
    | ClockTick
    | JobRequest
    | HeartbeatBatch
)
"""The messages that carry ``auth`` (every one but a manifest's part, which its head's digest
vouches for)."""

_Signed = TypeVar("_Signed", bound=Restore | Resume | Abort | Manifest | ManifestHead)


class Unauthenticated(SchemaError):
    """A message's ``auth`` is missing, names an unknown key, or does not verify.

    Permanent for the keys the verifier holds: the same bytes fail the same way, so a receiver
    ignores or dead-letters them.

    Attributes:
        code: the :data:`AuthFailure`.
        kid: the key id the message named, or ``None`` when it named none.
        field: always ``"auth"``.
        reason: human-readable explanation (names the key id, never key material).
    """

    def __init__(self, code: AuthFailure, reason: str, kid: str | None = None) -> None:
        super().__init__("auth", reason)
        self.args = (code, reason, kid)  # so that the error pickles as it was made
        self.code: AuthFailure = code
        self.kid = kid


def canonical_bytes(message: _Authenticated) -> bytes:
    """The bytes a MAC or signature of ``message`` covers: ``encode`` of the message without
    ``auth`` (module docstring).

    Raises:
        SchemaError: ``message`` breaks the wire contract (as :func:`~trainguard.schemas.encode`).
    """
    return encode(dataclasses.replace(message, auth=None))


def received_canonical_bytes(data: bytes | bytearray | memoryview) -> tuple[bytes, Any]:
    """The canonical bytes of a received message, and its ``auth`` property as received.

    Args:
        data: the message as received (call it on bytes that
            :func:`~trainguard.schemas.decode` accepted, which bounds their size).

    Returns:
        ``(canonical bytes, auth)``; ``auth`` is the parsed property (a dict when well formed),
        or ``None`` when absent.

    Raises:
        NotJSON: ``data`` is not a JSON object.
        NestingTooDeep: it nests deeper than orjson writes (254 levels), which only unknown
            properties of a newer minor version can (the codec bounds the known ones): such a
            message has no canonical bytes, so it never verifies.
    """
    try:
        wire = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise NotJSON(None, f"not JSON: {exc.msg}") from None
    if type(wire) is not dict:
        raise NotJSON(None, "a message is a JSON object")
    auth = wire.pop("auth", None)
    try:
        return orjson.dumps(wire, option=orjson.OPT_SORT_KEYS), auth
    except orjson.JSONEncodeError:
        raise NestingTooDeep(None, "too deeply nested to have canonical bytes") from None


def add_mac(message: _Mac, kid: str, key: bytes) -> _Mac:
    """``message`` (an event or a tick) with ``auth`` set to its HMAC-SHA256 under ``key``.

    Args:
        message: a heartbeat, heartbeat batch, checkpoint, data-cursor, lifecycle, job
            request or tick message.
        kid: the key's id (16 lowercase hex digits).
        key: the job's event key, 32 bytes.

    Raises:
        SchemaError: ``message`` breaks the wire contract.
    """
    tag = hmac.new(key, canonical_bytes(message), hashlib.sha256).digest()
    return dataclasses.replace(message, auth=Mac(kid=kid, mac=base64.b64encode(tag).decode()))


def sign(message: _Signed, kid: str, key: Ed25519PrivateKey) -> _Signed:
    """``message`` (a command or a manifest) with ``auth`` set to its Ed25519 signature.

    Args:
        message: a restore, resume, abort or manifest.
        kid: the signing key's id.
        key: the daemon's Ed25519 private key.

    Raises:
        SchemaError: ``message`` breaks the wire contract.
    """
    signature = key.sign(canonical_bytes(message))
    return dataclasses.replace(
        message, auth=Signature(kid=kid, sig=base64.b64encode(signature).decode())
    )


def verify_mac(data: bytes | bytearray | memoryview, keys: Mapping[str, bytes]) -> str:
    """Check the HMAC-SHA256 of a received event or tick (constant-time comparison).

    Args:
        data: the message as received (decoded successfully before).
        keys: the event keys of the message's job that are accepted, by key id.

    Returns:
        The key id that verified.

    Raises:
        Unauthenticated: ``missing`` (no ``auth``, or no ``mac`` in it), ``unknown_kid`` (not
            in ``keys``), ``bad_mac`` (also for bytes that have no canonical form).
    """
    canonical, auth = _canonical(data, "bad_mac")
    kid, given = _auth_parts(auth, "mac")
    key = keys.get(kid)
    if key is None:
        raise Unauthenticated("unknown_kid", f"MAC under unknown event key {kid}", kid)
    expected = hmac.new(key, canonical, hashlib.sha256).digest()
    if not hmac.compare_digest(expected, _base64(given, "bad_mac", kid)):
        raise Unauthenticated("bad_mac", f"MAC under event key {kid} does not verify", kid)
    return kid


def verify_signature(
    data: bytes | bytearray | memoryview, keys: Mapping[str, Ed25519PublicKey]
) -> str:
    """Check the Ed25519 signature of a received command or manifest.

    Args:
        data: the message as received (decoded successfully before).
        keys: the daemon's public keys that are accepted, by key id.

    Returns:
        The key id that verified.

    Raises:
        Unauthenticated: ``missing`` (no ``auth``, or no ``sig`` in it), ``unknown_kid``,
            ``bad_signature`` (also for bytes that have no canonical form).
    """
    canonical, auth = _canonical(data, "bad_signature")
    kid, given = _auth_parts(auth, "sig")
    key = keys.get(kid)
    if key is None:
        raise Unauthenticated("unknown_kid", f"signed with unknown daemon key {kid}", kid)
    try:
        key.verify(_base64(given, "bad_signature", kid), canonical)
    except InvalidSignature:
        raise Unauthenticated(
            "bad_signature", f"signature of daemon key {kid} does not verify", kid
        ) from None
    return kid


class RawMac(NamedTuple):
    """A received MACed message cut into its parts without decoding it (:func:`split_mac`).

    Attributes:
        kid: the key id its ``auth`` names (16 lowercase hex digits).
        mac: the MAC as received (44 characters of standard base64).
        canonical: the message's canonical bytes (the received bytes without the ``auth``
            member): what the MAC covers, and the message without ``auth``.
        wire: ``canonical`` parsed (``orjson.loads``), which :func:`decode_maced` validates
            and builds the message from instead of parsing the bytes again (it may change it).
    """

    kid: str
    mac: str
    canonical: bytes
    wire: dict[str, Any]


def split_mac(data: bytes) -> RawMac | None:
    """Cut a received message laid out as ``encode`` writes a MACed one (module docstring)
    into key id, MAC and canonical bytes, without decoding it.

    Returns a :class:`RawMac` only when the result is exactly what :func:`verify_mac` works
    on: ``received_canonical_bytes(data) == (raw.canonical, {"kid": raw.kid, "mac": raw.mac})``.
    So the rest must be canonical already (no whitespace, keys sorted, no duplicate key, numbers
    and strings as orjson writes them) and hold no other top-level ``auth`` (the last duplicate
    would win); the ``auth`` member must be valid (as the schema has it) and ``data`` within
    ``decode``'s default size limit (:data:`DEFAULT_MAX_BYTES`), so that :func:`decode_maced`
    decodes what ``decode(data)`` does. Costs one parse and one serialisation of the canonical
    bytes (~1 us for a heartbeat).

    Args:
        data: the message as received.

    Returns:
        The parts, or ``None`` for any other layout, size or content: then ``decode`` and
        :func:`verify_mac` give the verdict.
    """
    if len(data) > DEFAULT_MAX_BYTES or (layout := _MAC_LAYOUT.match(data)) is None:
        return None
    canonical = b"{" + data[layout.end() :]
    try:
        wire = orjson.loads(canonical)
        # ``{}`` is canonical, but ``data`` (``{"auth":...,}``) is no JSON at all.
        if type(wire) is not dict or not wire or "auth" in wire:
            return None
        if orjson.dumps(wire, option=orjson.OPT_SORT_KEYS) != canonical:
            return None
    except (orjson.JSONDecodeError, orjson.JSONEncodeError):  # encode: deeper than 254 levels
        return None
    return RawMac(layout[1].decode(), layout[2].decode(), canonical, wire)


def verify_raw_mac(raw: RawMac, keys: Mapping[str, bytes]) -> bool:
    """Whether ``raw``'s MAC verifies under the key its kid names (HMAC-SHA256, RFC 2104;
    constant-time comparison): exactly when :func:`verify_mac` on the received bytes returns
    ``raw.kid`` (:func:`split_mac` guarantees the same canonical bytes, kid and MAC).

    Args:
        raw: a message cut by :func:`split_mac`.
        keys: the event keys of the message's job that are accepted, by key id.

    Returns:
        ``True`` when it verifies; ``False`` for a kid not in ``keys`` or a MAC that does not
        verify (:func:`verify_mac` says which).
    """
    key = keys.get(raw.kid)
    if key is None:
        return False
    # The layout admits only valid standard base64 with padding: strict decoding cannot fail.
    tag = binascii.a2b_base64(raw.mac, strict_mode=True)
    mac = _keyed(key).copy()
    mac.update(raw.canonical)
    return hmac.compare_digest(mac.digest(), tag)


@functools.lru_cache(maxsize=1024)
def _keyed(key: bytes) -> hmac.HMAC:
    """HMAC-SHA256 keyed with ``key``, before any message. A copy per message skips the key
    setup that ``hmac.digest`` redoes every time (~0.5 of its 1.4 us for a heartbeat). Holds
    the keys of the last 1024 used (a daemon holds them all anyway)."""
    return hmac.new(key, digestmod=hashlib.sha256)


def decode_maced(raw: RawMac) -> _Maced:
    """The event or tick ``raw`` was cut from, as ``decode`` gives it for the whole received
    bytes (``auth`` included), built from ``raw.wire`` (the canonical bytes as parsed,
    validated as ``decode`` does). Consumes ``raw.wire``: call it once per :func:`split_mac`.

    Raises:
        SchemaError: as ``decode``, for the canonical bytes; :class:`UnexpectedMessage` for a
            message of another type (whose ``auth`` is no MAC). ``decode`` of the whole fails
            then too (perhaps naming another field).
    """
    # split_mac parsed the canonical bytes already; expect admits only these types.
    message = cast("_Maced", decode_parsed(raw.wire, expect=EVENTS_TOPIC_TYPES))
    # What decoding the whole gives: the same fields and this auth (split_mac checked it as the
    # schema does). Set on the message just built, which nothing else holds yet, as a frozen
    # dataclass's own __init__ does; dataclasses.replace would cost a second construction
    # (~2.5 us, more than the rest of the check).
    object.__setattr__(message, "auth", Mac(kid=raw.kid, mac=raw.mac))
    return message


def _canonical(data: bytes | bytearray | memoryview, failure: AuthFailure) -> tuple[bytes, Any]:
    try:
        return received_canonical_bytes(data)
    except SchemaError as exc:
        raise Unauthenticated(failure, f"cannot be authenticated: {exc.reason}") from None


def _auth_parts(auth: Any, name: str) -> tuple[str, str]:
    """``(kid, value)`` of an ``auth`` object holding ``name`` (``mac`` or ``sig``)."""
    if not isinstance(auth, dict) or not isinstance(auth.get(name), str):
        what = "MAC" if name == "mac" else "signature"
        raise Unauthenticated("missing", f"no {what}: the message carries no auth.{name}")
    kid = auth.get("kid")
    if not isinstance(kid, str):
        raise Unauthenticated("missing", "auth names no key id")
    # Bounded so that a hostile kid cannot flood a log line (the schema allows 16 hex digits).
    return kid[:32], auth[name]


def _base64(text: str, failure: AuthFailure, kid: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise Unauthenticated(failure, f"auth under key {kid} is not base64", kid) from None
