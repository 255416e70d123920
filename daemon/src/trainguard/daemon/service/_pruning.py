"""The daemon's own retention: every ``[retention] interval_s``, what ``trainguard checkpoints
prune`` does (:func:`trainguard.daemon.catalog.prune`, one code path), for the jobs of the
partitions of ``events`` this instance owns (``docs/catalog.md``, "Retention by the daemon").

A prune reads the whole ``manifests`` and ``audit`` topics (a snapshot of one job may be
another's parent, and its trail decides whether it still runs) over a bus connection of its
own, and lists and deletes step folders; all of it runs in a worker thread, so the event loop
goes on folding meanwhile. Nothing a prune raises ends the daemon: it is logged with its
reason, counted (``trainguard_retention_runs_total{result="failed"}``), and the next interval
tries again. A job whose storage cannot be listed is left alone (logged, counted) while the
others are pruned. An instance that is not ready (starting, a standby without partitions,
behind, the bus away) does not prune.

Ownership can move while a prune runs (a rebalance): the previous and the new owner may then
prune the same job at once, which is safe (a folder the other deleted is no error, and both
keep every possible restore target: the kept set only moves forward).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import TYPE_CHECKING

import structlog

from trainguard.agent.bus import open_bus, partition_for
from trainguard.agent.keys import DaemonKeys
from trainguard.daemon.catalog import BusCatalog, Pruned, RetentionPolicy, prune, read_catalog
from trainguard.daemon.service._metrics import DaemonMetrics
from trainguard.daemon.service._settings import DaemonConfig

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from trainguard.daemon.service._snapshot_store import SnapshotKeys

__all__ = ["Pruning"]

log = structlog.get_logger("trainguard.daemon")

READ_TIMEOUT_S = 120.0
"""Longest time, seconds, a prune may take to read the ``manifests`` and ``audit`` topics
(as ``trainguard checkpoints`` allows itself): a bus that does not answer fails the run, and
the next interval tries again."""


class Pruning:
    """Prunes the checkpoints of the jobs this daemon instance owns, every
    ``config.retention.interval_s`` seconds.

    Args:
        config: the daemon's settings: ``[retention]`` (what to keep, how often), the bus,
            and ``[machine] keep_snapshots`` (the restore targets never deleted, and
            ``keep_last`` when the table gives none).
        metrics: where runs, deletions, failures and durations are counted.
    """

    def __init__(self, config: DaemonConfig, metrics: DaemonMetrics) -> None:
        retention = config.retention
        targets = config.machine.keep_snapshots
        self._interval_s = retention.interval_s
        self._policy = RetentionPolicy(
            keep_last=retention.keep_last or targets,
            keep_every_steps=retention.keep_every_steps,
            restore_targets=targets,
            delete_parents=retention.delete_parents,
        )
        # A connection of its own, that never creates the bus: the daemon's has created it.
        self._bus = replace(config.bus, client_id=f"{config.bus.client_id}-retention", create=False)
        self._metrics = metrics

    async def run(
        self,
        not_ready: Callable[[], str | None],
        owned: Callable[[], AbstractSet[int]],
        keys: Callable[[], SnapshotKeys | None],
    ) -> None:
        """Prune every interval (the first one interval after the call) until cancelled.

        Args:
            not_ready: why the instance is not ready now, or ``None`` when it is
                (:meth:`~trainguard.daemon.service.DaemonService.not_ready_reason`).
            owned: the partitions of ``events`` the instance owns now.
            keys: the daemon's keys now (``None``: none; the manifests' signatures are then
                not checked).
        """
        while True:
            await asyncio.sleep(self._interval_s)
            reason = not_ready()
            if reason is not None:
                log.info("retention skipped: the daemon is not ready", reason=reason)
                continue
            await self.prune_once(frozenset(owned()), keys())

    async def prune_once(
        self, partitions: AbstractSet[int], keys: SnapshotKeys | None
    ) -> Pruned | None:
        """One prune of the jobs of ``partitions`` (of ``events``), in a worker thread; logs
        and counts what it did. Returns what it did, or ``None`` when it failed (logged with
        its reason and counted: it never raises but for cancellation)."""
        began = time.monotonic()
        try:
            pruned, jobs = await asyncio.to_thread(self._prune, partitions, keys)
            self._report(pruned, jobs, time.monotonic() - began)
        except Exception as exc:  # whatever it is, the daemon goes on; the next run retries
            duration_s = time.monotonic() - began
            self._metrics.prune_failed(duration_s)
            log.error(
                "retention run failed: trying again next interval",
                reason=type(exc).__name__,
                error=str(exc),
                duration_s=round(duration_s, 3),
                interval_s=self._interval_s,
            )
            return None
        return pruned

    def _prune(
        self, partitions: AbstractSet[int], keys: SnapshotKeys | None
    ) -> tuple[Pruned, AbstractSet[str]]:
        """Read the catalog, keep the jobs of ``partitions``, prune them (worker thread)."""
        verify = _public_keys(keys)

        async def read() -> tuple[BusCatalog, int]:
            async with open_bus(self._bus) as bus:
                count = await bus.partitions("events")
                return await read_catalog(bus, verify_keys=verify), count

        found, count = asyncio.run(asyncio.wait_for(read(), READ_TIMEOUT_S))
        jobs = {
            m.job_id
            for m in found.catalog.snapshots.values()
            if partition_for(m.job_id, count) in partitions
        }
        return prune(found, self._policy, jobs=jobs, skip_unreadable=True), jobs

    def _report(self, pruned: Pruned, jobs: AbstractSet[str], duration_s: float) -> None:
        """Log every deletion, failure and unreadable job, and the run's summary; count
        them."""
        for job_id, why in pruned.unreadable.items():
            log.error("checkpoints not pruned: storage unreadable", job_id=job_id, error=why)
        for v in pruned.plan.deleted:
            fields = {
                "job_id": v.job_id,
                "generation": v.generation,
                "step": v.step,
                "folder": v.name,
                "reasons": list(v.reasons),
            }
            failed = pruned.failures.get(v.name)
            if failed is None:
                log.info("checkpoint folder pruned", bytes=pruned.freed.get(v.name, 0), **fields)
            else:
                log.error("checkpoint folder not pruned", error=failed, **fields)
        self._metrics.pruned(pruned, duration_s)
        log.info(
            "retention run done",
            jobs=len(jobs),
            verdicts=len(pruned.plan.verdicts),
            deleted=len(pruned.freed),
            failed=len(pruned.failures),
            unreadable=len(pruned.unreadable),
            freed_bytes=sum(pruned.freed.values()),
            duration_s=round(duration_s, 3),
        )


def _public_keys(keys: SnapshotKeys | None) -> Mapping[str, Ed25519PublicKey] | None:
    """The daemon's public signing keys a manifest it committed verifies with: live ones, and
    from a key directory the retired ones too (a manifest signed before a rotation stays the
    daemon's), as ``trainguard checkpoints`` finds them; ``None`` without keys."""
    if keys is None:
        return None
    found = dict(keys.verify)
    if isinstance(keys, DaemonKeys) and keys.store is not None:
        found = {**keys.store.public_keys(retired=True), **found}
    return found
