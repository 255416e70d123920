"""Failed transactions of owned partitions, counted by :class:`CommitFailures` on a clock of
the test's: ``/healthz`` is not ready once they have gone on for longer than the bound, and is
again once one commit succeeds. The daemon's own failed commits are tested in
``tests/service/daemon/test_commit_health.py``."""

from __future__ import annotations

from trainguard.daemon.service._partitions import CommitFailures


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_commits_failing_longer_than_the_bound_are_not_ready_until_one_succeeds() -> None:
    clock = _Clock()
    failures = CommitFailures(clock)
    assert failures.not_ready_reason(10.0) is None
    assert failures.since_commit_s() == 0.0

    failures.failed(2, "failed", "send to 'audit' failed: boom", "t.daemon-2", last_ok=95.0)
    clock.now = 108.0
    failures.failed(2, "in_doubt", "commit not confirmed", "t.daemon-2", last_ok=107.0)
    clock.now = 110.0
    assert failures.not_ready_reason(10.0) is None, "10 s since the first failure: not over"
    assert failures.since_commit_s() == 15.0, "from the commit before the first failure"
    failures.failed(0, "failed", "other", "t.daemon-0", last_ok=110.0)
    clock.now = 110.5
    assert failures.not_ready_reason(10.0) == (
        "commits failing for 10 s on partition(s) 2 (writer t.daemon-2: in_doubt): "
        "commit not confirmed"
    )
    clock.now = 121.0
    reason = failures.not_ready_reason(10.0)
    assert reason is not None
    assert "on partition(s) 0, 2 " in reason

    failures.succeeded(2)
    reason = failures.not_ready_reason(10.0)
    assert reason is not None
    assert "on partition(s) 0 (writer t.daemon-0: failed)" in reason
    failures.keep([1, 2])  # partition 0 is no longer this instance's
    assert failures.not_ready_reason(10.0) is None
    assert failures.since_commit_s() == 0.0
