"""The Lightning ``Callback`` that drives a trainguard :class:`~trainguard.agent.Agent`."""

from __future__ import annotations

import signal
from typing import Any

import structlog
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor

from trainguard.agent import Agent, ConfigError, Snapshot
from trainguard.integrations.lightning._batches import ResumableBatches
from trainguard.integrations.lightning._checkpoint_io import (
    CHECKPOINT_KEY,
    SCHEME,
    TrainguardCheckpointIO,
)

__all__ = ["SUPPORTED_STRATEGIES", "TrainguardCallback"]

SUPPORTED_STRATEGIES: tuple[type, ...] = (SingleDeviceStrategy, DDPStrategy)
"""Strategies the callback runs under, by exact type: one device, and DDP with processes
started by ``trainguard run`` or ``torchrun`` (not by Lightning itself). Not FSDP nor
DeepSpeed (a ``DDPStrategy`` subclass): their sharded saves bypass the ``CheckpointIO``
(``docs/integrations-lightning.md``)."""

log = structlog.get_logger("trainguard.integrations.lightning")

_OWN_LAUNCHER = (
    "TrainguardCallback needs ranks started by `trainguard run --nproc-per-node N` (or "
    "torchrun), not by Lightning ({}): use strategy='ddp' (docs/integrations-lightning.md)"
)


class TrainguardCallback(Callback):
    """Reports a Lightning ``fit`` to trainguard and makes it restorable at the exact step and
    data position; ``docs/integrations-lightning.md`` has the whole picture.

    Typical use (``examples/lightning/train.py`` is complete)::

        with Agent() as agent:                      # TRAINGUARD_* variables, RANK, WORLD_SIZE
            batches = ResumableBatches(loader)      # its sampler: a ResumableDistributedSampler
            guard = TrainguardCallback(agent, batches, checkpoint_every=20)
            trainer = Trainer(max_steps=200, callbacks=[guard], strategy="ddp", ...)
            trainer.fit(module, train_dataloaders=batches, ckpt_path=guard.ckpt_path)

    What it does, by hook:

    * construction: asks the agent for the restore target (a process of generation g > 0 waits
      for the daemon's restore command), moves ``batches`` to its data cursor (and past a
      loss spike's batches, :attr:`Agent.skip <trainguard.agent.Agent.skip>`), and sets
      :attr:`ckpt_path` to the target (``trainguard://<snapshot id>``), ``None`` for a fresh
      start;
    * ``setup``: checks the strategy, ranks and gradient accumulation, and installs a
      :class:`TrainguardCheckpointIO` over the trainer's ``CheckpointIO`` (Lightning reads
      ``ckpt_path`` through it: digest verified before load, RNG states put back);
    * ``on_train_start``: acknowledges the restore (step, data cursor) and waits for the
      daemon's resume (:meth:`Agent.ready <trainguard.agent.Agent.ready>`); registers the
      module for parameter checksums (:meth:`Agent.watch <trainguard.agent.Agent.watch>`);
    * ``on_before_backward``: the ``nan`` and ``spike`` faults of ``TRAINGUARD_FAULTS`` scale
      the loss in place, so that the gradients and parameters diverge for real (nothing is
      looked up when no such fault is planned for the rank, :attr:`Agent.perturbs_loss
      <trainguard.agent.Agent.perturbs_loss>`);
    * ``on_train_batch_end``: reports the step (``trainer.global_step``), its loss and samples
      (:meth:`Agent.step <trainguard.agent.Agent.step>`), and every ``checkpoint_every`` steps
      and at ``max_steps`` saves: ``trainer.save_checkpoint`` builds Lightning's checkpoint
      dict on every rank (``on_save_checkpoint`` keeps it), which every rank then writes as its
      shard with :meth:`Agent.checkpoint <trainguard.agent.Agent.checkpoint>` (the data cursor
      after the batches trained, whatever Lightning fetched ahead);
    * ``on_validation_start``/``on_validation_end``: the declared phase ``eval`` and back;
    * ``on_exception``: finishes a background checkpoint write, so that a shard written before
      the failure is announced before Lightning's teardown, logs the exception with the step
      (the agent reports it as the rank's error when its ``with`` block ends), and gives
      Lightning's ``SIGTERMException`` (a ``SystemExit`` without status) the status 143, so that
      a stopped rank is never reported ``finished``.

    Restores restart the processes (the daemon's ``restart`` mode): keep the agent's
    ``in_process_restore`` off, and the agent declines in-process restores.

    Args:
        agent: this rank's agent, entered (``with Agent(...) as agent``).
        batches: the training data (:class:`ResumableBatches`), passed to ``trainer.fit``.
        checkpoint_every: steps between trainguard checkpoints (>= 1); the step ``max_steps``
            is checkpointed too.
        blocking_checkpoints: write shards on the training thread; default: the training
            thread pays only for a host copy of the state, a background thread writes.

    Raises:
        ValueError: ``checkpoint_every < 1``.
        RestoreTimeout, ShardError, JobAborted, StaleGeneration: as :meth:`Agent.restore_target
            <trainguard.agent.Agent.restore_target>`.
        DataVersionMismatch, CursorMismatch: the target's data cursor does not fit ``batches``.
    """

    def __init__(
        self,
        agent: Agent,
        batches: ResumableBatches,
        *,
        checkpoint_every: int,
        blocking_checkpoints: bool = False,
    ) -> None:
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        self.agent = agent
        self.batches = batches
        self.checkpoint_every = checkpoint_every
        self.blocking_checkpoints = blocking_checkpoints
        self.target: Snapshot | None = agent.restore_target()
        skip = agent.skip
        if self.target is not None:
            batches.load(self.target.cursor, step=self.target.step, skip=skip)
        elif skip is not None:
            batches.sampler.skip(skip, restored_step=0)
        self._trained = 0  # batches trained since the data origin (start or target)
        # Fixed for the fit, read once rather than at every step: each of Lightning's property
        # chains and the batches' property costs a microsecond or more in a step's cold caches.
        self._samples = batches.batch_size
        self._max_steps = -1  # trainer.max_steps, from on_train_start (every fit's own)
        self._perturbs = agent.perturbs_loss
        self._ready = False
        self._saving = False
        self._saved: dict[str, Any] | None = None
        self._loss: Tensor | None = None  # a fault's perturbed loss of the step in flight

    @property
    def ckpt_path(self) -> str | None:
        """``trainer.fit``'s ``ckpt_path``: the restore target (``trainguard://<snapshot
        id>``), or ``None`` to start afresh."""
        return None if self.target is None else SCHEME + self.target.snapshot_id

    def __reduce__(self) -> Any:
        """Refused: Lightning's ``ddp_spawn`` pickles the callbacks into processes it starts
        itself (before :meth:`setup` could refuse it), and the agent inside is this
        process's."""
        raise ConfigError(_OWN_LAUNCHER.format("a spawned process cannot take the callback"))

    @property
    def start_step(self) -> int:
        """The step training starts after: the target's, or 0."""
        return 0 if self.target is None else self.target.step

    # -- set-up -----------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """For ``fit``: check what the callback supports and install the ``CheckpointIO``.

        Raises:
            ConfigError: an unsupported strategy, ranks that differ from the agent's (Lightning
                started the processes itself), or gradient accumulation.
        """
        if stage != "fit":
            return
        strategy = trainer.strategy
        if type(strategy) not in SUPPORTED_STRATEGIES:
            raise ConfigError(
                f"TrainguardCallback supports the strategies "
                f"{[s.__name__ for s in SUPPORTED_STRATEGIES]}, not {type(strategy).__name__} "
                "(docs/integrations-lightning.md)"
            )
        # ddp_spawn and ddp_fork are DDPStrategy too: Lightning starts their processes itself.
        start = getattr(strategy, "_start_method", "popen")
        if start != "popen":
            raise ConfigError(_OWN_LAUNCHER.format(f"strategy 'ddp_{start}' starts them"))
        config = self.agent.config
        if (trainer.world_size, trainer.global_rank) != (config.world_size, config.rank):
            raise ConfigError(
                f"Lightning runs this process as rank {trainer.global_rank} of "
                f"{trainer.world_size}, the agent as rank {config.rank} of {config.world_size}: "
                "start the ranks with `trainguard run --nproc-per-node N` (or torchrun), not "
                "through Lightning's own launcher"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ConfigError(
                "TrainguardCallback counts a step per batch: gradient accumulation "
                f"(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not supported"
            )
        if not isinstance(strategy.checkpoint_io, TrainguardCheckpointIO):
            strategy.checkpoint_io = TrainguardCheckpointIO(
                self.agent, self.target, inner=strategy.checkpoint_io
            )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Acknowledge the restore (or the fresh start) and wait for the daemon's resume.

        Raises:
            ConfigError: the trainer stands at another step than the target's (``fit`` was not
                given :attr:`ckpt_path`).
            RestoreTimeout, JobAborted, StaleGeneration: as :meth:`Agent.ready
                <trainguard.agent.Agent.ready>`.
        """
        step = trainer.global_step
        if step != self.start_step:
            raise ConfigError(
                f"the trainer starts at step {step}, the restore target is step "
                f"{self.start_step}: pass ckpt_path=callback.ckpt_path to trainer.fit"
            )
        self.agent.ready(step, cursor=self.batches.cursor_after(self._trained))
        self._ready = True
        self._max_steps = trainer.max_steps
        self.agent.watch(pl_module)

    # -- steps --------------------------------------------------------------------------------

    def on_before_backward(
        self, trainer: Trainer, pl_module: LightningModule, loss: Tensor
    ) -> None:
        """Let the ``nan`` and ``spike`` faults scale the loss about to be differentiated."""
        if not self._perturbs:
            return  # no such fault for this rank: no step to read, nothing to look up
        perturbed = self.agent.perturb_loss(trainer.global_step + 1, loss)
        if perturbed is not loss:
            loss.copy_(perturbed)  # in place: Lightning differentiates this very tensor
            self._loss = loss.detach()

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Report the step; checkpoint it when it is due."""
        step = trainer.global_step
        self._trained += 1
        loss = self._loss
        if loss is None:
            loss = _loss_of(outputs)
        else:
            self._loss = None
        # .item(), not float(): the same number and the same wait for the device (none on the
        # CPU), but float() goes through Python's __float__ slot, about a microsecond more.
        self.agent.step(step, loss=None if loss is None else loss.item(), samples=self._samples)
        if step % self.checkpoint_every == 0 or step == self._max_steps:
            self._checkpoint(trainer, step)

    def _checkpoint(self, trainer: Trainer, step: int) -> None:
        """Have Lightning build its checkpoint dict on every rank, and write it as this rank's
        shard of ``step``."""
        config = self.agent.config
        self._saving = True
        try:
            trainer.save_checkpoint(
                f"{SCHEME}{config.job_id}/g{config.generation}/s{step}", weights_only=False
            )
        finally:
            self._saving = False
        checkpoint, self._saved = self._saved, None
        if checkpoint is None:
            raise RuntimeError("trainer.save_checkpoint did not call on_save_checkpoint")
        self.agent.checkpoint(
            step,
            {CHECKPOINT_KEY: checkpoint},
            cursor=self.batches.cursor_after(self._trained),
            blocking=self.blocking_checkpoints,
        )

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Keep the checkpoint dict of this callback's own save (the module's
        ``on_save_checkpoint`` fills the same dict after this hook)."""
        if self._saving:
            self._saved = checkpoint

    # -- phases and failures ----------------------------------------------------------------

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Declare the phase ``eval``: the daemon gives an evaluation its own time limit."""
        self.agent.phase("eval")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Back to ``train`` (``init`` during the sanity check before training starts: the
        daemon takes heartbeats of step 0 in ``init`` for no trained step)."""
        self.agent.phase("train" if self._ready else "init")

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        """Finish a background checkpoint write, log the failure with its step, and give
        Lightning's ``SIGTERMException`` the status of a SIGTERM.

        Lightning turns a SIGTERM (the supervisor stopping the workers for a restore, or a
        scheduler preempting the job) into ``SIGTERMException``, a ``SystemExit`` without a
        status, which the agent would take for a clean end and report as ``finished``: the
        daemon would then end the job as finished with steps still to train. Lightning raises
        this very exception again after this hook, now with status ``128 + SIGTERM``, which the
        agent reports as the rank's ``error``.
        """
        if isinstance(exception, SIGTERMException) and exception.code in (None, 0):
            exception.code = 128 + signal.SIGTERM
        self.agent.wait_checkpoints()
        log.error(
            "training failed",
            rank=self.agent.config.rank,
            step=trainer.global_step,
            error=f"{type(exception).__name__}: {exception}",
        )


def _loss_of(outputs: Any) -> Tensor | None:
    """The loss in ``training_step``'s output (a tensor, or a dict's ``"loss"``), or ``None``
    (manual optimization may return nothing)."""
    if isinstance(outputs, dict):  # what Lightning's loops hand the hook: first
        loss = outputs.get("loss")
        return loss if isinstance(loss, Tensor) else None
    if isinstance(outputs, Tensor):
        return outputs
    return None
