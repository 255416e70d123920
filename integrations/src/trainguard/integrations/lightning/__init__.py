"""trainguard for PyTorch Lightning (``pip install 'trainguard[lightning]'``; importing this
package imports ``lightning``).

:class:`TrainguardCallback` drives a :class:`trainguard.agent.Agent` from a ``Trainer``'s hooks
and installs :class:`TrainguardCheckpointIO`, through which ``trainer.fit(ckpt_path=...)``
restores the daemon's target, verified before it is loaded; :class:`ResumableBatches` makes
the training data a stream whose position is trainguard's data cursor, so that a restore in the
middle of an epoch resumes with exactly the next batch. Supported strategies
(:data:`SUPPORTED_STRATEGIES`): one device, and DDP with the ranks started by ``trainguard
run`` or ``torchrun``. ``docs/integrations-lightning.md`` has the details and the limits.
"""

from __future__ import annotations

from trainguard.integrations._extras import require as _require

_require("trainguard.integrations.lightning", "lightning", "lightning")

from trainguard.integrations.lightning._batches import ResumableBatches  # noqa: E402
from trainguard.integrations.lightning._callback import SUPPORTED_STRATEGIES, TrainguardCallback  # noqa: E402
from trainguard.integrations.lightning._checkpoint_io import (  # noqa: E402
    CHECKPOINT_KEY,
    SCHEME,
    TrainguardCheckpointIO,
    is_trainguard_path,
)

__all__ = [
    "CHECKPOINT_KEY",
    "SCHEME",
    "SUPPORTED_STRATEGIES",
    "ResumableBatches",
    "TrainguardCallback",
    "TrainguardCheckpointIO",
    "is_trainguard_path",
]
