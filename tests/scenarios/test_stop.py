"""Stopping a real charlm job on purpose and continuing it, a supervisor that restarts while
its job runs, and a supervisor without a daemon (issue 12, "Also"): the real ``trainguard
daemon``, ``trainguard run`` and ``trainguard stop`` processes on one bus."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.scenarios.harness import JOB, JobRun, assert_exact, is_restore, restore_decisions
from trainguard.agent.supervisor._supervisor import EXIT_STOPPED
from trainguard.daemon.demo._harness import JobRecord, stop_process
from trainguard.schemas import JobRequest, Lifecycle, Manifest, Resume

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

CLI = (sys.executable, "-m", "trainguard.daemon.cli")

STEP_SLEEP = ("--step-sleep", "0.1")
"""Paces the 120-step job over about 15 s, so that it is stopped while it trains (a run that
nothing waits for goes at full speed)."""


def trainguard(run: JobRun, *args: str, timeout_s: float = 120.0) -> tuple[int, str]:
    """Run ``trainguard ARGS --bus URL --topic-prefix P``; its exit status and output."""
    done = subprocess.run(
        [*CLI, *args, "--bus", run.bus.url, "--topic-prefix", run.bus.prefix],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def committed(step: int) -> Any:
    return lambda m: isinstance(m, Manifest) and m.step == step


def decided(record: JobRecord, kind: str) -> list[dict[str, Any]]:
    return [d for d in record.decisions() if d["decision"] == kind]


def assert_stopped_without_incident(run: JobRun, record: JobRecord, reason: str) -> None:
    """The job ended ``stopped``: an abort saying so, no incident, no restore."""
    assert decided(record, "incident_opened") == [], run.describe()
    assert restore_decisions(record) == [], run.describe()
    [stopped] = [d for d in decided(record, "transition") if d["new"] == "stopped"]
    assert reason in stopped["reason"], run.describe()
    [abort] = [d["command"] for d in decided(record, "issue")]
    assert (abort["schema"], abort["outcome"]) == ("abort/1.2", "stopped"), run.describe()


def continue_exactly(run: JobRun) -> None:
    """Continue the stopped job (``--continue``): one restore, of the newest snapshot committed
    before the stop, and a final result equal to the uninterrupted run's."""
    before = run.record()
    newest = max(m.message.step for m in before.manifests if m.message.generation == 0)
    run.start_job(run_args=["--continue"])  # at full speed: nothing waits for it
    code = run.finish()
    record = run.record()
    [(restore, _)] = restore_decisions(record)
    assert restore["target"]["snapshot_id"] == f"{JOB}/g0/s{newest}", run.describe()
    assert restore["generation"] == 1
    [opened] = decided(record, "incident_opened")
    assert opened["cause"] == "continued", run.describe()
    assert_exact(run, code, record)


# The request's way through either bus is tested on both by test_stop_service.py; the real job
# on the embedded bus.
@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
def test_trainguard_stop_ends_the_job_stopped_and_continue_resumes_it_exactly(
    job_run: JobRun,
) -> None:
    job_run.start_daemon()
    job_run.start_job(extra=STEP_SLEEP)
    job_run.wait_for("the commit of step 40", committed(40))
    code, output = trainguard(job_run, "stop", JOB, "--reason", "node maintenance")
    assert code == 0, output
    assert "stopped in generation 0" in output
    supervisor = job_run.supervisor
    assert supervisor is not None
    assert supervisor.wait(60) == EXIT_STOPPED, job_run.describe()
    record = job_run.record()  # replays to the same decisions
    assert_stopped_without_incident(job_run, record, "node maintenance")
    # status and the report say so; stopping again is no news.
    code, output = trainguard(job_run, "status", JOB, "--format", "json")
    assert code == 0, output
    assert json.loads(output)["phase"] == "stopped"
    code, output = trainguard(job_run, "report", JOB)
    assert code == 0, output
    assert "stopped" in output, output
    code, output = trainguard(job_run, "replay", JOB)
    assert code == 0, output
    assert "stop the job: node maintenance" in output, output
    code, output = trainguard(job_run, "stop", JOB)
    assert (code, "is stopped already" in output) == (0, True), output
    continue_exactly(job_run)


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
def test_sigterm_of_the_supervisor_stops_the_job_and_a_restart_needs_continue(
    job_run: JobRun,
) -> None:
    job_run.start_daemon()
    job_run.start_job(extra=STEP_SLEEP)
    job_run.wait_for("the commit of step 40", committed(40))
    supervisor = job_run.supervisor
    assert supervisor is not None
    assert stop_process(supervisor, signal.SIGTERM, timeout_s=60) == EXIT_STOPPED
    record = job_run.record()
    assert_stopped_without_incident(job_run, record, "was signalled")
    # The request came before the workers' exits (the daemon folded the stop first).
    kinds = [
        "request" if isinstance(s.message, JobRequest) else "exit"
        for s in record.events
        if isinstance(s.message, JobRequest)
        or (isinstance(s.message, Lifecycle) and s.message.kind == "exited")
    ]
    assert kinds[0] == "request", kinds
    assert kinds.count("request") == 1, kinds
    # Started again as before, the stopped job is refused, and nothing is started.
    job_run.start_job(extra=STEP_SLEEP)
    assert job_run.supervisor is not None
    assert job_run.supervisor.wait(60) == 2
    log = (job_run.workdir / "supervisor.log").read_text()
    assert "was stopped in generation 0" in log
    assert "--continue on every node" in log
    assert len(job_run.record().events) == len(record.events)  # nothing sent
    continue_exactly(job_run)


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
@pytest.mark.parametrize("after", ["resume", "commit"])
def test_a_restarted_supervisor_rejoins_the_running_generation(job_run: JobRun, after: str) -> None:
    """The node's supervisor is killed (its workers die with it) and restarted before the
    daemon noticed: it reports its ranks gone in the job's generation, the daemon restores at
    once, and it starts its workers in that restore: never in the running generation, never
    from step 0. ``resume``: the job runs in generation 1 after a restore; ``commit``: in
    generation 0, with a committed snapshot and no command yet."""
    job_run.start_daemon()
    faults = "kill@step=30,rank=1" if after == "resume" else ""
    job_run.context = f"{after} {faults}"
    job_run.start_job(faults, extra=STEP_SLEEP)
    if after == "resume":
        job_run.wait_for("the resume", lambda m: isinstance(m, Resume))
        job_run.wait_for(
            "a commit in generation 1", lambda m: isinstance(m, Manifest) and m.generation == 1
        )
    else:
        job_run.wait_for("the commit of step 40", committed(40))
    generation = 1 if after == "resume" else 0
    supervisor = job_run.supervisor
    assert supervisor is not None
    stop_process(supervisor, signal.SIGKILL)
    job_run.start_job(faults)  # at full speed: nothing waits for it
    job_run.wait_for("the rejoin restore", is_restore(generation + 1), timeout_s=120)
    code = job_run.finish()
    record = job_run.record()
    new_pid = job_run.supervisor.pid if job_run.supervisor else None
    [gone] = [
        s.message
        for s in record.events
        if isinstance(s.message, Lifecycle)
        and s.message.kind == "exited"
        and s.message.pid == new_pid
    ]
    assert (gone.generation, gone.ranks, gone.signal) == (generation, (0, 1), signal.SIGKILL)
    started = [
        s.message.generation
        for s in record.events
        if isinstance(s.message, Lifecycle)
        and s.message.kind == "started"
        and s.message.rank is None
    ]
    # Two workers per generation, none started again in the generation that was running.
    assert started.count(generation) == 2, (started, job_run.describe())
    assert_exact(job_run, code, record)


@pytest.mark.parametrize("bus_factory", ["sqlite"], indirect=True)
def test_a_supervisor_without_a_daemon_warns_until_one_reads_the_job(job_run: JobRun) -> None:
    job_run.start_job(
        extra=("--step-sleep", "0.3"), run_args=["--daemon-timeout", "1", "--warn-every", "1"]
    )
    log = job_run.workdir / "supervisor.log"
    deadline = time.monotonic() + 60
    while log.read_text().count("NO DAEMON") < 2:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    warning = next(json.loads(line) for line in log.read_text().splitlines() if "NO DAEMON" in line)
    assert warning["level"] == "warning"
    assert warning["bus"].startswith(job_run.bus.url)
    job_run.start_daemon()
    while "a daemon reads this job's events again" not in log.read_text():
        assert time.monotonic() < deadline + 60, log.read_text()[-3000:]
        time.sleep(0.1)
