"""The embedded bus file's simulated append clock, read synchronously.

``trainguard sim`` moves a bus file's append clock (:meth:`SQLiteBus.set_append_clock
<trainguard.agent.bus.SQLiteBus.set_append_clock>`); a daemon process serving that file in
simulated time takes its own clock from the same place, on every look at the time, so that the
ticks it decides to write and the times the file stamps on them agree.
"""

from __future__ import annotations

import sqlite3
import time

from trainguard.agent.bus._sqlite_db import append_clock, connect, translate

__all__ = ["AppendClock"]


class AppendClock:
    """Reads the simulated append clock of the embedded bus file at ``path``.

    One read is a point query on the file's ``meta`` table (some microseconds), made on the
    calling thread: meant for a simulator's daemon process, not for a production path.

    Args:
        path: the bus file; it must exist.

    Raises:
        BusError: the file cannot be opened as a bus of this schema version.
    """

    def __init__(self, path: str) -> None:
        try:
            self._conn = connect(path, create=False)
        except sqlite3.Error as exc:
            raise translate(exc, f"opening {path} for its clock") from exc

    def ns(self) -> int:
        """The file's simulated time in ns since the Unix epoch, or the wall clock's
        (:func:`time.time_ns`) while none is set.

        Raises:
            BusError: the file could not be read.
        """
        try:
            simulated = append_clock(self._conn)
        except sqlite3.Error as exc:
            raise translate(exc, "reading the append clock") from exc
        return time.time_ns() if simulated is None else simulated * 1_000_000

    def seconds(self) -> float:
        """:meth:`ns` in seconds (the scale of a monotonic clock, for the daemon's pulse).

        Raises:
            BusError: the file could not be read.
        """
        return self.ns() / 1e9

    def close(self) -> None:
        """Close the connection; the clock cannot be read afterwards."""
        self._conn.close()
