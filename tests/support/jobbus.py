"""Test helpers that play the daemon's side of the bus for one job: read the job's events,
publish commands, and build a snapshot manifest from checkpoint events.

Synchronous wrappers (each opens its own connection), so tests and threads can call them while
an agent runs its own loop in the background.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TypeVar, cast

from trainguard.agent.bus import BusConfig, Record, open_bus
from trainguard.agent.checkpoint import store_manifest
from trainguard.schemas import (
    Abort,
    Checkpoint,
    Command,
    Event,
    Lifecycle,
    Manifest,
    Restore,
    Resume,
    Shard,
    StepRange,
    decode,
    encode,
    split_manifest,
)

E = TypeVar("E", bound=Event)

DAEMON_ID = "test-daemon"

JOB = "job-1"
"""The job id of the agent tests."""


def read_events(url: str, job_id: str) -> list[Event]:
    """Every event of ``job_id`` on the bus at ``url``, in the order the bus holds them."""

    async def _read() -> list[Event]:
        async with open_bus(BusConfig(url=url)) as bus:
            ends = await bus.end_offsets("events")
            consumer = await bus.assign(dict.fromkeys(ends, 0))
            records: list[Record] = []
            while sum(ends.values()) > len(records):
                records += await consumer.getmany(timeout_s=1.0)
            await consumer.close()
        ordered = sorted(records, key=lambda r: (r.partition, r.offset))
        return [
            cast(Event, decode(r.value, expect=Event))
            for r in ordered
            if r.key == job_id and r.value
        ]

    return asyncio.run(_read())


def of_type(events: list[Event], kind: type[E]) -> list[E]:
    """The events of one class."""
    return [e for e in events if isinstance(e, kind)]


def lifecycles(events: list[Event], kind: str) -> list[Lifecycle]:
    """The lifecycle events of one ``kind`` (``started``, ``restored``, ...)."""
    return [e for e in of_type(events, Lifecycle) if e.kind == kind]


def wait_for_events(
    url: str, job_id: str, done: Callable[[list[Event]], bool], timeout_s: float = 10.0
) -> list[Event]:
    """Poll the job's events until ``done(events)``; raise ``TimeoutError`` after
    ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = read_events(url, job_id)
        if done(events):
            return events
        if time.monotonic() > deadline:
            raise TimeoutError(f"events of {job_id} not as expected after {timeout_s} s: {events}")
        time.sleep(0.05)


def after_acks(
    url: str, generation: int, ranks: range, command: Command, timeout_s: float = 120.0
) -> threading.Thread:
    """Start a thread that plays the daemon: once every rank of ``ranks`` has acknowledged the
    restore of ``generation`` (lifecycle ``restored``), it publishes ``command`` (usually that
    generation's ``resume``). Join the returned thread; a timeout ends it without publishing.
    """

    def acknowledged(events: list[Event]) -> bool:
        restored = lifecycles(events, "restored")
        return {e.rank for e in restored if e.generation == generation} >= set(ranks)

    def run() -> None:
        try:
            wait_for_events(url, command.job_id, acknowledged, timeout_s)
        except TimeoutError:
            return
        publish(url, command)

    thread = threading.Thread(target=run, name="test-daemon", daemon=True)
    thread.start()
    return thread


def publish(url: str, message: Command | Manifest) -> None:
    """Publish a command on the ``commands`` topic, or a manifest on ``manifests``, keyed by
    its job id."""
    topic = "manifests" if isinstance(message, Manifest) else "commands"

    async def _publish() -> None:
        async with open_bus(BusConfig(url=url)) as bus:
            await bus.publish(topic, message.job_id, encode(message))

    asyncio.run(_publish())


def restore(
    job_id: str,
    generation: int,
    target: Manifest | None,
    *,
    at_step: int | None = None,
    skip: StepRange | None = None,
) -> Restore:
    """A restore command establishing ``generation`` with ``target``: in process at
    ``at_step`` when it is given, else a restart; skipping the batches of ``skip``. As the
    daemon does, ``target``'s manifest is stored beside its checkpoint and the command names
    it by reference."""
    ref = None
    if target is not None:
        split = split_manifest(target)
        store_manifest(split)
        ref = split.ref
    return Restore(
        job_id=job_id,
        generation=generation,
        ts=time.time_ns(),
        seq=generation,
        daemon_id=DAEMON_ID,
        incident_id=f"{job_id}/i{generation}",
        reason="test",
        target=ref,
        mode="restart" if at_step is None else "in_process",
        at_step=at_step,
        skip=skip,
    )


def resume(job_id: str, generation: int, step: int) -> Resume:
    """A resume command for ``generation``."""
    return Resume(
        job_id=job_id,
        generation=generation,
        ts=time.time_ns(),
        seq=10_000 + generation,
        daemon_id=DAEMON_ID,
        step=step,
    )


def abort(job_id: str, generation: int, reason: str) -> Abort:
    """An abort command."""
    return Abort(
        job_id=job_id,
        generation=generation,
        ts=time.time_ns(),
        seq=20_000 + generation,
        daemon_id=DAEMON_ID,
        reason=reason,
    )


def committed_manifest(
    events: list[Event], job_id: str, world_size: int, generation: int = 0
) -> Manifest | None:
    """The manifest of the newest step of ``generation`` with a checkpoint from every rank (the
    daemon's commit rule, without its data-version and cursor checks), or ``None``."""
    shards: dict[int, dict[int, Checkpoint]] = defaultdict(dict)
    for event in of_type(events, Checkpoint):
        if event.generation == generation:
            shards[event.step][event.rank] = event
    complete = [step for step, ranks in shards.items() if len(ranks) == world_size]
    if not complete:
        return None
    step = max(complete)
    ordered = [shards[step][rank] for rank in range(world_size)]
    return Manifest(
        job_id=job_id,
        snapshot_id=f"{job_id}/g{generation}/s{step}",
        generation=generation,
        ts=time.time_ns(),
        step=step,
        world_size=world_size,
        shards=tuple(
            Shard(rank=c.rank, uri=c.shard_uri, size_bytes=c.size_bytes, digest=c.digest)
            for c in ordered
        ),
        cursor=ordered[0].cursor,
        metadata=ordered[0].metadata,
    )
