"""Bus throughput benchmark (issue 2): events/s through each bus adapter, next to its ceiling.

Usage::

    python bench/bus_throughput.py [--events N] [--kafka host:port] [--rounds R]
                                   [--markdown] [--json FILE]   # --help lists the rest

One run measures, with distinct ~265-byte ``Heartbeat`` messages encoded by the codec
beforehand and keyed by 64 job ids (so they spread over the topic's 6 partitions):

* codec: ``encode`` and ``decode`` (both validate) on one core, wall and CPU time; ceilings
  are bare ``orjson.dumps``/``orjson.loads`` of the same messages;
* embedded bus: pipelined ``send`` (``--chunk`` sends, then gather) from 1 and from
  ``--producers`` OS processes (this script in worker mode, one bus object each, released
  together; aggregate = all events / (last end - first start)), one-at-a-time ``publish``, and
  consume (consumer group; explicit offsets) with ``decode``; ceilings: raw ``sqlite3`` inserts
  of the same rows in transactions of ``--chunk`` rows (same schema, same pragmas) and raw
  ``SELECT`` pages, both in one process;
* Kafka: our adapter's pipelined ``send`` and one-at-a-time ``publish``, and its consume
  (``assign`` from 0, ``getmany``, ``decode``), against raw aiokafka on the same broker and an
  identically created topic: ``AIOKafkaProducer.send`` with ``acks=all`` and idempotence (as our
  adapter), with aiokafka's defaults (``acks=1``) for context, and ``AIOKafkaConsumer.getmany``
  + ``orjson.loads`` with our adapter's consumer settings. Rows marked "context" split the
  consume cost between the adapter and the codec.

Without ``--kafka`` the script starts its own broker with ``deploy/kafka/kafka-dev`` in a
temporary directory (after the codec and embedded parts, so the JVM does not disturb them) and
stops it at the end; if no broker starts, the Kafka part is reported as skipped. Every Kafka
measurement has its own topic prefix and every embedded one its own file. Before the clock
starts, producers send ``--warmup`` events and consumers read the warm-up events (connection,
metadata, first fetch); the broker first takes the whole workload once, unmeasured (JIT).

Each part (codec, embedded, Kafka) runs ``--rounds`` times, every measurement once per round,
so a ceiling and our figure alternate in time; a figure is its best round (the one least
disturbed by other load on a shared machine), and ratios compare best with best.

Columns: "ev/CPU-s" divides by the client's CPU time (``time.process_time``, summed over
worker processes); "spread" is (best - worst) / best over the rounds; "client CPU" and "broker
CPU" are CPU time over wall time in the best round (100% = one core; the broker's only when
this script started it). The figures are printed, never asserted: the exit status is 0 unless
the script itself fails.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka import TopicPartition as KafkaTP
from aiokafka.admin import AIOKafkaAdminClient
from rich.console import Console
from rich.table import Table

from trainguard.agent.bus import Bus, BusConfig, Consumer, TopicPartition, TopicSpec, open_bus
from trainguard.agent.bus._partitioner import partition_for
from trainguard.agent.bus._sqlite_db import connect, now_ms, prepare
from trainguard.schemas import Heartbeat, decode, encode

KAFKA_DEV = Path(__file__).resolve().parent.parent / "deploy" / "kafka" / "kafka-dev"
TOPICS = (TopicSpec("events", partitions=6),)
"""The benchmark's only topic; 6 partitions, as trainguard's ``events`` topic."""
PARTITIONS = TOPICS[0].partitions
JOBS = 64
"""Distinct keys (job ids)."""
CODEC_TARGET = 100_000
"""``decode`` (with validation) per CPU-second on one core."""
KAFKA_TARGET_RATIO = 0.5
"""Our Kafka adapter against raw aiokafka, both directions."""
EMBEDDED_TARGET = 10_000
"""Embedded bus publish, events/s aggregated over several producer processes."""
BROKER_START_TIMEOUT_S = 300.0
"""``kafka-dev start``, a cold Maven fetch included."""
BROKER_STOP_TIMEOUT_S = 60.0
WORKER_TIMEOUT_S = 600.0


# ------------------------------------------------------------------------------ measurement


class BrokerCPU:
    """CPU time of the broker JVM read from ``/proc/<pid>/stat``; ``pid=None``: unknown."""

    def __init__(self, pid: int | None) -> None:
        self._pid = pid
        self._tick = os.sysconf("SC_CLK_TCK")

    def seconds(self) -> float | None:
        """The broker's utime + stime so far, seconds, or ``None`` when unknown."""
        if self._pid is None:
            return None
        try:
            stat = Path(f"/proc/{self._pid}/stat").read_text()
        except OSError:
            return None
        # utime and stime are fields 14 and 15 of proc(5); split after the ")" that ends the
        # command name, which may itself hold spaces.
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self._tick


@dataclass
class Timing:
    """A measured window: wall and client CPU seconds, and broker CPU seconds when known."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    broker_cpu_s: float | None = None


@contextmanager
def clock(broker: BrokerCPU | None = None) -> Iterator[Timing]:
    """Time the ``with`` block; the yielded :class:`Timing` is filled in when it ends."""
    timing = Timing()
    broker_before = broker.seconds() if broker else None
    wall, cpu = time.perf_counter(), time.process_time()
    yield timing
    timing.wall_s, timing.cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    broker_after = broker.seconds() if broker else None
    if broker_before is not None and broker_after is not None:
        timing.broker_cpu_s = broker_after - broker_before


@dataclass
class Figure:
    """One measured rate, optionally judged against a ceiling or an absolute target.

    Attributes:
        section: ``"codec"``, ``"embedded"`` or ``"kafka"``.
        name: what was measured (unique within the section).
        events: events processed inside the measured window.
        timing: the window.
        ceiling: name of the figure of the same section this one is compared with.
        min_ratio: target for ``rate / ceiling rate``.
        min_rate: target for the rate itself, events/s (per ``rate_basis``).
        rate_basis: ``"wall"`` (events per second) or ``"cpu"`` (events per CPU-second).
        rates: events/s of every round (``events`` and ``timing`` are the best round's).
    """

    section: str
    name: str
    events: int
    timing: Timing
    ceiling: str | None = None
    min_ratio: float | None = None
    min_rate: float | None = None
    rate_basis: str = "wall"
    rates: list[float] = dataclasses.field(default_factory=list)

    @property
    def rate(self) -> float:
        """Events per wall-clock second."""
        return self.events / self.timing.wall_s

    @property
    def cpu_rate(self) -> float:
        """Events per client CPU-second."""
        return self.events / self.timing.cpu_s if self.timing.cpu_s > 0 else float("inf")

    @property
    def spread(self) -> float:
        """(best - worst) / best rate over the rounds; 0 for one round."""
        return (max(self.rates) - min(self.rates)) / max(self.rates)


@dataclass
class Report:
    """The figures of one run, in measurement order, and notes describing the run."""

    figures: list[Figure] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def add(self, figure: Figure) -> None:
        """Record ``figure``: a new measurement, or one more round of a known one, which then
        keeps the best round's events and timing (the one least disturbed by other load; best
        by CPU rate for figures judged by it)."""
        known = self.find(figure.section, figure.name)
        if known is None:
            figure.rates = [figure.rate]
            self.figures.append(figure)
            return
        known.rates.append(figure.rate)
        by_cpu = known.rate_basis == "cpu"
        if (figure.cpu_rate > known.cpu_rate) if by_cpu else (figure.rate > known.rate):
            known.events, known.timing = figure.events, figure.timing

    def find(self, section: str, name: str) -> Figure | None:
        """The figure called ``name`` in ``section``, if measured."""
        return next((f for f in self.figures if (f.section, f.name) == (section, name)), None)


# ---------------------------------------------------------------------------------- payloads


def heartbeats(n: int, producer: int = 0) -> list[Heartbeat]:
    """``n`` distinct, realistic heartbeats of 64 jobs with 8 ranks each (about 265 bytes
    encoded); ``producer`` makes the pids of different producer processes differ."""
    base_ts = time.time_ns()
    return [
        Heartbeat(
            job_id=f"job-{i % JOBS:02d}",
            generation=2,
            ts=base_ts + i * 1000,
            seq=1000 + i // JOBS,
            rank=(i // JOBS) % 8,
            host=f"node{(i // JOBS) % 8:03d}",
            pid=40_000 + 1000 * producer + i % JOBS,
            world_size=8,
            step=10_000 + i // JOBS,
            phase="train",
            step_time_s=0.25 + (i % 97) / 1000,
            loss=round(2.5 - (i % 1000) / 2000, 4),
            samples=(10_000 + i // JOBS) * 32,
            param_checksum=f"{i * 2654435761 % (1 << 64):016x}",
        )
        for i in range(n)
    ]


@dataclass(frozen=True)
class Payloads:
    """Encoded events: ``values[i]`` is the codec's encoding of an event of job ``keys[i]``."""

    keys: list[str]
    values: list[bytes]

    @classmethod
    def of(cls, messages: Sequence[Heartbeat]) -> Payloads:
        """Encode ``messages``, keeping right-sized copies: orjson (>= 3.12) returns bytes
        objects whose allocation stays several KiB whatever their length, so 100,000 kept
        encodings would hold about 800 MB (home-assistant/core#181513 measures the same)."""
        values = [bytes(memoryview(encode(m))) for m in messages]
        return cls([m.job_id for m in messages], values)

    @property
    def mean_bytes(self) -> float:
        """Mean encoded size, bytes."""
        return sum(map(len, self.values)) / len(self.values)

    def slice(self, start: int, stop: int) -> Payloads:
        """Events ``start`` to ``stop - 1``."""
        return Payloads(self.keys[start:stop], self.values[start:stop])


# -------------------------------------------------------------------------------------- codec


def bench_codec(report: Report, messages: list[Heartbeat]) -> None:
    """One round: time ``encode``/``decode`` and bare orjson on ``messages``.

    Results are dropped inside the timed loops: keeping thousands of orjson outputs alive costs
    about 3 us more per call on this machine, because glibc gives heap memory back to the
    system and asks for it again (``MALLOC_TRIM_THRESHOLD_`` makes it vanish); that is the
    allocator's cost, not the codec's.
    """
    payloads = Payloads.of(messages)
    wires = [orjson.loads(v) for v in payloads.values]
    with clock() as dumps:
        for wire in wires:
            orjson.dumps(wire, option=orjson.OPT_SORT_KEYS)
    with clock() as enc:
        for message in messages:
            encode(message)
    with clock() as loads:
        for value in payloads.values:
            orjson.loads(value)
    with clock() as dec:
        for value in payloads.values:
            decode(value, expect=Heartbeat)
    n, section = len(messages), "codec"
    report.add(Figure(section, "ceiling: orjson.dumps, sorted keys", n, dumps))
    report.add(Figure(section, "encode (validates)", n, enc, "ceiling: orjson.dumps, sorted keys"))
    report.add(Figure(section, "ceiling: orjson.loads", n, loads))
    report.add(
        Figure(
            section,
            "decode (validates)",
            n,
            dec,
            "ceiling: orjson.loads",
            min_rate=CODEC_TARGET,
            rate_basis="cpu",
        )
    )


# ------------------------------------------------------------------------ through the port


def bench_config(url: str, prefix: str) -> BusConfig:
    """The benchmark's bus settings: one 6-partition ``events`` topic under ``prefix``."""
    return BusConfig(url=url, prefix=prefix, topics=TOPICS, connect_timeout_s=60.0)


async def send_pipelined(bus: Bus, payloads: Payloads, chunk: int) -> None:
    """Queue ``chunk`` sends, then await their deliveries; repeat (a real producer's pattern)."""
    keys, values = payloads.keys, payloads.values
    for start in range(0, len(values), chunk):
        futures = [
            await bus.send("events", keys[i], values[i])
            for i in range(start, min(start + chunk, len(values)))
        ]
        await asyncio.gather(*futures)


async def publish_one_by_one(bus: Bus, payloads: Payloads) -> None:
    """Send each event and wait for its delivery before the next (the latency-bound pattern)."""
    for key, value in zip(payloads.keys, payloads.values, strict=True):
        await bus.publish("events", key, value)


async def consume(
    consumer: Consumer, n: int, max_records: int, parse: Callable[[bytes], object] | None
) -> int:
    """Read events, and ``parse`` each value (if given), until at least ``n`` arrived; return
    how many did."""
    got = 0
    while got < n:
        records = await consumer.getmany(timeout_s=1.0, max_records=max_records)
        if parse is not None:
            for record in records:
                assert record.value is not None
                parse(record.value)
        got += len(records)
    return got


async def timed_consume(
    consumer: Consumer,
    warmup: int,
    n: int,
    max_records: int,
    parse: Callable[[bytes], object] | None,
    broker: BrokerCPU | None = None,
) -> tuple[int, Timing]:
    """Read ``warmup`` events unmeasured, then the rest of ``warmup + n`` measured (the last
    warm-up batch may overshoot); return the events read in the window and the window."""
    done = await consume(consumer, warmup, max_records, parse)
    with clock(broker) as timing:
        got = await consume(consumer, warmup + n - done, max_records, parse)
    return got, timing


def all_partitions() -> dict[TopicPartition, int | None]:
    """Every partition of ``events``, from offset 0."""
    return {TopicPartition("events", p): 0 for p in range(PARTITIONS)}


# ----------------------------------------------------------------------------- embedded bus


def run_producer_processes(
    url: str, prefix: str, events: int, processes: int, chunk: int, warmup: int
) -> list[dict[str, float]]:
    """Run ``processes`` worker processes that send ``events`` events in all (and ``warmup``
    unmeasured ones before) to the embedded bus at ``url``, all released at once; return each
    worker's result (see :func:`worker_main`).

    Raises:
        RuntimeError: a worker did not start or failed.
    """
    workers = []
    for p in range(processes):
        command = [
            *(sys.executable, __file__, "--worker", url, "--worker-prefix", prefix),
            *("--worker-index", str(p), "--events", str(events // processes)),
            *("--chunk", str(chunk), "--warmup", str(warmup // processes)),
        ]
        workers.append(
            subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        )
    try:
        for worker in workers:
            assert worker.stdout is not None
            line = worker.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"producer worker did not start (said {line!r})")
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.write("go\n")
            worker.stdin.flush()
        results = []
        for worker in workers:
            out, _ = worker.communicate(timeout=WORKER_TIMEOUT_S)
            if worker.returncode != 0:
                raise RuntimeError(f"producer worker failed with exit code {worker.returncode}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()


async def worker_main(
    url: str, prefix: str, index: int, events: int, chunk: int, warmup: int
) -> None:
    """Worker mode: one producer process of the embedded-bus publish measurement.

    Prints ``ready`` once its bus is open and its ``warmup`` events are sent, waits for a line
    on stdin, sends ``events`` events pipelined, then prints one JSON line with ``start`` and
    ``end`` (``time.monotonic()``: one clock for every process on Linux), ``cpu_s`` and
    ``events``.
    """
    payloads = Payloads.of(heartbeats(warmup + events, producer=index))
    async with open_bus(bench_config(url, prefix)) as bus:
        await send_pipelined(bus, payloads.slice(0, warmup), chunk)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        cpu, start = time.process_time(), time.monotonic()
        await send_pipelined(bus, payloads.slice(warmup, warmup + events), chunk)
        end, cpu = time.monotonic(), time.process_time() - cpu
    print(json.dumps({"start": start, "end": end, "cpu_s": cpu, "events": events}), flush=True)


def raw_sqlite_insert(path: Path, payloads: Payloads, chunk: int) -> Timing:
    """Ceiling: insert the rows our bus would write into the same ``records`` table with plain
    ``sqlite3``, ``chunk`` rows per ``BEGIN IMMEDIATE`` transaction, on a connection with the
    bus's pragmas (WAL, ``synchronous=NORMAL``), offsets computed beforehand."""
    conn = connect(str(path))
    try:
        prepare(conn, "raw.", TOPICS, time.monotonic() + 30)
        (topic_id,) = conn.execute(
            "SELECT topic_id FROM topics WHERE name = 'raw.events'"
        ).fetchone()
        next_offset = [0] * PARTITIONS
        rows = []
        ts = now_ms()
        for key, value in zip(payloads.keys, payloads.values, strict=True):
            p = partition_for(key, PARTITIONS)
            rows.append((topic_id, p, next_offset[p], ts, key, value))
            next_offset[p] += 1
        with clock() as timing:
            for start in range(0, len(rows), chunk):
                conn.execute("BEGIN IMMEDIATE")
                conn.executemany(
                    "INSERT INTO records (topic_id, partition, offset, ts_ms, key, value)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    rows[start : start + chunk],
                )
                conn.execute("COMMIT")
    finally:
        conn.close()
    return timing


def raw_sqlite_select(path: Path, prefix: str, page: int, parse: bool) -> tuple[int, Timing]:
    """Ceiling: read every record of ``prefix + "events"`` with plain ``SELECT`` pages of
    ``page`` rows per partition (``orjson.loads`` of each value when ``parse``); return the
    count and the window."""
    conn = connect(str(path))
    try:
        topic_id, partitions = conn.execute(
            "SELECT topic_id, partitions FROM topics WHERE name = ?", (prefix + "events",)
        ).fetchone()
        got = 0
        with clock() as timing:
            for partition in range(partitions):
                position = 0
                while True:
                    rows = conn.execute(
                        "SELECT offset, ts_ms, key, value FROM records WHERE topic_id = ?"
                        " AND partition = ? AND offset >= ? ORDER BY offset LIMIT ?",
                        (topic_id, partition, position, page),
                    ).fetchall()
                    if parse:
                        for row in rows:
                            orjson.loads(row[3])
                    got += len(rows)
                    if len(rows) < page:
                        break
                    position = rows[-1][0] + 1
    finally:
        conn.close()
    return got, timing


async def bench_embedded(
    report: Report, args: argparse.Namespace, tmp: Path, payloads: Payloads
) -> None:
    """One round of the embedded bus in the empty directory ``tmp``: publish (1 and N
    processes; one by one), consume, raw ceilings; ``payloads`` holds warm-up + n events."""
    n, chunk, warmup, section = args.events, args.chunk, args.warmup, "embedded"

    insert_ceiling = f"ceiling: raw sqlite3 INSERT, {chunk} rows/transaction"
    timing = raw_sqlite_insert(tmp / "raw.db", payloads.slice(0, n), chunk)
    report.add(Figure(section, insert_ceiling, n, timing))
    for count in sorted({1, args.producers}):
        url = f"sqlite://{tmp / f'publish-{count}.db'}"
        results = run_producer_processes(url, "b.", n, count, chunk, warmup)
        timing = Timing(
            wall_s=max(r["end"] for r in results) - min(r["start"] for r in results),
            cpu_s=sum(r["cpu_s"] for r in results),
        )
        report.add(
            Figure(
                section,
                f"send, gather per {chunk}, {count} process{'es' if count > 1 else ''}",
                sum(int(r["events"]) for r in results),
                timing,
                insert_ceiling,
                min_rate=EMBEDDED_TARGET if count > 1 else None,
            )
        )

    one_by_one = payloads.slice(warmup, warmup + min(n, args.one_by_one))
    async with open_bus(bench_config(f"sqlite://{tmp / 'publish-one.db'}", "b.")) as bus:
        await publish_one_by_one(bus, payloads.slice(0, min(warmup, 200)))
        with clock() as timing:
            await publish_one_by_one(bus, one_by_one)
    report.add(Figure(section, "publish() one by one, 1 process", len(one_by_one.values), timing))

    # Consumers read the single producer's file: its warm-up events, then n measured ones.
    source, page = tmp / "publish-1.db", args.max_records
    read_ceiling = f"ceiling: raw SELECT, pages of {page}, + orjson.loads"
    got, timing = raw_sqlite_select(source, "b.", page, parse=True)
    report.add(Figure(section, read_ceiling, got, timing))
    async with open_bus(bench_config(f"sqlite://{source}", "b.")) as bus:
        async with await bus.subscribe(["events"], "bench", from_beginning=True) as group:
            got, timing = await timed_consume(group, warmup, n, page, _decode_heartbeat)
        report.add(Figure(section, "consume: group + decode", got, timing, read_ceiling))
        async with await bus.assign(all_partitions()) as explicit:
            got, timing = await timed_consume(explicit, warmup, n, page, _decode_heartbeat)
        report.add(Figure(section, "consume: assign(0) + decode", got, timing, read_ceiling))
        bare_ceiling = f"context: raw SELECT, pages of {page}, no parsing"
        got, timing = raw_sqlite_select(source, "b.", page, parse=False)
        report.add(Figure(section, bare_ceiling, got, timing))
        async with await bus.assign(all_partitions()) as explicit:
            got, timing = await timed_consume(explicit, warmup, n, page, None)
        report.add(
            Figure(section, "context: consume assign(0), no decode", got, timing, bare_ceiling)
        )


# -------------------------------------------------------------------------------------- Kafka


async def create_topic(bootstrap: str, prefix: str) -> None:
    """Create ``prefix + "events"`` exactly as our adapter does (by starting a bus on it), then
    wait until the broker lists it: asked at once, it may not know the topic yet, and aiokafka
    logs an error for every such metadata answer (deploy/kafka/README.md).

    Raises:
        TimeoutError: the topic is not listed within 30 s.
    """
    async with open_bus(bench_config(f"kafka://{bootstrap}", prefix)):
        pass
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for _ in range(600):  # 600 x 50 ms: polling the broker, nothing local to wait on
            if prefix + "events" in await admin.list_topics():
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"the broker does not list {prefix}events 30 s after creating it")
    finally:
        await admin.close()


async def raw_produce(
    producer: AIOKafkaProducer, topic: str, payloads: Payloads, chunk: int
) -> None:
    """``send()`` ``chunk`` records (aiokafka's default partitioner on the key), then gather
    their futures; repeat."""
    keys, values = [k.encode() for k in payloads.keys], payloads.values
    for start in range(0, len(values), chunk):
        futures = [
            await producer.send(topic, values[i], key=keys[i])
            for i in range(start, min(start + chunk, len(values)))
        ]
        await asyncio.gather(*futures)


async def raw_consume(
    consumer: AIOKafkaConsumer, n: int, max_records: int, parse: Callable[[bytes], object]
) -> int:
    """``getmany`` and ``parse`` every value until at least ``n`` records were read; return
    how many were."""
    got = 0
    while got < n:
        batches = await consumer.getmany(timeout_ms=1000, max_records=max_records)
        for records in batches.values():
            for record in records:
                parse(record.value)
            got += len(records)
    return got


async def raw_reader(bootstrap: str, topic: str) -> AIOKafkaConsumer:
    """A started raw consumer of every partition of ``topic`` from offset 0, with our
    adapter's consumer settings (no group, no auto-commit, read_committed, 100 ms fetch wait)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        isolation_level="read_committed",
        fetch_max_wait_ms=100,
    )
    await consumer.start()
    tps = [KafkaTP(topic, p) for p in range(PARTITIONS)]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)
    return consumer


def _decode_heartbeat(value: bytes) -> object:
    return decode(value, expect=Heartbeat)


async def warm_broker(bootstrap: str, payloads: Payloads, chunk: int, max_records: int) -> None:
    """Write and read ``payloads`` once, unmeasured, on a topic of its own: a cold broker (JVM
    JIT) would handicap whichever measurement runs first."""
    prefix = f"bench-{uuid.uuid4().hex[:8]}-warmup."
    await create_topic(bootstrap, prefix)
    async with open_bus(bench_config(f"kafka://{bootstrap}", prefix)) as bus:
        await send_pipelined(bus, payloads, chunk)
        async with await bus.assign(all_partitions()) as consumer:
            await consume(consumer, len(payloads.values), max_records, None)


async def bench_kafka(
    report: Report, args: argparse.Namespace, bootstrap: str, broker: BrokerCPU, payloads: Payloads
) -> None:
    """One round of our Kafka adapter against raw aiokafka on the same broker (see the module
    docstring), on topics of its own; ``payloads`` holds warm-up + n events."""
    n, chunk, warmup, page, section = (
        args.events,
        args.chunk,
        args.warmup,
        args.max_records,
        "kafka",
    )
    warm, main = payloads.slice(0, warmup), payloads.slice(warmup, warmup + n)
    run = uuid.uuid4().hex[:8]
    labels = ("ours", "ours-one", "raw-all", "raw-default")
    prefixes = {label: f"bench-{run}-{label}." for label in labels}
    for prefix in prefixes.values():
        await create_topic(bootstrap, prefix)

    raw_all = f"ceiling: raw send, gather per {chunk}, acks=all, idempotent"
    raw_default = "context: raw send, aiokafka defaults (acks=1)"
    for label, name, options in (
        ("raw-all", raw_all, {"acks": "all", "enable_idempotence": True}),
        ("raw-default", raw_default, {}),
    ):
        topic = prefixes[label] + "events"
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, **options)
        await producer.start()
        try:
            await producer.partitions_for(topic)
            await raw_produce(producer, topic, warm, chunk)
            with clock(broker) as timing:
                await raw_produce(producer, topic, main, chunk)
        finally:
            await producer.stop()
        report.add(Figure(section, name, n, timing))

    async with open_bus(bench_config(f"kafka://{bootstrap}", prefixes["ours"])) as bus:
        await send_pipelined(bus, warm, chunk)
        with clock(broker) as timing:
            await send_pipelined(bus, main, chunk)
    name = f"send, gather per {chunk}"
    report.add(Figure(section, name, n, timing, raw_all, min_ratio=KAFKA_TARGET_RATIO))

    one_by_one = main.slice(0, min(n, args.one_by_one))
    async with open_bus(bench_config(f"kafka://{bootstrap}", prefixes["ours-one"])) as bus:
        await publish_one_by_one(bus, warm.slice(0, min(warmup, 200)))
        with clock(broker) as timing:
            await publish_one_by_one(bus, one_by_one)
    report.add(Figure(section, "publish() one by one", len(one_by_one.values), timing))

    # Consumers read what the acks=all producers wrote: warm-up events, then n measured.
    raw_loads = "ceiling: raw getmany + orjson.loads"
    raw_decode = "context: raw getmany + decode"
    raw_bare = "context: raw getmany, no parsing"
    parsers: dict[str, Callable[[bytes], object]] = {
        raw_loads: orjson.loads,
        raw_decode: _decode_heartbeat,
        raw_bare: bytes,
    }
    for name, parse in parsers.items():
        consumer = await raw_reader(bootstrap, prefixes["raw-all"] + "events")
        try:
            done = await raw_consume(consumer, warmup, page, parse)
            with clock(broker) as timing:
                got = await raw_consume(consumer, warmup + n - done, page, parse)
        finally:
            await consumer.stop()
        report.add(Figure(section, name, got, timing))

    # The target compares like with like: our adapter and raw aiokafka each followed by
    # orjson.loads. Validation is the codec's cost (its own target above) and is shown apart.
    ours: tuple[tuple[str, Callable[[bytes], object] | None, str, float | None], ...] = (
        (
            "consume: assign(0) + getmany + orjson.loads",
            orjson.loads,
            raw_loads,
            KAFKA_TARGET_RATIO,
        ),
        (
            "context: consume + decode, validated (vs raw + orjson.loads)",
            _decode_heartbeat,
            raw_loads,
            None,
        ),
        ("context: consume + decode (vs raw + decode)", _decode_heartbeat, raw_decode, None),
        ("context: consume, no decode (vs raw)", None, raw_bare, None),
    )
    async with open_bus(bench_config(f"kafka://{bootstrap}", prefixes["ours"])) as bus:
        for name, our_parse, ceiling, target in ours:
            async with await bus.assign(all_partitions()) as consumer:
                got, timing = await timed_consume(consumer, warmup, n, page, our_parse, broker)
            report.add(Figure(section, name, got, timing, ceiling, min_ratio=target))


class BrokerUnavailable(RuntimeError):
    """``kafka-dev start`` failed."""


@contextmanager
def dev_broker(run_dir: Path) -> Iterator[tuple[str, int | None]]:
    """Start a broker with ``kafka-dev`` in ``run_dir``; yield its address and pid; stop it.

    Raises:
        BrokerUnavailable: the broker did not start (no Java or Maven, timeout, ...).
    """
    command = [sys.executable, str(KAFKA_DEV)]
    try:
        try:
            started = subprocess.run(
                [*command, "start", "--port", "0", "--dir", str(run_dir)],
                capture_output=True,
                text=True,
                timeout=BROKER_START_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BrokerUnavailable(str(exc)) from exc
        if started.returncode != 0:
            raise BrokerUnavailable(started.stderr.strip() or f"exit code {started.returncode}")
        pid_file = run_dir / "kafka.pid"
        pid = int(pid_file.read_text().strip()) if pid_file.exists() else None
        yield started.stdout.strip(), pid
    finally:
        # Also after a failed start, which may leave a JVM behind.
        subprocess.run(
            [*command, "stop", "--dir", str(run_dir)],
            capture_output=True,
            timeout=BROKER_STOP_TIMEOUT_S,
            check=False,
        )


# ------------------------------------------------------------------------------------ output


SECTIONS = {
    "codec": "codec (one process, one core)",
    "embedded": "embedded bus (SQLite, WAL)",
    "kafka": "Kafka (aiokafka, broker on the same 2 cores)",
}
HEADERS = (
    "measurement",
    "events",
    "events/s",
    "ev/CPU-s",
    "spread",
    "client CPU",
    "broker CPU",
    "ceiling ev/s",
    "ours/ceiling",
    "target",
    "verdict",
)
NUMERIC = range(1, 9)
"""Right-aligned columns (indices into :data:`HEADERS`)."""


def verdict(report: Report, figure: Figure) -> tuple[str, str, str, str]:
    """Ceiling rate, ratio, target and PASS/FAIL of ``figure``, as display strings."""
    ceiling = report.find(figure.section, figure.ceiling) if figure.ceiling else None
    ratio = figure.rate / ceiling.rate if ceiling else None
    target, ok = "", None
    if figure.min_ratio is not None and ratio is not None:
        target, ok = f">= {figure.min_ratio:.0%}", ratio >= figure.min_ratio
    if figure.min_rate is not None:
        cpu = figure.rate_basis == "cpu"
        rate = figure.cpu_rate if cpu else figure.rate
        target = f">= {figure.min_rate / 1000:,.0f}k{'/CPU-s' if cpu else '/s'}"
        ok = rate >= figure.min_rate
    return (
        f"{ceiling.rate:,.0f}" if ceiling else "",
        f"{ratio:.0%}" if ratio is not None else "",
        target,
        "" if ok is None else ("PASS" if ok else "FAIL"),
    )


def sections(report: Report) -> Iterator[tuple[str, list[tuple[str, ...]]]]:
    """Display rows (columns of :data:`HEADERS`) by section title, in measurement order."""
    for key, title in SECTIONS.items():
        rows: list[tuple[str, ...]] = []
        for f in report.figures:
            if f.section != key:
                continue
            t = f.timing
            broker = "" if t.broker_cpu_s is None else f"{t.broker_cpu_s / t.wall_s:.0%}"
            rows.append(
                (
                    f.name,
                    f"{f.events:,}",
                    f"{f.rate:,.0f}",
                    f"{f.cpu_rate:,.0f}",
                    f"{f.spread:.0%}",
                    f"{t.cpu_s / t.wall_s:.0%}",
                    broker,
                    *verdict(report, f),
                )
            )
        if rows:
            yield title, rows


def decode_bound(report: Report) -> str | None:
    """Explain the Kafka consume ratio: how close to the raw ceiling any consumer that decodes
    can come, given the codec's measured rate (``None`` without the figures)."""
    raw = report.find("kafka", "ceiling: raw getmany + orjson.loads")
    same = report.find("kafka", "context: consume + decode (vs raw + decode)")
    dec = report.find("codec", "decode (validates)")
    loads = report.find("codec", "ceiling: orjson.loads")
    if raw is None or same is None or dec is None or loads is None or same.ceiling is None:
        return None
    same_ceiling = report.find("kafka", same.ceiling)
    assert same_ceiling is not None
    # Per-record seconds: the raw path, with decode's time instead of orjson.loads' time.
    bound = 1 / (1 / raw.rate + 1 / dec.rate - 1 / loads.rate)
    return (
        f"Kafka consume: decode (validates) takes {1e6 / dec.rate:.1f} us per event against "
        f"{1e6 / loads.rate:.1f} us for orjson.loads, so even a zero-cost adapter that decodes "
        f"would reach {bound:,.0f} events/s = {bound / raw.rate:.0%} of the raw ceiling; with "
        f"the same decode on both sides ours reaches {same.rate / same_ceiling.rate:.0%} of raw."
    )


def print_report(report: Report, markdown: bool) -> None:
    """Print the notes and a rich table of the figures (and a Markdown table with
    ``markdown``)."""
    console = Console(width=max(Console().width, 190))
    for note in report.notes:
        console.print(note, highlight=False, markup=False)
    table = Table(title="Bus throughput (issue 2)")
    for i, header in enumerate(HEADERS):
        table.add_column(header, justify="right" if i in NUMERIC else "left", no_wrap=i == 0)
    for title, rows in sections(report):
        table.add_row(f"[bold]{title}[/bold]")
        for row in rows:
            table.add_row(*row, style={"PASS": "green", "FAIL": "bold red"}.get(row[-1]))
        table.add_section()
    console.print(table)
    explanation = decode_bound(report)
    if explanation:
        console.print(explanation, highlight=False, markup=False)
    if markdown:
        print("| " + " | ".join(HEADERS) + " |")
        print("|" + "|".join("---:" if i in NUMERIC else "---" for i in range(len(HEADERS))) + "|")
        for title, rows in sections(report):
            print(f"| **{title}** |" + " |" * (len(HEADERS) - 1))
            for row in rows:
                print("| " + " | ".join(row) + " |")


def write_json(report: Report, path: Path) -> None:
    """Write the notes and figures (with their rates) to ``path``."""
    figures = [
        dataclasses.asdict(f) | {"rate": f.rate, "cpu_rate": f.cpu_rate} for f in report.figures
    ]
    path.write_text(json.dumps({"notes": report.notes, "figures": figures}, indent=2) + "\n")


# -------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (``--worker*`` are internal: worker mode)."""
    parser = argparse.ArgumentParser(
        description="Bus throughput: events/s through each bus adapter next to its ceiling."
    )
    parser.add_argument("--events", type=int, default=100_000, help="measured events (100000)")
    parser.add_argument("--kafka", metavar="HOST:PORT", help="use this broker (default: start one)")
    parser.add_argument("--no-kafka", action="store_true", help="skip the Kafka part")
    parser.add_argument("--chunk", type=int, default=1000, help="sends per gather (1000)")
    parser.add_argument("--warmup", type=int, default=5000, help="unmeasured events first (5000)")
    parser.add_argument("--producers", type=int, default=4, help="embedded producer processes (4)")
    parser.add_argument(
        "--one-by-one", type=int, default=1000, help="events of the publish() lines (1000)"
    )
    parser.add_argument("--max-records", type=int, default=1000, help="getmany max_records (1000)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of each part; the best counts (3)"
    )
    parser.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-prefix", help=argparse.SUPPRESS)
    parser.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> Report:
    """Every measurement, ``--rounds`` times each part; the broker starts last so its JVM
    disturbs nothing else."""
    report, rounds = Report(), range(args.rounds)
    messages = heartbeats(args.events)
    for _ in rounds:
        bench_codec(report, messages)
    del messages
    payloads = Payloads.of(heartbeats(args.warmup + args.events))
    load = os.getloadavg()
    report.notes.append(
        f"{args.events:,} events of {payloads.mean_bytes:.0f} bytes (mean), {JOBS} keys, "
        f"{PARTITIONS} partitions; chunk {args.chunk}, warm-up {args.warmup}, getmany "
        f"max_records {args.max_records}; best of {args.rounds} rounds; {os.cpu_count()} CPUs, "
        f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
        f"Python {sys.version.split()[0]}, SQLite {sqlite3.sqlite_version}"
    )
    with tempfile.TemporaryDirectory(prefix="bus-bench-") as tmp:
        for r in rounds:
            (Path(tmp) / f"round-{r}").mkdir()
            await bench_embedded(report, args, Path(tmp) / f"round-{r}", payloads)
        if args.no_kafka:
            report.notes.append("Kafka part skipped (--no-kafka).")
            return report
        if args.kafka:
            report.notes.append(f"Kafka broker: {args.kafka} (given; its CPU is not measured).")
            await warm_broker(args.kafka, payloads, args.chunk, args.max_records)
            for _ in rounds:
                await bench_kafka(report, args, args.kafka, BrokerCPU(None), payloads)
            return report
        try:
            with dev_broker(Path(tmp) / "kafka") as (bootstrap, pid):
                report.notes.append(f"Kafka broker: {bootstrap} (kafka-dev, pid {pid}).")
                await warm_broker(bootstrap, payloads, args.chunk, args.max_records)
                for _ in rounds:
                    await bench_kafka(report, args, bootstrap, BrokerCPU(pid), payloads)
        except BrokerUnavailable as exc:
            report.notes.append(f"Kafka part skipped: kafka-dev could not start: {exc}")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or one producer worker) and print the figures; returns 0."""
    args = parse_args(argv)
    if args.worker:
        asyncio.run(
            worker_main(
                args.worker,
                args.worker_prefix,
                args.worker_index,
                args.events,
                args.chunk,
                args.warmup,
            )
        )
        return 0
    report = asyncio.run(run(args))
    print_report(report, args.markdown)
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
