"""``trainguard sim``: a discrete-event simulation of a large training job, its failures and
their recovery, driving the real daemon on a real bus (``docs/sim.md``).

:mod:`._model` is the job (pure: ranks, steps, checkpoints, faults, restarts, goodput
accounting), :mod:`._failures` draws its faults from a rate or reads them from a trace,
:mod:`._wire` encodes what its ranks send as real agents would, :mod:`._driver` runs it against
the daemon process (:mod:`._daemon_process`) on the embedded bus in simulated time or on Kafka
in real time, and :mod:`._results` compares the goodput with the Young-Daly model.
"""

from __future__ import annotations

from trainguard.daemon.sim._driver import DaemonRun, Measured, SimConfig, SimFailed, run_simulation
from trainguard.daemon.sim._failures import TraceError, draw_faults, parse_trace
from trainguard.daemon.sim._model import (
    FAULT_KINDS,
    Accounting,
    Fault,
    FaultKind,
    FaultRecord,
    JobModel,
    SimParams,
)
from trainguard.daemon.sim._results import SimSummary, print_summary, summarize

__all__ = [
    "FAULT_KINDS",
    "Accounting",
    "DaemonRun",
    "Fault",
    "FaultKind",
    "FaultRecord",
    "JobModel",
    "Measured",
    "SimConfig",
    "SimFailed",
    "SimParams",
    "SimSummary",
    "TraceError",
    "draw_faults",
    "parse_trace",
    "print_summary",
    "run_simulation",
    "summarize",
]
