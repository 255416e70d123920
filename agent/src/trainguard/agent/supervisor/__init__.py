"""The per-node supervisor behind ``trainguard run``: it starts a node's workers, reports
their exits, obeys the daemon's restore, resume and abort commands, and restarts the workers
when told to (:mod:`._supervisor`). Beside it: the node's slot in the job (:mod:`._node_slot`),
the on-disk spool in which workers leave records while the bus is away and the courier that
forwards them (:mod:`._spool`, :mod:`._courier`), the watch on the daemon's liveness
(:mod:`._daemon_watch`), and operator requests such as ``trainguard stop``
(:mod:`._requests`).
"""

from __future__ import annotations

from trainguard.agent.supervisor._requests import (
    encode_request,
    latest_command,
)
from trainguard.agent.supervisor._supervisor import (
    EXIT_SIGNALLED,
    Supervisor,
    SupervisorConfig,
)

__all__ = [
    "EXIT_SIGNALLED",
    "Supervisor",
    "SupervisorConfig",
    "encode_request",
    "latest_command",
]
