"""The daemon's health server as the service tests read it: :func:`serving` runs a
:class:`HealthServer` for a service, :func:`scrape` reads every sample of its ``/metrics`` over
real HTTP and :func:`sample` picks one out, :func:`health` reads ``/healthz`` and
:func:`until_health` waits until its body passes a check."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.support.http_get import http_get
from tests.support.service_support import eventually
from trainguard.daemon import DaemonService
from trainguard.daemon.service._http import HealthServer


async def scrape(server: HealthServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (name, sorted labels) -> value."""
    status, text = await asyncio.to_thread(http_get, f"{server.url}/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict[Any, float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@asynccontextmanager
async def serving(service: DaemonService) -> AsyncIterator[HealthServer]:
    server = HealthServer(service.metrics, service.not_ready_reason, host="127.0.0.1", port=0)
    server.start()
    try:
        yield server
    finally:
        await asyncio.to_thread(server.close)


async def health(server: HealthServer) -> str:
    status, body = await asyncio.to_thread(http_get, f"{server.url}/healthz")
    assert (status == 200) == (body == "ready\n"), (status, body)
    return body


async def until_health(server: HealthServer, check: Callable[[str], bool], timeout_s: float) -> str:
    async def probe() -> str | None:
        body = await health(server)
        return body if check(body) else None

    body: str = await eventually(probe, timeout_s)
    return body
