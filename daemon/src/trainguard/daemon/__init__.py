"""trainguard's daemon: the pure per-job state machine and the service that runs it.

The core is :func:`decide` (``(state, input, config) -> (state', decisions)``): no I/O, no
clock reads, no randomness, so restart, replay and what-if runs are one fold
(ARCHITECTURE.md section 4). :class:`DaemonService` is the shell: it consumes ``events`` from
the bus, folds them per job, and acts on the decisions (publishes commands, manifests, ticks
and audit records).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainguard.daemon._commit import snapshot_id
from trainguard.daemon._config import MachineConfig
from trainguard.daemon._decisions import (
    Anomaly,
    AnomalyKind,
    Committed,
    Decision,
    IncidentClosed,
    IncidentOpened,
    IncidentOutcome,
    Issue,
    JobFailed,
    RejectCode,
    Rejected,
    Transition,
)
from trainguard.daemon._evidence import Measures
from trainguard.daemon._inputs import Input, Observed, Tick
from trainguard.daemon._machine import decide, fold, next_deadline
from trainguard.daemon._state import (
    TERMINAL_PHASES,
    Incident,
    IncidentCause,
    JobPhase,
    JobState,
    RankState,
    RankStatus,
    new_job,
)

if TYPE_CHECKING:
    from trainguard.daemon._service import DaemonService
    from trainguard.daemon._settings import DaemonConfig, load_daemon_config

_LAZY = {
    "DaemonService": "trainguard.daemon._service",
    "DaemonConfig": "trainguard.daemon._settings",
    "load_daemon_config": "trainguard.daemon._settings",
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
