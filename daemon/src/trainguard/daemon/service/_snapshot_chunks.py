"""State snapshots larger than one bus record: the sealed envelope
(:mod:`trainguard.daemon.service._snapshot_envelope`) cut into *chunk* records behind one small
signed *head* record. Pure apart from hashing and signing: no I/O.

A job's snapshot is always the latest record of the job's key on ``snapshots``: either the
envelope itself, when it fits one record (``max_message_bytes``), or its head. The head lists
the chunks, whose records sit on the same partition under keys of their own
(:func:`chunk_key`: ``<job>/chunk/<offset>/<index>``; a job id never holds ``/``, since
snapshot ids use it to separate the job from the generation). Keys, not offsets, name the
chunks because the topic is compacted: compaction keeps the latest record of each key, so the
chunks of the latest snapshot stay and those of a superseded one are deleted once the writer has
sent a tombstone (a null value) for each of their keys, in the transaction that writes the new
head (:mod:`trainguard.daemon.service._snapshot_store`).

Head bytes, framed as the envelope is::

    header_len   4 bytes, unsigned big-endian
    header       a JSON object, UTF-8, keys sorted (below)
    signature    64 bytes: Ed25519(signing key, HEAD_CONTEXT + every byte above)

    {"bytes": 6012345, "chunks": [[1002058, "<sha256 hex>"], ...], "format":
     "trainguard-snapshot-head/1", "sha256": "<sha256 hex of the envelope>",
     "snapshot": {<the envelope's header, every field>}}

``chunks`` gives each chunk's size and SHA-256 in order, ``bytes`` and ``sha256`` the whole
envelope's. The head is signed with the key that signed the envelope (``snapshot.signing_kid``),
under its own context (:data:`HEAD_CONTEXT`), so it cannot pass for an envelope or a command.

:func:`join` verifies every chunk against the head before anything is decrypted and says which
one is wrong: ``chunk_missing`` (a chunk not on the bus: deleted, or a stale head whose chunks
were replaced by tombstones) or ``chunk_corrupt`` (another size or digest: a flipped byte, a
truncated chunk, or a chunk of another snapshot put in its place). The joined envelope is then
opened as any other (its own signature, tag and checks), and its header must be the head's.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from trainguard.daemon.core import JobState
from trainguard.daemon.service._snapshot_envelope import (
    FORMAT,
    SnapshotHeader,
    SnapshotRefused,
    frame,
    open_snapshot,
    parse_header,
    read_header,
)

__all__ = [
    "HEAD_CONTEXT",
    "HEAD_FORMAT",
    "Chunk",
    "Head",
    "chunk_job",
    "chunk_key",
    "head_of",
    "join",
    "open_record",
    "read_record_header",
    "split",
]

HEAD_FORMAT: Final = "trainguard-snapshot-head/1"
"""A head's ``format``."""

HEAD_CONTEXT: Final = b"trainguard-snapshot-head/1\x00"
"""Prefix of the bytes a head's signature covers (domain separation from envelopes, commands
and manifests signed with the same key)."""

_SIGNATURE_BYTES: Final = 64
_SHA256_HEX: Final = re.compile(r"[0-9a-f]{64}")
_CHUNK_KEY: Final = re.compile(r"(?P<job>[^/]+)/chunk/(?P<offset>[0-9]+)/(?P<index>[0-9]+)")
_HEAD_FIELDS: Final = frozenset({"bytes", "chunks", "format", "sha256", "snapshot"})


def chunk_key(job: str, offset: int, index: int) -> str:
    """The key of chunk ``index`` (from 0) of ``job``'s snapshot at ``offset``."""
    return f"{job}/chunk/{offset}/{index}"


def chunk_job(key: str) -> str | None:
    """The job whose chunk ``key`` names (:func:`chunk_key`), or ``None`` for a key that is
    no chunk's (a job's own key)."""
    match = _CHUNK_KEY.fullmatch(key)
    return None if match is None else match["job"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk as a head lists it.

    Attributes:
        key: its record key (:func:`chunk_key`).
        size: its length, bytes, >= 1.
        sha256: its SHA-256, 64 lower-case hex digits.
    """

    key: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Head:
    """A head record, parsed (its signature checked or not, as the function that made it
    says).

    Attributes:
        header: the header of the envelope the chunks make up.
        chunks: the chunks in order, >= 1.
        size: the envelope's length, bytes (the chunks' sizes added up).
        sha256: the envelope's SHA-256, hex.
    """

    header: SnapshotHeader
    chunks: tuple[Chunk, ...]
    size: int
    sha256: str


def split(
    sealed: bytes, limit: int, signing_key: Ed25519PrivateKey
) -> tuple[bytes, list[tuple[str, bytes]]]:
    """Cut envelope ``sealed`` into chunks of at most ``limit`` bytes and sign their head.

    The chunks are of equal size but for the last (``ceil(len / ceil(len / limit))`` bytes),
    which spreads the bytes evenly instead of leaving a sliver.

    Args:
        sealed: a ``trainguard-snapshot/2`` envelope (:func:`~._snapshot_envelope.seal`).
        limit: the largest chunk, bytes (the bus's ``max_message_bytes``), >= 1.
        signing_key: the key that signed ``sealed`` (its header's ``signing_kid``).

    Returns:
        The head's bytes, and the chunks as ``(key, value)`` in order.

    Raises:
        ValueError: ``limit`` < 1.
        SnapshotRefused: ``sealed`` has no readable ``/2`` header (a caller's bug).
    """
    if limit < 1:
        raise ValueError(f"the chunk limit must be >= 1 byte, not {limit}")
    header = read_header(sealed)
    if header.format != FORMAT:
        raise SnapshotRefused("format", f"only {FORMAT} envelopes are cut into chunks")
    count = math.ceil(len(sealed) / limit)
    size = math.ceil(len(sealed) / count)
    pieces = [sealed[i : i + size] for i in range(0, len(sealed), size)]
    keyed = [(chunk_key(header.job_id, header.offset, i), p) for i, p in enumerate(pieces)]
    document = {
        "bytes": len(sealed),
        "chunks": [[len(p), hashlib.sha256(p).hexdigest()] for p in pieces],
        "format": HEAD_FORMAT,
        "sha256": hashlib.sha256(sealed).hexdigest(),
        "snapshot": header.to_dict(),
    }
    raw = orjson.dumps(document, option=orjson.OPT_SORT_KEYS)
    signed = len(raw).to_bytes(4, "big") + raw
    return signed + signing_key.sign(HEAD_CONTEXT + signed), keyed


def head_of(value: bytes) -> Head | None:
    """The head in record ``value``, **unverified**, or ``None`` when ``value`` is no head (an
    envelope, or bytes of no known format: :func:`~._snapshot_envelope.open_snapshot` says
    what is wrong with those).

    Raises:
        SnapshotRefused: ``malformed``: a head whose fields are missing, unknown or of the
            wrong type, or ``format``/``malformed`` for its ``snapshot`` header.
    """
    try:
        # A head's header grows with its chunks (75 bytes each); the record bounds it.
        raw, _ = frame(value, _SIGNATURE_BYTES, max_header=len(value))
        fields = orjson.loads(raw)
    except (SnapshotRefused, orjson.JSONDecodeError):
        return None
    if type(fields) is not dict or fields.get("format") != HEAD_FORMAT:
        return None
    if fields.keys() != _HEAD_FIELDS:
        missing = sorted(_HEAD_FIELDS - fields.keys())
        unknown = sorted(fields.keys() - _HEAD_FIELDS)[:5]
        raise SnapshotRefused("malformed", f"head fields: missing {missing}, unknown {unknown}")
    header = parse_header(fields["snapshot"])
    if header.format != FORMAT:
        raise SnapshotRefused("malformed", f"a head of a {header.format} envelope")
    listed = fields["chunks"]
    if type(listed) is not list or not listed:
        raise SnapshotRefused("malformed", "the head lists no chunks")
    chunks: list[Chunk] = []
    for index, item in enumerate(listed):
        if (
            type(item) is not list
            or len(item) != 2
            or type(item[0]) is not int
            or item[0] < 1
            or type(item[1]) is not str
            or not _SHA256_HEX.fullmatch(item[1])
        ):
            raise SnapshotRefused("malformed", f"head chunk {index} is not [size, sha256]")
        chunks.append(Chunk(chunk_key(header.job_id, header.offset, index), item[0], item[1]))
    size, digest = fields["bytes"], fields["sha256"]
    if type(size) is not int or size != sum(c.size for c in chunks):
        raise SnapshotRefused("malformed", "the head's bytes are not its chunks' sizes added up")
    if type(digest) is not str or not _SHA256_HEX.fullmatch(digest):
        raise SnapshotRefused("malformed", "the head's sha256 is not 64 hex digits")
    return Head(header, tuple(chunks), size, digest)


def _verified_head(
    value: bytes, verify_keys: Mapping[str, Ed25519PublicKey], expected_job: str
) -> Head | None:
    """:func:`head_of` with its signature checked (``None``: no head).

    Raises:
        SnapshotRefused: as :func:`head_of`, ``unknown_kid``, ``bad_signature``, or
            ``wrong_job`` (a valid head of another job under ``expected_job``'s key).
    """
    head = head_of(value)
    if head is None:
        return None
    kid = head.header.signing_kid
    public = verify_keys.get(kid)
    if public is None:
        raise SnapshotRefused(
            "unknown_kid", f"head signed with key {kid!r}, which this reader lacks"
        )
    try:
        public.verify(value[-_SIGNATURE_BYTES:], HEAD_CONTEXT + value[:-_SIGNATURE_BYTES])
    except InvalidSignature:
        raise SnapshotRefused(
            "bad_signature", f"the head's signature does not verify with key {kid!r}"
        ) from None
    if head.header.job_id != expected_job:
        raise SnapshotRefused(
            "wrong_job", f"a head of job {head.header.job_id!r} where {expected_job!r} was expected"
        )
    return head


def join(head: Head, chunks: Mapping[str, bytes]) -> bytes:
    """The envelope ``head``'s chunks make up, each checked against the head first.

    Args:
        head: a head whose signature was checked.
        chunks: chunk key -> value, the latest records of the head's partition (other keys
            are ignored).

    Raises:
        SnapshotRefused: ``chunk_missing`` naming the first chunk not in ``chunks``, or
            ``chunk_corrupt`` naming the first whose size or SHA-256 is not the head's (or,
            each being right, a whole whose digest is not: a head that contradicts itself).
    """
    total = len(head.chunks)
    pieces: list[bytes] = []
    for index, chunk in enumerate(head.chunks):
        value = chunks.get(chunk.key)
        if value is None:
            raise SnapshotRefused(
                "chunk_missing",
                f"chunk {index + 1} of {total} ({chunk.key!r}) is not on the bus (deleted, or "
                "the head is older than the latest chunks)",
            )
        if len(value) != chunk.size:
            raise SnapshotRefused(
                "chunk_corrupt",
                f"chunk {index + 1} of {total} ({chunk.key!r}) holds {len(value)} bytes, the "
                f"head says {chunk.size}",
            )
        if hashlib.sha256(value).hexdigest() != chunk.sha256:
            raise SnapshotRefused(
                "chunk_corrupt",
                f"chunk {index + 1} of {total} ({chunk.key!r}) is not the one the head lists "
                "(its SHA-256 differs: altered, or of another snapshot)",
            )
        pieces.append(value)
    whole = b"".join(pieces)
    if hashlib.sha256(whole).hexdigest() != head.sha256:
        raise SnapshotRefused("chunk_corrupt", "the chunks joined are not the head's snapshot")
    return whole


def open_record(
    value: bytes,
    chunks: Mapping[str, bytes],
    verify_keys: Mapping[str, Ed25519PublicKey],
    data_keys: Mapping[str, bytes],
    expected_job: str,
    *,
    fold_config: str | None = None,
) -> tuple[SnapshotHeader, JobState]:
    """Open the snapshot whose record (the latest of ``expected_job``'s key) is ``value``: an
    envelope, or a head whose chunks are in ``chunks`` (:func:`join`). Arguments, checks and
    result are :func:`~._snapshot_envelope.open_snapshot`'s, after the head's signature and
    job and every chunk; the envelope's header must be the head's.

    Raises:
        SnapshotRefused: as :func:`_verified_head`, :func:`join` and
            :func:`~._snapshot_envelope.open_snapshot`; ``malformed`` for an envelope whose
            header is not its head's.
        ValueError: a data key in ``data_keys`` that is not 32 bytes.
    """
    head = _verified_head(value, verify_keys, expected_job)
    if head is None:
        return open_snapshot(value, verify_keys, data_keys, expected_job, fold_config=fold_config)
    header, state = open_snapshot(
        join(head, chunks), verify_keys, data_keys, expected_job, fold_config=fold_config
    )
    if header != head.header:
        raise SnapshotRefused("malformed", "the joined snapshot's header is not its head's")
    return header, state


def read_record_header(value: bytes) -> tuple[SnapshotHeader, Head | None]:
    """The header of the snapshot whose record is ``value`` (an envelope, or a head, which is
    returned too), **unverified** (for listings).

    Raises:
        SnapshotRefused: ``malformed`` or ``format``.
    """
    head = head_of(value)
    if head is not None:
        return head.header, head
    return read_header(value), None
