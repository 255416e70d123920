"""Authentication cost benchmark (issue 6): what signing, encryption and MACs cost the daemon,
next to the bare primitives in the same run.

Usage (from the repository root)::

    python bench/crypto.py [--events 200000] [--rounds 3] [--no-bus] [--markdown] [--json FILE]

**Snapshots** (:mod:`trainguard.daemon.service._snapshot_envelope`): the states of running jobs of 4, 64 and 512
ranks, each built by folding a simulated trace (``tests/support/traces.py``: heartbeats every
~1 s, checkpoint shards every 10 steps, parameter checksums every 10 steps; folded with ticks
at the deadlines, up to just before the last step completes) are sealed (``seal``: state codec,
AES-256-GCM, Ed25519 signature) and opened (``open_snapshot``: signature, GCM tag, state
decoding). Next to them, in the same round: ``encode_state`` / ``decode_state`` alone, bare
AES-256-GCM encrypt / decrypt of the same plaintext with the same associated data (an
``AESGCM`` object built once), and bare Ed25519 sign / verify of exactly the bytes the
snapshot's signature covers. Throughput is MB (10**6 bytes) of plaintext state (the
``jobstate/1`` document) per second; "other" is the rest of the envelope: the header (which
hashes the configuration twice), nonce, concatenations, framing, and, since the
``trainguard-snapshot/2`` envelope, the zstd compression of the document before it is encrypted
(the bare AES-GCM figures encrypt the uncompressed document, which the envelope no longer does;
``bench/state_snapshot.py`` measures the compressed envelope's parts).

**Commands and events** (:mod:`trainguard.schemas._auth`): ``sign`` and ``verify_signature`` of
a ``Restore`` whose target is a committed 64-shard manifest (taken from the fold below) and of
a ``Resume``, next to bare Ed25519 sign / verify of the same canonical bytes; ``add_mac`` and
``verify_mac`` of a heartbeat, next to bare HMAC-SHA256 (``hmac.digest``, plus
``hmac.compare_digest`` for verifying) of its canonical bytes. The codec's ``encode`` /
``decode`` of the same message are shown as context: a sender encodes, a receiver decodes
anyway.

**End-to-end fold**: one simulated 64-rank job of about ``--events`` heartbeats (with its
checkpoint shards every 100 steps, all committed, checksums, lifecycle events and the ticks a
daemon would write at the deadlines) as records of ``events`` (append time = arrival time),
encoded once without and once with MACs under the job's event key. Each record goes through
the daemon's per-record path, ``take`` (decode, job-id check, :class:`EventAuth`; below) then
``decide``, exactly as ``DaemonService._process`` calls them but without a bus:

* ``off``: unauthenticated records, a daemon without keys (``EventAuth(None)``);
* ``on``: MACed records, ``EventAuth`` with a real ``DaemonKeys`` (a key directory made by
  ``KeyAdmin.init``) holding the job's event key: the daemon's path, on which ``take`` checks
  the MAC on the record's raw bytes (``split_mac``, ``EventAuth.mac_keys``,
  ``verify_raw_mac``) and decodes only its canonical bytes (``decode_maced``);
* ``full``: as ``on``, but every record through the full path (:class:`FullPath`: decode the
  whole record, then ``EventAuth.refuse`` and ``verify_mac``), which records of other layouts
  and records failing the raw-bytes check take (and every record did before it existed);
* ``context``: MACed records taken by a daemon without keys (the cost of the larger record and
  of decoding its ``auth`` member, without checking it).

Target: ``on`` folds at least 75 % of ``off``'s rate (authentication costs the fold at most
25 %), judged on CPU time. Unless ``--no-bus``, the same records are also imported (with their
append times) into an embedded bus and folded by a real ``DaemonService`` (fresh consumer group
per round, snapshots off, ticks off: its clock is frozen), timed from the first batch folded to
the last; commands and manifests it issues are signed when it has keys.

**Where the time goes**: on every 10th record, ``take`` of a MACed record by a daemon with the
key against ``take`` of a plain record by one without, and the pieces of the difference:
``split_mac`` (layout, and the check that the rest is canonical: a parse and a sorted
serialisation), ``EventAuth.mac_keys``, ``verify_raw_mac`` (next to a one-shot ``hmac.digest``
of the same bytes, which keys the HMAC anew), ``decode_maced`` (it builds the message from the
object ``split_mac`` parsed, and consumes it: measured as ``split_mac`` + ``decode_maced`` minus
``split_mac``) against ``decode`` of the plain record (the same bytes). Next to them the full path: ``take`` through :class:`FullPath`,
``decode`` of the whole MACed record, and ``EventAuth.refuse``.

Each part runs ``--rounds`` times (3), interleaved (fold variants in alternating order); a
figure keeps its least CPU time and, apart, its least wall time over the rounds. Rates per
CPU-second (``time.process_time``, the whole process: the embedded bus's threads included) are
the basis of every ratio and verdict: on a shared machine wall-clock rates swing with other
jobs' load while CPU rates hold. "spread" is (worst - best) / best CPU time over the rounds.
Figures are printed, never asserted; the exit status is 0 unless a fold refused a record.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import hmac
import itertools
import json
import logging
import math
import os
import struct
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import TypeVar, cast

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from rich.console import Console

from trainguard.agent.bus import DEFAULT_TOPICS, BusConfig, Record, open_bus
from trainguard.agent.bus._sqlite import SQLiteBus
from trainguard.agent.keys._keystore import DaemonKeys, KeyStore
from trainguard.daemon import DaemonService
from trainguard.daemon.admin._keys import KeyAdmin
from trainguard.daemon.core._decisions import Committed
from trainguard.daemon.core._inputs import Observed
from trainguard.daemon.core._intake import (
    Authenticator,
    AuthRefusal,
    RawRecord,
    Refused,
    take,
)
from trainguard.daemon.core._machine import decide
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import JobState, new_job
from trainguard.daemon.core._state_codec import decode_state, encode_state
from trainguard.daemon.service._logging import configure_logging
from trainguard.daemon.service._security import EventAuth
from trainguard.daemon.service._settings import DaemonConfig
from trainguard.daemon.service._snapshot_envelope import (
    NONCE_BYTES,
    SIGNING_CONTEXT,
    Round,
    fold_config_id,
    open_snapshot,
    seal,
)
from trainguard.schemas import (
    EVENTS_TOPIC_TYPES,
    ClockTick,
    Event,
    Heartbeat,
    Manifest,
    RawMac,
    Restore,
    Resume,
    add_mac,
    canonical_bytes,
    decode,
    decode_maced,
    encode,
    sign,
    snapshot_ref,
    split_mac,
    verify_mac,
    verify_raw_mac,
    verify_signature,
)

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # bench._report and the tests' trace simulator

from bench._report import Report, print_report  # noqa: E402
from bench._summary import machine_notes  # noqa: E402

from tests.support.traces import Job, drive, simulate  # noqa: E402

JOB = "job"
"""The simulated job (``tests/support/traces.py`` names every event's job so)."""
TARGET_RATIO = 0.75
"""Fold rate with authentication over the rate without, at least (issue 6: costs <= 25 %)."""
SNAPSHOT_RANKS = (4, 64, 512)
SNAPSHOT_STEPS = 100
"""Steps of the jobs whose states are snapshotted (checkpoints and checksums every 10)."""
FOLD_RANKS = 64
FOLD_CHECKPOINT_EVERY = 100
STARTUP_S = 8
"""Seconds of a simulated job before its second step (init 5 s, first step 3 s): heartbeats
that come on top of one per rank and step."""
COMPONENT_STRIDE = 10
"""The cost breakdown runs on every 10th record of the fold's workload."""
PREFIX = "bench."
S = 1_000_000_000
NS_PER_MS = 1_000_000
MB = 1e6

_T = TypeVar("_T")


# ------------------------------------------------------------------------------ measurement


@dataclass
class Figure:
    """One measured operation over the rounds.

    Attributes:
        ops: operations per round (calls, or records for a fold).
        wall_s: wall-clock seconds of each round.
        cpu_s: CPU seconds of this process in each round.
    """

    ops: int
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)

    @property
    def cpu_us(self) -> float:
        """Microseconds of CPU per operation, best round."""
        return min(self.cpu_s) / self.ops * 1e6

    @property
    def wall_us(self) -> float:
        """Microseconds of wall time per operation, best round."""
        return min(self.wall_s) / self.ops * 1e6

    @property
    def spread(self) -> float:
        """(worst - best) / best CPU time over the rounds; 0 for one round."""
        return (max(self.cpu_s) - min(self.cpu_s)) / min(self.cpu_s)


class Figures(dict[str, Figure]):
    """Every figure of a run by name (``section/case/operation``)."""

    def record(self, name: str, ops: int, wall_s: float, cpu_s: float) -> None:
        """Add one round of ``name``: ``ops`` operations in ``wall_s`` / ``cpu_s`` seconds."""
        figure = self.setdefault(name, Figure(ops))
        figure.wall_s.append(wall_s)
        figure.cpu_s.append(cpu_s)

    def measure(self, name: str, fn: Callable[[_T], object], items: Sequence[_T]) -> None:
        """Time ``fn(item)`` for each of ``items`` (results dropped) as one round of ``name``."""
        wall, cpu = time.perf_counter(), time.process_time()
        for item in items:
            fn(item)
        self.record(name, len(items), time.perf_counter() - wall, time.process_time() - cpu)

    def us(self, name: str) -> float:
        """CPU microseconds per operation of ``name``."""
        return self[name].cpu_us


def repeat(item: _T, times: int) -> list[_T]:
    """``times`` references to ``item`` (the input of a :meth:`Figures.measure` of one call)."""
    return [item] * times


def right_sized(data: bytes) -> bytes:
    """A copy of ``data`` whose allocation fits its length: orjson (>= 3.12) returns bytes whose
    allocation stays several KiB whatever their length, which hundreds of thousands of kept
    encodings turn into gigabytes (as ``bench/bus_throughput.py`` notes)."""
    return bytes(memoryview(data))


# ---------------------------------------------------------------------------------- workloads


def daemon_keys(folder: Path) -> DaemonKeys:
    """A fresh key directory in ``folder`` (signing, data and ``JOB``'s event key, as
    ``trainguard keys init`` makes it), loaded as the daemon loads it."""
    admin = KeyAdmin(folder)
    admin.init([JOB])
    return KeyStore(admin.path).load_daemon_keys()


def running_state(ranks: int, config: MachineConfig) -> tuple[JobState, int]:
    """The state of a running ``ranks``-rank job after ``SNAPSHOT_STEPS - 1`` steps and the
    number of inputs folded into it (ticks included)."""
    job = Job(world_size=ranks, steps=SNAPSHOT_STEPS, checksum_every=10, tail_s=2.0, seed=ranks)
    trace = simulate(job)
    cut = trace.ends[job.steps]  # before the last step completes: no "finished" yet
    state, folded = drive([i for i in trace.inputs if i.at_ns < cut], cfg=config)
    return state, len(folded)


@dataclass(frozen=True)
class Stream:
    """The end-to-end workload: one job's records of ``events``, plain and MACed.

    Attributes:
        plain: the records as agents without keys write them (offsets 0, 1, ...).
        maced: the same records, each event and tick carrying its MAC.
        mix: records by message type.
        manifest: the first manifest the fold committed (the Restore command's target).
    """

    plain: list[Record]
    maced: list[Record]
    mix: dict[str, int]
    manifest: Manifest


def fold_stream(events: int, config: MachineConfig, event_key: tuple[str, bytes]) -> Stream:
    """About ``events`` heartbeats of a healthy ``FOLD_RANKS``-rank job (one per rank and ~1 s
    step), with the other events it sends, in arrival order, and the ticks a daemon folding
    them would write at each deadline (``tests/support/traces.py``: ``simulate``, ``drive``).

    Raises:
        RuntimeError: the fold committed no manifest (fewer than ``FOLD_CHECKPOINT_EVERY``
            steps).
    """
    steps = max(1, events // FOLD_RANKS - STARTUP_S)
    job = Job(
        world_size=FOLD_RANKS,
        steps=steps,
        checkpoint_every=FOLD_CHECKPOINT_EVERY,
        checksum_every=FOLD_CHECKPOINT_EVERY,
        tail_s=2.0,
    )
    _, folded = drive(simulate(job).inputs, cfg=config)
    kid, key = event_key
    ticks = itertools.count(1)
    plain: list[Record] = []
    maced: list[Record] = []
    mix: Counter[str] = Counter()
    manifest: Manifest | None = None
    for offset, (item, decisions) in enumerate(folded):
        message: Event | ClockTick
        if isinstance(item, Observed):
            message = item.event
        else:  # a healthy job stays in generation 0
            message = ClockTick(
                job_id=JOB, generation=0, ts=item.at_ns, seq=next(ticks), daemon_id=config.daemon_id
            )
        mix[type(message).__name__] += 1
        at_ms = item.at_ns // NS_PER_MS
        for out, value in ((plain, message), (maced, add_mac(message, kid, key))):
            out.append(Record("events", 0, offset, JOB, right_sized(encode(value)), at_ms))
        if manifest is None:
            manifest = next((d.manifest for d in decisions if isinstance(d, Committed)), None)
    if manifest is None:
        raise RuntimeError(f"{steps} steps committed no checkpoint: raise --events")
    return Stream(plain, maced, dict(mix), manifest)


# ---------------------------------------------------------------------------------- snapshots


@dataclass(frozen=True)
class SnapshotCase:
    """A state to seal and open, and the pieces of its envelope for the bare primitives.

    Attributes:
        ranks: the job's world size.
        state: the job's state.
        inputs: inputs folded into it.
        plain: ``encode_state(state)``, the bytes AES-GCM encrypts.
        sealed: a snapshot of it.
        header: the snapshot's header (the GCM associated data).
        nonce: its nonce.
        ciphertext: its ciphertext with the GCM tag.
        signed: the bytes its signature covers (``SIGNING_CONTEXT`` + everything before it).
        signature: its signature.
        reps: operations per round (about ``--snapshot-mb`` of plaintext).
    """

    ranks: int
    state: JobState
    inputs: int
    plain: bytes
    sealed: bytes
    header: bytes
    nonce: bytes
    ciphertext: bytes
    signed: bytes
    signature: bytes
    reps: int


class Sealer:
    """``seal`` and ``open_snapshot`` with the daemon's keys and configuration, as the daemon's
    snapshot writer and loader call them (a fresh ``os.urandom`` nonce per snapshot)."""

    def __init__(self, keys: DaemonKeys, config: MachineConfig) -> None:
        self.keys = keys
        self.config = config
        self.fold_config = fold_config_id(config)
        self.version = version("trainguard")

    def seal(self, state: JobState, offset: int) -> bytes:
        """The snapshot of ``state`` at partition 0, ``offset`` (a round of one job)."""
        keys = self.keys
        return seal(
            state,
            Round.of(0, offset, [state.job_id]),
            signing_kid=keys.signing_kid,
            signing_key=keys.signing,
            data_kid=keys.data_kid,
            data_key=keys.data[keys.data_kid],
            nonce=os.urandom(NONCE_BYTES),
            config=self.config,
            version=self.version,
        )

    def open(self, sealed: bytes) -> JobState:
        """The state in snapshot ``sealed``, verified and decrypted."""
        _, state = open_snapshot(
            sealed, self.keys.verify, self.keys.data, JOB, fold_config=self.fold_config
        )
        return state


def snapshot_case(
    ranks: int, sealer: Sealer, config: MachineConfig, budget_bytes: float
) -> SnapshotCase:
    """Build the state of a ``ranks``-rank job and cut its snapshot into its parts (the layout
    of :mod:`trainguard.daemon.service._snapshot_envelope`'s docstring)."""
    state, inputs = running_state(ranks, config)
    plain = encode_state(state)
    sealed = sealer.seal(state, inputs)
    (header_len,) = struct.unpack_from(">I", sealed)
    body = 4 + header_len
    return SnapshotCase(
        ranks=ranks,
        state=state,
        inputs=inputs,
        plain=plain,
        sealed=sealed,
        header=sealed[4:body],
        nonce=sealed[body : body + NONCE_BYTES],
        ciphertext=sealed[body + NONCE_BYTES : -64],
        signed=SIGNING_CONTEXT + sealed[:-64],
        signature=sealed[-64:],
        reps=max(3, math.ceil(budget_bytes / len(plain))),
    )


def bench_snapshots(figures: Figures, cases: Iterable[SnapshotCase], sealer: Sealer) -> None:
    """One round of every snapshot measurement (module docstring)."""
    keys = sealer.keys
    aes = AESGCM(keys.data[keys.data_kid])  # built once: the bare cipher, no key schedule per call
    for case in cases:
        bench_snapshot(figures, case, sealer, aes)


def bench_snapshot(figures: Figures, case: SnapshotCase, sealer: Sealer, aes: AESGCM) -> None:
    """One round of ``case``: seal and open, and each of their parts alone."""
    public, private = sealer.keys.verify[sealer.keys.signing_kid], sealer.keys.signing
    n, name = case.reps, f"snapshot/{case.ranks}"
    figures.measure(f"{name}/seal", lambda s: sealer.seal(s, case.inputs), repeat(case.state, n))
    figures.measure(f"{name}/encode_state", encode_state, repeat(case.state, n))
    figures.measure(
        f"{name}/aes_encrypt",
        lambda p: aes.encrypt(case.nonce, p, case.header),
        repeat(case.plain, n),
    )
    figures.measure(f"{name}/ed25519_sign", private.sign, repeat(case.signed, n))
    figures.measure(f"{name}/open", sealer.open, repeat(case.sealed, n))
    figures.measure(f"{name}/decode_state", decode_state, repeat(case.plain, n))
    figures.measure(
        f"{name}/aes_decrypt",
        lambda c: aes.decrypt(case.nonce, c, case.header),
        repeat(case.ciphertext, n),
    )
    figures.measure(
        f"{name}/ed25519_verify",
        lambda m: public.verify(case.signature, m),
        repeat(case.signed, n),
    )


# ------------------------------------------------------------------------ commands and events


@dataclass(frozen=True)
class Signed:
    """A command and what its authentication works on.

    Attributes:
        label: how the tables name it.
        message: the command, unsigned.
        canonical: its canonical bytes (what the signature covers).
        wire: its encoding, signed (what an agent receives).
        signature: the raw 64-byte signature.
    """

    label: str
    message: Restore | Resume
    canonical: bytes
    wire: bytes
    signature: bytes


def signed(label: str, message: Restore | Resume, keys: DaemonKeys) -> Signed:
    """``message`` signed with ``keys``' current signing key, in the forms the benchmark times."""
    canonical = canonical_bytes(message)
    return Signed(
        label,
        message,
        canonical,
        encode(sign(message, keys.signing_kid, keys.signing)),
        keys.signing.sign(canonical),
    )


def commands(manifest: Manifest, config: MachineConfig, keys: DaemonKeys) -> list[Signed]:
    """A Restore to ``manifest`` (the fold's first committed checkpoint: 64 shards; named by
    reference, as since ``restore/2``) and the Resume that follows it, as the daemon issues
    them."""
    restore = Restore(
        job_id=JOB,
        generation=manifest.generation + 1,
        ts=manifest.ts + S,
        seq=1,
        daemon_id=config.daemon_id,
        incident_id=f"{JOB}/g{manifest.generation}/i1",
        reason="rank 17 exited (signal 9)",
        target=snapshot_ref(manifest),
    )
    resume = Resume(
        job_id=JOB,
        generation=restore.generation,
        ts=restore.ts + 30 * S,
        seq=2,
        daemon_id=config.daemon_id,
        step=manifest.step,
    )
    return [
        signed(f"Restore ({len(manifest.shards)}-shard target)", restore, keys),
        signed("Resume", resume, keys),
    ]


def bench_messages(
    figures: Figures,
    cases: Sequence[Signed],
    heartbeat: Heartbeat,
    keys: DaemonKeys,
    reps: int,
) -> None:
    """One round of the per-message measurements (module docstring); ``reps`` calls each
    (ten times as many for the heartbeat, whose operations take microseconds)."""
    for case in cases:
        bench_command(figures, case, keys, reps)
    bench_heartbeat(figures, heartbeat, keys, 10 * reps)


def bench_command(figures: Figures, case: Signed, keys: DaemonKeys, reps: int) -> None:
    """One round of signing and verifying ``case``, the bare primitive, and the codec."""
    kid, public, private = keys.signing_kid, keys.verify[keys.signing_kid], keys.signing
    name, kind = f"message/{case.label}", type(case.message)
    figures.measure(f"{name}/sign", lambda m: sign(m, kid, private), repeat(case.message, reps))
    figures.measure(f"{name}/bare_sign", private.sign, repeat(case.canonical, reps))
    figures.measure(f"{name}/encode", encode, repeat(case.message, reps))
    figures.measure(
        f"{name}/verify", lambda w: verify_signature(w, keys.verify), repeat(case.wire, reps)
    )
    figures.measure(
        f"{name}/bare_verify",
        lambda c: public.verify(case.signature, c),
        repeat(case.canonical, reps),
    )
    figures.measure(f"{name}/decode", lambda w: decode(w, expect=kind), repeat(case.wire, reps))


def bench_heartbeat(figures: Figures, heartbeat: Heartbeat, keys: DaemonKeys, reps: int) -> None:
    """One round of MACing and verifying ``heartbeat``, bare HMAC-SHA256, and the codec."""
    kid, key = _event_key(keys)
    accepted = {kid: key}
    canonical = canonical_bytes(heartbeat)
    wire = encode(add_mac(heartbeat, kid, key))
    tag = hmac.digest(key, canonical, "sha256")
    name = "message/Heartbeat"
    figures.measure(f"{name}/sign", lambda m: add_mac(m, kid, key), repeat(heartbeat, reps))
    figures.measure(
        f"{name}/bare_sign", lambda c: hmac.digest(key, c, "sha256"), repeat(canonical, reps)
    )
    figures.measure(f"{name}/encode", encode, repeat(heartbeat, reps))
    figures.measure(f"{name}/verify", lambda w: verify_mac(w, accepted), repeat(wire, reps))
    figures.measure(
        f"{name}/bare_verify",
        lambda c: hmac.compare_digest(hmac.digest(key, c, "sha256"), tag),
        repeat(canonical, reps),
    )
    figures.measure(f"{name}/decode", lambda w: decode(w, expect=Heartbeat), repeat(wire, reps))


def _event_key(keys: DaemonKeys) -> tuple[str, bytes]:
    current = keys.current_event_key(JOB)
    if current is None:
        raise RuntimeError(f"the key directory holds no event key of {JOB!r}")
    return current


# ------------------------------------------------------------------------------------- fold


class FullPath:
    """An :class:`EventAuth` without the MAC check on raw bytes: intake decodes every record
    whole, then :meth:`EventAuth.refuse` judges it (the path records of other layouts, and
    records failing the raw-bytes check, take; the only one before it existed)."""

    def __init__(self, auth: EventAuth) -> None:
        self.auth = auth

    def refuse(
        self, record: RawRecord, message: Event | ClockTick
    ) -> tuple[AuthRefusal, str] | None:
        """:meth:`EventAuth.refuse`."""
        return self.auth.refuse(record, message)

    def mac_keys(self, record: RawRecord) -> None:
        """``None``: no record is judged on its raw bytes."""
        return None


def fold(records: Iterable[Record], auth: Authenticator, config: MachineConfig) -> JobState:
    """Take in and fold ``records`` as ``DaemonService._process`` does, without a bus.

    Raises:
        RuntimeError: a record was refused (the workload must be authentic throughout).
    """
    state = new_job(JOB)
    for record in records:
        taken = take(record, auth)
        if isinstance(taken, Refused):
            raise RuntimeError(f"record {record.offset} refused: {taken.reason}")
        state, _ = decide(state, taken.input, config)
    return state


FOLD_VARIANTS = ("off", "on", "full", "context")
FOLD_LABELS = {
    "off": "off: plain records, daemon without keys",
    "on": "on: MACed records, daemon with the job's event key",
    "full": "full path: as on, every record decoded whole, then EventAuth.refuse",
    "context": "context: MACed records, daemon without keys",
}


def bench_fold(
    figures: Figures,
    stream: Stream,
    keys: DaemonKeys,
    config: MachineConfig,
    round_index: int,
) -> dict[str, JobState]:
    """One round of the in-process fold, variants in alternating order; returns each
    variant's final state."""
    setups: dict[str, tuple[list[Record], Authenticator]] = {
        "off": (stream.plain, EventAuth(None, require=False)),
        "on": (stream.maced, EventAuth(keys, require=False)),
        "full": (stream.maced, FullPath(EventAuth(keys, require=False))),
        "context": (stream.maced, EventAuth(None, require=False)),
    }
    order = FOLD_VARIANTS if round_index % 2 == 0 else FOLD_VARIANTS[::-1]
    states: dict[str, JobState] = {}
    for variant in order:
        records, auth = setups[variant]
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        states[variant] = fold(records, auth, config)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        figures.record(f"fold/{variant}", len(records), wall, cpu)
    return states


def bench_components(figures: Figures, stream: Stream, keys: DaemonKeys) -> None:
    """One round of the per-record cost breakdown, on every ``COMPONENT_STRIDE``-th record.

    Raises:
        RuntimeError: a MACed record is not laid out as ``encode`` writes it, or the raw-bytes
            path does not give the message decoding the whole record gives.
    """
    plain_records = stream.plain[::COMPONENT_STRIDE]
    maced_records = stream.maced[::COMPONENT_STRIDE]
    plain = [r.value or b"" for r in plain_records]
    maced = [r.value or b"" for r in maced_records]
    cut = [split_mac(v) for v in maced]
    raws = [r for r in cut if r is not None]
    decoded = [cast("Event | ClockTick", decode(v, expect=EVENTS_TOPIC_TYPES)) for v in maced]
    if len(raws) < len(cut) or any(
        decode_maced(r) != m for r, m in zip(raws, decoded, strict=True)
    ):
        raise RuntimeError("the raw-bytes path does not take the records as decode does")
    kid, key = _event_key(keys)
    accepted = {kid: key}
    with_keys, without = EventAuth(keys, require=False), EventAuth(None, require=False)
    full = FullPath(EventAuth(keys, require=False))
    figures.measure("part/take_plain", lambda r: take(r, without), plain_records)
    figures.measure("part/take_maced", lambda r: take(r, with_keys), maced_records)
    figures.measure("part/split_mac", split_mac, maced)
    figures.measure("part/mac_keys", with_keys.mac_keys, maced_records)
    figures.measure("part/verify_raw_mac", lambda r: verify_raw_mac(r, accepted), raws)
    figures.measure("part/hmac", lambda r: hmac.digest(key, r.canonical, "sha256"), raws)
    figures.measure("part/decode_plain", lambda v: decode(v, expect=EVENTS_TOPIC_TYPES), plain)
    # decode_maced consumes what split_mac parsed: measured together, split_mac subtracted.
    figures.measure(
        "part/split_decode", lambda v: decode_maced(cast("RawMac", split_mac(v))), maced
    )
    figures.measure("part/take_full", lambda r: take(r, full), maced_records)
    figures.measure("part/decode_whole", lambda v: decode(v, expect=EVENTS_TOPIC_TYPES), maced)
    figures.measure(
        "part/refuse",
        lambda t: with_keys.refuse(*t),
        list(zip(maced_records, decoded, strict=True)),
    )


# ---------------------------------------------------------------------------- embedded bus


async def fill_bus(url: str, records: Sequence[Record]) -> None:
    """Write ``records`` onto the ``events`` topic of the embedded bus at ``url`` with their
    append times (as ``trainguard import`` does)."""
    async with open_bus(BusConfig(url=url, prefix=PREFIX, topics=DEFAULT_TOPICS)) as bus:
        if not isinstance(bus, SQLiteBus):
            raise RuntimeError(f"{url} is not an embedded bus")
        await bus.import_records("events", [(JOB, r.value, r.timestamp_ms) for r in records])


async def run_service(
    url: str, group: str, keys: DaemonKeys | None, config: MachineConfig, records: int
) -> tuple[int, float, float, JobState]:
    """Run a ``DaemonService`` on the bus at ``url`` until it has folded ``records`` records;
    return the records folded between its first batch and the end, the wall and CPU seconds
    that took, and the job's final state.

    Raises:
        RuntimeError: the service stopped before folding every record.
    """
    settings = DaemonConfig(
        bus=BusConfig(url=url, prefix=PREFIX, topics=DEFAULT_TOPICS),
        machine=config,
        group_id=group,
        metrics_port=-1,
        snapshot_interval_s=0,
    )
    # A frozen clock: no deadline ever passes, so the service writes no tick of its own.
    service = DaemonService(settings, clock=lambda: 0, keys=keys)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    started = (0, time.perf_counter(), time.process_time())
    first: tuple[int, float, float] | None = None
    try:
        while (folded := service.counters["folded"]) < records:
            if task.done():
                task.result()
                raise RuntimeError(f"the daemon stopped after {folded} of {records} records")
            if first is None and folded > 0:
                first = (folded, time.perf_counter(), time.process_time())
            await asyncio.sleep(0.002)
        wall, cpu = time.perf_counter(), time.process_time()
    finally:
        stop.set()
        await task
    # From the first batch seen folded (from the start if none was seen before the end).
    done, wall0, cpu0 = first or started
    return records - done, wall - wall0, cpu - cpu0, service.jobs[JOB]


async def bench_bus(
    figures: Figures,
    stream: Stream,
    keys: DaemonKeys,
    config: MachineConfig,
    folder: Path,
    rounds: int,
    reference: JobState,
) -> list[str]:
    """Every round of the ``DaemonService`` fold (off and on, alternating); returns the runs
    whose final job state differs from ``reference``."""
    urls = {"off": f"sqlite://{folder / 'off.db'}", "on": f"sqlite://{folder / 'on.db'}"}
    await fill_bus(urls["off"], stream.plain)
    await fill_bus(urls["on"], stream.maced)
    differ: list[str] = []
    for r in range(rounds):
        for variant in ("off", "on") if r % 2 == 0 else ("on", "off"):
            gc.collect()
            folded, wall, cpu, state = await run_service(
                urls[variant],
                f"bench-{variant}-{r}",
                keys if variant == "on" else None,
                config,
                len(stream.plain),
            )
            figures.record(f"bus/{variant}", folded, wall, cpu)
            if state != reference:
                differ.append(f"DaemonService {variant}, round {r + 1}")
    return differ


# ------------------------------------------------------------------------------------ report


def _ms(figures: Figures, name: str) -> float:
    return figures.us(name) / 1000


def _share(part: float, total: float) -> str:
    return f"{part:.2f} ({part / total:.0%})"


def _kb(size: int) -> str:
    return f"{size / 1000:,.1f} kB"


def snapshot_tables(report: Report, figures: Figures, cases: Sequence[SnapshotCase]) -> None:
    """Throughput of seal and open next to the bare primitives, and their time split."""
    rows: list[list[str]] = []
    split: list[list[str]] = []
    for case in cases:
        name, size = f"snapshot/{case.ranks}", len(case.plain)

        def rate(op: str) -> float:
            return size / MB / (figures.us(f"{name}/{op}") / 1e6)  # noqa: B023 (used at once)

        rows.append(
            [
                f"{case.ranks} ranks",
                _kb(size),
                f"{rate('seal'):,.1f}",
                f"{rate('open'):,.1f}",
                f"{rate('aes_encrypt'):,.0f} / {rate('aes_decrypt'):,.0f}",
                f"{rate('ed25519_sign'):,.0f} / {rate('ed25519_verify'):,.0f}",
                f"{_ms(figures, f'{name}/seal'):.2f} / {_ms(figures, f'{name}/open'):.2f}",
                f"{size / figures[f'{name}/seal'].wall_us:,.1f} / "
                f"{size / figures[f'{name}/open'].wall_us:,.1f}",
                f"{max(figures[f'{name}/seal'].spread, figures[f'{name}/open'].spread):.0%}",
            ]
        )
        for op, codec, aes, ed in (
            ("seal", "encode_state", "aes_encrypt", "ed25519_sign"),
            ("open", "decode_state", "aes_decrypt", "ed25519_verify"),
        ):
            total = _ms(figures, f"{name}/{op}")
            parts = [_ms(figures, f"{name}/{p}") for p in (codec, aes, ed)]
            split.append(
                [
                    f"{case.ranks} ranks, {op}",
                    f"{total:.2f}",
                    *(_share(p, total) for p in parts),
                    _share(total - sum(parts), total),
                ]
            )
    report.tables.append(
        (
            "Snapshots: seal (sign + encrypt) and open (verify + decrypt), MB of plaintext state "
            "per CPU-second, next to the bare primitives on the same bytes",
            [
                "state",
                "plaintext",
                "seal MB/s",
                "open MB/s",
                "bare AES-256-GCM enc / dec MB/s",
                "bare Ed25519 sign / verify MB/s",
                "seal / open CPU ms",
                "seal / open MB/s wall",
                "spread",
            ],
            rows,
        )
    )
    report.tables.append(
        (
            "Snapshots: where the time goes (CPU ms per snapshot, share of seal or open; each "
            "part measured alone, so a negative 'other' is measurement noise)",
            ["snapshot", "total ms", "state codec", "AES-256-GCM", "Ed25519", "other"],
            split,
        )
    )


def message_table(
    report: Report, figures: Figures, cases: Sequence[Signed], heartbeat: Heartbeat
) -> None:
    """Per-message sign / verify and MAC costs next to the bare primitives."""
    rows: list[list[str]] = []
    ed25519 = ("sign()", "Ed25519 sign", "verify_signature()", "Ed25519 verify")
    messages = [(c.label, len(c.canonical), ed25519) for c in cases]
    hmac_ops = ("add_mac()", "HMAC-SHA256", "verify_mac()", "HMAC-SHA256 + compare")
    messages.append(("Heartbeat", len(canonical_bytes(heartbeat)), hmac_ops))
    for label, size, (sign_op, bare_sign, verify_op, bare_verify) in messages:
        name = f"message/{label}"
        for op, bare_op, ours, codec in (
            (sign_op, bare_sign, "sign", "encode"),
            (verify_op, bare_verify, "verify", "decode"),
        ):
            us, bare_us = figures.us(f"{name}/{ours}"), figures.us(f"{name}/bare_{ours}")
            rows.append(
                [
                    label,
                    f"{size:,}",
                    op,
                    f"{us:.1f}",
                    f"{bare_op}: {bare_us:.1f}",
                    f"{us - bare_us:.1f}",
                    f"{codec}: {figures.us(f'{name}/{codec}'):.1f}",
                    f"{figures[f'{name}/{ours}'].spread:.0%}",
                ]
            )
    report.tables.append(
        (
            "Commands and events: authentication per message (CPU us), next to the bare "
            "primitive on the same canonical bytes; the codec as context",
            [
                "message",
                "canonical bytes",
                "operation",
                "ours us",
                "bare primitive us",
                "ours - bare us",
                "context: codec us",
                "spread",
            ],
            rows,
        )
    )


def fold_table(report: Report, figures: Figures, stream: Stream) -> str:
    """The end-to-end fold rates, with the verdict; returns the verdict line."""
    rows: list[list[str]] = []
    verdict = ""
    for section, label in (("fold", "in process: take + decide"), ("bus", "DaemonService")):
        off = figures.get(f"{section}/off")
        if off is None:
            continue
        for variant in FOLD_VARIANTS:
            figure = figures.get(f"{section}/{variant}")
            if figure is None:
                continue
            ratio = off.cpu_us / figure.cpu_us
            judged = variant == "on"
            ok = ratio >= TARGET_RATIO
            rows.append(
                [
                    f"{label}, {FOLD_LABELS[variant]}",
                    f"{figure.ops:,}",
                    f"{1e6 / figure.cpu_us:,.0f}",
                    f"{figure.cpu_us:.1f}",
                    f"{1e6 / figure.wall_us:,.0f}",
                    f"{figure.spread:.0%}",
                    f"{ratio:.0%}",
                    f">= {TARGET_RATIO:.0%}" if judged else "",
                    ("PASS" if ok else "FAIL") if judged else "",
                ]
            )
            if judged and section == "fold":
                verdict = (
                    f"Verdict: with authentication the daemon folds at {ratio:.0%} of its rate "
                    f"without (CPU time, in process): authentication costs "
                    f"{1 - ratio:.0%} of the rate, target <= {1 - TARGET_RATIO:.0%}: "
                    f"{'PASS' if ok else 'FAIL'}."
                )
    mix = ", ".join(f"{n:,} {kind}" for kind, n in sorted(stream.mix.items(), key=lambda x: -x[1]))
    plain = sum(len(r.value or b"") for r in stream.plain) / len(stream.plain)
    maced = sum(len(r.value or b"") for r in stream.maced) / len(stream.maced)
    report.tables.append(
        (
            f"End-to-end fold of one {FOLD_RANKS}-rank job ({mix}; {plain:.0f} bytes a record "
            f"plain, {maced:.0f} MACed): authentication off vs on",
            [
                "path",
                "records",
                "records/CPU-s",
                "CPU us/record",
                "records/s wall",
                "spread",
                "rate vs off (CPU)",
                "target",
                "verdict",
            ],
            rows,
        )
    )
    return verdict


def component_table(report: Report, figures: Figures) -> None:
    """Where authentication's per-record time goes, on the raw-bytes path and on the full one."""
    us = {n.removeprefix("part/"): f.cpu_us for n, f in figures.items() if n.startswith("part/")}
    added = us["take_maced"] - us["take_plain"]
    mac_set = us["split_decode"] - us["split_mac"] - us["decode_plain"]
    parts = us["split_mac"] + us["mac_keys"] + us["verify_raw_mac"] + mac_set
    full = us["take_full"] - us["take_plain"]
    off = figures.us("fold/off")
    rows = [
        ["take, plain record, daemon without keys", f"{us['take_plain']:.2f}", "decode, job check"],
        [
            "take, MACed record, daemon with the key",
            f"{us['take_maced']:.2f}",
            "MAC on the raw bytes, then decode_maced",
        ],
        ["authentication per record", f"{added:.2f}", "the difference"],
        [
            "  split_mac",
            f"{us['split_mac']:.2f}",
            "layout; canonical check: orjson.loads, orjson.dumps sorted",
        ],
        ["  EventAuth.mac_keys", f"{us['mac_keys']:.2f}", "the job's keys (cached)"],
        [
            "  verify_raw_mac",
            f"{us['verify_raw_mac']:.2f}",
            "base64, HMAC-SHA256 from the keyed state, compare",
        ],
        [
            "    context: one-shot hmac.digest",
            f"{us['hmac']:.2f}",
            "the same HMAC, keyed anew (as verify_mac)",
        ],
        [
            "  decode_maced - decode of a plain record",
            f"{mac_set:.2f}",
            "no parse (split_mac's object); Mac set",
        ],
        ["  rest", f"{added - parts:.2f}", "calls, take's own"],
        ["fold without authentication", f"{off:.2f}", "from the fold table"],
        [
            "predicted rate with / without",
            f"{off / (off + added):.0%}",
            f"fold table: {off / figures.us('fold/on'):.0%} (parts alone run in tight loops)",
        ],
        [
            "full path: take, MACed record",
            f"{us['take_full']:.2f}",
            "other layouts, failed checks: decode whole, refuse",
        ],
        ["  authentication per record", f"{full:.2f}", "take_full - take of a plain record"],
        [
            "    decode of the whole MACed record",
            f"{us['decode_whole'] - us['decode_plain']:.2f}",
            "minus decode of a plain record: the auth member",
        ],
        ["    EventAuth.refuse", f"{us['refuse']:.2f}", "keys, verify_mac (parse, dumps, HMAC)"],
        ["  predicted rate with / without", f"{off / (off + full):.0%}", ""],
    ]
    report.tables.append(
        (
            f"Where authentication's time goes per record (CPU us, every {COMPONENT_STRIDE}th "
            "record of the fold's workload)",
            ["part", "us/record", "what"],
            rows,
        )
    )


def write_json(path: Path, report: Report, figures: Figures) -> None:
    """Write the notes, the tables and every figure (per-round seconds) to ``path``."""
    data = {
        "notes": report.notes,
        "tables": [
            {"title": title, "header": header, "rows": rows}
            for title, header, rows in report.tables
        ],
        "figures": {
            name: dataclasses.asdict(f) | {"cpu_us": f.cpu_us, "wall_us": f.wall_us}
            for name, f in figures.items()
        },
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


# -------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        description="Authentication cost: snapshots, commands, events and the daemon's fold."
    )
    parser.add_argument(
        "--events", type=int, default=200_000, help="heartbeats of the fold's job (200000)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the best counts (3)")
    parser.add_argument(
        "--snapshot-mb",
        type=float,
        default=16.0,
        help="MB of plaintext state each snapshot operation handles per round (16)",
    )
    parser.add_argument(
        "--message-reps", type=int, default=2000, help="calls per command operation (2000)"
    )
    parser.add_argument("--no-bus", action="store_true", help="skip the DaemonService rows")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--json", type=Path, help="also write the figures to this JSON file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its tables; returns 0."""
    args = parse_args(argv)
    console = Console(width=max(Console().width, 160), stderr=True)
    configure_logging(level=logging.WARNING)  # the service's warnings, on stderr

    def say(text: str) -> None:
        console.print(text, highlight=False, markup=False)

    report, figures = Report(notes=machine_notes()), Figures()
    config = MachineConfig(daemon_id="bench-crypto")
    with tempfile.TemporaryDirectory(prefix="crypto-bench-") as tmp:
        folder = Path(tmp)
        keys = daemon_keys(folder / "keys")
        say(f"generating {args.events:,} heartbeats of a {FOLD_RANKS}-rank job ...")
        stream = fold_stream(args.events, config, _event_key(keys))
        sealer = Sealer(keys, config)
        say("building the snapshot states ...")
        cases = [snapshot_case(r, sealer, config, args.snapshot_mb * MB) for r in SNAPSHOT_RANKS]
        messages = commands(stream.manifest, config, keys)
        heartbeat = next(
            m
            for r in stream.plain
            if isinstance(m := decode(r.value or b"", expect=EVENTS_TOPIC_TYPES), Heartbeat)
            and m.loss is not None
        )
        states: dict[str, JobState] = {}
        for r in range(args.rounds):
            load = os.getloadavg()
            report.notes.append(f"round {r + 1}: load average at start {load[0]:.2f}")
            say(f"round {r + 1} of {args.rounds} (load {load[0]:.2f}) ...")
            bench_snapshots(figures, cases, sealer)
            bench_messages(figures, messages, heartbeat, keys, args.message_reps)
            states = bench_fold(figures, stream, keys, config, r)
            bench_components(figures, stream, keys)
        differ = [f"in process {v}" for v, state in states.items() if state != states["off"]]
        if not args.no_bus:
            say("DaemonService on an embedded bus ...")
            differ += asyncio.run(
                bench_bus(figures, stream, keys, config, folder, args.rounds, states["off"])
            )
    report.notes.append(
        f"job states that differ from the in-process fold without authentication: {differ}"
        if differ
        else "every fold (in process and DaemonService, authentication off and on) ended in "
        "the same job state"
    )
    report.notes.append(
        f"best of {args.rounds} rounds; snapshot states folded from simulated jobs of "
        f"{SNAPSHOT_STEPS} steps ({', '.join(f'{c.ranks} ranks: {c.inputs:,} inputs' for c in cases)})"
    )
    snapshot_tables(report, figures, cases)
    message_table(report, figures, messages, heartbeat)
    verdict = fold_table(report, figures, stream)
    component_table(report, figures)
    report.notes.append(verdict)
    print_report(report, args.markdown, Console(width=max(Console().width, 160)))
    if args.json:
        write_json(args.json, report, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
