"""The daemon SIGKILLed while a real charlm job runs, and started again: it loses no job and
decides no incident twice (architecture invariant 2), on the embedded bus and on Kafka.

A daemon rebuilds a job by folding its events again from the start of the log; whatever it
decided before the group's committed position it does not act on again, and a command it
re-derives after that position is recognised on the ``commands`` topic and not sent again. Both
paths are exercised: a daemon killed right after it issued a restore (the restarted one must
not issue a second one, and must take the job from restoring to resumed), and a daemon that is
dead when the rank dies (the restarted one must decide the incident, once, late).
"""

from __future__ import annotations

import pytest

from tests.scenarios.harness import (
    JobRun,
    assert_exact,
    assert_targets_newest_good,
    is_restore,
    only,
)
from trainguard.schemas import Lifecycle, Manifest, Restore, Resume

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _daemon_id_pid(daemon_id: str) -> int:
    """The pid in a default daemon id (``<host>-<pid>``)."""
    return int(daemon_id.rsplit("-", 1)[1])


def test_a_daemon_killed_right_after_a_restore_does_not_restore_again(job_run: JobRun) -> None:
    job_run.context = "kill@step=50,rank=1; daemon SIGKILLed once the restore is on the bus"
    first = job_run.start_daemon()
    job_run.start_job("kill@step=50,rank=1")
    job_run.wait_for("the restore of generation 1", is_restore(1))
    job_run.kill_daemon()
    second = job_run.start_daemon()
    code = job_run.finish()
    record = job_run.record()

    # Decided once (a re-derived decision is audited again, by the second daemon when the first
    # died before its audit entry) and sent once: the restore on the bus is the first daemon's.
    restore = only(record.restores(), "restore", job_run)
    assert (restore.incident_id, restore.attempt) == ("charlm-scenario/i1", 1), job_run.describe()
    sent = only([c for c in record.commands if isinstance(c.message, Restore)], "restore", job_run)
    assert _daemon_id_pid(sent.message.daemon_id) == first.pid, job_run.describe()
    resume = only([c for c in record.commands if isinstance(c.message, Resume)], "resume", job_run)
    # The job was still restoring when the first daemon died: the second one resumed it.
    assert _daemon_id_pid(resume.message.daemon_id) == second.pid, job_run.describe()
    assert_targets_newest_good(job_run, record)
    assert_exact(job_run, code, record)


def test_a_daemon_dead_when_the_rank_dies_decides_the_incident_once_when_back(
    job_run: JobRun,
) -> None:
    job_run.context = "kill@step=80,rank=1; daemon SIGKILLed after the first commit"
    job_run.start_daemon()
    job_run.start_job("kill@step=80,rank=1")
    job_run.wait_for("the first commit", lambda m: isinstance(m, Manifest))
    killed_at = job_run.kill_daemon()
    death = job_run.wait_for(
        "rank 1's death",
        lambda m: isinstance(m, Lifecycle) and m.kind == "exited" and m.signal is not None,
    )
    assert death.at_ms >= killed_at, f"rank 1 died before the daemon {job_run.describe()}"
    second = job_run.start_daemon()
    code = job_run.finish()
    record = job_run.record()

    restore = only(
        [c for c in record.commands if isinstance(c.message, Restore)], "restore", job_run
    )
    assert (restore.message.incident_id, restore.message.attempt) == ("charlm-scenario/i1", 1), (
        job_run.describe()
    )
    assert _daemon_id_pid(restore.message.daemon_id) == second.pid, job_run.describe()
    opened = [d for d in record.decisions() if d["decision"] == "incident_opened"]
    assert [d["incident_id"] for d in opened] == ["charlm-scenario/i1"], job_run.describe()
    assert_targets_newest_good(job_run, record)
    assert_exact(job_run, code, record)
