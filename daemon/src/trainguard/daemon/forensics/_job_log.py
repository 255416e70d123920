"""Read a job's log, from a bus (Kafka or embedded) or from an export file, for a replay.

A job's records all sit on one partition number of each job-keyed topic (the key is the job
id; :func:`~trainguard.agent.bus._partitioner.partition_for`). :func:`read_bus` reads that
partition of ``events`` from offset 0 (the state at any point depends on everything before it)
up to the end offset at the time of the call, or to the end of a :class:`Window`, keeping the
job's records with their offsets and append times; then the job's ``audit`` entries (read
after the events, so the trail covers every event read that the daemon had folded), and its
``commands`` and ``manifests``. :func:`read_file` reads the same from a file written by
:mod:`trainguard.daemon.forensics._export_file`. :func:`replay_file` replays a whole file's job as it reads it
(:mod:`trainguard.daemon.forensics._export_stream`), holding none of its events.

A window narrows what a replay shows and verifies: by bus time (``since_ms``/``until_ms``) or
by offset on the job's ``events`` partition (``from_offset``/``to_offset``), both ends
inclusive. Reading stops at the window's end; the records before its start are read and folded
all the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from trainguard.agent.bus import (
    Bus,
    BusConfig,
    KafkaSecurity,
    Record,
    TopicPartition,
    open_bus,
    partition_for,
)
from trainguard.daemon.core import (
    AuditTrail,
    MachineConfig,
    MalformedAudit,
    entries_by_job,
    read_trail,
)
from trainguard.daemon.forensics._export_file import ExportHeader, load
from trainguard.daemon.forensics._export_stream import EventStream
from trainguard.daemon.forensics._replay import Replay, replay

__all__ = [
    "FileReplay",
    "JobLog",
    "UnknownJob",
    "Window",
    "parse_time",
    "read_bus",
    "read_file",
    "replay_file",
]

_IDLE_TIMEOUT_S = 30.0
"""Seconds without a record, while records are known to be left, before reading gives up."""


class UnknownJob(LookupError):
    """The source holds no record of the job (or none in the window)."""


def parse_time(text: str) -> int:
    """A time given as ms since the Unix epoch (``1767225600123``) or ISO 8601
    (``2026-01-01T00:00:00.123Z``; without a zone, UTC), in ms since the epoch.

    Raises:
        ValueError: neither.
    """
    if text.strip().isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"{text!r} is neither ms since the epoch nor an ISO 8601 time "
            "(e.g. 2026-01-01T12:00:00Z)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return round(moment.timestamp() * 1000)


@dataclass(frozen=True, slots=True)
class Window:
    """Part of a job's log to show and verify; every bound optional and inclusive.

    Attributes:
        since_ms: first bus time, ms since the Unix epoch.
        until_ms: last bus time.
        from_offset: first offset on the job's ``events`` partition.
        to_offset: last offset.

    Raises:
        ValueError: a negative offset or an end before its start.
    """

    since_ms: int | None = None
    until_ms: int | None = None
    from_offset: int | None = None
    to_offset: int | None = None

    def __post_init__(self) -> None:
        for name in ("from_offset", "to_offset"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        pairs = (
            ("since", self.since_ms, self.until_ms),
            ("from", self.from_offset, self.to_offset),
        )
        for name, first, last in pairs:
            if first is not None and last is not None and last < first:
                raise ValueError(f"the window ends ({last}) before it starts ({first}) ({name})")

    def before(self, record: Record) -> bool:
        """``record`` comes before the window's start."""
        return (self.since_ms is not None and record.timestamp_ms < self.since_ms) or (
            self.from_offset is not None and record.offset < self.from_offset
        )

    def after(self, record: Record) -> bool:
        """``record`` comes after the window's end."""
        return (self.until_ms is not None and record.timestamp_ms > self.until_ms) or (
            self.to_offset is not None and record.offset > self.to_offset
        )

    @property
    def bounded(self) -> bool:
        """Some bound is set."""
        return any(
            v is not None for v in (self.since_ms, self.until_ms, self.from_offset, self.to_offset)
        )


@dataclass(frozen=True, slots=True)
class JobLog:
    """What a source holds of one job.

    Attributes:
        job_id: the job.
        source: where it was read: the bus URL (and prefix) or the file.
        partition: the job's partition of ``events`` (in the source it was first written to,
            for a file).
        partitions: partitions of ``events`` there.
        events: the job's records on ``events``, offsets ascending, from offset 0 up to the
            window's end.
        start: index in ``events`` of the window's first record (``len(events)`` when the
            window holds none).
        audit: the job's ``audit`` records in order.
        commands: the job's ``commands`` records (a compacted topic: older ones may be gone).
        manifests: the job's ``manifests`` records.
        window: the window read.
        header: the export file's header, for a file.
    """

    job_id: str
    source: str
    partition: int
    partitions: int
    events: tuple[Record, ...]
    start: int
    audit: tuple[Record, ...]
    commands: tuple[Record, ...]
    manifests: tuple[Record, ...]
    window: Window
    header: ExportHeader | None = None

    def trail(self) -> AuditTrail:
        """The job's audit trail, parsed.

        Raises:
            MalformedAudit: an entry is not JSON or not in the audit format (named by offset).
        """
        return _trail(self.job_id, self.audit)


def _trail(job_id: str, audit: Sequence[Record]) -> AuditTrail:
    return read_trail(entries_by_job(audit).get(job_id, []))


async def read_bus(
    bus_url: str,
    prefix: str,
    job_id: str,
    window: Window = Window(),
    *,
    connect_timeout_s: float = 15.0,
    security: KafkaSecurity | None = None,
) -> JobLog:
    """Read ``job_id``'s log from the bus at ``bus_url`` with topic prefix ``prefix``.

    ``security`` holds the Kafka TLS/SASL settings (``None``: plaintext; ignored by the
    embedded bus); ``connect_timeout_s`` bounds the connection, seconds.

    Raises:
        UnknownJob: no record of the job on ``events``, or none in ``window``.
        BusError: the bus cannot be reached or read (``BusURLError`` for a bad URL).
        TimeoutError: the bus stopped delivering records known to exist for
            :data:`_IDLE_TIMEOUT_S` seconds.
    """
    config = BusConfig(
        url=bus_url,
        prefix=prefix,
        client_id="trainguard-replay",
        connect_timeout_s=connect_timeout_s,
        security=security or KafkaSecurity(),
        create=False,  # a read: a mistyped embedded-bus path must not become a new file
    )
    async with open_bus(config) as bus:
        partitions = await bus.partitions("events")
        partition = partition_for(job_id, partitions)
        events = await _read_partition(bus, "events", job_id, stop=window.after)
        audit = await _read_partition(bus, "audit", job_id)
        commands = await _read_partition(bus, "commands", job_id)
        manifests = await _read_partition(bus, "manifests", job_id)
    return _job_log(
        job_id,
        f"{bus_url} (prefix {prefix!r})",
        partition,
        partitions,
        window,
        {"events": events, "audit": audit, "commands": commands, "manifests": manifests},
    )


def read_file(path: Path, job_id: str | None = None, window: Window = Window()) -> JobLog:
    """Read a job's log from an export file (:mod:`trainguard.daemon.forensics._export_file`).

    Args:
        path: the file.
        job_id: the job expected in it; ``None`` takes the file's.
        window: part of the log to show and verify.

    Raises:
        OSError: the file cannot be read.
        MalformedExport: it is not a valid export file.
        UnknownJob: it holds another job, or no record of it in ``window``.
    """
    header, records = load(path)
    if job_id is not None and job_id != header.job_id:
        raise UnknownJob(f"{path} holds job {header.job_id!r}, not {job_id!r}")
    events = [r for r in records["events"] if not window.after(r)]
    return _job_log(
        header.job_id,
        str(path),
        header.partition,
        header.partitions,
        window,
        {**records, "events": events},
        header,
    )


@dataclass(frozen=True, slots=True)
class FileReplay:
    """A whole export file's job, replayed as it was read (:func:`replay_file`).

    Attributes:
        job_id: the job.
        source: the file.
        partition: the job's partition of ``events`` where the file was exported from.
        trail: the job's audit trail.
        result: the replay (verify it with :func:`~trainguard.daemon.forensics._replay.verify`).
        count: events read.
        first: the first event record.
        last: the last event record.
    """

    job_id: str
    source: str
    partition: int
    trail: AuditTrail
    result: Replay
    count: int
    first: Record
    last: Record


def replay_file(
    path: Path,
    job_id: str | None,
    default: MachineConfig,
    *,
    timeline: bool = True,
    process: bool | None = None,
) -> FileReplay:
    """Replay the job of the export file at ``path`` (all of it: no window) while the file is
    read, by a reader process for a large file (:class:`~trainguard.daemon.forensics._export_stream.
    EventStream`; ``process`` forces it on or off); as :func:`read_file` and
    :func:`~trainguard.daemon.forensics._replay.replay` in turn, with the same result, holding none of the
    events.

    Args:
        path: the file.
        job_id: the job expected in it; ``None`` takes the file's.
        default: the configuration to fold under when the trail records none.
        timeline: build the timeline's rows (``replay``'s argument).
        process: read in a reader process (``None``: by the file's size).

    Raises:
        OSError: the file cannot be read.
        MalformedExport: it is not a valid export file (found while reading it: the replay is
            then discarded); also when its audit trail does not parse and the rest of the file
            is damaged.
        MalformedAudit: its audit trail is not valid (in an intact file).
        UnknownJob: it holds another job, or no event.
    """
    with EventStream(path, process=process) as stream:
        header = stream.header
        assert header is not None  # set on entry
        if job_id is not None and job_id != header.job_id:
            raise UnknownJob(f"{path} holds job {header.job_id!r}, not {job_id!r}")
        try:
            trail = _trail(header.job_id, stream.others["audit"])
            result = replay(header.job_id, stream, trail, default, timeline=timeline)
        except MalformedAudit:
            # The audit records come first, before gzip could check the file: read the rest,
            # so that damage to the file is named as such (and as read_file would name it).
            for _ in stream:
                pass
            raise
        if stream.first is None or stream.last is None:
            raise UnknownJob(f"{path} holds no event of job {header.job_id!r}")
        return FileReplay(
            job_id=header.job_id,
            source=str(path),
            partition=header.partition,
            trail=trail,
            result=result,
            count=stream.count,
            first=stream.first,
            last=stream.last,
        )


def _job_log(
    job_id: str,
    source: str,
    partition: int,
    partitions: int,
    window: Window,
    records: dict[str, list[Record]],
    header: ExportHeader | None = None,
) -> JobLog:
    events = records["events"]
    if not events:
        raise UnknownJob(f"{source} holds no event of job {job_id!r}")
    start = next((i for i, r in enumerate(events) if not window.before(r)), len(events))
    if start == len(events):
        raise UnknownJob(f"{source} holds no event of job {job_id!r} in the window")
    return JobLog(
        job_id=job_id,
        source=source,
        partition=partition,
        partitions=partitions,
        events=tuple(events),
        start=start,
        audit=tuple(records["audit"]),
        commands=tuple(records["commands"]),
        manifests=tuple(records["manifests"]),
        window=window,
        header=header,
    )


async def _read_partition(
    bus: Bus, topic: str, job_id: str, *, stop: Callable[[Record], bool] | None = None
) -> list[Record]:
    """The records keyed ``job_id`` on its partition of ``topic``, from offset 0 to the end
    offset at the time of the call, or up to the first record for which ``stop`` holds."""
    tp = TopicPartition(topic, partition_for(job_id, await bus.partitions(topic)))
    end = (await bus.end_offsets(topic))[tp]
    out: list[Record] = []
    if end == 0:
        return out
    position = 0
    idle_since = time.monotonic()
    async with await bus.assign({tp: 0}) as consumer:
        while position < end:
            batch = await consumer.getmany(timeout_s=1.0, max_records=10_000)
            if not batch:
                # Past transaction markers, which no record carries (the daemon's writes).
                position = await consumer.position(tp)
                if position < end and time.monotonic() - idle_since > _IDLE_TIMEOUT_S:
                    raise TimeoutError(
                        f"reading {topic} partition {tp.partition} stalled at offset {position} "
                        f"of {end}"
                    )
                continue
            idle_since = time.monotonic()
            for record in batch:
                if record.offset >= end or (stop is not None and stop(record)):
                    return out
                if record.key == job_id:
                    out.append(record)
            position = await consumer.position(tp)
    return out
