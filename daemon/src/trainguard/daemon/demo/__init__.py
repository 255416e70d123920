"""``trainguard demo``, and the harness behind it: a real job run under trainguard with
failures injected, its record read back (:mod:`._harness`; also used by the scenario tests and
the recovery benchmark).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.daemon.demo._demo import (
        DemoOptions,
        run_demo,
    )

_LAZY: dict[str, str] = {
    "DemoOptions": "trainguard.daemon.demo._demo",
    "run_demo": "trainguard.daemon.demo._demo",
}
"""Each public name -> the module that defines it; imported on first use: the harness starts processes and reads the bus."""


def __getattr__(name: str) -> Any:
    """The names of :data:`_LAZY`, imported when first asked for (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "DemoOptions",
    "run_demo",
]
