"""Committed training snapshots as the bus keeps them: the ``manifests`` topic.

The daemon publishes one manifest per committed step on ``manifests``, keyed by job id. The
topic is deleted by time, never compacted, so every committed snapshot stays readable for the
topic's retention (``docs/architecture.md``, topics). The agent reads one job's partition to
find the snapshot its ``init_from`` setting names; ``trainguard checkpoints`` reads them all.
Given the daemon's public keys, a reader keeps only manifests whose signature verifies (the
daemon signs every manifest it commits when it holds keys): a manifest planted on the bus
cannot make a job start from the wrong weights.

A manifest too large for a record (thousands of ranks) is published as its signed head
(``manifest-head``); the reader reads its parts from beside the checkpoint, each checked
against the digest the signed head gives it (:mod:`trainguard.agent.checkpoint._snapshot`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import cast

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from trainguard.agent._errors import ConfigError, RestoreTimeout, ShardError
from trainguard.agent.bus import (
    Bus,
    BusConfig,
    BusError,
    Record,
    TopicPartition,
    open_bus,
    partition_for,
)
from trainguard.agent.checkpoint._snapshot import Snapshot
from trainguard.schemas import (
    Manifest,
    ManifestHead,
    SchemaError,
    Unauthenticated,
    decode,
    verify_signature,
)

__all__ = ["ManifestLog", "fetch_manifest", "read_job_manifests", "read_manifests"]

TOPIC = "manifests"

_POLL_S = 0.5
"""Longest wait of one poll while reading the topic up to its end offsets, seconds."""


@dataclass(frozen=True, slots=True)
class ManifestLog:
    """The manifests read from the bus.

    Attributes:
        manifests: valid manifests in bus order (partition, then offset); a snapshot appears
            more than once when the daemon re-derived its commit after a restart.
        invalid: records skipped: undecodable, or inconsistent with their own key, snapshot id
            or world size (``docs/wire-contract.md``, manifest: "whoever consumes a manifest
            checks those"), or (with keys) not authentic.
        unauthenticated: snapshot id -> why its manifest was refused, for the manifests among
            ``invalid`` that decoded but whose signature did not verify.
        unreadable: snapshot id -> why its manifest's parts could not be read, for the heads
            among ``invalid`` (storage failed, or a part is missing or not the head's).
        others: the snapshot ids of the records passed over for not being the one asked for
            (:func:`read_manifests`' ``snapshot_id``), neither checked nor read whole.
    """

    manifests: tuple[Manifest, ...]
    invalid: int
    unauthenticated: Mapping[str, str] = field(default_factory=dict)
    unreadable: Mapping[str, str] = field(default_factory=dict)
    others: tuple[str, ...] = ()


def _consistent(manifest: Manifest, key: str | None) -> bool:
    """The checks the manifest schema cannot state: key, snapshot id and shards agree."""
    expected = f"{manifest.job_id}/g{manifest.generation}/s{manifest.step}"
    ranks = [s.rank for s in manifest.shards]
    return (
        key == manifest.job_id
        and manifest.snapshot_id == expected
        and ranks == list(range(manifest.world_size))
    )


async def read_manifests(
    bus: Bus,
    job_id: str | None = None,
    verify_keys: Mapping[str, Ed25519PublicKey] | None = None,
    snapshot_id: str | None = None,
) -> ManifestLog:
    """Read ``manifests`` from its first record to the end offsets at the time of the call.

    Args:
        bus: a started bus.
        job_id: read only this job's partition and records; ``None`` reads every job's.
        verify_keys: the daemon's public keys: keep only manifests signed by one of them;
            ``None`` keeps unsigned ones too.
        snapshot_id: keep only this snapshot's records; the others' heads are not put back
            together from their parts (at 16,384 ranks each is 16 parts, 3 MB, to read).

    Raises:
        BusError: the bus failed while reading (the caller bounds the time it takes).
    """
    ends = await bus.end_offsets(TOPIC)
    if job_id is not None:
        tp = TopicPartition(TOPIC, partition_for(job_id, len(ends)))
        ends = {tp: ends[tp]}
    pending = {tp: end for tp, end in ends.items() if end > 0}
    records: list[Record] = []
    if pending:
        async with await bus.assign(dict.fromkeys(pending, 0)) as consumer:
            # The next offset to see per partition; a log that starts past 0 (retention)
            # simply begins later.
            seen = dict.fromkeys(pending, 0)
            while any(seen[tp] < end for tp, end in pending.items()):
                for rec in await consumer.getmany(timeout_s=_POLL_S, max_records=10_000):
                    if rec.offset < pending[rec.tp]:
                        records.append(rec)
                # The consumer's position, not the last record's offset + 1: the daemon
                # writes in transactions, whose markers end a partition without a record.
                for tp in pending:
                    seen[tp] = max(seen[tp], await consumer.position(tp))
    records.sort(key=lambda r: (r.partition, r.offset))
    manifests: list[Manifest] = []
    invalid = 0
    unauthenticated: dict[str, str] = {}
    unreadable: dict[str, str] = {}
    others: dict[str, None] = {}
    for rec in records:
        if job_id is not None and rec.key != job_id:
            continue
        try:
            found = cast(
                "Manifest | ManifestHead", decode(rec.value or b"", expect=(Manifest, ManifestHead))
            )
            if snapshot_id is not None and found.snapshot_id != snapshot_id:
                others[found.snapshot_id] = None
                continue
            if verify_keys is not None:
                verify_signature(rec.value or b"", verify_keys)
        except Unauthenticated as exc:
            invalid += 1
            unauthenticated[found.snapshot_id] = exc.reason
            continue
        except SchemaError:
            invalid += 1
            continue
        if isinstance(found, ManifestHead):
            try:
                manifest = await asyncio.to_thread(Snapshot(found).manifest)
            except ShardError as exc:
                invalid += 1
                unreadable[found.snapshot_id] = str(exc)
                continue
        else:
            manifest = found
        if _consistent(manifest, rec.key):
            manifests.append(manifest)
        else:
            invalid += 1
    return ManifestLog(tuple(manifests), invalid, unauthenticated, unreadable, tuple(others))


def read_job_manifests(
    config: BusConfig,
    job_id: str,
    timeout_s: float,
    verify_keys: Mapping[str, Ed25519PublicKey] | None = None,
    snapshot_id: str | None = None,
) -> ManifestLog:
    """:func:`read_manifests` of one job over a connection of its own, from a thread that may
    or may not run an event loop (the reading runs on one in a helper thread).

    Args:
        config: how to reach the bus (its URL and topic prefix); the connect timeout is capped
            at ``timeout_s``.
        job_id: the job whose manifests to read.
        timeout_s: seconds the whole read may take.
        verify_keys, snapshot_id: as :func:`read_manifests`.

    Raises:
        RestoreTimeout: the bus could not be reached or read within ``timeout_s`` seconds.
    """
    config = replace(config, connect_timeout_s=min(config.connect_timeout_s, timeout_s))

    async def _read() -> ManifestLog:
        async def _connect_and_read() -> ManifestLog:
            async with open_bus(config) as bus:
                return await read_manifests(bus, job_id, verify_keys, snapshot_id)

        return await asyncio.wait_for(_connect_and_read(), timeout_s)

    began = time.monotonic()
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="trainguard-manifests") as pool:
            return pool.submit(asyncio.run, _read()).result()
    except (BusError, TimeoutError) as exc:
        raise RestoreTimeout(
            f"could not read the manifests of job {job_id} from the bus's {TOPIC} topic "
            f"(gave up after {time.monotonic() - began:.1f} s): {type(exc).__name__}: {exc}"
        ) from exc


def fetch_manifest(
    config: BusConfig,
    snapshot_id: str,
    timeout_s: float,
    verify_keys: Mapping[str, Ed25519PublicKey] | None = None,
) -> Manifest:
    """The committed manifest of ``snapshot_id`` (``<job>/g<generation>/s<step>``), read from
    the bus's ``manifests`` topic over a connection of its own.

    Blocks the calling thread; the reading runs on an event loop in a helper thread, so it
    works whether or not the caller's thread runs an event loop of its own.

    Args:
        config: how to reach the bus (its URL and topic prefix); the connect timeout is capped
            at ``timeout_s``.
        snapshot_id: the snapshot to find.
        timeout_s: seconds the whole lookup may take.
        verify_keys: the daemon's public keys: the manifest must carry the signature of one
            (``None``: an unsigned manifest is taken too).

    Raises:
        ConfigError: no committed snapshot ``snapshot_id`` on the bus (the message lists the
            job's newest committed snapshots, if any), or (with keys) none whose signature
            verifies.
        RestoreTimeout: the bus could not be reached or read within ``timeout_s`` seconds.
    """
    job_id = snapshot_id.partition("/")[0]
    log = read_job_manifests(config, job_id, timeout_s, verify_keys, snapshot_id)
    for manifest in log.manifests:
        if manifest.snapshot_id == snapshot_id:
            return manifest
    if snapshot_id in log.unauthenticated:
        raise ConfigError(
            f"init_from: the manifest of {snapshot_id!r} on the bus {config.url} is not signed "
            f"by the daemon's keys ({log.unauthenticated[snapshot_id]}): refusing to load it"
        )
    if snapshot_id in log.unreadable:
        raise ConfigError(
            f"init_from: the manifest of {snapshot_id!r} cannot be read from beside its "
            f"checkpoint: {log.unreadable[snapshot_id]}"
        )
    mine = sorted({*log.others, *(m.snapshot_id for m in log.manifests)}, key=_order)
    detail = (
        f"job {job_id!r} has {len(mine)} committed snapshot(s) there, the newest "
        f"{', '.join(mine[-3:])}"
        if mine
        else f"job {job_id!r} has no committed snapshot there"
    )
    raise ConfigError(
        f"init_from: no committed snapshot {snapshot_id!r} on the bus {config.url} "
        f"(topic prefix {config.prefix!r}); {detail}"
    )


def _order(snapshot_id: str) -> tuple[int, int]:
    """``(generation, step)`` of a well-formed snapshot id, for sorting one job's snapshots."""
    _, generation, step = snapshot_id.rsplit("/", 2)
    return int(generation[1:]), int(step[1:])
