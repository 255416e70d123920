"""Waits on the bus that a signal ends at once, and a bus that is away waited for, with
back-off and log lines, instead of failing the process: the supervisor's and the daemon's.

:func:`or_stop` races a bus call against a signal event: once the signal comes, the call is
cancelled and given :data:`ABANDON_GRACE_S` to unwind, then abandoned (:class:`Signalled` is
raised), whatever the bus's own timeouts (``connect_timeout_s``, ``send_timeout_s``) would have
allowed it. :func:`patiently` retries a call that failed with a retriable
:class:`~trainguard.agent.bus.BusError` (the bus unreachable) until it succeeds, pausing 0.1 s,
doubling to 2 s, between attempts, and logs a warning naming the outage when it begins, again
every ``warn_every_s`` while it lasts, and an info line when it ends; a non-retriable error (a
bad URL, credentials the broker refuses, a topic the cluster refuses) is raised at once.
:func:`started` starts a bus and closes it again, within :data:`ABANDON_GRACE_S`, when that
fails, so that an attempt of :func:`patiently` leaves no connection behind.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog

from trainguard.agent.bus._errors import BusError
from trainguard.agent.bus._port import Bus

__all__ = [
    "ABANDON_GRACE_S",
    "Signalled",
    "abandon",
    "close_soon",
    "or_stop",
    "patiently",
    "started",
]

T = TypeVar("T")

ABANDON_GRACE_S = 1.0
"""Seconds a bus call cancelled by a signal gets to unwind before it is abandoned."""

_BACKOFF_S = (0.1, 2.0)
"""First and longest pause between two attempts, seconds (doubling in between)."""

log = structlog.get_logger("trainguard.bus")


class Signalled(Exception):
    """A signal ended a wait on the bus; the call waited on was abandoned."""


async def abandon(*tasks: asyncio.Future[Any]) -> None:
    """Cancel ``tasks`` and wait at most :data:`ABANDON_GRACE_S` for them to end; then leave
    those still running (every outcome is retrieved and dropped)."""
    for task in tasks:
        task.cancel()
        task.add_done_callback(_drop_outcome)
    if tasks:
        await asyncio.wait(tasks, timeout=ABANDON_GRACE_S)


def _drop_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" at exit


async def or_stop(call: Awaitable[T], stop: asyncio.Event) -> T:
    """``await call``, unless ``stop`` is set before it ends.

    Raises:
        Signalled: ``stop`` was set (before or during the call); the call was abandoned
            (:func:`abandon`).
        Exception: whatever ``call`` raises.
    """
    task = asyncio.ensure_future(call)
    if stop.is_set():
        await abandon(task)
        raise Signalled
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        stopped.cancel()
    if task.done():
        return task.result()
    await abandon(task)
    raise Signalled


async def patiently(
    what: str,
    call: Callable[[], Awaitable[T]],
    stop: asyncio.Event,
    *,
    warn_every_s: float,
    failed: BusError | None = None,
    backoff_s: tuple[float, float] = _BACKOFF_S,
    **context: Any,
) -> T:
    """``call()`` until it succeeds, waiting out the bus's outages (module docstring).

    Args:
        what: the call, for the log lines (``"connecting to the bus"``).
        call: makes one attempt (a new awaitable each time).
        stop: the signal event; setting it ends the wait at once.
        warn_every_s: seconds between two warnings while the bus stays away.
        failed: a retriable failure that began the outage before this wait (the bus failing
            under work that ``call`` starts again): logged as the outage's start, and the
            first attempt comes after the first pause.
        backoff_s: ``(first, longest)`` pause between two attempts, seconds; the pause doubles
            from ``first`` after each failure up to ``longest``.
        context: further fields of the log lines (``job_id``, the bus URL).

    Raises:
        Signalled: ``stop`` was set.
        BusError: a non-retriable failure.
    """
    failures = 0
    began = warned = 0.0
    error = failed
    while True:
        if error is None:
            try:
                result = await or_stop(call(), stop)
            except BusError as exc:
                if not exc.retriable:
                    raise
                error = exc
            else:
                if failures:
                    log.info(
                        f"bus outage over: {what} succeeded",
                        waited_s=round(time.monotonic() - began, 1),
                        **context,
                    )
                return result
        failures += 1
        now = time.monotonic()
        said = f"{type(error).__name__}: {error}"
        error = None
        if failures == 1:
            began = warned = now
            log.warning(
                f"bus outage: {what} failed; retrying until the bus answers (a signal ends "
                "the wait)",
                error=said,
                **context,
            )
        elif now - warned >= warn_every_s:
            warned = now
            log.warning(
                f"bus outage goes on: {what} still fails",
                waited_s=round(now - began, 1),
                error=said,
                **context,
            )
        low, high = backoff_s
        await or_stop(asyncio.sleep(min(high, low * 2 ** (failures - 1))), stop)


async def started(bus: Bus) -> Bus:
    """``bus``, started; if starting it fails (or is cancelled), it is closed again
    (:func:`close_soon`) before the error is raised, so a failed attempt leaves no connection
    behind.

    Raises:
        BusError: the bus cannot be reached or used (``BusUnavailable``: retriable).
    """
    try:
        await bus.start()
    except BaseException:
        await close_soon(bus)
        raise
    return bus


async def close_soon(bus: Bus) -> None:
    """Close ``bus``, giving up after :data:`ABANDON_GRACE_S` (closing can wait for a broker
    that is away up to the bus's send timeout); a failure to close is dropped."""
    closing = asyncio.ensure_future(bus.close())
    closing.add_done_callback(_drop_outcome)
    if not (await asyncio.wait({closing}, timeout=ABANDON_GRACE_S))[0]:
        await abandon(closing)
