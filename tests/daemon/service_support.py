"""Helpers for tests that run a real :class:`DaemonService` on a real bus."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from trainguard.agent.bus import Bus
from trainguard.daemon import DaemonService


@asynccontextmanager
async def running(service: DaemonService) -> AsyncIterator[DaemonService]:
    """Run ``service`` in the background; stop it gracefully on exit (waiting up to 60 s)."""
    stop = asyncio.Event()
    task = asyncio.ensure_future(service.run(stop))
    try:
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def eventually(check: Callable[[], Awaitable[Any]], timeout_s: float = 30.0) -> Any:
    """Await ``check()`` every 50 ms until it returns something truthy, and return that.

    Raises:
        AssertionError: not within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = await check()
        if result:
            return result
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout_s} s")


async def read_all(bus: Bus, topic: str) -> list[bytes]:
    """Every record value of ``topic`` from offset 0, in partition order (a tombstone as
    ``b""``)."""
    ends = await bus.end_offsets(topic)
    pending = {tp for tp, end in ends.items() if end > 0}
    values: list[bytes] = []
    if not pending:
        return values
    async with await bus.assign(dict.fromkeys(pending, 0)) as consumer:
        seen = dict.fromkeys(pending, 0)
        while any(seen[tp] < ends[tp] for tp in pending):
            for record in await consumer.getmany(timeout_s=1.0):
                seen[record.tp] = record.offset + 1
                values.append(record.value or b"")
    return values
