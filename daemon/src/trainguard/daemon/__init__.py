"""trainguard's daemon: the pure per-job state machine and the service that runs it.

The core is :func:`decide` (``(state, input, config) -> (state', decisions)``): no I/O, no
clock reads, no randomness, so restart, replay and what-if runs are one fold
(ARCHITECTURE.md section 4). :class:`DaemonService` is the shell: it consumes ``events`` from
the bus, folds them per job, and acts on the decisions (publishes commands, manifests, ticks
and audit records).
"""

from __future__ import annotations

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
from trainguard.daemon._service import DaemonService
from trainguard.daemon._settings import DaemonConfig, load_daemon_config
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
