"""Helpers for tests that run a real :class:`DaemonService` on a real bus."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from trainguard.agent.bus import Bus
from trainguard.daemon import DaemonService
from trainguard.schemas import Checkpoint, DataCursor, Heartbeat, Lifecycle

CURSOR = DataCursor(data_version="v1", seed=7, epoch=0, offset=80, world_size=2)
"""The data cursor of every shard :class:`JobEvents` makes."""


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
                if record.offset < ends[record.tp]:
                    values.append(record.value or b"")
            for tp in pending:  # past transaction markers, which no record carries
                seen[tp] = await consumer.position(tp)
    return values


@dataclass(frozen=True)
class JobEvents:
    """Events of a 2-rank job of generation 0 on host ``h0``, as service tests publish them:
    rank r is pid 100 + r, its supervisor pid 900; ``seq`` as the test gives it (the
    supervisor's is 0). ``job`` overrides :attr:`job_id` for one event."""

    job_id: str

    def head(self, seq: int, job: str | None = None) -> dict[str, Any]:
        """The sender fields every event carries (rank, pid and the rest are the caller's)."""
        return {
            "job_id": job or self.job_id,
            "generation": 0,
            "ts": time.time_ns(),
            "seq": seq,
            "host": "h0",
        }

    def started(self, rank: int, job: str | None = None) -> Lifecycle:
        """Rank ``rank``'s ``started`` report (seq 0), world size 2."""
        return Lifecycle(
            **self.head(0, job), rank=rank, pid=100 + rank, kind="started", world_size=2
        )

    def beat(self, rank: int, seq: int, step: int, job: str | None = None) -> Heartbeat:
        """A training heartbeat of rank ``rank`` at ``step``."""
        return Heartbeat(
            **self.head(seq, job),
            rank=rank,
            pid=100 + rank,
            world_size=2,
            step=step,
            phase="train",
        )

    def shard(self, rank: int, seq: int, step: int) -> Checkpoint:
        """Rank ``rank``'s checkpoint shard of ``step`` (123 bytes, a fixed digest,
        :data:`CURSOR`)."""
        return Checkpoint(
            **self.head(seq, None),
            rank=rank,
            pid=100 + rank,
            world_size=2,
            step=step,
            shard_uri=f"file:///ckpt/{step}/{rank}.pt",
            size_bytes=123,
            digest="sha256:" + "ab" * 32,
            cursor=CURSOR,
        )

    def killed(self, rank: int) -> Lifecycle:
        """The supervisor's report that rank ``rank`` died of SIGKILL."""
        return Lifecycle(
            **self.head(0, None), rank=None, pid=900, kind="exited", ranks=(rank,), signal=9
        )
