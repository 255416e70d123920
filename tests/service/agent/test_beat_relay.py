"""The supervisor's heartbeat relay on a real embedded bus: what its workers' agents hand it
over its socket leaves as one MACed ``heartbeat-batch`` per flush, each rank's newest heartbeat
since the previous batch and nothing else; what is not a heartbeat of its job and node, or not
authentic, is refused."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.buses import BusFactory
from tests.support.service_support import eventually, read_all
from trainguard.agent.bus import Bus
from trainguard.agent.keys._keystore import EventKey
from trainguard.agent.supervisor._beat_relay import BeatRelay
from trainguard.schemas import Heartbeat, HeartbeatBatch, add_mac, decode, encode, verify_mac

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

KEY = EventKey(kid="0123456789abcdef", secret=bytes(range(32)))
OTHER_KEY = EventKey(kid="fedcba9876543210", secret=bytes(32))
JOB = "relay-job"


def beat(rank: int, seq: int, *, host: str = "node-1", key: EventKey = KEY) -> bytes:
    """Rank ``rank``'s heartbeat as its agent sends it (encoded, MACed)."""
    message = Heartbeat(
        job_id=JOB, generation=0, ts=seq, seq=seq, rank=rank, host=host, pid=100 + rank,
        world_size=16, step=seq, phase="train", loss=1.5,
    )  # fmt: skip
    return encode(add_mac(message, key.kid, key.secret))


@pytest.fixture
async def bus(tmp_path: Path) -> AsyncIterator[Bus]:
    async with BusFactory("sqlite", f"sqlite://{tmp_path / 'bus.db'}", "t.").open() as opened:
        yield opened


async def batches(bus: Bus) -> list[HeartbeatBatch]:
    out = []
    for value in await read_all(bus, "events"):
        verify_mac(value, {KEY.kid: KEY.secret})
        out.append(decode(value, expect=HeartbeatBatch))
    return out


async def test_a_batch_holds_each_ranks_newest_heartbeat_since_the_previous_one(bus: Bus) -> None:
    seqs = iter(range(1, 100))
    relay = BeatRelay(JOB, "node-1", KEY, 60.0, lambda: next(seqs))
    path = await relay.open()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as agent:
            for data in (beat(0, 1), beat(1, 1), beat(0, 2)):
                agent.sendto(data, str(path))

            async def both() -> bool:
                return relay.waiting == (0, 1)

            await eventually(both)
            await relay.flush(bus)
            # Rank 1 falls silent: the next batch holds rank 0 alone.
            agent.sendto(beat(0, 3), str(path))

            async def rank_0() -> bool:
                return relay.waiting == (0,)

            await eventually(rank_0)
            await relay.flush(bus)
            await relay.flush(bus)  # nothing waits: no record
    finally:
        relay.close()
    first, second = await batches(bus)
    assert [(b.rank, b.seq) for b in first.beats] == [(0, 2), (1, 1)]
    assert [(b.rank, b.seq) for b in second.beats] == [(0, 3)]
    assert (first.host, first.job_id, first.seq, second.seq) == ("node-1", JOB, 1, 2)
    sent = decode(beat(0, 2), expect=Heartbeat)
    assert first.heartbeats()[0] == dataclasses.replace(sent, auth=None)
    assert (relay.sent, relay.batches, relay.refused, relay.dropped) == (3, 2, 0, 0)
    assert not path.exists()


async def test_foreign_forged_and_forgotten_heartbeats_stay_out_of_batches(bus: Bus) -> None:
    relay = BeatRelay(JOB, "node-1", KEY, 60.0, lambda: 1)
    path = await relay.open()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as agent:
            for data in (
                beat(0, 1, host="node-2"),  # another node's rank
                beat(1, 1, key=OTHER_KEY),  # not under the job's key
                b"not a heartbeat",
                beat(2, 1),
                beat(3, 1),
            ):
                agent.sendto(data, str(path))

            async def refused_and_taken() -> bool:
                return relay.refused == 3 and relay.waiting == (2, 3)

            await eventually(refused_and_taken)
            relay.forget([3])  # its worker exited: its exit report tells the rest
            await relay.flush(bus)
    finally:
        relay.close()
    [only] = await batches(bus)
    assert [b.rank for b in only.beats] == [2]
