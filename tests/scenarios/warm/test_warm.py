"""Warm restarts (issue 18): the 2-rank charlm job under ``trainguard run --warm`` and a real
daemon, with every failure of a warm restart we know of, each ending like an uninterrupted run
(:func:`~tests.scenarios.harness.assert_exact`: bitwise-equal parameters, exact sample ledger,
decisions that replay).

The tests drive the failures themselves, by pid, once the supervisor's log says its spares are
ready (``spare ready``): a worker killed (each rank in turn), a spare killed while it waits, a
warm restore whose worker is killed before the resume (the second restore then finds no spare
and starts cold: the fallback), a spare stopped when it is needed (its rank starts cold), and
a hang whose rank the daemon replaces. The job is paced
(``--step-period``) so that it outlasts its spares' start-up on a loaded machine; the pace does
not change its numbers.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.scenarios.harness import JobRun, assert_exact, is_restore, only
from trainguard.daemon.demo._harness import JobRecord
from trainguard.schemas import Lifecycle, Manifest, Resume

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    # The restore rules are the pure machine's and the bus contract is tested on both buses;
    # the embedded bus keeps these runs short.
    pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True),
]

PERIOD = ["--step-period", "0.3"]
"""About 36 s of training for the 120 steps: room for two kills with spares ready for each."""

WARM = ["--warm"]


def log_entries(run: JobRun) -> list[dict[str, Any]]:
    """The supervisor's JSON log entries so far."""
    entries = []
    for line in (run.workdir / "supervisor.log").read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a worker's own line, or one being written
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def wait_log(
    run: JobRun, what: str, match: Callable[[dict[str, Any]], bool], timeout_s: float = 120.0
) -> dict[str, Any]:
    """The first supervisor log entry ``match`` holds for, waiting for it.

    Raises:
        AssertionError: none within ``timeout_s`` seconds, or the supervisor exited first.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        found = [e for e in log_entries(run) if match(e)]
        if found:
            return found[0]
        ended = run.supervisor is not None and run.supervisor.poll() is not None
        assert not ended, f"the job ended before {what} {run.describe()}"
        assert time.monotonic() < deadline, f"no {what} {run.describe()}"
        time.sleep(0.1)


def ready_spares(run: JobRun) -> dict[int, int]:
    """Wait until every rank has a spare that logged ``spare ready`` and was neither handed
    off nor seen exiting since; ``{rank: pid}``."""
    deadline = time.monotonic() + 120
    while True:
        entries = log_entries(run)
        ready = {e["ranks"][0]: e["pid"] for e in entries if e.get("event") == "spare ready"}
        used = {
            e["pid"]
            for e in entries
            if e.get("event") == "spare handed off" or e.get("event", "").startswith("spare exited")
        }
        ready = {rank: pid for rank, pid in ready.items() if pid not in used}
        if len(ready) == run.shape.world_size:
            return ready
        ended = run.supervisor is not None and run.supervisor.poll() is not None
        assert not ended, f"the job ended before its spares were ready {run.describe()}"
        assert time.monotonic() < deadline, f"spares never ready {run.describe()}"
        time.sleep(0.1)


def workers(record: JobRecord, generation: int) -> dict[int, int]:
    """``{rank: pid}`` of the workers the supervisor started in ``generation``."""
    return {
        m.ranks[0]: m.pid
        for m in (e.message for e in record.events)
        if isinstance(m, Lifecycle)
        and m.rank is None
        and m.kind == "started"
        and m.generation == generation
    }


def live_worker(run: JobRun, generation: int, rank: int) -> int:
    """The pid of ``rank``'s worker in ``generation``, once the supervisor reported it."""
    started = run.wait_for(
        f"rank {rank}'s worker of generation {generation}",
        lambda m: (
            isinstance(m, Lifecycle)
            and m.rank is None
            and m.kind == "started"
            and m.generation == generation
            and m.ranks == (rank,)
        ),
    )
    pid: int = started.message.pid
    return pid


def resume_of(generation: int) -> Callable[[Any], bool]:
    """Matches the resume command of ``generation``."""
    return lambda m: isinstance(m, Resume) and m.generation == generation


def committed(run: JobRun) -> None:
    """Wait for the job's first committed snapshot (a restore then goes back to it, not to the
    start)."""
    run.wait_for("a committed snapshot", lambda m: isinstance(m, Manifest))


def ready_to_kill_rank_0(run: JobRun, context: str) -> tuple[int, dict[int, int]]:
    """Start the daemon and the warm job, wait for generation 0's rank 0, both spares ready and
    a commit; return rank 0's pid and the spares' pids by rank."""
    run.context = context
    run.start_daemon()
    run.start_job(extra=PERIOD, run_args=WARM)
    victim = live_worker(run, 0, 0)
    spares = ready_spares(run)
    committed(run)
    return victim, spares


def gone(pid: int) -> bool:
    """Whether no process ``pid`` exists (reaped: its supervisor waited for it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_killed_rank_of_either_rank_restarts_from_the_spares_and_ends_exact(
    job_run: JobRun,
) -> None:
    """Rank 1, then rank 0 SIGKILLed; each restore hands every rank its spare (the survivor
    too), the spares are started again after the resume, and the job ends exact."""
    job_run.context = "warm: kill rank 1, then rank 0"
    job_run.start_daemon()
    job_run.start_job(extra=PERIOD, run_args=WARM)
    for generation, rank in ((1, 1), (2, 0)):
        victim = live_worker(job_run, generation - 1, rank)
        spares = ready_spares(job_run)
        if generation == 1:
            committed(job_run)
        os.kill(victim, signal.SIGKILL)
        job_run.wait_for(f"the resume of {generation}", resume_of(generation))
        record = job_run.record()
        assert workers(record, generation) == spares, (
            f"generation {generation} did not start from the spares {spares}: "
            f"{workers(record, generation)} {job_run.describe()}"
        )
    code = job_run.finish()
    record = job_run.record()
    kills = record.kills()
    assert [(k.generation, k.ranks) for k in kills] == [(0, (1,)), (1, (0,))], job_run.describe()
    assert [r.generation for r in record.restores()] == [1, 2], job_run.describe()
    assert_exact(job_run, code, record)


def test_a_kill_during_the_warm_restore_falls_back_to_a_cold_restart(job_run: JobRun) -> None:
    """Rank 0 is killed; rank 1's spare, handed off for generation 1, is SIGKILLed as soon as
    the supervisor logs its hand-off (mid-restore: a warm restore takes about half a second).
    The daemon's next restore finds no spare ready (they are started again only after a
    resume, and take seconds to get ready) and the supervisor starts both ranks cold: the job
    ends exact."""
    victim, spares = ready_to_kill_rank_0(job_run, "warm: kill during the warm restore")
    os.kill(victim, signal.SIGKILL)
    wait_log(
        job_run,
        "hand-off of rank 1's spare",
        lambda e: e.get("event") == "spare handed off" and e.get("pid") == spares[1],
    )
    os.kill(spares[1], signal.SIGKILL)
    job_run.wait_for("the resume of 2", resume_of(2))
    code = job_run.finish()
    record = job_run.record()
    assert workers(record, 1) == spares, job_run.describe()
    cold = workers(record, 2)
    assert set(cold.values()).isdisjoint(spares.values()), job_run.describe()
    handed = [e["pid"] for e in log_entries(job_run) if e.get("event") == "spare handed off"]
    assert sorted(handed) == sorted(spares.values()), (
        f"hand-offs {handed}: generation 2 was not cold {job_run.describe()}"
    )
    assert [(k.generation, k.ranks) for k in record.kills()] == [(0, (0,)), (1, (1,))]
    assert [r.generation for r in record.restores()] == [1, 2], job_run.describe()
    assert_exact(job_run, code, record)


def test_a_stopped_spare_is_skipped_and_its_rank_starts_cold(job_run: JobRun) -> None:
    """Rank 1's spare is stopped (SIGSTOP) before rank 0 is killed: it does not answer the
    supervisor's ping before the hand-off, so it is killed and rank 1 starts cold, while rank
    0 starts from its spare; one restore, which does not wait ``restore_timeout_s`` for the
    stopped spare (the generation's rank 1 is a fresh process, acknowledged), and the job ends
    exact."""
    victim, spares = ready_to_kill_rank_0(job_run, "warm: a stopped spare at the restore")
    os.kill(spares[1], signal.SIGSTOP)
    os.kill(victim, signal.SIGKILL)
    job_run.wait_for("the resume of 1", resume_of(1))
    code = job_run.finish()
    record = job_run.record()
    started = workers(record, 1)
    assert started[0] == spares[0], job_run.describe()
    assert started[1] not in spares.values(), job_run.describe()
    skipped = [
        e["pid"] for e in log_entries(job_run) if e.get("event", "").startswith("spare could not")
    ]
    assert skipped == [spares[1]], job_run.describe()
    assert [r.generation for r in record.restores()] == [1], job_run.describe()
    assert_exact(job_run, code, record)


def test_a_killed_spare_is_replaced_and_never_reported(job_run: JobRun) -> None:
    """A spare SIGKILLed while it waits is no failure of the job (nothing on the bus), and the
    supervisor starts another; the next kill of a rank restarts from the new one."""
    job_run.context = "warm: kill a spare, then rank 1"
    job_run.start_daemon()
    job_run.start_job(extra=PERIOD, run_args=WARM)
    victim = live_worker(job_run, 0, 1)
    first = ready_spares(job_run)
    os.kill(first[0], signal.SIGKILL)
    wait_log(
        job_run,
        "the killed spare seen",
        lambda e: e.get("event", "").startswith("spare exited") and e.get("pid") == first[0],
    )
    spares = ready_spares(job_run)
    assert spares[0] != first[0], job_run.describe()
    assert spares[1] == first[1], job_run.describe()
    committed(job_run)
    os.kill(victim, signal.SIGKILL)
    job_run.wait_for("the resume of 1", resume_of(1))
    code = job_run.finish()
    record = job_run.record()
    reported = {m.pid for m in (e.message for e in record.events) if isinstance(m, Lifecycle)}
    assert first[0] not in reported, f"the spare was reported {job_run.describe()}"
    kill = only(record.kills(), "worker killed", job_run)
    assert (kill.generation, kill.ranks) == (0, (1,)), job_run.describe()
    assert workers(record, 1) == spares, job_run.describe()
    assert_exact(job_run, code, record)


def test_a_hung_rank_is_replaced_by_its_spare_not_reused(job_run: JobRun) -> None:
    """Rank 1's training thread blocks for ever after step 40 while its heartbeats go on; the
    daemon's progress timeout restores the job, the supervisor stops the hung process and
    hands both ranks their spares; the job ends exact."""
    faults = "hang@step=40,rank=1"
    job_run.context = f"warm: {faults}"
    job_run.start_daemon()
    job_run.start_job(faults, extra=PERIOD, run_args=WARM)
    hung = live_worker(job_run, 0, 1)
    spares = ready_spares(job_run)
    restore = job_run.wait_for("the restore", is_restore(1)).message
    assert restore.mode == "restart", job_run.describe()
    job_run.wait_for("the resume of 1", resume_of(1))
    assert gone(hung), f"the hung worker {hung} still runs {job_run.describe()}"
    code = job_run.finish()
    record = job_run.record()
    assert workers(record, 1) == spares, job_run.describe()
    assert hung not in workers(record, 1).values(), job_run.describe()
    assert not record.kills(), job_run.describe()
    assert_exact(job_run, code, record)
