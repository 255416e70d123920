""":class:`TrainguardCallback`: the Hugging Face ``Trainer`` driving a trainguard agent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainguard.agent import Agent, ConfigError, Snapshot
from trainguard.integrations._folder import announce_folder, load_folder
from trainguard.integrations._position import StepPosition
from trainguard.schemas import DataCursor

__all__ = ["TrainguardCallback"]

_log = structlog.get_logger("trainguard.integrations.hf")


class TrainguardCallback(TrainerCallback):
    """Report a ``Trainer``'s progress to trainguard, announce its checkpoints with their
    files' digests, and start it from the daemon's restore target.

    Use (the complete script is ``examples/hf_trainer/train.py``)::

        with Agent(job_id="my-job") as agent:
            guard = TrainguardCallback(agent, data_version=dataset_version(files))
            args = TrainingArguments(output_dir=guard.output_dir, logging_steps=1,
                                     logging_nan_inf_filter=False, save_steps=50, ...)
            trainer = Trainer(model, args, train_dataset=data, callbacks=[guard])
            trainer.train(resume_from_checkpoint=guard.resume_from_checkpoint())

    What it does, hook by hook:

    * ``on_train_begin``: checks the arguments (see Raises), fixes the data position's
      arithmetic (steps per epoch and samples per step, from the prepared loader), watches the
      model's parameter checksums and acknowledges the start with ``agent.ready(step,
      cursor)`` (after a restore: waits for the daemon's ``resume``).
    * ``on_step_end`` / ``on_log``: ``agent.step(global_step, loss=...)``, the loss from the
      ``Trainer``'s log of that step when it logs one (every step with ``logging_steps=1``;
      a step that logs nothing is reported without a loss); injected faults fire here.
    * phases: ``eval`` from the step that evaluates until its evaluation ends, ``checkpoint``
      while the ``Trainer`` saves.
    * ``on_save``: the digests of ``checkpoint-<step>``'s files (rank 0 digests what the main
      process wrote and shares the list; every rank adds its ``rng_state_<rank>.pth``) go into
      this rank's shard (:meth:`Agent.checkpoint_files`), announced in the background.

    The data position is the ``Trainer``'s own: a seeded ``SeedableRandomSampler`` order per
    epoch, and on resume accelerate's ``skip_first_batches``, which for a map-style dataset
    skips index batches of the sampler and loads none of their samples. The cursor is computed
    from the step (``epoch = step // steps_per_epoch``, ``offset`` its samples), so a restored
    rank acknowledges exactly the target's position. ``docs/integrations-hf.md`` says what
    is bitwise restorable.

    Args:
        agent: the entered agent of this rank. Its ``in_process_restore`` must be off: the
            ``Trainer`` cannot reload in the middle of ``train()``, so the daemon restarts the
            processes (its in-process restores are declined, and it falls back to that).
        data_version: the training data's version (``trainguard.agent.dataset_version`` of
            its files, or an id from your data versioning tool); in every cursor.
        blocking_checkpoints: write the trainguard shard (a few KB: the index) on the
            training thread instead of the agent's background thread.
        watch: send the model's parameter checksums (``agent.watch``): replicas of DDP are
            bitwise equal, so a flipped bit on one shows.

    Raises:
        ConfigError: (from ``on_train_begin``) ``args.output_dir`` is not
            :attr:`output_dir`, ``save_total_limit`` is set, the training dataset has no
            length (an ``IterableDataset``: its position is not a function of the step), or
            a process of generation > 0 did not call :meth:`resume_from_checkpoint`.
    """

    def __init__(
        self,
        agent: Agent,
        *,
        data_version: str,
        blocking_checkpoints: bool = False,
        watch: bool = True,
    ) -> None:
        if agent.config.in_process_restore:
            raise ConfigError(
                "TrainguardCallback restores by restarting the processes: turn the agent's "
                "in_process_restore off (TRAINGUARD_IN_PROCESS_RESTORE)"
            )
        self.agent = agent
        self.data_version = data_version
        self.blocking_checkpoints = blocking_checkpoints
        self.watch = watch
        self._asked = False  # resume_from_checkpoint() was called
        self._target: Snapshot | None = None
        self._position: StepPosition | None = None
        self._pending: int | None = None  # a step whose loss the Trainer is about to log
        self._batch = 0  # samples per batch (per_device_train_batch_size)
        self._accumulation = 1  # batches per optimizer step (gradient_accumulation_steps)
        self._steps_per_epoch = 1  # optimizer steps per epoch
        self._last_batches = 1  # batches of an epoch's last optimizer step

    @property
    def output_dir(self) -> str:
        """The ``TrainingArguments.output_dir`` to use:
        ``<checkpoint_dir>/<job>/hf/g<generation:06>``, a folder per generation, so that a
        step saved again after a restore never overwrites the files of a committed snapshot."""
        c = self.agent.config
        return str(c.checkpoint_dir.resolve() / c.job_id / "hf" / f"g{c.generation:06}")

    def resume_from_checkpoint(self) -> str | None:
        """The checkpoint folder ``trainer.train(resume_from_checkpoint=...)`` must start
        from, or ``None`` for a fresh start; call it in every process, last before ``train``.

        In generation 0 (or after a restore to the initial state) ``None``; otherwise the
        folder of the daemon's target, once this rank's shard and every file it lists are
        verified (:meth:`Agent.load_files`; the RNG states are put back, as the ``Trainer``
        does again from its own files). A corrupt or missing file is reported to the daemon,
        which then restores the newest older snapshot in new processes.

        Raises:
            ShardError: the target's files failed verification (reported first).
            ValueError: the target was trained on another data version or world size.
            RestoreTimeout, JobAborted, StaleGeneration: as :meth:`Agent.restore_target`.
        """
        self._asked = True
        target = self.agent.restore_target()
        self._target = target
        if target is None:
            return None
        return str(load_folder(self.agent, target, self.data_version))

    def cursor(self, step: int) -> DataCursor:
        """The data cursor after optimizer step ``step``.

        Raises:
            RuntimeError: before ``on_train_begin`` (the loader's length is not known yet).
        """
        if self._position is None:
            raise RuntimeError("the data position is known from on_train_begin on")
        return self._position.cursor(step)

    # -- the Trainer's hooks ---------------------------------------------------------------------

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        train_dataloader: Any = None,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        """Check the arguments, fix the data position's arithmetic, acknowledge the start."""
        c = self.agent.config
        if args.output_dir is None or Path(args.output_dir).resolve() != Path(self.output_dir):
            raise ConfigError(
                f"TrainingArguments.output_dir is {args.output_dir}; use the callback's "
                f"output_dir ({self.output_dir}): a folder per generation"
            )
        if args.save_total_limit is not None:
            raise ConfigError(
                "save_total_limit deletes checkpoints trainguard may restore: leave it unset "
                "(trainguard's retention prunes committed snapshots)"
            )
        if c.generation > 0 and not self._asked:
            raise ConfigError(
                "a restored process must start from the daemon's target: "
                "trainer.train(resume_from_checkpoint=callback.resume_from_checkpoint())"
            )
        if train_dataloader is None or not hasattr(train_dataloader.dataset, "__len__"):
            raise ConfigError(
                "the training dataset has no length: the data position of an IterableDataset "
                "is not a function of the step, so a restore could not be exact"
            )
        if args.logging_nan_inf_filter:
            _log.warning(
                "logging_nan_inf_filter hides NaN and infinite losses from the log, and so "
                "from trainguard's divergence detector: set it to False",
                rank=c.rank,
            )
        accumulation = args.gradient_accumulation_steps
        batches = len(train_dataloader)  # this rank's, of the prepared (sharded) loader
        # As the Trainer counts them (transformers 4.52 on): an epoch whose batches are not a
        # multiple of the accumulation ends with a shorter optimizer step that takes the rest.
        steps_per_epoch = max(-(-batches // accumulation), 1)
        self._batch = args.per_device_train_batch_size
        self._accumulation = accumulation
        self._steps_per_epoch = steps_per_epoch
        self._last_batches = max(batches - (steps_per_epoch - 1) * accumulation, 1)
        seed = args.data_seed if args.data_seed is not None else args.seed
        self._position = StepPosition(
            data_version=self.data_version,
            seed=seed,
            steps_per_epoch=steps_per_epoch,
            global_batch=self._batch * accumulation * c.world_size,
            world_size=c.world_size,
        )
        if self.watch and model is not None:
            self.agent.watch(model)
        step = state.global_step
        self.agent.ready(step, cursor=self.cursor(step))

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Report the step now, or once its loss is logged (``control.should_log``)."""
        self._flush(control)
        if control.should_log:
            self._pending = state.global_step
        else:
            self._report(state.global_step, None, control)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        """Report the pending step with the loss the ``Trainer`` logged for it."""
        step = self._pending
        if step is not None and logs is not None and "loss" in logs:
            self._pending = None
            self._report(step, float(logs["loss"]), control)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The evaluation is over: a save may follow, else training goes on."""
        self.agent.phase("checkpoint" if control.should_save else "train")

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Announce ``checkpoint-<global_step>`` with its files' digests."""
        self._flush(control)
        step = state.global_step
        folder = Path(self.output_dir) / f"checkpoint-{step}"
        announce_folder(
            self.agent, step, folder, self.cursor(step), blocking=self.blocking_checkpoints
        )
        self.agent.phase("train")

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Report a step still waiting for its log; let the last shard reach the disk."""
        self._flush(control)
        self.agent.wait_checkpoints()

    # -- reporting -----------------------------------------------------------------------------

    def _samples_of(self, step: int) -> int:
        """Samples this rank trains in optimizer step ``step`` (>= 1): its accumulated
        batches, fewer in an epoch's last step when the epoch's batches are not a multiple of
        the accumulation."""
        last = step % self._steps_per_epoch == 0
        return self._batch * (self._last_batches if last else self._accumulation)

    def _flush(self, control: TrainerControl) -> None:
        """Report a pending step whose log never came (without its loss)."""
        if self._pending is not None:
            step, self._pending = self._pending, None
            self._report(step, None, control)

    def _report(self, step: int, loss: float | None, control: TrainerControl) -> None:
        """``agent.step`` (faults fire here), then declare what the Trainer does next."""
        self.agent.step(step, loss=loss, samples=self._samples_of(step))
        if control.should_evaluate:
            self.agent.phase("eval")
        elif control.should_save:
            self.agent.phase("checkpoint")
