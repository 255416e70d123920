"""Three daemon instances sharing the work (issue 13, items 3 and 4): exactly-once decisions
while instances crash or pause and ranks die.

Three ``trainguard daemon`` processes in one consumer group (session timeout 6 s, Kafka's
lower bound) and three 2-rank charlm jobs on a Kafka broker of the chaos tests' own. In each
round, at random moments, the instance that owns the round's job (the jobs take turns, in a
random order, so each is hit) is SIGKILLed (and a new one started) or SIGSTOPped for longer
than the session timeout (SIGCONTed :data:`PAUSE_S` later, at most one paused at a time), and
a rank of that job is SIGKILLed, in random order. The rounds overlap: a round begins once its
job trains again after its previous round's restore (acknowledged, resumed, committed in its
new generation) and its owner is known, without waiting for the other jobs' restores or the
end of a pause, so one round's faults often fall into the failover or the rebalance of the
previous one. After the last round every kill's restore is on the bus and no instance is
paused. Then every job is stopped with ``trainguard stop``, which some instance must answer.
Then: no lost job (every kill restored, every stop answered), per (job, command type,
generation) exactly one command on the ``commands`` topic read with ``read_committed`` and no
two different ones in the audit trail, and every job's replay reproduces its audit trail.

``TRAINGUARD_CHAOS_ROUNDS`` sets the number of rounds (default :data:`ROUNDS`, the issue's),
``TRAINGUARD_CHAOS_SEED`` the random seed (printed on failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from tests.scenarios.chaos.chaos import (
    DEADLINE_S,
    SMALL_MODEL,
    ChaosBroker,
    kill_running_rank,
    running_generation,
    wait_on_bus,
    wait_until,
)
from tests.scenarios.harness import WORLD_SIZE, JobRun, Shape
from tests.support.buses import BusFactory
from trainguard.agent.bus import BusUnavailable
from trainguard.agent.bus._partitioner import partition_for
from trainguard.agent.supervisor._supervisor import EXIT_STOPPED
from trainguard.daemon.demo._harness import follow_job, stop_process
from trainguard.schemas import Abort, Command, Manifest, Restore, Resume, decode

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(900)]

ROUNDS = int(os.environ.get("TRAINGUARD_CHAOS_ROUNDS", "20"))
SEED = int(os.environ.get("TRAINGUARD_CHAOS_SEED", str(random.randrange(2**32))))
INSTANCES = 3
#: Seconds a paused instance stays stopped: longer than its session (6 s, harness), so the
#: group gives its partitions to another instance while it sleeps.
PAUSE_S = 8.0
#: Seconds at most between a round's start and its first fault, and between its two faults.
GAP_S = 2.0
#: Long enough never to end on its own (the test stops it); paced so restarts stay cheap; a
#: checkpoint every 5 steps, so that a restored job soon commits and can be hit again.
SHAPE = Shape(steps=100_000, checkpoint_every=5, seed=17)
STEP_SLEEP_S = 0.1
CLI = (sys.executable, "-m", "trainguard.daemon.cli")
PARTITIONS = 6  # DEFAULT_TOPICS


def job_ids() -> list[str]:
    """Three job ids on three different partitions, so that different instances own them."""
    found: dict[int, str] = {}
    n = 0
    while len(found) < 3:
        job = f"many-{n}"
        found.setdefault(partition_for(job, PARTITIONS), job)
        n += 1
    return list(found.values())


async def committed_commands(bootstrap: str, topic: str) -> list[Command]:
    """Every command on ``topic`` that a ``read_committed`` reader sees, in partition order."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        isolation_level="read_committed",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)  # the last stable offsets, read_committed
        out: list[Command] = []
        async with asyncio.timeout(DEADLINE_S):
            while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
                batches = await consumer.getmany(timeout_ms=500)
                for tp, records in batches.items():
                    for rec in records:
                        if rec.value is not None and rec.offset < ends[tp]:
                            command = decode(rec.value, expect=Command)
                            assert isinstance(command, Restore | Resume | Abort)  # expect
                            out.append(command)
        return out
    finally:
        await consumer.stop()


async def _last_decider(run: JobRun, generation: int, timeout_s: float) -> str:
    configs: dict[str, str] = {}
    committed = False
    last: str | None = None
    deadline = time.monotonic() + timeout_s
    follow = follow_job(run.bus.url, run.bus.prefix, run.job)
    async with contextlib.aclosing(follow):
        async for batch in follow:
            for stamped in batch:
                message = stamped.message
                if isinstance(message, Manifest):
                    committed = committed or message.generation >= generation
                elif isinstance(message, dict) and message.get("entry") == "config":
                    configs[message["config_id"]] = message["config"]["daemon_id"]
                elif isinstance(message, dict) and message.get("entry") == "decisions":
                    last = configs.get(message["config_id"], last)
            if not batch and committed and last is not None:  # read up to the end
                return last
            assert time.monotonic() < deadline, (
                f"{run.job} did not commit in generation {generation} within {timeout_s:g} s "
                f"{run.describe()}"
            )
    raise AssertionError("follow_job() ended")  # it yields for ever


def owner_pid(run: JobRun, generation: int) -> int:
    """Once ``run``'s job has committed a snapshot of ``generation`` or later (it trains
    again after its last restore), the pid of the instance that decided for it last: the
    ``daemon_id`` (``host-pid``) of the config entry of the job's newest decision entry on the
    bus. Its owner, unless a rebalance that has not decided anything yet moved the job (then
    possibly an instance that is paused or dead).

    Raises:
        AssertionError: no such commit within :data:`DEADLINE_S`.
    """
    deadline = time.monotonic() + DEADLINE_S
    while True:  # a broker can refuse a new client's first requests for a moment
        try:
            last = asyncio.run(_last_decider(run, generation, deadline - time.monotonic()))
            return int(last.rpartition("-")[2])
        except BusUnavailable:
            assert time.monotonic() < deadline, f"bus unavailable {run.describe()}"
            time.sleep(0.5)


def running_after(job: str, generation: int) -> bool:
    """Whether every rank of ``job`` runs in a generation after ``generation``."""
    running = running_generation(job, WORLD_SIZE)
    return running is not None and running > generation


def restores_after(job: str, generation: int) -> Callable[[Any], bool]:
    """Matches a restore of ``job`` that ends ``generation`` (a later one may have come
    first: a rank starved of CPU on 2 loaded cores can miss its progress deadline too)."""
    return lambda m: isinstance(m, Restore) and m.job_id == job and m.generation > generation


def command_key(command: Command | dict[str, Any]) -> tuple[str, str, int]:
    """(job, command type, generation) of a command or of an audited command's dict."""
    if isinstance(command, dict):
        return command["job_id"], command["schema"].partition("/")[0], command["generation"]
    return command.job_id, command.SCHEMA.partition("/")[0], command.generation


def meaning(command: dict[str, Any]) -> bytes:
    """An audited command without what differs between instances deciding the same thing."""
    return orjson.dumps(
        {k: v for k, v in command.items() if k not in ("ts", "daemon_id", "auth")},
        option=orjson.OPT_SORT_KEYS,
    )


def last_lines(log: Path, count: int = 5) -> list[str]:
    """The last ``count`` lines of ``log`` (a daemon's), for a failure message."""
    return log.read_text(errors="replace").splitlines()[-count:]


class Pauses:
    """SIGSTOPped instances, each SIGCONTed :data:`PAUSE_S` seconds after its pause by a
    timer thread (the pause's length is the scenario itself, not a wait for anything)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._timers: dict[int, threading.Timer] = {}  # pid -> its SIGCONT

    def pause(self, pid: int) -> None:
        """SIGSTOP ``pid``'s process group; SIGCONT it :data:`PAUSE_S` seconds later."""
        os.killpg(pid, signal.SIGSTOP)
        timer = threading.Timer(PAUSE_S, self._resume, (pid,))
        with self._lock:
            self._timers[pid] = timer
        timer.start()

    def _resume(self, pid: int) -> None:
        with self._lock:
            if self._timers.pop(pid, None) is None:
                return  # resumed already (``resume_all``)
        os.killpg(pid, signal.SIGCONT)

    def paused(self) -> set[int]:
        """Pids paused now."""
        with self._lock:
            return set(self._timers)

    def resume_all(self) -> None:
        """SIGCONT every paused instance now (at teardown)."""
        with self._lock:
            timers, self._timers = self._timers, {}
        for pid, timer in timers.items():
            timer.cancel()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)


def test_three_instances_decide_every_incident_exactly_once(
    chaos_broker: ChaosBroker, chaos_bus: BusFactory, tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    context = f"seed {SEED}, {ROUNDS} rounds"
    runs: list[JobRun] = []
    for job in job_ids():
        (tmp_path / job).mkdir()
        runs.append(
            JobRun(
                chaos_bus,
                tmp_path / job,
                SHAPE,
                tmp_path,  # no reference: the jobs are stopped, never compared
                context=context,
                # Kills follow restores closely: no crash-loop verdict for a job that is
                # killed again before it gets far.
                machine={"max_restore_cycles": 1000},
                job=job,
            )
        )
    host = runs[0]  # its daemons serve every job
    pauses = Pauses()
    events: list[str] = []
    killed: dict[str, int] = {}  # job -> the generation of its last killed rank
    sigkilled: set[int] = set()  # daemon instances this test SIGKILLed
    try:
        for _ in range(INSTANCES):
            host.start_daemon()
        for run in runs:
            run.start_job(extra=[*SMALL_MODEL, "--step-sleep", str(STEP_SLEEP_S)])
        for run in runs:  # every job trains, and some instance commits its snapshots
            run.wait_for("a first commit", lambda m: isinstance(m, Manifest))
        turns = rng.sample(runs, len(runs))
        began = time.monotonic()
        for round_ in range(ROUNDS):
            run = turns[round_ % len(turns)]
            pause = rng.random() < 0.5
            rank = rng.randrange(WORLD_SIZE)
            # It trains again (acknowledged its last restore, resumed, committed): a kill
            # before would be another attempt of the last incident, which has a bounded number.
            after = killed.get(run.job, -1)
            wait_until(
                f"{run.job}'s ranks run in a generation after {after} ({events[-3:]})",
                lambda: running_after(run.job, after),  # noqa: B023
            )
            running = running_generation(run.job, WORLD_SIZE) or 0
            if pause:  # one instance paused at a time: wait for the last pause's end
                wait_until("the paused instance resumed", lambda: not pauses.paused())
            # The instance that owns the job: its successor must decide the incident, and
            # a paused one must find itself fenced when it wakes up.
            owner = owner_pid(run, running)
            # An instance ends only when this test SIGKILLs it: one that exits by itself
            # (a bus error after a pause, say) is a lost instance.
            lost = [
                f"pid {d.pid} exit {d.returncode}: {last_lines(host.workdir / f'daemon-{i + 1}.log')}"
                for i, d in enumerate(host.daemons)
                if d.poll() is not None and d.pid not in sigkilled
            ]
            assert not lost, (
                f"daemon instances exited on their own {lost} {host.describe()} {events}"
            )
            live = [d for d in host.daemons if d.poll() is None and d.pid not in pauses.paused()]
            victim = next((d for d in live if d.pid == owner), None) or rng.choice(live)
            time.sleep(rng.uniform(0.0, GAP_S))  # a random moment of the job's training
            first, second = rng.sample(("daemon", "rank"), 2)
            for i, fault in enumerate((first, second)):
                if i:
                    time.sleep(rng.uniform(0.0, GAP_S))
                if fault == "daemon":
                    if pause:
                        pauses.pause(victim.pid)
                    else:
                        sigkilled.add(victim.pid)
                        stop_process(victim, signal.SIGKILL)
                        host.start_daemon()
                else:
                    killed[run.job] = kill_running_rank(run.job, rank, WORLD_SIZE)
            events.append(
                f"{time.monotonic() - began:.1f} s: round {round_}: "
                f"{'SIGSTOP' if pause else 'SIGKILL'} daemon pid {victim.pid}, "
                f"SIGKILL {run.job} rank {rank} generation {killed[run.job]}, {first} first"
            )
            print(events[-1], flush=True)  # shown with a failure's captured output
        for run in runs:  # no lost job: the last kill of each was restored
            gen = killed[run.job]
            wait_on_bus(
                run, f"{run.job}'s restore after {gen} ({events})", restores_after(run.job, gen)
            )
        wait_until("the paused instance resumed", lambda: not pauses.paused())
        bus_args = ("--bus", chaos_bus.url, "--topic-prefix", chaos_bus.prefix)
        stops = {  # all at once: each waits for some instance to answer
            run.job: subprocess.Popen(
                [*CLI, "stop", run.job, "--reason", "chaos test over", *bus_args],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for run in runs
        }
        for job, stop in stops.items():
            output, _ = stop.communicate(timeout=DEADLINE_S)
            assert stop.returncode == 0, f"trainguard stop {job}: {output}"
        for run in runs:
            assert run.supervisor is not None
            code = run.supervisor.wait(DEADLINE_S)
            assert code == EXIT_STOPPED, f"supervisor exit {code} {run.describe()} {events}"
        for daemon in host.daemons:
            stop_process(daemon)

        commands = asyncio.run(
            committed_commands(chaos_broker.bootstrap, f"{chaos_bus.prefix}commands")
        )
        on_bus: defaultdict[tuple[str, str, int], int] = defaultdict(int)
        for command in commands:
            on_bus[command_key(command)] += 1
        duplicates = {k: n for k, n in on_bus.items() if n != 1}
        assert not duplicates, f"commands sent more than once: {duplicates} {context} {events}"
        for run in runs:
            record = run.record()  # also: the replay reproduces the audit trail
            audited: defaultdict[tuple[str, str, int], set[bytes]] = defaultdict(set)
            for decision in record.decisions():
                if decision["decision"] == "issue":
                    audited[command_key(decision["command"])].add(meaning(decision["command"]))
            conflicts = {k: len(v) for k, v in audited.items() if len(v) > 1}
            assert not conflicts, f"conflicting decisions {conflicts} {run.describe()} {events}"
            restores = sorted(g for (j, kind, g) in on_bus if j == run.job and kind == "restore")
            assert restores, f"{run.job} was never restored {run.describe()} {events}"
            assert restores == list(range(1, restores[-1] + 1)), (
                f"restores on the bus {restores} {run.describe()} {events}"
            )
            assert set(audited) == {k for k in on_bus if k[0] == run.job}, run.describe()
            assert any(isinstance(c, Abort) and c.job_id == run.job for c in commands)
    finally:
        pauses.resume_all()
        for run in runs:
            run.close()
