"""The pure core: the per-job state machine and the rules it applies.

``decide(state, input, config) -> (state', decisions)`` (:mod:`._machine`) folds one input into
one job's state. It reads no clock, does no I/O and draws no random numbers, so a restarted
daemon, a replay and a what-if run are the same fold (ARCHITECTURE.md section 4). Beside it: the
state (:mod:`._state`, :mod:`._window`) and its snapshot codec (:mod:`._state_codec`), the
inputs and decisions (:mod:`._inputs`, :mod:`._decisions`, :mod:`._evidence`), the
thresholds (:mod:`._machine_config`), the commit rule (:mod:`._commit_rule`), restores and
their holds (:mod:`._recovery`, :mod:`._outage`), stops (:mod:`._stop`), the one conversion
from a bus record to an input (:mod:`._intake`) and the audit trail's format
(:mod:`._audit_entry`). The detectors (hang, divergence) are :mod:`.detectors`.
"""

from __future__ import annotations

from trainguard.daemon.core._audit_entry import (
    AuditTrail,
    Group,
    InputKey,
    MalformedAudit,
    config_entry,
    config_fields,
    config_id,
    decision_entry,
    entries_by_job,
    input_id,
    input_key,
    plain_decisions,
    read_trail,
    refusal_entry,
)
from trainguard.daemon.core._commit_rule import (
    snapshot_id,
)
from trainguard.daemon.core._decisions import (
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
    plain_value,
)
from trainguard.daemon.core._evidence import (
    Measures,
    exit_status,
)
from trainguard.daemon.core._inputs import (
    Input,
    Observed,
    Tick,
)
from trainguard.daemon.core._intake import (
    Authenticator,
    AuthRefusal,
    RawRecord,
    Refused,
    Taken,
    take,
)
from trainguard.daemon.core._machine import (
    decide,
    fold,
    next_deadline,
    unacted_command,
)
from trainguard.daemon.core._machine_config import (
    RULES_VERSION,
    MachineConfig,
)
from trainguard.daemon.core._state import (
    TERMINAL_PHASES,
    Incident,
    IncidentCause,
    JobPhase,
    JobState,
    RankState,
    RankStatus,
    new_job,
)
from trainguard.daemon.core._state_codec import (
    LAYOUT,
    READABLE_LAYOUTS,
    StateFormatError,
    decode_state,
    encode_state,
)

__all__ = [
    "LAYOUT",
    "READABLE_LAYOUTS",
    "RULES_VERSION",
    "TERMINAL_PHASES",
    "Anomaly",
    "AnomalyKind",
    "AuditTrail",
    "AuthRefusal",
    "Authenticator",
    "Committed",
    "Decision",
    "Group",
    "Incident",
    "IncidentCause",
    "IncidentClosed",
    "IncidentOpened",
    "IncidentOutcome",
    "Input",
    "InputKey",
    "Issue",
    "JobFailed",
    "JobPhase",
    "JobState",
    "MachineConfig",
    "MalformedAudit",
    "Measures",
    "Observed",
    "RankState",
    "RankStatus",
    "RawRecord",
    "Refused",
    "RejectCode",
    "Rejected",
    "StateFormatError",
    "Taken",
    "Tick",
    "Transition",
    "config_entry",
    "config_fields",
    "config_id",
    "decide",
    "decision_entry",
    "decode_state",
    "encode_state",
    "entries_by_job",
    "exit_status",
    "fold",
    "input_id",
    "input_key",
    "new_job",
    "next_deadline",
    "plain_decisions",
    "plain_value",
    "read_trail",
    "refusal_entry",
    "snapshot_id",
    "take",
    "unacted_command",
]
