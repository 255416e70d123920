"""Broker outages under running jobs (issue 13, items 1, 2 and 4): an outage is not a failure.

Two Kafka brokers of the chaos tests' own, each with one daemon and three 2-rank charlm jobs,
taken down at the same moment: the first is paused (SIGSTOP) for 60 s, the second stopped with
``kafka-dev stop`` and started again 20 s later (same port, same data). On each broker, jobs A
and B train through the outage undisturbed: no restore, final parameters bitwise equal to an
uninterrupted run's, an exact sample ledger. Job C's rank 1 is SIGKILLed after C wrote two
checkpoints the daemon could not hear of yet: exactly one restore, to the newest snapshot
committed when the daemon decided, which is one of those made during the outage. ``/healthz``
answers 503 during each outage and 200 again after it. Every job's replay reproduces its
recorded decisions.

The two outages run side by side (their brokers and jobs share nothing), and the jobs are paced
by ``--step-period`` (each step lasts at least that long, sleeping only what its compute left),
so the module lasts about as long as the SIGSTOP outage and the jobs' startup, also on a loaded
machine. The uninterrupted reference run (pacing changes no number) runs beside them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.chaos.chaos import (
    DEADLINE_S,
    SMALL_MODEL,
    ChaosBroker,
    HealthPoller,
    broker_restored,
    bus_on,
    checkpoints_on_disk,
    kill_worker,
    wait_on_bus,
    wait_until,
)
from tests.scenarios.harness import (
    REPO,
    WORLD_SIZE,
    JobRun,
    Shape,
    assert_exact,
    assert_targets_newest_good,
    is_restore,
)
from trainguard.daemon._rehearsal import reference_run, stop_process
from trainguard.schemas import Manifest, Restore

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(600)]

#: 600 steps of at least 0.2 s each (``--step-period``), a checkpoint every 20: the jobs train
#: for at least 120 s, which outlasts their startup, the 60 s pause and the recovery after it
#: (measured: about 100 s from the jobs' start, under load), and about 4 s between checkpoints,
#: so that several fall inside each outage.
SHAPE = Shape(steps=600, checkpoint_every=20, seed=13)
STEP_PERIOD_S = 0.2
#: The jobs' and the reference run's model: six paced jobs and the reference run share 2
#: cores, and a step's compute must stay well within the period.
MODEL = SMALL_MODEL
PAUSE_S = 60.0
DOWN_S = 20.0
#: Seconds the daemon may take to say it cannot reach the bus (its probe: about 2-3 s).
NOTICE_S = 10.0
#: Seconds an outage goes on at least after C's rank is killed: the supervisor's report of
#: the dead worker is made while the broker is away.
KILLED_S = NOTICE_S / 2


@dataclass(frozen=True)
class Lane:
    """One broker taken down, its daemon and its jobs.

    Attributes:
        what: the outage, for messages.
        broker: the broker.
        begin: takes it down.
        end: brings it back (returns once it serves).
        duration_s: seconds from ``begin`` to ``end``.
        runs: jobs A, B and C; A's daemon serves all three.
    """

    what: str
    broker: ChaosBroker
    begin: Callable[[], None]
    end: Callable[[], None]
    duration_s: float
    runs: list[JobRun]


@dataclass(frozen=True)
class Outage:
    """What happened to job C in one outage.

    Attributes:
        generation: C's generation when its rank was killed.
        made: steps of that generation whose shards were all on disk when the rank was killed
            and that were written during the outage, ascending.
    """

    generation: int
    made: list[int]


def outage(
    what: str,
    begin: Callable[[], None],
    end: Callable[[], None],
    duration_s: float,
    c: JobRun,
    generation: int,
    health: HealthPoller,
) -> Outage:
    """``begin()`` the outage; once C wrote two checkpoints in it, SIGKILL C's rank 1; ``end()``
    it ``duration_s`` seconds after it began (the scenario's length, not a wait for anything),
    or :data:`KILLED_S` after the kill if that is later (a loaded machine, slow to write the
    checkpoints); check that ``/healthz`` said 503 from ``NOTICE_S`` after the start to the
    end."""
    before = set(checkpoints_on_disk(c.out, c.job, generation, WORLD_SIZE))
    began = time.monotonic()
    begin()

    def made() -> list[int]:
        return sorted(set(checkpoints_on_disk(c.out, c.job, generation, WORLD_SIZE)) - before)

    wait_until(f"{c.job} writes two checkpoints during the {what}", lambda: len(made()) >= 2)
    made_before_kill = made()
    kill_worker(c.job, 1, generation)
    # The outage's length, the scenario itself: the kill well inside it.
    time.sleep(max(began + duration_s, time.monotonic() + KILLED_S) - time.monotonic())
    ending = time.monotonic()
    answers = health.between(began + NOTICE_S, ending)
    end()
    assert answers, f"/healthz was not polled during the {what} {c.describe()}"
    assert set(answers) == {503}, (
        f"/healthz answered {sorted(set(answers))} during the {what}, not only 503 {c.describe()}"
    )
    recovered = time.monotonic()
    wait_until(
        f"/healthz ready after the {what}",
        lambda: 200 in health.between(recovered, time.monotonic()),
    )
    return Outage(generation, made_before_kill)


def lane(
    what: str,
    name: str,
    broker: ChaosBroker,
    begin: Callable[[], None],
    end: Callable[[], None],
    duration_s: float,
    workdir: Path,
) -> Lane:
    """The lane of ``broker``: a fresh bus on it and jobs ``name-a``, ``name-b`` and ``name-c``
    (job ids unique on this machine: workers are found by their job's id)."""
    bus = bus_on(broker)
    runs = []
    for job in (f"{name}-a", f"{name}-b", f"{name}-c"):
        (workdir / job).mkdir()
        runs.append(JobRun(bus, workdir / job, SHAPE, workdir, context=what, job=job))
    return Lane(what, broker, begin, end, duration_s, runs)


def take_down(lane: Lane, health: HealthPoller) -> Outage:
    """The lane's outage (:func:`outage`); then C's restore is on the bus, and A and B still
    train (else they did not train through the outage)."""
    a, b, c = lane.runs
    seen = outage(lane.what, lane.begin, lane.end, lane.duration_s, c, 0, health)
    wait_on_bus(c, f"C's restore after the {lane.what}", is_restore(1))
    for run in (a, b):
        assert run.supervisor is not None
        assert run.supervisor.poll() is None, (
            f"the job ended before the {lane.what} was over: size it {run.describe()}"
        )
    return seen


def test_broker_outages_restore_only_the_rank_killed_during_them(
    chaos_brokers: list[ChaosBroker], tmp_path: Path
) -> None:
    paused, stopped = chaos_brokers
    lanes = [
        lane("broker SIGSTOP", "paused", paused, paused.pause, paused.resume, PAUSE_S, tmp_path),
        lane("broker stop", "stopped", stopped, stopped.stop, stopped.start, DOWN_S, tmp_path),
    ]
    runs = [run for each in lanes for run in each.runs]
    pool = ThreadPoolExecutor(1 + len(lanes))
    # The uninterrupted run (``--step-period`` changes no number) runs beside the jobs, which
    # mostly sleep: it is needed only at the end.
    reference = pool.submit(
        reference_run,
        REPO,
        tmp_path / "reference",
        steps=SHAPE.steps,
        checkpoint_every=SHAPE.checkpoint_every,
        seed=SHAPE.seed,
        world_size=WORLD_SIZE,
        extra=MODEL,
    )

    try:
        with ExitStack() as stack:
            for each in lanes:
                stack.enter_context(broker_restored(each.broker))
                each.runs[0].start_daemon()
            for run in runs:
                run.start_job(extra=[*MODEL, "--step-period", str(STEP_PERIOD_S)])
            for run in runs:  # every job trains, and its daemon commits its snapshots
                run.wait_for("a first commit", lambda m: isinstance(m, Manifest))
            healths = [
                stack.enter_context(HealthPoller(f"{each.runs[0].metrics_url()}/healthz"))
                for each in lanes
            ]
            for health in healths:
                wait_until("/healthz ready", lambda: health.latest() == 200)  # noqa: B023
            downs = [pool.submit(take_down, *pair) for pair in zip(lanes, healths, strict=True)]
            seen = [down.result() for down in downs]
            codes = []
            for run in runs:
                assert run.supervisor is not None
                codes.append(run.supervisor.wait(DEADLINE_S * 2))
            for each in lanes:
                for daemon in each.runs[0].daemons:
                    stop_process(daemon)
        for run in runs:
            run.reference = reference.result(timeout=DEADLINE_S)
        for each, outage_seen, (code_a, code_b, code_c) in zip(
            lanes, seen, [codes[i : i + 3] for i in range(0, len(codes), 3)], strict=True
        ):
            a, b, c = each.runs
            for run, code in zip((a, b), (code_a, code_b), strict=True):
                record = run.record()
                assert record.restores() == [], f"restored {record.restores()} {run.describe()}"
                assert_exact(run, code, record)
            record = c.record()
            restores = record.restores()
            assert [r.generation for r in restores] == [1], (
                f"expected one restore, got {restores} {c.describe()}"
            )
            on_bus = [
                m.message.generation for m in record.commands if isinstance(m.message, Restore)
            ]
            assert on_bus == [1], f"restores on the commands topic: {on_bus} {c.describe()}"
            assert_targets_newest_good(c, record)
            target = restores[0].target
            assert target is not None, c.describe()
            # The newest shard on disk may have died with its rank before its event left;
            # the one before it was made during the outage too, and was sent.
            assert target.generation == outage_seen.generation, f"{target} {c.describe()}"
            assert target.step >= outage_seen.made[-2], (
                f"the restore targets step {target.step}, older than the checkpoints "
                f"{outage_seen.made} written during the {each.what} {c.describe()}"
            )
            assert_exact(c, code_c, record)
    finally:
        for run in runs:
            run.close()
        pool.shutdown(cancel_futures=True)
