"""The daemon's fold on Kafka with transactions against without them (issue 13).

Usage::

    python bench/daemon_txn.py [--events N] [--kafka host:port] [--rounds R] [--json FILE]

One topic prefix is loaded once with ``--events`` events of 64 jobs of 8 ranks (6 partitions
of ``events``): each rank's ``started``, then heartbeats, and a checkpoint shard every 25
steps (so a checkpoint of every job commits every 200 of its records: a manifest and audit
entries to write, about one decision per 25 records). Each round then runs a real
:class:`~trainguard.daemon.DaemonService` (decode, validation, the state machine, acting) in a
fresh consumer group over all of it, once per mode, the modes alternating in order from round
to round:

* ``txn``: the product: every write for partition ``p`` and ``p``'s position in one Kafka
  transaction (a transactional producer per partition), committed every 2000 records or
  ``commit_interval_s`` (0.1 s);
* ``plain``: the same loop and commit points, but the writes go through the bus's idempotent
  producer (``send``, the deliveries awaited at each commit point) and the positions through
  the consumer's ``commit``: what the daemon would do without transactions, and at least as
  fast as the loop before them, which awaited every write one by one.

A round's figure is events folded per second, from the moment the daemon is ready (its
partitions taken on) to the moment every partition's committed position reached the end of
``events``. The daemon's clock for ticks is frozen, so that no timeout fires however old the
events are. The ratio txn/plain is taken per round (same broker state, same machine load),
and its median over the rounds is the result (target: at least 70%).

Without ``--kafka`` the script starts a broker with ``deploy/kafka/kafka-dev`` in a
temporary directory and stops it at the end. Prints a table; the exit status is 0 unless the
script itself fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from unittest import mock

from trainguard.agent.bus import (
    DEFAULT_TOPICS,
    Bus,
    BusConfig,
    Consumer,
    Delivery,
    PartitionWriter,
    TopicPartition,
    open_bus,
)
from trainguard.agent.bus._kafka import KafkaBus
from trainguard.daemon import DaemonService, MachineConfig
from trainguard.daemon.service._settings import DaemonConfig
from trainguard.schemas import Checkpoint, DataCursor, Event, Heartbeat, Lifecycle, encode

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # bench._broker

from bench._broker import kafka_broker  # noqa: E402

JOBS = 64
RANKS = 8
CHECKPOINT_EVERY = 25
"""Steps between two checkpoints of a job."""
RUN_TIMEOUT_S = 600.0


def workload(n: int) -> list[Event]:
    """About ``n`` events: every rank's ``started``, then round-robin over jobs and ranks one
    heartbeat per step, and a checkpoint shard every :data:`CHECKPOINT_EVERY` steps."""
    now = time.time_ns()
    events: list[Event] = []
    seqs: dict[tuple[int, int], int] = {}

    def head(job: int, rank: int) -> dict[str, object]:
        seq = seqs.get((job, rank), 0)
        seqs[(job, rank)] = seq + 1
        return {
            "job_id": f"job-{job:02d}",
            "generation": 0,
            "ts": now + len(events),
            "seq": seq,
            "host": f"node{rank:03d}",
            "rank": rank,
            "pid": 1000 + rank,
            "world_size": RANKS,
        }

    for job in range(JOBS):
        for rank in range(RANKS):
            events.append(Lifecycle(**head(job, rank), kind="started"))  # type: ignore[arg-type]
    step = 0
    while len(events) < n:
        step += 1
        for job in range(JOBS):
            for rank in range(RANKS):
                events.append(
                    Heartbeat(
                        **head(job, rank),  # type: ignore[arg-type]
                        step=step,
                        phase="train",
                        step_time_s=0.25,
                        loss=2.0,
                        samples=step * 32,
                    )
                )
                if step % CHECKPOINT_EVERY == 0:
                    events.append(
                        Checkpoint(
                            **head(job, rank),  # type: ignore[arg-type]
                            step=step,
                            shard_uri=f"file:///ckpt/job-{job:02d}/{step}/{rank}.pt",
                            size_bytes=123,
                            digest="sha256:" + "ab" * 32,
                            cursor=DataCursor(
                                data_version="v1",
                                seed=7,
                                epoch=0,
                                offset=step * 32 * RANKS,
                                world_size=RANKS,
                            ),
                        )
                    )
    return events


class _PlainWriter(PartitionWriter):
    """The ``plain`` mode's writer: the bus's idempotent producer, deliveries awaited at the
    commit, then the position committed by the consumer (two steps, not atomic)."""

    def __init__(self, bus: Bus, consumer: Consumer) -> None:
        self._bus = bus
        self._consumer = consumer
        self._pending: list[asyncio.Future[Delivery]] = []

    async def send(
        self, topic: str, key: str, value: bytes | None, *, partition: int | None = None
    ) -> None:
        # Bus.send places records by key only; the benchmark's daemons write no snapshot
        # chunks, the one record that names its partition.
        if partition is not None:
            raise ValueError("the plain writer sends records to their key's partition only")
        self._pending.append(await self._bus.send(topic, key, value))

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        pending, self._pending = self._pending, []
        await asyncio.gather(*pending)
        if offsets:
            await self._consumer.commit(offsets)

    async def abort(self) -> None:
        self._pending.clear()

    async def close(self) -> None:
        self._pending.clear()


class _PlainKafkaBus(KafkaBus):
    """A Kafka bus whose partition writers are :class:`_PlainWriter`."""

    async def partition_writer(self, group_id: str, partition: int) -> PartitionWriter:
        [consumer] = [c for c in self._consumers if c._group_id == group_id]
        return _PlainWriter(self, consumer)


def bus_config(bootstrap: str, prefix: str) -> BusConfig:
    return BusConfig(
        url=f"kafka://{bootstrap}",
        prefix=prefix,
        topics=DEFAULT_TOPICS,
        connect_timeout_s=60.0,
        send_timeout_s=60.0,
    )


async def load(config: BusConfig, events: Sequence[Event]) -> dict[int, int]:
    """Produce ``events`` (pipelined); the end offsets of ``events`` after."""
    async with open_bus(config) as bus:
        futures = [await bus.send("events", e.job_id, encode(e)) for e in events]
        await asyncio.gather(*futures)
        return {tp.partition: end for tp, end in (await bus.end_offsets("events")).items()}


async def fold_once(
    config: BusConfig, ends: dict[int, int], mode: str, n: int
) -> tuple[float, float, int]:
    """One daemon over all of ``events`` in a fresh group: (events/s, CPU-s per wall-s,
    commands issued)."""
    daemon = DaemonConfig(
        bus=config,
        machine=MachineConfig(daemon_id=f"bench-{mode}"),
        group_id=f"{config.prefix}bench-{mode}-{uuid.uuid4().hex[:6]}",
        poll_s=0.05,
    )
    service = DaemonService(daemon, clock=lambda: 0)  # a frozen clock: no tick is ever due
    stop = asyncio.Event()

    def opened(cfg: BusConfig | str) -> Bus:
        assert isinstance(cfg, BusConfig)
        return _PlainKafkaBus(cfg, cfg.url.removeprefix("kafka://"))

    patch = (
        mock.patch("trainguard.daemon.service._daemon.open_bus", opened)
        if mode == "plain"
        else None
    )
    if patch is not None:
        patch.start()
    task = asyncio.ensure_future(service.run(stop))
    try:
        await asyncio.wait_for(service.ready.wait(), RUN_TIMEOUT_S)
        start, cpu = time.perf_counter(), time.process_time()
        deadline = start + RUN_TIMEOUT_S
        while not all(
            p in service._partitions and service._partitions[p].committed >= end
            for p, end in ends.items()
        ):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{mode}: not caught up within {RUN_TIMEOUT_S} s")
            await asyncio.sleep(0.005)
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu
    finally:
        stop.set()
        await asyncio.wait_for(task, 120)
        if patch is not None:
            patch.stop()
    return n / wall, cpu / wall, service.counters["commands"]


async def run(args: argparse.Namespace, bootstrap: str) -> dict[str, object]:
    prefix = f"bench-{uuid.uuid4().hex[:6]}."
    config = bus_config(bootstrap, prefix)
    events = workload(args.events)
    ends = await load(config, events)
    n = len(events)
    # Unmeasured warm-up of the broker and the client (JIT, connections, first fetches).
    await fold_once(config, ends, "plain", n)
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        order = ("txn", "plain") if r % 2 == 0 else ("plain", "txn")
        result: dict[str, float] = {}
        for mode in order:
            rate, cpu, _ = await fold_once(config, ends, mode, n)
            result[mode], result[f"{mode}_cpu"] = rate, cpu
        result["ratio"] = result["txn"] / result["plain"]
        result["load1"] = os.getloadavg()[0]
        rounds.append(result)
        print(
            f"round {r + 1}: txn {result['txn']:,.0f} ev/s (cpu {result['txn_cpu']:.0%}), "
            f"plain {result['plain']:,.0f} ev/s (cpu {result['plain_cpu']:.0%}), "
            f"ratio {result['ratio']:.0%}, load {result['load1']:.1f}",
            flush=True,
        )
    return {
        "events": n,
        "rounds": rounds,
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "median_txn": statistics.median(r["txn"] for r in rounds),
        "median_plain": statistics.median(r["plain"] for r in rounds),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=60_000, help="events to fold per run")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--kafka", help="host:port of a broker (default: start one)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, kafka_broker(args.kafka, Path(tmp)) as broker:
        if broker is None:
            print("no Kafka broker: nothing measured", file=sys.stderr)
            return 1
        summary = asyncio.run(run(args, broker.address))
    print(
        f"median over {args.rounds} rounds: txn {summary['median_txn']:,.0f} ev/s, "
        f"plain {summary['median_plain']:,.0f} ev/s, txn/plain {summary['median_ratio']:.0%} "
        f"({summary['events']:,} events)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
