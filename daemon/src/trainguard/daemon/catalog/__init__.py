"""The checkpoint catalog: every committed snapshot of every job, its lineage, whether it
can seed another job, and which snapshots retention may delete (``trainguard checkpoints``,
``docs/catalog.md``).
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
from trainguard.daemon.catalog._retention import (
    RetentionPlan,
    RetentionPolicy,
    StoredStep,
    Verdict,
    plan_retention,
)

__all__ = [
    "Abandoned",
    "Catalog",
    "Compat",
    "DescendantJob",
    "Lineage",
    "RetentionPlan",
    "RetentionPolicy",
    "SeedRequest",
    "StoredStep",
    "Verdict",
    "abandoned",
    "compat",
    "plan_retention",
]
