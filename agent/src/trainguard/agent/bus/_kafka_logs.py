"""Keeps the Kafka client's own log lines from flooding a process's log during an outage.

While a broker is away aiokafka logs every failed connection, bootstrap and metadata attempt,
about 200 lines a second per process (measured with ``kafka-dev stop``), into the daemon's log
and every worker's stderr; after a fence its orphaned tasks add "exception was never
retrieved" tracebacks. trainguard's own outage lines (``bus outage started`` / ``ended``,
:mod:`trainguard.daemon.service._bus_watch`) are the ones to alert on; these are detail.

The rule, per message template (logger, level and the format string before its arguments
are filled in): the first line goes through, and then at most one per :data:`WINDOW_S`
seconds; the line let through after some were dropped ends with ``[suppressed K similar
messages in the last N s]``. (A count whose template never recurs is not reported.)

:func:`quiet_kafka_logs` installs it on the ``aiokafka`` and ``kafka`` loggers, once per
process, for the records of every logger below them: a handler on each that applies the rule
and hands the record on to the root logger's handlers (they no longer propagate otherwise).
:func:`quiet_kafka_orphans` routes the exceptions of aiokafka's own futures and tasks that
nobody retrieved to the ``aiokafka`` logger as one warning line each (so they are throttled
too) instead of asyncio's error with a traceback; every other exception goes to the event
loop's previous handler. The daemon's and supervisor's log set-up and :class:`KafkaBus`'s
start call them (the latter covers worker processes, whose logging trainguard leaves alone).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["LOGGERS", "WINDOW_S", "Throttle", "quiet_kafka_logs", "quiet_kafka_orphans"]

WINDOW_S: Final = 30.0
"""Seconds between two lines of one template let through (the first always is)."""

LOGGERS: Final = ("aiokafka", "kafka")
"""Loggers whose records (and their children's) are throttled."""

_MAX_TEMPLATES: Final = 1024
"""Templates remembered at most; some client lines are formatted before logging (a host or
topic in the text), so the set is not bounded by the client's code."""

_AIOKAFKA_DIR: Final = f"{os.sep}aiokafka{os.sep}"


@dataclass(slots=True)
class _Seen:
    last: float  # when a line of the template was last let through
    suppressed: int  # lines dropped since


class Throttle(logging.Filter):
    """A :class:`logging.Filter` that lets the first record of each template through, then at
    most one per ``window_s`` seconds, and marks that one with the count dropped before it.

    Args:
        window_s: seconds, > 0.
        clock: monotonic clock in seconds (injected for tests).

    Thread-safe: records may come from any thread.
    """

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self._clock = clock
        self._seen: dict[tuple[str, int, str], _Seen] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` goes out; one let through after drops gets the count appended
        to its message."""
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        with self._lock:
            seen = self._seen.get(key)
            if seen is None:
                if len(self._seen) >= _MAX_TEMPLATES:
                    self._forget(now)
                self._seen[key] = _Seen(now, 0)
                return True
            if now - seen.last < self.window_s:
                seen.suppressed += 1
                return False
            suppressed, since = seen.suppressed, seen.last
            seen.last, seen.suppressed = now, 0
        if suppressed:
            record.msg = (
                f"{record.msg} [suppressed {suppressed} similar messages in the last "
                f"{now - since:.0f} s]"
            )
        return True

    def _forget(self, now: float) -> None:
        """Make room: drop the templates whose next line would go through anyway, or all."""
        stale = [k for k, s in self._seen.items() if now - s.last >= self.window_s]
        for key in stale:
            del self._seen[key]
        if len(self._seen) >= _MAX_TEMPLATES:
            self._seen.clear()


class _ToRoot(logging.Handler):
    """Hands a record that passed its filter (a :class:`Throttle`) to the root logger's
    handlers, as propagation would have."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger().handle(record)


_installed: Throttle | None = None
_install_lock = threading.Lock()


def quiet_kafka_logs() -> Throttle:
    """Throttle the records of the :data:`LOGGERS` (and their children) in this process.

    Idempotent: later calls return the throttle installed first. A handler added to one of
    those loggers by someone else still sees every record; only the way to the root
    logger's handlers is throttled.

    Returns:
        The process's :class:`Throttle` (its ``window_s`` may be changed).
    """
    global _installed
    with _install_lock:
        if _installed is None:
            throttle = Throttle()
            for name in LOGGERS:
                handler = _ToRoot()
                handler.addFilter(throttle)
                logger = logging.getLogger(name)
                logger.addHandler(handler)
                logger.propagate = False
            _installed = throttle
        return _installed


def _raised_in_aiokafka(exc: BaseException) -> bool:
    if type(exc).__module__.partition(".")[0] == "aiokafka":
        return True
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and _AIOKAFKA_DIR in tb.tb_frame.f_code.co_filename


def quiet_kafka_orphans(loop: asyncio.AbstractEventLoop) -> None:
    """On ``loop``, log an exception that no one retrieved from one of aiokafka's own futures
    or tasks (raised in aiokafka's code: after a fence, its sender leaves produce tasks
    failing with ``ProducerFenced`` and its transaction manager a ``KeyError``) as a warning
    of the ``aiokafka`` logger, throttled like its other lines; anything else goes to the
    loop's previous exception handler (or its default). Idempotent per loop."""
    previous = loop.get_exception_handler()
    if getattr(previous, "_trainguard_kafka_orphans", False):
        return

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        message = str(context.get("message", ""))
        if exc is not None and "never retrieved" in message and _raised_in_aiokafka(exc):
            logging.getLogger("aiokafka").warning(
                "%s (an aiokafka task's, nobody awaits it): %r", message, exc
            )
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handler._trainguard_kafka_orphans = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)
