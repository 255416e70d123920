"""State snapshot benchmark (issue 16, item 2): how large a job's state snapshot is and how
long writing and loading it take, at 1,024 / 4,096 / 16,384 ranks.

Usage (from the repository root)::

    python bench/state_snapshot.py [--ranks 1024 4096 16384] [--commits 8] [--rounds 3]
                                   [--markdown]

Each job's state is folded through the pure core by the replay benchmark's generator
(``bench/_job_record.py``: 8 ranks per host named ``gpu-NNN``, one heartbeat per rank and
~1 s step with loss and step time, a checkpoint every 2 steps with ``s3://`` shard URIs and
SHA-256 digests, hyperparameters and topology), stopped once ``--commits`` checkpoints are
committed (the daemon keeps ``keep_snapshots`` = 8 by default) and no shard is pending.

Measured on it, each figure the least over ``--rounds`` rounds, CPU time of this process
(``time.process_time``: the machine is shared, wall time swings with other load):

* **baseline**: the ``jobstate/1`` document alone (``encode_state`` / ``decode_state``), i.e.
  an uncompressed snapshot's size and codec cost;
* **compression candidates** on that document: zlib levels 1 and 6, zstd levels 1 and 3
  (size, compress, decompress), which chose zstd level 1 (``_snapshot_envelope.ZSTD_LEVEL``);
* **write**: ``seal`` (encode + zstd + AES-256-GCM + Ed25519) and ``split`` into chunks of
  the default ``max_message_bytes`` (1 MiB: hashing and signing the head);
* **load**: ``open_record`` on the head and its chunks, what a starting daemon does per job
  (head signature, every chunk's SHA-256, the envelope's signature, AES-GCM, zstd, decode),
  and its parts;
* **restart from the bus**: the snapshot written by :class:`Snapshots` into an embedded bus
  (one partition writer transaction) and loaded back by a fresh :class:`Snapshots`
  (``latest_per_key``, then the plan in a worker thread), wall time, as a daemon taking the
  partition on.

Figures are printed, never asserted; ``uptime``'s load is printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import zstandard
from rich.console import Console

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._job_record import PARTITIONS, Plan, running_state  # noqa: E402
from bench._report import Report, print_report  # noqa: E402
from bench._summary import machine_notes  # noqa: E402

from trainguard.agent.bus import DEFAULT_TOPICS, BusConfig, TopicPartition, open_bus  # noqa: E402
from trainguard.agent.bus._partitioner import partition_for  # noqa: E402
from trainguard.agent.keys._keystore import DaemonKeys, KeyStore  # noqa: E402
from trainguard.daemon.admin._keys import KeyAdmin  # noqa: E402
from trainguard.daemon.core._machine_config import MachineConfig  # noqa: E402
from trainguard.daemon.core._state import JobState  # noqa: E402
from trainguard.daemon.core._state_codec import decode_state, encode_state  # noqa: E402
from trainguard.daemon.service._metrics import DaemonMetrics  # noqa: E402
from trainguard.daemon.service._snapshot_chunks import head_of, join, open_record, split  # noqa: E402
from trainguard.daemon.service._snapshot_envelope import (  # noqa: E402
    NONCE_BYTES,
    Round,
    fold_config_id,
    open_snapshot,
    seal,
)
from trainguard.daemon.service._snapshot_store import Snapshots  # noqa: E402

LIMIT = 1 << 20
"""The default ``max_message_bytes``: the chunk size."""
MB = 1e6
_T = TypeVar("_T")


@dataclass
class Case:
    """One job's figures: sizes in bytes, times in CPU seconds (least over the rounds), the
    restart from the bus in wall seconds."""

    ranks: int
    records: int
    build_s: float
    sizes: dict[str, int]
    times: dict[str, float]


def least(fn: Callable[[], _T], rounds: int) -> tuple[_T, float]:
    """``fn()``'s result and its least CPU time over ``rounds`` calls."""
    best = float("inf")
    result: _T
    for _ in range(rounds):
        start = time.process_time()
        result = fn()
        best = min(best, time.process_time() - start)
    return result, best


def keys_in(folder: Path) -> DaemonKeys:
    admin = KeyAdmin(folder)
    admin.init()
    return KeyStore(admin.path).load_daemon_keys()


async def restart(state: JobState, keys: DaemonKeys, config: MachineConfig, folder: Path) -> float:
    """Write ``state``'s snapshot into a fresh embedded bus in a partition writer's
    transaction, then load it with a fresh :class:`Snapshots`; the load's wall seconds."""
    bus_config = BusConfig(url=f"sqlite://{folder / 'bus.db'}", prefix="b.", topics=DEFAULT_TOPICS)
    partition = partition_for(state.job_id, PARTITIONS)
    async with open_bus(bus_config) as bus:
        consumer = await bus.subscribe(["events"], "b.daemon")
        while not consumer.assignment():
            await consumer.getmany(timeout_s=0.1)
        writer = await bus.partition_writer("b.daemon", partition)
        store = Snapshots(config, DaemonMetrics(), max_message_bytes=LIMIT)
        await store.write(writer, partition, 1, {state.job_id: state}, keys)
        await writer.commit({TopicPartition("events", partition): 1})
        await writer.close()
        await consumer.close()
        start = time.perf_counter()
        plans = await Snapshots(config, DaemonMetrics(), max_message_bytes=LIMIT).load(
            bus, {partition: 1}, keys
        )
        took = time.perf_counter() - start
    if plans[partition].states[state.job_id] != state:
        raise RuntimeError("the state loaded from the bus is not the one written")
    return took


def measure(ranks: int, commits: int, rounds: int, keys: DaemonKeys, folder: Path) -> Case:
    plan = Plan(world_size=ranks, checkpoint_every=2, events=10**9)
    start = time.perf_counter()
    state, records = running_state(plan, commits)
    build_s = time.perf_counter() - start
    config = plan.machine
    fold = fold_config_id(config)
    sizes: dict[str, int] = {}
    times: dict[str, float] = {}

    document, times["encode_state"] = least(lambda: encode_state(state), rounds)
    _, times["decode_state"] = least(lambda: decode_state(document), rounds)
    sizes["document"] = len(document)
    for name, compress, decompress in (
        ("zlib-1", lambda: zlib.compress(document, 1), zlib.decompress),
        ("zlib-6", lambda: zlib.compress(document, 6), zlib.decompress),
        ("zstd-1", lambda: zstandard.ZstdCompressor(level=1).compress(document), None),
        ("zstd-3", lambda: zstandard.ZstdCompressor(level=3).compress(document), None),
    ):
        packed, times[f"{name} compress"] = least(compress, rounds)
        unpack = decompress or zstandard.ZstdDecompressor().decompress
        _, times[f"{name} decompress"] = least(lambda p=packed, u=unpack: u(p), rounds)  # type: ignore[misc]
        sizes[name] = len(packed)

    def sealed() -> bytes:
        return seal(
            state,
            Round.of(partition_for(state.job_id, PARTITIONS), records, [state.job_id]),
            signing_kid=keys.signing_kid,
            signing_key=keys.signing,
            data_kid=keys.data_kid,
            data_key=keys.data[keys.data_kid],
            nonce=os.urandom(NONCE_BYTES),
            config=config,
            version="bench",
        )

    envelope, times["seal"] = least(sealed, rounds)
    (head, chunks), times["split"] = least(lambda: split(envelope, LIMIT, keys.signing), rounds)
    sizes["envelope"] = len(envelope)
    sizes["chunks"] = len(chunks)
    sizes["head"] = len(head)
    values = dict(chunks)
    parsed = head_of(head)
    assert parsed is not None

    def load() -> JobState:
        _, loaded = open_record(
            head, values, keys.verify, keys.data, state.job_id, fold_config=fold
        )
        return loaded

    loaded, times["open_record"] = least(load, rounds)
    if loaded != state:
        raise RuntimeError("the loaded state is not the one sealed")
    _, times["join (chunk digests)"] = least(lambda: join(parsed, values), rounds)
    _, times["open_snapshot"] = least(
        lambda: open_snapshot(envelope, keys.verify, keys.data, state.job_id), rounds
    )
    _, times["sha256 of the envelope"] = least(lambda: hashlib.sha256(envelope).digest(), rounds)
    wall = [
        asyncio.run(restart(state, keys, config, Path(tempfile.mkdtemp(dir=folder))))
        for _ in range(rounds)
    ]
    times["restart from the bus (wall)"] = min(wall)
    return Case(ranks, records, build_s, sizes, times)


def report(cases: list[Case], commits: int) -> Report:
    out = Report()
    ranks = [f"{c.ranks:,}" for c in cases]
    mb = [
        [name, *(f"{c.sizes[key] / MB:.2f}" for c in cases)]
        for name, key in (
            ("document (baseline: uncompressed)", "document"),
            ("zlib level 1", "zlib-1"),
            ("zlib level 6", "zlib-6"),
            ("zstd level 1 (chosen)", "zstd-1"),
            ("zstd level 3", "zstd-3"),
            ("sealed envelope (zstd 1 + GCM + signature)", "envelope"),
        )
    ]
    mb.append(["chunks of 1 MiB", *(str(c.sizes["chunks"]) for c in cases)])
    mb.append(["head, bytes", *(str(c.sizes["head"]) for c in cases)])
    out.tables.append(
        (f"Snapshot sizes, MB (running job, {commits} commits kept)", ["", *ranks], mb)
    )
    ms = [
        [name, *(f"{c.times[name] * 1e3:.0f}" for c in cases)]
        for name in (
            "encode_state",
            "decode_state",
            "zlib-1 compress",
            "zlib-1 decompress",
            "zlib-6 compress",
            "zlib-6 decompress",
            "zstd-1 compress",
            "zstd-1 decompress",
            "zstd-3 compress",
            "zstd-3 decompress",
            "seal",
            "split",
            "open_record",
            "join (chunk digests)",
            "open_snapshot",
            "sha256 of the envelope",
            "restart from the bus (wall)",
        )
    ]
    out.tables.append(("Write and load, ms (CPU; least of the rounds)", ["", *ranks], ms))
    out.notes.append(
        "Baseline: encode_state / decode_state are the uncompressed document's codec cost "
        "(what a /1 snapshot cost before encryption); seal = encode_state + zstd + AES-GCM + "
        "Ed25519; open_record = head signature + chunk SHA-256s (join) + open_snapshot "
        "(signature, AES-GCM, zstd, decode_state)."
    )
    out.notes.append(
        "States folded: "
        + ", ".join(f"{c.ranks:,} ranks {c.records:,} records in {c.build_s:.0f} s" for c in cases)
    )
    out.notes.extend(machine_notes())
    out.notes.append(f"uptime: {os.popen('uptime').read().strip()}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--commits", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        keys = keys_in(Path(folder) / "keys")
        cases = [measure(r, args.commits, args.rounds, keys, Path(folder)) for r in args.ranks]
    print_report(report(cases, args.commits), args.markdown, Console())


if __name__ == "__main__":
    main()
