"""An export file's events handed to a replay as they are read, by a reader process for a large
file, so that reading (gunzip, JSON, base64, the file's checks) runs beside decoding and folding.

:class:`EventStream` gives the file's header and its ``commands``, ``manifests`` and ``audit``
records first (what a replay needs before the first event: the audit trail), then iterates over
its ``events`` records in order, keeping none. A file whose events come first (written before
:data:`~trainguard.daemon.forensics._export_file.FILE_ORDER` put them last) is read whole first.

From :data:`PROCESS_MIN_BYTES` up, a reader process (``python -P -m`` this module, a plain
subprocess: ``multiprocessing``'s ``spawn`` would import the caller's main module again, and
``fork`` is unsafe in a process that holds threads) reads the file and writes the records in
pickled batches of :data:`BATCH`, each behind its length, to a pipe of its own (not its
standard output, where anything the interpreter or a ``sitecustomize`` prints would land), through
a buffered writer (a raw write may be cut short by a signal, say a stop and continue); the
pipe's buffer bounds what is in flight. Its standard error goes to a temporary file (a pipe
nobody reads until the end would block it after 64 KiB, e.g. with ``PYTHONVERBOSE``), whose
last line is quoted if it fails. Only this process's own reader writes that pipe, and it
pickles records it built itself (strings, bytes, integers), so unpickling it trusts no file
content. A smaller file is read in the calling process (starting the reader process costs
about 0.2 s). Both run the same reader, :func:`_messages`, over
:func:`~trainguard.daemon.forensics._export_file.records`, so both read and check the file as
:func:`~trainguard.daemon.forensics._export_file.load` does. A fault is raised where the iteration reaches it
(:class:`~trainguard.daemon.forensics._export_file.MalformedExport`, or :class:`OSError`), after the records
before it: a caller must finish the iteration before trusting what it folded.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import signal
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from itertools import repeat
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Literal, NoReturn, Self, TypeAlias

from trainguard.agent.bus import Record
from trainguard.daemon.forensics._export_file import (
    JOB_TOPICS,
    ExportHeader,
    MalformedExport,
    records,
)

__all__ = ["BATCH", "PIPE_BYTES", "PROCESS_MIN_BYTES", "EventStream"]

PROCESS_MIN_BYTES = 8 << 20
"""Compressed size (bytes) from which a reader process reads the file: about 250,000 events,
3-4 s of replay, against about 0.2 s to start the process."""

BATCH = 1024
"""Records per message from the reader process (pickled as columns: about 0.15 us a record to
unpickle and rebuild, against about 4 us to read one from the file)."""

PIPE_BYTES = 1 << 20
"""Buffer asked for the reader's pipe (Linux; 1 MiB is the default most an unprivileged process
may set): about four batches of heartbeats."""

_OTHERS = tuple(topic for topic in JOB_TOPICS if topic != "events")

_Message: TypeAlias = (
    tuple[Literal["head"], ExportHeader, dict[str, list[Record]]]
    | tuple[Literal["events"], list[Record]]
    | tuple[Literal["end"], None]
    | tuple[Literal["malformed", "oserror"], str]
)
"""What the reader says: the header and every record of the other topics (once, first), a
batch of events, the end, or the fault that stopped it (its message)."""


def _messages(path: Path) -> Iterator[_Message]:
    """Read ``path`` into :data:`_Message`\\ s, ending with ``end`` or a fault."""
    try:
        header, lines = records(path)
        others: dict[str, list[Record]] = {topic: [] for topic in _OTHERS}
        # Events read before the other topics are complete (a file with events first) wait.
        waiting: list[Record] | None = []
        missing = sum(header.counts.get(topic, 0) for topic in _OTHERS)
        if missing <= 0:
            yield ("head", header, others)
            waiting = None
        batch: list[Record] = []
        for record in lines:
            if record.topic == "events":
                if waiting is not None:
                    waiting.append(record)
                    continue
                batch.append(record)
                if len(batch) >= BATCH:
                    yield ("events", batch)
                    batch = []
                continue
            others[record.topic].append(record)
            missing -= 1
            if missing == 0 and waiting is not None:
                yield ("head", header, others)
                for i in range(0, len(waiting), BATCH):
                    yield ("events", waiting[i : i + BATCH])
                waiting = None
        # Fewer records of the other topics than announced: records() raised at its end.
        if batch:
            yield ("events", batch)
        yield ("end", None)
    except MalformedExport as exc:
        yield ("malformed", str(exc))
    except OSError as exc:
        yield ("oserror", str(exc))


def _serve(path: Path, out: BinaryIO) -> None:
    """The reader process: write ``path``'s messages to ``out`` (a buffered writer: it writes
    everything it is given), each as its length (4 bytes, big-endian) and its pickle; a batch
    of events as columns (:func:`_columns`)."""
    for message in _messages(path):
        sent = ("columns", _columns(message[1])) if message[0] == "events" else message
        frame = pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL)
        out.write(_LENGTH.pack(len(frame)))
        out.write(frame)
    out.flush()


_LENGTH = struct.Struct(">I")

_Columns: TypeAlias = tuple[list[int], list[int], list[int], list[bytes | None]]
"""A batch of events as its partitions, offsets, append times and values (the key is the
job's): half the cost to unpickle and rebuild of a list of records."""


def _columns(batch: list[Record]) -> _Columns:
    return (
        [r.partition for r in batch],
        [r.offset for r in batch],
        [r.timestamp_ms for r in batch],
        [r.value for r in batch],
    )


_new_record = functools.partial(tuple.__new__, Record)
"""``Record`` built from one tuple of its fields in C (its ``__new__`` is Python code)."""


def _records(columns: _Columns, key: str) -> list[Record]:
    partitions, offsets, times, values = columns
    return list(
        map(_new_record, zip(repeat("events"), partitions, offsets, repeat(key), values, times))
    )


def _received(
    reader: subprocess.Popen[bytes], pipe: BinaryIO, errors: BinaryIO
) -> Iterator[_Message]:
    """The reader process's messages from ``pipe``, up to the last one; ``errors`` is its
    standard error."""
    key = ""
    while True:
        head = pipe.read(_LENGTH.size)
        size = _LENGTH.unpack(head)[0] if len(head) == _LENGTH.size else -1
        frame = pipe.read(size) if size > 0 else b""
        try:
            if len(frame) != size:  # it ended before its last message, maybe in a frame
                raise EOFError
            message = pickle.loads(frame)
        except (EOFError, pickle.UnpicklingError, ValueError, TypeError):
            yield ("oserror", _died(reader, errors))
            return
        if message[0] == "columns":
            message = ("events", _records(message[1], key))
        elif message[0] == "head":
            key = message[1].job_id  # every record's: records() checked
        yield message
        if message[0] not in ("head", "events"):
            return


def _died(reader: subprocess.Popen[bytes], errors: BinaryIO) -> str:
    """Why the reader process stopped short: its exit status or signal, and the last line it
    wrote to standard error."""
    code = reader.wait()
    how = f"exit status {code}"
    if code < 0:
        with contextlib.suppress(ValueError):
            how = f"killed by {signal.Signals(-code).name}"
    errors.seek(0)
    last = errors.read().decode(errors="replace").strip().splitlines()[-1:]
    return f"the export reader process ended ({how}){''.join(f': {line}' for line in last)}"


class EventStream:
    """An export file's records, the events as they are read (module docstring).

    Use as a context manager (it ends the reader process); the header and the other topics'
    records are there on entry, the events come from iterating (once).

    Attributes:
        path: the file.
        header: its header.
        others: its ``commands``, ``manifests`` and ``audit`` records, by topic.
        count: events yielded so far.
        first: the first event, once yielded.
        last: the last event yielded so far.
        process: whether a reader process reads the file.
    """

    def __init__(self, path: Path, *, process: bool | None = None) -> None:
        """Prepare to read ``path``; ``process`` forces the reader process on or off (``None``:
        from :data:`PROCESS_MIN_BYTES` up).

        Raises:
            OSError: the file cannot be opened.
        """
        self.path = path
        size = path.stat().st_size
        # (The reader process is POSIX: it is handed its pipe with ``pass_fds``.)
        by_size = size >= PROCESS_MIN_BYTES and os.name == "posix"
        self.process = by_size if process is None else process
        self.header: ExportHeader | None = None
        self.others: dict[str, list[Record]] = {}
        self.count = 0
        self.first: Record | None = None
        self.last: Record | None = None
        self._reader: subprocess.Popen[bytes] | None = None
        self._pipe: BinaryIO | None = None
        self._errors: BinaryIO | None = None
        self._source: Iterator[_Message] | None = None

    def __enter__(self) -> Self:
        """Start reading; return when the header and the other topics are in.

        Raises:
            MalformedExport: the file is not a valid job record (as far as read).
            OSError: the file cannot be read.
        """
        try:
            self._source = self._start() if self.process else _messages(self.path)
            message = next(self._source)
            if message[0] != "head":
                _raise(message)
            _, self.header, self.others = message
        except BaseException:
            self._close()
            raise
        return self

    def _start(self) -> Iterator[_Message]:
        """Start the reader process; its messages."""
        receiving, sending = (_above_std(fd) for fd in os.pipe())
        self._pipe = os.fdopen(receiving, "rb")
        self._errors = tempfile.TemporaryFile()  # noqa: SIM115 (closed by _close)
        try:
            self._reader = subprocess.Popen(
                [sys.executable, "-P", "-m", __name__, str(sending), os.fspath(self.path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._errors,
                pass_fds=(sending,),
            )
        finally:
            os.close(sending)  # the reader's now: the pipe ends when the reader does
        _widen(receiving)
        return _received(self._reader, self._pipe, self._errors)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """End the reader process, if any."""
        self._close()

    def __iter__(self) -> Iterator[Record]:
        """The events in file order (a single pass).

        Raises:
            MalformedExport: at the first bad line, or at the end when the counts differ from
                the header's.
            OSError: the file could not be read further, or the reader process died.
        """
        if self._source is None:
            raise RuntimeError("iterate an EventStream inside its with block")
        for message in self._source:
            if message[0] != "events":
                if message[0] == "end":
                    return
                _raise(message)
            batch = message[1]
            if self.first is None:
                self.first = batch[0]
            self.count += len(batch)
            self.last = batch[-1]
            yield from batch

    def _close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            if reader.poll() is None:
                reader.kill()  # it only reads: nothing to lose
            reader.wait()
        for held in (self._pipe, self._errors):
            if held is not None:
                held.close()
        self._pipe = self._errors = None


def _above_std(fd: int) -> int:
    """``fd``, moved to 3 or above if it took the number of a closed standard stream (a
    process started with them closed): the reader's standard streams would replace it there."""
    if fd > 2:
        return fd
    import fcntl  # POSIX, as the reader process

    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return moved


def _widen(pipe: int) -> None:
    """Give the pipe room for a whole batch or more (:data:`PIPE_BYTES`), where the system
    allows: with Linux's default 64 KiB the reader waits on every batch it writes and the
    replay on every one it reads, switching back and forth a few times per batch."""
    try:
        import fcntl  # POSIX only

        set_size = fcntl.F_SETPIPE_SZ  # Linux only
    except (ImportError, AttributeError):
        return
    with contextlib.suppress(OSError):  # above /proc/sys/fs/pipe-max-size: keep the default
        fcntl.fcntl(pipe, set_size, PIPE_BYTES)


def _raise(message: _Message) -> NoReturn:
    """Raise the fault a reader's message reports."""
    kind, detail = message[0], message[1]
    if kind == "malformed":
        raise MalformedExport(str(detail))
    raise OSError(str(detail))


def _main(argv: list[str]) -> None:
    """The reader process's entry: ``FD PATH``, the pipe to write to and the file."""
    # A replay that stopped listening (it failed, was interrupted or killed) closes the pipe.
    with (
        contextlib.suppress(BrokenPipeError),
        open(int(argv[0]), "wb", buffering=_WRITE_BYTES) as out,
    ):
        _serve(Path(argv[1]), out)


_WRITE_BYTES = 1 << 16


if __name__ == "__main__":
    _main(sys.argv[1:])
