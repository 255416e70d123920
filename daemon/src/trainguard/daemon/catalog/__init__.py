"""The checkpoint catalog: every committed snapshot of every job, its lineage, and whether it
can seed another job (``trainguard checkpoints``, ``docs/catalog.md``).
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

__all__ = [
    "Abandoned",
    "Catalog",
    "Compat",
    "DescendantJob",
    "Lineage",
    "SeedRequest",
    "abandoned",
    "compat",
]
