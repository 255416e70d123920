"""Lightning's checkpoint reads and writes, with trainguard's snapshots routed to the agent."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO

from trainguard.agent import Agent, Snapshot

__all__ = ["CHECKPOINT_KEY", "SCHEME", "TrainguardCheckpointIO", "is_trainguard_path"]

SCHEME = "trainguard://"
"""Prefix of the checkpoint paths that name trainguard snapshots (``trainguard://<job>/g<G>/s<S>``,
a snapshot id): Lightning passes them to the ``CheckpointIO``, no file has them."""

CHECKPOINT_KEY = "lightning"
"""Key of Lightning's checkpoint dict in a rank's trainguard shard."""


def is_trainguard_path(path: _PATH) -> bool:
    """Whether ``path`` names a trainguard snapshot rather than a file."""
    return str(path).startswith(SCHEME)


class TrainguardCheckpointIO(CheckpointIO):
    """The trainer's ``CheckpointIO`` while :class:`TrainguardCallback` runs (the callback
    installs it in ``setup``): paths under :data:`SCHEME` are trainguard's, every other path
    is passed on to the ``CheckpointIO`` it replaced (the user's own ``ModelCheckpoint`` files
    are written and read as before).

    * Saving a trainguard path writes nothing: Lightning saves on global rank 0 only, and
      trainguard needs a shard from every rank, so the callback hands the checkpoint dict to
      :meth:`Agent.checkpoint <trainguard.agent.Agent.checkpoint>` on every rank itself (the
      shard's SHA-256 is computed as it is written).
    * Loading the trainguard path of the restore target (the callback's ``ckpt_path``) reads
      this rank's shard through :meth:`Agent.load <trainguard.agent.Agent.load>`: its digest is
      checked against the committed manifest before a byte is deserialized
      (``torch.load(weights_only=True)``), and the RNG states it holds are put back. A shard
      that does not match raises :class:`~trainguard.agent.ShardCorrupt` after the agent told
      the daemon, which then restores the snapshot before it.

    Args:
        agent: this rank's agent (entered).
        target: the snapshot this process restores, or ``None``.
        inner: the ``CheckpointIO`` for every other path (default ``TorchCheckpointIO``).
    """

    def __init__(
        self, agent: Agent, target: Snapshot | None, inner: CheckpointIO | None = None
    ) -> None:
        self.agent = agent
        self.target = target
        self.inner = inner if inner is not None else TorchCheckpointIO()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        """Nothing for a trainguard path (the callback writes every rank's shard); otherwise
        the inner ``CheckpointIO``'s save."""
        if not is_trainguard_path(path):
            self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's checkpoint dict of ``path``: for the restore target's trainguard path,
        this rank's shard, verified, with its RNG states put back (tensors on the CPU;
        Lightning moves them); otherwise the inner ``CheckpointIO``'s load.

        Raises:
            ValueError: a trainguard path that is not this process's restore target.
            ShardCorrupt, ShardMissing, ShardError: as :meth:`Agent.load
                <trainguard.agent.Agent.load>` (reported to the daemon first).
        """
        if not is_trainguard_path(path):
            return self.inner.load_checkpoint(
                path, map_location=map_location, weights_only=weights_only
            )
        target = self.target
        if target is None or str(path) != SCHEME + target.snapshot_id:
            raise ValueError(
                f"{path} is not this process's restore target "
                f"({None if target is None else SCHEME + target.snapshot_id})"
            )
        state = self.agent.load(target)
        checkpoint = state.get(CHECKPOINT_KEY)
        if not isinstance(checkpoint, dict):
            raise ValueError(f"snapshot {target.snapshot_id} holds no Lightning checkpoint")
        return checkpoint

    def remove_checkpoint(self, path: _PATH) -> None:
        """Nothing for a trainguard path (the daemon's retention prunes snapshots); otherwise
        the inner ``CheckpointIO``'s removal."""
        if not is_trainguard_path(path):
            self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        """The inner ``CheckpointIO``'s teardown."""
        self.inner.teardown()
