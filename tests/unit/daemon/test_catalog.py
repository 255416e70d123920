"""The checkpoint catalog's pure core over synthetic manifests: selection, lineage across jobs,
the snapshots restores abandoned, and the compatibility verdict with every reason."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.support.manifests import T0, S, manifest
from trainguard.daemon.catalog._catalog import Catalog, SeedRequest, compat, lookup
from trainguard.daemon.forensics._report_record import AuditDigest, Opened, Restored
from trainguard.schemas import JSONValue, Manifest, StoredFile

PRE = [manifest("pre", 20, at=1), manifest("pre", 40, at=2)]
TUNE = [
    manifest("tune", 60, parent="pre/g0/s40", at=5, data="sha256:" + "e" * 64, code="77aa00"),
    manifest("tune", 80, parent="pre/g0/s40", at=6, data="sha256:" + "e" * 64, code="77aa00"),
]
EVAL = [manifest("eval", 70, parent="tune/g0/s60", at=7)]
SIDE = [manifest("side", 50, parent="pre/g0/s40", at=8)]
CATALOG = Catalog.of([*EVAL, *TUNE, *PRE, *SIDE])  # bus order is per partition only


def ids(manifests: list[Manifest]) -> list[str]:
    return [m.snapshot_id for m in manifests]


# -- selection ----------------------------------------------------------------------------------


def test_snapshots_are_listed_in_commit_order_once_each() -> None:
    again = Catalog.of([*PRE, PRE[0], *TUNE])  # a re-derived commit publishes it twice
    assert ids(again.select()) == ["pre/g0/s20", "pre/g0/s40", "tune/g0/s60", "tune/g0/s80"]


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({"job": "tune"}, ["tune/g0/s60", "tune/g0/s80"]),
        ({"job": "tun"}, []),  # a job is named exactly
        ({"data_version": "sha256:eee"}, ["tune/g0/s60", "tune/g0/s80"]),  # a prefix will do
        ({"code_version": "3f2c"}, ["pre/g0/s20", "pre/g0/s40", "eval/g0/s70", "side/g0/s50"]),
        ({"job": "pre", "code_version": "77"}, []),
    ],
)
def test_filters_by_job_data_version_and_code_version(
    filters: dict[str, str], expected: list[str]
) -> None:
    assert ids(CATALOG.select(**filters)) == expected


# -- lineage ------------------------------------------------------------------------------------


def test_ancestry_walks_up_across_jobs_to_a_start_from_scratch() -> None:
    found = CATALOG.lineage("eval/g0/s70")
    assert [a.snapshot_id for a in found.ancestors] == ["eval/g0/s70", "tune/g0/s60", "pre/g0/s40"]
    assert all(a.manifest is not None for a in found.ancestors)
    assert found.origin == "scratch"
    assert found.descendants == ()


def test_descendants_are_the_jobs_started_from_the_snapshot_and_theirs() -> None:
    found = CATALOG.lineage("pre/g0/s40")
    assert [a.snapshot_id for a in found.ancestors] == ["pre/g0/s40"]
    tune, side = found.descendants
    assert (tune.job_id, tune.started_from, ids(list(tune.snapshots))) == (
        "tune",
        "pre/g0/s40",
        ["tune/g0/s60", "tune/g0/s80"],
    )
    (evaluation,) = tune.descendants
    assert (evaluation.job_id, evaluation.started_from) == ("eval", "tune/g0/s60")
    assert side.job_id == "side"
    assert side.descendants == ()
    assert CATALOG.lineage("pre/g0/s20").descendants == ()


def test_a_parent_missing_from_the_catalog_ends_the_walk_as_unknown() -> None:
    orphan = Catalog.of([manifest("late", 10, parent="gone/g3/s900")])
    found = orphan.lineage("late/g0/s10")
    assert [(a.snapshot_id, a.manifest is None) for a in found.ancestors] == [
        ("late/g0/s10", False),
        ("gone/g3/s900", True),
    ]
    assert found.origin == "unknown"


def test_a_loop_in_corrupt_data_ends_the_walk() -> None:
    looped = Catalog.of([manifest("x", 1, parent="y/g0/s1"), manifest("y", 1, parent="x/g0/s1")])
    found = looped.lineage("x/g0/s1")
    assert [a.snapshot_id for a in found.ancestors] == ["x/g0/s1", "y/g0/s1"]
    assert found.origin == "loop"
    (y,) = found.descendants
    assert y.descendants == ()  # x is above y already


# -- compat -------------------------------------------------------------------------------------


SNAP = manifest("pre", 40)


def judge(**request: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    verdict = compat(SNAP, SeedRequest(**request))
    assert verdict.compatible == (not verdict.refusals)
    return verdict.refusals, verdict.warnings


def test_the_same_settings_are_compatible_without_a_word() -> None:
    same = {"lr": 0.003, "model.d_model": 64}
    assert judge(
        world_size=2, data_version=SNAP.data_version, code_version="3f2c1e9a", hyperparameters=same
    ) == ((), ())
    assert judge() == ((), ())  # nothing asked, nothing to object to


def test_another_data_version_is_refused_with_the_reason_unless_allowed() -> None:
    refusals, warnings = judge(data_version="other")
    (reason,) = refusals
    assert "data version 'other' differs from the snapshot's 'sha256:ddd" in reason
    assert "--allow-data-version-change" in reason
    assert warnings == ()
    refusals, (warning,) = judge(data_version="other", allow_data_version_change=True)
    assert refusals == ()
    assert "allowed" in warning


def test_a_larger_world_size_is_refused_a_smaller_one_warned() -> None:
    (reason,), _ = judge(world_size=4)
    assert "ranks 2..3 would find no shard" in reason
    refusals, (warning,) = judge(world_size=1)
    assert refusals == ()
    assert "world-size independent" in warning
    (reason,), _ = judge(world_size=1, exact=True)
    assert "exact continuation needs the snapshot's world size 2" in reason


def test_a_dcp_snapshot_is_resharded_onto_any_world_size() -> None:
    """DCP reshards, also model-parallel state: another world size is warned, refused only
    for an exact continuation."""
    split = manifest("mp", 10, world_size=4, topology={"world_size": 4, "tp": 2, "dp": 2})
    files = (StoredFile(name=".metadata", size_bytes=1, digest="sha256:" + "a" * 64),)
    dcp = dataclasses.replace(
        split,
        shards=tuple(
            dataclasses.replace(s, uri="file:///ckpt/mp/g000000/s0000000010", files=files)
            for s in split.shards
        ),
    )
    for size in (2, 8):
        result = compat(dcp, SeedRequest(world_size=size))
        assert result.refusals == ()
        (warning,) = result.warnings
        assert f"resharded onto ranks 0..{size - 1}" in warning
        assert "world-size independent" in warning
    (reason,) = compat(dcp, SeedRequest(world_size=8, exact=True)).refusals
    assert "exact continuation needs the snapshot's world size 4" in reason
    assert compat(dcp, SeedRequest(world_size=4)).refusals == ()


def test_a_model_parallel_snapshot_cannot_shrink() -> None:
    split = manifest("mp", 10, world_size=4, topology={"world_size": 4, "tp": 2, "dp": 2})
    (reason,) = compat(split, SeedRequest(world_size=2)).refusals
    assert "model-parallel (tp=2)" in reason


def test_code_versions_and_hyperparameters_are_warned_or_refused_when_exact() -> None:
    request = {"code_version": "deadbeef", "hyperparameters": {"lr": 0.001, "wd": 0.1}}
    refusals, warnings = judge(**request)
    assert refusals == ()
    assert warnings == (
        "code version 'deadbeef' differs from the snapshot's '3f2c1e9a'",
        "hyperparameter lr: snapshot 0.003, new job 0.001",
        "hyperparameter wd is not recorded in the snapshot (it records: lr, model, seed)",
    )
    refusals, _ = judge(**request, exact=True)
    assert refusals == ("hyperparameter lr: snapshot 0.003, new job 0.001 (an exact "
                        "continuation needs the same)",)  # fmt: skip


def test_every_reason_is_given_and_shard_problems_count_as_refusals() -> None:
    verdict = compat(
        SNAP,
        SeedRequest(world_size=8, data_version="v2", code_version="x"),
        ["shard of rank 1 is missing: /ckpt/pre/g0/s40/rank1.pt"],
    )
    assert not verdict.compatible
    assert len(verdict.refusals) == 3
    assert verdict.refusals[-1].startswith("shard of rank 1 is missing")
    assert len(verdict.warnings) == 1


def test_a_snapshot_without_a_code_version_says_so() -> None:
    bare = manifest("bare", 1, code="")
    (warning,) = compat(bare, SeedRequest(code_version="abc")).warnings
    assert warning == "the snapshot records no code version to compare with 'abc'"


def test_lookup_takes_a_key_itself_before_a_dotted_path() -> None:
    values: dict[str, JSONValue] = {"a.b": 1, "a": {"b": 2, "c": {"d": 3}}}
    assert lookup(values, "a.b") == (True, 1)
    assert lookup(values, "a.c.d") == (True, 3)
    assert lookup(values, "a.x") == (False, None)
    assert lookup(values, "a.b.c") == (False, None)


# -- abandoned snapshots --------------------------------------------------------------------------


def restored(
    generation: int, target: tuple[int, int] | None, incident: str, *, at: int = 0
) -> Restored:
    """The restore starting ``generation`` of job ``run`` to ``(generation, step)``, decided
    ``at`` seconds after ``T0``."""
    return Restored(
        incident_id=incident,
        generation=generation,
        target_step=None if target is None else target[1],
        target_generation=None if target is None else target[0],
        snapshot_id=None if target is None else f"run/g{target[0]}/s{target[1]}",
        mode="restart",
        at_ms=0,
        ts=T0 + at * S,
    )


def test_a_restore_abandons_the_older_generations_snapshots_past_its_target() -> None:
    run = [
        *(manifest("run", s, at=s) for s in (100, 120)),  # a bitflip at 110 ...
        *(manifest("run", s, generation=1, at=s + 100) for s in (120, 140)),  # ... restored
        manifest("run", 160, generation=2, at=300),
    ]
    audit = AuditDigest()
    audit.restores = {
        1: restored(1, (0, 100), "run/i1"),
        2: restored(2, (1, 140), "run/i2"),
        3: restored(3, None, "run/i3"),  # back to the job's initial state
    }
    audit.opened["run/i1"] = Opened(
        incident_id="run/i1",
        cause="checksum_mismatch",
        generation=0,
        ranks=(1,),
        hosts=("h0",),
        reason="rank 1's parameters differ",
        onset_after_step=110,
        measures={},
        at_ms=0,
    )
    catalog = Catalog.of([*run, *PRE], {"run": audit})
    by = {sid: gone.generation for sid, gone in catalog.abandoned.items()}
    assert by == {
        "run/g0/s120": 1,  # the first restore that dropped it
        "run/g0/s100": 3,
        "run/g1/s120": 3,
        "run/g1/s140": 3,
        "run/g2/s160": 3,
    }
    first = catalog.abandoned["run/g0/s120"]
    assert (first.target, first.target_step, first.incident_id) == ("run/g0/s100", 100, "run/i1")
    assert first.reason == (
        "abandoned: the restore of generation 1 to run/g0/s100 (step 100), for incident run/i1 "
        "(checksum_mismatch, onset after step 110), rolled the job back past it, so its state "
        "and data cursor are off the job's timeline"
    )
    assert (
        "to the job's initial state, for incident run/i3,"
        in catalog.abandoned["run/g2/s160"].reason
    )
    verdict = compat(run[1], SeedRequest(), abandoned_by=first)
    assert verdict.refusals == (first.reason,)


def test_a_restore_voided_by_a_late_finish_does_not_abandon_the_late_cuts() -> None:
    """A job that finished while the bus was away was restored to s20 (a NaN after step 25)
    at 35 s, and again at 36 s, before its late reports arrived: they voided the restore
    (its incident closed ``finished``) and committed s40 and s50 of generation 0 after it.
    Those are the job's last snapshots, not abandoned; s30, committed before the restore past
    its target, still is (a closure alone, as a forged audit entry could write, exempts no
    snapshot committed before the restore)."""
    run = [manifest("run", s, at=s) for s in (20, 30, 40, 50)]
    audit = AuditDigest()
    audit.restores = {
        1: restored(1, (0, 20), "run/i1", at=35),
        2: restored(2, (0, 20), "run/i1", at=36),
    }
    audit.closed["run/i1"] = ("finished", 0)
    catalog = Catalog.of(run, {"run": audit})
    assert {sid: gone.generation for sid, gone in catalog.abandoned.items()} == {"run/g0/s30": 1}
    gone = catalog.abandoned.get("run/g0/s50")
    assert compat(run[-1], SeedRequest(), abandoned_by=gone).refusals == ()
    audit.closed["run/i1"] = ("resumed", 0)
    assert set(Catalog.of(run, {"run": audit}).abandoned) == {
        "run/g0/s30",
        "run/g0/s40",
        "run/g0/s50",
    }
