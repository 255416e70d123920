"""The optimum checkpoint interval and the goodput it gives, after Young and Daly.

Pure arithmetic on three or four numbers, shared by the job report (``trainguard report``) and
the simulator (``trainguard sim``), so that both compare a measured goodput with the same
model. Symbols, all in seconds:

* ``C``: the cost of one checkpoint (training stands still that long);
* ``M``: the mean time between failures of the whole job;
* ``tau``: compute time between two checkpoints;
* ``D``, ``R``: the time from a failure to its detection, and from the detection to training
  again (restart, loading, the barrier); ``D + R`` is the downtime of one failure.

The first-order model: per period of ``tau + C`` the job loses ``C`` to the checkpoint, and
each failure (one per ``M`` on average) costs the work since the last checkpoint (``tau / 2``
on average) plus ``D + R``. So goodput ~ ``1 - C / tau - tau / (2 M) - (D + R) / M``, which
``tau = sqrt(2 C M)`` (Young) maximises for ``C << M``.
"""

from __future__ import annotations

import math

__all__ = [
    "DALY_SOURCE",
    "YOUNG_SOURCE",
    "daly_interval_s",
    "model_goodput",
    "young_interval_s",
]

YOUNG_SOURCE = (
    'J. W. Young, "A first order approximation to the optimum checkpoint interval", '
    "Communications of the ACM 17(9), 1974"
)
DALY_SOURCE = (
    'J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart '
    'dumps", Future Generation Computer Systems 22(3), 2006'
)


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's checkpoint interval ``sqrt(2 * C * M)``, seconds of compute between checkpoints,
    for a checkpoint cost ``cost_s`` and a mean time between failures ``mtbf_s`` (seconds,
    both >= 0). Source: :data:`YOUNG_SOURCE`."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order estimate of the optimum checkpoint interval, seconds:
    ``sqrt(2 C M) * (1 + sqrt(C / (2 M)) / 3 + C / (2 M) / 9) - C`` for ``C < 2 M``, else ``M``
    (``C = cost_s``, ``M = mtbf_s`` > 0, seconds). Source: :data:`DALY_SOURCE` (its
    higher-order estimate of the optimum compute time between checkpoints)."""
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2.0 * mtbf_s)
    return young_interval_s(cost_s, mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost_s


def model_goodput(
    cost_s: float, mtbf_s: float, downtime_s: float, interval_s: float | None = None
) -> float:
    """The first-order model's goodput (productive time / wall time):
    ``1 - C / tau - tau / (2 M) - (D + R) / M`` (module docstring; Young, :data:`YOUNG_SOURCE`,
    whose derivation it follows; Daly, :data:`DALY_SOURCE`, section 2).

    Args:
        cost_s: ``C``, seconds per checkpoint, >= 0.
        mtbf_s: ``M``, mean time between failures, seconds, > 0.
        downtime_s: ``D + R``, seconds from a failure to training again, >= 0.
        interval_s: ``tau``, seconds of compute between checkpoints, > 0; ``None``: Young's
            interval for ``C`` and ``M`` (with ``C = 0``: no checkpoint cost, and no work lost
            to a failure).

    Returns:
        The predicted goodput, at most 1; it may be negative where the first-order model no
        longer holds (``D + R`` or ``tau`` not small against ``M``).

    Raises:
        ValueError: ``mtbf_s`` not > 0, ``interval_s`` not > 0, or a negative cost or
            downtime.
    """
    if not mtbf_s > 0:
        raise ValueError(f"the mean time between failures must be > 0 s, not {mtbf_s!r}")
    if cost_s < 0 or downtime_s < 0:
        raise ValueError(f"cost ({cost_s!r} s) and downtime ({downtime_s!r} s) must be >= 0")
    tau = young_interval_s(cost_s, mtbf_s) if interval_s is None else interval_s
    if interval_s is not None and not interval_s > 0:
        raise ValueError(f"the checkpoint interval must be > 0 s, not {interval_s!r}")
    checkpointing = cost_s / tau if tau > 0 else 0.0
    return 1.0 - checkpointing - tau / (2.0 * mtbf_s) - downtime_s / mtbf_s
