"""The agent's link to the bus, against a real embedded bus: lifecycle and heartbeat events,
seq order, and a training thread that never waits for a slow, locked or missing bus."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import socket
import time
from pathlib import Path
from typing import cast

import pytest
import torch
from structlog.testing import capture_logs

from tests.support.jobbus import JOB, lifecycles, of_type, read_events, wait_for_events
from tests.support.outage import write_locked
from trainguard.agent import Agent
from trainguard.agent.bus import BusConfig, open_bus
from trainguard.agent.supervisor._spool import read_spool
from trainguard.schemas import Checkpoint, DataCursor, Event, Heartbeat, Lifecycle, decode

CURSOR = DataCursor(data_version="v1", seed=7, epoch=0, offset=64, world_size=1)


def seqs_rise(events: list[Event]) -> bool:
    """Whether the events' seqs strictly increase in bus order (one sender)."""
    seqs = [e.seq for e in events]
    return all(a < b for a, b in itertools.pairwise(seqs))


def test_started_then_heartbeats_while_the_training_thread_sleeps(make_agent, bus_url):
    with make_agent(world_size=2, rank=1) as agent:
        agent.ready(0)
        agent.step(1, loss=2.5, samples=8)
        time.sleep(0.6)  # the training thread is busy or stuck: heartbeats go on
    events = read_events(bus_url, JOB)
    assert [e.kind for e in lifecycles(events, "started")] == ["started"]
    assert events[0] == lifecycles(events, "started")[0]
    assert events[0].world_size == 2
    beats = of_type(events, Heartbeat)
    assert len(beats) >= 6  # 0.6 s at one per 50 ms, with slack for a loaded machine
    assert {(b.rank, b.world_size, b.host) for b in beats} == {(1, 2, "test-host")}
    assert (beats[-1].step, beats[-1].loss, beats[-1].samples) == (1, 2.5, 8)
    assert beats[-1].phase == "train"
    gaps = [(b.ts - a.ts) / 1e9 for a, b in itertools.pairwise(beats)]
    assert max(gaps) < 0.5
    assert events[-1].kind == "finished"  # type: ignore[union-attr]
    assert seqs_rise(events)


def test_step_costs_microseconds(make_agent):
    with make_agent() as agent:
        agent.ready(0)
        began = time.perf_counter()
        for step in range(1, 20_001):
            agent.step(step, loss=1.0, samples=8)
        per_step_s = (time.perf_counter() - began) / 20_000
    assert per_step_s < 20e-6


def test_phase_is_reported_at_once(make_agent, bus_url):
    with make_agent(heartbeat_interval_s=60.0) as agent:
        agent.phase("eval")
        events = wait_for_events(
            bus_url, JOB, lambda ev: any(isinstance(e, Heartbeat) and e.phase == "eval" for e in ev)
        )
    assert seqs_rise(events)


def test_seqs_keep_rising_across_agents_of_one_process(make_agent, bus_url):
    for _ in range(2):
        with make_agent():
            pass
    events = read_events(bus_url, JOB)
    assert [e.kind for e in events if not isinstance(e, Heartbeat)] == [  # type: ignore[union-attr]
        "started",
        "finished",
        "started",
        "finished",
    ]
    assert seqs_rise(events)


@pytest.mark.parametrize(
    ("error", "message"),
    [(ValueError(), "ValueError"), (RuntimeError("boom"), "RuntimeError: boom")],
)
def test_an_exception_leaving_the_block_is_reported(make_agent, bus_url, error, message):
    def train() -> None:
        with make_agent() as agent:
            agent.step(3)
            raise error

    with pytest.raises(type(error)):
        train()
    (reported,) = lifecycles(read_events(bus_url, JOB), "error")
    assert (reported.message, reported.step, reported.snapshot_id) == (message, 3, None)


def test_a_clean_system_exit_is_a_finish(make_agent, bus_url):
    with pytest.raises(SystemExit), make_agent():
        raise SystemExit(0)
    assert lifecycles(read_events(bus_url, JOB), "finished")


def test_no_heartbeat_follows_the_last_word(make_agent, bus_url):
    """The background beat can fire between ``finished`` and ``close()``: it is not sent, so
    ``finished`` stays the process's last event (a heartbeat after it would say it runs)."""
    agent = make_agent(heartbeat_interval_s=60.0).__enter__()
    agent.ready(0)
    agent._lifecycle("finished", step=0)  # what leaving the with block says, then close()
    agent._link.submit(agent._heartbeat)  # a beat that fired in between
    agent.close()
    events = read_events(bus_url, JOB)
    assert events[-1].kind == "finished"  # type: ignore[union-attr]
    assert [e.kind for e in lifecycles(events, "finished")] == ["finished"]


def create_bus(url: str) -> None:
    """Create the bus file with its topics (as any earlier client would have)."""

    async def _create() -> None:
        async with open_bus(BusConfig(url=url)):
            pass

    asyncio.run(_create())


STALL_S = 0.1
"""Longest step() call accepted while the bus is locked or away (seconds): far above a step's
cost plus a scheduling hiccup, far below the lock's duration or a bus timeout."""


def timed_steps(agent: Agent, steps: range) -> float:
    """Run ``agent.step`` for ``steps``, 10 ms apart; return the longest call, seconds."""
    longest = 0.0
    for step in steps:
        began = time.perf_counter()
        agent.step(step, loss=1.0)
        longest = max(longest, time.perf_counter() - began)
        time.sleep(0.01)
    return longest


def test_a_bus_locked_from_the_start_delays_events_not_training(
    make_agent, bus_url, tmp_path: Path
):
    create_bus(bus_url)
    with write_locked(tmp_path / "bus.db") as release:
        agent = make_agent(heartbeat_interval_s=0.02, heartbeat_queue=3)
        with agent:
            agent.ready(0)
            longest = timed_steps(agent, range(1, 31))
            shard = agent.checkpoint(30, {"w": torch.ones(2)}, cursor=CURSOR).result()
            longest = max(longest, timed_steps(agent, range(31, 41)))
            waiting = agent.stats
            release()
            assert agent._link.flush(10.0)
    assert longest < STALL_S
    assert not waiting.connected
    assert waiting.dropped_heartbeats > 0
    assert waiting.queued >= 2  # started and the checkpoint, at least
    events = read_events(bus_url, JOB)
    assert seqs_rise(events)
    assert (events[0].kind, events[-1].kind) == ("started", "finished")  # type: ignore[union-attr]
    assert of_type(events, Checkpoint) == [shard]
    assert len(of_type(events, Heartbeat)) <= 3 + 20  # the ring's 3, then the later ones
    assert agent.stats.dropped_heartbeats >= waiting.dropped_heartbeats


def test_a_lock_taken_mid_run_holds_events_back_in_order(make_agent, bus_url, tmp_path: Path):
    with make_agent(heartbeat_interval_s=0.02, heartbeat_queue=3) as agent:
        agent.ready(0)
        wait_for_events(bus_url, JOB, lambda ev: any(isinstance(e, Heartbeat) for e in ev))
        with write_locked(tmp_path / "bus.db"):
            longest = timed_steps(agent, range(1, 21))
            shard = agent.checkpoint(20, {"w": torch.ones(2)}, cursor=CURSOR).result()
            longest = max(longest, timed_steps(agent, range(21, 41)))
            during = agent.stats
        assert agent._link.flush(10.0)
    assert longest < STALL_S
    assert during.dropped_heartbeats > 0
    assert during.queued >= 1  # the checkpoint event waited for the lock
    events = read_events(bus_url, JOB)
    assert seqs_rise(events)
    assert of_type(events, Checkpoint) == [shard]
    assert events[-1].kind == "finished"  # type: ignore[union-attr]


def test_an_unreachable_bus_is_counted_and_closing_is_bounded(make_agent, tmp_path: Path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the bus folder should be")
    with capture_logs() as logs:
        agent = make_agent(bus_url=f"sqlite://{blocker / 'bus.db'}")
        agent.__enter__()
        agent.ready(0)
        assert timed_steps(agent, range(1, 11)) < STALL_S
        stats = agent.stats
        began = time.monotonic()
        agent.close(timeout_s=0.5)
        closing_s = time.monotonic() - began
    assert not stats.connected
    assert stats.send_errors > 0
    assert "cannot create the bus file" in (stats.last_error or "")
    assert closing_s < 0.5 + 5.0
    trouble = [entry for entry in logs if entry["event"] == "bus_trouble"]
    assert len(trouble) == 1  # one warning for the streak, not one per retry
    unsent = [entry for entry in logs if entry["event"] == "events_unsent"]
    assert [(e["count"], e["job_id"], e["rank"]) for e in unsent] == [(1, JOB, 0)]  # started


def test_events_unsent_at_close_stay_in_the_spool_in_order(make_agent, bus_url, tmp_path: Path):
    """Issue 13: a process that ends while the bus is away leaves its checkpoint and
    lifecycle events in its spool (the supervisor forwards them), not dropped."""
    create_bus(bus_url)
    spool = tmp_path / "spool"
    with write_locked(tmp_path / "bus.db"), capture_logs() as logs:
        with make_agent(spool_dir=spool, close_timeout_s=0.2) as agent:
            agent.ready(0)
            shard = agent.checkpoint(5, {"w": torch.ones(2)}, cursor=CURSOR).result()
            path = agent._link.spool_path
        events = [cast(Event, decode(s.data, expect=Event)) for s in read_spool(spool)]
    # The last heartbeat goes as reliably as the finish it precedes (the daemon judges it
    # first: a NaN in the last heartbeat interval): spooled, in order.
    assert [type(e).__name__ for e in events] == [
        "Lifecycle",
        "Checkpoint",
        "Heartbeat",
        "Lifecycle",
    ]
    assert events[1] == shard
    assert (events[0].kind, events[3].kind) == ("started", "finished")  # type: ignore[union-attr]
    assert seqs_rise(events)
    (unsent,) = [e for e in logs if e["event"] == "events_unsent"]
    assert (unsent["count"], unsent["spooled"]) == (4, str(path))


def test_the_last_heartbeat_precedes_the_finish_on_the_bus_even_with_a_relay(
    make_agent, bus_url, tmp_path: Path
):
    """Defect F1: a NaN in the job's last heartbeat interval was never seen (the ranks
    finished first) and the job was reported finished. The rank's last progress now goes on
    the bus right before its ``finished``, in order, and never through the supervisor's relay,
    which would deliver it after the finish."""
    path = tmp_path / "relay.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as relay:
        relay.bind(str(path))
        relay.setblocking(False)
        with make_agent(heartbeat_interval_s=0.02, heartbeat_relay=path) as agent:
            agent.watch(torch.nn.Linear(2, 2))  # its checksum goes with the last progress
            agent.ready(0)
            for step in range(1, 4):
                agent.step(step, loss=1.0)
                time.sleep(0.05)
            agent.step(4, loss=math.nan)
        assert relay.recv(65536)  # the periodic heartbeats went to the relay
    events = read_events(bus_url, JOB)
    *_, last_beat, finished = events
    assert isinstance(last_beat, Heartbeat)
    assert last_beat.step == 4
    assert last_beat.loss is not None
    assert math.isnan(last_beat.loss)
    assert last_beat.param_checksum is not None
    assert isinstance(finished, Lifecycle)
    assert finished.kind == "finished"
    assert [e for e in events if isinstance(e, Heartbeat)] == [last_beat]
    assert seqs_rise(events)


def test_checksum_heartbeats_go_on_the_bus_in_order_not_through_the_relay(
    make_agent, bus_url, tmp_path: Path
):
    """Found by a tester: with ``--batch-heartbeats`` silent corruption was caught only at the
    job's end, with every snapshot suspect. The relay's batch of the checksum heartbeat came
    after the rank's next checkpoint or cursor event, sent directly with a higher ``seq``, and
    the daemon skipped it as stale. A checksum heartbeat now goes as reliably as those."""
    path = tmp_path / "relay.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as relay:
        relay.bind(str(path))
        relay.setblocking(False)
        with make_agent(heartbeat_interval_s=0.02, heartbeat_relay=path, checksum_every=2) as agent:
            agent.watch(torch.nn.Linear(2, 2))
            agent.ready(0)
            for step in range(1, 6):
                agent.step(step, loss=1.0)
                time.sleep(0.05)
        relayed = []
        with contextlib.suppress(BlockingIOError):
            while True:
                relayed.append(decode(relay.recv(65536), expect=Heartbeat))
    assert relayed  # the periodic heartbeats went to the relay
    assert all(b.param_checksum is None for b in relayed)
    events = read_events(bus_url, JOB)
    # (A periodic heartbeat the relay's full socket refused goes on the bus too.)
    checksums = [e.step for e in events if isinstance(e, Heartbeat) and e.param_checksum]
    assert checksums == [2, 4, 5]  # 5: the last progress, before the finish
    assert seqs_rise(events)


def test_delivered_events_leave_no_spool_behind(make_agent, bus_url, tmp_path: Path):
    spool = tmp_path / "spool"
    with make_agent(spool_dir=spool) as agent:
        agent.checkpoint(5, {"w": torch.ones(2)}, cursor=CURSOR).result()
    assert len(of_type(read_events(bus_url, JOB), Checkpoint)) == 1
    assert read_spool(spool) == []
    assert list(spool.iterdir()) == []


def test_a_full_outbox_refuses_new_events_with_an_error_and_counts_them(
    make_agent, bus_url, tmp_path: Path
):
    """Issue 13: while the bus is away at most ``outbox_max_events`` checkpoint and lifecycle
    events wait; a further one is refused, logged as an error and counted, and training goes
    on; the ones kept arrive in order once the bus is back."""
    create_bus(bus_url)
    agent = make_agent(outbox_max_events=3, heartbeat_interval_s=60.0)
    with capture_logs() as logs, agent:
        with write_locked(tmp_path / "bus.db"):
            agent.ready(0)  # started waits
            kept = [
                agent.checkpoint(s, {"w": torch.ones(2)}, cursor=CURSOR).result() for s in (1, 2)
            ]
            refused = agent.checkpoint(3, {"w": torch.ones(2)}, cursor=CURSOR).result()
            stats = agent.stats
        assert agent._link.flush(30.0)
    assert (stats.refused_events, stats.dropped_cursors) == (1, 0)
    (error,) = [e for e in logs if e["event"] == "event_refused_outbox_full"]
    assert (error["log_level"], error["seq"], error["queued"]) == ("error", refused.seq, 3)
    events = read_events(bus_url, JOB)
    assert of_type(events, Checkpoint) == kept
    assert [e.kind for e in of_type(events, Lifecycle)] == ["started", "finished"]
    assert seqs_rise(events)
