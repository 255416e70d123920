"""Issue 13, the wait for a bus that is away (``patiently``), on callables of the test's own: the
outage is logged when it begins, while it lasts and when it ends; a wrong bus and a signal end
the wait at once. Supervisors waiting for a real listener are tested in
``tests/service/agent/test_supervisor_bus_wait.py``."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from trainguard.agent.bus import BusError, BusUnavailable, Signalled, patiently

pytestmark = pytest.mark.anyio


async def test_a_wait_for_the_bus_logs_the_outage_when_it_begins_while_it_lasts_and_ends() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls <= 4:
            raise BusUnavailable("Kafka at b:9092: connecting failed")
        return "connected"

    with capture_logs() as logs:
        got = await patiently(
            "connecting to the bus",
            flaky,
            asyncio.Event(),
            warn_every_s=0.0,
            backoff_s=(0.001, 0.004),
        )
    assert (got, calls) == ("connected", 5)
    said = [(e["log_level"], e["event"]) for e in logs]
    assert said == [
        ("warning", "bus outage: connecting to the bus failed; retrying until the bus answers "
         "(a signal ends the wait)"),
        *[("warning", "bus outage goes on: connecting to the bus still fails")] * 3,
        ("info", "bus outage over: connecting to the bus succeeded"),
    ]  # fmt: skip


async def test_a_wait_for_the_bus_gives_up_at_once_on_a_wrong_bus_and_on_a_signal() -> None:
    async def refused() -> None:
        raise BusError("Kafka refused to create topic 'events'")

    with pytest.raises(BusError, match="refused to create"):
        await patiently("connecting", refused, asyncio.Event(), warn_every_s=1.0)

    async def away() -> None:
        raise BusUnavailable("away")

    stop = asyncio.Event()
    waiting = asyncio.ensure_future(patiently("connecting", away, stop, warn_every_s=1.0))
    await asyncio.sleep(0)
    stop.set()
    with pytest.raises(Signalled):
        await asyncio.wait_for(waiting, 60.0)
