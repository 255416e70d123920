"""trainguard's daemon: the pure per-job state machine and the service that runs it.

The core is :func:`decide` (``(state, input, config) -> (state', decisions)``): no I/O, no
clock reads, no randomness, so restart, replay and what-if runs are one fold
(ARCHITECTURE.md section 4). :class:`DaemonService` is the shell: it consumes ``events`` from
the bus, folds them per job, and acts on the decisions (publishes commands, manifests, ticks
and audit records).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

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
    from trainguard.daemon.service import DaemonConfig as DaemonConfig
    from trainguard.daemon.service import DaemonService as DaemonService
    from trainguard.daemon.service import load_daemon_config as load_daemon_config

# Imported on first use (PEP 562): the service and its settings bring the bus adapters and the
# HTTP server along (0.17 s), which the pure core, the CLI's read-only commands and the export
# reader process do not need.
__getattr__, __dir__, _ = lazy_loader.attach(
    __name__, submod_attrs={"service": ["DaemonConfig", "DaemonService", "load_daemon_config"]}
)

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
