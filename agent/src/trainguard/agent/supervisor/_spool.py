"""The spool: a file per agent in which every non-heartbeat event waits until the bus took it.

A worker's agent writes each data-cursor, checkpoint and lifecycle event to its spool file the
moment it is queued, and notes when the bus has taken it. When the worker exits, its
supervisor forwards the events the bus never took, the same bytes (MAC intact), before its exit
report (:mod:`._supervisor`); the daemon drops any that did arrive as duplicates (same sender,
``seq`` not above the last). So a worker that exits, or is killed, while the bus is away loses
nothing that it queued.

The folder is the supervisor's (``TRAINGUARD_SPOOL_DIR``, one per worker it starts); each agent
of the worker writes its own file ``<pid>-<n>.spool`` there. A file is a sequence of lines:

* ``e <seq> <event>``: an event queued (its encoded JSON, which has no line break, with the
  same ``seq``);
* ``d <seq>``: every event up to ``seq`` is settled (delivered, or dropped by the outbox's
  bound): the delivered-up-to mark.

Each line is one ``write`` on an unbuffered descriptor opened with ``O_APPEND``, and nothing is
fsynced: the page cache keeps what a killed process wrote (the node's death loses the spool with
the node's other state). Once every spooled event is settled, the file is truncated, so it only
grows while the bus is away. A line that does not parse (a torn tail after a crash, or damage)
is skipped with a warning; reading never raises for the content.

The supervisor keeps its own outbox in a spool file too, its **journal**
(``supervisor-<ns>-<pid>.outbox`` in the node's spool folder, the parent of its workers'
folders; :mod:`._courier`): every event it puts in its outbox (its reports and requests, and the
worker events it forwards), numbered in the order they were put rather than by ``seq`` (they
come from several senders), marked as the bus takes them, in the same line format.
:func:`read_journal` reads back what it never delivered, in that order, for the next supervisor
of the node to forward before anything else.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import structlog

from trainguard.schemas import Event, JobRequest, SchemaError, decode

__all__ = ["JOURNAL_SUFFIX", "SPOOL_DIR_ENV", "Spool", "Spooled", "read_journal", "read_spool"]

SPOOL_DIR_ENV = "TRAINGUARD_SPOOL_DIR"
"""The environment variable by which a supervisor gives its worker a spool folder."""

_SUFFIX = ".spool"

JOURNAL_SUFFIX = ".outbox"
"""How a supervisor's journal is named: ``supervisor-<time ns, 19 digits>-<pid>.outbox``, so that
sorting the names sorts the journals by age."""

_FILES = itertools.count()
"""Numbers the spool files of one process (a process may open several agents)."""

log = structlog.get_logger("trainguard.spool")


class Spool:
    """This process's spool file in ``folder``, created on construction.

    Args:
        folder: the supervisor's spool folder for this worker (created if missing).
        name: the file's name; default ``<pid>-<n>.spool`` (an agent's). A journal passes its
            own name and numbers its events itself (module docstring).

    Raises:
        OSError: the folder or file cannot be created.
    """

    def __init__(self, folder: Path, name: str | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / (name or f"{os.getpid()}-{next(_FILES)}{_SUFFIX}")
        """The file."""
        self._fd: int | None = os.open(
            self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
        )
        self._last = -1  # highest seq written
        self._settled = -1  # highest seq settled

    def add(self, seq: int, data: bytes) -> None:
        """Spool the encoded event ``data`` with its ``seq`` (above every earlier one).

        Raises:
            OSError: the write failed (disk full).
        """
        self._write(b"e %d %s\n" % (seq, data))
        self._last = seq

    def settled(self, seq: int) -> None:
        """Every event up to ``seq`` was delivered or dropped: mark it, or, when nothing
        spooled is left unsettled, empty the file.

        Raises:
            OSError: the write failed.
        """
        self._settled = max(self._settled, seq)
        if self._fd is None:
            return
        if self._settled >= self._last:
            os.ftruncate(self._fd, 0)
        else:
            self._write(b"d %d\n" % self._settled)

    def close(self) -> None:
        """Close the file; remove it if nothing in it is unsettled. Idempotent."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        os.close(fd)
        if self._settled >= self._last:
            with contextlib.suppress(OSError):
                self.path.unlink()

    def _write(self, line: bytes) -> None:
        if self._fd is not None:
            os.write(self._fd, line)


@dataclass(frozen=True, slots=True)
class Spooled:
    """An event read back from a spool file, never delivered.

    Attributes:
        seq: its ``seq``.
        data: its encoded bytes, as the agent queued them.
        path: the file it came from.
    """

    seq: int
    data: bytes
    path: Path


def read_spool(folder: Path) -> list[Spooled]:
    """The unsettled events of every spool file in ``folder``, in ``seq`` order.

    A missing folder has none. A line that does not parse (an event that is not a valid
    event of its ``seq``), and a last line without its line break (the writer died
    mid-write), is skipped with a warning naming the file and line; a file that cannot be read
    is skipped with a warning.
    """
    found: list[Spooled] = []
    with contextlib.suppress(FileNotFoundError):
        for path in sorted(folder.glob(f"*{_SUFFIX}")):
            found += _read_file(path, _is_event)
    return sorted(found, key=lambda s: s.seq)


def read_journal(path: Path) -> list[bytes]:
    """The undelivered events of the supervisor's journal ``path``, in the order they were put
    (module docstring). A missing file has none; damage is skipped with a warning as in
    :func:`read_spool` (an entry must be an event or a job request)."""
    if not path.exists():
        return []
    return [s.data for s in sorted(_read_file(path, _is_sent), key=lambda s: s.seq)]


def _read_file(path: Path, valid: Callable[[bytes, int], bool]) -> list[Spooled]:
    try:
        content = path.read_bytes()
    except OSError as exc:
        log.warning("spool file not readable: its events are lost", path=str(path), error=str(exc))
        return []
    events: dict[int, bytes] = {}
    settled = -1
    lines = content.split(b"\n")
    # The split leaves b"" after a final line break; anything else there is a torn line.
    *whole, tail = lines
    if tail:
        log.warning("spool file ends in a torn line: skipped", path=str(path), line=len(lines))
    for number, line in enumerate(whole, start=1):
        match line.split(b" ", 2):
            case [b"e", seq, data] if seq.isdigit() and valid(data, int(seq)):
                events[int(seq)] = data
            case [b"d", seq] if seq.isdigit():
                settled = max(settled, int(seq))
            case _:
                log.warning("spool line not understood: skipped", path=str(path), line=number)
    return [Spooled(seq, data, path) for seq, data in events.items() if seq > settled]


def _is_event(data: bytes, seq: int) -> bool:
    """Whether ``data`` decodes to an event with this ``seq``."""
    try:
        event = decode(data, expect=Event)
    except SchemaError:
        return False
    return isinstance(event, Event) and event.seq == seq


def _is_sent(data: bytes, _: int) -> bool:
    """Whether ``data`` decodes to what a supervisor sends: an event or a job request (a
    journal numbers its entries itself)."""
    try:
        decode(data, expect=(*get_args(Event), JobRequest))
    except SchemaError:
        return False
    return True
