"""Errors of the agent: one base, subclasses named for the condition; and the one
control-flow signal a training loop catches, :class:`RestoreRequested`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainguard.schemas import Restore, StepRange

if TYPE_CHECKING:
    from trainguard.agent.checkpoint._snapshot import Snapshot

__all__ = [
    "AgentError",
    "ConfigError",
    "JobAborted",
    "RestoreRequested",
    "RestoreTimeout",
    "ShardCorrupt",
    "ShardError",
    "ShardMissing",
    "StaleGeneration",
    "StorageUnavailable",
]


class AgentError(Exception):
    """Base of the agent's errors."""


class ConfigError(AgentError, ValueError):
    """A setting is missing or invalid; the message names the setting or environment variable."""


class StorageUnavailable(AgentError, ConnectionError):
    """Checkpoint storage did not answer the agent's check at start (connection refused, timed
    out, busy) in any of a few attempts; the message names the URI and the last error. Not a
    :class:`ConfigError`: an outage may end, so the process exits as after a crash, and is
    restarted (``docs/checkpoints.md``, "Object storage")."""


class ShardError(AgentError):
    """A checkpoint shard cannot be used (the agent reported its snapshot to the daemon)."""


class ShardMissing(ShardError, FileNotFoundError):
    """The shard file named in a manifest does not exist, or the manifest has no shard for
    this rank."""


class ShardCorrupt(ShardError):
    """The shard's bytes do not match the digest in its manifest; it was not deserialized."""


class RestoreTimeout(AgentError, TimeoutError):
    """The daemon's ``restore`` or ``resume`` command for this generation did not arrive in
    time, or the manifest of the ``init_from`` snapshot could not be read from the bus."""


class JobAborted(AgentError):
    """The daemon aborted the job; the message says why."""


class StaleGeneration(AgentError):
    """The daemon moved on to a newer generation while this process waited for its own: this
    process is fenced off and its supervisor will replace it."""


class RestoreMissed(AgentError):
    """The training loop ended before the step of an in-process restore the daemon ordered
    (its ``at_step`` lay past the job's last step): the parameters trained since the restore's
    cause are not sound, so the agent does not announce ``finished``. Raised when the
    :class:`~trainguard.agent.Agent`'s ``with`` block ends; the agent has told the daemon,
    which restarts the job from the restore's target instead (``docs/recovery.md``), and the
    process must exit with a failure for its supervisor to wait for that restart."""


class RestoreRequested(Exception):
    """Raised by :meth:`Agent.step <trainguard.agent.Agent.step>` to make the training loop
    reload a snapshot without exiting: the daemon ordered an in-process restore and the step
    just reported is its ``at_step`` (``docs/wire-contract.md``, restore).

    Not an :class:`AgentError`: nothing failed, and ``except AgentError`` must not swallow
    it. It is raised only when the agent's ``in_process_restore`` setting says the loop
    catches it; the loop then loads :attr:`target` (``agent.load``, or its own initialisation
    when it is ``None``), points its data at the snapshot's cursor, honours :attr:`skip`, and
    calls ``agent.ready(target_step, cursor=...)``, which acknowledges and waits for the
    daemon's ``resume``.

    Attributes:
        restore: the daemon's command (its ``generation`` is already the agent's).
        target: the snapshot to load (its manifest read and checked): the command's target,
            or when that is ``None`` (the job's initial state), the snapshot of another job
            this job started from (the agent's ``init_from``), or ``None``: start from scratch.
    """

    def __init__(self, restore: Restore, target: Snapshot | None = None) -> None:
        self.restore = restore
        self.target = target
        where = "scratch" if target is None else target.snapshot_id
        super().__init__(
            f"in-process restore to {where} at step {restore.at_step} "
            f"(generation {restore.generation}): {restore.reason}"
        )

    @property
    def step(self) -> int:
        """The step the restored state stands at: the target's, or 0 from scratch."""
        target = self.target
        return 0 if target is None else target.step

    @property
    def skip(self) -> StepRange | None:
        """Steps whose batches to skip after reloading (see ``Agent.skip``), or ``None``."""
        return self.restore.skip
