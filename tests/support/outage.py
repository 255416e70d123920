"""Helpers of the outage tests: a supervised worker with a real agent that checkpoints and
finishes when told, a reader of the job's events in bus order, and the embedded bus file held
write-locked by another connection (:func:`write_locked`), as a stuck process would."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from trainguard.agent.bus import Bus, BusConfig
from trainguard.agent.supervisor._supervisor import SupervisorConfig
from trainguard.schemas import Checkpoint, Event, Heartbeat, Lifecycle, decode

JOB = "outage-job"

# A real agent: trains 3 steps, waits for the file argv[1], checkpoints step 3, finishes. Its
# close waits TRAINGUARD_CLOSE_TIMEOUT for the bus, then leaves the rest in its spool.
WORKER = """
import pathlib, sys, time
import torch
from trainguard.agent import Agent
from trainguard.schemas import DataCursor
go = pathlib.Path(sys.argv[1])
cursor = DataCursor(data_version="v1", seed=0, epoch=0, offset=24, world_size=1)
with Agent() as agent:
    agent.ready(0)
    for step in range(1, 4):
        agent.step(step, loss=1.0, samples=8)
    while not go.exists():
        time.sleep(0.02)
    agent.checkpoint(3, {"w": torch.ones(2)}, cursor=cursor)
"""


def supervised(tmp_path: Path, bus: BusConfig, **overrides: Any) -> SupervisorConfig:
    """One node, one rank running :data:`WORKER`, which goes on once ``tmp_path/go`` exists."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    settings: dict[str, Any] = {
        "job_id": JOB,
        "bus": bus,
        "command": [sys.executable, str(script), str(tmp_path / "go")],
        "nproc_per_node": 1,
        "grace_s": 1.0,
        "host": "node-a",
        "daemon_timeout_s": 0.0,
        "state_dir": tmp_path / "state",
        "env": {
            "TRAINGUARD_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
            "TRAINGUARD_CLOSE_TIMEOUT": "0.2",
        },
    }
    return SupervisorConfig(**{**settings, **overrides})


async def job_events(bus: Bus) -> list[Event]:
    """The job's checkpoint and lifecycle events (no heartbeats), in bus order."""
    ends = {tp: end for tp, end in (await bus.end_offsets("events")).items() if end}
    found: list[tuple[int, Event]] = []
    if not ends:
        return []
    async with await bus.assign(dict.fromkeys(ends, 0)) as consumer:
        seen = 0
        while seen < sum(ends.values()):
            for record in await consumer.getmany(timeout_s=1.0):
                seen += 1
                if record.key != JOB or record.value is None:
                    continue
                event = cast(Event, decode(record.value, expect=Event))
                if not isinstance(event, Heartbeat):
                    found.append((record.offset, event))
    return [e for _, e in sorted(found, key=lambda p: p[0])]


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    """Wait for ``condition()``; fail naming ``what`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.05)


async def wait_for_events(
    bus: Bus, done: Callable[[list[Event]], bool], timeout_s: float = 120.0
) -> list[Event]:
    """Poll the job's events until ``done(events)``."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = await job_events(bus)
        if done(events):
            return events
        if time.monotonic() > deadline:
            raise AssertionError(f"events not as expected after {timeout_s:g} s: {events}")
        await asyncio.sleep(0.1)


def agent_started(events: list[Event]) -> bool:
    return any(isinstance(e, Lifecycle) and e.kind == "started" and e.rank == 0 for e in events)


def last_words_in_order(events: list[Event]) -> list[str]:
    """The worker's checkpoint and ``finished``, and the supervisor's ``exited``, as
    ``checkpoint@step``, ``finished``, ``exited(code)``, in bus order."""
    out: list[str] = []
    for e in events:
        if isinstance(e, Checkpoint):
            out.append(f"checkpoint@{e.step}")
        elif isinstance(e, Lifecycle) and e.kind == "finished":
            out.append("finished")
        elif isinstance(e, Lifecycle) and e.kind == "exited":
            out.append(f"exited({e.exit_code})")
    return out


def first_copies(events: list[Event]) -> list[Event]:
    """``events`` without the copies of an earlier one (same sender and ``seq``), as the
    daemon drops them."""
    seen: set[tuple[int | None, str, int, int]] = set()
    out: list[Event] = []
    for e in events:
        key = (e.rank, e.host, e.pid, e.seq)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


@contextmanager
def written_busily(path: Path) -> Iterator[None]:
    """Another process's writer at its busiest while the block runs: the bus file's write lock
    held 50 ms per transaction, each committing, back to back (SQLite's busy handler then
    rarely catches the lock free)."""
    stop = threading.Event()

    def write() -> None:
        conn = sqlite3.connect(path, isolation_level=None)
        n = 0
        while not stop.is_set():
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT OR REPLACE INTO meta (name, value) VALUES ('busy', ?)", (n,))
            time.sleep(0.05)
            conn.execute("COMMIT")
            n += 1
        conn.close()

    writer = threading.Thread(target=write, name="busy-writer")
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join()


@contextmanager
def write_locked(path: Path) -> Iterator[Callable[[], None]]:
    """Hold the bus file's write lock from another connection, as a stuck process would;
    yields a function that releases it early."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")

    def release() -> None:
        if conn.in_transaction:
            conn.execute("COMMIT")

    try:
        yield release
    finally:
        release()
        conn.close()
