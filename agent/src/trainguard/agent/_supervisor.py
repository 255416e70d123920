"""The per-node supervisor behind ``trainguard run``: starts the worker command, reports its
exits, and restarts it when the daemon orders a restore.

Two ways to start workers:

* **launcher mode** (``nproc_per_node`` set): the supervisor starts one process per local rank
  itself, with the variables ``torch.distributed`` reads under torchrun (``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT``). Each rank's death is reported with its rank and signal the moment it
  happens.
* **plain mode**: one command (a script, or ``torchrun ...``) whose exit is reported for the
  ranks it hosts (``ranks``).

An ``in_process`` restore leaves the workers running (their agents reload at the restore's
step boundary): the supervisor only adopts its generation, for the exits it reports from then
on; if that restore fails, the daemon's next one restarts.

Every worker runs in its own session (process group), so a restore can stop everything it
started, grandchildren included: SIGTERM to the group, SIGKILL after ``grace_s`` seconds.

In launcher mode each worker also gets a step file of its own (``TRAINGUARD_STEP_FILE``, in a
temporary folder removed at the end): its agent records there the last step it completed,
and the supervisor reports that step with the worker's exit (:mod:`._step_file`), also after
a SIGKILL. In plain mode one command hosts several ranks and exits carry no step.
Workers get ``TRAINGUARD_JOB``, ``TRAINGUARD_BUS``, ``TRAINGUARD_TOPIC_PREFIX`` and
``TRAINGUARD_GENERATION``; the agent inside reads its restore target from the restore command
of that generation. Everything else of the supervisor's environment passes through unchanged,
so the ``TRAINGUARD_KAFKA_*`` security variables ``trainguard run`` read reach the agents too.

With keys (``TRAINGUARD_DAEMON_PUBLIC_KEYS``, ``TRAINGUARD_EVENT_KEY``, which the workers
inherit as well) the supervisor acts only on commands the daemon signed, for its job and not
replayed (:mod:`._command_gate`), and sends its lifecycle events with their MAC.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import itertools
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from trainguard.agent._command_gate import CommandGate, Ignored, IgnoreReason, log_ignored
from trainguard.agent._errors import AgentError, ConfigError
from trainguard.agent._keystore import AgentKeys
from trainguard.agent._step_file import STEP_FILE_ENV, read_step_file, reset_step_file
from trainguard.agent.bus import Bus, BusConfig, BusError, Consumer, TopicPartition, open_bus
from trainguard.agent.bus._partitioner import partition_for
from trainguard.schemas import Abort, Lifecycle, Restore, Resume, SchemaError, add_mac, encode

__all__ = ["EXIT_ABORTED", "EXIT_STOPPED", "JobNotJoinable", "Supervisor", "SupervisorConfig"]

log = structlog.get_logger("trainguard.supervisor")


class JobNotJoinable(AgentError):
    """The job's latest command says it runs on, finished or was aborted without this node."""


EXIT_ABORTED = 3
"""Exit status of ``trainguard run`` when the daemon aborted the job."""

EXIT_STOPPED = 128 + signal.SIGTERM
"""Exit status of ``trainguard run`` stopped by a signal (the shell's convention for SIGTERM)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorConfig:
    """What one node's supervisor runs.

    Attributes:
        job_id: the job's name.
        bus: how to reach the bus.
        command: the worker command and its arguments.
        nproc_per_node: launcher mode: start this many local ranks; ``None`` for plain mode.
        nnodes: number of nodes (launcher mode); world size = ``nnodes * nproc_per_node``.
        node_rank: this node's index in ``0..nnodes-1`` (launcher mode).
        master_addr: rendezvous host of rank 0 (launcher mode).
        master_port: rendezvous port; ``None`` picks a free port per generation on a single
            node (a port reused right after a kill can still be in TIME_WAIT). With several
            nodes the port is ``master_port + generation % 1000`` so that all nodes agree.
        ranks: plain mode: the ranks the command hosts, reported with its exit.
        grace_s: seconds between SIGTERM and SIGKILL when stopping workers.
        env: extra environment for the workers.
        host: this node's name.
        keys: the daemon's public keys (commands must be signed by one) and the job's event
            key (lifecycle events carry its MAC); default none, insecure (``docs/security.md``).
    """

    job_id: str
    bus: BusConfig
    command: Sequence[str]
    nproc_per_node: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    ranks: tuple[int, ...] = ()
    grace_s: float = 10.0
    env: Mapping[str, str] = field(default_factory=dict)
    host: str = field(default_factory=socket.gethostname)
    keys: AgentKeys = field(default_factory=AgentKeys)

    def __post_init__(self) -> None:
        """Raises :class:`ConfigError` for settings that could only fail later, less clearly."""
        if not self.command:
            raise ConfigError("no worker command given (trainguard run ... -- CMD)")
        if shutil.which(self.command[0]) is None:
            raise ConfigError(f"worker command {self.command[0]!r} not found")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise ConfigError(f"nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank {self.node_rank} outside 0..{self.nnodes - 1}")
        if self.nnodes > 1 and self.master_port is None:
            raise ConfigError("several nodes need one agreed --master-port (and --master-addr)")
        if self.grace_s < 0:
            raise ConfigError(f"grace_s must be >= 0, got {self.grace_s}")
        probe = Lifecycle(
            job_id=self.job_id, generation=0, ts=0, seq=0, rank=None, host=self.host, pid=1,
            kind="started", ranks=self.local_ranks(),
        )  # fmt: skip
        try:
            encode(probe)  # the wire schema is the rulebook for ids, hosts and ranks
        except SchemaError as exc:
            raise ConfigError(f"invalid setting: {exc}") from exc

    def local_ranks(self) -> tuple[int, ...]:
        """Global ranks this node hosts."""
        if self.nproc_per_node is None:
            return self.ranks
        first = self.node_rank * self.nproc_per_node
        return tuple(range(first, first + self.nproc_per_node))


@dataclass(eq=False)  # compared by identity: "is it still one of ours?"
class _Worker:
    ranks: tuple[int, ...]
    proc: asyncio.subprocess.Process
    watcher: asyncio.Task[None] | None = None
    step_file: Path | None = None


class Supervisor:
    """Runs one node's workers for one job until it finishes or is aborted.

    ``await Supervisor(config).run()`` returns the exit status for ``trainguard run``: 0 when
    every worker finished with status 0, :data:`EXIT_ABORTED` when the daemon aborted the job.

    Attributes:
        ignored: commands not acted on, by reason (see ``trainguard.agent._command_gate``).
    """

    def __init__(self, config: SupervisorConfig) -> None:
        self._c = config
        self._gate = CommandGate(config.job_id, 0, config.keys.verify)
        self.ignored: collections.Counter[IgnoreReason] = self._gate.ignored
        self._seq = itertools.count()
        self._generation = 0
        self._workers: list[_Worker] = []
        self._orders: asyncio.Queue[Restore | Abort] = asyncio.Queue()
        self._all_exited = asyncio.Event()
        self._failed = False
        self._step_dir: Path | None = None

    async def run(self, stop: asyncio.Event | None = None) -> int:
        """Start the workers, follow the job's commands, restart on restore orders.

        Setting ``stop`` (``trainguard run`` sets it on SIGTERM/SIGINT) stops the workers
        (SIGTERM, SIGKILL after the grace period), reports their exits, so that the daemon
        knows these ranks are gone, and returns :data:`EXIT_STOPPED`.
        """
        async with open_bus(self._c.bus) as bus:
            commands = await self._follow_commands(bus)
            listener = asyncio.ensure_future(self._listen(commands))
            if self._c.nproc_per_node is not None:
                self._step_dir = Path(tempfile.mkdtemp(prefix="trainguard-steps-"))
            try:
                return await self._supervise(bus, stop or asyncio.Event())
            finally:
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener
                await commands.close()
                await self._stop_workers(None)
                if self._step_dir is not None:
                    shutil.rmtree(self._step_dir, ignore_errors=True)

    async def _follow_commands(self, bus: Bus) -> Consumer:
        tp = TopicPartition(
            "commands", partition_for(self._c.job_id, await bus.partitions("commands"))
        )
        end = (await bus.end_offsets("commands"))[tp]
        latest = (await bus.latest_per_key("commands")).get(self._c.job_id)
        if latest is not None and latest.value is not None:
            command = self._admit(latest.value, latest.offset)
            if command is not None:
                self._join(command)
        return await bus.assign({tp: end})

    def _admit(self, data: bytes, offset: int) -> Restore | Resume | Abort | None:
        """The command in ``data`` if it may be acted on; else count and log why not."""
        command = self._gate.admit(data)
        if not isinstance(command, Ignored):
            return command
        log_ignored(log, command, offset)
        return None

    def _join(self, latest: Restore | Resume | Abort) -> None:
        """Start in the generation of a restore the daemon has ordered; refuse a job that
        already runs on without us, finished, or was aborted (a new run needs a new job id)."""
        if isinstance(latest, Restore):
            self._generation = latest.generation
            return
        what = "was aborted" if isinstance(latest, Abort) else "already runs or has finished"
        raise JobNotJoinable(
            f"job {self._c.job_id!r} {what} in generation {latest.generation}: a new run needs "
            "a new job id (a supervisor can only join a job at its start or at a restore)"
        )

    async def _listen(self, consumer: Consumer) -> None:
        while True:
            for record in await consumer.getmany(timeout_s=0.2):
                if record.key != self._c.job_id or record.value is None:
                    continue
                command = self._admit(record.value, record.offset)
                if isinstance(command, Restore | Abort):
                    await self._orders.put(command)

    async def _supervise(self, bus: Bus, stop: asyncio.Event) -> int:
        await self._start_workers(bus)
        stop_task = asyncio.ensure_future(stop.wait())
        while True:
            order_task = asyncio.ensure_future(self._orders.get())
            waiting = {order_task, stop_task}
            # Once a worker failed, only the daemon's order (or a signal) moves us on.
            done_task = None if self._failed else asyncio.ensure_future(self._all_exited.wait())
            if done_task is not None:
                waiting.add(done_task)
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if done_task is not None:
                done_task.cancel()
            if stop_task.done():
                order_task.cancel()
                log.warning("stopping: signalled", generation=self._generation)
                await self._stop_workers(bus)
                return EXIT_STOPPED
            if not order_task.done():
                order_task.cancel()
                if not self._failed:
                    log.info("workers finished", generation=self._generation)
                    return 0
                log.warning("a worker failed: waiting for the daemon", generation=self._generation)
                continue
            order = order_task.result()
            if order.generation <= self._generation and isinstance(order, Restore):
                continue  # the restore this generation was started for, or an older one
            if isinstance(order, Abort):
                log.error("job aborted by the daemon", reason=order.reason)
                return EXIT_ABORTED
            if order.mode == "in_process":
                log.info(
                    "in-process restore ordered: the workers reload themselves",
                    generation=order.generation,
                    at_step=order.at_step,
                    reason=order.reason,
                )
                self._generation = order.generation
                continue
            log.info(
                "restore ordered",
                generation=order.generation,
                target=order.target.snapshot_id if order.target else None,
                reason=order.reason,
            )
            await self._stop_workers(None)
            self._generation = order.generation
            await self._start_workers(bus)

    # -- workers -------------------------------------------------------------------------------

    def _worker_env(self, port: int) -> list[tuple[tuple[int, ...], dict[str, str]]]:
        c = self._c
        base = {
            **os.environ,
            **c.env,
            "TRAINGUARD_JOB": c.job_id,
            "TRAINGUARD_BUS": c.bus.url,
            "TRAINGUARD_TOPIC_PREFIX": c.bus.prefix,
            "TRAINGUARD_GENERATION": str(self._generation),
        }
        if c.nproc_per_node is None:
            return [(c.ranks, base)]
        world = c.nnodes * c.nproc_per_node
        out: list[tuple[tuple[int, ...], dict[str, str]]] = []
        for local, rank in enumerate(c.local_ranks()):
            step_file = self._step_file(rank)
            out.append(
                (
                    (rank,),
                    {
                        **base,
                        **({} if step_file is None else {STEP_FILE_ENV: str(step_file)}),
                        "RANK": str(rank),
                        "LOCAL_RANK": str(local),
                        "WORLD_SIZE": str(world),
                        "LOCAL_WORLD_SIZE": str(c.nproc_per_node),
                        "GROUP_RANK": str(c.node_rank),
                        "MASTER_ADDR": c.master_addr,
                        "MASTER_PORT": str(port),
                    },
                )
            )
        return out

    def _step_file(self, rank: int) -> Path | None:
        """``rank``'s step file (launcher mode), or ``None``."""
        return None if self._step_dir is None else self._step_dir / f"rank{rank}.step"

    def _port(self) -> int:
        if self._c.master_port is not None:
            offset = self._generation % 1000 if self._c.nnodes > 1 else 0
            return self._c.master_port + offset
        with socket.socket() as s:
            s.bind((self._c.master_addr, 0))
            port: int = s.getsockname()[1]
            return port

    async def _start_workers(self, bus: Bus) -> None:
        self._all_exited.clear()
        self._failed = False
        port = self._port()
        for ranks, env in self._worker_env(port):
            step_file = self._step_file(ranks[0]) if len(ranks) == 1 else None
            if step_file is not None:
                try:
                    reset_step_file(step_file)  # no step of a previous generation
                except OSError as exc:
                    log.warning("step file not written", path=str(step_file), error=str(exc))
                    step_file = None
                    env.pop(STEP_FILE_ENV, None)
            proc = await asyncio.create_subprocess_exec(
                *self._c.command, env=env, start_new_session=True, preexec_fn=_die_with_parent
            )
            worker = _Worker(ranks, proc, step_file=step_file)
            self._workers.append(worker)
            await self._report(bus, "started", worker)
            worker.watcher = asyncio.ensure_future(self._watch(bus, worker))
        log.info("workers started", generation=self._generation, ranks=self._c.local_ranks())

    async def _watch(self, bus: Bus, worker: _Worker) -> None:
        code = await worker.proc.wait()
        if worker not in self._workers:
            return  # stopped for a restart: the daemon has moved on
        if code != 0:
            self._failed = True
        await self._report(bus, "exited", worker, code=code)
        if all(w.proc.returncode is not None for w in self._workers):
            self._all_exited.set()

    async def _report(self, bus: Bus, kind: str, worker: _Worker, code: int | None = None) -> None:
        exit_code = signal_no = step = None
        if code is not None:
            exit_code, signal_no = (None, -code) if code < 0 else (code, None)
            if worker.step_file is not None:
                step = read_step_file(worker.step_file)
        event = Lifecycle(
            job_id=self._c.job_id,
            generation=self._generation,
            ts=time.time_ns(),
            seq=next(self._seq),
            rank=None,
            host=self._c.host,
            pid=worker.proc.pid,
            kind=kind,  # type: ignore[arg-type]
            ranks=worker.ranks,
            exit_code=exit_code,
            signal=signal_no,
            step=step,
        )
        key = self._c.keys.event
        if key is not None:
            event = add_mac(event, key.kid, key.secret)
        await bus.publish("events", self._c.job_id, encode(event))
        log.info(
            f"worker {kind}",
            ranks=worker.ranks,
            pid=worker.proc.pid,
            generation=self._generation,
            exit_code=exit_code,
            signal=signal.Signals(signal_no).name if signal_no else None,
            step=step,
        )

    async def _stop_workers(self, bus: Bus | None) -> None:
        """SIGTERM every worker's process group, SIGKILL after the grace period, reap them.

        With ``bus``, report each worker's exit (a restore order does not: the daemon already
        moved on to a new generation)."""
        workers, self._workers = self._workers, []
        reported = [w for w in workers if w.proc.returncode is not None]  # their watchers did
        for w in workers:
            if w.watcher is not None:
                w.watcher.cancel()
            _signal_group(w.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self._c.grace_s
        for w in workers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(w.proc.wait(), max(0.0, deadline - time.monotonic()))
        for w in workers:
            # The group may hold grandchildren (torchrun's workers) even after the leader died.
            _signal_group(w.proc.pid, signal.SIGKILL)
            code = await w.proc.wait()
            if bus is not None and w not in reported:
                with contextlib.suppress(BusError):
                    await self._report(bus, "exited", w, code=code)


def _die_with_parent() -> None:
    """In the forked worker, before exec: have Linux SIGKILL it when the supervisor dies
    (``prctl(PR_SET_PDEATHSIG)``), so that a killed supervisor leaves no orphan training on
    unsupervised. Elsewhere a no-op."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
