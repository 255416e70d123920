"""Heartbeat batches (issue 16 item 3): what one ``heartbeat-batch`` record per node saves the
daemon and the bus, against one ``heartbeat`` record per rank, measured in the same run.

Usage (from the repository root)::

    python bench/heartbeat_batches.py [--ranks 4096] [--ranks-per-host 8] [--seconds 20]
                                      [--rounds 3] [--markdown]

A running job of ``--ranks`` ranks (``trainguard sim``'s wire: every rank's records exactly
as an agent, or with batching a node's supervisor, sends them, MACed under the job's event
key; ``daemon/src/trainguard/daemon/sim/_wire.py``) heartbeats once a second for
``--seconds`` seconds, every tenth second with a parameter checksum. The same heartbeats are
encoded twice: one record per rank (``plain``) and one record per node (``batched``). Each
record goes through the daemon's per-record path without a bus, ``take`` (the MAC checked on
the raw bytes, decode, ``EventAuth`` holding the job's key) then ``decide``, from the state the
job's ``started`` reports left (folded first, not timed).

Printed per variant: records, bytes on the wire per rank heartbeat, CPU microseconds per
record and per rank heartbeat (``time.process_time``; each round interleaves the variants and a
figure keeps its least time over ``--rounds``), and the ratio batched / plain per heartbeat.
Figures are printed, never asserted.

With ``--kafka HOST:PORT --kafka-data DIR`` both variants' heartbeat records are also sent to a
Kafka broker whose log folder is ``DIR`` (``deploy/kafka/kafka-dev start --dir D``: ``D/data``),
each to a fresh topic prefix, and the bytes its ``events`` partition holds are reported per
rank heartbeat (Kafka's record and batch framing included; no compression, as the bus sends).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path
from typing import NamedTuple

from trainguard.agent.bus import BusConfig, open_bus
from trainguard.agent.keys._keystore import DaemonKeys, KeyStore
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.daemon.core._intake import Refused, take
from trainguard.daemon.core._machine import decide
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import JobState, new_job
from trainguard.daemon.service._security import EventAuth
from trainguard.daemon.sim._model import Beats, Reports, SimParams
from trainguard.daemon.sim._wire import Wire

JOB = "bench-batches"
T0_MS = 1_764_000_000_000


class _Record(NamedTuple):
    key: str | None
    value: bytes | None
    offset: int
    timestamp_ms: int


def _records(
    ranks: int, per_host: int, seconds: int, batched: bool, key: tuple[str, bytes], folder: Path
) -> list[_Record]:
    """The job's ``started`` reports, then ``seconds`` seconds of heartbeats, as records."""
    params = SimParams(ranks=ranks, ranks_per_host=per_host, batch_heartbeats=batched)
    wire = Wire(JOB, params, lambda rank: rank // per_host, key, folder)
    all_ranks = tuple(range(ranks))
    emissions: list[tuple[int, Reports | Beats]] = [(0, Reports(0, 0, all_ranks, "started", 0))]
    for s in range(1, seconds + 1):
        checksum = f"{s:08x}" if s % 10 == 0 else None
        emissions.append(
            (s * 1000, Beats(s * 1000, 0, all_ranks, s, "train", 100, 2.0, checksum=checksum))
        )
    out: list[_Record] = []
    for at_ms, emission in emissions:
        for value in wire.encode(emission):
            out.append(_Record(JOB, value, len(out), T0_MS + at_ms))
    return out


def _fold(records: list[_Record], auth: EventAuth, config: MachineConfig) -> JobState:
    state = new_job(JOB)
    for record in records:
        taken = take(record, auth)
        if isinstance(taken, Refused):
            raise SystemExit(f"record {record.offset} refused: {taken.reason}")
        state, _ = decide(state, taken.input, config)
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--ranks-per-host", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--kafka", help="HOST:PORT of a Kafka broker to measure bytes on")
    parser.add_argument("--kafka-data", type=Path, help="that broker's log folder")
    args = parser.parse_args()
    config = MachineConfig(daemon_id="bench")
    with tempfile.TemporaryDirectory() as tmp:
        admin = KeyAdmin(Path(tmp) / "keys")
        admin.init([JOB])
        store = KeyStore(admin.path)
        kid = store.current("event", JOB)
        assert kid is not None
        key = (kid, store.secret_key("event", kid, JOB))
        keys = store.load_daemon_keys()  # reads the folder when a job's key is first asked
        variants = {
            name: _records(args.ranks, args.ranks_per_host, args.seconds, batched, key, Path(tmp))
            for name, batched in (("plain", False), ("batched", True))
        }
        best = _measure(variants, keys, config, args.rounds)
    _print(args, variants, best)
    if args.kafka and args.kafka_data:
        beats = args.ranks * args.seconds
        for name, records in variants.items():
            size = asyncio.run(
                _on_kafka(args.kafka, args.kafka_data, records[_first_beat(records) :])
            )
            print(
                f"Kafka, {name}: {size:,} bytes in the events log, {size / beats:.0f} per heartbeat"
            )


def _measure(
    variants: dict[str, list[_Record]], keys: DaemonKeys, config: MachineConfig, rounds: int
) -> dict[str, float]:
    """Least CPU seconds over ``rounds`` to take and fold each variant's heartbeat records,
    from the state its ``started`` reports left."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, records in variants.items():
            auth = EventAuth(keys, require=True)
            first = _first_beat(records)
            state = _fold(records[:first], auth, config)
            cpu = time.process_time()
            for record in records[first:]:
                taken = take(record, auth)
                assert not isinstance(taken, Refused), taken.reason
                state, _ = decide(state, taken.input, config)
            spent = time.process_time() - cpu
            best[name] = min(best.get(name, spent), spent)
            assert state.phase == "running", state.phase
    return best


def _print(
    args: argparse.Namespace, variants: dict[str, list[_Record]], best: dict[str, float]
) -> None:
    beats = args.ranks * args.seconds
    rows = []
    for name, records in variants.items():
        timed = records[_first_beat(records) :]
        size = sum(len(r.value or b"") for r in timed)
        per_record, per_beat = 1e6 * best[name] / len(timed), 1e6 * best[name] / beats
        rows.append((name, len(timed), size / beats, per_record, per_beat))
    head = ("variant", "records", "bytes / heartbeat", "CPU us / record", "CPU us / heartbeat")
    print(
        f"{args.ranks} ranks, {args.ranks_per_host} per host, {args.seconds} s of heartbeats "
        f"({beats:,} heartbeats), best of {args.rounds} rounds"
    )
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    for name, n, size, per_record, per_beat in rows:
        if args.markdown:
            print(f"| {name} | {n:,} | {size:.0f} | {per_record:.1f} | {per_beat:.1f} |")
        else:
            print(
                f"{name:8} {n:>9,} records  {size:6.0f} B/heartbeat  "
                f"{per_record:7.1f} us/record  {per_beat:6.1f} us/heartbeat"
            )
    sizes = {name: size for name, _, size, _, _ in rows}
    print(
        f"batched / plain: CPU per heartbeat x{best['batched'] / best['plain']:.2f}, "
        f"bytes per heartbeat x{sizes['batched'] / sizes['plain']:.2f}"
    )


async def _on_kafka(bootstrap: str, records: list[_Record]) -> str:
    """Send ``records`` to a fresh topic prefix of the broker; return the prefix once all are
    acknowledged."""
    prefix = f"bench-{uuid.uuid4().hex[:8]}."
    async with open_bus(BusConfig(url=f"kafka://{bootstrap}", prefix=prefix)) as bus:
        deliveries = [await bus.send("events", JOB, r.value or b"") for r in records]
        await asyncio.gather(*deliveries)
    return prefix


def _events_bytes(data: Path, prefix: str) -> int:
    """The bytes of ``prefix``'s ``events`` logs in the broker's log folder (segments reach
    the page cache as they are appended)."""
    return sum(f.stat().st_size for d in data.glob(f"{prefix}events-*") for f in d.glob("*.log"))


def _first_beat(records: list[_Record]) -> int:
    """Index of the first heartbeat record (after the ``started`` reports at time 0)."""
    return next(i for i, r in enumerate(records) if r.timestamp_ms > T0_MS)


if __name__ == "__main__":
    main()
