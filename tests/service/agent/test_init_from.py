"""A job started from another job's committed snapshot (``init_from``), against a real embedded
bus and real torch shards: job A checkpoints and its snapshot is published on ``manifests`` as
the daemon would; job B's agent finds it there, verifies and loads it, and names it as the
``parent`` of its own checkpoints; a restore of B to its initial state loads it again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tests.support import jobbus as daemon
from tests.support.jobbus import lifecycles, of_type, read_events, wait_for_events
from trainguard.agent import Agent, ConfigError, RestoreRequested, ShardCorrupt, ShardMissing
from trainguard.agent.bus import BusConfig, open_bus
from trainguard.agent.checkpoint._manifests import read_manifests
from trainguard.agent.checkpoint._shards import uri_to_path
from trainguard.schemas import Checkpoint, DataCursor, Event, Manifest, encode

A, B = "job-a", "job-b"
CURSOR = DataCursor(data_version="v1", seed=5, epoch=0, offset=80, world_size=1)


@dataclass(frozen=True)
class Origin:
    """Job A's committed snapshot of step 10 and the torch draw right after saving it."""

    manifest: Manifest
    torch_draw: torch.Tensor


def publish_manifest(url: str, manifest: Manifest) -> None:
    """Publish ``manifest`` on ``manifests``, keyed by its job, as the daemon does on commit."""

    async def _publish() -> None:
        async with open_bus(BusConfig(url=url)) as bus:
            await bus.publish("manifests", manifest.job_id, encode(manifest))

    asyncio.run(_publish())


@pytest.fixture
def origin(make_agent: Callable[..., Agent], bus_url: str) -> Origin:
    """Job A trains to step 10, checkpoints it (a real torch shard), and the daemon's commit
    is published on ``manifests``."""
    torch.manual_seed(1)
    with make_agent(job_id=A) as agent:
        agent.ready(0)
        agent.step(10)
        agent.checkpoint(10, {"w": torch.arange(3.0)}, cursor=CURSOR)
        draw = torch.rand(3)
    manifest = daemon.committed_manifest(read_events(bus_url, A), A, world_size=1)
    assert manifest is not None
    publish_manifest(bus_url, manifest)
    return Origin(manifest, draw)


def test_generation_zero_loads_the_other_jobs_snapshot(
    make_agent: Callable[..., Agent], bus_url: str, origin: Origin
) -> None:
    torch.manual_seed(99)
    with make_agent(job_id=B, init_from=origin.manifest.snapshot_id) as agent:
        target = agent.restore_target()
        assert target is not None
        assert target.manifest() == origin.manifest
        state = agent.load(target)
        assert torch.equal(state["w"], torch.arange(3.0))
        assert torch.rand(3).equal(origin.torch_draw)  # A's RNG streams, as after a restore
        agent.ready(target.step, cursor=target.cursor)  # generation 0: no acknowledgement
        agent.step(11)
        agent.checkpoint(11, {"w": state["w"] + 1}, cursor=CURSOR)
    events = read_events(bus_url, B)
    (shard,) = of_type(events, Checkpoint)
    assert (shard.step, shard.parent) == (11, origin.manifest.snapshot_id)
    assert not lifecycles(events, "restored")
    assert f"/{B}/" in shard.shard_uri  # B writes under its own job folder


def test_an_unknown_snapshot_is_a_clear_error(
    make_agent: Callable[..., Agent], bus_url: str, origin: Origin
) -> None:
    with (
        make_agent(job_id=B, init_from=f"{A}/g0/s99") as agent,
        pytest.raises(ConfigError) as caught,
    ):
        agent.restore_target(timeout_s=20)
    message = str(caught.value)
    assert f"no committed snapshot '{A}/g0/s99'" in message
    assert origin.manifest.snapshot_id in message  # what the job does have


def test_a_job_without_snapshots_on_the_bus_is_named(
    make_agent: Callable[..., Agent], bus_url: str
) -> None:
    missing = "job 'nobody' has no committed snapshot"
    with (
        make_agent(job_id=B, init_from="nobody/g0/s1") as agent,
        pytest.raises(ConfigError, match=missing),
    ):
        agent.restore_target(timeout_s=20)


def test_a_corrupt_origin_is_reported_to_this_jobs_daemon(
    make_agent: Callable[..., Agent], bus_url: str, origin: Origin
) -> None:
    path = uri_to_path(origin.manifest.shards[0].uri)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    agent = make_agent(job_id=B, init_from=origin.manifest.snapshot_id)
    with pytest.raises(ShardCorrupt), agent:
        agent.load(agent.restore_target() or pytest.fail("no target"))
    (error,) = lifecycles(read_events(bus_url, B), "error")
    # The report names A's snapshot, B's initial state: B's daemon never restores it again.
    assert error.snapshot_id == origin.manifest.snapshot_id
    assert error.message is not None
    assert f"cannot start from init_from snapshot {origin.manifest.snapshot_id}" in error.message
    assert "ShardCorrupt" in error.message


def test_a_rank_the_origin_has_no_shard_for_reports_why_before_it_exits(
    make_agent: Callable[..., Agent], bus_url: str, origin: Origin
) -> None:
    """Rank 1 of 2 started from A's 1-rank snapshot (``trainguard run`` refuses that at start;
    a worker started otherwise says so at once, while it still runs)."""
    sid = origin.manifest.snapshot_id

    def load_and_look(agent: Agent) -> None:
        """Load the origin; as it raises, the error must be on the bus already."""
        try:
            agent.load(agent.restore_target() or pytest.fail("no target"))
        finally:
            (error,) = lifecycles(read_events(bus_url, B), "error")
            assert (error.rank, error.snapshot_id) == (1, sid)
            assert error.message is not None
            assert error.message.startswith(f"cannot start from init_from snapshot {sid}: ")

    agent = make_agent(job_id=B, rank=1, world_size=2, init_from=sid)
    with pytest.raises(ShardMissing, match="taken at world size 1, this job runs 2 ranks"), agent:
        load_and_look(agent)
    # Reported once: the exit the error caused does not repeat it.
    assert len(lifecycles(read_events(bus_url, B), "error")) == 1


def test_a_restore_to_the_initial_state_loads_the_origin_again(
    make_agent: Callable[..., Agent], bus_url: str, origin: Origin
) -> None:
    daemon.publish(bus_url, daemon.restore(B, 1, None))
    with make_agent(job_id=B, generation=1, init_from=origin.manifest.snapshot_id) as agent:
        target = agent.restore_target()
        assert target is not None
        assert target.manifest() == origin.manifest
        agent.load(target)
        helper = daemon.after_acks(bus_url, 1, range(1), daemon.resume(B, 1, step=0))
        agent.ready(target.step, cursor=target.cursor)
        helper.join()
    (restored,) = lifecycles(read_events(bus_url, B), "restored")
    # The daemon targeted B's initial state, not a snapshot of B: the acknowledgement names none.
    assert (restored.generation, restored.step, restored.snapshot_id) == (1, 10, None)


def test_an_in_process_restore_to_the_initial_state_names_the_origin(
    make_agent: Callable[..., Agent], bus_url: str, origin: Origin
) -> None:
    settings = {"job_id": B, "init_from": origin.manifest.snapshot_id, "in_process_restore": True}
    with make_agent(**settings) as agent:
        target = agent.restore_target()
        assert target is not None
        agent.load(target)
        agent.ready(target.step)
        agent.step(11)
        daemon.publish(bus_url, daemon.restore(B, 1, None, at_step=13))
        deadline = time.monotonic() + 10
        while agent.config.generation != 1:  # adopted on arrival
            assert time.monotonic() < deadline, "the restore never arrived"
            time.sleep(0.02)
        agent.step(12)
        with pytest.raises(RestoreRequested) as caught:
            agent.step(13)
        target = caught.value.target
        assert target is not None
        assert target.manifest() == origin.manifest
        assert caught.value.step == 10
        assert origin.manifest.snapshot_id in str(caught.value)


def test_read_manifests_keeps_bus_order_and_skips_inconsistent_records(
    bus_url: str, origin: Origin
) -> None:
    forged = Manifest(
        job_id=A,
        snapshot_id=f"{A}/g0/s11",  # says step 11, holds step 10
        generation=0,
        ts=origin.manifest.ts,
        step=10,
        world_size=1,
        shards=origin.manifest.shards,
        cursor=CURSOR,
    )
    publish_manifest(bus_url, forged)

    async def _read() -> tuple[tuple[Manifest, ...], int]:
        async with open_bus(BusConfig(url=bus_url)) as bus:
            await bus.publish("manifests", A, b"not json")
            log = await read_manifests(bus)
            assert (await read_manifests(bus, B)).manifests == ()
            return log.manifests, log.invalid

    manifests, invalid = asyncio.run(_read())
    assert manifests == (origin.manifest,)
    assert invalid == 2


def test_every_shard_of_the_job_names_the_origin_also_after_a_restart(
    make_agent: Callable[..., Agent], bus_url: str, origin: Origin
) -> None:
    sid = origin.manifest.snapshot_id
    daemon.publish(bus_url, daemon.restore(B, 1, None))
    for generation in (0, 1):
        with make_agent(job_id=B, generation=generation, init_from=sid) as agent:
            target = agent.restore_target()
            assert target is not None
            assert target.manifest() == origin.manifest
            agent.checkpoint(10 + generation, {"w": torch.zeros(1)}, cursor=CURSOR)

    def both(events: list[Event]) -> bool:
        return len(of_type(events, Checkpoint)) == 2

    shards = of_type(wait_for_events(bus_url, B, both), Checkpoint)
    assert [(s.generation, s.parent) for s in shards] == [(0, sid), (1, sid)]
