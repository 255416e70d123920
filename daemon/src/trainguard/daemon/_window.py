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
"""

from __future__ import annotations

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
