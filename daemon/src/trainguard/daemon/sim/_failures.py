"""The faults a simulation injects: drawn from a failure rate, or read from a trace.

Times are seconds of the job's *training time* (the clock the mean time between failures
counts, which stands still while the job is down; :mod:`._model`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import cast, get_args

from trainguard.daemon.sim._model import FAULT_KINDS, Fault, FaultKind

__all__ = ["TraceError", "draw_faults", "parse_trace"]


class TraceError(ValueError):
    """A failure trace that cannot be read: names the line and what is wrong."""


def draw_faults(
    count: int, mtbf_s: float, kinds: Sequence[FaultKind], ranks: int, seed: int
) -> tuple[tuple[Fault, ...], float]:
    """``count`` faults of a Poisson process of rate ``1 / mtbf_s`` in training time, and the
    training time at which the run should end.

    The gaps between faults are exponential with mean ``mtbf_s`` (memoryless failures, the
    assumption of Young's and Daly's models); the kinds take turns in the order of ``kinds``
    (so that every kind is seen), each striking a rank drawn uniformly. The run ends at the
    arrival the process would have next (the ``count + 1``-th): ``count`` failures in
    ``count + 1`` whole gaps.

    Args:
        count: faults to draw, >= 0.
        mtbf_s: mean time between failures, seconds of training time, > 0.
        kinds: the kinds, at least one.
        ranks: the world size (victims are drawn below it).
        seed: seeds every draw: one seed, one sequence.

    Returns:
        ``(faults, horizon_s)``.

    Raises:
        ValueError: ``count < 0``, ``mtbf_s <= 0`` or no kinds.
    """
    if count < 0 or not mtbf_s > 0 or not kinds:
        raise ValueError("count must be >= 0, mtbf_s > 0, and at least one kind given")
    rng = random.Random(seed)
    at = 0.0
    faults = []
    for i in range(count):
        at += rng.expovariate(1.0 / mtbf_s)
        faults.append(Fault(round(at, 3), kinds[i % len(kinds)], rng.randrange(ranks)))
    horizon = at + rng.expovariate(1.0 / mtbf_s)
    return tuple(faults), round(horizon, 3)


def parse_trace(lines: Iterable[str], ranks: int) -> tuple[Fault, ...]:
    """Faults from a trace: one per line, ``<after_s>,<kind>[,<rank>]`` (training seconds, one
    of :data:`~trainguard.daemon.sim._model.FAULT_KINDS`, the victim; rank 0 when left out),
    blank lines and ``#`` comments ignored.

    Raises:
        TraceError: a malformed line, an unknown kind, a time not >= 0 or a rank not below
            ``ranks``, or times out of order.
    """
    faults: list[Fault] = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = [part.strip() for part in line.split(",")]
        if len(parts) not in (2, 3):
            raise TraceError(f"line {number}: expected <after_s>,<kind>[,<rank>], got {line!r}")
        try:
            after = float(parts[0])
            rank = int(parts[2]) if len(parts) == 3 else 0
        except ValueError:
            raise TraceError(f"line {number}: not a number in {line!r}") from None
        if parts[1] not in get_args(FaultKind):
            raise TraceError(f"line {number}: unknown kind {parts[1]!r} (one of {FAULT_KINDS})")
        if not 0 <= after < float("inf") or not 0 <= rank < ranks:
            raise TraceError(f"line {number}: time must be >= 0 and rank below {ranks}")
        if faults and after < faults[-1].after_s:
            raise TraceError(f"line {number}: times must not decrease")
        faults.append(Fault(after, cast(FaultKind, parts[1]), rank))
    return tuple(faults)
