"""The state-snapshot envelope (``trainguard-snapshot/2``): one job's state, compressed with
Zstandard, encrypted with AES-256-GCM and signed with Ed25519, as the daemon writes it on the
compacted ``snapshots`` topic (ARCHITECTURE.md section 6). Pure apart from the cryptography and
the compression: no I/O, no clock, no randomness (the caller passes the nonce). An envelope
larger than one bus record is cut into chunks behind a signed head
(:mod:`trainguard.daemon.service._snapshot_chunks`).

Bytes, in order::

    header_len   4 bytes, unsigned big-endian
    header       header_len bytes: a JSON object, UTF-8, keys sorted
    nonce        12 bytes (96 bits; fresh random bytes for every snapshot)
    ciphertext   AES-256-GCM(data key, nonce, zstd(encode_state(state)), aad=header); the last
                 16 bytes are the GCM tag
    signature    64 bytes: Ed25519(signing key, SIGNING_CONTEXT + every byte above)

**Compression before encryption**: AES-GCM output is indistinguishable from random bytes and
does not compress, so the state document is compressed first (Zstandard level
:data:`ZSTD_LEVEL`, one frame). Chosen by measurement (``bench/state_snapshot.py``, figures in
``bench/RESULTS.md``): on a 16,384-rank job with 8 kept manifests (a 31 MB document, mostly
SHA-256 digests in hex) zstd level 1 gives 6.0 MB in 44 ms and decompresses in 13 ms, where
zlib gives 8.3 MB in 189 ms (level 1) or 7.6 MB in 456 ms (level 6) and decompresses in
53-68 ms; zstd level 3 is slower and, on this data, larger (7.0 MB). Compressing the
plaintext leaks its compressed size, which the ciphertext's length showed anyway (it is the
state's size, not a secret the attacker can probe with chosen inputs).

The header is authenticated twice: as GCM associated data (so a ciphertext cannot be moved under
another header) and by the signature (so only the daemon's signing key can write a snapshot;
the data key alone, which any reader holding it for ``snapshots show`` has, cannot forge one).
``SIGNING_CONTEXT`` separates these signatures from the other things the daemon signs with the
same key (commands, manifests, chunk heads). Header fields (:class:`SnapshotHeader`)::

    {"compression": "zstd", "config_id": "3f0c9e1a52b7d4e8", "created_ns": 1767225600123000000,
     "data_kid": "...", "fold_config": "9a01c2d3e4f50617", "format": "trainguard-snapshot/2",
     "job_id": "j1", "layout": "<jobstate layout>", "offset": 118, "partition": 2,
     "round_digest": "<64 hex>", "round_jobs": 3, "signing_kid": "...", "state_bytes": 52114,
     "trainguard": "0.1.0"}

* ``offset``: the state covers the job's records of ``events`` partition ``partition`` below
  this offset (the next offset to fold); ``round_jobs`` and ``round_digest`` name every job the
  daemon held in the partition at that offset (:class:`Round`), which lets a loader tell a
  complete set of snapshots from a partial one (:mod:`trainguard.daemon.service._snapshot_store`).
* ``created_ns``: the state's clock (``JobState.clock_ns``, bus time), not a wall clock.
* ``compression``: ``zstd``; ``state_bytes``: the size of the ``jobstate/1`` document before
  compression. Decompression stops there: a body that decompresses to anything else is
  ``malformed`` (only the signing key could have made one, but a reader never allocates more
  than the signed size).
* ``layout``: :data:`trainguard.daemon.core._state_codec.LAYOUT`; a build whose state classes differ
  refuses the snapshot before decrypting it, unless it reads that layout too
  (:data:`~trainguard.daemon.core._state_codec.READABLE_LAYOUTS`: it only added state fields).
* ``config_id``: the writer's configuration as the audit trail names it
  (:func:`trainguard.daemon.core._audit_entry.config_id`), for forensics. ``fold_config``: the same digest
  with ``daemon_id`` left out (:func:`fold_config_id`), the part of the configuration a state
  depends on: a reader refuses a snapshot whose ``fold_config`` differs from its own, because
  continuing a fold made under other thresholds would not give the state its own fold gives.
  ``daemon_id`` is left out because it only names the issuer of commands and never enters a
  state (tested), and by default it is ``<host>-<pid>``, new at every start.

**Versions.** :func:`open_snapshot` still opens the uncompressed ``trainguard-snapshot/1``
envelopes earlier builds wrote (the same bytes, signed under ``trainguard-snapshot/1\x00``, the
header without ``compression`` and ``state_bytes``): a daemon upgraded in place then starts
from the snapshots its predecessor left instead of folding every partition from offset 0 once,
which on a large job costs minutes. It costs one branch (no decompression). An earlier build
refuses a ``/2`` envelope (``format``) and folds from the log: a downgrade is slow once, never
wrong.

:func:`open_snapshot` refuses anything else with :class:`SnapshotRefused`, whose ``code`` says
why: ``malformed``, ``format``, ``unknown_kid``, ``bad_signature``, ``wrong_job``, ``layout``,
``config``, ``tag`` (and, for chunked snapshots, ``chunk_missing`` and ``chunk_corrupt``).
Sources: AES-GCM, NIST SP 800-38D (96-bit nonces; with random nonces, at most 2**32 messages
per key, section 8.3); Ed25519, RFC 8032; Zstandard, RFC 8878.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias, get_args

import orjson
import zstandard
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from trainguard.daemon.core import (
    LAYOUT,
    READABLE_LAYOUTS,
    JobState,
    MachineConfig,
    StateFormatError,
    config_fields,
    config_id,
    decode_state,
    encode_state,
)

__all__ = [
    "FALLBACK_REASONS",
    "FORMAT",
    "FORMAT_V1",
    "NONCE_BYTES",
    "SIGNING_CONTEXT",
    "SIGNING_CONTEXT_V1",
    "ZSTD_LEVEL",
    "FallbackReason",
    "RefusalCode",
    "Round",
    "SnapshotHeader",
    "SnapshotRefused",
    "fold_config_id",
    "frame",
    "job_set_digest",
    "open_snapshot",
    "parse_header",
    "read_header",
    "seal",
]

FORMAT: Final = "trainguard-snapshot/2"
"""The envelope's format as this build writes it, the header's ``format``."""

FORMAT_V1: Final = "trainguard-snapshot/1"
"""The uncompressed format of earlier builds, still opened (module docstring)."""

SIGNING_CONTEXT: Final = b"trainguard-snapshot/2\x00"
"""Prefix of the bytes a snapshot's signature covers (domain separation from commands,
manifests and chunk heads signed with the same key, and from the earlier format)."""

SIGNING_CONTEXT_V1: Final = b"trainguard-snapshot/1\x00"
"""The signing context of :data:`FORMAT_V1` envelopes."""

ZSTD_LEVEL: Final = 1
"""Zstandard level of the state document (the module docstring has the measurements)."""

NONCE_BYTES: Final = 12
KEY_BYTES: Final = 32  # AES-256
_TAG_BYTES: Final = 16
_SIGNATURE_BYTES: Final = 64
_LENGTH: Final = struct.Struct(">I")
_MAX_HEADER_BYTES: Final = 64 * 1024
"""Larger headers are malformed (a real one is about 450 bytes)."""

RefusalCode: TypeAlias = Literal[
    "malformed",
    "format",
    "unknown_kid",
    "bad_signature",
    "wrong_job",
    "layout",
    "config",
    "tag",
    "chunk_missing",
    "chunk_corrupt",
]


_RoundProblem: TypeAlias = Literal["partition", "incomplete", "ahead"]
FallbackReason: TypeAlias = RefusalCode | _RoundProblem
"""Why a partition is rebuilt from its full log although snapshots of it exist: a snapshot
refused (:data:`RefusalCode`), one of another partition (``partition``), a round some job's
snapshot is missing from (``incomplete``), or snapshots past the consumer group's committed
position (``ahead``): see :mod:`trainguard.daemon.service._snapshot_store`."""

FALLBACK_REASONS: Final[tuple[str, ...]] = (
    *get_args(RefusalCode),
    *get_args(_RoundProblem),
)
"""Every value of :data:`FallbackReason` (the labels of the metric that counts them)."""


class SnapshotRefused(ValueError):
    """A snapshot that cannot be used.

    Attributes:
        code: ``malformed`` (not an envelope, a header field missing or of the wrong type, or a
            decrypted body that does not decompress to the signed size or is no ``jobstate/1``
            document of the header's job), ``format`` (another envelope format), ``unknown_kid``
            (a signing or data key id the reader does not hold), ``bad_signature``,
            ``wrong_job`` (a valid snapshot of another job than expected, e.g. replayed under
            another key), ``layout`` (written by a build with other state classes), ``config``
            (folded under another configuration), ``tag`` (the GCM tag does not verify: wrong
            data key or altered ciphertext); for a snapshot in chunks
            (:mod:`trainguard.daemon.service._snapshot_chunks`): ``chunk_missing`` (a chunk its
            head lists is not on the bus: deleted, or a stale head whose chunks were replaced by
            tombstones) and ``chunk_corrupt`` (a chunk whose size or SHA-256 is not the head's:
            altered, truncated, or one of another snapshot).
        reason: a sentence for people (never contains key material).
    """

    def __init__(self, code: RefusalCode, reason: str) -> None:
        super().__init__(code, reason)
        self.code: RefusalCode = code
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.code}: {self.reason}"


_ADDED_FIELDS: Final = ("bus_gap_s", "outage_settle_s", "loss_spike_false_alarm", "cut_settle_s")
"""``MachineConfig`` fields added after snapshots were first written: part of the digest only
when set to another value than their default, so that a configuration leaving them alone has
the digest that the snapshots written before they existed carry."""


def fold_config_id(config: MachineConfig) -> str:
    """The digest of the configuration a job's state depends on: the first 16 hex digits of the
    SHA-256 of :func:`~trainguard.daemon.core._audit_entry.config_fields` without ``daemon_id`` (and
    without the fields of :data:`_ADDED_FIELDS` left at their defaults), as JSON with sorted
    keys (the audit's :func:`~trainguard.daemon.core._audit_entry.config_id` with those fields left
    out)."""
    fields = config_fields(config)
    del fields["daemon_id"]
    defaults = {f.name: f.default for f in dataclasses.fields(MachineConfig)}
    for name in _ADDED_FIELDS:
        if fields[name] == defaults[name]:
            del fields[name]
    return hashlib.sha256(orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Round:
    """The jobs a daemon held in one partition at one position: what a set of snapshots
    written at ``offset`` must cover.

    Attributes:
        partition: the ``events`` partition.
        offset: the partition position (next offset to fold).
        jobs: how many jobs, >= 1.
        digest: SHA-256 (hex) of the job ids sorted, as a JSON array.
    """

    partition: int
    offset: int
    jobs: int
    digest: str

    @classmethod
    def of(cls, partition: int, offset: int, job_ids: Iterable[str]) -> Round:
        """The round of ``job_ids`` (any order, no repeats) at ``partition``/``offset``.

        Raises:
            ValueError: no job, a repeated job id, or a negative partition or offset.
        """
        ids = sorted(job_ids)
        if not ids or len(set(ids)) != len(ids):
            raise ValueError("a round names one or more distinct jobs")
        if partition < 0 or offset < 0:
            raise ValueError(f"partition {partition} and offset {offset} must be >= 0")
        return cls(partition, offset, len(ids), job_set_digest(ids))


def job_set_digest(job_ids: Iterable[str]) -> str:
    """SHA-256 (hex) of the job ids sorted, as a JSON array (:attr:`Round.digest`)."""
    return hashlib.sha256(orjson.dumps(sorted(job_ids))).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotHeader:
    """A snapshot's header (see the module docstring for each field). A ``/1`` header has no
    ``compression`` (``"none"`` here) and no ``state_bytes`` (``None`` here)."""

    format: str
    job_id: str
    partition: int
    offset: int
    round_jobs: int
    round_digest: str
    data_kid: str
    signing_kid: str
    created_ns: int
    trainguard: str
    config_id: str
    fold_config: str
    layout: str
    compression: Literal["none", "zstd"] = "none"
    state_bytes: int | None = None

    @property
    def round(self) -> Round:
        """The round this snapshot belongs to."""
        return Round(self.partition, self.offset, self.round_jobs, self.round_digest)

    def to_dict(self) -> dict[str, object]:
        """The header's JSON object as its format has it (a ``/1`` header without the fields
        that format lacks)."""
        fields = dataclasses.asdict(self)
        if self.format == FORMAT_V1:
            del fields["compression"], fields["state_bytes"]
        return fields

    def to_bytes(self) -> bytes:
        """The header as written: JSON, keys sorted, no whitespace."""
        return orjson.dumps(self.to_dict(), option=orjson.OPT_SORT_KEYS)


_INT_FIELDS_V1: Final = ("partition", "offset", "round_jobs", "created_ns")
_STR_FIELDS: Final = (
    "format",
    "job_id",
    "round_digest",
    "data_kid",
    "signing_kid",
    "trainguard",
    "config_id",
    "fold_config",
    "layout",
)
_FIELDS: Final = {
    FORMAT_V1: frozenset(_INT_FIELDS_V1 + _STR_FIELDS),
    FORMAT: frozenset((*_INT_FIELDS_V1, *_STR_FIELDS, "compression", "state_bytes")),
}
_CONTEXTS: Final = {FORMAT_V1: SIGNING_CONTEXT_V1, FORMAT: SIGNING_CONTEXT}


def seal(
    state: JobState,
    round: Round,
    *,
    signing_kid: str,
    signing_key: Ed25519PrivateKey,
    data_kid: str,
    data_key: bytes,
    nonce: bytes,
    config: MachineConfig,
    version: str,
) -> bytes:
    """Compress, encrypt and sign ``state`` (module docstring).

    Args:
        state: the job's state after folding its records of ``round.partition`` below
            ``round.offset``.
        round: the partition position and the jobs held there (the state's job among them).
        signing_kid, signing_key: the daemon's current Ed25519 key and its id.
        data_kid, data_key: the current AES-256 key (32 bytes) and its id.
        nonce: 12 fresh random bytes, never used before with ``data_key``.
        config: the configuration the state was folded under.
        version: trainguard's version, recorded in the header.

    Returns:
        The ``trainguard-snapshot/2`` envelope, of any size (the caller cuts one larger than a
        bus record into chunks).

    Raises:
        ValueError: a nonce that is not 12 bytes or a key that is not 32.
        StateFormatError: ``state`` holds a value ``jobstate/1`` cannot write.
    """
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"the nonce must be {NONCE_BYTES} bytes, not {len(nonce)}")
    if len(data_key) != KEY_BYTES:
        raise ValueError(f"the data key must be {KEY_BYTES} bytes (AES-256), not {len(data_key)}")
    document = encode_state(state)
    header = SnapshotHeader(
        format=FORMAT,
        job_id=state.job_id,
        partition=round.partition,
        offset=round.offset,
        round_jobs=round.jobs,
        round_digest=round.digest,
        data_kid=data_kid,
        signing_kid=signing_kid,
        created_ns=state.clock_ns,
        trainguard=version,
        config_id=config_id(config),
        fold_config=fold_config_id(config),
        layout=LAYOUT,
        compression="zstd",
        state_bytes=len(document),
    ).to_bytes()
    # A compressor per call: zstandard's contexts are not safe to share between threads, and
    # the daemon seals in a worker thread.
    body = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(document)
    ciphertext = AESGCM(data_key).encrypt(nonce, body, header)
    signed = _LENGTH.pack(len(header)) + header + nonce + ciphertext
    return signed + signing_key.sign(SIGNING_CONTEXT + signed)


def frame(data: bytes, trailer: int, max_header: int = _MAX_HEADER_BYTES) -> tuple[bytes, bytes]:
    """Cut ``header_len | header | rest`` (the framing the envelope and a chunk head share)
    into the header's bytes and ``rest``, which must hold at least ``trailer`` bytes.

    Args:
        data: the record value.
        trailer: the least length of ``rest``, bytes.
        max_header: the largest header accepted, bytes.

    Raises:
        SnapshotRefused: ``malformed``: too short, or a header length that does not fit.
    """
    if len(data) < _LENGTH.size + 2 + trailer:
        raise SnapshotRefused("malformed", f"{len(data)} bytes: too short for a snapshot")
    (size,) = _LENGTH.unpack_from(data)
    body = _LENGTH.size + size
    if size > max_header or body + trailer > len(data):
        raise SnapshotRefused("malformed", f"header length {size} does not fit the record")
    return data[_LENGTH.size : body], data[body:]


_ENVELOPE_TRAILER: Final = NONCE_BYTES + _TAG_BYTES + _SIGNATURE_BYTES


class _Parts:
    """An envelope cut into its parts (framing checked, nothing verified). The header is
    parsed before the rest's length is checked, so a record of another format is refused as
    such."""

    __slots__ = ("ciphertext", "header", "header_bytes", "nonce", "signature", "signed")

    def __init__(self, data: bytes) -> None:
        self.header_bytes, rest = frame(data, 0)
        self.header = _parse_header(self.header_bytes)
        if len(rest) < _ENVELOPE_TRAILER:
            raise SnapshotRefused(
                "malformed", f"{len(rest)} bytes after the header: too short for a snapshot"
            )
        self.nonce = rest[:NONCE_BYTES]
        self.ciphertext = rest[NONCE_BYTES:-_SIGNATURE_BYTES]
        self.signature = data[-_SIGNATURE_BYTES:]
        self.signed = data[:-_SIGNATURE_BYTES]


def _parse_header(raw: bytes) -> SnapshotHeader:
    try:
        fields = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise SnapshotRefused("malformed", "the header is not JSON") from None
    return parse_header(fields)


def parse_header(fields: object) -> SnapshotHeader:
    """The :class:`SnapshotHeader` of a parsed header object (of either format), checked
    field by field (a chunk head carries one too).

    Raises:
        SnapshotRefused: ``format`` (a format other than :data:`FORMAT` and
            :data:`FORMAT_V1`) or ``malformed`` (not an object, a field missing, unknown or of
            the wrong type).
    """
    if type(fields) is not dict:
        raise SnapshotRefused("malformed", "the header is not a JSON object")
    stated = fields.get("format")
    expected = _FIELDS.get(stated) if type(stated) is str else None
    if expected is None:
        shown = repr(stated)[:80]
        raise SnapshotRefused("format", f"format {shown}, expected {FORMAT!r} or {FORMAT_V1!r}")
    if fields.keys() != expected:
        missing = sorted(expected - fields.keys())
        unknown = sorted(fields.keys() - expected)
        raise SnapshotRefused(
            "malformed", f"header fields: missing {missing}, unknown {unknown[:5]}"
        )
    ints = _INT_FIELDS_V1 if stated == FORMAT_V1 else (*_INT_FIELDS_V1, "state_bytes")
    for name in ints:
        value = fields[name]
        if type(value) is not int or value < 0:
            raise SnapshotRefused("malformed", f"header {name} is not an integer >= 0")
    for name in _STR_FIELDS:
        if type(fields[name]) is not str:
            raise SnapshotRefused("malformed", f"header {name} is not a string")
    if stated == FORMAT and fields["compression"] != "zstd":
        shown = repr(fields["compression"])[:40]
        raise SnapshotRefused("malformed", f"header compression {shown}, expected 'zstd'")
    return SnapshotHeader(**fields)


def read_header(data: bytes) -> SnapshotHeader:
    """The header of snapshot ``data``, **unverified** (for listings: anyone who can write on
    the bus can write any header; use :func:`open_snapshot` before trusting it).

    Raises:
        SnapshotRefused: ``malformed`` or ``format``.
    """
    return _Parts(data).header


def open_snapshot(
    data: bytes,
    verify_keys: Mapping[str, Ed25519PublicKey],
    data_keys: Mapping[str, bytes],
    expected_job: str,
    *,
    fold_config: str | None = None,
) -> tuple[SnapshotHeader, JobState]:
    """Verify, decrypt and decompress snapshot ``data`` (``trainguard-snapshot/2``, or an
    uncompressed ``/1`` of an earlier build).

    Checks, in order: framing, format, header fields, the signing key id, the signature,
    the job, the state layout, the configuration, the data key id, the GCM tag, that the body
    decompresses to the header's ``state_bytes``, and finally that it decodes to a state of the
    header's job. Only the header's key ids are tried (no other key), so a snapshot is opened
    with the right key or not at all.

    Args:
        data: the record value (for a snapshot in chunks: the chunks joined).
        verify_keys: Ed25519 public keys by key id (current and rotated-out ones).
        data_keys: AES-256 keys (32 bytes) by key id.
        expected_job: the job the record claims (its key); a snapshot of another job is
            refused even with a valid signature.
        fold_config: the reader's :func:`fold_config_id`; ``None`` skips that check
            (inspection tools that do not fold).

    Returns:
        The verified header and the decrypted state.

    Raises:
        SnapshotRefused: with the ``code`` of the first check that failed.
        ValueError: a data key in ``data_keys`` that is not 32 bytes.
    """
    parts = _Parts(data)
    header = parts.header
    public = verify_keys.get(header.signing_kid)
    if public is None:
        raise SnapshotRefused(
            "unknown_kid", f"signed with key {header.signing_kid!r}, which this reader lacks"
        )
    try:
        public.verify(parts.signature, _CONTEXTS[header.format] + parts.signed)
    except InvalidSignature:
        raise SnapshotRefused(
            "bad_signature", f"signature does not verify with key {header.signing_kid!r}"
        ) from None
    if header.job_id != expected_job:
        raise SnapshotRefused(
            "wrong_job", f"a snapshot of job {header.job_id!r} where {expected_job!r} was expected"
        )
    if header.layout not in READABLE_LAYOUTS:
        raise SnapshotRefused("layout", f"state layout {header.layout}, this build reads {LAYOUT}")
    if fold_config is not None and header.fold_config != fold_config:
        raise SnapshotRefused(
            "config",
            f"folded under configuration {header.fold_config} (config_id {header.config_id}), "
            f"this daemon folds under {fold_config}",
        )
    key = data_keys.get(header.data_kid)
    if key is None:
        raise SnapshotRefused(
            "unknown_kid", f"encrypted with data key {header.data_kid!r}, which this reader lacks"
        )
    if len(key) != KEY_BYTES:
        raise ValueError(f"data key {header.data_kid!r} is not {KEY_BYTES} bytes")
    try:
        plain = AESGCM(key).decrypt(parts.nonce, parts.ciphertext, parts.header_bytes)
    except InvalidTag:
        raise SnapshotRefused(
            "tag", f"the GCM tag does not verify with data key {header.data_kid!r}"
        ) from None
    if header.state_bytes is not None:
        plain = _decompress(plain, header.state_bytes)
    try:
        state = decode_state(plain)
    except StateFormatError as exc:
        raise SnapshotRefused("malformed", f"the decrypted state does not decode: {exc}") from None
    if state.job_id != header.job_id:
        raise SnapshotRefused(
            "malformed", f"the header names job {header.job_id!r}, the state {state.job_id!r}"
        )
    return header, state


def _decompress(body: bytes, size: int) -> bytes:
    """The zstd frame ``body`` decompressed to exactly ``size`` bytes (the header's
    ``state_bytes``), never more.

    Raises:
        SnapshotRefused: ``malformed``: not one zstd frame, or another size.
    """
    try:
        # A frame that states its size is decompressed into a buffer of that size: it must be
        # the signed one. One that does not is bounded by max_output_size.
        stated = zstandard.frame_content_size(body)
        if stated not in (-1, size):
            raise SnapshotRefused(
                "malformed", f"the body's frame states {stated} bytes, the header says {size}"
            )
        plain = zstandard.ZstdDecompressor().decompress(body, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise SnapshotRefused("malformed", f"the body does not decompress: {exc}") from None
    if len(plain) != size:
        raise SnapshotRefused(
            "malformed", f"the body decompresses to {len(plain)} bytes, the header says {size}"
        )
    return plain
