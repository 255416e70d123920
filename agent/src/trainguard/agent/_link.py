"""The agent's link to the bus: a background event loop that sends events and hears commands.

The training thread never waits on the network. It hands messages over with a thread-safe
call; the loop (an anyio blocking portal in its own thread, ARCHITECTURE.md section 2) sends
them in the order of their ``seq`` numbers, which the daemon uses to drop duplicates (so a
message must never overtake one with a lower ``seq``). One FIFO, two policies:

* checkpoint and lifecycle events are retried, unchanged, until the bus takes them, and
  nothing behind them is sent meanwhile (losing one would lose a commit or an acknowledgement;
  a retry that lands twice is dropped by the daemon as a duplicate);
* heartbeats are dropped, oldest first, when more than ``ring`` of them wait: only the newest
  progress matters, and a backlog would grow without limit while the broker is away.

Commands for the job arrive on the compacted ``commands`` topic. The link first reads the
latest command of the job (a late-starting worker must see the restore it was started for),
then follows the partition from there. Commands of an older generation are ignored.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import threading
from collections.abc import Callable
from typing import Any

from anyio.from_thread import BlockingPortal, start_blocking_portal

from trainguard.agent.bus import Bus, BusConfig, BusError, Record, TopicPartition, open_bus
from trainguard.agent.bus._partitioner import partition_for
from trainguard.schemas import (
    Abort,
    Command,
    Event,
    Heartbeat,
    Restore,
    Resume,
    SchemaError,
    decode,
    encode,
)

__all__ = ["CommandState", "Link"]

_RETRY_S = 0.5


class CommandState:
    """What the job's commands have said so far; written by the loop, read by the trainer.

    Attributes:
        restores: restore commands by generation (this process's and newer ones).
        resumed: generations the daemon has resumed.
        aborted: the abort command, once one arrived.
        ignored: count of commands ignored (stale generation, other job, undecodable).
    """

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.restores: dict[int, Restore] = {}
        self.resumed: set[int] = set()
        self.aborted: Abort | None = None
        self.ignored = 0

    def wait_for(self, predicate: Callable[[], Any], timeout_s: float) -> Any:
        """Block the calling (training) thread until ``predicate()`` is truthy or time runs out.

        Returns the predicate's last value.
        """
        with self.changed:
            return self.changed.wait_for(predicate, timeout_s)


class Link:
    """Background sender/listener for one rank. Start with :meth:`open`, stop with :meth:`close`.

    Args:
        bus_config: how to reach the bus.
        job_id: the job whose commands to follow.
        generation: this process's generation; older commands are ignored.
        ring: most heartbeats queued while the bus is slow.
        beat: builds the current heartbeat from a ``seq``; called from the loop thread every
            ``interval_s`` seconds, so heartbeats keep flowing while the training thread is
            busy or stuck (which is what lets the daemon tell a hang from a death).
        interval_s: seconds between heartbeats.
    """

    def __init__(
        self,
        bus_config: BusConfig,
        job_id: str,
        generation: int,
        *,
        ring: int,
        beat: Callable[[int], Heartbeat],
        interval_s: float,
    ) -> None:
        self._beat = beat
        self._interval_s = interval_s
        self._bus_config = bus_config
        self._job_id = job_id
        self._generation = generation
        self.commands = CommandState()
        self.dropped_heartbeats = 0
        self.send_errors = 0
        self._ring = ring
        self._queue: collections.deque[Event] = collections.deque()
        self._queued_beats = 0
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._portal_cm: Any = None
        self._portal: BlockingPortal | None = None
        self._loop: _Loop | None = None

    def open(self, timeout_s: float) -> None:
        """Start the loop thread, connect and subscribe; raises ``BusError`` on failure."""
        self._portal_cm = start_blocking_portal(backend="asyncio")
        self._portal = self._portal_cm.__enter__()
        try:
            self._portal.call(self._start, timeout_s)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    async def _start(self, timeout_s: float) -> None:
        loop = _Loop(asyncio.get_running_loop())
        bus = open_bus(self._bus_config)
        await asyncio.wait_for(bus.start(), timeout_s)
        commands = await self._follow_commands(bus)
        loop.done = asyncio.ensure_future(self._run(bus, commands, loop))
        self._loop = loop

    async def _follow_commands(self, bus: Bus) -> Any:
        partition = partition_for(self._job_id, await bus.partitions("commands"))
        tp = TopicPartition("commands", partition)
        # End offset first: a command appended while we read the latest one is read twice
        # (harmless, commands are idempotent) rather than missed.
        end = (await bus.end_offsets("commands"))[tp]
        latest = (await bus.latest_per_key("commands")).get(self._job_id)
        if latest is not None:
            self._on_command(latest)
        return await bus.assign({tp: end})

    async def _run(self, bus: Bus, commands: Any, loop: _Loop) -> None:
        helpers = [
            asyncio.ensure_future(self._listen(commands)),
            asyncio.ensure_future(self._heartbeats()),
        ]
        try:
            await self._send_loop(bus, loop)
        finally:
            for task in helpers:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, BusError):
                    await task
            await commands.close()
            await bus.close()

    async def _heartbeats(self) -> None:
        while True:
            self.submit(self._beat)
            await asyncio.sleep(self._interval_s)

    async def _listen(self, consumer: Any) -> None:
        while True:
            for record in await consumer.getmany(timeout_s=0.2):
                self._on_command(record)

    def _on_command(self, record: Record) -> None:
        state = self.commands
        if record.key != self._job_id or record.value is None:
            return
        try:
            command: Command = decode(record.value, expect=(Restore, Resume, Abort))  # type: ignore[assignment]
        except SchemaError:
            state.ignored += 1
            return
        if command.job_id != self._job_id or command.generation < self._generation:
            state.ignored += 1
            return
        with state.changed:
            match command:
                case Restore():
                    state.restores[command.generation] = command
                case Resume():
                    state.resumed.add(command.generation)
                case Abort():
                    state.aborted = command
            state.changed.notify_all()

    async def _send_loop(self, bus: Bus, loop: _Loop) -> None:
        while True:
            await loop.wake.wait()
            loop.wake.clear()
            while self._queue:
                if isinstance(self._queue[0], Heartbeat):
                    await self._send_heartbeats(bus)
                else:
                    await self._send_urgent(bus, self._queue[0])
            loop.idle.set()
            if loop.stopping.is_set():
                return

    async def _send_urgent(self, bus: Bus, event: Event) -> None:
        data = encode(event)
        while True:
            try:
                await bus.publish("events", self._job_id, data)
            except BusError:
                self.send_errors += 1
                await asyncio.sleep(_RETRY_S)
                continue
            with self._lock:
                self._queue.popleft()
            return

    async def _send_heartbeats(self, bus: Bus) -> None:
        """Pipeline the run of heartbeats at the head of the queue; failures are dropped."""
        pending = []
        with self._lock:
            while self._queue and isinstance(self._queue[0], Heartbeat):
                pending.append(self._queue.popleft())
                self._queued_beats -= 1
        futures = []
        for beat in pending:
            try:
                futures.append(await bus.send("events", self._job_id, encode(beat)))
            except BusError:
                self.send_errors += 1
        for fut in futures:
            try:
                await fut
            except BusError:
                self.send_errors += 1

    # -- called from the training thread --------------------------------------------------------

    def submit(self, build: Callable[[int], Event]) -> None:
        """Queue the event ``build(seq)``; ``seq`` is assigned here so that queue order and
        ``seq`` order agree. Heartbeats beyond ``ring`` waiting ones evict the oldest."""
        with self._lock:
            event = build(next(self._seq))
            if isinstance(event, Heartbeat):
                if self._queued_beats >= self._ring:
                    oldest = next(i for i, e in enumerate(self._queue) if isinstance(e, Heartbeat))
                    del self._queue[oldest]
                    self._queued_beats -= 1
                    self.dropped_heartbeats += 1
                self._queued_beats += 1
            self._queue.append(event)
        if self._loop is not None:
            self._loop.poke()

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued so far is sent; returns False on timeout."""
        if self._portal is None or self._loop is None:
            return False
        loop = self._loop

        async def _drained() -> None:
            loop.idle.clear()
            loop.wake.set()
            await loop.idle.wait()

        try:
            self._portal.call(asyncio.wait_for, _drained(), timeout_s)
        except TimeoutError:
            return False
        return True

    def close(self, timeout_s: float) -> None:
        """Send what is queued (bounded by ``timeout_s``), disconnect, stop the loop thread."""
        if self._portal is None:
            return
        portal, self._portal = self._portal, None
        loop = self._loop

        async def _stop() -> None:
            if loop is None or loop.done is None:
                return
            loop.stopping.set()
            loop.wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(loop.done), timeout_s)
            except TimeoutError:
                loop.done.cancel()
                with contextlib.suppress(asyncio.CancelledError, BusError):
                    await loop.done

        try:
            portal.call(_stop)
        finally:
            self._portal_cm.__exit__(None, None, None)


class _Loop:
    """The background loop and the events the two threads signal each other with."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.wake = asyncio.Event()
        self.idle = asyncio.Event()
        self.stopping = asyncio.Event()
        self.done: asyncio.Future[None] | None = None

    def poke(self) -> None:
        """Wake the sender; safe from any thread."""
        self.loop.call_soon_threadsafe(self.wake.set)
