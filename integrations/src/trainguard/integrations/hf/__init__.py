"""trainguard for the Hugging Face ``Trainer`` (``pip install 'trainguard[hf]'``).

:class:`TrainguardCallback` reports the ``Trainer``'s steps, losses and phases to a
:class:`trainguard.agent.Agent`, announces each checkpoint it saves with its files' digests,
and starts ``trainer.train(resume_from_checkpoint=...)`` from the daemon's verified restore
target (``docs/integrations-hf.md``). Importing this package imports ``transformers``.
"""

from __future__ import annotations

from trainguard.integrations._extras import require as _require

_require("trainguard.integrations.hf", "hf", "transformers", "accelerate")

from trainguard.integrations.hf._callback import TrainguardCallback  # noqa: E402

__all__ = ["TrainguardCallback"]
