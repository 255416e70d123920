"""The commit rule: when a step's checkpoint shards form a training snapshot.

ARCHITECTURE.md section 4: step S of generation G is committed when every rank of the world size
has reported a shard for (G, S), all with one data version and one world size; the data cursor
is world-size independent, so every rank's must be the same too, and so must the snapshot the
job started from (``parent``: shards of different origins are not one model). A DCP step is
one folder with the coordinator's ``.metadata`` and every file listed once (``docs/checkpoints.md``).
Only committed steps are restore targets.

Ranks whose data cursors disagree at one step (seed, epoch, data version or offset; from
shards or data-cursor events) can never commit: :func:`disagreement` finds the first such
pair as the cursor arrives, and the machine fails the job with it (``docs/recovery.md``).

Late cuts (:func:`late_shard`): while a restore nobody joined is pending, shards of the
generation it left (``JobState.left``) still form that generation's steps, which commit only if
the job turns out to have finished there (``docs/recovery.md``, "A job that finished is never
restored").
"""

from __future__ import annotations

from collections.abc import Mapping

from msgspec import structs
from rpds import HashTrieMap

from trainguard.daemon.core._decisions import Anomaly, Decision
from trainguard.daemon.core._evidence import Measures
from trainguard.daemon.core._machine_config import MachineConfig
from trainguard.daemon.core._recovery import Failure
from trainguard.daemon.core._state import JobState, unjoined
from trainguard.schemas import Checkpoint, DataCursor, Manifest, Shard, files_digest

_METADATA = ".metadata"
"""The DCP coordinator's file: the plan that maps every tensor to its bytes."""

_POSITION = ("data_version", "seed", "epoch", "offset")
"""The cursor fields ranks must agree on (``world_size`` is the sender's, informational)."""


def snapshot_id(job_id: str, generation: int, step: int) -> str:
    """``<job_id>/g<generation>/s<step>``: a step re-committed in a later generation differs."""
    return f"{job_id}/g{generation}/s{step}"


def commit(
    job_id: str,
    generation: int,
    step: int,
    world_size: int,
    shards: Mapping[int, Checkpoint],
    now_ns: int,
) -> Manifest | str:
    """Build the manifest of ``step`` from one shard per rank, or say why it cannot commit.

    Args:
        job_id: the job.
        generation: the generation every shard was written in.
        step: the step every shard captures.
        world_size: ranks in the job; ``shards`` must hold exactly ranks ``0..world_size-1``
            (the caller has checked every shard's rank and world size against it).
        shards: rank -> that rank's checkpoint event.
        now_ns: the manifest's ``ts`` (the daemon's clock, ns).

    Returns:
        The manifest (shards ordered by rank; cursor, metadata and ``parent`` are rank 0's),
        or a reason naming the disagreeing ranks when data versions, cursors or parents differ.

    Raises:
        ValueError: ``shards`` does not hold exactly the ranks ``0..world_size-1``.
    """
    if sorted(shards) != list(range(world_size)):
        raise ValueError(f"shards of ranks {sorted(shards)} for world size {world_size}")
    ordered = [shards[r] for r in range(world_size)]
    first = ordered[0]
    versions = [c for c in ordered if c.data_version != first.data_version]
    if versions:
        odd = ", ".join(f"rank {c.rank}: {c.data_version!r}" for c in versions[:8])
        return (
            f"shards of step {step} in generation {generation} disagree on the data version "
            f"(rank 0: {first.data_version!r}; {odd}); step not committed"
        )
    cursors = [c for c in ordered if c.cursor != first.cursor]
    if cursors:
        odd = ", ".join(f"rank {c.rank}: {c.cursor}" for c in cursors[:8])
        return (
            f"shards of step {step} in generation {generation} disagree on the data cursor "
            f"(rank 0: {first.cursor}; {odd}); step not committed"
        )
    parents = [c for c in ordered if c.parent != first.parent]
    if parents:
        odd = ", ".join(f"rank {c.rank}: {c.parent!r}" for c in parents[:8])
        return (
            f"shards of step {step} in generation {generation} disagree on the snapshot the job "
            f"started from (rank 0: {first.parent!r}; {odd}); step not committed"
        )
    layout = _dcp_layout(ordered)
    if layout is not None:
        return f"shards of step {step} in generation {generation} {layout}; step not committed"
    return Manifest(
        job_id=job_id,
        snapshot_id=snapshot_id(job_id, generation, step),
        generation=generation,
        ts=now_ns,
        step=step,
        world_size=world_size,
        shards=tuple(
            Shard(
                rank=c.rank,
                uri=c.shard_uri,
                size_bytes=c.size_bytes,
                digest=c.digest,
                files=c.files,
            )
            for c in ordered
        ),
        cursor=first.cursor,
        metadata=first.metadata,
        parent=first.parent,
    )


def _dcp_layout(ordered: list[Checkpoint]) -> str | None:
    """Why the shards (ordered by rank) are not one checkpoint in one layout, or ``None``.

    A step is all ``torch.save`` files or all DCP; a DCP step is one folder (every rank's
    ``shard_uri``), each file in it listed by one rank, and the coordinator's ``.metadata``
    (written by rank 0, ``torch.distributed.checkpoint``'s coordinator) listed by rank 0;
    each rank's ``digest`` and ``size_bytes`` are those of its file list.
    """
    dcp = [c.rank for c in ordered if c.files is not None]
    if not dcp:
        return None
    if len(dcp) != len(ordered):
        torch = [c.rank for c in ordered if c.files is None]
        return f"mix formats (DCP: ranks {_ranks(dcp)}; torch.save: ranks {_ranks(torch)})"
    folder = ordered[0].shard_uri
    elsewhere = [c for c in ordered if c.shard_uri != folder]
    if elsewhere:
        odd = ", ".join(f"rank {c.rank}: {c.shard_uri!r}" for c in elsewhere[:8])
        return f"name different DCP folders (rank 0: {folder!r}; {odd})"
    owner: dict[str, int] = {}
    for c in ordered:
        files = c.files or ()
        if c.digest != files_digest(files) or c.size_bytes != sum(f.size_bytes for f in files):
            return f"include rank {c.rank}'s, whose digest or size does not sum up its file list"
        for f in files:
            first = owner.setdefault(f.name, c.rank)
            if first != c.rank:
                return f"both list the file {f.name!r} (ranks {first} and {c.rank})"
    if owner.get(_METADATA) != 0:
        return f"are a DCP checkpoint whose rank 0 does not list its {_METADATA} file"
    return None


def _ranks(ranks: list[int]) -> str:
    """``"0, 1, 2, ..."``: at most 8 ranks named."""
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


def late_shard(
    state: JobState, event: Checkpoint, config: MachineConfig
) -> tuple[JobState, tuple[Decision, ...]] | None:
    """Judge a checkpoint shard of an older generation than the job's (otherwise stale).

    It counts when the job is ``restoring``, no event of the current generation has been
    accepted (``senders`` empty: no process joined the restore), and it is a shard of the
    generation the ranks last ran in (``JobState.left``) for the job's world size, at a step
    after the restore's target (any step for a restore to the initial state) and after that
    generation's newest late cut, at or before the incident's last known-good step when it
    has one (a later step may hold the state the incident restores away from), and its rank
    has no shard of that step yet. Then it joins its step's shards in ``Left.pending`` (a
    ``late_checkpoint`` anomaly says so); the shard that completes the step makes it a cut
    (``Left.cuts``, the newest ``keep_snapshots``) when the shards agree, as :func:`commit`
    judges (else a ``checkpoint_mismatch`` anomaly, and the step is dropped). A cut is no
    restore target: the restore was issued, and its retries choose among the committed
    snapshots as before. :func:`trainguard.daemon.core._outage.late_finish` commits the cuts when
    the job finishes in that generation (the restore void); once a process joins the restore
    they are off the job's timeline and never commit. The clock is the caller's to move (the
    event's time, before this), as for any input; the ranks' records, senders and detectors
    of the current generation are untouched.

    Returns:
        The new state and its decisions, or ``None`` when the rule does not apply (the event
        is then stale, as before).
    """
    pending_restore = unjoined(state, event.generation, event.rank)
    if pending_restore is None or event.world_size != pending_restore.world_size:
        return None
    left, incident, world_size, restore = pending_restore
    target, onset, step = incident.target, incident.onset_after_step, event.step
    floor = -1 if target is None else target.step
    if left.cuts:
        floor = max(floor, left.cuts[-1].step)
    if step <= floor or (onset is not None and step > onset):
        return None
    shards = left.pending.get(step, HashTrieMap())
    if event.rank in shards:
        return None
    shards = shards.insert(event.rank, event)
    generation = left.generation
    noted = Anomaly(
        kind="late_checkpoint",
        reason=f"rank {event.rank} on host {event.host} (pid {event.pid}) reported its shard of "
        f"step {step} in generation {generation} after {restore} was issued, before any rank "
        f"joined it: {len(shards)} of {world_size} shards of step {step}; the step commits "
        f"only if every rank of generation {generation} finishes before anyone joins the "
        f"restore",
        ranks=(event.rank,),
        hosts=(event.host,),
    )
    if len(shards) < world_size:
        left = left._replace(pending=left.pending.insert(step, shards))
        return structs.replace(state, left=left), (noted,)
    pending = HashTrieMap((s, v) for s, v in left.pending.items() if s > step)
    result = commit(state.job_id, generation, step, world_size, shards, state.clock_ns)
    if isinstance(result, str):
        mismatch = Anomaly(kind="checkpoint_mismatch", reason=result)
        return structs.replace(state, left=left._replace(pending=pending)), (noted, mismatch)
    cuts = (*left.cuts, result)[-config.keep_snapshots :]
    return structs.replace(state, left=left._replace(pending=pending, cuts=cuts)), (noted,)


def disagreement(
    state: JobState, rank: int, host: str, step: int, cursor: DataCursor, source: str
) -> Failure | None:
    """Whether ``rank``'s data cursor after ``step`` (from its ``source``, e.g. ``"checkpoint
    shard"``) disagrees with what another rank reported for that step in this generation.

    The reference is, in this order: another rank's pending shard of ``step`` (they all agree,
    or the job would have failed), the first data-cursor event of ``step`` from another rank
    (``Watch.positions``), the committed snapshot of ``step`` of this generation. Compared:
    data version, seed, epoch and global sample offset. O(1): one reference is enough.

    Returns:
        A ``cursor_mismatch`` failure naming both sides and their values, or ``None``.
    """
    reference = _reference(state, rank, step)
    if reference is None:
        return None
    who, ranks, hosts, theirs, what = reference
    differing = [name for name in _POSITION if getattr(cursor, name) != getattr(theirs, name)]
    if not differing:
        return None
    fields = ", ".join(name.replace("_", " ") for name in differing)
    reason = (
        f"the ranks disagree on the data order after step {step} in generation "
        f"{state.generation}: rank {rank} on host {host} reports {_position_text(cursor)} in "
        f"its {source}, {who} {_position_text(theirs)} in {what} (they differ in the "
        f"{fields}). No step can be committed while they do, and no restore can reconcile "
        f"them: each rank rebuilds its data order from its own settings (a sampler seed that "
        f"differs by rank, such as torch.initial_seed() in a process that never seeded torch; "
        f"another dataset, batch size or offset arithmetic), so the job fails here"
    )
    return Failure(
        "cursor_mismatch",
        reason,
        tuple(sorted({rank, *ranks})),
        (host, *hosts),
        measures=Measures(step=step, differing=fields),
    )


def note_position(
    state: JobState, rank: int, step: int, cursor: DataCursor, config: MachineConfig
) -> JobState:
    """Keep ``rank``'s data cursor after ``step`` as the step's reference if it is the first
    (``Watch.positions``); steps more than ``max_step_lag`` behind the newest are dropped
    (ranks that far apart are an incident of their own), which bounds the map."""
    watch = state.watch
    positions = watch.positions
    if step in positions:
        return state
    positions = positions.insert(step, (rank, cursor))
    if len(positions) > config.max_step_lag:
        newest = max(positions)
        positions = HashTrieMap(
            (s, p) for s, p in positions.items() if s >= newest - config.max_step_lag
        )
    return structs.replace(state, watch=watch._replace(positions=positions))


def _reference(
    state: JobState, rank: int, step: int
) -> tuple[str, tuple[int, ...], tuple[str, ...], DataCursor, str] | None:
    """Who else reported a cursor for ``step``: ``(who, ranks, hosts, cursor, where)``."""
    shards = state.pending.get(step)
    if shards is not None:
        # The map's order depends only on its keys: the same reference in every replay.
        shard = next((c for r, c in shards.items() if r != rank), None)
        if shard is not None:
            who = f"rank {shard.rank} on host {shard.host}"
            return who, (shard.rank,), (shard.host,), shard.cursor, "its checkpoint shard"
    first = state.watch.positions.get(step)
    if first is not None and first[0] != rank:
        other, cursor = first
        rec = state.ranks.get(other)
        host = () if rec is None else (rec.host,)
        who = f"rank {other}" + ("" if rec is None else f" on host {rec.host}")
        return who, (other,), host, cursor, "its data cursor"
    for manifest in state.committed:
        if manifest.generation == state.generation and manifest.step == step:
            who = f"committed snapshot {manifest.snapshot_id}"
            return who, (), (), manifest.cursor, "its manifest"
    return None


def _position_text(cursor: DataCursor) -> str:
    """``"seed 7, epoch 0, offset 320 (data version 'v1')"``."""
    return (
        f"seed {cursor.seed}, epoch {cursor.epoch}, offset {cursor.offset} (data version "
        f"{cursor.data_version!r})"
    )
