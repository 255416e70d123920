"""One producer process of the contract suite's concurrency test, run as a script.

``python _producer.py URL PREFIX TOPICS_JSON PRODUCER COUNT KEYS`` opens its own bus (topics as
``[[name, partitions, compacted], ...]``), prints ``ready``, waits for a line on stdin (so all
producers start together), sends COUNT records to ``events`` with key ``k{seq % KEYS}`` and
value ``PRODUCER:SEQ``, waiting for a delivery after every :data:`CHUNK` sends (so the
processes' writes interleave), awaits every delivery and prints ``done``.
"""

from __future__ import annotations

import asyncio
import json
import sys

from trainguard.agent.bus import BusConfig, TopicSpec, open_bus

CHUNK = 20


async def produce(
    url: str, prefix: str, topics: tuple[TopicSpec, ...], producer: int, count: int, keys: int
) -> None:
    """Send the records (see the module docstring) through one bus object."""
    config = BusConfig(url=url, prefix=prefix, topics=topics, send_timeout_s=60.0)
    async with open_bus(config) as bus:
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        futures = []
        for seq in range(count):
            futures.append(await bus.send("events", f"k{seq % keys}", f"{producer}:{seq}".encode()))
            if seq % CHUNK == CHUNK - 1:
                # Many small overlapping writes rather than one big batch per process.
                await futures[-1]
        await asyncio.gather(*futures)
    print("done", flush=True)


if __name__ == "__main__":
    url, prefix, topics_json, producer, count, keys = sys.argv[1:]
    specs = tuple(TopicSpec(n, p, c) for n, p, c in json.loads(topics_json))
    asyncio.run(produce(url, prefix, specs, int(producer), int(count), int(keys)))
