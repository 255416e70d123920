"""Retention (``trainguard.daemon.catalog.plan_retention``) against the state machine it must
never contradict: at the end of any generated job with restores (kills, acknowledgements,
corrupt snapshots, exits, finishes), every snapshot the daemon could still restore, and the
target of a restore in progress, is kept whatever the policy; every other snapshot is kept
exactly when the policy promises it; and a step folder is deleted only when nothing can commit
it any more."""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.machine_scenarios import JOB, Sim, actions, config, healthy_traces, play
from trainguard.daemon.catalog import (
    Catalog,
    RetentionPolicy,
    StoredStep,
    plan_retention,
)
from trainguard.daemon.core._decisions import Committed, Decision
from trainguard.daemon.core._inputs import Input
from trainguard.daemon.core._machine import decide
from trainguard.daemon.core._state import JobState, new_job
from trainguard.daemon.forensics import AuditDigest, read_audit
from trainguard.schemas import Manifest

CFG = config(keep_snapshots=3)

policies = st.builds(
    RetentionPolicy,
    keep_last=st.integers(1, 4),
    keep_every_steps=st.none() | st.integers(1, 12),
    restore_targets=st.just(CFG.keep_snapshots),
    delete_parents=st.booleans(),
)


def fold_each(inputs: Iterable[Input], state: JobState) -> tuple[JobState, list[Decision]]:
    decisions: list[Decision] = []
    for item in inputs:
        state, made = decide(state, item, CFG)
        decisions += made
    return state, decisions


def what_the_daemon_recorded(decisions: list[Decision]) -> tuple[Catalog, AuditDigest]:
    """The catalog and audit trail the decisions would leave on the bus (one audit entry per
    decision, in order)."""
    manifests = [d.manifest for d in decisions if isinstance(d, Committed)]
    audit = read_audit({"at_ms": i, "decisions": [d.to_dict()]} for i, d in enumerate(decisions))
    return Catalog.of(manifests, {JOB: audit}), audit


def folders(manifests: Iterable[Manifest], extra: Iterable[tuple[int, int]]) -> list[StoredStep]:
    """Step folders of the committed snapshots, plus ``extra`` ``(generation, step)``
    folders that hold no commit (partial checkpoints)."""
    committed = [(m.generation, m.step) for m in manifests]
    return [
        StoredStep(JOB, g, s, f"/ckpt/{JOB}/g{g:06d}/s{s:010d}")
        for g, s in sorted(set(committed) | set(extra))
    ]


@settings(max_examples=150, deadline=None)
@given(
    trace=healthy_traces(),
    steps=actions,
    policy=policies,
    partial=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 40)), max_size=4),
)
def test_pruning_keeps_every_possible_restore_target_and_exactly_what_it_promises(
    trace: tuple[Sim, list[Input]],
    steps: list[tuple[str, int, int]],
    policy: RetentionPolicy,
    partial: list[tuple[int, int]],
) -> None:
    sim, healthy = trace
    state, decisions = fold_each(healthy, new_job(JOB))
    state, played = play(sim, state, [("exit", 0, 1), *steps], CFG)
    decisions += [d for _, made in played for d in made]
    catalog, audit = what_the_daemon_recorded(decisions)
    stored = folders(catalog.snapshots.values(), partial)
    plan = plan_retention(catalog, {JOB: audit}, policy, stored)

    by_id = {v.manifest.snapshot_id: v for v in plan.verdicts if v.manifest is not None}
    assert list(by_id) == list(catalog.snapshots), "one verdict per committed snapshot"
    # Safety: what the daemon may restore stays, whatever the policy (a stopped or failed job
    # may be continued: only a finished one restores nothing more).
    finished = state.phase == "finished"
    if not finished:
        for manifest in state.committed:
            assert by_id[manifest.snapshot_id].keep, manifest.snapshot_id
        if state.incident is not None and state.incident.target is not None:
            assert by_id[state.incident.target.snapshot_id].keep
    # Exactness: kept exactly when promised (the newest keep_last of the timeline, multiples
    # of keep_every_steps, possible restore targets of a running job).
    timeline = [sid for sid in catalog.snapshots if sid not in catalog.abandoned]
    promised = set(timeline[-policy.keep_last :])
    if not finished:
        promised |= set(timeline[-policy.restore_targets :])
        if state.incident is not None and state.incident.target is not None:
            promised.add(state.incident.target.snapshot_id)
    if policy.keep_every_steps:
        promised |= {
            sid for sid, m in catalog.snapshots.items() if m.step % policy.keep_every_steps == 0
        }
    assert {sid for sid, v in by_id.items() if v.keep} == promised
    # Leftovers: only folders without a commit, deleted only once nothing can commit them.
    leftovers = [v for v in plan.verdicts if v.manifest is None]
    committed = {(m.generation, m.step) for m in catalog.snapshots.values()}
    assert {(v.generation, v.step) for v in leftovers} == set(partial) - committed
    for verdict in leftovers:
        assert verdict.keep == (not finished and verdict.generation >= resumed(audit))


def resumed(audit: AuditDigest) -> int:
    return max(audit.resumes, default=-1)


def test_a_leftover_that_an_unverified_manifest_names_is_kept() -> None:
    """A committed snapshot whose manifest the catalog left out (its signature did not verify
    with the keys given) is not taken for a leftover, even in a job that ended; nor is any
    folder when the manifests topic held a record that could not be read."""
    ended = AuditDigest(ended=("finished", 0))
    stored = [StoredStep(JOB, 0, 10, "/ckpt/g0/s10"), StoredStep(JOB, 0, 20, "/ckpt/g0/s20")]
    policy = RetentionPolicy(keep_last=1)
    plan = plan_retention(
        Catalog.of([]), {JOB: ended}, policy, stored, unverified=[f"{JOB}/g0/s10"]
    )
    assert [(v.step, v.keep) for v in plan.verdicts] == [(20, False)]
    unread = plan_retention(Catalog.of([]), {JOB: ended}, policy, stored, complete=False)
    assert [(v.step, v.keep) for v in unread.verdicts] == [(10, True), (20, True)]
