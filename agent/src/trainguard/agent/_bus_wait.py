"""The supervisor's waits on the bus: every one ends at once on a signal, and a bus that is
away is waited for, with back-off and log lines, instead of failing the supervisor.

:func:`or_stop` races a bus call against the supervisor's signal event: once the signal comes,
the call is cancelled and given :data:`ABANDON_GRACE_S` to unwind, then abandoned
(:class:`Signalled` is raised), whatever the bus's own timeouts (``connect_timeout_s``,
``send_timeout_s``) would have allowed it. :func:`patiently` retries a call that failed with
a retriable :class:`~trainguard.agent.bus.BusError` (the bus unreachable) until it succeeds,
pausing 0.1 s, doubling to 2 s, between attempts, and logs a warning naming the outage when it
begins, again every ``warn_every_s`` while it lasts, and an info line when it ends; a
non-retriable error (a bad URL, a topic the cluster refuses) is raised at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog

from trainguard.agent.bus import BusError

__all__ = ["ABANDON_GRACE_S", "Signalled", "abandon", "or_stop", "patiently"]

T = TypeVar("T")

ABANDON_GRACE_S = 1.0
"""Seconds a bus call cancelled by a signal gets to unwind before it is abandoned."""

_BACKOFF_S = (0.1, 2.0)
"""First and longest pause between two attempts, seconds (doubling in between)."""

log = structlog.get_logger("trainguard.supervisor")


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
    **context: Any,
) -> T:
    """``call()`` until it succeeds, waiting out the bus's outages (module docstring).

    Args:
        what: the call, for the log lines (``"connecting to the bus"``).
        call: makes one attempt (a new awaitable each time).
        stop: the signal event; setting it ends the wait at once.
        warn_every_s: seconds between two warnings while the bus stays away.
        context: further fields of the log lines (``job_id``, the bus URL).

    Raises:
        Signalled: ``stop`` was set.
        BusError: a non-retriable failure.
    """
    failures = 0
    began = warned = 0.0
    while True:
        try:
            result = await or_stop(call(), stop)
        except BusError as exc:
            if not exc.retriable:
                raise
            failures += 1
            now = time.monotonic()
            error = f"{type(exc).__name__}: {exc}"
            if failures == 1:
                began = warned = now
                log.warning(
                    f"bus outage: {what} failed; retrying until the bus answers (a signal "
                    "ends the wait)",
                    error=error,
                    **context,
                )
            elif now - warned >= warn_every_s:
                warned = now
                log.warning(
                    f"bus outage goes on: {what} still fails",
                    waited_s=round(now - began, 1),
                    error=error,
                    **context,
                )
            low, high = _BACKOFF_S
            await or_stop(asyncio.sleep(min(high, low * 2 ** (failures - 1))), stop)
            continue
        if failures:
            log.info(
                f"bus outage over: {what} succeeded",
                waited_s=round(time.monotonic() - began, 1),
                **context,
            )
        return result
