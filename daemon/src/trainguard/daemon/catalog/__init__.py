"""The checkpoint catalog: every committed snapshot of every job, its lineage, whether it
can seed another job, and which snapshots retention may delete (``trainguard checkpoints``,
``docs/catalog.md``).

:mod:`._catalog` and :mod:`._retention` are pure; :mod:`._prune` reads the catalog from the bus
and lists and deletes step folders, for ``trainguard checkpoints prune`` and the daemon's own
retention alike.
"""

from __future__ import annotations

from trainguard.daemon.catalog._catalog import (
    Abandoned,
    Catalog,
    Compat,
    DescendantJob,
    Lineage,
    SeedRequest,
    abandoned,
    compat,
)
from trainguard.daemon.catalog._prune import (
    BusCatalog,
    JobAuditMalformed,
    Pruned,
    StorageUnreadable,
    prune,
    read_catalog,
)
from trainguard.daemon.catalog._retention import (
    RetentionPlan,
    RetentionPolicy,
    StoredStep,
    Verdict,
    plan_retention,
)

__all__ = [
    "Abandoned",
    "BusCatalog",
    "Catalog",
    "Compat",
    "DescendantJob",
    "JobAuditMalformed",
    "Lineage",
    "Pruned",
    "RetentionPlan",
    "RetentionPolicy",
    "SeedRequest",
    "StorageUnreadable",
    "StoredStep",
    "Verdict",
    "abandoned",
    "compat",
    "plan_retention",
    "prune",
    "read_catalog",
]
