"""False alarms of the loss-spike detector on healthy (Gaussian) losses (docs/detection.md,
"Robust z-score of a loss sample").

Usage (from the repository root, numpy needed: the ``torch`` extra)::

    python bench/loss_false_alarm.py [--windows 1000000] [--false-alarm 1e-7]
                                     [--n 8 16 24 32 48 64 128 256] [--seed 1] [--fit]

For each window size ``n`` it draws ``--windows`` windows of ``n`` standard normal samples,
takes their median ``m`` and scale ``s = 1.4826 * MAD`` as the daemon does, and averages, over
the windows, the probability that a new independent normal sample opens a spike,
``P(x >= m + c s) = Q(m + c s)`` with ``Q`` the normal upper tail and ``c`` the detector's
threshold ``max(loss_spike_z, robust_z_critical(n, false_alarm))``. Averaging ``Q`` instead of
counting simulated crossings (conditioning on the window: the Rao-Blackwell estimator) makes
rates of 1e-9 measurable from a million windows. The same average of
``Q(m + c s) * Q(m + r s) ** (persist - 1)`` (``r``: ``loss_spike_return_z``) bounds the rate
of false *restores*: a spike opened by noise that noise keeps above the return threshold for
``loss_spike_persist`` samples (the healing rule can only lower it).

``--fit`` also prints, for several thresholds, the degrees of freedom ``nu`` at which
``n / (n - 0.8) * sqrt(1 + pi / (2 n)) * T_nu`` has the measured tail: the fit behind
``robust_z_critical``'s ``nu = floor(0.39 n + 0.6)`` (needs ``mpmath``, installed with torch).
The rates depend only on ``n`` (the score is location and scale invariant), not on the noise
level; a trending loss inflates the MAD and makes false alarms rarer still.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator

import numpy as np

from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._window import MAD_TO_SIGMA, robust_z_critical

_BATCH = 50_000
_ERFC = np.frompyfunc(math.erfc, 1, 1)  # numpy has no erfc; math's is exact far in the tail


def _upper(u: np.ndarray) -> np.ndarray:
    """The standard normal upper tail ``Q(u)``, elementwise."""
    return 0.5 * np.asarray(_ERFC(u / math.sqrt(2)), dtype=float)


def windows(
    rng: np.random.Generator, n: int, count: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Batches of the median and the scale (``1.4826 * MAD``) of ``count`` normal windows."""
    done = 0
    while done < count:
        k = min(_BATCH, count - done)
        w = rng.standard_normal((k, n))
        m = np.median(w, axis=1)
        yield m, MAD_TO_SIGMA * np.median(np.abs(w - m[:, None]), axis=1)
        done += k


def rates(
    rng: np.random.Generator, n: int, count: int, thresholds: list[float], back: float, persist: int
) -> tuple[list[float], list[float], list[float]]:
    """Per threshold: the mean rate of opening a spike, its standard error (the spread of the
    windows' probabilities over the square root of their number: an estimate dominated by a
    few windows with a tiny MAD shows a large one), and the bound on false restores."""
    opens = np.zeros(len(thresholds))
    squares = np.zeros(len(thresholds))
    restores = np.zeros(len(thresholds))
    for m, s in windows(rng, n, count):
        stay = _upper(m + back * s) ** (persist - 1)
        for i, c in enumerate(thresholds):
            q = _upper(m + c * s)
            opens[i] += q.sum()
            squares[i] += (q * q).sum()
            restores[i] += (q * stay).sum()
    mean = opens / count
    error = np.sqrt(np.maximum(squares / count - mean * mean, 0.0) / count)
    return list(mean), list(error), list(restores / count)


def implied_dof(n: int, c: float, rate: float) -> float:
    """The degrees of freedom at which the scaled t has tail ``rate`` at ``c``."""
    import mpmath

    t = c / (n / (n - 0.8) * math.sqrt(1 + math.pi / (2 * n)))
    low, high = 0.5, 1000.0
    for _ in range(60):
        mid = math.sqrt(low * high)
        tail = float(0.5 * mpmath.betainc(mid / 2, 0.5, 0, mid / (mid + t * t), regularized=True))
        low, high = (mid, high) if tail > rate else (low, mid)
    return mid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=1_000_000)
    parser.add_argument("--false-alarm", type=float, default=None)
    parser.add_argument("--n", type=int, nargs="+", default=[8, 16, 24, 32, 48, 64, 128, 256])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fit", action="store_true")
    args = parser.parse_args()
    cfg = MachineConfig(daemon_id="bench")
    alpha = cfg.loss_spike_false_alarm if args.false_alarm is None else args.false_alarm
    rng = np.random.default_rng(args.seed)
    print(f"false_alarm {alpha:g}, loss_spike_z {cfg.loss_spike_z:g}, windows {args.windows}")
    print("| n | threshold | P(open) per sample (+- 1 se) | old P(open), z 6 | P(restore) bound |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.n:
        threshold = max(cfg.loss_spike_z, robust_z_critical(n, alpha))
        grid = [threshold, cfg.loss_spike_z, 8.0, 12.0] if args.fit else [threshold, 6.0]
        opens, errors, restores = rates(
            rng, n, args.windows, grid, cfg.loss_spike_return_z, cfg.loss_spike_persist
        )
        print(
            f"| {n} | {threshold:.2f} | {opens[0]:.1e} +- {errors[0]:.0e} | {opens[1]:.1e} "
            f"| {restores[0]:.0e} |",
            flush=True,
        )
        if args.fit:
            dofs = ", ".join(
                f"z {c:.1f}: {implied_dof(n, c, r):.1f}"
                for c, r in zip(grid, opens, strict=True)
                if r > 0
            )
            print(f"|   | nu fitted: {dofs} | | | |")


if __name__ == "__main__":
    main()
