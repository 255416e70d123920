"""Idle consumers of the embedded bus: CPU per second with the change watch, against polling
the reader thread at every look (the behaviour before it), in the same run.

Usage (from the repository root)::

    python bench/idle_poll.py [--consumers 3] [--seconds 10] [--rounds 3]

``--consumers`` consumers of one embedded bus (one file, in a temporary folder), each assigned
every partition of ``events``, call ``getmany(timeout_s=0.05)`` in a loop (as the daemon's fold
loop does) while nothing is written. Two variants alternate, ``--rounds`` times each:

* ``watch``: the bus as it is: a look reads ``PRAGMA data_version`` on the event loop's thread
  (``trainguard.agent.bus._sqlite_db.ChangeWatch``) and hops to the reader thread only when it
  moved;
* ``hop``: the same bus with its change watch closed, so that every look of the idle cadence
  (every ``idle_poll_s``, 20 ms) hops to the reader thread, as before the watch.

Printed per variant: CPU time of this process over wall time (``time.process_time``, all its
threads; 100% = one core), its least over the rounds, and the ratio watch / hop. Figures are
printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from trainguard.agent.bus import DEFAULT_TOPICS, BusConfig, Consumer, TopicPartition
from trainguard.agent.bus._sqlite import SQLiteBus


async def _idle(bus: SQLiteBus, consumers: int, seconds: float) -> float:
    """CPU share of this process while ``consumers`` consumers of ``bus`` poll nothing."""
    partitions = await bus.partitions("events")
    tps = {TopicPartition("events", p): 0 for p in range(partitions)}
    readers = [await bus.assign(tps) for _ in range(consumers)]
    for consumer in readers:
        await consumer.getmany(timeout_s=0.3)  # past the first look, the cadence at its longest

    async def poll(consumer: Consumer) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            assert await consumer.getmany(timeout_s=0.05) == []

    cpu, wall = time.process_time(), time.monotonic()
    await asyncio.gather(*(poll(c) for c in readers))
    share = (time.process_time() - cpu) / (time.monotonic() - wall)
    for consumer in readers:
        await consumer.close()
    return share


async def _variant(folder: Path, name: str, consumers: int, seconds: float) -> float:
    path = folder / f"{name}.db"
    bus = SQLiteBus(BusConfig(url=f"sqlite://{path}", topics=DEFAULT_TOPICS), str(path))
    async with bus:
        if name == "hop":
            watch = bus._watch  # the baseline: no change watch, every look hops
            assert watch is not None
            watch.close()
        return await _idle(bus, consumers, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--consumers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name in ("watch", "hop"):
                share = asyncio.run(_variant(Path(tmp), name, args.consumers, args.seconds))
                best[name] = min(best.get(name, share), share)
    for name, share in best.items():
        print(f"{name:5s}: {100 * share:5.2f}% of a core ({args.consumers} idle consumers)")
    print(f"watch / hop: {best['watch'] / best['hop']:.2f}")


if __name__ == "__main__":
    main()
