"""Figures the benchmarks share: quantiles of measured spans, and the state of the machine a
run was measured on."""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Sequence
from datetime import datetime

__all__ = ["format_quantiles", "machine_notes", "quantiles"]


def quantiles(values: Sequence[float]) -> tuple[float, float, float] | None:
    """p50, p90 (linear interpolation between order statistics, ``statistics.quantiles``
    with ``method="inclusive"``) and maximum; ``None`` if empty."""
    if not values:
        return None
    if len(values) == 1:
        return values[0], values[0], values[0]
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return statistics.median(values), cuts[8], max(values)


def format_quantiles(values: Sequence[float], scale: float = 1.0, digits: int = 2) -> list[str]:
    """:func:`quantiles` of ``values`` times ``scale`` (e.g. 1e3 for seconds to ms), as text
    with ``digits`` decimals; three ``"-"`` if empty."""
    q = quantiles(values)
    if q is None:
        return ["-", "-", "-"]
    return [f"{v * scale:.{digits}f}" for v in q]


def machine_notes() -> list[str]:
    """Date (local, ISO 8601), CPU count, 1/5/15-minute load averages and Python version."""
    load = os.getloadavg()
    return [
        f"date {datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        f"Python {sys.version.split()[0]}",
    ]
