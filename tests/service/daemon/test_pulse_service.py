"""The pulse in the daemon service on the embedded bus: a live job whose ranks went quiet gets
a tick per ``pulse_s``, a finished job none. The pulse rule itself is tested in
``tests/unit/daemon/test_pulse.py``."""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

import pytest

from tests.support.buses import BusFactory
from tests.support.service_support import (
    JobEvents,
    daemon_config,
    eventually,
    publish,
    read_all,
    running,
)
from trainguard.agent.bus import DEFAULT_TOPICS
from trainguard.daemon import DaemonService
from trainguard.daemon.service._settings import DaemonConfig
from trainguard.schemas import ClockTick, Lifecycle, decode


def finished(job: JobEvents, rank: int) -> Lifecycle:
    """Rank ``rank`` of ``job`` finished at step 4."""
    return Lifecycle(**job.head(1), rank=rank, pid=100 + rank, kind="finished", step=4)


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_the_service_pulses_quiet_live_jobs_and_no_ended_one(tmp_path: Path) -> None:
    """On the embedded bus: a live job whose ranks went quiet gets a pulse per ``pulse_s`` (the
    time between its ticks, on the daemon's clock, is never shorter), a finished job none."""
    factory = BusFactory("sqlite", f"sqlite://{tmp_path}/bus.db", "t.")
    # No deadline falls within the test: every tick is a pulse.
    config: DaemonConfig = dataclasses.replace(
        daemon_config(factory, heartbeat_timeout_s=600.0), pulse_s=0.5
    )
    live, done = JobEvents("live-job"), JobEvents("done-job")
    async with factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, live.started(0), live.started(1), live.beat(0, 1, 3))
        await publish(bus, done.started(0), done.started(1))
        await publish(bus, *(finished(done, rank) for rank in (0, 1)))
        service = DaemonService(config)
        async with running(service):

            async def pulses() -> list[ClockTick] | None:
                ticks = [
                    t
                    for t in map(decode, await read_all(bus, "events"))
                    if isinstance(t, ClockTick)
                ]
                return ticks if len(ticks) >= 4 else None

            began = time.monotonic()
            ticks = await eventually(pulses, 60)
            elapsed = time.monotonic() - began
            assert service.jobs["done-job"].phase == "finished"
    assert {t.job_id for t in ticks} == {"live-job"}
    gaps_s = [(b.ts - a.ts) / 1e9 for a, b in itertools.pairwise(ticks)]
    assert min(gaps_s) >= 0.5 - 0.01  # the daemon's wall clock at writing; no flood
    assert len(ticks) <= elapsed / 0.5 + 2
