"""The data cursor of a framework whose data order is a function of the step (pure).

The Hugging Face ``Trainer`` and an Accelerate loop over a map-style dataset draw each epoch's
order from a seeded sampler (``SeedableRandomSampler``: seed + epoch) and hand every optimizer
step the next ``global_batch`` samples; an epoch is ``steps_per_epoch`` optimizer steps. So
``(epoch, offset)`` follows from the step, and the frameworks' own resume (which skips the
already trained index batches of the epoch without loading them) puts the loader there.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.schemas import DataCursor

__all__ = ["StepPosition"]


@dataclass(frozen=True, slots=True)
class StepPosition:
    """Where the data stands after a given optimizer step.

    Attributes:
        data_version: the dataset's version (``trainguard.agent.dataset_version`` or an id).
        seed: the sampler's seed (``data_seed``, else ``seed``), 0 <= seed < 2**64.
        steps_per_epoch: optimizer steps per epoch (>= 1).
        global_batch: samples per optimizer step over all ranks (per-device batch x
            gradient accumulation x world size, >= 1).
        world_size: ranks (informational in the cursor).
    """

    data_version: str
    seed: int
    steps_per_epoch: int
    global_batch: int
    world_size: int

    def __post_init__(self) -> None:
        if self.steps_per_epoch < 1 or self.global_batch < 1:
            raise ValueError(
                f"steps_per_epoch ({self.steps_per_epoch}) and global_batch "
                f"({self.global_batch}) must be >= 1"
            )

    def cursor(self, step: int) -> DataCursor:
        """The data cursor after optimizer step ``step`` (>= 0): epoch ``step //
        steps_per_epoch``, offset the samples of the epoch's steps done so far.

        Raises:
            ValueError: ``step`` is negative.
        """
        if step < 0:
            raise ValueError(f"step {step} is negative")
        epoch, done = divmod(step, self.steps_per_epoch)
        return DataCursor(
            data_version=self.data_version,
            seed=self.seed,
            epoch=epoch,
            offset=done * self.global_batch,
            world_size=self.world_size,
        )
