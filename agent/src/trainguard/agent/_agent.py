"""The :class:`Agent`: what a training loop calls at its step boundaries."""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar, cast
from urllib.parse import urlsplit

import structlog

from trainguard.agent._config import AgentConfig
from trainguard.agent._errors import (
    AgentError,
    ConfigError,
    JobAborted,
    RestoreMissed,
    RestoreRequested,
    RestoreTimeout,
    ShardError,
    ShardMissing,
    StaleGeneration,
)
from trainguard.agent._link import Commands, Link
from trainguard.agent.bus import BusConfig
from trainguard.agent.checkpoint._dcp import (
    DcpWrite,
    load_dcp,
    step_folder_uri,
    storage_writer,
)
from trainguard.agent.checkpoint._files import INDEX_KEY, files_index, index_files, verify_files
from trainguard.agent.checkpoint._manifests import fetch_manifest, read_job_manifests
from trainguard.agent.checkpoint._probe import probe_storage
from trainguard.agent.checkpoint._shards import (
    HostStager,
    capture_rng,
    load_shard,
    restore_rng,
    shard_path,
    write_shard,
)
from trainguard.agent.checkpoint._snapshot import Snapshot
from trainguard.agent.checkpoint._step_file import StepRecorder
from trainguard.agent.faults._injector import FaultInjector, Scalable
from trainguard.agent.faults._plan import parse_faults
from trainguard.schemas import (
    Abort,
    Checkpoint,
    DataCursor,
    Heartbeat,
    Lifecycle,
    LifecycleKind,
    Manifest,
    Phase,
    Restore,
    Resume,
    SnapshotRef,
    StepRange,
    StoredFile,
    encode,
    files_digest,
)

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.staging import AsyncStager

__all__ = ["RESERVED_KEY", "Agent", "AgentStats"]

RESERVED_KEY = "trainguard"
"""Key of the agent's own part of a shard (RNG states, cursor, step); not for user state."""

_FLUSH_S = 30.0
"""Seconds :meth:`Agent.load` waits for its error report to reach the bus before raising."""

_MESSAGE_CHARS = 4096
"""Longest lifecycle ``message`` (the wire contract's bound), characters."""

_T = TypeVar("_T")
_L = TypeVar("_L", bound=Scalable)


@dataclass(frozen=True, slots=True)
class AgentStats:
    """A snapshot of an agent's background work (background failures are counted, not raised).

    Attributes:
        connected: the background thread holds a working bus connection.
        queued: events waiting to be sent.
        sent: events the bus confirmed, and heartbeats the supervisor's relay took.
        relayed_heartbeats: heartbeats handed to the supervisor's relay
            (``heartbeat_relay``), which sends them batched.
        dropped_heartbeats: heartbeats never delivered (more than ``heartbeat_queue`` waited
            while the bus was slow or away, or their send failed).
        dropped_cursors: data-cursor events dropped to make room in a full outbox
            (``outbox_max_events``).
        refused_events: checkpoint and lifecycle events refused by a full outbox.
        send_errors: failed connect, send and poll attempts (each retried).
        last_error: the latest of those failures, as text, or ``None``.
        commands_ignored: commands not acted on (older generations, undecodable ones, and with
            the daemon's public keys unsigned, badly signed, other jobs' and replayed ones).
        commands_ignored_by_reason: the same by reason (``unsigned``, ``bad_signature``,
            ``replayed``, ...; see ``trainguard.agent.keys._command_gate``).
        checkpoints_written: shards written and announced.
        checkpoint_failures: shards that could not be written (their futures hold the error).
    """

    connected: bool
    queued: int
    sent: int
    dropped_heartbeats: int
    send_errors: int
    last_error: str | None
    commands_ignored: int
    checkpoints_written: int
    checkpoint_failures: int
    commands_ignored_by_reason: Mapping[str, int] = dataclasses.field(default_factory=dict)
    dropped_cursors: int = 0
    refused_events: int = 0
    relayed_heartbeats: int = 0


class Agent:
    """One rank's connection to trainguard. Use as a context manager around training.

    Typical loop (the complete example is ``examples/charlm/train.py``)::

        with Agent(job_id="my-job") as agent:        # or TRAINGUARD_JOB; RANK, WORLD_SIZE
            model, optim, sampler, loader = build()   # seeds, initial parameters
            step = 0
            if (target := agent.restore_target()) is not None:
                sampler.load_state_dict(target.cursor)
                state = agent.load(target)            # digest-verified; RNG states restored
                model.load_state_dict(state["model"])
                optim.load_state_dict(state["optim"])
                step = target.step
            if agent.skip is not None:                # a loss spike's batches: never again
                sampler.skip(agent.skip, restored_step=step)
            # After a restore: acknowledge it and wait for the daemon's resume.
            agent.ready(step, cursor=sampler.cursor)
            agent.watch(model)                        # parameter checksums (optional)
            while step < total_steps:                 # one pass over the loader per epoch
                for batch in loader:
                    step += 1
                    loss = agent.perturb_loss(step, forward(batch))  # fault injection (optional)
                    loss.backward(); optim.step()
                    agent.step(step, loss=loss.item(), samples=len(batch))
                    if step % 50 == 0:
                        state = {"model": model.state_dict(), "optim": optim.state_dict()}
                        agent.checkpoint(step, state, cursor=sampler.cursor, blocking=False)
                    if step == total_steps:
                        break

    **Starting from another job's snapshot.** With ``init_from`` set to a committed snapshot of
    another job (``TRAINGUARD_INIT_FROM``, ``trainguard run --init-from``; see
    :class:`AgentConfig`), :meth:`restore_target` returns that snapshot in generation 0, and
    the same loop loads it (a fine-tune, or a continuation under a new job id). The job's
    checkpoints, and so its committed snapshots, name it as their ``parent``
    (``trainguard checkpoints lineage``).

    **Restoring in process.** With ``in_process_restore`` set (see :class:`AgentConfig`), an
    in-process restore of the daemon makes :meth:`step` raise :class:`RestoreRequested` at the
    step boundary it names; the loop catches it, loads the target as above (the same calls,
    plus :attr:`skip`) and calls :meth:`ready` again, without exiting. ``examples/charlm``
    shows the loop.

    **Cost and threads.** :meth:`step` costs under a microsecond (0.5 us in a tight loop on
    CPython 3.11, a parameter checksum every ``checksum_every`` steps aside) and does no I/O;
    heartbeats are built and sent by a background thread every ``heartbeat_interval_s`` seconds,
    also while the training thread is stuck (that is how the daemon tells a hang from a death).
    The bus may be down, locked or slow at any time, also at start-up: events wait in a queue
    and are sent once it is back (see :mod:`._link`). Call the methods from the training
    thread.

    **Bitwise-exact resume.** A shard holds the user state plus the torch (CPU), Python and
    NumPy RNG states, which :meth:`load` puts back. Anything that draws random numbers between
    :meth:`load` and the first step shifts the streams, and the most common culprit is a
    ``DataLoader`` without a generator of its own: every ``iter(loader)`` draws a seed from
    torch's global generator, so give each loader ``generator=torch.Generator().manual_seed(s)``.
    With a ``ResumableDistributedSampler`` the data cursor to checkpoint is ``sampler.cursor``
    (a loader without workers), or ``sampler.cursor_after(batches_of_this_pass)`` (exact
    whatever the loader prefetches). With 3 or more ranks, DDP must average the gradients with
    :func:`~trainguard.agent.ordered_allreduce` (``docs/bitwise.md``; :meth:`watch` warns).

    **Errors.** Calls at step boundaries do not raise for background trouble (bus errors,
    failed shard writes): it is counted in :attr:`stats`, logged, and kept in checkpoint
    futures. The restore calls raise, as a restarted process cannot train without them.

    Args:
        config: a prepared configuration; otherwise one is resolved from ``settings`` and the
            environment (see :class:`AgentConfig` for names and precedence).
        **settings: :class:`AgentConfig` fields, e.g. ``job_id=...``, ``bus_url=...``.

    Raises:
        ConfigError: a setting is missing or invalid, both ``config`` and ``settings`` were
            given, or the storage of ``checkpoint_uri`` refused a test write (with
            ``probe_storage``; the message names the URI and the storage's reason).
        StorageUnavailable: the storage of ``checkpoint_uri`` did not answer the test write
            (with ``probe_storage``, after a few attempts, at most about a minute).
    """

    def __init__(self, config: AgentConfig | None = None, **settings: Any) -> None:
        if config is not None and settings:
            raise ConfigError("pass either config or settings, not both")
        self.config = config if config is not None else AgentConfig.resolve(**settings)
        c = self.config
        self._log = structlog.get_logger("trainguard.agent").bind(
            job_id=c.job_id, rank=c.rank, generation=c.generation
        )
        uri = c.checkpoint_uri
        if c.probe_storage and uri is not None and urlsplit(uri).scheme != "file":
            # Before anything starts: a wrong bucket is found now, not at the first
            # checkpoint of a job that may run for hours without one.
            undeleted = probe_storage(uri, c.job_id, c.rank)
            if undeleted is not None:
                self._log.warning(
                    "checkpoint storage took a test write but refused its delete: an empty "
                    ".trainguard-probe object stays in the job's folder",
                    checkpoint_uri=uri,
                    error=undeleted,
                )
        self._pid = os.getpid()
        self._root = c.checkpoint_dir.resolve()
        self._phase: Phase = "init"
        # (step, loss, samples so far, step time in s, monotonic time the step completed in
        # this process): replaced as a whole, so the loop thread never sees a step with another
        # step's loss.
        self._progress: tuple[int, float | None, int, float | None, float | None] = (
            0,
            None,
            0,
            None,
            None,
        )
        self._last_step_at: float | None = None
        faults = parse_faults(c.faults)
        self._faults = FaultInjector(faults, c.rank, self._root / c.job_id / ".faults-fired")
        # step() skips the injector's hooks altogether in a job without faults (the usual one).
        self._faults_armed = bool(faults)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-ckpt")
        self._pending: Future[Checkpoint] | None = None
        self._written = 0
        self._write_failures = 0
        self._stager = HostStager()  # also DCP's async_stager
        # DCP only, made at the first DCP checkpoint or load (see _dcp_group).
        self._dcp_pg: tuple[ProcessGroup | None] | None = None
        self._restore: Restore | None = None
        self._initial: Snapshot | None = None  # init_from's snapshot, once read
        self._skip: StepRange | None = None
        self._reported: BaseException | None = None
        self._state = "new"
        # The in-process restore protocol: the loop thread adopts a restore and the training
        # thread stops at its at_step; the gate makes "which step is done" and "is a restore
        # pending" one decision, so a restore is either taken at at_step or declined, never
        # both (docs/wire-contract.md, restore).
        self._gate = threading.Lock()
        self._in_process: Restore | None = None
        self._training = False  # ready() returned: the loop is at step boundaries now
        self._watched: nn.Module | None = None
        self._steps = self._step_recorder()
        # The mapped step of the supervisor's step file, stored into directly by step().
        self._step_cell = None if self._steps is None else self._steps.cell
        self._link = Link(
            BusConfig(
                url=c.bus_url,
                prefix=c.topic_prefix,
                client_id=f"agent-{c.rank}",
                security=c.kafka_security,
                # Commands reach a training process rarely and a quarter second late is fine
                # (supervisors, which act on restores, keep the fast default); polling the
                # embedded bus every 20 ms cost each rank ~2% of a core.
                idle_poll_s=0.25,
            ),
            c.job_id,
            c.generation,
            ring=c.heartbeat_queue,
            max_events=c.outbox_max_events,
            spool=c.spool_dir,
            beat=self._heartbeat,
            interval_s=c.heartbeat_interval_s,
            log=self._log,
            on_command=self._on_command,
            verify_keys=c.keys.verify,
            event_key=c.keys.event,
            relay=c.heartbeat_relay,
        )

    def _step_recorder(self) -> StepRecorder | None:
        """The recorder of ``config.step_file``, or ``None`` (none set, or it cannot be
        mapped: the supervisor then reports exits without the step, as for plain mode)."""
        path = self.config.step_file
        if path is None:
            return None
        try:
            return StepRecorder(path)
        except (OSError, ValueError) as exc:
            self._log.warning("step file not used", path=str(path), error=str(exc))
            return None

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        """Start the background thread and announce ``started`` (with the world size).

        Returns at once: the thread connects to the bus on its own.

        Raises:
            AgentError: the agent was entered before.
        """
        if self._state != "new":
            raise AgentError("an Agent can be entered only once")
        self._state = "open"
        self._lifecycle("started", world_size=self.config.world_size)
        self._link.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Wait for a pending checkpoint write, announce ``finished`` (no exception, or
        ``SystemExit`` with status 0; after a last heartbeat sent as reliably, so that the
        daemon judges the final progress, its loss, before the finish) or ``error`` (with the
        exception as message), close.

        Raises:
            RestoreMissed: the loop ended normally before the ``at_step`` of an in-process
                restore the daemon ordered; the daemon was told (as for any missed
                in-process restore), and restarts the job from its target.
        """
        try:
            self.wait_checkpoints()
            step = self._progress[0]
            if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
                with self._gate:
                    missed, self._in_process = self._in_process, None
                if missed is not None:
                    why = f"the training loop ended at step {step}, before it"
                    self._decline(missed, step, why)
                    raise RestoreMissed(
                        f"in-process restore of generation {missed.generation} at step "
                        f"{missed.at_step} missed: {why}; the daemon restarts the job from the "
                        "restore's target"
                    )
                # The last progress first (its loss, and the watched model's checksum): a
                # divergence or a flipped bit in the final heartbeat interval is judged before
                # the finish, and restored.
                self._link.submit(self._last_heartbeat(), reliable=True)
                self._lifecycle("finished", step=step)
            elif exc is not self._reported and not isinstance(exc, JobAborted | StaleGeneration):
                # The daemon's own orders (abort, a newer generation) need no error report.
                self._lifecycle("error", step=step, message=_describe(exc))
        finally:
            self.close()

    def close(self, timeout_s: float | None = None) -> None:
        """Finish a pending checkpoint write, send the queued events (waiting at most
        ``timeout_s`` seconds for the bus, default ``close_timeout_s``), stop the background
        thread. Events left unsent stay in the spool (``spool_dir``) for the supervisor to
        forward, or are lost without one (logged either way). Idempotent."""
        if self._state == "closed":
            return
        self._state = "closed"
        self._writer.shutdown(wait=True)
        self._stager.close()
        self._link.close(self.config.close_timeout_s if timeout_s is None else timeout_s)
        self._step_cell = None
        if self._steps is not None:
            self._steps.close()

    @property
    def stats(self) -> AgentStats:
        """Counters of the background work (see :class:`AgentStats`)."""
        link = self._link
        return AgentStats(
            connected=link.connected,
            queued=link.queued,
            sent=link.sent,
            relayed_heartbeats=link.relayed_heartbeats,
            dropped_heartbeats=link.dropped_heartbeats,
            send_errors=link.send_errors,
            last_error=link.last_error,
            commands_ignored=link.commands.ignored.total(),
            checkpoints_written=self._written,
            checkpoint_failures=self._write_failures,
            commands_ignored_by_reason={str(k): n for k, n in link.commands.ignored.items()},
            dropped_cursors=link.dropped_cursors,
            refused_events=link.refused_events,
        )

    # -- restore -----------------------------------------------------------------------------

    def restore_target(self, timeout_s: float | None = None) -> Snapshot | None:
        """The snapshot this process must resume from, or ``None`` for a fresh start.

        Generation 0 starts from the job's initial state and returns at once: ``None``, or
        with ``init_from`` set, that snapshot of another job (its manifest, read from the
        bus's ``manifests`` topic). A process started for generation g > 0
        (``TRAINGUARD_GENERATION``, set by the supervisor) waits for the daemon's ``restore``
        command of g on the ``commands`` topic and returns its target; when that is ``None``
        (no step of the job committed yet), the job's initial state again.

        The command names the target by id and manifest digest; the manifest's head is read
        from beside the checkpoint (or, for a manifest small enough to be published whole,
        from the bus) and checked against the digest here, and the shards' list part by part
        as :meth:`load` needs them (``docs/checkpoints.md``, "Manifests").

        Args:
            timeout_s: seconds to wait for the command, and for reading ``init_from``'s
                manifest; default ``config.restore_timeout_s``.

        Raises:
            RestoreTimeout: the command did not arrive in time, or the bus could not be read.
            ConfigError: ``init_from`` names no committed snapshot on the bus.
            ShardError: the target's manifest is missing or is not the one the command names
                (reported to the daemon first, as :meth:`load` does: it restores an older
                snapshot).
            JobAborted: the daemon aborted the job.
            StaleGeneration: the daemon has already moved on to a newer generation.
            AgentError: called outside the ``with`` block.
        """
        self._require_open()
        generation = self.config.generation
        wait_s = self.config.restore_timeout_s if timeout_s is None else timeout_s
        if generation == 0:
            return self._initial_target(wait_s)
        self._restore = self._await(
            lambda commands: commands.restores.get(generation),
            wait_s,
            f"the restore command of generation {generation}",
        )
        self._skip = self._restore.skip
        target = self._restore.target
        return self._open(target) if target is not None else self._initial_target(wait_s)

    def _open(self, ref: SnapshotRef) -> Snapshot:
        """The snapshot ``ref`` names, its manifest checked (:meth:`Snapshot.open`); a failure
        is reported like a shard's (:meth:`_failed_load`) and raised."""
        try:
            return Snapshot.open(ref, lambda: self._manifest_on_bus(ref.snapshot_id))
        except ShardError as exc:
            self._failed_load(ref.job_id, ref.snapshot_id, ref.step, exc)
            raise

    def _manifest_on_bus(self, snapshot_id: str) -> list[Manifest]:
        """The whole (signed, with keys) manifests of ``snapshot_id`` on the bus; none when the
        bus cannot be read."""
        c = self.config
        try:
            job = snapshot_id.partition("/")[0]
            log = read_job_manifests(
                self._bus_config(), job, c.restore_timeout_s, c.keys.verify, snapshot_id
            )
        except RestoreTimeout:
            return []
        return [m for m in log.manifests if m.snapshot_id == snapshot_id]

    def _bus_config(self) -> BusConfig:
        """A bus connection's settings for reading ``manifests`` outside the link."""
        c = self.config
        return BusConfig(
            url=c.bus_url,
            prefix=c.topic_prefix,
            client_id=f"agent-{c.rank}",
            security=c.kafka_security,
        )

    def _initial_target(self, timeout_s: float) -> Snapshot | None:
        """The job's initial state: ``init_from``'s snapshot (read once), or ``None``."""
        c = self.config
        if c.init_from is None:
            return None
        if self._initial is None:
            self._initial = Snapshot.of(
                fetch_manifest(self._bus_config(), c.init_from, timeout_s, c.keys.verify)
            )
            self._log.info("init_from", snapshot_id=c.init_from, step=self._initial.step)
        return self._initial

    @property
    def skip(self) -> StepRange | None:
        """Steps whose batches this process must not train on, or ``None``: the ``skip`` of
        the restore it started from (:meth:`restore_target`) or last reloaded in process.

        The daemon sets it for a loss spike (``docs/detection.md``). Honour it like this: train
        the steps after the restored one as usual until the step about to be trained is
        ``skip.from_step``; there move the data cursor forward by ``skip.to_step -
        skip.from_step + 1`` global batches and train ``from_step`` on the batch that follows.
        Step numbers are unchanged. A ``ResumableDistributedSampler`` does all of it:
        ``sampler.skip(agent.skip, restored_step=step)`` right after loading the target.
        """
        return self._skip

    def load(
        self, target: Snapshot | SnapshotRef | Manifest, state: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Verify and load this rank's part of ``target``; put back the RNG states it holds.

        ``target`` is what :meth:`restore_target` returned (or a :class:`RestoreRequested`'s
        ``target``), a restore command's reference (its manifest is read and checked first),
        or a whole manifest.

        Call it last before the training loop: anything drawing random numbers after it changes
        the streams that resumed training sees.

        A ``torch.save`` snapshot: the rank's shard is read into memory once, its SHA-256
        checked against the manifest, and only then deserialized with
        ``torch.load(weights_only=True)``, on the CPU; ``state`` is not used. It loads only
        onto the world size it was written with.

        A DCP snapshot (``checkpoint_format="dcp"``): every rank calls ``load`` together, with
        ``state`` the state dict to fill in place, shaped for the current mesh (e.g.
        ``get_state_dict(model, optimizer)``; then ``set_state_dict``). ``dcp.load`` reshards
        onto any world size; each file is read whole and checked against its digest before
        DCP deserializes a byte of it. The RNG states are put back when the snapshot has this
        rank's (it was written by more than ``rank`` ranks).

        Returns:
            A ``torch.save`` snapshot: the ``state`` given to :meth:`checkpoint` (tensors on
            the CPU). DCP: ``state``, filled.

        Raises:
            ShardCorrupt: the shard's digest does not match; nothing was deserialized.
            ShardMissing: the shard file is gone, or ``target`` has no shard for this rank.
            ShardError: the shard cannot be read or deserialized.
            AgentError: called outside the ``with`` block, or a DCP snapshot without
                ``state`` (nothing is reported then).

            Before raising, a lifecycle ``error`` is sent (and given up to 30 s to reach the
            bus). For a snapshot of this job it names ``target.snapshot_id``, so that the
            daemon stops using that snapshot and retries the restore from an older one. For
            the job's ``init_from`` it names that snapshot too and says that this rank cannot
            start from it: the daemon never restores it again, and fails a job with no
            snapshot of its own at once. For any other snapshot it names none.
        """
        self._require_open()
        rank = self.config.rank
        into = state
        if isinstance(target, SnapshotRef):
            target = self._open(target)
        elif isinstance(target, Manifest):
            target = Snapshot.of(target)
        try:
            first = target.shard(0)
            if first is not None and first.files is not None:
                if into is None:
                    raise AgentError(
                        f"snapshot {target.snapshot_id} is a DCP checkpoint: it loads in place "
                        "into a state dict, so pass state= (e.g. get_state_dict(model, "
                        "optimizer)'s)"
                    )
                own = load_dcp(target, into, rank, process_group=self._dcp_group())
                if own is not None:
                    restore_rng(own["rng"])
                return into
            shard = target.shard(rank)
            if shard is None:
                raise ShardMissing(
                    f"snapshot {target.snapshot_id} has no shard for rank {rank}: it was taken "
                    f"at world size {target.world_size}, this job runs {self.config.world_size} "
                    "ranks; a torch.save snapshot loads only onto its own world size (DCP "
                    "snapshots reshard: checkpoint_format='dcp')"
                )
            state = load_shard(shard.uri, shard.digest)
            own = state.pop(RESERVED_KEY, None)
            if not isinstance(own, dict) or "rng" not in own:
                raise ShardError(f"shard {shard.uri} was not written by a trainguard agent")
            restore_rng(own["rng"])
        except ShardError as exc:
            self._failed_load(target.job_id, target.snapshot_id, target.step, exc)
            raise
        return state

    def _failed_load(self, job_id: str, snapshot_id: str, step: int, exc: ShardError) -> None:
        """Report that this rank cannot load snapshot ``snapshot_id`` (of job ``job_id``, at
        ``step``), as :meth:`load` says, and give the report up to 30 s to reach the bus."""
        self._reported = exc
        if job_id == self.config.job_id:
            self._lifecycle("error", step=step, snapshot_id=snapshot_id, message=_describe(exc))
        else:
            initial = snapshot_id == self.config.init_from
            self._lifecycle(
                "error",
                step=self._progress[0],
                snapshot_id=snapshot_id if initial else None,
                message=_describe_init(snapshot_id, exc),
            )
        self._link.flush(_FLUSH_S)

    def ready(self, step: int, cursor: DataCursor | None = None) -> None:
        """Declare this rank ready to train from ``step`` (the next step is ``step + 1``).

        A heartbeat reports ``step`` at once: the daemon then knows where this rank starts
        (heartbeats before it say step 0, which the daemon does not take for a trained step as
        long as the phase is ``init``). After a restore (generation > 0) this acknowledges it
        with a lifecycle ``restored`` (step, cursor, the snapshot loaded) and blocks until the
        daemon's ``resume`` of this generation, which it sends once every rank has
        acknowledged exactly the target's step and data position (``docs/recovery.md``); that
        keeps all ranks of a job in one generation. Call it again after reloading for a
        :class:`RestoreRequested`.

        Args:
            step: the step the model state corresponds to (0 for a fresh start).
            cursor: the data cursor at ``step``. Required after a restore to a snapshot (every
                snapshot has one): an acknowledgement without it, or at another position, is
                a failed restore of this rank, and the daemon orders the restore again.

        Raises:
            RestoreTimeout: no ``resume`` within ``config.resume_timeout_s`` seconds.
            JobAborted: the daemon aborted the job.
            StaleGeneration: the daemon has already moved on to a newer generation.
            AgentError: called outside the ``with`` block.
        """
        self._require_open()
        with self._gate:
            self._progress = (step, None, self._progress[2], None, None)
        if self._steps is not None:
            self._steps.record(step)  # where the rank stands now, for an exit report
        self._link.submit(self._heartbeat)
        generation = self.config.generation
        if generation > 0:
            restore = self._restore or self._link.commands.restores.get(generation)
            target = restore.target if restore is not None else None
            if target is not None and cursor is None:
                # The daemon resumes only acknowledgements at the target's data position.
                self._log.warning(
                    "restore acknowledged without a data cursor: the daemon will not resume "
                    "it (pass cursor= the sampler's position, docs/recovery.md)",
                    step=step,
                    snapshot_id=target.snapshot_id,
                )
            self._lifecycle(
                "restored",
                step=step,
                cursor=cursor,
                snapshot_id=target.snapshot_id if target is not None else None,
            )
            self._await(
                lambda commands: commands.resumes.get(generation),
                self.config.resume_timeout_s,
                f"the resume command of generation {generation}",
            )
        self._last_step_at = time.monotonic()
        self._training = True

    def _require_open(self) -> None:
        if self._state != "open":
            raise AgentError(f"the agent is {self._state}: call this inside 'with Agent(...)'")

    def _await(self, get: Callable[[Commands], _T | None], timeout_s: float, what: str) -> _T:
        """Wait for ``get(commands)`` to return a command; raise for abort, fencing, timeout."""
        commands = self._link.commands
        generation = self.config.generation
        commands.wait(
            lambda: (
                get(commands) is not None
                or commands.aborted is not None
                or commands.newest_generation > generation
            ),
            timeout_s,
        )
        if commands.aborted is not None:
            raise JobAborted(f"the daemon aborted the job: {commands.aborted.reason}")
        if commands.newest_generation > generation:
            raise StaleGeneration(
                f"waiting for {what}, but the daemon is at generation "
                f"{commands.newest_generation} already"
            )
        found = get(commands)
        if found is None:
            link = self._link
            detail = "" if link.connected else f"; not connected to the bus ({link.last_error})"
            raise RestoreTimeout(f"{what} did not arrive in {timeout_s:g} s{detail}")
        return found

    # -- the training thread's per-step calls ------------------------------------------------

    def step(self, step: int, *, loss: float | None = None, samples: int = 0) -> None:
        """Record that training step ``step`` completed: about a microsecond, no I/O.

        Also, in this order: a fault of ``TRAINGUARD_FAULTS`` scheduled for this step fires
        (see :mod:`._faults`); every ``checksum_every`` steps the watched model's parameter
        checksum is queued in a heartbeat of exactly this step, which leaves with the next
        periodic one, as reliably as a checkpoint event (:meth:`watch`); and at the
        ``at_step`` of an in-process restore the daemon ordered, :class:`RestoreRequested` is
        raised.

        Args:
            step: the step just completed (``start + 1``, ``start + 2``, ...).
            loss: its loss as a Python number (pass ``loss.item()``, not a tensor, which would
                wait for the device); NaN and infinities are reported as such.
            samples: samples this rank consumed in the step.

        Raises:
            RestoreRequested: ``step`` is the ``at_step`` of an in-process restore (only with
                the ``in_process_restore`` setting). Pending checkpoint writes are finished
                first.
            ConfigError, RestoreTimeout: instead, as :meth:`restore_target`, when that restore
                targets the job's initial state and ``init_from``'s manifest cannot be read.
            RuntimeError: an ``error`` fault of ``TRAINGUARD_FAULTS`` scheduled for this step.
        """
        now = time.monotonic()
        last = self._last_step_at
        armed = self._faults_armed
        if armed and self._faults.pace(step, 0.0 if last is None else now - last):
            now = time.monotonic()
        with self._gate:
            self._last_step_at = now
            self._progress = (
                step,
                None if loss is None else float(loss),
                self._progress[2] + samples,
                None if last is None else now - last,
                now,
            )
            request = self._in_process
            if request is not None and request.at_step is not None and step >= request.at_step:
                self._in_process = None
            else:
                request = None
        cell = self._step_cell
        if cell is not None:
            # Before a fault may end the process: the supervisor reports this step then.
            # (try/except, not contextlib.suppress: free when nothing is raised, per step.)
            try:  # noqa: SIM105
                cell[0] = step
            except (TypeError, ValueError, OverflowError):
                pass  # not an int64 step: the exit report falls back to the heartbeats'
        self._phase = "train"
        if armed:
            self._faults.after_step(step)
        if self._watched is not None:
            every = self.config.checksum_every
            if every and step % every == 0:
                self._send_checksum(self._watched)
        if request is not None:
            self._stop(request, step)

    def watch(self, model: nn.Module) -> None:
        """Register ``model`` (a ``torch.nn.Module``; the module itself, not a DDP wrapper, is
        fine: their parameters are the same tensors): every ``checksum_every`` steps
        :meth:`step` queues a heartbeat with a checksum of its parameters (sent with the next
        periodic heartbeat, within ``heartbeat_interval_s``, as reliably as a checkpoint
        event), so that the daemon can compare the
        data-parallel replicas (``parameter_checksum`` in :mod:`._checksum`: an exact integer
        sum of the parameters' bits on their device, hashed; any single flipped bit changes
        it), and the ``bitflip`` fault corrupts it. Call it again after replacing the model.

        Replicas must be bitwise equal for their checksums to agree: do not watch a model whose
        ranks legitimately differ (independent replicas, sharded parameters).

        With 3 or more ranks, rank 0 logs a warning (``restores_not_bitwise``) when ``model``
        does not average its gradients with :func:`~trainguard.agent.ordered_allreduce`: DDP's
        own all-reduce sums in an order that a restarted process changes, so a restored run
        drifts from the uninterrupted one in the last bits (``docs/bitwise.md``).
        """
        self._watched = model
        self._faults.watch(model)
        c = self.config
        if c.world_size >= 3 and c.rank == 0:
            from trainguard.agent._ddp import averages_in_fixed_order

            if not averages_in_fixed_order(model):
                self._log.warning(
                    "restores_not_bitwise",
                    world_size=c.world_size,
                    why="the watched model's gradients are not averaged by "
                    "trainguard.agent.ordered_allreduce: DDP's all-reduce sums each element in "
                    "an order that depends on its bucket layout, which a restarted process "
                    "rebuilds, so with 3 or more ranks a restored run is not bitwise equal to "
                    "an uninterrupted one (docs/bitwise.md)",
                )

    @property
    def perturbs_loss(self) -> bool:
        """Whether ``TRAINGUARD_FAULTS`` plans a ``nan`` or ``spike`` fault for this rank.
        Without one, :meth:`perturb_loss` returns every loss untouched, and a loop whose step
        costs microseconds may skip calling it (the Lightning callback does)."""
        return self._faults.perturbs_loss

    def perturb_loss(self, step: int, loss: _L) -> _L:
        """``loss`` of training step ``step`` as the ``nan`` and ``spike`` faults of
        ``TRAINGUARD_FAULTS`` make it: multiplied by NaN or by the spike's factor, or
        ``loss`` itself, untouched (a dictionary lookup) when no such fault applies.

        Call it between computing the loss and differentiating it, so that a fault changes
        the gradients (and so the parameters) too, as a real divergence would::

            loss = agent.perturb_loss(step, criterion(model(x), y))
            loss.backward()

        Args:
            step: the step being trained (the one :meth:`step` will then report).
            loss: a tensor or a number.
        """
        return self._faults.loss(step, loss)

    def _last_heartbeat(self) -> Callable[[int], Heartbeat]:
        """The builder of this rank's last heartbeat: its progress now, with the watched
        model's parameter checksum (:meth:`watch`) if there is one and checksums are on
        (``checksum_every``), so that the replicas' final states are compared too. A checksum
        that cannot be computed is left out (logged): the finish goes on."""
        model = self._watched
        if model is None or not self.config.checksum_every:
            return self._heartbeat
        try:
            return self._checksummed(model)
        except Exception as exc:  # the finish must not fail on a diagnostic
            self._log.warning("final_checksum_failed", error=_describe(exc))
            return self._heartbeat

    def _send_checksum(self, model: nn.Module) -> None:
        # Reliable: on the bus in seq order with the rank's other events, never evicted nor
        # through the node's heartbeat relay, whose batches a checkpoint or cursor event sent
        # meanwhile overtakes (the daemon then skips the batched heartbeat as stale: the
        # checksum was lost). No wake-up of the link's thread: it would take the GIL from
        # training for about 0.5 ms; the next periodic heartbeat takes this one along.
        self._link.submit(self._checksummed(model), reliable=True, wake=False)

    def _checksummed(self, model: nn.Module) -> Callable[[int], Heartbeat]:
        """The builder of a heartbeat carrying ``model``'s parameter checksum now."""
        from trainguard.agent.checkpoint._checksum import parameter_checksum

        checksum = parameter_checksum(model)
        return lambda seq: dataclasses.replace(self._heartbeat(seq), param_checksum=checksum)

    # -- in-process restores --------------------------------------------------------------------

    def _on_command(self, command: Restore | Resume | Abort) -> None:
        """A command arrived (loop thread): adopt a newer in-process restore, or decline it at
        once when this process cannot stop at its ``at_step``."""
        if not isinstance(command, Restore) or command.mode != "in_process":
            return
        at_step = command.at_step
        try:
            with self._gate:
                if command.generation <= self.config.generation or at_step is None:
                    return
                done = self._progress[0]
                why = (
                    "this training loop does not reload in process (in_process_restore is off)"
                    if not self.config.in_process_restore
                    else "not training yet"
                    if not self._training
                    else f"already at step {done}"
                    if done >= at_step
                    else None
                )
                self._adopt(command)
                if why is None:
                    self._in_process = command
                    self._log.warning(
                        "in_process_restore_ordered", at_step=at_step, reason=command.reason
                    )
                    return
            self._decline(command, done, why)
        except Exception:
            # The loop thread must live on; the daemon's restore timeout covers the silence.
            self._log.exception("in_process_restore_failed", generation=command.generation)

    def _adopt(self, restore: Restore) -> None:
        """Run in ``restore``'s generation from now on (events, shards, acknowledgements)."""
        self.config = dataclasses.replace(self.config, generation=restore.generation)
        self._restore = restore
        self._log = self._log.bind(generation=restore.generation)

    def _decline(self, restore: Restore, step: int, why: str) -> None:
        """Tell the daemon this rank cannot stop at ``restore``'s ``at_step`` (it restarts the
        processes instead)."""
        message = f"in-process restore at step {restore.at_step} missed: {why}"
        self._log.warning("in_process_restore_declined", at_step=restore.at_step, why=why)
        self._lifecycle("error", step=step, message=message, missed_at_step=restore.at_step)

    def _stop(self, restore: Restore, step: int) -> None:
        """At or past ``restore``'s ``at_step``: raise :class:`RestoreRequested`, or decline a
        restore whose step this loop jumped over."""
        if step != restore.at_step:
            self._decline(restore, step, f"the loop went from before it to step {step}")
            return
        self._faults.end_generation()
        self._training = False
        self._skip = restore.skip
        # A write of the abandoned timeline must not land after the reload.
        self.wait_checkpoints()
        if restore.target is None:
            target = self._initial_target(self.config.restore_timeout_s)
        else:
            target = self._open(restore.target)
        raise RestoreRequested(restore, target)

    def phase(self, phase: Phase) -> None:
        """Declare what this rank is doing (``train``, ``checkpoint``, ``eval``, ``data``,
        ``init``) and send a heartbeat saying so at once; the daemon gives declared long phases
        their own time limits. :meth:`step` sets ``train`` again."""
        self._phase = phase
        self._link.submit(self._heartbeat)

    def _heartbeat(self, seq: int) -> Heartbeat:
        """This rank's heartbeat now (built on any thread; ``_progress`` is replaced whole)."""
        c = self.config
        step, loss, samples, step_time_s, done_at = self._progress
        return Heartbeat(
            job_id=c.job_id,
            generation=c.generation,
            ts=time.time_ns(),
            seq=seq,
            rank=c.rank,
            host=c.host,
            pid=self._pid,
            world_size=c.world_size,
            step=step,
            phase=self._phase,
            step_time_s=step_time_s,
            loss=loss,
            samples=samples,
            # How long ago the step completed: the daemon dates its progress by it.
            step_age_s=None if done_at is None else max(0.0, time.monotonic() - done_at),
        )

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        cursor: DataCursor,
        blocking: bool = True,
    ) -> Future[Checkpoint]:
        """Write this rank's shard of ``step`` and announce it once it is durable.

        The shard holds ``state`` (tensors and nested dicts/lists/tuples of tensors, numbers
        and strings) and, under the key :data:`RESERVED_KEY`, the RNG states, ``cursor`` and
        ``step``. It is written atomically (temporary file, fsync, rename, fsync of the folder)
        under ``<checkpoint_dir>/<job>/g<generation:06>/s<step:010>/rank<rank:05>.pt`` with its SHA-256
        computed while writing; then a ``checkpoint`` event carries URI, size, digest, cursor
        and metadata. The daemon commits ``step`` once every rank's shard is in.

        With ``checkpoint_format="dcp"`` (``docs/checkpoints.md``), ``state`` is a DCP state
        dict (``get_state_dict(model, optimizer)``'s, DTensors welcome) and every rank must
        call this at the same step: it is written with ``torch.distributed.checkpoint``
        (``dcp.save``, or ``dcp.async_save`` when not ``blocking``) into
        ``<checkpoint_uri>/<job>/g<generation:06>/s<step:010>/``, each file digested as it is
        written; the RNG states, cursor and step go into this rank's
        ``trainguard.rank<rank:05>.pt`` beside it, and the event lists the rank's files.

        One write runs at a time: a call first waits for the previous write to finish, in the
        declared phase ``checkpoint``. ``blocking=True`` writes on the calling thread, declaring
        the phase ``checkpoint`` meanwhile. ``blocking=False`` makes the calling thread pay only
        for copying ``state`` to host memory, into buffers kept and reused across
        checkpoints (:class:`~trainguard.agent.checkpoint.HostStager`, in both formats); a
        background thread writes and announces it.

        Returns:
            A future of the announced event (``shard_uri``, ``size_bytes``, ``digest``); done
            on return when ``blocking``. A failed write is not raised here: the future holds
            the ``OSError`` (or serialization error; DCP: a ``RuntimeError`` naming every
            rank's failure), and it is logged and counted in :attr:`stats`; training can go
            on, the daemon just does not commit ``step``.

        Raises:
            ValueError: ``state`` uses the key :data:`RESERVED_KEY`.
            SchemaViolation: ``step`` or ``cursor`` is out of the wire contract's range.
            AgentError: the agent is closed.
        """
        return self._checkpoint(step, state, cursor=cursor, blocking=blocking, plain=False)

    def _checkpoint(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        cursor: DataCursor,
        blocking: bool,
        plain: bool,
    ) -> Future[Checkpoint]:
        """:meth:`checkpoint`; ``plain``: a ``torch.save`` shard whatever ``checkpoint_format``."""
        if self._state == "closed":
            raise AgentError("the agent is closed")
        if RESERVED_KEY in state:
            raise ValueError(f"the state key {RESERVED_KEY!r} is reserved for the agent")
        template = self.config.checkpoint_template(step=step, cursor=cursor, pid=self._pid)
        encode(template)  # a bad step or cursor fails here, not in the background
        previous = self._phase
        self.wait_checkpoints()
        # Freshly made objects: only the caller's state needs a copy for a background write.
        own = {"rng": capture_rng(), "cursor": dataclasses.asdict(cursor), "step": step}
        if self.config.checkpoint_format == "dcp" and not plain:
            return self._checkpoint_dcp(template, state, own, blocking=blocking)
        if not blocking:
            try:
                staged = {**self._stager.stage(state), RESERVED_KEY: own}
            except Exception as exc:  # what the copy refuses, as the write would: no raise
                self._write_failed(step, exc)
                failed: Future[Checkpoint] = Future()
                failed.set_exception(exc)
                return failed
            self._pending = self._writer.submit(self._write_and_announce, template, staged)
            return self._pending
        full = {**state, RESERVED_KEY: own}
        done: Future[Checkpoint] = Future()
        self.phase("checkpoint")
        try:
            done.set_result(self._write_and_announce(template, full))
        except Exception as exc:
            done.set_exception(exc)
        finally:
            self._phase = previous
        return done

    def checkpoint_files(
        self,
        step: int,
        folder: str | Path,
        files: Sequence[StoredFile],
        *,
        cursor: DataCursor,
        blocking: bool = True,
    ) -> Future[Checkpoint]:
        """Announce ``step``'s checkpoint that a framework wrote into ``folder`` (the Hugging
        Face ``Trainer``'s ``checkpoint-<step>``, Accelerate's ``save_state`` folder).

        The files are not copied: this rank's shard (a ``torch.save`` file, written and
        announced as :meth:`checkpoint` does, whatever ``checkpoint_format``) holds an index of
        ``files`` (name, size, SHA-256: :func:`~trainguard.agent.digest_files`) besides the
        RNG states, ``cursor`` and ``step``. List every file this rank reads back on a restore,
        also those another rank wrote (rank 0's model, for instance): :meth:`load_files`
        checks each of them before the framework opens it. The files must not change once
        announced: a framework that saves a step again must save it into another folder.

        Returns and raises as :meth:`checkpoint`.
        """
        state = {INDEX_KEY: files_index(folder, files)}
        return self._checkpoint(step, state, cursor=cursor, blocking=blocking, plain=True)

    def load_files(self, target: Snapshot | SnapshotRef | Manifest) -> Path:
        """Verify this rank's part of ``target``, a snapshot of :meth:`checkpoint_files`;
        return the framework's checkpoint folder, to be loaded by the framework itself.

        This rank's shard is verified and read as :meth:`load` does (the RNG states it holds
        are put back), then every file its index lists is read whole and checked against its
        size and SHA-256; nothing of the folder has been deserialized when this returns or
        raises. Call it last before the framework loads the folder.

        Raises:
            ShardCorrupt: the shard, or a file, does not match its digest.
            ShardMissing: the shard or a file is gone.
            ShardError: the shard is not an index of files, or cannot be read.
            AgentError: as :meth:`load`.

            Before raising, the snapshot is reported as :meth:`load` says, so that the daemon
            restores an older one.
        """
        if isinstance(target, SnapshotRef):
            target = self._open(target)
        elif isinstance(target, Manifest):
            target = Snapshot.of(target)
        state = self.load(target)
        try:
            folder, files = index_files(state.get(INDEX_KEY), f"snapshot {target.snapshot_id}")
            verify_files(folder, files)
        except ShardError as exc:
            self._failed_load(target.job_id, target.snapshot_id, target.step, exc)
            raise
        return folder

    def wait_checkpoints(self) -> None:
        """Block until the background checkpoint write (if any) has finished, in the declared
        phase ``checkpoint`` while it runs (a slow write stalls the caller: no hang; the phase
        before is kept for the next heartbeat); never raises (its outcome is in the future
        :meth:`checkpoint` returned). The next checkpoint, the end of the ``with`` block and
        an in-process restore wait so too."""
        pending = self._pending
        if pending is not None and not pending.done():
            previous = self._phase
            self.phase("checkpoint")
            wait([pending])
            self._phase = previous

    def _write_and_announce(self, template: Checkpoint, state: Mapping[str, Any]) -> Checkpoint:
        c = self.config
        path = shard_path(self._root, c.job_id, template.generation, template.step, c.rank)
        try:
            self._faults.before_write(template.step)
            written = write_shard(path, state)
        except Exception as exc:
            self._write_failed(template.step, exc)
            raise
        shard = dataclasses.replace(
            template, shard_uri=written.uri, size_bytes=written.size_bytes, digest=written.digest
        )
        return self._announce(shard)

    def _announce(self, shard: Checkpoint) -> Checkpoint:
        """Count a durable shard and queue its event."""
        self._written += 1
        return self._link.submit(lambda seq: dataclasses.replace(shard, seq=seq, ts=time.time_ns()))

    def _write_failed(self, step: int, exc: BaseException) -> None:
        """Count, log and report a checkpoint write that failed."""
        self._write_failures += 1
        self._log.warning("checkpoint_failed", step=step, error=_describe(exc))
        # Tell the daemon too: otherwise a full or read-only disk only shows as restores
        # that silently reach back further than expected.
        self._lifecycle(
            "error",
            step=step,
            message=f"checkpoint write failed at step {step}: {_describe(exc)}"[:_MESSAGE_CHARS],
        )

    # -- DCP checkpoints (checkpoint_format="dcp", docs/checkpoints.md) ------------------------

    def _dcp_group(self) -> ProcessGroup | None:
        """The process group DCP saves and loads synchronize over, made on first use (every
        rank makes its first DCP checkpoint or load at the same point, as ``new_group`` asks);
        ``None`` without ``torch.distributed``.

        A gloo group of its own: an async save runs DCP's collectives on a background thread,
        which must not interleave with the training's collectives on the default group (as
        torchtitan's async checkpointing does). Gloo also serves a job whose default backend
        is NCCL: DCP's collectives carry only plans and small results, on the CPU.
        """
        if self._dcp_pg is None:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self._dcp_pg = (dist.new_group(backend="gloo"),)
            else:
                self._dcp_pg = (None,)
        return self._dcp_pg[0]

    def _checkpoint_dcp(
        self,
        template: Checkpoint,
        state: Mapping[str, Any],
        own: Mapping[str, Any],
        *,
        blocking: bool,
    ) -> Future[Checkpoint]:
        """:meth:`checkpoint` in the ``dcp`` format (its docstring says what happens)."""
        from torch.distributed.checkpoint.state_dict_saver import async_save, save

        c = self.config
        base = c.checkpoint_uri or self._root.as_uri()
        write = storage_writer(step_folder_uri(base, c.job_id, template.generation, template.step))
        group = self._dcp_group()
        done: Future[Checkpoint] = Future()
        if not blocking:
            try:
                # The calling thread pays the staging copy; DCP writes on its own thread.
                upload = async_save(
                    dict(state),
                    storage_writer=write.writer,
                    process_group=group,
                    async_stager=cast("AsyncStager", self._stager),
                    no_dist=group is None,
                )
            except _save_failures() as exc:
                error = _as_error(exc)
                self._write_failed(template.step, error)
                done.set_exception(error)
                return done
            pending = cast("Future[Any]", upload)
            self._pending = self._writer.submit(
                self._finish_dcp, template, write, own, pending.result
            )
            return self._pending
        previous = self._phase
        self.phase("checkpoint")
        try:
            save = functools.partial(
                save,
                dict(state),
                storage_writer=write.writer,
                process_group=group,
                no_dist=group is None,
            )
            done.set_result(self._finish_dcp(template, write, own, save))
        except Exception as exc:
            done.set_exception(exc)
        finally:
            self._phase = previous
        return done

    def _finish_dcp(
        self,
        template: Checkpoint,
        write: DcpWrite,
        own: Mapping[str, Any],
        save: Callable[[], Any],
    ) -> Checkpoint:
        """Run (or await) the DCP save, write the agent's own file, announce the rank's files."""
        try:
            self._faults.before_write(template.step)
            save()
            write.write_sidecar(self.config.rank, own)
        except _save_failures() as exc:
            error = _as_error(exc)
            self._write_failed(template.step, error)
            if error is exc:
                raise
            raise error from exc
        files = write.files()
        shard = dataclasses.replace(
            template,
            shard_uri=write.uri,
            size_bytes=sum(f.size_bytes for f in files),
            digest=files_digest(files),
            files=files,
        )
        return self._announce(shard)

    def _lifecycle(self, kind: LifecycleKind, **fields: Any) -> None:
        c = self.config
        self._link.submit(
            lambda seq: Lifecycle(
                job_id=c.job_id,
                generation=c.generation,
                ts=time.time_ns(),
                seq=seq,
                rank=c.rank,
                host=c.host,
                pid=self._pid,
                kind=kind,
                **fields,
            )
        )


def _save_failures() -> tuple[type[BaseException], ...]:
    """What a failed DCP save raises: any ``Exception``, or DCP's ``CheckpointException`` (a
    ``BaseException``) with every rank's failures."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _as_error(exc: BaseException) -> Exception:
    """``exc`` itself when it is an ``Exception``; DCP's ``CheckpointException`` (a
    ``BaseException``, gathered from every rank, whose text holds each rank's traceback) as a
    ``RuntimeError`` naming each failed rank's error in one line (``"DCP save failed on rank
    0: FileNotFoundError: The specified bucket does not exist"``), so that it is handled and
    reported as the failed write it is rather than as an interrupt."""
    if isinstance(exc, Exception):
        return exc
    failures: Mapping[int, Any] = getattr(exc, "failures", {})
    causes = []
    for rank in sorted(failures)[:4]:
        failure = failures[rank]
        cause = failure[0] if isinstance(failure, tuple) else failure
        causes.append(
            f"rank {rank}: {_describe(cause) if isinstance(cause, BaseException) else cause}"
        )
    more = f" (and {len(failures) - 4} more ranks)" if len(failures) > 4 else ""
    error = RuntimeError(f"DCP save failed on {'; '.join(causes) or str(exc)}{more}")
    error.__cause__ = exc
    return error


def _describe_init(snapshot_id: str, exc: BaseException) -> str:
    """Why this rank cannot start from another job's snapshot, for a lifecycle ``error``."""
    return f"cannot start from init_from snapshot {snapshot_id}: {_describe(exc)}"[:_MESSAGE_CHARS]


def _describe(exc: BaseException) -> str:
    """``"Type: message"`` (or just the type when the message is empty), never empty, cut to
    the wire contract's 4096 characters."""
    text = str(exc)
    return (f"{type(exc).__name__}: {text}" if text else type(exc).__name__)[:_MESSAGE_CHARS]
