"""The daemon on a real bus (SQLite and Kafka) commits the snapshots of a job started from
another job's snapshot with that snapshot as their ``parent``, and the catalog's reader finds
them on ``manifests``."""

from __future__ import annotations

import dataclasses

import pytest

from tests.support.buses import BusFactory
from tests.support.service_support import (
    daemon_config,
    eventually,
    publish,
    running,
    shard,
    started,
)
from trainguard.agent.bus import DEFAULT_TOPICS
from trainguard.agent.checkpoint._manifests import read_manifests
from trainguard.daemon import DaemonService
from trainguard.daemon.catalog._catalog import Catalog

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

ORIGIN = "pretrain/g1/s500"


async def test_committed_manifests_carry_the_parent_the_shards_name(
    bus_factory: BusFactory,
) -> None:
    shards = [
        dataclasses.replace(shard(rank, seq, step), parent=ORIGIN)
        for seq, step in ((1, 10), (2, 20))
        for rank in (0, 1)
    ]
    async with bus_factory.open(topics=DEFAULT_TOPICS) as bus:
        await publish(bus, started(0), started(1), *shards)
        async with running(DaemonService(daemon_config(bus_factory))):

            async def both_committed() -> Catalog | None:
                catalog = Catalog.of((await read_manifests(bus)).manifests)
                return catalog if len(catalog.snapshots) == 2 else None

            catalog = await eventually(both_committed)
    assert [(m.snapshot_id, m.parent) for m in catalog.select()] == [
        ("svc-job/g0/s10", ORIGIN),
        ("svc-job/g0/s20", ORIGIN),
    ]
    found = catalog.lineage("svc-job/g0/s20")
    assert [a.snapshot_id for a in found.ancestors] == ["svc-job/g0/s20", ORIGIN]
    assert found.origin == "unknown"  # the origin's job is not on this bus
