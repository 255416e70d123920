"""The supervisor (``trainguard run``) with real worker processes on the embedded bus: exit
reports, restarts into a new generation on a restore order (but not for an in-process one),
SIGTERM-then-SIGKILL, abort."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog

from trainguard.agent.bus import DEFAULT_TOPICS, Bus, BusConfig, TopicPartition, open_bus
from trainguard.agent.bus._partitioner import partition_for
from trainguard.agent.supervisor._supervisor import (
    EXIT_ABORTED,
    EXIT_SIGNALLED,
    EXIT_STOPPED,
    JobNotJoinable,
    Supervisor,
    SupervisorConfig,
)
from trainguard.daemon.core._audit_entry import decision_entry
from trainguard.daemon.core._decisions import Anomaly, Decision, Transition
from trainguard.schemas import (
    EXIT_CONFIG,
    Abort,
    AbortOutcome,
    DataCursor,
    JobRequest,
    Lifecycle,
    Manifest,
    Restore,
    RestoreMode,
    Resume,
    Shard,
    decode,
    encode,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

CLI = [sys.executable, "-m", "trainguard.daemon.cli"]

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
if mode == "bad-setting":
    from trainguard.agent import AgentConfig, exit_on_config_error
    with exit_on_config_error():
        AgentConfig.resolve()
if mode == "orphan":
    # A child that outlives it, holding its stderr (as a DataLoader worker would).
    import subprocess
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("giving up", file=sys.stderr)
    sys.exit(5)
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
        "daemon_timeout_s": 0.0,  # no daemon in these tests: no warnings unless asked
        "state_dir": tmp_path / "state" / "trainguard",  # XDG_STATE_HOME=tmp_path/state
    }
    return SupervisorConfig(**{**base, **overrides})


def bus_config(tmp_path: Path) -> BusConfig:
    return BusConfig(url=f"sqlite://{tmp_path / 'bus.db'}", topics=DEFAULT_TOPICS)


async def lifecycles(bus: Bus) -> list[Lifecycle]:
    return [e for e in await events(bus) if isinstance(e, Lifecycle)]


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
    """Also: the stopped worker is logged (no exit report on the bus: the daemon moved on)."""
    cfg = config(tmp_path, "stubborn", nproc_per_node=1)
    # What asyncio reports of futures nobody awaited, once they are collected.
    unhandled: list[str] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: unhandled.append(context["message"]))
    try:
        with structlog.testing.capture_logs() as logs:
            await _restore_a_stubborn_worker(cfg, tmp_path)
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert unhandled == []
    # Generation 0's by the restore, generation 1's by the abort.
    stopped = [
        (e["generation"], e["ranks"], e["signal"]) for e in logs if e["event"] == "worker stopped"
    ]
    assert stopped[0] == (0, (0,), "SIGKILL"), stopped
    assert [g for g, _, _ in stopped] == [0, 1], stopped


async def _restore_a_stubborn_worker(cfg: SupervisorConfig, tmp_path: Path) -> None:
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
        assert killed.message == ""  # killed from outside: its output does not say why
        await bus.publish("commands", JOB, restore(1))
        exited = exits(await wait_for(bus, lambda es: len(exits(es)) == 2, timeout_s=60))
        assert (exited[1].generation, exited[1].exit_code, exited[1].step) == (1, 7, None)
        await bus.publish("commands", JOB, abort_at(1))
        assert await asyncio.wait_for(task, 30) == EXIT_ABORTED
    env0 = json.loads((tmp_path / "out" / "0-0.json").read_text())
    assert Path(env0["TRAINGUARD_STEP_FILE"]).parent.name.startswith("trainguard-steps-")
    # Removed with the supervisor.
    assert not await asyncio.to_thread(Path(env0["TRAINGUARD_STEP_FILE"]).exists)


async def test_a_failed_workers_exit_report_carries_its_last_words(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A worker whose setting is bad exits with EXIT_CONFIG (``exit_on_config_error``); its
    exit report says why, in the line its traceback ended with, and its stderr still reached
    the supervisor's."""
    cfg = config(tmp_path, "bad-setting", nproc_per_node=1, env={"TRAINGUARD_CHECKSUM_EVERY": "-1"})
    async with open_bus(bus_config(tmp_path)) as bus:
        task = asyncio.ensure_future(Supervisor(cfg).run())
        events = await wait_for(bus, lambda es: any(e.kind == "exited" for e in es))
        [exited] = [e for e in events if e.kind == "exited"]
        assert (exited.ranks, exited.exit_code) == ((0,), EXIT_CONFIG)
        assert exited.message == (
            "trainguard.agent._errors.ConfigError: agent setting checksum_every must be >= 0 "
            "steps, got -1"
        )
        await bus.publish("commands", JOB, abort_at(0))
        assert await asyncio.wait_for(task, 30) == EXIT_ABORTED
    err = capfd.readouterr().err
    assert "Traceback (most recent call last):" in err
    assert "AgentConfig.resolve()" in err  # the whole traceback, not just the last words


async def test_a_child_holding_the_workers_stderr_does_not_delay_its_exit_report(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, "orphan", nproc_per_node=1)
    async with open_bus(bus_config(tmp_path)) as bus:
        task = asyncio.ensure_future(Supervisor(cfg).run())
        events = await wait_for(bus, lambda es: any(e.kind == "exited" for e in es), timeout_s=20)
        [exited] = [e for e in events if e.kind == "exited"]
        assert (exited.exit_code, exited.message) == (5, "giving up")
        await bus.publish("commands", JOB, abort_at(0))
        assert await asyncio.wait_for(task, 30) == EXIT_ABORTED


def abort_at(generation: int, outcome: AbortOutcome = "failed", seq: int = 99) -> bytes:
    return encode(
        Abort(
            job_id=JOB,
            generation=generation,
            ts=time.time_ns(),
            seq=seq,
            daemon_id="t",
            reason="x",
            outcome=outcome,
        )
    )


async def test_a_stop_signal_asks_for_a_stop_before_the_workers_exits(tmp_path: Path) -> None:
    """SIGTERM of a supervisor stops the whole job: its request precedes its workers' exits on
    the job's stream (so the daemon folds the stop first: no incident), and it exits with
    EXIT_STOPPED once the daemon's abort says the job is stopped."""
    cfg = config(tmp_path, "sleep", nproc_per_node=2, stop_timeout_s=60.0)
    stop = asyncio.Event()
    async with open_bus(bus_config(tmp_path)) as bus:
        task = asyncio.ensure_future(Supervisor(cfg).run(stop))
        started = await wait_for(bus, lambda es: sum(e.kind == "started" for e in es) == 2)
        pids = [e.pid for e in started]
        stop.set()
        seen = await wait_for_events(bus, lambda es: sum(is_exit(e) for e in es) == 2)
        kinds = [e.kind for e in seen if isinstance(e, JobRequest) or e.kind == "exited"]
        assert kinds == ["stop", "exited", "exited"]
        [request] = [e for e in seen if isinstance(e, JobRequest)]
        assert (request.generation, request.host, request.pid) == (0, "node-a", os.getpid())
        assert "was signalled" in request.reason
        assert not task.done()  # waiting for the daemon's confirmation
        await bus.publish("commands", JOB, abort_at(0, "stopped"))
        assert await asyncio.wait_for(task, 30) == EXIT_STOPPED
        exits = [e for e in seen if isinstance(e, Lifecycle) and is_exit(e)]
        assert sorted(e.ranks for e in exits) == [(0,), (1,)]
        assert {e.signal for e in exits} == {signal.SIGTERM}
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_without_the_daemons_confirmation_a_stop_signal_exits_signalled(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, "sleep", nproc_per_node=1, stop_timeout_s=1.0)
    stop = asyncio.Event()
    async with open_bus(bus_config(tmp_path)) as bus:
        task = asyncio.ensure_future(Supervisor(cfg).run(stop))
        await wait_for(bus, lambda es: any(e.kind == "started" for e in es))
        stop.set()
        assert await asyncio.wait_for(task, 30) == EXIT_SIGNALLED


async def test_a_second_signal_does_not_wait_for_the_confirmation(tmp_path: Path) -> None:
    cfg = config(tmp_path, "sleep", nproc_per_node=1, stop_timeout_s=600.0)
    stop = asyncio.Event()
    async with open_bus(bus_config(tmp_path)) as bus:
        task = asyncio.ensure_future(Supervisor(cfg).run(stop))
        await wait_for(bus, lambda es: any(e.kind == "started" for e in es))
        stop.set()
        await wait_for_events(bus, lambda es: any(is_exit(e) for e in es))
        while stop.is_set():  # noqa: ASYNC110  # the supervisor re-arms it after its workers
            await asyncio.sleep(0.05)
        stop.set()
        assert await asyncio.wait_for(task, 30) == EXIT_SIGNALLED


async def test_the_stop_timeout_bounds_the_workers_grace(tmp_path: Path) -> None:
    """A signalled supervisor exits ``stop_timeout_s`` after the signal, however long its
    workers' grace: a worker that ignores SIGTERM is killed at that deadline. The old one
    gave it the whole grace first, then waited ``stop_timeout_s`` on top."""
    cfg = config(tmp_path, "stubborn", nproc_per_node=1, grace_s=120.0, stop_timeout_s=1.0)
    stop = asyncio.Event()
    async with open_bus(bus_config(tmp_path)) as bus:
        task = asyncio.ensure_future(Supervisor(cfg).run(stop))
        [started] = await wait_for(bus, lambda es: any(e.kind == "started" for e in es))
        await asyncio.sleep(0.5)  # let the worker install its SIGTERM handler
        stop.set()
        assert await asyncio.wait_for(task, 30) == EXIT_SIGNALLED
        [exited] = [e for e in await lifecycles(bus) if e.kind == "exited"]
        assert exited.signal == signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(started.pid, 0)


async def test_a_paused_worker_is_stopped_without_waiting_for_the_grace(tmp_path: Path) -> None:
    """A worker paused by SIGSTOP (a hang) acts on the SIGTERM at once: it is continued too,
    instead of being SIGKILLed at the end of the grace."""
    cfg = config(tmp_path, "sleep", nproc_per_node=1, grace_s=120.0)
    async with open_bus(bus_config(tmp_path)) as bus:
        task = asyncio.ensure_future(Supervisor(cfg).run())
        [started] = await wait_for(bus, lambda es: any(e.kind == "started" for e in es))
        os.kill(started.pid, signal.SIGSTOP)
        await bus.publish("commands", JOB, abort_at(0, "stopped"))
        assert await asyncio.wait_for(task, 30) == EXIT_STOPPED  # not after the 120 s grace
    with pytest.raises(ProcessLookupError):
        os.kill(started.pid, 0)


async def test_a_second_signal_does_not_wait_for_the_workers_grace(tmp_path: Path) -> None:
    """The old supervisor heard a second signal only once its workers had ended: one that
    ignores SIGTERM held it for the whole grace."""
    cfg = config(tmp_path, "stubborn", nproc_per_node=1, grace_s=120.0, stop_timeout_s=600.0)
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        async with open_bus(bus_config(tmp_path)) as bus:
            task = asyncio.ensure_future(Supervisor(cfg).run(stop))
            await wait_for(bus, lambda es: any(e.kind == "started" for e in es))
            await asyncio.sleep(0.5)  # let the worker install its SIGTERM handler
            stop.set()
            await until(lambda: any(e["event"].startswith("signalled:") for e in logs))
            stop.set()
            assert await asyncio.wait_for(task, 30) == EXIT_SIGNALLED


async def test_an_abort_that_stops_the_job_exits_stopped(tmp_path: Path) -> None:
    """``trainguard stop`` from elsewhere: the daemon's abort says ``stopped``."""
    cfg = config(tmp_path, "sleep", nproc_per_node=1)
    async with open_bus(bus_config(tmp_path)) as bus:
        task = asyncio.ensure_future(Supervisor(cfg).run())
        [started] = await wait_for(bus, lambda es: any(e.kind == "started" for e in es))
        await bus.publish("commands", JOB, abort_at(0, "stopped"))
        assert await asyncio.wait_for(task, 30) == EXIT_STOPPED
    with pytest.raises(ProcessLookupError):
        os.kill(started.pid, 0)


@pytest.mark.parametrize("latest", ["resume", "in_process"])
async def test_a_restarted_supervisor_reports_its_ranks_gone_and_joins_the_next_restore(
    tmp_path: Path, latest: str
) -> None:
    """The job runs in generation 1 (resumed, or restoring in process) and this node's
    supervisor restarts: it must not start workers in generation 1 (nor 0) from scratch, but
    report its ranks gone and start them in the daemon's next restore."""
    cfg = config(tmp_path, "sleep", nproc_per_node=2, nnodes=2, node_rank=1, master_port=29611)
    async with open_bus(bus_config(tmp_path)) as bus:
        if latest == "resume":
            value = encode(
                Resume(job_id=JOB, generation=1, ts=time.time_ns(), seq=2, daemon_id="t", step=5)
            )
        else:
            value = restore(1, "in_process")
        await bus.publish("commands", JOB, value)
        task = asyncio.ensure_future(Supervisor(cfg).run())
        seen = await wait_for_events(bus, lambda es: any(is_exit(e) for e in es))
        [gone] = [e for e in seen if isinstance(e, Lifecycle) and is_exit(e)]
        assert (gone.generation, gone.ranks, gone.signal, gone.pid) == (
            1,
            (2, 3),
            signal.SIGKILL,
            os.getpid(),
        )
        assert not list((tmp_path / "out").iterdir())  # no worker started meanwhile
        await bus.publish("commands", JOB, restore(2))
        reports = await wait_for(bus, lambda es: sum(e.kind == "started" for e in es) == 2)
        assert {e.generation for e in reports if e.kind == "started"} == {2}
        out = tmp_path / "out"
        written = await until(
            lambda: len(names := sorted(p.name for p in out.iterdir())) == 2 and names
        )
        assert written == ["2-2.json", "2-3.json"]
        await bus.publish("commands", JOB, abort_at(2))
        assert await asyncio.wait_for(task, 30) == EXIT_ABORTED


async def test_a_restarted_supervisor_of_a_job_that_committed_in_generation_0_rejoins(
    tmp_path: Path,
) -> None:
    """No command yet, but a committed snapshot: the job has run with this node's ranks; a
    fresh start in generation 0 would train them from step 0 beside a job at step 30."""
    cfg = config(tmp_path, "sleep", nproc_per_node=1)
    async with open_bus(bus_config(tmp_path)) as bus:
        await bus.publish("manifests", JOB, encode(manifest(step=30)))
        task = asyncio.ensure_future(Supervisor(cfg).run())
        seen = await wait_for_events(bus, lambda es: any(is_exit(e) for e in es))
        assert [
            (e.generation, e.ranks) for e in seen if isinstance(e, Lifecycle) and is_exit(e)
        ] == [(0, (0,))]
        assert not list((tmp_path / "out").iterdir())
        await bus.publish("commands", JOB, restore(1))
        await wait_for(bus, lambda es: any(e.kind == "started" and e.generation == 1 for e in es))
        await bus.publish("commands", JOB, abort_at(1))
        assert await asyncio.wait_for(task, 30) == EXIT_ABORTED


async def test_a_second_supervisor_of_a_live_job_and_node_is_refused_and_posts_nothing(
    tmp_path: Path,
) -> None:
    """Only the supervisor holding a node's slot may declare the node's previous ranks gone: a
    second ``trainguard run`` of a job whose supervisor lives on this node (and has committed,
    which a restarted supervisor takes for a rejoin) exits 2 naming the job, the node and the
    holder's pid, posts nothing and starts no worker. The same job's other node is no
    conflict."""
    first = config(tmp_path, "sleep", nproc_per_node=2, nnodes=2, node_rank=0, master_port=29711)
    async with open_bus(bus_config(tmp_path)) as bus:
        tasks = [asyncio.ensure_future(Supervisor(first).run())]
        await wait_for(bus, lambda es: sum(e.kind == "started" for e in es) == 2)
        tasks.append(asyncio.ensure_future(Supervisor(replace(first, node_rank=1)).run()))
        await wait_for(bus, lambda es: sum(e.kind == "started" for e in es) == 4)
        await bus.publish("manifests", JOB, encode(manifest(step=30)))
        before = await events(bus)
        second = await asyncio.create_subprocess_exec(
            *CLI, "run", "--job", JOB, "--bus", first.bus.url, "--nproc-per-node", "2",
            "--nnodes", "2", "--node-rank", "0", "--master-port", "29711",
            "--daemon-timeout", "0", "--", *first.command,
            env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        output = asyncio.ensure_future(second.communicate())
        try:
            # Without the slot it reports ranks 0-1 gone, then waits for a daemon for ever.
            seen = await wait_for_events(
                bus, lambda es: output.done() or any(is_exit(e) for e in es), timeout_s=60
            )
        finally:
            if second.returncode is None:
                second.kill()
            _, err = await output
        assert [e for e in seen if is_exit(e)] == []
        assert second.returncode == 2
        said = " ".join(err.decode().split())
        assert f"job {JOB!r} already has a supervisor on this node (rank0): pid {os.getpid()}" in (
            said
        )
        assert f"holds {tmp_path / 'state' / 'trainguard' / 'supervisors'}/" in said
        assert await events(bus) == before  # nothing posted
        written = sorted(p.name for p in (tmp_path / "out").iterdir())
        assert written == ["0-0.json", "0-1.json", "0-2.json", "0-3.json"]
        await bus.publish("commands", JOB, abort_at(0))
        assert await asyncio.wait_for(asyncio.gather(*tasks), 30) == [EXIT_ABORTED] * 2


def finished(rank: int, generation: int) -> bytes:
    """A worker's last word: its rank finished in ``generation``."""
    return encode(
        Lifecycle(
            job_id=JOB, generation=generation, ts=time.time_ns(), seq=9, rank=rank,
            host="node-a", pid=100 + rank, kind="finished", step=30,
        )
    )  # fmt: skip


@pytest.mark.parametrize(
    ("latest", "generation"), [(None, 0), ("resume", 1)], ids=["committed", "resumed"]
)
async def test_a_restarted_supervisor_whose_ranks_finished_has_nothing_to_do(
    tmp_path: Path, latest: str | None, generation: int
) -> None:
    """A supervisor restarted (systemd, Kubernetes) after this node's ranks finished in the
    job's generation: none is gone, so it reports nothing (the daemon would ignore the report),
    starts nothing, says so and exits 0 like its predecessor. The old one exited 2, the status
    of a bad setting, which a pod failure policy takes for the end of the whole job."""
    async with open_bus(bus_config(tmp_path)) as bus:
        await bus.publish("manifests", JOB, encode(manifest(step=30)))
        if latest == "resume":
            value = encode(
                Resume(job_id=JOB, generation=1, ts=time.time_ns(), seq=2, daemon_id="t", step=5)
            )
            await bus.publish("commands", JOB, value)
            await bus.publish("events", JOB, finished(0, 0))  # an older generation: no answer
        for rank in (0, 1):
            await bus.publish("events", JOB, finished(rank, generation))
        before = await events(bus)
        with structlog.testing.capture_logs() as logs:
            assert await Supervisor(config(tmp_path, "exit", nproc_per_node=2)).run() == 0
        assert await events(bus) == before  # nothing posted
    assert not list((tmp_path / "out").iterdir())
    [said] = [e for e in logs if "nothing to do" in e["event"]]
    assert said["event"].startswith(
        f"this node's ranks finished in generation {generation}; nothing to do"
    )
    assert said["log_level"] == "info"
    assert not [e for e in logs if e["log_level"] in ("warning", "error")]


async def test_trainguard_run_of_a_node_whose_ranks_finished_exits_0(tmp_path: Path) -> None:
    """The same through ``trainguard run``, whose exit status the orchestrator reads."""
    cfg = config(tmp_path, "exit", nproc_per_node=2)
    async with open_bus(bus_config(tmp_path)) as bus:
        await bus.publish("manifests", JOB, encode(manifest(step=30)))
        for rank in (0, 1):
            await bus.publish("events", JOB, finished(rank, 0))
    run = await asyncio.create_subprocess_exec(
        *CLI, "run", "--job", JOB, "--bus", cfg.bus.url, "--nproc-per-node", "2",
        "--daemon-timeout", "0", "--", *cfg.command,
        env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(run.communicate(), 60)
    assert run.returncode == 0, err.decode()
    assert "this node's ranks finished in generation 0; nothing to do" in err.decode()
    assert not list((tmp_path / "out").iterdir())


async def test_a_restarted_supervisor_whose_ranks_did_not_all_finish_rejoins(
    tmp_path: Path,
) -> None:
    async with open_bus(bus_config(tmp_path)) as bus:
        await bus.publish("manifests", JOB, encode(manifest(step=30)))
        await bus.publish("events", JOB, finished(0, 0))
        task = asyncio.ensure_future(Supervisor(config(tmp_path, "sleep", nproc_per_node=2)).run())
        seen = await wait_for_events(bus, lambda es: any(is_exit(e) for e in es))
        assert [(e.ranks, e.signal) for e in seen if isinstance(e, Lifecycle) and is_exit(e)] == [
            ((0, 1), signal.SIGKILL)
        ]
        await bus.publish("commands", JOB, abort_at(0))
        assert await asyncio.wait_for(task, 30) == EXIT_ABORTED


async def test_the_node_slot_is_free_again_once_its_supervisor_ended(tmp_path: Path) -> None:
    cfg = config(tmp_path, "exit", nproc_per_node=1)
    async with open_bus(bus_config(tmp_path)):
        assert await asyncio.wait_for(Supervisor(cfg).run(), 30) == 0
        assert await asyncio.wait_for(Supervisor(cfg).run(), 30) == 0


@pytest.mark.parametrize("outcome", ["failed", "stopped"])
async def test_continue_asks_the_daemon_and_joins_the_restore_that_answers(
    tmp_path: Path, outcome: AbortOutcome
) -> None:
    cfg = config(tmp_path, "sleep", nproc_per_node=1, continue_job=True)
    async with open_bus(bus_config(tmp_path)) as bus:
        await bus.publish("commands", JOB, abort_at(3, outcome, seq=9))
        task = asyncio.ensure_future(Supervisor(cfg).run())
        seen = await wait_for_events(bus, lambda es: any(isinstance(e, JobRequest) for e in es))
        [ask] = [e for e in seen if isinstance(e, JobRequest)]
        assert (ask.kind, ask.generation) == ("continue", 3)
        assert not list((tmp_path / "out").iterdir())
        await bus.publish("commands", JOB, restore(4))
        await wait_for(bus, lambda es: any(e.kind == "started" and e.generation == 4 for e in es))
        await bus.publish("commands", JOB, abort_at(4))
        assert await asyncio.wait_for(task, 30) == EXIT_ABORTED


async def test_a_refused_continue_ends_with_the_jobs_outcome(tmp_path: Path) -> None:
    cfg = config(tmp_path, "sleep", nproc_per_node=1, continue_job=True)
    async with open_bus(bus_config(tmp_path)) as bus:
        await bus.publish("commands", JOB, abort_at(3, "stopped", seq=9))
        task = asyncio.ensure_future(Supervisor(cfg).run())
        await wait_for_events(bus, lambda es: any(isinstance(e, JobRequest) for e in es))
        await bus.publish("commands", JOB, abort_at(3, "stopped", seq=10))  # the refusal
        assert await asyncio.wait_for(task, 30) == EXIT_STOPPED
    assert not list((tmp_path / "out").iterdir())


async def test_a_request_the_daemon_read_without_answering_is_said(tmp_path: Path) -> None:
    """The daemon's group read past the rejoin report and ordered nothing (the job has
    finished, say): the supervisor says so instead of waiting for ever."""
    cfg = config(tmp_path, "sleep", nproc_per_node=1)
    async with open_bus(bus_config(tmp_path)) as bus:
        await bus.publish(
            "commands",
            JOB,
            encode(
                Resume(job_id=JOB, generation=1, ts=time.time_ns(), seq=2, daemon_id="t", step=5)
            ),
        )
        task = asyncio.ensure_future(Supervisor(cfg).run())
        seen = await wait_for_events(bus, lambda es: any(is_exit(e) for e in es))
        await commit_as_daemon(bus, len(seen))
        with pytest.raises(JobNotJoinable, match=r"read this node's report .* ordered nothing"):
            await asyncio.wait_for(task, 30)


async def test_a_report_whose_restore_the_daemon_holds_waits_for_it(tmp_path: Path) -> None:
    """The daemon's group read past the rejoin report, and its audit entry for the report says
    the restore is held (after a bus outage, or for a checkpoint in flight): the supervisor
    waits for the restore and joins it. It gave up with exit 2 before (issue 13's tester, a
    supervisor restarted during a broker outage)."""
    cfg = config(tmp_path, "sleep", nproc_per_node=1)
    with structlog.testing.capture_logs() as logs:
        async with open_bus(bus_config(tmp_path)) as bus:
            resume = Resume(
                job_id=JOB, generation=1, ts=time.time_ns(), seq=2, daemon_id="t", step=5
            )
            await bus.publish("commands", JOB, encode(resume))
            task = asyncio.ensure_future(Supervisor(cfg).run())
            seen = await wait_for_events(bus, lambda es: any(is_exit(e) for e in es))
            [offset] = [n for n, e in enumerate(seen) if is_exit(e)]
            entry = decision_entry(
                JOB,
                partition=partition_for(JOB, await bus.partitions("events")),
                offset=offset,
                at_ms=0,
                identity={"type": "lifecycle"},
                config="c",
                decisions=[Anomaly(kind="restore_held", reason="held for step 25")],
            )
            await bus.publish("audit", JOB, orjson.dumps(entry))
            await commit_as_daemon(bus, len(seen))
            await until(lambda: any("holds its restore" in e["event"] for e in logs))
            assert not task.done()
            await bus.publish("commands", JOB, restore(2))
            await wait_for(bus, lambda es: any(e.kind == "started" for e in es))
            await bus.publish("commands", JOB, abort_at(2))
            assert await asyncio.wait_for(task, 30) == EXIT_ABORTED


WAITING = "workers finished: waiting for the daemon to judge"


async def read_as_daemon(bus: Bus) -> None:
    """Commit the daemon group's position at the end of the job's partition of ``events``:
    the daemon read (and acted on) everything there."""
    tp = TopicPartition("events", partition_for(JOB, await bus.partitions("events")))
    await commit_as_daemon(bus, (await bus.end_offsets("events"))[tp])


async def decided_as_daemon(bus: Bus, decision: Decision) -> None:
    """Act as a daemon that read everything and recorded ``decision`` in the job's audit."""
    entry = decision_entry(
        JOB,
        partition=partition_for(JOB, await bus.partitions("events")),
        offset=0,
        at_ms=0,
        identity={"type": "lifecycle"},
        config="c",
        decisions=[decision],
    )
    await bus.publish("audit", JOB, orjson.dumps(entry))
    await read_as_daemon(bus)


async def finish_as_daemon(bus: Bus, generation: int) -> None:
    """Act as a daemon that read everything and found the whole job finished."""
    done = Transition(old="running", new="finished", generation=generation, reason="all done")
    await decided_as_daemon(bus, done)


async def until_judging(bus: Bus, logs: list[Any], generations: list[int]) -> None:
    """Until the supervisor reported its worker's exit in each of ``generations`` and waits
    for the daemon to judge the last one's finish."""
    await wait_for(bus, lambda es: [e.generation for e in es if e.kind == "exited"] == generations)
    await until(lambda: sum(e["event"] == WAITING for e in logs) >= len(generations))


async def hold_a_restore(bus: Bus) -> None:
    """Act as a daemon that read everything and holds its restore (after a bus gap)."""
    await decided_as_daemon(bus, Anomaly(kind="restore_held", reason="until the bus has settled"))


async def test_finished_workers_wait_for_the_daemons_verdict_and_obey_its_restore(
    tmp_path: Path,
) -> None:
    """Defect F1: a NaN in the job's last heartbeat interval reaches the daemon in the ranks'
    last heartbeats, right before their ``finished``; its restore found no supervisor, which
    had exited with its workers. Now workers that all finished leave the supervisor waiting
    until the daemon's group read this node's reports: its restore then restarts them; with
    no new command the run ends with 0."""
    cfg = config(tmp_path, "exit", nproc_per_node=1, daemon_timeout_s=60.0)
    with structlog.testing.capture_logs() as logs:
        async with open_bus(bus_config(tmp_path)) as bus:
            task = asyncio.ensure_future(Supervisor(cfg).run())
            await until_judging(bus, logs, [0])
            await asyncio.sleep(0.5)
            assert not task.done()  # no daemon has read the exit yet
            await bus.publish("commands", JOB, restore(1))
            await read_as_daemon(bus)
            await until_judging(bus, logs, [0, 1])
            assert [e.generation for e in await lifecycles(bus) if e.kind == "started"] == [0, 1]
            assert not task.done()
            await finish_as_daemon(bus, 1)
            assert await asyncio.wait_for(task, 30) == 0
    assert any(e["event"] == "the daemon judged the finish" for e in logs)


async def test_a_node_that_finished_waits_until_the_whole_job_is_found_finished(
    tmp_path: Path,
) -> None:
    """Several nodes: the daemon read this node's finish, but another node's last reports
    (read later) may show a divergence whose restore needs this node's ranks too. So the
    node waits, without a command, until the daemon finds the whole job finished; a restore
    ordered meanwhile restarts its workers."""
    cfg = config(tmp_path, "exit", nproc_per_node=1, daemon_timeout_s=60.0)
    with structlog.testing.capture_logs() as logs:
        async with open_bus(bus_config(tmp_path)) as bus:
            task = asyncio.ensure_future(Supervisor(cfg).run())
            await until_judging(bus, logs, [0])
            await read_as_daemon(bus)  # this node's reports read; the job not finished
            await until(lambda: any("whole job finished" in e["event"] for e in logs))
            await asyncio.sleep(0.5)
            assert not task.done()
            await bus.publish("commands", JOB, restore(1))  # another node's divergence
            await until_judging(bus, logs, [0, 1])
            await finish_as_daemon(bus, 1)
            assert await asyncio.wait_for(task, 30) == 0
    assert [e["generation"] for e in logs if e["event"] == "the daemon judged the finish"] == [1]


async def test_a_restore_the_daemon_holds_after_the_finish_is_waited_for(tmp_path: Path) -> None:
    """A tester's finding: after a bus gap the daemon holds its restore until the bus settled,
    so it decides it after its group read past the finish. The supervisor took that for a
    verdict and exited, leaving a NaN job restoring with nobody to restart it. The daemon's
    audit says a restore is held: the supervisor waits for it."""
    cfg = config(tmp_path, "exit", nproc_per_node=1, daemon_timeout_s=60.0)
    with structlog.testing.capture_logs() as logs:
        async with open_bus(bus_config(tmp_path)) as bus:
            task = asyncio.ensure_future(Supervisor(cfg).run())
            await until_judging(bus, logs, [0])
            await hold_a_restore(bus)
            await until(lambda: any("holds a restore" in e["event"] for e in logs))
            await asyncio.sleep(0.5)
            assert not task.done()
            await bus.publish("commands", JOB, restore(1))
            await until_judging(bus, logs, [0, 1])
            await finish_as_daemon(bus, 1)
            assert await asyncio.wait_for(task, 30) == 0
    assert not any(e["event"] == "the daemon judged the finish" and e["generation"] == 0
                   for e in logs)  # fmt: skip


async def test_a_signal_while_the_daemon_holds_a_restore_stops_the_job(tmp_path: Path) -> None:
    """A tester's finding: SIGTERM while the daemon held the restore of a finish ended the
    wait with 0 ("finished") and left the NaN job restoring. With a restore pending the signal
    stops the job as for running workers: a stop request, then the daemon's confirmation."""
    cfg = config(tmp_path, "exit", nproc_per_node=1, daemon_timeout_s=60.0, stop_timeout_s=60.0)
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        async with open_bus(bus_config(tmp_path)) as bus:
            task = asyncio.ensure_future(Supervisor(cfg).run(stop))
            await until_judging(bus, logs, [0])
            await hold_a_restore(bus)
            await until(lambda: any("holds a restore" in e["event"] for e in logs))
            stop.set()
            await wait_for_events(bus, lambda es: any(isinstance(e, JobRequest) for e in es))
            assert not task.done()  # waiting for the daemon's confirmation
            await bus.publish("commands", JOB, abort_at(0, "stopped"))
            assert await asyncio.wait_for(task, 30) == EXIT_STOPPED


async def test_finished_workers_with_no_daemon_reading_exit_after_the_daemon_timeout(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, "exit", nproc_per_node=1, daemon_timeout_s=1.0, warn_every_s=60.0)
    with structlog.testing.capture_logs() as logs:
        async with open_bus(bus_config(tmp_path)):
            assert await asyncio.wait_for(Supervisor(cfg).run(), 30) == 0
    [said] = [e for e in logs if "no daemon has judged this node's finish" in e["event"]]
    assert said["log_level"] == "warning"


async def test_no_daemon_is_warned_about_repeatedly(tmp_path: Path) -> None:
    cfg = config(tmp_path, "sleep", nproc_per_node=1, daemon_timeout_s=0.5, warn_every_s=0.5)
    with structlog.testing.capture_logs() as logs:
        async with open_bus(bus_config(tmp_path)) as bus:
            task = asyncio.ensure_future(Supervisor(cfg).run())
            deadline = time.monotonic() + 60
            while sum("NO DAEMON" in e["event"] for e in logs) < 2:
                assert time.monotonic() < deadline, logs
                await asyncio.sleep(0.1)
            warning = next(e for e in logs if "NO DAEMON" in e["event"])
            assert warning["log_level"] == "warning"
            assert warning["group"] == "trainguard.daemon"
            assert warning["bus"].startswith(f"sqlite://{tmp_path}")
            # A daemon that reads the job's events ends the warnings.
            seen = await wait_for_events(bus, lambda es: bool(es))
            await commit_as_daemon(bus, len(seen))
            while not any(e["event"] == "a daemon reads this job's events again" for e in logs):
                assert time.monotonic() < deadline, logs
                await asyncio.sleep(0.1)
            await bus.publish("commands", JOB, abort_at(0))
            assert await asyncio.wait_for(task, 30) == EXIT_ABORTED


async def commit_as_daemon(bus: Bus, position: int) -> None:
    """Commit ``position`` on the job's partition of ``events`` as the daemon's group does."""
    tp = TopicPartition("events", partition_for(JOB, await bus.partitions("events")))
    consumer = await bus.subscribe(["events"], "trainguard.daemon")
    async with consumer:
        await consumer.commit({tp: position})


async def until(probe: Any, timeout_s: float = 30.0) -> Any:
    """The first truthy value of ``probe()``, polled; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := probe()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        await asyncio.sleep(0.05)
    return value


def manifest(step: int) -> Manifest:
    cursor = DataCursor(data_version="v", seed=0, epoch=0, offset=step, world_size=1)
    shard = Shard(rank=0, uri="file:///x", size_bytes=1, digest="sha256:" + "0" * 64)
    return Manifest(
        job_id=JOB,
        snapshot_id=f"{JOB}/g0/s{step}",
        generation=0,
        ts=0,
        step=step,
        world_size=1,
        shards=(shard,),
        cursor=cursor,
    )


def is_exit(e: Lifecycle | JobRequest) -> bool:
    return isinstance(e, Lifecycle) and e.kind == "exited"


async def events(bus: Bus) -> list[Lifecycle | JobRequest]:
    """Every lifecycle event and job request on ``events``, in order."""
    ends = await bus.end_offsets("events")
    pending = {tp: end for tp, end in ends.items() if end}
    found: list[Lifecycle | JobRequest] = []
    if not pending:
        return found
    async with await bus.assign(dict.fromkeys(pending, 0)) as consumer:
        read = 0
        while read < sum(pending.values()):
            for record in await consumer.getmany(timeout_s=1.0):
                read += 1
                assert record.value is not None
                message = decode(record.value, expect=(Lifecycle, JobRequest))
                assert isinstance(message, Lifecycle | JobRequest)
                found.append(message)
    return found


async def wait_for_events(
    bus: Bus, predicate: Any, timeout_s: float = 30.0
) -> list[Lifecycle | JobRequest]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = await events(bus)
        if predicate(found):
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"not seen in {timeout_s} s: {await events(bus)}")


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


@pytest.mark.parametrize("outcome", ["failed", "stopped"])
async def test_a_job_that_ended_is_refused_without_continue(
    tmp_path: Path, outcome: AbortOutcome
) -> None:
    async with open_bus(bus_config(tmp_path)) as bus:
        await bus.publish("commands", JOB, abort_at(1, outcome))
        with pytest.raises(JobNotJoinable, match="with --continue on every node"):
            await Supervisor(config(tmp_path, "exit", nproc_per_node=1)).run()
        assert [e for e in await events(bus) if e.job_id == JOB] == []  # nothing sent
    assert not list((tmp_path / "out").iterdir())  # no worker was started
