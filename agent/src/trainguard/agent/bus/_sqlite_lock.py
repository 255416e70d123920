"""One daemon per embedded bus: the bus file's daemon lock, an exclusive advisory file lock.

Two daemons on one SQLite bus file would both fold the same events and both act on one
incident (a duplicate restore and resume: the embedded bus has no transactions that could
fence the loser). So a daemon holds ``flock(LOCK_EX | LOCK_NB)`` on ``<bus file>.daemon.lock``
for its whole life, whatever its consumer group or topic prefix. The kernel releases the lock
when its holder exits, however it exits (SIGKILL, an out-of-memory kill), so a standby that
waits for it takes over at once; a *paused* holder (SIGSTOP, a debugger) keeps it, so there are
never two deciders. The file holds the holder's pid and the time it took the lock, for the
message of the daemon refused, and stays after the holder exits (removing it could let two
processes lock two different files of one name). Same pattern as the supervisors' node slot
(:mod:`trainguard.agent.supervisor._node_slot`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import orjson
import structlog

from trainguard.agent.bus._config import BusConfig, parse_bus_url
from trainguard.agent.bus._errors import BusError

__all__ = ["STANDBY_POLL_S", "DaemonLock", "DaemonLockHeld", "daemon_lock_path", "serving_lock"]

STANDBY_POLL_S = 0.1
"""Seconds between a standby's tries of the lock: it takes over at most this long after the
holder died."""

_log = structlog.get_logger(__name__)


class DaemonLockHeld(BusError):
    """Another live daemon holds the embedded bus's daemon lock; the message names it.

    Attributes:
        holder: who holds it, as its lock file says: ``pid N since T`` (an ISO 8601 UTC
            time), or ``unknown holder``.
    """

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


def daemon_lock_path(bus_file: str) -> Path:
    """The daemon lock of the embedded bus file ``bus_file``: ``<file>.daemon.lock`` beside
    the file it resolves to, so that two spellings of one file (relative, through a symbolic
    link) name one lock."""
    return Path(os.path.realpath(bus_file) + ".daemon.lock")


class DaemonLock:
    """The held daemon lock of one embedded bus file; :meth:`release` (or process exit) frees
    it."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path
        """The lock file."""

    @classmethod
    def take(cls, bus_file: str) -> DaemonLock:
        """Take the lock of ``bus_file`` without waiting, creating the lock file and its
        folder when missing.

        Args:
            bus_file: the embedded bus's database file (it need not exist yet).

        Raises:
            DaemonLockHeld: a live process holds the lock.
            BusError: the lock file cannot be created, opened or locked.
        """
        path = daemon_lock_path(bus_file)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise BusError(f"cannot create the embedded bus's daemon lock {path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(fd, 256, 0))
            os.close(fd)
            raise DaemonLockHeld(
                f"another trainguard daemon serves the embedded bus {bus_file} ({holder}; "
                f"lock {path}): one daemon per embedded bus; use Kafka for several. "
                "`trainguard daemon --standby` waits for the lock instead and takes over when "
                "that daemon exits",
                holder,
            ) from None
        except OSError as exc:
            os.close(fd)
            raise BusError(f"cannot lock the embedded bus's daemon lock {path}: {exc}") from exc
        since = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        os.ftruncate(fd, 0)
        os.pwrite(fd, orjson.dumps({"pid": os.getpid(), "since": since}) + b"\n", 0)
        return cls(fd, path)

    def release(self) -> None:
        """Free the lock (idempotent); the file stays."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the only descriptor releases the lock


def _describe(content: bytes) -> str:
    """``pid N since T`` from a lock file's content (``unknown holder`` if it is not ours)."""
    try:
        holder = orjson.loads(content)
        return f"pid {int(holder['pid'])} since {holder['since']}"
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return "unknown holder"


@contextlib.asynccontextmanager
async def serving_lock(
    config: BusConfig, *, standby: bool, stop: asyncio.Event
) -> AsyncIterator[bool]:
    """Hold the embedded bus's daemon lock while the block runs; on Kafka, nothing to hold.

    Args:
        config: the daemon's bus.
        standby: wait for the lock (trying every :data:`STANDBY_POLL_S` seconds) instead of
            refusing when another daemon holds it.
        stop: set while waiting: give up, and yield ``False``.

    Yields:
        ``True`` when the daemon may serve the bus (the lock is held, or the bus is Kafka),
        ``False`` when ``stop`` was set before the lock was free.

    Raises:
        DaemonLockHeld: not ``standby``, and another daemon holds the lock.
        BusError: the lock file cannot be created, opened or locked; a bad bus URL.
    """
    kind, bus_file = parse_bus_url(config.url)
    if kind != "sqlite":
        yield True
        return
    lock: DaemonLock | None = None
    waited = False
    try:
        while lock is None:
            try:
                lock = DaemonLock.take(bus_file)
            except DaemonLockHeld as held:
                if not standby:
                    raise
                if not waited:
                    waited = True
                    _log.info(
                        "standby: another daemon serves this embedded bus; waiting for its lock",
                        holder=held.holder,
                        lock=str(daemon_lock_path(bus_file)),
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), STANDBY_POLL_S)
                if stop.is_set():
                    yield False
                    return
        if waited:
            _log.warning("standby: took over the embedded bus", lock=str(lock.path))
        yield True
    finally:
        if lock is not None:
            lock.release()
