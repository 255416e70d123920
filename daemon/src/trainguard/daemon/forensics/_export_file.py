"""A job's full record as one self-contained file, and back onto an embedded bus.

The file is gzip-compressed JSON Lines (``.tgjsonl.gz``). The first line is the header, every
other line one bus record of the job, topic by topic (``commands``, ``manifests``, ``audit``,
then ``events``: :data:`FILE_ORDER`), offsets ascending::

    {"format": "trainguard-job-record", "version": 1, "job_id": "j1",
     "source": "kafka://k1:9092 (prefix 'trainguard.')", "partition": 2, "partitions": 6,
     "exported_at_ms": 1767225700000, "trainguard": "0.1.0",
     "counts": {"events": 812, "commands": 2, "manifests": 6, "audit": 15}}
    {"topic": "events", "partition": 2, "offset": 0, "at_ms": 1767225600120, "key": "j1",
     "value_b64": "eyJzY2hlbWEiOiJsaWZlY3ljbGUvMS4xIiwi..."}

``value_b64`` is the record's value exactly as the bus held it (base64; ``null`` for a
tombstone), so a replay of the file decodes the same bytes the daemon decoded. ``at_ms`` is the
bus append time the daemon decided on; ``offset`` the original offset (shown by a replay, never
needed by it: inputs are matched by identity). Ticks are ``events`` records; the audit trail's
entries are ``audit`` records.

The events come last so that a reader holds the audit trail before the first event and can
replay the events as it reads them (:mod:`trainguard.daemon.forensics._export_stream`), without holding
a million records. Files written before (events first) are read all the same: readers accept
the topics in any order.

:func:`import_file` writes a file's records onto an embedded bus with their original append
times (:meth:`~trainguard.agent.bus._sqlite.SQLiteBus.import_records`); Kafka is refused, since
a Kafka topic with ``LogAppendTime`` stamps every record with the time of the import.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import gzip
import io
import os
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import orjson

from trainguard.agent.bus import (
    BusConfig,
    BusError,
    Record,
    SQLiteBus,
    TopicPartition,
    open_bus,
    parse_bus_url,
    partition_for,
)

__all__ = [
    "FILE_ORDER",
    "FORMAT",
    "JOB_TOPICS",
    "VERSION",
    "ExportHeader",
    "ImportRefused",
    "MalformedExport",
    "dump",
    "import_file",
    "load",
    "records",
]

FORMAT = "trainguard-job-record"
"""The header's ``format``."""

VERSION = 1
"""The header's ``version``: the layout this module writes and reads."""

JOB_TOPICS = ("events", "commands", "manifests", "audit")
"""The job-keyed topics a job record holds."""

FILE_ORDER = ("commands", "manifests", "audit", "events")
"""The order :func:`dump` writes the topics in: events last (module docstring)."""

_READ_BYTES = 1 << 16
"""Decompressed bytes :func:`load` reads at a time."""


class MalformedExport(ValueError):
    """The file is not a job record this version reads (named by path and line)."""


class ImportRefused(ValueError):
    """The record cannot be imported into that bus (Kafka, or the job is there already)."""


@dataclass(frozen=True, slots=True)
class ExportHeader:
    """The first line of a job record.

    Attributes:
        job_id: the job.
        source: the bus it was exported from (URL and prefix).
        partition: the job's partition there.
        partitions: partitions of ``events`` there.
        exported_at_ms: when, ms since the Unix epoch.
        trainguard: version of the trainguard that wrote it.
        counts: records per topic in the file.
    """

    job_id: str
    source: str
    partition: int
    partitions: int
    exported_at_ms: int
    trainguard: str
    counts: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The header line's object."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "job_id": self.job_id,
            "source": self.source,
            "partition": self.partition,
            "partitions": self.partitions,
            "exported_at_ms": self.exported_at_ms,
            "trainguard": self.trainguard,
            "counts": dict(self.counts),
        }


def dump(path: Path, header: ExportHeader, records: Mapping[str, Sequence[Record]]) -> int:
    """Write a job record to ``path`` (atomically: a temporary file renamed); return its size
    in bytes. ``records`` maps each of :data:`JOB_TOPICS` to the job's records on it; the
    header's ``counts`` are filled in here.

    Raises:
        OSError: the file cannot be written.
    """
    counts = {topic: len(records.get(topic, ())) for topic in JOB_TOPICS}
    header = dataclasses.replace(header, counts=counts)
    tmp = path.with_name(path.name + ".tmp")
    try:
        # No file name in the gzip header: it would be the temporary one (gzip.open's
        # default), which ``gunzip -N`` would restore.
        with tmp.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw) as out:
            out.write(orjson.dumps(header.to_json()) + b"\n")
            for topic in FILE_ORDER:
                for r in records.get(topic, ()):
                    line = {
                        "topic": topic,
                        "partition": r.partition,
                        "offset": r.offset,
                        "at_ms": r.timestamp_ms,
                        "key": r.key,
                        "value_b64": None
                        if r.value is None
                        else base64.b64encode(r.value).decode(),
                    }
                    out.write(orjson.dumps(line) + b"\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def load(path: Path) -> tuple[ExportHeader, dict[str, list[Record]]]:
    """Read and check a job record: its header and its records by topic (every one of
    :data:`JOB_TOPICS` present, possibly empty), offsets ascending.

    Raises:
        OSError: the file cannot be opened.
        MalformedExport: not gzip, truncated, not JSON Lines, not a job record, another format
            version, a record line missing a field or holding a wrong type, offsets out of
            order, or fewer or more records than the header announces.
    """
    held: dict[str, list[Record]] = {topic: [] for topic in JOB_TOPICS}
    header, lines = records(path)
    for record in lines:
        held[record.topic].append(record)
    return header, held


def records(path: Path) -> tuple[ExportHeader, Iterator[Record]]:
    """The header of the job record at ``path``, and an iterator over its records in file
    order, each checked as it is read (the file is read as the iterator advances, and closed
    when it ends).

    Raises:
        OSError: the file cannot be opened or read (here, or from the iterator).
        MalformedExport: as :func:`load`: a bad header here; a bad record line from the
            iterator when it reaches it (the records before it have been yielded), and from its
            end when the record counts differ from the header's.
    """
    items = _items(path)
    header = next(items)  # _items raises rather than end without its header
    assert isinstance(header, ExportHeader)
    return header, cast("Iterator[Record]", items)


def _items(path: Path) -> Iterator[ExportHeader | Record]:
    """:func:`records`'s header, then its records, from one read of the file."""
    header: ExportHeader | None = None
    last: dict[str, int] = {}
    held = dict.fromkeys(JOB_TOPICS, 0)
    try:
        # GzipFile's own readline is a Python method per line; a BufferedReader over it
        # splits lines in C from large reads.
        with gzip.open(path, "rb") as unzipped, io.BufferedReader(unzipped, _READ_BYTES) as f:
            number = 0
            try:
                for number, line in enumerate(f, start=1):
                    if line.isspace():  # (no copy of the line, unlike strip)
                        continue
                    try:
                        obj = orjson.loads(line)
                    except orjson.JSONDecodeError as exc:
                        raise MalformedExport(f"{path}:{number}: not JSON ({exc})") from exc
                    if header is None:
                        header = _header(obj, f"{path}:{number}")
                        yield header
                        continue
                    record = _record(obj)
                    if record is None:
                        raise _bad_record(obj, f"{path}:{number}")
                    if record.key != header.job_id:
                        raise MalformedExport(
                            f"{path}:{number}: a record keyed {record.key!r} in the record of job "
                            f"{header.job_id!r}"
                        )
                    topic = record.topic
                    if record.offset <= last.get(topic, -1):
                        raise MalformedExport(f"{path}:{number}: {topic} offsets out of order")
                    last[topic] = record.offset
                    held[topic] += 1
                    yield record
            except MalformedExport as exc:
                # A damaged byte of the compressed stream decompresses to garbage (or to other
                # valid records) well before gzip checks its CRC at the end: then the damage is
                # the reason to give.
                damage = _gzip_damage(f, path, number)
                if damage is None:
                    raise
                raise damage from exc
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise MalformedExport(f"{path}: not a complete gzip file ({exc}){_hint(path)}") from exc
    if header is None:
        raise MalformedExport(f"{path}: empty; a job record starts with a header line")
    for topic, expected in header.counts.items():
        if held.get(topic, 0) != expected:
            raise MalformedExport(
                f"{path}: the header announces {expected} {topic} records, the file holds "
                f"{held.get(topic, 0)}"
            )


def _hint(path: Path) -> str:
    """What to do about a file that is no gzip at all but starts like JSON (a decompressed
    job record), else nothing."""
    with contextlib.suppress(OSError), path.open("rb") as f:
        if f.read(2) == b'{"':
            return "; it looks like uncompressed JSON Lines: compress it with gzip first"
    return ""


def _gzip_damage(rest: Iterator[bytes], path: Path, number: int) -> MalformedExport | None:
    """Read ``rest`` of ``path``; the error to give if gzip finds it damaged (line ``number``
    was read from the damaged stream), else ``None``."""
    try:
        for _ in rest:
            pass
    except (gzip.BadGzipFile, EOFError, zlib.error) as bad:
        return MalformedExport(
            f"{path}: not a complete gzip file ({bad}; line {number} was read from the damaged "
            "stream)"
        )
    return None


def _header(obj: Any, where: str) -> ExportHeader:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise MalformedExport(f"{where}: not a trainguard job record (no {FORMAT!r} header)")
    if obj.get("version") != VERSION:
        raise MalformedExport(
            f"{where}: job record format version {obj.get('version')!r}; this trainguard "
            f"reads version {VERSION}"
        )
    try:
        counts = obj["counts"]
        if (
            not isinstance(counts, dict)
            or counts.keys() != set(JOB_TOPICS)
            or not all(_is_int(n) and n >= 0 for n in counts.values())
        ):
            # Every topic, always written: a reader that streams the events relies on the
            # counts of the others to know when the audit trail is complete.
            raise TypeError(f"counts {counts!r}: a count >= 0 for each of {', '.join(JOB_TOPICS)}")
        header = ExportHeader(
            job_id=_typed(obj["job_id"], str),
            source=_typed(obj["source"], str),
            partition=_typed(obj["partition"], int),
            partitions=_typed(obj["partitions"], int),
            exported_at_ms=_typed(obj["exported_at_ms"], int),
            trainguard=_typed(obj["trainguard"], str),
            counts=counts,
        )
    except (KeyError, TypeError) as exc:
        raise MalformedExport(f"{where}: bad header field {exc}") from exc
    return header


def _record(obj: Any) -> Record | None:
    """The record a line's object holds, or ``None`` when it is not a valid record line
    (:func:`_bad_record` says why).

    One pass over the fields with exact type checks (``orjson`` makes exact ``int``, ``str``
    and ``dict``; a ``bool`` is no offset) and ``binascii``'s strict base64 decoder instead of
    :func:`base64.b64decode` with ``validate=True``, which runs a regular expression over
    every value first: this is paid per record of a million-record file.
    """
    if type(obj) is not dict:
        return None
    topic = obj.get("topic")
    partition = obj.get("partition")
    offset = obj.get("offset")
    at_ms = obj.get("at_ms")
    key = obj.get("key", _ABSENT)
    encoded = obj.get("value_b64", _ABSENT)
    if not (
        type(topic) is str
        and topic in JOB_TOPICS
        and type(partition) is int
        and type(offset) is int
        and offset >= 0
        and type(at_ms) is int
        and (key is None or type(key) is str)
        and (encoded is None or type(encoded) is str)
    ):
        return None
    if encoded is None:
        value = None
    else:
        try:
            value = binascii.a2b_base64(encoded, strict_mode=True)
        except ValueError:  # binascii.Error, or a str that is not ASCII
            return None
    return Record(topic, partition, offset, key, value, at_ms)


_ABSENT = object()
"""A member the line lacks (``None`` is a valid key and value)."""


def _bad_record(obj: Any, where: str) -> MalformedExport:
    """Why ``obj`` (a line's object at ``where``) is not a record line, for the error."""
    if not isinstance(obj, dict):
        return MalformedExport(f"{where}: bad record (a record line must be an object)")
    if obj.get("format") == FORMAT:
        return MalformedExport(f"{where}: a second header (a file holds one job record)")
    for name in ("topic", "partition", "offset", "at_ms", "key", "value_b64"):
        if name not in obj:
            return MalformedExport(f"{where}: record without {name!r}")
    try:
        topic = _typed(obj["topic"], str)
        if topic not in JOB_TOPICS:
            raise TypeError(f"topic {topic!r} is not one of {JOB_TOPICS}")
        _typed(obj["partition"], int)
        offset = _typed(obj["offset"], int)
        if offset < 0:
            raise TypeError(f"offset {offset} < 0")
        _typed(obj["at_ms"], int)
        key = obj["key"]
        if key is not None and not isinstance(key, str):
            raise TypeError(f"key {key!r}")
        encoded = obj["value_b64"]
        if encoded is not None:
            binascii.a2b_base64(_typed(encoded, str), strict_mode=True)
    except (TypeError, ValueError) as exc:
        return MalformedExport(f"{where}: bad record ({exc})")
    return MalformedExport(f"{where}: bad record")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _typed(value: Any, kind: type) -> Any:
    if (kind is int and not _is_int(value)) or not isinstance(value, kind):
        raise TypeError(f"{value!r} is not {'an integer' if kind is int else 'a string'}")
    return value


async def import_file(path: Path, bus_url: str, prefix: str) -> tuple[ExportHeader, dict[str, int]]:
    """Write the job record at ``path`` onto the embedded bus at ``bus_url`` (topics under
    ``prefix``, created when missing), keeping every record's append time; return the header
    and the records written per topic.

    Do not run a daemon on that bus: it would take the imported job for a live one.

    Raises:
        ImportRefused: a Kafka URL, or the bus already holds events of the job.
        MalformedExport: the file is not a valid job record (nothing is written then).
        BusError: the bus cannot be opened or written.
        OSError: the file cannot be read.
    """
    kind, _ = parse_bus_url(bus_url)
    if kind != "sqlite":
        raise ImportRefused(
            "import needs an embedded bus (sqlite:///path/bus.db): Kafka topics use "
            "LogAppendTime, so the broker would stamp every record with the time of the "
            "import and a replay would no longer decide what the daemon decided; replay the "
            "file itself instead (trainguard replay JOB --file FILE)"
        )
    header, records = load(path)
    written: dict[str, int] = {}
    config = BusConfig(url=bus_url, prefix=prefix, client_id="trainguard-import")
    async with open_bus(config) as bus:
        if not isinstance(bus, SQLiteBus):
            raise ImportRefused(f"{bus_url} is not an embedded bus")
        tp = TopicPartition("events", partition_for(header.job_id, await bus.partitions("events")))
        if (await bus.end_offsets("events"))[tp] > 0 and await _holds_job(bus, tp, header.job_id):
            raise ImportRefused(
                f"{bus_url} (prefix {prefix!r}) already holds events of job {header.job_id!r}; "
                "import into a fresh bus or under another prefix"
            )
        for topic in JOB_TOPICS:
            rows = [(header.job_id, r.value, r.timestamp_ms) for r in records[topic]]
            written[topic] = len(await bus.import_records(topic, rows))
    return header, written


async def _holds_job(bus: SQLiteBus, tp: TopicPartition, job_id: str) -> bool:
    end = (await bus.end_offsets(tp.topic))[tp]
    async with await bus.assign({tp: 0}) as consumer:
        position = 0
        while position < end:
            batch = await consumer.getmany(timeout_s=5.0, max_records=10_000)
            if not batch:
                raise BusError(f"reading {tp.topic} partition {tp.partition} stalled")
            for record in batch:
                position = record.offset + 1
                if record.key == job_id:
                    return True
    return False
