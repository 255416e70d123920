"""The supervisor (``trainguard run``) with real worker processes on the embedded bus: exit
reports, restarts into a new generation on a restore order (but not for an in-process one),
SIGTERM-then-SIGKILL, abort."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent import ConfigError
from trainguard.agent._supervisor import (
    EXIT_ABORTED,
    EXIT_STOPPED,
    JobNotJoinable,
    Supervisor,
    SupervisorConfig,
)
from trainguard.agent.bus import DEFAULT_TOPICS, Bus, BusConfig, open_bus
from trainguard.schemas import Abort, Lifecycle, Restore, RestoreMode, Resume, decode, encode

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

JOB = "sup-job"

# Writes its environment to out/<generation>-<rank>.json, then behaves as MODE says.
WORKER = """
import json, os, signal, sys, time
out, mode = sys.argv[1], sys.argv[2]
gen, rank = os.environ["TRAINGUARD_GENERATION"], os.environ.get("RANK", "-")
with open(os.path.join(out, f"{gen}-{rank}.json"), "w") as f:
    json.dump({k: v for k, v in os.environ.items() if k.startswith(("TRAINGUARD_", "RANK",
        "WORLD_SIZE", "LOCAL_", "MASTER_", "GROUP_RANK"))}, f)
if mode == "fail-gen0" and gen == "0":
    sys.exit(3)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
if mode == "sleep":
    time.sleep(600)
if mode == "agent-kill" and gen == "0":
    # A real agent, killed by its fault after completing step 41.
    from trainguard.agent import Agent
    with Agent() as agent:
        agent.ready(0)
        for step in range(1, 100):
            agent.step(step)
if mode == "agent-kill":
    sys.exit(7)  # before any step: no step to report
"""


def config(tmp_path: Path, mode: str, **overrides: Any) -> SupervisorConfig:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    base: dict[str, Any] = {
        "job_id": JOB,
        "bus": bus_config(tmp_path),
        "command": [sys.executable, str(script), str(out), mode],
        "grace_s": 1.0,
        "host": "node-a",
    }
    return SupervisorConfig(**{**base, **overrides})


def bus_config(tmp_path: Path) -> BusConfig:
    return BusConfig(url=f"sqlite://{tmp_path / 'bus.db'}", topics=DEFAULT_TOPICS)


async def lifecycles(bus: Bus) -> list[Lifecycle]:
    ends = await bus.end_offsets("events")
    pending = {tp: end for tp, end in ends.items() if end}
    found: list[Lifecycle] = []
    if not pending:
        return found
    async with await bus.assign(dict.fromkeys(pending, 0)) as consumer:
        read = 0
        while read < sum(pending.values()):
            for record in await consumer.getmany(timeout_s=1.0):
                read += 1
                assert record.value is not None
                found.append(decode(record.value, expect=Lifecycle))
    return found


async def wait_for(bus: Bus, predicate: Any, timeout_s: float = 30.0) -> list[Lifecycle]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = await lifecycles(bus)
        if predicate(events):
            return events
        await asyncio.sleep(0.05)
    raise AssertionError(f"not seen in {timeout_s} s: {await lifecycles(bus)}")


def restore(generation: int, mode: RestoreMode = "restart") -> bytes:
    return encode(
        Restore(
            job_id=JOB,
            generation=generation,
            ts=time.time_ns(),
            seq=generation,
            daemon_id="test",
            incident_id=f"{JOB}/i1",
            reason="test restore",
            target=None,
            mode=mode,
            at_step=50 if mode == "in_process" else None,
        )
    )


async def test_plain_mode_reports_the_exit_and_restarts_into_the_new_generation(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, "fail-gen0", ranks=(0, 1))
    async with open_bus(bus_config(tmp_path)) as bus:
        task = asyncio.ensure_future(Supervisor(cfg).run())
        events = await wait_for(bus, lambda es: any(e.kind == "exited" for e in es))
        [exited] = [e for e in events if e.kind == "exited"]
        assert (exited.rank, exited.ranks, exited.exit_code, exited.signal) == (
            None,
            (0, 1),
            3,
            None,
        )
        assert exited.generation == 0
        await bus.publish("commands", JOB, restore(1))
        # Generation 1 runs the command again and it exits 0: the supervisor is done.
        assert await asyncio.wait_for(task, 30) == 0
        env = json.loads((tmp_path / "out" / "1--.json").read_text())
        assert env["TRAINGUARD_GENERATION"] == "1"
        assert "TRAINGUARD_STEP_FILE" not in env  # one command, several ranks: no step
        assert exited.step is None
        assert env["TRAINGUARD_JOB"] == JOB
        started = [e for e in await lifecycles(bus) if e.kind == "started"]
        assert [e.generation for e in started] == [0, 1]


async def test_launcher_mode_gives_each_rank_torchrun_variables(tmp_path: Path) -> None:
    cfg = config(tmp_path, "exit", nproc_per_node=2, nnodes=2, node_rank=1, master_port=29511)
    async with open_bus(bus_config(tmp_path)):
        assert await asyncio.wait_for(Supervisor(cfg).run(), 30) == 0
    envs = [json.loads((tmp_path / "out" / f"0-{r}.json").read_text()) for r in (2, 3)]
    assert [e["RANK"] for e in envs] == ["2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["GROUP_RANK"] for e in envs} == {"1"}
    assert {e["MASTER_PORT"] for e in envs} == {"29511"}  # generation 0: no offset


async def test_a_restore_stops_workers_that_ignore_sigterm(tmp_path: Path) -> None:
    cfg = config(tmp_path, "stubborn", nproc_per_node=1)
    async with open_bus(bus_config(tmp_path)) as bus:
        task = asyncio.ensure_future(Supervisor(cfg).run())
        await wait_for(bus, lambda es: any(e.kind == "started" for e in es))
        await asyncio.sleep(0.5)  # let the worker install its SIGTERM handler
        began = time.monotonic()
        await bus.publish("commands", JOB, restore(1))
        await wait_for(bus, lambda es: any(e.kind == "started" and e.generation == 1 for e in es))
        # Stopped by SIGKILL after the 1 s grace period, not left running.
        assert 1.0 <= time.monotonic() - began < 10
        await bus.publish("commands", JOB, abort_at(1))
        assert await asyncio.wait_for(task, 30) == EXIT_ABORTED


async def test_an_in_process_restore_keeps_the_workers_and_adopts_its_generation(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, "sleep", nproc_per_node=1)
    async with open_bus(bus_config(tmp_path)) as bus:
        task = asyncio.ensure_future(Supervisor(cfg).run())
        [started] = await wait_for(bus, lambda es: any(e.kind == "started" for e in es))
        await bus.publish("commands", JOB, restore(1, "in_process"))
        await asyncio.sleep(1.0)  # the supervisor polls commands every 0.2 s
        assert [e.kind for e in await lifecycles(bus)] == ["started"]  # no restart
        os.kill(started.pid, signal.SIGKILL)
        events = await wait_for(bus, lambda es: any(e.kind == "exited" for e in es))
        [exited] = [e for e in events if e.kind == "exited"]
        # Reported in the generation the workers run in now, so the daemon acts on it.
        assert (exited.generation, exited.ranks, exited.signal) == (1, (0,), signal.SIGKILL)
        await bus.publish("commands", JOB, restore(2))
        await wait_for(bus, lambda es: any(e.kind == "started" and e.generation == 2 for e in es))
        await bus.publish("commands", JOB, abort_at(2))
        assert await asyncio.wait_for(task, 30) == EXIT_ABORTED


async def test_an_older_generation_restore_is_ignored(tmp_path: Path) -> None:
    cfg = config(tmp_path, "sleep", nproc_per_node=1)
    async with open_bus(bus_config(tmp_path)) as bus:
        await bus.publish("commands", JOB, restore(2))  # the job is already in generation 2
        task = asyncio.ensure_future(Supervisor(cfg).run())
        await wait_for(bus, lambda es: any(e.kind == "started" for e in es))
        await bus.publish("commands", JOB, restore(1))
        await asyncio.sleep(1.0)
        started = [e for e in await lifecycles(bus) if e.kind == "started"]
        assert [e.generation for e in started] == [2]
        await bus.publish("commands", JOB, abort_at(2))
        assert await asyncio.wait_for(task, 30) == EXIT_ABORTED


async def test_an_exit_report_carries_the_last_step_the_worker_completed(tmp_path: Path) -> None:
    """Launcher mode: the agent records each completed step in the worker's step file, and
    the supervisor reports the last one with the exit, also after a SIGKILL; a worker of a
    new generation that completed no step is reported without one."""
    env = {"TRAINGUARD_FAULTS": "kill@step=41,rank=0", "TRAINGUARD_CHECKPOINT_DIR": str(tmp_path)}
    cfg = config(tmp_path, "agent-kill", nproc_per_node=1, env=env)
    async with open_bus(bus_config(tmp_path)) as bus:
        task = asyncio.ensure_future(Supervisor(cfg).run())

        def exits(events: list[Lifecycle]) -> list[Lifecycle]:
            return [e for e in events if e.kind == "exited" and e.rank is None]

        [killed] = exits(await wait_for(bus, lambda es: len(exits(es)) == 1, timeout_s=60))
        assert (killed.ranks, killed.signal, killed.step) == ((0,), signal.SIGKILL, 41)
        await bus.publish("commands", JOB, restore(1))
        exited = exits(await wait_for(bus, lambda es: len(exits(es)) == 2, timeout_s=60))
        assert (exited[1].generation, exited[1].exit_code, exited[1].step) == (1, 7, None)
        await bus.publish("commands", JOB, abort_at(1))
        assert await asyncio.wait_for(task, 30) == EXIT_ABORTED
    env0 = json.loads((tmp_path / "out" / "0-0.json").read_text())
    assert Path(env0["TRAINGUARD_STEP_FILE"]).parent.name.startswith("trainguard-steps-")
    # Removed with the supervisor.
    assert not await asyncio.to_thread(Path(env0["TRAINGUARD_STEP_FILE"]).exists)


def abort_at(generation: int) -> bytes:
    return encode(
        Abort(
            job_id=JOB, generation=generation, ts=time.time_ns(), seq=99, daemon_id="t", reason="x"
        )
    )


async def test_a_stop_signal_stops_the_workers_and_reports_their_exits(tmp_path: Path) -> None:
    cfg = config(tmp_path, "sleep", nproc_per_node=2)
    stop = asyncio.Event()
    async with open_bus(bus_config(tmp_path)) as bus:
        task = asyncio.ensure_future(Supervisor(cfg).run(stop))
        events = await wait_for(bus, lambda es: sum(e.kind == "started" for e in es) == 2)
        pids = [e.pid for e in events if e.kind == "started"]
        stop.set()
        assert await asyncio.wait_for(task, 30) == EXIT_STOPPED
        exits = [e for e in await lifecycles(bus) if e.kind == "exited"]
        assert sorted(e.ranks for e in exits) == [(0,), (1,)]
        assert {e.signal for e in exits} == {signal.SIGTERM}
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_after_a_failure_the_supervisor_waits_idle_for_the_daemon(tmp_path: Path) -> None:
    cfg = config(tmp_path, "fail-gen0", ranks=(0,))
    async with open_bus(bus_config(tmp_path)) as bus:
        task = asyncio.ensure_future(Supervisor(cfg).run())
        await wait_for(bus, lambda es: any(e.kind == "exited" for e in es))
        cpu = time.process_time()
        await asyncio.sleep(1.0)
        assert time.process_time() - cpu < 0.3  # no busy loop while nobody answers
        assert not task.done()
        await bus.publish("commands", JOB, abort_at(0))
        assert await asyncio.wait_for(task, 30) == EXIT_ABORTED


@pytest.mark.parametrize("latest", ["resume", "abort"])
async def test_a_job_that_ran_on_or_ended_cannot_be_joined(tmp_path: Path, latest: str) -> None:
    async with open_bus(bus_config(tmp_path)) as bus:
        if latest == "resume":
            value = encode(
                Resume(job_id=JOB, generation=1, ts=time.time_ns(), seq=2, daemon_id="t", step=5)
            )
        else:
            value = abort_at(1)
        await bus.publish("commands", JOB, value)
        with pytest.raises(JobNotJoinable, match="new job id"):
            await Supervisor(config(tmp_path, "exit")).run()
    assert not list((tmp_path / "out").iterdir())  # no worker was started


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"job_id": "my job"}, "job_id"),
        ({"command": ["no-such-program-xyz"]}, "not found"),
        ({"nproc_per_node": 0}, "nproc_per_node"),
        ({"nnodes": 2}, "master-port"),
    ],
)
def test_bad_settings_fail_before_anything_starts(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, "exit", **overrides)
