"""Agent.checkpoint against a real embedded bus: the event describes the durable shard; async
saves cost the caller only the host copy; failures are counted, not raised."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.jobbus import JOB, of_type, read_events, wait_for_events
from trainguard.agent import RESERVED_KEY, AgentError
from trainguard.agent import _agent as agent_module
from trainguard.agent.checkpoint._shards import WrittenShard, uri_to_path, write_shard
from trainguard.schemas import Checkpoint, DataCursor, Heartbeat, Lifecycle, SchemaViolation

CURSOR = DataCursor(data_version="sha256:abc", seed=3, epoch=1, offset=128, world_size=2)


def test_the_event_describes_the_durable_shard(make_agent, bus_url, tmp_path: Path):
    agent = make_agent(
        rank=1,
        world_size=2,
        generation=0,
        hyperparameters={"lr": 0.001, "model": {"layers": 2}},
        code_version="abc123",
    )
    with agent:
        agent.ready(0)
        agent.step(40)
        announced = agent.checkpoint(40, {"w": torch.arange(4.0)}, cursor=CURSOR).result()
    (event,) = of_type(read_events(bus_url, JOB), Checkpoint)
    assert event == announced
    path = uri_to_path(event.shard_uri)
    assert path == tmp_path / "checkpoints" / JOB / "g000000" / "s0000000040" / "rank00001.pt"
    data = path.read_bytes()
    assert event.digest == f"sha256:{hashlib.sha256(data).hexdigest()}"
    assert event.size_bytes == len(data)
    assert (event.step, event.rank, event.world_size, event.generation) == (40, 1, 2, 0)
    assert event.cursor == CURSOR
    assert event.metadata.hyperparameters == {"lr": 0.001, "model": {"layers": 2}}
    assert event.metadata.topology == {"world_size": 2}
    assert event.metadata.code_version == "abc123"
    assert agent.stats.checkpoints_written == 1
    shard = torch.load(path, weights_only=True)
    assert torch.equal(shard["w"], torch.arange(4.0))
    assert shard[RESERVED_KEY]["step"] == 40
    assert shard[RESERVED_KEY]["cursor"]["offset"] == 128


def test_a_blocking_checkpoint_declares_its_phase(make_agent, bus_url):
    with make_agent(heartbeat_interval_s=60.0) as agent:
        agent.step(1)
        agent.checkpoint(1, {"w": torch.ones(1)}, cursor=CURSOR)
        agent.step(2)
    events = read_events(bus_url, JOB)
    kinds = [
        e.phase if isinstance(e, Heartbeat) else type(e).__name__
        for e in events
        if isinstance(e, Heartbeat | Checkpoint)
    ]
    # The declaration precedes the shard's announcement.
    assert kinds.index("checkpoint") < kinds.index("Checkpoint")


class SlowWrites:
    """Replaces the agent's shard writer with one that waits until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        monkeypatch.setattr(agent_module, "write_shard", self._write)

    def _write(self, path: Path, state: Any) -> WrittenShard:
        self.release.wait(10.0)
        return write_shard(path, state)


def test_an_async_checkpoint_costs_the_caller_only_the_host_copy(
    make_agent, bus_url, monkeypatch: pytest.MonkeyPatch
):
    writes = SlowWrites(monkeypatch)
    weights = torch.zeros(1000)
    with make_agent() as agent:
        began = time.perf_counter()
        future = agent.checkpoint(5, {"w": weights}, cursor=CURSOR, blocking=False)
        returned_s = time.perf_counter() - began
        weights.add_(1.0)  # training goes on and changes its tensors
        time.sleep(0.1)
        assert not future.done()
        assert not of_type(read_events(bus_url, JOB), Checkpoint)
        writes.release.set()
        event = future.result(timeout=10.0)
        events = wait_for_events(
            bus_url, JOB, lambda ev: any(isinstance(e, Checkpoint) for e in ev)
        )
    assert returned_s < 0.05
    assert of_type(events, Checkpoint) == [event]
    saved = torch.load(uri_to_path(event.shard_uri), weights_only=True)
    assert torch.equal(saved["w"], torch.zeros(1000))  # the state at the call, not later


def test_the_next_checkpoint_waits_for_the_previous_write(
    make_agent, bus_url, monkeypatch: pytest.MonkeyPatch
):
    writes = SlowWrites(monkeypatch)
    with make_agent() as agent:
        first = agent.checkpoint(1, {"w": torch.ones(1)}, cursor=CURSOR, blocking=False)
        threading.Timer(0.2, writes.release.set).start()
        began = time.perf_counter()
        second = agent.checkpoint(2, {"w": torch.ones(1)}, cursor=CURSOR, blocking=False)
        assert time.perf_counter() - began >= 0.15
        assert first.done()
        second.result(timeout=10.0)
    assert [e.step for e in of_type(read_events(bus_url, JOB), Checkpoint)] == [1, 2]


@pytest.mark.parametrize("blocking", [True, False])
def test_a_failed_write_is_counted_not_raised(
    make_agent, bus_url, monkeypatch: pytest.MonkeyPatch, blocking: bool
):
    def full_disk(path: Path, state: Any) -> WrittenShard:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(agent_module, "write_shard", full_disk)
    with make_agent() as agent:
        future = agent.checkpoint(5, {"w": torch.ones(1)}, cursor=CURSOR, blocking=blocking)
        with pytest.raises(OSError, match="No space"):
            future.result(timeout=10.0)
        agent.step(6)  # training goes on
    assert agent.stats.checkpoint_failures == 1
    events = read_events(bus_url, JOB)
    assert not of_type(events, Checkpoint)
    [report] = [e for e in of_type(events, Lifecycle) if e.kind == "error"]
    assert report.step == 5
    assert "checkpoint write failed at step 5" in report.message
    assert "No space left on device" in report.message


def test_state_the_async_copy_refuses_is_counted_not_raised(make_agent, bus_url):
    """The host copy of an async checkpoint fails (here: a leaf that cannot be deep-copied):
    the future holds the error, and it is counted and reported, as a failed write is."""

    class Uncopyable:
        def __deepcopy__(self, memo: Any) -> Any:
            raise TypeError("cannot copy this")

    with make_agent() as agent:
        future = agent.checkpoint(5, {"o": Uncopyable()}, cursor=CURSOR, blocking=False)
        with pytest.raises(TypeError, match="cannot copy this"):
            future.result(timeout=10.0)
        agent.step(6)  # training goes on
    assert agent.stats.checkpoint_failures == 1
    [report] = [e for e in of_type(read_events(bus_url, JOB), Lifecycle) if e.kind == "error"]
    assert "checkpoint write failed at step 5" in report.message


def test_caller_mistakes_raise_at_once(make_agent):
    agent = make_agent()
    with agent:
        with pytest.raises(ValueError, match="reserved"):
            agent.checkpoint(1, {RESERVED_KEY: 1}, cursor=CURSOR)
        bad = DataCursor(data_version="v", seed=-1, epoch=0, offset=0, world_size=1)
        with pytest.raises(SchemaViolation, match="seed"):
            agent.checkpoint(1, {}, cursor=bad, blocking=False)
    with pytest.raises(AgentError, match="closed"):
        agent.checkpoint(2, {}, cursor=CURSOR)
    assert agent.stats.checkpoints_written == 0
