"""A bounded window of recent samples and the order statistics the detectors read from it.

The state machine's state is immutable, so a window cannot be a ring buffer written in place.
:class:`Window` keeps the newest samples in a short tuple and the older ones in full chunks of
:data:`CHUNK` samples: adding a sample copies at most ``CHUNK`` references, and statistics are
recomputed only when a chunk fills (``push`` says so), from the full chunks. Per sample that is
O(1) amortised; each recomputation sorts at most ``size`` floats (about 5 us for 256).

Sources: the nearest-rank quantile is definition 1 of Hyndman & Fan, "Sample quantiles in
statistical packages", The American Statistician 50(4), 1996 (the inverse of the empirical
distribution function). The median absolute deviation and its consistency constant 1.4826
(= 1 / Phi^-1(3/4), making it estimate the standard deviation of normal data) follow Hampel,
"The influence curve and its role in robust estimation", JASA 69(346), 1974; Rousseeuw &
Croux, "Alternatives to the median absolute deviation", JASA 88(424), 1993.

:func:`robust_z_critical` is the critical value of the robust z-score of a *new* sample
against a window of ``n`` samples; its sources are in its docstring and ``docs/detection.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple

CHUNK = 8
"""Samples per chunk: statistics are recomputed once every ``CHUNK`` samples."""

MAD_TO_SIGMA = 1.4826
"""Consistency constant: ``MAD_TO_SIGMA * MAD`` estimates the standard deviation of normal data."""


class Window(NamedTuple):
    """The newest samples of a series, at most ``size`` of them in full chunks.

    Attributes:
        recent: the newest samples, fewer than :data:`CHUNK`, oldest first; not yet part of
            the statistics.
        chunks: full chunks of :data:`CHUNK` samples, oldest first.
    """

    recent: tuple[float, ...] = ()
    chunks: tuple[tuple[float, ...], ...] = ()

    def push(self, value: float, size: int) -> tuple[Window, bool]:
        """Add ``value``; return the new window and whether a chunk filled (recompute then).

        Args:
            value: the sample.
            size: samples kept in full chunks, a multiple of :data:`CHUNK`; the oldest chunk is
                dropped when a new one would exceed it.
        """
        recent = (*self.recent, value)
        if len(recent) < CHUNK:
            return Window(recent, self.chunks), False
        return Window((), (*self.chunks, recent)[-(size // CHUNK) :]), True

    def values(self) -> list[float]:
        """The samples of the full chunks, oldest first (a new list)."""
        return list(chain.from_iterable(self.chunks))

    @property
    def filled(self) -> int:
        """Samples in full chunks (those the statistics see)."""
        return CHUNK * len(self.chunks)


def quantile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank ``q``-quantile of ascending, non-empty ``ordered`` (Hyndman & Fan def. 1).

    Args:
        ordered: samples sorted ascending.
        q: the probability, ``0 < q <= 1``.

    Returns:
        The smallest sample ``x`` with at least a fraction ``q`` of the samples ``<= x``.
    """
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def median(ordered: Sequence[float]) -> float:
    """Median of ascending, non-empty ``ordered`` (mean of the two middle samples if even)."""
    n = len(ordered)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def median_and_mad(values: Sequence[float]) -> tuple[float, float]:
    """Median and median absolute deviation ``median(|x - median|)`` of non-empty ``values``."""
    centre = median(sorted(values))
    return centre, median(sorted([abs(v - centre) for v in values]))


def t_tail(t: float, dof: int) -> float:
    """Upper tail ``P(T > t)`` of Student's t distribution with ``dof`` degrees of freedom.

    The finite series of Abramowitz & Stegun, *Handbook of Mathematical Functions*, 26.7.3 (odd
    ``dof``) and 26.7.4 (even), exact for integer ``dof``; ``1 - A`` keeps about 9 significant
    digits at a tail of 1e-7, 4 at 1e-12.

    Args:
        t: the value, >= 0.
        dof: degrees of freedom, >= 1.
    """
    theta = math.atan(t / math.sqrt(dof))
    cos2 = math.cos(theta) ** 2
    if dof % 2:
        term = total = math.cos(theta) if dof > 1 else 0.0
        for k in range(1, (dof - 1) // 2):
            term *= 2 * k / (2 * k + 1) * cos2
            total += term
        inside = 2 / math.pi * (theta + math.sin(theta) * total)
    else:
        term = total = 1.0
        for k in range(dof // 2 - 1):
            term *= (2 * k + 1) / (2 * k + 2) * cos2
            total += term
        inside = math.sin(theta) * total
    return max(0.0, (1 - inside) / 2)


@functools.cache
def robust_z_critical(n: int, false_alarm: float) -> float:
    """The robust z-score ``(x - median) / (MAD_TO_SIGMA * MAD)`` of the median and MAD of ``n``
    samples that a new, independent sample ``x`` of the same normal distribution reaches with
    probability ``false_alarm``.

    The MAD of a small window often underestimates the standard deviation, so the score's
    tails are much heavier than the normal's (``P(z >= 6)`` is 4.8e-4 at ``n`` = 16, 3e-5 at
    32, against 1e-9 for a known standard deviation). The score is approximated as

        z ~ b_n * sqrt(1 + pi / (2 n)) * T_nu,   nu = floor(0.39 n + 0.6)

    with ``b_n = n / (n - 0.8)`` the small-sample correction of the MAD (Croux & Rousseeuw,
    "Time-efficient algorithms for two highly robust estimators of scale", Computational
    Statistics 1, 1992), ``pi / (2 n)`` the variance of the median of ``n`` normal samples
    relative to one sample's (so ``x - median`` has the variance of a prediction error) and
    ``T_nu`` Student's t with ``nu`` effective degrees of freedom, fitted by simulation for
    ``n`` from 8 to 256 (``bench/loss_false_alarm.py``; rounding down makes the tail heavier,
    so the returned value errs high). Cached: a pure function of its arguments.

    Args:
        n: samples in the window, >= 2.
        false_alarm: the tail probability, in (0, 0.5).

    Returns:
        The critical value, > 0.
    """
    dof = max(1, math.floor(0.39 * n + 0.6))
    # The t quantile by bisection (the tail falls monotonically), then in the score's units.
    low, high = 0.0, 1.0
    while t_tail(high, dof) > false_alarm:
        low, high = high, 2 * high
    for _ in range(64):
        mid = (low + high) / 2
        if t_tail(mid, dof) > false_alarm:
            low = mid
        else:
            high = mid
    return high * n / (n - 0.8) * math.sqrt(1 + math.pi / (2 * n))
