"""A worker's standard error: passed through to the supervisor's, its tail kept for the exit
report.

The supervisor starts every worker with its stderr on a pipe of its own (:class:`StderrTail`).
The supervisor's event loop reads the pipe as bytes arrive and writes each chunk on to its own
stderr (file descriptor 2) at once, unchanged, so the terminal or log file shows what it showed
before; it keeps the last :data:`TAIL_BYTES` bytes. When the worker exits, what it wrote last
is drained from the pipe, and :func:`last_words` picks from that tail the lines that say why it
exited (a Python traceback's exception, else the last lines), which the supervisor puts into
the worker's exit report (``lifecycle exited``, ``message``) and the daemon into the
incident's and the abort's reason.

Why a pipe made here, not ``asyncio.subprocess.PIPE``: on Python 3.11 ``Process.wait()``
returns only once every pipe asyncio made for the process is closed, and a grandchild that
inherited the pipe (a ``DataLoader`` worker, torchrun's ranks) would hold the exit report back
for as long as it lives. asyncio does not know this pipe, so the exit is reported the moment
the worker ends.

The price: a worker's stderr is a pipe, not a terminal, so a tool that colours its output only
on a terminal writes plain text.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

__all__ = ["LAST_WORDS_CHARS", "TAIL_BYTES", "TAIL_LINES", "StderrTail", "last_words"]

TAIL_BYTES = 4096
"""Bytes of a worker's stderr kept: the end of what it wrote."""

TAIL_LINES = 20
"""Lines at the end of the kept bytes that :func:`last_words` looks at."""

LAST_WORDS_CHARS = 1000
"""Longest text :func:`last_words` returns, characters (its start is cut: the end says why)."""

_SAID_LINES = 3
"""Most lines :func:`last_words` picks."""

_TRACEBACK = "Traceback (most recent call last)"

_READ_BYTES = 1 << 16


class StderrTail:
    """The stderr pipe of one worker process and the tail of what went through it.

    Make it before spawning the worker and give the child :attr:`write_fd` as its stderr; then
    call :meth:`start` (which closes the supervisor's copy of the write end). The pipe's read
    end closes itself at end of file (every process holding the write end has ended) and on
    :meth:`close`.

    Args:
        sink_fd: where the bytes go on to, default 2 (the supervisor's own stderr). A sink that
            refuses a write (closed, broken) loses that chunk; the tail keeps it.

    Raises:
        OSError: no pipe can be made (no file descriptors left).
    """

    def __init__(self, sink_fd: int = 2) -> None:
        self._read_fd, self.write_fd = os.pipe()
        # Read from the event loop: never block it on a worker that writes nothing.
        os.set_blocking(self._read_fd, False)
        self._sink = sink_fd
        self._tail = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._write_open = True

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The worker is spawned: close the write end here (so that the pipe ends when the
        worker and its children do) and read what arrives on ``loop``."""
        self._close_write()
        if not self._closed:
            self._loop = loop
            loop.add_reader(self._read_fd, self.drain)

    def drain(self) -> None:
        """Read everything the pipe holds now (without waiting), pass it on, keep its tail;
        close the read end at end of file."""
        while not self._closed:
            try:
                data = os.read(self._read_fd, _READ_BYTES)
            except BlockingIOError:
                return
            except OSError:
                self.close()
                return
            if not data:
                self.close()
                return
            self._pass_on(data)
            self._tail += data
            del self._tail[:-TAIL_BYTES]

    def _pass_on(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                written = os.write(self._sink, view)
            except OSError:
                return  # a sink that refuses is the operator's to fix; the tail has it
            view = view[written:]

    @property
    def text(self) -> str:
        """The kept tail, decoded as UTF-8 (undecodable bytes replaced)."""
        return self._tail.decode("utf-8", errors="replace")

    def close(self) -> None:
        """Stop reading and close both ends (idempotent); the tail stays readable."""
        self._close_write()
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._read_fd)
        with contextlib.suppress(OSError):
            os.close(self._read_fd)

    def _close_write(self) -> None:
        if self._write_open:
            self._write_open = False
            with contextlib.suppress(OSError):
                os.close(self.write_fd)


def last_words(tail: str) -> str:
    """What a process said last, in one line, from the end of its stderr: ``""`` when it said
    nothing.

    The last :data:`TAIL_LINES` lines of ``tail`` are looked at, blank ones left out. After a
    Python traceback (its last ``Traceback (most recent call last):``), the exception: the
    first unindented line after the frames and up to two more; otherwise the last three
    lines. They are joined with ``" | "``; a text longer than :data:`LAST_WORDS_CHARS` keeps
    its end, after ``"..."``.
    """
    lines = [line.rstrip() for line in tail.splitlines()[-TAIL_LINES:] if line.strip()]
    header = max((i for i, line in enumerate(lines) if line.startswith(_TRACEBACK)), default=None)
    if header is None:
        said = lines[-_SAID_LINES:]
    else:
        after = lines[header + 1 :]
        first = next((i for i, line in enumerate(after) if not line[:1].isspace()), None)
        said = after[-1:] if first is None else after[first : first + _SAID_LINES]
    text = " | ".join(said)
    if len(text) > LAST_WORDS_CHARS:
        text = "..." + text[-(LAST_WORDS_CHARS - 3) :]
    return text
