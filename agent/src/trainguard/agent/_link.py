"""The agent's link to the bus: a background event loop that sends events and hears commands.

The training thread never waits on the network. It hands events over with :meth:`Link.submit`
(a lock, an encode, a wake-up: tens of microseconds); an asyncio event loop in a daemon thread
sends them. (ARCHITECTURE.md section 2 names an anyio blocking portal; but the portal of
``start_blocking_portal`` runs in a non-daemon thread, so a process that never closes its agent
would hang at exit, and the bus adapters are asyncio-only anyway.) Events leave in the order
of their ``seq`` numbers, which the daemon uses to drop duplicates (``seq <= last seen``), so
an event never overtakes one with a lower ``seq``. The outbox (:mod:`._outbox`) holds them:

* checkpoint, data-cursor and lifecycle events wait, unchanged, until the bus takes them, and
  nothing behind them is sent meanwhile (losing one would lose a commit or an
  acknowledgement). At most ``max_events`` wait: beyond that the oldest data cursor is dropped,
  and without one the new event is refused (logged as an error, counted). Each is sent once
  per connection: the link awaits that delivery for as long as it takes, since the idempotent
  Kafka producer retries it by itself (a second copy could land too). Only after a failure that
  leaves the delivery in doubt does it reconnect, with a new producer, and send the same bytes
  again; the daemon drops a copy that landed twice as a duplicate. A failure that appended
  nothing (the embedded bus's file stayed locked) is retried on the same connection.
* heartbeats are dropped, oldest first, when more than ``ring`` of them wait: only the newest
  progress matters, and a backlog would grow without limit while the bus is away.

With the supervisor's heartbeat relay (``TRAINGUARD_HEARTBEAT_RELAY``, from ``trainguard run
--batch-heartbeats``) heartbeats go to the relay's Unix datagram socket instead of the bus, one
non-blocking ``send`` each, and the supervisor sends the node's heartbeats batched
(:mod:`trainguard.agent.supervisor._beat_relay`); one the relay does not take (none
listening, its buffer full) goes on the bus as before.

With a spool folder (``TRAINGUARD_SPOOL_DIR``, from the supervisor) every event but the
heartbeats is also written to this process's spool file the moment it is queued, and marked
once the bus took it (:mod:`._spool`); what the process could not deliver before it ended,
closed or killed, its supervisor forwards.

The loop connects in the background and reconnects after failures (capped exponential
back-off), so a bus that is down, locked or slow at start-up or later never stalls training;
events wait in the FIFO meanwhile.

Commands for the job arrive on the compacted ``commands`` topic. On its first connection the
link reads the latest command of the job (a late-starting worker must see the restore it was
started for), then follows the job's partition from there; after a reconnection it continues
after the last command it read. Commands of an older generation than this process's are
ignored; with the daemon's public keys, so is every command that is unsigned, badly signed,
for another job or a replay (:mod:`._command_gate`), each counted by reason and logged. With
the job's event key, every event leaves with its HMAC (``auth``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from structlog.typing import FilteringBoundLogger

from trainguard.agent._outbox import Kind, Outbox, Queued
from trainguard.agent.bus import (
    Bus,
    BusConfig,
    BusError,
    Consumer,
    DeliveryFailed,
    Record,
    TopicPartition,
    open_bus,
    parse_bus_url,
    partition_for,
)
from trainguard.agent.keys._command_gate import CommandGate, Ignored, IgnoreReason, log_ignored
from trainguard.agent.keys._keystore import EventKey
from trainguard.agent.supervisor._spool import Spool
from trainguard.schemas import (
    Abort,
    DataCursorEvent,
    Event,
    Heartbeat,
    Lifecycle,
    Restore,
    Resume,
    SchemaError,
    add_mac,
    encode,
)

__all__ = ["Commands", "Link"]

_E = TypeVar("_E", bound=Event)
_T = TypeVar("_T")

_BACKOFF_S = (0.1, 2.0)
"""First and longest pause after a failed connect or send, seconds (doubling in between)."""

_POLL_S = 1.0
"""Longest wait of one command poll, seconds (bounds how late a broken consumer is noticed)."""

_STOP_GRACE_S = 5.0
"""Seconds :meth:`Link.close` waits for the loop thread after cancelling it."""

_LAST_WORDS = frozenset({"finished", "error"})
"""Lifecycle kinds after which a process sends no heartbeat."""

# One counter for the whole process: a sender is (rank, host, pid), and seqs must keep rising
# across every Agent a process creates. Starting at the wall clock in ns keeps them rising
# across processes too, when a restarted worker gets the same pid (a container's pid namespace)
# in the same generation: the daemon would drop its events as duplicates otherwise.
_SEQ = itertools.count(time.time_ns())


class Commands:
    """What the daemon has said to this job so far; written by the loop, read by the trainer.

    Args:
        job_id: the job whose commands count.
        generation: commands of older generations are ignored.
        on_command: called on the loop thread with every command taken, after it is
            recorded (and outside the lock :meth:`wait` uses); it must not raise.
        keys: the daemon's public keys by kid: only commands they verify are taken, and
            replays are refused (:mod:`._command_gate`); ``None`` takes unsigned commands.
        log: where ignored commands are reported (with the reason, never a key).

    Attributes:
        restores: restore commands by generation (this process's and newer ones).
        resumes: resume commands by generation.
        aborted: the abort command, once one arrived.
        newest_generation: highest generation of any command taken (this process's at least).
        ignored: commands ignored so far, by :data:`~._command_gate.IgnoreReason`.
    """

    def __init__(
        self,
        job_id: str,
        generation: int,
        on_command: Callable[[Restore | Resume | Abort], None] | None = None,
        *,
        keys: Mapping[str, Ed25519PublicKey] | None = None,
        log: FilteringBoundLogger | None = None,
    ) -> None:
        self._job_id = job_id
        self._gate = CommandGate(job_id, generation, keys)
        self._on_command = on_command
        self._log = log
        self._changed = threading.Condition()
        self.restores: dict[int, Restore] = {}
        self.resumes: dict[int, Resume] = {}
        self.aborted: Abort | None = None
        self.newest_generation = generation
        self.ignored: collections.Counter[IgnoreReason] = self._gate.ignored

    def take(self, record: Record) -> None:
        """Apply one record of the ``commands`` topic (other jobs' records are skipped)."""
        if record.key != self._job_id or record.value is None:
            return
        command = self._gate.admit(record.value)
        if isinstance(command, Ignored):
            if self._log is not None:
                log_ignored(self._log, command, record.offset)
            return
        with self._changed:
            match command:
                case Restore():
                    self.restores[command.generation] = command
                case Resume():
                    self.resumes[command.generation] = command
                case Abort():
                    self.aborted = command
            self.newest_generation = max(self.newest_generation, command.generation)
            self._changed.notify_all()
        if self._on_command is not None:
            self._on_command(command)

    def wait(self, predicate: Callable[[], _T], timeout_s: float) -> _T:
        """Block the calling thread until ``predicate()`` is truthy or ``timeout_s`` seconds
        passed; return its last value. ``predicate`` runs under the lock that :meth:`take`
        holds while it changes anything."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout_s)


class Link:
    """Background sender/listener of one rank: :meth:`start` it, :meth:`close` it.

    Args:
        bus_config: how to reach the bus (the URL is checked here; nothing connects before
            :meth:`start`).
        job_id: the job: the key of every event sent and of the commands followed.
        generation: this process's generation; commands of older ones are ignored.
        ring: most heartbeats kept waiting (>= 1); older ones are dropped when more arrive.
        max_events: most checkpoint, data-cursor and lifecycle events kept waiting (>= 1; see
            the module docstring for what happens beyond).
        spool: the supervisor's spool folder for this worker, or ``None`` (no spool: what is
            unsent when the process ends is lost). A folder that cannot be written is logged
            and not used.
        beat: builds the current heartbeat for a ``seq``; called from the loop thread every
            ``interval_s`` seconds, so heartbeats keep flowing while the training thread is
            busy or stuck (that is how the daemon tells a hang from a death).
        interval_s: seconds between heartbeats.
        log: logger for connection trouble and losses.
        on_command: see :class:`Commands`.
        verify_keys: the daemon's public keys (see :class:`Commands`).
        event_key: the job's event key: every event is sent with its MAC; ``None`` sends
            events unauthenticated.
        relay: the socket of the supervisor's heartbeat relay, or ``None``: heartbeats go to
            the bus (module docstring).

    Raises:
        BusURLError: ``bus_config.url`` is not a bus URL.

    Attributes (counters, read from any thread):
        commands: the job's commands heard so far.
        connected: whether the loop holds a working connection.
        sent: events the bus confirmed, and heartbeats the relay took.
        relayed_heartbeats: heartbeats the relay took.
        dropped_heartbeats: heartbeats never delivered (ring overflow, failed sends).
        dropped_cursors: data-cursor events dropped to make room in a full outbox.
        refused_events: checkpoint and lifecycle events refused by a full outbox.
        send_errors: failed connect, send and poll attempts.
        last_error: the latest of those failures, as text.
    """

    def __init__(
        self,
        bus_config: BusConfig,
        job_id: str,
        generation: int,
        *,
        ring: int,
        max_events: int,
        spool: Path | None = None,
        beat: Callable[[int], Heartbeat],
        interval_s: float,
        log: FilteringBoundLogger,
        on_command: Callable[[Restore | Resume | Abort], None] | None = None,
        verify_keys: Mapping[str, Ed25519PublicKey] | None = None,
        event_key: EventKey | None = None,
        relay: Path | None = None,
    ) -> None:
        parse_bus_url(bus_config.url)
        self._bus_config = bus_config
        self._job_id = job_id
        self._beat = beat
        self._interval_s = interval_s
        self._log = log
        self.commands = Commands(job_id, generation, on_command, keys=verify_keys, log=log)
        self._event_key = event_key
        self.connected = False
        self.sent = 0
        self.relayed_heartbeats = 0
        self.dropped_heartbeats = 0
        self.dropped_cursors = 0
        self._relay = None if relay is None else str(relay)
        self._relay_socket: socket.socket | None = None
        self.refused_events = 0
        self.send_errors = 0
        self.last_error: str | None = None
        # The outbox and the spool; the condition's lock also makes "assign seq, spool,
        # append" one step, and lets flush() wait for the loop thread's progress.
        self._outbox = Outbox(max_events, ring)
        self._queue_changed = threading.Condition()
        self._spool: Spool | None = None
        if spool is not None:
            try:
                self._spool = Spool(spool)
            except OSError as exc:
                log.warning(
                    "spool not used: unsent events are lost if the process ends", error=str(exc)
                )
        self._last_seq = -1
        self._commands_next: int | None = None  # offset after the last command read
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._main: asyncio.Task[None] | None = None
        self._stopping = False
        self._said_last = False  # a finished or error event is queued: no heartbeat follows
        self._wake = asyncio.Event()  # something was queued, or stop
        self._broken: BusError | None = None  # the listener's failure, for the sender

    # -- called from the training thread ------------------------------------------------------

    @property
    def queued(self) -> int:
        """Events waiting to be sent."""
        return len(self._outbox)

    @property
    def spool_path(self) -> Path | None:
        """This process's spool file, or ``None`` without a spool."""
        return None if self._spool is None else self._spool.path

    def submit(
        self, build: Callable[[int], _E], *, reliable: bool = False, wake: bool = True
    ) -> _E:
        """Queue the event ``build(seq)`` and return it; safe from any thread.

        With ``reliable`` a heartbeat is queued as any other event (spooled, sent on the bus
        in ``seq`` order, never evicted nor relayed): the rank's last progress before its
        ``finished``, which the daemon must fold before the finish, and the heartbeats that
        carry a parameter checksum, which a relayed batch overtaken by a later event of the
        rank would lose (the daemon skips a batched heartbeat older than what it accepted).

        Without ``wake`` the loop thread is not woken: the event leaves with the next one that
        wakes it (the next heartbeat at the latest, within ``interval_s``). Waking it costs
        the calling thread the time the loop thread then holds the GIL (about 0.5 ms measured,
        ``bench/RESULTS.md``, "Lightning callback overhead"), which an event that may wait a
        beat (a checksum heartbeat) need not pay.

        ``seq`` is assigned, the event built (and MACed, with an event key), encoded and
        spooled under the outbox's lock, so queue order and ``seq`` order agree. A heartbeat
        beyond ``ring`` waiting ones evicts the oldest; one after a ``finished`` or ``error``
        lifecycle event (the process's last word) is not queued. Any other event beyond
        ``max_events`` waiting ones evicts the oldest data cursor, or without one is refused
        (logged as an error and counted, never raised: training goes on). The event returned
        carries its ``auth``.

        Raises:
            SchemaError: the event breaks the wire contract (nothing is queued).
        """
        with self._queue_changed:
            seq = next(_SEQ)
            event = build(seq)
            if self._event_key is not None:
                event = add_mac(event, self._event_key.kid, self._event_key.secret)
            kind: Kind = (
                "heartbeat"
                if isinstance(event, Heartbeat) and not reliable
                else "cursor"
                if isinstance(event, DataCursorEvent)
                else "event"
            )
            if isinstance(event, Heartbeat) and self._said_last:
                # The background beat can fire between the training thread's last word and
                # close(): a heartbeat after it would tell the daemon the process still runs.
                return event
            item = Queued(seq, encode(event), kind)
            if isinstance(event, Lifecycle) and event.kind in _LAST_WORDS:
                self._said_last = True
            added = self._outbox.add(item)
            if not added.accepted:
                self.refused_events += 1
                self._log.error(
                    "event_refused_outbox_full",
                    schema=type(event).SCHEMA,
                    seq=seq,
                    queued=self._outbox.events,
                    refused=self.refused_events,
                    last_error=self.last_error,
                )
                return event
            if added.evicted is not None:
                if added.evicted.kind == "heartbeat":
                    self.dropped_heartbeats += 1
                else:
                    self.dropped_cursors += 1
            if kind != "heartbeat":
                self._spool_add(item)
            self._last_seq = seq
        if wake:
            self._call(self._wake.set)
        return event

    def _spool_add(self, item: Queued) -> None:
        """Spool ``item`` (under the outbox's lock); a failed write stops spooling."""
        if self._spool is None:
            return
        try:
            self._spool.add(item.seq, item.data)
        except OSError as exc:
            self._spool_failed(exc)

    def _spool_settled(self, seq: int) -> None:
        if self._spool is None:
            return
        try:
            self._spool.settled(seq)
        except OSError as exc:
            self._spool_failed(exc)

    def _spool_failed(self, exc: OSError) -> None:
        # A spool that missed a line could make the supervisor forward a partial history.
        assert self._spool is not None
        self._log.error(
            "spool write failed: spooling stopped", path=str(self._spool.path), error=str(exc)
        )
        self._spool.close()
        self._spool = None

    def flush(self, timeout_s: float) -> bool:
        """Wait until every event queued so far has left the outbox (sent, or a heartbeat
        dropped), at most ``timeout_s`` seconds; return whether it has."""
        with self._queue_changed:
            upto = self._last_seq
            return self._queue_changed.wait_for(
                lambda: (oldest := self._outbox.oldest) is None or oldest > upto, timeout_s
            )

    def start(self) -> None:
        """Start the loop thread; it connects in the background. Call once."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run_thread, name=f"trainguard-agent-{self._job_id}", daemon=True
        )
        self._thread.start()

    def close(self, timeout_s: float) -> int:
        """Stop heartbeats, send what is queued (for at most ``timeout_s`` seconds), disconnect,
        stop the thread. Returns the number of checkpoint, data-cursor and lifecycle events left
        unsent (logged when > 0); with a spool they stay in its file, for the supervisor to
        forward once this process ended."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return self._unsent()
        self._call(self._begin_stop)
        thread.join(timeout_s)
        if thread.is_alive():
            self._call(self._cancel_main)
            thread.join(_STOP_GRACE_S)
        return self._unsent()

    def _unsent(self) -> int:
        with self._queue_changed:
            unsent = self._outbox.events
            spool = self._spool
            if spool is not None:
                spool.close()
                self._spool = None
        if unsent:
            self._log.warning(
                "events_unsent",
                count=unsent,
                last_error=self.last_error,
                spooled=None if spool is None else str(spool.path),
            )
        return unsent

    def _call(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the loop thread soon; a no-op before :meth:`start` (the loop looks at
        the FIFO when it starts) and once the loop has ended."""
        if self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed
            self._loop.call_soon_threadsafe(fn)

    # -- the loop thread ----------------------------------------------------------------------

    def _run_thread(self) -> None:
        loop = self._loop
        assert loop is not None  # set by start() before the thread starts
        asyncio.set_event_loop(loop)
        self._main = loop.create_task(self._run())
        try:
            loop.run_until_complete(self._main)
        except asyncio.CancelledError:
            pass
        except Exception:
            self._log.exception("agent_link_crashed")
        finally:
            self.connected = False
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _begin_stop(self) -> None:
        """Stop heartbeats; with nothing left to send, disconnect at once, else let the sender
        finish first."""
        self._stopping = True
        if self._outbox:
            self._wake.set()
        else:
            self._cancel_main()

    def _cancel_main(self) -> None:
        if self._main is not None:
            self._main.cancel()

    async def _run(self) -> None:
        beats = asyncio.create_task(self._heartbeats())
        try:
            await self._connections()
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
            if self._relay_socket is not None:
                self._relay_socket.close()

    async def _heartbeats(self) -> None:
        while not self._stopping:
            try:
                self.submit(self._beat)
            except SchemaError as exc:
                # A heartbeat the wire contract refuses (e.g. an absurd step) is lost, not fatal.
                with self._queue_changed:
                    self.dropped_heartbeats += 1
                self._fail("heartbeat", exc)
            await asyncio.sleep(self._interval_s)

    async def _connections(self) -> None:
        """Connect, serve, and on failure reconnect, until stopped with an empty FIFO."""
        failures = 0
        while True:
            bus = open_bus(self._bus_config)
            consumer: Consumer | None = None
            try:
                await bus.start()
                consumer = await self._follow_commands(bus)
                if failures:
                    self._log.info("bus_reconnected", after_failures=failures)
                failures, self.connected, self._broken = 0, True, None
                listener = asyncio.create_task(self._listen(consumer))
                try:
                    await self._send(bus)
                    return
                finally:
                    listener.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await listener
            except BusError as exc:
                self._fail("bus", exc, first=not failures)
                failures += 1
            finally:
                self.connected = False
                with contextlib.suppress(BusError):
                    if consumer is not None:
                        await consumer.close()
                    await bus.close()
            await self._pause(failures)

    async def _pause(self, failures: int) -> None:
        """Back off before retrying: ``0.1 * 2**(failures - 1)`` seconds, at most 2."""
        low, high = _BACKOFF_S
        await asyncio.sleep(min(high, low * 2 ** max(0, failures - 1)))

    def _fail(self, what: str, exc: BaseException, *, first: bool = True) -> None:
        """Count and remember a failure; log it when it starts a streak (``first``)."""
        self.send_errors += 1
        self.last_error = f"{what}: {type(exc).__name__}: {exc}"
        if first:
            self._log.warning("bus_trouble", error=self.last_error)

    async def _follow_commands(self, bus: Bus) -> Consumer:
        tp = TopicPartition(
            "commands", partition_for(self._job_id, await bus.partitions("commands"))
        )
        if self._commands_next is None:
            # End offset first: a command appended while the latest one is read is then read
            # twice (harmless, commands are idempotent) rather than missed.
            end = (await bus.end_offsets("commands"))[tp]
            latest = (await bus.latest_per_key("commands")).get(self._job_id)
            if latest is not None:
                self.commands.take(latest)
            self._commands_next = end
        return await bus.assign({tp: self._commands_next})

    async def _listen(self, consumer: Consumer) -> None:
        try:
            while True:
                for record in await consumer.getmany(timeout_s=_POLL_S):
                    self.commands.take(record)
                    self._commands_next = record.offset + 1
        except BusError as exc:
            self._broken = exc
            self._wake.set()

    async def _send(self, bus: Bus) -> None:
        """Send the outbox's events in order until stopped with an empty outbox.

        Raises:
            BusError: the connection is unusable, or a delivery is in doubt (the caller
                reconnects; the event stays taken, to be sent again on the new connection).
        """
        while True:
            if self._broken is not None:
                raise self._broken
            with self._queue_changed:
                beats = self._outbox.take_heartbeats()
                item = None if beats else self._outbox.take()
            if beats:
                await self._send_heartbeats(bus, beats)
            elif item is not None:
                await self._deliver(bus, item)
            elif self._stopping:
                return
            else:
                await self._wake.wait()
                self._wake.clear()

    async def _deliver(self, bus: Bus, item: Queued) -> None:
        """Send the taken ``item`` and wait until the bus has it, however long that takes.

        A retriable failure that appended nothing (not a ``DeliveryFailed`` in doubt) is
        retried on this connection after a pause.

        Raises:
            BusError: a failure that may have appended it, or that needs a new connection.
        """
        failures = 0
        while True:
            try:
                delivery = await bus.send("events", self._job_id, item.data)
                # Shielded: closing the link cancels this wait, not the delivery.
                await asyncio.shield(delivery)
            except BusError as exc:
                if not exc.retriable or (isinstance(exc, DeliveryFailed) and exc.in_doubt):
                    raise
                self._fail("send", exc, first=not failures)
                failures += 1
                await self._pause(failures)
                continue
            break
        with self._queue_changed:
            self._outbox.done()
            self.sent += 1
            self._spool_settled(item.seq)
            self._queue_changed.notify_all()

    def _relay_heartbeats(self, relay: str, batch: list[Queued]) -> list[Queued]:
        """Hand ``batch`` to the supervisor's relay at ``relay``, in order; return the
        heartbeats from the first one it did not take on (to be sent on the bus)."""
        if self._relay_socket is None:
            self._relay_socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._relay_socket.setblocking(False)
        for n, item in enumerate(batch):
            try:
                self._relay_socket.sendto(item.data, relay)
            except OSError:  # none listening, its buffer full: the bus takes them
                return batch[n:]
            with self._queue_changed:
                self.sent += 1
                self.relayed_heartbeats += 1
        return []

    async def _send_heartbeats(self, bus: Bus, batch: list[Queued]) -> None:
        """Pipeline ``batch``, the heartbeats that came next (already out of the outbox, so
        that the ring's evictions never touch them); failures drop them."""
        with self._queue_changed:
            self._queue_changed.notify_all()
        if self._relay is not None:
            batch = self._relay_heartbeats(self._relay, batch)
        futures: list[asyncio.Future[Any]] = []
        try:
            for item in batch:
                futures.append(await bus.send("events", self._job_id, item.data))
            results = await asyncio.gather(*futures, return_exceptions=True)
        except BaseException:
            for future in futures:
                future.cancel()
            with self._queue_changed:
                self.dropped_heartbeats += len(batch)
            raise
        failures = [r for r in results if isinstance(r, BaseException)]
        with self._queue_changed:
            self.sent += len(batch) - len(failures)
            self.dropped_heartbeats += len(failures)
        if failures:
            self._fail("heartbeat", failures[0], first=False)
