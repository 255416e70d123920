"""Pulse ticks: which quiet jobs the daemon writes a ``ClockTick`` for, to keep their streams dense.

A live job's stream of inputs is dense only while its ranks send. The daemon therefore writes a
tick, a *pulse*, for every job that is not finished, failed or stopped and has had nothing folded
for ``pulse_s`` seconds of its own monotonic clock. With the bus and the daemon working, a live
job's consecutive inputs are then at most about ``pulse_s + poll_s`` apart in bus time, so a
longer gap (the machine's ``bus_gap_s``) can only mean that the bus or the daemon was away. A
busy job needs none, and a quiet one gets one tick per ``pulse_s``: a pulse written counts as
activity, so a pulse not folded yet is never followed by another within ``pulse_s``.

"Something folded" is read from the job's state: its clock (the latest input time) moved. The
service calls :meth:`Pulse.due` for each job it holds, every loop; the rule has no I/O.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from trainguard.daemon.core import TERMINAL_PHASES, JobState

__all__ = ["Pulse"]


class _Seen(NamedTuple):
    clock_ns: int  # the job's clock when last looked at
    active_s: float  # monotonic seconds of its last fold seen, or of its last tick written


class Pulse:
    """Decides which jobs are due a pulse tick.

    Args:
        pulse_s: seconds without a fold after which a job is due, > 0.
    """

    def __init__(self, pulse_s: float) -> None:
        self._pulse_s = pulse_s
        self._seen: dict[str, _Seen] = {}

    def due(self, job: str, state: JobState, now_s: float) -> bool:
        """Whether ``job`` is due a pulse at ``now_s``.

        Args:
            job: the job id.
            state: its current state.
            now_s: the daemon's monotonic clock, seconds.

        Returns:
            ``True`` when the job is not finished, failed or stopped and neither a fold (its
            state's clock moving) nor a tick written (:meth:`ticked`) was seen for ``pulse_s``.
            The first look at a job counts as a fold.
        """
        if state.phase in TERMINAL_PHASES:
            self._seen.pop(job, None)
            return False
        seen = self._seen.get(job)
        if seen is None or seen.clock_ns != state.clock_ns:
            self._seen[job] = _Seen(state.clock_ns, now_s)
            return False
        return now_s - seen.active_s >= self._pulse_s

    def ticked(self, job: str, state: JobState, now_s: float) -> None:
        """Note that a tick of ``job`` (a pulse or a deadline's) was written at ``now_s``."""
        self._seen[job] = _Seen(state.clock_ns, now_s)

    def keep(self, jobs: Collection[str]) -> None:
        """Forget the jobs not in ``jobs`` (the jobs the service still holds) once more are
        remembered than held: memory stays below twice the jobs held, at O(1) a call."""
        if len(self._seen) > len(jobs):
            self._seen = {job: seen for job, seen in self._seen.items() if job in jobs}
