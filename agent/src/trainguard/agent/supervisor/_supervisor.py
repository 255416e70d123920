"""The per-node supervisor behind ``trainguard run``: starts the worker command, reports its
exits, and restarts it when the daemon orders a restore.

Two ways to start workers:

* **launcher mode** (``nproc_per_node`` set): the supervisor starts one process per local rank
  itself, with the variables ``torch.distributed`` reads under torchrun (``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT``). Each rank's death is reported with its rank and signal the moment it
  happens.
* **plain mode**: one command (a script, or ``torchrun ...``) whose exit is reported for the
  ranks it hosts (``ranks``). It gets a ``TORCHELASTIC_ERROR_FILE`` (unless the environment
  names one), so that a failed torchrun's exit report names the rank that failed and its error
  (:mod:`._torchelastic`).

**Warm spares** (``warm``, launcher mode): the supervisor keeps a spare process per local rank
waiting at the script's hand-off point, and starts each rank of a restored generation from its
spare when one is ready, cold otherwise (:mod:`._spares`, ``docs/warm-restarts.md``). Spares
are started with the first generation and again after each ``resume``.

An ``in_process`` restore leaves the workers running (their agents reload at the restore's
step boundary): the supervisor only adopts its generation, for the exits it reports from then
on; if that restore fails, the daemon's next one restarts.

Every worker runs in its own session (process group), so a restore can stop everything it
started, grandchildren included: SIGTERM to the group, SIGKILL after ``grace_s`` seconds.

Every worker's stderr reaches the supervisor's through a pipe of the supervisor (:mod:`._stderr`),
unchanged; the exit report of a worker that failed carries what it wrote last (a traceback's
exception), which the daemon quotes in its reasons. A worker that exits with
:data:`~trainguard.schemas.EXIT_CONFIG` (a configuration error) is reported like any other; the
daemon fails the job instead of restoring it (``docs/recovery.md``).

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
replayed (:mod:`._command_gate`), and sends its lifecycle events and requests with their MAC.

**Joining** (``docs/operations.md``, "A supervisor that restarts"): on start the supervisor
takes the node's slot (:mod:`._node_slot`: one supervisor per job and node; a second one is
refused before it reads or posts anything), then reads the job's latest command. It starts
workers only in a generation whose processes nobody runs yet: generation 0 of a job without
command and without committed snapshot, or the generation of a ``restart`` restore. A job that
runs already (a ``resume``, an ``in_process`` restore, or a committed snapshot in generation 0)
ran this node's ranks in a previous supervisor, whose workers died with it
(``PR_SET_PDEATHSIG``): the supervisor reports them ``exited`` (SIGKILL) in that generation, so
that the daemon restores the job at once, and starts its workers in the restore's generation
with its target; unless every one of its ranks reported ``finished`` in that generation
(nothing is gone, nothing to do: it posts nothing and exits 0). A job that was stopped or
failed (``abort``) is refused unless ``continue_job`` is set: then it asks the daemon to
continue it (a ``job-request`` ``continue``) and joins the restore that answers.

**Stopping**: a SIGTERM or SIGINT asks the daemon to stop the whole job (a ``job-request``
``stop``, queued in the outbox ahead of the exit reports) before this node's workers are
stopped, so that their exits are no failure, and waits for the daemon's ``abort`` (outcome
``stopped``). All of it within ``stop_timeout_s`` of the signal: the workers' grace is cut
short at that deadline, and what the bus has not taken by then stays in the journal (below);
a second signal ends it at once.

**No daemon**: while no daemon reads the job's events for ``daemon_timeout_s``, a warning is
logged every ``warn_every_s`` (:mod:`._daemon_watch`).

**Finishing** (``docs/recovery.md``, "A finish the daemon has not judged"): once every worker
exited with status 0, the supervisor waits, at most ``daemon_timeout_s``, until the daemon has
read this node's reports and found the whole job finished (every node's ranks), and obeys the
restore it may order meanwhile (a divergence in the ranks' last heartbeats, of any node)
before it exits 0.

**Outages** (``docs/operations.md``, "Agents and supervisors during a bus outage"): the
supervisor's lifecycle reports leave through its outbox (:mod:`._courier`), which delivers them
in order and retries for as long as the bus is away; no bus failure ends or stalls the watch
of a worker. Each worker gets a spool folder (``TRAINGUARD_SPOOL_DIR``, under the state
folder's ``spool``), in which its agents keep the events the bus has not taken yet
(:mod:`._spool`). When a worker exits, the supervisor forwards those events, the same bytes,
and then its exit report, through the same outbox: a rank's ``finished`` is on the bus before
the supervisor's ``exited``, so a finished job is never taken for a failed one. The outbox is
journaled (a file in the node's spool folder, :mod:`._spool`): everything in it is on disk, in
order, until the bus took it. Before it exits, the supervisor waits for its outbox to be
delivered, logging every ``warn_every_s``; a signal ends that wait (for a supervisor that was
signalled before, the stop's deadline does), and its journal and the spools of undelivered
workers stay on disk: the next supervisor of the job on this node forwards them before
anything else, the workers' spools first, then the journals (and, if they held a stop request,
waits up to ``daemon_timeout_s`` for the daemon to read it, so that it finds the job
stopped). Its own calls
on the bus (connecting, reading the job's state, sending a report or request) wait out an
outage, logged when it begins, while it lasts and when it ends
(:func:`~trainguard.agent.bus.patiently`): a supervisor started during an outage waits for the bus and starts nothing meanwhile. A signal
ends every wait on the bus at once, whatever the bus's timeouts; only a bus that cannot work
(not retriable: a bad URL, refused credentials) fails the run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import os
import re
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, NamedTuple, TypeVar

import orjson
import structlog

from trainguard.agent._errors import AgentError, ConfigError
from trainguard.agent.bus import (
    ABANDON_GRACE_S,
    Bus,
    BusConfig,
    BusError,
    Consumer,
    Delivery,
    Record,
    Signalled,
    TopicPartition,
    abandon,
    default_state_dir,
    open_bus,
    or_stop,
    parse_bus_url,
    partition_for,
    patiently,
    started,
)
from trainguard.agent.checkpoint._manifests import read_manifests
from trainguard.agent.checkpoint._step_file import STEP_FILE_ENV, read_step_file, reset_step_file
from trainguard.agent.keys._command_gate import CommandGate, Ignored, IgnoreReason, log_ignored
from trainguard.agent.keys._keystore import AgentKeys
from trainguard.agent.supervisor._beat_relay import HEARTBEAT_RELAY_ENV, BeatRelay
from trainguard.agent.supervisor._courier import Courier
from trainguard.agent.supervisor._daemon_watch import DaemonWatch, poll_interval_s
from trainguard.agent.supervisor._node_slot import NodeSlot, NodeTaken
from trainguard.agent.supervisor._process import die_with_parent, signal_group
from trainguard.agent.supervisor._requests import encode_request
from trainguard.agent.supervisor._spares import SparePool
from trainguard.agent.supervisor._spool import (
    JOURNAL_SUFFIX,
    SPOOL_DIR_ENV,
    read_journal,
    read_spool,
)
from trainguard.agent.supervisor._stderr import StderrTail, last_words
from trainguard.agent.supervisor._torchelastic import (
    ERROR_FILE_ENV,
    describe_failure,
    torchrun_max_restarts,
)
from trainguard.schemas import (
    EXIT_CONFIG,
    Abort,
    Checkpoint,
    DataCursorEvent,
    Heartbeat,
    JobRequest,
    Lifecycle,
    RequestKind,
    Restore,
    Resume,
    SchemaError,
    add_mac,
    decode,
    encode,
)

__all__ = [
    "EXIT_ABORTED",
    "EXIT_SIGNALLED",
    "EXIT_STOPPED",
    "JobNotJoinable",
    "NodeTaken",
    "Supervisor",
    "SupervisorConfig",
]

log = structlog.get_logger("trainguard.supervisor")

_T = TypeVar("_T")


class JobNotJoinable(AgentError):
    """The job was stopped or failed (and ``--continue`` was not given), a rejoin needs the
    node's ranks (plain mode without ``ranks``), or the daemon read this node's report or
    request and ordered nothing (it rejected it); the message says which and what to do. (A
    node whose ranks finished is no refusal: nothing to do, status 0.)"""


EXIT_ABORTED = 3
"""Exit status of ``trainguard run`` when the daemon aborted the job as ``failed``."""

EXIT_STOPPED = 4
"""Exit status of ``trainguard run`` when the job was stopped on request (``trainguard stop``,
or a signalled supervisor of the job) and the daemon confirmed it: the job can be continued."""

EXIT_SIGNALLED = 128 + signal.SIGTERM
"""Exit status of ``trainguard run`` stopped by a signal without the daemon's confirmation of
the job's stop (none within ``stop_timeout_s``, a second signal, or the bus did not take the
request in time: it stays in the node's spool); the shell's convention for SIGTERM."""

_ANSWER_POLL_S = 1.0
"""Seconds between two looks at whether the daemon read a request this supervisor waits on."""

_VERDICT_POLL_S = 0.2
"""Seconds between two looks at whether the daemon read this node's finish: every job's end
waits on it (two cheap reads)."""


_SECONDS_OPTIONS: Final = {
    "grace_s": "--grace",
    "daemon_timeout_s": "--daemon-timeout",
    "stop_timeout_s": "--stop-timeout",
    "heartbeat_batch_s": "--batch-heartbeats",
}
"""Durations of :class:`SupervisorConfig` that must be >= 0, by the ``trainguard run`` option
that sets them (its messages name settings as the command line spells them)."""


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
            nodes the port is ``master_port + generation % 1000`` so that all nodes agree
            (so at most 64536 then; 65535 on a single node).
        ranks: plain mode: the ranks the command hosts, reported with its exit.
        grace_s: seconds between SIGTERM and SIGKILL when stopping workers.
        env: extra environment for the workers.
        host: this node's name.
        keys: the daemon's public keys (commands must be signed by one) and the job's event
            key (lifecycle events carry its MAC); default none, insecure (``docs/security.md``).
        continue_job: continue a job that was stopped or failed (``trainguard run
            --continue``); without it such a job is refused. A job that runs is joined either
            way.
        daemon_group: the daemon's consumer group, whose position on ``events`` tells whether
            a daemon reads the job; ``None``: ``<prefix>daemon``, the daemon's default.
        daemon_timeout_s: warn when no daemon has read the job's events for this many seconds;
            also the longest wait, once every worker finished, for the daemon to judge the
            finish (:meth:`Supervisor._finish`); 0: no daemon expected (never warn, no wait).
        warn_every_s: seconds between two such warnings while it lasts (> 0).
        stop_timeout_s: seconds from a signal (SIGTERM, SIGINT) to the exit of a supervisor
            whose workers run: within them it stops its workers (``grace_s``, cut short),
            delivers its stop request and exit reports and waits for the daemon's
            confirmation; what the bus has not taken by then stays in the node's spool folder
            (:data:`EXIT_SIGNALLED`). Closing its connections adds at most about 2 s.
        heartbeat_batch_s: batch this node's heartbeats (``trainguard run
            --batch-heartbeats``): the workers hand their heartbeats to the supervisor, which
            sends them every this many seconds as one ``heartbeat-batch`` record
            (:mod:`._beat_relay`); 0 (default): each rank sends its own. A heartbeat waits at
            most this long, so keep it well under the daemon's ``heartbeat_timeout_s``.
        state_dir: the per-user state folder; the node slots' lock files
            (:mod:`._node_slot`) go to its ``supervisors`` folder. Default
            :func:`~trainguard.agent.bus.default_state_dir` of the environment.
        warm: keep a warm spare per local rank (launcher mode only) and restart each rank
            from its spare when it is ready, cold otherwise (:mod:`._spares`,
            ``docs/warm-restarts.md``); the worker command must call
            :func:`trainguard.agent.await_handoff`.
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
    continue_job: bool = False
    daemon_group: str | None = None
    daemon_timeout_s: float = 30.0
    warn_every_s: float = 30.0
    stop_timeout_s: float = 20.0
    heartbeat_batch_s: float = 0.0
    state_dir: Path = field(default_factory=default_state_dir)
    warm: bool = False

    def __post_init__(self) -> None:
        """Raises :class:`ConfigError` for settings that could only fail later, less clearly."""
        if not self.command:
            raise ConfigError("no worker command given (trainguard run ... -- CMD)")
        if shutil.which(self.command[0]) is None:
            raise ConfigError(f"worker command {self.command[0]!r} not found")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        restarts = torchrun_max_restarts(self.command)
        if restarts:
            raise ConfigError(
                f"torchrun would restart the ranks itself, up to {restarts} times "
                "(--max-restarts, or PET_MAX_RESTARTS), in the same generation and behind the "
                "daemon's back; run it with --max-restarts 0, and trainguard's restores restart "
                "it in a new generation (docs/launchers.md)"
            )
        if self.warm and self.nproc_per_node is None:
            raise ConfigError("warm spares need --nproc-per-node (launcher mode)")
        if self.ranks and self.nproc_per_node is not None:
            # Launcher mode derives the node's ranks; a second list could only disagree.
            raise ConfigError(
                "--ranks names the ranks of a plain-mode command; with --nproc-per-node the "
                "node's ranks follow from --node-rank (--node-rank x --nproc-per-node onwards)"
            )
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} outside 0..{self.nnodes - 1}")
        if self.nnodes > 1 and self.master_port is None:
            raise ConfigError("several nodes need one agreed --master-port (and --master-addr)")
        if self.master_port is not None:
            # Several nodes use master_port + generation % 1000: every one must be a port.
            highest = 65535 - (999 if self.nnodes > 1 else 0)
            if not 1 <= self.master_port <= highest:
                several = " with several nodes (generation g uses it + g % 1000)"
                raise ConfigError(
                    f"--master-port must be 1..{highest}{several if self.nnodes > 1 else ''}, "
                    f"got {self.master_port}"
                )
        for name, option in _SECONDS_OPTIONS.items():
            if not 0 <= getattr(self, name) < float("inf"):
                raise ConfigError(
                    f"{option} must be a finite number of seconds >= 0, got {getattr(self, name)}"
                )
        if not 0 < self.warn_every_s < float("inf"):
            raise ConfigError(
                f"--warn-every must be a finite number of seconds > 0, got {self.warn_every_s}"
            )
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

    def node(self) -> str:
        """This node's identity within the job: ``rank<first global rank>``, or
        ``node<node_rank>`` when it names no rank (plain mode without ``ranks``)."""
        ranks = self.local_ranks()
        return f"rank{min(ranks)}" if ranks else f"node{self.node_rank}"

    @property
    def group(self) -> str:
        """The daemon's consumer group in effect (``daemon_group`` or ``<prefix>daemon``)."""
        return self.daemon_group or f"{self.bus.prefix}daemon"


@dataclass(eq=False)  # compared by identity: "is it still one of ours?"
class _Worker:
    ranks: tuple[int, ...]
    proc: asyncio.subprocess.Process
    watcher: asyncio.Task[None] | None = None
    step_file: Path | None = None
    spool: Path | None = None
    stderr: StderrTail | None = None
    error_file: Path | None = None  # plain mode: the worker's TORCHELASTIC_ERROR_FILE


class Supervisor:
    """Runs one node's workers for one job until it finishes, is stopped or is aborted.

    ``await Supervisor(config).run()`` returns the exit status for ``trainguard run``: 0 when
    every worker finished with status 0, :data:`EXIT_ABORTED` when the daemon aborted the job
    as failed, :data:`EXIT_STOPPED` when the job was stopped on request, :data:`EXIT_SIGNALLED`
    when this supervisor was signalled and the daemon did not confirm the stop.

    Attributes:
        ignored: commands not acted on, by reason (see ``trainguard.agent.keys._command_gate``).
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
        # The job's audit partition and its end when this generation's workers started: where
        # a restore the daemon holds for their finish is looked for (None: not read yet).
        self._audit_from: tuple[TopicPartition, int] | None = None
        # _finish's round: a round the loop moved on from does nothing more (a cancellation
        # that asyncio.wait_for swallowed on 3.11 leaves its task running); and whether the
        # current round saw the daemon hold a restore.
        self._finish_round = 0
        self._restore_held_seen = False
        self._step_dir: Path | None = None
        # How this supervisor begins (module docstring): start workers, report the previous
        # supervisor's workers gone, or ask for a continuation; and the latest command's
        # (generation, seq) then, which a daemon's answer must be newer than.
        self._plan: Literal["start", "rejoin", "continue", "finished"] = "start"
        self._baseline = (0, 0)
        self._unanswered = asyncio.Event()
        self._unanswered_why = ""
        # Background lookers (daemon watch, answer): they end at their next pause once
        # _closing is set, never cancelled in the middle of a bus call.
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = asyncio.Event()
        # The supervisor's outbox (module docstring, outages), journaled in the node's spool
        # folder, which also holds its workers' spool folders.
        self._spool_root = (
            config.state_dir
            / "spool"
            / NodeSlot.name(self._bus_identity(), config.job_id, config.node())
        )
        journal = f"supervisor-{time.time_ns():019d}-{os.getpid()}{JOURNAL_SUFFIX}"
        self._courier = Courier(config.bus, config.job_id, self._spool_root / journal)
        self._courier_task: asyncio.Task[None] | None = None
        self._relay = (
            BeatRelay(
                config.job_id,
                config.host,
                config.keys.event,
                config.heartbeat_batch_s,
                functools.partial(next, self._seq),
            )
            if config.heartbeat_batch_s > 0
            else None
        )
        # Once signalled to stop the job: the monotonic time by which it exits.
        self._stop_by: float | None = None
        self._interrupted = asyncio.Event()  # set from the first signal on
        self._spares = SparePool(config.command) if config.warm else None

    @property
    def undelivered(self) -> int:
        """Events in the supervisor's outbox that the bus has not taken yet (its reports, and
        the events of exited workers it forwards)."""
        return self._courier.undelivered

    async def run(self, stop: asyncio.Event | None = None) -> int:
        """Start (or rejoin) the workers, follow the job's commands, restart on restore orders.

        Setting ``stop`` (``trainguard run`` sets it on SIGTERM/SIGINT) asks the daemon to stop
        the job, stops the workers (SIGTERM, SIGKILL after the grace period), reports their
        exits, and returns :data:`EXIT_STOPPED` once the daemon confirmed the stop; setting it
        again, or no confirmation within ``stop_timeout_s`` of the first signal, returns
        :data:`EXIT_SIGNALLED`. Everything after the signal (the workers' grace, delivering the
        request and the exit reports, the daemon's confirmation) ends by that deadline; what
        the bus has not taken then stays in the journal for the next supervisor of the node.

        Signalled while it waits for the bus (before its workers start), it returns
        :data:`EXIT_SIGNALLED` at once.

        Before it returns, it waits until the bus has taken its outbox (its reports and its
        exited workers' undelivered events; module docstring, outages), however long the bus is
        away; setting ``stop`` ends that wait and returns :data:`EXIT_SIGNALLED` (after a
        stop, the wait ends at the stop's deadline).

        Returns 0 without starting anything when this node's ranks finished in the job's
        current generation, or every rank before a pending restore was joined (nothing to do).

        Raises:
            NodeTaken: another supervisor of the job runs on this node (it holds the node's
                slot); nothing was read or posted, no worker started.
            JobNotJoinable: the job was stopped or failed and ``continue_job`` is not set, a
                rejoin needs ``ranks`` (plain mode), or the daemon read this node's report or
                request and ordered nothing (it was refused).
            ConfigError: the slot's lock file cannot be created.
            BusError: the bus cannot work (not retriable: a bad URL, refused credentials, a
                topic the cluster refuses); a bus that is away is waited for.
        """
        slot = self._take_slot()
        try:
            return await self._run(stop)
        finally:
            slot.release()

    def _take_slot(self) -> NodeSlot:
        """This node's slot for the job on this bus (a job id names a job within a bus and
        topic prefix; an embedded bus by its absolute path)."""
        c = self._c
        return NodeSlot.take(c.state_dir / "supervisors", self._bus_identity(), c.job_id, c.node())

    def _bus_identity(self) -> str:
        """The bus's URL and topic prefix, the namespace of job ids (an embedded bus by its
        absolute path)."""
        kind, where = parse_bus_url(self._c.bus.url)
        return f"{kind}:{Path(where).resolve() if kind == 'sqlite' else where} {self._c.bus.prefix}"

    async def _run(self, stop: asyncio.Event | None) -> int:
        stop = stop or asyncio.Event()
        # The first signal, for good: a stop request clears ``stop`` to hear a second one,
        # but from the first on no wait on the bus outlasts a short grace.
        first = asyncio.ensure_future(stop.wait())
        first.add_done_callback(lambda _: self._interrupted.set())
        try:
            try:
                status = await self._run_on_bus(stop)
            except Signalled:
                log.warning("signalled while waiting for the bus: exiting", job_id=self._c.job_id)
                status = EXIT_SIGNALLED
            except AgentError:
                await self._deliver_rest(stop)
                raise
            return status if await self._deliver_rest(stop) else EXIT_SIGNALLED
        finally:
            first.cancel()
            self._courier.stop()
            if self._courier_task is not None:
                self._courier_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._courier_task

    async def _deliver_rest(self, stop: asyncio.Event) -> bool:
        """Wait until the outbox is delivered, logging every ``warn_every_s`` seconds; a
        signal (``stop``) ends the wait, and so does the stop's deadline (``stop_timeout_s``
        after the signal) for a supervisor that was signalled before. Whether everything was
        delivered; what was not stays in the journal."""
        c = self._c
        if not self._courier.undelivered:
            return True
        deadline = float("inf") if self._stop_by is None else self._stop_by
        delivered = asyncio.ensure_future(self._courier.delivered())
        signalled = asyncio.ensure_future(stop.wait())
        waited = 0
        try:
            while not delivered.done():
                left = deadline - time.monotonic()
                if signalled.done() or left <= 0:
                    log.error(
                        f"exiting with {self._courier.undelivered} events the bus has not "
                        "taken: they stay in this node's spool folder, and the next "
                        "trainguard run of this job on this node forwards them first",
                        job_id=c.job_id,
                        spool=str(self._spool_root),
                        journal=str(self._courier.journal),
                        last_error=self._courier.last_error,
                    )
                    return False
                log.warning(
                    f"waiting for the bus to take {self._courier.undelivered} events before "
                    "exiting (a signal ends the wait)",
                    job_id=c.job_id,
                    last_error=self._courier.last_error,
                )
                waited += 1
                await asyncio.wait(
                    {delivered, signalled},
                    timeout=min(c.warn_every_s, left),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            if waited:  # close the warnings with the outcome the operator waits for
                log.info("the bus took every event: exiting", job_id=c.job_id)
            return True
        finally:
            delivered.cancel()
            signalled.cancel()

    async def _forward_leftovers(self, bus: Bus) -> None:
        """Forward what previous supervisors of the job on this node left undelivered (when
        signalled or killed during an outage), and wait for the bus to take it, before this
        supervisor reads the job's state: first their workers' spools (what the ranks did
        and no supervisor forwarded: a shard written while the bus was away must reach the
        daemon before the stop request that followed it, or it would come after the job
        ended and be ignored); then their journals, oldest first, each in the order its
        events were put (a stop request ahead of the exit reports it explains). Events a
        journal holds too arrive twice, and the daemon drops the second copy. A file or
        folder is removed once the bus has taken everything in it. If a job request (a stop) was among them, wait until the daemon has
        read it (:meth:`_until_read`), so that the job's state this supervisor reads next is
        the daemon's answer to it."""
        try:
            entries = sorted(self._spool_root.iterdir())
        except FileNotFoundError:
            entries = []
        for folder in entries:
            if folder.is_dir():
                self._forward(folder, None)
        requests = 0
        for journal in entries:
            if journal.suffix != JOURNAL_SUFFIX or journal == self._courier.journal:
                continue
            left = read_journal(journal)
            requests += sum(_is_request(data) for data in left)
            remove = functools.partial(_remove_file, journal)
            if left:
                log.warning(
                    "forwarding events a previous supervisor of this node could not deliver",
                    count=len(left),
                    journal=str(journal),
                )
            for n, data in enumerate(left, start=1):
                self._courier.put(data, then=remove if n == len(left) else None)
            if not left:
                remove()
        await self._courier.delivered()
        if requests:
            await self._until_read(bus)

    async def _until_read(self, bus: Bus) -> None:
        """Wait until the daemon's group has read the job's partition of ``events`` up to its
        end offset now (it acts on what it reads before it commits its position), polling
        every ``_ANSWER_POLL_S``; at most ``daemon_timeout_s`` (not at all when 0: no daemon
        is expected), then go on, saying so. A bus failure ends the wait, logged."""
        c = self._c
        if c.daemon_timeout_s <= 0:
            return
        deadline = time.monotonic() + c.daemon_timeout_s
        try:
            ends = await bus.end_offsets("events")
            tp = TopicPartition("events", partition_for(c.job_id, len(ends)))
            while True:
                position = (await bus.group_positions(c.group, "events")).get(tp)
                if position is not None and position >= ends[tp]:
                    return
                if time.monotonic() > deadline:
                    log.warning(
                        "no daemon has read the stop request a previous supervisor of this node "
                        f"left within {c.daemon_timeout_s:g} s: going on with the job as it "
                        "stands; a daemon that reads it later stops the job",
                        job_id=c.job_id,
                        group=c.group,
                    )
                    return
                await asyncio.sleep(_ANSWER_POLL_S)
        except BusError as exc:
            log.warning(
                "cannot tell whether the daemon read the stop request a previous supervisor "
                "of this node left",
                error=str(exc),
            )

    async def _run_on_bus(self, stop: asyncio.Event) -> int:
        # A bus that is away is waited for (module docstring, outages); one that is wrong
        # (a bad URL, a topic the cluster refuses) fails the run at once.
        bus = await self._patiently("connecting to the bus", self._started_bus, stop)
        lingering: list[asyncio.Future[Any]] = []  # wound down with the bus's close
        relaying: asyncio.Task[None] | None = None
        try:
            self._courier_task = asyncio.ensure_future(self._courier.run())
            if self._relay is not None:
                relaying = await self._start_relay(self._relay, bus)
            await or_stop(self._forward_leftovers(bus), stop)
            commands = await self._follow_commands(bus, stop)
            listener = asyncio.ensure_future(self._listen(commands))
            # Launcher mode: the workers' step files; plain mode: torchrun's error file.
            self._step_dir = Path(tempfile.mkdtemp(prefix="trainguard-steps-"))
            if self._c.daemon_timeout_s > 0:
                self._tasks.append(asyncio.ensure_future(self._watch_daemon(bus)))
            try:
                return await self._supervise(bus, stop)
            finally:
                self._closing.set()
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener
                if self._tasks:
                    # Each finishes the bus call it is in (bounded by the bus's timeouts)
                    # before the connections close, unless a signal came: then they wind down
                    # with them.
                    with contextlib.suppress(Signalled):
                        await or_stop(asyncio.wait(self._tasks), self._interrupted)
                lingering += [t for t in self._tasks if not t.done()]
                lingering.append(asyncio.ensure_future(commands.close()))
                if self._spares is not None:
                    await self._spares.close()
                await self._stop_workers(report=False)
                if self._step_dir is not None:
                    shutil.rmtree(self._step_dir, ignore_errors=True)
        finally:
            if relaying is not None:
                relaying.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await relaying
            if self._relay is not None:
                self._relay.close()
            await self._wind_down(*lingering, asyncio.ensure_future(bus.close()))

    async def _start_relay(self, relay: BeatRelay, bus: Bus) -> asyncio.Task[None] | None:
        """Open the heartbeat relay and start its batches on ``bus``; ``None`` (logged) when
        its socket cannot be made: the workers then send their heartbeats themselves."""
        try:
            path = await relay.open()
        except OSError as exc:
            log.warning("heartbeats not batched: no relay socket", error=str(exc))
            relay.close()
            self._relay = None
            return None
        log.info(
            "batching the node's heartbeats", every_s=self._c.heartbeat_batch_s, relay=str(path)
        )
        return asyncio.ensure_future(relay.run(bus))

    async def _wind_down(self, *calls: asyncio.Future[Any]) -> None:
        """Wait for the last bus calls (closing connections, a looker's last request), all
        together; after a signal, :data:`ABANDON_GRACE_S` more, then abandon them (cancelled,
        with another grace to unwind). Not cancelled at once: a close cancelled before it began
        would leave its Kafka clients open (aiokafka logs ``Unclosed AIOKafkaProducer`` at
        exit). Their bus errors are dropped (the connections are done with), any other failure
        is logged: nothing here may change how the supervisor ends."""
        with contextlib.suppress(Signalled):
            await or_stop(asyncio.wait(calls), self._interrupted)
        pending = [c for c in calls if not c.done()]
        if pending:
            await asyncio.wait(pending, timeout=ABANDON_GRACE_S)
        await abandon(*(c for c in pending if not c.done()))
        for call in calls:
            if call.done() and not call.cancelled():
                failure = call.exception()
                if failure is not None and not isinstance(failure, BusError):
                    log.warning("closing the bus connections failed", error=repr(failure))

    async def _started_bus(self) -> Bus:
        """A new connection to the bus, started (closed again if it fails to start:
        :func:`~trainguard.agent.bus.started`).

        Raises:
            BusError: the bus cannot be reached or used.
        """
        return await started(open_bus(self._c.bus))

    async def _patiently(
        self, what: str, call: Callable[[], Awaitable[_T]], stop: asyncio.Event
    ) -> _T:
        """``call()`` until the bus answers it, logging the outage; a signal ends the wait
        (:func:`~trainguard.agent.bus.patiently`).

        Raises:
            Signalled: ``stop`` was set.
            BusError: a non-retriable failure.
        """
        c = self._c
        return await patiently(
            what, call, stop, warn_every_s=c.warn_every_s, job_id=c.job_id, bus=c.bus.url
        )

    async def _follow_commands(self, bus: Bus, stop: asyncio.Event) -> Consumer:
        async def read() -> tuple[TopicPartition, int, Record | None]:
            tp = TopicPartition(
                "commands", partition_for(self._c.job_id, await bus.partitions("commands"))
            )
            end = (await bus.end_offsets("commands"))[tp]
            return tp, end, (await bus.latest_per_key("commands")).get(self._c.job_id)

        tp, end, latest = await self._patiently("reading the job's latest command", read, stop)
        command = None
        if latest is not None and latest.value is not None:
            command = self._admit(latest.value, latest.offset)
        await self._join(bus, command, stop)
        return await self._patiently(
            "following the job's commands", lambda: bus.assign({tp: end}), stop
        )

    def _admit(self, data: bytes, offset: int) -> Restore | Resume | Abort | None:
        """The command in ``data`` if it may be acted on; else count and log why not."""
        command = self._gate.admit(data)
        if not isinstance(command, Ignored):
            return command
        log_ignored(log, command, offset)
        return None

    async def _join(
        self, bus: Bus, latest: Restore | Resume | Abort | None, stop: asyncio.Event
    ) -> None:
        """Choose how to begin from the job's latest command (module docstring, joining)."""
        job = self._c.job_id
        if latest is None:
            if await self._patiently(
                "reading the job's snapshots", lambda: self._has_committed(bus), stop
            ):
                await self._rejoin(bus, stop, 0, 0, "it has committed snapshots in generation 0")
            return
        self._generation = latest.generation
        self._baseline = (latest.generation, latest.seq)
        if isinstance(latest, Abort):
            ended = "was stopped" if latest.outcome == "stopped" else "failed"
            if not self._c.continue_job:
                raise JobNotJoinable(
                    f"job {job!r} {ended} in generation {latest.generation} ({latest.reason}). "
                    "To continue it from its latest committed snapshot, run the same command "
                    "with --continue on every node; for a new run, use a new job id"
                )
            log.warning(
                f"job {ended}: asking the daemon to continue it",
                job_id=job,
                generation=latest.generation,
                reason=latest.reason,
            )
            self._plan = "continue"
            return
        if isinstance(latest, Restore) and latest.mode == "restart":
            # A generation whose processes are being started: join it, unless the job
            # finished before anyone did (the daemon then voids the restore), which a
            # divergence's restore never is (docs/recovery.md).
            left = await self._patiently(
                "reading the job's events",
                lambda: _finished_before(bus, job, latest.generation),
                stop,
            )
            if left is not None and await self._patiently(
                "reading the job's audit",
                lambda: _diverged(bus, job, latest.incident_id),
                stop,
            ):
                log.info(
                    f"every rank of generation {left} reported finished, but after a "
                    f"divergence ({latest.incident_id}): the restore stands; joining it",
                    job_id=job,
                )
                left = None
            if left is not None:
                log.warning(
                    f"job finished: every rank of generation {left} reported finished before "
                    f"any process joined its restore to generation {latest.generation}; the "
                    "daemon voids that restore, and no worker starts",
                    job_id=job,
                )
                self._plan = "finished"
            return
        await self._rejoin(
            bus,
            stop,
            latest.generation,
            latest.seq,
            "the daemon resumed it" if isinstance(latest, Resume) else "it restores in process",
        )

    async def _rejoin(
        self, bus: Bus, stop: asyncio.Event, generation: int, seq: int, why: str
    ) -> None:
        """Begin by reporting this node's previous workers gone in ``generation``, unless they
        all finished there (:meth:`_node_finished`: nothing to do)."""
        if not self._c.local_ranks():
            raise JobNotJoinable(
                f"job {self._c.job_id!r} runs in generation {generation} ({why}): this "
                "supervisor can only rejoin it by reporting its ranks gone; give them with "
                "--ranks (plain mode)"
            )
        self._generation = generation
        self._baseline = (generation, seq)
        if await self._node_finished(bus, stop):
            self._plan = "finished"
            return
        self._plan = "rejoin"
        log.warning(
            f"job runs in generation {generation} ({why}): this node's previous workers are "
            "gone; reporting them, then joining the daemon's restore",
            job_id=self._c.job_id,
            ranks=self._c.local_ranks(),
        )

    async def _has_committed(self, bus: Bus) -> bool:
        """Whether the job has a committed snapshot on ``manifests`` (a job without command
        that committed has run, with this node)."""
        found = await read_manifests(bus, self._c.job_id, self._c.keys.verify)
        return bool(found.manifests)

    async def _listen(self, consumer: Consumer) -> None:
        while True:
            try:
                records = await consumer.getmany(timeout_s=0.2)
            except BusError as exc:
                if not exc.retriable:
                    raise
                # The bus is away: the orders wait on it; a pause, then the next poll.
                log.debug("cannot read the job's commands: retrying", error=str(exc))
                await asyncio.sleep(_ANSWER_POLL_S)
                continue
            for record in records:
                if record.key != self._c.job_id or record.value is None:
                    continue
                command = self._admit(record.value, record.offset)
                if isinstance(command, Restore | Abort):
                    await self._orders.put(command)
                elif isinstance(command, Resume):
                    # The restore is done: warm the spares it used up now, not while they
                    # would take the restoring workers' CPU.
                    await self._fill_spares()

    async def _supervise(self, bus: Bus, stop: asyncio.Event) -> int:
        if self._plan == "finished":
            return 0
        await self._begin(bus, stop)
        stop_task = asyncio.ensure_future(stop.wait())
        unanswered = asyncio.ensure_future(self._unanswered.wait())
        while True:
            order_task = asyncio.ensure_future(self._orders.get())
            waiting: set[asyncio.Future[Any]] = {order_task, stop_task, unanswered}
            # Once a worker failed, only the daemon's order (or a signal) moves us on.
            done_task = None if self._failed else asyncio.ensure_future(self._finish(bus))
            if done_task is not None:
                waiting.add(done_task)
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if done_task is not None:
                done_task.cancel()
                self._finish_round += 1
            if stop_task.done():
                order_task.cancel()
                unanswered.cancel()
                if self._all_exited.is_set() and not self._failed and not self._restore_held_seen:
                    # Signalled while the daemon judges the finish: nothing left to stop.
                    log.info("workers finished", generation=self._generation)
                    return 0
                return await self._stop_job(stop)
            if unanswered.done() and not order_task.done():
                order_task.cancel()
                stop_task.cancel()
                raise JobNotJoinable(self._unanswered_why)
            if not order_task.done():
                order_task.cancel()
                if not self._failed:
                    if not self._orders.empty():
                        continue  # the daemon's answer to the finish (_finish): take it
                    log.info("workers finished", generation=self._generation)
                    return 0
                log.warning("a worker failed: waiting for the daemon", generation=self._generation)
                continue
            order = order_task.result()
            if order.generation <= self._generation and isinstance(order, Restore):
                continue  # the restore this generation was started for, or an older one
            if isinstance(order, Abort):
                stop_task.cancel()
                unanswered.cancel()
                return _ended(order)
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
            await self._stop_workers(report=False)
            self._generation = order.generation
            await self._start_workers(bus)

    async def _finish(self, bus: Bus) -> None:
        """Return once every worker exited: at once when one failed; when all finished, once
        the daemon judged this node's finish (``docs/recovery.md``, "A finish the daemon has
        not judged"), or after ``daemon_timeout_s`` without it (not at all when 0: no daemon
        is expected), said in a warning.

        The ranks' last heartbeats and ``finished`` reports are on the bus before their exit;
        the daemon may find a divergence in them (a non-finite loss in the last heartbeat
        interval) and order a restore, which only a supervisor still running can obey. The
        daemon has judged them once its group's position on the job's partition of ``events``
        passed the end offset read after this node's reports were delivered (it acts on what
        it reads before it commits its position, as :meth:`_await_answer` relies on); its
        latest command then is its answer: a restore or an abort is queued for the caller,
        which takes it (``_orders``) instead of ending. Unless it holds its restore (after a
        bus gap, or for a checkpoint in flight: a ``restore_held`` in the job's audit since
        this generation's workers started, :func:`_judged`): then the wait goes on, with a
        new ``daemon_timeout_s``, until it issues the restore. Without a command, the wait
        ends when the job's audit shows it finished: in a job of several nodes the other
        nodes' last reports, read later, may show a divergence (a replica's checksum) whose
        restore needs this node's ranks too; a node whose ranks finished before the others
        waits for them, within ``daemon_timeout_s``."""
        await self._all_exited.wait()
        c = self._c
        self._restore_held_seen = False
        if self._failed or c.daemon_timeout_s <= 0:
            return
        round_ = self._finish_round
        log.info("workers finished: waiting for the daemon to judge", generation=self._generation)
        deadline = time.monotonic() + c.daemon_timeout_s
        try:
            # This node's reports (forwarded spools first) on the bus: what the daemon reads.
            await asyncio.wait_for(self._courier.delivered(), c.daemon_timeout_s)
            events, end = await asyncio.wait_for(
                self._patiently(
                    "reading the end of the job's events",
                    lambda: _job_end(bus, "events", c.job_id),
                    self._closing,
                ),
                max(0.0, deadline - time.monotonic()),
            )
        except Signalled:
            return None  # winding down
        except (TimeoutError, BusError) as exc:  # BusError: one that no retry mends
            if isinstance(exc, BusError):
                log.warning("cannot read the end of the job's events", error=str(exc))
            return None if round_ != self._finish_round else self._unjudged()
        audit, scanned = self._audit_from or (None, 0)  # None: from the audit's start
        judged = _Judged(held=False, finished=False, end=scanned)
        others_said = False
        while round_ == self._finish_round:
            try:
                if (await bus.group_positions(c.group, "events")).get(events, -1) >= end:
                    if audit is None:
                        audit, _ = await _job_end(bus, "audit", c.job_id)
                    was_held = judged.held
                    judged = await _judged(bus, c.job_id, audit, judged)
                    if round_ != self._finish_round:
                        return  # the loop moved on meanwhile
                    self._restore_held_seen = judged.held
                    if judged.held:
                        # The daemon is there and decided: its restore comes once the bus
                        # settled or the cut it waits for is in.
                        deadline = time.monotonic() + c.daemon_timeout_s
                        if not was_held:
                            log.info(
                                "the daemon holds a restore (after a bus gap, or for a checkpoint "
                                "in flight): waiting for it",
                                generation=self._generation,
                            )
                    else:
                        record = (await bus.latest_per_key("commands")).get(c.job_id)
                        if round_ != self._finish_round:
                            return
                        verdict = (
                            None
                            if record is None or record.value is None
                            else self._gate.admit(record.value)
                        )
                        if isinstance(verdict, Restore | Abort):
                            await self._orders.put(verdict)  # the loop acts on it
                            return
                        if (
                            isinstance(verdict, Ignored)
                            and (verdict.generation or 0) > self._generation
                        ):
                            return  # the listener took it first: the loop acts on that
                        if judged.finished:
                            log.info("the daemon judged the finish", generation=self._generation)
                            return
                        # This node's reports are read, the job is not finished: ranks of
                        # other nodes still train, or their last reports are not read yet,
                        # and may show a divergence whose restore needs this node too.
                        if not others_said:
                            others_said = True
                            log.info(
                                "this node's finish is read; waiting for the daemon to find "
                                "the whole job finished (other nodes' ranks may still train; "
                                "a daemon that refuses the job's events never does: its log "
                                "says so)",
                                generation=self._generation,
                            )
            except BusError as exc:
                log.debug("cannot read the daemon's verdict: retrying", error=str(exc))
            if time.monotonic() > deadline and round_ == self._finish_round:
                return self._unjudged(whole_job=others_said)
            if await self._pause(_VERDICT_POLL_S):
                return

    async def _note_audit_start(self, bus: Bus) -> None:
        """Note the job's audit partition and its end offset now (:attr:`_audit_from`), for
        :meth:`_finish`; a bus failure leaves it unread (the audit is then read from its
        start)."""
        try:
            self._audit_from = await _job_end(bus, "audit", self._c.job_id)
        except BusError as exc:
            log.debug("cannot read the end of the job's audit", error=str(exc))

    def _unjudged(self, *, whole_job: bool = False) -> None:
        """Say that no daemon judged this node's finish (``whole_job``: the whole job's, this
        node's being read) within ``daemon_timeout_s``."""
        what = (
            "found the whole job finished (other nodes' ranks still train, it lags, or it "
            "refuses the job's events: see its log)"
            if whole_job
            else "judged this node's finish"
        )
        log.warning(
            f"no daemon has {what} within {self._c.daemon_timeout_s:g} s: "
            "exiting; a restore it orders later finds no supervisor here",
            job_id=self._c.job_id,
            group=self._c.group,
            generation=self._generation,
        )

    async def _begin(self, bus: Bus, stop: asyncio.Event) -> None:
        """Start the workers, or report the previous ones gone, or ask for a continuation, as
        :meth:`_join` chose; the last two wait for the daemon's restore (no workers meanwhile)."""
        if self._plan == "start":
            await self._start_workers(bus)
            await self._fill_spares()
            return
        self._failed = True  # nothing runs here until the daemon orders a restore
        if self._plan == "rejoin":
            data, sent = self._report_gone(), "report that this node's ranks are gone"
            what = f"this node's report that its ranks are gone (generation {self._generation})"
        else:
            data, sent = self._request("continue", "trainguard run --continue"), "continue request"
            what = f"the continue request (generation {self._generation})"
        # Where the daemon's audit of it will be, at the latest: after the audit's end now.
        audit = await self._patiently(
            "reading the end of the job's audit",
            lambda: _job_end(bus, "audit", self._c.job_id),
            stop,
        )
        # The same bytes at every attempt: a copy that landed twice is dropped by the daemon
        # (same sender, seq not above the last).
        delivery = await self._patiently(
            f"sending the {sent}", lambda: bus.publish("events", self._c.job_id, data), stop
        )
        log.info(f"{sent} sent", generation=self._generation, offset=delivery.offset)
        self._tasks.append(asyncio.ensure_future(self._await_answer(bus, delivery, what, audit)))

    def _request(self, kind: RequestKind, reason: str) -> bytes:
        """A job request in the current generation as this supervisor, encoded."""
        return encode_request(
            self._c.job_id,
            kind,
            generation=self._generation,
            host=self._c.host,
            pid=os.getpid(),
            seq=next(self._seq),
            reason=reason,
            key=self._c.keys.event,
        )

    async def _node_finished(self, bus: Bus, stop: asyncio.Event) -> bool:
        """Whether every rank of this node reported ``finished`` in the current generation (the
        job's events, as the daemon counts finished ranks), logged if so: none is gone, the
        job has ended or ends without this node, and this supervisor has nothing to do (it
        posts nothing and exits 0, as its predecessor did or would have)."""
        finished = await self._patiently(
            "reading the job's events",
            lambda: _finished_ranks(bus, self._c.job_id, self._generation),
            stop,
        )
        ranks = self._c.local_ranks()
        if not set(ranks) <= finished:
            return False
        log.info(
            f"this node's ranks finished in generation {self._generation}; nothing to do "
            "(for a new run, use a new job id)",
            job_id=self._c.job_id,
            ranks=list(ranks),
        )
        return True

    def _report_gone(self) -> bytes:
        """This node's ranks ``exited`` (SIGKILL) in the current generation, as this
        supervisor, encoded: the previous supervisor's workers were killed with it."""
        event = Lifecycle(
            job_id=self._c.job_id,
            generation=self._generation,
            ts=time.time_ns(),
            seq=next(self._seq),
            rank=None,
            host=self._c.host,
            pid=os.getpid(),
            kind="exited",
            ranks=self._c.local_ranks(),
            signal=signal.SIGKILL,
            message="gone with the previous supervisor of this node (restarted)",
        )
        key = self._c.keys.event
        if key is not None:
            event = add_mac(event, key.kid, key.secret)
        return encode(event)

    async def _await_answer(
        self, bus: Bus, sent: Delivery, what: str, audit: tuple[TopicPartition, int]
    ) -> None:
        """Once the daemon's group has read past ``sent`` (its position on ``events``), the
        daemon has acted on it: find its answer, a command newer than :attr:`_baseline`, on
        the bus (if the listener has not delivered it yet), or say that none came, unless the
        daemon holds its restore (:func:`_restore_held`, read from ``audit``: the partition of
        the job's audit and an offset before its entry for ``sent``)."""
        tp = TopicPartition("events", sent.partition)
        said_held = False
        while not await self._pause(_ANSWER_POLL_S):
            if self._generation > self._baseline[0]:
                return  # the daemon's restore arrived: answered
            try:
                position = (await bus.group_positions(self._c.group, "events")).get(tp)
                if position is None or position <= sent.offset:
                    continue
                record = (await bus.latest_per_key("commands")).get(self._c.job_id)
            except BusError as exc:
                log.warning("cannot tell whether the daemon read " + what, error=str(exc))
                return
            verdict = (
                None if record is None or record.value is None else self._gate.admit(record.value)
            )
            if isinstance(verdict, Ignored):
                # A duplicate of the command known at the start is no answer; anything else
                # was taken by the listener already, or is no command to judge by.
                known = (verdict.generation or 0, verdict.seq or 0) <= self._baseline
                if verdict.reason != "duplicate" or not known:
                    return
            elif verdict is not None and (verdict.generation, verdict.seq) > self._baseline:
                if isinstance(verdict, Restore | Abort):  # a resume: the restore came before
                    await self._orders.put(verdict)
                return
            try:
                held = await _restore_held(bus, self._c.job_id, sent, *audit)
            except BusError as exc:
                log.warning("cannot tell whether the daemon holds its restore", error=str(exc))
                return
            if held:
                if not said_held:
                    log.info(
                        f"the daemon read {what} and holds its restore (after a bus outage, or "
                        "for a checkpoint in flight): waiting for it",
                        generation=self._generation,
                    )
                    said_held = True
                continue
            self._unanswered_why = (
                f"the daemon read {what} but ordered nothing: job {self._c.job_id!r} has "
                "probably ended (trainguard status), or the daemon rejected it (its log and "
                "the dead-letter topic say why)"
            )
            self._unanswered.set()
            return

    async def _stop_job(self, stop: asyncio.Event) -> int:
        """Signalled: ask the daemon to stop the whole job, stop this node's workers (their
        exits reported after the request, so no failure), and wait for the daemon's abort;
        all of it by ``stop_timeout_s`` after the signal, and at once on a second signal."""
        if self._plan == "continue" and not self._workers:
            log.warning(
                "signalled while waiting for the continuation: the continue request stays on "
                "the bus; trainguard stop stops the job if it must not run",
                job_id=self._c.job_id,
            )
            return EXIT_SIGNALLED
        self._stop_by = time.monotonic() + self._c.stop_timeout_s
        stop.clear()  # from here on, a signal is the second one
        again = asyncio.ensure_future(stop.wait())
        log.warning(
            "signalled: asking the daemon to stop the job",
            generation=self._generation,
            stop_timeout_s=self._c.stop_timeout_s,
        )
        # Through the outbox, ahead of the workers' exit reports: the bus holds it before
        # them however long it is away (the journal keeps it if this supervisor exits first),
        # and no wait on the bus delays stopping the workers.
        self._courier.put(
            self._request("stop", f"trainguard run on host {self._c.host} was signalled")
        )
        try:
            await self._stop_workers(report=True, hurry=again)
            while not again.done() and (left := self._stop_by - time.monotonic()) > 0:
                order_task = asyncio.ensure_future(self._orders.get())
                await asyncio.wait(
                    {order_task, again}, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                if not order_task.done():
                    order_task.cancel()
                    continue
                order = order_task.result()
                if isinstance(order, Abort):
                    return _ended(order)
            if again.done():
                log.warning("signalled again: not waiting for the bus or the daemon")
                return EXIT_SIGNALLED
        finally:
            again.cancel()
        log.warning(
            f"the daemon has not confirmed the stop within {self._c.stop_timeout_s:g} s of "
            "the signal; once the request is on the bus (see below if it is not), the job "
            "ends stopped when a daemon reads it",
            job_id=self._c.job_id,
        )
        return EXIT_SIGNALLED

    async def _watch_daemon(self, bus: Bus) -> None:
        """Warn while no daemon reads the job's events (:class:`._daemon_watch.DaemonWatch`)."""
        c = self._c
        watch = DaemonWatch(
            c.job_id,
            c.group,
            timeout_s=c.daemon_timeout_s,
            warn_every_s=c.warn_every_s,
            where=f"{c.bus.url} (topic prefix {c.bus.prefix!r})",
        )
        while not await self._pause(poll_interval_s(c.daemon_timeout_s)):
            await watch.look(bus)

    async def _pause(self, seconds: float) -> bool:
        """Wait ``seconds``, or less if the supervisor winds down; whether it does."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing.wait(), seconds)
        return self._closing.is_set()

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
        if self._relay is not None and self._relay.path is not None:
            base[HEARTBEAT_RELAY_ENV] = str(self._relay.path)
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

    async def _fill_spares(self) -> None:
        """Start a spare for every local rank that has none (``warm``)."""
        if self._spares is not None and not self._closing.is_set():
            await self._spares.fill(self._worker_env(0))  # a port is no spare's business

    def _step_file(self, rank: int) -> Path | None:
        """``rank``'s step file (launcher mode), or ``None``."""
        if self._step_dir is None or self._c.nproc_per_node is None:
            return None
        return self._step_dir / f"rank{rank}.step"

    def _error_file(self, env: dict[str, str]) -> Path | None:
        """Plain mode: the ``TORCHELASTIC_ERROR_FILE`` of the worker about to start with
        ``env`` (the operator's, or one in this supervisor's folder, set in ``env``), emptied
        of a previous generation's failure (:mod:`._torchelastic`); launcher mode: ``None``."""
        if self._c.nproc_per_node is not None or self._step_dir is None:
            return None
        path = Path(env.setdefault(ERROR_FILE_ENV, str(self._step_dir / "torchelastic-error.json")))
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning(
                "torchrun's error file not emptied: not read", path=str(path), error=str(exc)
            )
            return None
        return path

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
        self._audit_from = None
        self._tasks.append(asyncio.ensure_future(self._note_audit_start(bus)))
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
            spool = self._spool_dir(ranks)
            if spool is not None:
                env[SPOOL_DIR_ENV] = str(spool)
            error_file = self._error_file(env)
            pool = self._spares
            spare = None if pool is None else pool.take(ranks)
            if pool is not None and spare is not None and await pool.hand_off(spare, env):
                proc, stderr = spare.proc, spare.stderr
            else:
                proc, stderr = await self._spawn(env)
            worker = _Worker(
                ranks, proc, step_file=step_file, spool=spool, stderr=stderr, error_file=error_file
            )
            self._workers.append(worker)
            self._report("started", worker)
            worker.watcher = asyncio.ensure_future(self._watch(worker))
        log.info("workers started", generation=self._generation, ranks=self._c.local_ranks())

    async def _spawn(self, env: Mapping[str, str]) -> tuple[asyncio.subprocess.Process, StderrTail]:
        """Start the worker command cold with ``env``: the process and its stderr pipe."""
        stderr = StderrTail()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._c.command,
                env=env,
                stderr=stderr.write_fd,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        except BaseException:
            stderr.close()
            raise
        stderr.start(asyncio.get_running_loop())
        return proc, stderr

    def _spool_dir(self, ranks: tuple[int, ...]) -> Path | None:
        """A new spool folder for a worker hosting ``ranks`` (``None``, logged, if it cannot be
        made: its agents then run without a spool)."""
        first = f"r{ranks[0]}" if ranks else "node"
        try:
            self._spool_root.mkdir(parents=True, exist_ok=True)
            return Path(
                tempfile.mkdtemp(prefix=f"g{self._generation}-{first}-", dir=self._spool_root)
            )
        except OSError as exc:
            log.warning(
                "no spool for the worker: events it cannot deliver die with it", error=str(exc)
            )
            return None

    async def _watch(self, worker: _Worker) -> None:
        code = await worker.proc.wait()
        if worker not in self._workers:
            return  # stopped for a restart: the daemon has moved on
        if code != 0:
            self._failed = True
        self._gone(worker, code, report=True)
        if all(w.proc.returncode is not None for w in self._workers):
            self._all_exited.set()

    def _gone(self, worker: _Worker, code: int, *, report: bool) -> None:
        """``worker`` ended with status ``code``: forward what its agents never delivered
        (their spool), then, with ``report``, its exit report."""
        if self._relay is not None:
            self._relay.forget(worker.ranks)
        if worker.spool is None:
            if report:
                self._report("exited", worker, code=code)
            return
        self._forward(worker.spool, (worker, code) if report else None)

    def _forward(self, spool: Path, report: tuple[_Worker, int] | None) -> None:
        """Queue the undelivered events of the spool folder ``spool``, the same bytes, then the
        exit ``report`` if given; the folder is removed once the bus has taken them all."""
        spooled = read_spool(spool)
        if spooled:
            log.warning(
                "forwarding events a worker could not deliver itself",
                count=len(spooled),
                spool=str(spool),
            )
        remove = functools.partial(shutil.rmtree, spool, ignore_errors=True)
        for n, item in enumerate(spooled, start=1):
            self._courier.put(
                item.data, then=remove if n == len(spooled) and report is None else None
            )
        if report is not None:
            self._report("exited", report[0], code=report[1], then=remove)
        elif not spooled:
            remove()

    def _report(
        self,
        kind: str,
        worker: _Worker,
        code: int | None = None,
        *,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Queue this supervisor's lifecycle report ``kind`` of ``worker`` in its outbox
        (``then`` runs once the bus has it). The exit (``code`` given) of a worker that failed
        carries the last words of its stderr as ``message`` (:func:`._stderr.last_words`), or
        for a torchrun in plain mode its failed rank and error (:mod:`._torchelastic`),
        unless a signal that comes from outside the process ended it (:data:`_SENT_SIGNALS`)."""
        exit_code = signal_no = step = None
        said = ""
        if code is not None:
            exit_code, signal_no = (None, -code) if code < 0 else (code, None)
            if worker.step_file is not None:
                step = read_step_file(worker.step_file)
            if code != 0 and -code not in _SENT_SIGNALS and worker.stderr is not None:
                worker.stderr.drain()  # what it wrote just before it ended
                text = worker.stderr.text
                said = describe_failure(worker.error_file, text) if worker.error_file else ""
                said = said or last_words(text)
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
            message=said,
        )
        key = self._c.keys.event
        if key is not None:
            event = add_mac(event, key.kid, key.secret)
        self._courier.put(encode(event), then=then)
        log.info(
            f"worker {kind}",
            ranks=worker.ranks,
            pid=worker.proc.pid,
            generation=self._generation,
            exit_code=exit_code,
            signal=_signal_name(signal_no) if signal_no else None,
            step=step,
            last_words=said or None,
        )
        if exit_code == EXIT_CONFIG:
            log.error(
                f"worker exited with status {EXIT_CONFIG}, a configuration error: the daemon "
                "fails the job instead of restarting it (docs/recovery.md)",
                ranks=worker.ranks,
                last_words=said or None,
            )

    async def _stop_workers(
        self, *, report: bool, hurry: asyncio.Future[Any] | None = None
    ) -> None:
        """SIGTERM (and SIGCONT) every worker's process group, SIGKILL after the grace period,
        reap them, forward what their agents never delivered.

        With ``report``, report each worker's exit (a restore order does not: the daemon
        already moved on to a new generation). The grace period ends early at the stop's
        deadline (a signalled supervisor) and once ``hurry`` is done (a second signal)."""
        workers, self._workers = self._workers, []
        reported = [w for w in workers if w.proc.returncode is not None]  # their watchers did
        for w in workers:
            if w.watcher is not None:
                w.watcher.cancel()
            signal_group(w.proc.pid, signal.SIGTERM)
            # A stopped process (SIGSTOP: a hang trainguard restores from) acts on the SIGTERM
            # only once continued, else it would take the whole grace (as systemd does too).
            signal_group(w.proc.pid, signal.SIGCONT)
        grace = self._c.grace_s
        if self._stop_by is not None:
            grace = max(0.0, min(grace, self._stop_by - time.monotonic()))
        if not workers:
            return
        exited = asyncio.ensure_future(asyncio.gather(*(w.proc.wait() for w in workers)))
        waits: set[asyncio.Future[Any]] = {exited} if hurry is None else {exited, hurry}
        await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        for w in workers:
            # The group may hold grandchildren (torchrun's workers) even after the leader died.
            signal_group(w.proc.pid, signal.SIGKILL)
        # Awaited, not cancelled: on Python 3.11 a cancelled gather ends with a CancelledError
        # nobody retrieves ("_GatheringFuture exception was never retrieved" at exit).
        codes = await exited
        for w, code in zip(workers, codes, strict=True):
            if w not in reported:
                self._gone(w, code, report=report)
                if not report:  # unreported on the bus, but not unlogged
                    log.info(
                        "worker stopped",
                        ranks=w.ranks,
                        pid=w.proc.pid,
                        generation=self._generation,
                        exit_code=code if code >= 0 else None,
                        signal=_signal_name(-code) if code < 0 else None,
                    )
            if w.stderr is not None:
                w.stderr.close()  # its process group is gone: nothing more to read


def _signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 40`` for a number without a name (real-time signals)."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


async def _job_records(
    bus: Bus, job_id: str, tp: TopicPartition, start: int, end: int
) -> AsyncIterator[bytes]:
    """The values of the job's records on ``tp`` from offset ``start`` to before ``end``, in
    order (one pass; records of other jobs and tombstones left out).

    Raises:
        BusError: the bus cannot be read.
    """
    if end <= start:
        return
    async with await bus.assign({tp: start}) as consumer:
        seen = start  # the next offset to see; a log trimmed by retention begins later
        while seen < end:
            for rec in await consumer.getmany(timeout_s=_ANSWER_POLL_S, max_records=10_000):
                if rec.key == job_id and rec.offset < end and rec.value:
                    yield rec.value
            # The consumer's position, past the markers of the daemon's transactions (its
            # ticks), which no record carries.
            seen = await consumer.position(tp)


async def _job_end(bus: Bus, topic: str, job_id: str) -> tuple[TopicPartition, int]:
    """The job's partition of ``topic`` and its end offset now.

    Raises:
        BusError: the bus cannot be read.
    """
    tp = TopicPartition(topic, partition_for(job_id, await bus.partitions(topic)))
    return tp, (await bus.end_offsets(topic))[tp]


def _audit_entry(value: bytes) -> dict[str, Any] | None:
    """An audit record's entry as plain JSON (``trainguard.daemon`` writes them), or ``None``
    for one that does not parse as an object."""
    try:
        entry = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    return entry if isinstance(entry, dict) else None


class _Judged(NamedTuple):
    """What the job's audit entries say of its finish, up to ``end`` (:func:`_judged`).

    Attributes:
        held: the daemon holds a restore.
        finished: the daemon found the whole job finished (every rank, of every node).
        end: the audit offset read up to.
    """

    held: bool
    finished: bool
    end: int


async def _judged(bus: Bus, job_id: str, tp: TopicPartition, since: _Judged) -> _Judged:
    """What the daemon decided of the job by its audit entries on ``tp`` from ``since.end``
    to the end, after ``since`` (what the entries before said): an entry with a
    ``restore_held`` anomaly holds a restore, a later one that issued a command, closed an
    incident or failed the job ends the hold (as :func:`_restore_held` judges); a transition
    to ``finished`` finishes the job.

    Raises:
        BusError: the bus cannot be read.
    """
    held, finished = since.held, since.finished
    end = (await bus.end_offsets("audit"))[tp]
    async for value in _job_records(bus, job_id, tp, since.end, end):
        entry = _audit_entry(value)
        if entry is None:
            continue
        kinds = _decision_kinds(entry)
        if "restore_held" in kinds:
            held = True
        elif kinds & {"issue", "incident_closed", "job_failed"}:
            held = False
        finished = finished or "finished" in kinds
    return _Judged(held, finished, max(since.end, end))


async def _diverged(bus: Bus, job_id: str, incident_id: str) -> bool:
    """Whether the job's audit records incident ``incident_id`` as opened with an onset step
    (a divergence: ``nan_loss``, ``loss_spike``, ``checksum_mismatch``), whose restore a finish
    never voids (``docs/recovery.md``, "A finish the daemon has not judged"). One pass over
    the job's audit partition: only a rejoining supervisor asks.

    Raises:
        BusError: the bus cannot be read.
    """
    tp, end = await _job_end(bus, "audit", job_id)
    async for value in _job_records(bus, job_id, tp, 0, end):
        entry = _audit_entry(value)
        decisions = None if entry is None else entry.get("decisions")
        for decision in decisions if isinstance(decisions, list) else ():
            if (
                isinstance(decision, dict)
                and decision.get("decision") == "incident_opened"
                and decision.get("incident_id") == incident_id
            ):
                return decision.get("onset_after_step") is not None
    return False


def _decision_kinds(entry: dict[str, Any]) -> set[str]:
    """The decisions of an audit entry by name (``issue``, ``incident_closed``, ...), with
    each anomaly's kind (``restore_held``, ...) and ``finished`` for a transition to that
    phase."""
    kinds: set[str] = set()
    decisions = entry.get("decisions")
    for decision in decisions if isinstance(decisions, list) else ():
        if isinstance(decision, dict):
            kinds.add(str(decision.get("decision")))
            if decision.get("decision") == "anomaly":
                kinds.add(str(decision.get("kind")))
            elif decision.get("decision") == "transition" and decision.get("new") == "finished":
                kinds.add("finished")
    return kinds


async def _restore_held(
    bus: Bus, job_id: str, sent: Delivery, tp: TopicPartition, start: int
) -> bool:
    """Whether the daemon holds the restore its decisions on the record ``sent`` of
    ``events`` opened or joined: its audit entry for that record (on ``tp``, at or after
    ``start``) holds a ``restore_held`` anomaly, and no later entry of the job issued a command
    or closed an incident. A held restore is issued later (``docs/recovery.md``: after a bus
    outage, or for a checkpoint in flight), though the daemon's group has read past the record.
    Audit entries are read as plain JSON (``trainguard.daemon`` writes them); one that does not
    parse is skipped.

    Raises:
        BusError: the bus cannot be read.
    """
    end = (await bus.end_offsets("audit"))[tp]
    held = False
    async for value in _job_records(bus, job_id, tp, start, end):
        entry = _audit_entry(value)
        if entry is None:
            continue
        kinds = _decision_kinds(entry)
        if (entry.get("partition"), entry.get("offset")) == (sent.partition, sent.offset):
            held = "restore_held" in kinds
        elif held and kinds & {"issue", "incident_closed", "job_failed"}:
            held = False
    return held


async def _finished_ranks(bus: Bus, job_id: str, generation: int) -> set[int]:
    """The ranks whose worker reported ``finished`` in ``generation`` on the job's partition
    of ``events``, read from its first record to its end offset at the call (one pass over
    the partition: only a rejoining supervisor asks)."""
    ends = await bus.end_offsets("events")
    tp = TopicPartition("events", partition_for(job_id, len(ends)))
    finished: set[int] = set()
    async for value in _job_records(bus, job_id, tp, 0, ends[tp]):
        if b'"finished"' not in value:  # most records are heartbeats: skip them undecoded
            continue
        with contextlib.suppress(SchemaError):
            event = decode(value, expect=Lifecycle)
            if (event.kind, event.generation) == ("finished", generation) and (
                event.rank is not None
            ):
                finished.add(event.rank)
    return finished


async def _finished_before(bus: Bus, job_id: str, generation: int) -> int | None:
    """The generation whose ranks all reported ``finished`` before any process joined
    ``generation`` (a restart restore's), or ``None``: the daemon's late-finish rule
    (``docs/recovery.md``, "A job that finished is never restored") applied to the job's
    partition of ``events`` as the daemon folds it, in order, from its first record to its
    end offset at the call.

    The ranks last ran in the latest generation below ``generation`` with an event of the job
    (job requests count, the daemon's ticks do not); the rule holds when the ranks that
    reported ``finished`` in it cover its world size (as its first event stating one says:
    a heartbeat, a rank's ``started``) before the first event of ``generation`` or later. One
    pass over the partition; only records of a new generation, ``finished`` reports and, until
    the generation's world size is known, records stating one are decoded.
    """
    ends = await bus.end_offsets("events")
    tp = TopicPartition("events", partition_for(job_id, len(ends)))
    end = ends[tp]
    last, world_size, finished = -1, None, set[int]()
    if end == 0:
        return None
    async with await bus.assign({tp: 0}) as consumer:
        seen = 0
        while seen < end:
            for rec in await consumer.getmany(timeout_s=_ANSWER_POLL_S, max_records=10_000):
                value = rec.value or b""
                if rec.key != job_id or rec.offset >= end:
                    continue
                named = _GENERATION.search(value)
                if named is None:
                    continue
                at = int(named[1])
                # Decoded: a record of a new generation, a finished, and one that states
                # the world size while the generation's is unknown.
                if at < last or (
                    at == last
                    and b'"finished"' not in value
                    and (world_size is not None or b'"world_size"' not in value)
                ):
                    continue
                try:
                    message = decode(value)
                except SchemaError:
                    continue
                if not isinstance(message, _JOINS) or message.job_id != job_id:
                    continue  # a tick, or no event of the job
                if message.generation >= generation:
                    return None  # someone joined: the restore stands
                if message.generation < last:
                    continue
                if message.generation > last:
                    last, world_size, finished = message.generation, None, set()
                if isinstance(message, Heartbeat | Lifecycle) and world_size is None:
                    world_size = message.world_size
                if (
                    isinstance(message, Lifecycle)
                    and message.kind == "finished"
                    and message.rank is not None
                ):
                    finished.add(message.rank)
            seen = await consumer.position(tp)
    if world_size is None or not set(range(world_size)) <= finished:
        return None
    return last


_JOINS = (Heartbeat, Checkpoint, DataCursorEvent, Lifecycle, JobRequest)
"""What the daemon takes in from a sender of a generation (its ticks are not among them)."""

_GENERATION = re.compile(rb'"generation":(\d+)')
"""The top-level ``generation`` of an encoded event (canonical JSON: sorted keys, no spaces;
no object nested in an event has one)."""


def _ended(abort: Abort) -> int:
    """Log how the daemon ended the job; the exit status that says it."""
    if abort.outcome == "stopped":
        log.warning("job stopped", generation=abort.generation, reason=abort.reason)
        return EXIT_STOPPED
    log.error("job aborted by the daemon", generation=abort.generation, reason=abort.reason)
    return EXIT_ABORTED


_SENT_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
"""Signals another process sends (a kill, the OOM killer, a stop): what the worker wrote last
does not say why it ended, so its exit report quotes nothing (a ``SIGABRT`` or ``SIGSEGV`` it
raised itself comes with its own words: ``terminate called ...``, ``Fatal Python error``)."""


def _is_request(data: bytes) -> bool:
    """Whether the encoded message ``data`` is a job request (a stop, a continue)."""
    try:
        decode(data, expect=JobRequest)
    except SchemaError:
        return False
    return True


def _remove_file(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)
