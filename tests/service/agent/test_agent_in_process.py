"""The agent's side of issue 4 against a real embedded bus, with the daemon's commands published
by hand: the in-process restore protocol (adopt the generation on arrival, raise
``RestoreRequested`` from ``step(at_step)``, reload, acknowledge, resume; decline with
``missed_at_step`` when the rank cannot stop there), a restart restore's ``skip``, parameter
checksums in heartbeats of exactly their step, and the faults that need the loop's help."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import pytest
import torch

from tests.support import jobbus as daemon
from tests.support.jobbus import JOB, lifecycles, of_type, read_events, wait_for_events
from trainguard.agent import Agent, RestoreMissed, RestoreRequested
from trainguard.agent.checkpoint._checksum import parameter_checksum
from trainguard.schemas import DataCursor, Event, Heartbeat, Lifecycle, Manifest, StepRange

CURSOR = DataCursor(data_version="v1", seed=5, epoch=0, offset=80, world_size=1)


def eventually(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until ``predicate()`` holds (the agent polls commands every 0.25 s)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def errors(bus_url: str, count: int = 1) -> list[Lifecycle]:
    """The job's lifecycle ``error`` events, once there are ``count`` of them."""
    events = wait_for_events(bus_url, JOB, lambda es: len(lifecycles(es, "error")) >= count)
    return lifecycles(events, "error")


def train_and_commit(agent: Agent, bus_url: str, steps: int = 10) -> Manifest:
    """Report steps 1..``steps``, checkpoint the last; return its committed manifest."""
    agent.ready(0)
    for step in range(1, steps + 1):
        agent.step(step)
    agent.checkpoint(steps, {"w": torch.arange(3.0)}, cursor=CURSOR)

    def committed(events: list[Event]) -> bool:
        return daemon.committed_manifest(events, JOB, world_size=1) is not None

    manifest = daemon.committed_manifest(wait_for_events(bus_url, JOB, committed), JOB, 1)
    assert manifest is not None
    return manifest


def test_a_rank_stops_at_at_step_reloads_acknowledges_and_resumes(make_agent, bus_url):
    torch.manual_seed(1)
    skip = StepRange(from_step=12, to_step=13)
    with make_agent(in_process_restore=True) as agent:
        manifest = train_and_commit(agent, bus_url)
        draw = torch.rand(3)  # what the restored RNG stream must give again
        daemon.publish(bus_url, daemon.restore(JOB, 1, manifest, at_step=20, skip=skip))
        eventually(lambda: agent.config.generation == 1)  # adopted on arrival
        for step in range(11, 20):
            agent.step(step)  # trains on until at_step
        time.sleep(0.15)  # a heartbeat (every 50 ms) of step 19
        with pytest.raises(RestoreRequested) as caught:
            agent.step(20)
        request = caught.value
        assert request.target is not None
        assert request.target.manifest() == manifest
        assert (request.step, request.skip) == (10, skip)
        assert agent.skip == skip
        assert torch.equal(agent.load(manifest)["w"], torch.arange(3.0))
        assert torch.rand(3).equal(draw)
        helper = daemon.after_acks(bus_url, 1, range(1), daemon.resume(JOB, 1, step=10))
        agent.ready(request.step, cursor=CURSOR)
        helper.join()
        agent.step(11)
    events = read_events(bus_url, JOB)
    (restored,) = lifecycles(events, "restored")
    assert (restored.generation, restored.step, restored.snapshot_id, restored.cursor) == (
        1,
        10,
        manifest.snapshot_id,
        CURSOR,
    )
    beats = of_type(events, Heartbeat)
    assert any((b.generation, b.step) == (1, 19) for b in beats)  # before the reload
    assert not lifecycles(events, "error")
    assert lifecycles(events, "finished")[0].generation == 1


def test_a_rank_already_past_at_step_declines_and_trains_on(make_agent, bus_url):
    with make_agent(in_process_restore=True) as agent:
        manifest = train_and_commit(agent, bus_url, steps=25)
        daemon.publish(bus_url, daemon.restore(JOB, 1, manifest, at_step=20))
        (error,) = errors(bus_url)
        agent.step(26)  # no RestoreRequested: the daemon restarts the processes instead
        assert agent.config.generation == 1
    assert (error.generation, error.rank, error.step, error.missed_at_step) == (1, 0, 25, 20)
    assert error.message == "in-process restore at step 20 missed: already at step 25"
    assert len(lifecycles(read_events(bus_url, JOB), "error")) == 1  # declined once


def test_a_loop_that_ends_before_at_step_declines_and_does_not_finish(make_agent, bus_url):
    """``at_step`` past the job's last step (a fast job, a fault near its end): the parameters
    trained since the fault are not sound, so no ``finished``; the daemon restarts instead,
    and the process must fail for its supervisor to wait for that."""

    def train_to_the_last_step() -> None:
        with make_agent(in_process_restore=True) as agent:
            manifest = train_and_commit(agent, bus_url, steps=10)
            daemon.publish(bus_url, daemon.restore(JOB, 1, manifest, at_step=40))
            eventually(lambda: agent.config.generation == 1)
            for step in range(11, 31):  # the loop's last step is 30
                agent.step(step)

    with pytest.raises(RestoreMissed, match="at step 40 missed"):
        train_to_the_last_step()
    events = read_events(bus_url, JOB)
    (error,) = lifecycles(events, "error")
    assert (error.generation, error.step, error.missed_at_step) == (1, 30, 40)
    assert "the training loop ended at step 30, before it" in error.message
    assert not lifecycles(events, "finished")


def test_a_loop_without_in_process_restores_declines_at_once(make_agent, bus_url):
    with make_agent() as agent:
        manifest = train_and_commit(agent, bus_url, steps=1)
        daemon.publish(bus_url, daemon.restore(JOB, 1, manifest, at_step=100))
        (error,) = errors(bus_url)
        for step in range(2, 102):
            agent.step(step)
    assert (error.generation, error.missed_at_step) == (1, 100)
    assert "in_process_restore is off" in error.message


def test_a_loop_that_jumps_over_at_step_declines_when_it_does(make_agent, bus_url):
    with make_agent(in_process_restore=True) as agent:
        manifest = train_and_commit(agent, bus_url, steps=5)
        daemon.publish(bus_url, daemon.restore(JOB, 1, manifest, at_step=10))
        eventually(lambda: agent.config.generation == 1)
        agent.step(15)
        (error,) = errors(bus_url)
    assert (error.step, error.missed_at_step) == (15, 10)
    assert "went from before it to step 15" in error.message


def test_a_restore_before_the_loop_is_ready_is_declined(make_agent, bus_url):
    with make_agent(in_process_restore=True) as agent:
        daemon.publish(bus_url, daemon.restore(JOB, 1, None, at_step=10))
        (error,) = errors(bus_url)
        assert agent.config.generation == 1
    assert "not training yet" in error.message


def test_a_restart_restore_tells_the_loop_which_batches_to_skip(make_agent, bus_url):
    skip = StepRange(from_step=5, to_step=9)
    daemon.publish(bus_url, daemon.restore(JOB, 1, None, skip=skip))
    with make_agent(generation=1) as agent:
        assert agent.skip is None  # nothing known before the restore command is read
        assert agent.restore_target() is None
        assert agent.skip == skip


def test_the_watched_model_is_checksummed_in_heartbeats_of_exactly_its_steps(make_agent, bus_url):
    model = torch.nn.Linear(4, 3)
    expected: dict[int, str] = {}
    with make_agent(checksum_every=5) as agent:
        agent.ready(0)
        agent.watch(model)
        for step in range(1, 13):
            with torch.no_grad():
                model.weight.add_(0.5)  # the parameters change every step
            if step % 5 == 0:
                expected[step] = parameter_checksum(model)
            agent.step(step)
        # The last heartbeat, before the finish, carries the final parameters' checksum.
        expected[12] = parameter_checksum(model)
    beats = of_type(read_events(bus_url, JOB), Heartbeat)
    sent = {b.step: b.param_checksum for b in beats if b.param_checksum is not None}
    assert sent == expected
    assert len(set(expected.values())) == 3


def test_a_checksum_heartbeat_leaves_with_the_next_beat_not_at_once(make_agent, bus_url):
    """Waking the link's thread for it would take the GIL from training (about 0.5 ms a
    checksum); it waits for the next periodic heartbeat instead, ahead of it in ``seq``."""
    model = torch.nn.Linear(4, 3)
    with make_agent(checksum_every=5, heartbeat_interval_s=3600) as agent:
        agent.ready(0)
        agent.watch(model)
        deadline = time.monotonic() + 10
        while not of_type(read_events(bus_url, JOB), Heartbeat):  # the first beat is out
            assert time.monotonic() < deadline, "no first heartbeat"
            time.sleep(0.02)
        for step in range(1, 6):
            agent.step(step)
        time.sleep(0.5)  # a woken thread sends in milliseconds
        assert all(b.param_checksum is None for b in of_type(read_events(bus_url, JOB), Heartbeat))
    beats = of_type(read_events(bus_url, JOB), Heartbeat)
    assert [b.step for b in beats if b.param_checksum is not None] == [5, 5]  # and the last


def test_checksums_are_off_with_checksum_every_zero_or_no_model(make_agent, bus_url):
    with make_agent(checksum_every=0) as agent:
        agent.ready(0)
        agent.watch(torch.nn.Linear(2, 2))
        for step in range(1, 101):
            agent.step(step)
        time.sleep(0.15)
    with make_agent(checksum_every=1) as agent:
        agent.ready(0)
        agent.step(1)
        time.sleep(0.15)
    beats = of_type(read_events(bus_url, JOB), Heartbeat)
    assert beats
    assert all(b.param_checksum is None for b in beats)


def test_perturb_loss_passes_the_loss_through_unless_a_fault_applies(make_agent):
    with make_agent(faults="nan@step=3,rank=0; spike@step=5,factor=10,steps=1") as agent:
        loss = torch.tensor(2.0)
        assert agent.perturb_loss(1, loss) is loss
        assert math.isnan(agent.perturb_loss(3, 2.0))
        assert agent.perturb_loss(5, 2.0) == 20.0
        assert agent.perturb_loss(6, 2.0) == 2.0


def test_a_slow_rank_reports_stretched_step_times(make_agent, bus_url):
    with make_agent(faults="slow@step=2,rank=0,factor=4") as agent:
        agent.ready(0)
        agent.step(1)
        time.sleep(0.1)
        agent.step(2)  # 0.1 s of work, stretched to 0.4 s
        time.sleep(0.2)  # a heartbeat (every 50 ms) reports it
    beats = [b for b in of_type(read_events(bus_url, JOB), Heartbeat) if b.step == 2]
    assert beats
    assert beats[0].step_time_s is not None
    assert 0.4 <= beats[0].step_time_s < 1.0


def test_waiting_for_a_slow_background_write_is_declared_a_checkpoint_phase(make_agent, bus_url):
    with make_agent(faults="stall-checkpoint@step=1,seconds=0.5") as agent:
        agent.ready(0)
        agent.step(1)
        agent.checkpoint(1, {"w": torch.zeros(2)}, cursor=CURSOR, blocking=False)
        agent.step(2)
        began = time.monotonic()
        agent.checkpoint(2, {"w": torch.ones(2)}, cursor=CURSOR, blocking=False)
        waited = time.monotonic() - began
        agent.step(3)
        time.sleep(0.2)  # heartbeats every 50 ms
    assert waited >= 0.3  # the first write's stall
    phases = [(b.step, b.phase) for b in of_type(read_events(bus_url, JOB), Heartbeat)]
    assert (2, "checkpoint") in phases
    assert phases[-1] == (3, "train")


def test_the_end_of_the_loop_waits_for_a_slow_last_write_in_a_checkpoint_phase(make_agent, bus_url):
    """Found by a tester: a slow write of the last checkpoint, waited for at the end of the
    ``with`` block in the phase ``train``, was judged a hang (progress timeout) and restored,
    and on storage that is always that slow the crash-loop guard failed the job."""
    with make_agent(
        faults="stall-checkpoint@step=3,seconds=0.5", heartbeat_interval_s=3600
    ) as agent:
        agent.ready(0)
        for step in range(1, 4):
            agent.step(step)
        agent.checkpoint(3, {"w": torch.zeros(2)}, cursor=CURSOR, blocking=False)
    events = read_events(bus_url, JOB)
    beats = [(e.step, e.phase) for e in events if isinstance(e, Heartbeat)]
    assert (3, "checkpoint") in beats  # declared while the write ran (no periodic beat then)
    assert beats[-1] == (3, "train")  # the last progress, before the finish
