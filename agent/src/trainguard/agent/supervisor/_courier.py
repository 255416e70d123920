"""The supervisor's outbox: its own events, and the events its dead workers never delivered,
sent in order over a bus connection of its own, for as long as the bus is away.

One FIFO of encoded events. The courier sends the head, waits for the bus to take it however
long that takes (the idempotent Kafka producer retries it by itself), and only then sends the
next, so the bus holds them in the order they were put: a worker's spooled ``finished`` is on
the bus before the supervisor's report of its exit. A failure that appended nothing (the
embedded bus's file stayed locked) is retried on the same connection; one that may have
appended the event (a delivery in doubt), or a broken connection, makes the courier reconnect
with a new producer and send the same bytes again (the daemon drops a copy that landed twice:
same sender, ``seq`` not above the last). Pauses between attempts double from 0.1 s to 2 s.
Nothing raises out of :meth:`Courier.run`: the courier keeps trying until it is stopped.

With a journal (:mod:`._spool`: the supervisor's), every event is written to it when it is put
and marked when the bus took it, so that what the courier holds when its process ends (a
signal's deadline, a SIGKILL) stays on disk, in order, for the next supervisor of the node to
forward. A journal that cannot be written is logged once and the courier goes on without it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from trainguard.agent.bus import Bus, BusConfig, BusError, DeliveryFailed, open_bus
from trainguard.agent.supervisor._spool import Spool

__all__ = ["Courier"]

_BACKOFF_S = (0.1, 2.0)
"""First and longest pause after a failed connect or send, seconds (doubling in between)."""

_CLOSE_GRACE_S = 1.0
"""Seconds a cancelled courier gives its connection to close (an event in flight may still
go out meanwhile); not the bus's send timeout, so that a signal ends the supervisor promptly."""

log = structlog.get_logger("trainguard.supervisor")


@dataclass(frozen=True, slots=True)
class _Parcel:
    data: bytes
    then: Callable[[], None] | None
    number: int  # its place in the journal


class Courier:
    """Delivers encoded events to the job's partition of ``events``, in order (module
    docstring). Start :meth:`run` as a task, :meth:`put` from the same event loop, and end it
    with :meth:`stop`.

    Args:
        bus_config: how to reach the bus; the courier opens its own connection.
        job_id: the key of every event.
        journal: the journal file (module docstring), created at the first :meth:`put`;
            ``None``: none.

    Attributes:
        last_error: the latest failure, as text, or ``None``.
    """

    def __init__(self, bus_config: BusConfig, job_id: str, journal: Path | None = None) -> None:
        self._config = bus_config
        self._job_id = job_id
        self._parcels: collections.deque[_Parcel] = collections.deque()
        self._changed = asyncio.Event()  # something was put
        self._empty = asyncio.Event()
        self._empty.set()
        self._stopped = False
        self._numbers = itertools.count()
        self._journal_path = journal
        self._journal: Spool | None = None
        self.last_error: str | None = None

    @property
    def journal(self) -> Path | None:
        """The journal file, if any (it may not exist yet, or any longer)."""
        return self._journal_path

    @property
    def undelivered(self) -> int:
        """Events put and not yet taken by the bus."""
        return len(self._parcels)

    def put(self, data: bytes, *, then: Callable[[], None] | None = None) -> None:
        """Queue the encoded event ``data`` (and write it to the journal); ``then`` is called
        once the bus has it (it must not raise)."""
        number = next(self._numbers)
        self._journaled(lambda journal: journal.add(number, data))
        self._parcels.append(_Parcel(data, then, number))
        self._empty.clear()
        self._changed.set()

    def _journaled(self, write: Callable[[Spool], None]) -> None:
        """``write`` to the journal, opened first if need be; a failure (a full disk) is logged
        and ends the journal: later events are kept in memory only."""
        path = self._journal_path
        if path is None:
            return
        try:
            if self._journal is None:
                self._journal = Spool(path.parent, path.name)
            write(self._journal)
        except OSError as exc:
            log.warning(
                "cannot write the supervisor's journal: events it cannot deliver are lost "
                "when it exits",
                journal=str(path),
                error=str(exc),
            )
            self._journal_path = None
            if self._journal is not None:
                with contextlib.suppress(OSError):
                    self._journal.close()

    async def delivered(self) -> None:
        """Return once every event put so far (and since) has been delivered."""
        await self._empty.wait()

    def stop(self) -> None:
        """Have :meth:`run` end, leaving what is undelivered (in the journal, which is closed,
        and removed if everything was delivered); cancel its task too (an event in flight then
        gets ``_CLOSE_GRACE_S`` to go out)."""
        self._stopped = True
        if self._journal is not None:
            with contextlib.suppress(OSError):
                self._journal.close()

    async def run(self) -> None:
        """Connect, deliver, and reconnect after failures, until :meth:`stop`."""
        failures = 0
        # The flag, not the cancellation alone, ends the loop: aiokafka can turn a
        # cancellation during a connect into a connection error.
        while not self._stopped:
            bus = open_bus(self._config)
            try:
                await bus.start()
                if failures:
                    log.info("bus reachable again: delivering", undelivered=self.undelivered)
                failures = 0
                await self._deliver(bus)
            except BusError as exc:
                failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                if failures == 1:
                    log.warning(
                        "cannot deliver to the bus: retrying until it answers",
                        error=self.last_error,
                        undelivered=self.undelivered,
                    )
            finally:
                grace = _CLOSE_GRACE_S if self._stopped else None
                with contextlib.suppress(BusError, TimeoutError):
                    await asyncio.wait_for(bus.close(), grace)
            await _pause(failures)

    async def _deliver(self, bus: Bus) -> None:
        """Deliver parcels for as long as the connection serves.

        Raises:
            BusError: a delivery in doubt, or a failure a new connection may cure.
        """
        failures = 0
        while True:
            if not self._parcels:
                self._empty.set()
                self._changed.clear()
                await self._changed.wait()
                continue
            parcel = self._parcels[0]
            try:
                delivery = await bus.send("events", self._job_id, parcel.data)
                # Shielded: cancelling the courier must not cancel a delivery in flight.
                await asyncio.shield(delivery)
            except BusError as exc:
                if not exc.retriable or (isinstance(exc, DeliveryFailed) and exc.in_doubt):
                    raise
                failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                if failures == 1:
                    log.warning(
                        "the bus did not take an event: retrying",
                        error=self.last_error,
                        undelivered=self.undelivered,
                    )
                await _pause(failures)
                continue
            failures = 0
            self._parcels.popleft()
            self._journaled(functools.partial(Spool.settled, seq=parcel.number))
            if not self._parcels:
                self._empty.set()
            if parcel.then is not None:
                parcel.then()


async def _pause(failures: int) -> None:
    """Back off before retrying: ``0.1 * 2**(failures - 1)`` seconds, at most 2."""
    low, high = _BACKOFF_S
    await asyncio.sleep(min(high, low * 2 ** max(0, failures - 1)))
