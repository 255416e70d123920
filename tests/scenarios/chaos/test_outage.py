"""Broker outages under running jobs (issue 13, items 1, 2 and 4): an outage is not a failure.

One daemon and three 2-rank charlm jobs on the chaos tests' own Kafka broker. The broker is
first paused (SIGSTOP) for 60 s, then, once everything has recovered, stopped with
``kafka-dev stop`` and started again 20 s later (same port, same data). Jobs A and B train
through both outages undisturbed: no restore, final parameters bitwise equal to an
uninterrupted run's, an exact sample ledger. In each outage, job C's rank 1 is SIGKILLed after
C wrote two checkpoints the daemon could not hear of yet: exactly one restore per outage, to
the newest snapshot committed when the daemon decided, which is one of those made during the
outage. ``/healthz`` answers 503 during each outage and 200 again after it. Every job's replay
reproduces its recorded decisions.

Both outages share one run (one broker start, one set of jobs, the reference run beside them)
to keep the module within about three and a half minutes on 2 cores.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.scenarios.chaos.chaos import (
    DEADLINE_S,
    SMALL_MODEL,
    ChaosBroker,
    HealthPoller,
    broker_restored,
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
from tests.support.buses import BusFactory
from trainguard.daemon.demo._harness import reference_run, stop_process
from trainguard.schemas import Manifest, Restore

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(600)]

#: 600 steps of at least 0.2 s (``--step-sleep``) with a checkpoint every 20: at least 120 s of
#: training, which outlasts startup, both outages and the recovery between them, and about 4 s
#: between checkpoints, so that several fall inside each outage. The model is the chaos tests'
#: small one (:data:`SMALL_MODEL`): its size is no part of an outage, and the default's steps
#: cost the suite about 50 s of CPU here.
SHAPE = Shape(steps=600, checkpoint_every=20, seed=13)
STEP_SLEEP_S = 0.2
PAUSE_S = 60.0
DOWN_S = 20.0
#: Seconds the daemon may take to say it cannot reach the bus (its probe: about 2-3 s).
NOTICE_S = 10.0
JOBS = ("chaos-a", "chaos-b", "chaos-c")


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
    or later when C was slow: at least ``NOTICE_S / 2`` after the kill and 2 s past
    ``NOTICE_S``; check that ``/healthz`` said 503 from ``NOTICE_S`` after the start to the
    end."""
    before = set(checkpoints_on_disk(c.out, c.job, generation, WORLD_SIZE))
    began = time.monotonic()
    begin()

    def made() -> list[int]:
        return sorted(set(checkpoints_on_disk(c.out, c.job, generation, WORLD_SIZE)) - before)

    wait_until(f"{c.job} writes two checkpoints during the {what}", lambda: len(made()) >= 2)
    made_before_kill = made()
    killed = time.monotonic()
    kill_worker(c.job, 1, generation)
    # The outage's length is the scenario itself; on a loaded machine C may take most of it to
    # write its two checkpoints, and then the outage lasts longer, so that the daemon cannot
    # hear of the kill before the bus is back and /healthz is polled for a while after NOTICE_S.
    end_at = max(began + duration_s, killed + NOTICE_S / 2, began + NOTICE_S + 2)
    time.sleep(end_at - time.monotonic())
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


def test_broker_outages_restore_only_the_rank_killed_during_them(
    chaos_broker: ChaosBroker, chaos_bus: BusFactory, tmp_path: Path
) -> None:
    for job in JOBS:
        (tmp_path / job).mkdir()
    runs = [
        JobRun(chaos_bus, tmp_path / job, SHAPE, tmp_path, context="broker outages", job=job)
        for job in JOBS
    ]
    a, b, c = runs
    # The uninterrupted run (``--step-sleep`` changes no number) runs beside the jobs, which
    # mostly sleep: it is needed only at the end, and would otherwise add half a minute.
    pool = ThreadPoolExecutor(1)
    reference = pool.submit(
        reference_run,
        REPO,
        tmp_path / "reference",
        steps=SHAPE.steps,
        checkpoint_every=SHAPE.checkpoint_every,
        seed=SHAPE.seed,
        world_size=WORLD_SIZE,
        extra=SMALL_MODEL,
    )
    try:
        with broker_restored(chaos_broker):
            a.start_daemon()
            url = f"{a.metrics_url()}/healthz"
            for run in runs:
                run.start_job(extra=[*SMALL_MODEL, "--step-sleep", str(STEP_SLEEP_S)])
            for run in runs:  # every job trains, and the daemon commits its snapshots
                run.wait_for("a first commit", lambda m: isinstance(m, Manifest))
            with HealthPoller(url) as health:
                wait_until("/healthz ready", lambda: health.latest() == 200)
                paused = outage(
                    "broker SIGSTOP",
                    chaos_broker.pause,
                    chaos_broker.resume,
                    PAUSE_S,
                    c,
                    0,
                    health,
                )
                wait_on_bus(c, "C's restore after the SIGSTOP", is_restore(1))
                wait_until(
                    "C trains again in generation 1",
                    lambda: bool(checkpoints_on_disk(c.out, c.job, 1, WORLD_SIZE)),
                )
                stopped = outage(
                    "broker stop",
                    chaos_broker.stop,
                    chaos_broker.start,
                    DOWN_S,
                    c,
                    1,
                    health,
                )
                for run in (a, b):
                    assert run.supervisor is not None
                    assert run.supervisor.poll() is None, (
                        f"the job ended before the outages did: size it {run.describe()}"
                    )
            codes = []
            for run in runs:
                assert run.supervisor is not None
                codes.append(run.supervisor.wait(DEADLINE_S * 2))
            for daemon in a.daemons:
                stop_process(daemon)
        for run in runs:
            run.reference = reference.result(timeout=DEADLINE_S)
        for run, code in zip((a, b), codes[:2], strict=True):
            record = run.record()
            assert record.restores() == [], f"restored {record.restores()} {run.describe()}"
            assert_exact(run, code, record)
        record = c.record()
        restores = record.restores()
        assert [r.generation for r in restores] == [1, 2], (
            f"expected one restore per outage, got {restores} {c.describe()}"
        )
        on_bus = [m.message.generation for m in record.commands if isinstance(m.message, Restore)]
        assert sorted(on_bus) == [1, 2], f"restores on the commands topic: {on_bus}"
        assert_targets_newest_good(c, record)
        for restore, seen in zip(restores, (paused, stopped), strict=True):
            target = restore.target
            assert target is not None, c.describe()
            # The newest shard on disk may have died with its rank before its event left;
            # the one before it was made during the outage too, and was sent.
            assert target.generation == seen.generation, f"{target} {c.describe()}"
            assert target.step >= seen.made[-2], (
                f"restore of generation {restore.generation} targets step {target.step}, older "
                f"than the checkpoints {seen.made} written during the outage {c.describe()}"
            )
        assert_exact(c, codes[2], record)
    finally:
        for run in runs:
            run.close()
        pool.shutdown()
