"""The launcher scenarios run ``examples/lightning`` as the Lightning scenarios do, against
the same reference run (shared through the session's folder)."""

from __future__ import annotations

from tests.scenarios.lightning.conftest import lightning_reference

__all__ = ["lightning_reference"]
