"""``trainguard status``'s rows, from job states folded by the pure core: an ended job counts no
rank alive. The command on a real bus is tested in ``tests/service/daemon/test_status.py``."""

from __future__ import annotations

from tests.support.machine_scenarios import Sim, request, run, running_job
from trainguard.daemon.forensics._status import JobStatus, job_summary


def test_an_ended_job_counts_no_rank_alive() -> None:
    """A stopped job's workers exit after the stop, and those exits are late inputs the daemon
    ignores: its ranks stay "alive" in the state, so the row says nothing instead of 2/2
    (found by issue 13's tester); a live job's row counts its ranks."""
    sim = Sim()
    live, _ = running_job(sim, 12)
    stopped, _ = run([request("stop", live.clock_ns + 1, 0)], live)
    assert [r.status for r in stopped.ranks.values()] == ["alive"] * 4
    assert job_summary(JobStatus(stopped), stopped.clock_ns)["ranks_alive"] is None
    assert job_summary(JobStatus(live), live.clock_ns)["ranks_alive"] == 4
