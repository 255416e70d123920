"""Configuration of the per-job state machine (:mod:`trainguard.daemon._machine`).

Built once at the edge (the daemon's configuration loader); the machine only reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainguard.schemas import RestoreMode

_NS_PER_S = 1_000_000_000


def _to_ns(name: str, seconds: float) -> int:
    """Convert a positive, finite duration in seconds to whole nanoseconds.

    Raises:
        ValueError: ``seconds`` is not a finite number > 0.
    """
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {seconds!r}")
    return round(seconds * _NS_PER_S)


@dataclass(frozen=True, slots=True, kw_only=True)
class MachineConfig:
    """Thresholds and identity the state machine decides with.

    Attributes:
        daemon_id: identity the daemon signs its commands with (``Restore.daemon_id`` ...).
        heartbeat_timeout_s: seconds without any event from a rank of the current generation
            after which the rank counts as dead. Agents heartbeat well inside this interval,
            also while they wait for ``resume`` after a restore.
        startup_timeout_s: seconds from the start of generation 0 within which every rank of
            the world size must have sent an event.
        restore_timeout_s: seconds from issuing a ``restore`` within which every rank must
            acknowledge it with ``lifecycle restored``; past it the restore is retried.
        max_restore_attempts: restores tried per incident (the first one included) before the
            job is aborted and ``failed``.
        restore_mode: the ``mode`` of issued restores (``restart``: supervisors restart the
            processes; ``in_process``: agents reload without exiting).
        keep_snapshots: committed snapshots kept as restore targets, newest first; older ones
            are forgotten (their files are not touched).

    The ``*_ns`` attributes hold the same durations in nanoseconds, computed once.

    Raises:
        ValueError: an empty ``daemon_id``, a duration that is not finite and > 0, or a count
            below 1.
    """

    daemon_id: str
    heartbeat_timeout_s: float = 10.0
    startup_timeout_s: float = 120.0
    restore_timeout_s: float = 120.0
    max_restore_attempts: int = 3
    restore_mode: RestoreMode = "restart"
    keep_snapshots: int = 8
    heartbeat_timeout_ns: int = field(init=False, repr=False, compare=False)
    startup_timeout_ns: int = field(init=False, repr=False, compare=False)
    restore_timeout_ns: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.daemon_id:
            raise ValueError("daemon_id must not be empty")
        if self.max_restore_attempts < 1:
            raise ValueError(f"max_restore_attempts must be >= 1, got {self.max_restore_attempts}")
        if self.keep_snapshots < 1:
            raise ValueError(f"keep_snapshots must be >= 1, got {self.keep_snapshots}")
        # Frozen dataclass: derived fields are set once here, the documented way around frozen.
        object.__setattr__(
            self, "heartbeat_timeout_ns", _to_ns("heartbeat_timeout_s", self.heartbeat_timeout_s)
        )
        object.__setattr__(
            self, "startup_timeout_ns", _to_ns("startup_timeout_s", self.startup_timeout_s)
        )
        object.__setattr__(
            self, "restore_timeout_ns", _to_ns("restore_timeout_s", self.restore_timeout_s)
        )
