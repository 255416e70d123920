"""trainguard's daemon: the pure per-job state machine and the service that runs it.

The core is :func:`decide` (``(state, input, config) -> (state', decisions)``): no I/O, no
clock reads, no randomness, so restart, replay and what-if runs are one fold
(ARCHITECTURE.md section 4). :class:`DaemonService` is the shell: it consumes ``events`` from
the bus, folds them per job, and acts on the decisions (publishes commands, manifests, ticks
and audit records).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainguard.daemon.core import (
    TERMINAL_PHASES,
    Anomaly,
    AnomalyKind,
    Committed,
    Decision,
    Incident,
    IncidentCause,
    IncidentClosed,
    IncidentOpened,
    IncidentOutcome,
    Input,
    Issue,
    JobFailed,
    JobPhase,
    JobState,
    MachineConfig,
    Measures,
    Observed,
    RankState,
    RankStatus,
    RejectCode,
    Rejected,
    Tick,
    Transition,
    decide,
    fold,
    new_job,
    next_deadline,
    snapshot_id,
)

if TYPE_CHECKING:
    from trainguard.daemon.service import DaemonConfig, DaemonService, load_daemon_config

_LAZY = {
    "DaemonService": "trainguard.daemon.service",
    "DaemonConfig": "trainguard.daemon.service",
    "load_daemon_config": "trainguard.daemon.service",
}
"""Names imported on first use (PEP 562): the service and its settings bring the bus adapters
and the HTTP server along (0.17 s), which the pure core, the CLI's read-only commands and the
export reader process do not need."""


def __getattr__(name: str) -> Any:
    """The names of :data:`_LAZY`, imported when first asked for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "TERMINAL_PHASES",
    "Anomaly",
    "AnomalyKind",
    "Committed",
    "DaemonConfig",
    "DaemonService",
    "Decision",
    "Incident",
    "IncidentCause",
    "IncidentClosed",
    "IncidentOpened",
    "IncidentOutcome",
    "Input",
    "Issue",
    "JobFailed",
    "JobPhase",
    "JobState",
    "MachineConfig",
    "Measures",
    "Observed",
    "RankState",
    "RankStatus",
    "RejectCode",
    "Rejected",
    "Tick",
    "Transition",
    "decide",
    "fold",
    "load_daemon_config",
    "new_job",
    "next_deadline",
    "snapshot_id",
]
