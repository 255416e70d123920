"""The checkpoint catalog: every committed training snapshot across jobs, their lineage, and
whether one can seed a new job (``trainguard checkpoints``; ``docs/catalog.md``).

Pure: built from manifests already read (the bus's ``manifests`` topic keeps one per committed
step, :func:`trainguard.agent.checkpoint._manifests.read_manifests`) and the jobs' audit trails digested
(:func:`trainguard.daemon.forensics._report_record.read_audit`); no I/O, no clock. A job started
from another job's snapshot (the agent's ``init_from``) records it as the ``parent`` of every
snapshot it commits, so ancestry is a walk from parent to parent, across jobs.

**Abandoned snapshots** (:func:`abandoned`). A restore rolls its job back to its target, the
latest committed step before the fault's onset: the job's timeline continues from there, and
every snapshot committed before the restore at a later step is off it (committed at step 120
when a bitflip at step 110 made the daemon restore to step 100). Fencing makes "before the
restore" exact: a generation's snapshots all precede the restore that starts the next one. So
restore R, which starts generation G with target step T (none: the job's initial state),
abandons every snapshot of its job of a generation below G and a step above T. Such a snapshot
may hold state the fault already corrupted, and its data cursor sits past samples the job
then trained again: it is listed as ``abandoned``, and :func:`compat` refuses it. The daemon
commits a snapshot of a generation below G after R (its ``ts`` at or after R's) only as a late
cut: a step of the generation R left whose shards arrived after R, committed because the job
finished in that generation before any process joined R, which voided R and closed its incident
with outcome ``finished`` (``docs/recovery.md``, "Late checkpoints of a finished job commit").
The job's timeline runs through it: R does not abandon it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import orjson

from trainguard.daemon.forensics import AuditDigest
from trainguard.schemas import JSONValue, Manifest

__all__ = [
    "Abandoned",
    "Ancestor",
    "Catalog",
    "Compat",
    "DescendantJob",
    "Lineage",
    "SeedRequest",
    "abandoned",
    "compat",
    "lookup",
]

Origin = Literal["scratch", "unknown", "loop"]
"""How an ancestry ends: at a job started from scratch, at a parent the catalog does not hold
(expired from the topic, or on another bus), or at a snapshot already met (corrupt data)."""


@dataclass(frozen=True, slots=True)
class Ancestor:
    """One step up a lineage: a snapshot id and its manifest, ``None`` if not in the catalog."""

    snapshot_id: str
    manifest: Manifest | None


@dataclass(frozen=True, slots=True)
class DescendantJob:
    """A job started from a snapshot, and the jobs started from its snapshots in turn.

    Attributes:
        job_id: the job.
        started_from: the snapshot it started from (its snapshots' ``parent``).
        snapshots: its committed snapshots, oldest first.
        descendants: jobs started from any of ``snapshots``.
    """

    job_id: str
    started_from: str
    snapshots: tuple[Manifest, ...]
    descendants: tuple[DescendantJob, ...]


@dataclass(frozen=True, slots=True)
class Lineage:
    """A snapshot's ancestry across jobs and the jobs descended from it.

    Attributes:
        ancestors: the snapshot itself, the snapshot its job started from, that one's origin,
            and so on up.
        origin: how the walk up ended (see :data:`Origin`).
        descendants: jobs started from the snapshot, each with its own descendants.
    """

    ancestors: tuple[Ancestor, ...]
    origin: Origin
    descendants: tuple[DescendantJob, ...]


@dataclass(frozen=True, slots=True)
class Abandoned:
    """A committed snapshot off its job's timeline: a restore rolled the job back past it
    (module docstring).

    Attributes:
        snapshot_id: the snapshot.
        generation: the generation the restore started.
        target: the snapshot the restore went back to, ``None`` for the job's initial state.
        target_step: the target's step, ``None`` with ``target``.
        incident_id: the incident the restore answered.
        cause: that incident's cause (the detector), ``None`` when the trail does not hold it.
        onset_after_step: the last step the incident's evidence shows sound, ``None`` when
            unknown.
    """

    snapshot_id: str
    generation: int
    target: str | None
    target_step: int | None
    incident_id: str
    cause: str | None = None
    onset_after_step: int | None = None

    @property
    def reason(self) -> str:
        """Why the snapshot is abandoned, in a sentence."""
        back = (
            f"to {self.target} (step {self.target_step})"
            if self.target is not None
            else "to the job's initial state"
        )
        why = f"incident {self.incident_id}"
        if self.cause is not None:
            onset = (
                f", onset after step {self.onset_after_step}"
                if self.onset_after_step is not None
                else ""
            )
            why += f" ({self.cause}{onset})"
        return (
            f"abandoned: the restore of generation {self.generation} {back}, for {why}, rolled "
            "the job back past it, so its state and data cursor are off the job's timeline"
        )


def abandoned(
    manifests: Iterable[Manifest], audits: Mapping[str, AuditDigest]
) -> dict[str, Abandoned]:
    """The snapshots among ``manifests`` that a restore abandoned (module docstring), each with
    the first restore (lowest generation) that did; a late cut committed after a restore its
    job's finish voided is not abandoned by it.

    Args:
        manifests: committed snapshots, of any jobs.
        audits: job id -> its audit trail digested (its restores and incidents); a job
            without one has no restore on record, so none of its snapshots is abandoned.
    """
    out: dict[str, Abandoned] = {}
    for manifest in manifests:
        audit = audits.get(manifest.job_id)
        if audit is None or manifest.snapshot_id in out:
            continue
        for generation in sorted(audit.restores):
            restore = audit.restores[generation]
            if manifest.generation >= generation:
                continue
            closed = audit.closed.get(restore.incident_id)
            if closed is not None and closed[0] == "finished" and manifest.ts >= restore.ts:
                continue  # a late cut, committed as the job finished and voided the restore
            if restore.target_step is not None and manifest.step <= restore.target_step:
                continue
            opened = audit.opened.get(restore.incident_id)
            out[manifest.snapshot_id] = Abandoned(
                snapshot_id=manifest.snapshot_id,
                generation=generation,
                target=restore.snapshot_id,
                target_step=restore.target_step,
                incident_id=restore.incident_id,
                cause=None if opened is None else opened.cause,
                onset_after_step=None if opened is None else opened.onset_after_step,
            )
            break
    return out


def _order(manifest: Manifest) -> tuple[int, str]:
    """Commit time, then id: the catalog's order (bus order is per partition only)."""
    return manifest.ts, manifest.snapshot_id


@dataclass(frozen=True, slots=True)
class Catalog:
    """Every committed snapshot the bus holds, by id.

    Build it with :meth:`of`. ``snapshots`` maps id to manifest in commit order (``ts``,
    then id); ``abandoned`` maps the ids of the snapshots a restore abandoned to how
    (:func:`abandoned`).
    """

    snapshots: Mapping[str, Manifest]
    _children: Mapping[str, tuple[Manifest, ...]] = field(repr=False, compare=False)
    abandoned: Mapping[str, Abandoned] = field(default_factory=dict)

    @classmethod
    def of(
        cls, manifests: Iterable[Manifest], audits: Mapping[str, AuditDigest] | None = None
    ) -> Catalog:
        """The catalog of ``manifests`` (bus order). A snapshot published twice (a commit the
        daemon re-derived after a restart) is kept once, as first published. ``audits``
        (job id -> its audit trail digested) tells which snapshots restores abandoned; none:
        no snapshot is marked."""
        unique: dict[str, Manifest] = {}
        for manifest in manifests:
            unique.setdefault(manifest.snapshot_id, manifest)
        ordered = sorted(unique.values(), key=_order)
        children: dict[str, list[Manifest]] = {}
        for manifest in ordered:
            if manifest.parent is not None:
                children.setdefault(manifest.parent, []).append(manifest)
        return cls(
            {m.snapshot_id: m for m in ordered},
            {parent: tuple(kids) for parent, kids in children.items()},
            abandoned(ordered, audits or {}),
        )

    def get(self, snapshot_id: str) -> Manifest | None:
        """The snapshot's manifest, or ``None`` when the catalog does not hold it."""
        return self.snapshots.get(snapshot_id)

    def select(
        self,
        *,
        job: str | None = None,
        data_version: str | None = None,
        code_version: str | None = None,
    ) -> list[Manifest]:
        """The snapshots of ``job`` (exact id) whose data version and code version start with
        the given values (a full value, or a prefix such as a short git commit); all of them
        when no filter is given; in commit order."""
        return [
            m
            for m in self.snapshots.values()
            if (job is None or m.job_id == job)
            and (data_version is None or m.data_version.startswith(data_version))
            and (code_version is None or m.metadata.code_version.startswith(code_version))
        ]

    def lineage(self, snapshot_id: str) -> Lineage:
        """``snapshot_id``'s ancestry (itself first, then parent after parent) and the jobs
        descended from it. ``snapshot_id`` need not be in the catalog (its ancestry is then
        just itself, origin ``unknown``)."""
        ancestors: list[Ancestor] = []
        seen: set[str] = set()
        current: str | None = snapshot_id
        origin: Origin = "scratch"
        while current is not None:
            if current in seen:
                origin = "loop"
                break
            seen.add(current)
            manifest = self.snapshots.get(current)
            ancestors.append(Ancestor(current, manifest))
            if manifest is None:
                origin = "unknown"
                break
            current = manifest.parent
        own_job = frozenset({snapshot_id.partition("/")[0]})
        return Lineage(tuple(ancestors), origin, self._descendants(snapshot_id, own_job))

    def _descendants(
        self, snapshot_id: str, jobs_above: frozenset[str]
    ) -> tuple[DescendantJob, ...]:
        """The jobs started from ``snapshot_id``, except those in ``jobs_above`` (the jobs on
        the way down from the snapshot asked about, its own included: only a loop in corrupt
        data would lead back to them)."""
        by_job: dict[str, list[Manifest]] = {}
        for child in self._children.get(snapshot_id, ()):
            if child.job_id not in jobs_above:
                by_job.setdefault(child.job_id, []).append(child)
        out: list[DescendantJob] = []
        for job_id, snapshots in by_job.items():
            above = jobs_above | {job_id}
            below = tuple(d for m in snapshots for d in self._descendants(m.snapshot_id, above))
            out.append(DescendantJob(job_id, snapshot_id, tuple(snapshots), below))
        return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class SeedRequest:
    """The settings of a new job that is to start from a snapshot.

    Attributes:
        world_size: the new job's world size, or ``None``: not checked.
        data_version: the data version it will read, or ``None``: not checked.
        code_version: its code version, or ``None``: not checked.
        hyperparameters: hyperparameters it will use; a key may be a dotted path into nested
            objects (``model.d_model``).
        allow_data_version_change: a different data version is deliberate (a fine-tune on
            new data): warned, not refused.
        exact: the new job must continue the snapshot's run bitwise (as ``examples/charlm``
            requires of every restore): a world-size or hyperparameter change is refused.
    """

    world_size: int | None = None
    data_version: str | None = None
    code_version: str | None = None
    hyperparameters: Mapping[str, JSONValue] = field(default_factory=dict)
    allow_data_version_change: bool = False
    exact: bool = False


@dataclass(frozen=True, slots=True)
class Compat:
    """Whether a snapshot can seed a new job, and why not.

    Attributes:
        snapshot_id: the snapshot judged.
        refusals: every reason it cannot (empty: it can).
        warnings: differences that do not prevent it but change what the new job computes.
    """

    snapshot_id: str
    refusals: tuple[str, ...]
    warnings: tuple[str, ...]

    @property
    def compatible(self) -> bool:
        """No reason to refuse."""
        return not self.refusals


_MODEL_PARALLEL = ("tp", "pp")
"""Topology degrees (``docs/wire-contract.md``, metadata) that split the model across ranks."""


def lookup(values: Mapping[str, JSONValue], path: str) -> tuple[bool, JSONValue]:
    """``(found, value)`` of ``path`` in ``values``: the key itself if present, else a dotted
    path into nested objects (``model.d_model``)."""
    if path in values:
        return True, values[path]
    head, dot, rest = path.partition(".")
    inner = values.get(head) if dot else None
    if isinstance(inner, dict):
        return lookup(inner, rest)
    return False, None


def compat(
    manifest: Manifest,
    request: SeedRequest,
    shard_problems: Sequence[str] = (),
    abandoned_by: Abandoned | None = None,
) -> Compat:
    """Judge whether ``manifest`` can seed a job with ``request``'s settings.

    A snapshot a restore abandoned (``abandoned_by``, from :attr:`Catalog.abandoned`) is
    refused whatever the settings (module docstring).
    Otherwise what the agent and the data cursor do on a restore decides it
    (``docs/catalog.md``):

    * world size, DCP snapshot: DCP reshards onto any world size, so another one is warned
      (each step trains another number of samples), refused only with ``exact``;
    * world size, ``torch.save`` snapshot: every rank loads its own shard (``Agent.load``:
      rank r takes shard r, ``ShardMissing`` otherwise), which cannot be resharded; so a
      larger world size is refused. A smaller one is refused for a model-parallel topology (``tp`` or ``pp`` > 1:
      the unused shards hold parts of the model) and with ``exact``; otherwise warned: the
      cursor is world-size independent, so the data resumes with no sample skipped or
      repeated, but each step trains fewer samples;
    * data version: a different one is refused (the sampler raises ``DataVersionMismatch``
      on restore) unless ``allow_data_version_change``;
    * code version: a difference is warned, as is a snapshot that records none;
    * hyperparameters: a different or unrecorded value is warned; with ``exact`` a different
      one is refused;
    * ``shard_problems``: what the caller found wrong with the shard files, each refused.
    """
    refusals: list[str] = [] if abandoned_by is None else [abandoned_by.reason]
    warnings: list[str] = []
    size, new_size = manifest.world_size, request.world_size
    not_exact = (
        f"world size {new_size}: an exact continuation needs the snapshot's world size "
        f"{size} (the samples per step and the ranks' random streams change)"
    )
    if new_size is not None and new_size != size and manifest.shards[0].files is not None:
        if request.exact:
            refusals.append(not_exact)
        else:
            warnings.append(
                f"world size {new_size} != {size}: this DCP snapshot is resharded onto "
                f"{_span('rank', 0, new_size - 1)} as it loads; the data cursor is world-size "
                "independent, so no sample is skipped or repeated, but with the same per-rank "
                f"batch a step trains the samples of {_span('rank', 0, new_size - 1)} where it "
                f"trained those of {_span('rank', 0, size - 1)} (a data "
                "loader state that only its own rank can resume, such as a StatefulDataLoader "
                "without trainguard's sampler, is refused on restore)"
            )
    elif new_size is not None and new_size != size:
        split = {
            k: v
            for k in _MODEL_PARALLEL
            if isinstance(v := manifest.metadata.topology.get(k), int) and v > 1
        }
        if new_size > size:
            refusals.append(
                f"world size {new_size}: {_span('rank', size, new_size - 1)} would find no "
                f"shard in this snapshot of world size {size} (each rank loads its own shard; "
                "trainguard does not reshard)"
            )
        elif split:
            degrees = ", ".join(f"{k}={v}" for k, v in split.items())
            refusals.append(
                f"world size {new_size}: the snapshot is model-parallel ({degrees}), so the "
                f"{_span('shard', new_size, size - 1)} hold parts of the model every rank needs"
            )
        elif request.exact:
            refusals.append(not_exact)
        else:
            warnings.append(
                f"world size {new_size} < {size}: the ranks load {_span('shard', 0, new_size - 1)}"
                f" and leave {_span('shard', new_size, size - 1)} unused (data-parallel "
                "replicas); the data cursor is world-size independent, so no sample is skipped "
                f"or repeated, but a step trains {new_size}/{size} of the samples it did"
            )
    version, new_version = manifest.data_version, request.data_version
    if new_version is not None and new_version != version:
        text = f"data version {new_version!r} differs from the snapshot's {version!r}"
        if request.allow_data_version_change:
            warnings.append(f"{text} (allowed: the data cursor's offset is then into other data)")
        else:
            refusals.append(
                f"{text}: a restore refuses another data version (DataVersionMismatch) unless "
                "the change is allowed (--allow-data-version-change)"
            )
    code, new_code = manifest.metadata.code_version, request.code_version
    if new_code is not None and new_code != code:
        warnings.append(
            f"code version {new_code!r} differs from the snapshot's {code!r}"
            if code
            else f"the snapshot records no code version to compare with {new_code!r}"
        )
    recorded = manifest.metadata.hyperparameters
    for key, value in request.hyperparameters.items():
        found, old = lookup(recorded, key)
        if not found:
            warnings.append(
                f"hyperparameter {key} is not recorded in the snapshot (it records: "
                f"{', '.join(sorted(recorded)) or 'none'})"
            )
        elif old != value:
            text = f"hyperparameter {key}: snapshot {_json(old)}, new job {_json(value)}"
            if request.exact:
                refusals.append(f"{text} (an exact continuation needs the same)")
            else:
                warnings.append(text)
    refusals.extend(shard_problems)
    return Compat(manifest.snapshot_id, tuple(refusals), tuple(warnings))


def _span(noun: str, first: int, last: int) -> str:
    """``"rank 3"`` or ``"ranks 2..5"`` (``noun`` ``"rank"``)."""
    return f"{noun} {first}" if first == last else f"{noun}s {first}..{last}"


def _json(value: JSONValue) -> str:
    """A hyperparameter value as JSON, strings quoted as Python does."""
    return repr(value) if isinstance(value, str) else orjson.dumps(value).decode()
