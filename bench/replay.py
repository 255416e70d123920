"""Replay benchmark (issue 5): how fast ``trainguard replay`` folds a long job's record, from an
export file and from each bus, next to the codec's bare decode rate (the ceiling).

Usage (from the repository root)::

    python bench/replay.py [--events 1000000] [--rounds 3] [--kafka host:port | --no-kafka]
                           [--record job.tgjsonl.gz] [--profile] [--markdown] [--json FILE]

**The record** (``bench/_job_record.py``): a generated, seeded job of ``--events`` records on
``events`` (1,000,000 by default): 64 ranks on 8 hosts heartbeating every ~1 s step, data-cursor
events every 100 steps, checkpoint shards every 200 steps (each committed), four incidents (a
kill reported by its supervisor, a lost node found as a stall, another kill, a lost rack found
by the daemon's ticks past the heartbeat timeout) with their restores, acknowledgements and
resumes, stale heartbeats rejected after each restore, and the daemon's ticks; then every rank
finishes. The daemon's side (commands, manifests, the audit trail) comes from folding the
records once as ``DaemonService`` does, with its audit helpers. The record is written

* as an export file (``trainguard export``'s format: gzip JSON Lines, ``_export.dump``);
* onto a fresh embedded bus with ``import_file`` (``trainguard import``: original append
  times);
* onto Kafka (``--kafka``, or a broker started with ``deploy/kafka/kafka-dev``; ``--no-kafka``
  skips it), into topics under a fresh prefix that the benchmark creates itself with
  ``message.timestamp.type=CreateTime`` (and ``retention.ms=-1``), each record produced with
  its recorded append time as its timestamp.

  Why not trainguard's own topic settings: they use ``LogAppendTime``, so the broker would
  stamp the million records with the few seconds of the write, and the time-driven part of the
  job (the lost node's stall, the lost rack's heartbeat timeout) would no longer happen: the
  replay would fold a different job (every event after the first missed incident rejected as
  of a future generation), and neither a fold without verification nor an audit trail
  regenerated from those times would measure the same work as the file and the embedded bus.
  With ``CreateTime`` the broker holds what it would hold had it stamped the job live; the
  consumer path (fetch, record batches, the adapter's ``getmany``) is the same for both
  timestamp types, so the read is measured as in production and the replay verifies.

**Measured**, in ``--rounds`` interleaved rounds (3); wall-clock rates come from each figure's
fastest round, CPU rates from its round with the least CPU time:

* ``ceiling: decode``: ``trainguard.schemas.decode`` of every ``events`` value in a loop,
  results dropped (as ``bench/bus_throughput.py`` measures the codec);
* ``context: decode, results kept``: the same, keeping the messages (as a replay holds them:
  the allocator and the cyclic garbage collector then cost more);
* ``file: read + decode + fold + verify`` (the target): what ``trainguard replay --file`` does
  for a whole file before printing: ``_job_log.replay_file(..., timeline=False)`` and
  ``verify``, which must find no difference. The events are replayed as they are read; from
  8 MiB up (this record) a reader process reads the file (gunzip, JSON, base64, the file's
  checks) beside the replaying process, which decodes, takes in, folds and verifies
  (:mod:`trainguard.daemon.forensics._export_stream`);
* ``file: the same, read in the replaying process``: ``replay_file`` with the reader process
  off (what a file under 8 MiB gets);
* its stages, each on the previous stage's output: ``file: read only`` (``_export.load``:
  gunzip, JSON, base64, the whole file held), ``take`` (``_intake.take`` of every record into
  a list: decode, job-id check) and ``fold only`` (``decide`` over that list from a new job);
  and ``context: take + fold streamed``: each record taken in and folded at once, nothing
  kept (what ``replay`` does for a trail of one configuration, less its input keys for the
  recorded append times, its decision groups and ``verify``);
* ``embedded bus`` and ``Kafka``: the same replay from ``read_bus``, and the read on its own.

Rates are events on ``events`` (ticks included) per second of wall time and per CPU-second of
this process (``time.process_time``); the reader process's CPU time (``getrusage`` of the
children) and the broker's (from ``/proc``, when the benchmark started it) are listed apart.
Ratios divide by the ceiling's rate on the same basis. Target: replay from a file at least 50 %
of the ceiling's rate, in events per second: the verdict is on wall-clock rates, the issue's
unit, now that a file replay is two processes at work (its CPU rate counts only the replaying
one). Wall-clock rates swing with other jobs' load on a shared machine (2-4x between rounds
seen here), so run it on a quiet one; each round prints its load average.

**Profile.** When replay from a file misses the target (or with ``--profile``), one more file
replay runs under ``cProfile``: the time under each stage (cumulative, profiler overhead
included) and the functions with the most own time are printed; and one runs with the cyclic
garbage collector disabled, to show its share. Time spent collecting garbage is charged by
``cProfile`` to whichever call allocated when a collection started (``dict.keys`` in the
codec's validators, for instance).

Each round prints the load average at its start. Figures are printed, never asserted; the exit
status is 0 unless a replay failed to reproduce the recorded decisions (1).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import os
import pstats
import resource
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypeVar

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from rich.console import Console

from trainguard.agent.bus import Record
from trainguard.daemon.core._intake import Taken, take
from trainguard.daemon.core._machine import decide
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import new_job
from trainguard.daemon.forensics._export_file import (
    JOB_TOPICS,
    ExportHeader,
    dump,
    import_file,
    load,
)
from trainguard.daemon.forensics._job_log import JobLog, read_bus, replay_file
from trainguard.daemon.forensics._replay import replay, verify
from trainguard.schemas import decode

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # bench._broker and friends

from bench._broker import Broker, kafka_broker  # noqa: E402
from bench._job_record import PARTITIONS, GeneratedJob, Plan, generate  # noqa: E402
from bench._report import Report, print_report  # noqa: E402
from bench._summary import machine_notes  # noqa: E402

MIN_EVENTS = 20_000
"""Smallest record the plan fits: 64 ranks send about 2,000 events while they start."""

TARGET = 0.5
"""Replay from a file: at least this fraction of the ceiling's events/s."""

CEILING = "ceiling: decode"
FILE_REPLAY = "file: read + decode + fold + verify"
REPLAY_CONFIG = MachineConfig(daemon_id="replay")
"""The default configuration ``trainguard replay`` passes, folded under only when the trail
records none (this record's trail records the daemon's)."""

T = TypeVar("T")


class ReplayMismatch(RuntimeError):
    """A replay did not reproduce the recorded decisions."""


# -- measuring -------------------------------------------------------------------------------


@dataclass
class Timing:
    """One timed run: wall and CPU seconds of this process, broker CPU seconds (or ``None``),
    CPU seconds of the child processes that ended during it (the file replay's reader)."""

    wall_s: float
    cpu_s: float
    broker_cpu_s: float | None = None
    reader_cpu_s: float = 0.0


@dataclass
class Figure:
    """A measurement over the rounds.

    Attributes:
        section: ``codec``, ``file``, ``embedded`` or ``kafka``.
        name: what was measured.
        events: records on ``events`` it covers.
        runs: one timing per round.
    """

    section: str
    name: str
    events: int
    runs: list[Timing] = field(default_factory=list)

    @property
    def best(self) -> Timing:
        """The round with the shortest wall time."""
        return min(self.runs, key=lambda t: t.wall_s)

    @property
    def rate(self) -> float:
        """Events per second of wall time, best round."""
        return self.events / self.best.wall_s

    @property
    def cpu_rate(self) -> float:
        """Events per CPU-second of this process, in the round that took the least CPU time."""
        return self.events / min(t.cpu_s for t in self.runs)

    def spread(self, cpu: bool = False) -> float:
        """(slowest - fastest) / fastest over the rounds, wall time (or CPU time)."""
        times = [t.cpu_s if cpu else t.wall_s for t in self.runs]
        return (max(times) - min(times)) / min(times)


@dataclass
class Results:
    """Figures by name, in measurement order, and notes."""

    figures: dict[str, Figure] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    profile: dict[str, Any] = field(default_factory=dict)

    def add(self, section: str, name: str, events: int, timing: Timing) -> None:
        """Record one round of ``name``."""
        figure = self.figures.setdefault(name, Figure(section, name, events))
        figure.runs.append(timing)


@contextmanager
def clock(broker: Broker | None = None) -> Iterator[Timing]:
    """Time the ``with`` block, after a full garbage collection: the yielded :class:`Timing`
    is filled in when the block ends (the broker's CPU time too, given one whose process is
    known)."""
    gc.collect()
    broker_before = broker.cpu_s() if broker is not None else None
    timing = Timing(0.0, 0.0)
    children = _children_cpu_s()
    cpu, wall = time.process_time(), time.perf_counter()
    yield timing
    timing.wall_s, timing.cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    timing.reader_cpu_s = _children_cpu_s() - children
    if broker is not None and broker_before is not None:
        after = broker.cpu_s()
        timing.broker_cpu_s = None if after is None else after - broker_before


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(fn: Callable[[], T]) -> tuple[T, Timing]:
    """Run ``fn`` under :func:`clock`; its result and timing."""
    with clock() as timing:
        out = fn()
    return out, timing


async def timed_async(
    fn: Callable[[], Awaitable[T]], broker: Broker | None = None
) -> tuple[T, Timing]:
    """Await ``fn()`` under :func:`clock`; its result and timing."""
    with clock(broker) as timing:
        out = await fn()
    return out, timing


def replay_log(log: JobLog) -> int:
    """Replay and verify ``log`` as ``trainguard replay`` does (no timeline); return the
    decision groups verified.

    Raises:
        ReplayMismatch: the replay does not reproduce the recorded decisions.
    """
    result = replay(
        log.job_id, log.events, log.trail(), REPLAY_CONFIG, start=log.start, timeline=False
    )
    difference = verify(result.replayed, result.recorded)
    if difference is not None:
        raise ReplayMismatch(f"{log.source}: replay differs from the audit trail: {difference}")
    return len(result.replayed)


def replay_whole_file(path: Path, *, process: bool | None = None) -> int:
    """Replay the export file at ``path`` as ``trainguard replay --file`` does (no window, no
    timeline) and verify it; return the decision groups verified. ``process``: the reader
    process on, off, or (``None``) by the file's size.

    Raises:
        ReplayMismatch: the replay does not reproduce the recorded decisions.
    """
    done = replay_file(path, None, REPLAY_CONFIG, timeline=False, process=process)
    difference = verify(done.result.replayed, done.result.recorded)
    if difference is not None:
        raise ReplayMismatch(f"{path}: replay differs from the audit trail: {difference}")
    return len(done.result.replayed)


def decode_all(values: Sequence[bytes]) -> None:
    """Decode every value, dropping the results."""
    for value in values:
        decode(value)


def fold_all(job_id: str, taken: Sequence[Taken], machine: MachineConfig) -> None:
    """Fold ``taken`` from a new job under ``machine``."""
    state = new_job(job_id)
    for item in taken:
        state, _ = decide(state, item.input, machine)


def take_and_fold(job_id: str, records: Sequence[Record], machine: MachineConfig) -> None:
    """Take each record in and fold it at once, keeping nothing (what ``replay`` does for a
    single-configuration trail, less its keys, groups and verification)."""
    state = new_job(job_id)
    for record in records:
        item = take(record)
        if isinstance(item, Taken):
            state, _ = decide(state, item.input, machine)


# -- writing the record ----------------------------------------------------------------------


def write_file(job: GeneratedJob, path: Path) -> int:
    """Write ``job`` as an export file at ``path``; its size in bytes."""
    header = ExportHeader(
        job_id=job.plan.job_id,
        source="bench/replay.py (generated)",
        partition=job.partition,
        partitions=PARTITIONS,
        exported_at_ms=time.time_ns() // 1_000_000,
        trainguard=version("trainguard"),
    )
    return dump(path, header, job.records)


async def write_kafka(address: str, prefix: str, path: Path) -> None:
    """Create the job-keyed topics under ``prefix`` with ``CreateTime`` timestamps (module
    docstring) and produce the records of the export file at ``path`` to the job's partition,
    each with its append time.

    A broker just started may refuse the first sends to a new topic with
    ``NotLeaderForPartitionError`` while its partitions settle; aiokafka retries them and logs
    a line each (harmless).

    Raises:
        RuntimeError: the broker refused a topic.
        aiokafka.errors.KafkaError: the broker is unreachable or a send failed.
    """
    header, records = load(path)
    admin = AIOKafkaAdminClient(bootstrap_servers=address, client_id="replay-bench")
    await admin.start()
    try:
        topics = [
            NewTopic(
                prefix + topic,
                PARTITIONS,
                1,
                topic_configs={
                    "cleanup.policy": "compact" if topic == "commands" else "delete",
                    "message.timestamp.type": "CreateTime",
                    "retention.ms": "-1",
                },
            )
            for topic in JOB_TOPICS
        ]
        response = await admin.create_topics(topics)
        for name, code, *_ in response.topic_errors:
            if code != 0:
                raise RuntimeError(f"Kafka refused to create {name}: error code {code}")
    finally:
        await admin.close()
    producer = AIOKafkaProducer(
        bootstrap_servers=address, acks="all", enable_idempotence=True, linger_ms=5
    )
    await producer.start()
    try:
        key = header.job_id.encode()
        for topic in JOB_TOPICS:
            pending = []
            for r in records[topic]:
                sent = await producer.send(
                    prefix + topic,
                    r.value,
                    key=key,
                    partition=header.partition,
                    timestamp_ms=r.timestamp_ms,
                )
                pending.append(sent)
                if len(pending) >= 1000:
                    await asyncio.gather(*pending)
                    pending.clear()
            await asyncio.gather(*pending)
    finally:
        await producer.stop()


async def delete_topics(address: str, prefix: str) -> None:
    """Delete the job-keyed topics under ``prefix`` (best effort)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=address, client_id="replay-bench")
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        await admin.delete_topics([t for t in existing if t.startswith(prefix)])
    except Exception as exc:  # cleanup must not hide the figures
        print(f"could not delete Kafka topics {prefix}*: {exc!r}", file=sys.stderr)
    finally:
        await admin.close()


# -- the rounds ------------------------------------------------------------------------------


@dataclass
class Sources:
    """Where the record was written: the file, the embedded bus and Kafka (if any)."""

    path: Path
    embedded: str
    prefix: str
    kafka: str | None = None
    broker: Broker | None = None


def file_stages(results: Results, path: Path, n: int, plan: Plan) -> None:
    """The file replay's stages, each on the previous one's output, then the streamed
    context figure on the same records."""
    (_, records), t = timed(lambda: load(path))
    results.add("file", "file: read only (gunzip, JSON, base64)", n, t)
    events = records["events"]
    kept_stages(results, events, n, plan)
    _, t = timed(lambda: take_and_fold(plan.job_id, events, plan.machine))
    results.add("file", "context: take + fold streamed, nothing kept", n, t)


def kept_stages(results: Results, events: Sequence[Record], n: int, plan: Plan) -> None:
    """``take`` of every record into a list, then the fold of that list (the two stages
    apart; ``replay`` itself streams them)."""
    taken, t = timed(lambda: [take(r) for r in events])
    results.add("file", "stage: take (decode, intake)", n, t)
    inputs = [item for item in taken if isinstance(item, Taken)]
    _, t = timed(lambda: fold_all(plan.job_id, inputs, plan.machine))
    results.add("file", "stage: fold only (decide)", n, t)


async def bus_replays(
    results: Results, section: str, label: str, url: str, sources: Sources, n: int, job_id: str
) -> None:
    """Read the job from the bus at ``url``, then read and replay it."""
    broker = sources.broker if section == "kafka" else None

    async def read() -> int:
        return len((await read_bus(url, sources.prefix, job_id)).events)

    async def full() -> int:
        return replay_log(await read_bus(url, sources.prefix, job_id))

    _, t = await timed_async(read, broker)
    results.add(section, f"{label}: read only (read_bus)", n, t)
    _, t = await timed_async(full, broker)
    results.add(section, f"{label}: read + decode + fold + verify", n, t)


async def one_round(results: Results, sources: Sources, values: list[bytes], plan: Plan) -> None:
    """Every measurement once."""
    n = len(values)
    _, t = timed(lambda: decode_all(values))
    results.add("codec", CEILING, n, t)
    _, t = timed(lambda: [decode(v) for v in values])
    results.add("codec", "context: decode, results kept", n, t)
    _, t = timed(lambda: replay_whole_file(sources.path))
    results.add("file", FILE_REPLAY, n, t)
    _, t = timed(lambda: replay_whole_file(sources.path, process=False))
    results.add("file", "file: the same, read in the replaying process", n, t)
    file_stages(results, sources.path, n, plan)
    await bus_replays(
        results, "embedded", "embedded bus", sources.embedded, sources, n, plan.job_id
    )
    if sources.kafka is not None:
        url = f"kafka://{sources.kafka}"
        await bus_replays(results, "kafka", "Kafka", url, sources, n, plan.job_id)


def profile_file(path: Path, top: int) -> dict[str, Any]:
    """Profile one file replay (module docstring): the cumulative seconds under each stage,
    the functions with the most own time, and a run with the garbage collector off."""
    profiler = cProfile.Profile()
    gc.collect()
    profiler.enable()
    replay_whole_file(path, process=False)  # the reading too, in this process
    profiler.disable()
    stats = pstats.Stats(profiler)
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = stats.stats  # type: ignore[attr-defined]
    total = max(ct for _, _, _, ct, _ in raw.values())

    def under(module: str, function: str) -> float:
        return sum(
            ct
            for (file, _, name), (_, _, _, ct, _) in raw.items()
            if name == function and file.endswith(module)
        )

    decode_s = under("schemas/_codec.py", "decode")
    take_s = under("core/_intake.py", "take")
    stages = [
        (
            "read the file (_export_file._items: gunzip, JSON, base64, Record)",
            under("forensics/_export_file.py", "_items"),
        ),
        ("decode (codec, under take)", decode_s),
        ("intake besides decode (input_id, Observed, Taken)", take_s - decode_s),
        (
            "input keys (_audit_entry.input_key: orjson with sorted keys)",
            under("core/_audit_entry.py", "input_key"),
        ),
        (
            "decision groups (_audit_entry.plain_decisions)",
            under("core/_audit_entry.py", "plain_decisions"),
        ),
        ("fold (_machine.decide)", under("core/_machine.py", "decide")),
        ("audit trail (read_trail)", under("core/_audit_entry.py", "read_trail")),
        ("verify", under("_replay.py", "verify")),
    ]
    stages.append(("everything else", total - sum(s for _, s in stages)))
    functions = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    gc.collect()
    gc.disable()
    try:
        _, no_gc = timed(lambda: replay_whole_file(path, process=False))
    finally:
        gc.enable()
    return {
        "total_s": total,
        "stages": stages,
        "functions": [
            (f"{Path(file).name}:{line}({name})", calls, own, cum)
            for (file, line, name), (_, calls, own, cum, _) in functions
        ],
        "no_gc": asdict(no_gc),
    }


def prepare(plan: Plan, path: Path, results: Results) -> list[bytes]:
    """Generate the record and write it to ``path``; return its ``events`` values."""
    job, t = timed(lambda: generate(plan))
    events = job.records["events"]
    values = [r.value for r in events if r.value is not None]
    kinds = Counter(type(decode(v)).__name__ for v in values)
    results.notes.append(
        f"record: {len(events):,} events ({', '.join(f'{k} {c:,}' for k, c in kinds.items())}), "
        f"{sum(map(len, values)) / len(values):.0f} bytes each on average; "
        f"{plan.world_size} ranks, {job.steps:,} steps reached, incidents "
        f"{', '.join(f'{cause} at step {step:,}' for cause, step in job.incidents)}; "
        f"audit {len(job.records['audit']):,} entries, commands {len(job.records['commands'])}, "
        f"manifests {len(job.records['manifests'])}; decisions "
        f"{', '.join(f'{k} {c}' for k, c in sorted(job.decisions.items()))}; "
        f"generated in {t.wall_s:.0f} s (seed {plan.seed})"
    )
    size, t = timed(lambda: write_file(job, path))
    results.notes.append(f"export file: {size / 1e6:.1f} MB, written in {t.wall_s:.0f} s")
    return values


async def run(args: argparse.Namespace, console: Console) -> Results:
    """Generate and write the record, then measure (module docstring)."""
    results = Results()
    results.notes.extend(machine_notes())
    plan = Plan(events=args.events, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="replay-bench-") as tmp:
        path = args.record or Path(tmp) / "job.tgjsonl.gz"
        values = prepare(plan, path, results)
        sources = Sources(
            path, f"sqlite://{Path(tmp) / 'bus.db'}", f"bench-{uuid.uuid4().hex[:8]}."
        )
        _, t = await timed_async(lambda: import_file(path, sources.embedded, sources.prefix))
        results.notes.append(f"embedded bus: imported with import_file in {t.wall_s:.0f} s")
        brokers = (
            nullcontext(None) if args.no_kafka else kafka_broker(args.kafka, Path(tmp) / "kafka")
        )
        with brokers as broker:
            if args.no_kafka:
                results.notes.append("Kafka skipped (--no-kafka)")
            elif broker is None:
                results.notes.append("Kafka skipped: kafka-dev did not start (stderr says why)")
            else:
                _, t = await timed_async(lambda: write_kafka(broker.address, sources.prefix, path))
                started = f"kafka-dev, pid {broker.pid}" if broker.pid else "given"
                results.notes.append(
                    f"Kafka: broker {broker.address} ({started}), topics with CreateTime "
                    f"timestamps, written in {t.wall_s:.0f} s"
                )
                sources.kafka, sources.broker = broker.address, broker
            try:
                loads = []
                for r in range(args.rounds):
                    console.print(f"round {r + 1} of {args.rounds} ...", highlight=False)
                    loads.append(f"{os.getloadavg()[0]:.1f}")
                    await one_round(results, sources, values, plan)
                results.notes.append(
                    f"load average (1 min) at each round's start: {', '.join(loads)}"
                )
            finally:
                if sources.kafka is not None:
                    await delete_topics(sources.kafka, sources.prefix)
        ratio = results.figures[FILE_REPLAY].rate / results.figures[CEILING].rate
        if args.profile or ratio < TARGET:
            console.print("profiling one file replay ...", highlight=False)
            results.profile = profile_file(path, args.profile_top)
    load = os.getloadavg()
    results.notes.append(f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return results


# -- output ----------------------------------------------------------------------------------

HEADER = [
    "measurement",
    "events",
    "events/s",
    "ev/CPU-s",
    "spread wall / CPU",
    "broker CPU-s",
    "reader CPU-s",
    "÷ ceiling",
    "÷ ceiling (CPU)",
    "target",
    "verdict",
]


def report(results: Results) -> Report:
    """The tables: figures, and the profile when there is one."""
    ceiling = results.figures[CEILING]
    rows = []
    for f in results.figures.values():
        is_ceiling = f.name == CEILING
        target = f"≥ {TARGET:.0%}" if f.name == FILE_REPLAY else ""
        cpu_ratio = f.cpu_rate / ceiling.cpu_rate
        ratio = f.rate / ceiling.rate
        verdict = ("PASS" if ratio >= TARGET else "FAIL") if target else ""
        broker = f.best.broker_cpu_s
        reader = f.best.reader_cpu_s
        rows.append(
            [
                f.name,
                f"{f.events:,}",
                f"{f.rate:,.0f}",
                f"{f.cpu_rate:,.0f}",
                f"{f.spread():.0%} / {f.spread(cpu=True):.0%}",
                "" if broker is None else f"{broker:.1f}",
                f"{reader:.1f}" if reader else "",
                "" if is_ceiling else f"{ratio:.0%}",
                "" if is_ceiling else f"{cpu_ratio:.0%}",
                target,
                verdict,
            ]
        )
    out = Report(tables=[("Replay (issue 5)", HEADER, rows)], notes=list(results.notes))
    profile = results.profile
    if profile:
        total = profile["total_s"]
        out.tables.append(
            (
                f"Where a file replay's time goes, read in the replaying process (cProfile, "
                f"{total:.1f} s with profiler overhead)",
                ["stage", "s (cumulative)", "share"],
                [[name, f"{s:.1f}", f"{s / total:.0%}"] for name, s in profile["stages"]],
            )
        )
        out.tables.append(
            (
                "Functions with the most own time",
                ["function", "calls", "own s", "cumulative s"],
                [
                    [name, f"{calls:,}", f"{own:.2f}", f"{cum:.2f}"]
                    for name, calls, own, cum in profile["functions"]
                ],
            )
        )
        replayed = results.figures["file: the same, read in the replaying process"]
        no_gc = Timing(**profile["no_gc"])
        with_gc = replayed.events / replayed.cpu_rate
        out.notes.append(
            f"file replay read in the replaying process, cyclic garbage collector disabled: "
            f"{replayed.events / no_gc.cpu_s:,.0f} ev/CPU-s ({no_gc.cpu_s:.1f} CPU-s against "
            f"{with_gc:.1f} with it; {replayed.events / no_gc.cpu_s / ceiling.cpu_rate:.0%} of "
            "the ceiling per CPU-second)"
        )
    return out


def write_json(results: Results, path: Path) -> None:
    """The figures (every round), notes and profile as JSON."""
    figures = [
        {
            "section": f.section,
            "name": f.name,
            "events": f.events,
            "rate": f.rate,
            "cpu_rate": f.cpu_rate,
            "spread": f.spread(),
            "cpu_spread": f.spread(cpu=True),
            "runs": [asdict(t) for t in f.runs],
        }
        for f in results.figures.values()
    ]
    document = {"figures": figures, "notes": results.notes, "profile": results.profile}
    path.write_text(json.dumps(document, indent=2) + "\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description="Replay throughput from an export file and each bus, next to decode."
    )
    parser.add_argument(
        "--events", type=int, default=1_000_000, help="records on events, >= 20000 (1000000)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the best counts (3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated job (0)")
    parser.add_argument("--kafka", metavar="HOST:PORT", help="use this broker (default: start one)")
    parser.add_argument("--no-kafka", action="store_true", help="skip Kafka")
    parser.add_argument("--record", type=Path, help="also keep the export file here")
    parser.add_argument("--profile", action="store_true", help="profile even if the target is met")
    parser.add_argument("--profile-top", type=int, default=15, help="functions listed (15)")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.events < MIN_EVENTS:
        # The first incident strikes at a fifth of the record, after the start-up.
        parser.error(f"--events must be at least {MIN_EVENTS:,}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0, or 1 when a replay did not reproduce the recorded decisions."""
    args = parse_args(argv)
    console = Console(width=200)
    try:
        results = asyncio.run(run(args, console))
    except ReplayMismatch as exc:
        console.print(f"[bold red]{exc}[/bold red]")
        return 1
    print_report(report(results), args.markdown, console)
    if args.json:
        write_json(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
