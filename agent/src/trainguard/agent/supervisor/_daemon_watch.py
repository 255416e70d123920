"""Is a daemon reading this job? What a supervisor (or ``trainguard stop``) can see cheaply.

The daemon reads the ``events`` topic as a member of its consumer group (``<prefix>daemon``
unless configured otherwise) and commits its position after acting on what it read
(``docs/architecture.md``). So a daemon *answers* a job when its group's committed position on
the job's partition of ``events`` passes the records written there: the job's own reports and
heartbeats, and the daemon's ticks. Both numbers are two cheap reads on either bus (the
partition's end offset, the group's committed offsets read without joining the group), and
they need no record from the daemon: a healthy job for which the daemon decides nothing for
hours is answered all the same.

:class:`DaemonWatch` samples the partition's end offset every poll; a sample the group's
position has not passed after ``timeout_s`` means nobody read the job's records for that long:
no daemon on this bus and prefix (the classic trap: the daemon started with another ``--bus``),
a daemon of another consumer group, or a daemon that is down or far behind. It then logs a
warning, again every ``warn_every_s`` while it lasts, and once that the daemon reads again.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Final

import structlog

from trainguard.agent.bus import Bus, BusError, TopicPartition, partition_for

__all__ = ["DaemonWatch", "poll_interval_s"]

log = structlog.get_logger("trainguard.supervisor")

_MAX_POLL_S: Final = 5.0
"""Longest time between two looks at the offsets, seconds."""


def poll_interval_s(timeout_s: float) -> float:
    """Seconds between two looks at the offsets for a warning after ``timeout_s``: a quarter
    of it, between 0.25 and 5 s."""
    return max(0.25, min(_MAX_POLL_S, timeout_s / 4))


class DaemonWatch:
    """Warns while no daemon reads a job's records of ``events`` (module docstring).

    Args:
        job_id: the job; its partition of ``events`` is watched.
        group_id: the daemon's consumer group (``<prefix>daemon`` by default, as
            :attr:`trainguard.daemon.service._settings.DaemonConfig.group`).
        timeout_s: seconds a record may stay unread by the group before the warning, > 0.
        warn_every_s: seconds between two warnings while it lasts, > 0.
        where: the bus URL and topic prefix, named in the warning.
        clock: monotonic seconds (injected by tests).

    Attributes:
        position: the group's committed position on the job's partition at the last look, or
            ``None`` (it never committed one, or no look yet).
    """

    def __init__(
        self,
        job_id: str,
        group_id: str,
        *,
        timeout_s: float,
        warn_every_s: float,
        where: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._job = job_id
        self._group = group_id
        self._timeout = timeout_s
        self._every = warn_every_s
        self._where = where
        self._clock = clock
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self._next_warning = 0.0
        self._warned = False
        self._unreadable = False
        self.position: int | None = None

    async def look(self, bus: Bus) -> None:
        """Read the partition's end and the group's position once; warn if it is due. A bus
        that cannot tell the group's position (on Kafka: no right to describe the group, or
        trouble) is said once, and asked again at the next look."""
        try:
            partitions = await bus.partitions("events")
            tp = TopicPartition("events", partition_for(self._job, partitions))
            end = (await bus.end_offsets("events"))[tp]
            self.position = (await bus.group_positions(self._group, "events")).get(tp)
        except BusError as exc:
            if not self._unreadable:
                log.warning(
                    "cannot tell whether a daemon reads this job: the bus does not show the "
                    "daemon group's position",
                    job_id=self._job,
                    group=self._group,
                    error=str(exc),
                )
            self._unreadable = True
            return
        self._unreadable = False
        self.observe(end, self.position)

    def observe(self, end: int, position: int | None) -> None:
        """Take one look: the partition's end offset and the group's position (or ``None``);
        log what is due."""
        now = self._clock()
        if not self._samples or end > self._samples[-1][1]:
            self._samples.append((now, end))
        read = -1 if position is None else position
        while self._samples and self._samples[0][1] <= read:
            self._samples.popleft()
        if not self._samples:
            if self._warned:
                log.info("a daemon reads this job's events again", job_id=self._job)
                self._warned = False
            return
        since, _ = self._samples[0]
        if now - since < self._timeout or now < self._next_warning:
            return
        self._next_warning = now + self._every
        self._warned = True
        log.warning(
            f"NO DAEMON has read this job's events for {now - since:.0f} s: nothing detects "
            "failures or restores the job. Is `trainguard daemon` running on this bus, with "
            "this topic prefix and consumer group?",
            job_id=self._job,
            bus=self._where,
            group=self._group,
            group_position=position,
            partition_end=end,
        )
