"""Pruning: the catalog as the bus holds it, the step folders storage holds, the retention
rule's verdicts (:mod:`._retention`) and the deletions they call for, in one code path for
``trainguard checkpoints prune`` and the daemon's own retention (``docs/catalog.md``,
"Retention").

I/O: :func:`read_catalog` reads the ``manifests`` and ``audit`` topics, :func:`prune` lists
and deletes step folders (through the agent's layout, :mod:`trainguard.agent.checkpoint`, which
never follows a symbolic link and never deletes outside a step folder). :func:`prune` blocks
for as long as storage takes: the daemon calls it from a worker thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainguard.agent.bus import Bus, Record
from trainguard.agent.checkpoint import (
    ManifestLog,
    files_present,
    job_folder,
    read_manifests,
    remove_step_folder,
    snapshot_folder,
    step_folders,
)
from trainguard.daemon.catalog._catalog import Catalog
from trainguard.daemon.catalog._retention import (
    RetentionPlan,
    RetentionPolicy,
    StoredStep,
    plan_retention,
)
from trainguard.daemon.core import MalformedAudit, entries_by_job
from trainguard.daemon.forensics import AuditDigest, read_audit, read_topic

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

__all__ = [
    "BusCatalog",
    "JobAuditMalformed",
    "Pruned",
    "StorageUnreadable",
    "prune",
    "read_catalog",
]


class JobAuditMalformed(ValueError):
    """One job's audit trail lacks a field its decisions always have.

    Attributes:
        job_id: the job.
        cause: what digesting its trail raised (``KeyError``, ``TypeError``, ``ValueError``).
    """

    def __init__(self, job_id: str, cause: Exception) -> None:
        super().__init__(f"the audit trail of job {job_id!r} is malformed: {cause!r}")
        self.job_id = job_id
        self.cause = cause


class StorageUnreadable(OSError):
    """A job's checkpoint folder cannot be listed, or a snapshot's files cannot be checked;
    the message says which and why.

    Attributes:
        job_id: the job.
    """

    def __init__(self, job_id: str, message: str) -> None:
        super().__init__(message)
        self.job_id = job_id


@dataclass(frozen=True, slots=True, kw_only=True)
class BusCatalog:
    """The catalog as the bus holds it: what a prune plans from.

    Attributes:
        catalog: the committed snapshots (with keys, of the manifests whose signature
            verifies), with the ones restores abandoned.
        audits: job id -> its audit trail digested, for the jobs with snapshots.
        unverified: snapshot id -> why its manifest's signature does not verify (with keys):
            its step folder is never taken for a leftover.
        skipped: records of the manifests topic that were undecodable or inconsistent (any
            keeps every leftover: an unreadable manifest may name it).
    """

    catalog: Catalog
    audits: Mapping[str, AuditDigest]
    unverified: Mapping[str, str]
    skipped: int

    @classmethod
    def of(cls, log: ManifestLog, audit: Iterable[Record]) -> BusCatalog:
        """The catalog of ``log`` (the ``manifests`` topic read) with the restores the
        ``audit`` topic's records (in bus order) show.

        Raises:
            MalformedAudit: an audit record that is not a JSON object.
            JobAuditMalformed: a job's trail lacks a field its decisions always have.
        """
        jobs = {m.job_id for m in log.manifests}
        audits: dict[str, AuditDigest] = {}
        for job, entries in entries_by_job(audit).items():
            if job not in jobs:
                continue
            try:
                audits[job] = read_audit(entries)
            except MalformedAudit:  # a ValueError too, that names the record itself
                raise
            except (KeyError, TypeError, ValueError) as exc:
                raise JobAuditMalformed(job, exc) from exc
        return cls(
            catalog=Catalog.of(log.manifests, audits),
            audits=audits,
            unverified=log.unauthenticated,
            skipped=log.invalid - len(log.unauthenticated),
        )


async def read_catalog(
    bus: Bus, *, verify_keys: Mapping[str, Ed25519PublicKey] | None = None
) -> BusCatalog:
    """Read the whole ``manifests`` and ``audit`` topics of ``bus`` (up to their end offsets
    now) into a :class:`BusCatalog`.

    Args:
        bus: a started bus.
        verify_keys: the daemon's public keys (key id -> Ed25519 public key): only manifests
            signed by one of them are in the catalog; ``None`` takes unsigned ones too.

    Raises:
        BusError: the bus failed while reading.
        TimeoutError: the audit topic stopped yielding records for 120 s.
        MalformedAudit, JobAuditMalformed: as :meth:`BusCatalog.of`.
    """
    log = await read_manifests(bus, verify_keys=verify_keys)
    audit = [r async for r in read_topic(bus, "audit")]
    return BusCatalog.of(log, audit)


@dataclass(frozen=True, slots=True, kw_only=True)
class Pruned:
    """What a prune decided and did.

    Attributes:
        plan: every verdict (those of the jobs pruned).
        failures: the name of each verdict whose deletion failed -> why.
        freed: the name of each step folder deleted -> bytes freed (0: another prune got
            there first).
        unreadable: job -> why its storage could not be listed or checked; nothing of it was
            deleted (only with ``skip_unreadable``).
    """

    plan: RetentionPlan
    failures: Mapping[str, str]
    freed: Mapping[str, int]
    unreadable: Mapping[str, str]


def prune(
    found: BusCatalog,
    policy: RetentionPolicy,
    *,
    jobs: AbstractSet[str] | None = None,
    dry_run: bool = False,
    skip_unreadable: bool = False,
) -> Pruned:
    """List the step folders of ``jobs``' snapshots in storage, judge every snapshot and
    leftover folder (:func:`~trainguard.daemon.catalog.plan_retention`) and, unless
    ``dry_run``, delete the step folders the plan lets go.

    Storage is listed from this machine: the job folders the snapshots' shard URIs name, laid
    out ``<root>/<job>/g<generation>/s<step>/`` as the agent writes them (``file://`` or an
    fsspec URL). A committed snapshot is deleted as its own step folder, and only if every
    shard its manifest names lies in it and no symbolic link leads there; a leftover as the
    folder found. A folder another prune deleted meanwhile is no error.

    Args:
        found: the catalog as the bus holds it (:func:`read_catalog`).
        policy: what to keep.
        jobs: only these jobs (``None``: every job of the catalog).
        dry_run: plan only; delete nothing.
        skip_unreadable: leave a job whose storage cannot be listed or checked out of the
            plan (named in :attr:`Pruned.unreadable`) and prune the others; without it that
            raises before anything is deleted.

    Raises:
        StorageUnreadable: without ``skip_unreadable``, a job folder that cannot be listed or
            a snapshot whose files cannot be checked.
    """
    catalog = found.catalog
    wanted = {m.job_id for m in catalog.snapshots.values() if jobs is None or m.job_id in jobs}
    stored: list[StoredStep] = []
    listed: set[str] = set()
    incomplete: list[str] = []
    unreadable: dict[str, str] = {}
    for job_id in sorted(wanted):
        try:
            steps, folders = _stored_steps(catalog, job_id)
            incomplete += _incomplete(catalog, steps, job_id)
        except StorageUnreadable as exc:
            if not skip_unreadable:
                raise
            unreadable[job_id] = str(exc)
            continue
        stored += steps
        if folders:
            listed.add(job_id)
    plan = plan_retention(
        catalog,
        found.audits,
        policy,
        stored,
        jobs=wanted - unreadable.keys(),
        unverified=found.unverified,
        complete=found.skipped == 0,
        listed=listed,
        incomplete=incomplete,
    )
    failures: dict[str, str] = {}
    freed: dict[str, int] = {}
    if not dry_run:
        failures, freed = _apply(plan)
    return Pruned(plan=plan, failures=failures, freed=freed, unreadable=unreadable)


def _stored_steps(catalog: Catalog, job_id: str) -> tuple[list[StoredStep], list[str]]:
    """The step folders under the job folders of ``job_id``'s snapshots, on a file system or
    object storage, and those job folders (none: no shard of the job is in the agent's
    layout, so its storage is not known).

    Raises:
        StorageUnreadable: a folder cannot be listed.
    """
    folders: list[str] = []
    for manifest in catalog.snapshots.values():
        if manifest.job_id != job_id:
            continue
        for shard in manifest.shards:
            folder = job_folder(shard, job_id)
            if folder is not None and folder not in folders:
                folders.append(folder)
    stored: list[StoredStep] = []
    for folder in folders:
        try:
            found = step_folders(folder)
        except OSError as exc:
            raise StorageUnreadable(
                job_id, f"cannot list the checkpoints of job {job_id!r} in {folder}: {exc}"
            ) from exc
        stored += [StoredStep(job_id, f.generation, f.step, f.uri) for f in found]
    return stored, folders


def _incomplete(catalog: Catalog, stored: Iterable[StoredStep], job_id: str) -> list[str]:
    """``job_id``'s committed snapshots whose step folder is there but lacks one of their
    files (lost: no restore point).

    Raises:
        StorageUnreadable: storage cannot be asked about a snapshot's files.
    """
    there = {(s.generation, s.step) for s in stored}
    out: list[str] = []
    for m in catalog.snapshots.values():
        if m.job_id == job_id and (m.generation, m.step) in there:
            try:
                if not files_present(m.shards):
                    out.append(m.snapshot_id)
            except OSError as exc:
                raise StorageUnreadable(
                    job_id, f"cannot check the files of {m.snapshot_id}: {exc}"
                ) from exc
    return out


def _apply(plan: RetentionPlan) -> tuple[dict[str, str], dict[str, int]]:
    """Delete the step folder of each verdict ``plan`` deletes (a committed snapshot's only
    where its shards lie in its own folder of the agent's layout: never a path a manifest
    names elsewhere); return why, for each deletion that failed, and the bytes each deletion
    freed."""
    failures: dict[str, str] = {}
    freed: dict[str, int] = {}
    for v in plan.deleted:
        try:
            if v.manifest is not None:
                shards = v.manifest.shards
                folder = snapshot_folder(shards, v.job_id, v.generation, v.step)
                freed[v.name] = remove_step_folder(folder)
            elif v.location is not None:
                freed[v.name] = remove_step_folder(v.location)
        except (OSError, ValueError) as exc:
            failures[v.name] = str(exc)
    return failures, freed
