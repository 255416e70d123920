"""The :class:`Agent`: what a training loop calls at its step boundaries."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from trainguard.agent._config import AgentConfig
from trainguard.agent._errors import JobAborted, RestoreTimeout
from trainguard.agent._faults import FaultInjector, parse_faults
from trainguard.agent._link import Link
from trainguard.agent._shards import (
    capture_rng,
    load_shard,
    restore_rng,
    shard_path,
    to_host,
    write_shard,
)
from trainguard.agent.bus import BusConfig
from trainguard.schemas import (
    Checkpoint,
    CheckpointMeta,
    DataCursor,
    Heartbeat,
    Lifecycle,
    Manifest,
    Phase,
)

__all__ = ["Agent"]


class Agent:
    """One rank's connection to trainguard. Use as a context manager around training.

    Typical loop (see ``examples/charlm``)::

        with Agent(job_id="my-job") as agent:          # or TRAINGUARD_JOB, RANK, WORLD_SIZE
            start, cursor = 0, initial_cursor
            if (target := agent.restore_target()) is not None:
                state = agent.load(target)             # digest-verified, weights_only
                model.load_state_dict(state["model"]); optim.load_state_dict(state["optim"])
                start, cursor = target.step, target.cursor
            agent.ready(step=start, cursor=cursor)     # after a restore: ack, wait for resume
            for step in range(start + 1, total + 1):
                loss = train_one_step(...)
                agent.step(step, loss=loss, samples=batch)
                if step % 50 == 0:
                    agent.checkpoint(step, {"model": ..., "optim": ...}, cursor=cursor_now)

    ``step`` and ``phase`` cost microseconds and never wait on the network; heartbeats are
    sent by a background thread every ``heartbeat_interval_s`` seconds, also while the
    training thread is stuck (that is how the daemon tells a hang from a death).

    Args:
        config: a prepared configuration; otherwise one is resolved from ``settings`` and the
            environment (see :class:`AgentConfig` for names and precedence).
        **settings: :class:`AgentConfig` fields, e.g. ``job_id=...``, ``bus_url=...``.

    Raises:
        ConfigError: a required setting is missing or invalid.
        BusError: the bus cannot be reached at start-up.
    """

    def __init__(self, config: AgentConfig | None = None, **settings: Any) -> None:
        self.config = config or AgentConfig.resolve(**settings)
        c = self.config
        self._pid = os.getpid()
        self._step = 0
        self._phase: Phase = "init"
        self._loss: float | None = None
        self._samples = 0
        self._step_time_s: float | None = None
        self._last_step_at: float | None = None
        self._faults = FaultInjector(
            parse_faults(c.faults), c.rank, c.checkpoint_dir / c.job_id / ".faults-fired"
        )
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-ckpt")
        self._pending_write: Future[None] | None = None
        self._write_lock = threading.Lock()
        self._link = Link(
            BusConfig(url=c.bus_url, prefix=c.topic_prefix, client_id=f"agent-{c.rank}"),
            c.job_id,
            c.generation,
            ring=c.heartbeat_queue,
            beat=self._heartbeat,
            interval_s=c.heartbeat_interval_s,
        )
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        self._link.open(timeout_s=60.0)
        self._lifecycle("started", world_size=self.config.world_size)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.wait_checkpoints()
            self._lifecycle("finished", step=self._step)
        else:
            self._lifecycle("error", step=self._step, message=f"{exc_type.__name__}: {exc}"[:4096])  # type: ignore[union-attr]
        self.close()

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish pending checkpoint writes, send queued events (bounded), disconnect."""
        if self._closed:
            return
        self._closed = True
        self._writer.shutdown(wait=True)
        self._link.close(timeout_s)

    # -- restore -----------------------------------------------------------------------------

    def restore_target(self, timeout_s: float = 60.0) -> Manifest | None:
        """The snapshot this process must resume from, or ``None`` for a fresh start.

        Generation 0 starts fresh. A process started by the supervisor for generation g > 0
        waits (at most ``timeout_s`` seconds) for the daemon's ``restore`` command of g and
        returns its target (``None`` when no step had been committed yet).

        Raises :class:`RestoreTimeout` when that command does not arrive in time.
        """
        generation = self.config.generation
        if generation == 0:
            return None
        state = self._link.commands
        command = state.wait_for(lambda: state.restores.get(generation), timeout_s)
        if command is None:
            raise RestoreTimeout(f"no restore command for generation {generation} in {timeout_s} s")
        return command.target  # type: ignore[no-any-return]

    def load(self, target: Manifest) -> dict[str, Any]:
        """Verify and load this rank's shard of ``target``; restores the RNG states it holds.

        Call it last before the training loop: anything drawing random numbers after it would
        change the stream that resumed training sees. Returns the state given to
        :meth:`checkpoint` (plus ``"rng"`` and ``"cursor"``).

        Raises:
            ShardCorrupt: the shard's digest does not match; the daemon is told, so that the
                retried restore uses an earlier snapshot. Nothing was deserialized.
            ShardMissing: the shard file is gone.
        """
        shard = next((s for s in target.shards if s.rank == self.config.rank), None)
        if shard is None:
            raise ValueError(
                f"snapshot {target.snapshot_id} has no shard for rank {self.config.rank}"
            )
        try:
            state = load_shard(shard.uri, shard.digest)
        except Exception as exc:
            self._lifecycle(
                "error", step=target.step, snapshot_id=target.snapshot_id, message=str(exc)[:4096]
            )
            self._link.flush(timeout_s=30.0)
            raise
        if "rng" in state:
            restore_rng(state["rng"])
        return state

    def ready(self, step: int, cursor: DataCursor | None = None) -> None:
        """Declare this rank ready to train from ``step`` (the next step is ``step + 1``).

        After a restore (generation > 0) this acknowledges it (``restored``) and blocks until
        the daemon's ``resume`` for this generation, which it sends once every rank has
        acknowledged; this keeps all ranks of a job in one generation.

        Raises:
            RestoreTimeout: no ``resume`` within ``resume_timeout_s`` seconds.
            JobAborted: the daemon aborted the job meanwhile.
        """
        self._step = step
        generation = self.config.generation
        if generation == 0:
            return
        target = self._link.commands.restores.get(generation)
        self._lifecycle(
            "restored",
            step=step,
            cursor=cursor,
            snapshot_id=target.target.snapshot_id if target and target.target else None,
        )
        state = self._link.commands
        done = state.wait_for(
            lambda: generation in state.resumed or state.aborted is not None,
            self.config.resume_timeout_s,
        )
        if state.aborted is not None:
            raise JobAborted(state.aborted.reason)
        if not done:
            raise RestoreTimeout(
                f"no resume for generation {generation} in {self.config.resume_timeout_s} s"
            )

    # -- the training thread's per-step calls ------------------------------------------------

    def step(self, step: int, *, loss: float | None = None, samples: int = 0) -> None:
        """Record that training step ``step`` completed (microseconds; no I/O).

        Args:
            step: the step just completed (1, 2, ...).
            loss: its loss, if known (NaN/Inf are reported as such).
            samples: samples this rank consumed in the step.
        """
        now = time.monotonic()
        if self._last_step_at is not None:
            self._step_time_s = now - self._last_step_at
        self._last_step_at = now
        self._step = step
        self._loss = loss
        self._samples += samples
        self._phase = "train"
        self._faults.at_step(step)

    def phase(self, phase: Phase) -> None:
        """Declare what this rank is doing (``train``, ``checkpoint``, ``eval``, ``data``,
        ``init``); long declared phases get their own time limits in the daemon."""
        self._phase = phase
        self._link.submit(self._heartbeat)

    def _heartbeat(self, seq: int) -> Heartbeat:
        c = self.config
        return Heartbeat(
            job_id=c.job_id,
            generation=c.generation,
            ts=time.time_ns(),
            seq=seq,
            rank=c.rank,
            host=c.host,
            pid=self._pid,
            world_size=c.world_size,
            step=self._step,
            phase=self._phase,
            step_time_s=self._step_time_s,
            loss=self._loss,
            samples=self._samples,
        )

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        cursor: DataCursor,
        blocking: bool = True,
    ) -> Future[None]:
        """Write this rank's shard of ``step`` and announce it once it is durable.

        The shard holds ``state`` (tensors, dicts, lists, numbers), the RNG states and
        ``cursor``; it is written atomically (temporary file, fsync, rename) with its SHA-256
        computed while writing, then a ``checkpoint`` event carries URI, size, digest, cursor
        and metadata. The daemon commits ``step`` when every rank's shard is in.

        With ``blocking=False`` the training thread pays only for copying tensors to host
        memory; writing happens in a background thread (one write at a time: a new call waits
        for the previous write to finish). The returned future completes when the shard is
        written; it raises the write's ``OSError`` if it failed.
        """
        full = {**state, "rng": capture_rng(), "cursor": _cursor_dict(cursor)}
        if blocking:
            self.wait_checkpoints()
            self._write_and_announce(step, full, cursor)
            done: Future[None] = Future()
            done.set_result(None)
            return done
        snapshot = to_host(full)
        with self._write_lock:
            self.wait_checkpoints()
            self._pending_write = self._writer.submit(
                self._write_and_announce, step, snapshot, cursor
            )
            return self._pending_write

    def wait_checkpoints(self) -> None:
        """Block until a background checkpoint write (if any) has finished."""
        pending = self._pending_write
        if pending is not None:
            pending.result()

    def _write_and_announce(self, step: int, state: dict[str, Any], cursor: DataCursor) -> None:
        c = self.config
        path = shard_path(Path(c.checkpoint_dir).resolve(), c.job_id, c.generation, step, c.rank)
        written = write_shard(path, state)
        self._link.submit(
            lambda seq: Checkpoint(
                job_id=c.job_id,
                generation=c.generation,
                ts=time.time_ns(),
                seq=seq,
                rank=c.rank,
                host=c.host,
                pid=self._pid,
                world_size=c.world_size,
                step=step,
                shard_uri=written.uri,
                size_bytes=written.size_bytes,
                digest=written.digest,
                cursor=cursor,
                metadata=CheckpointMeta(
                    hyperparameters=dict(c.hyperparameters),
                    topology={"world_size": c.world_size},
                    code_version=c.code_version,
                ),
            )
        )

    def _lifecycle(self, kind: Any, **fields: Any) -> None:
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

    @property
    def dropped_heartbeats(self) -> int:
        """Heartbeats dropped because the bus was slower than the heartbeat rate."""
        return self._link.dropped_heartbeats


def _cursor_dict(cursor: DataCursor) -> dict[str, Any]:
    return {
        "data_version": cursor.data_version,
        "seed": cursor.seed,
        "epoch": cursor.epoch,
        "offset": cursor.offset,
        "world_size": cursor.world_size,
    }
