"""Retention: which committed snapshots and which uncommitted leftovers may be deleted
(``trainguard checkpoints prune``; ``docs/catalog.md``, "Retention").

Pure: a verdict for every committed snapshot of the catalog and every step folder found in
storage, from the catalog (manifests, with the snapshots restores abandoned), the jobs' audit
trails digested and the policy; no I/O, no clock. :func:`trainguard.daemon.catalog.prune`
lists storage and applies the deletions, for the command (which prints the verdicts) and the
daemon's own retention.

**What is never deleted** (each a reason a verdict keeps its snapshot):

* the newest ``keep_last`` snapshots of each job's timeline (the snapshots no restore
  abandoned), and every snapshot whose step is a multiple of ``keep_every_steps``;
* a *possible restore target*: while a job has not finished (a stopped or failed job may be
  continued from its newest snapshot not known bad), the newest ``restore_targets``
  snapshots of its timeline. That is the set the daemon restores from (its
  ``keep_snapshots``: :meth:`trainguard.daemon.core.JobState.committing` keeps the newest ones
  of the current timeline, a restore drops those after its target), so whatever fault comes
  next, its target is still on storage;
* the target of a restore in progress (issued, not yet resumed, its incident open);
* a snapshot another job started from (a lineage ``parent``); with ``delete_parents`` only
  when that job has finished, since a job that runs may still restore its initial state, which
  is its parent.

A job without an audit trail on the bus (expired, or another bus) counts as running, and so
does a stopped or failed one.

**Uncommitted leftovers** are step folders in storage that hold no committed snapshot: the
shards of a step some rank never finished, or that the daemon never committed. Such a folder
is deleted only when nothing can commit it any more: its generation is below one that resumed
(fencing: the daemon refuses the shards of an older generation once a process joined a newer
one, ``docs/recovery.md``), or its job has finished. Any other one may be a checkpoint in flight
and is kept.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

from trainguard.daemon.catalog._catalog import Catalog
from trainguard.daemon.core import snapshot_id
from trainguard.daemon.forensics import AuditDigest
from trainguard.schemas import Manifest

__all__ = ["RetentionPlan", "RetentionPolicy", "StoredStep", "Verdict", "plan_retention"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RetentionPolicy:
    """What to keep.

    Attributes:
        keep_last: the newest snapshots kept per job, on its timeline; >= 1.
        keep_every_steps: keep forever every snapshot whose step is a multiple of this
            (``None``: none); >= 1.
        restore_targets: how many of a running job's newest snapshots the daemon may restore
            from (the daemon's ``[machine] keep_snapshots``); >= 1.
        delete_parents: delete a snapshot another job started from, once that job finished.

    Raises:
        ValueError: a count below 1.
    """

    keep_last: int
    keep_every_steps: int | None = None
    restore_targets: int = 8
    delete_parents: bool = False

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every_steps", "restore_targets"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, not {value}")


@dataclass(frozen=True, slots=True)
class StoredStep:
    """A step folder found in storage: ``<root>/<job>/g<generation>/s<step>``.

    Attributes:
        job_id: the job.
        generation: the generation that wrote it.
        step: its step.
        location: where it is (a path or URI), as the storage listing gave it.
    """

    job_id: str
    generation: int
    step: int
    location: str


@dataclass(frozen=True, slots=True)
class Verdict:
    """Keep or delete one committed snapshot or one leftover step folder.

    Attributes:
        job_id: the job.
        generation: the generation that wrote it.
        step: its step.
        keep: whether it stays.
        reasons: why, in words (every reason to keep it; else why it may go).
        manifest: the committed snapshot's manifest (its files are its shards); ``None`` for a
            leftover.
        location: the leftover's step folder; ``None`` for a committed snapshot.
        present: its step folder was found in storage; ``False`` for a committed snapshot of
            a job whose storage was listed without it (deleted before, or lost).
        complete: every shard file of a committed snapshot is there (``False`` when absent,
            or when its folder lacks a shard file).
    """

    job_id: str
    generation: int
    step: int
    keep: bool
    reasons: tuple[str, ...]
    manifest: Manifest | None = None
    location: str | None = None
    present: bool = True
    complete: bool = True

    @property
    def name(self) -> str:
        """The snapshot id, or ``leftover <location>``."""
        return self.manifest.snapshot_id if self.manifest else f"leftover {self.location}"


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    """The verdicts, committed snapshots first (commit order), then leftovers (by job,
    generation, step)."""

    verdicts: tuple[Verdict, ...]

    @property
    def deleted(self) -> tuple[Verdict, ...]:
        """The verdicts that delete something still in storage."""
        return tuple(v for v in self.verdicts if not v.keep and v.present)


def plan_retention(
    catalog: Catalog,
    audits: Mapping[str, AuditDigest],
    policy: RetentionPolicy,
    stored: Iterable[StoredStep] = (),
    *,
    jobs: AbstractSet[str] | None = None,
    unverified: Iterable[str] = (),
    complete: bool = True,
    listed: Iterable[str] = (),
    incomplete: Iterable[str] = (),
) -> RetentionPlan:
    """The verdict of every committed snapshot of ``jobs`` (every job: ``None``) and of every
    step folder of ``stored`` that holds no committed snapshot (module docstring).

    Args:
        catalog: the committed snapshots, with the ones restores abandoned.
        audits: job id -> its audit trail digested (ended, restores, resumes, incidents).
        policy: what to keep.
        stored: the step folders found in storage (committed ones included: they are matched
            to their snapshots by job, generation and step).
        jobs: only these jobs' snapshots and leftovers (one job for ``trainguard checkpoints
            prune --job``; the jobs of its partitions for a daemon). The rest of the catalog
            still counts: a snapshot of one of them another job started from keeps its
            reason.
        unverified: ids of snapshots the manifests topic names but the catalog left out (their
            signature did not verify): their step folders are kept, never taken for leftovers.
        complete: the manifests topic was read whole (no undecodable record); ``False`` keeps
            every leftover, since an unreadable manifest may name it.
        listed: the jobs whose storage ``stored`` lists whole: their committed snapshots
            without a step folder there are marked absent (``present=False``).
        incomplete: ids of snapshots whose step folder is there but lacks a shard file. The
            newest ``keep_last`` whole snapshots are kept as well as the newest ``keep_last``.
    """
    parents = _parents(catalog, audits, policy)
    verdicts: list[Verdict] = []
    # Folders that hold a snapshot, by the id the daemon gives its step (``unverified`` ones
    # too: their manifests are on the topic even if the catalog left them out).
    committed = {*catalog.snapshots, *unverified}
    by_job: dict[str, list[Manifest]] = {}
    for manifest in catalog.snapshots.values():
        if jobs is None or manifest.job_id in jobs:
            by_job.setdefault(manifest.job_id, []).append(manifest)
    stored = list(stored)
    found = {(s.job_id, s.generation, s.step) for s in stored}
    whole = set(listed)
    absent = {
        m.snapshot_id
        for m in catalog.snapshots.values()
        if m.job_id in whole and (m.job_id, m.generation, m.step) not in found
    }
    damaged = absent | set(incomplete)
    for job_id, manifests in by_job.items():
        made = _job_verdicts(catalog, audits.get(job_id), policy, manifests, parents, damaged)
        for verdict in made:
            sid = verdict.name
            if sid in damaged:
                verdict = replace(verdict, present=sid not in absent, complete=False)
            verdicts.append(verdict)
    order = {m.snapshot_id: i for i, m in enumerate(catalog.snapshots.values())}
    verdicts.sort(key=lambda v: order[v.manifest.snapshot_id] if v.manifest else 0)
    leftovers = sorted(
        (s for s in stored if snapshot_id(s.job_id, s.generation, s.step) not in committed),
        key=lambda s: (s.job_id, s.generation, s.step, s.location),
    )
    for leftover in leftovers:
        if jobs is None or leftover.job_id in jobs:
            verdicts.append(_leftover_verdict(leftover, audits.get(leftover.job_id), complete))
    return RetentionPlan(tuple(verdicts))


def _parents(
    catalog: Catalog, audits: Mapping[str, AuditDigest], policy: RetentionPolicy
) -> dict[str, list[str]]:
    """Snapshot id -> why it stays as a parent: the jobs started from it that keep it."""
    out: dict[str, list[str]] = {}
    for manifest in catalog.snapshots.values():
        parent = manifest.parent
        if parent is None or parent.partition("/")[0] == manifest.job_id:
            continue
        audit = audits.get(manifest.job_id)
        if not _finished(audit):
            why = f"the initial state of running job {manifest.job_id}"
        elif policy.delete_parents:
            continue
        else:
            why = f"the parent of job {manifest.job_id}"
        if why not in out.setdefault(parent, []):
            out[parent].append(why)
    return out


def _finished(audit: AuditDigest | None) -> bool:
    """The job finished. A stopped or failed job is not: ``trainguard run --continue`` resumes
    it from its newest snapshot not known bad, so it keeps its restore targets."""
    return audit is not None and audit.ended is not None and audit.ended[0] == "finished"


def _restoring_target(audit: AuditDigest | None) -> str | None:
    """The target snapshot of the job's restore in progress, if any: its newest restore, not
    resumed, its incident still open, the job not finished."""
    if audit is None or _finished(audit) or not audit.restores:
        return None
    generation = max(audit.restores)
    restore = audit.restores[generation]
    if generation in audit.resumes or restore.incident_id in audit.closed:
        return None
    return restore.snapshot_id


def _job_verdicts(
    catalog: Catalog,
    audit: AuditDigest | None,
    policy: RetentionPolicy,
    manifests: list[Manifest],
    parents: Mapping[str, list[str]],
    damaged: Collection[str],
) -> list[Verdict]:
    """The verdicts of one job's committed snapshots (``manifests``, in commit order)."""
    timeline = [m.snapshot_id for m in manifests if m.snapshot_id not in catalog.abandoned]
    # A damaged snapshot is no restore point: the newest K whole ones are kept too (and the
    # damaged one stays, for whoever looks into it).
    whole = [sid for sid in timeline if sid not in damaged]
    newest = set(timeline[-policy.keep_last :]) | set(whole[-policy.keep_last :])
    running = not _finished(audit)
    targets = set(timeline[-policy.restore_targets :]) if running else set()
    restoring = _restoring_target(audit)
    out: list[Verdict] = []
    for manifest in manifests:
        sid = manifest.snapshot_id
        keep: list[str] = []
        if sid in newest:
            keep.append(f"one of the job's newest {policy.keep_last}")
        if policy.keep_every_steps and manifest.step % policy.keep_every_steps == 0:
            keep.append(f"a multiple of {policy.keep_every_steps} steps")
        if sid in targets:
            keep.append(f"a possible restore target (the daemon's newest {policy.restore_targets})")
        if sid == restoring:
            keep.append("the target of the restore in progress")
        keep += parents.get(sid, [])
        gone = catalog.abandoned.get(sid)
        if keep:
            reasons = tuple(keep)
        elif gone is not None:
            reasons = (gone.reason,)
        else:
            reasons = (f"older than the job's newest {policy.keep_last}",)
        out.append(
            Verdict(
                manifest.job_id,
                manifest.generation,
                manifest.step,
                keep=bool(keep),
                reasons=reasons,
                manifest=manifest,
            )
        )
    return out


def _leftover_verdict(leftover: StoredStep, audit: AuditDigest | None, complete: bool) -> Verdict:
    """A step folder without a committed snapshot: deleted when nothing can commit it."""
    resumed = max(audit.resumes, default=-1) if audit is not None else -1
    if not complete:
        keep, why = True, "uncommitted as far as known: the manifests topic held unreadable records"
    elif _finished(audit):
        keep, why = False, "uncommitted, and the job finished"
    elif leftover.generation < resumed:
        keep, why = False, f"uncommitted, and generation {resumed} resumed since (fenced)"
    else:
        keep, why = True, "uncommitted, and may still commit (a checkpoint in flight)"
    return Verdict(
        leftover.job_id,
        leftover.generation,
        leftover.step,
        keep=keep,
        reasons=(why,),
        location=leftover.location,
    )
