"""The daemon's view of the bus: reachable or not, and how far behind its end the daemon is.

:class:`BusWatch` runs as a task of its own next to the service's fold loop and probes the bus
every ``probe_interval_s`` with one request, the end offsets of ``events``
(:meth:`~trainguard.agent.bus.Bus.probe`), bounded by ``probe_timeout_s``. Only a bounded
request tells: a broker stopped with SIGSTOP keeps its TCP connections open, so a client sees
it connected while nothing is answered (measured on Kafka 4.4 with aiokafka 0.14: a 2 s probe
detected a SIGSTOP after 2.0-2.3 s), and consumers' polls return empty rather than fail. On
the embedded bus the probe also takes the file's write lock for a moment, waiting for it up to
most of ``probe_timeout_s``: reads never wait for that lock, so a file another process keeps
locked (a ``sqlite3`` shell in ``BEGIN EXCLUSIVE``, a process stopped inside a write) would
answer every read while nothing can be written; the milliseconds an agent's or the daemon's
own write holds it are waited out. The fold loop never waits for a probe: during an outage it
goes on polling (empty), and readiness, gauges and logs come from here.

What it keeps, and what shows it:

* connected or not, since when (``trainguard_bus_connected``, ``trainguard_bus_outages_total``,
  ``trainguard_bus_last_contact_seconds``, ``/healthz``: ``cannot reach the bus for N s``);
* the end offsets of the last successful probe (on Kafka the last stable offset: the bus's
  metadata consumer reads committed) and, from them and the service's positions at that
  moment, the consumer lag per owned partition (``trainguard_consumer_lag_records``; it keeps
  its last value while the bus cannot be reached, jumps to the backlog when it is back, then
  falls as the daemon folds it; ``/healthz``: ``behind by N records``);
* after an outage, the end offsets read on reconnecting: until the service has folded up to
  them, :meth:`BusWatch.holding` says to write no ticks (the log of the outage arrives first).

Log lines: ``bus outage started`` (error, once per outage: what failed, seconds since the
last contact), ``bus outage ended`` (warning: how long), ``caught up after outage`` (info:
records folded since, seconds taken). An outage that resumes (below) ends again, so it has one
``bus outage ended`` per end, and a ``caught up after outage`` after any of them.

Before the probes, the service reaches the bus (connecting, joining its consumer group) and
tells the watch: :meth:`BusWatch.connecting` when it begins, :meth:`BusWatch.unreachable` when
an attempt fails (or the bus failed under its fold loop, which then serves again from scratch),
:meth:`BusWatch.start` once it is connected. A failed attempt is an outage like an unanswered
probe (the same gauges and log lines), and so is a first attempt that has gone unanswered for
``timeout_s`` as far as readiness is concerned (``cannot reach the bus for N s``; a broker
paused with SIGSTOP lets a connection attempt hang for the bus's whole ``connect_timeout_s``).
Before it has ever reached the bus, the seconds count from the first attempt.

A broker coming back often answers one probe and then fails the next (leaders still being
elected, metadata not yet current). A probe that fails within ``2 * (interval_s + timeout_s)``
of an outage's end is the same outage *resumed* (``bus outage resumed``, warning): readiness and
``trainguard_bus_connected`` follow every probe, but ``trainguard_bus_outages_total`` and the
``bus outage started`` alert count one outage, not each flap.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

import structlog

from trainguard.agent.bus import Bus
from trainguard.daemon.service._metrics import DaemonMetrics

__all__ = ["BusWatch"]

log = structlog.get_logger("trainguard.daemon")

_TOPIC: Final = "events"


@dataclass(frozen=True, slots=True)
class _CatchUp:
    """What the service must fold after an outage before it writes ticks again."""

    ends: Mapping[int, int]  # partition -> end offset read on reconnecting
    start: Mapping[int, int]  # partition -> the service's position then
    at: float  # monotonic seconds of the reconnect


class BusWatch:
    """Probes the bus in the background and keeps what the daemon knows of it.

    Args:
        metrics: where the bus gauges and the consumer lag go; its
            ``trainguard_bus_last_contact_seconds`` is computed from this watch at each scrape.
        positions: the service's next offset to process per owned partition of ``events``
            (called from the event loop's thread, once per probe and per :meth:`holding`).
        interval_s: seconds between the starts of two probes, > 0.
        timeout_s: longest wait for one probe's answer, seconds, > 0; a probe without an
            answer by then (or failing) starts an outage.
        clock: monotonic clock in seconds (injected for tests).

    Readers (:meth:`outage_reason`, :meth:`lag_reason`, :attr:`connected`, the last-contact gauge) may be called
    from another thread, e.g. the HTTP server's: they only read attributes that are replaced
    whole.
    """

    def __init__(
        self,
        metrics: DaemonMetrics,
        positions: Callable[[], Mapping[int, int]],
        *,
        interval_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._positions = positions
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._last_contact: float | None = None  # None: never reached the bus
        self._connecting: float | None = None  # since when the service tries to reach it
        self._outage_started: float | None = None  # None: no outage
        self._ended: tuple[float, float] | None = None  # (start, end) of the last outage
        self._lag: Mapping[int, int] = {}
        self._catchup: _CatchUp | None = None
        self._task: asyncio.Task[None] | None = None
        metrics.follow_bus_contact(self.last_contact_age_s)

    # -- lifecycle ------------------------------------------------------------------------------

    def connecting(self) -> None:
        """The service begins to reach the bus (at its start, or again after the bus failed
        under its loop): not connected until :meth:`start`."""
        if self._connecting is None:
            self._connecting = self._clock()
        self._metrics.bus_connected(False)

    def unreachable(self, error: str) -> None:
        """An attempt of the service to reach the bus failed, or the bus failed under its fold
        loop (``error`` says how): an outage, logged and counted once, as an unanswered probe
        starts one."""
        self._failed(self._clock(), error, what="reaching the bus")

    def start(self, bus: Bus) -> None:
        """Start probing ``bus`` (a started bus: that start was a contact) from a task of the
        running event loop, with nothing known of the service's partitions yet; an outage in
        progress ends (``bus outage ended``). Call :meth:`close` when done."""
        now = self._clock()
        if self._outage_started is not None:
            self._ended = (self._outage_started, now)
            log.warning("bus outage ended", duration_s=round(self.last_contact_age_s(), 3))
        self._outage_started = None
        self._connecting = None
        self._last_contact = now
        self._catchup = None
        self._lag = {}
        self._metrics.observe_lag(self._lag)
        self._metrics.bus_connected(True)
        self._task = asyncio.get_running_loop().create_task(self._run(bus), name="bus-watch")

    async def close(self) -> None:
        """Stop probing (waits for the probe task to end)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    # -- what it knows --------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the bus is reached and the latest probe was answered (``False`` before
        :meth:`start`)."""
        return (
            self._connecting is None
            and self._last_contact is not None
            and self._outage_started is None
        )

    def last_contact_age_s(self) -> float:
        """Seconds since the bus last answered; before it ever did, since the service began
        to reach it (0 before that)."""
        since = self._last_contact if self._last_contact is not None else self._connecting
        if since is None:
            return 0.0
        return max(0.0, self._clock() - since)

    def outage_reason(self) -> str | None:
        """Why the bus is not reached, else ``None``: ``cannot reach the bus for N s``
        (:meth:`last_contact_age_s`) during an outage, or while the service has been trying to
        reach it for ``timeout_s`` or longer, ``connecting to the bus`` while it has not yet."""
        connecting = self._connecting
        if self._outage_started is None:
            if connecting is None:
                return None
            if self._clock() - connecting < self._timeout_s:
                return "connecting to the bus"
        return f"cannot reach the bus for {int(self.last_contact_age_s())} s"

    def lag_reason(self, max_lag_records: int) -> str | None:
        """``behind by N records (max_lag_records M)`` when the lag of the last successful
        probe, summed over the owned partitions, exceeds ``max_lag_records``, else ``None``."""
        behind = sum(self._lag.values())
        if behind > max_lag_records:
            return f"behind by {behind} records (max_lag_records {max_lag_records})"
        return None

    def holding(self) -> bool:
        """Whether the daemon should hold its ticks back: while the bus cannot be reached, and
        after an outage until the service's positions reach the end offsets read on
        reconnecting. Logs ``caught up after outage`` (once) when they do."""
        if not self.connected:
            return True
        catchup = self._catchup
        if catchup is None:
            return False
        positions = self._positions()
        if any(pos < catchup.ends.get(p, 0) for p, pos in positions.items()):
            return True
        self._catchup = None
        log.info(
            "caught up after outage",
            records=sum(max(0, pos - catchup.start.get(p, pos)) for p, pos in positions.items()),
            seconds=round(self._clock() - catchup.at, 3),
        )
        return False

    # -- probing --------------------------------------------------------------------------------

    async def _run(self, bus: Bus) -> None:
        while True:
            began = self._clock()
            bound = asyncio.timeout(self._timeout_s)
            try:
                async with bound:
                    ends = await bus.probe(_TOPIC, self._timeout_s)
            except Exception as exc:  # any failure of the probe is an outage
                # BusUnavailable is a TimeoutError too: only the expired bound is "no answer".
                self._failed(
                    began,
                    f"no answer to a probe within {self._timeout_s:g} s"
                    if bound.expired()
                    else f"{type(exc).__name__}: {exc}",
                )
            else:
                self._answered({tp.partition: end for tp, end in ends.items()})
            await asyncio.sleep(max(0.0, began + self._interval_s - self._clock()))

    def _answered(self, ends: Mapping[int, int]) -> None:
        now = self._clock()
        positions = self._positions()
        if self._outage_started is not None:
            self._ended = (self._outage_started, now)
            self._outage_started = None
            self._metrics.bus_connected(True)
            self._catchup = _CatchUp(ends=ends, start=dict(positions), at=now)
            # From the last answer before the outage to this one: how long nothing was heard.
            log.warning("bus outage ended", duration_s=round(self.last_contact_age_s(), 3))
        self._last_contact = now
        self._lag = {p: max(0, ends.get(p, 0) - pos) for p, pos in positions.items()}
        self._metrics.observe_lag(self._lag)

    def _failed(self, began: float, error: str, *, what: str = f"end offsets of {_TOPIC}") -> None:
        if self._outage_started is not None:
            return  # logged and counted once per outage
        self._metrics.bus_connected(False)
        ended = self._ended
        if ended is not None and began - ended[1] < 2 * (self._interval_s + self._timeout_s):
            self._outage_started = ended[0]  # a flap of a broker coming back: the same outage
            log.warning("bus outage resumed", error=error, since_end_s=round(began - ended[1], 3))
            return
        self._outage_started = began
        self._metrics.bus_outage()
        log.error(
            "bus outage started",
            error=error,
            probe=what,
            since_contact_s=round(self.last_contact_age_s(), 3),
        )
