"""The job's step-time and loss series and what the detectors derive from them.

Adaptive progress timeout (ARCHITECTURE.md section 4, "hang"): from the last
``progress_window`` sampled step times,

    timeout = clamp(progress_factor * Q(progress_quantile), progress_floor_s, progress_ceiling_s)

with ``Q`` the nearest-rank quantile (:func:`~trainguard.daemon.core._window.quantile`). It is
recomputed when a chunk of samples fills, so per sample the work is O(1) amortised; until
``progress_min_samples`` step times are in, the start-up allowance applies instead.

Loss level: the median and median absolute deviation of the last ``loss_window`` normal loss
samples, for the robust z-score ``(loss - median) / (1.4826 * MAD)`` of the spike detector
(Iglewicz & Hoaglin, "How to Detect and Handle Outliers", ASQC 1993, use the same statistic as
their "modified z-score").
"""

from __future__ import annotations

import math

from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._state import Trend
from trainguard.daemon.core._window import MAD_TO_SIGMA, median, median_and_mad, quantile

_NS_PER_S = 1_000_000_000


def advance(
    trend: Trend, step: int, seconds: float | None, loss: float | None, config: MachineConfig
) -> tuple[Trend, int]:
    """Fold a lead sample into ``trend``: raise the high-water step to ``step``, add a sampled
    step time (``seconds``) and a normal loss (``loss``) when given, and recompute the
    statistics of a window whose chunk filled.

    Returns:
        The new trend, and by how much (ns) the timeout that applies to ranks past their
        start-up steps shrank (0 if it did not): every such rank's stall deadline moved
        earlier by at most that much, so the caller lowers its deadline bound by it.
    """
    (step_times, losses, timeout, high, typical, centre, mad, high_water) = trend
    shrunk = 0
    if seconds is not None:
        step_times, filled = step_times.push(seconds, config.progress_window)
        if filled and step_times.filled >= config.progress_min_samples:
            ordered = sorted(step_times.values())
            high = quantile(ordered, config.progress_quantile)
            typical = median(ordered)
            before = config.startup_allowance_ns if timeout is None else timeout
            timeout = round(config.progress_factor * high * _NS_PER_S)
            timeout = min(max(timeout, config.progress_floor_ns), config.progress_ceiling_ns)
            shrunk = max(0, before - timeout)
    if loss is not None:
        losses, filled = losses.push(loss, config.loss_window)
        if filled and losses.filled >= config.loss_min_samples:
            centre, mad = median_and_mad(losses.values())
    if seconds is None and loss is None and step <= high_water:
        return trend, 0
    high_water = max(high_water, step)
    return Trend(step_times, losses, timeout, high, typical, centre, mad, high_water), shrunk


def robust_z(loss: float, centre: float, mad: float) -> float:
    """``(loss - centre) / (1.4826 * mad)``; with a zero MAD, ``inf`` above the centre and 0
    otherwise (``loss_spike_min_rise`` then decides)."""
    scale = MAD_TO_SIGMA * mad
    if scale > 0:
        return (loss - centre) / scale
    return math.inf if loss > centre else 0.0
