""":class:`TrainguardAccelerate`: an Accelerate training loop driving a trainguard agent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.data_loader import SeedableRandomSampler
from torch.utils.data import RandomSampler

from trainguard.agent import Agent, ConfigError, ShardError
from trainguard.integrations._folder import announce_folder, load_folder
from trainguard.integrations._position import StepPosition
from trainguard.schemas import DataCursor

__all__ = ["TrainguardAccelerate"]


class _Progress:
    """The step and epoch, saved into every ``save_state`` folder
    (``register_for_checkpointing``: ``custom_checkpoint_<i>.pkl``): the epoch is not in the
    loader's state, and a restored loop needs it to draw the epoch's order again."""

    def __init__(self) -> None:
        self.step = 0
        self.epoch = 0

    def state_dict(self) -> dict[str, int]:
        """``{"step", "epoch"}``, as ``save_state`` stores it."""
        return {"step": self.step, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Take back what :meth:`state_dict` gave (``load_state``)."""
        self.step, self.epoch = int(state["step"]), int(state["epoch"])


class TrainguardAccelerate:
    """Checkpoints and restores of an Accelerate loop through trainguard.

    Use (the complete script is ``examples/accelerate_loop/train.py``)::

        accelerator = Accelerator(
            dataloader_config=DataLoaderConfiguration(
                use_stateful_dataloader=True, use_seedable_sampler=True, data_seed=0))
        loader = DataLoader(data, batch_size=4, shuffle=True,
                            generator=torch.Generator().manual_seed(0))
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        with Agent() as agent:
            guard = TrainguardAccelerate(agent, accelerator, loader, data_version=v, seed=0)
            step = guard.start()                  # 0, or the daemon's target, loaded
            for batch in guard.batches():         # epoch after epoch, from where it stands
                step += 1
                loss = agent.perturb_loss(step, compute_loss(model, batch))
                accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()
                guard.step(step, loss=loss.item())
                if step % 50 == 0:
                    guard.save_state(step)
                if step == total_steps:
                    break

    A step is one batch of ``loader`` (with gradient accumulation, count batches).

    * :meth:`save_state`: ``accelerator.save_state`` into
      ``<checkpoint_dir>/<job>/accelerate/g<generation>/step-<step>`` (a folder per
      generation: a step saved again after a restore never overwrites a committed snapshot's
      files), in the declared phase ``checkpoint`` (a save pre-hook); then the files' digests
      are announced (:meth:`Agent.checkpoint_files`; rank 0 digests the main process's files,
      every rank its ``random_states_<rank>.pkl``).
    * :meth:`start`: the daemon's target, if any: this rank's shard and every file it lists
      verified (:meth:`Agent.load_files`), then ``accelerator.load_state`` (a load pre-hook
      refuses any folder not verified so), which restores model, optimizer, RNG states and
      the stateful loader's position; then ``agent.ready``.

    The data position is the stateful loader's: with
    ``DataLoaderConfiguration(use_stateful_dataloader=True)`` ``save_state`` stores its
    ``state_dict`` (batches yielded in the epoch) and ``load_state`` puts it back; the epoch
    is in a registered object (``register_for_checkpointing``). The trainguard cursor is
    computed from the step.

    Args:
        agent: the entered agent of this rank; its ``in_process_restore`` must be off
            (restores restart the processes).
        accelerator: the ``Accelerator``; register nothing else for checkpointing after this.
        loader: the prepared training loader (a map-style dataset, stateful).
        data_version: the training data's version, in every cursor.
        seed: the seed of the data order (``DataLoaderConfiguration(data_seed=...)``, or the
            one ``set_seed`` gave before ``prepare``), in every cursor.

    Raises:
        ConfigError: ``in_process_restore`` is on, the loader is not stateful, it shuffles
            without ``use_seedable_sampler`` (a ``RandomSampler``'s generator is in no
            checkpoint, so a restore after the first epoch would draw another order), its
            dataset has no length, or the loader has no generator of its own.
    """

    def __init__(
        self,
        agent: Agent,
        accelerator: Accelerator,
        loader: Any,
        *,
        data_version: str,
        seed: int,
    ) -> None:
        if agent.config.in_process_restore:
            raise ConfigError(
                "TrainguardAccelerate restores by restarting the processes: turn the agent's "
                "in_process_restore off (TRAINGUARD_IN_PROCESS_RESTORE)"
            )
        if not getattr(loader, "use_stateful_dataloader", False):
            raise ConfigError(
                "the loader is not stateful: prepare it with an Accelerator made with "
                "DataLoaderConfiguration(use_stateful_dataloader=True)"
            )
        sampler = loader.get_sampler()
        if isinstance(sampler, RandomSampler) and not isinstance(sampler, SeedableRandomSampler):
            # Its generator's state, which each epoch advances, is in no checkpoint: a
            # restore mid-epoch past the first would draw another order (accelerate#3938).
            raise ConfigError(
                "a shuffling loader needs a seeded order: DataLoaderConfiguration("
                "use_seedable_sampler=True, data_seed=...)"
            )
        if getattr(loader, "generator", None) is None:
            # Every iter(loader) draws a base seed from its generator, by default torch's
            # global one: a restored loop starts its pass mid-epoch, after the RNG restore,
            # and that draw would shift every later dropout mask.
            raise ConfigError(
                "give the DataLoader a generator of its own (generator=torch.Generator()"
                ".manual_seed(seed)): by default each pass draws its seed from torch's global "
                "generator, which a restore mid-epoch would shift"
            )
        if not hasattr(loader.dataset, "__len__"):
            raise ConfigError(
                "the dataset has no length: its position is not a function of the step"
            )
        self.agent = agent
        self.accelerator = accelerator
        self.loader = loader
        c = agent.config
        self.position = StepPosition(
            data_version=data_version,
            seed=seed,
            steps_per_epoch=max(len(loader), 1),
            global_batch=int(loader.total_batch_size),
            world_size=c.world_size,
        )
        self._progress = _Progress()
        self._verified: Path | None = None
        accelerator.register_for_checkpointing(self._progress)
        accelerator.register_save_state_pre_hook(self._before_save)
        accelerator.register_load_state_pre_hook(self._before_load)

    @property
    def output_dir(self) -> Path:
        """``<checkpoint_dir>/<job>/accelerate/g<generation:06>``: where the states go."""
        c = self.agent.config
        return c.checkpoint_dir.resolve() / c.job_id / "accelerate" / f"g{c.generation:06}"

    @property
    def epoch(self) -> int:
        """The epoch :meth:`batches` is in."""
        return self._progress.epoch

    def cursor(self, step: int) -> DataCursor:
        """The data cursor after step ``step``."""
        return self.position.cursor(step)

    def start(self) -> int:
        """Load the daemon's restore target (if any), acknowledge, and return the step to
        continue from (0 for a fresh start). Call it once, in every process, before training.

        Raises:
            ShardError: the target's files failed verification (reported to the daemon, which
                restores an older snapshot in new processes).
            ValueError: the target was trained on other data or another world size.
            RestoreTimeout, JobAborted, StaleGeneration: as :meth:`Agent.restore_target` and
                :meth:`Agent.ready`.
        """
        step = 0
        target = self.agent.restore_target()
        if target is not None:
            self._verified = load_folder(self.agent, target, self.position.data_version)
            self.accelerator.load_state(str(self._verified))
            step = target.step
        self.agent.ready(step, cursor=self.cursor(step))
        return step

    def batches(self) -> Iterator[Any]:
        """The loader's batches, epoch after epoch, for ever: each epoch's order drawn again
        (``set_epoch``), the first one resumed where a restored loader stands."""
        while True:
            self.loader.set_epoch(self._progress.epoch)
            yield from self.loader
            self._progress.epoch += 1

    def step(self, step: int, *, loss: float | None = None) -> None:
        """Report step ``step`` (:meth:`Agent.step`: faults fire here)."""
        self.agent.step(
            step, loss=loss, samples=self.position.global_batch // self.position.world_size
        )

    def save_state(self, step: int, *, blocking: bool = False) -> None:
        """Save the state of step ``step`` and announce it (every rank, at the same step).

        Args:
            step: the step just completed.
            blocking: write trainguard's index shard on this thread, not in the background.
        """
        self._progress.step = step
        folder = self.output_dir / f"step-{step}"
        self.accelerator.save_state(str(folder))
        # Every rank writes the loader's state to the same file: digest it once all have.
        self.accelerator.wait_for_everyone()
        announce_folder(self.agent, step, folder, self.cursor(step), blocking=blocking)
        self.agent.phase("train")

    # -- Accelerate's hooks ----------------------------------------------------------------------

    def _before_save(self, models: Any, weights: Any, output_dir: str) -> None:
        """A save may take long: declare it."""
        self.agent.phase("checkpoint")

    def _before_load(self, models: Any, input_dir: str) -> None:
        """Refuse to load a folder :meth:`start` did not verify."""
        if self._verified is None or Path(input_dir).resolve() != self._verified.resolve():
            raise ShardError(
                f"{input_dir} was not verified by trainguard: restore with "
                "TrainguardAccelerate.start(), which checks every file first"
            )
