"""Daemon services a test can hold mid-loop: :class:`Stalls` stops folding records while
``stall`` is set, until ``go`` is (a daemon falling behind the bus); :class:`Pausable` holds its
loop right after it acted and before its transaction commits (a paused owner, or a commit in
doubt)."""

from __future__ import annotations

import asyncio
from typing import Any

from trainguard.agent.bus import Bus, Record
from trainguard.daemon import DaemonService


class Stalls(DaemonService):
    """A daemon that stops folding once ``stall`` is set, until ``go`` is."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stall = False
        self.go = asyncio.Event()

    async def _process(self, record: Record) -> None:
        if self.stall:
            await self.go.wait()
        await super()._process(record)


class Pausable(DaemonService):
    """A daemon whose loop can be held (no poll, hence no lease renewal on the embedded bus)
    right after it acted and before its transaction commits."""

    hold: asyncio.Event | None = None  # set by the test: hold the loop until it is set
    held: asyncio.Event  # set by the loop when it holds

    async def _write_due_ticks(self, bus: Bus) -> None:
        hold = self.hold
        if hold is not None and self.counters["commands"]:
            self.hold = None
            self.held.set()
            await hold.wait()
        await super()._write_due_ticks(bus)
