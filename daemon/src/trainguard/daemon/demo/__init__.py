"""``trainguard demo``, and the harness behind it: a real job run under trainguard with
failures injected, its record read back (:mod:`._harness`; also used by the scenario tests and
the recovery benchmark).
"""

from __future__ import annotations

from trainguard.daemon.demo._demo import DemoOptions, run_demo

__all__ = ["DemoOptions", "run_demo"]
