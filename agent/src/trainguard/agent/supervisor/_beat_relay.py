"""The node's heartbeat relay: its workers' heartbeats in one ``heartbeat-batch`` record.

With ``heartbeat_batch_s`` > 0 (``trainguard run --batch-heartbeats``) the supervisor binds a
Unix datagram socket in a folder of its own (mode 0700) and gives its path to its workers
(``TRAINGUARD_HEARTBEAT_RELAY``). A worker's agent then hands each heartbeat it built, encoded
and MACed as it would send it, to that socket (one ``send`` on a non-blocking socket, no
connection), instead of to the bus; every ``heartbeat_batch_s`` seconds the relay sends the
heartbeats it received since its previous batch as one record (``docs/wire-contract.md``,
heartbeat-batch). A node of 8 ranks then puts one record on the bus where it put 8, and the
daemon decodes and authenticates one.

Per-rank detection is kept: a batch holds, for each rank, only its newest heartbeat received
since the previous batch, unchanged; a rank that sent none meanwhile (killed, paused, its
process gone) is missing from it, and its silence shows at the daemon as without batching.
Ranks the supervisor saw exit are dropped from the pending batch (their exit report tells the
rest). A heartbeat waits at most ``heartbeat_batch_s`` for its batch: to the daemon, delivery
delay like the bus's own.

Failures are no surprise to anyone: a worker whose send fails (no relay listening: the
supervisor is gone or still starting; its socket buffer full) sends that heartbeat on the bus
itself (:mod:`trainguard.agent._link`); the relay drops a datagram that is no heartbeat of its
job and host, or whose MAC does not verify under the job's event key (counted, logged once);
a batch the bus does not take is dropped like an agent's failed heartbeat (counted, logged):
the next one carries newer heartbeats.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import structlog

from trainguard.agent.bus import Bus, BusError
from trainguard.agent.keys._keystore import EventKey
from trainguard.schemas import (
    MAX_BATCHED_BEATS,
    Heartbeat,
    HeartbeatBatch,
    SchemaError,
    add_mac,
    batched_beat,
    decode,
    encode,
    verify_mac,
)

__all__ = ["HEARTBEAT_RELAY_ENV", "BeatRelay"]

HEARTBEAT_RELAY_ENV = "TRAINGUARD_HEARTBEAT_RELAY"
"""The environment variable by which a supervisor gives its workers its relay's socket."""

log = structlog.get_logger("trainguard.supervisor")


class BeatRelay:
    """Collects a node's heartbeats from its workers and sends them batched (module
    docstring). :meth:`open` binds the socket, :meth:`run` (a task) sends a batch every
    ``interval_s``, :meth:`close` removes the socket.

    Args:
        job_id: the job; heartbeats of another job are refused.
        host: this node's name; heartbeats naming another host are refused, and the batches
            name it.
        event_key: the job's event key: heartbeats must carry its MAC, and batches carry it;
            ``None``: neither (a job without keys).
        interval_s: seconds between two batches (> 0).
        seq: the supervisor's sequence counter (shared with its lifecycle events).

    Attributes (counters):
        sent: heartbeats in batches the bus took.
        refused: datagrams refused (not a heartbeat of this job and host, or not authentic).
        batches: batch records the bus took.
        dropped: heartbeats in batches the bus did not take.
    """

    def __init__(
        self,
        job_id: str,
        host: str,
        event_key: EventKey | None,
        interval_s: float,
        seq: Callable[[], int],
    ) -> None:
        self._job = job_id
        self._host = host
        self._key = event_key
        self._interval_s = interval_s
        self._seq = seq
        self._pending: dict[int, Heartbeat] = {}
        self._folder: Path | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self.sent = 0
        self.refused = 0
        self.batches = 0
        self.dropped = 0

    @property
    def path(self) -> Path | None:
        """The socket the workers send to (:data:`HEARTBEAT_RELAY_ENV`), ``None`` before
        :meth:`open`."""
        return None if self._folder is None else self._folder / "relay.sock"

    @property
    def waiting(self) -> tuple[int, ...]:
        """The ranks whose heartbeat waits for the next batch, in order."""
        return tuple(sorted(self._pending))

    async def open(self) -> Path:
        """Bind the relay's socket in a new private folder (short, under the system's
        temporary folder: a socket path has at most 107 bytes) and return its path.

        Raises:
            OSError: the folder or the socket cannot be made.
        """
        self._folder = Path(tempfile.mkdtemp(prefix="trainguard-beats-"))
        path = self._folder / "relay.sock"
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: _Receiver(self.take), local_addr=str(path), family=socket.AF_UNIX
        )
        self._transport = transport
        return path

    def close(self) -> None:
        """Stop receiving and remove the socket's folder."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def take(self, data: bytes) -> None:
        """Keep the heartbeat ``data`` (as a worker's agent encoded it) as its rank's newest,
        or refuse it (counted; the first refusal is logged)."""
        try:
            beat = decode(data, expect=Heartbeat)
            if self._key is not None:
                verify_mac(data, {self._key.kid: self._key.secret})
        except SchemaError as exc:
            self._refuse(str(exc))
            return
        if beat.job_id != self._job or beat.host != self._host:
            self._refuse(f"a heartbeat of job {beat.job_id!r} on host {beat.host!r}")
            return
        self._pending[beat.rank] = beat

    def forget(self, ranks: Iterable[int]) -> None:
        """Drop the pending heartbeats of ``ranks``, whose process the supervisor saw end."""
        for rank in ranks:
            self._pending.pop(rank, None)

    async def run(self, bus: Bus) -> None:
        """Send a batch of the heartbeats received meanwhile every ``interval_s`` seconds,
        until cancelled. Never raises for the bus."""
        while True:
            await asyncio.sleep(self._interval_s)
            await self.flush(bus)

    async def flush(self, bus: Bus) -> None:
        """Send the pending heartbeats now, as batches of at most :data:`MAX_BATCHED_BEATS`
        in rank order, each awaited until the bus took it; a failure drops the batch."""
        beats = [self._pending[r] for r in self.waiting]
        self._pending.clear()
        for first in range(0, len(beats), MAX_BATCHED_BEATS):
            chunk = beats[first : first + MAX_BATCHED_BEATS]
            batch = HeartbeatBatch(
                job_id=self._job,
                ts=time.time_ns(),
                seq=self._seq(),
                host=self._host,
                pid=os.getpid(),
                beats=tuple(batched_beat(b) for b in chunk),
            )
            if self._key is not None:
                batch = add_mac(batch, self._key.kid, self._key.secret)
            try:
                await (await bus.send("events", self._job, encode(batch)))
            except BusError as exc:
                self.dropped += len(chunk)
                log.warning(
                    "heartbeat batch not sent", ranks=len(chunk), error=str(exc), job_id=self._job
                )
                continue
            self.sent += len(chunk)
            self.batches += 1

    def _refuse(self, why: str) -> None:
        if not self.refused:
            log.warning("heartbeat relay refused a datagram", reason=why, job_id=self._job)
        self.refused += 1


class _Receiver(asyncio.DatagramProtocol):
    """Hands every datagram to ``take``."""

    def __init__(self, take: Callable[[bytes], None]) -> None:
        self._take = take

    def datagram_received(self, data: bytes, addr: object) -> None:
        self._take(data)
