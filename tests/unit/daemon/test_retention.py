"""The retention rule's verdicts on a catalog of two jobs, one started from the other's
snapshot: what the policy keeps, why, and the parents a running job may still restore."""

from __future__ import annotations

import pytest

from tests.support.manifests import manifest
from trainguard.daemon.catalog import Catalog, RetentionPolicy, StoredStep, plan_retention
from trainguard.daemon.forensics import AuditDigest

ENDED = AuditDigest(ended=("finished", 0))
PRE = [manifest("pre", step, at=step) for step in (10, 20, 30, 40)]
TUNE = [manifest("tune", 50, parent="pre/g0/s20", at=50)]


def kept(catalog: Catalog, audits: dict[str, AuditDigest], **policy: object) -> dict[str, str]:
    plan = plan_retention(catalog, audits, RetentionPolicy(**policy))  # type: ignore[arg-type]
    return {v.name: "; ".join(v.reasons) for v in plan.verdicts if v.keep}


def test_an_ended_job_keeps_its_newest_and_the_steps_promised_forever() -> None:
    catalog = Catalog.of(PRE)
    assert kept(catalog, {"pre": ENDED}, keep_last=1, keep_every_steps=20) == {
        "pre/g0/s20": "a multiple of 20 steps",
        "pre/g0/s40": "one of the job's newest 1; a multiple of 20 steps",
    }


def test_a_running_job_keeps_the_daemon_s_restore_targets_whatever_keep_last_says() -> None:
    catalog = Catalog.of(PRE)
    assert list(kept(catalog, {}, keep_last=1, restore_targets=3)) == [
        "pre/g0/s20",
        "pre/g0/s30",
        "pre/g0/s40",
    ]


def test_a_parent_stays_while_its_child_runs_and_until_told_otherwise() -> None:
    catalog = Catalog.of([*PRE, *TUNE])
    running = kept(catalog, {"pre": ENDED}, keep_last=1, delete_parents=True)
    assert running["pre/g0/s20"] == "the initial state of running job tune"
    done = {"pre": ENDED, "tune": ENDED}
    assert kept(catalog, done, keep_last=1)["pre/g0/s20"] == "the parent of job tune"
    assert "pre/g0/s20" not in kept(catalog, done, keep_last=1, delete_parents=True)


def test_a_deleted_snapshot_says_why_and_leftovers_of_a_running_job_stay() -> None:
    catalog = Catalog.of(PRE)
    stored = [StoredStep("pre", 0, 50, "/ckpt/pre/g000000/s0000000050")]
    plan = plan_retention(catalog, {}, RetentionPolicy(keep_last=1, restore_targets=1), stored)
    reasons = {v.name: (v.keep, v.reasons) for v in plan.verdicts}
    assert reasons["pre/g0/s10"] == (False, ("older than the job's newest 1",))
    assert reasons["leftover /ckpt/pre/g000000/s0000000050"] == (
        True,
        ("uncommitted, and may still commit (a checkpoint in flight)",),
    )


@pytest.mark.parametrize("field", ["keep_last", "keep_every_steps", "restore_targets"])
def test_a_count_below_one_is_refused(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be >= 1"):
        RetentionPolicy(**{"keep_last": 1, field: 0})  # type: ignore[arg-type]


def test_a_stopped_job_keeps_its_restore_targets_and_a_lost_snapshot_counts_for_nothing() -> None:
    """A stopped job may be continued from its newest snapshot not known bad: it keeps what a
    running job keeps. A kept snapshot whose files are lost is shown so, and the newest K are
    counted among whole snapshots."""
    catalog = Catalog.of(PRE)
    stopped = {"pre": AuditDigest(ended=("stopped", 0))}
    assert len(kept(catalog, stopped, keep_last=1, restore_targets=3)) == 3
    stored = [StoredStep("pre", 0, s, f"/c/pre/g000000/s{s:010d}") for s in (10, 20, 30, 40)]
    plan = plan_retention(
        catalog, {"pre": ENDED}, RetentionPolicy(keep_last=1), stored, listed=["pre"],
        incomplete=["pre/g0/s40"],
    )  # fmt: skip
    verdicts = {v.name: v for v in plan.verdicts}
    assert (verdicts["pre/g0/s40"].keep, verdicts["pre/g0/s40"].complete) == (True, False)
    assert verdicts["pre/g0/s30"].keep, "the newest whole snapshot, besides the damaged one"
    assert [v.name for v in plan.deleted] == ["pre/g0/s10", "pre/g0/s20"]
