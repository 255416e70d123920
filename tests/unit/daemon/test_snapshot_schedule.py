"""When the daemon starts a round of state snapshots: due by time or by records folded, and
only in a pause of its input unless a whole interval late (the seal's worker thread takes
the interpreter's lock from the fold: begun inside a checkpoint's burst of shard records, it
made the burst's last record wait up to twice as long)."""

from __future__ import annotations

import pytest

from trainguard.daemon.service._daemon import snapshot_round_starts


@pytest.mark.parametrize(
    ("elapsed_s", "folded", "idle", "starts"),
    [
        (59.9, 0, True, False),  # not due
        (60.0, 0, True, True),  # due by time, in a pause
        (60.0, 0, False, False),  # due, but records wait: after the burst
        (119.9, 0, False, False),
        (120.0, 0, False, True),  # a whole interval late: whatever the load
        (1.0, 1_000, True, True),  # due by records, in a pause
        (1.0, 1_999, False, False),
        (1.0, 2_000, False, True),  # a whole interval of records late
    ],
)
def test_a_due_round_waits_for_a_pause_at_most_one_interval(
    elapsed_s: float, folded: int, idle: bool, starts: bool
) -> None:
    assert (
        snapshot_round_starts(elapsed_s, folded, interval_s=60.0, interval_records=1_000, idle=idle)
        is starts
    )


def test_without_a_record_bound_only_time_makes_a_round_due() -> None:
    assert not snapshot_round_starts(1.0, 10**9, interval_s=60.0, interval_records=0, idle=True)
    assert snapshot_round_starts(120.0, 0, interval_s=60.0, interval_records=0, idle=False)
