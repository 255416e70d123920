"""Run a real job under trainguard, with failures injected, and read back what happened.

Used by ``trainguard demo``, the scenario tests and the recovery benchmark. Everything runs as
separate OS processes, exactly as in production: a ``trainguard daemon``, a ``trainguard run``
supervisor, and the workers it starts; faults are injected inside the workers through
``TRAINGUARD_FAULTS`` (see :mod:`trainguard.agent.faults._plan`). The job is usually the repository's
``examples/charlm`` (:func:`charlm_command`, :func:`charlm_env`), judged against an
uninterrupted :func:`reference_run`; :func:`follow_job` watches a job live, and
:func:`read_job_record` reads back everything the bus holds about it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from trainguard.agent.bus import (
    DEFAULT_TOPICS,
    Bus,
    BusConfig,
    Record,
    TopicPartition,
    open_bus,
    partition_for,
    sqlite_url,
)
from trainguard.schemas import (
    Abort,
    Command,
    Heartbeat,
    Lifecycle,
    Restore,
    Resume,
    SchemaError,
    decode,
)

__all__ = [
    "JOB_TOPICS",
    "JobRecord",
    "Stamped",
    "charlm_command",
    "charlm_env",
    "follow_job",
    "read_job_record",
    "reference_run",
    "start_daemon",
    "stop_process",
    "supervise",
    "wait_all",
]

#: The job's topics :func:`follow_job` and :func:`read_job_record` read, all keyed by job id.
JOB_TOPICS = ("events", "commands", "manifests", "audit")

# -P (Python 3.11+, PYTHONSAFEPATH): no working folder on sys.path. Run from a clone's parent
# folder, that folder's ``trainguard/`` (the clone: no __init__.py) would join the trainguard
# namespace package and hide the installed ``trainguard.agent``.
_CLI = [sys.executable, "-P", "-m", "trainguard.daemon.cli"]


def start_daemon(
    bus_url: str,
    *,
    prefix: str,
    log_path: Path,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``trainguard daemon`` in its own process group; its JSON log goes to ``log_path``.

    Its ``/metrics`` server binds a free port (logged), so that rehearsals can run side by side
    and next to a daemon on the default port; ``args`` may choose another.
    """
    log = log_path.open("ab")
    return subprocess.Popen(
        [*_CLI, "daemon", "--bus", bus_url, "--topic-prefix", prefix, "--metrics-port", "0", *args],
        stdout=log,
        stderr=log,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def supervise(
    job_id: str,
    command: Sequence[str],
    *,
    bus_url: str,
    prefix: str,
    nproc_per_node: int,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    grace_s: float = 5.0,
    args: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """Start ``trainguard run --nproc-per-node N [args] -- command`` (the node's supervisor)."""
    log = log_path.open("ab")
    return subprocess.Popen(
        [
            *_CLI,
            "run",
            "--job",
            job_id,
            "--bus",
            bus_url,
            "--topic-prefix",
            prefix,
            "--nproc-per-node",
            str(nproc_per_node),
            "--grace",
            str(grace_s),
            *args,
            "--",
            *command,
        ],
        stdout=log,
        stderr=log,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def handed_off_pids(log_path: Path) -> frozenset[int]:
    """The pids of the warm spares a supervisor handed off (its log's ``spare handed off``
    entries, JSON lines; ``trainguard run --warm``, ``docs/warm-restarts.md``); lines that are
    no such entry (a worker's own output) are skipped."""
    pids = set()
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(entry, dict) and entry.get("event") == "spare handed off":
            pids.add(int(entry["pid"]))
    return frozenset(pids)


def stop_process(
    proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 30
) -> int:
    """Send ``sig`` to the process's group, wait, SIGKILL after ``timeout_s``; return its code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.wait()


def charlm_command(
    out: Path, *, steps: int, checkpoint_every: int, seed: int, extra: Sequence[str] = ()
) -> list[str]:
    """The worker command of the ``examples/charlm`` job writing to ``out``, with ``extra``
    options of ``examples/charlm/train.py`` (``--step-sleep``, ``--eval-every``, ...); run it
    with :func:`charlm_env`, whose ``PYTHONPATH`` finds ``examples`` from any folder."""
    return [
        sys.executable,
        "-m",
        "examples.charlm.train",
        "--steps",
        str(steps),
        "--checkpoint-every",
        str(checkpoint_every),
        "--seed",
        str(seed),
        "--out",
        str(out),
        *extra,
    ]


def charlm_env(
    out: Path,
    repo: Path,
    *,
    faults: str = "",
    heartbeat_interval_s: float = 0.5,
    checksum_every: int | None = None,
) -> dict[str, str]:
    """Worker environment for :func:`charlm_command`: shards under ``out/checkpoints`` (the
    fault markers too, so a fault fires once per job), heartbeats every
    ``heartbeat_interval_s`` seconds, ``faults`` as ``TRAINGUARD_FAULTS``, parameter checksums
    every ``checksum_every`` steps (``None``: the agent's default), ``repo`` (the folder
    holding ``examples/``) on ``PYTHONPATH`` and, as ``PYTHONSAFEPATH``, not the working
    folder (see ``_CLI``: the workers import trainguard too)."""
    env = {
        "TRAINGUARD_CHECKPOINT_DIR": str(out / "checkpoints"),
        "TRAINGUARD_HEARTBEAT_INTERVAL": str(heartbeat_interval_s),
        "TRAINGUARD_FAULTS": faults,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(repo),
        "PYTHONSAFEPATH": "1",
    }
    if checksum_every is not None:
        env["TRAINGUARD_CHECKSUM_EVERY"] = str(checksum_every)
    return env


def _reference_key(
    repo: Path,
    steps: int,
    checkpoint_every: int,
    seed: int,
    world_size: int,
    extra: Sequence[str],
) -> str:
    """Cache key of a reference run: everything that decides its bytes. The example's and the
    agent's sources (the model, the loop, the sampler's data order, the gradient all-reduce),
    the training data (charlm's corpus is the interpreter's standard library:
    ``examples/charlm/data.py``), the arguments (steps, checkpoint interval, seed, world
    size, and ``extra``: e.g. the skipped steps), and what computes the floats (torch's
    version and build, the CPU kernels it picked). Faults and ``--step-sleep`` never reach a
    reference run; the world size decides the batches and the sum of the gradients."""
    import torch

    import trainguard.agent

    h = hashlib.sha256()
    agent = Path(trainguard.agent.__file__).parent
    for path in [
        *sorted((repo / "examples" / "charlm").glob("*.py")),
        *sorted(agent.rglob("*.py")),
        *sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")),
    ]:
        h.update(path.read_bytes())
    machine = f"{platform.machine()}:{torch.backends.cpu.get_cpu_capability()}"
    h.update(
        f"{steps}:{checkpoint_every}:{seed}:{world_size}:{list(extra)}:{torch.__version__}:"
        f"{machine}".encode()
    )
    return h.hexdigest()[:16]


def reference_run(
    repo: Path,
    cache: Path,
    *,
    steps: int,
    checkpoint_every: int,
    seed: int,
    world_size: int = 2,
    extra: Sequence[str] = (),
    timeout_s: float = 600,
    keep: int | None = None,
) -> Path:
    """Run the ``examples/charlm`` job without faults (and without a daemon: the agents only
    publish) under ``cache``, with ``extra`` options of its ``train.py`` (e.g.
    ``--skip-steps``), or reuse such a run; return its output folder,
    ``cache/reference-<key>``.

    A finished run (one with ``final.sha256``) is reused when everything that decides its
    bytes is the same (sources, data, arguments, world size, torch and CPU kernels: see
    ``_reference_key``). The folder holds
    ``final.sha256`` and ``ledger-rank-*.jsonl`` to compare an interrupted run with,
    ``supervisor.log``, and the run's checkpoints (tens of MB). With ``keep``, only the
    ``keep`` most recently used runs stay in ``cache`` (the others are deleted), so that a
    cache shared by runs of changing arguments stays bounded.

    Raises:
        RuntimeError: the run failed (see its ``supervisor.log``).
        TimeoutError: it took longer than ``timeout_s`` seconds.
    """
    key = _reference_key(repo, steps, checkpoint_every, seed, world_size, extra)
    out = cache / f"reference-{key}"
    if (out / "final.sha256").is_file():
        out.touch()  # most recently used: the last to be pruned
        if keep is not None:
            _prune(cache, keep)
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    sup = supervise(
        "reference",
        charlm_command(out, steps=steps, checkpoint_every=checkpoint_every, seed=seed, extra=extra),
        bus_url=sqlite_url(out / "bus.db"),
        prefix="ref.",
        nproc_per_node=world_size,
        log_path=out / "supervisor.log",
        env=charlm_env(out, repo),
        args=("--daemon-timeout", "0"),  # no daemon on purpose: no warning about it
    )
    try:
        code = sup.wait(timeout_s)
    except subprocess.TimeoutExpired as exc:
        stop_process(sup, signal.SIGKILL)
        raise TimeoutError(f"the reference run took over {timeout_s} s; see {out}") from exc
    if code != 0:
        raise RuntimeError(f"the reference run failed ({code}); see {out / 'supervisor.log'}")
    if keep is not None:
        _prune(cache, keep)
    return out


def _prune(cache: Path, keep: int) -> None:
    """Delete all but the ``keep`` most recently used (modified) reference runs in ``cache``."""
    runs = sorted(
        (p for p in cache.glob("reference-*") if p.is_dir()),
        key=lambda p: p.stat().st_mtime_ns,
        reverse=True,
    )
    for old in runs[keep:]:
        shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class Stamped:
    """A record of one of the job's topics with its bus append time (ms since the Unix epoch).

    ``message`` is the decoded message (event, command, or :class:`~trainguard.schemas.Manifest`), or for
    ``audit`` the entry as a dict (``{"offset": ..., "decisions": [...]}``).
    """

    at_ms: int
    message: Any


@dataclass
class JobRecord:
    """Everything the bus holds about one job, in bus order per topic.

    Attributes:
        events: the job's events (``ClockTick`` records included), decoded.
        commands: the job's records on ``commands`` still on the bus (a compacted topic: the
            commands the daemon issued are :meth:`issued`).
        manifests: the snapshots the daemon committed (a re-derived commit can repeat one).
        audit: the daemon's decisions (``{"offset": ..., "decisions": [...]}`` dicts).
        rejected: records of the job that did not decode.
    """

    events: list[Stamped] = field(default_factory=list)
    commands: list[Stamped] = field(default_factory=list)
    manifests: list[Stamped] = field(default_factory=list)
    audit: list[dict[str, Any]] = field(default_factory=list)
    rejected: int = 0

    def issued(self) -> list[Command]:
        """The commands the daemon issued, in the order it decided them, read from the audit
        trail: ``commands`` is compacted (the embedded bus keeps only a job's latest command
        once it is older than 60 s), the audit trail keeps every decision. Each command counts
        once (by type, generation and ``seq``): a daemon that re-derived its last decisions after a
        restart audits them again, with its own ``daemon_id``.

        Raises:
            SchemaError: an audited command does not decode (a malformed audit trail).
        """
        seen: set[tuple[str, int, int]] = set()
        out: list[Command] = []
        for decision in self.decisions():
            if decision.get("decision") != "issue":
                continue
            command = decode(orjson.dumps(decision["command"]), expect=Command)
            assert isinstance(command, Restore | Resume | Abort)  # expect=Command
            key = (command.SCHEMA.partition("/")[0], command.generation, command.seq)
            if key not in seen:
                seen.add(key)
                out.append(command)
        return out

    def restores(self) -> list[Restore]:
        """The restore commands the daemon issued, in order (:meth:`issued`)."""
        return [c for c in self.issued() if isinstance(c, Restore)]

    def resumes(self) -> list[Resume]:
        """The resume commands the daemon issued, in order (:meth:`issued`)."""
        return [c for c in self.issued() if isinstance(c, Resume)]

    def aborts(self) -> list[Abort]:
        """The abort commands the daemon issued (:meth:`issued`)."""
        return [c for c in self.issued() if isinstance(c, Abort)]

    def first(self, kind: type, **match: Any) -> Stamped | None:
        """The first event or command of ``kind`` whose attributes equal ``match``."""
        for item in (*self.events, *self.commands):
            if isinstance(item.message, kind) and all(
                getattr(item.message, k) == v for k, v in match.items()
            ):
                return item
        return None

    def kills(self) -> list[Lifecycle]:
        """Supervisor reports of workers that died of a signal."""
        return [
            e.message
            for e in self.events
            if isinstance(e.message, Lifecycle)
            and e.message.kind == "exited"
            and e.message.signal is not None
        ]

    def max_step(self, generation: int) -> int:
        """Highest step any rank reported in ``generation`` (heartbeats), or 0."""
        steps = [
            e.message.step
            for e in self.events
            if isinstance(e.message, Heartbeat) and e.message.generation == generation
        ]
        return max(steps, default=0)

    def decisions(self) -> list[dict[str, Any]]:
        """Every decision of the audit trail, flattened, in order."""
        return [d for entry in self.audit for d in entry["decisions"]]


def _decoded(rec: Record) -> Any:
    """The value of one of a job's records: an audit entry as a dict, else the decoded
    message; ``None`` for a tombstone or a value that does not decode."""
    if rec.value is None:
        return None
    if rec.topic == "audit":
        return orjson.loads(rec.value)
    try:
        return decode(rec.value)
    except SchemaError:
        return None


async def read_job_record(bus_url: str, prefix: str, job_id: str) -> JobRecord:
    """Read the job's events, commands, manifests and audit entries from the bus (from
    offset 0 to the end offsets at the time of the call)."""
    record = JobRecord()
    config = BusConfig(url=bus_url, prefix=prefix, topics=DEFAULT_TOPICS, client_id="rehearsal")
    async with open_bus(config) as bus:
        for topic in JOB_TOPICS:
            for rec in await _read_topic(bus, topic):
                if rec.key != job_id or rec.value is None:
                    continue
                value = _decoded(rec)
                if value is None:
                    record.rejected += 1
                elif topic == "audit":
                    record.audit.append(value)
                else:
                    getattr(record, topic).append(Stamped(rec.timestamp_ms, value))
    return record


async def follow_job(
    bus_url: str, prefix: str, job_id: str, *, poll_s: float = 0.2
) -> AsyncGenerator[list[Stamped], None]:
    """Follow a job's records on ``events``, ``commands``, ``manifests`` and ``audit`` live,
    from offset 0: yield one batch per poll of at most ``poll_s`` seconds, ordered by append
    time (one poll mixes topics), possibly empty so that the caller can look at other things
    (a process that ended) between polls. Records of other jobs and undecodable ones are
    skipped. Runs until the caller stops iterating; close it (``contextlib.aclosing``) to
    release the bus at once.
    """
    config = BusConfig(url=bus_url, prefix=prefix, topics=DEFAULT_TOPICS, client_id="follow")
    async with open_bus(config) as bus:
        # The job's topics are co-partitioned: one partition number holds all its records.
        partition = partition_for(job_id, await bus.partitions("events"))
        tps = {TopicPartition(topic, partition): 0 for topic in JOB_TOPICS}
        async with await bus.assign(tps) as consumer:
            while True:
                batch: list[Stamped] = []
                records = await consumer.getmany(timeout_s=poll_s)
                for rec in sorted(records, key=lambda r: r.timestamp_ms):
                    value = _decoded(rec) if rec.key == job_id else None
                    if value is not None:
                        batch.append(Stamped(rec.timestamp_ms, value))
                yield batch


async def _read_topic(bus: Bus, topic: str) -> list[Record]:
    ends = await bus.end_offsets(topic)
    pending = {tp: end for tp, end in ends.items() if end > 0}
    out: list[Record] = []
    if not pending:
        return out
    async with await bus.assign(dict.fromkeys(pending, 0)) as consumer:
        seen = dict.fromkeys(pending, 0)
        deadline = time.monotonic() + 60
        while any(seen[tp] < end for tp, end in pending.items()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} stalled")
            for rec in await consumer.getmany(timeout_s=0.5, max_records=10_000):
                if rec.offset < pending[rec.tp]:
                    out.append(rec)
            for tp in pending:  # past transaction markers, which no record carries
                seen[tp] = max(seen[tp], await consumer.position(tp))
    out.sort(key=lambda r: (r.partition, r.offset))
    return out


def wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Wait for every process; raises ``TimeoutError`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"process {proc.args!r} still running after {timeout_s} s") from exc
